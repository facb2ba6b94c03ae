//! KV-cache events as vLLM and SGLang publish them, decoded from their msgpack payloads.
//!
//! Every form the engines have shipped is accepted (see `DESIGN.md`, "The sidecar"):
//! - the batch as an array `[ts, events, dp_rank?]` or a map
//!   `{ts, events, data_parallel_rank | attn_dp_rank}`;
//! - each event as a tagged array `["BlockStored", …]` or a map with a `type` tag;
//! - block hashes as msgpack ints (u64 or i64) or bytes (the last 8 bytes, big-endian);
//! - unknown trailing fields and unknown map keys are ignored.
//!
//! Decoding is all or nothing per batch: a payload that is not a well-formed batch is an
//! error (the caller cannot know what it said, so it must not guess). An event whose tag
//! is not known is kept as [`Event::Unknown`] so it can be counted and skipped.

use crate::msgpack::{Kind, MsgpackError, Reader};

/// Where a block lives. vLLM sends `medium = "GPU"` (or nothing) for device memory; any
/// other medium (`"CPU"`, disk, a connector's name) is a lower tier the engine can load
/// the block back from.
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

/// One block's `extra_keys` entry: what besides its tokens went into the engine's hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKeys {
    /// No extra keys (msgpack nil, or no `extra_keys` field at all).
    None,
    /// A tuple of strings (LoRA name, cache salt, multimodal identifiers).
    Strings(Vec<String>),
    /// Anything else: cannot be reproduced from a request.
    Opaque,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// Engine hashes, one per engine block, in chain order.
    pub block_hashes: Vec<u64>,
    /// Engine hash of the block before `block_hashes[0]`; `None` for a chain's first block.
    pub parent: Option<u64>,
    /// The tokens of all blocks, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per engine block.
    pub block_size: u32,
    pub medium: Medium,
    pub lora_id: Option<i64>,
    pub lora_name: Option<String>,
    /// One entry per block, when the engine sent them.
    pub extra_keys: Vec<ExtraKeys>,
    /// KV-cache group (hybrid models have several); 0 when not sent.
    pub group_idx: u32,
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
    /// An event type this sidecar does not know (kept to be counted).
    Unknown(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Publisher's wall clock, seconds since the epoch.
    pub ts: f64,
    pub events: Vec<Event>,
    /// The data-parallel rank the publisher reports, if any.
    pub dp_rank: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<MsgpackError> for DecodeError {
    fn from(e: MsgpackError) -> Self {
        DecodeError(format!("msgpack: {e}"))
    }
}

fn bad<T>(what: &str) -> Result<T, DecodeError> {
    Err(DecodeError(what.to_string()))
}

/// Decodes one event-batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, DecodeError> {
    let mut r = Reader::new(payload);
    let batch = match r.peek_kind()? {
        Kind::Array => {
            let n = r.array_len()?;
            if n < 2 {
                return bad("batch array has fewer than 2 fields");
            }
            let ts = r.number()?;
            let events = decode_events(&mut r)?;
            let dp_rank = if n >= 3 { opt_u32(&mut r)? } else { None };
            for _ in 3..n {
                r.skip()?;
            }
            Batch { ts, events, dp_rank }
        }
        Kind::Map => {
            let (mut ts, mut events, mut dp_rank) = (None, None, None);
            for _ in 0..r.map_len()? {
                match r.str()? {
                    "ts" => ts = Some(r.number()?),
                    "events" => events = Some(decode_events(&mut r)?),
                    "data_parallel_rank" | "attn_dp_rank" | "dp_rank" => dp_rank = opt_u32(&mut r)?,
                    _ => r.skip()?,
                }
            }
            let (Some(ts), Some(events)) = (ts, events) else {
                return bad("batch map lacks `ts` or `events`");
            };
            Batch { ts, events, dp_rank }
        }
        _ => return bad("batch is neither an array nor a map"),
    };
    if !r.is_at_end() {
        return bad("trailing bytes after the batch");
    }
    Ok(batch)
}

