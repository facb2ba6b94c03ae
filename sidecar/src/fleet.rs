//! The whole fleet's state: every worker's cache, the feed's version and change log, and
//! the counters `/metrics` shows. One `Fleet` lives behind a mutex; the ingest thread
//! applies events to it, the HTTP server reads frames and views from it.
//!
//! Workers come and go (discovery), so each has a [`WorkerKey`] that is never reused within
//! the process: events, resets and the change log name workers by key, and a feed frame's
//! worker indices are positions in the list as it is when the frame is cut.

use crate::cache::{Change, Outcome, WorkerCache};
use crate::changelog::ChangeLog;
use crate::checkpoint::{self, ResumePoint, SavedWorker};
use crate::config::{Config, WorkerConfig};
use crate::events::{Batch, BatchReader, BatchTail, DecodeError, Event, GroupKind};
use bytes::Bytes;
use kvroute::feed::{FeedBlock, FeedWorker, Frame, FrameKind, Op};
use kvroute::role::Role;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::watch;

/// The fleet behind its mutex. A panic elsewhere must not stop ingestion or serving; the
/// state stays consistent because every mutation completes under one lock.
pub fn lock(fleet: &Mutex<Fleet>) -> MutexGuard<'_, Fleet> {
    kvroute_serve::lock(fleet)
}

/// Why a worker's (rank's) state was thrown away and rebuilt from later events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetReason {
    /// The sequence number went back: the publisher (engine) restarted.
    PublisherRestart,
    /// Batches were missed and could not be replayed.
    GapNotReplayed,
    /// A batch could not be decoded, so what it changed is unknown.
    UndecodableBatch,
    /// A rank restored from a checkpoint whose publisher did not confirm the resume point.
    RestoreUnverified,
}

impl ResetReason {
    pub const ALL: [ResetReason; 4] = [
        ResetReason::PublisherRestart,
        ResetReason::GapNotReplayed,
        ResetReason::UndecodableBatch,
        ResetReason::RestoreUnverified,
    ];
    pub fn label(self) -> &'static str {
        match self {
            ResetReason::PublisherRestart => "publisher_restart",
            ResetReason::GapNotReplayed => "gap_not_replayed",
            ResetReason::UndecodableBatch => "undecodable_batch",
            ResetReason::RestoreUnverified => "restore_unverified",
        }
    }
}

pub const EVENT_TYPES: [&str; 4] = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "unknown"];

#[derive(Debug, Default, Clone)]
pub struct Stats {
    /// [event type][outcome] (indices of `EVENT_TYPES` and `Outcome::ALL`).
    pub events: [[u64; Outcome::ALL.len()]; EVENT_TYPES.len()],
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    pub batches: u64,
    /// Payloads that did not decode.
    pub batches_bad: u64,
    /// Live batches that arrived again after a replay had applied them (dropped).
    pub batches_duplicate: u64,
    /// Of them, batches over a cap (`crate::events::MAX_EVENTS_PER_BATCH`, …).
    pub batches_over_cap: u64,
    /// ZMQ messages that were not `[topic, seq(8), payload]`.
    pub frames_bad: u64,
    /// Stores of a KV-cache group whose kind this sidecar does not know (not indexed).
    pub unknown_group_kinds: u64,
    pub gaps: u64,
    pub replays_ok: u64,
    pub replays_failed: u64,
    pub resets: [u64; ResetReason::ALL.len()],
    /// Feed frames served: delta, snapshot first page, later page.
    pub feed_frames: [u64; 3],
    pub feed_bad_requests: u64,
    /// Long polls waiting now.
    pub feed_waiting: u64,
    /// `version - since` of the latest feed request.
    pub feed_lag_versions: u64,
    /// Workers added and removed after start (discovery).
    pub workers_added: u64,
    pub workers_removed: u64,
    /// Workers discovery offered that could not be added (fleet full, id taken).
    pub workers_refused: u64,
    /// Checkpoints written to `state_file`, and those that failed (logged).
    pub checkpoints_written: u64,
    pub checkpoint_errors: u64,
    /// Workers whose caches were restored from the checkpoint at start or when they joined;
    /// of their ranks, those whose publisher confirmed the resume point (the others were
    /// cleared: `resets{reason="restore_unverified"}`).
    pub workers_restored: u64,
    pub restores_verified: u64,
    /// Discovery lookups or sessions that failed (the last worker list was kept).
    pub discovery_errors: u64,
    /// Discovery records that did not describe a worker (ignored).
    pub discovery_records_bad: u64,
    /// Endpoint-discovery polls answered, and refused as malformed.
    pub eds_requests: u64,
    pub eds_bad_requests: u64,
}

#[derive(Debug, Default, Clone)]
pub struct RankState {
    pub last_seq: Option<u64>,
    pub last_event_at: Option<Instant>,
    /// Receive time minus the batch's `ts`, of the latest batch.
    pub lag_ms: Option<f64>,
    /// The digest of the latest batch's payload (`checkpoint::payload_digest`): with
    /// `last_seq`, where a restarted sidecar resumes the stream.
    pub last_digest: Option<u64>,
}

/// A worker's name inside this process: positions shift when a worker leaves, keys do not.
pub type WorkerKey = u32;

#[derive(Debug)]
pub struct WorkerState {
    pub key: WorkerKey,
    pub config: WorkerConfig,
    pub cache: WorkerCache,
    pub up: bool,
    pub ranks: Vec<RankState>,
}

impl WorkerState {
    fn new(key: WorkerKey, config: WorkerConfig) -> WorkerState {
        let ranks = config.dp_ranks as usize;
        WorkerState { key, cache: WorkerCache::new(ranks), up: true, ranks: vec![RankState::default(); ranks], config }
    }
}

