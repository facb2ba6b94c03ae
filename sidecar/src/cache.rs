//! One worker's KV cache as the router sees it: which blocks (named by router hash) the
//! worker holds, kept in step with its engine's events.
//!
//! The engine names blocks by its own hashes, which the router cannot reproduce; the router
//! names them by the chained hash of their tokens (`kvroute::hash`). A `BlockStored` gives
//! both: its `token_ids`, and its parent's *engine* hash, which this map turns into the
//! parent's router hash. So each worker keeps
//!
//! - per data-parallel rank, `engine hash → router hash(es)` (for parents and removals), and
//! - `router hash → (anchor, position, holders)`: what the feed publishes.
//!
//! A block can be held several times over: by several DP ranks, in several full-attention
//! KV-cache groups, in GPU memory and in offload tiers. The worker holds it while any copy
//! exists. Storing a held GPU copy again changes nothing (vLLM re-announces reused blocks in
//! its `full` report mode, with no removal to match). Offload-tier copies are counted: vLLM's
//! offloading connector announces a block once per chunk and medium that holds it, and
//! removes it as often, and asks consumers to count.
//!
//! ## What `cache_hits` means for groups that are not full attention
//!
//! vLLM's own rule (`HybridKVCacheCoordinator.find_longest_cache_hit`, 0.33) is the
//! reference: a request hits the longest block-aligned prefix of length L such that every
//! full-attention group holds all blocks before L, every sliding-window group holds the
//! `ceil((window − 1) / block_size)` blocks just before L, and every Mamba group holds the
//! state block ending at L; the groups are checked in turn until L no longer shrinks.
//!
//! Only the first condition is a property of each block on its own, so only full-attention
//! groups are indexed: a block counts while a full-attention group holds it, and blocks of
//! sliding-window, chunked-local, Mamba, encoder and cross-attention groups, and of kinds this
//! sidecar does not know, are skipped ([`Outcome::NotFullAttention`]). `cache_hits(w)`, the
//! leading run of held blocks, is then exactly vLLM's hit for models with full attention
//! only, and an upper bound for hybrid models: equal when the other groups hold their state
//! at the end of the shared prefix (a repeated or continued prompt), larger when the
//! request leaves a cached prompt where they hold none. A group's kind comes with its
//! stores (vLLM ≥ 0.22); before that every group counts as full attention.
//!
//! Hashing beyond the block (vLLM's `lookahead_token_ids`, SGLang's EAGLE bigram pages) makes
//! an engine block a hit only if the next few tokens match too; the router hashes a block's
//! own tokens, so it may count one block more than the engine uses where a request diverges
//! within those tokens.

use crate::checkpoint::{Reader, Writer};
use crate::events::{BlockRemoved, BlockStored, ExtraKeys, GroupKind, Medium};
use crate::table::HashTable;
use kvroute::feed::FeedBlock;
use kvroute::hash::{namespace, BlockId, Chain, BASE_NAMESPACE};

/// Copies are tracked per (KV-cache group, medium) in a 32-bit mask: 16 groups.
pub const MAX_GROUPS: u32 = 16;

/// A change to the worker's published block set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Now held, with a copy in GPU memory.
    Store(FeedBlock),
    /// Now held only in an offload tier (newly, or its last GPU copy went).
    StoreOffloaded(FeedBlock),
    Remove(FeedBlock),
}

/// What became of one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Applied; the published set may or may not have changed.
    Applied,
    /// The parent's engine hash is unknown (its store was missed or skipped): the chain is
    /// skipped rather than hashed from a wrong root.
    UnknownParent,
    /// The engine's block size is not a multiple of the router's.
    BlockSizeMismatch,
    /// Token count, hash count and block size disagree; or the group index is out of range.
    Malformed,
    /// Hashed by the engine with inputs a request cannot name (multimodal identifiers, a
    /// LoRA adapter known only by its numeric id): the router cannot reproduce its identity,
    /// so it is not indexed (and its descendants will have an unknown parent).
    Unroutable,
    /// A removal of a block this index does not hold (its store was skipped or missed).
    NotHeld,
    /// A block of a KV-cache group that is not full attention: not indexed (module docs).
    NotFullAttention,
    /// An offload placeholder (no tokens) for an engine block this index never saw stored
    /// with its tokens, so its router hash is unknown.
    UnknownBlock,
}

impl Outcome {
    pub const ALL: [Outcome; 8] = [
        Outcome::Applied,
        Outcome::UnknownParent,
        Outcome::BlockSizeMismatch,
        Outcome::Malformed,
        Outcome::Unroutable,
        Outcome::NotHeld,
        Outcome::NotFullAttention,
        Outcome::UnknownBlock,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::UnknownParent => "unknown_parent",
            Outcome::BlockSizeMismatch => "block_size_mismatch",
            Outcome::Malformed => "malformed",
            Outcome::Unroutable => "unroutable",
            Outcome::NotHeld => "not_held",
            Outcome::NotFullAttention => "not_full_attention",
            Outcome::UnknownBlock => "unknown_block",
        }
    }
}

/// One engine block as one rank holds it. An engine block the size of the router's block
/// is one entry under its engine hash. One that covers `span` router blocks (its size a
/// multiple of the router's) is `span` entries: the last router block under the engine
/// hash (what a child's parent link finds), the others under [`part_key`]s. Kept at 16
/// bytes: this table is most of the sidecar's memory.
#[derive(Debug, Clone, Copy, Default)]
struct EngineBlock {
    router: u64,
    /// Bit `2·group + tier` (tier 0 = GPU, 1 = offloaded) per copy the engine holds; the
    /// same on every entry of one engine block.
    copies: u32,
    /// Router blocks the engine block covers, on its main entry; 0 on the other parts.
    span: u32,
}

/// Where part `j` (0-based, `j < span − 1`) of a split engine block is kept.
fn part_key(engine_hash: u64, j: u32) -> u64 {
    engine_hash ^ 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(u64::from(j) + 1)
}

/// The main entry of an engine block (never a part of another one).
fn main_entry(engine: &HashTable<EngineBlock>, engine_hash: u64) -> Option<EngineBlock> {
    engine.get(&engine_hash).copied().filter(|e| e.span > 0)
}

