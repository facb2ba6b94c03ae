//! KV events on the wire exactly as vLLM (≥ 0.11) publishes them: a msgspec-encoded
//! `KVEventBatch` map `{ts, events, data_parallel_rank}` whose events are maps tagged
//! `type`, sent from a ZMQ PUB socket as `[topic, seq (u64 big-endian), payload]`, with
//! the last `buffer_steps` batches kept for a ROUTER replay socket (a DEALER sends
//! `[b"", start_seq]`; it gets `[b"", seq, payload]` per batch, then `[b"", 0xFF×8, b""]`).
//!
//! Configured by vLLM's own `--kv-events-config` JSON keys.

use crate::kvcache::KvEvent;
use serde::Deserialize;
use std::collections::VecDeque;
use std::sync::mpsc;
use std::time::Duration;

/// vLLM's `KVEventsConfig`, the keys that matter to a publisher.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    pub enable_kv_cache_events: bool,
    pub publisher: String,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub buffer_steps: usize,
    pub hwm: i32,
    pub max_queue_size: usize,
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            enable_kv_cache_events: false,
            publisher: "null".into(),
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    pub fn from_json(s: &str) -> Result<KvEventsConfig, String> {
        let c: KvEventsConfig = serde_json::from_str(s).map_err(|e| format!("--kv-events-config: {e}"))?;
        match c.publisher.as_str() {
            "zmq" | "null" => Ok(c),
            other => Err(format!("--kv-events-config: publisher `{other}` is not zmq or null")),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enable_kv_cache_events && self.publisher == "zmq"
    }
}

// ---------------------------------------------------------------------------------------
// msgpack, as msgspec writes it (smallest integer form, float64, str8/16/32)

