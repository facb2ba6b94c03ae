//! The sync service's model of the fleet: feed frames in, bucket and table values out.
//!
//! It keeps the sidecar's index in bucket order (what the filter reads is a bucket), the
//! slot assignment (stable for the process: in-flight entries name slots), and which
//! buckets changed since they were last written. It never touches the in-flight part of a
//! bucket; the writer merges that from the current shared value.

use crate::feed::{Frame, FrameKind, Op};
use crate::layout::{
    bucket_key, bucket_of, encode_bucket, lower_bound, Bucket, CachedBlocks, FlyEntry, IndexPart, SlotState,
    WorkerSlot, WorkerTable, CACHED_KEY, FLY_ENTRY, TABLE_KEY,
};
use crate::slots::MAX_SLOTS;
use crate::store::{update, Edit, SharedStore};
use std::fmt;

/// Why a frame was not applied. The sync service then asks for a fresh snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResyncNeeded(pub String);

impl fmt::Display for ResyncNeeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What one applied frame changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    pub stored: u64,
    pub removed: u64,
    pub cleared_workers: u64,
    /// Workers beyond [`MAX_SLOTS`]: ignored, with their ops.
    pub workers_rejected: u64,
}

/// Where the next poll starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PollPosition {
    pub epoch: u64,
    pub since: u64,
    pub cursor: u64,
}

pub struct SyncIndex {
    n_buckets: u32,
    /// u64 words per holder mask; grows with the slot count.
    mask_words: usize,
    /// Whether entries carry offloaded-only masks: from the first offloaded store until the
    /// next snapshot, so a fleet without CPU offload pays nothing for the tier.
    tiered: bool,
    /// Per bucket, entries `[hash, holders: mask_words × u64, offloaded-only: mask_words ×
    /// u64 if tiered]` flattened, sorted by hash.
    buckets: Vec<Vec<u64>>,
    slots: Vec<WorkerSlot>,
    block_size: u32,
    epoch: u64,
    version: u64,
    /// Mid-snapshot: the cursor of the next page.
    snapshot_cursor: Option<u64>,
    /// No frame accepted yet (or the last one was refused): ask for a snapshot.
    need_snapshot: bool,
    live: bool,
    /// Other gateways' load is written ([`crate::peerload`]).
    peer_load: bool,
    /// The first snapshot rewrites every bucket: shared data outlives the VM, so a bucket
    /// this VM never wrote may hold an older index.
    rewrite_all: bool,
    dirty: Vec<u32>,
    is_dirty: Vec<bool>,
    table_dirty: bool,
    entries: u64,
    /// Per bucket, a snapshot's stores not yet merged into its entries (see [`Staged`]).
    staged: Vec<Vec<Staged>>,
    /// Per slot (as long as `slots`), the blocks it holds in GPU memory (merged entries
    /// only: a snapshot's staged stores count when their bucket is merged, at the latest
    /// when it is written).
    cached: Vec<u32>,
    /// `cached` changed since it was last written.
    cached_dirty: bool,
}

/// A snapshot page's store, kept as it came until its bucket is next read or written. A
/// page merged at once would rewrite buckets that already hold every earlier page — time
/// in proportion to the index so far, per page — so a resync was quadratic in its pages;
/// staged, each page costs its own size, and each bucket is sorted and merged once, when
/// its slice is published.
#[derive(Clone, Copy, Debug)]
struct Staged {
    hash: u64,
    slot: u16,
    hold: Hold,
}

impl SyncIndex {
    pub fn new(n_buckets: u32) -> SyncIndex {
        let n = n_buckets.max(1) as usize;
        SyncIndex {
            n_buckets,
            mask_words: 1,
            tiered: false,
            buckets: vec![Vec::new(); n],
            slots: Vec::new(),
            block_size: 0,
            epoch: 0,
            version: 0,
            snapshot_cursor: None,
            need_snapshot: true,
            live: false,
            peer_load: false,
            rewrite_all: true,
            dirty: Vec::new(),
            is_dirty: vec![false; n],
            // Nothing to say before the feed (or a restored table) says something: an
            // empty table would turn the filters' "no table" into "no worker up".
            table_dirty: false,
            entries: 0,
            staged: vec![Vec::new(); n],
            cached: Vec::new(),
            cached_dirty: false,
        }
    }

    /// Takes over the slot assignment of a table found in shared data (this VM restarted;
    /// in-flight entries of the old one name these slots). Workers start down until the
    /// sidecar says otherwise.
    pub fn restore_slots(&mut self, table: &WorkerTable) {
        self.slots = table
            .slots
            .iter()
            .map(|s| WorkerSlot {
                id: s.id.clone(),
                role: s.role,
                state: if s.state == SlotState::Gone { SlotState::Gone } else { SlotState::Down },
                // The same engines: what they evicted at before this VM still holds.
                kv_capacity_blocks: s.kv_capacity_blocks,
            })
            .collect();
        self.cached = vec![0; self.slots.len()];
        self.mask_words = self.slots.len().div_ceil(64).max(1);
        self.table_dirty = true;
    }

    pub fn poll_position(&self) -> PollPosition {
        if self.need_snapshot {
            return PollPosition { epoch: 0, since: 0, cursor: 0 };
        }
        PollPosition { epoch: self.epoch, since: self.version, cursor: self.snapshot_cursor.unwrap_or(0) }
    }

    /// Between a snapshot's first page and its last: what the index holds is not yet a
    /// whole fleet's state, so [`publish`] holds it back.
    pub fn snapshot_in_progress(&self) -> bool {
        self.snapshot_cursor.is_some()
    }

    /// Forget the feed position: the next poll asks for a snapshot.
    pub fn request_snapshot(&mut self) {
        self.need_snapshot = true;
        self.snapshot_cursor = None;
    }

    pub fn is_live(&self) -> bool {
        self.live
    }

    /// Marks the index current or stale (the filter routes by load while stale).
    pub fn set_live(&mut self, live: bool) {
        if self.live != live {
            self.live = live;
            self.table_dirty = true;
        }
    }

