//! KV-cache events as vLLM and SGLang publish them, decoded from their msgpack payloads.
//!
//! Every form the engines have shipped is accepted (the table in `sidecar/README.md`,
//! "Compatibility", names each with its versions):
//! - the batch as an array `[ts, events, dp_rank?]` (every vLLM and SGLang release) or a
//!   map `{ts, events, data_parallel_rank | attn_dp_rank}`;
//! - each event as a tagged array `["BlockStored", …]` (vLLM ≤ 0.23, SGLang ≤ 0.5.19) or a
//!   map with a `type` tag and defaults omitted (vLLM ≥ 0.24, SGLang ≥ 0.5.20);
//! - block hashes as msgpack ints (u64 or i64) or bytes (the last 8 bytes, big-endian);
//! - a token as an int or, in SGLang's EAGLE "bigram" pages, a pair whose first element is
//!   the token;
//! - unknown trailing fields and unknown map keys are ignored.
//!
//! A batch is read event by event ([`BatchReader`]), so applying one costs the memory of one
//! event whatever the batch's size; [`decode_batch`] collects them (tests, benchmarks). A
//! payload that is not a well-formed batch is an error, found where it goes wrong: the
//! caller cannot know what the batch said, so it clears the stream, dropping what the
//! batch's first events did with the rest. Events of a type not known are counted and
//! dropped.
//!
//! No allocation follows a header's word: every reservation goes through
//! [`kvroute::wire::capacity_for`], so a length prefix can only reserve what the bytes
//! after it could hold. Events per batch and blocks and tokens per event are also capped
//! ([`MAX_EVENTS_PER_BATCH`], …): a batch over a cap is an error marked `over_cap`.

use crate::msgpack::{Kind, MsgpackError, Reader};
use kvroute::wire::{capacity_for, VLLM_BLOCK_REMOVED_FIELDS, VLLM_BLOCK_STORED_FIELDS};

/// Where a block lives. vLLM sends `medium = "GPU"` (or nothing) for device memory; any
/// other medium (vLLM `"CPU"`, `"STORAGE"`; SGLang `"CPU_PINNED"`, `"DISK"`, `"EXTERNAL"`;
/// a connector's name) is a lower tier the engine can load the block back from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    Gpu,
    Offloaded,
}

impl Medium {
    fn parse(s: Option<&str>) -> Medium {
        match s {
            None => Medium::Gpu,
            Some(m) if m.eq_ignore_ascii_case("gpu") => Medium::Gpu,
            Some(_) => Medium::Offloaded,
        }
    }
}

/// The kind of KV-cache group a stored block belongs to (vLLM's `kv_cache_spec_kind`,
/// sent since 0.22; SGLang and older vLLM send none). Only full-attention groups make
/// prefix hits on their own; see `cache.rs` for what the others mean for `cache_hits`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    /// `full_attention`, `mla_attention`, `sink_full_attention`.
    Full,
    /// `sliding_window`, `sliding_window_mla`, `chunked_local_attention`, `mamba`:
    /// state the engine needs only near a hit's end; `encoder_only_attention`,
    /// `cross_attention`: never prefix-cached.
    NotFull,
    /// A kind this sidecar does not know (vLLM's own `unknown`, or a newer one).
    Unknown,
}

impl GroupKind {
    fn parse(s: &str) -> GroupKind {
        match s {
            "full_attention" | "mla_attention" | "sink_full_attention" => GroupKind::Full,
            "sliding_window"
            | "sliding_window_mla"
            | "chunked_local_attention"
            | "mamba"
            | "encoder_only_attention"
            | "cross_attention" => GroupKind::NotFull,
            _ => GroupKind::Unknown,
        }
    }
}