fn uint(out: &mut Vec<u8>, v: u64) {
    match v {
        0..=0x7f => out.push(v as u8),
        0x80..=0xff => out.extend_from_slice(&[0xcc, v as u8]),
        0x100..=0xffff => {
            out.push(0xcd);
            out.extend_from_slice(&(v as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(0xce);
            out.extend_from_slice(&(v as u32).to_be_bytes());
        }
        _ => {
            out.push(0xcf);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
}

fn str(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    match n {
        0..=31 => out.push(0xa0 | n as u8),
        32..=0xff => out.extend_from_slice(&[0xd9, n as u8]),
        0x100..=0xffff => {
            out.push(0xda);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(0xdb);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
    out.extend_from_slice(s.as_bytes());
}

fn header(out: &mut Vec<u8>, n: usize, fix: u8, b16: u8, b32: u8) {
    match n {
        0..=15 => out.push(fix | n as u8),
        16..=0xffff => {
            out.push(b16);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        _ => {
            out.push(b32);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
}

fn array(out: &mut Vec<u8>, n: usize) {
    header(out, n, 0x90, 0xdc, 0xdd);
}

fn map(out: &mut Vec<u8>, n: usize) {
    header(out, n, 0x80, 0xde, 0xdf);
}

fn uints(out: &mut Vec<u8>, vs: impl ExactSizeIterator<Item = u64>) {
    array(out, vs.len());
    for v in vs {
        uint(out, v);
    }
}

/// One `KVEventBatch` payload.
pub fn encode_batch(ts: f64, events: &[KvEvent], dp_rank: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 128);
    map(&mut out, 3);
    str(&mut out, "ts");
    out.push(0xcb);
    out.extend_from_slice(&ts.to_bits().to_be_bytes());
    str(&mut out, "events");
    array(&mut out, events.len());
    for e in events {
        match e {
            KvEvent::Stored { hashes, parent, token_ids } => {
                map(&mut out, 11);
                str(&mut out, "type");
                str(&mut out, "BlockStored");
                str(&mut out, "block_hashes");
                uints(&mut out, hashes.iter().copied());
                str(&mut out, "parent_block_hash");
                match parent {
                    Some(p) => uint(&mut out, *p),
                    None => out.push(0xc0),
                }
                str(&mut out, "token_ids");
                uints(&mut out, token_ids.iter().map(|t| u64::from(*t)));
                str(&mut out, "block_size");
                let bs = token_ids.len().checked_div(hashes.len()).unwrap_or(0);
                uint(&mut out, bs as u64);
                str(&mut out, "lora_id");
                out.push(0xc0);
                str(&mut out, "medium");
                str(&mut out, "GPU");
                str(&mut out, "lora_name");
                out.push(0xc0);
                str(&mut out, "group_idx");
                uint(&mut out, 0);
                str(&mut out, "kv_cache_spec_kind");
                str(&mut out, "full_attention");
                str(&mut out, "kv_cache_spec_sliding_window");
                out.push(0xc0);
            }
            KvEvent::Removed { hashes } => {
                map(&mut out, 4);
                str(&mut out, "type");
                str(&mut out, "BlockRemoved");
                str(&mut out, "block_hashes");
                uints(&mut out, hashes.iter().copied());
                str(&mut out, "medium");
                str(&mut out, "GPU");
                str(&mut out, "group_idx");
                uint(&mut out, 0);
            }
            KvEvent::Cleared => {
                map(&mut out, 1);
                str(&mut out, "type");
                str(&mut out, "AllBlocksCleared");
            }
        }
    }
    str(&mut out, "data_parallel_rank");
    uint(&mut out, u64::from(dp_rank));
    out
}

// ---------------------------------------------------------------------------------------
// The publisher thread

const END_SEQ: [u8; 8] = [0xff; 8];

/// Sends batches from a thread that owns the ZMQ sockets (as vLLM's publisher thread does).
pub struct Publisher {
    tx: mpsc::SyncSender<Vec<u8>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// vLLM's heuristic: bind a wildcard, IPC or in-process endpoint, connect anything else.
fn open(sock: &zmq::Socket, endpoint: &str) -> zmq::Result<()> {
    if endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
    {
        sock.bind(endpoint)
    } else {
        sock.connect(endpoint)
    }
}

impl Publisher {
    pub fn start(cfg: &KvEventsConfig) -> Result<Publisher, String> {
        let ctx = zmq::Context::new();
        let pub_sock = ctx.socket(zmq::PUB).map_err(|e| format!("zmq: {e}"))?;
        pub_sock.set_sndhwm(cfg.hwm).map_err(|e| format!("zmq hwm: {e}"))?;
        pub_sock.set_linger(0).map_err(|e| format!("zmq linger: {e}"))?;
        open(&pub_sock, &cfg.endpoint).map_err(|e| format!("kv events endpoint {}: {e}", cfg.endpoint))?;
        let replay = match &cfg.replay_endpoint {
            Some(ep) => {
                let r = ctx.socket(zmq::ROUTER).map_err(|e| format!("zmq: {e}"))?;
                r.set_linger(0).map_err(|e| format!("zmq linger: {e}"))?;
                r.bind(ep).map_err(|e| format!("kv events replay endpoint {ep}: {e}"))?;
                Some(r)
            }
            None => None,
        };
        let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(cfg.max_queue_size.max(1));
        let topic = cfg.topic.clone().into_bytes();
        let buffer_steps = cfg.buffer_steps.max(1);
        let thread = std::thread::Builder::new()
            .name("kv-events".into())
            .spawn(move || {
                let _ctx = ctx;
                let mut buffer: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
                let mut seq = 0u64;
                loop {
                    if let Some(r) = &replay {
                        while r.poll(zmq::POLLIN, 0).unwrap_or(0) > 0 {
                            serve_replay(r, &buffer);
                        }
                    }
                    match rx.recv_timeout(Duration::from_millis(10)) {
                        Ok(payload) => {
                            let parts: [&[u8]; 3] = [&topic, &seq.to_be_bytes(), &payload];
                            if let Err(e) = pub_sock.send_multipart(parts, 0) {
                                log::warn!("kv events: send failed: {e}");
                            }
                            buffer.push_back((seq, payload));
                            if buffer.len() > buffer_steps {
                                buffer.pop_front();
                            }
                            seq += 1;
                        }
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    }
                }
            })
            .map_err(|e| format!("kv events thread: {e}"))?;
        Ok(Publisher { tx, thread: Some(thread) })
    }

    /// Queues a batch; false if the queue is full (the batch is dropped, as vLLM's bounded
    /// queue would block — a subscriber sees a gap and replays).
    pub fn publish(&self, payload: Vec<u8>) -> bool {
        self.tx.try_send(payload).is_ok()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        // Closing the channel ends the thread.
        let (tx, _) = mpsc::sync_channel(1);
        drop(std::mem::replace(&mut self.tx, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve_replay(r: &zmq::Socket, buffer: &VecDeque<(u64, Vec<u8>)>) {
    let Ok(frames) = r.recv_multipart(zmq::DONTWAIT) else { return };
    // [client identity, b"", start_seq]
    let [client, _, start] = frames.as_slice() else { return };
    let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else { return };
    let start = u64::from_be_bytes(start);
    for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
        let parts: [&[u8]; 4] = [client, b"", &seq.to_be_bytes(), payload];
        let _ = r.send_multipart(parts, 0);
    }
    let parts: [&[u8]; 4] = [client, b"", &END_SEQ, b""];
    let _ = r.send_multipart(parts, 0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_sidecar::events::{decode_batch, Event, Medium};

    #[test]
    fn batches_decode_with_the_sidecars_decoder() {
        let events = vec![
            KvEvent::Stored { hashes: vec![u64::MAX, 7], parent: Some(300), token_ids: (0..32).collect() },
            KvEvent::Removed { hashes: vec![1, 70_000, 5_000_000_000] },
            KvEvent::Cleared,
        ];
        let b = decode_batch(&encode_batch(1700000000.25, &events, 3)).unwrap();
        assert_eq!((b.ts, b.dp_rank), (1700000000.25, Some(3)));
        let Event::Stored(s) = &b.events[0] else { panic!() };
        assert_eq!(
            (s.block_hashes.clone(), s.parent, s.block_size, s.medium),
            (vec![u64::MAX, 7], Some(300), 16, Medium::Gpu)
        );
        assert_eq!(s.token_ids, (0..32).collect::<Vec<u32>>());
        let Event::Removed(r) = &b.events[1] else { panic!() };
        assert_eq!(r.block_hashes, vec![1, 70_000, 5_000_000_000]);
        assert_eq!(b.events[2], Event::Cleared);
    }

    #[test]
    fn config_takes_vllms_keys_only() {
        let c = KvEventsConfig::from_json(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}"#,
        )
        .unwrap();
        assert!(c.enabled());
        assert_eq!(c.buffer_steps, 10_000);
        assert!(KvEventsConfig::from_json(r#"{"publisher": "kafka"}"#).is_err());
        assert!(KvEventsConfig::from_json(r#"{"endpoints": "x"}"#).is_err());
    }
}