fn decode_events(r: &mut Reader) -> Result<Vec<Event>, DecodeError> {
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(decode_event(r)?);
    }
    Ok(out)
}

/// The fields any event type may carry, filled from either wire form.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<u64>>,
    parent: Option<u64>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Vec<ExtraKeys>,
    group_idx: Option<u32>,
}

impl Fields {
    fn read(&mut self, name: &str, r: &mut Reader) -> Result<(), DecodeError> {
        match name {
            "block_hashes" => self.block_hashes = Some(hash_list(r)?),
            "parent_block_hash" => self.parent = opt_hash(r)?,
            "token_ids" => self.token_ids = Some(token_list(r)?),
            "block_size" => self.block_size = Some(r.u32()?),
            "lora_id" => self.lora_id = opt_i64(r)?,
            "medium" => self.medium = opt_str(r)?,
            "lora_name" => self.lora_name = opt_str(r)?,
            "extra_keys" => self.extra_keys = extra_keys(r)?,
            "group_idx" => self.group_idx = opt_u32(r)?,
            _ => r.skip()?,
        }
        Ok(())
    }

    fn into_event(self, tag: &str) -> Result<Event, DecodeError> {
        Ok(match tag {
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
                    medium: Medium::parse(self.medium.as_deref()),
                    lora_id: self.lora_id,
                    lora_name: self.lora_name,
                    extra_keys: self.extra_keys,
                    group_idx: self.group_idx.unwrap_or(0),
                })
            }
            "BlockRemoved" => {
                let Some(block_hashes) = self.block_hashes else {
                    return bad("BlockRemoved lacks block_hashes");
                };
                Event::Removed(BlockRemoved {
                    block_hashes,
                    medium: Medium::parse(self.medium.as_deref()),
                    group_idx: self.group_idx.unwrap_or(0),
                })
            }
            "AllBlocksCleared" => Event::Cleared,
            other => Event::Unknown(other.to_string()),
        })
    }
}

/// Field order of the array (`array_like`) form, after the tag.
const STORED_FIELDS: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
];
const REMOVED_FIELDS: &[&str] = &["block_hashes", "medium", "group_idx"];

fn decode_event(r: &mut Reader) -> Result<Event, DecodeError> {
    let mut fields = Fields::default();
    match r.peek_kind()? {
        Kind::Array => {
            let n = r.array_len()?;
            if n == 0 {
                return bad("event array is empty");
            }
            let tag = r.str()?;
            let names: &[&str] = match tag {
                "BlockStored" => STORED_FIELDS,
                "BlockRemoved" => REMOVED_FIELDS,
                _ => &[],
            };
            for i in 0..n - 1 {
                match names.get(i) {
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
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(hash(r)?);
    }
    Ok(out)
}

fn token_list(r: &mut Reader) -> Result<Vec<u32>, DecodeError> {
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(r.u32().map_err(|_| DecodeError("token id is not a u32".into()))?);
    }
    Ok(out)
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
    if r.nil()? {
        return Ok(None);
    }
    Ok(Some(r.str()?.to_string()))
}

fn extra_keys(r: &mut Reader) -> Result<Vec<ExtraKeys>, DecodeError> {
    if r.nil()? {
        return Ok(Vec::new());
    }
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(n);
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
        let mut strings = Vec::with_capacity(m);
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

    // Hand-assembled payloads; the real-encoder fixtures are tested in tests/events.rs.

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
        assert_eq!(b.ts, 1.5);
        assert_eq!(b.dp_rank, Some(3));
        assert_eq!(b.events.len(), 2);
        let Event::Stored(s) = &b.events[0] else { panic!("{:?}", b.events[0]) };
        assert_eq!((s.block_hashes.as_slice(), s.parent, s.token_ids.as_slice()), (&[7u64][..], None, &[1u32, 2][..]));
        assert_eq!((s.block_size, s.medium, s.group_idx), (2, Medium::Gpu, 0));
        assert_eq!(b.events[1], Event::Cleared);
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
