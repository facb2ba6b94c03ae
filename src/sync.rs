//! The sync service's policy, host-independent: long-poll the sidecar's feed and write the
//! index into shared data. A host (the proxy-wasm bootstrap singleton, a native bootstrap
//! extension) calls [`SyncService::on_tick`] every [`TICK`] and hands it each poll's answer.
//!
//! One poll is in flight at a time. A frame is applied to the [`SyncIndex`], then every
//! bucket it changed is rewritten (compare-and-swap, keeping the filters' in-flight part)
//! and then the worker table. The next poll goes out at once; after a failure, after
//! `retry_interval_ms`, backing off. With no good answer for `stale_after_ms` the table
//! says the index is not live and the filters route by load.

use crate::cachekey::{key_bucket_key, ANCHORS_KEY, KEYLOAD_KEY, KEY_BUCKETS};
use crate::config::{ConfigError, SyncConfig};
use crate::feed::{poll_path, Frame, FrameKind};
use crate::host::{Counter, FeedClient, Gauge, Host, SidecarCall};
use crate::index::{publish, SyncIndex};
use crate::layout::{bucket_key, prefill_epoch, LoadVector, WorkerTable, LOAD_KEY, TABLE_KEY};
use crate::peerload::{Answer, PeerLoad, Report, PEERLOAD_KEY};
use crate::store::SharedStore;
use std::time::Duration;

/// The host's tick period. Also the pace of a publish spread over several calls (one
/// slice per tick): measured, a 5 ms pace finished a 6.4M-entry resync 0.5 s sooner but
/// kept admin reads waiting 0.4 s, against 0.1 s at this one (docs/benchmarks.md).
pub const TICK: Duration = Duration::from_millis(100);

/// The per-worker load gauges ([`crate::host::Stats::define_worker_gauge`]).
pub const ACTIVE_BLOCKS_GAUGE: &str = "kvroute.active_blocks";
pub const PREFILL_BLOCKS_GAUGE: &str = "kvroute.prefill_blocks";
/// The per-worker gauge of blocks the index says each worker holds in GPU memory.
pub const CACHED_BLOCKS_GAUGE: &str = "kvroute.cached_blocks";
/// The per-worker gauge of the KV blocks each engine holds at most, as learned from its
/// evictions (0: not learned yet); the memory limit's capacity at its default.
pub const KV_CAPACITY_GAUGE: &str = "kvroute.kv_capacity_blocks";
/// The per-worker gauges of the other gateways' load, as their last answer gave it.
pub const PEER_ACTIVE_BLOCKS_GAUGE: &str = "kvroute.peer_active_blocks";
pub const PEER_PREFILL_BLOCKS_GAUGE: &str = "kvroute.peer_prefill_blocks";
/// Every per-worker gauge (a host that declares its stats up front declares these).
pub const WORKER_GAUGES: [&str; 6] = [
    ACTIVE_BLOCKS_GAUGE,
    PREFILL_BLOCKS_GAUGE,
    CACHED_BLOCKS_GAUGE,
    KV_CAPACITY_GAUGE,
    PEER_ACTIVE_BLOCKS_GAUGE,
    PEER_PREFILL_BLOCKS_GAUGE,
];

/// A poll's answer may take this long beyond the long poll's own timeout.
const POLL_GRACE_MS: u64 = 5_000;
/// A load report's answer may take this long.
const LOAD_CALL_TIMEOUT_MS: u64 = 1_000;
/// Largest load answer read (every worker of a full table, with long ids, fits).
const MAX_LOAD_ANSWER_BYTES: usize = 1 << 20;

struct Metrics {
    polls_ok: Counter,
    polls_failed: Counter,
    frames_bad: Counter,
    resyncs: Counter,
    blocks_stored: Counter,
    blocks_removed: Counter,
    bucket_writes: Counter,
    write_failures: Counter,
    live: Gauge,
    version: Gauge,
    entries: Gauge,
    load_reports_ok: Counter,
    load_reports_failed: Counter,
    peer_gateways: Gauge,
}

