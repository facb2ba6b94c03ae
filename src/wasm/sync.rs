//! The sync service: long-polls the sidecar's feed and writes the index into shared data.
//!
//! One poll is in flight at a time. A frame is applied to the [`SyncIndex`], then every
//! bucket it changed is rewritten (compare-and-swap, keeping the filters' in-flight part)
//! and then the worker table. The next poll goes out at once; after a failure, after
//! `retry_interval_ms`. With no good answer for `stale_after_ms` the table says the index
//! is not live and the filters route by load.

use super::host::{self, HostStore, Metric};
use crate::config::SyncConfig;
use crate::feed::{poll_path, Frame, FrameKind};
use crate::index::{publish, SyncIndex};
use crate::layout::{bucket_key, prefill_epoch, LoadVector, WorkerTable, LOAD_KEY, TABLE_KEY};
use crate::store::SharedStore;
use std::time::Duration;

/// Also the pace of a publish spread over several calls (one slice per tick): measured,
/// a 5 ms pace finished a 6.4M-entry resync 0.5 s sooner but kept admin reads waiting
/// 0.4 s, against 0.1 s at this one (docs/benchmarks.md).
const TICK: Duration = Duration::from_millis(100);

struct Metrics {
    polls_ok: Metric,
    polls_failed: Metric,
    frames_bad: Metric,
    resyncs: Metric,
    blocks_stored: Metric,
    blocks_removed: Metric,
    bucket_writes: Metric,
    write_failures: Metric,
    live: Metric,
    version: Metric,
    entries: Metric,
}

impl Metrics {
    fn define() -> Metrics {
        Metrics {
            polls_ok: Metric::counter("kvroute_sync.polls_ok"),
            polls_failed: Metric::counter("kvroute_sync.polls_failed"),
            frames_bad: Metric::counter("kvroute_sync.frames_bad"),
            resyncs: Metric::counter("kvroute_sync.resyncs"),
            blocks_stored: Metric::counter("kvroute_sync.blocks_stored"),
            blocks_removed: Metric::counter("kvroute_sync.blocks_removed"),
            bucket_writes: Metric::counter("kvroute_sync.bucket_writes"),
            write_failures: Metric::counter("kvroute_sync.write_failures"),
            live: Metric::gauge("kvroute_sync.index_live"),
            version: Metric::gauge("kvroute_sync.version"),
            entries: Metric::gauge("kvroute_sync.index_entries"),
        }
    }
}

pub struct SyncRoot {
    cfg: SyncConfig,
    index: SyncIndex,
    metrics: Metrics,
    /// `kvroute.active_blocks.<worker>` and `kvroute.prefill_blocks.<worker>` gauges, by slot.
    load_gauges: Vec<(Metric, Metric)>,
    in_flight: Option<u32>,
    next_poll_ms: u64,
    last_ok_ms: u64,
    consecutive_failures: u32,
}

impl SyncRoot {
    pub fn configure(config: &[u8]) -> Option<SyncRoot> {
        let cfg = match SyncConfig::from_json(config) {
            Ok(c) => c,
            Err(e) => {
                log::error!("kvroute-sync: refusing configuration: {e}");
                return None;
            }
        };
        let mut index = SyncIndex::new(cfg.n_buckets);
        // Shared data outlives this VM: keep the slots a previous VM assigned, since
        // in-flight entries name them.
        if let Ok((Some(v), _)) = HostStore.get(TABLE_KEY) {
            if let Ok(t) = WorkerTable::decode(&v) {
                index.restore_slots(&t);
            }
        }
        // Create every key now, so later compare-and-swap writes always have a token to
        // compare (the host treats a missing key's CAS as unconditional).
        for b in 0..cfg.n_buckets {
            let key = bucket_key(b);
            if matches!(HostStore.get(&key), Ok((None, _))) {
                let _ = HostStore.set(&key, &[], None);
            }
        }
        if matches!(HostStore.get(LOAD_KEY), Ok((None, _))) {
            let _ = HostStore.set(LOAD_KEY, &[], None);
        }
        if proxy_wasm::hostcalls::set_tick_period(TICK).is_err() {
            log::error!("kvroute-sync: cannot set a tick period");
            return None;
        }
        log::info!(
            "kvroute-sync: polling cluster {} ({}{}), {} buckets",
            cfg.feed_cluster,
            cfg.feed_authority,
            cfg.feed_path,
            cfg.n_buckets
        );
        let now = host::now_ms();
        Some(SyncRoot {
            cfg,
            index,
            metrics: Metrics::define(),
            load_gauges: Vec::new(),
            in_flight: None,
            next_poll_ms: 0,
            last_ok_ms: now,
            consecutive_failures: 0,
        })
    }

