//! The ZMQ source: one SUB socket per (worker, DP rank) publisher, polled together by one
//! thread, and a DEALER per running replay. What to do with each batch (gaps, replays,
//! restarts) is the stream's [`Sequencer`]'s decision; this module only moves messages.
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
//! A message that is not `[topic, 8-byte seq, payload]` is counted and dropped.

use crate::config::Config;
use crate::fleet::{lock, Fleet, ResetReason};
use crate::sequence::{Count, ReplayReply, Sequencer, Sink};
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

struct Stream {
    worker: usize,
    rank: usize,
    label: String,
    sub: zmq::Socket,
    replay_endpoint: Option<String>,
    /// The running replay's connection.
    dealer: Option<zmq::Socket>,
    seq: Sequencer,
}

pub struct Ingest {
    ctx: zmq::Context,
    streams: Vec<Stream>,
    fleet: Arc<Mutex<Fleet>>,
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// A stream's [`Sink`]: the fleet for batches, resets and counts; ZMQ for replays.
struct ZmqSink<'a> {
    ctx: &'a zmq::Context,
    fleet: &'a Mutex<Fleet>,
    worker: usize,
    rank: usize,
    label: &'a str,
    replay_endpoint: Option<&'a str>,
    dealer: &'a mut Option<zmq::Socket>,
}

impl Sink for ZmqSink<'_> {
    fn apply(&mut self, seq: u64, payload: &[u8]) -> Result<(), String> {
        lock(self.fleet)
            .apply_payload(self.worker, self.rank, seq, payload, Instant::now(), unix_now())
            .map_err(|e| e.to_string())
    }

    fn reset(&mut self, reason: ResetReason) {
        lock(self.fleet).reset_rank(self.worker, self.rank, reason);
    }

    fn request_replay(&mut self, from: u64) -> bool {
        let Some(endpoint) = self.replay_endpoint else { return false };
        let dealer = match self.ctx.socket(zmq::DEALER) {
            Ok(d) => d,
            Err(e) => {
                log::error!("{}: zmq dealer: {e}", self.label);
                return false;
            }
        };
        let sent = dealer
            .set_linger(0)
            .and_then(|_| dealer.set_maxmsgsize(MAX_MESSAGE_BYTES))
            .and_then(|_| dealer.connect(endpoint))
            .and_then(|_| dealer.send_multipart([&b""[..], &from.to_be_bytes()[..]], zmq::DONTWAIT));
        if let Err(e) = sent {
            log::warn!("{}: replay request to {endpoint} failed: {e}", self.label);
            return false;
        }
        log::info!("{}: replaying from seq {from} via {endpoint}", self.label);
        *self.dealer = Some(dealer);
        true
    }

    fn end_replay(&mut self) {
        *self.dealer = None;
    }

    fn count(&mut self, what: Count) {
        let stats = &mut lock(self.fleet).stats;
        match what {
            Count::Gap => stats.gaps += 1,
            Count::ReplayOk => stats.replays_ok += 1,
            Count::ReplayFailed => stats.replays_failed += 1,
            Count::BadBatch => stats.batches_bad += 1,
        }
    }
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
                let label = format!("{} rank {rank}", wc.id);
                streams.push(Stream {
                    worker: w,
                    rank: rank as usize,
                    label: label.clone(),
                    sub,
                    replay_endpoint: wc.replay_for(rank),
                    dealer: None,
                    seq: Sequencer::new(label, config.max_pending_batches, config.replay_timeout),
                });
            }
        }
        Ok(Ingest { ctx, streams, fleet })
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
                if let Some(d) = &s.dealer {
                    items.push(d.as_poll_item(zmq::POLLIN));
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
            let (ctx, fleet) = (&self.ctx, &*self.fleet);
            let s = &mut self.streams[i];
            if replay {
                s.drain_replay(ctx, fleet);
            }
            if live {
                s.drain_live(ctx, fleet);
            }
            let (seq, mut sink) = s.split(ctx, fleet);
            seq.tick(Instant::now(), &mut sink);
        }
    }
}

impl Stream {
    /// The sequencer and the sink it drives, borrowed apart.
    fn split<'a>(&'a mut self, ctx: &'a zmq::Context, fleet: &'a Mutex<Fleet>) -> (&'a mut Sequencer, ZmqSink<'a>) {
        let sink = ZmqSink {
            ctx,
            fleet,
            worker: self.worker,
            rank: self.rank,
            label: &self.label,
            replay_endpoint: self.replay_endpoint.as_deref(),
            dealer: &mut self.dealer,
        };
        (&mut self.seq, sink)
    }

    fn drain_live(&mut self, ctx: &zmq::Context, fleet: &Mutex<Fleet>) {
        for _ in 0..MAX_PER_TURN {
            let msg = match self.sub.recv_multipart(zmq::DONTWAIT) {
                Ok(m) => m,
                Err(zmq::Error::EAGAIN) => return,
                Err(e) => {
                    log::error!("{}: zmq recv: {e}", self.label);
                    return;
                }
            };
            let Some((seq, payload)) = live_message(msg) else {
                self.dropped(fleet, "message that is not [topic, seq, payload]");
                continue;
            };
            let (q, mut sink) = self.split(ctx, fleet);
            q.live(seq, payload, Instant::now(), &mut sink);
        }
    }

    fn drain_replay(&mut self, ctx: &zmq::Context, fleet: &Mutex<Fleet>) {
        for _ in 0..MAX_PER_TURN {
            let Some(dealer) = &self.dealer else { return };
            let reply = match dealer.recv_multipart(zmq::DONTWAIT) {
                Ok(m) => replay_reply(m),
                Err(zmq::Error::EAGAIN) => return,
                Err(e) => {
                    log::warn!("{}: replay recv: {e}", self.label);
                    let (q, mut sink) = self.split(ctx, fleet);
                    q.replay_failed(Instant::now(), &mut sink);
                    return;
                }
            };
            let Some(reply) = reply else {
                self.dropped(fleet, "replay reply that is not [\"\", topic?, seq, payload]");
                continue;
            };
            let (q, mut sink) = self.split(ctx, fleet);
            q.replay_reply(reply, Instant::now(), &mut sink);
        }
    }

    /// Counts a message of the wrong shape, and logs it (rate-limited).
    fn dropped(&mut self, fleet: &Mutex<Fleet>, what: &str) {
        lock(fleet).stats.frames_bad += 1;
        if self.seq.should_log() {
            log::warn!("{}: dropped a {what} (problem #{})", self.label, self.seq.problems());
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