impl Metrics {
    fn define(stats: &dyn crate::host::Stats) -> Metrics {
        let counter = |name: &str| Counter::define(stats, name);
        let gauge = |name: &str| Gauge::define(stats, name);
        Metrics {
            polls_ok: counter("kvroute_sync.polls_ok"),
            polls_failed: counter("kvroute_sync.polls_failed"),
            frames_bad: counter("kvroute_sync.frames_bad"),
            resyncs: counter("kvroute_sync.resyncs"),
            blocks_stored: counter("kvroute_sync.blocks_stored"),
            blocks_removed: counter("kvroute_sync.blocks_removed"),
            bucket_writes: counter("kvroute_sync.bucket_writes"),
            write_failures: counter("kvroute_sync.write_failures"),
            live: gauge("kvroute_sync.index_live"),
            version: gauge("kvroute_sync.version"),
            entries: gauge("kvroute_sync.index_entries"),
            load_reports_ok: counter("kvroute_sync.load_reports_ok"),
            load_reports_failed: counter("kvroute_sync.load_reports_failed"),
            peer_gateways: gauge("kvroute_sync.peer_gateways"),
        }
    }
}

/// A worker's gauges: `kvroute.active_blocks.<worker>`, `kvroute.prefill_blocks.<worker>`,
/// `kvroute.cached_blocks.<worker>` and `kvroute.kv_capacity_blocks.<worker>`.
#[derive(Clone, Copy)]
struct WorkerGauges {
    active: Gauge,
    prefill: Gauge,
    cached: Gauge,
    capacity: Gauge,
    peer_active: Gauge,
    peer_prefill: Gauge,
}

/// The load shared with other gateways ([`crate::peerload`]): this gateway's reports and
/// the answers.
struct LoadShare {
    gateway: String,
    /// The report in flight: its token and when to stop waiting for it.
    in_flight: Option<(u64, u64)>,
    next_ms: u64,
    last_ok_ms: u64,
    failures: u32,
    /// The other gateways' load as last written.
    peers: PeerLoad,
}

pub struct SyncService<H: Host + FeedClient> {
    host: H,
    cfg: SyncConfig,
    index: SyncIndex,
    metrics: Metrics,
    /// By slot.
    worker_gauges: Vec<WorkerGauges>,
    /// The token of the poll in flight, and when to stop waiting for its answer.
    in_flight: Option<(u64, u64)>,
    next_poll_ms: u64,
    last_ok_ms: u64,
    consecutive_failures: u32,
    load_share: LoadShare,
}

impl<H: Host + FeedClient> SyncService<H> {
    /// Validates the configuration (JSON; a bad one refuses to load) and prepares shared
    /// data. The first poll goes out on the first tick. `seed`: entropy for this gateway's
    /// name in load reports when the configuration gives none.
    pub fn configure(host: H, config: &[u8], seed: u64) -> Result<SyncService<H>, ConfigError> {
        let cfg = SyncConfig::from_json(config)?;
        let store = host.store();
        let mut index = SyncIndex::new(cfg.n_buckets);
        // Shared data outlives this VM: keep the slots a previous VM assigned, since
        // in-flight entries name them.
        if let Ok((Some(v), _)) = store.get(TABLE_KEY) {
            if let Ok(t) = WorkerTable::decode(&v) {
                index.restore_slots(&t);
            }
        }
        // Create every key now, so later compare-and-swap writes always have a token to
        // compare (the host treats a missing key's CAS as unconditional).
        let keys = (0..cfg.n_buckets).map(bucket_key).chain([LOAD_KEY, KEYLOAD_KEY, ANCHORS_KEY].map(String::from));
        for key in keys.chain((0..KEY_BUCKETS).map(key_bucket_key)) {
            if matches!(store.get(&key), Ok((None, _))) {
                let _ = store.set(&key, &[], None);
            }
        }
        log::info!(
            "kvroute-sync: polling cluster {} ({}{}), {} buckets",
            cfg.feed_cluster,
            cfg.feed_authority,
            cfg.feed_path,
            cfg.n_buckets
        );
        // Created empty, or emptied: a previous VM's peer load is not this one's to vouch for.
        let _ = store.set(PEERLOAD_KEY, &[], None);
        let gateway = cfg
            .gateway_id
            .clone()
            .unwrap_or_else(|| format!("gw-{:016x}", xxhash_rust::xxh3::xxh3_64(&seed.to_le_bytes())));
        Ok(SyncService {
            load_share: LoadShare {
                gateway,
                in_flight: None,
                next_ms: 0,
                last_ok_ms: 0,
                failures: 0,
                peers: PeerLoad::default(),
            },
            metrics: Metrics::define(&host),
            last_ok_ms: host.now_ms(),
            host,
            cfg,
            index,
            worker_gauges: Vec::new(),
            in_flight: None,
            next_poll_ms: 0,
            consecutive_failures: 0,
        })
    }

