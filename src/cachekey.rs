//! Cache keys: the requests a client marks as one cache group (OpenAI's `prompt_cache_key`,
//! or a header), such as one agent's steps or one conversation's turns.
//!
//! A key tells the router what no prompt can: that a request opens a group that will come
//! back and grow. Without it, a new conversation that shares only a system prompt goes to
//! the prompt's holder, where it costs a few blocks; thirty agents started together then
//! pile onto the few engines that hold their instructions and queue behind each other for
//! every later step (docs/benchmarks.md, "Cache keys"). So the first request of a key the
//! router has not seen is charged, on each worker, for the keys live there
//! (`cache_key_spread` × the request's blocks per key): new groups spread over the fleet,
//! each paying for its shared prefix once per engine. A key's later requests are ranked by
//! the plain cost, which keeps them where their history is. A key is live on its worker
//! for one to two live windows (`cache_key_live_ms`) after its last request, so sessions
//! that end stop counting; it is remembered (its next request goes by the plain cost) for
//! `cache_key_window_ms`.
//!
//! Implicit keys, for requests without one (`implicit_cache_keys`): a request cannot say
//! it opens a conversation, but the fleet shows which shared prefixes conversations grow
//! from. A request's *anchor* is the deepest prefix other requests have in flight on one
//! worker (a system prompt shared by agents at work); a request whose hits run past its
//! anchor there is a later step of a conversation that started at the anchor, and marks
//! the anchor conversational. A request that leaves a conversational anchor (or runs past
//! it) gets the implicit key [`implicit_key`] of its first block past it, and is placed as
//! a keyed request: new conversations apart, later steps by the plain cost (with
//! `implicit_key_charge_continuations`, a later step whose key is new is charged too, at
//! its own blocks past the anchor: conversations that all began before the anchor was
//! known are spread when they come back). Requests that only share a prefix and end there
//! (siblings over one document, a burst) never mark it, so they are placed as before.
//!
//! Shared-data values, all written with compare-and-swap by the filters:
//! - `kvroute.k.{0..64}`: where each key's requests went last and when
//!   ([`KeyEntry`], sorted by the key's hash); entries older than the window go on the next
//!   write, and a full bucket drops its oldest;
//! - `kvroute.keyload`: per slot, the keys whose last request went there in the last one to
//!   two live windows ([`EpochCount`] per slot): each key is counted once, in the window
//!   of its last request — a request in a later window, or on another worker, moves the
//!   key's count there;
//! - `kvroute.anchors`: the conversational anchors (the prefix's last block hash) and when
//!   one was last seen continued, in a key bucket's layout; those not seen within the
//!   window go on the next write.

use crate::layout::{
    bucket_of, decode_slot_records, encode_slot_records, le_u64, lower_bound, slot_record, EpochCount, LayoutError,
    Reader,
};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Buckets of key entries. Power of two.
pub const KEY_BUCKETS: u32 = 64;
/// Entries a bucket keeps at most: 16384 keys seen within a window over all buckets.
pub const MAX_KEYS_PER_BUCKET: usize = 256;
pub const KEYLOAD_KEY: &str = "kvroute.keyload";
/// The conversational anchors ([`implicit_key`]): a key bucket's layout, slot unused.
pub const ANCHORS_KEY: &str = "kvroute.anchors";
const KEY_BUCKET_PREFIX: &str = "kvroute.k.";
/// Seeds the key hash apart from block hashes.
const KEY_SEED: u64 = 0x6b76_726f_7574_656b;
/// Seeds implicit keys apart from clients' keys.
const IMPLICIT_SEED: u64 = 0x696d_706c_6963_6974;

/// Key of key bucket `b`.
pub fn key_bucket_key(b: u32) -> String {
    format!("{KEY_BUCKET_PREFIX}{b}")
}

/// The hash a key is known by.
pub fn key_hash(key: &[u8]) -> u64 {
    xxh3_64_with_seed(key, KEY_SEED)
}

/// The implicit key of a request without one that leaves a conversational anchor: its
/// first block past the anchor, which every later step of the same conversation repeats
/// (block hashes chain their prefix, so it names the anchor too).
pub fn implicit_key(first_own_block: u64) -> u64 {
    xxh3_64_with_seed(&first_own_block.to_le_bytes(), IMPLICIT_SEED)
}

/// The bucket of a key's hash.
pub fn key_bucket_of(hash: u64) -> u32 {
    bucket_of(hash, KEY_BUCKETS)
}

/// Where a key's requests went last, and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyEntry {
    pub hash: u64,
    pub slot: u16,
    pub seen_ms: u64,
}

