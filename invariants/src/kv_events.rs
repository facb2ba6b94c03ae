//! The KV-event batch decoder ([`kvroute_sidecar::events`]), every wire form, and the
//! index it feeds.
//!
//! Input: a selector byte (bit 0: two DP ranks instead of one; bit 1: a router block size
//! of 8 instead of 16), then one msgpack batch payload as an engine publishes it.
//! - the streaming reader and [`decode_batch`] agree;
//! - a decoded batch re-encoded by an independent msgpack encoder (`rmp`), in vLLM 0.33's
//!   form, decodes to the same events, `ts` and DP rank: nothing read is lost or invented;
//! - applied to a worker's cache, the changes the sidecar would publish, replayed on an
//!   empty set, give exactly the blocks the cache then holds (the feed never disagrees
//!   with the index).

use kvroute_sidecar::cache::{Change, WorkerCache};
use kvroute_sidecar::events::{decode_batch, Batch, BatchReader, Event, ExtraKeys, GroupKind, Medium};
use std::collections::HashMap;

pub fn check(data: &[u8]) {
    let (sel, payload) = crate::selector(data);
    let batch = decode_batch(payload);
    // Debug forms, so that a NaN `ts` (which a hostile publisher may send) compares equal.
    let whole = format!("{:?}", batch.as_ref().map_err(|e| e.message.clone()));
    assert_eq!(format!("{:?}", streamed(payload).as_ref()), whole, "reader and decode_batch");
    let Ok(batch) = batch else { return };

    let again = decode_batch(&encode(&batch)).unwrap_or_else(|e| panic!("re-encoded batch does not decode: {e}"));
    assert_eq!(again.events, batch.events, "events do not round-trip");
    assert_eq!((again.tail.ts.to_bits(), again.tail.dp_rank), (batch.tail.ts.to_bits(), batch.tail.dp_rank));

    let dp_ranks = if sel & 1 == 1 { 2 } else { 1 };
    let router_block_size = if sel & 2 == 2 { 8 } else { 16 };
    let rank = batch.tail.dp_rank.unwrap_or(0) as usize;
    let mut cache = WorkerCache::new(dp_ranks);
    // Router hash → (anchor, held only offloaded), as a feed reader would know it.
    let mut published: HashMap<u64, (u64, bool)> = HashMap::new();
    let mut changes = Vec::new();
    for event in &batch.events {
        changes.clear();
        match event {
            Event::Stored(s) => {
                cache.apply_stored(rank, s, router_block_size, &mut changes);
            }
            Event::Removed(r) => {
                cache.apply_removed(rank, r, &mut changes);
            }
            Event::Cleared => {
                // A clear that leaves the worker empty is published as one CLEAR of it
                // (the sidecar's fleet drops the changes); otherwise as the changes.
                if cache.clear_rank(rank, &mut changes) {
                    changes.clear();
                    published.clear();
                }
            }
        }
        for c in &changes {
            match *c {
                Change::Store(b) => published.insert(b.hash, (b.anchor, false)),
                Change::StoreOffloaded(b) => published.insert(b.hash, (b.anchor, true)),
                Change::Remove(b) => published.remove(&b.hash),
            };
        }
    }
    let held: HashMap<u64, (u64, bool)> = cache.feed_blocks().map(|(b, off)| (b.hash, (b.anchor, off))).collect();
    assert_eq!(published, held, "published changes and the cache disagree");
    assert_eq!(cache.block_count(), held.len());
}

fn streamed(payload: &[u8]) -> Result<Batch, String> {
    let mut reader = BatchReader::new(payload).map_err(|e| e.message)?;
    let mut events = Vec::new();
    while let Some(e) = reader.next_event().map_err(|e| e.message)? {
        events.push(e);
    }
    Ok(Batch { events, tail: reader.finish().map_err(|e| e.message)? })
}

