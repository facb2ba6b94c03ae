//! The feed's change log: every change to any worker's block set since some version, so a
//! client at that version gets a delta instead of a snapshot. Bounded by blocks held; the
//! oldest versions fall off, and a client older than that gets a snapshot. Workers are
//! named by their fleet key; a delta maps keys to the frame's positions.

use kvroute::feed::{FeedBlock, Op};
use std::collections::VecDeque;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Store(Vec<FeedBlock>),
    StoreOffloaded(Vec<FeedBlock>),
    Remove(Vec<FeedBlock>),
    Clear,
}

impl Entry {
    fn blocks(&self) -> usize {
        match self {
            Entry::Store(b) | Entry::StoreOffloaded(b) | Entry::Remove(b) => b.len(),
            Entry::Clear => 1,
        }
    }
}

#[derive(Debug)]
struct Logged {
    version: u64,
    worker: u32,
    entry: Entry,
}

#[derive(Debug)]
pub struct ChangeLog {
    entries: VecDeque<Logged>,
    blocks: usize,
    max_blocks: usize,
    /// Deltas can be served for any `since` ≥ this.
    floor: u64,
}

impl ChangeLog {
    pub fn new(max_blocks: usize) -> Self {
        ChangeLog { entries: VecDeque::new(), blocks: 0, max_blocks: max_blocks.max(1), floor: 0 }
    }

