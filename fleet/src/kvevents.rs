//! KV events on the wire byte for byte as vLLM 0.33 publishes them (checked against vLLM's
//! own classes by `tests/integration/test_wire_forms.py`): a msgspec-encoded `KVEventBatch`
//! `[ts, events, data_parallel_rank]` whose events are maps tagged `type`, sent from a ZMQ
//! PUB socket as `[topic, seq (u64 big-endian), payload]`, with the last `buffer_steps`
//! batches kept for a ROUTER replay socket (a DEALER sends `[b"", start_seq]`; it gets
//! `[b"", topic, seq, payload]` per batch, then `[b"", b"", END, b""]`, END = -1 as 8
//! signed big-endian bytes). [`WireForm`] selects an older release's form instead.
//!
//! Configured by vLLM's own `--kv-events-config` JSON keys.

use crate::kvcache::KvEvent;
use kvroute::wire::{VLLM_BLOCK_REMOVED_FIELDS, VLLM_BLOCK_STORED_FIELDS};
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
// The wire forms

/// What the mock publishes: vLLM's wire form of one release line. Each is the encoding that
/// release's `vllm/distributed/kv_events.py` gives this engine's events (read from the
/// wheels; `sidecar/README.md`, "Compatibility", has the whole table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WireForm {
    /// vLLM 0.33 (the default): events are maps tagged `type` with defaults omitted; a
    /// replay reply carries the topic frame (PR #45177).
    #[value(name = "vllm-0.33")]
    Vllm033,
    /// vLLM 0.26–0.32: as 0.33, but `BlockStored` has fewer than 15 fields, so msgspec
    /// writes its map header in one byte.
    #[value(name = "vllm-0.26")]
    Vllm026,
    /// vLLM 0.24–0.25: tagged-map events (PR #42892); replay replies without the topic.
    #[value(name = "vllm-0.24")]
    Vllm024,
    /// vLLM 0.22–0.23: positional events ending in the group's spec kind and window.
    #[value(name = "vllm-0.22")]
    Vllm022,
    /// vLLM 0.20–0.21: positional events ending in `extra_keys`, `group_idx`.
    #[value(name = "vllm-0.20")]
    Vllm020,
    /// vLLM 0.14–0.16: positional events ending in `medium`, `lora_name`.
    #[value(name = "vllm-0.14")]
    Vllm014,
    /// vLLM 0.10.2–0.13: positional events ending in `medium`.
    #[value(name = "vllm-0.10.2")]
    Vllm0102,
    /// vLLM 0.9.2–0.10.1: positional events without `medium`.
    #[value(name = "vllm-0.9.2")]
    Vllm092,
    /// vLLM 0.9.0–0.9.1: and the batch without the DP rank.
    #[value(name = "vllm-0.9.0")]
    Vllm090,
}

impl WireForm {
    /// Events as maps (else positional arrays after the tag).
    fn map_events(self) -> bool {
        matches!(self, WireForm::Vllm033 | WireForm::Vllm026 | WireForm::Vllm024)
    }

    /// How many of vLLM's `BlockStored` and `BlockRemoved` fields this form has.
    fn fields(self) -> (usize, usize) {
        match self {
            WireForm::Vllm033 | WireForm::Vllm026 | WireForm::Vllm024 | WireForm::Vllm022 => (11, 3),
            WireForm::Vllm020 => (9, 3),
            WireForm::Vllm014 => (7, 2),
            WireForm::Vllm0102 => (6, 2),
            WireForm::Vllm092 | WireForm::Vllm090 => (5, 1),
        }
    }

    /// Fields the release's `BlockStored` declares in all (those past the 11 positional ones
    /// are never set here): msgspec sizes a struct's map header by them.
    fn stored_struct_fields(self) -> usize {
        match self {
            WireForm::Vllm033 => 15,
            _ => 14, // at most: 0.30–0.32 have 14, 0.26–0.29 12–13, 0.24 11
        }
    }

    /// A replay reply has the live layout `[topic, seq, payload]` behind the envelope.
    pub fn replay_with_topic(self) -> bool {
        matches!(self, WireForm::Vllm033 | WireForm::Vllm026)
    }
}

