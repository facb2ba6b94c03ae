//! One routing decision, start to finish, over an abstract shared-data store.
//!
//! The filter glue implements [`SharedStore`] with proxy-wasm host calls; tests implement
//! it with a map that has the host's compare-and-swap semantics. Everything else — token
//! decoding, hashing, the bucket scan, scoring, in-flight accounting — happens here, with
//! time and the tie-break seed passed in.

use crate::config::{FilterConfig, Mode};
use crate::hash::block_hashes_le;
use crate::inflight::{self, ActiveDelta, Change};
use crate::layout::{
    begin_bucket, bucket_key, bucket_of, finish_bucket, segments, Bucket, LoadVector, Role, SlotState, WorkerTable,
    LOAD_KEY, TABLE_KEY,
};
use crate::scan::scan_segment;
use crate::score::{rank, worker_key, Candidate, Scored};
use crate::slots::{SlotSet, MAX_SLOTS};
use crate::tokens::{decode_tokens, TokenEncoding, TokenError};
use std::fmt::Write as _;
use std::rc::Rc;

/// A shared-data write that did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// Someone else wrote the key since it was read: read again and redo.
    CasMismatch,
    Other(String),
}

/// Process-wide key/value data with compare-and-swap, as proxy-wasm shared data.
/// `get` returns the value and its CAS token; `set` with `Some(cas)` fails with
/// [`StoreError::CasMismatch`] if the key changed since.
pub trait SharedStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError>;
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

/// Compare-and-swap attempts before an update is given up (and counted).
pub(crate) const CAS_ATTEMPTS: u32 = 16;

/// Why a request was not scored by KV cost. Each has a counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// No worker table (the sync service has never heard from the sidecar) or an
    /// unreadable one: no destination is set and Envoy's fallback policy picks.
    NoTable,
    /// No worker is up (for this mode): no destination is set.
    NoWorkerUp,
    /// No token header: scored by load only.
    NoTokens,
    /// A token header that could not be decoded: scored by load only.
    BadTokens,
    /// The sidecar has not answered for `stale_after_ms`: scored by load only.
    IndexStale,
    /// The sidecar hashes with another block size: scored by load only.
    BlockSizeMismatch,
    /// PD mode without any prefill-capable worker up: decode worker only.
    NoPrefillWorker,
}

impl Fallback {
    pub const ALL: [Fallback; 7] = [
        Fallback::NoTable,
        Fallback::NoWorkerUp,
        Fallback::NoTokens,
        Fallback::BadTokens,
        Fallback::IndexStale,
        Fallback::BlockSizeMismatch,
        Fallback::NoPrefillWorker,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fallback::NoTable => "no_table",
            Fallback::NoWorkerUp => "no_worker_up",
            Fallback::NoTokens => "no_tokens",
            Fallback::BadTokens => "bad_tokens",
            Fallback::IndexStale => "index_stale",
            Fallback::BlockSizeMismatch => "block_size_mismatch",
            Fallback::NoPrefillWorker => "no_prefill_worker",
        }
    }
}

/// What a request holds in flight, released when its stream ends.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Slots the blocks are in flight on, sorted (PD mode: prefill and decode worker).
    slots: Vec<u16>,
    /// Per segment whose in-flight entries were written (all of them unless an update gave
    /// up): its bucket and its block hashes, sorted as the bucket rewrite wants them.
    segments: Vec<(u32, Vec<u64>)>,
}

impl Held {
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }
}

/// Per slot (indexed by slot), what the scan found.
struct Hits {
    /// `cache_hits`: leading consecutive blocks held.
    leading: Vec<u32>,
    /// Of those, blocks held only in an offload tier.
    offloaded: Vec<u32>,
}

/// The outcome of [`Router::route`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    /// Ranked `ip:port` list for the destination header; empty: set none.
    pub destinations: Vec<String>,
    /// PD mode: the prefill worker.
    pub prefiller: Option<String>,
    pub fallback: Option<Fallback>,
    pub token_error: Option<TokenError>,
    pub request_blocks: u32,
    /// Cache hits of the chosen (decode or aggregated) worker.
    pub hits: u32,
    /// Of them, blocks it holds only in an offload tier.
    pub offloaded_hits: u32,
    pub cost: f64,
    pub held: Held,
    /// Shared-data values that failed to decode (table, load or buckets).
    pub layout_errors: u32,
    /// Updates abandoned after 16 compare-and-swap conflicts in a row, or a store error.
    pub update_failures: u32,
    pub shared_reads: u32,
}

