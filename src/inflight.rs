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

use crate::layout::FlyEntry;
use crate::slots::SlotSet;

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

fn find(entries: &[FlyEntry], hash: u64, slot: u16) -> Result<usize, usize> {
    entries.binary_search_by(|e| (e.hash, e.slot).cmp(&(hash, slot)))
}

/// Drops dead entries: expired predictions, predictions the index now confirms
/// (`confirmed(hash)` holds the slot), and in-flight entries whose lease ran out — those
/// were counted as active and are subtracted in the returned delta.
pub fn collect_garbage(
    entries: &mut Vec<FlyEntry>,
    now_ms: u64,
    mut confirmed: impl FnMut(u64) -> SlotSet,
) -> ActiveDelta {
    let mut delta = ActiveDelta::default();
    entries.retain(|e| {
        if e.refs > 0 {
            if e.live(now_ms) {
                return true;
            }
            delta.add(usize::from(e.slot), -1);
            return false;
        }
        e.live(now_ms) && !confirmed(e.hash).contains(usize::from(e.slot))
    });
    delta
}

/// Takes a reference on `hashes` for `slot`. Blocks that were not in flight on `slot`
/// become active (+1 each).
pub fn acquire(entries: &mut Vec<FlyEntry>, hashes: &[u64], slot: u16, now_ms: u64, lease_ms: u64) -> i64 {
    let until_ms = now_ms.saturating_add(lease_ms);
    let mut newly_active = 0;
    for &hash in hashes {
        match find(entries, hash, slot) {
            Ok(i) => {
                let e = &mut entries[i];
                if e.refs == 0 || !e.live(now_ms) {
                    // A lingering prediction (or a dead lease the caller's GC has not seen)
                    // becomes in flight again.
                    if e.refs == 0 {
                        newly_active += 1;
                    }
                    e.refs = 1;
                } else {
                    e.refs = e.refs.saturating_add(1);
                }
                e.until_ms = e.until_ms.max(until_ms);
            }
            Err(i) => {
                entries.insert(i, FlyEntry { hash, slot, refs: 1, until_ms });
                newly_active += 1;
            }
        }
    }
    newly_active
}

/// Drops a reference on `hashes` for `slot`. A block whose last reference goes becomes
/// inactive (−1 each) and stays as a prediction for `linger_ms` (0: removed at once).
/// Entries already gone (lease expired and collected) are skipped: their −1 was counted
/// when they were collected.
pub fn release(entries: &mut Vec<FlyEntry>, hashes: &[u64], slot: u16, now_ms: u64, linger_ms: u64) -> i64 {
    let mut newly_inactive = 0;
    for &hash in hashes {
        if let Ok(i) = find(entries, hash, slot) {
            let e = &mut entries[i];
            if e.refs == 0 {
                continue;
            }
            e.refs -= 1;
            if e.refs == 0 {
                newly_inactive += 1;
                if linger_ms == 0 {
                    entries.remove(i);
                } else {
                    e.until_ms = now_ms.saturating_add(linger_ms);
                }
            }
        }
    }
    newly_inactive
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn active(entries: &[FlyEntry], slot: u16) -> usize {
        entries.iter().filter(|e| e.slot == slot && e.refs > 0).count()
    }

    #[test]
    fn shared_prefix_counted_once() {
        let mut e = Vec::new();
        assert_eq!(acquire(&mut e, &[1, 2, 3], 0, 0, 1000), 3);
        // A second stream sharing blocks 1, 2 adds only its own block.
        assert_eq!(acquire(&mut e, &[1, 2, 4], 0, 0, 1000), 1);
        // Another worker counts separately.
        assert_eq!(acquire(&mut e, &[1], 1, 0, 1000), 1);
        assert_eq!(active(&e, 0), 4);
        assert_eq!(release(&mut e, &[1, 2, 3], 0, 10, 500), 1);
        assert_eq!(active(&e, 0), 3);
        assert_eq!(release(&mut e, &[1, 2, 4], 0, 10, 500), 3);
        assert_eq!(active(&e, 0), 0);
        // Released blocks linger as predictions until 510.
        assert!(e.iter().filter(|x| x.slot == 0).all(|x| x.refs == 0 && x.until_ms == 510));
        // Double release is harmless.
        assert_eq!(release(&mut e, &[1, 2, 4], 0, 10, 500), 0);
        // Re-acquiring a prediction makes it active again.
        assert_eq!(acquire(&mut e, &[1], 0, 20, 1000), 1);
    }

    #[test]
    fn garbage_collection() {
        let mut e = Vec::new();
        acquire(&mut e, &[1], 0, 0, 100); // lease to 100
        acquire(&mut e, &[2], 0, 0, 1000);
        release(&mut e, &[2], 0, 0, 50); // prediction to 50
        acquire(&mut e, &[3], 1, 0, 1000);
        release(&mut e, &[3], 1, 0, 5000); // prediction to 5000, but confirmed below
        acquire(&mut e, &[4], 1, 0, 1000); // live in flight
        let mut confirmed_3 = SlotSet::EMPTY;
        confirmed_3.insert(1);
        let d = collect_garbage(&mut e, 200, |h| if h == 3 { confirmed_3 } else { SlotSet::EMPTY });
        assert_eq!(d, ActiveDelta(vec![(0, -1)]), "the dead lease is subtracted");
        assert_eq!(e.iter().map(|x| x.hash).collect::<Vec<_>>(), vec![4]);
        // The stream that lost its lease releases later: nothing counted twice.
        assert_eq!(release(&mut e, &[1], 0, 300, 50), 0);
    }

    #[test]
    fn no_linger_removes() {
        let mut e = Vec::new();
        acquire(&mut e, &[1, 2], 0, 0, 1000);
        release(&mut e, &[1, 2], 0, 0, 0);
        assert!(e.is_empty());
    }
}