    /// Says in the table whether the filters should add other gateways' load.
    pub fn set_peer_load(&mut self, on: bool) {
        if self.peer_load != on {
            self.peer_load = on;
            self.table_dirty = true;
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// Distinct cached blocks in the index (a block several workers hold is one entry).
    /// A snapshot's blocks count once their bucket is merged, at the latest when published.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// Heap bytes of the index (bucket vectors at their capacity).
    pub fn heap_bytes(&self) -> usize {
        let vec = std::mem::size_of::<Vec<u64>>();
        self.buckets.iter().map(|b| b.capacity() * 8 + vec).sum::<usize>()
            + self.staged.iter().map(|s| s.capacity() * std::mem::size_of::<Staged>() + vec).sum::<usize>()
            + self.dirty.capacity() * 4
            + self.is_dirty.capacity()
    }

    pub fn n_buckets(&self) -> u32 {
        self.n_buckets
    }

    pub fn apply(&mut self, frame: &Frame) -> Result<ApplyStats, ResyncNeeded> {
        match frame.kind {
            FrameKind::SnapshotStart => {
                self.reset();
                self.epoch = frame.epoch;
            }
            FrameKind::SnapshotMore => {
                if self.snapshot_cursor.is_none() || frame.epoch != self.epoch || frame.to_version != self.version {
                    return Err(self.refuse("snapshot page does not continue the snapshot in progress"));
                }
            }
            FrameKind::Delta => {
                if self.need_snapshot || self.snapshot_cursor.is_some() {
                    return Err(self.refuse("delta while a snapshot is needed"));
                }
                if frame.epoch != self.epoch {
                    return Err(self.refuse("epoch changed"));
                }
                if frame.from_version != self.version {
                    return Err(self.refuse("delta does not start at our version"));
                }
            }
        }
        if self.block_size != frame.block_size {
            self.block_size = frame.block_size;
            self.table_dirty = true;
        }
        self.version = frame.to_version;
        self.need_snapshot = false;
        self.snapshot_cursor = match (frame.kind, frame.next_cursor) {
            (FrameKind::Delta, _) | (_, 0) => None,
            (_, c) => Some(c),
        };

        let mut stats = ApplyStats::default();
        let slot_of = self.apply_workers(frame, &mut stats);
        for op in &frame.ops {
            let (Op::Store { worker, .. }
            | Op::StoreOffloaded { worker, .. }
            | Op::Remove { worker, .. }
            | Op::Clear { worker }) = op;
            let Some(Some(slot)) = slot_of.get(*worker as usize).copied() else { continue };
            let snapshot = frame.kind != FrameKind::Delta;
            match op {
                Op::Store { blocks, .. } if snapshot => stats.stored += self.stage(blocks, slot, Hold::Gpu),
                Op::StoreOffloaded { blocks, .. } if snapshot => {
                    stats.stored += self.stage(blocks, slot, Hold::Offloaded)
                }
                Op::Store { blocks, .. } => {
                    stats.stored += self.store_many(blocks, slot, Hold::Gpu);
                    self.raise_capacity(slot);
                }
                // Moving blocks to an offload tier and removing them both take them out of
                // GPU memory: evictions, which say how much the engine holds at most.
                Op::StoreOffloaded { blocks, .. } => {
                    let held = self.gpu_blocks(slot);
                    stats.stored += self.store_many(blocks, slot, Hold::Offloaded);
                    self.learn_capacity(slot, held);
                }
                Op::Remove { blocks, .. } => {
                    let held = self.gpu_blocks(slot);
                    for b in blocks {
                        stats.removed += u64::from(self.set_hold(b.hash, b.anchor, slot, Hold::None));
                    }
                    self.learn_capacity(slot, held);
                }
                Op::Clear { .. } => {
                    self.clear_slot(slot);
                    stats.cleared_workers += 1;
                }
            }
        }
        Ok(stats)
    }

    fn refuse(&mut self, why: &str) -> ResyncNeeded {
        self.request_snapshot();
        ResyncNeeded(why.to_string())
    }

    fn reset(&mut self) {
        for b in 0..self.buckets.len() {
            if !self.buckets[b].is_empty() || !self.staged[b].is_empty() || self.rewrite_all {
                self.buckets[b].clear();
                self.staged[b].clear();
                self.mark(b as u32);
            }
        }
        self.rewrite_all = false;
        self.entries = 0;
        self.cached.iter_mut().for_each(|n| *n = 0);
        self.cached_dirty = true;
        self.tiered = false; // every bucket is empty: free to drop the tier masks
        self.table_dirty = true;
    }

    /// Updates the slot table from the frame's fleet; returns frame worker index → slot.
    fn apply_workers(&mut self, frame: &Frame, stats: &mut ApplyStats) -> Vec<Option<usize>> {
        let mut slot_of = Vec::with_capacity(frame.workers.len());
        let mut present = vec![false; self.slots.len()];
        for w in &frame.workers {
            let slot = match self.slots.iter().position(|s| s.id == w.id) {
                Some(s) => s,
                None if self.slots.len() < MAX_SLOTS => {
                    self.slots.push(WorkerSlot {
                        id: w.id.clone(),
                        role: w.role,
                        state: SlotState::Down,
                        kv_capacity_blocks: 0,
                    });
                    self.cached.push(0);
                    present.push(false);
                    self.table_dirty = true;
                    self.slots.len() - 1
                }
                None => {
                    stats.workers_rejected += 1;
                    slot_of.push(None);
                    continue;
                }
            };
            present[slot] = true;
            let state = if w.up { SlotState::Up } else { SlotState::Down };
            let s = &mut self.slots[slot];
            if s.state != state || s.role != w.role {
                s.state = state;
                s.role = w.role;
                self.table_dirty = true;
            }
            slot_of.push(Some(slot));
        }
        let gone: Vec<usize> =
            (0..self.slots.len()).filter(|&s| !present[s] && self.slots[s].state != SlotState::Gone).collect();
        for slot in gone {
            self.slots[slot].state = SlotState::Gone;
            self.table_dirty = true;
            self.clear_slot(slot);
        }
        let needed = self.slots.len().div_ceil(64).max(1);
        if needed > self.mask_words {
            self.relayout(needed, self.tiered);
        }
        slot_of
    }

    fn stride(&self) -> usize {
        1 + self.mask_words * (1 + usize::from(self.tiered))
    }

    /// Rewrites every entry for masks of `words` words, with or without the offloaded-only
    /// masks (neither ever shrinks here: only a snapshot's reset drops the tier).
    fn relayout(&mut self, words: usize, tiered: bool) {
        let (old_words, old_tiered) = (self.mask_words, self.tiered);
        if (words, tiered) == (old_words, old_tiered) {
            return;
        }
        let old_stride = self.stride();
        (self.mask_words, self.tiered) = (words, tiered);
        let stride = self.stride();
        for b in 0..self.buckets.len() {
            if self.buckets[b].is_empty() {
                continue;
            }
            let mut wide = Vec::with_capacity(self.buckets[b].len() / old_stride * stride);
            for e in self.buckets[b].chunks_exact(old_stride) {
                wide.push(e[0]);
                // Each mask padded to `words` (an untiered entry's offloaded mask is empty).
                let (held, offloaded) = e[1..].split_at(old_words);
                for mask in [held, offloaded].iter().take(1 + usize::from(tiered)) {
                    wide.extend_from_slice(mask);
                    wide.extend(std::iter::repeat_n(0, words - mask.len()));
                }
            }
            self.buckets[b] = wide;
            self.mark(b as u32);
        }
    }

    /// Makes the entries able to record `hold` (an offloaded one needs the tier masks).
    fn make_room_for(&mut self, hold: Hold) {
        if hold == Hold::Offloaded {
            self.relayout(self.mask_words, true);
        }
    }

    fn mark(&mut self, b: u32) {
        if !self.is_dirty[b as usize] {
            self.is_dirty[b as usize] = true;
            self.dirty.push(b);
        }
    }

    /// Keeps a snapshot page's stores on `slot` for a later merge ([`Staged`]); returns
    /// their count.
    fn stage(&mut self, blocks: &[crate::feed::FeedBlock], slot: usize, hold: Hold) -> u64 {
        let slot = slot as u16; // < MAX_SLOTS
        self.make_room_for(hold);
        for blk in blocks {
            let b = bucket_of(blk.anchor, self.n_buckets);
            self.staged[b as usize].push(Staged { hash: blk.hash, slot, hold });
            self.mark(b);
        }
        blocks.len() as u64
    }

    /// Merges bucket `b`'s staged stores into its sorted entries, in one pass. Stores of
    /// one block keep their page order (a later one decides the tier).
    fn merge_staged(&mut self, b: u32) {
        let mut staged = std::mem::take(&mut self.staged[b as usize]);
        if staged.is_empty() {
            return;
        }
        staged.sort_by_key(|s| s.hash);
        let (mw, stride) = (self.mask_words, self.stride());
        let old = std::mem::take(&mut self.buckets[b as usize]);
        let mut merged = Vec::with_capacity(old.len() + staged.len() * stride);
        let (mut o, mut i) = (0, 0);
        while i < staged.len() {
            let hash = staged[i].hash;
            let (at, fresh) = merge_up_to(&old, &mut o, &mut merged, hash, stride);
            self.entries += u64::from(fresh);
            while i < staged.len() && staged[i].hash == hash {
                let slot = usize::from(staged[i].slot);
                let (_, gpu) = set_hold_bits(&mut merged[at..at + stride], mw, slot, staged[i].hold);
                self.count_cached(slot, gpu);
                // A snapshot's stores count only once merged: what the engine is seen to
                // hold then can raise its learned capacity, as a delta's stores do.
                if gpu > 0 {
                    self.raise_capacity(slot);
                }
                i += 1;
            }
        }
        merged.extend_from_slice(&old[o..]);
        self.buckets[b as usize] = merged;
    }

    /// Stores many blocks on `slot` (a snapshot page, a large delta): per bucket, the new
    /// hashes are sorted and merged into the bucket's sorted entries in one pass, instead
    /// of one insertion (a shift of the bucket's tail) per block. Returns the changes.
    fn store_many(&mut self, blocks: &[crate::feed::FeedBlock], slot: usize, hold: Hold) -> u64 {
        if blocks.len() < 8 {
            return blocks.iter().map(|b| u64::from(self.set_hold(b.hash, b.anchor, slot, hold))).sum();
        }
        let mut new: Vec<(u32, u64)> = blocks.iter().map(|b| (bucket_of(b.anchor, self.n_buckets), b.hash)).collect();
        new.sort_unstable();
        new.dedup();
        self.make_room_for(hold);
        let (mw, stride) = (self.mask_words, self.stride());
        let mut changed = 0u64;
        let mut i = 0;
        while i < new.len() {
            let b = new[i].0;
            let end = i + new[i..].partition_point(|(nb, _)| *nb == b);
            self.merge_staged(b);
            let old = std::mem::take(&mut self.buckets[b as usize]);
            let mut merged = Vec::with_capacity(old.len() + (end - i) * stride);
            let mut o = 0;
            let mut bucket_changed = false;
            for &(_, hash) in &new[i..end] {
                let (at, fresh) = merge_up_to(&old, &mut o, &mut merged, hash, stride);
                self.entries += u64::from(fresh);
                let (any, gpu) = set_hold_bits(&mut merged[at..at + stride], mw, slot, hold);
                self.count_cached(slot, gpu);
                if any {
                    changed += 1;
                    bucket_changed = true;
                }
            }
            merged.extend_from_slice(&old[o..]);
            self.buckets[b as usize] = merged;
            if bucket_changed {
                self.mark(b);
            }
            i = end;
        }
        changed
    }

    /// Sets how `slot` holds `hash`; true when that changed anything.
    fn set_hold(&mut self, hash: u64, anchor: u64, slot: usize, hold: Hold) -> bool {
        let b = bucket_of(anchor, self.n_buckets);
        self.merge_staged(b);
        self.make_room_for(hold);
        let (mw, stride) = (self.mask_words, self.stride());
        let entries = &mut self.buckets[b as usize];
        let n = entries.len() / stride;
        let lo = lower_bound(0, n, |i| entries[i * stride] < hash);
        let found = lo < n && entries[lo * stride] == hash;
        if !found {
            if hold == Hold::None {
                return false;
            }
            let at = lo * stride;
            entries.splice(at..at, std::iter::repeat_n(0, stride));
            entries[at] = hash;
        }
        let at = lo * stride;
        let (changed, gpu) = set_hold_bits(&mut entries[at..at + stride], mw, slot, hold);
        if !found {
            self.entries += 1;
        } else if entries[at + 1..at + 1 + mw].iter().all(|w| *w == 0) {
            entries.drain(at..at + stride);
            self.entries -= 1;
        }
        self.count_cached(slot, gpu);
        if changed {
            self.mark(b);
        }
        changed
    }

    /// Adds `gpu` (−1, 0 or 1: what [`set_hold_bits`] said) to `slot`'s cached blocks.
    fn count_cached(&mut self, slot: usize, gpu: i32) {
        if let Some(n) = self.cached.get_mut(slot).filter(|_| gpu != 0) {
            *n = n.saturating_add_signed(gpu);
            self.cached_dirty = true;
        }
    }

    fn gpu_blocks(&self, slot: usize) -> u32 {
        self.cached.get(slot).copied().unwrap_or(0)
    }

    /// After an op that may have taken blocks out of `slot`'s GPU memory, which held `held`
    /// before it: if it did, the engine evicted at `held` blocks, and holds at least that
    /// many at most. The largest such count is its learned capacity. Events come in the
    /// engine's order, so `held` is what the engine held then: never above its capacity
    /// (blocks a request reserved but has not filled yet are not in it, which makes the
    /// figure the room for cached prompts, what the memory limit compares with).
    fn learn_capacity(&mut self, slot: usize, held: u32) {
        if self.gpu_blocks(slot) < held {
            self.capacity_at_least(slot, held);
        }
    }

    /// An engine that has evicted and now holds more than its learned capacity can hold
    /// that many: the figure was learned from an eviction at a low count (a removal that
    /// was not for memory, a sliding window's, say) and rises to what the engine holds, so
    /// the memory limit does not keep passing over an engine for room it is seen to have.
    fn raise_capacity(&mut self, slot: usize) {
        if self.slots.get(slot).is_some_and(|s| s.kv_capacity_blocks != 0) {
            self.capacity_at_least(slot, self.gpu_blocks(slot));
        }
    }

    /// Raises `slot`'s learned capacity to `blocks` if it is lower; the table then carries it.
    fn capacity_at_least(&mut self, slot: usize, blocks: u32) {
        if let Some(s) = self.slots.get_mut(slot).filter(|s| blocks > s.kv_capacity_blocks) {
            s.kv_capacity_blocks = blocks;
            self.table_dirty = true;
        }
    }

    fn clear_slot(&mut self, slot: usize) {
        // An engine that restarted (or reset its cache) is learned anew: its memory may
        // have changed with it.
        if let Some(s) = self.slots.get_mut(slot).filter(|s| s.kv_capacity_blocks != 0) {
            s.kv_capacity_blocks = 0;
            self.table_dirty = true;
        }
        let (mw, stride) = (self.mask_words, self.stride());
        if slot / 64 >= mw {
            return;
        }
        for b in 0..self.buckets.len() {
            self.merge_staged(b as u32);
            let entries = &mut self.buckets[b];
            if entries.is_empty() {
                continue;
            }
            let mut touched = false;
            let mut kept = Vec::with_capacity(entries.len());
            for e in entries.chunks_exact(stride) {
                let mut e = e.to_vec();
                touched |= set_hold_bits(&mut e, mw, slot, Hold::None).0;
                if e[1..1 + mw].iter().any(|w| *w != 0) {
                    kept.extend_from_slice(&e);
                } else {
                    self.entries -= 1;
                }
            }
            if touched {
                *entries = kept;
                self.mark(b as u32);
            }
        }
        if self.cached.get(slot).is_some_and(|&n| n > 0) {
            self.cached[slot] = 0;
            self.cached_dirty = true;
        }
    }

    /// Buckets changed since the last call, to be written.
    #[cfg(test)]
    fn take_dirty(&mut self) -> Vec<u32> {
        for &b in &self.dirty {
            self.is_dirty[b as usize] = false;
        }
        std::mem::take(&mut self.dirty)
    }

    #[cfg(test)]
    fn merge_all(&mut self) {
        for b in 0..self.n_buckets {
            self.merge_staged(b);
        }
    }

    /// One changed bucket to write, if any is left.
    fn pop_dirty(&mut self) -> Option<u32> {
        let b = self.dirty.pop()?;
        self.is_dirty[b as usize] = false;
        Some(b)
    }

    /// Changes not yet written to shared data: [`publish`] has more to do (once any
    /// snapshot in progress is complete).
    pub fn has_unpublished(&self) -> bool {
        !self.dirty.is_empty() || self.table_dirty || self.cached_dirty
    }

    /// Puts a bucket back on the dirty list (its write failed).
    fn mark_dirty(&mut self, b: u32) {
        if (b as usize) < self.buckets.len() {
            self.mark(b);
        }
    }

    /// Copies bucket `b`'s in-flight entries into `out`, less the predictions (entries no
    /// stream holds) that the index now confirms: the engine reported the block, so the
    /// prediction has done its job. Both lists are sorted by hash: one merge pass.
    fn drop_confirmed(&self, b: u32, fly: &[u8], n: usize, out: &mut Vec<u8>) -> usize {
        out.clear();
        let stride = self.stride();
        let entries = &self.buckets[b as usize];
        let mut j = 0;
        for raw in fly.chunks_exact(FLY_ENTRY).take(n) {
            let e = FlyEntry::decode(raw);
            while j < entries.len() && entries[j] < e.hash {
                j += stride;
            }
            let slot = usize::from(e.slot);
            let confirmed = e.refs == 0
                && j < entries.len()
                && entries[j] == e.hash
                && slot / 64 < self.mask_words
                && entries[j + 1 + slot / 64] & (1 << (slot % 64)) != 0;
            if !confirmed {
                out.extend_from_slice(raw);
            }
        }
        out.len() / FLY_ENTRY
    }

    /// The index part of bucket `b` as stored: `(mask_words, tiered, n_idx, raw entries)`.
    /// The offloaded-only masks are written only when one of them is not empty.
    pub fn encode_idx(&self, b: u32) -> (usize, bool, usize, Vec<u8>) {
        debug_assert!(self.staged[b as usize].is_empty(), "bucket {b} read before its staged stores are merged");
        let (mw, stride) = (self.mask_words, self.stride());
        let entries = &self.buckets[b as usize];
        let tiered = self.tiered && entries.chunks_exact(stride).any(|e| e[1 + mw..].iter().any(|w| *w != 0));
        let keep = if tiered { stride } else { 1 + mw };
        let raw = entries.chunks_exact(stride).flat_map(|e| &e[..keep]).flat_map(|w| w.to_le_bytes()).collect();
        (mw, tiered, entries.len() / stride, raw)
    }

    /// Per slot, the blocks it holds in GPU memory (see [`CachedBlocks`]).
    pub fn cached_blocks(&self) -> &[u32] {
        &self.cached
    }

    /// [`Self::cached_blocks`] if they changed since the last call.
    fn take_cached(&mut self) -> Option<CachedBlocks> {
        if !self.cached_dirty {
            return None;
        }
        self.cached_dirty = false;
        Some(CachedBlocks(self.cached.clone()))
    }

    /// The worker table if it changed since the last call.
    pub fn take_table(&mut self) -> Option<WorkerTable> {
        if !self.table_dirty {
            return None;
        }
        self.table_dirty = false;
        Some(self.table())
    }

    /// The workers' slots as [`Self::table`] carries them, without a copy.
    pub fn slots(&self) -> &[WorkerSlot] {
        &self.slots
    }

    pub fn table(&self) -> WorkerTable {
        WorkerTable {
            index_live: self.live,
            peer_load: self.peer_load,
            block_size: self.block_size,
            n_buckets: self.n_buckets,
            epoch: self.epoch,
            version: self.version,
            slots: self.slots.clone(),
        }
    }
}

/// How a worker holds a block, as the feed says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hold {
    Gpu,
    Offloaded,
    None,
}

/// Sets how `slot` holds the block of `entry` (`[hash, holders, offloaded-only]`, masks of
/// `mw` words; the offloaded-only mask absent when the index is not tiered, where no hold
/// is `Offloaded`). Returns whether that changed anything, and the change in whether
/// `slot` holds the block in GPU memory (−1, 0 or 1).
fn set_hold_bits(entry: &mut [u64], mw: usize, slot: usize, hold: Hold) -> (bool, i32) {
    let (word, bit) = (slot / 64, 1u64 << (slot % 64));
    let (held, off) = (1 + word, 1 + mw + word);
    let tiered = entry.len() > 1 + mw;
    debug_assert!(tiered || hold != Hold::Offloaded, "an offloaded hold in an untiered index");
    let get = |entry: &[u64]| (entry[held] & bit, if tiered { entry[off] & bit } else { 0 });
    let before = get(entry);
    let set = |w: &mut u64, on: bool| if on { *w |= bit } else { *w &= !bit };
    set(&mut entry[held], hold != Hold::None);
    if tiered {
        set(&mut entry[off], hold == Hold::Offloaded);
    }
    let after = get(entry);
    let gpu = |(held, off): (u64, u64)| i32::from(held != 0 && off == 0);
    (before != after, gpu(after) - gpu(before))
}

/// One step of merging into a bucket's sorted entries: copies `old`'s entries below `hash`
/// (from offset `*o` on) to `merged`, then `hash`'s own entry — the old one, or a new one
/// that no worker holds yet. Returns that entry's offset in `merged`, and whether it is new.
fn merge_up_to(old: &[u64], o: &mut usize, merged: &mut Vec<u64>, hash: u64, stride: usize) -> (usize, bool) {
    while *o < old.len() && old[*o] < hash {
        merged.extend_from_slice(&old[*o..*o + stride]);
        *o += stride;
    }
    let at = merged.len();
    if *o < old.len() && old[*o] == hash {
        merged.extend_from_slice(&old[*o..*o + stride]);
        *o += stride;
        (at, false)
    } else {
        merged.push(hash);
        merged.extend(std::iter::repeat_n(0, stride - 1));
        (at, true)
    }
}

/// Shared-data writes of one [`publish`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublishStats {
    pub bucket_writes: u64,
    /// Bytes of bucket values written.
    pub bucket_bytes: u64,
    /// Writes that failed (left dirty, retried on the next publish).
    pub failures: u64,
    /// Changed buckets left for the next call: the byte budget ran out.
    pub more: bool,
}