impl Decision {
    /// `worker=…;hits=…;blocks=…;cost=…[;offloaded=…][;prefill=…][;fallback=…]` for the
    /// debug response header.
    pub fn debug_value(&self) -> String {
        let mut s = String::new();
        let worker = self.destinations.first().map(String::as_str).unwrap_or("-");
        let _ = write!(s, "worker={worker};hits={};blocks={};cost={}", self.hits, self.request_blocks, self.cost);
        if self.offloaded_hits > 0 {
            let _ = write!(s, ";offloaded={}", self.offloaded_hits);
        }
        if let Some(p) = &self.prefiller {
            let _ = write!(s, ";prefill={p}");
        }
        if let Some(f) = self.fallback {
            let _ = write!(s, ";fallback={}", f.name());
        }
        s
    }
}

/// The token header of a request, as found.
#[derive(Clone, Copy, Debug)]
pub enum TokenSource<'a> {
    Missing,
    /// A token header's value, its encoding, and the namespace (LoRA adapter / cache salt,
    /// [`crate::hash::namespace`]) the prompt's blocks live in.
    Header {
        value: &'a [u8],
        encoding: TokenEncoding,
        namespace: u64,
    },
}

/// Per-VM routing state: the configuration, the last worker table decoded, and scratch
/// buffers reused across requests.
pub struct Router {
    cfg: FilterConfig,
    token_bytes: Vec<u8>,
    candidates: Vec<Candidate>,
    scored: Vec<Scored>,
    table: Option<Rc<DecodedTable>>,
}

/// A worker table as read from shared data, decoded once: it changes only when the fleet
/// does, and decoding it (every worker id) and hashing the ids for tie-breaks would
/// otherwise cost each request time linear in the fleet.
struct DecodedTable {
    bytes: Vec<u8>,
    table: WorkerTable,
    /// [`worker_key`] of each slot.
    keys: Vec<u64>,
}

struct ScannedBucket {
    value: Option<Vec<u8>>,
    cas: Option<u32>,
}

impl Router {
    pub fn new(cfg: FilterConfig) -> Router {
        Router { cfg, token_bytes: Vec::new(), candidates: Vec::new(), scored: Vec::new(), table: None }
    }

    /// The worker table in shared data, decoded (or the cached decoding when the bytes are
    /// the same); `None` with the fallback set when there is none or it does not decode.
    fn read_table(&mut self, store: &dyn SharedStore, d: &mut Decision) -> Option<Rc<DecodedTable>> {
        d.shared_reads += 1;
        let bytes = match store.get(TABLE_KEY) {
            Ok((Some(v), _)) if !v.is_empty() => v,
            _ => {
                d.fallback = Some(Fallback::NoTable);
                return None;
            }
        };
        if let Some(t) = self.table.as_ref().filter(|t| t.bytes == bytes) {
            return Some(t.clone());
        }
        match WorkerTable::decode(&bytes) {
            Ok(table) => {
                let keys = table.slots.iter().map(|s| worker_key(&s.id)).collect();
                let t = Rc::new(DecodedTable { bytes, table, keys });
                self.table = Some(t.clone());
                Some(t)
            }
            Err(_) => {
                d.layout_errors += 1;
                d.fallback = Some(Fallback::NoTable);
                None
            }
        }
    }

