//! The HTTP filter: per request, route by KV cost and release in-flight blocks at the end.

use super::host::{self, BatchedCounter, HostStore};
use crate::config::FilterConfig;
use crate::router::{Decision, Fallback, Held, Router, TokenSource};
use crate::tokens::{TokenEncoding, TokenError};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

/// Envoy stats (`wasmcustom.kvroute.*`), defined once per VM, flushed to the host every
/// [`FLUSH_EVERY`] requests and on the root context's tick.
struct Metrics {
    requests: BatchedCounter,
    scored: BatchedCounter,
    fallback: Vec<(Fallback, BatchedCounter)>,
    token_errors: Vec<(&'static str, BatchedCounter)>,
    blocks_requested: BatchedCounter,
    blocks_hit: BatchedCounter,
    layout_errors: BatchedCounter,
    update_failures: BatchedCounter,
    shared_reads: BatchedCounter,
    prefill_releases: BatchedCounter,
    spilled: BatchedCounter,
    kept_on_holder: BatchedCounter,
    unflushed: Cell<u32>,
}

const FLUSH_EVERY: u32 = 64;
pub const FLUSH_PERIOD: Duration = Duration::from_millis(100);

impl Metrics {
    fn define() -> Metrics {
        Metrics {
            requests: BatchedCounter::new("kvroute.requests"),
            scored: BatchedCounter::new("kvroute.scored"),
            fallback: Fallback::ALL
                .iter()
                .map(|f| (*f, BatchedCounter::new(&format!("kvroute.fallback.{}", f.name()))))
                .collect(),
            token_errors: TokenError::REASONS
                .iter()
                .map(|r| (*r, BatchedCounter::new(&format!("kvroute.token_errors.{r}"))))
                .collect(),
            blocks_requested: BatchedCounter::new("kvroute.blocks_requested"),
            blocks_hit: BatchedCounter::new("kvroute.blocks_hit"),
            layout_errors: BatchedCounter::new("kvroute.layout_errors"),
            update_failures: BatchedCounter::new("kvroute.update_failures"),
            shared_reads: BatchedCounter::new("kvroute.shared_reads"),
            prefill_releases: BatchedCounter::new("kvroute.prefill_releases"),
            spilled: BatchedCounter::new("kvroute.spilled"),
            kept_on_holder: BatchedCounter::new("kvroute.kept_on_holder"),
            unflushed: Cell::new(0),
        }
    }

    fn record(&self, d: &Decision) {
        self.requests.inc();
        match d.fallback {
            None => self.scored.inc(),
            Some(f) => {
                if let Some((_, m)) = self.fallback.iter().find(|(k, _)| *k == f) {
                    m.inc();
                }
            }
        }
        if let Some(e) = &d.token_error {
            if let Some((_, m)) = self.token_errors.iter().find(|(k, _)| *k == e.reason()) {
                m.inc();
            }
        }
        self.blocks_requested.add(u64::from(d.request_blocks));
        self.blocks_hit.add(u64::from(d.hits));
        self.layout_errors.add(u64::from(d.layout_errors));
        self.update_failures.add(u64::from(d.update_failures));
        self.shared_reads.add(u64::from(d.shared_reads));
        self.spilled.add(u64::from(d.spilled));
        self.kept_on_holder.add(u64::from(d.kept_on_holder));
        let n = self.unflushed.get() + 1;
        self.unflushed.set(n);
        if n >= FLUSH_EVERY {
            self.flush();
        }
    }

    fn flush(&self) {
        self.unflushed.set(0);
        let all = [
            &self.requests,
            &self.scored,
            &self.blocks_requested,
            &self.blocks_hit,
            &self.layout_errors,
            &self.update_failures,
            &self.shared_reads,
            &self.prefill_releases,
            &self.spilled,
            &self.kept_on_holder,
        ];
        for c in
            all.into_iter().chain(self.fallback.iter().map(|(_, c)| c)).chain(self.token_errors.iter().map(|(_, c)| c))
        {
            c.flush();
        }
    }
}

/// Finished streams whose blocks are released together: one update per bucket and one of
/// the load for the whole batch instead of per stream. A stream's blocks stay counted in
/// flight until its batch goes, at most [`FLUSH_PERIOD`] after it ended.
const RELEASE_BATCH: usize = 64;

/// State shared by the streams of one VM (one Envoy worker thread: no locking needed).
struct Shared {
    cfg: FilterConfig,
    router: RefCell<Router>,
    metrics: Metrics,
    ended: RefCell<Vec<Held>>,
    /// Requests that met an undecodable shared-data value or a failed update.
    problems_seen: Cell<u64>,
    /// xorshift state for tie-breaking requests without blocks.
    entropy: Cell<u64>,
}

pub struct FilterRoot {
    shared: Rc<Shared>,
}

impl FilterRoot {
    pub fn configure(config: &[u8]) -> Option<FilterRoot> {
        match FilterConfig::from_json(config) {
            Ok(cfg) => {
                log::info!(
                    "kvroute: filter configured: mode {:?}, block_size {}, overlap_weight {}, predict_on_route {}",
                    cfg.mode,
                    cfg.block_size,
                    cfg.overlap_weight,
                    cfg.predict_on_route
                );
                let seed = host::now_ms() | 1;
                Some(FilterRoot {
                    shared: Rc::new(Shared {
                        router: RefCell::new(Router::new(cfg.clone())),
                        cfg,
                        metrics: Metrics::define(),
                        ended: RefCell::new(Vec::new()),
                        problems_seen: Cell::new(0),
                        entropy: Cell::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                    }),
                })
            }
            Err(e) => {
                log::error!("kvroute: refusing filter configuration: {e}");
                None
            }
        }
    }

