//! Where the fleet's worker list comes from ([`crate::config::Discovery`]): the configured
//! list, a DNS name ([`dns`]) or registrations in etcd ([`etcd`], written by
//! `kvroute-sidecar register`: [`register`]).
//!
//! A backend sends the whole list each time it changes; the ingest thread makes the fleet
//! equal to the newest ([`crate::ingest::Ingest::set_workers`]). A backend that cannot
//! reach its source keeps the last list: an outage of DNS or etcd must not empty the
//! fleet (the health probes still mark a dead worker down).

pub mod dns;
pub mod etcd;
pub mod register;

use crate::config::{Config, Discovery, FileWorker, WorkerConfig};
use crate::fleet::{lock, Fleet};
use serde::{Deserialize, Serialize};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

/// Runs the configured backend until the process ends (`static`: returns at once).
pub async fn run(config: &Config, fleet: Arc<Mutex<Fleet>>, tx: Sender<Vec<WorkerConfig>>) {
    match &config.discovery {
        Discovery::Static => {}
        Discovery::Dns(d) => dns::run(d.clone(), fleet, tx).await,
        Discovery::Etcd(d) => etcd::run(d.clone(), fleet, tx).await,
    }
}

/// One engine's record in etcd, as JSON under `{prefix}{http}`. Unknown fields are
/// ignored, so a newer registrar's records still read.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Registration {
    /// `ip:port` Envoy routes to (the worker's id).
    pub http: String,
    /// ZMQ endpoint of DP rank 0's KV-event publisher.
    pub events: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_ranks: Option<u32>,
    /// The model the engine serves (a sidecar with `etcd_model` takes only its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl Registration {
    /// The worker it describes, validated as a configured one is.
    pub fn worker(&self, field: &str) -> Result<WorkerConfig, String> {
        crate::config::worker(
            field,
            FileWorker {
                id: self.http.clone(),
                events: self.events.clone(),
                replay: self.replay.clone(),
                role: self.role.clone(),
                dp_ranks: self.dp_ranks,
            },
        )
    }
}

/// Counts a discovery failure, logging the 1st, 2nd, 4th… of a run of them.
fn failed(fleet: &Mutex<Fleet>, what: &str) {
    let n = {
        let mut f = lock(fleet);
        f.stats.discovery_errors += 1;
        f.stats.discovery_errors
    };
    if n.is_power_of_two() {
        log::warn!("discovery: {what}; keeping the last worker list (#{n})");
    }
}

/// Counts a record that does not describe a worker.
fn bad_record(fleet: &Mutex<Fleet>, what: &str) {
    let n = {
        let mut f = lock(fleet);
        f.stats.discovery_records_bad += 1;
        f.stats.discovery_records_bad
    };
    log::warn!("discovery: {what}; ignored (#{n})");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrations_round_trip_and_validate_like_configured_workers() {
        let r = Registration {
            http: "10.0.0.5:8000".into(),
            events: "tcp://10.0.0.5:5557".into(),
            replay: Some("tcp://10.0.0.5:5558".into()),
            dp_ranks: Some(2),
            model: Some("Qwen/Qwen3-0.6B".into()),
            ..Registration::default()
        };
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Registration>(&json).unwrap(), r);
        let w = r.worker("k").unwrap();
        assert_eq!((w.id.as_str(), w.dp_ranks, w.events_for(1).as_str()), ("10.0.0.5:8000", 2, "tcp://10.0.0.5:5558"));
        // Newer fields are ignored; a bad endpoint is an error naming the record.
        let newer: Registration =
            serde_json::from_str(r#"{"http":"10.0.0.6:8000","events":"tcp://10.0.0.6:5557","zone":"b"}"#).unwrap();
        assert!(newer.worker("k").is_ok());
        let bad = Registration { events: "udp://x:1".into(), ..newer };
        assert!(bad.worker("/kvroute/workers/x").unwrap_err().contains("/kvroute/workers/x.events"));
    }
}
