//! `cache_hits` over one segment bucket: for each candidate worker, how many leading
//! blocks of the request it holds, and how many of those only in an offload tier.
//!
//! The request's blocks are looked up in hash order, not position order: both parts of a
//! bucket are sorted by hash, so each lookup gallops forward from the previous one over
//! memory already in cache, instead of a binary search from scratch per block. The
//! per-block holder sets, kept as bitmasks over the (at most 64) candidates still in the
//! running, are then replayed in position order to find where each candidate drops out.
//! With more than 64 candidates, or a short segment, the per-block binary-search path is
//! used.

use crate::layout::{le_u64, Bucket, FLY_ENTRY};
use crate::slots::{SlotSet, MAX_SLOTS};

/// Below this many blocks the sorted scan's setup costs more than the binary searches it
/// saves.
const SORTED_SCAN_MIN_BLOCKS: usize = 64;

/// Scans one segment: `hashes` are its blocks, the first at position `start` of the
/// request. `alive` holds the slots that held every block before `start`; on return, those
/// that also hold every block of this segment. `hits[slot]` is set for every slot that
/// drops out (to the position of its first miss). `offloaded[slot]` is increased by the
/// blocks of this segment within the slot's leading run that it holds only offloaded.
/// `with_fly`: count in-flight and predicted entries as held (in GPU memory).
#[allow(clippy::too_many_arguments)]
pub fn scan_segment(
    bucket: &Bucket<'_>,
    hashes: &[u64],
    start: usize,
    now_ms: u64,
    with_fly: bool,
    alive: &mut SlotSet,
    hits: &mut [u32],
    offloaded: &mut [u32],
) {
    let candidates: Vec<usize> = alive.iter().collect();
    if candidates.len() > 64 || hashes.len() < SORTED_SCAN_MIN_BLOCKS {
        return scan_by_position(bucket, hashes, start, now_ms, with_fly, alive, hits, offloaded);
    }
    // slot → bit among the candidates.
    let mut bit_of = [u8::MAX; MAX_SLOTS];
    for (bit, &slot) in candidates.iter().enumerate() {
        bit_of[slot] = bit as u8;
    }
    let compact = |slot: usize| -> u64 {
        match bit_of.get(slot) {
            Some(&b) if b != u8::MAX => 1 << b,
            _ => 0,
        }
    };

    let mut order: Vec<u32> = (0..hashes.len() as u32).collect();
    order.sort_unstable_by_key(|&i| hashes[i as usize]);
    let compact_mask = |mask: &[u8]| -> u64 {
        let mut bits = 0u64;
        for (w, word) in mask.chunks_exact(8).enumerate() {
            let mut word = le_u64(word);
            while word != 0 {
                bits |= compact(w * 64 + word.trailing_zeros() as usize);
                word &= word - 1;
            }
        }
        bits
    };

    let mut held = vec![0u64; hashes.len()];
    // Offloaded-only holders per block, in tiered buckets only.
    let mut off_held = if bucket.is_tiered() { vec![0u64; hashes.len()] } else { Vec::new() };
    let index = bucket.index_part();
    let stride = index.stride();
    let (n_idx, idx) = (index.n, index.raw);
    let (n_fly, fly) = bucket.fly_raw();
    let (mut i_idx, mut i_fly) = (0usize, 0usize);
    for &i in &order {
        let hash = hashes[i as usize];
        let mut bits = 0u64;
        let mut off_bits = 0u64;
        i_idx = gallop(i_idx, n_idx, |k| le_u64(&idx[k * stride..]) < hash);
        if i_idx < n_idx && le_u64(&idx[i_idx * stride..]) == hash {
            let (mask, off) = bucket.masks_at(i_idx);
            bits = compact_mask(mask);
            if let Some(off) = off {
                off_bits = compact_mask(off);
            }
        }
        if with_fly {
            i_fly = gallop(i_fly, n_fly, |k| le_u64(&fly[k * FLY_ENTRY..]) < hash);
            let mut k = i_fly;
            while k < n_fly {
                let e = &fly[k * FLY_ENTRY..(k + 1) * FLY_ENTRY];
                if le_u64(e) != hash {
                    break;
                }
                if le_u64(&e[12..]) > now_ms {
                    let bit = compact(usize::from(u16::from_le_bytes([e[8], e[9]])));
                    bits |= bit;
                    off_bits &= !bit; // routed there: being loaded into its GPU
                }
                k += 1;
            }
        }
        held[i as usize] = bits;
        if let Some(o) = off_held.get_mut(i as usize) {
            *o = off_bits;
        }
    }

    let mut running = if candidates.len() == 64 { u64::MAX } else { (1u64 << candidates.len()) - 1 };
    for (offset, &bits) in held.iter().enumerate() {
        let still = running & bits;
        let mut dropped = running & !still;
        while dropped != 0 {
            let b = dropped.trailing_zeros() as usize;
            if let Some(h) = hits.get_mut(candidates[b]) {
                *h = (start + offset) as u32;
            }
            dropped &= dropped - 1;
        }
        let mut off = still & off_held.get(offset).copied().unwrap_or(0);
        while off != 0 {
            let b = off.trailing_zeros() as usize;
            if let Some(o) = offloaded.get_mut(candidates[b]) {
                *o += 1;
            }
            off &= off - 1;
        }
        running = still;
        if running == 0 {
            break;
        }
    }
    *alive = SlotSet::EMPTY;
    for (b, &slot) in candidates.iter().enumerate() {
        if running & (1 << b) != 0 {
            alive.insert(slot);
        }
    }
}