/// A snapshot cut at one version, kept so its later pages show that same version.
struct Snapshot {
    version: u64,
    tiers: bool,
    pages: Vec<Bytes>,
}

pub struct Fleet {
    epoch: u64,
    version: u64,
    block_size: u32,
    page_blocks: usize,
    pub workers: Vec<WorkerState>,
    next_key: WorkerKey,
    log: ChangeLog,
    snapshot: Option<Snapshot>,
    pub stats: Stats,
    version_tx: watch::Sender<u64>,
    changes: Vec<Change>,
    /// Checkpoint records of workers that have not joined since the sidecar started.
    saved: Vec<SavedWorker>,
}

/// The feed's answer to one poll.
pub enum FeedReply {
    Frame(Bytes),
    /// Nothing new: wait for a change, then ask again with `may_wait = false`.
    Wait,
}

impl Fleet {
    pub fn new(config: &Config, epoch: u64) -> Fleet {
        let workers: Vec<WorkerState> =
            config.workers.iter().enumerate().map(|(i, w)| WorkerState::new(i as WorkerKey, w.clone())).collect();
        let (version_tx, _) = watch::channel(0);
        Fleet {
            epoch: epoch.max(1),
            version: 0,
            block_size: config.block_size,
            page_blocks: config.snapshot_page_blocks,
            next_key: workers.len() as WorkerKey,
            workers,
            log: ChangeLog::new(config.log_max_blocks),
            snapshot: None,
            stats: Stats::default(),
            version_tx,
            changes: Vec::new(),
            saved: Vec::new(),
        }
    }

    pub fn version(&self) -> u64 {
        self.version
    }
    pub fn log_blocks(&self) -> usize {
        self.log.blocks()
    }