/// Every router hash of the engine block whose main entry is `main`.
fn routers_of(engine: &HashTable<EngineBlock>, engine_hash: u64, main: EngineBlock) -> Vec<u64> {
    let mut out: Vec<u64> =
        (0..main.span - 1).filter_map(|j| engine.get(&part_key(engine_hash, j)).map(|e| e.router)).collect();
    out.push(main.router);
    out
}

/// Removes an engine block (all its entries); returns its router hashes.
fn remove_engine_block(engine: &mut HashTable<EngineBlock>, engine_hash: u64, main: EngineBlock) -> Vec<u64> {
    let routers = routers_of(engine, engine_hash, main);
    for j in 0..main.span - 1 {
        engine.remove(&part_key(engine_hash, j));
    }
    engine.remove(&engine_hash);
    routers
}

fn set_copies(engine: &mut HashTable<EngineBlock>, engine_hash: u64, main: EngineBlock, copies: u32) {
    for key in (0..main.span - 1).map(|j| part_key(engine_hash, j)).chain([engine_hash]) {
        if let Some(e) = engine.get_mut(&key) {
            e.copies = copies;
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct RouterBlock {
    anchor: u64,
    /// 0-based position in its chain.
    pos: u32,
    /// Engine blocks (over all ranks) holding a copy.
    holders: u16,
    /// Those of them holding it in GPU memory.
    gpu_holders: u16,
}

/// What one DP rank of the worker holds.
#[derive(Debug, Default)]
struct Rank {
    /// Engine hash (and part keys of split engine blocks) → router block.
    engine: HashTable<EngineBlock>,
    /// Offload-tier copies announced again while held: how many more removals they take,
    /// per [`extra_key`] (engine block, copy bit). Empty unless the engine re-announces.
    extra_offloaded: HashTable<u32>,
    /// Bit `g`: KV-cache group `g` is known, from its stores, not to be full attention.
    not_full: u32,
}

impl Rank {
    fn learn_kind(&mut self, group: u32, kind: GroupKind) {
        if kind == GroupKind::Full {
            self.not_full &= !(1 << group);
        } else {
            self.not_full |= 1 << group;
        }
    }

    fn is_full(&self, group: u32) -> bool {
        self.not_full & (1 << group) == 0
    }

    /// One more copy (`bit`) of the held engine block `h` (main entry `e`).
    fn add_copy(
        &mut self,
        blocks: &mut HashTable<RouterBlock>,
        h: u64,
        e: EngineBlock,
        bit: u32,
        out: &mut Vec<Change>,
    ) {
        if e.copies & bit != 0 {
            if bit & GPU_BITS == 0 {
                *self.extra_offloaded.get_or_insert_with(extra_key(h, bit), || 0) += 1;
            }
            return;
        }
        set_copies(&mut self.engine, h, e, e.copies | bit);
        if bit & GPU_BITS != 0 && e.copies & GPU_BITS == 0 {
            for r in routers_of(&self.engine, h, e) {
                gpu_gained(blocks, r, out);
            }
        }
    }

    /// Takes one announcement of an offload copy that was announced more than once; false
    /// if this is its last.
    fn take_extra(&mut self, h: u64, bit: u32) -> bool {
        if bit & GPU_BITS != 0 || self.extra_offloaded.is_empty() {
            return false;
        }
        let key = extra_key(h, bit);
        match self.extra_offloaded.get_mut(&key) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.extra_offloaded.remove(&key);
            }
            None => return false,
        }
        true
    }

    /// Forgets the extra announcements of every copy in `copies` of engine block `h`.
    fn forget_extras(&mut self, h: u64, copies: u32) {
        if self.extra_offloaded.is_empty() {
            return;
        }
        for b in 0..2 * MAX_GROUPS {
            if copies & !GPU_BITS & (1 << b) != 0 {
                self.extra_offloaded.remove(&extra_key(h, 1 << b));
            }
        }
    }
}

/// Where the extra announcements of copy `bit` of engine block `h` are counted.
fn extra_key(h: u64, bit: u32) -> u64 {
    h ^ 0xD6E8_FEB8_6659_FD93u64.wrapping_mul(u64::from(bit.trailing_zeros()) + 1)
}

#[derive(Debug, Default)]
pub struct WorkerCache {
    /// Per DP rank.
    ranks: Vec<Rank>,
    blocks: HashTable<RouterBlock>,
    /// Scratch for `apply_stored`: one router block's token bytes, one engine block's
    /// router blocks (hash, anchor, position).
    block_le: Vec<u8>,
    routers: Vec<BlockId>,
}

fn copy_bit(group: u32, medium: Medium) -> u32 {
    1 << (2 * group + u32::from(medium == Medium::Offloaded))
}

const GPU_BITS: u32 = 0x5555_5555;

impl WorkerCache {
    pub fn new(dp_ranks: usize) -> Self {
        WorkerCache { ranks: (0..dp_ranks.max(1)).map(|_| Rank::default()).collect(), ..WorkerCache::default() }
    }

    /// Distinct blocks the worker holds (any tier).
    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// Of them, held only in an offload tier.
    pub fn offloaded_count(&self) -> usize {
        self.blocks.values().filter(|b| b.gpu_holders == 0).count()
    }

    /// Every block held, as the feed names it, and whether it is held only offloaded.
    pub fn feed_blocks(&self) -> impl Iterator<Item = (FeedBlock, bool)> + '_ {
        self.blocks.iter().map(|(h, b)| (FeedBlock { hash: h, anchor: b.anchor }, b.gpu_holders == 0))
    }

    pub fn apply_stored(
        &mut self,
        rank: usize,
        ev: &BlockStored,
        router_block_size: u32,
        out: &mut Vec<Change>,
    ) -> Outcome {
        if ev.group_idx >= MAX_GROUPS {
            return Outcome::Malformed;
        }
        let Some(r) = self.ranks.get_mut(rank) else {
            return Outcome::Malformed;
        };
        if let Some(kind) = ev.group_kind {
            r.learn_kind(ev.group_idx, kind);
        }
        // Before the size checks: a sliding-window group's store skips the blocks that fell
        // out of its window but still carries all their tokens.
        if !r.is_full(ev.group_idx) {
            return Outcome::NotFullAttention;
        }
        let bit = copy_bit(ev.group_idx, ev.medium);
        if ev.is_placeholder() {
            return store_placeholder(r, &mut self.blocks, ev, bit, out);
        }
        let engine_bs = ev.block_size as usize;
        let rbs = router_block_size as usize;
        if engine_bs == 0 || ev.token_ids.len() != ev.block_hashes.len() * engine_bs {
            return Outcome::Malformed;
        }
        if rbs == 0 || !engine_bs.is_multiple_of(rbs) {
            return Outcome::BlockSizeMismatch;
        }
        let chain_namespace = match namespace_of(ev) {
            Ok(ns) => ns,
            Err(outcome) => return outcome,
        };
        let mut chain = match ev.parent {
            None => Chain::start(chain_namespace),
            Some(p) => {
                let Some(router) = main_entry(&r.engine, p).map(|e| e.router) else {
                    return Outcome::UnknownParent;
                };
                let Some(rb) = self.blocks.get(&router) else {
                    return Outcome::UnknownParent;
                };
                Chain::after(BlockId { hash: router, anchor: rb.anchor, pos: rb.pos })
            }
        };
        let (block_le, routers) = (&mut self.block_le, &mut self.routers);
        for (i, &engine_hash) in ev.block_hashes.iter().enumerate() {
            let tokens = &ev.token_ids[i * engine_bs..(i + 1) * engine_bs];
            routers.clear();
            for sub in tokens.chunks_exact(rbs) {
                block_le.clear();
                block_le.extend(sub.iter().flat_map(|t| t.to_le_bytes()));
                routers.push(chain.push(block_le));
            }
            let span = routers.len() as u32;
            let gpu = bit & GPU_BITS != 0;
            match main_entry(&r.engine, engine_hash) {
                // The chain hash of the last part names all of them.
                Some(e) if e.router == routers[routers.len() - 1].hash && e.span == span => {
                    r.add_copy(&mut self.blocks, engine_hash, e, bit, out);
                    continue;
                }
                Some(e) => {
                    // Same engine hash, other tokens or parent: the engine reused the hash
                    // (it restarted, or hashes collided). The new content replaces the old.
                    r.forget_extras(engine_hash, e.copies);
                    let old = remove_engine_block(&mut r.engine, engine_hash, e);
                    release(&mut self.blocks, &old, e.copies & GPU_BITS != 0, out);
                }
                None => {}
            }
            for (j, &BlockId { hash, anchor, pos }) in routers.iter().enumerate() {
                let b = self.blocks.get_or_insert_with(hash, || {
                    let block = FeedBlock { hash, anchor };
                    out.push(if gpu { Change::Store(block) } else { Change::StoreOffloaded(block) });
                    RouterBlock { anchor, pos, holders: 0, gpu_holders: 0 }
                });
                b.holders = b.holders.saturating_add(1);
                if gpu {
                    b.gpu_holders = b.gpu_holders.saturating_add(1);
                    if b.gpu_holders == 1 && b.holders > 1 {
                        out.push(Change::Store(FeedBlock { hash, anchor: b.anchor }));
                        // back on a GPU
                    }
                }
                let (key, entry_span) =
                    if j + 1 == routers.len() { (engine_hash, span) } else { (part_key(engine_hash, j as u32), 0) };
                r.engine.insert(key, EngineBlock { router: hash, copies: bit, span: entry_span });
            }
        }
        Outcome::Applied
    }

    pub fn apply_removed(&mut self, rank: usize, ev: &BlockRemoved, out: &mut Vec<Change>) -> Outcome {
        if ev.group_idx >= MAX_GROUPS {
            return Outcome::Malformed;
        }
        let Some(r) = self.ranks.get_mut(rank) else {
            return Outcome::Malformed;
        };
        if !r.is_full(ev.group_idx) {
            return Outcome::NotFullAttention;
        }
        let bit = copy_bit(ev.group_idx, ev.medium);
        let mut all_held = true;
        for &h in &ev.block_hashes {
            let Some(e) = main_entry(&r.engine, h).filter(|e| e.copies & bit != 0) else {
                all_held = false;
                continue;
            };
            if r.take_extra(h, bit) {
                continue; // another announcement of this copy still stands
            }
            let had_gpu = e.copies & GPU_BITS != 0;
            let copies = e.copies & !bit;
            if copies == 0 {
                let old = remove_engine_block(&mut r.engine, h, e);
                release(&mut self.blocks, &old, had_gpu, out);
            } else {
                set_copies(&mut r.engine, h, e, copies);
                if had_gpu && copies & GPU_BITS == 0 {
                    for router in routers_of(&r.engine, h, e) {
                        gpu_lost(&mut self.blocks, router, out);
                    }
                }
            }
        }
        if all_held {
            Outcome::Applied
        } else {
            Outcome::NotHeld
        }
    }

    /// Forgets everything one DP rank holds (`AllBlocksCleared`, a restart, a lost stream).
    /// Returns true if the worker now holds nothing at all. What the rank's groups are is
    /// kept: a cleared cache has the same layout.
    pub fn clear_rank(&mut self, rank: usize, out: &mut Vec<Change>) -> bool {
        let sole = self.ranks.len() == 1;
        if let Some(r) = self.ranks.get_mut(rank) {
            r.extra_offloaded.clear();
            if sole {
                // Sole rank: drop everything at once (the caller publishes a CLEAR).
                r.engine.clear();
                self.blocks.clear();
            } else {
                // Every entry, main or part, holds one router block with the copies of its
                // engine block.
                for (_, e) in r.engine.drain() {
                    release(&mut self.blocks, &[e.router], e.copies & GPU_BITS != 0, out);
                }
            }
        }
        self.blocks.is_empty()
    }

    /// The engine hash of every engine block each DP rank holds, sorted: what the engine's
    /// own cache should list (the admin API's `/v1/admin/engine-blocks/`).
    pub fn engine_blocks(&self) -> Vec<Vec<u64>> {
        let per_rank = |r: &Rank| {
            let mut v: Vec<u64> = r.engine.iter().filter(|(_, e)| e.span > 0).map(|(h, _)| h).collect();
            v.sort_unstable();
            v
        };
        self.ranks.iter().map(per_rank).collect()
    }

    /// Writes everything the cache holds, for a checkpoint (`crate::checkpoint`).
    pub fn save(&self, out: &mut Writer) {
        out.u32(self.ranks.len() as u32);
        for r in &self.ranks {
            out.u32(r.not_full);
            out.u64(r.engine.len() as u64);
            for (k, e) in r.engine.iter() {
                out.u64(k);
                out.u64(e.router);
                out.u32(e.copies);
                out.u32(e.span);
            }
            out.u64(r.extra_offloaded.len() as u64);
            for (k, n) in r.extra_offloaded.iter() {
                out.u64(k);
                out.u32(*n);
            }
        }
        out.u64(self.blocks.len() as u64);
        for (h, b) in self.blocks.iter() {
            out.u64(h);
            out.u64(b.anchor);
            out.u32(b.pos);
            out.u16(b.holders);
            out.u16(b.gpu_holders);
        }
    }

    /// Reads what [`WorkerCache::save`] wrote, for a worker of `dp_ranks` ranks. The
    /// holder counts must agree with the engine entries, so a record that was not written
    /// by `save` (or by another layout of it) is refused rather than half trusted.
    pub fn load(input: &mut Reader<'_>, dp_ranks: usize) -> Result<WorkerCache, String> {
        let n_ranks = input.u32()? as usize;
        if n_ranks != dp_ranks.max(1) {
            return Err(format!("{n_ranks} ranks saved, the worker has {dp_ranks}"));
        }
        let mut cache = WorkerCache::new(n_ranks);
        // Each table sized first (`HashTable::with_capacity` says why).
        for r in &mut cache.ranks {
            r.not_full = input.u32()?;
            let n = input.count(24)?;
            r.engine = HashTable::with_capacity(n);
            for _ in 0..n {
                let (k, router, copies, span) = (input.u64()?, input.u64()?, input.u32()?, input.u32()?);
                r.engine.insert(k, EngineBlock { router, copies, span });
            }
            let n = input.count(12)?;
            r.extra_offloaded = HashTable::with_capacity(n);
            for _ in 0..n {
                let (k, n) = (input.u64()?, input.u32()?);
                r.extra_offloaded.insert(k, n);
            }
        }
        let n = input.count(24)?;
        cache.blocks = HashTable::with_capacity(n);
        for _ in 0..n {
            let (h, anchor, pos, holders, gpu_holders) =
                (input.u64()?, input.u64()?, input.u32()?, input.u16()?, input.u16()?);
            cache.blocks.insert(h, RouterBlock { anchor, pos, holders, gpu_holders });
        }
        // An engine block of span s is s entries (its main one and s − 1 parts), each with
        // its copies.
        for r in &cache.ranks {
            let spans: u64 = r.engine.values().map(|e| u64::from(e.span)).sum();
            if spans != r.engine.len() as u64 || r.engine.values().any(|e| e.copies == 0) {
                return Err("engine blocks and their parts disagree".into());
            }
        }
        // Every engine entry holds one router block with its engine block's copies.
        let mut held: HashTable<(u16, u16)> = HashTable::default();
        for e in cache.ranks.iter().flat_map(|r| r.engine.values()) {
            let c = held.get_or_insert_with(e.router, || (0, 0));
            c.0 = c.0.saturating_add(1);
            c.1 = c.1.saturating_add(u16::from(e.copies & GPU_BITS != 0));
        }
        if held.len() != cache.blocks.len()
            || !cache.blocks.iter().all(|(h, b)| held.get(&h) == Some(&(b.holders, b.gpu_holders)))
        {
            return Err("holder counts disagree with the engine blocks".into());
        }
        Ok(cache)
    }

    /// Heap bytes held by the tables.
    pub fn heap_bytes(&self) -> usize {
        self.ranks.iter().map(|r| r.engine.heap_bytes() + r.extra_offloaded.heap_bytes()).sum::<usize>()
            + self.blocks.heap_bytes()
    }
}

