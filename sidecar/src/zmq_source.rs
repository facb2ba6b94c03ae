//! The ZMQ source: one SUB socket per (worker, DP rank) publisher, polled together by the
//! ingest thread, and a DEALER per running replay. What to do with each batch (gaps,
//! replays, restarts) is the stream's sequencer's decision ([`crate::ingest`]); this
//! module only moves messages.
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

use crate::ingest::{Arrival, Source, StreamSpec};
use crate::sequence::ReplayReply;
use std::time::Duration;

const END_OF_REPLAY: [u8; 8] = [0xff; 8];
/// Messages taken from one socket per poll, so a flood on one stream cannot starve others.
const MAX_PER_POLL: usize = 256;
/// ZMQ receive high-water mark: bursts beyond this are dropped by ZMQ (and replayed).
const RCV_HWM: i32 = 1_000_000;
/// Largest message accepted. An engine's batch is a scheduler step's events (kilobytes to
/// a few megabytes); libzmq drops the connection of a peer that sends more (it reconnects;
/// what was lost shows as a sequence gap and is replayed), so nothing hostile makes the
/// sidecar allocate without bound.
const MAX_MESSAGE_BYTES: i64 = 64 << 20;

struct Stream {
    label: String,
    sub: zmq::Socket,
    replay_endpoint: Option<String>,
    /// The running replay's connection.
    dealer: Option<zmq::Socket>,
}

/// One SUB socket per stream, polled together, and a DEALER per running replay.
pub struct ZmqSource {
    ctx: zmq::Context,
    topic: String,
    streams: Vec<Stream>,
}

impl ZmqSource {
    /// Subscribes to every stream's publisher (`topic`: the subscription prefix). ZMQ
    /// connects in the background: a publisher not up yet is reached when it starts.
    pub fn connect(specs: &[StreamSpec], topic: &str) -> Result<ZmqSource, String> {
        let mut source = ZmqSource { ctx: zmq::Context::new(), topic: topic.to_string(), streams: Vec::new() };
        for spec in specs {
            source.add_stream(spec)?;
        }
        Ok(source)
    }

    fn subscribe(&self, spec: &StreamSpec) -> Result<zmq::Socket, String> {
        let sub = self.ctx.socket(zmq::SUB).map_err(|e| format!("zmq socket: {e}"))?;
        sub.set_rcvhwm(RCV_HWM).map_err(|e| format!("zmq rcvhwm: {e}"))?;
        sub.set_maxmsgsize(MAX_MESSAGE_BYTES).map_err(|e| format!("zmq maxmsgsize: {e}"))?;
        sub.set_linger(0).map_err(|e| format!("zmq linger: {e}"))?;
        // IPv6 endpoints (`tcp://[fd00::5]:5557`, from DNS discovery) need it; IPv4 still works.
        sub.set_ipv6(true).map_err(|e| format!("zmq ipv6: {e}"))?;
        sub.set_subscribe(self.topic.as_bytes()).map_err(|e| format!("zmq subscribe: {e}"))?;
        sub.connect(&spec.events).map_err(|e| format!("{} events {}: {e}", spec.label, spec.events))?;
        Ok(sub)
    }
}

impl Source for ZmqSource {
    fn poll(&mut self, timeout: Duration) -> Vec<(usize, Arrival)> {
        let mut ready = vec![(false, false); self.streams.len()];
        {
            let mut items: Vec<zmq::PollItem<'_>> = Vec::with_capacity(self.streams.len() * 2);
            let mut owners = Vec::with_capacity(self.streams.len() * 2);
            for (i, s) in self.streams.iter().enumerate() {
                items.push(s.sub.as_poll_item(zmq::POLLIN));
                owners.push((i, false));
                if let Some(d) = &s.dealer {
                    items.push(d.as_poll_item(zmq::POLLIN));
                    owners.push((i, true));
                }
            }
            if let Err(e) = zmq::poll(&mut items, timeout.as_millis() as i64) {
                log::error!("zmq poll: {e}");
                std::thread::sleep(timeout);
                return Vec::new();
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
        let mut out = Vec::new();
        for (i, (live, replay)) in ready.into_iter().enumerate() {
            let s = &self.streams[i];
            if replay {
                s.drain_replay(i, &mut out);
            }
            if live {
                s.drain_live(i, &mut out);
            }
        }
        out
    }

    fn request_replay(&mut self, stream: usize, from: u64) -> bool {
        let Some(s) = self.streams.get_mut(stream) else { return false };
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
            .and_then(|_| dealer.set_ipv6(true))
            .and_then(|_| dealer.set_maxmsgsize(MAX_MESSAGE_BYTES))
            .and_then(|_| dealer.connect(endpoint))
            .and_then(|_| dealer.send_multipart([&b""[..], &from.to_be_bytes()[..]], zmq::DONTWAIT));
        if let Err(e) = sent {
            log::warn!("{}: replay request to {endpoint} failed: {e}", s.label);
            return false;
        }
        log::info!("{}: replaying from seq {from} via {endpoint}", s.label);
        s.dealer = Some(dealer);
        true
    }

    fn end_replay(&mut self, stream: usize) {
        if let Some(s) = self.streams.get_mut(stream) {
            s.dealer = None;
        }
    }

    fn add_stream(&mut self, spec: &StreamSpec) -> Result<(), String> {
        let sub = self.subscribe(spec)?;
        self.streams.push(Stream {
            label: spec.label.clone(),
            sub,
            replay_endpoint: spec.replay.clone(),
            dealer: None,
        });
        Ok(())
    }

    fn remove_stream(&mut self, stream: usize) {
        // Dropping the sockets closes them (linger 0: nothing waits on a gone publisher).
        if stream < self.streams.len() {
            self.streams.remove(stream);
        }
    }
}

impl Stream {
    fn drain_live(&self, i: usize, out: &mut Vec<(usize, Arrival)>) {
        for _ in 0..MAX_PER_POLL {
            let msg = match self.sub.recv_multipart(zmq::DONTWAIT) {
                Ok(m) => m,
                Err(zmq::Error::EAGAIN) => return,
                Err(e) => {
                    log::error!("{}: zmq recv: {e}", self.label);
                    return;
                }
            };
            out.push((
                i,
                match live_message(msg) {
                    Some((seq, payload)) => Arrival::Live(seq, payload),
                    None => Arrival::Malformed("message that is not [topic, seq, payload]"),
                },
            ));
        }
    }

    fn drain_replay(&self, i: usize, out: &mut Vec<(usize, Arrival)>) {
        let Some(dealer) = &self.dealer else { return };
        for _ in 0..MAX_PER_POLL {
            let msg = match dealer.recv_multipart(zmq::DONTWAIT) {
                Ok(m) => m,
                Err(zmq::Error::EAGAIN) => return,
                Err(e) => {
                    log::warn!("{}: replay recv: {e}", self.label);
                    out.push((i, Arrival::ReplayFailed));
                    return;
                }
            };
            match replay_reply(msg) {
                Some(reply) => {
                    let end = reply == ReplayReply::End;
                    out.push((i, Arrival::Replay(reply)));
                    if end {
                        return;
                    }
                }
                None => out.push((i, Arrival::Malformed("replay reply that is not [\"\", topic?, seq, payload]"))),
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
