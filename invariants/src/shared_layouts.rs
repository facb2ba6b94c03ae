//! The shared-data layouts the filter reads ([`kvroute::layout`]): the worker table, the
//! load vector and the buckets, as another VM, the sync service or a corrupted write may
//! have left them.
//!
//! Input: a selector byte (the request's length in blocks, 1–4; bit 2: the request carries
//! a cache key; bit 3: the filter adds other gateways' load), `u16` length + table bytes,
//! `u16` length + load-vector bytes (also stored as the cached-block counts, which are read
//! on a tie, as the cache keys' counts, and as the other gateways' load),
//! then one bucket value (stored under every bucket key the request's blocks map to, and
//! as the cache key's bucket, or without a key as the implicit keys' anchors).
//! - each layout that decodes encodes back to itself;
//! - the router, reading them, names only workers the table has *up*, each once; counts
//!   no more hits than the request has blocks; and every bucket and load vector it writes
//!   back decodes again, before and after the request is released; a cache key's bucket
//!   that decoded holds at most its limit of entries after the write, the key's among them
//!   on a worker that is up; anchors that decoded still decode after the write.

use kvroute::cachekey::{
    self, key_bucket_key, key_bucket_of, key_hash, KeyLoad, ANCHORS_KEY, KEYLOAD_KEY, MAX_KEYS_PER_BUCKET,
};
use kvroute::config::FilterConfig;
use kvroute::feed::FeedBlock;
use kvroute::hash::BASE_NAMESPACE;
use kvroute::layout::{
    bucket_key, bucket_of, encode_bucket, Bucket, CachedBlocks, LoadVector, SlotState, WorkerTable, CACHED_KEY,
    LOAD_KEY, LOAD_RECORD, TABLE_KEY,
};
use kvroute::peerload::{PeerLoad, PEERLOAD_KEY};
use kvroute::router::{Router, TokenSource};
use kvroute::slots::MAX_SLOTS;
use kvroute::store::{MemStore, SharedStore};
use kvroute::tokens::TokenEncoding;
use std::collections::BTreeSet;