    /// Releases the streams that ended since the last tick and pushes collected stats to
    /// the host (on the root context's tick, and when the VM shuts down).
    pub fn flush(&self) {
        self.shared.release_ended();
        self.shared.metrics.flush();
    }

    pub fn new_stream(&self, _context_id: u32) -> Stream {
        Stream { shared: Rc::clone(&self.shared), held: None, debug: None }
    }
}

pub struct Stream {
    shared: Rc<Shared>,
    held: Option<Held>,
    debug: Option<String>,
}

impl Shared {
    fn release_ended(&self) {
        let ended = match self.ended.try_borrow_mut() {
            Ok(mut e) => std::mem::take(&mut *e),
            Err(_) => return,
        };
        if ended.is_empty() {
            return;
        }
        if let Ok(router) = self.router.try_borrow() {
            let failures = router.release_all(&HostStore, &ended, host::now_ms());
            self.metrics.update_failures.add(u64::from(failures));
        }
    }
}

impl Stream {
    fn next_entropy(&self) -> u64 {
        let mut x = self.shared.entropy.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.shared.entropy.set(x);
        x
    }

    /// Queues this stream's blocks for release (see [`RELEASE_BATCH`]).
    fn release(&mut self) {
        if let Some(held) = self.held.take() {
            let full = match self.shared.ended.try_borrow_mut() {
                Ok(mut ended) => {
                    ended.push(held);
                    ended.len() >= RELEASE_BATCH
                }
                // Not reachable (one thread, no re-entry); the lease would reclaim it.
                Err(_) => false,
            };
            if full {
                self.shared.release_ended();
            }
        }
    }
}

impl Context for Stream {
    fn on_done(&mut self) -> bool {
        self.release();
        true
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let shared = Rc::clone(&self.shared);
        let cfg = &shared.cfg;
        let Ok(mut router) = shared.router.try_borrow_mut() else { return Action::Continue };
        // No client picks its own host or forges a decision.
        for h in cfg.routing_headers() {
            host::remove_request_header(h);
        }
        let b64 = host::request_header(&cfg.token_header_b64);
        let dec = if b64.is_none() { host::request_header(&cfg.token_header) } else { None };
        // The namespace headers matter only for a prompt with tokens: read them then.
        let (lora, salt) = if b64.is_some() || dec.is_some() {
            (
                cfg.lora_header.as_deref().and_then(host::request_header),
                cfg.cache_salt_header.as_deref().and_then(host::request_header),
            )
        } else {
            (None, None)
        };
        let namespace = crate::hash::namespace(lora.as_deref(), salt.as_deref());
        let tokens = match (&b64, &dec) {
            (Some(v), _) => TokenSource::Header { value: v, encoding: TokenEncoding::Base64LeU32, namespace },
            (None, Some(v)) => TokenSource::Header { value: v, encoding: TokenEncoding::Decimal, namespace },
            (None, None) => TokenSource::Missing,
        };
        let entropy = self.next_entropy();
        let d = router.route(&HostStore, tokens, host::now_ms(), entropy);
        drop(router);

        if let Some(e) = &d.token_error {
            log::debug!("kvroute: token header not usable ({e}); routing by load");
        }
        if !d.destinations.is_empty() {
            host::set_request_header(&cfg.destination_header, &d.destinations.join(","));
        }
        if let Some(p) = &d.prefiller {
            host::set_request_header(&cfg.prefiller_header, p);
        }
        if !cfg.forward_token_headers {
            // Removing costs a host call: skip headers known to be absent (the decimal one
            // is not read when the base64 one is present, so it may still be there).
            if b64.is_some() {
                host::remove_request_header(&cfg.token_header_b64);
            }
            if b64.is_some() || dec.is_some() {
                host::remove_request_header(&cfg.token_header);
            }
            for (read, name) in [(&lora, &cfg.lora_header), (&salt, &cfg.cache_salt_header)] {
                if let (Some(_), Some(name)) = (read, name) {
                    host::remove_request_header(name);
                }
            }
        }
        self.shared.metrics.record(&d);
        if d.layout_errors > 0 || d.update_failures > 0 {
            self.shared.problems_seen.set(self.shared.problems_seen.get() + 1);
            // Logged at 1, 2, 4, 8… occurrences: visible, never a flood.
            if self.shared.problems_seen.get().is_power_of_two() {
                log::warn!(
                    "kvroute: {} shared-data values did not decode, {} in-flight updates gave up \
                     (occurrence {}; see kvroute.layout_errors / kvroute.update_failures)",
                    d.layout_errors,
                    d.update_failures,
                    self.shared.problems_seen.get()
                );
            }
        }
        if cfg.debug_header.is_some() {
            self.debug = Some(d.debug_value());
        }
        if !d.held.is_empty() {
            self.held = Some(d.held);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        // The first response bytes: engines send headers before prefill and the first
        // token after it, so the request's prefill is over. The release is the only host
        // work here (a non-streaming answer's first bytes are its end).
        if body_size > 0 {
            if let Some(held) = self.held.as_mut().filter(|h| h.prefilling()) {
                if let Ok(router) = self.shared.router.try_borrow() {
                    let (reads, failures) = router.end_prefill(&HostStore, held, host::now_ms());
                    let m = &self.shared.metrics;
                    m.prefill_releases.inc();
                    m.shared_reads.add(u64::from(reads));
                    m.update_failures.add(u64::from(failures));
                }
            }
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let (Some(v), Some(name)) = (&self.debug, &self.shared.cfg.debug_header) {
            host::add_response_header(name, v);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        // Runs for every stream end: completion, client abort, upstream reset.
        self.release();
    }
}