/// Bucket bytes one [`publish`] writes at most. The sync service publishes on Envoy's main
/// thread (admin API, xDS, stats), so a resync's whole index must not go in one call: at
/// 6.4M entries that held the main thread for 1.3–1.5 s. What is left goes at the next tick.
pub const PUBLISH_BUDGET_BYTES: usize = 8 << 20;

/// Writes changed buckets (index part only: the filters' in-flight part is kept as found,
/// by compare-and-swap) up to [`PUBLISH_BUDGET_BYTES`], then — once none is left — the
/// worker table and the cached-block counts if they changed. Buckets before the table: a
/// table never names a state its buckets do not hold yet.
///
/// Nothing is written in the middle of a paged snapshot: the filters keep routing on the
/// last complete index (not on one where the workers of later pages look cold), and each
/// bucket is written once per snapshot instead of once per page — the pages' writes grow
/// with the index, so publishing every page made a resync quadratic in its page count.
/// While a snapshot's buckets go out over several calls the filters see some buckets old
/// and some new; every entry is right for its block either way (a block's holders do not
/// depend on its bucket), so the mix can only miss hits, never invent them.
pub fn publish(index: &mut SyncIndex, store: &dyn SharedStore) -> PublishStats {
    publish_within(index, store, PUBLISH_BUDGET_BYTES)
}

