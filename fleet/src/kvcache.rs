//! The mock engine's paged KV cache with prefix caching, as vLLM keeps it where a router
//! can tell:
//!
//! - the GPU holds `capacity` blocks of `block_size` tokens;
//! - a full block is named by a hash chained over its parent's (the engine's own hash,
//!   deliberately not the router's: the sidecar must recompute router hashes from tokens);
//! - a request reuses the cached blocks of its longest cached prefix and allocates the rest
//!   up front (prompt and the most it may generate), so the cache never exceeds capacity;
//! - blocks a running request references are never evicted; free cached blocks are
//!   evicted least recently used first, and only leaves (a block whose children are cached
//!   cannot go before them). A finished request frees its blocks tail first, as vLLM does,
//!   so its tail is evicted first.
//!
//! Every change is reported as a KV event ([`KvEvent`]) for the publisher.

use std::collections::{BTreeSet, HashMap};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The engine's hash seed: any value but the router's (1337).
const ENGINE_SEED: u64 = 0x5EED_0FE9;

/// What the engine tells subscribers, as vLLM's `BlockStored` / `BlockRemoved` /
/// `AllBlocksCleared`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    Stored { hashes: Vec<u64>, parent: Option<u64>, token_ids: Vec<u32> },
    Removed { hashes: Vec<u64> },
    Cleared,
}

#[derive(Debug, Clone)]
struct Block {
    parent: Option<u64>,
    /// Cached children (blocks whose parent this is).
    children: u32,
    /// Running requests using it.
    refs: u32,
    last_used: u64,
}

/// The engine hash of a block given its parent's.
pub fn engine_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut buf = Vec::with_capacity(8 + tokens.len() * 4);
    buf.extend_from_slice(&parent.unwrap_or(0).to_le_bytes());
    buf.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    xxh3_64_with_seed(&buf, ENGINE_SEED)
}

/// One request's hold on the cache.
#[derive(Debug, Clone, Default)]
pub struct Allocation {
    /// Cached blocks the request references, in chain order (its prefix hits, then the
    /// blocks it has computed and committed).
    pub chain: Vec<u64>,
    /// Leading prompt blocks found cached at admission.
    pub hit_blocks: usize,
    /// Blocks allocated but not yet committed as cached blocks.
    reserved: usize,
}

#[derive(Debug)]
pub struct KvCache {
    block_size: usize,
    capacity: usize,
    blocks: HashMap<u64, Block>,
    /// Free leaves, oldest first: (last_used, hash).
    evictable: BTreeSet<(u64, u64)>,
    /// Blocks occupied: cached blocks plus reserved ones.
    used: usize,
    tick: u64,
    events: Vec<KvEvent>,
}

impl KvCache {
    pub fn new(block_size: usize, capacity: usize) -> KvCache {
        KvCache {
            block_size: block_size.max(1),
            capacity,
            blocks: HashMap::new(),
            evictable: BTreeSet::new(),
            used: 0,
            tick: 0,
            events: Vec::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn used(&self) -> usize {
        self.used
    }
    pub fn cached_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The events since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Engine hashes of every full block of `tokens`.
    pub fn hashes(&self, tokens: &[u32]) -> Vec<u64> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        let mut parent = None;
        for block in tokens.chunks_exact(self.block_size) {
            let h = engine_hash(parent, block);
            out.push(h);
            parent = Some(h);
        }
        out
    }

    /// Leading blocks of `hashes` cached now.
    pub fn cached_prefix(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.blocks.contains_key(h)).count()
    }

    /// Whether a request needing `total_blocks` could ever fit.
    pub fn fits(&self, total_blocks: usize) -> bool {
        total_blocks <= self.capacity
    }

    /// Admits a request of `prompt_hashes` (its full prompt blocks) that needs `total_blocks`
    /// blocks in all (prompt and the most it may generate): references its cached prefix
    /// and reserves the rest, evicting free blocks as needed. `None` if it cannot fit yet.
    pub fn admit(&mut self, prompt_hashes: &[u64], total_blocks: usize) -> Option<Allocation> {
        let hits = self.cached_prefix(prompt_hashes);
        let needed = total_blocks.saturating_sub(hits);
        // Free space, counting what could be evicted (hit blocks are about to be pinned).
        let pinned_free =
            prompt_hashes[..hits].iter().filter(|h| self.blocks.get(h).is_some_and(|b| b.refs == 0)).count();
        let free = self.capacity - self.used;
        let evictable = self.evictable_total().saturating_sub(pinned_free);
        if needed > free + evictable {
            return None;
        }
        for h in &prompt_hashes[..hits] {
            self.reference(*h);
        }
        while self.capacity - self.used < needed {
            if !self.evict_one() {
                // Not reachable: the count above said enough could go.
                break;
            }
        }
        self.used += needed;
        Some(Allocation { chain: prompt_hashes[..hits].to_vec(), hit_blocks: hits, reserved: needed })
    }

