//! `discovery_backend = "etcd"`: every key under `etcd_prefix` is one worker's
//! [`Registration`](super::Registration), put under a lease by `kvroute-sidecar register`
//! beside its engine. The sidecar lists the prefix, then watches it from the revision after
//! the list, so no change falls between the two. A lease that ends deletes its key, which
//! the watch reports like any delete: the worker leaves.
//!
//! A lost connection or a cancelled watch (the revision was compacted) starts over with a
//! new list; meanwhile the last worker list stands.

use super::{bad_record, failed, Registration};
use crate::config::{EtcdDiscovery, WorkerConfig};
use crate::fleet::Fleet;
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, KeyValue, WatchOptions};
use std::collections::BTreeMap;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Pause before reconnecting, doubled up to `MAX_BACKOFF` while attempts fail.
const MIN_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Client options shared with the registrar: a dead connection is noticed within ~4 s
/// (HTTP/2 keepalive), not at the next TCP timeout.
pub fn connect_options() -> ConnectOptions {
    ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
        .with_keep_alive_while_idle(true)
}

pub async fn run(d: EtcdDiscovery, fleet: Arc<Mutex<Fleet>>, tx: Sender<Vec<WorkerConfig>>) {
    let mut backoff = MIN_BACKOFF;
    let mut last: Option<Vec<WorkerConfig>> = None;
    loop {
        match follow(&d, &fleet, &tx, &mut last, &mut backoff).await {
            Ok(()) => return, // the ingest thread is gone: shutting down
            Err(e) => failed(&fleet, &format!("etcd {}: {e}", d.endpoints.join(","))),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One session: list, publish, watch until something breaks (Err) or the receiver is gone.
async fn follow(
    d: &EtcdDiscovery,
    fleet: &Mutex<Fleet>,
    tx: &Sender<Vec<WorkerConfig>>,
    last: &mut Option<Vec<WorkerConfig>>,
    backoff: &mut Duration,
) -> Result<(), String> {
    let mut client = Client::connect(&d.endpoints, Some(connect_options())).await.map_err(|e| e.to_string())?;
    let listed = client
        .get(d.prefix.as_str(), Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|e| format!("listing {}: {e}", d.prefix))?;
    let revision = listed.header().map_or(0, |h| h.revision());
    let mut records: BTreeMap<Vec<u8>, Option<WorkerConfig>> = BTreeMap::new();
    for kv in listed.kvs() {
        records.insert(kv.key().to_vec(), record(d, kv, fleet));
    }
    log::info!("discovery: {} registrations under {} (etcd revision {revision})", records.len(), d.prefix);
    if !publish(&records, tx, last) {
        return Ok(());
    }
    let mut watch = client
        .watch(d.prefix.as_str(), Some(WatchOptions::new().with_prefix().with_start_revision(revision + 1)))
        .await
        .map_err(|e| format!("watching {}: {e}", d.prefix))?;
    *backoff = MIN_BACKOFF;
    loop {
        let Some(resp) = watch.message().await.map_err(|e| format!("watch: {e}"))? else {
            return Err("the watch stream ended".into());
        };
        if resp.canceled() {
            return Err(format!(
                "watch cancelled ({}; compacted at {})",
                resp.cancel_reason(),
                resp.compact_revision()
            ));
        }
        if resp.events().is_empty() {
            continue; // created / progress notices
        }
        for ev in resp.events() {
            let Some(kv) = ev.kv() else { continue };
            match ev.event_type() {
                EventType::Put => {
                    records.insert(kv.key().to_vec(), record(d, kv, fleet));
                }
                EventType::Delete => {
                    records.remove(kv.key());
                }
            }
        }
        if !publish(&records, tx, last) {
            return Ok(());
        }
    }
}

/// The worker a key describes; None (counted, logged) if it does not describe one, or
/// names another model.
fn record(d: &EtcdDiscovery, kv: &KeyValue, fleet: &Mutex<Fleet>) -> Option<WorkerConfig> {
    let key = String::from_utf8_lossy(kv.key());
    let reg: Registration = match serde_json::from_slice(kv.value()) {
        Ok(r) => r,
        Err(e) => {
            bad_record(fleet, &format!("{key}: not a registration ({e})"));
            return None;
        }
    };
    if d.model.as_ref().is_some_and(|m| reg.model.as_ref() != Some(m)) {
        log::debug!("discovery: {key} serves {:?}, not this sidecar's model", reg.model);
        return None;
    }
    match reg.worker(&key) {
        Ok(w) => Some(w),
        Err(e) => {
            bad_record(fleet, &e);
            None
        }
    }
}

/// Sends the workers the records describe if they changed; false once nobody listens.
fn publish(
    records: &BTreeMap<Vec<u8>, Option<WorkerConfig>>,
    tx: &Sender<Vec<WorkerConfig>>,
    last: &mut Option<Vec<WorkerConfig>>,
) -> bool {
    let workers: Vec<WorkerConfig> = records.values().flatten().cloned().collect();
    if last.as_ref() == Some(&workers) {
        return true;
    }
    *last = Some(workers.clone());
    tx.send(workers).is_ok()
}