/// [`publish`] with another byte budget (at least one bucket is written per call).
pub fn publish_within(index: &mut SyncIndex, store: &dyn SharedStore, budget_bytes: usize) -> PublishStats {
    let mut stats = PublishStats::default();
    if index.snapshot_in_progress() {
        return stats;
    }
    let mut failed = Vec::new();
    while stats.bucket_bytes < budget_bytes as u64 {
        let Some(b) = index.pop_dirty() else { break };
        index.merge_staged(b);
        match write_bucket(index, store, b) {
            Some(bytes) => {
                stats.bucket_writes += 1;
                stats.bucket_bytes += bytes as u64;
            }
            None => failed.push(b),
        }
    }
    // Failed writes wait for the next call; they do not hold back the table.
    stats.more = !index.dirty.is_empty();
    stats.failures = failed.len() as u64;
    for b in failed {
        index.mark_dirty(b);
    }
    if stats.more {
        return stats;
    }
    if let Some(t) = index.take_table() {
        if store.set(TABLE_KEY, &t.encode(), None).is_err() {
            stats.failures += 1;
            index.table_dirty = true;
        }
    }
    if let Some(c) = index.take_cached() {
        if store.set(CACHED_KEY, &c.encode(), None).is_err() {
            stats.failures += 1;
            index.cached_dirty = true;
        }
    }
    stats
}