    /// Commits the request's next computed full blocks (`hashes`, the chain continuing its
    /// own, and their `tokens`) as cached: one `BlockStored` for the run. A block another
    /// request cached meanwhile is shared instead (its reserved block is returned).
    pub fn commit(&mut self, alloc: &mut Allocation, hashes: &[u64], tokens: &[u32]) {
        let mut run_start: Option<usize> = None;
        let mut parent = alloc.chain.last().copied();
        let flush = |cache: &mut KvCache, from: Option<usize>, to: usize, parent_of_run: Option<u64>| {
            if let Some(s) = from {
                cache.events.push(KvEvent::Stored {
                    hashes: hashes[s..to].to_vec(),
                    parent: parent_of_run,
                    token_ids: tokens[s * cache.block_size..to * cache.block_size].to_vec(),
                });
            }
        };
        let mut run_parent = parent;
        for (i, &h) in hashes.iter().enumerate() {
            alloc.reserved = alloc.reserved.saturating_sub(1);
            if self.blocks.contains_key(&h) {
                // Computed twice (another request got there first): share, free ours.
                flush(self, run_start.take(), i, run_parent);
                self.reference(h);
                self.used -= 1;
            } else {
                if run_start.is_none() {
                    run_start = Some(i);
                    run_parent = parent;
                }
                if let Some(p) = parent.and_then(|p| self.blocks.get_mut(&p)) {
                    p.children += 1;
                }
                if let Some(p) = parent {
                    // A parent with a cached child is no longer a leaf.
                    let lu = self.blocks.get(&p).map(|b| b.last_used);
                    if let Some(lu) = lu {
                        self.evictable.remove(&(lu, p));
                    }
                }
                self.blocks.insert(h, Block { parent, children: 0, refs: 1, last_used: self.tick });
            }
            alloc.chain.push(h);
            parent = Some(h);
        }
        flush(self, run_start, hashes.len(), run_parent);
    }

    /// Ends a request: its blocks are freed tail first (the tail becomes the least recently
    /// used), its unused reservation returned.
    pub fn release(&mut self, alloc: Allocation) {
        self.used -= alloc.reserved;
        for &h in alloc.chain.iter().rev() {
            self.tick += 1;
            let tick = self.tick;
            let Some(b) = self.blocks.get_mut(&h) else { continue };
            b.refs = b.refs.saturating_sub(1);
            b.last_used = tick;
            if b.refs == 0 && b.children == 0 {
                self.evictable.insert((tick, h));
            }
        }
    }

    /// Drops every free block (vLLM's `reset_prefix_cache`); reports `AllBlocksCleared`
    /// when nothing is in use, else the blocks removed.
    pub fn reset(&mut self) {
        if self.blocks.values().all(|b| b.refs == 0) {
            self.used -= self.blocks.len();
            self.blocks.clear();
            self.evictable.clear();
            self.events.push(KvEvent::Cleared);
        } else {
            while self.evict_one() {}
        }
    }

    /// Free blocks that eviction could reach: every block no request references (a free
    /// parent becomes a leaf once its free children go; a referenced block's ancestors are
    /// referenced too).
    fn evictable_total(&self) -> usize {
        self.blocks.values().filter(|b| b.refs == 0).count()
    }

    fn reference(&mut self, h: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(b) = self.blocks.get_mut(&h) {
            if b.refs == 0 && b.children == 0 {
                self.evictable.remove(&(b.last_used, h));
            }
            b.refs += 1;
            b.last_used = tick;
        }
    }

    /// Evicts the least recently used free leaf; false if there is none.
    fn evict_one(&mut self) -> bool {
        let Some(&(lu, h)) = self.evictable.iter().next() else { return false };
        self.evictable.remove(&(lu, h));
        let Some(b) = self.blocks.remove(&h) else { return false };
        self.used -= 1;
        match self.events.last_mut() {
            Some(KvEvent::Removed { hashes }) => hashes.push(h),
            _ => self.events.push(KvEvent::Removed { hashes: vec![h] }),
        }
        if let Some(p) = b.parent.and_then(|p| self.blocks.get_mut(&p).map(|pb| (p, pb))) {
            let (p, pb) = p;
            pb.children = pb.children.saturating_sub(1);
            if pb.children == 0 && pb.refs == 0 {
                let lu = pb.last_used;
                self.evictable.insert((lu, p));
            }
        }
        true
    }