/// vLLM's offload placeholder: an offload tier holds engine blocks known only by hash. Each
/// is found among the blocks stored with their tokens (the offloading connector offloads
/// what the GPU holds, so its GPU store came first).
fn store_placeholder(
    r: &mut Rank,
    blocks: &mut HashTable<RouterBlock>,
    ev: &BlockStored,
    bit: u32,
    out: &mut Vec<Change>,
) -> Outcome {
    if ev.medium != Medium::Offloaded {
        return Outcome::Malformed;
    }
    let mut all_known = true;
    for &h in &ev.block_hashes {
        match main_entry(&r.engine, h) {
            Some(e) => r.add_copy(blocks, h, e, bit, out),
            None => all_known = false,
        }
    }
    if all_known {
        Outcome::Applied
    } else {
        Outcome::UnknownBlock
    }
}

/// The namespace a `BlockStored` starts its chain in (used only when it has no parent;
/// children inherit it through their parent's hash).
///
/// vLLM's `extra_keys` per block are the block's multimodal identifiers, then the LoRA
/// adapter's name, then — on a request's first block only — its cache salt. So: every
/// string equal to `lora_name` is the adapter; on the chain's first block one other string
/// is the salt; anything else (multimodal inputs, non-string keys) cannot come from a
/// request's tokens and makes the event unroutable. SGLang names the salt in its own
/// `cache_salt` field instead.
fn namespace_of(ev: &BlockStored) -> Result<u64, Outcome> {
    if ev.lora_id.is_some() && ev.lora_name.is_none() {
        return Err(Outcome::Unroutable); // adapter known only by id (old vLLM)
    }
    if !ev.extra_keys.is_empty() && ev.extra_keys.len() != ev.block_hashes.len() {
        return Err(Outcome::Malformed);
    }
    let mut salt = None;
    for (i, keys) in ev.extra_keys.iter().enumerate() {
        match keys {
            ExtraKeys::None => {}
            ExtraKeys::Opaque => return Err(Outcome::Unroutable),
            ExtraKeys::Strings(strings) => {
                let mut others = strings.iter().filter(|s| Some(s.as_str()) != ev.lora_name.as_deref());
                let first = others.next();
                let chain_start = i == 0 && ev.parent.is_none();
                match (first, others.next()) {
                    (None, _) => {}
                    (Some(s), None) if chain_start => salt = Some(s.as_str()),
                    _ => return Err(Outcome::Unroutable),
                }
            }
        }
    }
    let salt = match (ev.cache_salt.as_deref(), salt) {
        (Some(a), Some(b)) if a != b => return Err(Outcome::Malformed),
        (a, b) => a.or(b),
    };
    if ev.parent.is_some() {
        return Ok(BASE_NAMESPACE); // unused: the parent's hash carries the namespace
    }
    Ok(namespace(ev.lora_name.as_deref().map(str::as_bytes), salt.map(str::as_bytes)))
}

