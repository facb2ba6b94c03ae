//! The HTTP side: the feed for Envoy's sync service, the admin API, `/metrics`, `/healthz`.

use crate::fleet::{FeedReply, Fleet};
use crate::peerload::{PeerLoads, Publisher, LOAD_PATH, MAX_REPORT_BYTES};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use kvroute_serve::respond;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub const FEED_PATH: &str = "/v1/kv/feed";
const FEED_CONTENT_TYPE: &str = "application/x-kvroute-feed";
/// Longest a feed poll is held, whatever the client asks.
const MAX_HOLD: Duration = Duration::from_secs(60);
/// Longest `linger_ms` honoured, whatever the client asks.
const MAX_LINGER: Duration = Duration::from_secs(1);

pub struct App {
    pub fleet: Arc<Mutex<Fleet>>,
    pub started: Instant,
    /// Gateways' load reports ([`crate::peerload`]) and where they are published.
    pub loads: Arc<Mutex<PeerLoads>>,
    pub publisher: Publisher,
}

impl App {
    pub fn fleet(&self) -> MutexGuard<'_, Fleet> {
        crate::fleet::lock(&self.fleet)
    }
}

type Resp = Response<Full<Bytes>>;

fn json(status: StatusCode, v: &serde_json::Value) -> Resp {
    respond(status, "application/json", v.to_string())
}

fn unknown_worker(id: &str) -> Resp {
    json(StatusCode::NOT_FOUND, &serde_json::json!({"error": "unknown worker", "worker_id": id}))
}

fn error(status: StatusCode, msg: &str) -> Resp {
    json(status, &serde_json::json!({ "error": msg }))
}

pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Result<Resp, std::convert::Infallible> {
    let path = req.uri().path().to_string();
    if path == crate::eds::EDS_PATH {
        return Ok(eds(&app, req).await);
    }
    if path == LOAD_PATH {
        return Ok(load(&app, req).await);
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return Ok(error(StatusCode::METHOD_NOT_ALLOWED, "only GET"));
    }
    let resp = if path == FEED_PATH {
        feed(&app, req.uri().query().unwrap_or("")).await
    } else if let Some(id) = path.strip_prefix("/v1/admin/cache-view/") {
        let id = percent_decode(id);
        match app.fleet().cache_view(&id) {
            Some(v) => respond(StatusCode::OK, "application/json", v),
            None => unknown_worker(&id),
        }
    } else if let Some(id) = path.strip_prefix("/v1/admin/engine-blocks/") {
        let id = percent_decode(id);
        match app.fleet().engine_blocks(&id) {
            Some(v) => json(StatusCode::OK, &v),
            None => unknown_worker(&id),
        }
    } else if path == "/v1/admin/workers" {
        json(StatusCode::OK, &app.fleet().workers_json(Instant::now()))
    } else if path == "/metrics" {
        let mut text = crate::metrics::render(&app.fleet(), Instant::now(), app.started);
        text.push_str(&crate::peerload::lock(&app.loads).render(Instant::now()));
        respond(StatusCode::OK, "text/plain; version=0.0.4", text)
    } else if path == "/healthz" {
        json(StatusCode::OK, &serde_json::json!({"status": "ok"}))
    } else {
        error(StatusCode::NOT_FOUND, "no such path")
    };
    Ok(resp)
}

/// Envoy's endpoint discovery: a POSTed `DiscoveryRequest`, read up to its size limit.
async fn eds(app: &App, req: Request<Incoming>) -> Resp {
    use http_body_util::BodyExt;
    if req.method() != Method::POST {
        return error(StatusCode::METHOD_NOT_ALLOWED, "only POST");
    }
    let body = match http_body_util::Limited::new(req.into_body(), crate::eds::MAX_REQUEST_BYTES).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return eds_refused(app, &format!("request body: {e}")),
    };
    let answer = crate::eds::answer(&app.fleet(), &body);
    match answer {
        Ok(v) => {
            app.fleet().stats.eds_requests += 1;
            json(StatusCode::OK, &v)
        }
        Err(e) => eds_refused(app, &e),
    }
}

/// A discovery request that cannot be answered: counted, logged (at powers of two: a
/// misconfigured gateway polls twice a second), and told why.
fn eds_refused(app: &App, why: &str) -> Resp {
    let n = {
        let mut fleet = app.fleet();
        fleet.stats.eds_bad_requests += 1;
        fleet.stats.eds_bad_requests
    };
    if n.is_power_of_two() {
        log::warn!("endpoint discovery: {why} (#{n})");
    }
    error(StatusCode::BAD_REQUEST, why)
}

/// A gateway's load report (`kvroute::peerload::Report`), answered with the other
/// gateways' load. A bad one is refused with the reason, counted, and logged at powers of
/// two (a gateway reports ten times a second).
async fn load(app: &App, req: Request<Incoming>) -> Resp {
    use http_body_util::BodyExt;
    if req.method() != Method::POST {
        return error(StatusCode::METHOD_NOT_ALLOWED, "only POST");
    }
    let body = http_body_util::Limited::new(req.into_body(), MAX_REPORT_BYTES).collect().await;
    let now = Instant::now();
    let mut loads = crate::peerload::lock(&app.loads);
    // What other sidecars get is the report as it came, once it decoded and was kept.
    let kept = body.map_err(|e| format!("request body: {e}")).and_then(|b| {
        let bytes = b.to_bytes();
        let report = kvroute::peerload::Report::decode(&bytes)?;
        let gateway = report.gateway.clone();
        loads.put(report, now).map(|()| (gateway, bytes))
    });
    match kept {
        Ok((gateway, bytes)) => {
            loads.stats.reports += 1;
            if !app.publisher.publish(bytes) {
                loads.stats.exchanged_dropped += 1;
            }
            respond(StatusCode::OK, "application/json", loads.others(&gateway, now).encode())
        }
        Err(why) => {
            loads.stats.reports_bad += 1;
            if loads.stats.reports_bad.is_power_of_two() {
                log::warn!("load report refused: {why} (#{})", loads.stats.reports_bad);
            }
            error(StatusCode::BAD_REQUEST, &why)
        }
    }
}