    /// Decides where a request goes and records its blocks as in flight there.
    /// `now_ms`: wall-clock milliseconds; `entropy`: a random number, used only to break
    /// ties for requests without blocks.
    pub fn route(&mut self, store: &dyn SharedStore, tokens: TokenSource<'_>, now_ms: u64, entropy: u64) -> Decision {
        let mut d = Decision::default();
        let Some(decoded) = self.read_table(store, &mut d) else { return d };
        let table = &decoded.table;
        let hashes = self.prompt_hashes(tokens, table, &mut d);
        d.shared_reads += 1;
        let load = match store.get(LOAD_KEY) {
            Ok((v, cas)) => (LoadVector::decode(v.as_deref().unwrap_or(&[])), cas),
            Err(_) => (LoadVector::default(), None),
        };

        let (decode_set, prefill_set) = match self.cfg.mode {
            Mode::Aggregated => (up_slots(table, |r| r == Role::Both), SlotSet::EMPTY),
            Mode::Pd => (up_slots(table, Role::can_decode), up_slots(table, Role::can_prefill)),
        };
        if decode_set.is_empty() {
            d.fallback = Some(Fallback::NoWorkerUp);
            return d;
        }
        // With a stale index nothing is a hit (load only); in-flight entries are still
        // written below, so active_blocks stays exact.
        let mut candidates = SlotSet::EMPTY;
        if table.index_live {
            candidates = decode_set;
            for s in prefill_set.iter() {
                candidates.insert(s);
            }
        }
        let (hits, scanned) = self.scan(store, &hashes, candidates, table, now_ms, &mut d);
        let hits = &hits;

        // Choose: in PD mode the prefill worker first, then the destination list.
        let request_key = hashes.first().copied().unwrap_or(entropy);
        let mut chosen: Vec<u16> = Vec::with_capacity(2);
        if self.cfg.mode == Mode::Pd {
            if prefill_set.is_empty() {
                d.fallback.get_or_insert(Fallback::NoPrefillWorker);
            } else {
                self.rank_set(
                    &decoded.keys,
                    &prefill_set,
                    hits,
                    &load.0,
                    self.cfg.prefill_overlap_weight,
                    d.request_blocks,
                    request_key,
                );
                if let Some(best) = self.scored.first() {
                    d.prefiller = Some(table.slots[best.candidate.slot].id.clone());
                    chosen.push(best.candidate.slot as u16);
                }
            }
        }
        let weight = match self.cfg.mode {
            Mode::Aggregated => self.cfg.overlap_weight,
            Mode::Pd => self.cfg.decode_overlap_weight,
        };
        self.rank_set(&decoded.keys, &decode_set, hits, &load.0, weight, d.request_blocks, request_key);
        for s in self.scored.iter().take(self.cfg.max_endpoints) {
            d.destinations.push(table.slots[s.candidate.slot].id.clone());
        }
        if let Some(best) = self.scored.first() {
            d.hits = best.candidate.cache_hits;
            d.offloaded_hits = best.candidate.offloaded_hits;
            d.cost = best.cost;
            let slot = best.candidate.slot as u16;
            if !chosen.contains(&slot) {
                chosen.push(slot);
            }
        }

        if !hashes.is_empty() {
            chosen.sort_unstable();
            d.held = self.acquire(store, &mut d, &hashes, table.n_buckets, chosen, scanned, load, now_ms);
        }
        d
    }

    /// The request's block hashes, or none with the reason in `d.fallback`.
    fn prompt_hashes(&mut self, tokens: TokenSource<'_>, table: &WorkerTable, d: &mut Decision) -> Vec<u64> {
        let mut hashes = Vec::new();
        match tokens {
            TokenSource::Missing => d.fallback = Some(Fallback::NoTokens),
            TokenSource::Header { value, encoding, namespace } => {
                match decode_tokens(value, encoding, self.cfg.max_tokens, &mut self.token_bytes) {
                    Ok(_) => block_hashes_le(&self.token_bytes, self.cfg.block_size, namespace, &mut hashes),
                    Err(e) => {
                        d.token_error = Some(e);
                        d.fallback = Some(Fallback::BadTokens);
                    }
                }
            }
        }
        if !hashes.is_empty() && table.block_size as usize != self.cfg.block_size {
            d.fallback = Some(Fallback::BlockSizeMismatch);
            hashes.clear();
        }
        if !hashes.is_empty() && !table.index_live {
            d.fallback = Some(Fallback::IndexStale);
        }
        d.request_blocks = hashes.len() as u32;
        hashes
    }

    /// Reads the request's segment buckets in order and returns, per slot, the number of
    /// leading blocks it holds (`cache_hits`), for the slots in `alive`. Stops at the first
    /// segment where no slot is left. Returns the values read, for the in-flight update.
    fn scan(
        &self,
        store: &dyn SharedStore,
        hashes: &[u64],
        mut alive: SlotSet,
        table: &WorkerTable,
        now_ms: u64,
        d: &mut Decision,
    ) -> (Hits, Vec<ScannedBucket>) {
        // Indexed by slot; every slot in `alive` is a slot of the table.
        let mut hits = vec![0u32; table.slots.len()];
        let mut offloaded = vec![0u32; table.slots.len()];
        let mut scanned = Vec::new();
        for seg in segments(hashes.len()) {
            if alive.is_empty() {
                break;
            }
            d.shared_reads += 1;
            let (value, cas) =
                store.get(&bucket_key(bucket_of(hashes[seg.start], table.n_buckets))).unwrap_or((None, None));
            let bucket = match value.as_deref().map(Bucket::parse).unwrap_or(Ok(Bucket::EMPTY)) {
                Ok(b) => b,
                Err(_) => {
                    d.layout_errors += 1;
                    Bucket::EMPTY
                }
            };
            let start = seg.start;
            let with_fly = self.cfg.predict_on_route;
            scan_segment(&bucket, &hashes[seg], start, now_ms, with_fly, &mut alive, &mut hits, &mut offloaded);
            scanned.push(ScannedBucket { value, cas });
        }
        for slot in alive.iter() {
            if let Some(h) = hits.get_mut(slot) {
                *h = hashes.len() as u32;
            }
        }
        (Hits { leading: hits, offloaded }, scanned)
    }