    /// Wakes when the version moves.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version_tx.subscribe()
    }

    /// The worker with this key, if it is still in the fleet.
    pub fn worker(&self, key: WorkerKey) -> Option<&WorkerState> {
        self.workers.iter().find(|w| w.key == key)
    }

    fn position(&self, key: WorkerKey) -> Option<usize> {
        self.workers.iter().position(|w| w.key == key)
    }

    /// Adds a worker holding nothing; a new version. Refused if the id is taken or the
    /// fleet is full. The change log starts it with a CLEAR, so a client that never saw an
    /// earlier worker of the same id leave drops what that one held.
    pub fn add_worker(&mut self, config: WorkerConfig) -> Result<WorkerKey, String> {
        if self.workers.iter().any(|w| w.config.id == config.id) {
            return Err(format!("worker {} is already in the fleet", config.id));
        }
        if self.workers.len() >= crate::config::MAX_WORKERS {
            return Err(format!("worker {}: the fleet is full ({} workers)", config.id, self.workers.len()));
        }
        let key = self.next_key;
        self.next_key = self.next_key.wrapping_add(1);
        log::info!("worker {} joined ({} ranks, role {})", config.id, config.dp_ranks, role_name(config.role));
        self.workers.push(WorkerState::new(key, config));
        self.stats.workers_added += 1;
        self.log.clear(self.version + 1, key);
        self.bump();
        Ok(key)
    }

    /// Removes a worker and all it holds; a new version (clients drop a worker that is
    /// absent from a frame's list). What the log holds for it is skipped from then on.
    pub fn remove_worker(&mut self, key: WorkerKey) -> bool {
        let Some(i) = self.position(key) else { return false };
        let w = self.workers.remove(i);
        log::info!("worker {} left ({} blocks dropped)", w.config.id, w.cache.block_count());
        self.stats.workers_removed += 1;
        self.bump();
        true
    }

    /// Applies one batch payload from worker `w`, DP rank `rank`, sequence `seq`, event by
    /// event as it decodes. A payload that does not decode is an error once its first
    /// events were applied (and logged): the caller clears the rank, as it must for any batch
    /// it cannot read, which drops them with the rest.
    pub fn apply_payload(
        &mut self,
        key: WorkerKey,
        rank: usize,
        seq: u64,
        payload: &[u8],
        now: Instant,
        now_unix: f64,
    ) -> Result<(), DecodeError> {
        let Some(w) = self.position(key) else { return Ok(()) };
        let tail = self
            .apply_events(w, |f, changes, changed| {
                let mut reader = BatchReader::new(payload)?;
                while let Some(ev) = reader.next_event()? {
                    *changed |= f.apply_event(w, rank, &ev, changes);
                }
                reader.finish()
            })
            .inspect_err(|e| self.stats.batches_over_cap += u64::from(e.over_cap))?;
        self.batch_done(w, rank, seq, &tail, now, now_unix);
        if let Some(r) = self.workers.get_mut(w).and_then(|x| x.ranks.get_mut(rank)) {
            r.last_digest = Some(checkpoint::payload_digest(payload));
        }
        Ok(())
    }

    /// Applies one decoded batch (as [`Fleet::apply_payload`] does its payload).
    pub fn apply_batch(&mut self, key: WorkerKey, rank: usize, seq: u64, batch: &Batch, now: Instant, now_unix: f64) {
        let Some(w) = self.position(key) else { return };
        let _infallible: Result<(), DecodeError> = self.apply_events(w, |f, changes, changed| {
            for ev in &batch.events {
                *changed |= f.apply_event(w, rank, ev, changes);
            }
            Ok(())
        });
        self.batch_done(w, rank, seq, &batch.tail, now, now_unix);
    }

    /// Runs `apply` (which collects changes, and flags any it logged itself), then logs what
    /// it changed as one new version: also when it fails partway, so the feed always says
    /// what the caches hold.
    fn apply_events<T>(
        &mut self,
        w: usize,
        apply: impl FnOnce(&mut Self, &mut Vec<Change>, &mut bool) -> Result<T, DecodeError>,
    ) -> Result<T, DecodeError> {
        let mut changes = std::mem::take(&mut self.changes);
        let mut changed = false;
        let result = apply(self, &mut changes, &mut changed);
        let key = self.workers.get(w).map_or(WorkerKey::MAX, |x| x.key);
        changed |= Self::log_changes(&mut self.log, self.version + 1, key, &mut changes);
        self.changes = changes;
        if changed {
            self.bump();
        }
        result
    }

    /// A whole batch was applied: counted (its events of unknown types too), and the rank's
    /// last sequence and lag noted.
    fn batch_done(&mut self, w: usize, rank: usize, seq: u64, tail: &BatchTail, now: Instant, now_unix: f64) {
        if let Some(i) = Outcome::ALL.iter().position(|o| *o == Outcome::Malformed) {
            self.stats.events[EVENT_TYPES.len() - 1][i] += tail.unknown;
        }
        let Some(worker) = self.workers.get_mut(w) else { return };
        if let Some(tag) = &tail.first_unknown {
            log::debug!("worker {}: skipped {} events of unknown types, first {tag:?}", worker.config.id, tail.unknown);
        }
        self.stats.batches += 1;
        if let Some(r) = worker.ranks.get_mut(rank) {
            r.last_seq = Some(seq);
            r.last_digest = None;
            r.last_event_at = Some(now);
            // A `ts` that is no time (NaN, infinite: never sent by an engine) gives no lag.
            r.lag_ms = tail.ts.is_finite().then(|| ((now_unix - tail.ts) * 1000.0).max(0.0));
        }
    }

    /// One event; true if it logged changes already (a clear logs what came before it).
    fn apply_event(&mut self, w: usize, rank: usize, ev: &Event, changes: &mut Vec<Change>) -> bool {
        let Some(worker) = self.workers.get_mut(w) else { return false };
        let mut changed = false;
        let (kind, outcome) = match ev {
            Event::Stored(s) => {
                if s.group_kind == Some(GroupKind::Unknown) {
                    self.stats.unknown_group_kinds += 1;
                    if self.stats.unknown_group_kinds.is_power_of_two() {
                        log::warn!(
                            "worker {}: KV-cache group {} has a kind this sidecar does not know; its blocks are \
                             not indexed (#{})",
                            worker.config.id,
                            s.group_idx,
                            self.stats.unknown_group_kinds
                        );
                    }
                }
                let o = worker.cache.apply_stored(rank, s, self.block_size, changes);
                if o == Outcome::Applied {
                    self.stats.blocks_stored += s.block_hashes.len() as u64;
                }
                (0, o)
            }
            Event::Removed(r) => {
                self.stats.blocks_removed += r.block_hashes.len() as u64;
                (1, worker.cache.apply_removed(rank, r, changes))
            }
            Event::Cleared => {
                // What came before the clear is logged before it.
                changed |= Self::log_changes(&mut self.log, self.version + 1, worker.key, changes);
                changed |= Self::clear_into(&mut self.log, self.version + 1, worker, rank, changes);
                (2, Outcome::Applied)
            }
        };
        if let Some(i) = Outcome::ALL.iter().position(|o| *o == outcome) {
            self.stats.events[kind][i] += 1;
        }
        changed
    }

    /// Forgets what DP rank `rank` of worker `key` holds, to rebuild it from later events.
    pub fn reset_rank(&mut self, key: WorkerKey, rank: usize, reason: ResetReason) {
        let Some(worker) = self.workers.iter_mut().find(|w| w.key == key) else { return };
        let mut n = 0;
        if let Some(i) = ResetReason::ALL.iter().position(|r| *r == reason) {
            self.stats.resets[i] += 1;
            n = self.stats.resets[i];
        }
        // Counted always; logged at the 1st, 2nd, 4th… reset for a reason (no floods).
        if n.is_power_of_two() {
            log::warn!("worker {} rank {rank}: cleared and rebuilding ({}, #{n})", worker.config.id, reason.label());
        }
        let mut changes = std::mem::take(&mut self.changes);
        let changed = Self::clear_into(&mut self.log, self.version + 1, worker, rank, &mut changes);
        self.changes = changes;
        if changed {
            self.bump();
        }
    }

    /// The whole fleet as a checkpoint file (`crate::checkpoint`): every worker's cache and
    /// resume points, and the saved records of workers that have not rejoined.
    pub fn checkpoint(&self) -> Vec<u8> {
        let mut records: Vec<Vec<u8>> = Vec::with_capacity(self.workers.len());
        for worker in &self.workers {
            let mut w = checkpoint::Writer::default();
            let points: Vec<Option<ResumePoint>> =
                worker.ranks.iter().map(|r| Some(ResumePoint { seq: r.last_seq?, digest: r.last_digest? })).collect();
            checkpoint::record_header(&mut w, &worker.config.id, &points);
            worker.cache.save(&mut w);
            records.push(w.0);
        }
        let carried = self.saved.iter().filter(|s| self.workers.iter().all(|w| w.config.id != s.id));
        let all: Vec<&[u8]> = records.iter().map(Vec::as_slice).chain(carried.map(|s| s.record.as_slice())).collect();
        checkpoint::encode(self.block_size, &all)
    }

    /// Takes a checkpoint file read at start: its records wait for their workers to join
    /// ([`Fleet::restore_worker`]). Refused whole if damaged or written for another block
    /// size; the number of records otherwise.
    pub fn load_checkpoint(&mut self, file: &[u8]) -> Result<usize, String> {
        self.saved = checkpoint::decode(file, self.block_size)?;
        Ok(self.saved.len())
    }

    /// Gives worker `key` the cache its checkpoint record holds, if there is one for its
    /// id with as many ranks, and returns each rank's resume point (empty: nothing
    /// restored). The restored blocks are a new version, like any others; until the
    /// sequencer confirms a rank's resume point with its publisher the rank is provisional
    /// (a rank that is not confirmed is cleared).
    pub fn restore_worker(&mut self, key: WorkerKey) -> Vec<Option<ResumePoint>> {
        let Some(w) = self.position(key) else { return Vec::new() };
        let Some(i) = self.saved.iter().position(|s| s.id == self.workers[w].config.id) else { return Vec::new() };
        let saved = self.saved.swap_remove(i);
        let worker = &mut self.workers[w];
        let mut input = checkpoint::Reader::new(&saved.record);
        let restored = checkpoint::read_header(&mut input).and_then(|points| {
            if points.len() != worker.ranks.len() {
                return Err(format!("{} ranks saved, the worker has {}", points.len(), worker.ranks.len()));
            }
            let cache = WorkerCache::load(&mut input, worker.ranks.len())?;
            if !input.is_empty() {
                return Err("bytes after the cache".into());
            }
            Ok((points, cache))
        });
        let (points, cache) = match restored {
            Ok(r) => r,
            Err(e) => {
                self.stats.checkpoint_errors += 1;
                log::error!("worker {}: checkpoint record refused ({e}); starting it empty", worker.config.id);
                return Vec::new();
            }
        };
        worker.cache = cache;
        for (rank, (r, p)) in worker.ranks.iter_mut().zip(&points).enumerate() {
            r.last_seq = p.map(|p| p.seq);
            r.last_digest = p.map(|p| p.digest);
            // Nothing can confirm what a rank without a resume point holds (caught between
            // a batch that broke partway and its clear): it starts empty.
            if p.is_none() {
                worker.cache.clear_rank(rank, &mut Vec::new());
            }
        }
        let mut changes: Vec<Change> = worker
            .cache
            .feed_blocks()
            .map(|(b, offloaded)| if offloaded { Change::StoreOffloaded(b) } else { Change::Store(b) })
            .collect();
        changes.sort_by_key(|c| matches!(c, Change::StoreOffloaded(_)));
        log::info!("worker {}: {} blocks restored from the checkpoint", worker.config.id, changes.len());
        let key = worker.key;
        if Self::log_changes(&mut self.log, self.version + 1, key, &mut changes) {
            self.bump();
        }
        self.stats.workers_restored += 1;
        points
    }

    /// Marks a worker up or down; a change is a new version (the worker list changed).
    pub fn set_up(&mut self, key: WorkerKey, up: bool) {
        let Some(worker) = self.workers.iter_mut().find(|w| w.key == key) else { return };
        if worker.up != up {
            worker.up = up;
            log::warn!("worker {} marked {}", worker.config.id, if up { "up" } else { "down" });
            self.bump();
        }
    }

    fn clear_into(
        log: &mut ChangeLog,
        version: u64,
        worker: &mut WorkerState,
        rank: usize,
        changes: &mut Vec<Change>,
    ) -> bool {
        let had = worker.cache.block_count();
        if worker.cache.clear_rank(rank, changes) {
            changes.clear();
            if had > 0 {
                log.clear(version, worker.key);
                return true;
            }
            false
        } else {
            Self::log_changes(log, version, worker.key, changes)
        }
    }

    /// Logs `changes` (drained) as runs of one kind.
    fn log_changes(log: &mut ChangeLog, version: u64, key: WorkerKey, changes: &mut Vec<Change>) -> bool {
        if changes.is_empty() {
            return false;
        }
        let flush = |log: &mut ChangeLog, kind: &Change, run: Vec<FeedBlock>| match kind {
            Change::Store(_) => log.store(version, key, run),
            Change::StoreOffloaded(_) => log.store_offloaded(version, key, run),
            Change::Remove(_) => log.remove(version, key, run),
        };
        let mut run: Vec<FeedBlock> = Vec::new();
        let mut kind = changes[0];
        for c in changes.drain(..) {
            let b = match c {
                Change::Store(b) | Change::StoreOffloaded(b) | Change::Remove(b) => b,
            };
            if std::mem::discriminant(&c) != std::mem::discriminant(&kind) {
                flush(log, &kind, std::mem::take(&mut run));
                kind = c;
            }
            run.push(b);
        }
        flush(log, &kind, run);
        true
    }

    fn bump(&mut self) {
        self.version += 1;
        self.version_tx.send_replace(self.version);
    }

    fn feed_workers(&self) -> Vec<FeedWorker> {
        self.workers.iter().map(|w| FeedWorker { id: w.config.id.clone(), role: w.config.role, up: w.up }).collect()
    }

    /// Whether a poll at this position would be answered with changes after `since` (rule 3
    /// of `docs/feed-protocol.md`, "Response"): what `linger_ms` may hold back.
    /// Snapshots and their pages are never held.
    pub fn delta_ready(&self, epoch: u64, since: u64, cursor: u64) -> bool {
        !self.needs_snapshot(epoch, since) && cursor == 0 && since < self.version
    }

    /// Rule 1 of `docs/feed-protocol.md`, "Response", as far as the position tells: the
    /// client's copy is from another epoch, is empty, or is ahead of the server.
    fn needs_snapshot(&self, epoch: u64, since: u64) -> bool {
        epoch != self.epoch || epoch == 0 || since > self.version
    }

    /// Answers a poll (`docs/feed-protocol.md`, "Response"). `tiers`: the client takes
    /// `STORE_OFFLOADED` ops.
    pub fn feed(&mut self, epoch: u64, since: u64, cursor: u64, tiers: bool, may_wait: bool) -> FeedReply {
        self.stats.feed_lag_versions = self.version.saturating_sub(since);
        let fresh = self.needs_snapshot(epoch, since);
        if !fresh && cursor != 0 {
            if let Some(s) = self.snapshot.as_ref().filter(|s| s.version == since && s.tiers == tiers) {
                if let Some(page) = usize::try_from(cursor).ok().and_then(|c| s.pages.get(c)) {
                    self.stats.feed_frames[2] += 1;
                    return FeedReply::Frame(page.clone());
                }
            }
        }
        if !fresh && cursor == 0 {
            if since == self.version && may_wait {
                return FeedReply::Wait;
            }
            let position: std::collections::HashMap<WorkerKey, u32> =
                self.workers.iter().enumerate().map(|(i, w)| (w.key, i as u32)).collect();
            if let Some(ops) = self.log.delta(since, tiers, |key| position.get(&key).copied()) {
                self.stats.feed_frames[0] += 1;
                let frame = Frame {
                    kind: FrameKind::Delta,
                    epoch: self.epoch,
                    from_version: since,
                    to_version: self.version,
                    next_cursor: 0,
                    block_size: self.block_size,
                    workers: self.feed_workers(),
                    ops,
                };
                return FeedReply::Frame(Bytes::from(frame.encode()));
            }
        }
        self.stats.feed_frames[1] += 1;
        if self.snapshot.as_ref().is_none_or(|s| s.version != self.version || s.tiers != tiers) {
            self.snapshot = Some(Snapshot { version: self.version, tiers, pages: self.snapshot_pages(tiers) });
        }
        match self.snapshot.as_ref().and_then(|s| s.pages.first()) {
            Some(p) => FeedReply::Frame(p.clone()),
            None => FeedReply::Frame(Bytes::new()), // unreachable: pages is never empty
        }
    }

    /// Every block of every worker at the current version, cut into pages.
    fn snapshot_pages(&self, tiers: bool) -> Vec<Bytes> {
        let mut pages: Vec<Vec<Op>> = vec![Vec::new()];
        let mut in_page = 0usize;
        // Per worker, a run of stores, then (for clients that take tiers) one of blocks held
        // only offloaded.
        let classes: &[Option<bool>] = if tiers { &[Some(false), Some(true)] } else { &[None] };
        for (i, w) in self.workers.iter().enumerate() {
            for &class in classes {
                let make = |blocks| match class {
                    Some(true) => Op::StoreOffloaded { worker: i as u32, blocks },
                    _ => Op::Store { worker: i as u32, blocks },
                };
                let mut blocks = Vec::new();
                for (b, offloaded) in w.cache.feed_blocks() {
                    if class.is_some_and(|c| c != offloaded) {
                        continue;
                    }
                    if in_page == self.page_blocks {
                        if let (Some(p), false) = (pages.last_mut(), blocks.is_empty()) {
                            p.push(make(std::mem::take(&mut blocks)));
                        }
                        pages.push(Vec::new());
                        in_page = 0;
                    }
                    blocks.push(b);
                    in_page += 1;
                }
                if let (Some(p), false) = (pages.last_mut(), blocks.is_empty()) {
                    p.push(make(blocks));
                }
            }
        }
        let workers = self.feed_workers();
        let n = pages.len();
        pages
            .into_iter()
            .enumerate()
            .map(|(i, ops)| {
                let frame = Frame {
                    kind: if i == 0 { FrameKind::SnapshotStart } else { FrameKind::SnapshotMore },
                    epoch: self.epoch,
                    from_version: 0,
                    to_version: self.version,
                    next_cursor: if i + 1 < n { i as u64 + 1 } else { 0 },
                    block_size: self.block_size,
                    workers: workers.clone(),
                    ops,
                };
                Bytes::from(frame.encode())
            })
            .collect()
    }

    /// `{"worker_id":…,"block_count":N}` for the admin API, in the specification's key order.
    pub fn cache_view(&self, id: &str) -> Option<String> {
        let w = self.workers.iter().find(|w| w.config.id == id)?;
        let id = serde_json::Value::from(w.config.id.as_str());
        Some(format!("{{\"worker_id\":{id},\"block_count\":{}}}", w.cache.block_count()))
    }

    /// Every engine block hash the worker holds, per DP rank: to compare the index with an
    /// engine's own cache (the soak does). Operators only: large, never routed by Envoy.
    pub fn engine_blocks(&self, id: &str) -> Option<serde_json::Value> {
        let w = self.workers.iter().find(|w| w.config.id == id)?;
        Some(serde_json::json!({"worker_id": w.config.id, "engine_blocks": w.cache.engine_blocks()}))
    }

    pub fn workers_json(&self, now: Instant) -> serde_json::Value {
        let workers: Vec<serde_json::Value> = self
            .workers
            .iter()
            .map(|w| {
                let ranks: Vec<serde_json::Value> = w
                    .ranks
                    .iter()
                    .map(|r| {
                        serde_json::json!({
                            "last_seq": r.last_seq,
                            "lag_ms": r.lag_ms.map(|l| (l * 1000.0).round() / 1000.0),
                            "silent_ms": r.last_event_at.map(|t| now.saturating_duration_since(t).as_millis() as u64),
                        })
                    })
                    .collect();
                let last_seq = w.ranks.iter().filter_map(|r| r.last_seq).max();
                let lag_ms = w
                    .ranks
                    .iter()
                    .filter_map(|r| r.lag_ms)
                    .fold(None, |m: Option<f64>, l| Some(m.map_or(l, |m| m.max(l))));
                serde_json::json!({
                    "id": w.config.id,
                    "role": role_name(w.config.role),
                    "state": if w.up { "up" } else { "down" },
                    "blocks": w.cache.block_count(),
                    "offloaded_blocks": w.cache.offloaded_count(),
                    "last_seq": last_seq,
                    "lag_ms": lag_ms.map(|l| (l * 1000.0).round() / 1000.0),
                    "events": w.config.events,
                    "replay": w.config.replay,
                    "dp_ranks": ranks,
                })
            })
            .collect();
        serde_json::json!({"epoch": self.epoch.to_string(), "version": self.version, "block_size": self.block_size, "workers": workers})
    }
}