/// `hash u64, slot u16, seen_ms u64`, little-endian.
const ENTRY: usize = 18;

impl KeyEntry {
    fn decode(r: &mut Reader<'_>) -> Result<KeyEntry, LayoutError> {
        Ok(KeyEntry { hash: r.u64("key hash")?, slot: r.u16("key slot")?, seen_ms: r.u64("key seen")? })
    }
    fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.hash.to_le_bytes());
        out.extend_from_slice(&self.slot.to_le_bytes());
        out.extend_from_slice(&self.seen_ms.to_le_bytes());
    }
}

/// The number of entries in a key bucket's value, once its length is checked.
fn entries_in(bytes: &[u8]) -> Result<usize, LayoutError> {
    if !bytes.len().is_multiple_of(ENTRY) || bytes.len() / ENTRY > MAX_KEYS_PER_BUCKET {
        return Err(LayoutError("key bucket length"));
    }
    Ok(bytes.len() / ENTRY)
}

/// A key bucket's entries (an empty value: none).
pub fn decode_bucket(bytes: &[u8]) -> Result<Vec<KeyEntry>, LayoutError> {
    let mut r = Reader::new(bytes);
    (0..entries_in(bytes)?).map(|_| KeyEntry::decode(&mut r)).collect()
}

/// The entry of `hash` in a bucket's value, if any: a binary search over the entries in
/// place (they are sorted by hash), one entry decoded. In a bucket not sorted, as no
/// writer of ours leaves one, a key may be missed: it is then taken as new, and the write
/// that follows sorts the bucket.
pub fn find(bytes: &[u8], hash: u64) -> Result<Option<KeyEntry>, LayoutError> {
    let n = entries_in(bytes)?;
    let hash_at = |i: usize| le_u64(&bytes[i * ENTRY..i * ENTRY + 8]);
    match lower_bound(0, n, |i| hash_at(i) < hash) {
        i if i < n && hash_at(i) == hash => {
            KeyEntry::decode(&mut Reader::new(&bytes[i * ENTRY..(i + 1) * ENTRY])).map(Some)
        }
        _ => Ok(None),
    }
}

/// The bucket with `entry` put in (replacing the key's old one), without the entries last
/// seen before `keep_from_ms`, and at most [`MAX_KEYS_PER_BUCKET`] (the oldest go).
pub fn upsert(bytes: &[u8], entry: KeyEntry, keep_from_ms: u64) -> Result<Vec<u8>, LayoutError> {
    let mut entries = decode_bucket(bytes)?;
    entries.retain(|e| e.hash != entry.hash && e.seen_ms >= keep_from_ms);
    if entries.len() >= MAX_KEYS_PER_BUCKET {
        entries.sort_unstable_by_key(|e| std::cmp::Reverse(e.seen_ms));
        entries.truncate(MAX_KEYS_PER_BUCKET - 1);
    }
    entries.push(entry);
    entries.sort_unstable_by_key(|e| e.hash);
    let mut out = Vec::with_capacity(entries.len() * ENTRY);
    for e in &entries {
        e.encode_into(&mut out);
    }
    Ok(out)
}

/// Per slot, the keys live there: `n_slots × (u32 epoch, u32 now, u32 before)`
/// little-endian; missing tail slots count 0.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyLoad(pub Vec<EpochCount>);

impl KeyLoad {
    /// Decodes a value (a trailing partial slot is ignored: the writer's layout is ours).
    pub fn decode(bytes: &[u8]) -> KeyLoad {
        KeyLoad(decode_slot_records(bytes, |[epoch, now, before]| EpochCount { epoch, now, before }))
    }
    pub fn encode(&self) -> Vec<u8> {
        encode_slot_records(&self.0, |c| [c.epoch, c.now, c.before])
    }
    /// Keys live on `slot` as of live window `epoch`: last seen there in it or the one before.
    pub fn get(&self, slot: usize, epoch: u32) -> u32 {
        self.0.get(slot).map_or(0, |c| c.get(epoch))
    }
    /// A key's last request went to `slot` in live window `epoch`; before, it was counted on
    /// `was` (slot and window), where it is taken off (nothing, if that window has passed).
    pub fn seen(&mut self, was: Option<(usize, u32)>, slot: usize, epoch: u32) {
        if let Some((from, at)) = was {
            if let Some(c) = slot_record(&mut self.0, from) {
                c.add(at, -1, epoch);
            }
        }
        if let Some(c) = slot_record(&mut self.0, slot) {
            c.add(epoch, 1, epoch);
        }
    }
}