/// `[ts, [event…], dp_rank]` with each event a map tagged `type`, as vLLM ≥ 0.24 sends.
fn encode(batch: &Batch) -> Vec<u8> {
    let mut w = Msgpack::default();
    w.array(3).f64(batch.tail.ts).array(batch.events.len());
    for e in &batch.events {
        match e {
            Event::Stored(s) => {
                w.map(12).str("type").str("BlockStored");
                w.str("block_hashes").uints(s.block_hashes.iter().copied());
                w.str("parent_block_hash").opt_uint(s.parent);
                w.str("token_ids").uints(s.token_ids.iter().map(|&t| u64::from(t)));
                w.str("block_size").uint(u64::from(s.block_size));
                w.str("lora_id");
                match s.lora_id {
                    Some(id) => w.sint(id),
                    None => w.nil(),
                };
                w.str("medium").str(medium(s.medium));
                w.str("lora_name").opt_str(s.lora_name.as_deref());
                w.str("extra_keys").array(s.extra_keys.len());
                for k in &s.extra_keys {
                    match k {
                        ExtraKeys::None => w.nil(),
                        ExtraKeys::Strings(v) => v.iter().fold(w.array(v.len()), |w, s| w.str(s)),
                        // A multimodal `(identifier, offset)` pair.
                        ExtraKeys::Opaque => w.array(2).str("image-0").uint(0),
                    };
                }
                w.str("group_idx").uint(u64::from(s.group_idx));
                let kind = s.group_kind.map(|k| match k {
                    GroupKind::Full => "full_attention",
                    GroupKind::NotFull => "sliding_window",
                    GroupKind::Unknown => "unknown",
                });
                w.str("kv_cache_spec_kind").opt_str(kind);
                w.str("cache_salt").opt_str(s.cache_salt.as_deref());
            }
            Event::Removed(r) => {
                w.map(4).str("type").str("BlockRemoved");
                w.str("block_hashes").uints(r.block_hashes.iter().copied());
                w.str("medium").str(medium(r.medium));
                w.str("group_idx").uint(u64::from(r.group_idx));
            }
            Event::Cleared => {
                w.map(1).str("type").str("AllBlocksCleared");
            }
        }
    }
    w.opt_uint(batch.tail.dp_rank.map(u64::from));
    w.0
}

fn medium(m: Medium) -> &'static str {
    if m == Medium::Gpu {
        "GPU"
    } else {
        "CPU"
    }
}

/// `rmp`'s writers, chained; writing into a `Vec` cannot fail.
#[derive(Default)]
struct Msgpack(Vec<u8>);

impl Msgpack {
    fn array(&mut self, n: usize) -> &mut Self {
        let _ = rmp::encode::write_array_len(&mut self.0, n as u32);
        self
    }
    fn map(&mut self, n: u32) -> &mut Self {
        let _ = rmp::encode::write_map_len(&mut self.0, n);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        let _ = rmp::encode::write_str(&mut self.0, s);
        self
    }
    fn uint(&mut self, v: u64) -> &mut Self {
        let _ = rmp::encode::write_uint(&mut self.0, v);
        self
    }
    fn sint(&mut self, v: i64) -> &mut Self {
        let _ = rmp::encode::write_sint(&mut self.0, v);
        self
    }
    fn f64(&mut self, v: f64) -> &mut Self {
        let _ = rmp::encode::write_f64(&mut self.0, v);
        self
    }
    fn nil(&mut self) -> &mut Self {
        let _ = rmp::encode::write_nil(&mut self.0);
        self
    }
    fn uints(&mut self, v: impl ExactSizeIterator<Item = u64>) -> &mut Self {
        let n = v.len();
        v.fold(self.array(n), |w, x| w.uint(x))
    }
    fn opt_uint(&mut self, v: Option<u64>) -> &mut Self {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }
    fn opt_str(&mut self, v: Option<&str>) -> &mut Self {
        match v {
            Some(v) => self.str(v),
            None => self.nil(),
        }
    }
}
