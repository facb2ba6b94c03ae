//! The mock engine's paged KV cache with prefix caching, as vLLM keeps it where a router
//! can tell:
//!
//! - the GPU holds `capacity` blocks of `block_size` tokens;
//! - a full block is named by a hash chained over its parent's, vLLM 0.33's default
//!   ([`BlockHash::of`]): not the router's hash, so the sidecar must recompute router
//!   hashes from tokens, and the one peers that recompute vLLM's hashes from a request's
//!   tokens (vllm-router's `kv_aware`) look up;
//! - a request reuses the cached blocks of its longest cached prefix and allocates the rest
//!   up front (prompt and the most it may generate), so the cache never exceeds capacity;
//! - blocks a running request references are never evicted; free cached blocks are
//!   evicted least recently used first, and only leaves (a block whose children are cached
//!   cannot go before them). A finished request frees its blocks tail first, as vLLM does,
//!   so its tail is evicted first.
//!
//! Every change is reported as a KV event ([`KvEvent`]) for the publisher.

use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashMap};

/// What the engine tells subscribers, as vLLM's `BlockStored` / `BlockRemoved` /
/// `AllBlocksCleared` (hashes as their 64-bit event form, [`BlockHash::id`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    Stored { hashes: Vec<u64>, parent: Option<u64>, token_ids: Vec<u32> },
    Removed { hashes: Vec<u64> },
    Cleared,
}

#[derive(Debug, Clone)]
struct Block {
    /// Its whole hash, which its children's are computed from.
    hash: BlockHash,
    parent: Option<u64>,
    /// Cached children (blocks whose parent this is).
    children: u32,
    /// Running requests using it.
    refs: u32,
    last_used: u64,
}

/// A block's hash as vLLM 0.33 computes it by default (`prefix_caching_hash_algo =
/// "sha256"`, `vllm/v1/core/kv_cache_utils.py`): SHA-256 of
/// `pickle.dumps((parent, tuple(tokens), None), protocol=5)`, where the first block's
/// parent is `NONE_HASH`, SHA-256 of the pickled seed `"vllm-none-hash"` (vLLM's fixed
/// seed for a cryptographic hash when `PYTHONHASHSEED` is unset), and `None` stands for no
/// extra keys (no LoRA, cache salt or multimodal input, which the mock does not take).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHash(pub [u8; 32]);

/// vLLM's `DEFAULT_NONE_HASH_SEED`.
const NONE_HASH_SEED: &str = "vllm-none-hash";

impl BlockHash {
    /// The hash of a block of `tokens` after `parent` (`None`: the first block).
    pub fn of(parent: Option<&BlockHash>, tokens: &[u32]) -> BlockHash {
        let none;
        let parent = match parent {
            Some(p) => p,
            None => {
                none = BlockHash::none();
                &none
            }
        };
        let mut body = Vec::with_capacity(48 + 3 * tokens.len());
        body.extend_from_slice(&[0x43, 32]); // SHORT_BINBYTES, 32 bytes
        body.extend_from_slice(&parent.0);
        body.push(0x94); // MEMOIZE
        pickle_int_tuple(&mut body, tokens);
        body.extend_from_slice(&[0x4e, 0x87, 0x94]); // None, TUPLE3, MEMOIZE
        BlockHash(sha256_pickle(&body))
    }

    /// `NONE_HASH`: the parent of every first block.
    fn none() -> BlockHash {
        let mut body = vec![0x8c, NONE_HASH_SEED.len() as u8]; // SHORT_BINUNICODE
        body.extend_from_slice(NONE_HASH_SEED.as_bytes());
        body.push(0x94); // MEMOIZE
        BlockHash(sha256_pickle(&body))
    }

    /// The hash as KV events carry it (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, on by
    /// default): the digest as a big-endian integer, its low 64 bits.
    pub fn id(&self) -> u64 {
        let mut low = [0u8; 8];
        low.copy_from_slice(&self.0[24..]);
        u64::from_be_bytes(low)
    }
}

/// SHA-256 of a protocol-5 pickle whose opcodes after the header are `body` (then STOP),
/// in one frame, as CPython's pickler writes it.
fn sha256_pickle(body: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update([0x80, 5, 0x95]); // PROTO 5, FRAME
    h.update((body.len() as u64 + 1).to_le_bytes());
    h.update(body);
    h.update([0x2e]); // STOP
    h.finalize().into()
}

