//! Load shared between gateway replicas (`kvroute::peerload`): each gateway's sync service
//! `POST`s its per-worker load to `/v1/load` and is answered with every other gateway's,
//! summed. Gateways that share this sidecar see each other directly; with a load exchange
//! (`load_exchange = "nats"`) every report is also published on a NATS core subject and
//! the other sidecars' reports are read from it.

use crate::config::LoadExchange;
use futures_util::StreamExt;
use kvroute::peerload::{Answer, Report, WorkerLoad};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

pub const LOAD_PATH: &str = "/v1/load";
/// Largest report read (every worker of a full table, with long ids, fits).
pub const MAX_REPORT_BYTES: usize = 1 << 20;
/// Gateways remembered at once; a report from one more is refused until some expire.
const MAX_GATEWAYS: usize = 1024;
/// Reports waiting to be published; beyond this the newest are dropped (counted): the
/// next interval brings a newer one.
const PUBLISH_QUEUE: usize = 64;

#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadStats {
    /// Reports taken from gateways of this sidecar.
    pub reports: u64,
    /// Reports refused (malformed, too large, too many gateways).
    pub reports_bad: u64,
    /// Reports read from the exchange, and those that did not decode.
    pub exchanged_in: u64,
    pub exchanged_bad: u64,
    /// Reports published, and those dropped (queue full, or no connection).
    pub exchanged_out: u64,
    pub exchanged_dropped: u64,
}

/// Every gateway's latest report, for `ttl` after it arrived.
pub struct PeerLoads {
    ttl: Duration,
    reports: HashMap<String, (Instant, BTreeMap<String, WorkerLoad>)>,
    pub stats: LoadStats,
}

impl PeerLoads {
    pub fn new(ttl: Duration) -> PeerLoads {
        PeerLoads { ttl, reports: HashMap::new(), stats: LoadStats::default() }
    }

    /// Keeps `report` as its gateway's latest. Err: too many gateways.
    pub fn put(&mut self, report: Report, now: Instant) -> Result<(), String> {
        self.expire(now);
        if self.reports.len() >= MAX_GATEWAYS && !self.reports.contains_key(&report.gateway) {
            return Err(format!("{MAX_GATEWAYS} gateways report already"));
        }
        self.reports.insert(report.gateway, (now, report.workers));
        Ok(())
    }

    /// Every other gateway's load, summed per worker.
    pub fn others(&mut self, gateway: &str, now: Instant) -> Answer {
        self.expire(now);
        let mut answer = Answer::default();
        for (_, (_, workers)) in self.reports.iter().filter(|(g, _)| g.as_str() != gateway) {
            answer.gateways += 1;
            for (id, load) in workers {
                answer.workers.entry(id.clone()).or_default().add(*load);
            }
        }
        answer
    }

    /// Gateways with a report within the TTL.
    pub fn gateways(&mut self, now: Instant) -> usize {
        self.expire(now);
        self.reports.len()
    }

    fn expire(&mut self, now: Instant) {
        let ttl = self.ttl;
        self.reports.retain(|_, (at, _)| now.saturating_duration_since(*at) <= ttl);
    }