    /// Invariants, for tests: usage within capacity, counts consistent.
    #[cfg(test)]
    fn check(&self) {
        assert!(self.used <= self.capacity, "used {} > capacity {}", self.used, self.capacity);
        assert!(self.blocks.len() <= self.used);
        for (h, b) in &self.blocks {
            let kids = self.blocks.values().filter(|c| c.parent == Some(*h)).count() as u32;
            assert_eq!(kids, b.children, "children of {h}");
            assert_eq!(self.evictable.contains(&(b.last_used, *h)), b.refs == 0 && b.children == 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(prefix: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| prefix * 100_000 + i).collect()
    }

    /// Admit, compute every prompt block, release.
    fn serve(c: &mut KvCache, tokens: &[u32], extra: usize) -> (usize, Option<Allocation>) {
        let hashes = c.hashes(tokens);
        let Some(mut a) = c.admit(&hashes, hashes.len() + extra) else { return (0, None) };
        let hits = a.hit_blocks;
        let new = hashes[hits..].to_vec();
        c.commit(&mut a, &new, &tokens[hits * 4..hashes.len() * 4]);
        (hits, Some(a))
    }

    #[test]
    fn prefixes_are_shared_and_events_say_so() {
        let mut c = KvCache::new(4, 100);
        let a = toks(1, 16);
        let (hits, alloc) = serve(&mut c, &a, 1);
        assert_eq!(hits, 0);
        c.release(alloc.unwrap());
        let ev = c.take_events();
        assert!(matches!(&ev[..], [KvEvent::Stored { hashes, parent: None, token_ids }]
            if hashes.len() == 4 && token_ids.len() == 16));
        // Same first 8 tokens, then different: 2 hits, a Stored run parented on block 1.
        let mut b = a[..8].to_vec();
        b.extend(toks(2, 8));
        let (hits, alloc) = serve(&mut c, &b, 0);
        assert_eq!(hits, 2);
        let ev = c.take_events();
        let hb = c.hashes(&b);
        assert_eq!(
            ev,
            vec![KvEvent::Stored { hashes: hb[2..].to_vec(), parent: Some(hb[1]), token_ids: b[8..].to_vec() }]
        );
        c.release(alloc.unwrap());
        assert_eq!(c.cached_blocks(), 6);
        c.check();
    }

    #[test]
    fn never_exceeds_capacity_and_evicts_leaves_tail_first() {
        let mut c = KvCache::new(4, 10);
        let a = toks(1, 24); // 6 blocks
        let (_, alloc) = serve(&mut c, &a, 0);
        c.release(alloc.unwrap());
        c.take_events();
        // 7 more blocks needed: 4 free, 3 evicted — a's last three, tail first.
        let b = toks(2, 28);
        let (_, alloc) = serve(&mut c, &b, 0);
        c.check();
        let ha = c.hashes(&a);
        let removed: Vec<u64> = c
            .take_events()
            .into_iter()
            .filter_map(|e| if let KvEvent::Removed { hashes } = e { Some(hashes) } else { None })
            .flatten()
            .collect();
        assert_eq!(removed, vec![ha[5], ha[4], ha[3]]);
        assert_eq!(c.cached_prefix(&ha), 3);
        // While b runs, its 7 blocks are pinned: a request needing 4 must wait.
        assert!(c.admit(&c.hashes(&toks(3, 16)), 4).is_none());
        c.release(alloc.unwrap());
        assert!(c.admit(&c.hashes(&toks(3, 16)), 4).is_some());
        c.check();
    }

    #[test]
    fn random_traffic_keeps_every_invariant() {
        let mut c = KvCache::new(4, 40);
        let mut live: Vec<Allocation> = Vec::new();
        let mut x = 7u64;
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x.is_multiple_of(3) && !live.is_empty() {
                let a = live.swap_remove((x as usize / 3) % live.len());
                c.release(a);
            } else {
                // Prompts share prefixes: a few roots, varying lengths.
                let root = (x % 5) as u32;
                let len = 4 * (1 + (x >> 8) as usize % 8);
                let mut t = toks(root, 16);
                t.extend(toks(10 + (x >> 20) as u32 % 7, len));
                let (_, a) = serve(&mut c, &t, (x >> 30) as usize % 3);
                if let Some(a) = a {
                    live.push(a);
                }
            }
            c.check();
        }
    }

    #[test]
    fn reset_clears_when_idle() {
        let mut c = KvCache::new(4, 10);
        let (_, a) = serve(&mut c, &toks(1, 8), 0);
        c.release(a.unwrap());
        c.take_events();
        c.reset();
        assert_eq!(c.take_events(), vec![KvEvent::Cleared]);
        assert_eq!((c.used(), c.cached_blocks()), (0, 0));
    }
}
