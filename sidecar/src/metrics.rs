//! `/metrics` in the Prometheus text format, rendered from the fleet's counters.

use crate::cache::Outcome;
use crate::fleet::{role_name, Fleet, ResetReason, EVENT_TYPES};
use std::fmt::Write;
use std::time::Instant;

fn head(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

pub fn render(f: &Fleet, now: Instant, started: Instant) -> String {
    let s = &f.stats;
    let mut o = String::with_capacity(4096);
    head(&mut o, "kvroute_sidecar_events_total", "counter", "KV events by type and outcome.");
    for (t, ty) in EVENT_TYPES.iter().enumerate() {
        for (k, outcome) in Outcome::ALL.iter().enumerate() {
            let _ = writeln!(
                o,
                "kvroute_sidecar_events_total{{type=\"{ty}\",outcome=\"{}\"}} {}",
                outcome.label(),
                s.events[t][k]
            );
        }
    }
    let counters: [(&str, &str, u64); 23] = [
        ("kvroute_sidecar_batches_total", "Event batches decoded and applied.", s.batches),
        (
            "kvroute_sidecar_batches_bad_total",
            "Batches whose payload did not decode (the stream was cleared).",
            s.batches_bad,
        ),
        (
            "kvroute_sidecar_batches_over_cap_total",
            "Of the bad batches, those over a cap: events per batch, blocks or tokens per event.",
            s.batches_over_cap,
        ),
        (
            "kvroute_sidecar_batches_duplicate_total",
            "Live batches that arrived again after a replay had applied them; dropped.",
            s.batches_duplicate,
        ),
        (
            "kvroute_sidecar_frames_bad_total",
            "ZMQ messages that were not [topic, seq, payload]; dropped.",
            s.frames_bad,
        ),
        (
            "kvroute_sidecar_unknown_group_kinds_total",
            "Stores of a KV-cache group of a kind this sidecar does not know; not indexed.",
            s.unknown_group_kinds,
        ),
        ("kvroute_sidecar_blocks_stored_total", "Engine blocks stored by applied BlockStored events.", s.blocks_stored),
        ("kvroute_sidecar_blocks_removed_total", "Engine blocks named by BlockRemoved events.", s.blocks_removed),
        ("kvroute_sidecar_sequence_gaps_total", "Sequence gaps seen on event streams.", s.gaps),
        ("kvroute_sidecar_replays_ok_total", "Replays that covered their gap.", s.replays_ok),
        ("kvroute_sidecar_replays_failed_total", "Replays that could not cover their gap.", s.replays_failed),
        (
            "kvroute_sidecar_checkpoints_written_total",
            "Checkpoints of the caches written to state_file.",
            s.checkpoints_written,
        ),
        (
            "kvroute_sidecar_checkpoint_errors_total",
            "Checkpoints that could not be written or read back (logged).",
            s.checkpoint_errors,
        ),
        (
            "kvroute_sidecar_workers_restored_total",
            "Workers whose caches were restored from the checkpoint.",
            s.workers_restored,
        ),
        (
            "kvroute_sidecar_restores_verified_total",
            "Restored ranks whose publisher confirmed the checkpoint's last batch.",
            s.restores_verified,
        ),
        ("kvroute_sidecar_feed_bad_requests_total", "Feed polls refused as malformed.", s.feed_bad_requests),
        ("kvroute_sidecar_workers_added_total", "Workers that joined after start (discovery).", s.workers_added),
        ("kvroute_sidecar_workers_removed_total", "Workers that left (discovery).", s.workers_removed),
        (
            "kvroute_sidecar_workers_refused_total",
            "Workers discovery offered that the fleet could not take (full, id taken).",
            s.workers_refused,
        ),
        (
            "kvroute_sidecar_discovery_errors_total",
            "Discovery lookups or sessions that failed; the last worker list was kept.",
            s.discovery_errors,
        ),
        (
            "kvroute_sidecar_discovery_records_bad_total",
            "Discovery records that do not describe a worker; ignored.",
            s.discovery_records_bad,
        ),
        ("kvroute_sidecar_eds_requests_total", "Envoy endpoint-discovery polls answered.", s.eds_requests),
        (
            "kvroute_sidecar_eds_bad_requests_total",
            "Endpoint-discovery polls refused as malformed.",
            s.eds_bad_requests,
        ),
    ];
    for (name, help, v) in counters {
        head(&mut o, name, "counter", help);
        let _ = writeln!(o, "{name} {v}");
    }
    head(&mut o, "kvroute_sidecar_resets_total", "counter", "Worker streams cleared and rebuilt, by reason.");
    for (i, r) in ResetReason::ALL.iter().enumerate() {
        let _ = writeln!(o, "kvroute_sidecar_resets_total{{reason=\"{}\"}} {}", r.label(), s.resets[i]);
    }
    head(&mut o, "kvroute_sidecar_feed_frames_total", "counter", "Feed frames served, by kind.");
    for (i, k) in ["delta", "snapshot", "snapshot_page"].iter().enumerate() {
        let _ = writeln!(o, "kvroute_sidecar_feed_frames_total{{kind=\"{k}\"}} {}", s.feed_frames[i]);
    }
    let gauges: [(&str, &str, u64); 6] = [
        ("kvroute_sidecar_feed_clients_waiting", "Feed long-polls being held now.", s.feed_waiting),
        ("kvroute_sidecar_feed_lag_versions", "Versions the latest feed poll was behind.", s.feed_lag_versions),
        ("kvroute_sidecar_feed_version", "The feed's current version.", f.version()),
        ("kvroute_sidecar_workers", "Workers in the fleet now.", f.workers.len() as u64),
        ("kvroute_sidecar_changelog_blocks", "Blocks held in the change log.", f.log_blocks() as u64),
        ("kvroute_sidecar_uptime_seconds", "Seconds since start.", now.saturating_duration_since(started).as_secs()),
    ];
    for (name, help, v) in gauges {
        head(&mut o, name, "gauge", help);
        let _ = writeln!(o, "{name} {v}");
    }
    head(&mut o, "kvroute_sidecar_worker_blocks", "gauge", "Distinct blocks each worker holds.");
    for w in &f.workers {
        let _ = writeln!(
            o,
            "kvroute_sidecar_worker_blocks{{worker=\"{}\",role=\"{}\"}} {}",
            label(&w.config.id),
            role_name(w.config.role),
            w.cache.block_count()
        );
    }
    head(&mut o, "kvroute_sidecar_worker_offloaded_blocks", "gauge", "Blocks held only in an offload tier.");
    for w in &f.workers {
        let _ = writeln!(
            o,
            "kvroute_sidecar_worker_offloaded_blocks{{worker=\"{}\"}} {}",
            label(&w.config.id),
            w.cache.offloaded_count()
        );
    }
    head(&mut o, "kvroute_sidecar_worker_up", "gauge", "1 if the worker is routable.");
    for w in &f.workers {
        let _ = writeln!(o, "kvroute_sidecar_worker_up{{worker=\"{}\"}} {}", label(&w.config.id), u8::from(w.up));
    }
    head(&mut o, "kvroute_sidecar_worker_last_seq", "gauge", "Sequence number of the latest batch, per DP rank.");
    for w in &f.workers {
        for (r, rs) in w.ranks.iter().enumerate() {
            if let Some(seq) = rs.last_seq {
                let _ = writeln!(
                    o,
                    "kvroute_sidecar_worker_last_seq{{worker=\"{}\",rank=\"{r}\"}} {seq}",
                    label(&w.config.id)
                );
            }
        }
    }
    head(
        &mut o,
        "kvroute_sidecar_worker_event_lag_seconds",
        "gauge",
        "Receive time minus the publisher's timestamp, latest batch.",
    );
    for w in &f.workers {
        for (r, rs) in w.ranks.iter().enumerate() {
            if let Some(lag) = rs.lag_ms {
                let _ = writeln!(
                    o,
                    "kvroute_sidecar_worker_event_lag_seconds{{worker=\"{}\",rank=\"{r}\"}} {:.6}",
                    label(&w.config.id),
                    lag / 1000.0
                );
            }
        }
    }
    o
}