#[derive(Debug)]
struct Poll {
    epoch: u64,
    since: u64,
    cursor: u64,
    timeout: Duration,
    /// `tiers=1`: the client takes `STORE_OFFLOADED` ops.
    tiers: bool,
    /// How long a delta waits for more changes once there is one to send (`linger_ms`).
    linger: Duration,
}

fn parse_poll(query: &str) -> Result<Poll, String> {
    let mut vals = [None; 6];
    const NAMES: [&str; 6] = ["epoch", "since", "cursor", "timeout_ms", "tiers", "linger_ms"];
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if let Some(i) = NAMES.iter().position(|n| *n == k) {
            vals[i] = Some(v.parse::<u64>().map_err(|_| format!("`{k}` must be an unsigned integer, got `{v}`"))?);
        }
    }
    let get = |i: usize| vals[i].ok_or_else(|| format!("missing `{}`", NAMES[i]));
    let timeout = Duration::from_millis(get(3)?).min(MAX_HOLD);
    Ok(Poll {
        epoch: get(0)?,
        since: get(1)?,
        cursor: get(2)?,
        timeout,
        tiers: vals[4].unwrap_or(0) == 1,
        linger: Duration::from_millis(vals[5].unwrap_or(0)).min(MAX_LINGER),
    })
}

async fn feed(app: &App, query: &str) -> Resp {
    let poll = match parse_poll(query) {
        Ok(p) => p,
        Err(e) => {
            app.fleet().stats.feed_bad_requests += 1;
            return error(StatusCode::BAD_REQUEST, &e);
        }
    };
    let waiting = {
        let mut fleet = app.fleet();
        if !poll.linger.is_zero() && fleet.delta_ready(poll.epoch, poll.since, poll.cursor) {
            None // lingers below, as a change that wakes a waiting poll does
        } else {
            // Subscribed before asking, so a change right after the answer still wakes us.
            let rx = fleet.subscribe();
            match fleet.feed(poll.epoch, poll.since, poll.cursor, poll.tiers, true) {
                FeedReply::Frame(b) => return respond(StatusCode::OK, FEED_CONTENT_TYPE, b),
                FeedReply::Wait => {
                    fleet.stats.feed_waiting += 1;
                    Some(rx)
                }
            }
        }
    };
    let woken = match waiting {
        Some(mut changed) => {
            let woken = tokio::time::timeout(poll.timeout, changed.changed()).await.is_ok_and(|r| r.is_ok());
            let mut fleet = app.fleet();
            fleet.stats.feed_waiting = fleet.stats.feed_waiting.saturating_sub(1);
            woken
        }
        None => true,
    };
    if woken && !poll.linger.is_zero() {
        // Changes close together leave in one delta: each answer costs the gateway's main
        // thread a whole callout (0.13-0.5 ms of Envoy CPU, docs/benchmarks.md).
        tokio::time::sleep(poll.linger).await;
    }
    let mut fleet = app.fleet();
    match fleet.feed(poll.epoch, poll.since, poll.cursor, poll.tiers, false) {
        FeedReply::Frame(b) => respond(StatusCode::OK, FEED_CONTENT_TYPE, b),
        FeedReply::Wait => error(StatusCode::INTERNAL_SERVER_ERROR, "feed did not answer"),
    }
}

/// `%XX` sequences decoded (IPv6 ids arrive as `%5B…%5D`); anything malformed kept as is.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_parameters_are_all_required_and_numeric() {
        let p = parse_poll("epoch=1&since=2&cursor=0&timeout_ms=500").unwrap();
        assert_eq!((p.epoch, p.since, p.cursor, p.timeout, p.tiers), (1, 2, 0, Duration::from_millis(500), false));
        assert!(parse_poll("epoch=1&since=2&cursor=0&timeout_ms=5&tiers=1").unwrap().tiers);
        assert!(parse_poll("epoch=1&since=2&cursor=0").unwrap_err().contains("timeout_ms"));
        assert!(parse_poll("epoch=x&since=2&cursor=0&timeout_ms=1").unwrap_err().contains("epoch"));
        assert!(parse_poll("epoch=-1&since=2&cursor=0&timeout_ms=1").is_err());
        // The linger: none by default, at most 1 s.
        assert_eq!(p.linger, Duration::ZERO);
        let linger = |q: &str| parse_poll(q).unwrap().linger;
        assert_eq!(linger("epoch=1&since=2&cursor=0&timeout_ms=500&linger_ms=5"), Duration::from_millis(5));
        assert_eq!(linger("epoch=1&since=2&cursor=0&timeout_ms=500&linger_ms=5000"), Duration::from_secs(1));
        assert!(parse_poll("epoch=1&since=2&cursor=0&timeout_ms=5&linger_ms=x").is_err());
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("%5Bfd00%3A%3A5%5D:8000"), "[fd00::5]:8000");
        assert_eq!(percent_decode("10.0.0.1:80"), "10.0.0.1:80");
        assert_eq!(percent_decode("bad%zz%4"), "bad%zz%4");
        assert_eq!(percent_decode("é%é%41"), "é%éA");
    }
}
