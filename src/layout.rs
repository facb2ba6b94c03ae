//! The shared-data layout: what the sync service writes and the filter reads.
//!
//! proxy-wasm shared data is one process-global map per `vm_id` behind one mutex; every
//! `get` copies the value twice and keys can never be deleted (ABI 0.2.1). So the layout
//! has a fixed, bounded key space and the request path reads a handful of small values:
//!
//! | key | writer | value |
//! |---|---|---|
//! | `kvroute.workers` | sync | [`WorkerTable`]: slots, ids, roles, up/down, feed state |
//! | `kvroute.slotload` | filters (CAS) | [`LoadVector`]: distinct in-flight blocks and outstanding prefill per slot |
//! | `kvroute.cached` | sync | [`CachedBlocks`]: blocks each slot holds in GPU memory |
//! | `kvroute.b.{0..n_buckets}` | sync + filters (CAS) | [`Bucket`]: cached blocks and in-flight/predicted blocks |
//! | `kvroute.k.{0..64}`, `kvroute.keyload` | filters (CAS) | cache keys ([`crate::cachekey`]) |
//!
//! Blocks are grouped into *segments* of a request's block sequence whose lengths double:
//! `[0,32) [32,64) [64,128) [128,256) …` (see [`crate::hash::segments`]). All blocks of one segment go to
//! the bucket of the segment's first block (its *anchor*), so scoring a request reads one
//! bucket per segment — 3 reads for 2k tokens, 7 for 32k — and stops at the first segment
//! nobody holds. The full format is in `docs/shared-data.md`.

use crate::role::Role;
use crate::slots::SlotSet;
pub use crate::slots::MAX_SLOTS;
use std::fmt;

pub const TABLE_KEY: &str = "kvroute.workers";
pub const LOAD_KEY: &str = "kvroute.slotload";
pub const CACHED_KEY: &str = "kvroute.cached";
pub(crate) const BUCKET_KEY_PREFIX: &str = "kvroute.b.";

/// Default number of index buckets (keys). Power of two. A decision reads a fixed number
/// of buckets, so what it costs grows with the entries per bucket: 16384 keeps that ≤ ~600
/// up to 10M cached (worker, block) entries, for ~2 MB of shared data when the index is
/// empty (docs/benchmarks.md, scale simulation).
pub const DEFAULT_BUCKETS: u32 = 16384;

/// Key of bucket `b`.
pub fn bucket_key(b: u32) -> String {
    // Three of these a routing decision: without the formatting machinery.
    let mut digits = [0u8; 10];
    let (mut i, mut n) = (digits.len(), b);
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut key = String::with_capacity(BUCKET_KEY_PREFIX.len() + digits.len() - i);
    key.push_str(BUCKET_KEY_PREFIX);
    key.extend(digits[i..].iter().map(|&d| char::from(d)));
    key
}

/// Bucket of a segment anchor. `n_buckets` is a power of two (checked at configuration).
#[inline]
pub fn bucket_of(anchor: u64, n_buckets: u32) -> u32 {
    // xxh3 output is well mixed; folding the halves keeps both in play for small masks.
    ((anchor ^ (anchor >> 32)) as u32) & (n_buckets.max(1) - 1)
}

/// A shared-data value that could not be decoded. The filter routes by load and counts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutError(pub &'static str);

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bad shared-data value: {}", self.0)
    }
}

