//! `discovery_backend = "dns"`: a name (a Kubernetes headless service, say) resolved to its
//! A/AAAA records every `dns_interval_ms`; each address is one worker, with the configured
//! ports. Resolution goes through the system resolver (`getaddrinfo`, as the engines' own
//! clients do), so `/etc/hosts`, search domains and the cluster's DNS all apply.

use super::failed;
use crate::config::{DnsDiscovery, WorkerConfig};
use crate::fleet::Fleet;
use std::net::IpAddr;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

pub async fn run(d: DnsDiscovery, fleet: Arc<Mutex<Fleet>>, tx: Sender<Vec<WorkerConfig>>) {
    let mut tick = tokio::time::interval(d.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last: Option<Vec<WorkerConfig>> = None;
    loop {
        tick.tick().await;
        match tokio::net::lookup_host((d.name.as_str(), d.http_port)).await {
            Ok(addrs) => {
                let workers = workers_at(&d, addrs.map(|a| a.ip()));
                if last.as_ref() != Some(&workers) {
                    log::info!("discovery: {} resolves to {} workers", d.name, workers.len());
                    if tx.send(workers.clone()).is_err() {
                        return; // the ingest thread is gone: shutting down
                    }
                    last = Some(workers);
                }
            }
            // NXDOMAIN (a service with no ready endpoints answers so too) is an error
            // here, like any failed lookup: the last list stays and the probes judge it.
            Err(e) => failed(&fleet, &format!("resolving {}: {e}", d.name)),
        }
    }
}

/// One worker per distinct address, sorted (the order does not matter to the fleet, but an
/// unchanged answer in another order must not look like a change).
pub fn workers_at(d: &DnsDiscovery, ips: impl Iterator<Item = IpAddr>) -> Vec<WorkerConfig> {
    let mut ips: Vec<IpAddr> = ips.collect();
    ips.sort();
    ips.dedup();
    ips.into_iter()
        .map(|ip| {
            let host = match ip {
                IpAddr::V4(v4) => v4.to_string(),
                IpAddr::V6(v6) => format!("[{v6}]"),
            };
            WorkerConfig {
                id: format!("{host}:{}", d.http_port),
                events: format!("tcp://{host}:{}", d.events_port),
                replay: d.replay_port.map(|p| format!("tcp://{host}:{p}")),
                role: d.role,
                dp_ranks: d.dp_ranks,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute::role::Role;
    use std::time::Duration;

    #[test]
    fn each_address_is_a_worker_with_the_configured_ports() {
        let d = DnsDiscovery {
            name: "vllm".into(),
            http_port: 8000,
            events_port: 5557,
            replay_port: Some(5558),
            role: Role::Decode,
            dp_ranks: 1,
            interval: Duration::from_secs(1),
        };
        let ips = ["10.0.0.2", "fd00::5", "10.0.0.1", "10.0.0.2"].map(|s| s.parse().unwrap());
        let w = workers_at(&d, ips.into_iter());
        let ids: Vec<&str> = w.iter().map(|w| w.id.as_str()).collect();
        assert_eq!(ids, ["10.0.0.1:8000", "10.0.0.2:8000", "[fd00::5]:8000"]);
        assert_eq!(w[2].events, "tcp://[fd00::5]:5557");
        assert_eq!(w[0].replay.as_deref(), Some("tcp://10.0.0.1:5558"));
        assert_eq!(w[0].role, Role::Decode);
    }
}
