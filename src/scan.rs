//! `cache_hits` over one segment bucket: for each candidate worker, how many leading
//! blocks of the request it holds, how many of those only in an offload tier, and how many
//! leading blocks it already has in flight (the request's blocks it carries as load).
//!
//! The request's blocks are looked up in hash order, not position order: both parts of a
//! bucket are sorted by hash, so each lookup gallops forward from the previous one over
//! memory already in cache, instead of a binary search from scratch per block. The
//! per-block holder sets, kept as bitmasks over the (at most 64) candidates still in the
//! running, are then replayed in position order to find where each candidate drops out.
//! A short segment is looked up in position order, a binary search per block (sorting it
//! would cost more than the gallop saves), into the same bitmasks. With more than 64
//! candidates, the per-block path over whole slot sets is used.

use crate::layout::{gallop, le_u64, lower_bound, Bucket, FLY_ENTRY};
use crate::slots::{SlotSet, MAX_SLOTS};

/// Below this many blocks sorting them costs more than the binary searches it saves.
const SORTED_SCAN_MIN_BLOCKS: usize = 64;

/// What the scan of a request's segments has found so far, per slot (indexed by slot).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scan {
    /// Slots that held every block so far: in the index, and (with `with_fly`) in flight
    /// or predicted.
    pub holding: SlotSet,
    /// Slots with every block so far in flight (a stream holds it there: `refs > 0`).
    pub carrying: SlotSet,
    /// Slots with every block so far in the index (tracked with `carrying`).
    pub indexed: SlotSet,
    /// `cache_hits`: set when a slot stops holding (its first miss).
    pub hits: Vec<u32>,
    /// Of the leading blocks held, those held only in an offload tier.
    pub offloaded: Vec<u32>,
    /// Leading blocks in flight: set when a slot stops carrying.
    pub in_flight: Vec<u32>,
    /// Leading blocks in the index, for the slots in `carrying` at the start.
    pub in_index: Vec<u32>,
}

impl Scan {
    /// A scan over a table of `n_slots`, looking for hits on `holding`, and in-flight and
    /// indexed blocks on `carrying`.
    pub fn new(n_slots: usize, holding: SlotSet, carrying: SlotSet) -> Scan {
        let n = n_slots.min(MAX_SLOTS);
        let zeros = vec![0; n];
        Scan {
            holding,
            carrying,
            indexed: carrying,
            hits: zeros.clone(),
            offloaded: zeros.clone(),
            in_flight: zeros.clone(),
            in_index: zeros,
        }
    }

    /// No slot is left in the running: later segments cannot change anything.
    pub fn is_done(&self) -> bool {
        self.holding.is_empty() && self.carrying.is_empty() && self.indexed.is_empty()
    }

    /// Of the request's blocks `slot` has in flight, those not yet in its index: blocks
    /// another request is still computing there.
    pub fn computing(&self, slot: usize) -> u32 {
        let of = |v: &[u32]| v.get(slot).copied().unwrap_or(0);
        of(&self.in_flight).saturating_sub(of(&self.in_index))
    }

    /// Ends a scan of a `len`-block request: slots still in the running hold (carry) all.
    pub fn finish(&mut self, len: usize) {
        for (running, counts) in [
            (&self.holding, &mut self.hits),
            (&self.carrying, &mut self.in_flight),
            (&self.indexed, &mut self.in_index),
        ] {
            for slot in running.iter() {
                set_at(counts, slot, len);
            }
        }
    }
}

fn set_at(v: &mut [u32], slot: usize, pos: usize) {
    if let Some(x) = v.get_mut(slot) {
        *x = pos as u32;
    }
}