    pub fn host(&self) -> &H {
        &self.host
    }

    pub fn index(&self) -> &SyncIndex {
        &self.index
    }

    pub fn on_tick(&mut self) {
        let now = self.host.now_ms();
        if self.index.is_live() && now.saturating_sub(self.last_ok_ms) > self.cfg.stale_after_ms {
            log::warn!(
                "kvroute-sync: no feed answer for {} ms; routing by load until the sidecar is back",
                now - self.last_ok_ms
            );
            self.index.set_live(false);
            if self.index.snapshot_in_progress() {
                // Cut off mid-snapshot: start it over when the sidecar is back, and let
                // publish write the stale flag now (it holds back a snapshot in progress).
                self.index.request_snapshot();
            }
        }
        if self.index.has_unpublished() {
            // The stale flag just set, what the last publish's byte budget left over, or
            // a failed write's retry.
            self.publish();
        }
        if let Some((_, deadline)) = self.in_flight.filter(|(_, deadline)| now > *deadline) {
            // The host answers every poll by its timeout; one that never came (lost in the
            // host) must not stop the feed for good.
            log::warn!("kvroute-sync: no answer to the poll by {deadline} ms; polling again");
            self.in_flight = None;
            self.failed();
        }
        if self.in_flight.is_none() && now >= self.next_poll_ms {
            self.poll();
        }
        // Read once a tick: for the gauges, and for the report when one is due.
        let load = match self.host.store().get(LOAD_KEY) {
            Ok((Some(v), _)) => LoadVector::decode(&v),
            // No value yet (no request routed): every worker's load is 0.
            _ => LoadVector::default(),
        };
        self.share_load(now, &load);
        self.publish_load(&load, now);
    }

    /// This gateway's name in its load reports.
    pub fn gateway_id(&self) -> &str {
        &self.load_share.gateway
    }

    /// Sends this gateway's load to the sidecar when the interval has passed, and stops
    /// counting the other gateways' when no answer came for ten intervals (at least 1 s).
    fn share_load(&mut self, now: u64, load: &LoadVector) {
        let interval = self.cfg.load_report_interval_ms;
        if interval == 0 {
            return;
        }
        if let Some((_, deadline)) = self.load_share.in_flight.filter(|(_, deadline)| now > *deadline) {
            log::debug!("kvroute-sync: no answer to the load report by {deadline} ms");
            self.load_share.in_flight = None;
            self.load_failed();
        }
        let stale_after = (10 * interval).max(1_000);
        if !self.load_share.peers.0.is_empty() && now.saturating_sub(self.load_share.last_ok_ms) > stale_after {
            log::warn!("kvroute-sync: no load answer for {stale_after} ms; routing on this gateway's load alone");
            self.set_peers(PeerLoad::default(), 0);
        }
        if self.load_share.in_flight.is_some() || now < self.load_share.next_ms {
            return;
        }
        self.load_share.next_ms = now + interval;
        let body = Report::of(&self.load_share.gateway, self.index.slots(), load, prefill_epoch(now)).encode();
        let call = SidecarCall {
            cluster: &self.cfg.feed_cluster,
            authority: &self.cfg.feed_authority,
            method: "POST",
            path: &self.cfg.load_path,
            accept: "application/json",
            body: Some(&body),
            timeout: Duration::from_millis(LOAD_CALL_TIMEOUT_MS),
        };
        match self.host.dispatch(&call) {
            Ok(token) => self.load_share.in_flight = Some((token, now + LOAD_CALL_TIMEOUT_MS + POLL_GRACE_MS)),
            Err(e) => {
                log::debug!("kvroute-sync: cannot send the load report: {e}");
                self.load_failed();
            }
        }
    }

