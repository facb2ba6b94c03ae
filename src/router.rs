//! One routing decision, start to finish, over an abstract shared-data store.
//!
//! The filter glue implements [`SharedStore`] with proxy-wasm host calls; tests implement
//! it with a map that has the host's compare-and-swap semantics. Everything else — token
//! decoding, hashing, the bucket scan, scoring, in-flight accounting — happens here, with
//! time and the tie-break seed passed in.

use crate::cachekey::{self, key_bucket_key, key_bucket_of, key_epoch, KeyEntry, KeyLoad, ANCHORS_KEY, KEYLOAD_KEY};
use crate::config::{ActiveBlocks, FilterConfig, KvCapacity, Mode, TieBreak};
use crate::hash::{block_hashes_le, segments};
use crate::inflight::{self, ActiveDelta, Change};
use crate::layout::{
    begin_bucket, bucket_key, bucket_of, finish_bucket, prefill_epoch, Bucket, CachedBlocks, LoadVector, PrefillChange,
    SlotState, WorkerTable, CACHED_KEY, FLY_ENTRY, LOAD_KEY, TABLE_KEY,
};
use crate::peerload::{PeerLoad, PEERLOAD_KEY};
use crate::role::Role;
use crate::scan::{scan_segment, Scan};
use crate::score::{rank, tied_at_top, worker_key, Candidate, RankOutcome, Scored};
use crate::slots::{SlotSet, MAX_SLOTS};
use crate::store::{update, update_tries, Edit, SharedStore, UpdateError, Versioned, CAS_ATTEMPTS};
use crate::tokens::{decode_tokens, TokenEncoding, TokenError};
use std::fmt::Write as _;
use std::rc::Rc;

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
    /// The outstanding prefill charged for this request, until its prefill ends (the first
    /// response bytes) or the stream does.
    prefill: Option<PrefillChange>,
}

impl Held {
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty() && self.prefill.is_none()
    }

    /// Outstanding prefill is still charged for this request.
    pub fn prefilling(&self) -> bool {
        self.prefill.is_some()
    }
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
    /// The most cache hits any (decode or aggregated) worker had: above `hits` when the
    /// cost chose load over a holder.
    pub most_hits: u32,
    /// When above `hits`: the cheapest such holder's cost, `active_blocks` and
    /// `pending_prefill`, to tell which term passed it over.
    pub holder_terms: Option<(f64, u32, u32)>,
    pub cost: f64,
    pub held: Held,
    /// Shared-data values that failed to decode (table, load or buckets).
    pub layout_errors: u32,
    /// Updates abandoned after 16 compare-and-swap conflicts in a row, or a store error.
    pub update_failures: u32,
    pub shared_reads: u32,
    /// The wait limit passed over the cheapest worker (`wait_slack_per_hit`).
    pub spilled: bool,
    /// The memory limit passed over the cheapest worker (`kv_capacity_blocks`).
    pub memory_limited: bool,
    /// The holder tie put a worker with more cache hits first (`holder_tie_per_hit`).
    pub kept_on_holder: bool,
    /// A tie went to the worker holding the fewest blocks (`tie_break`).
    pub least_cached: bool,
    /// The request's cache key was new to the router: placed apart from other keys.
    pub new_cache_key: bool,
    /// The request had no cache key and was given an implicit one
    /// ([`cachekey::implicit_key`]): it left or continued a conversational anchor.
    pub implicit_cache_key: bool,
    /// Times the decision was made again because another wrote the prompt's first bucket
    /// between this one's read and its write (at most [`REDECISIONS`]).
    pub redecided: u32,
}

impl Decision {
    fn note(&mut self, r: RankOutcome) {
        self.spilled |= r.spilled;
        self.memory_limited |= r.memory_limited;
        self.kept_on_holder |= r.kept_on_holder;
        self.least_cached |= r.least_cached;
    }