    /// Scores the slots of `set` into `self.scored`, best first.
    #[allow(clippy::too_many_arguments)]
    fn rank_set(
        &mut self,
        keys: &[u64],
        set: &SlotSet,
        hits: &Hits,
        load: &LoadVector,
        weight: f64,
        request_blocks: u32,
        request_key: u64,
    ) {
        self.candidates.clear();
        for slot in set.iter() {
            self.candidates.push(Candidate {
                slot,
                cache_hits: hits.leading.get(slot).copied().unwrap_or(0),
                offloaded_hits: hits.offloaded.get(slot).copied().unwrap_or(0),
                active_blocks: load.get(slot),
                worker_key: keys.get(slot).copied().unwrap_or(0),
            });
        }
        let credit = self.cfg.offload_hit_credit;
        rank(&self.candidates, weight, credit, request_blocks, request_key, &mut self.scored);
    }

    /// Records the request's blocks as in flight on `slots`. `scanned` and `load` are the
    /// values the decision read, reused as the first attempt of their compare-and-swap.
    #[allow(clippy::too_many_arguments)]
    fn acquire(
        &self,
        store: &dyn SharedStore,
        d: &mut Decision,
        hashes: &[u64],
        n_buckets: u32,
        slots: Vec<u16>,
        scanned: Vec<ScannedBucket>,
        load: (LoadVector, Option<u32>),
        now_ms: u64,
    ) -> Held {
        let change = Change::Acquire { lease_ms: self.cfg.inflight_lease_ms };
        let mut held = Held { slots, segments: Vec::new() };
        let mut delta = ActiveDelta::default();
        let mut scanned = scanned.into_iter();
        for seg in segments(hashes.len()) {
            let b = bucket_of(hashes[seg.start], n_buckets);
            let first_read = scanned.next().map(|s| (s.value, s.cas));
            let mut sorted = hashes[seg].to_vec();
            sorted.sort_unstable();
            sorted.dedup();
            let mut keys = Vec::with_capacity(sorted.len() * held.slots.len());
            inflight::keys(&sorted, &held.slots, &mut keys);
            match update_bucket(store, b, first_read, &keys, change, now_ms, &mut d.shared_reads) {
                Ok(seg_delta) => {
                    delta.merge(&seg_delta);
                    held.segments.push((b, sorted));
                }
                Err(layout) => {
                    d.update_failures += 1;
                    d.layout_errors += u32::from(layout);
                }
            }
        }
        if !update_load(store, &delta, Some(load), &mut d.shared_reads) {
            d.update_failures += 1;
        }
        held
    }

    /// Releases what a finished stream held: in-flight blocks become predictions (or go,
    /// with predict-on-route off). Returns the number of updates that failed.
    pub fn release(&self, store: &dyn SharedStore, held: &Held, now_ms: u64) -> u32 {
        self.release_all(store, std::slice::from_ref(held), now_ms)
    }

    /// Releases several finished streams at once: one update per bucket they touch and one
    /// of the load, however many streams share them. Returns the number of updates that
    /// failed.
    pub fn release_all(&self, store: &dyn SharedStore, helds: &[Held], now_ms: u64) -> u32 {
        let linger_ms = if self.cfg.predict_on_route { self.cfg.prediction_ttl_ms } else { 0 };
        let mut by_bucket: Vec<(u32, Vec<inflight::Key>)> = Vec::new();
        for held in helds {
            for (b, hashes) in &held.segments {
                let i = match by_bucket.iter().position(|(x, _)| x == b) {
                    Some(i) => i,
                    None => {
                        by_bucket.push((*b, Vec::new()));
                        by_bucket.len() - 1
                    }
                };
                inflight::keys(hashes, &held.slots, &mut by_bucket[i].1);
            }
        }
        let mut failures = 0;
        let mut delta = ActiveDelta::default();
        let mut reads = 0;
        for (b, mut keys) in by_bucket {
            inflight::merge_keys(&mut keys);
            match update_bucket(store, b, None, &keys, Change::Release { linger_ms }, now_ms, &mut reads) {
                Ok(seg_delta) => delta.merge(&seg_delta),
                Err(_) => failures += 1,
            }
        }
        if !update_load(store, &delta, None, &mut reads) {
            failures += 1;
        }
        failures
    }
}