/// Writes bucket `b`'s index part; the bytes written, or `None` if the store refused.
fn write_bucket(index: &SyncIndex, store: &dyn SharedStore, b: u32) -> Option<usize> {
    let (mask_words, tiered, n, raw) = index.encode_idx(b);
    let part = IndexPart { mask_words, tiered, n, raw: &raw };
    let mut fly = Vec::new();
    let edit = |cur: &[u8]| {
        // A value that does not decode (nothing of ours writes one) loses its in-flight
        // part: the index must be written regardless.
        let parsed = Bucket::parse(cur).unwrap_or(Bucket::EMPTY);
        let (n_old, old) = parsed.fly_raw();
        let n_fly = index.drop_confirmed(b, old, n_old, &mut fly);
        let value = encode_bucket(part, n_fly, &fly, parsed.sweep_at_ms());
        let len = value.len();
        Ok::<_, ()>(Edit::Write(value, len))
    };
    update(store, &bucket_key(b), None, &mut 0, edit).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feed::{FeedBlock, FeedWorker};
    use crate::layout::{encode_bucket, Bucket, IndexPart};
    use crate::role::Role;
    use crate::slots::SlotSet;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    pub(crate) fn worker(id: &str) -> FeedWorker {
        FeedWorker { id: id.into(), role: Role::Both, up: true }
    }

    fn frame(kind: FrameKind, from: u64, to: u64, workers: Vec<FeedWorker>, ops: Vec<Op>) -> Frame {
        Frame { kind, epoch: 1, from_version: from, to_version: to, next_cursor: 0, block_size: 16, workers, ops }
    }

    fn bucket_bytes(ix: &mut SyncIndex, anchor: u64) -> Vec<u8> {
        let b = bucket_of(anchor, ix.n_buckets());
        ix.merge_staged(b);
        let (mask_words, tiered, n, raw) = ix.encode_idx(b);
        encode_bucket(IndexPart { mask_words, tiered, n, raw: &raw }, 0, &[], 0)
    }

    fn holders(ix: &mut SyncIndex, hash: u64, anchor: u64) -> Vec<usize> {
        Bucket::parse(&bucket_bytes(ix, anchor)).unwrap().holders(hash, 0, false, &SlotSet::FULL).iter().collect()
    }

    fn offloaded(ix: &mut SyncIndex, hash: u64, anchor: u64) -> Vec<usize> {
        let bytes = bucket_bytes(ix, anchor);
        Bucket::parse(&bytes).unwrap().offloaded_only(hash, 0, false, &SlotSet::FULL).iter().collect()
    }

    #[test]
    fn bulk_and_staged_stores_equal_one_by_one_stores() {
        // The same ops applied through store_many (≥ 8 blocks, a delta), staged (a
        // snapshot, merged when read) and through set_hold.
        let ws = vec![worker("a:1"), worker("b:1"), worker("c:1")];
        let blocks: Vec<FeedBlock> =
            (0..500u64).map(|i| FeedBlock { hash: i.wrapping_mul(0x9E37_79B9_7F4A_7C15), anchor: i % 7 }).collect();
        let ops = vec![
            Op::Store { worker: 0, blocks: blocks[..300].to_vec() },
            Op::StoreOffloaded { worker: 1, blocks: blocks[100..400].to_vec() },
            Op::Store { worker: 2, blocks: blocks.clone() },
            Op::Store { worker: 1, blocks: blocks[150..160].to_vec() },
        ];
        let mut bulk = SyncIndex::new(8);
        bulk.apply(&frame(FrameKind::SnapshotStart, 0, 1, ws.clone(), vec![])).unwrap();
        let bulk_stats = bulk.apply(&frame(FrameKind::Delta, 1, 2, ws.clone(), ops.clone())).unwrap();
        let mut staged = SyncIndex::new(8);
        staged.apply(&frame(FrameKind::SnapshotStart, 0, 1, ws.clone(), ops.clone())).unwrap();
        assert_eq!(staged.entries, 0, "a snapshot's stores wait for their bucket's merge");
        staged.merge_all();
        let mut single = SyncIndex::new(8);
        single.apply(&frame(FrameKind::SnapshotStart, 0, 1, ws, vec![])).unwrap();
        let mut stored = 0;
        for op in &ops {
            let (w, blocks, hold) = match op {
                Op::Store { worker, blocks } => (*worker as usize, blocks, Hold::Gpu),
                Op::StoreOffloaded { worker, blocks } => (*worker as usize, blocks, Hold::Offloaded),
                _ => unreachable!(),
            };
            for b in blocks {
                stored += u64::from(single.set_hold(b.hash, b.anchor, w, hold));
            }
        }
        assert_eq!(bulk.buckets, single.buckets);
        assert_eq!(staged.buckets, single.buckets);
        assert_eq!((bulk.entries, bulk_stats.stored), (single.entries, stored));
        assert_eq!(staged.entries, single.entries);
        // a: 300 on GPU; b: 300 offloaded, then 10 of them back on GPU; c: all 500.
        for ix in [&bulk, &staged, &single] {
            assert_eq!(ix.cached_blocks(), &[300, 10, 500]);
            assert_eq!(ix.cached_blocks(), recount_cached(ix));
        }
    }

    /// Per slot, the GPU-held blocks of the merged entries, counted from scratch.
    fn recount_cached(ix: &SyncIndex) -> Vec<u32> {
        let (mw, stride) = (ix.mask_words, ix.stride());
        let mut n = vec![0u32; ix.slots.len()];
        for e in ix.buckets.iter().flat_map(|b| b.chunks_exact(stride)) {
            for (slot, count) in n.iter_mut().enumerate() {
                let (word, bit) = (slot / 64, 1u64 << (slot % 64));
                let off = ix.tiered && e[1 + mw + word] & bit != 0;
                *count += u32::from(e[1 + word] & bit != 0 && !off);
            }
        }
        n
    }

    #[test]
    fn cached_blocks_follow_every_change_and_are_published_after_the_buckets() {
        // Stores, repeated stores, removes of held and unheld blocks, tier moves, a clear,
        // a worker leaving, and a snapshot that starts over: the running counts equal a
        // count from scratch after each frame.
        let ws = vec![worker("a:1"), worker("b:1"), worker("c:1")];
        let blocks: Vec<FeedBlock> =
            (0..64u64).map(|i| FeedBlock { hash: i.wrapping_mul(0x9E37_79B9_7F4A_7C15), anchor: i % 5 }).collect();
        let frames = [
            frame(
                FrameKind::SnapshotStart,
                0,
                1,
                ws.clone(),
                vec![Op::Store { worker: 0, blocks: blocks[..40].to_vec() }],
            ),
            frame(
                FrameKind::Delta,
                1,
                2,
                ws.clone(),
                vec![
                    Op::Store { worker: 0, blocks: blocks[30..50].to_vec() },
                    Op::Store { worker: 1, blocks: blocks[..3].to_vec() },
                    Op::Remove { worker: 0, blocks: blocks[45..60].to_vec() },
                ],
            ),
            frame(
                FrameKind::Delta,
                2,
                3,
                ws.clone(),
                vec![
                    Op::StoreOffloaded { worker: 0, blocks: blocks[..10].to_vec() },
                    Op::Store { worker: 2, blocks: blocks.clone() },
                    Op::Clear { worker: 1 },
                ],
            ),
            frame(
                FrameKind::Delta,
                3,
                4,
                ws[..2].to_vec(),
                vec![Op::Store { worker: 0, blocks: blocks[..2].to_vec() }],
            ),
            frame(
                FrameKind::SnapshotStart,
                0,
                5,
                ws.clone(),
                vec![Op::Store { worker: 1, blocks: blocks[..9].to_vec() }],
            ),
        ];
        let expect: [&[u32]; 5] = [&[40, 0, 0], &[45, 3, 0], &[35, 0, 64], &[37, 0, 0], &[0, 9, 0]];
        let mut ix = SyncIndex::new(8);
        let store = crate::store::MemStore::default();
        for (f, want) in frames.iter().zip(expect) {
            ix.apply(f).unwrap();
            let published = publish(&mut ix, &store);
            assert_eq!(published.failures, 0);
            assert_eq!(ix.cached_blocks(), want, "after version {}", f.to_version);
            assert_eq!(ix.cached_blocks(), recount_cached(&ix));
            let (bytes, _) = store.get(CACHED_KEY).unwrap();
            assert_eq!(CachedBlocks::decode(&bytes.unwrap()).unwrap().0, ix.cached_blocks());
        }
        assert!(!ix.has_unpublished());
        assert!(publish(&mut ix, &store) == PublishStats::default(), "nothing changed: nothing written");
    }

    #[test]
    fn tiers_move_between_gpu_and_offload() {
        let ws = vec![worker("a:1"), worker("b:1")];
        let mut ix = SyncIndex::new(64);
        ix.apply(&frame(
            FrameKind::SnapshotStart,
            0,
            1,
            ws.clone(),
            vec![Op::Store { worker: 0, blocks: vec![blk(7)] }, Op::StoreOffloaded { worker: 1, blocks: vec![blk(7)] }],
        ))
        .unwrap();
        assert_eq!((holders(&mut ix, 7, 1000), offloaded(&mut ix, 7, 1000)), (vec![0, 1], vec![1]));
        assert!(Bucket::parse(&bucket_bytes(&mut ix, 1000)).unwrap().is_tiered());
        // b's copy comes back to its GPU; a's goes to CPU; then a loses it altogether.
        ix.apply(&frame(
            FrameKind::Delta,
            1,
            2,
            ws.clone(),
            vec![Op::Store { worker: 1, blocks: vec![blk(7)] }, Op::StoreOffloaded { worker: 0, blocks: vec![blk(7)] }],
        ))
        .unwrap();
        assert_eq!((holders(&mut ix, 7, 1000), offloaded(&mut ix, 7, 1000)), (vec![0, 1], vec![0]));
        ix.apply(&frame(FrameKind::Delta, 2, 3, ws, vec![Op::Remove { worker: 0, blocks: vec![blk(7)] }])).unwrap();
        assert_eq!((holders(&mut ix, 7, 1000), offloaded(&mut ix, 7, 1000)), (vec![1], vec![]));
        // No offloaded holder left: the bucket is written in the untiered format.
        assert!(!Bucket::parse(&bucket_bytes(&mut ix, 1000)).unwrap().is_tiered());
    }

    fn blk(hash: u64) -> FeedBlock {
        FeedBlock { hash, anchor: 1000 }
    }

    #[test]
    fn snapshot_then_deltas() {
        let mut ix = SyncIndex::new(64);
        assert_eq!(ix.poll_position(), PollPosition { epoch: 0, since: 0, cursor: 0 });
        let ws = vec![worker("a:1"), worker("b:1")];
        let snap = frame(
            FrameKind::SnapshotStart,
            0,
            5,
            ws.clone(),
            vec![Op::Store { worker: 1, blocks: vec![blk(7), blk(8)] }],
        );
        ix.apply(&snap).unwrap();
        assert_eq!(ix.take_dirty().len(), 64, "first snapshot rewrites every bucket");
        assert_eq!(holders(&mut ix, 7, 1000), vec![1]);
        assert_eq!(ix.poll_position(), PollPosition { epoch: 1, since: 5, cursor: 0 });
        let d = frame(
            FrameKind::Delta,
            5,
            6,
            ws.clone(),
            vec![Op::Store { worker: 0, blocks: vec![blk(7)] }, Op::Remove { worker: 1, blocks: vec![blk(8), blk(9)] }],
        );
        let st = ix.apply(&d).unwrap();
        assert_eq!((st.stored, st.removed), (1, 1));
        assert_eq!(holders(&mut ix, 7, 1000), vec![0, 1]);
        assert!(holders(&mut ix, 8, 1000).is_empty());
        assert_eq!(ix.take_dirty(), vec![bucket_of(1000, 64)]);
        assert_eq!(ix.entries(), 1);
        // A delta that does not start at our version forces a snapshot.
        let gap = frame(FrameKind::Delta, 9, 10, ws.clone(), vec![]);
        assert!(ix.apply(&gap).is_err());
        assert_eq!(ix.poll_position().since, 0);
        assert!(ix.apply(&frame(FrameKind::Delta, 6, 7, ws, vec![])).is_err(), "still needs a snapshot");
    }

    #[test]
    fn workers_leave_and_slots_stay() {
        let mut ix = SyncIndex::new(16);
        ix.apply(&frame(
            FrameKind::SnapshotStart,
            0,
            1,
            vec![worker("a:1"), worker("b:1")],
            vec![Op::Store { worker: 0, blocks: vec![blk(1)] }, Op::Store { worker: 1, blocks: vec![blk(1)] }],
        ))
        .unwrap();
        // b leaves: its bits go, its slot stays reserved; c gets a new slot.
        ix.apply(&frame(FrameKind::Delta, 1, 2, vec![worker("a:1"), worker("c:1")], vec![])).unwrap();
        let t = ix.take_table().unwrap();
        assert_eq!(
            t.slots.iter().map(|s| (s.id.as_str(), s.state)).collect::<Vec<_>>(),
            vec![("a:1", SlotState::Up), ("b:1", SlotState::Gone), ("c:1", SlotState::Up)]
        );
        assert_eq!(holders(&mut ix, 1, 1000), vec![0]);
        assert!(ix.take_table().is_none());
        // Down state and clear.
        let mut down = worker("a:1");
        down.up = false;
        ix.apply(&frame(FrameKind::Delta, 2, 3, vec![down, worker("c:1")], vec![Op::Clear { worker: 0 }])).unwrap();
        assert_eq!(ix.table().slots[0].state, SlotState::Down);
        assert!(holders(&mut ix, 1, 1000).is_empty());
        assert_eq!(ix.entries(), 0);
    }

    #[test]
    fn masks_widen_past_64_workers() {
        let mut ix = SyncIndex::new(16);
        let ws: Vec<_> = (0..70).map(|i| worker(&format!("w:{i}"))).collect();
        ix.apply(&frame(
            FrameKind::SnapshotStart,
            0,
            1,
            ws[..2].to_vec(),
            vec![Op::Store { worker: 1, blocks: vec![blk(5)] }],
        ))
        .unwrap();
        ix.apply(&frame(FrameKind::Delta, 1, 2, ws.clone(), vec![Op::Store { worker: 69, blocks: vec![blk(5)] }]))
            .unwrap();
        assert_eq!(holders(&mut ix, 5, 1000), vec![1, 69]);
    }

    #[test]
    fn tier_masks_come_with_the_first_offloaded_block_and_go_with_a_snapshot() {
        let mut ix = SyncIndex::new(16);
        let ws: Vec<_> = (0..70).map(|i| worker(&format!("w:{i}"))).collect();
        let snapshot = frame(
            FrameKind::SnapshotStart,
            0,
            1,
            ws[..2].to_vec(),
            vec![Op::Store { worker: 1, blocks: vec![blk(5), blk(6)] }],
        );
        ix.apply(&snapshot).unwrap();
        ix.merge_all();
        assert_eq!((ix.tiered, ix.stride()), (false, 2), "hash and one holder word: 16 B an entry");
        // An offloaded copy: the tier masks appear, the GPU holders stay.
        ix.apply(&frame(
            FrameKind::Delta,
            1,
            2,
            ws[..2].to_vec(),
            vec![Op::StoreOffloaded { worker: 0, blocks: vec![blk(5)] }],
        ))
        .unwrap();
        assert_eq!((ix.tiered, ix.stride()), (true, 3));
        assert_eq!((holders(&mut ix, 5, 1000), offloaded(&mut ix, 5, 1000)), (vec![0, 1], vec![0]));
        assert_eq!(holders(&mut ix, 6, 1000), vec![1]);
        // Wider masks keep both.
        ix.apply(&frame(FrameKind::Delta, 2, 3, ws.clone(), vec![Op::Store { worker: 69, blocks: vec![blk(5)] }]))
            .unwrap();
        assert_eq!(ix.stride(), 5);
        assert_eq!((holders(&mut ix, 5, 1000), offloaded(&mut ix, 5, 1000)), (vec![0, 1, 69], vec![0]));
        // A worker's Clear drops its offloaded bit with its holder bit.
        ix.apply(&frame(FrameKind::Delta, 3, 4, ws.clone(), vec![Op::Clear { worker: 0 }])).unwrap();
        assert_eq!((holders(&mut ix, 5, 1000), offloaded(&mut ix, 5, 1000)), (vec![1, 69], vec![]));
        // A snapshot without offloaded blocks drops the masks again.
        ix.apply(&frame(FrameKind::SnapshotStart, 1, 1, ws, vec![Op::Store { worker: 1, blocks: vec![blk(5)] }]))
            .unwrap();
        ix.merge_all();
        assert_eq!((ix.tiered, ix.stride()), (false, 3));
        assert_eq!(holders(&mut ix, 5, 1000), vec![1]);
    }

    #[test]
    fn paged_snapshot() {
        let mut ix = SyncIndex::new(16);
        let mut p1 = frame(
            FrameKind::SnapshotStart,
            0,
            9,
            vec![worker("a:1")],
            vec![Op::Store { worker: 0, blocks: vec![blk(1)] }],
        );
        p1.next_cursor = 77;
        ix.apply(&p1).unwrap();
        assert_eq!(ix.poll_position(), PollPosition { epoch: 1, since: 9, cursor: 77 });
        let p2 = frame(
            FrameKind::SnapshotMore,
            0,
            9,
            vec![worker("a:1")],
            vec![Op::Store { worker: 0, blocks: vec![blk(2)] }],
        );
        ix.apply(&p2).unwrap();
        assert_eq!(ix.poll_position(), PollPosition { epoch: 1, since: 9, cursor: 0 });
        ix.merge_all();
        assert_eq!(ix.entries(), 2);
        // A stray continuation page is refused.
        assert!(ix.apply(&p2).is_err());
    }

    #[test]
    fn publishing_within_a_budget_ends_where_one_publish_does() {
        use crate::store::MemStore;
        let blocks: Vec<FeedBlock> = (1..=200u64).map(|h| FeedBlock { hash: h, anchor: h * 7919 }).collect();
        let snapshot = frame(
            FrameKind::SnapshotStart,
            0,
            1,
            vec![worker("a:1"), worker("b:1")],
            vec![
                Op::Store { worker: 0, blocks: blocks.clone() },
                Op::Store { worker: 1, blocks: blocks[..50].to_vec() },
            ],
        );
        let (whole, parts) = (MemStore::new(), MemStore::new());
        let (mut ix_whole, mut ix_parts) = (SyncIndex::new(64), SyncIndex::new(64));
        for ix in [&mut ix_whole, &mut ix_parts] {
            ix.apply(&snapshot).unwrap();
            ix.set_live(true);
        }
        let all = publish_within(&mut ix_whole, &whole, usize::MAX);
        assert_eq!((all.bucket_writes, all.more), (64, false));

        // One bucket per call: the table goes out with the last one, not before.
        let mut calls = 0;
        loop {
            let st = publish_within(&mut ix_parts, &parts, 1);
            calls += 1;
            assert_eq!(st.bucket_writes, 1);
            if !st.more {
                break;
            }
            assert!(parts.get(TABLE_KEY).unwrap().0.is_none(), "no table before its buckets");
            assert!(ix_parts.has_unpublished());
        }
        assert_eq!(calls, 64);
        assert!(!ix_parts.has_unpublished());
        for b in 0..64 {
            assert_eq!(parts.get(&bucket_key(b)).unwrap().0, whole.get(&bucket_key(b)).unwrap().0, "bucket {b}");
        }
        assert_eq!(parts.get(TABLE_KEY).unwrap().0, whole.get(TABLE_KEY).unwrap().0);
    }

    #[test]
    fn a_fresh_index_publishes_nothing_until_the_feed_answers() {
        use crate::store::MemStore;
        let store = MemStore::new();
        let mut ix = SyncIndex::new(16);
        assert!(!ix.has_unpublished());
        publish(&mut ix, &store);
        assert!(store.get(TABLE_KEY).unwrap().0.is_none());

        ix.apply(&frame(FrameKind::SnapshotStart, 0, 1, vec![worker("a:1")], vec![])).unwrap();
        ix.set_live(true);
        assert!(ix.has_unpublished());
        publish(&mut ix, &store);
        let table = WorkerTable::decode(&store.get(TABLE_KEY).unwrap().0.unwrap()).unwrap();
        assert_eq!((table.index_live, table.slots.len()), (true, 1));
    }

    #[test]
    fn a_paged_snapshot_is_published_whole() {
        use crate::store::MemStore;
        let store = MemStore::new();
        let mut ix = SyncIndex::new(16);
        let delta = frame(
            FrameKind::SnapshotStart,
            0,
            3,
            vec![worker("a:1")],
            vec![Op::Store { worker: 0, blocks: vec![blk(1)] }],
        );
        ix.apply(&delta).unwrap();
        ix.set_live(true);
        publish(&mut ix, &store);
        let table_before = store.get(TABLE_KEY).unwrap().0;
        let published_bucket =
            |store: &MemStore| store.get(&bucket_key(bucket_of(1000, 16))).unwrap().0.unwrap_or_default();
        let before = published_bucket(&store);

        // A resync in two pages: worker b's blocks in the first, a's in the second.
        let mut p1 = frame(
            FrameKind::SnapshotStart,
            0,
            9,
            vec![worker("a:1"), worker("b:1")],
            vec![Op::Store { worker: 1, blocks: vec![blk(2)] }],
        );
        p1.epoch = 2;
        p1.next_cursor = 1;
        ix.apply(&p1).unwrap();
        assert!(ix.snapshot_in_progress());
        assert_eq!(publish(&mut ix, &store), PublishStats::default(), "nothing written mid-snapshot");
        assert_eq!(store.get(TABLE_KEY).unwrap().0, table_before);
        assert_eq!(published_bucket(&store), before, "readers keep the last whole index");

        let mut p2 = frame(
            FrameKind::SnapshotMore,
            0,
            9,
            vec![worker("a:1"), worker("b:1")],
            vec![Op::Store { worker: 0, blocks: vec![blk(1)] }],
        );
        p2.epoch = 2;
        ix.apply(&p2).unwrap();
        assert!(!ix.snapshot_in_progress());
        let stats = publish(&mut ix, &store);
        assert!(stats.bucket_writes >= 1 && stats.failures == 0);
        let table = WorkerTable::decode(&store.get(TABLE_KEY).unwrap().0.unwrap()).unwrap();
        assert_eq!((table.epoch, table.version, table.slots.len()), (2, 9, 2));
        let published = published_bucket(&store);
        let held: Vec<usize> = Bucket::parse(&published).unwrap().holders(1, 0, false, &SlotSet::FULL).iter().collect();
        assert_eq!(held, vec![0]);
    }

    #[test]
    fn confirmed_predictions_are_dropped_on_publish() {
        use crate::layout::fly_raw_of;
        use crate::store::MemStore;
        let store = MemStore::new();
        let mut ix = SyncIndex::new(16);
        ix.apply(&frame(FrameKind::SnapshotStart, 0, 1, vec![worker("a:1"), worker("b:1")], vec![])).unwrap();
        publish(&mut ix, &store);
        // Filters predicted blocks 7 and 8 on slot 0 and hold 7 in flight on slot 1.
        let key = bucket_key(bucket_of(1000, 16));
        let fly = [
            FlyEntry { hash: 7, slot: 0, refs: 0, until_ms: 99 },
            FlyEntry { hash: 7, slot: 1, refs: 1, until_ms: 99 },
            FlyEntry { hash: 8, slot: 0, refs: 0, until_ms: 99 },
        ];
        store.set(&key, &encode_bucket(IndexPart::EMPTY, 3, &fly_raw_of(&fly), 0), None).unwrap();
        // The engines confirm 7 on both slots.
        let d = Op::Store { worker: 0, blocks: vec![blk(7)] };
        let d2 = Op::Store { worker: 1, blocks: vec![blk(7)] };
        ix.apply(&frame(FrameKind::Delta, 1, 2, vec![worker("a:1"), worker("b:1")], vec![d, d2])).unwrap();
        assert_eq!(publish(&mut ix, &store).failures, 0);
        let v = store.get(&key).unwrap().0.unwrap();
        let left: Vec<_> = Bucket::parse(&v).unwrap().fly_entries().map(|e| (e.hash, e.slot)).collect();
        assert_eq!(left, vec![(7, 1), (8, 0)], "in-flight entries stay; unconfirmed predictions stay");
    }

    #[test]
    fn restored_slots_are_kept() {
        let mut ix = SyncIndex::new(16);
        ix.restore_slots(&WorkerTable {
            index_live: true,
            peer_load: false,
            block_size: 16,
            n_buckets: 16,
            epoch: 1,
            version: 1,
            slots: vec![
                WorkerSlot { id: "x:1".into(), role: Role::Both, state: SlotState::Up, kv_capacity_blocks: 300 },
                WorkerSlot { id: "y:1".into(), role: Role::Both, state: SlotState::Up, kv_capacity_blocks: 512 },
            ],
        });
        ix.apply(&frame(FrameKind::SnapshotStart, 0, 1, vec![worker("y:1")], vec![])).unwrap();
        let t = ix.table();
        assert_eq!(t.slots[1].state, SlotState::Up);
        assert_eq!(t.slots[0].state, SlotState::Gone);
        // The same engine keeps what it was learned to hold; one that left is forgotten.
        assert_eq!((t.slots[0].kv_capacity_blocks, t.slots[1].kv_capacity_blocks), (0, 512));
    }

    #[test]
    fn capacity_is_the_most_blocks_held_before_an_eviction() {
        let ws = vec![worker("a:1"), worker("b:1")];
        let blocks: Vec<FeedBlock> = (1..=40u64).map(blk).collect();
        let mut ix = SyncIndex::new(16);
        ix.apply(&frame(
            FrameKind::SnapshotStart,
            0,
            1,
            ws.clone(),
            vec![Op::Store { worker: 0, blocks: blocks[..10].to_vec() }],
        ))
        .unwrap();
        let capacities = |ix: &mut SyncIndex| -> Option<Vec<u32>> {
            ix.take_table().map(|t| t.slots.iter().map(|s| s.kv_capacity_blocks).collect())
        };
        capacities(&mut ix);
        let delta = |ix: &mut SyncIndex, ops: Vec<Op>| {
            let v = ix.version();
            ix.apply(&frame(FrameKind::Delta, v, v + 1, ws.clone(), ops)).unwrap();
        };
        // Stores alone say nothing of memory.
        delta(&mut ix, vec![Op::Store { worker: 0, blocks: blocks[10..15].to_vec() }]);
        assert_eq!(capacities(&mut ix), None);
        // The engine evicts three to store three: it held 15 when it had to.
        delta(
            &mut ix,
            vec![
                Op::Remove { worker: 0, blocks: blocks[..3].to_vec() },
                Op::Store { worker: 0, blocks: blocks[15..18].to_vec() },
            ],
        );
        assert_eq!(capacities(&mut ix), Some(vec![15, 0]));
        // Evicting at fewer, or removing what the index never had, changes nothing.
        delta(&mut ix, vec![Op::Remove { worker: 0, blocks: blocks[3..5].to_vec() }]);
        delta(
            &mut ix,
            vec![Op::Remove { worker: 0, blocks: vec![blk(99)] }, Op::Remove { worker: 1, blocks: vec![blk(7)] }],
        );
        assert_eq!(capacities(&mut ix), None);
        assert_eq!(ix.cached_blocks(), &[13, 0]);
        // Moving blocks to an offload tier takes them out of GPU memory too: 17 held then.
        delta(&mut ix, vec![Op::Store { worker: 0, blocks: blocks[18..22].to_vec() }]);
        delta(&mut ix, vec![Op::StoreOffloaded { worker: 0, blocks: blocks[5..7].to_vec() }]);
        assert_eq!(capacities(&mut ix), Some(vec![17, 0]));
        // A snapshot (the sidecar restarted) keeps it: the engines did not change.
        ix.apply(&frame(FrameKind::SnapshotStart, 0, 1, ws.clone(), vec![])).unwrap();
        assert_eq!(ix.table().slots[0].kv_capacity_blocks, 17);
        // One whose engine holds more than that raises it once its stores are merged, as a
        // delta's would.
        ix.apply(&frame(
            FrameKind::SnapshotStart,
            0,
            1,
            ws.clone(),
            vec![Op::Store { worker: 0, blocks: blocks[..20].to_vec() }],
        ))
        .unwrap();
        ix.merge_all();
        assert_eq!((ix.cached_blocks()[0], ix.table().slots[0].kv_capacity_blocks), (20, 20));
        // An engine that restarted is learned anew.
        delta(&mut ix, vec![Op::Store { worker: 0, blocks: blocks[..4].to_vec() }, Op::Clear { worker: 0 }]);
        assert_eq!(capacities(&mut ix), Some(vec![0, 0]));
        delta(&mut ix, vec![Op::Store { worker: 0, blocks: blocks[..4].to_vec() }]);
        delta(&mut ix, vec![Op::Remove { worker: 0, blocks: blocks[..1].to_vec() }]);
        assert_eq!(capacities(&mut ix), Some(vec![4, 0]));
        // Holding more than that later (the eviction at 4 was not for memory) raises it;
        // an engine that never evicted still has none.
        delta(
            &mut ix,
            vec![
                Op::Store { worker: 0, blocks: blocks[4..9].to_vec() },
                Op::Store { worker: 1, blocks: blocks[..9].to_vec() },
            ],
        );
        assert_eq!(capacities(&mut ix), Some(vec![8, 0]));
        delta(&mut ix, vec![Op::Remove { worker: 0, blocks: blocks[4..6].to_vec() }]);
        assert_eq!(capacities(&mut ix), None);
        // And the table carries it to the filters.
        let t = ix.table();
        assert_eq!(WorkerTable::decode(&t.encode()).unwrap().slots[0].kv_capacity_blocks, 8);
    }
}