pub fn check(data: &[u8]) {
    let (sel, rest) = crate::selector(data);
    let (table_bytes, rest) = section(rest);
    let (load_bytes, bucket_bytes) = section(rest);

    let table = WorkerTable::decode(table_bytes).ok();
    if let Some(t) = &table {
        assert_eq!(WorkerTable::decode(&t.encode()).as_ref(), Ok(t), "table does not round-trip");
    }
    let load = LoadVector::decode(load_bytes);
    let whole = (load_bytes.len() / LOAD_RECORD).min(MAX_SLOTS) * LOAD_RECORD;
    assert_eq!(load.encode(), load_bytes[..whole], "load vector does not round-trip");
    if let Ok(c) = CachedBlocks::decode(load_bytes) {
        assert_eq!(c.encode(), load_bytes, "cached-block counts do not round-trip");
    }
    let bucket = Bucket::parse(bucket_bytes).ok();
    if let Some(b) = &bucket {
        let (n_fly, fly) = b.fly_raw();
        let again = encode_bucket(b.index_part(), n_fly, fly, b.sweep_at_ms());
        if b.n_idx() + b.n_fly() == 0 {
            assert!(again.is_empty(), "an empty bucket encodes to the empty value");
        } else {
            assert_eq!(again, bucket_bytes, "bucket does not round-trip");
        }
    }

    let peers = PeerLoad::decode(load_bytes);
    let whole = (load_bytes.len() / 8).min(MAX_SLOTS) * 8;
    assert_eq!(peers.encode(), load_bytes[..whole], "other gateways' load does not round-trip");
    let json: &[u8] = if sel & 8 != 0 { br#"{"peer_load": true}"# } else { b"{}" };
    let cfg = FilterConfig::from_json(json).unwrap_or_else(|e| panic!("config: {e}"));
    let blocks = usize::from(sel % 4) + 1;
    let tokens: Vec<u32> = (0..(blocks * cfg.block_size) as u32).collect();
    let header = tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let store = MemStore::new();
    let put = |key: &str, value: &[u8]| store.set(key, value, None).unwrap_or_else(|e| panic!("{e:?}"));
    put(TABLE_KEY, table_bytes);
    put(LOAD_KEY, load_bytes);
    put(CACHED_KEY, load_bytes);
    put(PEERLOAD_KEY, load_bytes);
    let mut keys = BTreeSet::new();
    if let Some(t) = &table {
        // A table's bucket count is any power of two; only the request's keys are stored.
        for b in FeedBlock::chain(&tokens, cfg.block_size) {
            keys.insert(bucket_key(bucket_of(b.anchor, t.n_buckets)));
        }
    }
    for k in &keys {
        put(k, bucket_bytes);
    }
    let cache_key = (sel & 4 != 0).then(|| key_hash(b"fuzz"));
    let key_bucket = key_bucket_key(key_bucket_of(key_hash(b"fuzz")));
    if cache_key.is_some() {
        put(&key_bucket, bucket_bytes);
        put(KEYLOAD_KEY, load_bytes);
    } else {
        put(ANCHORS_KEY, bucket_bytes);
    }

    let mut router = Router::new(cfg);
    let source =
        TokenSource::Header { value: header.as_bytes(), encoding: TokenEncoding::Decimal, namespace: BASE_NAMESPACE };
    let now_ms = 1_000_000 + u64::from(sel) * 7_919;
    let d = router.route_keyed(&store, source, cache_key, now_ms, u64::from(sel));
    let up: BTreeSet<&str> =
        table.iter().flat_map(|t| &t.slots).filter(|s| s.state == SlotState::Up).map(|s| s.id.as_str()).collect();
    let named: BTreeSet<&str> = d.destinations.iter().map(String::as_str).collect();
    assert_eq!(named.len(), d.destinations.len(), "a worker named twice: {:?}", d.destinations);
    assert!(named.is_subset(&up), "routed to {:?}, up: {up:?}", d.destinations);
    if let Some(p) = &d.prefiller {
        assert!(up.contains(p.as_str()), "prefill on {p}, up: {up:?}");
    }
    assert!(d.hits <= d.request_blocks && d.offloaded_hits <= d.hits, "{d:?}");
    if let (Some(hash), Some(t)) = (cache_key, &table) {
        let written = store.get(&key_bucket).ok().and_then(|(v, _)| v).unwrap_or_default();
        if cachekey::decode_bucket(bucket_bytes).is_ok() && !d.destinations.is_empty() && d.update_failures == 0 {
            let entries =
                cachekey::decode_bucket(&written).unwrap_or_else(|e| panic!("router wrote a bad key bucket: {e}"));
            assert!(entries.len() <= MAX_KEYS_PER_BUCKET);
            let e = entries.iter().find(|e| e.hash == hash).unwrap_or_else(|| panic!("the key's entry is missing"));
            let slot = t.slots.get(usize::from(e.slot)).unwrap_or_else(|| panic!("key on slot {}", e.slot));
            assert!(up.contains(slot.id.as_str()), "key on {} that is not up", slot.id);
        }
        let counts = store.get(KEYLOAD_KEY).ok().and_then(|(v, _)| v).unwrap_or_default();
        assert_eq!(KeyLoad::decode(&counts).encode(), counts[..(counts.len() / 12).min(MAX_SLOTS) * 12], "key counts");
    }
    if cache_key.is_none() && cachekey::decode_bucket(bucket_bytes).is_ok() {
        let written = store.get(ANCHORS_KEY).ok().and_then(|(v, _)| v).unwrap_or_default();
        let anchors = cachekey::decode_bucket(&written).unwrap_or_else(|e| panic!("router wrote bad anchors: {e}"));
        assert!(anchors.len() <= MAX_KEYS_PER_BUCKET);
    }
    assert_written_layouts_decode(&store, &keys, bucket.is_some());
    router.release(&store, &d.held, now_ms + 5);
    assert_written_layouts_decode(&store, &keys, bucket.is_some());
}

/// `u16` little-endian length, then that many bytes (fewer if the input ends).
fn section(data: &[u8]) -> (&[u8], &[u8]) {
    let len = match data {
        [a, b, ..] => usize::from(u16::from_le_bytes([*a, *b])),
        _ => return (&[], &[]),
    };
    let body = &data[2..];
    body.split_at(len.min(body.len()))
}

/// What the router left in the buckets it read decodes (a bucket that did not decode may
/// be left as it was).
fn assert_written_layouts_decode(store: &MemStore, keys: &BTreeSet<String>, bucket_decoded: bool) {
    for k in keys {
        let Ok((Some(v), _)) = store.get(k) else { continue };
        if bucket_decoded {
            Bucket::parse(&v).unwrap_or_else(|e| panic!("router wrote an undecodable bucket {k}: {e}"));
        }
    }
    if let Ok((Some(v), _)) = store.get(LOAD_KEY) {
        assert_eq!(
            LoadVector::decode(&v).encode(),
            v[..(v.len() / LOAD_RECORD).min(MAX_SLOTS) * LOAD_RECORD],
            "load vector"
        );
    }
}

/// No index entry has a holder, and no in-flight entry a slot, at or beyond `n_slots`.
pub fn assert_holders_within(bucket: &Bucket<'_>, n_slots: usize) {
    for i in 0..bucket.n_idx() {
        let (holders, offloaded) = bucket.masks_at(i);
        for mask in std::iter::once(holders).chain(offloaded) {
            for (byte, &bits) in mask.iter().enumerate() {
                for bit in 0..8 {
                    let slot = byte * 8 + bit;
                    assert!(bits & (1 << bit) == 0 || slot < n_slots, "holder slot {slot} of {n_slots}");
                }
            }
        }
    }
    for e in bucket.fly_entries() {
        assert!(usize::from(e.slot) < n_slots, "in-flight slot {} of {n_slots}", e.slot);
    }
}