/// Little-endian reader over a byte slice that fails instead of panicking.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }
    pub(crate) fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], LayoutError> {
        if self.remaining() < n {
            return Err(LayoutError(what));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, LayoutError> {
        Ok(self.take(1, what)?[0])
    }
    pub(crate) fn u16(&mut self, what: &'static str) -> Result<u16, LayoutError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, LayoutError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, LayoutError> {
        Ok(le_u64(self.take(8, what)?))
    }
}

/// The first index in `lo..hi` where `before(index)` is false, for a `before` that is true
/// on a prefix of the range (entries sorted by what it compares): a bisection.
#[inline]
pub(crate) fn lower_bound(mut lo: usize, mut hi: usize, before: impl Fn(usize) -> bool) -> usize {
    while lo < hi {
        let mid = (lo + hi) / 2;
        if before(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// First index in `from..n` where `before(index)` is false, for a `before` that is true on
/// a prefix: gallops forward, then bisects.
#[inline]
pub(crate) fn gallop(from: usize, n: usize, before: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (from, from);
    let mut step = 1;
    while hi < n && before(hi) {
        lo = hi + 1;
        hi = (hi + step).min(n);
        step *= 2;
    }
    lower_bound(lo, hi, before)
}

#[inline]
pub(crate) fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

// ---------------------------------------------------------------------------------------
// Worker table

/// A slot's state in the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Assigned once, the worker has since left the fleet; the slot is not reused.
    Gone = 0,
    Up = 1,
    /// In the fleet, but the sidecar marked it down: never chosen.
    Down = 2,
}

impl SlotState {
    fn from_u8(v: u8) -> Option<SlotState> {
        match v {
            0 => Some(SlotState::Gone),
            1 => Some(SlotState::Up),
            2 => Some(SlotState::Down),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerSlot {
    /// `ip:port`, as Envoy's `workers` cluster knows the host.
    pub id: String,
    pub role: Role,
    pub state: SlotState,
    /// The KV blocks its engine holds at most, as learned from the events: the most blocks
    /// the index saw it hold just before it evicted one (GPU memory). 0: not learned yet
    /// (the engine has not evicted since it started or the sync service did).
    pub kv_capacity_blocks: u32,
}

/// The worker table and the feed's state, written by the sync service.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerTable {
    /// The index in the buckets is current (the sidecar answered recently). When false the
    /// filter routes by load only.
    pub index_live: bool,
    /// Other gateways report load ([`crate::peerload`]): the filter reads
    /// [`crate::peerload::PEERLOAD_KEY`] and adds it to its own.
    pub peer_load: bool,
    /// The fleet's block size, as the sidecar hashes; must equal the filter's.
    pub block_size: u32,
    pub n_buckets: u32,
    pub epoch: u64,
    pub version: u64,
    /// Indexed by slot.
    pub slots: Vec<WorkerSlot>,
}

const TABLE_FORMAT: u16 = 2;

impl WorkerTable {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.slots.len() * 28);
        out.extend_from_slice(&TABLE_FORMAT.to_le_bytes());
        out.push(u8::from(self.index_live) | u8::from(self.peer_load) << 1);
        out.push(0);
        out.extend_from_slice(&self.block_size.to_le_bytes());
        out.extend_from_slice(&self.n_buckets.to_le_bytes());
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.slots.len() as u16).to_le_bytes());
        for s in &self.slots {
            out.push(s.state as u8);
            out.push(s.role as u8);
            out.extend_from_slice(&s.kv_capacity_blocks.to_le_bytes());
            let id = &s.id.as_bytes()[..s.id.len().min(255)];
            out.push(id.len() as u8);
            out.extend_from_slice(id);
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<WorkerTable, LayoutError> {
        let mut r = Reader::new(bytes);
        // Format 1 (no capacities) is what a VM of an earlier build left: read, so that a
        // new sync service keeps its slot assignment.
        let format = r.u16("table format")?;
        if format != TABLE_FORMAT && format != 1 {
            return Err(LayoutError("unknown table format"));
        }
        let flags = r.u8("table flags")?;
        let (index_live, peer_load) = (flags & 1 == 1, flags & 2 == 2);
        r.u8("table reserved")?;
        let block_size = r.u32("block size")?;
        let n_buckets = r.u32("bucket count")?;
        if !n_buckets.is_power_of_two() {
            return Err(LayoutError("bucket count not a power of two"));
        }
        let epoch = r.u64("epoch")?;
        let version = r.u64("version")?;
        let n = usize::from(r.u16("slot count")?);
        if n > MAX_SLOTS {
            return Err(LayoutError("too many slots"));
        }
        let mut slots = Vec::with_capacity(crate::wire::capacity_for::<WorkerSlot>(n, r.remaining(), 7));
        for _ in 0..n {
            let state = SlotState::from_u8(r.u8("slot state")?).ok_or(LayoutError("slot state"))?;
            let role = Role::from_u8(r.u8("slot role")?).ok_or(LayoutError("slot role"))?;
            let kv_capacity_blocks = if format == 1 { 0 } else { r.u32("slot capacity")? };
            let len = usize::from(r.u8("id length")?);
            let id = std::str::from_utf8(r.take(len, "id")?).map_err(|_| LayoutError("id utf-8"))?;
            if id.is_empty() {
                return Err(LayoutError("empty worker id"));
            }
            slots.push(WorkerSlot { id: id.to_string(), role, state, kv_capacity_blocks });
        }
        // The sync service gives a worker one slot for the process's life (a returning
        // worker gets its old one back); a table naming one twice was not written by it,
        // and routing on it could name a worker twice in the ranked list.
        let mut ids = std::collections::HashSet::with_capacity(slots.len());
        if !slots.iter().all(|s| ids.insert(s.id.as_str())) {
            return Err(LayoutError("worker listed twice"));
        }
        Ok(WorkerTable { index_live, peer_load, block_size, n_buckets, epoch, version, slots })
    }
}

// ---------------------------------------------------------------------------------------
// Cached blocks

/// Per slot, the blocks the index says it holds in GPU memory: `n_slots × u32`
/// little-endian; missing tail slots are 0 (a slot newer than the last write holds
/// nothing yet). The filter reads it only to break a tie between equally cheap workers
/// (`tie_break`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CachedBlocks(pub Vec<u32>);

impl CachedBlocks {
    pub fn decode(bytes: &[u8]) -> Result<CachedBlocks, LayoutError> {
        if !bytes.len().is_multiple_of(4) || bytes.len() / 4 > MAX_SLOTS {
            return Err(LayoutError("cached-block counts: length"));
        }
        let u = |c: &[u8]| u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        Ok(CachedBlocks(bytes.chunks_exact(4).map(u).collect()))
    }
    pub fn encode(&self) -> Vec<u8> {
        self.0.iter().flat_map(|n| n.to_le_bytes()).collect()
    }
    /// Blocks `slot` holds.
    pub fn get(&self, slot: usize) -> u32 {
        self.0.get(slot).copied().unwrap_or(0)
    }
}

// ---------------------------------------------------------------------------------------
// Load vector

/// A count kept in two epochs, so that what nothing takes back still expires: a charge
/// goes into the current epoch and its release comes out of the epoch it went into; a
/// charge whose release never comes (a VM that died) stops counting once its epoch is two
/// behind. Also a plain count of recent events (nothing released): then it counts the
/// events of the last one to two epochs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EpochCount {
    /// The epoch `now` belongs to; `before` is the one before it.
    pub epoch: u32,
    pub now: u32,
    pub before: u32,
}

impl EpochCount {
    /// The count as of `epoch`.
    pub fn get(&self, epoch: u32) -> u32 {
        match epoch.wrapping_sub(self.epoch) {
            0 => self.now.saturating_add(self.before),
            1 => self.now,
            _ => 0,
        }
    }

    /// Moves the epochs forward to `epoch` (never back: a writer with a slower clock
    /// charges the current epoch).
    fn advance(&mut self, epoch: u32) {
        let ahead = epoch.wrapping_sub(self.epoch);
        if ahead == 0 || ahead > u32::MAX / 2 {
            return;
        }
        self.before = if ahead == 1 { self.now } else { 0 };
        self.now = 0;
        self.epoch = epoch;
    }

    /// Adds `n` (a release: < 0) to epoch `at`, by a writer whose clock is at `epoch`. A
    /// change for an epoch that is no longer kept is dropped: that charge has expired.
    pub fn add(&mut self, at: u32, n: i64, epoch: u32) {
        self.advance(epoch);
        match self.epoch.wrapping_sub(at) {
            0 => self.now = saturate(i64::from(self.now) + n),
            1 => self.before = saturate(i64::from(self.before) + n),
            _ => {}
        }
    }
}

/// One slot's load: its distinct in-flight prompt blocks (`active`) and its outstanding
/// prefill, the uncached prompt blocks of requests whose prefill has not finished, kept in
/// two epochs of [`PREFILL_EPOCH_MS`] ([`EpochCount`]): a sum with nothing to expire it
/// entry by entry. Charged whole until each request's first token, it overstates what is
/// left while the engine works through it, so the slot also keeps when its prefill last
/// began draining and the rate it drains at ([`PrefillRate`], learned from the prefills
/// that ended): [`SlotLoad::draining_prefill`] is the sum less what that rate has
/// computed since.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotLoad {
    pub active: u32,
    pub prefill: EpochCount,
    /// ms (wrapping `u32` of the writer's clock) when the outstanding prefill began
    /// draining: the last prefill end on the slot, or the charge that found it idle.
    pub prefill_since_ms: u32,
    pub prefill_rate: PrefillRate,
}

/// Length of an outstanding-prefill epoch: a prefill still running after a minute may stop
/// being counted; one never released is forgotten within two.
pub const PREFILL_EPOCH_MS: u64 = 60_000;

/// The outstanding-prefill epoch of `now_ms`.
pub fn prefill_epoch(now_ms: u64) -> u32 {
    (now_ms / PREFILL_EPOCH_MS) as u32
}

/// A slot's prefill rate as sums of the blocks its ended prefills computed and the busy ms
/// they took, in 1/16 units, over about the last [`RATE_WINDOW_MS`] of busy time: when the
/// ms pass it, both sums are scaled down together. A ratio of sums, not a mean of ratios:
/// prefills batched into one engine step end together, the first with the step's whole
/// time and the rest with none, and only their sums give the rate. The window is of time,
/// not of prefills: a step ending dozens of short prefills at once (a hot prefix's questions)
/// must not push its own time out of the sums, which would read as a rate of many blocks in
/// no time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillRate {
    pub blocks: u32,
    pub ms: u32,
}

