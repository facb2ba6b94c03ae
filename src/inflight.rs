//! In-flight and predicted blocks: the filter-owned part of a bucket.
//!
//! When a request is routed to worker `w`, each of its blocks gets an in-flight entry
//! `(hash, w)` with a reference count, in the bucket of the block's segment. That one
//! structure serves two purposes:
//!
//! - `active_blocks(w)` = the number of entries on `w` with `refs > 0`: distinct blocks, a
//!   prefix shared by several streams counted once, exact across Envoy's worker threads
//!   because every change goes through compare-and-swap on shared data;
//! - predict-on-route: a live entry counts as a cache hit on `w`, so a burst of requests
//!   with one prefix lands together before the engine's first KV event arrives. After the
//!   last stream releases a block, the entry lives on as a prediction for
//!   `prediction_ttl_ms`, or until the sidecar's index holds it.
//!
//! These functions rewrite the raw in-flight part of one bucket value; the caller
//! (`router`) does the compare-and-swap and applies the returned change to the load.

use crate::layout::{gallop, FlyEntry, FLY_ENTRY};

/// Change of `active_blocks` per slot from one edit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ActiveDelta(pub Vec<(usize, i64)>);

impl ActiveDelta {
    pub fn add(&mut self, slot: usize, d: i64) {
        if d == 0 {
            return;
        }
        match self.0.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, v)) => *v += d,
            None => self.0.push((slot, d)),
        }
    }
    pub fn merge(&mut self, other: &ActiveDelta) {
        for &(s, d) in &other.0 {
            self.add(s, d);
        }
    }
    pub fn is_zero(&self) -> bool {
        self.0.iter().all(|(_, d)| *d == 0)
    }
}

/// What a stream does to its blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// Routed: take a reference; the entry is leased for `lease_ms`.
    Acquire { lease_ms: u64 },
    /// Ended: drop the references; at zero the entry stays a prediction for `linger_ms`
    /// (0: removed at once).
    Release { linger_ms: u64 },
}

/// How often a writer sweeps a whole bucket's in-flight part for dead entries. Between
/// sweeps writers touch only their own entries, so a request's cost does not grow with the
/// number of other blocks in flight in the same bucket.
pub const SWEEP_INTERVAL_MS: u64 = 1_000;

/// Appends the in-flight entries (`n` in `old`, sorted) that are still alive at `now_ms`
/// to `out`, and returns their count and the change of `active_blocks`: an in-flight
/// entry whose lease ran out (a stream that never released, e.g. its VM died) was counted
/// active and counts −1 now. Expired predictions just go.
pub fn sweep(old: &[u8], n: usize, now_ms: u64, out: &mut Vec<u8>) -> (usize, ActiveDelta) {
    let start = out.len();
    out.reserve(old.len());
    let mut delta = ActiveDelta::default();
    for raw in old.chunks_exact(FLY_ENTRY).take(n) {
        let e = FlyEntry::decode(raw);
        if e.live(now_ms) {
            out.extend_from_slice(raw);
        } else if e.refs > 0 {
            delta.add(usize::from(e.slot), -1);
        }
    }
    ((out.len() - start) / FLY_ENTRY, delta)
}

/// One `(block, worker)` entry to change, `count` times (several streams' releases of the
/// same block are applied at once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Key {
    pub hash: u64,
    pub slot: u16,
    pub count: u16,
}

/// The keys of `hashes × slots`, once each, in (hash, slot) order; both inputs sorted.
pub fn keys(hashes: &[u64], slots: &[u16], out: &mut Vec<Key>) {
    out.reserve(hashes.len() * slots.len());
    for &hash in hashes {
        out.extend(slots.iter().map(|&slot| Key { hash, slot, count: 1 }));
    }
}

/// Sorts keys by (hash, slot) and merges duplicates, adding their counts.
pub fn merge_keys(keys: &mut Vec<Key>) {
    keys.sort_unstable_by_key(|k| (k.hash, k.slot));
    keys.dedup_by(|later, kept| {
        let same = (later.hash, later.slot) == (kept.hash, kept.slot);
        if same {
            kept.count = kept.count.saturating_add(later.count);
        }
        same
    });
}