    pub fn render(&mut self, now: Instant) -> String {
        let s = self.stats;
        let mut o = String::new();
        let counters = [
            (
                "kvroute_sidecar_load_reports_total",
                "Gateway load reports taken from this sidecar's gateways.",
                s.reports,
            ),
            (
                "kvroute_sidecar_load_reports_bad_total",
                "Load reports refused (malformed, too large, too many gateways).",
                s.reports_bad,
            ),
            ("kvroute_sidecar_load_exchanged_in_total", "Load reports read from the other sidecars.", s.exchanged_in),
            (
                "kvroute_sidecar_load_exchanged_bad_total",
                "Load reports from the exchange that did not decode.",
                s.exchanged_bad,
            ),
            (
                "kvroute_sidecar_load_exchanged_out_total",
                "Load reports published to the other sidecars.",
                s.exchanged_out,
            ),
            (
                "kvroute_sidecar_load_exchanged_dropped_total",
                "Load reports not published (queue full or not connected).",
                s.exchanged_dropped,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        let name = "kvroute_sidecar_load_gateways";
        let _ = writeln!(
            o,
            "# HELP {name} Gateways whose load report is current.\n# TYPE {name} gauge\n{name} {}",
            self.gateways(now)
        );
        o
    }
}

pub fn lock(loads: &Mutex<PeerLoads>) -> MutexGuard<'_, PeerLoads> {
    loads.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where a report goes after it is kept here: to the exchange, if there is one.
#[derive(Clone)]
pub struct Publisher(Option<mpsc::Sender<bytes::Bytes>>);

impl Publisher {
    pub const NONE: Publisher = Publisher(None);

    /// Queues a report's bytes; `false` if it was dropped.
    pub fn publish(&self, bytes: bytes::Bytes) -> bool {
        self.0.as_ref().is_none_or(|tx| tx.try_send(bytes).is_ok())
    }
}

/// Starts the exchange: publishes what [`Publisher`] queues, keeps what other sidecars
/// publish. The NATS client reconnects by itself; until it first connects, reports are
/// dropped (counted) and the gateways see only this sidecar's.
pub fn start_exchange(exchange: &LoadExchange, loads: Arc<Mutex<PeerLoads>>) -> Publisher {
    let (tx, rx) = mpsc::channel(PUBLISH_QUEUE);
    tokio::spawn(run_exchange(exchange.clone(), loads, rx));
    Publisher(Some(tx))
}

async fn run_exchange(exchange: LoadExchange, loads: Arc<Mutex<PeerLoads>>, mut rx: mpsc::Receiver<bytes::Bytes>) {
    let connect = async_nats::ConnectOptions::new()
        .name("kvroute-sidecar load exchange")
        // Our own reports are kept when they are sent; their echo would only be work.
        .no_echo()
        .retry_on_initial_connect()
        .connect(exchange.url.as_str());
    let client = match connect.await {
        Ok(c) => c,
        Err(e) => {
            log::error!(
                "load exchange: cannot connect to {}: {e}; sharing load with local gateways only",
                exchange.url
            );
            return;
        }
    };
    let mut sub = match client.subscribe(exchange.subject.clone()).await {
        Ok(s) => s,
        Err(e) => {
            log::error!(
                "load exchange: cannot subscribe to {}: {e}; sharing load with local gateways only",
                exchange.subject
            );
            return;
        }
    };
    log::info!("load exchange: gateway load on {} at {}", exchange.subject, exchange.url);
    loop {
        tokio::select! {
            out = rx.recv() => {
                let Some(bytes) = out else { return };
                let sent = client.publish(exchange.subject.clone(), bytes).await.is_ok();
                let mut l = lock(&loads);
                if sent { l.stats.exchanged_out += 1 } else { l.stats.exchanged_dropped += 1 }
            }
            msg = sub.next() => {
                let Some(msg) = msg else {
                    log::error!("load exchange: subscription to {} ended", exchange.subject);
                    return;
                };
                let mut l = lock(&loads);
                match Report::decode(&msg.payload).and_then(|r| l.put(r, Instant::now())) {
                    Ok(()) => l.stats.exchanged_in += 1,
                    Err(e) => {
                        l.stats.exchanged_bad += 1;
                        if l.stats.exchanged_bad.is_power_of_two() {
                            log::warn!("load exchange: {e} (#{})", l.stats.exchanged_bad);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(gateway: &str, workers: &[(&str, u32, u32)]) -> Report {
        Report {
            gateway: gateway.into(),
            workers: workers.iter().map(|&(w, active, prefill)| (w.into(), WorkerLoad { active, prefill })).collect(),
        }
    }

    #[test]
    fn a_gateway_gets_the_others_load_summed_and_never_its_own() {
        let mut l = PeerLoads::new(Duration::from_secs(1));
        let t0 = Instant::now();
        l.put(report("a", &[("w1:1", 10, 2)]), t0).unwrap();
        l.put(report("b", &[("w1:1", 5, 1), ("w2:1", 7, 0)]), t0).unwrap();
        l.put(report("c", &[("w1:1", 1, 1)]), t0).unwrap();
        let a = l.others("a", t0);
        assert_eq!(a.gateways, 2);
        assert_eq!(a.workers["w1:1"], WorkerLoad { active: 6, prefill: 2 });
        assert_eq!(a.workers["w2:1"], WorkerLoad { active: 7, prefill: 0 });
        // A newer report replaces the gateway's last.
        l.put(report("b", &[]), t0).unwrap();
        assert_eq!(l.others("a", t0).workers["w1:1"], WorkerLoad { active: 1, prefill: 1 });
        assert_eq!(l.others("z", t0).gateways, 3);
    }

    #[test]
    fn reports_expire_and_the_gateway_count_is_bounded() {
        let mut l = PeerLoads::new(Duration::from_millis(500));
        let t0 = Instant::now();
        l.put(report("a", &[("w1:1", 10, 2)]), t0).unwrap();
        assert_eq!(l.others("b", t0 + Duration::from_millis(500)).gateways, 1);
        assert_eq!(l.others("b", t0 + Duration::from_millis(501)), Answer::default());
        for i in 0..MAX_GATEWAYS {
            l.put(report(&format!("g{i}"), &[]), t0).unwrap();
        }
        assert!(l.put(report("one-more", &[]), t0).unwrap_err().contains("gateways"));
        l.put(report("g0", &[("w", 1, 1)]), t0).unwrap();
        assert!(l.put(report("one-more", &[]), t0 + Duration::from_secs(1)).is_ok());
    }
}
