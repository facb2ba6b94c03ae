//! The HTTP filter's policy, host-independent: per request, strip the headers clients may
//! not set, read the token header, route, set the destination; release the request's
//! in-flight blocks when its stream ends. A host (the proxy-wasm glue, a native module)
//! calls these hooks from its own callbacks and owns nothing else.
//!
//! One [`Filter`] serves the streams of one Envoy worker thread; its per-request state is
//! a [`Stream`] the host keeps beside its own stream context.

use crate::cachekey::key_hash;
use crate::config::{ConfigError, DestinationVia, FilterConfig};
use crate::hash::namespace;
use crate::host::{BatchedCounter, Host, RequestHeaders, Stats};
use crate::router::{Decision, Fallback, Held, Router, TokenSource};
use crate::tokens::{TokenEncoding, TokenError};
use std::time::Duration;

/// Stats reach the host every this many requests, and on every tick (a host without ticks:
/// after every request, [`Host::ticks`]).
const FLUSH_EVERY: u32 = 64;

/// The host's tick period for [`Filter::flush`].
pub const FLUSH_PERIOD: Duration = Duration::from_millis(100);

/// Finished streams whose blocks are released together: one update per bucket and one of
/// the load for the whole batch instead of per stream. A stream's blocks stay counted in
/// flight until its batch goes, at most [`FLUSH_PERIOD`] after it ended. A host without
/// ticks releases each stream as it ends.
const RELEASE_BATCH: usize = 64;

/// Envoy stats (`kvroute.*` under the build's prefix), defined once, batched in the filter.
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
    memory_limited: BatchedCounter,
    kept_on_holder: BatchedCounter,
    least_cached: BatchedCounter,
    new_cache_keys: BatchedCounter,
    redecided: BatchedCounter,
    override_refused: BatchedCounter,
    unflushed: u32,
}

impl Metrics {
    fn define(stats: &dyn Stats) -> Metrics {
        let counter = |name: &str| BatchedCounter::define(stats, name);
        Metrics {
            requests: counter("kvroute.requests"),
            scored: counter("kvroute.scored"),
            fallback: Fallback::ALL.iter().map(|f| (*f, counter(&format!("kvroute.fallback.{}", f.name())))).collect(),
            token_errors: TokenError::REASONS
                .iter()
                .map(|r| (*r, counter(&format!("kvroute.token_errors.{r}"))))
                .collect(),
            blocks_requested: counter("kvroute.blocks_requested"),
            blocks_hit: counter("kvroute.blocks_hit"),
            layout_errors: counter("kvroute.layout_errors"),
            update_failures: counter("kvroute.update_failures"),
            shared_reads: counter("kvroute.shared_reads"),
            prefill_releases: counter("kvroute.prefill_releases"),
            spilled: counter("kvroute.spilled"),
            memory_limited: counter("kvroute.memory_limited"),
            kept_on_holder: counter("kvroute.kept_on_holder"),
            least_cached: counter("kvroute.least_cached"),
            new_cache_keys: counter("kvroute.new_cache_keys"),
            redecided: counter("kvroute.redecided"),
            override_refused: counter("kvroute.upstream_override_refused"),
            unflushed: 0,
        }
    }

    /// Counts one routed request; returns whether the batch is full.
    fn record(&mut self, d: &Decision) -> bool {
        self.requests.inc();
        match d.fallback {
            None => self.scored.inc(),
            Some(f) => {
                if let Some((_, m)) = self.fallback.iter_mut().find(|(k, _)| *k == f) {
                    m.inc();
                }
            }
        }
        if let Some(e) = &d.token_error {
            if let Some((_, m)) = self.token_errors.iter_mut().find(|(k, _)| *k == e.reason()) {
                m.inc();
            }
        }
        self.blocks_requested.add(u64::from(d.request_blocks));
        self.blocks_hit.add(u64::from(d.hits));
        self.layout_errors.add(u64::from(d.layout_errors));
        self.update_failures.add(u64::from(d.update_failures));
        self.shared_reads.add(u64::from(d.shared_reads));
        self.spilled.add(u64::from(d.spilled));
        self.memory_limited.add(u64::from(d.memory_limited));
        self.kept_on_holder.add(u64::from(d.kept_on_holder));
        self.least_cached.add(u64::from(d.least_cached));
        self.new_cache_keys.add(u64::from(d.new_cache_key));
        self.redecided.add(u64::from(d.redecided));
        self.unflushed += 1;
        self.unflushed >= FLUSH_EVERY
    }

    fn flush(&mut self, stats: &dyn Stats) {
        self.unflushed = 0;
        let singles = [
            &mut self.requests,
            &mut self.scored,
            &mut self.blocks_requested,
            &mut self.blocks_hit,
            &mut self.layout_errors,
            &mut self.update_failures,
            &mut self.shared_reads,
            &mut self.prefill_releases,
            &mut self.spilled,
            &mut self.memory_limited,
            &mut self.kept_on_holder,
            &mut self.least_cached,
            &mut self.new_cache_keys,
            &mut self.redecided,
            &mut self.override_refused,
        ];
        let by_kind = self.fallback.iter_mut().map(|(_, c)| c).chain(self.token_errors.iter_mut().map(|(_, c)| c));
        for c in singles.into_iter().chain(by_kind) {
            c.flush(stats);
        }
    }
}