/// Longest busy time one ended prefill counts for, and longest a drain runs: a slot whose
/// prefill started longer ago is stale (charges expire within two epochs anyway).
const MAX_DRAIN_MS: u32 = 2 * PREFILL_EPOCH_MS as u32;

/// The busy time a slot's prefill rate is measured over ([`PrefillRate`]): several
/// prefills of a 2k-token prompt on the engines measured here (0.2–0.4 s each), so one
/// slow step moves it little, and recent enough to follow a change of load.
pub const RATE_WINDOW_MS: u32 = 4_000;

impl PrefillRate {
    /// An ended prefill of `blocks` that kept the slot busy `ms`.
    fn sample(&mut self, blocks: u32, ms: u32) {
        let (b, m) = (u64::from(self.blocks) + u64::from(blocks) * 16, u64::from(self.ms) + u64::from(ms) * 16);
        let window = u64::from(RATE_WINDOW_MS) * 16;
        // Past the window, both scale down together: the ratio stays, the old time weighs less.
        let (b, m) = if m > window { (b * window / m, window) } else { (b, m) };
        self.blocks = b.min(u64::from(u32::MAX)) as u32;
        self.ms = m as u32;
    }

    /// Whether no prefill has ended to give a rate.
    pub fn is_unknown(&self) -> bool {
        self.ms == 0
    }

    /// Blocks computed in `ms` at this rate; none before any prefill ended.
    pub fn blocks_in(&self, ms: u32) -> u32 {
        match self.ms {
            0 => 0,
            per => (u64::from(ms) * u64::from(self.blocks) / u64::from(per)).min(u64::from(u32::MAX)) as u32,
        }
    }
}

fn elapsed_ms(now_ms: u64, since_ms: u32) -> u32 {
    (now_ms as u32).wrapping_sub(since_ms).min(MAX_DRAIN_MS)
}

impl SlotLoad {
    /// Outstanding prefill blocks as of `epoch`, as charged.
    pub fn pending_prefill(&self, epoch: u32) -> u32 {
        self.prefill.get(epoch)
    }

    /// Outstanding prefill blocks at `now_ms`, less what the slot's learned rate has
    /// computed since its prefill began draining; `fleet` stands in for a rate the slot has
    /// not learned yet (no prefill of its own ended: a new engine, the first seconds).
    pub fn draining_prefill(&self, now_ms: u64, fleet: PrefillRate) -> u32 {
        let pending = self.pending_prefill(prefill_epoch(now_ms));
        let rate = if self.prefill_rate.is_unknown() { fleet } else { self.prefill_rate };
        pending.saturating_sub(rate.blocks_in(elapsed_ms(now_ms, self.prefill_since_ms)))
    }

    /// Applies one change at the writer's `now_ms`. A release of a prefill that `ended`
    /// (its first token came) is a sample of the slot's rate and restarts the drain; a
    /// charge on an idle slot starts it.
    fn change_prefill(&mut self, c: &PrefillChange, now_ms: u64, ended: bool) {
        let epoch = prefill_epoch(now_ms);
        let pending = self.pending_prefill(epoch);
        if c.blocks > 0 && pending == 0 {
            self.prefill_since_ms = now_ms as u32;
        } else if c.blocks < 0 && ended && pending > 0 {
            let blocks = c.blocks.unsigned_abs().min(u64::from(u32::MAX)) as u32;
            self.prefill_rate.sample(blocks, elapsed_ms(now_ms, self.prefill_since_ms));
            self.prefill_since_ms = now_ms as u32;
        }
        self.prefill.add(c.epoch, c.blocks, epoch);
    }
}

/// A change of outstanding prefill: `blocks` charged (> 0) or released (< 0) on `slot` in
/// epoch `epoch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillChange {
    pub slot: usize,
    pub epoch: u32,
    pub blocks: i64,
}

impl PrefillChange {
    /// What undoes this change: a charge's release, in the epoch it was charged in.
    pub fn undone(self) -> PrefillChange {
        PrefillChange { blocks: -self.blocks, ..self }
    }
}

/// Per slot (indexed by slot) [`SlotLoad`]: `n_slots × (u32 active, u32 prefill_epoch,
/// u32 prefill_now, u32 prefill_before, u32 prefill_since_ms, u32 rate_blocks, u32
/// rate_ms)` little-endian; missing tail slots are all 0.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadVector(pub Vec<SlotLoad>);

/// Bytes of one slot's record in the load vector.
pub const LOAD_RECORD: usize = 7 * 4;