/// The live window of `now_ms`.
pub fn key_epoch(now_ms: u64, live_ms: u64) -> u32 {
    (now_ms / live_ms.max(1)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(hash: u64, slot: u16, seen_ms: u64) -> KeyEntry {
        KeyEntry { hash, slot, seen_ms }
    }

    #[test]
    fn upsert_replaces_a_keys_entry_and_drops_the_expired() {
        let v = upsert(&[], e(7, 1, 1_000), 0).unwrap();
        let v = upsert(&v, e(3, 2, 2_000), 0).unwrap();
        assert_eq!(decode_bucket(&v).unwrap(), vec![e(3, 2, 2_000), e(7, 1, 1_000)]);
        // The key moves; the entry last seen before 1500 goes.
        let v = upsert(&v, e(3, 4, 5_000), 1_500).unwrap();
        assert_eq!(decode_bucket(&v).unwrap(), vec![e(3, 4, 5_000)]);
        assert_eq!(find(&v, 3).unwrap(), Some(e(3, 4, 5_000)));
        assert_eq!(find(&v, 7).unwrap(), None);
    }

    #[test]
    fn find_searches_a_sorted_bucket_as_decoding_it_would() {
        let mut v = Vec::new();
        for i in 0..200u64 {
            v = upsert(&v, e(i.wrapping_mul(0x9e37_79b9_7f4a_7c15), (i % 7) as u16, i), 0).unwrap();
        }
        let all = decode_bucket(&v).unwrap();
        for x in &all {
            assert_eq!(find(&v, x.hash).unwrap(), Some(*x));
        }
        assert_eq!(find(&v, 12345).unwrap(), None);
        assert_eq!(find(&[], 1).unwrap(), None);
        assert!(find(&[0; ENTRY + 1], 1).is_err());
    }

    #[test]
    fn a_full_bucket_drops_its_oldest_entry() {
        let mut v = Vec::new();
        for i in 0..MAX_KEYS_PER_BUCKET as u64 {
            v = upsert(&v, e(i, 0, 1_000 + i), 0).unwrap();
        }
        let v = upsert(&v, e(999, 1, 9_000), 0).unwrap();
        let entries = decode_bucket(&v).unwrap();
        assert_eq!(entries.len(), MAX_KEYS_PER_BUCKET);
        assert!(entries.iter().all(|x| x.hash != 0), "the oldest (hash 0) went");
        assert!(entries.windows(2).all(|w| w[0].hash < w[1].hash));
    }

    #[test]
    fn bad_bucket_values_are_errors_not_panics() {
        assert!(decode_bucket(&[1, 2, 3]).is_err());
        assert!(decode_bucket(&vec![0; ENTRY * (MAX_KEYS_PER_BUCKET + 1)]).is_err());
        assert!(upsert(&[0; 5], e(1, 0, 0), 0).is_err());
        assert_eq!(decode_bucket(&[]).unwrap(), vec![]);
    }

    #[test]
    fn key_load_counts_each_key_once_in_the_window_of_its_last_request() {
        let mut l = KeyLoad::default();
        l.seen(None, 2, 10);
        l.seen(None, 2, 10);
        l.seen(None, 0, 11);
        assert_eq!((l.get(2, 10), l.get(2, 11), l.get(2, 12), l.get(0, 11), l.get(1, 11)), (2, 2, 0, 1, 0));
        assert_eq!(KeyLoad::decode(&l.encode()), l);
        // One of slot 2's keys is seen again a window later: still one key, now counted
        // until window 12; the other ends with window 11.
        l.seen(Some((2, 10)), 2, 11);
        assert_eq!((l.get(2, 11), l.get(2, 12), l.get(2, 13)), (2, 1, 0));
        // A key moves from slot 0 to 1; one whose window has passed adds only.
        l.seen(Some((0, 11)), 1, 11);
        l.seen(Some((2, 9)), 1, 11);
        assert_eq!((l.get(0, 11), l.get(1, 11), l.get(2, 11)), (0, 2, 2));
        l.seen(None, crate::slots::MAX_SLOTS, 11);
        assert_eq!(l.0.len(), 3);
        assert_eq!(key_epoch(125_000, 60_000), 2);
        assert_eq!(key_epoch(5, 0), 5, "a zero window is taken as 1 ms, never a division by zero");
    }

    #[test]
    fn key_hashes_differ_from_the_key_bytes_and_spread_over_buckets() {
        let buckets: std::collections::BTreeSet<u32> =
            (0..1000).map(|i| key_bucket_of(key_hash(format!("agent-{i}").as_bytes()))).collect();
        assert_eq!(buckets.len(), KEY_BUCKETS as usize);
        assert_ne!(key_hash(b"a"), key_hash(b"b"));
    }
}