/// Scans one segment: `hashes` are its blocks, the first at position `start` of the
/// request, updating `scan` (whose running sets hold the slots that held, or carried,
/// every block before `start`). `with_fly`: count in-flight and predicted entries as held
/// (in GPU memory).
pub fn scan_segment(bucket: &Bucket<'_>, hashes: &[u64], start: usize, now_ms: u64, with_fly: bool, scan: &mut Scan) {
    let mut candidates: Vec<usize> = scan.holding.iter().collect();
    candidates.extend(scan.carrying.union(&scan.indexed).difference(&scan.holding).iter());
    if candidates.len() > 64 {
        return scan_by_position(bucket, hashes, start, now_ms, with_fly, scan);
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
    let bits_of = |set: &SlotSet| set.iter().fold(0u64, |m, s| m | compact(s));

    let mut order: Vec<u32> = (0..hashes.len() as u32).collect();
    let sorted = hashes.len() >= SORTED_SCAN_MIN_BLOCKS;
    if sorted {
        order.sort_unstable_by_key(|&i| hashes[i as usize]);
    }
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
    let mut in_index = vec![0u64; hashes.len()];
    let mut flying = vec![0u64; hashes.len()];
    // Offloaded-only holders per block, in tiered buckets only.
    let mut off_held = if bucket.is_tiered() { vec![0u64; hashes.len()] } else { Vec::new() };
    let index = bucket.index_part();
    let stride = index.stride();
    let (n_idx, idx) = (index.n, index.raw);
    let (n_fly, fly) = bucket.fly_raw();
    let (mut i_idx, mut i_fly) = (0usize, 0usize);
    let look_at_fly = with_fly || !scan.carrying.is_empty();
    for &i in &order {
        let hash = hashes[i as usize];
        let mut bits = 0u64;
        let mut idx_bits = 0u64;
        let mut off_bits = 0u64;
        let mut fly_bits = 0u64;
        let idx_before = |k: usize| le_u64(&idx[k * stride..]) < hash;
        i_idx = if sorted { gallop(i_idx, n_idx, idx_before) } else { lower_bound(0, n_idx, idx_before) };
        if i_idx < n_idx && le_u64(&idx[i_idx * stride..]) == hash {
            let (mask, off) = bucket.masks_at(i_idx);
            idx_bits = compact_mask(mask);
            if let Some(off) = off {
                off_bits = compact_mask(off);
            }
        }
        if look_at_fly {
            let fly_before = |k: usize| le_u64(&fly[k * FLY_ENTRY..]) < hash;
            i_fly = if sorted { gallop(i_fly, n_fly, fly_before) } else { lower_bound(0, n_fly, fly_before) };
        }
        let mut k = if look_at_fly { i_fly } else { n_fly };
        while k < n_fly {
            let e = &fly[k * FLY_ENTRY..(k + 1) * FLY_ENTRY];
            if le_u64(e) != hash {
                break;
            }
            if le_u64(&e[12..]) > now_ms {
                let bit = compact(usize::from(u16::from_le_bytes([e[8], e[9]])));
                if with_fly {
                    bits |= bit;
                    off_bits &= !bit; // routed there: being loaded into its GPU
                }
                if u16::from_le_bytes([e[10], e[11]]) > 0 {
                    fly_bits |= bit;
                }
            }
            k += 1;
        }
        in_index[i as usize] = idx_bits;
        held[i as usize] = bits | idx_bits;
        flying[i as usize] = fly_bits;
        if let Some(o) = off_held.get_mut(i as usize) {
            *o = off_bits;
        }
    }

    // Keeps the bits of `running` set in `bits`; a slot whose bit drops out gets `pos`.
    let narrow = |running: &mut u64, bits: u64, out: &mut [u32], pos: usize| {
        let mut dropped = *running & !bits;
        while dropped != 0 {
            set_at(out, candidates[dropped.trailing_zeros() as usize], pos);
            dropped &= dropped - 1;
        }
        *running &= bits;
    };
    let mut running = bits_of(&scan.holding);
    let mut carrying = bits_of(&scan.carrying);
    let mut indexed = bits_of(&scan.indexed);
    for offset in 0..hashes.len() {
        let pos = start + offset;
        narrow(&mut running, held[offset], &mut scan.hits, pos);
        let mut off = running & off_held.get(offset).copied().unwrap_or(0);
        while off != 0 {
            if let Some(o) = scan.offloaded.get_mut(candidates[off.trailing_zeros() as usize]) {
                *o += 1;
            }
            off &= off - 1;
        }
        narrow(&mut carrying, flying[offset], &mut scan.in_flight, pos);
        narrow(&mut indexed, in_index[offset], &mut scan.in_index, pos);
        if running == 0 && carrying == 0 && indexed == 0 {
            break;
        }
    }
    let set_of = |bits: u64| {
        let mut set = SlotSet::EMPTY;
        for (b, &slot) in candidates.iter().enumerate() {
            if bits & (1 << b) != 0 {
                set.insert(slot);
            }
        }
        set
    };
    scan.holding = set_of(running);
    scan.carrying = set_of(carrying);
    scan.indexed = set_of(indexed);
}

/// The plain path: one lookup per block, in position order: one search of the index and
/// one of the in-flight entries, whatever is tracked.
fn scan_by_position(bucket: &Bucket<'_>, hashes: &[u64], start: usize, now_ms: u64, with_fly: bool, scan: &mut Scan) {
    for (offset, &hash) in hashes.iter().enumerate() {
        let pos = start + offset;
        let among = scan.holding.union(&scan.carrying).union(&scan.indexed);
        let in_index = bucket.holders(hash, now_ms, false, &among);
        let (live, flying) = bucket.fly_holders_and_in_flight(hash, now_ms, &among);
        let held = if with_fly { in_index.union(&live) } else { in_index };
        let narrow = |running: &mut SlotSet, still: SlotSet, out: &mut [u32]| {
            let still = running.intersection(&still);
            // Most blocks drop no slot: skip the walk over an empty set.
            let dropped = running.difference(&still);
            if !dropped.is_empty() {
                for slot in dropped.iter() {
                    set_at(out, slot, pos);
                }
            }
            *running = still;
        };
        narrow(&mut scan.holding, held, &mut scan.hits);
        if bucket.is_tiered() && !scan.holding.is_empty() {
            for slot in bucket.offloaded_only(hash, now_ms, with_fly, &scan.holding).iter() {
                if let Some(o) = scan.offloaded.get_mut(slot) {
                    *o += 1;
                }
            }
        }
        narrow(&mut scan.carrying, flying, &mut scan.in_flight);
        narrow(&mut scan.indexed, in_index, &mut scan.in_index);
        if scan.is_done() {
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
        general_bucket_bytes(n, mw, idx, |_| vec![], fly, |_| vec![])
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
        general_bucket_bytes(n, mw, idx, off, fly, |_| vec![])
    }

    /// As [`tiered_bucket_bytes`], with `predicted(p)`: slots where block `p` is a
    /// prediction (released, `refs` 0) rather than in flight.
    fn general_bucket_bytes(
        n: usize,
        mw: usize,
        idx: impl Fn(usize) -> Vec<usize>,
        off: impl Fn(usize) -> Vec<usize>,
        fly: impl Fn(usize) -> Vec<u16>,
        predicted: impl Fn(usize) -> Vec<u16>,
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
        let entry = |p: usize, slot: u16, refs: u16| FlyEntry { hash: hash(p), slot, refs, until_ms: 100 };
        let mut f: Vec<FlyEntry> = (0..n)
            .flat_map(|p| {
                let live = fly(p).into_iter().map(move |s| entry(p, s, 1));
                live.chain(predicted(p).into_iter().map(move |s| entry(p, s, 0)))
            })
            .collect();
        f.sort_by_key(|e| (e.hash, e.slot));
        encode_bucket(IndexPart { mask_words: mw, tiered, n: rows.len(), raw: &raw }, f.len(), &fly_raw_of(&f), 0)
    }

    fn hashes(n: usize) -> Vec<u64> {
        (0..n).map(|p| (p as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect()
    }

    fn set(slots: &[usize]) -> SlotSet {
        let mut set = SlotSet::EMPTY;
        for &s in slots {
            set.insert(s);
        }
        set
    }

    /// Scans `n` blocks starting at position `start` at time 50, looking for hits on
    /// `holding` and in-flight blocks on `carrying`; `u32::MAX` marks a count not set.
    fn scan_of(bytes: &[u8], n: usize, start: usize, holding: &[usize], carrying: &[usize], with_fly: bool) -> Scan {
        let b = Bucket::parse(bytes).unwrap();
        let mut scan = Scan::new(MAX_SLOTS, set(holding), set(carrying));
        scan.hits.fill(u32::MAX);
        scan.in_flight.fill(u32::MAX);
        scan.in_index.fill(u32::MAX);
        scan_segment(&b, &hashes(n), start, 50, with_fly, &mut scan);
        scan
    }

    /// Scans for hits only: the slots still alive, `hits` and `offloaded` per slot.
    fn scan(
        bytes: &[u8],
        n: usize,
        start: usize,
        alive_slots: &[usize],
        with_fly: bool,
    ) -> (Vec<usize>, Vec<u32>, Vec<u32>) {
        let scan = scan_of(bytes, n, start, alive_slots, &[], with_fly);
        assert!(scan.in_flight.iter().all(|&v| v == u32::MAX));
        (scan.holding.iter().collect(), scan.hits, scan.offloaded)
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
    fn every_path_agrees() {
        // 100 candidates force the per-position path over slot sets; compare with the
        // bitmask paths (sorted at 90 blocks, in position order at 40 and 20) on the same
        // data through subsets of at most 64: hits, blocks in flight, blocks in the index.
        let holds = |p: usize| (0..100).filter(|s| p < (s * 7) % 90).collect::<Vec<usize>>();
        let flies = |p: usize| (0..100u16).filter(|s| p < (usize::from(*s) * 11) % 95).collect::<Vec<u16>>();
        let predicted = |p: usize| if p < 30 { vec![99] } else { vec![] };
        let bytes = general_bucket_bytes(90, 2, holds, |_| vec![], flies, predicted);
        let all: Vec<usize> = (0..100).collect();
        for n in [90, 40, 20] {
            let big = scan_of(&bytes, n, 32, &all, &all, true);
            for chunk in all.chunks(50) {
                let small = scan_of(&bytes, n, 32, chunk, chunk, true);
                for &s in chunk {
                    let what = format!("slot {s}, {n} blocks");
                    assert_eq!(small.holding.contains(s), big.holding.contains(s), "{what}");
                    assert_eq!(small.carrying.contains(s), big.carrying.contains(s), "{what}");
                    assert_eq!(small.indexed.contains(s), big.indexed.contains(s), "{what}");
                    assert_eq!(
                        (small.hits[s], small.in_flight[s], small.in_index[s]),
                        (big.hits[s], big.in_flight[s], big.in_index[s]),
                        "{what}"
                    );
                }
            }
        }
    }

    #[test]
    fn leading_blocks_in_flight_per_slot() {
        // Slot 0 holds all 80 blocks in the index, in flight on none; slot 1 has 0..50 in
        // flight; slot 2 has 0..20 in flight and 20..80 only predicted; slot 3 is in flight
        // on everything. A prediction is a hit (with predict-on-route) but not load.
        let bytes = general_bucket_bytes(
            80,
            1,
            |_| vec![0],
            |_| vec![],
            |p| {
                let mut v = vec![3];
                if p < 50 {
                    v.push(1);
                }
                if p < 20 {
                    v.push(2);
                }
                v
            },
            |p| if p >= 20 { vec![2] } else { vec![] },
        );
        for n in [80, 40] {
            // 80 blocks: the sorted path; 40: the per-position path.
            let s = scan_of(&bytes, n, 32, &[0, 1, 2, 3], &[0, 1, 2, 3], true);
            let full = 32 + n as u32;
            assert_eq!(s.carrying.iter().collect::<Vec<_>>(), if n == 80 { vec![3] } else { vec![1, 3] }, "n {n}");
            assert_eq!((s.in_flight[0], s.in_flight[2]), (32, 32 + 20), "n {n}");
            if n == 80 {
                assert_eq!(s.in_flight[1], 32 + 50);
            }
            let holding = if n == 80 { vec![0, 2, 3] } else { vec![0, 1, 2, 3] };
            assert_eq!(s.holding.iter().collect::<Vec<_>>(), holding, "n {n}");
            assert_eq!(s.hits[1], if n == 80 { 32 + 50 } else { u32::MAX });
            // Only slot 0 has the blocks in its index: what the others have in flight is still
            // being computed.
            assert_eq!((s.in_index[1], s.in_index[3]), (32, 32));
            let mut s = s;
            s.finish(full as usize);
            assert_eq!((s.in_flight[3], s.hits[0], s.hits[2], s.in_index[0]), (full, full, full, full));
            assert_eq!((s.computing(0), s.computing(2), s.computing(3)), (0, 20, n as u32));
            // Without predict-on-route in-flight blocks are not hits, and are still load;
            // a slot scanned only for load is not given hits.
            let s = scan_of(&bytes, n, 32, &[0], &[1, 2, 3], false);
            assert_eq!(s.holding.iter().collect::<Vec<_>>(), vec![0]);
            assert_eq!((s.hits[1], s.hits[3], s.in_flight[2]), (u32::MAX, u32::MAX, 32 + 20));
            assert!(s.carrying.contains(3));
        }
    }
}