/// One block's `extra_keys` entry: what besides its tokens went into the engine's hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKeys {
    /// No extra keys (msgpack nil, or no `extra_keys` field at all).
    None,
    /// A tuple of strings (LoRA name, cache salt).
    Strings(Vec<String>),
    /// Anything else (multimodal `(identifier, offset)` pairs, prompt-embedding digests):
    /// cannot be reproduced from a request.
    Opaque,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// Engine hashes, one per engine block, in chain order.
    pub block_hashes: Vec<u64>,
    /// Engine hash of the block before `block_hashes[0]`; `None` for a chain's first block.
    pub parent: Option<u64>,
    /// The tokens of all blocks, concatenated. Empty in vLLM's offload placeholders, which
    /// name an engine block stored elsewhere with `block_size` 0.
    pub token_ids: Vec<u32>,
    /// Tokens per engine block.
    pub block_size: u32,
    pub medium: Medium,
    pub lora_id: Option<i64>,
    pub lora_name: Option<String>,
    /// One entry per block, when the engine sent them (vLLM ≥ 0.17).
    pub extra_keys: Vec<ExtraKeys>,
    /// KV-cache group (hybrid models have several); 0 when not sent.
    pub group_idx: u32,
    /// The group's kind, when the engine says (vLLM ≥ 0.22).
    pub group_kind: Option<GroupKind>,
    /// SGLang's cache salt: its `cache_salt` field (≥ 0.5.20) or `metadata.cache_salt`
    /// (0.5.18–0.5.19). vLLM sends the salt in `extra_keys` instead.
    pub cache_salt: Option<String>,
}

impl BlockStored {
    /// A store of the base model's blocks in GPU memory, as most tests and seeds want one.
    pub fn on_gpu(block_hashes: &[u64], parent: Option<u64>, token_ids: Vec<u32>, block_size: u32) -> BlockStored {
        BlockStored {
            block_hashes: block_hashes.to_vec(),
            parent,
            token_ids,
            block_size,
            medium: Medium::Gpu,
            lora_id: None,
            lora_name: None,
            extra_keys: Vec::new(),
            group_idx: 0,
            group_kind: None,
            cache_salt: None,
        }
    }
}

impl BlockStored {
    /// vLLM's offloading connector without `self_describing_kv_events`: "an offload tier now
    /// holds the engine block with this hash", with no tokens (`block_size` 0).
    pub fn is_placeholder(&self) -> bool {
        self.block_size == 0 && self.token_ids.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Medium,
    pub group_idx: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Stored(BlockStored),
    Removed(BlockRemoved),
    Cleared,
}

/// A whole decoded batch ([`decode_batch`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub events: Vec<Event>,
    pub tail: BatchTail,
}

/// Most events one batch may carry. vLLM publishes a batch per engine step: thousands of
/// events at most.
pub const MAX_EVENTS_PER_BATCH: usize = 1 << 16;
/// Most blocks one event may name: 2M tokens of blocks of 16, beyond any context length.
pub const MAX_BLOCKS_PER_EVENT: usize = 1 << 17;
/// Most token ids one event may carry.
pub const MAX_TOKENS_PER_EVENT: usize = 1 << 22;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    pub message: String,
    /// The batch is well-formed as far as read, but over one of the caps above.
    pub over_cap: bool,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<MsgpackError> for DecodeError {
    fn from(e: MsgpackError) -> Self {
        DecodeError { message: format!("msgpack: {e}"), over_cap: false }
    }
}

fn bad<T>(what: &str) -> Result<T, DecodeError> {
    Err(DecodeError { message: what.to_string(), over_cap: false })
}

/// A length over its cap: an error before anything of that length is read.
fn capped(n: usize, cap: usize, what: &str) -> Result<usize, DecodeError> {
    if n > cap {
        return Err(DecodeError { message: format!("{n} {what}, more than the cap of {cap}"), over_cap: true });
    }
    Ok(n)
}

/// Decodes one whole event-batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, DecodeError> {
    let mut reader = BatchReader::new(payload)?;
    let mut events = Vec::new();
    while let Some(e) = reader.next_event()? {
        events.push(e);
    }
    Ok(Batch { events, tail: reader.finish()? })
}

/// What a batch says besides its events, known once they are read (a map batch may put
/// `ts` after them).
#[derive(Debug, Clone, PartialEq)]
pub struct BatchTail {
    /// Publisher's wall clock, seconds since the epoch.
    pub ts: f64,
    /// The data-parallel rank the publisher reports, if any.
    pub dp_rank: Option<u32>,
    /// Events of a type this sidecar does not know (counted, skipped), and the first one's tag.
    pub unknown: u64,
    pub first_unknown: Option<String>,
}

/// Reads one batch payload event by event: [`BatchReader::next_event`] until `None`, then
/// [`BatchReader::finish`] for the fields after the events and the end-of-payload check.
pub struct BatchReader<'a> {
    r: Reader<'a>,
    /// Events not read yet.
    left: usize,
    /// What follows the events: positional fields, or key/value pairs of a map batch.
    after: After,
    ts: Option<f64>,
    dp_rank: Option<u32>,
    unknown: u64,
    first_unknown: Option<String>,
}

