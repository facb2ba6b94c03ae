//! Worker liveness. A worker whose publisher is sending is up. One that has been silent for
//! `silent_after` is probed with `GET http://{id}{health_path}`; if the probe fails it is
//! marked down in the feed (never routed to, its blocks kept), and up again on a good probe
//! or its next event.

use crate::config::Config;
use crate::fleet::{Fleet, WorkerKey};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

pub async fn run(config: Config, fleet: Arc<Mutex<Fleet>>, started: Instant) {
    let Some(path) = config.health_path.clone() else { return };
    let mut tick = tokio::time::interval(config.health_interval);
    // Static workers count their silence from the sidecar's start; discovered ones from
    // when this loop first saw them.
    let mut joined: HashMap<WorkerKey, Instant> = HashMap::new();
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = Instant::now();
        // Which workers are silent (no batch from any rank for `silent_after`)?
        // A worker that joined later counts from when it joined.
        let silent: Vec<(WorkerKey, String)> = {
            let f = crate::fleet::lock(&fleet);
            for w in &f.workers {
                joined.entry(w.key).or_insert(now);
            }
            joined.retain(|k, _| f.worker(*k).is_some());
            f.workers
                .iter()
                .filter_map(|w| {
                    let since = joined.get(&w.key).copied().unwrap_or(started);
                    let last = w.ranks.iter().filter_map(|r| r.last_event_at).max().unwrap_or(since);
                    (now.saturating_duration_since(last) >= config.silent_after).then(|| (w.key, w.config.id.clone()))
                })
                .collect()
        };
        let mut results = Vec::new();
        for (key, id) in &silent {
            results.push((*key, probe(id, &path).await));
        }
        let mut f = crate::fleet::lock(&fleet);
        let keys: Vec<WorkerKey> = f.workers.iter().map(|w| w.key).collect();
        for key in keys {
            let up = match results.iter().find(|(k, _)| *k == key) {
                Some((_, ok)) => *ok,
                None => true, // sending events
            };
            f.set_up(key, up);
        }
    }
}

/// One HTTP/1.1 GET; true on a 2xx status line within the timeout.
async fn probe(id: &str, path: &str) -> bool {
    let attempt = async {
        let mut s = TcpStream::connect(id).await.ok()?;
        let req =
            format!("GET {path} HTTP/1.1\r\nHost: {id}\r\nConnection: close\r\nUser-Agent: kvroute-sidecar\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = [0u8; 64];
        let mut n = 0;
        while n < 12 {
            let r = s.read(&mut buf[n..]).await.ok()?;
            if r == 0 {
                break;
            }
            n += r;
        }
        let line = std::str::from_utf8(&buf[..n]).ok()?;
        let code = line.strip_prefix("HTTP/1.")?.get(2..5)?;
        Some(code.starts_with('2'))
    };
    matches!(tokio::time::timeout(PROBE_TIMEOUT, attempt).await, Ok(Some(true)))
}