/// Per-slot records of `N` little-endian `u32`s, at most [`MAX_SLOTS`]; a trailing partial
/// record is ignored (the writers' layout is ours). The load vector's and the cache keys'
/// counts.
pub(crate) fn decode_slot_records<const N: usize, T>(bytes: &[u8], record: impl Fn([u32; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(4 * N)
        .take(MAX_SLOTS)
        .map(|c| {
            record(std::array::from_fn(|i| u32::from_le_bytes([c[4 * i], c[4 * i + 1], c[4 * i + 2], c[4 * i + 3]])))
        })
        .collect()
}

/// The inverse of [`decode_slot_records`].
pub(crate) fn encode_slot_records<const N: usize, T>(records: &[T], fields: impl Fn(&T) -> [u32; N]) -> Vec<u8> {
    // Sized up front: a nested iterator collects with no size hint, growing by copies (the
    // load vector is written twice a request).
    let mut out = Vec::with_capacity(records.len() * 4 * N);
    for r in records {
        for v in fields(r) {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

/// `slot`'s record, the vector grown with empty records up to it; `None` past [`MAX_SLOTS`].
pub(crate) fn slot_record<T: Default + Clone>(records: &mut Vec<T>, slot: usize) -> Option<&mut T> {
    if slot >= MAX_SLOTS {
        return None;
    }
    if records.len() <= slot {
        records.resize(slot + 1, T::default());
    }
    records.get_mut(slot)
}

impl LoadVector {
    pub fn decode(bytes: &[u8]) -> LoadVector {
        LoadVector(decode_slot_records(bytes, |[active, epoch, now, before, since, blocks, ms]| SlotLoad {
            active,
            prefill: EpochCount { epoch, now, before },
            prefill_since_ms: since,
            prefill_rate: PrefillRate { blocks, ms },
        }))
    }
    pub fn encode(&self) -> Vec<u8> {
        encode_slot_records(&self.0, |s| {
            [
                s.active,
                s.prefill.epoch,
                s.prefill.now,
                s.prefill.before,
                s.prefill_since_ms,
                s.prefill_rate.blocks,
                s.prefill_rate.ms,
            ]
        })
    }
    /// `active_blocks` of `slot`.
    pub fn get(&self, slot: usize) -> u32 {
        self.0.get(slot).map_or(0, |s| s.active)
    }
    /// Outstanding prefill blocks of `slot` as of `epoch`, as charged.
    pub fn pending_prefill(&self, slot: usize, epoch: u32) -> u32 {
        self.0.get(slot).map_or(0, |s| s.pending_prefill(epoch))
    }
    /// Outstanding prefill blocks of `slot` at `now_ms`, drained ([`SlotLoad::draining_prefill`]).
    pub fn draining_prefill(&self, slot: usize, now_ms: u64, fleet: PrefillRate) -> u32 {
        self.0.get(slot).map_or(0, |s| s.draining_prefill(now_ms, fleet))
    }
    /// The fleet's prefill rate: every slot's sums added (a ratio of sums, as one slot's is),
    /// for a slot that has not learned its own. Engines behind one route usually serve one
    /// model on one kind of GPU; unknown (0 ms) before any prefill ended anywhere.
    pub fn fleet_prefill_rate(&self) -> PrefillRate {
        let (blocks, ms) = self
            .0
            .iter()
            .fold((0u64, 0u64), |(b, m), s| (b + u64::from(s.prefill_rate.blocks), m + u64::from(s.prefill_rate.ms)));
        // Both scaled alike into u32: the ratio is what counts.
        let shift = (64 - blocks.max(ms).leading_zeros()).saturating_sub(32);
        PrefillRate { blocks: (blocks >> shift) as u32, ms: (ms >> shift) as u32 }
    }
    fn slot_mut(&mut self, slot: usize) -> Option<&mut SlotLoad> {
        slot_record(&mut self.0, slot)
    }
    /// Applies signed per-slot changes of `active_blocks`, saturating at 0.
    pub fn apply(&mut self, deltas: &[(usize, i64)]) {
        for &(slot, d) in deltas {
            if let Some(s) = self.slot_mut(slot) {
                s.active = saturate(i64::from(s.active) + d);
            }
        }
    }
    /// Applies changes of outstanding prefill at the writer's `now_ms`; the releases among
    /// them are of prefills that `ended` (their first token came: a sample of the slot's
    /// rate) or not (streams that ended before it). A change for an epoch that is no longer
    /// kept is dropped: that charge has expired already.
    pub fn apply_prefill(&mut self, changes: &[PrefillChange], now_ms: u64, ended: bool) {
        for c in changes {
            if let Some(s) = self.slot_mut(c.slot) {
                s.change_prefill(c, now_ms, ended);
            }
        }
    }
}

fn saturate(v: i64) -> u32 {
    v.clamp(0, i64::from(u32::MAX)) as u32
}

// ---------------------------------------------------------------------------------------
// Buckets

/// A block a filter routed to a worker: in flight while `refs > 0`, then a prediction
/// until `until_ms` (or until the sidecar's index confirms it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlyEntry {
    pub hash: u64,
    pub slot: u16,
    /// Streams in flight holding this block on this slot.
    pub refs: u16,
    /// While `refs > 0`: lease end (a stream that never released, e.g. a VM that died, is
    /// dropped then). After: end of the prediction.
    pub until_ms: u64,
}

impl FlyEntry {
    #[inline]
    pub fn live(&self, now_ms: u64) -> bool {
        self.until_ms > now_ms
    }
}

/// Index entries carry holders only.
const BUCKET_FORMAT: u16 = 1;
/// Index entries carry holders, then the holders that have the block only in an offload
/// tier (a subset), each `mask_words` words.
const BUCKET_FORMAT_TIERED: u16 = 2;
const BUCKET_HEADER: usize = 20;
/// Bytes of one in-flight entry.
pub const FLY_ENTRY: usize = 20;

/// A decoded view of one bucket value. An empty value is an empty bucket (keys cannot be
/// deleted, so "removed" is "stored empty").
///
/// ```text
/// u16 format (1, or 2 = tiered) | u16 mask_words | u32 n_idx | u32 n_fly | u64 sweep_at_ms
/// n_idx × (u64 hash, mask_words × u64 holder mask          sorted by hash   (sync-owned)
///          [, mask_words × u64 offloaded-only mask])       (format 2 only)
/// n_fly × (u64 hash, u16 slot, u16 refs, u64 until_ms)      sorted by (hash, slot) (filter-owned)
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Bucket<'a> {
    mask_words: usize,
    tiered: bool,
    n_idx: usize,
    idx: &'a [u8],
    n_fly: usize,
    fly: &'a [u8],
    sweep_at_ms: u64,
}

impl<'a> Bucket<'a> {
    pub const EMPTY: Bucket<'static> =
        Bucket { mask_words: 0, tiered: false, n_idx: 0, idx: &[], n_fly: 0, fly: &[], sweep_at_ms: 0 };

    pub fn parse(bytes: &'a [u8]) -> Result<Bucket<'a>, LayoutError> {
        if bytes.is_empty() {
            return Ok(Bucket::EMPTY);
        }
        let mut r = Reader::new(bytes);
        let tiered = match r.u16("bucket format")? {
            BUCKET_FORMAT => false,
            BUCKET_FORMAT_TIERED => true,
            _ => return Err(LayoutError("unknown bucket format")),
        };
        let mask_words = usize::from(r.u16("mask words")?);
        if mask_words > MAX_SLOTS / 64 {
            return Err(LayoutError("mask too wide"));
        }
        let n_idx = r.u32("index count")? as usize;
        let n_fly = r.u32("in-flight count")? as usize;
        let sweep_at_ms = r.u64("sweep time")?;
        let stride = IndexPart { mask_words, tiered, n: 0, raw: &[] }.stride();
        let idx_len = n_idx.checked_mul(stride).ok_or(LayoutError("index size"))?;
        let fly_len = n_fly.checked_mul(FLY_ENTRY).ok_or(LayoutError("in-flight size"))?;
        if r.remaining() != idx_len.saturating_add(fly_len) {
            return Err(LayoutError("bucket length"));
        }
        let idx = r.take(idx_len, "index entries")?;
        let fly = r.take(fly_len, "in-flight entries")?;
        Ok(Bucket { mask_words, tiered, n_idx, idx, n_fly, fly, sweep_at_ms })
    }

    pub fn n_idx(&self) -> usize {
        self.n_idx
    }

    pub fn n_fly(&self) -> usize {
        self.n_fly
    }

    fn idx_stride(&self) -> usize {
        self.index_part().stride()
    }

    /// Whether some index entry has holders that hold it only offloaded.
    pub fn is_tiered(&self) -> bool {
        self.tiered
    }

    fn idx_hash(&self, i: usize) -> u64 {
        le_u64(&self.idx[i * self.idx_stride()..])
    }

    /// The holder mask of `hash` in the index part, as raw little-endian words.
    pub fn idx_mask(&self, hash: u64) -> Option<&'a [u8]> {
        self.idx_masks(hash).map(|(holders, _)| holders)
    }

    /// The holder mask of `hash` and, in a tiered bucket, its offloaded-only mask.
    pub fn idx_masks(&self, hash: u64) -> Option<(&'a [u8], Option<&'a [u8]>)> {
        let (mut lo, mut hi) = (0, self.n_idx);
        while lo < hi {
            let mid = (lo + hi) / 2;
            match self.idx_hash(mid).cmp(&hash) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(self.masks_at(mid)),
            }
        }
        None
    }

    /// The masks of the `i`-th index entry.
    pub fn masks_at(&self, i: usize) -> (&'a [u8], Option<&'a [u8]>) {
        let s = i * self.idx_stride() + 8;
        let w = 8 * self.mask_words;
        (&self.idx[s..s + w], self.tiered.then(|| &self.idx[s + w..s + 2 * w]))
    }

    pub fn fly_entry(&self, i: usize) -> FlyEntry {
        FlyEntry::decode(&self.fly[i * FLY_ENTRY..(i + 1) * FLY_ENTRY])
    }

    pub fn fly_entries(&self) -> impl Iterator<Item = FlyEntry> + '_ {
        (0..self.n_fly).map(move |i| self.fly_entry(i))
    }

    /// Index of the first in-flight entry with `entry.hash >= hash`. Its own bisection, not
    /// [`lower_bound`]: that one here cost `route/32768tok/128` 8% (`cargo bench --bench
    /// core`); `idx_masks` keeps its three-way search for the same reason.
    #[inline]
    fn fly_lower_bound(&self, hash: u64) -> usize {
        let (mut lo, mut hi) = (0, self.n_fly);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if le_u64(&self.fly[mid * FLY_ENTRY..]) < hash {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// The in-flight entries of `hash`.
    #[inline]
    fn fly_entries_of(&self, hash: u64) -> impl Iterator<Item = FlyEntry> + '_ {
        (self.fly_lower_bound(hash)..self.n_fly).map(|i| self.fly_entry(i)).take_while(move |e| e.hash == hash)
    }

    /// The slots of `among` that hold `hash`: in the sidecar's index, and (when
    /// `with_fly`) in flight or predicted at `now_ms`. Only the index mask's words and the
    /// hash's own in-flight entries are looked at.
    #[inline]
    pub fn holders(&self, hash: u64, now_ms: u64, with_fly: bool, among: &SlotSet) -> SlotSet {
        let mut out = SlotSet::EMPTY;
        if let Some(mask) = self.idx_mask(hash) {
            out.union_le_words(mask);
            out = out.intersection(among);
        }
        if with_fly {
            out = out.union(&self.fly_holders(hash, now_ms, among));
        }
        out
    }

    /// The slots of `among` with `hash` in flight or predicted at `now_ms`.
    pub fn fly_holders(&self, hash: u64, now_ms: u64, among: &SlotSet) -> SlotSet {
        self.fly_holders_and_in_flight(hash, now_ms, among).0
    }

    /// The slots of `among` with `hash` in flight or predicted at `now_ms`, and of those the
    /// ones where it is in flight (a stream holds it there: `refs > 0`).
    pub fn fly_holders_and_in_flight(&self, hash: u64, now_ms: u64, among: &SlotSet) -> (SlotSet, SlotSet) {
        let (mut live, mut flying) = (SlotSet::EMPTY, SlotSet::EMPTY);
        if self.n_fly == 0 {
            return (live, flying);
        }
        for e in self.fly_entries_of(hash) {
            let slot = usize::from(e.slot);
            if e.live(now_ms) && among.contains(slot) {
                live.insert(slot);
                if e.refs > 0 {
                    flying.insert(slot);
                }
            }
        }
        (live, flying)
    }

    /// The slots of `among` where two or more streams have `hash` in flight.
    pub fn fly_shared(&self, hash: u64, now_ms: u64, among: &SlotSet) -> SlotSet {
        let mut shared = SlotSet::EMPTY;
        for e in self.fly_entries_of(hash) {
            if e.refs >= 2 && e.live(now_ms) && among.contains(usize::from(e.slot)) {
                shared.insert(usize::from(e.slot));
            }
        }
        shared
    }

    /// The slots of `among` that hold `hash` only in an offload tier: in the index's
    /// offloaded mask and (when `with_fly`) not in flight or predicted there — a block
    /// routed to a worker is being loaded into its GPU.
    pub fn offloaded_only(&self, hash: u64, now_ms: u64, with_fly: bool, among: &SlotSet) -> SlotSet {
        let Some((_, Some(off))) = self.idx_masks(hash) else { return SlotSet::EMPTY };
        let mut out = SlotSet::EMPTY;
        out.union_le_words(off);
        out = out.intersection(among);
        if with_fly && !out.is_empty() {
            out = out.difference(&self.fly_holders(hash, now_ms, &out));
        }
        out
    }

    /// The index part as stored.
    pub fn index_part(&self) -> IndexPart<'a> {
        IndexPart { mask_words: self.mask_words, tiered: self.tiered, n: self.n_idx, raw: self.idx }
    }

    /// The raw in-flight part: `(n_fly, bytes)`.
    pub fn fly_raw(&self) -> (usize, &'a [u8]) {
        (self.n_fly, self.fly)
    }

    /// When the next writer should sweep dead in-flight entries out of the whole bucket
    /// (writers in between only touch their own entries).
    pub fn sweep_at_ms(&self) -> u64 {
        self.sweep_at_ms
    }
}

impl FlyEntry {
    pub fn decode(b: &[u8]) -> FlyEntry {
        FlyEntry {
            hash: le_u64(b),
            slot: u16::from_le_bytes([b[8], b[9]]),
            refs: u16::from_le_bytes([b[10], b[11]]),
            until_ms: le_u64(&b[12..]),
        }
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.hash.to_le_bytes());
        out.extend_from_slice(&self.slot.to_le_bytes());
        out.extend_from_slice(&self.refs.to_le_bytes());
        out.extend_from_slice(&self.until_ms.to_le_bytes());
    }
}