enum After {
    Fields(usize),
    Pairs(usize),
}

impl<'a> BatchReader<'a> {
    /// Reads up to the first event.
    pub fn new(payload: &'a [u8]) -> Result<BatchReader<'a>, DecodeError> {
        let mut r = Reader::new(payload);
        let (mut ts, mut dp_rank) = (None, None);
        let after = match r.peek_kind()? {
            Kind::Array => {
                let n = r.array_len()?;
                if n < 2 {
                    return bad("batch array has fewer than 2 fields");
                }
                ts = Some(r.number()?);
                After::Fields(n - 2)
            }
            Kind::Map => {
                let mut pairs = r.map_len()?;
                loop {
                    if pairs == 0 {
                        return bad("batch map lacks `events`");
                    }
                    pairs -= 1;
                    if !read_batch_key(&mut r, &mut ts, &mut dp_rank)? {
                        break After::Pairs(pairs); // at `events`
                    }
                }
            }
            _ => return bad("batch is neither an array nor a map"),
        };
        let left = capped(r.array_len()?, MAX_EVENTS_PER_BATCH, "events in the batch")?;
        Ok(BatchReader { r, left, after, ts, dp_rank, unknown: 0, first_unknown: None })
    }

    /// The next event the sidecar knows, or `None` after the last.
    pub fn next_event(&mut self) -> Result<Option<Event>, DecodeError> {
        while self.left > 0 {
            self.left -= 1;
            match decode_event(&mut self.r)? {
                Decoded::Event(e) => return Ok(Some(e)),
                Decoded::Unknown(tag) => {
                    self.unknown += 1;
                    if self.first_unknown.is_none() {
                        self.first_unknown = Some(tag.to_string());
                    }
                }
            }
        }
        Ok(None)
    }

    /// Reads the rest of the payload (events not read yet are decoded and dropped).
    pub fn finish(mut self) -> Result<BatchTail, DecodeError> {
        while self.next_event()?.is_some() {}
        match self.after {
            After::Fields(n) => {
                if n >= 1 {
                    self.dp_rank = opt_u32(&mut self.r)?;
                }
                for _ in 1..n {
                    self.r.skip()?;
                }
            }
            After::Pairs(n) => {
                for _ in 0..n {
                    if !read_batch_key(&mut self.r, &mut self.ts, &mut self.dp_rank)? {
                        return bad("batch map has `events` twice");
                    }
                }
            }
        }
        let Some(ts) = self.ts else {
            return bad("batch map lacks `ts`");
        };
        if !self.r.is_at_end() {
            return bad("trailing bytes after the batch");
        }
        Ok(BatchTail { ts, dp_rank: self.dp_rank, unknown: self.unknown, first_unknown: self.first_unknown })
    }
}

/// One key/value pair of a map batch other than `events`; false (value unread) at `events`.
fn read_batch_key(r: &mut Reader, ts: &mut Option<f64>, dp_rank: &mut Option<u32>) -> Result<bool, DecodeError> {
    match r.str()? {
        "events" => return Ok(false),
        "ts" => *ts = Some(r.number()?),
        "data_parallel_rank" | "attn_dp_rank" | "dp_rank" => *dp_rank = opt_u32(r)?,
        _ => r.skip()?,
    }
    Ok(true)
}

/// The fields any event type may carry, filled from either wire form.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<u64>>,
    parent: Option<u64>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<Medium>,
    lora_name: Option<String>,
    extra_keys: Vec<ExtraKeys>,
    group_idx: Option<u32>,
    kind: Option<GroupKind>,
    cache_salt: Option<String>,
}

impl Fields {
    fn read(&mut self, name: &str, r: &mut Reader) -> Result<(), DecodeError> {
        match name {
            "block_hashes" => self.block_hashes = Some(hash_list(r)?),
            "parent_block_hash" => self.parent = opt_hash(r)?,
            "token_ids" => self.token_ids = Some(token_list(r)?),
            "block_size" => self.block_size = Some(r.u32()?),
            "lora_id" => self.lora_id = opt_i64(r)?,
            // (Both read without a copy: they are on every event.)
            "medium" => self.medium = Some(Medium::parse(opt_str_ref(r)?)),
            "lora_name" => self.lora_name = opt_str(r)?,
            "extra_keys" => self.extra_keys = extra_keys(r)?,
            "group_idx" => self.group_idx = opt_u32(r)?,
            "kv_cache_spec_kind" => self.kind = opt_str_ref(r)?.map(GroupKind::parse),
            "cache_salt" => self.cache_salt = opt_str(r)?,
            // SGLang 0.5.18–0.5.19: `BlockStoredWithMetadata`'s `{"cache_salt": …}`.
            "metadata" => self.read_metadata(r)?,
            // Known and not needed: `kv_cache_spec_sliding_window`, `locality`, `ownership`,
            // `session_id`, `lookahead_token_ids` (see cache.rs on lookahead hashing).
            _ => r.skip()?,
        }
        Ok(())
    }