/// Applies `change` to the in-flight entries (`n` in `old`, sorted by (hash, slot)) for
/// every key (sorted by (hash, slot), no duplicates), appending the result to `out`; returns
/// the new count and the change of `active_blocks` per slot. Entries of other keys are
/// copied in runs, not decoded: the cost is a galloping search per key plus a memcpy of
/// the bucket, whatever else is in flight.
///
/// Acquire: `refs += count`; a block not in flight on the slot becomes active (+1), its
/// entry leased for `lease_ms`. Release: `refs −= count`; a block whose last reference
/// goes becomes inactive (−1) and stays a prediction for `linger_ms` (0: removed). A
/// touched entry that is dead is treated as absent (an expired lease counts −1 on the
/// way), so releasing an entry already swept changes nothing: its −1 was counted then.
pub fn apply(
    old: &[u8],
    n: usize,
    keys: &[Key],
    change: Change,
    now_ms: u64,
    out: &mut Vec<u8>,
) -> (usize, ActiveDelta) {
    let start = out.len();
    out.reserve(old.len() + if matches!(change, Change::Acquire { .. }) { keys.len() * FLY_ENTRY } else { 0 });
    let mut delta = ActiveDelta::default();
    let key_at = |i: usize| {
        let b = &old[i * FLY_ENTRY..];
        (crate::layout::le_u64(b), u16::from_le_bytes([b[8], b[9]]))
    };
    let mut pos = 0usize;
    for &Key { hash, slot, count } in keys {
        // First entry at or after (hash, slot), galloping forward from `pos`: keys are
        // sorted, so the next one is usually close.
        let lo = gallop(pos, n, |i| key_at(i) < (hash, slot));
        out.extend_from_slice(&old[pos * FLY_ENTRY..lo * FLY_ENTRY]);
        pos = lo;
        let existing = if lo < n && key_at(lo) == (hash, slot) {
            pos += 1;
            let e = FlyEntry::decode(&old[lo * FLY_ENTRY..(lo + 1) * FLY_ENTRY]);
            if e.live(now_ms) {
                Some(e)
            } else {
                if e.refs > 0 {
                    delta.add(usize::from(slot), -1);
                }
                None
            }
        } else {
            None
        };
        let updated = match (change, existing) {
            (Change::Acquire { lease_ms }, e) => {
                let until_ms = now_ms.saturating_add(lease_ms);
                let (refs, until_ms) = match e {
                    Some(e) => (e.refs, e.until_ms.max(until_ms)),
                    None => (0, until_ms),
                };
                if refs == 0 {
                    delta.add(usize::from(slot), 1);
                }
                Some(FlyEntry { hash, slot, refs: refs.saturating_add(count), until_ms })
            }
            (Change::Release { .. }, None) => None,
            (Change::Release { linger_ms }, Some(e)) => {
                if e.refs == 0 {
                    Some(e)
                } else if e.refs > count {
                    Some(FlyEntry { refs: e.refs - count, ..e })
                } else {
                    delta.add(usize::from(slot), -1);
                    (linger_ms > 0).then(|| FlyEntry { refs: 0, until_ms: now_ms.saturating_add(linger_ms), ..e })
                }
            }
        };
        if let Some(e) = updated {
            e.encode_into(out);
        }
    }
    out.extend_from_slice(&old[pos * FLY_ENTRY..n * FLY_ENTRY]);
    ((out.len() - start) / FLY_ENTRY, delta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::fly_raw_of;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// Applies a change to decoded entries through the raw rewrite.
    fn apply(entries: &mut Vec<FlyEntry>, hashes: &[u64], slot: u16, change: Change, now: u64) -> ActiveDelta {
        let mut sorted = hashes.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let mut out = Vec::new();
        let mut swept = Vec::new();
        let (n0, mut d) = sweep(&fly_raw_of(entries), entries.len(), now, &mut swept);
        let mut k = Vec::new();
        keys(&sorted, &[slot], &mut k);
        let (n, d2) = super::apply(&swept, n0, &k, change, now, &mut out);
        d.merge(&d2);
        assert_eq!(out.len(), n * FLY_ENTRY);
        *entries = out.chunks_exact(FLY_ENTRY).map(FlyEntry::decode).collect();
        assert!(entries.windows(2).all(|w| (w[0].hash, w[0].slot) < (w[1].hash, w[1].slot)), "sorted");
        d
    }

    fn acq(e: &mut Vec<FlyEntry>, h: &[u64], slot: u16, now: u64, lease: u64) -> i64 {
        let d = apply(e, h, slot, Change::Acquire { lease_ms: lease }, now);
        d.0.iter().filter(|(s, _)| *s == usize::from(slot)).map(|(_, v)| v).sum()
    }

    fn rel(e: &mut Vec<FlyEntry>, h: &[u64], slot: u16, now: u64, linger: u64) -> i64 {
        let d = apply(e, h, slot, Change::Release { linger_ms: linger }, now);
        -d.0.iter().filter(|(s, _)| *s == usize::from(slot)).map(|(_, v)| v).sum::<i64>()
    }

    fn active(entries: &[FlyEntry], slot: u16) -> usize {
        entries.iter().filter(|e| e.slot == slot && e.refs > 0).count()
    }

    #[test]
    fn shared_prefix_counted_once() {
        let mut e = Vec::new();
        assert_eq!(acq(&mut e, &[1, 2, 3], 0, 0, 1000), 3);
        // A second stream sharing blocks 1, 2 adds only its own block.
        assert_eq!(acq(&mut e, &[1, 2, 4], 0, 0, 1000), 1);
        // Another worker counts separately.
        assert_eq!(acq(&mut e, &[1], 1, 0, 1000), 1);
        assert_eq!(active(&e, 0), 4);
        assert_eq!(rel(&mut e, &[1, 2, 3], 0, 10, 500), 1);
        assert_eq!(active(&e, 0), 3);
        assert_eq!(rel(&mut e, &[1, 2, 4], 0, 10, 500), 3);
        assert_eq!(active(&e, 0), 0);
        // Released blocks linger as predictions until 510.
        assert!(e.iter().filter(|x| x.slot == 0).all(|x| x.refs == 0 && x.until_ms == 510));
        // Double release is harmless.
        assert_eq!(rel(&mut e, &[1, 2, 4], 0, 10, 500), 0);
        // Re-acquiring a prediction makes it active again.
        assert_eq!(acq(&mut e, &[1], 0, 20, 1000), 1);
    }

    #[test]
    fn dead_entries_are_collected_on_any_rewrite() {
        let mut e = Vec::new();
        acq(&mut e, &[1], 0, 0, 100); // lease to 100
        acq(&mut e, &[2], 0, 0, 1000);
        rel(&mut e, &[2], 0, 0, 50); // prediction to 50
        acq(&mut e, &[4], 1, 0, 1000); // live in flight
                                       // An unrelated change at 200 collects the dead lease (−1) and the prediction.
        let d = apply(&mut e, &[9], 2, Change::Acquire { lease_ms: 1000 }, 200);
        assert_eq!(d, ActiveDelta(vec![(0, -1), (2, 1)]));
        // Without a sweep, a dead entry that is touched is still accounted exactly.
        assert_eq!(e.iter().map(|x| (x.hash, x.slot)).collect::<Vec<_>>(), vec![(4, 1), (9, 2)]);
        // The stream that lost its lease releases later: nothing counted twice.
        assert_eq!(rel(&mut e, &[1], 0, 300, 50), 0);
        // A dead lease re-acquired before collection: −1 for the dead, +1 for the new.
        let mut e = Vec::new();
        acq(&mut e, &[1], 0, 0, 100);
        let d = apply(&mut e, &[1], 0, Change::Acquire { lease_ms: 100 }, 500);
        assert!(d.is_zero(), "{d:?}");
        assert_eq!(e[0].refs, 1);
    }

    #[test]
    fn touched_dead_entries_are_accounted_without_a_sweep() {
        let mut out = Vec::new();
        // In flight with a lease to 100, never released; untouched prediction expired at 50.
        let old = fly_raw_of(&[
            FlyEntry { hash: 1, slot: 0, refs: 1, until_ms: 100 },
            FlyEntry { hash: 2, slot: 0, refs: 0, until_ms: 50 },
        ]);
        let one = [Key { hash: 1, slot: 0, count: 1 }];
        let (n, d) = super::apply(&old, 2, &one, Change::Acquire { lease_ms: 100 }, 500, &mut out);
        assert!(d.is_zero(), "−1 for the dead lease, +1 for the new one: {d:?}");
        assert_eq!(n, 2, "the untouched dead prediction waits for the sweep");
        let (n, d) = super::apply(&old, 2, &one, Change::Release { linger_ms: 10 }, 500, &mut out);
        assert_eq!((n, d), (1, ActiveDelta(vec![(0, -1)])), "a dead lease released: counted once, gone");
    }

    #[test]
    fn batched_release_counts() {
        let mut e = Vec::new();
        for _ in 0..3 {
            acq(&mut e, &[1, 2], 0, 0, 1000);
        }
        acq(&mut e, &[2], 1, 0, 1000);
        let mut k = vec![
            Key { hash: 2, slot: 0, count: 1 },
            Key { hash: 1, slot: 0, count: 2 },
            Key { hash: 2, slot: 0, count: 1 },
            Key { hash: 2, slot: 1, count: 1 },
        ];
        merge_keys(&mut k);
        assert_eq!(
            k,
            vec![
                Key { hash: 1, slot: 0, count: 2 },
                Key { hash: 2, slot: 0, count: 2 },
                Key { hash: 2, slot: 1, count: 1 }
            ]
        );
        let mut out = Vec::new();
        let (_, d) = super::apply(&fly_raw_of(&e), e.len(), &k, Change::Release { linger_ms: 0 }, 1, &mut out);
        assert_eq!(d, ActiveDelta(vec![(1, -1)]), "slot 0 keeps one reference on each block");
        let left: Vec<_> =
            out.chunks_exact(FLY_ENTRY).map(FlyEntry::decode).map(|e| (e.hash, e.slot, e.refs)).collect();
        assert_eq!(left, vec![(1, 0, 1), (2, 0, 1)]);
    }

    #[test]
    fn no_linger_removes() {
        let mut e = Vec::new();
        acq(&mut e, &[1, 2], 0, 0, 1000);
        rel(&mut e, &[1, 2], 0, 0, 0);
        assert!(e.is_empty());
    }

    #[test]
    fn several_slots_at_once() {
        let mut e = Vec::new();
        acq(&mut e, &[5], 3, 0, 1000);
        let mut out = Vec::new();
        let mut k = Vec::new();
        keys(&[1, 5, 9], &[1, 3], &mut k);
        let (n, d) = super::apply(&fly_raw_of(&e), e.len(), &k, Change::Acquire { lease_ms: 1000 }, 0, &mut out);
        assert_eq!(n, 6);
        assert_eq!(d, ActiveDelta(vec![(1, 3), (3, 2)]));
    }
}