/// The worker table, or none with the reason in `d.fallback`.
/// Slots that are up and whose role passes `role_ok`.
fn up_slots(table: &WorkerTable, role_ok: fn(Role) -> bool) -> SlotSet {
    let mut s = SlotSet::EMPTY;
    for (slot, w) in table.slots.iter().enumerate().take(MAX_SLOTS) {
        if w.state == SlotState::Up && role_ok(w.role) {
            s.insert(slot);
        }
    }
    s
}

/// Read-modify-write of bucket `b`'s in-flight part with compare-and-swap (see
/// [`inflight::apply`]; with a sweep when due). The first read may come from the scan.
/// Err(true) when the bucket could not be decoded.
fn update_bucket(
    store: &dyn SharedStore,
    b: u32,
    mut first_read: Option<(Option<Vec<u8>>, Option<u32>)>,
    keys: &[inflight::Key],
    change: Change,
    now_ms: u64,
    reads: &mut u32,
) -> Result<ActiveDelta, bool> {
    let key = bucket_key(b);
    let (mut out, mut swept) = (Vec::new(), Vec::new());
    for _ in 0..CAS_ATTEMPTS {
        let (value, cas) = match first_read.take() {
            Some(r) => r,
            None => {
                *reads += 1;
                store.get(&key).map_err(|_| false)?
            }
        };
        let value = value.unwrap_or_default();
        let bucket = Bucket::parse(&value).map_err(|_| true)?;
        let (n_fly, fly_raw) = bucket.fly_raw();
        let index = bucket.index_part();
        let mut sweep_at = bucket.sweep_at_ms();
        let sweep = now_ms >= sweep_at;
        if sweep {
            // This writer's turn to sweep the whole bucket.
            sweep_at = now_ms.saturating_add(inflight::SWEEP_INTERVAL_MS);
        }
        begin_bucket(&mut out, index, sweep_at);
        let (n, delta) = if sweep {
            swept.clear();
            let (n_live, mut delta) = inflight::sweep(fly_raw, n_fly, now_ms, &mut swept);
            let (n, d) = inflight::apply(&swept, n_live, keys, change, now_ms, &mut out);
            delta.merge(&d);
            (n, delta)
        } else {
            inflight::apply(fly_raw, n_fly, keys, change, now_ms, &mut out)
        };
        finish_bucket(&mut out, n);
        if out == value {
            return Ok(delta);
        }
        // The host treats CAS 0 as "unconditional". Keys exist from the sync service's
        // start (it creates every bucket and the load key empty), so 0 only happens
        // before that, when no table exists and nothing is routed yet.
        match store.set(&key, &out, Some(cas.unwrap_or(0))) {
            Ok(()) => return Ok(delta),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Other(_)) => return Err(false),
        }
    }
    Err(false)
}

/// Applies per-slot active-block changes to the load vector with compare-and-swap; the
/// first attempt may use a value already read.
fn update_load(
    store: &dyn SharedStore,
    delta: &ActiveDelta,
    mut first_read: Option<(LoadVector, Option<u32>)>,
    reads: &mut u32,
) -> bool {
    if delta.is_zero() {
        return true;
    }
    for _ in 0..CAS_ATTEMPTS {
        let (mut load, cas) = match first_read.take() {
            Some(r) => r,
            None => {
                *reads += 1;
                let Ok((value, cas)) = store.get(LOAD_KEY) else { return false };
                (LoadVector::decode(value.as_deref().unwrap_or(&[])), cas)
            }
        };
        load.apply(&delta.0);
        match store.set(LOAD_KEY, &load.encode(), Some(cas.unwrap_or(0))) {
            Ok(()) => return true,
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Other(_)) => return false,
        }
    }
    false
}

#[cfg(test)]
pub(crate) mod tests;