    fn read_metadata(&mut self, r: &mut Reader) -> Result<(), DecodeError> {
        if r.nil()? {
            return Ok(());
        }
        for _ in 0..r.map_len()? {
            match r.str()? {
                "cache_salt" => self.cache_salt = opt_str(r)?,
                _ => r.skip()?,
            }
        }
        Ok(())
    }

    fn into_event(self, tag: &str) -> Result<Decoded<'_>, DecodeError> {
        Ok(Decoded::Event(match tag {
            "BlockStored" => {
                let (Some(block_hashes), Some(token_ids), Some(block_size)) =
                    (self.block_hashes, self.token_ids, self.block_size)
                else {
                    return bad("BlockStored lacks block_hashes, token_ids or block_size");
                };
                Event::Stored(BlockStored {
                    block_hashes,
                    parent: self.parent,
                    token_ids,
                    block_size,
                    medium: self.medium.unwrap_or(Medium::Gpu),
                    lora_id: self.lora_id,
                    lora_name: self.lora_name,
                    extra_keys: self.extra_keys,
                    group_idx: self.group_idx.unwrap_or(0),
                    group_kind: self.kind,
                    cache_salt: self.cache_salt,
                })
            }
            "BlockRemoved" => {
                let Some(block_hashes) = self.block_hashes else {
                    return bad("BlockRemoved lacks block_hashes");
                };
                Event::Removed(BlockRemoved {
                    block_hashes,
                    medium: self.medium.unwrap_or(Medium::Gpu),
                    group_idx: self.group_idx.unwrap_or(0),
                })
            }
            "AllBlocksCleared" => Event::Cleared,
            other => return Ok(Decoded::Unknown(other)),
        }))
    }
}

enum Decoded<'a> {
    Event(Event),
    Unknown(&'a str),
}

/// Positional events: vLLM's field order ([`VLLM_BLOCK_STORED_FIELDS`]). SGLang's positional
/// `BlockStored` is the same up to `medium`, then (0.5.18–0.5.19, a salted block) a
/// `metadata` map where vLLM has `lora_name`.
const LORA_NAME_AT: usize = 6;

fn decode_event<'a>(r: &mut Reader<'a>) -> Result<Decoded<'a>, DecodeError> {
    let mut fields = Fields::default();
    match r.peek_kind()? {
        Kind::Array => {
            let n = r.array_len()?;
            if n == 0 {
                return bad("event array is empty");
            }
            let tag = r.str()?;
            let names: &[&str] = match tag {
                "BlockStored" => &VLLM_BLOCK_STORED_FIELDS,
                "BlockRemoved" => &VLLM_BLOCK_REMOVED_FIELDS,
                _ => &[],
            };
            for i in 0..n - 1 {
                match names.get(i) {
                    Some(_) if i == LORA_NAME_AT && tag == "BlockStored" && r.peek_kind()? == Kind::Map => {
                        fields.read("metadata", r)?
                    }
                    Some(name) => fields.read(name, r)?,
                    None => r.skip()?,
                }
            }
            fields.into_event(tag)
        }
        Kind::Map => {
            let mut tag = None;
            for _ in 0..r.map_len()? {
                match r.str()? {
                    "type" => tag = Some(r.str()?),
                    name => fields.read(name, r)?,
                }
            }
            let Some(tag) = tag else {
                return bad("event map has no `type` tag");
            };
            fields.into_event(tag)
        }
        _ => bad("event is neither an array nor a map"),
    }
}