    pub fn floor(&self) -> u64 {
        self.floor
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    pub fn store(&mut self, version: u64, worker: u32, blocks: Vec<FeedBlock>) {
        self.push(version, worker, Entry::Store(blocks));
    }

    pub fn store_offloaded(&mut self, version: u64, worker: u32, blocks: Vec<FeedBlock>) {
        self.push(version, worker, Entry::StoreOffloaded(blocks));
    }

    pub fn remove(&mut self, version: u64, worker: u32, blocks: Vec<FeedBlock>) {
        self.push(version, worker, Entry::Remove(blocks));
    }

    pub fn clear(&mut self, version: u64, worker: u32) {
        self.push(version, worker, Entry::Clear);
    }

    fn push(&mut self, version: u64, worker: u32, entry: Entry) {
        let n = entry.blocks();
        if n == 0 {
            return;
        }
        self.blocks += n;
        self.entries.push_back(Logged { version, worker, entry });
        self.trim();
    }

    /// Drops whole versions from the front until the log fits, never the newest version.
    fn trim(&mut self) {
        while self.blocks > self.max_blocks {
            let Some(oldest) = self.entries.front().map(|e| e.version) else { break };
            if self.entries.back().map(|e| e.version) == Some(oldest) {
                break;
            }
            while self.entries.front().is_some_and(|e| e.version == oldest) {
                if let Some(e) = self.entries.pop_front() {
                    self.blocks -= e.entry.blocks();
                }
            }
            self.floor = oldest;
        }
    }

    /// The ops taking a client from `since` to the newest version, merged where consecutive
    /// entries are the same kind for the same worker. `None` if `since` is below the floor.
    /// Without `tiers` (a client that did not ask for them), offloaded blocks are plain
    /// stores. `position` maps a worker key to its index in the frame; entries of workers it
    /// does not know (they left: the frame's list drops them whole) are skipped.
    pub fn delta(&self, since: u64, tiers: bool, position: impl Fn(u32) -> Option<u32>) -> Option<Vec<Op>> {
        if since < self.floor {
            return None;
        }
        let start = self.entries.partition_point(|e| e.version <= since);
        let mut ops: Vec<Op> = Vec::new();
        for e in self.entries.range(start..) {
            let Some(worker) = position(e.worker) else { continue };
            let (kind, blocks) = match &e.entry {
                Entry::Clear => {
                    ops.push(Op::Clear { worker });
                    continue;
                }
                Entry::Store(b) => (RunKind::Store, b),
                Entry::StoreOffloaded(b) if tiers => (RunKind::StoreOffloaded, b),
                Entry::StoreOffloaded(b) => (RunKind::Store, b),
                Entry::Remove(b) => (RunKind::Remove, b),
            };
            match ops.last_mut().and_then(run_of) {
                Some((w, k, run)) if w == worker && k == kind => run.extend_from_slice(blocks),
                _ => ops.push(kind.op(worker, blocks.clone())),
            }
        }
        Some(ops)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum RunKind {
    Store,
    StoreOffloaded,
    Remove,
}

impl RunKind {
    fn op(self, worker: u32, blocks: Vec<FeedBlock>) -> Op {
        match self {
            RunKind::Store => Op::Store { worker, blocks },
            RunKind::StoreOffloaded => Op::StoreOffloaded { worker, blocks },
            RunKind::Remove => Op::Remove { worker, blocks },
        }
    }
}

/// An op's worker, kind and blocks, if it carries blocks.
fn run_of(op: &mut Op) -> Option<(u32, RunKind, &mut Vec<FeedBlock>)> {
    match op {
        Op::Store { worker, blocks } => Some((*worker, RunKind::Store, blocks)),
        Op::StoreOffloaded { worker, blocks } => Some((*worker, RunKind::StoreOffloaded, blocks)),
        Op::Remove { worker, blocks } => Some((*worker, RunKind::Remove, blocks)),
        Op::Clear { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(h: u64) -> FeedBlock {
        FeedBlock { hash: h, anchor: h }
    }

    #[test]
    fn delta_merges_runs_and_starts_after_since() {
        let mut log = ChangeLog::new(100);
        log.store(1, 0, vec![b(1)]);
        log.store(2, 0, vec![b(2)]);
        log.store(2, 1, vec![b(3)]);
        log.remove(3, 1, vec![b(3)]);
        log.clear(4, 0);
        assert_eq!(
            log.delta(1, true, Some).unwrap(),
            vec![
                Op::Store { worker: 0, blocks: vec![b(2)] },
                Op::Store { worker: 1, blocks: vec![b(3)] },
                Op::Remove { worker: 1, blocks: vec![b(3)] },
                Op::Clear { worker: 0 },
            ]
        );
        assert_eq!(log.delta(0, true, Some).unwrap()[0], Op::Store { worker: 0, blocks: vec![b(1), b(2)] });
        assert!(log.delta(4, true, Some).unwrap().is_empty());
    }

    #[test]
    fn offloaded_stores_are_plain_stores_for_clients_without_tiers() {
        let mut log = ChangeLog::new(100);
        log.store(1, 0, vec![b(1)]);
        log.store_offloaded(1, 0, vec![b(2)]);
        assert_eq!(
            log.delta(0, true, Some).unwrap(),
            vec![Op::Store { worker: 0, blocks: vec![b(1)] }, Op::StoreOffloaded { worker: 0, blocks: vec![b(2)] }]
        );
        assert_eq!(log.delta(0, false, Some).unwrap(), vec![Op::Store { worker: 0, blocks: vec![b(1), b(2)] }]);
    }

    #[test]
    fn trimming_drops_whole_versions_and_raises_the_floor() {
        let mut log = ChangeLog::new(3);
        log.store(1, 0, vec![b(1), b(2)]);
        log.store(2, 0, vec![b(3)]);
        assert_eq!(log.floor(), 0);
        log.store(3, 0, vec![b(4)]);
        assert_eq!(log.floor(), 1);
        assert!(log.delta(0, true, Some).is_none());
        assert_eq!(log.delta(1, true, Some).unwrap(), vec![Op::Store { worker: 0, blocks: vec![b(3), b(4)] }]);
        // A single version larger than the bound is kept whole.
        log.store(4, 0, (10..20).map(b).collect());
        assert_eq!(log.floor(), 3);
        assert_eq!(log.delta(3, true, Some).unwrap().len(), 1);
    }
}