pub fn role_name(r: Role) -> &'static str {
    match r {
        Role::Both => "both",
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Cli;
    use crate::events::{BlockRemoved, BlockStored, Medium};

    fn fleet(page_blocks: usize) -> Fleet {
        let text = format!(
            "snapshot_page_blocks = {page_blocks}\n[[workers]]\nid=\"127.0.0.1:8101\"\nevents=\"tcp://127.0.0.1:5557\"\n\
             [[workers]]\nid=\"127.0.0.1:8102\"\nevents=\"tcp://127.0.0.1:5567\""
        );
        Fleet::new(&Config::from_toml(&text, &Cli::default()).unwrap(), 42)
    }

    fn stored(hashes: &[u64], parent: Option<u64>, first_token: u32) -> Event {
        let n = hashes.len() as u32 * 16;
        Event::Stored(BlockStored::on_gpu(hashes, parent, (first_token..first_token + n).collect(), 16))
    }

    fn batch(events: Vec<Event>) -> Batch {
        Batch { events, tail: BatchTail { ts: 0.0, dp_rank: None, unknown: 0, first_unknown: None } }
    }

    fn frame(r: FeedReply) -> Frame {
        match r {
            FeedReply::Frame(b) => Frame::decode(&b).unwrap(),
            FeedReply::Wait => panic!("expected a frame"),
        }
    }

    #[test]
    fn first_poll_is_a_snapshot_then_deltas_then_wait() {
        let mut f = fleet(1000);
        let now = Instant::now();
        f.apply_batch(0, 0, 0, &batch(vec![stored(&[1, 2], None, 0)]), now, 0.0);
        let s = frame(f.feed(0, 0, 0, true, true));
        assert_eq!((s.kind, s.to_version, s.epoch), (FrameKind::SnapshotStart, 1, 42));
        assert_eq!(s.ops.len(), 1);
        assert!(matches!(f.feed(42, 1, 0, true, true), FeedReply::Wait));
        let empty = frame(f.feed(42, 1, 0, true, false));
        assert_eq!((empty.kind, empty.from_version, empty.to_version, empty.ops.len()), (FrameKind::Delta, 1, 1, 0));
        f.apply_batch(
            1,
            0,
            0,
            &batch(vec![
                stored(&[9], None, 100),
                Event::Removed(BlockRemoved { block_hashes: vec![2], medium: Medium::Gpu, group_idx: 0 }),
            ]),
            now,
            0.0,
        );
        // the removal of engine hash 2 on worker 1 is not held there: no change, counted
        let d = frame(f.feed(42, 1, 0, true, true));
        assert_eq!((d.from_version, d.to_version), (1, 2));
        assert!(matches!(&d.ops[..], [Op::Store { worker: 1, blocks }] if blocks.len() == 1));
        assert_eq!(f.stats.events[1][Outcome::ALL.iter().position(|o| *o == Outcome::NotHeld).unwrap()], 1);
        // a stale epoch or a version from the future gets a snapshot
        assert_eq!(frame(f.feed(41, 1, 0, true, true)).kind, FrameKind::SnapshotStart);
        assert_eq!(frame(f.feed(42, 99, 0, true, true)).kind, FrameKind::SnapshotStart);
    }

    #[test]
    fn snapshots_page_and_later_pages_show_the_same_version() {
        let mut f = fleet(3);
        let now = Instant::now();
        f.apply_batch(0, 0, 0, &batch(vec![stored(&[1, 2, 3, 4], None, 0)]), now, 0.0);
        f.apply_batch(1, 0, 0, &batch(vec![stored(&[5, 6], None, 500)]), now, 0.0);
        let p0 = frame(f.feed(0, 0, 0, true, true));
        assert_eq!((p0.kind, p0.to_version, p0.next_cursor), (FrameKind::SnapshotStart, 2, 1));
        // a change between pages does not leak into the snapshot's later pages
        f.apply_batch(1, 0, 1, &batch(vec![stored(&[7], Some(6), 532)]), now, 0.0);
        let p1 = frame(f.feed(p0.epoch, 2, 1, true, true));
        assert_eq!((p1.kind, p1.to_version, p1.next_cursor), (FrameKind::SnapshotMore, 2, 0));
        let total: usize = [&p0, &p1]
            .iter()
            .flat_map(|p| p.ops.iter())
            .map(|o| if let Op::Store { blocks, .. } = o { blocks.len() } else { 0 })
            .sum();
        assert_eq!(total, 6);
        // then the delta since the snapshot has the new block
        let d = frame(f.feed(p0.epoch, 2, 0, true, true));
        assert_eq!((d.kind, d.to_version), (FrameKind::Delta, 3));
    }

    #[test]
    fn tiers_reach_only_clients_that_ask() {
        let mut f = fleet(1000);
        let now = Instant::now();
        let Event::Stored(mut s) = stored(&[1, 2], None, 0) else { unreachable!() };
        s.medium = Medium::Offloaded;
        f.apply_batch(0, 0, 0, &batch(vec![stored(&[1, 2], None, 0), Event::Stored(s)]), now, 0.0);
        f.apply_batch(
            0,
            0,
            1,
            &batch(vec![Event::Removed(BlockRemoved { block_hashes: vec![2], medium: Medium::Gpu, group_idx: 0 })]),
            now,
            0.0,
        );
        // Block 1 on the GPU; block 2 only in CPU memory now.
        let snap = frame(f.feed(0, 0, 0, true, true));
        assert!(matches!(&snap.ops[..], [Op::Store { blocks: g, .. }, Op::StoreOffloaded { blocks: o, .. }]
            if g.len() == 1 && o.len() == 1));
        let old_client = frame(f.feed(0, 0, 0, false, true));
        assert!(matches!(&old_client.ops[..], [Op::Store { blocks, .. }] if blocks.len() == 2));
        let d = frame(f.feed(42, 1, 0, true, true));
        assert!(matches!(&d.ops[..], [Op::StoreOffloaded { blocks, .. }] if blocks.len() == 1));
        let d = frame(f.feed(42, 1, 0, false, true));
        assert!(matches!(&d.ops[..], [Op::Store { blocks, .. }] if blocks.len() == 1));
    }

    /// vLLM's positional batch `[0, [["BlockStored", hashes, parent, tokens, 16]]]`.
    fn payload(hashes: &[u64], parent: Option<u64>, first_token: u16) -> Vec<u8> {
        let mut p = vec![0x92, 0x00, 0x91, 0x95, 0xab];
        p.extend_from_slice(b"BlockStored");
        p.push(0x90 | hashes.len() as u8);
        for h in hashes {
            p.push(0xcf);
            p.extend_from_slice(&h.to_be_bytes());
        }
        match parent {
            Some(h) => {
                p.push(0xcf);
                p.extend_from_slice(&h.to_be_bytes());
            }
            None => p.push(0xc0),
        }
        let n = hashes.len() as u16 * 16;
        p.push(0xdc);
        p.extend_from_slice(&n.to_be_bytes());
        for t in first_token..first_token + n {
            p.push(0xcd);
            p.extend_from_slice(&t.to_be_bytes());
        }
        p.push(0x10);
        p
    }

    fn held(f: &Fleet, w: usize) -> Vec<(u64, u64, bool)> {
        let mut v: Vec<_> = f.workers[w].cache.feed_blocks().map(|(b, off)| (b.hash, b.anchor, off)).collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn a_checkpoint_restores_each_worker_when_it_joins() {
        let mut f = fleet(1000);
        let now = Instant::now();
        let (p0, p1) = (payload(&[1, 2], None, 0), payload(&[5], None, 500));
        f.apply_payload(0, 0, 3, &p0, now, 0.0).unwrap();
        f.apply_payload(1, 0, 8, &p1, now, 0.0).unwrap();
        let file = f.checkpoint();

        let mut g = fleet(1000);
        assert_eq!(g.load_checkpoint(&file), Ok(2));
        let v = g.version();
        assert_eq!(g.restore_worker(0), [Some(ResumePoint { seq: 3, digest: checkpoint::payload_digest(&p0) })]);
        assert_eq!(held(&g, 0), held(&f, 0));
        assert_eq!(g.stats.workers_restored, 1);
        // The restored blocks reach the feed like any others.
        let d = frame(g.feed(42, v, 0, true, true));
        assert!(matches!(&d.ops[..], [Op::Store { worker: 0, blocks }] if blocks.len() == 2));
        // A record is used once.
        assert!(g.restore_worker(0).is_empty());
        // Worker 1 has not rejoined: its record is carried into the next checkpoint, and
        // restored from that one.
        assert!(g.remove_worker(1));
        let mut h = fleet(1000);
        assert_eq!(h.load_checkpoint(&g.checkpoint()), Ok(2));
        assert_eq!(h.restore_worker(1), [Some(ResumePoint { seq: 8, digest: checkpoint::payload_digest(&p1) })]);
        assert_eq!(held(&h, 1), held(&f, 1));
        // A rank with no whole batch applied has no resume point, and starts empty.
        let mut partial = fleet(1000);
        partial.apply_batch(0, 0, 0, &batch(vec![stored(&[1, 2], None, 0)]), now, 0.0); // no payload digest
        let mut e = fleet(1000);
        e.load_checkpoint(&partial.checkpoint()).unwrap();
        assert_eq!(e.restore_worker(0), [None]);
        assert_eq!(e.workers[0].cache.block_count(), 0);

        // A worker that now has another number of ranks starts empty (counted); a file
        // for another block size is refused whole.
        let text = "[[workers]]\nid=\"127.0.0.1:8101\"\nevents=\"tcp://127.0.0.1:5557\"\ndp_ranks=2";
        let mut two = Fleet::new(&Config::from_toml(text, &Cli::default()).unwrap(), 42);
        two.load_checkpoint(&file).unwrap();
        assert!(two.restore_worker(0).is_empty());
        assert_eq!((two.workers[0].cache.block_count(), two.stats.checkpoint_errors), (0, 1));
        let text = format!("block_size = 32\n{text}");
        let mut other = Fleet::new(&Config::from_toml(&text, &Cli::default()).unwrap(), 42);
        assert!(other.load_checkpoint(&file).unwrap_err().contains("block size"));
    }

    #[test]
    fn a_payload_that_breaks_partway_is_an_error_after_its_first_events_are_logged() {
        let mut f = fleet(1000);
        let now = Instant::now();
        // [0, [["BlockStored", [1], nil, [0..16], 16], "not an event"]]
        let mut p = vec![0x92, 0x00, 0x92, 0x95, 0xab];
        p.extend_from_slice(b"BlockStored");
        p.extend_from_slice(&[0x91, 0x01, 0xc0, 0xdc, 0x00, 0x10]);
        p.extend(0u8..16);
        p.push(0x10);
        p.extend_from_slice(&[0xa3, b'b', b'a', b'd']);
        assert!(f.apply_payload(0, 0, 0, &p, now, 0.0).is_err());
        // What the first event did is logged (the cache and the feed agree) but the batch
        // is not counted; the caller then clears the rank.
        assert_eq!((f.workers[0].cache.block_count(), f.version(), f.stats.batches), (1, 1, 0));
        let d = frame(f.feed(42, 0, 0, true, true));
        assert!(matches!(&d.ops[..], [Op::Store { worker: 0, blocks }] if blocks.len() == 1));
        f.reset_rank(0, 0, ResetReason::UndecodableBatch);
        assert_eq!(frame(f.feed(42, 1, 0, true, true)).ops, vec![Op::Clear { worker: 0 }]);
        // A good payload is applied and counted.
        p.truncate(p.len() - 4);
        p[2] = 0x91;
        f.apply_payload(1, 0, 0, &p, now, 0.0).unwrap();
        assert_eq!((f.workers[1].cache.block_count(), f.stats.batches), (1, 1));
        assert_eq!(f.stats.batches_over_cap, 0);
        // A batch over a cap is refused the same way, and counted as such.
        let n = crate::events::MAX_EVENTS_PER_BATCH + 1;
        let mut over = vec![0x92, 0x00, 0xdd];
        over.extend_from_slice(&(n as u32).to_be_bytes());
        over.resize(over.len() + n, 0xc0);
        assert!(f.apply_payload(1, 0, 1, &over, now, 0.0).unwrap_err().over_cap);
        assert_eq!(f.stats.batches_over_cap, 1);
    }

    #[test]
    fn clearing_and_marking_down_are_versions() {
        let mut f = fleet(1000);
        let now = Instant::now();
        f.apply_batch(0, 0, 0, &batch(vec![stored(&[1], None, 0)]), now, 0.0);
        f.reset_rank(0, 0, ResetReason::PublisherRestart);
        assert_eq!(f.version(), 2);
        let d = frame(f.feed(42, 1, 0, true, true));
        assert_eq!(d.ops, vec![Op::Clear { worker: 0 }]);
        f.set_up(1, false);
        let d = frame(f.feed(42, 2, 0, true, true));
        assert!(d.ops.is_empty() && !d.workers[1].up);
        // clearing an empty worker is not a change
        f.reset_rank(0, 0, ResetReason::GapNotReplayed);
        assert_eq!(f.version(), 3);
    }

    fn worker_config(id: &str) -> WorkerConfig {
        crate::config::worker(
            "w",
            crate::config::FileWorker { id: id.into(), events: "tcp://127.0.0.1:9".into(), ..Default::default() },
        )
        .unwrap()
    }

    #[test]
    fn workers_join_and_leave_and_deltas_follow_by_key() {
        let mut f = fleet(1000);
        let now = Instant::now();
        f.apply_batch(0, 0, 0, &batch(vec![stored(&[1], None, 0)]), now, 0.0);
        f.apply_batch(1, 0, 0, &batch(vec![stored(&[2], None, 16)]), now, 0.0);
        let v = f.version();
        // Worker 0 leaves: worker 1 moves to position 0, and its later changes say so.
        assert!(f.remove_worker(0));
        assert!(!f.remove_worker(0));
        f.apply_batch(1, 0, 1, &batch(vec![stored(&[3], Some(2), 32)]), now, 0.0);
        // Events for the gone worker change nothing.
        f.apply_batch(0, 0, 1, &batch(vec![stored(&[9], None, 48)]), now, 0.0);
        let d = frame(f.feed(42, v, 0, true, true));
        assert_eq!(d.workers.iter().map(|w| w.id.as_str()).collect::<Vec<_>>(), ["127.0.0.1:8102"]);
        assert!(matches!(&d.ops[..], [Op::Store { worker: 0, blocks }] if blocks.len() == 1));
        // A client from before worker 1's first batch still gets it, at its new position;
        // worker 0's stores are skipped (the frame's list no longer has it).
        let d = frame(f.feed(42, 0, 0, true, true));
        assert!(matches!(&d.ops[..], [Op::Store { worker: 0, blocks }] if blocks.len() == 2));
        // A worker that joins starts with a CLEAR (an earlier worker of its id may have
        // held blocks a client never saw it drop) and gets a new key.
        let v = f.version();
        let key = f.add_worker(worker_config("127.0.0.1:8101")).unwrap();
        assert_eq!(key, 2);
        assert!(f.add_worker(worker_config("127.0.0.1:8101")).unwrap_err().contains("already"));
        let d = frame(f.feed(42, v, 0, true, true));
        assert_eq!(d.workers.len(), 2);
        assert_eq!(d.ops, vec![Op::Clear { worker: 1 }]);
        f.apply_batch(key, 0, 0, &batch(vec![stored(&[5], None, 64)]), now, 0.0);
        let s = frame(f.feed(0, 0, 0, true, true));
        assert!(
            matches!(&s.ops[..], [Op::Store { worker: 0, .. }, Op::Store { worker: 1, blocks }] if blocks.len() == 1)
        );
        assert_eq!((f.stats.workers_added, f.stats.workers_removed), (1, 1));
    }

    #[test]
    fn the_fleet_refuses_workers_beyond_its_limit() {
        let mut f = fleet(1000);
        for i in 2..crate::config::MAX_WORKERS {
            f.add_worker(worker_config(&format!("10.0.{}.{}:8000", i / 250, i % 250))).unwrap();
        }
        assert!(f.add_worker(worker_config("10.9.9.9:8000")).unwrap_err().contains("full"));
    }
}