fn hash(r: &mut Reader) -> Result<u64, DecodeError> {
    match r.peek_kind()? {
        Kind::Int => {
            let v = r.int()?;
            // u64 as is; i64 by its two's-complement bit pattern (vLLM's signed hashes).
            if let Ok(u) = u64::try_from(v) {
                Ok(u)
            } else if let Ok(i) = i64::try_from(v) {
                Ok(i as u64)
            } else {
                bad("block hash out of 64-bit range")
            }
        }
        Kind::Bin => {
            let b = r.bin()?;
            if b.is_empty() {
                return bad("empty block hash");
            }
            let tail = &b[b.len().saturating_sub(8)..];
            Ok(tail.iter().fold(0u64, |acc, x| (acc << 8) | u64::from(*x)))
        }
        _ => bad("block hash is neither an int nor bytes"),
    }
}

fn opt_hash(r: &mut Reader) -> Result<Option<u64>, DecodeError> {
    if r.nil()? {
        return Ok(None);
    }
    hash(r).map(Some)
}

fn hash_list(r: &mut Reader) -> Result<Vec<u64>, DecodeError> {
    let n = capped(r.array_len()?, MAX_BLOCKS_PER_EVENT, "block hashes in an event")?;
    let mut out = Vec::with_capacity(capacity_for::<u64>(n, r.remaining(), 1));
    for _ in 0..n {
        out.push(hash(r)?);
    }
    Ok(out)
}

fn token_list(r: &mut Reader) -> Result<Vec<u32>, DecodeError> {
    let n = capped(r.array_len()?, MAX_TOKENS_PER_EVENT, "token ids in an event")?;
    let mut out = Vec::with_capacity(capacity_for::<u32>(n, r.remaining(), 1));
    for _ in 0..n {
        out.push(token(r)?);
    }
    Ok(out)
}

fn token(r: &mut Reader) -> Result<u32, DecodeError> {
    let not_a_token = |_| DecodeError { message: "token id is not a u32".into(), over_cap: false };
    if let Some(t) = r.u32_if_int().map_err(not_a_token)? {
        return Ok(t);
    }
    // SGLang's EAGLE bigram page: (token, next token).
    let n = r.array_len()?;
    if n == 0 {
        return bad("empty token pair");
    }
    let t = r.u32().map_err(not_a_token)?;
    for _ in 1..n {
        r.skip()?;
    }
    Ok(t)
}

fn opt_u32(r: &mut Reader) -> Result<Option<u32>, DecodeError> {
    if r.nil()? {
        return Ok(None);
    }
    Ok(Some(r.u32()?))
}

fn opt_i64(r: &mut Reader) -> Result<Option<i64>, DecodeError> {
    if r.nil()? {
        return Ok(None);
    }
    let v = r.int()?;
    i64::try_from(v).map(Some).or_else(|_| bad("integer out of i64 range"))
}

fn opt_str(r: &mut Reader) -> Result<Option<String>, DecodeError> {
    Ok(opt_str_ref(r)?.map(str::to_string))
}

fn opt_str_ref<'a>(r: &mut Reader<'a>) -> Result<Option<&'a str>, DecodeError> {
    if r.nil()? {
        return Ok(None);
    }
    Ok(Some(r.str()?))
}

