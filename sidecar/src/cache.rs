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
//! A block can be held several times over: by several DP ranks, in several KV-cache groups
//! (hybrid models), in GPU memory and in an offload tier. The worker holds it while any copy
//! exists; storing a held copy again changes nothing.

use crate::events::{BlockRemoved, BlockStored, ExtraKeys, Medium};
use crate::table::HashTable;
use kvroute::feed::FeedBlock;
use kvroute::hash::{chain_hash, local_hash, namespace, root_parent, BASE_NAMESPACE};
use kvroute::layout::anchor_position;

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
}

impl Outcome {
    pub const ALL: [Outcome; 6] = [
        Outcome::Applied,
        Outcome::UnknownParent,
        Outcome::BlockSizeMismatch,
        Outcome::Malformed,
        Outcome::Unroutable,
        Outcome::NotHeld,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::UnknownParent => "unknown_parent",
            Outcome::BlockSizeMismatch => "block_size_mismatch",
            Outcome::Malformed => "malformed",
            Outcome::Unroutable => "unroutable",
            Outcome::NotHeld => "not_held",
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

#[derive(Debug, Default)]
pub struct WorkerCache {
    /// Per DP rank.
    ranks: Vec<HashTable<EngineBlock>>,
    blocks: HashTable<RouterBlock>,
    /// Scratch for `apply_stored`: one router block's token bytes, one engine block's
    /// router blocks (hash, anchor, position).
    block_le: Vec<u8>,
    routers: Vec<(u64, u64, u32)>,
}

fn copy_bit(group: u32, medium: Medium) -> u32 {
    1 << (2 * group + u32::from(medium == Medium::Offloaded))
}

const GPU_BITS: u32 = 0x5555_5555;

impl WorkerCache {
    pub fn new(dp_ranks: usize) -> Self {
        WorkerCache { ranks: (0..dp_ranks.max(1)).map(|_| HashTable::default()).collect(), ..WorkerCache::default() }
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
        let engine_bs = ev.block_size as usize;
        let rbs = router_block_size as usize;
        if engine_bs == 0 || ev.group_idx >= MAX_GROUPS || ev.token_ids.len() != ev.block_hashes.len() * engine_bs {
            return Outcome::Malformed;
        }
        if rbs == 0 || !engine_bs.is_multiple_of(rbs) {
            return Outcome::BlockSizeMismatch;
        }
        let chain_namespace = match namespace_of(ev) {
            Ok(ns) => ns,
            Err(outcome) => return outcome,
        };
        let Some(engine) = self.ranks.get_mut(rank) else {
            return Outcome::Malformed;
        };
        let (mut parent_hash, mut parent_pos) = match ev.parent {
            None => (None, None),
            Some(p) => {
                let Some(router) = main_entry(engine, p).map(|e| e.router) else {
                    return Outcome::UnknownParent;
                };
                let Some(rb) = self.blocks.get(&router) else {
                    return Outcome::UnknownParent;
                };
                (Some((router, rb.anchor)), Some(rb.pos))
            }
        };
        let bit = copy_bit(ev.group_idx, ev.medium);
        let (block_le, routers) = (&mut self.block_le, &mut self.routers);
        for (i, &engine_hash) in ev.block_hashes.iter().enumerate() {
            let tokens = &ev.token_ids[i * engine_bs..(i + 1) * engine_bs];
            routers.clear();
            for sub in tokens.chunks_exact(rbs) {
                block_le.clear();
                block_le.extend(sub.iter().flat_map(|t| t.to_le_bytes()));
                let local = local_hash(block_le);
                let pos = parent_pos.map_or(0, |p: u32| p.saturating_add(1));
                // A chain's first block hangs off its namespace (kvroute::hash).
                let hash = match parent_hash.map(|p| p.0).or(root_parent(chain_namespace)) {
                    None => local,
                    Some(ph) => chain_hash(ph, local),
                };
                let anchor = match parent_hash {
                    Some((_, pa)) if anchor_position(pos as usize) != pos as usize => pa,
                    _ => hash,
                };
                routers.push((hash, anchor, pos));
                parent_hash = Some((hash, anchor));
                parent_pos = Some(pos);
            }
            let span = routers.len() as u32;
            let gpu = bit & GPU_BITS != 0;
            match main_entry(engine, engine_hash) {
                // The chain hash of the last part names all of them.
                Some(e) if e.router == routers[routers.len() - 1].0 && e.span == span => {
                    if e.copies & bit != 0 {
                        continue; // the same copy again: nothing changes
                    }
                    set_copies(engine, engine_hash, e, e.copies | bit);
                    if gpu && e.copies & GPU_BITS == 0 {
                        for (h, _, _) in routers.iter() {
                            gpu_gained(&mut self.blocks, *h, out);
                        }
                    }
                    continue;
                }
                Some(e) => {
                    // Same engine hash, other tokens or parent: the engine reused the hash
                    // (it restarted, or hashes collided). The new content replaces the old.
                    let old = remove_engine_block(engine, engine_hash, e);
                    release(&mut self.blocks, &old, e.copies & GPU_BITS != 0, out);
                }
                None => {}
            }
            for (j, &(hash, anchor, pos)) in routers.iter().enumerate() {
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
                engine.insert(key, EngineBlock { router: hash, copies: bit, span: entry_span });
            }
        }
        Outcome::Applied
    }

    pub fn apply_removed(&mut self, rank: usize, ev: &BlockRemoved, out: &mut Vec<Change>) -> Outcome {
        if ev.group_idx >= MAX_GROUPS {
            return Outcome::Malformed;
        }
        let Some(engine) = self.ranks.get_mut(rank) else {
            return Outcome::Malformed;
        };
        let bit = copy_bit(ev.group_idx, ev.medium);
        let mut all_held = true;
        for &h in &ev.block_hashes {
            let Some(e) = main_entry(engine, h).filter(|e| e.copies & bit != 0) else {
                all_held = false;
                continue;
            };
            let had_gpu = e.copies & GPU_BITS != 0;
            let copies = e.copies & !bit;
            if copies == 0 {
                let old = remove_engine_block(engine, h, e);
                release(&mut self.blocks, &old, had_gpu, out);
            } else {
                set_copies(engine, h, e, copies);
                if had_gpu && copies & GPU_BITS == 0 {
                    for r in routers_of(engine, h, e) {
                        gpu_lost(&mut self.blocks, r, out);
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
    /// Returns true if the worker now holds nothing at all.
    pub fn clear_rank(&mut self, rank: usize, out: &mut Vec<Change>) -> bool {
        let sole = self.ranks.len() == 1;
        if let Some(engine) = self.ranks.get_mut(rank) {
            if sole {
                // Sole rank: drop everything at once (the caller publishes a CLEAR).
                engine.clear();
                self.blocks.clear();
            } else {
                // Every entry, main or part, holds one router block with the copies of its
                // engine block.
                for (_, e) in engine.drain() {
                    release(&mut self.blocks, &[e.router], e.copies & GPU_BITS != 0, out);
                }
            }
        }
        self.blocks.is_empty()
    }

    /// Heap bytes held by the tables.
    pub fn heap_bytes(&self) -> usize {
        self.ranks.iter().map(HashTable::heap_bytes).sum::<usize>() + self.blocks.heap_bytes()
    }
}

/// The namespace a `BlockStored` starts its chain in (used only when it has no parent;
/// children inherit it through their parent's hash).
///
/// vLLM's `extra_keys` per block are the block's multimodal identifiers, then the LoRA
/// adapter's name, then — on a request's first block only — its cache salt. So: every
/// string equal to `lora_name` is the adapter; on the chain's first block one other string
/// is the salt; anything else (multimodal inputs, non-string keys) cannot come from a
/// request's tokens and makes the event unroutable.
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
        BlockStored {
            block_hashes: hashes.to_vec(),
            parent,
            token_ids: tokens,
            block_size: bs,
            medium: Medium::Gpu,
            lora_id: None,
            lora_name: None,
            extra_keys: Vec::new(),
            group_idx: 0,
        }
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
}