    pub fn on_tick(&mut self) {
        let now = host::now_ms();
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
        if self.in_flight.is_none() && now >= self.next_poll_ms {
            self.poll();
        }
        self.publish_load();
    }

    /// Mirrors the load vector into per-worker gauges, for operators and tests.
    fn publish_load(&mut self) {
        let Ok((Some(v), _)) = HostStore.get(LOAD_KEY) else { return };
        let load = LoadVector::decode(&v);
        let epoch = prefill_epoch(host::now_ms());
        let table = self.index.table();
        for (slot, w) in table.slots.iter().enumerate() {
            if slot == self.load_gauges.len() {
                // Stat names split on '.', so the id's dots and colon become '_'.
                let name: String = w.id.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
                let gauge = |what: &str| Metric::gauge(&format!("kvroute.{what}.{name}"));
                self.load_gauges.push((gauge("active_blocks"), gauge("prefill_blocks")));
            }
            let (active, prefill) = &self.load_gauges[slot];
            active.set(u64::from(load.get(slot)));
            prefill.set(u64::from(load.pending_prefill(slot, epoch)));
        }
    }

    fn poll(&mut self) {
        let pos = self.index.poll_position();
        let path = poll_path(&self.cfg.feed_path, pos.epoch, pos.since, pos.cursor, self.cfg.poll_timeout_ms);
        let headers = vec![
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", self.cfg.feed_authority.as_str()),
            ("accept", "application/x-kvroute-feed"),
        ];
        let timeout = Duration::from_millis(self.cfg.poll_timeout_ms + 5_000);
        match proxy_wasm::hostcalls::dispatch_http_call(&self.cfg.feed_cluster, headers, None, vec![], timeout) {
            Ok(token) => self.in_flight = Some(token),
            Err(e) => {
                log::warn!("kvroute-sync: cannot call cluster {}: {e:?}", self.cfg.feed_cluster);
                self.failed();
            }
        }
    }

    fn failed(&mut self) {
        self.metrics.polls_failed.inc();
        self.consecutive_failures += 1;
        // Back off up to 8× the retry interval while the sidecar stays away.
        let factor = 1u64 << self.consecutive_failures.min(3);
        self.next_poll_ms = host::now_ms() + self.cfg.retry_interval_ms * factor / 2;
    }

    pub fn on_http_call_response(&mut self, token: u32, _n_headers: usize, body_size: usize, _n_trailers: usize) {
        if self.in_flight != Some(token) {
            return;
        }
        self.in_flight = None;
        let status = host::http_call_status();
        if status != Some(200) {
            if self.consecutive_failures == 0 {
                log::warn!("kvroute-sync: feed answered {status:?}");
            }
            return self.failed();
        }
        if body_size > self.cfg.max_frame_bytes {
            log::error!("kvroute-sync: feed frame of {body_size} bytes exceeds max_frame_bytes");
            self.metrics.frames_bad.inc();
            return self.failed();
        }
        let body = host::http_call_body(body_size).unwrap_or_default();
        let frame = match Frame::decode(&body) {
            Ok(f) => f,
            Err(e) => {
                log::error!("kvroute-sync: {e}; asking for a snapshot");
                self.metrics.frames_bad.inc();
                self.index.request_snapshot();
                return self.failed();
            }
        };
        let prev_epoch = self.index.epoch();
        match self.index.apply(&frame) {
            Ok(stats) => {
                if frame.kind == FrameKind::SnapshotStart && prev_epoch != 0 {
                    log::info!("kvroute-sync: resynchronised from a snapshot (epoch {prev_epoch} -> {})", frame.epoch);
                    self.metrics.resyncs.inc();
                }
                self.metrics.blocks_stored.add(stats.stored);
                self.metrics.blocks_removed.add(stats.removed);
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
        self.metrics.polls_ok.inc();
        if self.consecutive_failures > 0 {
            log::info!("kvroute-sync: feed is back");
        }
        self.consecutive_failures = 0;
        self.last_ok_ms = host::now_ms();
        self.index.set_live(true);
        self.publish();
        // Long poll: ask again at once.
        self.poll();
    }

    /// Writes what changed (buckets, then the table) into shared data, as much as one
    /// call's budget allows; `on_tick` calls again while anything is left.
    fn publish(&mut self) {
        self.metrics.live.set(u64::from(self.index.is_live()));
        let stats = publish(&mut self.index, &HostStore);
        self.metrics.bucket_writes.add(stats.bucket_writes);
        self.metrics.write_failures.add(stats.failures);
        self.metrics.entries.set(self.index.entries());
        if !self.index.snapshot_in_progress() && !self.index.has_unpublished() {
            // The version the filters now route on.
            self.metrics.version.set(self.index.version());
        }
    }
}