fn extra_keys(r: &mut Reader) -> Result<Vec<ExtraKeys>, DecodeError> {
    if r.nil()? {
        return Ok(Vec::new());
    }
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(capacity_for::<ExtraKeys>(n, r.remaining(), 1));
    for _ in 0..n {
        if r.nil()? {
            out.push(ExtraKeys::None);
            continue;
        }
        if r.peek_kind()? != Kind::Array {
            r.skip()?;
            out.push(ExtraKeys::Opaque);
            continue;
        }
        let m = r.array_len()?;
        let mut strings = Vec::with_capacity(capacity_for::<String>(m, r.remaining(), 1));
        let mut opaque = false;
        for _ in 0..m {
            if r.peek_kind()? == Kind::Str {
                strings.push(r.str()?.to_string());
            } else {
                r.skip()?;
                opaque = true;
            }
        }
        out.push(if opaque { ExtraKeys::Opaque } else { ExtraKeys::Strings(strings) });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Hand-assembled payloads. Payloads from the engines' own encoders (msgspec, every
    // form in sidecar/README.md's table) are tested against the real sidecar in
    // tests/integration/test_sidecar.py.

    fn stored(b: &Batch, i: usize) -> &BlockStored {
        match &b.events[i] {
            Event::Stored(s) => s,
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn counts_over_a_cap_are_refused_before_reading_on() {
        // [0.0, array32 of MAX_EVENTS_PER_BATCH + 1 nils]: the bytes are there (a shorter
        // array is refused as truncated first), the count is over the cap.
        let events = |n: usize| {
            let mut p = vec![0x92, 0x00, 0xdd];
            p.extend_from_slice(&(n as u32).to_be_bytes());
            p.resize(p.len() + n, 0xc0);
            p
        };
        let e = decode_batch(&events(MAX_EVENTS_PER_BATCH + 1)).unwrap_err();
        assert!(e.over_cap && e.message.contains("events in the batch"), "{e:?}");
        // At the cap the batch is read (and refused for what its events are).
        assert!(!decode_batch(&events(MAX_EVENTS_PER_BATCH)).unwrap_err().over_cap);
        // [0.0, [["BlockRemoved", array32 of MAX_BLOCKS_PER_EVENT + 1 hashes]]]
        let mut p = vec![0x92, 0x00, 0x91, 0x92, 0xac];
        p.extend_from_slice(b"BlockRemoved");
        p.push(0xdd);
        p.extend_from_slice(&(MAX_BLOCKS_PER_EVENT as u32 + 1).to_be_bytes());
        p.resize(p.len() + MAX_BLOCKS_PER_EVENT + 1, 0x07);
        let e = decode_batch(&p).unwrap_err();
        assert!(e.over_cap && e.message.contains("block hashes"), "{e:?}");
    }

    #[test]
    fn array_batch_with_tagged_array_events() {
        // [1.5, [["BlockStored", [7], nil, [1,2], 2, nil, "GPU"], ["AllBlocksCleared"]], 3]
        let mut p = vec![0x93, 0xcb];
        p.extend_from_slice(&1.5f64.to_bits().to_be_bytes());
        p.extend_from_slice(&[0x92, 0x97, 0xab]);
        p.extend_from_slice(b"BlockStored");
        p.extend_from_slice(&[0x91, 0x07, 0xc0, 0x92, 0x01, 0x02, 0x02, 0xc0, 0xa3]);
        p.extend_from_slice(b"GPU");
        p.extend_from_slice(&[0x91, 0xb0]);
        p.extend_from_slice(b"AllBlocksCleared");
        p.push(0x03);
        let b = decode_batch(&p).unwrap();
        assert_eq!(b.tail.ts, 1.5);
        assert_eq!(b.tail.dp_rank, Some(3));
        assert_eq!(b.events.len(), 2);
        let s = stored(&b, 0);
        assert_eq!((s.block_hashes.as_slice(), s.parent, s.token_ids.as_slice()), (&[7u64][..], None, &[1u32, 2][..]));
        assert_eq!((s.block_size, s.medium, s.group_idx, s.group_kind), (2, Medium::Gpu, 0, None));
        assert_eq!(b.events[1], Event::Cleared);
    }

    #[test]
    fn sglang_positional_metadata_carries_the_salt_where_vllm_has_lora_name() {
        // ["BlockStored", [7], nil, [1], 1, nil, "GPU", {"cache_salt": "s"}] and vLLM's
        // ["BlockStored", [7], nil, [1], 1, nil, "GPU", "sql"].
        let event = |last: &[u8]| {
            let mut p = vec![0x92, 0x00, 0x91, 0x98, 0xab];
            p.extend_from_slice(b"BlockStored");
            p.extend_from_slice(&[0x91, 0x07, 0xc0, 0x91, 0x01, 0x01, 0xc0, 0xa3]);
            p.extend_from_slice(b"GPU");
            p.extend_from_slice(last);
            decode_batch(&p).unwrap()
        };
        let mut meta = vec![0x81, 0xaa];
        meta.extend_from_slice(b"cache_salt");
        meta.extend_from_slice(&[0xa1, b's']);
        let b = event(&meta);
        assert_eq!((stored(&b, 0).cache_salt.as_deref(), stored(&b, 0).lora_name.as_deref()), (Some("s"), None));
        let b = event(&[0xa3, b's', b'q', b'l']);
        assert_eq!((stored(&b, 0).cache_salt.as_deref(), stored(&b, 0).lora_name.as_deref()), (None, Some("sql")));
    }

    #[test]
    fn group_kinds_and_bigram_tokens() {
        for (kind, want) in [
            ("full_attention", GroupKind::Full),
            ("mla_attention", GroupKind::Full),
            ("sliding_window", GroupKind::NotFull),
            ("mamba", GroupKind::NotFull),
            ("cross_attention", GroupKind::NotFull),
            ("unknown", GroupKind::Unknown),
            ("hyperbolic_attention", GroupKind::Unknown),
        ] {
            assert_eq!(GroupKind::parse(kind), want, "{kind:?}");
        }
        // [[5, 6], [6, 7]] → tokens 5, 6 (the first of each pair)
        let p = [0x92, 0x92, 0x05, 0x06, 0x92, 0x06, 0x07];
        assert_eq!(token_list(&mut Reader::new(&p)).unwrap(), vec![5, 6]);
        assert!(token_list(&mut Reader::new(&[0x91, 0x90])).is_err());
    }

    #[test]
    fn unknown_event_types_are_counted_not_kept() {
        // [0, [["Renamed"], {"type": "BlockPinned"}, ["AllBlocksCleared"]]]
        let mut p = vec![0x92, 0x00, 0x93, 0x91, 0xa7];
        p.extend_from_slice(b"Renamed");
        p.extend_from_slice(&[0x81, 0xa4]);
        p.extend_from_slice(b"type");
        p.push(0xab);
        p.extend_from_slice(b"BlockPinned");
        p.extend_from_slice(&[0x91, 0xb0]);
        p.extend_from_slice(b"AllBlocksCleared");
        let b = decode_batch(&p).unwrap();
        assert_eq!(
            (b.events.as_slice(), b.tail.unknown, b.tail.first_unknown.as_deref()),
            (&[Event::Cleared][..], 2, Some("Renamed"))
        );
    }

    #[test]
    fn bytes_hashes_take_the_last_eight_bytes_big_endian() {
        let mut bytes = vec![0u8; 24];
        bytes[16..].copy_from_slice(&0x0102030405060708u64.to_be_bytes());
        let mut p = vec![0xc4, 24];
        p.extend_from_slice(&bytes);
        assert_eq!(hash(&mut Reader::new(&p)).unwrap(), 0x0102030405060708);
        // negative int hash → its bit pattern
        assert_eq!(hash(&mut Reader::new(&[0xff])).unwrap(), u64::MAX);
    }

    #[test]
    fn a_map_batch_may_put_its_fields_around_the_events() {
        // {"events": [["AllBlocksCleared"]], "ts": 2, "data_parallel_rank": 1}
        let mut p = vec![0x83, 0xa6];
        p.extend_from_slice(b"events");
        p.extend_from_slice(&[0x91, 0x91, 0xb0]);
        p.extend_from_slice(b"AllBlocksCleared");
        p.extend_from_slice(&[0xa2, b't', b's', 0x02, 0xb2]);
        p.extend_from_slice(b"data_parallel_rank");
        p.push(0x01);
        let b = decode_batch(&p).unwrap();
        assert_eq!((b.tail.ts, b.tail.dp_rank, b.events.as_slice()), (2.0, Some(1), &[Event::Cleared][..]));
        // Without `ts`, or with `events` twice: errors.
        let mut no_ts = vec![0x81, 0xa6];
        no_ts.extend_from_slice(b"events");
        no_ts.push(0x90);
        assert!(decode_batch(&no_ts).is_err());
        let mut twice = vec![0x82, 0xa6];
        twice.extend_from_slice(b"events");
        twice.extend_from_slice(&[0x90, 0xa6]);
        twice.extend_from_slice(b"events");
        twice.push(0x90);
        assert!(decode_batch(&twice).is_err());
    }

    #[test]
    fn a_batch_is_read_event_by_event_and_an_error_found_where_it_is() {
        // [0, [["AllBlocksCleared"], 7]]: the first event reads, the second does not.
        let mut p = vec![0x92, 0x00, 0x92, 0x91, 0xb0];
        p.extend_from_slice(b"AllBlocksCleared");
        p.push(0x07);
        let mut r = BatchReader::new(&p).unwrap();
        assert_eq!(r.next_event().unwrap(), Some(Event::Cleared));
        assert!(r.next_event().is_err());
    }

    #[test]
    fn malformed_payloads_are_errors() {
        for p in [
            &[][..],
            &[0xc0],
            &[0x91, 0x00],                   // one-field batch
            &[0x92, 0x00, 0x91, 0x90],       // event array without tag
            &[0x92, 0x00, 0x91, 0x91, 0x01], // tag not a string
            &[0x92, 0x00, 0x90, 0x00],       // trailing byte
        ] {
            assert!(decode_batch(p).is_err(), "{p:02x?}");
        }
    }
}