/// First index in `from..n` where `before(index)` is false, for a `before` that is true on
/// a prefix: gallops forward, then bisects.
fn gallop(from: usize, n: usize, before: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (from, from);
    let mut step = 1;
    while hi < n && before(hi) {
        lo = hi + 1;
        hi = (hi + step).min(n);
        step *= 2;
    }
    while lo < hi {
        let mid = (lo + hi) / 2;
        if before(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The plain path: one lookup per block, in position order.
#[allow(clippy::too_many_arguments)]
fn scan_by_position(
    bucket: &Bucket<'_>,
    hashes: &[u64],
    start: usize,
    now_ms: u64,
    with_fly: bool,
    alive: &mut SlotSet,
    hits: &mut [u32],
    offloaded: &mut [u32],
) {
    for (offset, &hash) in hashes.iter().enumerate() {
        let still = bucket.holders(hash, now_ms, with_fly, alive);
        if bucket.is_tiered() {
            for slot in bucket.offloaded_only(hash, now_ms, with_fly, &still).iter() {
                if let Some(o) = offloaded.get_mut(slot) {
                    *o += 1;
                }
            }
        }
        if still != *alive {
            for slot in alive.difference(&still).iter() {
                if let Some(h) = hits.get_mut(slot) {
                    *h = (start + offset) as u32;
                }
            }
            *alive = still;
        }
        if alive.is_empty() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{encode_bucket, fly_raw_of, FlyEntry, IndexPart};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// A bucket where block `p` (hash `1000 + p`) is held in the index by the slots
    /// `idx(p)` and in flight on `fly(p)`.
    fn bucket_bytes(
        n: usize,
        mw: usize,
        idx: impl Fn(usize) -> Vec<usize>,
        fly: impl Fn(usize) -> Vec<u16>,
    ) -> Vec<u8> {
        tiered_bucket_bytes(n, mw, idx, |_| vec![], fly)
    }

    /// As [`bucket_bytes`], with `off(p)`: the index holders of block `p` that hold it only
    /// offloaded (a tiered bucket when any).
    fn tiered_bucket_bytes(
        n: usize,
        mw: usize,
        idx: impl Fn(usize) -> Vec<usize>,
        off: impl Fn(usize) -> Vec<usize>,
        fly: impl Fn(usize) -> Vec<u16>,
    ) -> Vec<u8> {
        // Hashes out of position order, as real chain hashes are.
        let hash = |p: usize| (p as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mask = |slots: Vec<usize>| {
            let mut m = vec![0u64; mw];
            for s in slots {
                m[s / 64] |= 1 << (s % 64);
            }
            m
        };
        let mut rows: Vec<(u64, Vec<u64>, Vec<u64>)> = (0..n)
            .map(|p| (hash(p), mask(idx(p)), mask(off(p))))
            .filter(|(_, m, _)| m.iter().any(|w| *w != 0))
            .collect();
        rows.sort();
        let tiered = rows.iter().any(|(_, _, o)| o.iter().any(|w| *w != 0));
        let raw: Vec<u8> = rows
            .iter()
            .flat_map(|(h, m, o)| {
                let words = m.iter().chain(if tiered { o.iter() } else { [].iter() });
                h.to_le_bytes().into_iter().chain(words.flat_map(|w| w.to_le_bytes()))
            })
            .collect();
        let mut f: Vec<FlyEntry> = (0..n)
            .flat_map(|p| fly(p).into_iter().map(move |s| FlyEntry { hash: hash(p), slot: s, refs: 1, until_ms: 100 }))
            .collect();
        f.sort_by_key(|e| (e.hash, e.slot));
        encode_bucket(IndexPart { mask_words: mw, tiered, n: rows.len(), raw: &raw }, f.len(), &fly_raw_of(&f), 0)
    }

    fn hashes(n: usize) -> Vec<u64> {
        (0..n).map(|p| (p as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect()
    }

    /// Scans `n` blocks starting at position `start` at time 50: the slots still alive,
    /// `hits` and `offloaded` per slot.
    fn scan(
        bytes: &[u8],
        n: usize,
        start: usize,
        alive_slots: &[usize],
        with_fly: bool,
    ) -> (Vec<usize>, Vec<u32>, Vec<u32>) {
        let b = Bucket::parse(bytes).unwrap();
        let mut alive = SlotSet::EMPTY;
        for &s in alive_slots {
            alive.insert(s);
        }
        let mut hits = vec![u32::MAX; MAX_SLOTS];
        let mut off = vec![0; MAX_SLOTS];
        scan_segment(&b, &hashes(n), start, 50, with_fly, &mut alive, &mut hits, &mut off);
        (alive.iter().collect(), hits, off)
    }

    fn run(bytes: &[u8], n: usize, alive_slots: &[usize], with_fly: bool) -> (Vec<usize>, Vec<u32>) {
        let (alive, hits, _) = scan(bytes, n, 32, alive_slots, with_fly);
        (alive, hits)
    }

    #[test]
    fn offloaded_blocks_counted_within_the_leading_run() {
        // Slot 0: all 80 blocks, 0..40 offloaded only. Slot 1: blocks 0..10, then a miss,
        // 20..30 offloaded (after its run: not counted). Slot 2: all, offloaded, but in
        // flight there on 0..5 (being loaded: not offloaded-only).
        let idx = |p: usize| {
            let mut v = vec![0, 2];
            if p < 10 || (20..30).contains(&p) {
                v.push(1);
            }
            v
        };
        let off = |p: usize| {
            let mut v = vec![2];
            if p < 40 {
                v.push(0);
            }
            if (20..30).contains(&p) {
                v.push(1);
            }
            v
        };
        let bytes = tiered_bucket_bytes(80, 1, idx, off, |p| if p < 5 { vec![2] } else { vec![] });
        for n in [80, 30] {
            // 80 blocks: the sorted path; 30: the per-position path.
            let (_, _, o) = scan(&bytes, n, 0, &[0, 1, 2], true);
            assert_eq!((o[0], o[1], o[2]), (40.min(n as u32), 0, n as u32 - 5), "n = {n}");
        }
    }

    #[test]
    fn leading_blocks_per_slot() {
        // Slot 0 holds all 80 blocks; slot 1 the first 10; slot 2 none; slot 3 blocks 0..20
        // except 5 (a hole: only 5 lead); slot 4 all, but in flight only.
        let bytes = bucket_bytes(
            80,
            1,
            |p| {
                let mut v = vec![0];
                if p < 10 {
                    v.push(1);
                }
                if p < 20 && p != 5 {
                    v.push(3);
                }
                v
            },
            |_| vec![4],
        );
        let (alive, hits) = run(&bytes, 80, &[0, 1, 2, 3, 4], true);
        assert_eq!(alive, vec![0, 4]);
        assert_eq!((hits[1], hits[2], hits[3]), (32 + 10, 32, 32 + 5));
        let (alive, _) = run(&bytes, 80, &[0, 1, 2, 3, 4], false);
        assert_eq!(alive, vec![0], "in-flight entries ignored without predict-on-route");
        // The same on a short segment (the per-position path).
        let (alive, hits_short) = run(&bytes, 30, &[0, 1, 2, 3, 4], true);
        assert_eq!(alive, vec![0, 4]);
        assert_eq!((hits_short[1], hits_short[2], hits_short[3]), (32 + 10, 32, 32 + 5));
        // Slots not alive on entry are never looked at.
        let (alive, hits) = run(&bytes, 80, &[1], true);
        assert_eq!((alive, hits[0], hits[1]), (vec![], u32::MAX, 32 + 10));
    }

    #[test]
    fn both_paths_agree() {
        // 100 candidates forces the per-position path; compare with the sorted path on
        // the same data through subsets of at most 64.
        let holds = |p: usize| (0..100).filter(|s| p < (s * 7) % 90).collect::<Vec<usize>>();
        let bytes = bucket_bytes(90, 2, holds, |p| if p < 30 { vec![99] } else { vec![] });
        let all: Vec<usize> = (0..100).collect();
        let (alive_big, hits_big) = run(&bytes, 90, &all, true);
        for chunk in all.chunks(50) {
            let (alive, hits) = run(&bytes, 90, chunk, true);
            for &s in chunk {
                assert_eq!(alive.contains(&s), alive_big.contains(&s), "slot {s}");
                if !alive.contains(&s) {
                    assert_eq!(hits[s], hits_big[s], "slot {s}");
                }
            }
        }
    }
}