    /// `worker=…;hits=…;blocks=…;cost=…[;most_hits=…;holder_cost=…;holder_active=…;holder_prefill=…][;offloaded=…][;prefill=…][;spilled=1][;memory=1][;holder=1][;least_cached=1][;new_key=1][;implicit_key=1][;redecided=…][;fallback=…]`
    /// for the debug response header.
    pub fn debug_value(&self) -> String {
        let mut s = String::new();
        let worker = self.destinations.first().map(String::as_str).unwrap_or("-");
        let _ = write!(s, "worker={worker};hits={};blocks={};cost={}", self.hits, self.request_blocks, self.cost);
        if self.most_hits > self.hits {
            let _ = write!(s, ";most_hits={}", self.most_hits);
            if let Some((cost, active, prefill)) = self.holder_terms {
                let _ = write!(s, ";holder_cost={cost};holder_active={active};holder_prefill={prefill}");
            }
        }
        if self.offloaded_hits > 0 {
            let _ = write!(s, ";offloaded={}", self.offloaded_hits);
        }
        if let Some(p) = &self.prefiller {
            let _ = write!(s, ";prefill={p}");
        }
        if self.spilled {
            s.push_str(";spilled=1");
        }
        if self.memory_limited {
            s.push_str(";memory=1");
        }
        if self.kept_on_holder {
            s.push_str(";holder=1");
        }
        if self.least_cached {
            s.push_str(";least_cached=1");
        }
        if self.new_cache_key {
            s.push_str(";new_key=1");
        }
        if self.implicit_cache_key {
            s.push_str(";implicit_key=1");
        }
        if self.redecided > 0 {
            let _ = write!(s, ";redecided={}", self.redecided);
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
    /// The cached-block counts, once this decision has read them (on its first tie).
    cached: Option<CachedBlocks>,
}

/// A worker table as read from shared data, decoded once: it changes only when the fleet
/// does, and decoding it (every worker id) and hashing the ids for tie-breaks would
/// otherwise cost each request time linear in the fleet.
struct DecodedTable {
    bytes: Vec<u8>,
    table: WorkerTable,
    /// [`worker_key`] of each slot.
    keys: Vec<u64>,
    /// The memory limit's capacity of each slot's engine (`None`: no limit on it).
    capacities: Vec<Option<u32>>,
}

/// What ranking needs to know of the request being routed.
struct Request<'a> {
    store: &'a dyn SharedStore,
    /// The index is live: its cached-block counts may break ties.
    index_live: bool,
    /// [`worker_key`] of each slot.
    keys: &'a [u64],
    /// The memory limit's capacity of each slot's engine.
    capacities: &'a [Option<u32>],
    scan: &'a Scan,
    load: &'a LoadVector,
    /// Other gateways' load on each slot, added to `load` for ranking only.
    peers: &'a PeerLoad,
    blocks: u32,
    /// Tie-break key: the first block's hash, or entropy for a request without blocks.
    key: u64,
    now_ms: u64,
    /// A new cache key's charge per key live on a worker, in blocks, the counts and the
    /// live window.
    key_charge: Option<(f64, &'a KeyLoad, u32)>,
}

/// The request's cache key as read before ranking.
struct KeyRead {
    hash: u64,
    bucket: Option<Versioned>,
    /// Keys live per worker, read for a key not seen within the window only (a new key).
    counts: Option<(KeyLoad, Option<Versioned>)>,
}

/// A request's implicit key ([`crate::cachekey`], "Implicit keys").
struct ImplicitKey {
    hash: u64,
    /// The request continues its conversation: some worker holds it past the anchor.
    continues: bool,
    /// The request's blocks past the anchor.
    own_blocks: u32,
}

struct ScannedBucket {
    value: Option<Vec<u8>>,
    cas: Option<u32>,
}

/// How many times a decision that lost its first bucket to another is made again before
/// it records its blocks over the change (the fallback of every decision before). A burst
/// over a new prompt on two Envoy threads races once or twice.
const REDECISIONS: u32 = 2;

/// What a decision's writes start from: the values it read.
struct Commit {
    scanned: Vec<ScannedBucket>,
    load_read: Option<Versioned>,
    /// Write nothing if the first bucket changed since it was scanned.
    may_race: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Placed,
    /// Another decision wrote the prompt's first bucket since this one read it.
    Raced,
}

impl Router {
    pub fn new(cfg: FilterConfig) -> Router {
        Router { cfg, token_bytes: Vec::new(), candidates: Vec::new(), scored: Vec::new(), table: None, cached: None }
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
                let capacities = table
                    .slots
                    .iter()
                    .map(|s| match self.cfg.kv_capacity_blocks {
                        KvCapacity::Off => None,
                        KvCapacity::Learned => Some(s.kv_capacity_blocks).filter(|&c| c > 0),
                        KvCapacity::Blocks(n) => Some(n),
                    })
                    .collect();
                let t = Rc::new(DecodedTable { bytes, table, keys, capacities });
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
        self.route_keyed(store, tokens, None, now_ms, entropy)
    }

    /// [`Router::route`] for a request that may carry a cache key ([`cachekey::key_hash`]
    /// of it).
    pub fn route_keyed(
        &mut self,
        store: &dyn SharedStore,
        tokens: TokenSource<'_>,
        cache_key: Option<u64>,
        now_ms: u64,
        entropy: u64,
    ) -> Decision {
        let mut d = Decision::default();
        let Some(decoded) = self.read_table(store, &mut d) else { return d };
        let hashes = self.prompt_hashes(tokens, &decoded.table, &mut d);
        let start = d.clone();
        for attempt in 0..=REDECISIONS {
            let may_race = attempt < REDECISIONS;
            if self.decide(store, &decoded, &hashes, cache_key, now_ms, entropy, may_race, &mut d) == Outcome::Placed {
                break;
            }
            // Another decision wrote the prompt's first bucket since this one read it (a
            // burst's sibling on the other Envoy thread): nothing was written; decide again
            // on what it left, keeping the counts of what was read.
            let (reads, layout, failures) = (d.shared_reads, d.layout_errors, d.update_failures);
            d = start.clone();
            (d.shared_reads, d.layout_errors, d.update_failures) = (reads, layout, failures);
            d.redecided = attempt + 1;
        }
        d
    }

    /// One decision on the shared state as read now. With `may_race`, it gives up
    /// ([`Outcome::Raced`]) before writing anything if the prompt's first bucket changed
    /// since its scan read it; without, it records its blocks over whatever changed.
    #[allow(clippy::too_many_arguments)]
    fn decide(
        &mut self,
        store: &dyn SharedStore,
        decoded: &DecodedTable,
        hashes: &[u64],
        cache_key: Option<u64>,
        now_ms: u64,
        entropy: u64,
        may_race: bool,
        d: &mut Decision,
    ) -> Outcome {
        let table = &decoded.table;
        d.shared_reads += 1;
        // Kept as read: the update of the load vector after the decision starts from it.
        let load_read = store.get(LOAD_KEY).ok();
        let load = LoadVector::decode(load_read.as_ref().and_then(|(v, _)| v.as_deref()).unwrap_or(&[]));
        let peers = if self.cfg.peer_load && table.peer_load { read_peer_load(store, d) } else { PeerLoad::default() };

        let (decode_set, prefill_set) = match self.cfg.mode {
            Mode::Aggregated => (up_slots(table, |r| r == Role::Both), SlotSet::EMPTY),
            Mode::Pd => (up_slots(table, Role::can_decode), up_slots(table, Role::can_prefill)),
        };
        if decode_set.is_empty() {
            d.fallback = Some(Fallback::NoWorkerUp);
            return Outcome::Placed;
        }
        let candidates = decode_set.union(&prefill_set);
        // With a stale index nothing is a hit (load only); in-flight entries are still
        // read and written, so active_blocks stays exact.
        let holding = if table.index_live { candidates } else { SlotSet::EMPTY };
        // Which of the request's blocks each worker already has in flight: its potential
        // load, and the prefill a sibling request is already doing there.
        let carrying = if self.reads_in_flight() { candidates } else { SlotSet::EMPTY };
        let scan = Scan::new(table.slots.len(), holding, carrying);
        let (scan, scanned) = self.scan(store, hashes, table.n_buckets, scan, now_ms, d);
        self.cached = None;
        // A cache key: read when keys are on; a new one is charged per key on each worker,
        // but for an implicit key found continuing its conversation (its first step went
        // unkeyed, before the anchor was known): it stays by the plain cost unless
        // `implicit_key_charge_continuations` spreads such conversations now.
        let implicit = match (cache_key, self.cfg.cache_key_spread) {
            (None, Some(_)) if self.cfg.implicit_cache_keys => {
                self.implicit_key(store, hashes, &scan, &scanned, now_ms, d)
            }
            _ => None,
        };
        d.implicit_cache_key = implicit.is_some();
        // The blocks a new key is charged for, per key live on a worker: a new
        // conversation's whole prompt; a continuation's own blocks past the anchor, which is
        // what it leaves behind when it moves to another worker holding the anchor.
        let (cache_key, charge_if_new, charged_blocks) = match implicit {
            Some(ImplicitKey { hash, continues: false, .. }) => (Some(hash), true, d.request_blocks),
            Some(ImplicitKey { hash, continues: true, own_blocks }) => {
                (Some(hash), self.cfg.implicit_key_charge_continuations, own_blocks)
            }
            None => (cache_key, true, d.request_blocks),
        };
        let key = match (cache_key, self.cfg.cache_key_spread) {
            (Some(hash), Some(spread)) => Some((self.read_key(store, hash, charge_if_new, now_ms, d), spread)),
            _ => None,
        };
        let live_epoch = key_epoch(now_ms, self.cfg.cache_key_live_ms);
        let key_charge = key.as_ref().and_then(|(k, spread)| {
            k.counts.as_ref().map(|(counts, _)| (spread * f64::from(charged_blocks), counts, live_epoch))
        });
        d.new_cache_key = key_charge.is_some();
        let request = Request {
            store,
            index_live: table.index_live,
            keys: &decoded.keys,
            capacities: &decoded.capacities,
            scan: &scan,
            load: &load,
            peers: &peers,
            blocks: d.request_blocks,
            key: hashes.first().copied().unwrap_or(entropy),
            now_ms,
            key_charge,
        };

        // Choose: in PD mode the prefill worker first, then the destination list.
        let mut chosen: Vec<u16> = Vec::with_capacity(2);
        if self.cfg.mode == Mode::Pd {
            if prefill_set.is_empty() {
                d.fallback.get_or_insert(Fallback::NoPrefillWorker);
            } else {
                self.rank_set(&request, &prefill_set, self.cfg.prefill_overlap_weight, true, false, d);
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
        // A decode worker fed by a prefill worker computes none of the prompt.
        let prefills = d.prefiller.is_none();
        self.rank_set(&request, &decode_set, weight, prefills, true, d);
        for s in self.scored.iter().take(self.cfg.max_endpoints) {
            d.destinations.push(table.slots[s.candidate.slot].id.clone());
        }
        // The cheapest of the workers with the most hits (the first of equals), in one pass.
        let holder = self
            .scored
            .iter()
            .min_by(|a, b| b.candidate.cache_hits.cmp(&a.candidate.cache_hits).then(a.cost.total_cmp(&b.cost)));
        d.most_hits = holder.map_or(0, |s| s.candidate.cache_hits);
        d.holder_terms = holder.map(|s| (s.cost, s.candidate.active_blocks, s.candidate.pending_prefill));
        let mut destination = None;
        if let Some(best) = self.scored.first() {
            d.hits = best.candidate.cache_hits;
            d.offloaded_hits = best.candidate.offloaded_hits;
            d.cost = best.cost;
            let slot = best.candidate.slot as u16;
            if !chosen.contains(&slot) {
                chosen.push(slot);
            }
            destination = Some(slot);
        }

        if !hashes.is_empty() {
            // Charged to the worker that computes the prefill: the prefill worker in PD
            // mode, else the destination.
            let prefill = chosen.first().and_then(|&slot| {
                let slot = usize::from(slot);
                let blocks = own_prefill(&scan, slot, d.request_blocks);
                let charge = PrefillChange { slot, epoch: prefill_epoch(now_ms), blocks: i64::from(blocks) };
                (self.tracks_prefill() && blocks > 0).then_some(charge)
            });
            chosen.sort_unstable();
            let commit = Commit { scanned, load_read, may_race };
            match self.acquire(store, d, hashes, table.n_buckets, chosen, prefill, commit, now_ms) {
                Some(held) => d.held = held,
                None => return Outcome::Raced,
            }
        }
        // After the blocks: a decision given up writes nothing.
        if let (Some((k, _)), Some(slot)) = (key, destination) {
            self.record_key(store, k, slot, now_ms, d);
        }
        Outcome::Placed
    }

    /// Whether routing reads which of a request's blocks are in flight on each worker:
    /// for potential load, and to credit a sibling's prefill.
    fn reads_in_flight(&self) -> bool {
        self.cfg.active_blocks == ActiveBlocks::Potential || self.tracks_prefill()
    }

    /// Whether routing charges each worker its outstanding prefill: read by the prefill
    /// term, the wait limit and the holder tie.
    fn tracks_prefill(&self) -> bool {
        self.cfg.prefill_load_weight > 0.0
            || self.cfg.wait_slack_per_hit.is_some()
            || self.cfg.holder_tie_per_hit.is_some()
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

    /// Reads the request's segment buckets in order into `scan` (see [`Scan`]), stopping at
    /// the first segment where no slot is left in the running. Returns the values read, for
    /// the in-flight update.
    fn scan(
        &self,
        store: &dyn SharedStore,
        hashes: &[u64],
        n_buckets: u32,
        mut scan: Scan,
        now_ms: u64,
        d: &mut Decision,
    ) -> (Scan, Vec<ScannedBucket>) {
        let mut scanned = Vec::new();
        for seg in segments(hashes.len()) {
            if scan.is_done() {
                break;
            }
            d.shared_reads += 1;
            let (value, cas) = store.get(&bucket_key(bucket_of(hashes[seg.start], n_buckets))).unwrap_or((None, None));
            let bucket = match value.as_deref().map(Bucket::parse).unwrap_or(Ok(Bucket::EMPTY)) {
                Ok(b) => b,
                Err(_) => {
                    d.layout_errors += 1;
                    Bucket::EMPTY
                }
            };
            let start = seg.start;
            scan_segment(&bucket, &hashes[seg], start, now_ms, self.cfg.predict_on_route, &mut scan);
            scanned.push(ScannedBucket { value, cas });
        }
        scan.finish(hashes.len());
        (scan, scanned)
    }

    /// The implicit key of a request without one ([`cachekey`], "Implicit keys"), and
    /// whether the request continues its conversation (its hits run past the anchor);
    /// `None` if it has no anchor or the anchor is not conversational. A continuation marks
    /// its anchor with (16 bits of) its implicit key; one by another conversation confirms
    /// it, and only a confirmed anchor is conversational: a request whose own previous step
    /// is still in flight (its stream not yet released) sees that step as its anchor, and
    /// no other conversation continues it.
    fn implicit_key(
        &self,
        store: &dyn SharedStore,
        hashes: &[u64],
        scan: &Scan,
        scanned: &[ScannedBucket],
        now_ms: u64,
        d: &mut Decision,
    ) -> Option<ImplicitKey> {
        const CONFIRMED: u16 = u16::MAX;
        // The anchor: the deepest prefix two or more streams have in flight on one worker
        // (one stream may be this conversation's previous step, not yet released).
        let depth = shared_in_flight(hashes, scanned, scan, now_ms);
        if depth == 0 || depth >= hashes.len() {
            return None;
        }
        let (anchor, key) = (hashes[depth - 1], cachekey::implicit_key(hashes[depth]));
        // A later step: some worker holds more than the anchor (its history), and not the
        // whole request (a repeated prompt is no conversation).
        let continues = scan.hits.iter().any(|&h| (depth + 1..hashes.len()).contains(&(h as usize)));
        let window = self.cfg.cache_key_window_ms;
        let (marked, read) = read_entry(store, ANCHORS_KEY, anchor, d);
        let marked = marked.filter(|e| now_ms.saturating_sub(e.seen_ms) <= window);
        let implicit = ImplicitKey { hash: key, continues, own_blocks: (hashes.len() - depth) as u32 };
        if !continues {
            return marked.is_some_and(|e| e.slot == CONFIRMED).then_some(implicit);
        }
        let mine = (key as u16).min(CONFIRMED - 1);
        let mark = match marked {
            Some(e) if e.slot == CONFIRMED || e.slot != mine => CONFIRMED,
            _ => mine,
        };
        if marked.is_none_or(|e| e.slot != mark || now_ms.saturating_sub(e.seen_ms) >= window / 4) {
            let entry = KeyEntry { hash: anchor, slot: mark, seen_ms: now_ms };
            let keep_from = now_ms.saturating_sub(window);
            let edit = |v: &[u8]| cachekey::upsert(v, entry, keep_from).map(|new| Edit::Write(new, ()));
            if let Err(e) = update(store, ANCHORS_KEY, read, &mut d.shared_reads, edit) {
                d.update_failures += 1;
                d.layout_errors += u32::from(matches!(e, UpdateError::Rejected(_)));
            }
        }
        (mark == CONFIRMED).then_some(implicit)
    }

    /// The request's cache key: its entry and, for a key not seen within the window, the
    /// keys live on each worker. Unreadable values count as layout errors and the key as
    /// new.
    fn read_key(
        &self,
        store: &dyn SharedStore,
        hash: u64,
        charge_if_new: bool,
        now_ms: u64,
        d: &mut Decision,
    ) -> KeyRead {
        let (entry, bucket) = read_entry(store, &key_bucket_key(key_bucket_of(hash)), hash, d);
        let known = entry.is_some_and(|e| now_ms.saturating_sub(e.seen_ms) <= self.cfg.cache_key_window_ms);
        let counts = (!known && charge_if_new).then(|| {
            d.shared_reads += 1;
            let read = store.get(KEYLOAD_KEY).ok();
            (KeyLoad::decode(read.as_ref().and_then(|(v, _)| v.as_deref()).unwrap_or_default()), read)
        });
        KeyRead { hash, bucket, counts }
    }

    /// Records where the key's request went: its entry, and its live count moved to `slot`
    /// and this live window. Written when the slot or the window changed, or the entry is a
    /// quarter window old (so a known key stays known); most of a key's requests write
    /// nothing. Where the key was counted is read from the bucket the write replaces, so
    /// two requests of one key racing to move it move its count once.
    fn record_key(&self, store: &dyn SharedStore, k: KeyRead, slot: u16, now_ms: u64, d: &mut Decision) {
        let (window, live) = (self.cfg.cache_key_window_ms, self.cfg.cache_key_live_ms);
        let epoch = key_epoch(now_ms, live);
        let entry = KeyEntry { hash: k.hash, slot, seen_ms: now_ms };
        let keep_from = now_ms.saturating_sub(window);
        // `Some(was)`: the count moves from `was` (slot and window; none for a key not in
        // the bucket) to here.
        let edit = |v: &[u8]| {
            let last = cachekey::find(v, k.hash)?;
            let was = last.map(|e| (usize::from(e.slot), key_epoch(e.seen_ms, live)));
            let recount = was != Some((usize::from(slot), epoch));
            if !recount && last.is_some_and(|e| now_ms.saturating_sub(e.seen_ms) < window / 4) {
                return Ok(Edit::Keep(None));
            }
            cachekey::upsert(v, entry, keep_from).map(|new| Edit::Write(new, recount.then_some(was)))
        };
        let key = key_bucket_key(key_bucket_of(k.hash));
        let was = match update(store, &key, k.bucket, &mut d.shared_reads, edit) {
            Ok(Some(was)) => was,
            Ok(None) => return,
            Err(e) => {
                d.update_failures += 1;
                d.layout_errors += u32::from(matches!(e, UpdateError::Rejected(_)));
                return;
            }
        };
        let first = k.counts.and_then(|(_, read)| read);
        let edit = |v: &[u8]| {
            let mut counts = KeyLoad::decode(v);
            counts.seen(was, usize::from(slot), epoch);
            Ok::<_, ()>(Edit::Write(counts.encode(), ()))
        };
        if update(store, KEYLOAD_KEY, first, &mut d.shared_reads, edit).is_err() {
            d.update_failures += 1;
        }
    }

    /// Scores the slots of `set` into `self.scored`, best first. `prefills`: the chosen
    /// worker will compute the request's prefill; `destination`: it is the request's
    /// destination, where a new cache key is charged for the keys live there.
    fn rank_set(
        &mut self,
        r: &Request<'_>,
        set: &SlotSet,
        weight: f64,
        prefills: bool,
        destination: bool,
        d: &mut Decision,
    ) {
        let potential = self.cfg.active_blocks == ActiveBlocks::Potential;
        let (scan, request_blocks) = (r.scan, r.blocks);
        let epoch = prefill_epoch(r.now_ms);
        let fleet_rate = if self.cfg.prefill_drain { r.load.fleet_prefill_rate() } else { Default::default() };
        self.candidates.clear();
        // No worker holds or carries any of the request's blocks: a prefix new to the set.
        let mut unseen = true;
        for slot in set.iter() {
            let of = |v: &[u32]| v.get(slot).copied().unwrap_or(0);
            unseen &= of(&scan.hits) == 0 && of(&scan.in_flight) == 0;
            // What the worker would carry with this request added — the blocks already in
            // flight there count once: the potential load, and the memory limit's count.
            let peer = r.peers.get(slot);
            // Summed as they are, two gateways' requests on one prefix would count it twice:
            // what a peer carries on a holder is taken to be that prefix first.
            let carried = r.load.get(slot).saturating_add(peer.active.saturating_sub(of(&scan.hits)));
            let with_request = carried.saturating_add(request_blocks.saturating_sub(of(&scan.in_flight)));
            // The worker's prefill queue with this request added: its outstanding prefill,
            // less what siblings compute there on this request's blocks (work this request
            // needs done anyway), plus the request's own.
            let own = if prefills { own_prefill(scan, slot, request_blocks) } else { 0 };
            // As charged until each first token, or less what the worker has computed since.
            let own_outstanding = if self.cfg.prefill_drain {
                r.load.draining_prefill(slot, r.now_ms, fleet_rate)
            } else {
                r.load.pending_prefill(slot, epoch)
            };
            let outstanding = own_outstanding.saturating_add(peer.prefill);
            let queued = outstanding.saturating_sub(scan.computing(slot));
            self.candidates.push(Candidate {
                slot,
                cache_hits: of(&scan.hits),
                offloaded_hits: of(&scan.offloaded),
                active_blocks: if potential { with_request } else { carried },
                pending_prefill: queued.saturating_add(own),
                wait: outstanding.saturating_add(own),
                own_prefill: own,
                cached_blocks: self.cached.as_ref().map_or(0, |c| c.get(slot)),
                memory_blocks: with_request,
                kv_capacity_blocks: r.capacities.get(slot).copied().flatten(),
                worker_key: r.keys.get(slot).copied().unwrap_or(0),
                key_load: match r.key_charge.filter(|_| destination) {
                    Some((per_key, counts, epoch)) => (per_key * f64::from(counts.get(slot, epoch))).min(1.0e9) as u32,
                    None => 0,
                },
            });
        }
        let weights = self.cfg.weights(weight, prefills);
        let mut outcome = rank(&self.candidates, weights, request_blocks, r.key, &mut self.scored);
        // Only a new prefix is placed by the counts. One that a busy worker holds spills by
        // the hash: its later spills then agree on one second worker, where the emptiest
        // of the moment would scatter copies of it.
        let unread = self.cached.is_none() && self.cfg.tie_break == TieBreak::LeastCached && r.index_live;
        if unread && unseen && tied_at_top(&self.scored, weights.offload_hit_credit) {
            let cached = self.read_cached(r.store, d);
            for c in &mut self.candidates {
                c.cached_blocks = cached.get(c.slot);
            }
            self.cached = Some(cached);
            outcome = rank(&self.candidates, weights, request_blocks, r.key, &mut self.scored);
        }
        d.note(outcome);
    }

    /// The sync service's cached-block counts; none (every worker 0: the hash decides) when
    /// there are none yet or they do not decode (counted).
    fn read_cached(&self, store: &dyn SharedStore, d: &mut Decision) -> CachedBlocks {
        d.shared_reads += 1;
        match store.get(CACHED_KEY) {
            Ok((Some(v), _)) => CachedBlocks::decode(&v).unwrap_or_else(|_| {
                d.layout_errors += 1;
                CachedBlocks::default()
            }),
            _ => CachedBlocks::default(),
        }
    }

    /// Records the request's blocks as in flight on `slots`, starting from the values the
    /// decision read. `None`: `commit.may_race` and the first bucket changed since it was
    /// read; nothing was written.
    #[allow(clippy::too_many_arguments)]
    fn acquire(
        &self,
        store: &dyn SharedStore,
        d: &mut Decision,
        hashes: &[u64],
        n_buckets: u32,
        slots: Vec<u16>,
        prefill: Option<PrefillChange>,
        commit: Commit,
        now_ms: u64,
    ) -> Option<Held> {
        let change = Change::Acquire { lease_ms: self.cfg.inflight_lease_ms };
        let mut held = Held { slots, segments: Vec::new(), prefill: None };
        let mut delta = ActiveDelta::default();
        let mut scanned = commit.scanned.into_iter();
        for (i, seg) in segments(hashes.len()).enumerate() {
            let b = bucket_of(hashes[seg.start], n_buckets);
            let first_read = scanned.next().map(|s| (s.value, s.cas));
            let mut sorted = hashes[seg].to_vec();
            sorted.sort_unstable();
            sorted.dedup();
            let mut keys = Vec::with_capacity(sorted.len() * held.slots.len());
            inflight::keys(&sorted, &held.slots, &mut keys);
            // Every decision on a prompt writes its first bucket first: a write there since
            // the scan is a decision this one did not see.
            let strict = i == 0 && commit.may_race && first_read.is_some();
            let attempts = if strict { 1 } else { CAS_ATTEMPTS };
            match update_bucket(store, b, first_read, &keys, change, now_ms, attempts, &mut d.shared_reads) {
                Ok(seg_delta) => {
                    delta.merge(&seg_delta);
                    held.segments.push((b, sorted));
                }
                Err(UpdateError::Contended) if strict => return None,
                Err(e) => {
                    d.update_failures += 1;
                    d.layout_errors += u32::from(matches!(e, UpdateError::Rejected(())));
                }
            }
        }
        if update_load(store, &delta, prefill.as_slice(), now_ms, false, commit.load_read, &mut d.shared_reads) {
            held.prefill = prefill;
        } else {
            d.update_failures += 1;
        }
        Some(held)
    }

    /// The request's prefill has ended (its first response bytes came back): its
    /// outstanding prefill is released. Returns the shared-data reads made and the number
    /// of updates that failed (0 or 1).
    pub fn end_prefill(&self, store: &dyn SharedStore, held: &mut Held, now_ms: u64) -> (u32, u32) {
        let Some(charge) = held.prefill.take() else { return (0, 0) };
        let release = [charge.undone()];
        let mut reads = 0;
        let ok = update_load(store, &ActiveDelta::default(), &release, now_ms, true, None, &mut reads);
        (reads, u32::from(!ok))
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
        // Streams that ended before their first response bytes (aborted, reset, or no body).
        let prefills: Vec<PrefillChange> = helds.iter().filter_map(|h| h.prefill).map(PrefillChange::undone).collect();
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
            let release = Change::Release { linger_ms };
            match update_bucket(store, b, None, &keys, release, now_ms, CAS_ATTEMPTS, &mut reads) {
                Ok(seg_delta) => delta.merge(&seg_delta),
                Err(_) => failures += 1,
            }
        }
        if !update_load(store, &delta, &prefills, now_ms, false, None, &mut reads) {
            failures += 1;
        }
        failures
    }
}

/// Other gateways' load ([`PEERLOAD_KEY`]); none if unreadable.
fn read_peer_load(store: &dyn SharedStore, d: &mut Decision) -> PeerLoad {
    d.shared_reads += 1;
    match store.get(PEERLOAD_KEY) {
        Ok((Some(v), _)) => PeerLoad::decode(&v),
        _ => PeerLoad::default(),
    }
}

/// A key bucket's value as read (for the write that may follow) and the entry of `hash` in
/// it; a value that does not decode counts as a layout error and holds no entry.
fn read_entry(
    store: &dyn SharedStore,
    key: &str,
    hash: u64,
    d: &mut Decision,
) -> (Option<KeyEntry>, Option<Versioned>) {
    d.shared_reads += 1;
    let read = store.get(key).ok();
    let value = read.as_ref().and_then(|(v, _)| v.as_deref()).unwrap_or_default();
    let entry = cachekey::find(value, hash).unwrap_or_else(|_| {
        d.layout_errors += 1;
        None
    });
    (entry, read)
}

/// How many leading blocks of the request two or more streams have in flight on one
/// worker, from the buckets the scan read (within the blocks `scan` found in flight).
fn shared_in_flight(hashes: &[u64], scanned: &[ScannedBucket], scan: &Scan, now_ms: u64) -> usize {
    let mut running = SlotSet::EMPTY;
    for (slot, &n) in scan.in_flight.iter().enumerate() {
        if n > 0 {
            running.insert(slot);
        }
    }
    for (seg, read) in segments(hashes.len()).zip(scanned) {
        // A bucket that did not parse was counted by the scan.
        let bucket = read.value.as_deref().and_then(|v| Bucket::parse(v).ok()).unwrap_or(Bucket::EMPTY);
        for i in seg {
            running = bucket.fly_shared(hashes[i], now_ms, &running);
            if running.is_empty() {
                return i;
            }
        }
    }
    hashes.len()
}

/// The request's own prefill work on `slot`: its blocks the worker neither holds nor has in
/// flight for another request (which computes them).
fn own_prefill(scan: &Scan, slot: usize, request_blocks: u32) -> u32 {
    let of = |v: &[u32]| v.get(slot).copied().unwrap_or(0);
    request_blocks.saturating_sub(of(&scan.hits).max(of(&scan.in_flight)))
}

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

/// Read-modify-write of bucket `b`'s in-flight part (see [`inflight::apply`]; with a sweep
/// when due), in at most `attempts` compare-and-swaps. The first read may come from the
/// scan.
#[allow(clippy::too_many_arguments)]
fn update_bucket(
    store: &dyn SharedStore,
    b: u32,
    first_read: Option<Versioned>,
    keys: &[inflight::Key],
    change: Change,
    now_ms: u64,
    attempts: u32,
    reads: &mut u32,
) -> Result<ActiveDelta, UpdateError<()>> {
    let mut swept = Vec::new();
    let edit = |value: &[u8]| {
        let bucket = Bucket::parse(value).map_err(|_| ())?;
        let (n_fly, fly_raw) = bucket.fly_raw();
        let mut sweep_at = bucket.sweep_at_ms();
        let sweep = now_ms >= sweep_at;
        if sweep {
            // This writer's turn to sweep the whole bucket.
            sweep_at = now_ms.saturating_add(inflight::SWEEP_INTERVAL_MS);
        }
        // One allocation: growing from empty copied the index part several times over.
        let mut out = Vec::with_capacity(value.len() + keys.len() * FLY_ENTRY);
        begin_bucket(&mut out, bucket.index_part(), sweep_at);
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
        Ok(if out == value { Edit::Keep(delta) } else { Edit::Write(out, delta) })
    };
    // The host treats CAS 0 as "unconditional". Keys exist from the sync service's start
    // (it creates every bucket and the load key empty), so 0 only happens before that,
    // when no table exists and nothing is routed yet.
    update_tries(store, &bucket_key(b), first_read, reads, attempts, edit)
}

/// Applies per-slot changes of active blocks and of outstanding prefill (at the writer's
/// `now_ms`; releases of prefills that `ended` or not, [`LoadVector::apply_prefill`]) to
/// the load vector; the first attempt may use a value already read.
#[allow(clippy::too_many_arguments)]
fn update_load(
    store: &dyn SharedStore,
    delta: &ActiveDelta,
    prefill: &[PrefillChange],
    now_ms: u64,
    ended: bool,
    first_read: Option<Versioned>,
    reads: &mut u32,
) -> bool {
    if delta.is_zero() && prefill.iter().all(|c| c.blocks == 0) {
        return true;
    }
    let edit = |value: &[u8]| {
        let mut load = LoadVector::decode(value);
        load.apply(&delta.0);
        load.apply_prefill(prefill, now_ms, ended);
        Ok::<_, ()>(Edit::Write(load.encode(), ()))
    };
    update(store, LOAD_KEY, first_read, reads, edit).is_ok()
}

#[cfg(test)]
pub(crate) mod tests;