/// A bucket's index part as stored: `n` entries of `(hash, holders[, offloaded-only])`,
/// masks of `mask_words` words, the second mask present when `tiered`.
#[derive(Clone, Copy, Debug)]
pub struct IndexPart<'a> {
    pub mask_words: usize,
    pub tiered: bool,
    pub n: usize,
    pub raw: &'a [u8],
}

impl IndexPart<'_> {
    pub const EMPTY: IndexPart<'static> = IndexPart { mask_words: 1, tiered: false, n: 0, raw: &[] };

    /// Bytes per entry.
    pub fn stride(&self) -> usize {
        8 + 8 * self.mask_words * (1 + usize::from(self.tiered))
    }
}

/// Encodes a bucket from its two raw parts. Both parts empty encode to an empty value.
pub fn encode_bucket(index: IndexPart<'_>, n_fly: usize, fly_raw: &[u8], sweep_at_ms: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(BUCKET_HEADER + index.raw.len() + fly_raw.len());
    begin_bucket(&mut out, index, sweep_at_ms);
    out.extend_from_slice(fly_raw);
    finish_bucket(&mut out, n_fly);
    out
}

/// Starts a bucket value in `out` (cleared): the header and the index part. The in-flight
/// entries are then appended straight into `out`, and [`finish_bucket`] records how many
/// — so a rewritten bucket is built without an intermediate copy.
pub fn begin_bucket(out: &mut Vec<u8>, index: IndexPart<'_>, sweep_at_ms: u64) {
    out.clear();
    let format = if index.tiered { BUCKET_FORMAT_TIERED } else { BUCKET_FORMAT };
    out.extend_from_slice(&format.to_le_bytes());
    out.extend_from_slice(&(index.mask_words as u16).to_le_bytes());
    out.extend_from_slice(&(index.n as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&sweep_at_ms.to_le_bytes());
    out.extend_from_slice(index.raw);
}

/// Completes a bucket started by [`begin_bucket`] with `n_fly` in-flight entries appended.
/// A bucket with neither part is the empty value.
pub fn finish_bucket(out: &mut Vec<u8>, n_fly: usize) {
    let n_idx = u32::from_le_bytes([out[4], out[5], out[6], out[7]]);
    if n_idx == 0 && n_fly == 0 {
        out.clear();
    } else {
        out[8..12].copy_from_slice(&(n_fly as u32).to_le_bytes());
    }
}

/// Raw bytes of in-flight entries (tests and tools).
pub fn fly_raw_of(entries: &[FlyEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.len() * FLY_ENTRY);
    for e in entries {
        e.encode_into(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn bucket_keys_are_the_prefix_and_the_decimal_number() {
        for b in [0u32, 7, 10, 16383, 1 << 20, u32::MAX] {
            assert_eq!(bucket_key(b), format!("kvroute.b.{b}"));
        }
    }

    #[test]
    fn table_round_trip_and_rejects_garbage() {
        let t = WorkerTable {
            index_live: true,
            peer_load: true,
            block_size: 16,
            n_buckets: 4096,
            epoch: 7,
            version: 42,
            slots: vec![
                WorkerSlot {
                    id: "10.0.0.1:8000".into(),
                    role: Role::Both,
                    state: SlotState::Up,
                    kv_capacity_blocks: 0,
                },
                WorkerSlot {
                    id: "[::1]:9".into(),
                    role: Role::Decode,
                    state: SlotState::Down,
                    kv_capacity_blocks: 7_000_000,
                },
            ],
        };
        let bytes = t.encode();
        assert_eq!(WorkerTable::decode(&bytes), Ok(t.clone()));
        for cut in 0..bytes.len() {
            assert!(WorkerTable::decode(&bytes[..cut]).is_err(), "cut {cut}");
        }
        let mut bad = bytes.clone();
        bad[0] = 9;
        assert!(WorkerTable::decode(&bad).is_err());
        // An earlier build's table (format 1: no capacities) keeps its slots.
        let mut v1 = vec![1, 0];
        v1.extend_from_slice(&bytes[2..30]);
        for s in &t.slots {
            v1.extend_from_slice(&[s.state as u8, s.role as u8, s.id.len() as u8]);
            v1.extend_from_slice(s.id.as_bytes());
        }
        let old = WorkerTable::decode(&v1).unwrap();
        assert_eq!(
            old.slots.iter().map(|s| (&s.id, s.kv_capacity_blocks)).collect::<Vec<_>>(),
            [(&t.slots[0].id, 0), (&t.slots[1].id, 0)]
        );
        // A worker named twice, or by nothing, is no table the sync service writes.
        for ids in [["10.0.0.1:8000", "10.0.0.1:8000"], ["10.0.0.1:8000", ""]] {
            let mut t2 = t.clone();
            for (slot, id) in t2.slots.iter_mut().zip(ids) {
                slot.id = id.into();
            }
            assert!(WorkerTable::decode(&t2.encode()).is_err(), "{ids:?}");
        }
    }

    #[test]
    fn cached_blocks_round_trip_and_reject_a_bad_length() {
        let c = CachedBlocks(vec![0, 132, u32::MAX]);
        let bytes = c.encode();
        assert_eq!(bytes.len(), 12);
        assert_eq!(CachedBlocks::decode(&bytes), Ok(c.clone()));
        assert_eq!((c.get(1), c.get(3)), (132, 0), "a slot past the end holds nothing");
        assert_eq!(CachedBlocks::decode(&[]), Ok(CachedBlocks(vec![])));
        for cut in [1, 5, 11] {
            assert!(CachedBlocks::decode(&bytes[..cut]).is_err(), "cut {cut}");
        }
        assert!(CachedBlocks::decode(&vec![0; 4 * (MAX_SLOTS + 1)]).is_err());
    }

    #[test]
    fn bucket_round_trip_and_lookup() {
        // Two index entries, mask_words 1: hash 5 on slots {0,2}, hash 9 on {1}.
        let mut idx = Vec::new();
        for (h, m) in [(5u64, 0b101u64), (9, 0b10)] {
            idx.extend_from_slice(&h.to_le_bytes());
            idx.extend_from_slice(&m.to_le_bytes());
        }
        let fly = [
            FlyEntry { hash: 5, slot: 3, refs: 1, until_ms: 100 },
            FlyEntry { hash: 9, slot: 4, refs: 0, until_ms: 50 },
        ];
        let part = IndexPart { mask_words: 1, tiered: false, n: 2, raw: &idx };
        let bytes = encode_bucket(part, fly.len(), &fly_raw_of(&fly), 7);
        let b = Bucket::parse(&bytes).unwrap();
        let all = SlotSet::FULL;
        let s = b.holders(5, 60, true, &all);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 2, 3]);
        let s = b.holders(9, 60, true, &all); // prediction expired at 50
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![1]);
        let s = b.holders(5, 60, false, &all);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 2]);
        assert!(b.holders(6, 0, true, &all).is_empty());
        let mut some = SlotSet::EMPTY;
        some.insert(2);
        some.insert(3);
        assert_eq!(b.holders(5, 60, true, &some).iter().collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(b.fly_entries().collect::<Vec<_>>(), fly.to_vec());
        for cut in 1..bytes.len() {
            assert!(Bucket::parse(&bytes[..cut]).is_err(), "cut {cut}");
        }
        assert_eq!(encode_bucket(IndexPart::EMPTY, 0, &[], 0), Vec::<u8>::new());
        assert_eq!(b.sweep_at_ms(), 7);
        assert_eq!(Bucket::parse(&[]).unwrap().n_idx(), 0);
    }

    #[test]
    fn tiered_bucket_knows_offloaded_only_holders() {
        // hash 5: held by {0, 1, 2}, of which {1, 2} only offloaded; slot 2 has it in flight.
        let mut idx = Vec::new();
        for w in [5u64, 0b111, 0b110] {
            idx.extend_from_slice(&w.to_le_bytes());
        }
        let fly = [FlyEntry { hash: 5, slot: 2, refs: 1, until_ms: 100 }];
        let part = IndexPart { mask_words: 1, tiered: true, n: 1, raw: &idx };
        let bytes = encode_bucket(part, 1, &fly_raw_of(&fly), 0);
        let b = Bucket::parse(&bytes).unwrap();
        assert!(b.is_tiered());
        assert_eq!(b.holders(5, 0, true, &SlotSet::FULL).iter().collect::<Vec<_>>(), vec![0, 1, 2]);
        // in flight on 2 = being loaded into its GPU: only 1 is offloaded-only
        assert_eq!(b.offloaded_only(5, 0, true, &SlotSet::FULL).iter().collect::<Vec<_>>(), vec![1]);
        assert_eq!(b.offloaded_only(5, 0, false, &SlotSet::FULL).iter().collect::<Vec<_>>(), vec![1, 2]);
        assert!(b.offloaded_only(6, 0, true, &SlotSet::FULL).is_empty());
        for cut in 1..bytes.len() {
            assert!(Bucket::parse(&bytes[..cut]).is_err(), "cut {cut}");
        }
    }

    #[test]
    fn load_vector_saturates() {
        let mut l = LoadVector::decode(&[]);
        l.apply(&[(2, 5), (0, -3)]);
        assert_eq!(l.0.iter().map(|s| s.active).collect::<Vec<_>>(), vec![0, 0, 5]);
        l.apply(&[(2, -7)]);
        assert_eq!(l.get(2), 0);
        assert_eq!(LoadVector::decode(&l.encode()), l);
        assert_eq!(l.get(99), 0);
        l.apply(&[(MAX_SLOTS, 1)]);
        assert_eq!(l.0.len(), 3, "a slot past the table's limit is ignored");
    }

    #[test]
    fn outstanding_prefill_lives_two_epochs_at_most() {
        let ch = |slot, epoch, blocks| PrefillChange { slot, epoch, blocks };
        let at = |epoch: u64| epoch * PREFILL_EPOCH_MS;
        let mut l = LoadVector::default();
        l.apply_prefill(&[ch(1, 10, 50), ch(1, 10, 30)], at(10), false);
        assert_eq!((l.pending_prefill(1, 10), l.get(1)), (80, 0));
        // The next epoch still counts it, and releases go to the epoch they were charged in.
        l.apply_prefill(&[ch(1, 11, 7)], at(11), false);
        assert_eq!(l.pending_prefill(1, 11), 87);
        l.apply_prefill(&[ch(1, 10, -30)], at(11), false);
        assert_eq!(l.pending_prefill(1, 11), 57);
        assert_eq!(LoadVector::decode(&l.encode()), l);
        // A reader one epoch ahead of the last writer sees only the newer epoch; two ahead,
        // nothing: the 50 never released are gone within two epochs.
        assert_eq!(l.pending_prefill(1, 12), 7);
        assert_eq!(l.pending_prefill(1, 13), 0);
        // A release for an epoch no longer kept changes nothing.
        l.apply_prefill(&[ch(1, 10, -50)], at(12), false);
        assert_eq!(l.pending_prefill(1, 12), 7);
        // Saturates at 0, and a writer whose clock is behind does not move epochs back.
        l.apply_prefill(&[ch(1, 11, -99)], at(11), false);
        assert_eq!((l.0[1].prefill.epoch, l.pending_prefill(1, 12)), (12, 0));
        assert_eq!(l.pending_prefill(7, 12), 0);
    }

    #[test]
    fn outstanding_prefill_drains_at_the_rate_ended_prefills_were_computed_at() {
        let ch = |blocks| PrefillChange { slot: 0, epoch: 0, blocks };
        let none = PrefillRate::default();
        let mut l = LoadVector::default();
        // Before any prefill ended nothing is known of the rate: the charge stands whole.
        l.apply_prefill(&[ch(100)], 1_000, false);
        assert_eq!(l.draining_prefill(0, 5_000, none), 100);
        // 100 blocks ended 500 ms after the charge found the slot idle: 0.2 blocks/ms. A
        // charge while it ran does not restart the drain; the end does.
        l.apply_prefill(&[ch(60)], 1_200, false);
        l.apply_prefill(&[ch(-100)], 1_500, true);
        assert_eq!(l.0[0].prefill_rate.blocks_in(500), 100);
        assert_eq!(l.draining_prefill(0, 1_500, none), 60);
        assert_eq!(l.draining_prefill(0, 1_600, none), 40);
        assert_eq!(l.draining_prefill(0, 1_900, none), 0, "never below 0");
        assert_eq!(l.pending_prefill(0, 0), 60, "the charge itself stands until its end");
        // A stream that ended before its first token is no sample, and the drain goes on.
        let rate = l.0[0].prefill_rate;
        l.apply_prefill(&[ch(40), ch(-40)], 1_700, false);
        assert_eq!((l.0[0].prefill_rate, l.draining_prefill(0, 1_700, none)), (rate, 20));
        // Two prefills of one engine step end together: the first takes the step's time,
        // the second none, and their sum gives the rate (60 + 40 blocks in 500 ms).
        let mut l = LoadVector::default();
        l.apply_prefill(&[ch(60), ch(40)], 0, false);
        l.apply_prefill(&[ch(-60)], 500, true);
        assert_eq!(l.0[0].prefill_rate.blocks_in(500), 60);
        l.apply_prefill(&[ch(-40)], 500, true);
        assert_eq!(l.0[0].prefill_rate.blocks_in(500), 100);
        // So do forty: a step's many short prefills (a hot prefix's questions, 4 blocks
        // each, 160 in 400 ms) keep its time in the sums and read 0.4 a ms, not thousands.
        let mut many = LoadVector::default();
        many.apply_prefill(&[ch(160)], 0, false);
        for _ in 0..40 {
            many.apply_prefill(&[ch(-4)], 400, true);
        }
        assert_eq!(many.0[0].prefill_rate.blocks_in(1_000), 400);
        // Past the window the old time weighs less: 20 s at 0.1 a ms after it reads ~0.1.
        for t in 1..=40 {
            many.apply_prefill(&[ch(50)], 400 + 500 * (t - 1), false);
            many.apply_prefill(&[ch(-50)], 400 + 500 * t, true);
        }
        assert_eq!(many.0[0].prefill_rate.blocks_in(1_000), 100);
        assert_eq!(LoadVector::decode(&l.encode()), l);
        // A drain that started long ago (a clock jump, a stale slot) stops at two epochs.
        l.apply_prefill(&[ch(1_000_000)], 1_000, false);
        assert_eq!(l.draining_prefill(0, 1_000 + 10 * PREFILL_EPOCH_MS, none), 0);
        assert_eq!(l.0[0].draining_prefill(u64::from(u32::MAX) + 2_000, none), 0, "the ms clock wraps");
        // A slot that has ended no prefill drains at the fleet's rate, the others' sums
        // added: slot 1's 100 blocks in 500 ms and slot 2's 100 in 1000 ms give 200 in 1500,
        // 0.133 a ms. A slot with a rate keeps its own.
        let mut l = LoadVector::default();
        let on = |slot, blocks| PrefillChange { slot, epoch: 0, blocks };
        l.apply_prefill(&[on(1, 60), on(1, 40), on(2, 100)], 0, false);
        l.apply_prefill(&[on(1, -60), on(1, -40)], 500, true);
        l.apply_prefill(&[on(2, -100)], 1_000, true);
        l.apply_prefill(&[on(3, 90)], 1_000, false);
        let fleet = l.fleet_prefill_rate();
        assert_eq!((fleet.blocks_in(300), l.draining_prefill(3, 1_300, fleet)), (40, 50));
        assert_eq!(l.draining_prefill(3, 1_300, none), 90, "no fleet rate: the charge stands whole");
        assert!(LoadVector::default().fleet_prefill_rate().is_unknown());
        let own = |l: &LoadVector| l.0[1].prefill_rate;
        l.apply_prefill(&[on(1, 50)], 2_000, false);
        assert_eq!(l.draining_prefill(1, 2_100, fleet), 50 - own(&l).blocks_in(100));
        // Sums of every slot saturated still give the rate (scaled, not wrapped).
        let big = LoadVector(vec![
            SlotLoad {
                prefill_rate: PrefillRate { blocks: u32::MAX, ms: u32::MAX / 2 },
                ..SlotLoad::default()
            };
            64
        ]);
        assert_eq!(big.fleet_prefill_rate().blocks_in(1_000), 2_000);
        // Sums saturate: a record of any bytes is applied without overflow.
        let mut r = PrefillRate { blocks: u32::MAX, ms: u32::MAX };
        r.sample(u32::MAX, MAX_DRAIN_MS);
        assert_eq!((r.blocks, r.ms, r.blocks_in(1_000)), (1_087_513, RATE_WINDOW_MS * 16, 16_992));
    }
}