/// One request's state between its hooks.
#[derive(Debug, Default)]
pub struct Stream {
    held: Option<Held>,
    /// The debug response header's value, when configured.
    debug: Option<String>,
    /// With [`DestinationVia::UpstreamOverride`]: the worker to hand Envoy, and the whole
    /// ranked list (the header then carries only the rest).
    upstream_override: Option<(String, String)>,
}

impl Stream {
    /// The upstream host the host should ask Envoy for ("ip:port"), if any.
    pub fn upstream_override(&self) -> Option<&str> {
        self.upstream_override.as_ref().map(|(best, _)| best.as_str())
    }
}

/// The filter of one Envoy worker thread.
pub struct Filter<H: Host> {
    host: H,
    cfg: FilterConfig,
    router: Router,
    metrics: Metrics,
    /// Ended streams whose blocks wait for the next release batch.
    ended: Vec<Held>,
    /// Requests that met an undecodable shared-data value or a failed update.
    problems_seen: u64,
    /// Upstream overrides Envoy refused.
    refusals_seen: u64,
    /// xorshift state for tie-breaking requests without blocks.
    entropy: u64,
    /// [`Host::ticks`], read once.
    ticks: bool,
}

impl<H: Host> Filter<H> {
    /// Validates the plugin configuration (JSON); a bad one refuses to load. `seed`: any
    /// varying number (the time will do), for tie-breaks between equal workers.
    pub fn configure(host: H, config: &[u8], seed: u64) -> Result<Filter<H>, ConfigError> {
        let cfg = FilterConfig::from_json(config)?;
        if cfg.destination_via == DestinationVia::UpstreamOverride && !host.overrides_upstream() {
            return Err(ConfigError(
                "`destination_via`: \"upstream_override\" needs the native build (an Envoy dynamic module); \
                 proxy-wasm cannot set the upstream host: use \"header\""
                    .into(),
            ));
        }
        log::info!(
            "kvroute: filter configured: mode {:?}, block_size {}, overlap_weight {}, predict_on_route {}",
            cfg.mode,
            cfg.block_size,
            cfg.overlap_weight,
            cfg.predict_on_route
        );
        Ok(Filter {
            metrics: Metrics::define(&host),
            ticks: host.ticks(),
            router: Router::new(cfg.clone()),
            cfg,
            host,
            ended: Vec::new(),
            problems_seen: 0,
            refusals_seen: 0,
            // xorshift needs a nonzero state.
            entropy: (seed | 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        })
    }

    pub fn host(&self) -> &H {
        &self.host
    }

    /// The request's headers are complete: route it. Sets the destination (and prefiller)
    /// header, removes what clients may not send and, unless configured to forward them,
    /// the token headers.
    pub fn on_request_headers(&mut self, headers: &mut dyn RequestHeaders) -> Stream {
        let cfg = &self.cfg;
        // No client picks its own host or forges a decision.
        for h in cfg.routing_headers() {
            headers.remove(h);
        }
        let b64 = headers.get(&cfg.token_header_b64);
        let dec = if b64.is_none() { headers.get(&cfg.token_header) } else { None };
        // The namespace headers matter only for a prompt with tokens: read them then.
        let (lora, salt) = if b64.is_some() || dec.is_some() {
            (
                cfg.lora_header.as_deref().and_then(|h| headers.get(h)),
                cfg.cache_salt_header.as_deref().and_then(|h| headers.get(h)),
            )
        } else {
            (None, None)
        };
        let ns = namespace(lora.as_deref(), salt.as_deref());
        let tokens = match (&b64, &dec) {
            (Some(v), _) => TokenSource::Header { value: v, encoding: TokenEncoding::Base64LeU32, namespace: ns },
            (None, Some(v)) => TokenSource::Header { value: v, encoding: TokenEncoding::Decimal, namespace: ns },
            (None, None) => TokenSource::Missing,
        };
        let cache_key = cfg.cache_key_header.as_deref().and_then(|h| headers.get(h));
        let entropy = xorshift(&mut self.entropy);
        let key_hash = cache_key.as_deref().filter(|k| !k.is_empty()).map(key_hash);
        let d = self.router.route_keyed(self.host.store(), tokens, key_hash, self.host.now_ms(), entropy);

        if let Some(e) = &d.token_error {
            log::debug!("kvroute: token header not usable ({e}); routing by load");
        }
        let mut upstream_override = None;
        match (cfg.destination_via, d.destinations.split_first()) {
            (_, None) => {}
            (DestinationVia::Header, Some(_)) => headers.set(&cfg.destination_header, &d.destinations.join(",")),
            (DestinationVia::UpstreamOverride, Some((best, rest))) => {
                // The first attempt goes to `best` directly; Envoy's retries skip the
                // override and ask the cluster's policy, which reads the rest in order.
                if !rest.is_empty() {
                    headers.set(&cfg.destination_header, &rest.join(","));
                }
                upstream_override = Some((best.clone(), d.destinations.join(",")));
            }
        }
        if let Some(p) = &d.prefiller {
            headers.set(&cfg.prefiller_header, p);
        }
        if !cfg.forward_token_headers {
            // Removing costs a host call: skip headers known to be absent (the decimal one
            // is not read when the base64 one is present, so it may still be there).
            if b64.is_some() {
                headers.remove(&cfg.token_header_b64);
            }
            if b64.is_some() || dec.is_some() {
                headers.remove(&cfg.token_header);
            }
            for (read, name) in
                [(&lora, &cfg.lora_header), (&salt, &cfg.cache_salt_header), (&cache_key, &cfg.cache_key_header)]
            {
                if let (Some(_), Some(name)) = (read, name) {
                    headers.remove(name);
                }
            }
        }
        if self.metrics.record(&d) || !self.ticks {
            self.metrics.flush(&self.host);
        }
        if d.layout_errors > 0 || d.update_failures > 0 {
            self.problems_seen += 1;
            // Logged at 1, 2, 4, 8… occurrences: visible, never a flood.
            if self.problems_seen.is_power_of_two() {
                log::warn!(
                    "kvroute: {} shared-data values did not decode, {} in-flight updates gave up \
                     (occurrence {}; see kvroute.layout_errors / kvroute.update_failures)",
                    d.layout_errors,
                    d.update_failures,
                    self.problems_seen
                );
            }
        }
        Stream {
            debug: cfg.debug_header.is_some().then(|| d.debug_value()),
            held: (!d.held.is_empty()).then_some(d.held),
            upstream_override,
        }
    }

    /// Envoy refused the stream's upstream override (an id that is not an IP address and
    /// port): the whole ranking goes in the destination header instead, counted.
    pub fn on_upstream_override_refused(&mut self, stream: &mut Stream, headers: &mut dyn RequestHeaders) {
        if let Some((best, all)) = stream.upstream_override.take() {
            headers.set(&self.cfg.destination_header, &all);
            self.metrics.override_refused.inc();
            self.refusals_seen += 1;
            // Logged at 1, 2, 4, 8… occurrences, as the shared-data problems.
            if self.refusals_seen.is_power_of_two() {
                log::warn!(
                    "kvroute: Envoy refused {best:?} as the upstream host (not an IP address and port?); routing \
                     by the destination header (occurrence {}; see kvroute.upstream_override_refused)",
                    self.refusals_seen
                );
            }
            if !self.ticks {
                self.metrics.flush(&self.host);
            }
        }
    }

    /// Response body bytes arrived. The first ones end the request's prefill: engines
    /// send headers before prefill and the first token after it (a non-streaming answer's
    /// first bytes are its end).
    pub fn on_response_body(&mut self, stream: &mut Stream, body_size: usize) {
        if body_size == 0 {
            return;
        }
        if let Some(held) = stream.held.as_mut().filter(|h| h.prefilling()) {
            let (reads, failures) = self.router.end_prefill(self.host.store(), held, self.host.now_ms());
            let m = &mut self.metrics;
            m.prefill_releases.inc();
            m.shared_reads.add(u64::from(reads));
            m.update_failures.add(u64::from(failures));
            if !self.ticks {
                m.flush(&self.host);
            }
        }
    }

    /// The response header to add when the debug header is configured: name and value.
    pub fn debug_header<'a>(&'a self, stream: &'a Stream) -> Option<(&'a str, &'a str)> {
        Some((self.cfg.debug_header.as_deref()?, stream.debug.as_deref()?))
    }

    /// The stream ended, however it ended (completion, client abort, upstream reset):
    /// queues its blocks for release. Calling it again does nothing.
    pub fn on_stream_end(&mut self, stream: &mut Stream) {
        if let Some(held) = stream.held.take() {
            self.ended.push(held);
            if !self.ticks {
                self.flush();
            } else if self.ended.len() >= RELEASE_BATCH {
                self.release_ended();
            }
        }
    }

    /// Releases the streams that ended since the last call and pushes collected stats to
    /// the host: on every tick ([`FLUSH_PERIOD`]) and when the host shuts the filter down,
    /// so nothing stays counted in flight.
    pub fn flush(&mut self) {
        self.release_ended();
        self.metrics.flush(&self.host);
    }

    fn release_ended(&mut self) {
        if self.ended.is_empty() {
            return;
        }
        let failures = self.router.release_all(self.host.store(), &self.ended, self.host.now_ms());
        self.ended.clear();
        self.metrics.update_failures.add(u64::from(failures));
    }
}

/// The next number of a xorshift sequence (its state must not be 0).
fn xorshift(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    x
}

#[cfg(test)]
mod tests;
