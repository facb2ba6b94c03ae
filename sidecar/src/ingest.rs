//! The ZMQ side: one SUB socket per (worker, DP rank) publisher, polled together by one
//! thread, with the sequence checks and replays that keep each worker's view exact.
//!
//! Wire format (vLLM and SGLang `ZmqEventPublisher`): multipart `[topic, seq (u64
//! big-endian), msgpack payload]`, `seq` counting from 0 per publisher. Replay: a DEALER
//! sends `[b"", start_seq]` to the publisher's ROUTER and receives, for each buffered batch
//! from `start_seq` on, the live layout behind the envelope `[b"", topic, seq, payload]`
//! (vLLM ≥ 0.26, SGLang ≥ 0.5.22) or, from older publishers, `[b"", seq, payload]`; then the
//! end marker `[b"", b"", END, b""]` or `[b"", END, b""]`, END being -1 as 8 signed
//! big-endian bytes. The layout is read off each message ([`replay_reply`]), so a publisher
//! upgraded under a running sidecar is served too.
//!
//! Per stream, `expected` is the next sequence number:
//! - `seq == expected`: apply.
//! - `seq > expected`: a gap. Replay from `expected`, holding live batches meanwhile; if the
//!   replay cannot cover the gap (no replay endpoint, buffer too short, timeout), the
//!   stream's blocks are cleared and rebuilt from what follows.
//! - `seq < expected`: the publisher restarted; its cache started empty, so clear it too.
//! - first batch seen with `seq > 0`: catch up by replaying from 0 if possible (what the
//!   engine cached before the sidecar subscribed).
//!
//! A message that is not `[topic, 8-byte seq, payload]` is counted and dropped; a payload
//! that does not decode is counted and clears the stream (what it changed is unknown).

use crate::config::Config;
use crate::fleet::{lock, Fleet, ResetReason};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const END_OF_REPLAY: [u8; 8] = [0xff; 8];
/// Messages taken from one socket per turn, so a flood on one stream cannot starve others.
const MAX_PER_TURN: usize = 256;
const POLL_MS: i64 = 50;
/// ZMQ receive high-water mark: bursts beyond this are dropped by ZMQ (and replayed).
const RCV_HWM: i32 = 1_000_000;
/// Largest message accepted. An engine's batch is a scheduler step's events (kilobytes to
/// a few megabytes); libzmq drops the connection of a peer that sends more (it reconnects;
/// what was lost shows as a sequence gap and is replayed), so nothing hostile makes the
/// sidecar allocate without bound.
const MAX_MESSAGE_BYTES: i64 = 64 << 20;

struct Replay {
    dealer: zmq::Socket,
    deadline: Instant,
    /// Catching up after subscribing: a buffer that does not reach back to 0 is expected,
    /// not a failure.
    catch_up: bool,
    /// The replay could not cover the gap and the stream was already cleared.
    gave_up: bool,
}

struct Stream {
    worker: usize,
    rank: usize,
    label: String,
    sub: zmq::Socket,
    replay_endpoint: Option<String>,
    expected: Option<u64>,
    replay: Option<Replay>,
    /// Live messages held while a replay runs.
    pending: VecDeque<(u64, Vec<u8>)>,
    /// Problems seen on this stream; each is counted in the metrics, but logged only at
    /// the 1st, 2nd, 4th, 8th… occurrence, so a stream of garbage cannot flood the log.
    problems: u64,
}

impl Stream {
    fn should_log(&mut self) -> bool {
        self.problems += 1;
        self.problems.is_power_of_two()
    }
}