    /// A failed load report: counted, logged at powers of two (a sidecar without the load
    /// endpoint fails every one), and the next one waits up to 8 intervals.
    fn load_failed(&mut self) {
        self.metrics.load_reports_failed.add(&self.host, 1);
        let share = &mut self.load_share;
        share.failures = share.failures.saturating_add(1);
        if share.failures.is_power_of_two() {
            log::warn!(
                "kvroute-sync: load report failed ({} in a row); other gateways' load not known",
                share.failures
            );
        }
        let factor = 1u64 << share.failures.min(3);
        share.next_ms = self.host.now_ms() + self.cfg.load_report_interval_ms * factor;
    }

    fn on_load_answer(&mut self, status: Option<u32>, body_size: usize, read_body: impl FnOnce() -> Option<Vec<u8>>) {
        self.load_share.in_flight = None;
        if status != Some(200) || body_size > MAX_LOAD_ANSWER_BYTES {
            return self.load_failed();
        }
        let answer = match Answer::decode(&read_body().unwrap_or_default()) {
            Ok(a) => a,
            Err(e) => {
                log::warn!("kvroute-sync: {e}");
                return self.load_failed();
            }
        };
        self.metrics.load_reports_ok.add(&self.host, 1);
        self.load_share.failures = 0;
        self.load_share.last_ok_ms = self.host.now_ms();
        self.set_peers(answer.by_slot(self.index.slots()), answer.gateways);
    }

    /// Writes the other gateways' load, then the table's flag that has the filters read it.
    fn set_peers(&mut self, peers: PeerLoad, gateways: u32) {
        self.metrics.peer_gateways.set(&self.host, u64::from(gateways));
        if peers != self.load_share.peers {
            if let Err(e) = self.host.store().set(PEERLOAD_KEY, &peers.encode(), None) {
                log::warn!("kvroute-sync: cannot write the other gateways' load: {e:?}");
                self.metrics.write_failures.add(&self.host, 1);
                return;
            }
            self.index.set_peer_load(!peers.0.is_empty());
            self.load_share.peers = peers;
            if self.index.has_unpublished() {
                self.publish();
            }
        }
    }

    /// Mirrors the load vector and the index's per-worker counts into per-worker gauges,
    /// for operators and tests.
    fn publish_load(&mut self, load: &LoadVector, now: u64) {
        let epoch = prefill_epoch(now);
        for (slot, w) in self.index.slots().iter().enumerate() {
            if slot == self.worker_gauges.len() {
                let gauge = |name: &str| Gauge::define_for_worker(&self.host, name, &w.id);
                self.worker_gauges.push(WorkerGauges {
                    active: gauge(ACTIVE_BLOCKS_GAUGE),
                    prefill: gauge(PREFILL_BLOCKS_GAUGE),
                    cached: gauge(CACHED_BLOCKS_GAUGE),
                    capacity: gauge(KV_CAPACITY_GAUGE),
                    peer_active: gauge(PEER_ACTIVE_BLOCKS_GAUGE),
                    peer_prefill: gauge(PEER_PREFILL_BLOCKS_GAUGE),
                });
            }
            let g = self.worker_gauges[slot];
            g.active.set(&self.host, u64::from(load.get(slot)));
            g.prefill.set(&self.host, u64::from(load.pending_prefill(slot, epoch)));
            g.cached.set(&self.host, u64::from(self.index.cached_blocks().get(slot).copied().unwrap_or(0)));
            g.capacity.set(&self.host, u64::from(w.kv_capacity_blocks));
            let peer = self.load_share.peers.get(slot);
            g.peer_active.set(&self.host, u64::from(peer.active));
            g.peer_prefill.set(&self.host, u64::from(peer.prefill));
        }
    }

    fn poll(&mut self) {
        let pos = self.index.poll_position();
        let (timeout, linger) = (self.cfg.poll_timeout_ms, self.cfg.feed_linger_ms);
        let path = poll_path(&self.cfg.feed_path, pos.epoch, pos.since, pos.cursor, timeout, linger);
        let request = SidecarCall {
            cluster: &self.cfg.feed_cluster,
            authority: &self.cfg.feed_authority,
            method: "GET",
            path: &path,
            accept: "application/x-kvroute-feed",
            body: None,
            timeout: Duration::from_millis(self.cfg.poll_timeout_ms + POLL_GRACE_MS),
        };
        match self.host.dispatch(&request) {
            Ok(token) => {
                let deadline = self.host.now_ms() + request.timeout.as_millis() as u64 + POLL_GRACE_MS;
                self.in_flight = Some((token, deadline));
            }
            Err(e) => {
                log::warn!("kvroute-sync: cannot call cluster {}: {e}", self.cfg.feed_cluster);
                self.failed();
            }
        }
    }

