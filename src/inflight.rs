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
//! These functions edit a decoded entry list; the caller does the compare-and-swap.

use crate::layout::{FlyEntry, FLY_ENTRY};

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
    /// Ended: drop the reference; at zero the entry stays a prediction for `linger_ms`
    /// (0: removed at once).
    Release { linger_ms: u64 },
}

/// Rewrites a bucket's in-flight part (`n` entries in `old`, sorted by (hash, slot)) into
/// `out` in one merge pass, and returns the new entry count and the change of
/// `active_blocks` per slot. On the way, dead entries are dropped: expired predictions,
/// and in-flight entries whose lease ran out (those were counted active, so they count
/// −1). `hashes` must be sorted and free of duplicates; `slots` likewise.
///
/// Acquire: a block not in flight on the slot becomes active (+1); release: a block whose
/// last reference goes becomes inactive (−1). A release of an entry already gone (its
/// lease expired and it was collected) changes nothing: its −1 was counted then.
pub fn rewrite(
    old: &[u8],
    n: usize,
    hashes: &[u64],
    slots: &[u16],
    change: Change,
    now_ms: u64,
    out: &mut Vec<u8>,
) -> (usize, ActiveDelta) {
    out.clear();
    out.reserve(
        old.len() + if matches!(change, Change::Acquire { .. }) { hashes.len() * slots.len() * FLY_ENTRY } else { 0 },
    );
    let mut delta = ActiveDelta::default();
    let keys = hashes.iter().flat_map(|&h| slots.iter().map(move |&s| (h, s)));
    let mut keys = keys.peekable();
    let emit = |e: &FlyEntry, out: &mut Vec<u8>| e.encode_into(out);
    for i in 0..n {
        let raw = &old[i * FLY_ENTRY..(i + 1) * FLY_ENTRY];
        let e = FlyEntry::decode(raw);
        // Keys before this entry are not present: new entries on acquire.
        while let Some(&(h, s)) = keys.peek() {
            if (h, s) >= (e.hash, e.slot) {
                break;
            }
            keys.next();
            if let Change::Acquire { lease_ms } = change {
                emit(&FlyEntry { hash: h, slot: s, refs: 1, until_ms: now_ms.saturating_add(lease_ms) }, out);
                delta.add(usize::from(s), 1);
            }
        }
        let touched = keys.peek() == Some(&(e.hash, e.slot));
        if touched {
            keys.next();
        }
        let slot = usize::from(e.slot);
        let alive = e.live(now_ms);
        if !alive && e.refs > 0 {
            // A stream that never released (its VM died): it was active, it is no more.
            delta.add(slot, -1);
        }
        match (touched, change) {
            (false, _) => {
                if alive {
                    out.extend_from_slice(raw);
                }
            }
            (true, Change::Acquire { lease_ms }) => {
                let refs = if alive { e.refs } else { 0 };
                if refs == 0 {
                    delta.add(slot, 1);
                }
                let until_ms = now_ms.saturating_add(lease_ms);
                let until_ms = if alive { e.until_ms.max(until_ms) } else { until_ms };
                emit(&FlyEntry { refs: refs.saturating_add(1), until_ms, ..e }, out);
            }
            (true, Change::Release { linger_ms }) => {
                if !alive {
                    continue;
                }
                if e.refs == 0 {
                    out.extend_from_slice(raw);
                } else if e.refs > 1 {
                    emit(&FlyEntry { refs: e.refs - 1, ..e }, out);
                } else {
                    delta.add(slot, -1);
                    if linger_ms > 0 {
                        emit(&FlyEntry { refs: 0, until_ms: now_ms.saturating_add(linger_ms), ..e }, out);
                    }
                }
            }
        }
    }
    if let Change::Acquire { lease_ms } = change {
        for (h, s) in keys {
            emit(&FlyEntry { hash: h, slot: s, refs: 1, until_ms: now_ms.saturating_add(lease_ms) }, out);
            delta.add(usize::from(s), 1);
        }
    }
    (out.len() / FLY_ENTRY, delta)
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
        let (n, d) = rewrite(&fly_raw_of(entries), entries.len(), &sorted, &[slot], change, now, &mut out);
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
        let (n, d) =
            rewrite(&fly_raw_of(&e), e.len(), &[1, 5, 9], &[1, 3], Change::Acquire { lease_ms: 1000 }, 0, &mut out);
        assert_eq!(n, 6);
        assert_eq!(d, ActiveDelta(vec![(1, 3), (3, 2)]));
    }
}