/// One field's value, as far as this engine's events go.
#[derive(Clone, Copy)]
enum Value<'a> {
    /// A required field's `None`: always written.
    Nil,
    /// A defaulted field left at its default `None`: omitted from maps.
    Default,
    Uint(u64),
    Str(&'a str),
    Hashes(&'a [u64]),
    Tokens(&'a [u32]),
    /// `[nil] × n`: vLLM's `extra_keys` for blocks with none.
    Nils(usize),
}

impl Value<'_> {
    fn is_default(self) -> bool {
        matches!(self, Value::Default)
    }
}

/// `BlockRemoved` declares at most 5 fields (0.29+): its map header is always one byte.
const REMOVED_STRUCT_FIELDS: usize = 5;

// msgpack as msgspec writes it: the smallest integer and string forms, float64.

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

fn value(out: &mut Vec<u8>, v: Value) {
    match v {
        Value::Nil | Value::Default => out.push(0xc0),
        Value::Uint(u) => uint(out, u),
        Value::Str(s) => str(out, s),
        Value::Hashes(hs) => {
            array(out, hs.len());
            hs.iter().for_each(|h| uint(out, *h));
        }
        Value::Tokens(ts) => {
            array(out, ts.len());
            ts.iter().for_each(|t| uint(out, u64::from(*t)));
        }
        Value::Nils(n) => {
            array(out, n);
            out.extend(std::iter::repeat_n(0xc0, n));
        }
    }
}

/// One tagged event as msgspec encodes a `tag=True, omit_defaults=True` struct: a map
/// `{type, fields…}` without the defaulted fields left at their default, its header one
/// byte only if the struct could never have more than 15 entries (`struct_fields` + the
/// tag); or, `array_like`, `[tag, fields…]` with every field (msgspec omits nothing there).
fn event(out: &mut Vec<u8>, form: WireForm, tag: &str, names: &[&str], values: &[Value], struct_fields: usize) {
    if form.map_events() {
        let kept: Vec<usize> = (0..values.len()).filter(|&i| !values[i].is_default()).collect();
        if struct_fields + 1 > 15 {
            out.push(0xde);
            out.extend_from_slice(&(kept.len() as u16 + 1).to_be_bytes());
        } else {
            map(out, kept.len() + 1);
        }
        str(out, "type");
        str(out, tag);
        for i in kept {
            str(out, names[i]);
            value(out, values[i]);
        }
    } else {
        array(out, values.len() + 1);
        str(out, tag);
        values.iter().for_each(|v| value(out, *v));
    }
}

/// One `KVEventBatch` payload: `[ts, events, data_parallel_rank]` (vLLM's `EventBatch` is
/// `array_like`; its publisher always fills in the rank).
pub fn encode_batch(form: WireForm, ts: f64, events: &[KvEvent], dp_rank: u32) -> Vec<u8> {
    let (n_stored, n_removed) = form.fields();
    let mut out = Vec::with_capacity(64 + events.len() * 128);
    array(&mut out, if form == WireForm::Vllm090 { 2 } else { 3 });
    out.push(0xcb);
    out.extend_from_slice(&ts.to_bits().to_be_bytes());
    array(&mut out, events.len());
    for e in events {
        match e {
            KvEvent::Stored { hashes, parent, token_ids } => {
                let bs = token_ids.len().checked_div(hashes.len()).unwrap_or(0);
                let values = [
                    Value::Hashes(hashes),
                    parent.map_or(Value::Nil, Value::Uint),
                    Value::Tokens(token_ids),
                    Value::Uint(bs as u64),
                    Value::Nil, // lora_id
                    Value::Str("GPU"),
                    Value::Nil, // lora_name
                    Value::Nils(hashes.len()),
                    Value::Uint(0),
                    Value::Str("full_attention"),
                    Value::Default, // sliding window
                ];
                event(
                    &mut out,
                    form,
                    "BlockStored",
                    &VLLM_BLOCK_STORED_FIELDS,
                    &values[..n_stored],
                    form.stored_struct_fields(),
                );
            }
            KvEvent::Removed { hashes } => {
                let values = [Value::Hashes(hashes), Value::Str("GPU"), Value::Uint(0)];
                event(
                    &mut out,
                    form,
                    "BlockRemoved",
                    &VLLM_BLOCK_REMOVED_FIELDS,
                    &values[..n_removed],
                    REMOVED_STRUCT_FIELDS,
                );
            }
            KvEvent::Cleared => event(&mut out, form, "AllBlocksCleared", &[], &[], 0),
        }
    }
    if form != WireForm::Vllm090 {
        uint(&mut out, u64::from(dp_rank));
    }
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
    pub fn start(cfg: &KvEventsConfig, form: WireForm) -> Result<Publisher, String> {
        let ctx = zmq::Context::new();
        let pub_sock = ctx.socket(zmq::PUB).map_err(|e| format!("zmq: {e}"))?;
        pub_sock.set_sndhwm(cfg.hwm).map_err(|e| format!("zmq hwm: {e}"))?;
        pub_sock.set_linger(0).map_err(|e| format!("zmq linger: {e}"))?;
        open(&pub_sock, &cfg.endpoint).map_err(|e| format!("kv events endpoint {}: {e}", cfg.endpoint))?;
        let replay = match &cfg.replay_endpoint {
            Some(ep) => {
                let r = ctx.socket(zmq::ROUTER).map_err(|e| format!("zmq: {e}"))?;
                r.set_linger(0).map_err(|e| format!("zmq linger: {e}"))?;
                // As vLLM >= 0.26: room for a whole replay and its end marker, which a ROUTER
                // would otherwise drop past the default high-water mark.
                let hwm = i32::try_from(2 * (cfg.buffer_steps.max(1) + 1)).unwrap_or(i32::MAX);
                r.set_sndhwm(hwm).map_err(|e| format!("zmq hwm: {e}"))?;
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
                            serve_replay(r, &buffer, form.replay_with_topic().then_some(topic.as_slice()));
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

/// Answers one replay request; `topic`: the reply has the live layout (vLLM >= 0.26).
fn serve_replay(r: &zmq::Socket, buffer: &VecDeque<(u64, Vec<u8>)>, topic: Option<&[u8]>) {
    let Ok(frames) = r.recv_multipart(zmq::DONTWAIT) else { return };
    // [client identity, b"", start_seq]
    let [client, _, start] = frames.as_slice() else { return };
    let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else { return };
    let start = u64::from_be_bytes(start);
    let send = |seq: &[u8], payload: &[u8], topic_frame: &[u8]| {
        let sent = match topic {
            Some(_) => r.send_multipart([&client[..], b"", topic_frame, seq, payload], 0),
            None => r.send_multipart([&client[..], b"", seq, payload], 0),
        };
        if let Err(e) = sent {
            log::warn!("kv events: replay send failed: {e}");
        }
    };
    for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
        send(&seq.to_be_bytes(), payload, topic.unwrap_or_default());
    }
    send(&END_SEQ, b"", b"");
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_sidecar::events::{decode_batch, Event, Medium};

    #[test]
    fn every_form_decodes_with_the_sidecars_decoder() {
        use clap::ValueEnum;
        let events = vec![
            KvEvent::Stored { hashes: vec![u64::MAX, 7], parent: Some(300), token_ids: (0..32).collect() },
            KvEvent::Removed { hashes: vec![1, 70_000, 5_000_000_000] },
            KvEvent::Cleared,
        ];
        for form in WireForm::value_variants() {
            let b = decode_batch(&encode_batch(*form, 1700000000.25, &events, 3)).unwrap();
            let rank = if *form == WireForm::Vllm090 { None } else { Some(3) };
            assert_eq!((b.tail.ts, b.tail.dp_rank), (1700000000.25, rank), "{form:?}");
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
    }

    #[test]
    fn layouts_follow_msgspec() {
        // (The bytes are checked against vLLM's own classes in tests/integration.)
        let one = [KvEvent::Stored { hashes: vec![5], parent: None, token_ids: vec![1] }];
        // 0.33: BlockStored declares 15 fields, so its map header is map16 whatever is set;
        // the window (a default None) is left out.
        let v033 = encode_batch(WireForm::Vllm033, 0.0, &one, 0);
        assert_eq!(v033[..2], [0x93, 0xcb]);
        assert_eq!(v033[10..14], [0x91, 0xde, 0x00, 0x0b]); // one event: type + 10 fields
        let tail: &[u8] = b"\xb2kv_cache_spec_kind\xaefull_attention\x00";
        assert!(v033.ends_with(tail));
        assert!(!v033.windows(12).any(|w| w == b"sliding_wind"));
        let v026 = encode_batch(WireForm::Vllm026, 0.0, &one, 0);
        assert_eq!(v026[10..12], [0x91, 0x8b]);
        assert_eq!(v026[12..], v033[14..]);
        // Positional forms write every field, defaults included.
        let v022 = encode_batch(WireForm::Vllm022, 0.0, &one, 0);
        assert_eq!(v022[10..12], [0x91, 0x9c]); // [tag, 11 fields]
        assert!(v022.ends_with(b"\xaefull_attention\xc0\x00"));
        let v020 = encode_batch(WireForm::Vllm020, 0.0, &one, 0);
        assert_eq!(v020[10..12], [0x91, 0x9a]); // [tag, 9 fields]
        assert!(v020.ends_with(&[0xa3, b'G', b'P', b'U', 0xc0, 0x91, 0xc0, 0x00, 0x00]));
        let v090 = encode_batch(WireForm::Vllm090, 0.0, &one, 0);
        assert_eq!((v090[0], v090[10], v090[11]), (0x92, 0x91, 0x96)); // no rank; [tag, 5 fields]
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