    fn failed(&mut self) {
        self.metrics.polls_failed.add(&self.host, 1);
        self.consecutive_failures += 1;
        // Back off up to 8× the retry interval while the sidecar stays away.
        let factor = 1u64 << self.consecutive_failures.min(3);
        self.next_poll_ms = self.host.now_ms() + self.cfg.retry_interval_ms * factor / 2;
    }

    /// The answer to the call with `token` (a poll or a load report): its HTTP status
    /// (`None` if the call failed or had none), its body's size, and how to read the body
    /// (only read when it fits the limit). Answers to other tokens are ignored.
    pub fn on_response(
        &mut self,
        token: u64,
        status: Option<u32>,
        body_size: usize,
        read_body: impl FnOnce() -> Option<Vec<u8>>,
    ) {
        if self.load_share.in_flight.map(|(t, _)| t) == Some(token) {
            return self.on_load_answer(status, body_size, read_body);
        }
        if self.in_flight.map(|(t, _)| t) != Some(token) {
            return;
        }
        self.in_flight = None;
        if status != Some(200) {
            if self.consecutive_failures == 0 {
                log::warn!("kvroute-sync: feed answered {status:?}");
            }
            return self.failed();
        }
        if body_size > self.cfg.max_frame_bytes {
            log::error!("kvroute-sync: feed frame of {body_size} bytes exceeds max_frame_bytes");
            self.metrics.frames_bad.add(&self.host, 1);
            return self.failed();
        }
        let body = read_body().unwrap_or_default();
        let frame = match Frame::decode(&body) {
            Ok(f) => f,
            Err(e) => {
                log::error!("kvroute-sync: {e}; asking for a snapshot");
                self.metrics.frames_bad.add(&self.host, 1);
                self.index.request_snapshot();
                return self.failed();
            }
        };
        let prev_epoch = self.index.epoch();
        match self.index.apply(&frame) {
            Ok(stats) => {
                if frame.kind == FrameKind::SnapshotStart && prev_epoch != 0 {
                    log::info!("kvroute-sync: resynchronised from a snapshot (epoch {prev_epoch} -> {})", frame.epoch);
                    self.metrics.resyncs.add(&self.host, 1);
                }
                self.metrics.blocks_stored.add(&self.host, stats.stored);
                self.metrics.blocks_removed.add(&self.host, stats.removed);
                if stats.workers_rejected > 0 {
                    log::error!("kvroute-sync: {} workers beyond the slot limit ignored", stats.workers_rejected);
                }
            }
            Err(why) => {
                // Counted as a resync when the snapshot it asks for arrives.
                log::warn!("kvroute-sync: frame refused ({why}); asking for a snapshot");
                self.next_poll_ms = 0;
                return;
            }
        }
        self.metrics.polls_ok.add(&self.host, 1);
        if self.consecutive_failures > 0 {
            log::info!("kvroute-sync: feed is back");
        }
        self.consecutive_failures = 0;
        self.last_ok_ms = self.host.now_ms();
        self.index.set_live(true);
        self.publish();
        // Long poll: ask again at once.
        self.poll();
    }

    /// Writes what changed (buckets, then the table) into shared data, as much as one
    /// call's budget allows; `on_tick` calls again while anything is left.
    fn publish(&mut self) {
        let m = &self.metrics;
        m.live.set(&self.host, u64::from(self.index.is_live()));
        let stats = publish(&mut self.index, self.host.store());
        m.bucket_writes.add(&self.host, stats.bucket_writes);
        m.write_failures.add(&self.host, stats.failures);
        m.entries.set(&self.host, self.index.entries());
        if !self.index.snapshot_in_progress() && !self.index.has_unpublished() {
            // The version the filters now route on.
            m.version.set(&self.host, self.index.version());
        }
    }
}

#[cfg(test)]
mod tests;
