//! Worker liveness. A worker whose publisher is sending is up. One that has been silent for
//! `silent_after` is probed with `GET http://{id}{health_path}`; if the probe fails it is
//! marked down in the feed (never routed to, its blocks kept), and up again on a good probe
//! or its next event.

use crate::config::Config;
use crate::fleet::Fleet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

pub async fn run(config: Config, fleet: Arc<Mutex<Fleet>>, started: Instant) {
    let Some(path) = config.health_path.clone() else { return };
    let mut tick = tokio::time::interval(config.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = Instant::now();
        // Which workers are silent (no batch from any rank for `silent_after`)?
        let silent: Vec<(usize, String)> = {
            let f = crate::fleet::lock(&fleet);
            f.workers
                .iter()
                .enumerate()
                .filter_map(|(i, w)| {
                    let last = w.ranks.iter().filter_map(|r| r.last_event_at).max().unwrap_or(started);
                    (now.saturating_duration_since(last) >= config.silent_after).then(|| (i, w.config.id.clone()))
                })
                .collect()
        };
        let mut results = Vec::new();
        for (i, id) in &silent {
            results.push((*i, probe(id, &path).await));
        }
        let mut f = crate::fleet::lock(&fleet);
        for i in 0..f.workers.len() {
            let up = match results.iter().find(|(j, _)| *j == i) {
                Some((_, ok)) => *ok,
                None => true, // sending events
            };
            f.set_up(i, up);
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