/// A tuple of non-negative ints, pickled: the smallest integer opcode each, a MARK and
/// TUPLE around more than three, then MEMOIZE (an empty tuple is not memoized).
fn pickle_int_tuple(out: &mut Vec<u8>, items: &[u32]) {
    if items.len() > 3 {
        out.push(0x28); // MARK
    }
    for &t in items {
        match t {
            0..=0xff => out.extend_from_slice(&[0x4b, t as u8]), // BININT1
            0x100..=0xffff => {
                out.push(0x4d); // BININT2
                out.extend_from_slice(&(t as u16).to_le_bytes());
            }
            0x1_0000..=0x7fff_ffff => {
                out.push(0x4a); // BININT (signed 32-bit)
                out.extend_from_slice(&t.to_le_bytes());
            }
            _ => {
                out.extend_from_slice(&[0x8a, 5]); // LONG1: two's complement, a zero sign byte
                out.extend_from_slice(&t.to_le_bytes());
                out.push(0);
            }
        }
    }
    match items.len() {
        0 => out.push(0x29),                                         // EMPTY_TUPLE
        n @ 1..=3 => out.extend_from_slice(&[0x84 + n as u8, 0x94]), // TUPLE1..3, MEMOIZE
        _ => out.extend_from_slice(&[0x74, 0x94]),                   // TUPLE, MEMOIZE
    }
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

    /// The id (as KV events name it) of every cached block, sorted.
    pub fn block_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.blocks.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// The events since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// The hashes of every full block of `tokens`.
    pub fn hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out: Vec<BlockHash> = Vec::with_capacity(tokens.len() / self.block_size);
        for block in tokens.chunks_exact(self.block_size) {
            out.push(BlockHash::of(out.last(), block));
        }
        out
    }

    /// The whole hash of a cached block (a running request's last, say).
    pub fn block_hash(&self, id: u64) -> Option<BlockHash> {
        self.blocks.get(&id).map(|b| b.hash)
    }

    /// Leading blocks of `hashes` cached now.
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.blocks.contains_key(&h.id())).count()
    }

    /// Whether a request needing `total_blocks` could ever fit.
    pub fn fits(&self, total_blocks: usize) -> bool {
        total_blocks <= self.capacity
    }

    /// Admits a request of `prompt_hashes` (its full prompt blocks) that needs `total_blocks`
    /// blocks in all (prompt and the most it may generate): references its cached prefix
    /// and reserves the rest, evicting free blocks as needed. `None` if it cannot fit yet.
    pub fn admit(&mut self, prompt_hashes: &[BlockHash], total_blocks: usize) -> Option<Allocation> {
        let hits = self.cached_prefix(prompt_hashes);
        let needed = total_blocks.saturating_sub(hits);
        // Free space, counting what could be evicted (hit blocks are about to be pinned).
        let pinned_free =
            prompt_hashes[..hits].iter().filter(|h| self.blocks.get(&h.id()).is_some_and(|b| b.refs == 0)).count();
        let free = self.capacity - self.used;
        let evictable = self.evictable_total().saturating_sub(pinned_free);
        if needed > free + evictable {
            return None;
        }
        for h in &prompt_hashes[..hits] {
            self.reference(h.id());
        }
        while self.capacity - self.used < needed {
            if !self.evict_one() {
                // Not reachable: the count above said enough could go.
                break;
            }
        }
        self.used += needed;
        Some(Allocation {
            chain: prompt_hashes[..hits].iter().map(BlockHash::id).collect(),
            hit_blocks: hits,
            reserved: needed,
        })
    }

    /// Commits the request's next computed full blocks (`hashes`, the chain continuing its
    /// own, and their `tokens`) as cached: one `BlockStored` for the run. A block another
    /// request cached meanwhile is shared instead (its reserved block is returned).
    pub fn commit(&mut self, alloc: &mut Allocation, hashes: &[BlockHash], tokens: &[u32]) {
        let mut run_start: Option<usize> = None;
        let mut parent = alloc.chain.last().copied();
        let flush = |cache: &mut KvCache, from: Option<usize>, to: usize, parent_of_run: Option<u64>| {
            if let Some(s) = from {
                cache.events.push(KvEvent::Stored {
                    hashes: hashes[s..to].iter().map(BlockHash::id).collect(),
                    parent: parent_of_run,
                    token_ids: tokens[s * cache.block_size..to * cache.block_size].to_vec(),
                });
            }
        };
        let mut run_parent = parent;
        for (i, full) in hashes.iter().enumerate() {
            let h = full.id();
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
                self.blocks.insert(h, Block { hash: *full, parent, children: 0, refs: 1, last_used: self.tick });
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

    #[test]
    fn block_hashes_are_vllms() {
        // From CPython 3.11: hashlib.sha256(pickle.dumps((parent, tuple(tokens), None), 5)),
        // the first parent hashlib.sha256(pickle.dumps("vllm-none-hash", 5)).
        let hex = |h: &BlockHash| h.0.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(hex(&BlockHash::none()), "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198");
        let a = BlockHash::of(None, &(250..266).collect::<Vec<u32>>());
        assert_eq!(hex(&a), "ea81352c8694f5b1c00f88736e32cede489d35b615b3babe916a3c9fa17466f1");
        assert_eq!(a.id(), 10478254139337107185);
        // Every integer opcode: BININT1, BININT2, BININT, LONG1.
        let wide = [0, 255, 256, 65535, 65536, (1 << 31) - 1, 1 << 31, u32::MAX, 7, 8, 9, 10, 11, 12, 13, 14];
        let b = BlockHash::of(Some(&a), &wide);
        assert_eq!(hex(&b), "d6c0c7c680ec9588367f7295783885cf4efd4f327b6586eb57a39efb201b531d");
        // A short block: TUPLE2, no MARK.
        assert_eq!(BlockHash::of(Some(&b), &[1, 2]).id(), 14746757103545265928);
    }

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
            vec![KvEvent::Stored {
                hashes: hb[2..].iter().map(BlockHash::id).collect(),
                parent: Some(hb[1].id()),
                token_ids: b[8..].to_vec()
            }]
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
        assert_eq!(removed, vec![ha[5].id(), ha[4].id(), ha[3].id()]);
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