pub struct Ingest {
    ctx: zmq::Context,
    streams: Vec<Stream>,
    fleet: Arc<Mutex<Fleet>>,
    replay_timeout: Duration,
    max_pending: usize,
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl Ingest {
    pub fn new(config: &Config, fleet: Arc<Mutex<Fleet>>) -> Result<Ingest, String> {
        let ctx = zmq::Context::new();
        let mut streams = Vec::new();
        for (w, wc) in config.workers.iter().enumerate() {
            for rank in 0..wc.dp_ranks {
                let endpoint = wc.events_for(rank);
                let sub = ctx.socket(zmq::SUB).map_err(|e| format!("zmq socket: {e}"))?;
                sub.set_rcvhwm(RCV_HWM).map_err(|e| format!("zmq rcvhwm: {e}"))?;
                sub.set_maxmsgsize(MAX_MESSAGE_BYTES).map_err(|e| format!("zmq maxmsgsize: {e}"))?;
                sub.set_linger(0).map_err(|e| format!("zmq linger: {e}"))?;
                sub.set_subscribe(config.topic.as_bytes()).map_err(|e| format!("zmq subscribe: {e}"))?;
                sub.connect(&endpoint).map_err(|e| format!("worker {} events {endpoint}: {e}", wc.id))?;
                streams.push(Stream {
                    worker: w,
                    rank: rank as usize,
                    label: format!("{} rank {rank}", wc.id),
                    sub,
                    replay_endpoint: wc.replay_for(rank),
                    expected: None,
                    replay: None,
                    pending: VecDeque::new(),
                    problems: 0,
                });
            }
        }
        Ok(Ingest {
            ctx,
            streams,
            fleet,
            replay_timeout: config.replay_timeout,
            max_pending: config.max_pending_batches,
        })
    }

    /// Runs until `stop` is set.
    pub fn run(mut self, stop: Arc<AtomicBool>) {
        while !stop.load(Ordering::Relaxed) {
            self.turn();
        }
    }

    fn turn(&mut self) {
        let mut ready = vec![(false, false); self.streams.len()];
        {
            let mut items: Vec<zmq::PollItem> = Vec::with_capacity(self.streams.len() * 2);
            let mut owners = Vec::with_capacity(self.streams.len() * 2);
            for (i, s) in self.streams.iter().enumerate() {
                items.push(s.sub.as_poll_item(zmq::POLLIN));
                owners.push((i, false));
                if let Some(r) = &s.replay {
                    items.push(r.dealer.as_poll_item(zmq::POLLIN));
                    owners.push((i, true));
                }
            }
            if let Err(e) = zmq::poll(&mut items, POLL_MS) {
                log::error!("zmq poll: {e}");
                std::thread::sleep(Duration::from_millis(POLL_MS as u64));
                return;
            }
            for (item, (i, is_replay)) in items.iter().zip(owners) {
                if item.is_readable() {
                    if is_replay {
                        ready[i].1 = true;
                    } else {
                        ready[i].0 = true;
                    }
                }
            }
        }
        for (i, (live, replay)) in ready.into_iter().enumerate() {
            if replay {
                self.drain_replay(i);
            }
            if live {
                self.drain_live(i);
            }
            self.check_replay_deadline(i);
        }
    }

    fn drain_live(&mut self, i: usize) {
        for _ in 0..MAX_PER_TURN {
            let msg = match self.streams[i].sub.recv_multipart(zmq::DONTWAIT) {
                Ok(m) => m,
                Err(zmq::Error::EAGAIN) => return,
                Err(e) => {
                    log::error!("{}: zmq recv: {e}", self.streams[i].label);
                    return;
                }
            };
            let Some((seq, payload)) = live_message(msg) else {
                self.dropped(i, "message that is not [topic, seq, payload]");
                continue;
            };
            self.live(i, seq, payload);
        }
    }

    /// Counts a message of the wrong shape, and logs it (rate-limited).
    fn dropped(&mut self, i: usize, what: &str) {
        lock(&self.fleet).stats.frames_bad += 1;
        let s = &mut self.streams[i];
        if s.should_log() {
            log::warn!("{}: dropped a {what} (problem #{})", s.label, s.problems);
        }
    }

    /// One live batch.
    fn live(&mut self, i: usize, seq: u64, payload: Vec<u8>) {
        if self.streams[i].replay.is_some() {
            if self.streams[i].pending.len() < self.max_pending {
                self.streams[i].pending.push_back((seq, payload));
                return;
            }
            log::warn!(
                "{}: replay too slow, {} live batches held; abandoning it",
                self.streams[i].label,
                self.max_pending
            );
            self.finish_replay(i);
            if self.streams[i].replay.is_some() {
                self.streams[i].pending.push_back((seq, payload));
                return;
            }
        }
        let s = &self.streams[i];
        match s.expected {
            Some(e) if seq == e => self.apply(i, seq, &payload),
            Some(e) if seq > e => {
                lock(&self.fleet).stats.gaps += 1;
                if self.streams[i].should_log() {
                    log::warn!("{}: sequence gap, expected {e}, got {seq}", self.streams[i].label);
                }
                if !self.start_replay(i, e, false) {
                    self.reset(i, ResetReason::GapNotReplayed);
                    self.apply(i, seq, &payload);
                    return;
                }
                self.streams[i].pending.push_back((seq, payload));
            }
            Some(e) => {
                if self.streams[i].should_log() {
                    log::warn!("{}: sequence went back from {e} to {seq}: publisher restarted", self.streams[i].label);
                }
                self.reset(i, ResetReason::PublisherRestart);
                self.streams[i].expected = None;
                self.live(i, seq, payload);
            }
            None => {
                if seq > 0 && self.start_replay(i, 0, true) {
                    self.streams[i].expected = Some(0);
                    self.streams[i].pending.push_back((seq, payload));
                } else {
                    self.apply(i, seq, &payload);
                }
            }
        }
    }

    fn apply(&mut self, i: usize, seq: u64, payload: &[u8]) {
        let s = &mut self.streams[i];
        s.expected = Some(seq.wrapping_add(1));
        let mut f = lock(&self.fleet);
        if let Err(e) = f.apply_payload(s.worker, s.rank, seq, payload, Instant::now(), unix_now()) {
            if s.should_log() {
                log::warn!("{}: batch {seq} does not decode ({e}); clearing (problem #{})", s.label, s.problems);
            }
            f.stats.batches_bad += 1;
            f.reset_rank(s.worker, s.rank, ResetReason::UndecodableBatch);
        }
    }

    fn reset(&mut self, i: usize, reason: ResetReason) {
        let s = &self.streams[i];
        lock(&self.fleet).reset_rank(s.worker, s.rank, reason);
    }

    /// Sends a replay request; false if this stream has no replay endpoint or it failed.
    fn start_replay(&mut self, i: usize, from: u64, catch_up: bool) -> bool {
        let s = &mut self.streams[i];
        let Some(endpoint) = s.replay_endpoint.as_deref() else { return false };
        let dealer = match self.ctx.socket(zmq::DEALER) {
            Ok(d) => d,
            Err(e) => {
                log::error!("{}: zmq dealer: {e}", s.label);
                return false;
            }
        };
        let sent = dealer
            .set_linger(0)
            .and_then(|_| dealer.set_maxmsgsize(MAX_MESSAGE_BYTES))
            .and_then(|_| dealer.connect(endpoint))
            .and_then(|_| dealer.send_multipart([&b""[..], &from.to_be_bytes()[..]], zmq::DONTWAIT));
        if let Err(e) = sent {
            log::warn!("{}: replay request to {endpoint} failed: {e}", s.label);
            return false;
        }
        log::info!("{}: replaying from seq {from} via {endpoint}", s.label);
        s.replay = Some(Replay { dealer, deadline: Instant::now() + self.replay_timeout, catch_up, gave_up: false });
        true
    }

    fn drain_replay(&mut self, i: usize) {
        for _ in 0..MAX_PER_TURN {
            let Some(r) = &self.streams[i].replay else { return };
            let msg = match r.dealer.recv_multipart(zmq::DONTWAIT) {
                Ok(m) => m,
                Err(zmq::Error::EAGAIN) => return,
                Err(e) => {
                    log::warn!("{}: replay recv: {e}", self.streams[i].label);
                    self.finish_replay(i);
                    return;
                }
            };
            let (seq, payload) = match replay_reply(msg) {
                Some(ReplayReply::Batch(seq, payload)) => (seq, payload),
                Some(ReplayReply::End) => {
                    self.finish_replay(i);
                    return;
                }
                None => {
                    self.dropped(i, "replay reply that is not [\"\", topic?, seq, payload]");
                    continue;
                }
            };
            let expected = self.streams[i].expected.unwrap_or(0);
            if seq < expected {
                continue; // already applied
            }
            if seq > expected {
                let s = &mut self.streams[i];
                let Some(r) = s.replay.as_mut() else { return };
                if r.catch_up && expected == 0 {
                    log::info!("{}: replay buffer starts at {seq}; earlier history is gone", s.label);
                } else if !r.gave_up {
                    // The publisher's buffer no longer reaches back to the gap.
                    log::warn!("{}: replay starts at {seq}, needed {expected}", s.label);
                    r.gave_up = true;
                    self.reset(i, ResetReason::GapNotReplayed);
                }
            }
            self.apply(i, seq, &payload);
        }
    }

    fn check_replay_deadline(&mut self, i: usize) {
        if self.streams[i].replay.as_ref().is_some_and(|r| Instant::now() >= r.deadline) {
            log::warn!("{}: replay timed out", self.streams[i].label);
            self.finish_replay(i);
        }
    }

    /// Ends the replay (at its end marker, a timeout or too many held batches), then applies
    /// the live batches held meanwhile.
    fn finish_replay(&mut self, i: usize) {
        let Some(replay) = self.streams[i].replay.take() else { return };
        let pending = std::mem::take(&mut self.streams[i].pending);
        let expected = self.streams[i].expected.unwrap_or(0);
        // Covered: the replay reached the first held live batch.
        let covered = pending.front().is_none_or(|(seq, _)| *seq <= expected);
        let nothing_to_lose = replay.catch_up && expected == 0;
        {
            let mut f = lock(&self.fleet);
            if covered && !replay.gave_up {
                f.stats.replays_ok += 1;
            } else {
                f.stats.replays_failed += 1;
            }
        }
        if !covered && !nothing_to_lose && !replay.gave_up {
            self.reset(i, ResetReason::GapNotReplayed);
        }
        let mut restart_at_first = !covered;
        for (seq, payload) in pending {
            if std::mem::take(&mut restart_at_first) {
                self.apply(i, seq, &payload);
            } else if self.streams[i].replay.is_none() && self.streams[i].expected.is_some_and(|e| seq < e) {
                continue; // the replay already applied it
            } else {
                // (If a new gap among them started another replay, `live` holds the rest.)
                self.live(i, seq, payload);
            }
        }
    }
}

/// Splits a live message `[topic, seq (8 bytes BE), payload]`.
fn live_message(mut msg: Vec<Vec<u8>>) -> Option<(u64, Vec<u8>)> {
    if msg.len() != 3 {
        return None;
    }
    let payload = msg.pop()?;
    let seq: [u8; 8] = msg.pop()?.try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

#[derive(Debug, PartialEq, Eq)]
enum ReplayReply {
    Batch(u64, Vec<u8>),
    End,
}

/// Reads one message a replay DEALER received, in either layout (module docs): four frames
/// carry the topic, three do not. None: neither.
fn replay_reply(mut msg: Vec<Vec<u8>>) -> Option<ReplayReply> {
    if !(msg.len() == 3 || msg.len() == 4) || !msg[0].is_empty() {
        return None;
    }
    let payload = msg.pop()?;
    let seq: [u8; 8] = msg.pop()?.try_into().ok()?;
    if seq == END_OF_REPLAY {
        return Some(ReplayReply::End);
    }
    Some(ReplayReply::Batch(u64::from_be_bytes(seq), payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(parts: &[&[u8]]) -> Vec<Vec<u8>> {
        parts.iter().map(|p| p.to_vec()).collect()
    }

    #[test]
    fn replay_replies_in_both_layouts() {
        let seq = 7u64.to_be_bytes();
        // vLLM >= 0.26 / SGLang >= 0.5.22: the live layout behind the envelope.
        assert_eq!(
            replay_reply(frames(&[b"", b"kv@10.0.0.5", &seq, b"payload"])),
            Some(ReplayReply::Batch(7, b"payload".to_vec()))
        );
        assert_eq!(replay_reply(frames(&[b"", b"", &seq, b"p"])), Some(ReplayReply::Batch(7, b"p".to_vec())));
        assert_eq!(replay_reply(frames(&[b"", b"", &END_OF_REPLAY, b""])), Some(ReplayReply::End));
        // Older publishers: no topic.
        assert_eq!(replay_reply(frames(&[b"", &seq, b"payload"])), Some(ReplayReply::Batch(7, b"payload".to_vec())));
        assert_eq!(replay_reply(frames(&[b"", &END_OF_REPLAY, b""])), Some(ReplayReply::End));
        // END is -1 as 8 signed big-endian bytes.
        assert_eq!((-1i64).to_be_bytes(), END_OF_REPLAY);
    }

    #[test]
    fn malformed_replay_replies_are_refused() {
        let seq = 7u64.to_be_bytes();
        for msg in [
            frames(&[]),
            frames(&[b""]),
            frames(&[b"", &seq]),
            frames(&[b"x", &seq, b"p"]),       // no envelope delimiter
            frames(&[b"", b"\x00\x01", b"p"]), // seq not 8 bytes
            frames(&[b"", b"t", b"\x00\x01", b"p"]),
            frames(&[b"", b"t", b"u", &seq, b"p"]), // five frames
        ] {
            assert_eq!(replay_reply(msg.clone()), None, "{msg:?}");
        }
    }

    #[test]
    fn live_messages_are_three_frames_with_an_8_byte_seq() {
        assert_eq!(live_message(frames(&[b"", &3u64.to_be_bytes(), b"p"])), Some((3, b"p".to_vec())));
        assert_eq!(live_message(frames(&[b"", b"short", b"p"])), None);
        assert_eq!(live_message(frames(&[b"", &3u64.to_be_bytes(), b"p", b"q"])), None);
    }
}