/// Drops one engine block's hold on its router blocks; `gpu`: it held a GPU copy.
fn release(blocks: &mut HashTable<RouterBlock>, routers: &[u64], gpu: bool, out: &mut Vec<Change>) {
    for &h in routers {
        let Some(b) = blocks.get_mut(&h) else { continue };
        b.holders = b.holders.saturating_sub(1);
        if b.holders == 0 {
            let anchor = b.anchor;
            blocks.remove(&h);
            out.push(Change::Remove(FeedBlock { hash: h, anchor }));
        } else if gpu {
            gpu_lost(blocks, h, out);
        }
    }
}

/// One more holder has router block `h` in GPU memory.
fn gpu_gained(blocks: &mut HashTable<RouterBlock>, h: u64, out: &mut Vec<Change>) {
    if let Some(b) = blocks.get_mut(&h) {
        b.gpu_holders = b.gpu_holders.saturating_add(1);
        if b.gpu_holders == 1 {
            out.push(Change::Store(FeedBlock { hash: h, anchor: b.anchor }));
        }
    }
}

/// One holder less has router block `h` in GPU memory (it keeps a copy elsewhere).
fn gpu_lost(blocks: &mut HashTable<RouterBlock>, h: u64, out: &mut Vec<Change>) {
    if let Some(b) = blocks.get_mut(&h) {
        b.gpu_holders = b.gpu_holders.saturating_sub(1);
        if b.gpu_holders == 0 && b.holders > 0 {
            out.push(Change::StoreOffloaded(FeedBlock { hash: h, anchor: b.anchor }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>, bs: u32) -> BlockStored {
        BlockStored::on_gpu(hashes, parent, tokens, bs)
    }

    fn removed(hashes: &[u64]) -> BlockRemoved {
        BlockRemoved { block_hashes: hashes.to_vec(), medium: Medium::Gpu, group_idx: 0 }
    }

    fn toks(n: u32) -> Vec<u32> {
        (1000..1000 + n).collect()
    }

    #[test]
    fn router_hashes_match_the_filters_chain_whatever_the_event_split() {
        let tokens = toks(16 * 40);
        let want = FeedBlock::chain(&tokens, 16);
        // One event with all 40 blocks…
        let mut a = WorkerCache::new(1);
        let mut out = Vec::new();
        let hashes: Vec<u64> = (1..=40).collect();
        assert_eq!(a.apply_stored(0, &stored(&hashes, None, tokens.clone(), 16), 16, &mut out), Outcome::Applied);
        let got: Vec<FeedBlock> = out.iter().map(|c| if let Change::Store(b) = c { *b } else { panic!() }).collect();
        assert_eq!(got, want);
        // …or one per block, as SGLang sends pages: the same hashes and anchors.
        let mut b = WorkerCache::new(1);
        let mut out = Vec::new();
        for i in 0..40usize {
            let parent = if i == 0 { None } else { Some(i as u64) };
            let ev = stored(&[i as u64 + 1], parent, tokens[i * 16..(i + 1) * 16].to_vec(), 16);
            assert_eq!(b.apply_stored(0, &ev, 16, &mut out), Outcome::Applied);
        }
        let got: Vec<FeedBlock> = out.iter().map(|c| if let Change::Store(b) = c { *b } else { panic!() }).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn engine_blocks_a_multiple_of_the_router_block_are_split() {
        let tokens = toks(64 * 3);
        let want = FeedBlock::chain(&tokens, 16);
        let mut c = WorkerCache::new(1);
        let mut out = Vec::new();
        assert_eq!(
            c.apply_stored(0, &stored(&[1, 2], None, tokens[..128].to_vec(), 64), 16, &mut out),
            Outcome::Applied
        );
        assert_eq!(
            c.apply_stored(0, &stored(&[3], Some(2), tokens[128..].to_vec(), 64), 16, &mut out),
            Outcome::Applied
        );
        assert_eq!(c.block_count(), 12);
        let mut got: Vec<FeedBlock> = c.feed_blocks().map(|b| b.0).collect();
        let mut w = want.clone();
        got.sort_by_key(|b| b.hash);
        w.sort_by_key(|b| b.hash);
        assert_eq!(got, w);
        // Removing engine block 2 removes its four router blocks.
        out.clear();
        assert_eq!(c.apply_removed(0, &removed(&[2]), &mut out), Outcome::Applied);
        assert_eq!(out.len(), 4);
        assert_eq!(c.block_count(), 8);
        // A CPU copy of engine block 3 (four router blocks) outlives its GPU copy.
        let mut cpu = stored(&[3], Some(2), tokens[128..].to_vec(), 64);
        cpu.medium = Medium::Offloaded;
        c.apply_stored(0, &stored(&[2], Some(1), tokens[64..128].to_vec(), 64), 16, &mut out);
        c.apply_stored(0, &cpu, 16, &mut out);
        assert_eq!((c.block_count(), c.offloaded_count()), (12, 0));
        c.apply_removed(0, &removed(&[3]), &mut out);
        assert_eq!((c.block_count(), c.offloaded_count()), (12, 4));
        // 24 is not a multiple of 16.
        assert_eq!(c.apply_stored(0, &stored(&[9], None, toks(24), 24), 16, &mut out), Outcome::BlockSizeMismatch);
    }

    #[test]
    fn storing_again_is_flat_and_removal_is_exact() {
        let mut c = WorkerCache::new(1);
        let mut out = Vec::new();
        let ev = stored(&[1, 2], None, toks(32), 16);
        c.apply_stored(0, &ev, 16, &mut out);
        assert_eq!(out.len(), 2);
        out.clear();
        c.apply_stored(0, &ev, 16, &mut out);
        assert!(out.is_empty());
        assert_eq!(c.block_count(), 2);
        assert_eq!(c.apply_removed(0, &removed(&[2, 77]), &mut out), Outcome::NotHeld);
        assert_eq!(c.block_count(), 1);
        assert!(matches!(out[..], [Change::Remove(_)]));
    }

    #[test]
    fn unknown_parent_skips_the_chain() {
        let mut c = WorkerCache::new(1);
        let mut out = Vec::new();
        assert_eq!(c.apply_stored(0, &stored(&[5], Some(4), toks(16), 16), 16, &mut out), Outcome::UnknownParent);
        assert_eq!(c.block_count(), 0);
        assert!(out.is_empty());
    }

    #[test]
    fn copies_in_two_tiers_and_two_ranks_hold_until_the_last_goes() {
        let mut c = WorkerCache::new(2);
        let mut out = Vec::new();
        let gpu = stored(&[1], None, toks(16), 16);
        let mut cpu = gpu.clone();
        cpu.medium = Medium::Offloaded;
        c.apply_stored(0, &gpu, 16, &mut out);
        c.apply_stored(0, &cpu, 16, &mut out);
        c.apply_stored(1, &gpu, 16, &mut out);
        assert_eq!((c.block_count(), out.len()), (1, 1));
        c.apply_removed(0, &removed(&[1]), &mut out);
        let mut r1 = removed(&[1]);
        r1.medium = Medium::Gpu;
        c.apply_removed(1, &r1, &mut out);
        // rank 0 still has the CPU copy: held, offloaded only.
        assert_eq!((c.block_count(), c.offloaded_count()), (1, 1));
        let mut rc = removed(&[1]);
        rc.medium = Medium::Offloaded;
        c.apply_removed(0, &rc, &mut out);
        assert_eq!(c.block_count(), 0);
        assert!(matches!(out.last(), Some(Change::Remove(_))));
    }

    #[test]
    fn clearing_one_rank_keeps_the_others_blocks() {
        let mut c = WorkerCache::new(2);
        let mut out = Vec::new();
        c.apply_stored(0, &stored(&[1, 2], None, toks(32), 16), 16, &mut out);
        c.apply_stored(1, &stored(&[7], None, toks(16), 16), 16, &mut out);
        out.clear();
        assert!(!c.clear_rank(0, &mut out));
        assert_eq!(c.block_count(), 1); // block 0 is shared with rank 1
        assert_eq!(out.len(), 1);
        assert!(c.clear_rank(1, &mut out));
    }

    #[test]
    fn lora_and_salted_chains_live_in_their_namespace() {
        let tokens = toks(48);
        let mut c = WorkerCache::new(1);
        let mut out = Vec::new();
        // vLLM: the adapter name in every block's extra keys, the salt in the first one's.
        let mut ev = stored(&[1, 2], None, tokens[..32].to_vec(), 16);
        ev.lora_name = Some("sql".into());
        ev.lora_id = Some(3);
        ev.extra_keys =
            vec![ExtraKeys::Strings(vec!["sql".into(), "tenant-42".into()]), ExtraKeys::Strings(vec!["sql".into()])];
        assert_eq!(c.apply_stored(0, &ev, 16, &mut out), Outcome::Applied);
        let mut child = stored(&[3], Some(2), tokens[32..].to_vec(), 16);
        child.lora_name = Some("sql".into());
        child.extra_keys = vec![ExtraKeys::Strings(vec!["sql".into()])];
        assert_eq!(c.apply_stored(0, &child, 16, &mut out), Outcome::Applied);
        let ns = namespace(Some(b"sql"), Some(b"tenant-42"));
        let mut want = FeedBlock::chain_in(&tokens, 16, ns);
        let mut got: Vec<FeedBlock> = c.feed_blocks().map(|b| b.0).collect();
        want.sort_by_key(|b| b.hash);
        got.sort_by_key(|b| b.hash);
        assert_eq!(got, want);
        // ... and never the base model's blocks.
        assert!(FeedBlock::chain(&tokens, 16).iter().all(|b| !got.contains(b)));
    }

    #[test]
    fn inputs_a_request_cannot_name_are_not_indexed() {
        let mut c = WorkerCache::new(1);
        let mut out = Vec::new();
        let mut by_id = stored(&[1], None, toks(16), 16);
        by_id.lora_id = Some(7);
        assert_eq!(c.apply_stored(0, &by_id, 16, &mut out), Outcome::Unroutable);
        let mut multimodal = stored(&[1, 2], None, toks(32), 16);
        multimodal.extra_keys = vec![ExtraKeys::None, ExtraKeys::Strings(vec!["image-hash".into()])];
        assert_eq!(c.apply_stored(0, &multimodal, 16, &mut out), Outcome::Unroutable);
        let mut opaque = stored(&[1], None, toks(16), 16);
        opaque.extra_keys = vec![ExtraKeys::Opaque];
        assert_eq!(c.apply_stored(0, &opaque, 16, &mut out), Outcome::Unroutable);
        let mut short = stored(&[1, 2], None, toks(32), 16);
        short.extra_keys = vec![ExtraKeys::None];
        assert_eq!(c.apply_stored(0, &short, 16, &mut out), Outcome::Malformed);
        assert_eq!(c.apply_stored(0, &stored(&[1, 2], None, toks(16), 16), 16, &mut out), Outcome::Malformed);
        assert_eq!(c.block_count(), 0);
    }

    fn removed_in(hashes: &[u64], group: u32, medium: Medium) -> BlockRemoved {
        BlockRemoved { block_hashes: hashes.to_vec(), medium, group_idx: group }
    }

    fn placeholder(hashes: &[u64]) -> BlockStored {
        let mut p = stored(hashes, None, Vec::new(), 0);
        p.medium = Medium::Offloaded;
        p
    }

    #[test]
    fn groups_that_are_not_full_attention_are_not_indexed() {
        let tokens = toks(16 * 4);
        let mut c = WorkerCache::new(1);
        let mut out = Vec::new();
        let mut full = stored(&[1, 2, 3, 4], None, tokens.clone(), 16);
        full.group_kind = Some(GroupKind::Full);
        assert_eq!(c.apply_stored(0, &full, 16, &mut out), Outcome::Applied);
        // vLLM's sliding-window store: blocks 0 and 1 fell out of the window (null, no hash),
        // but the event still carries every token.
        let mut swa = stored(&[3, 4], None, tokens.clone(), 16);
        (swa.group_idx, swa.group_kind) = (1, Some(GroupKind::NotFull));
        assert_eq!(c.apply_stored(0, &swa, 16, &mut out), Outcome::NotFullAttention);
        let mut mamba = stored(&[4], Some(3), tokens[48..].to_vec(), 16);
        (mamba.group_idx, mamba.group_kind) = (2, Some(GroupKind::Unknown));
        assert_eq!(c.apply_stored(0, &mamba, 16, &mut out), Outcome::NotFullAttention);
        assert_eq!(c.block_count(), 4);
        // Their removals and their offload placeholders (which carry no kind) are known as
        // theirs, and the full-attention copies stay.
        assert_eq!(c.apply_removed(0, &removed_in(&[3, 4], 1, Medium::Gpu), &mut out), Outcome::NotFullAttention);
        let mut p = placeholder(&[4]);
        p.group_idx = 1;
        assert_eq!(c.apply_stored(0, &p, 16, &mut out), Outcome::NotFullAttention);
        assert_eq!((c.block_count(), c.offloaded_count()), (4, 0));
        // A group is what its latest store says.
        let mut again = stored(&[1], None, tokens[..16].to_vec(), 16);
        (again.group_idx, again.group_kind) = (1, Some(GroupKind::Full));
        assert_eq!(c.apply_stored(0, &again, 16, &mut out), Outcome::Applied);
        assert_eq!(c.apply_removed(0, &removed_in(&[1], 1, Medium::Gpu), &mut out), Outcome::Applied);
    }

    /// vLLM 0.33's hit length in blocks, transcribed from `HybridKVCacheCoordinator.
    /// find_longest_cache_hit` and the `find_longest_cache_hit` of `FullAttentionManager`,
    /// `SlidingWindowManager` and `MambaManager` (block size = hash block size, no EAGLE):
    /// each group in turn shortens the candidate length until none does.
    fn vllm_hit(n: usize, full: &[bool], swa: Option<(&[bool], usize)>, mamba: Option<&[bool]>) -> usize {
        let mut len = n;
        loop {
            let before = len;
            len = full[..len].iter().take_while(|h| **h).count();
            if let Some((held, window_blocks)) = swa {
                // Right to left: the first run of `window_blocks` held blocks ends the hit;
                // with none, the run from block 0.
                let mut run = 0;
                let mut hit = None;
                for i in (0..len).rev() {
                    run = if held[i] { run + 1 } else { 0 };
                    if run >= window_blocks {
                        hit = Some(i + window_blocks);
                        break;
                    }
                }
                len = hit.unwrap_or(run);
            }
            if let Some(held) = mamba {
                len = (1..=len).rev().find(|&p| held[p - 1]).unwrap_or(0);
            }
            if len == before {
                return len;
            }
        }
    }

    #[test]
    fn cache_hits_are_vllms_for_full_attention_and_bound_them_for_hybrid_models() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % m) as usize
        };
        let (mut equal, mut bounded) = (0, 0);
        for trial in 0..600 {
            let n = 1 + rnd(20);
            let tokens = toks(16 * n as u32);
            let chain = FeedBlock::chain(&tokens, 16);
            let hashes: Vec<u64> = (1..=n as u64).collect();
            let mut held = |p: usize| (0..n).map(|_| rnd(100) < p).collect::<Vec<bool>>();
            let full = held(85);
            let other = held(60);
            let window_blocks = 1 + rnd(4);
            let model = trial % 3; // full attention only; + sliding window; + Mamba

            // The engine's events: the full-attention group stores the chain and evicts
            // what it no longer holds; the other group stores what it holds.
            let mut c = WorkerCache::new(1);
            let mut out = Vec::new();
            let mut ev = stored(&hashes, None, tokens.clone(), 16);
            ev.group_kind = Some(GroupKind::Full);
            c.apply_stored(0, &ev, 16, &mut out);
            let evicted: Vec<u64> = (0..n).filter(|&i| !full[i]).map(|i| hashes[i]).collect();
            c.apply_removed(0, &removed_in(&evicted, 0, Medium::Gpu), &mut out);
            if model > 0 {
                let kept: Vec<u64> = (0..n).filter(|&i| other[i]).map(|i| hashes[i]).collect();
                let mut o = stored(&kept, None, tokens.clone(), 16);
                (o.group_idx, o.group_kind) = (1, Some(GroupKind::NotFull));
                assert_eq!(c.apply_stored(0, &o, 16, &mut out), Outcome::NotFullAttention);
            }
            let index: std::collections::HashSet<u64> = c.feed_blocks().map(|(b, _)| b.hash).collect();
            let ours = chain.iter().take_while(|b| index.contains(&b.hash)).count();

            let swa = (model == 1).then_some((other.as_slice(), window_blocks));
            let mamba = (model == 2).then_some(other.as_slice());
            let theirs = vllm_hit(n, &full, swa, mamba);
            assert!(ours >= theirs, "trial {trial}: ours {ours} < vLLM's {theirs}");
            // Equal whenever the other group holds its state at the end of our prefix.
            let state_at_end = match model {
                0 => true,
                1 => (ours.saturating_sub(window_blocks)..ours).all(|i| other[i]),
                _ => ours == 0 || other[ours - 1],
            };
            if state_at_end {
                assert_eq!(ours, theirs, "trial {trial}: model {model}");
                equal += 1;
            } else {
                bounded += 1;
            }
        }
        // Both cases were exercised.
        assert!(equal > 100 && bounded > 50, "{equal} equal, {bounded} bounded");
    }

    #[test]
    fn offload_placeholders_name_blocks_stored_with_their_tokens() {
        let tokens = toks(16 * 3);
        let mut c = WorkerCache::new(1);
        let mut out = Vec::new();
        c.apply_stored(0, &stored(&[1, 2, 3], None, tokens, 16), 16, &mut out);
        // vLLM's offloading connector without self-describing events: hash only, block_size 0.
        assert_eq!(c.apply_stored(0, &placeholder(&[2, 3]), 16, &mut out), Outcome::Applied);
        assert_eq!(c.apply_removed(0, &removed(&[2, 3]), &mut out), Outcome::Applied);
        assert_eq!((c.block_count(), c.offloaded_count()), (3, 2));
        // A hash never stored with tokens cannot be indexed; a GPU "placeholder" is malformed.
        assert_eq!(c.apply_stored(0, &placeholder(&[2, 99]), 16, &mut out), Outcome::UnknownBlock);
        let mut gpu = placeholder(&[1]);
        gpu.medium = Medium::Gpu;
        assert_eq!(c.apply_stored(0, &gpu, 16, &mut out), Outcome::Malformed);
        // Block 2's CPU copy was announced twice (two placeholders): it takes two removals.
        assert_eq!(c.apply_removed(0, &removed_in(&[2, 3], 0, Medium::Offloaded), &mut out), Outcome::Applied);
        assert_eq!(c.block_count(), 2);
        assert_eq!(c.apply_removed(0, &removed_in(&[2], 0, Medium::Offloaded), &mut out), Outcome::Applied);
        assert_eq!(c.block_count(), 1);
    }

    #[test]
    fn self_describing_offload_stores_are_counted_per_announcement() {
        // Two chunks of 4 blocks that share blocks 0-1 (a prefix ending mid-chunk): vLLM
        // announces the shared blocks once per chunk and removes them with each chunk.
        let (a, b) = (toks(16 * 4), [toks(32), (5000..5032).collect()].concat());
        let mut c = WorkerCache::new(1);
        let mut out = Vec::new();
        let cpu = |hashes: &[u64], tokens: &[u32]| {
            let mut e = stored(hashes, None, tokens.to_vec(), 16);
            e.medium = Medium::Offloaded;
            e
        };
        assert_eq!(c.apply_stored(0, &cpu(&[1, 2, 3, 4], &a), 16, &mut out), Outcome::Applied);
        assert_eq!(c.apply_stored(0, &cpu(&[1, 2, 7, 8], &b), 16, &mut out), Outcome::Applied);
        assert_eq!((c.block_count(), c.offloaded_count()), (6, 6));
        c.apply_removed(0, &removed_in(&[1, 2, 3, 4], 0, Medium::Offloaded), &mut out);
        assert_eq!(c.block_count(), 4, "the second chunk still holds blocks 0-1");
        c.apply_removed(0, &removed_in(&[1, 2, 7, 8], 0, Medium::Offloaded), &mut out);
        assert_eq!(c.block_count(), 0);
        // GPU re-announcements (vLLM's `full` report mode) are not counted: one removal goes.
        c.apply_stored(0, &stored(&[1], None, toks(16), 16), 16, &mut out);
        c.apply_stored(0, &stored(&[1], None, toks(16), 16), 16, &mut out);
        c.apply_removed(0, &removed(&[1]), &mut out);
        assert_eq!(c.block_count(), 0);
    }

    /// Blocks (hash, anchor, offloaded only) and engine blocks per rank.
    type View = (Vec<(u64, u64, bool)>, Vec<Vec<u64>>);

    /// Everything a cache shows, in an order that does not depend on its tables' layout.
    fn view(c: &WorkerCache) -> View {
        let mut blocks: Vec<(u64, u64, bool)> = c.feed_blocks().map(|(b, off)| (b.hash, b.anchor, off)).collect();
        blocks.sort_unstable();
        (blocks, c.engine_blocks())
    }

    #[test]
    fn a_saved_cache_loads_back_and_goes_on_as_the_original() {
        // Two ranks; engine blocks of 32 tokens split into two router blocks; copies on the
        // GPU and offloaded, one of them announced twice.
        let mut a = WorkerCache::new(2);
        let mut out = Vec::new();
        a.apply_stored(0, &stored(&[1, 2], None, toks(64), 32), 16, &mut out);
        a.apply_stored(1, &stored(&[1], None, toks(32), 32), 16, &mut out);
        a.apply_stored(0, &placeholder(&[2]), 16, &mut out);
        a.apply_stored(0, &placeholder(&[2]), 16, &mut out);
        a.apply_removed(0, &removed(&[2]), &mut out);
        let mut saved = Writer::default();
        a.save(&mut saved);
        let mut b = WorkerCache::load(&mut Reader::new(&saved.0), 2).unwrap();
        assert_eq!(view(&b), view(&a));
        assert_eq!((b.block_count(), b.offloaded_count()), (a.block_count(), a.offloaded_count()));
        // What follows (a child of a saved block, the offloaded copy announced twice going
        // twice, a rank's copy going) changes both alike.
        let (mut out_a, mut out_b) = (Vec::new(), Vec::new());
        let next = stored(&[3], Some(1), toks(64)[32..].to_vec(), 32);
        assert_eq!(b.apply_stored(1, &next, 16, &mut out_b), a.apply_stored(1, &next, 16, &mut out_a));
        for ev in [removed_in(&[2], 0, Medium::Offloaded), removed_in(&[2], 0, Medium::Offloaded), removed(&[1])] {
            assert_eq!(b.apply_removed(0, &ev, &mut out_b), a.apply_removed(0, &ev, &mut out_a));
        }
        assert_eq!(out_b, out_a);
        assert_eq!(view(&b), view(&a));
        // Another rank count, a cut record, or holders that disagree: refused.
        assert!(WorkerCache::load(&mut Reader::new(&saved.0), 1).is_err());
        for cut in 0..saved.0.len() {
            let mut input = Reader::new(&saved.0[..cut]);
            assert!(WorkerCache::load(&mut input, 2).is_err(), "cut {cut}");
        }
        let mut bad = saved.0.clone();
        let last = bad.len() - 4; // the last block's holder count
        bad[last] ^= 1;
        assert!(WorkerCache::load(&mut Reader::new(&bad), 2).unwrap_err().contains("holder"));
    }

    #[test]
    fn sglang_names_the_salt_in_its_own_field() {
        let tokens = toks(32);
        let mut c = WorkerCache::new(1);
        let mut out = Vec::new();
        let mut first = stored(&[1], None, tokens[..16].to_vec(), 16);
        first.cache_salt = Some("tenant-7".into());
        let mut child = stored(&[2], Some(1), tokens[16..].to_vec(), 16);
        child.cache_salt = Some("tenant-7".into());
        assert_eq!(c.apply_stored(0, &first, 16, &mut out), Outcome::Applied);
        assert_eq!(c.apply_stored(0, &child, 16, &mut out), Outcome::Applied);
        let mut got: Vec<FeedBlock> = c.feed_blocks().map(|b| b.0).collect();
        let mut want = FeedBlock::chain_in(&tokens, 16, namespace(None, Some(b"tenant-7")));
        got.sort_by_key(|b| b.hash);
        want.sort_by_key(|b| b.hash);
        assert_eq!(got, want);
        // Two different salts for one block cannot both be right.
        let mut both = stored(&[3], None, toks(16), 16);
        both.cache_salt = Some("a".into());
        both.extra_keys = vec![ExtraKeys::Strings(vec!["b".into()])];
        assert_eq!(c.apply_stored(0, &both, 16, &mut out), Outcome::Malformed);
    }
}
