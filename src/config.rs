//! Plugin configuration, validated once at `on_configure` into typed form.
//!
//! Both configurations are JSON objects. Unknown keys and out-of-range values are errors:
//! the plugin refuses to load with a log line naming the key, instead of running with a
//! setting the operator did not mean. Every key has a default, so `{}` is valid.
//! Reference: `docs/configuration.md`.

use crate::hash::DEFAULT_BLOCK_SIZE;
use crate::layout::DEFAULT_BUCKETS;
use crate::score::Weights;
use serde::Deserialize;
use std::fmt;

/// A configuration that must not load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn bad(key: &str, why: impl fmt::Display) -> ConfigError {
    ConfigError(format!("`{key}`: {why}"))
}

fn parse_json<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, ConfigError> {
    // An absent configuration means all defaults.
    let text = std::str::from_utf8(bytes).map_err(|_| ConfigError("configuration is not UTF-8".into()))?;
    let text = if text.trim().is_empty() { "{}" } else { text };
    // serde names the key only for unknown fields; the path names it for a bad value too
    // (`-1` where a count goes, a misspelt variant), so the log line says what to fix.
    let mut de = serde_json::Deserializer::from_str(text);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        match path.as_str() {
            "." => ConfigError(format!("invalid configuration: {}", e.inner())),
            _ => ConfigError(format!("invalid configuration: `{path}`: {}", e.inner())),
        }
    })?;
    de.end().map_err(|e| ConfigError(format!("invalid configuration: {e}")))?;
    Ok(value)
}

/// How requests are placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// One worker does prefill and decode; candidates are workers of role `both`.
    Aggregated,
    /// Prefill/decode disaggregation: a prefill worker (role `prefill` or `both`) chosen
    /// with the prefill weight is named in the prefiller header; the decode worker (role
    /// `decode` or `both`) chosen with the decode weight is the destination.
    Pd,
}

/// How the chosen worker reaches Envoy's load balancer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DestinationVia {
    /// The ranked list in `destination_header`, for the cluster's `override_host` policy
    /// (every build).
    Header,
    /// The best worker through Envoy's upstream override host (the native build only: no
    /// proxy-wasm call exists for it), the rest of the ranking in `destination_header` for
    /// retries. Works on a cluster with any load-balancing policy.
    UpstreamOverride,
}

/// What `active_blocks(w)` in the cost function counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActiveBlocks {
    /// The load `w` would carry with this request added: its distinct in-flight prompt
    /// blocks plus the request's blocks not already in flight there.
    Potential,
    /// `w`'s distinct in-flight prompt blocks as they are. With `prefill_load_weight` 0
    /// this is the specification's formula read literally.
    InFlight,
}

/// The memory limit's capacity ([`crate::score`]): the KV blocks each engine holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCapacity {
    /// No memory limit (`null`).
    Off,
    /// Each engine's own, as the sync service learned it from its evictions (`"learned"`,
    /// the default); no limit on an engine that has not evicted yet.
    Learned,
    /// Every engine holds this many blocks (a positive integer).
    Blocks(u32),
}

impl<'de> Deserialize<'de> for KvCapacity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = KvCapacity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a block count, \"learned\" or null")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<KvCapacity, E> {
                u32::try_from(v)
                    .map(KvCapacity::Blocks)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(v), &self))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<KvCapacity, E> {
                u64::try_from(v)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<KvCapacity, E> {
                match v {
                    "learned" => Ok(KvCapacity::Learned),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// How a tie between equally cheap workers with as many cache hits is broken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TieBreak {
    /// For a prompt no worker holds or carries any block of: the worker holding the fewest
    /// blocks (the sync service's count from the index), then the rendezvous hash. Costs
    /// one more shared-data read, on such ties only. Every other tie: the hash.
    LeastCached,
    /// The rendezvous hash of the request's first block and the worker alone.
    Hash,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawFilterConfig {
    token_header: String,
    token_header_b64: String,
    max_tokens: usize,
    block_size: usize,
    overlap_weight: f64,
    prefill_overlap_weight: Option<f64>,
    decode_overlap_weight: Option<f64>,
    mode: Mode,
    destination_header: String,
    destination_via: DestinationVia,
    prefiller_header: String,
    max_endpoints: usize,
    predict_on_route: bool,
    prediction_ttl_ms: u64,
    inflight_lease_ms: u64,
    debug_header: Option<String>,
    forward_token_headers: bool,
    lora_header: Option<String>,
    cache_salt_header: Option<String>,
    cache_key_header: Option<String>,
    cache_key_spread: Option<f64>,
    cache_key_window_ms: u64,
    cache_key_live_ms: Option<u64>,
    implicit_cache_keys: bool,
    implicit_key_charge_continuations: bool,
    offload_hit_credit: f64,
    active_blocks: ActiveBlocks,
    prefill_load_weight: f64,
    prefill_drain: bool,
    wait_slack_per_hit: Option<f64>,
    idle_wait_slack_per_hit: Option<f64>,
    wait_slack_backlog: Option<f64>,
    wait_slack_own_cap: Option<f64>,
    holder_tie_per_hit: Option<f64>,
    holder_tie_load_slack: Option<f64>,
    kv_capacity_blocks: Option<KvCapacity>,
    tie_break: TieBreak,
    peer_load: bool,
}

impl Default for RawFilterConfig {
    fn default() -> Self {
        RawFilterConfig {
            token_header: "x-prompt-token-ids".into(),
            token_header_b64: "x-prompt-token-ids-b64".into(),
            max_tokens: 131_072,
            block_size: DEFAULT_BLOCK_SIZE,
            overlap_weight: 1.0,
            prefill_overlap_weight: None,
            decode_overlap_weight: None,
            mode: Mode::Aggregated,
            destination_header: "x-gateway-destination-endpoint".into(),
            destination_via: DestinationVia::Header,
            prefiller_header: "x-prefiller-host-port".into(),
            max_endpoints: 3,
            predict_on_route: true,
            prediction_ttl_ms: 2_000,
            inflight_lease_ms: 600_000,
            debug_header: None,
            forward_token_headers: false,
            lora_header: Some("x-kvroute-lora".into()),
            cache_salt_header: Some("x-kvroute-cache-salt".into()),
            cache_key_header: Some("x-kvroute-cache-key".into()),
            cache_key_spread: Some(DEFAULT_CACHE_KEY_SPREAD),
            cache_key_window_ms: 60_000,
            cache_key_live_ms: None,
            implicit_cache_keys: DEFAULT_IMPLICIT_CACHE_KEYS,
            implicit_key_charge_continuations: DEFAULT_IMPLICIT_KEY_CHARGE_CONTINUATIONS,
            offload_hit_credit: DEFAULT_OFFLOAD_HIT_CREDIT,
            active_blocks: ActiveBlocks::Potential,
            prefill_load_weight: DEFAULT_PREFILL_LOAD_WEIGHT,
            prefill_drain: DEFAULT_PREFILL_DRAIN,
            wait_slack_per_hit: Some(DEFAULT_WAIT_SLACK_PER_HIT),
            idle_wait_slack_per_hit: Some(DEFAULT_IDLE_WAIT_SLACK_PER_HIT),
            wait_slack_backlog: Some(DEFAULT_WAIT_SLACK_BACKLOG),
            wait_slack_own_cap: Some(DEFAULT_WAIT_SLACK_OWN_CAP),
            holder_tie_per_hit: Some(DEFAULT_HOLDER_TIE_PER_HIT),
            holder_tie_load_slack: None,
            kv_capacity_blocks: Some(KvCapacity::Learned),
            tie_break: TieBreak::LeastCached,
            peer_load: false,
        }
    }
}

/// The filter's configuration (`root_id` `kvroute`).
#[derive(Clone, Debug, PartialEq)]
pub struct FilterConfig {
    /// Header with decimal comma-separated token ids.
    pub token_header: String,
    /// Header with base64 little-endian `u32` token ids; read first when both are present.
    pub token_header_b64: String,
    pub max_tokens: usize,
    pub block_size: usize,
    pub overlap_weight: f64,
    /// Prefill weight in PD mode (falls back to `overlap_weight`).
    pub prefill_overlap_weight: f64,
    /// Decode weight in PD mode (falls back to `overlap_weight`).
    pub decode_overlap_weight: f64,
    pub mode: Mode,
    pub destination_header: String,
    pub destination_via: DestinationVia,
    pub prefiller_header: String,
    /// Length of the ranked destination list (the first is the choice, the rest are what
    /// Envoy's retries try next).
    pub max_endpoints: usize,
    /// Count routed blocks as cached on the chosen worker until events confirm them.
    pub predict_on_route: bool,
    pub prediction_ttl_ms: u64,
    pub inflight_lease_ms: u64,
    /// Response header naming the chosen worker, its cache hits and cost; off when `None`.
    pub debug_header: Option<String>,
    /// Forward the token (and namespace) headers upstream. Off by default: engines do not
    /// need them, and a long prompt's header can exceed the engine's own header limit.
    pub forward_token_headers: bool,
    /// Header naming the request's LoRA adapter (as the engine names it: vLLM's
    /// `lora_name`); its blocks live in their own namespace. `None`: not read.
    pub lora_header: Option<String>,
    /// Header carrying the request's cache salt (vLLM's `cache_salt`). `None`: not read.
    pub cache_salt_header: Option<String>,
    /// Header carrying the request's cache key ([`crate::cachekey`]: OpenAI's
    /// `prompt_cache_key`, which the stage copies here). `None`: not read.
    pub cache_key_header: Option<String>,
    /// What the first request of a cache key new to the router is charged on a worker for
    /// each key live there, in the request's blocks ([`crate::cachekey`]). `None`: keys are
    /// not read.
    pub cache_key_spread: Option<f64>,
    /// How long a key is remembered after its last request: its next request within this
    /// goes by the plain cost, to where its history is.
    pub cache_key_window_ms: u64,
    /// How long a key counts as live on its worker after its last request (one to two of
    /// these windows). At most `cache_key_window_ms`; by default
    /// [`DEFAULT_CACHE_KEY_LIVE_MS`] or the window if shorter.
    pub cache_key_live_ms: u64,
    /// Give requests without a cache key an implicit one when they leave or continue a
    /// shared prefix conversations are seen to grow from ([`crate::cachekey`]). Needs
    /// `cache_key_spread`.
    pub implicit_cache_keys: bool,
    /// Charge a later step whose implicit key the router has not seen (its conversation
    /// began before its anchor was known) for the keys live on each worker, as a new key's
    /// first request is, but per key at its own blocks past the anchor (what it leaves
    /// behind moving to another holder of the anchor): conversations that all started
    /// before any came back are spread evenly when they do. Off: such a step stays by the
    /// plain cost.
    pub implicit_key_charge_continuations: bool,
    /// What a cache hit held only in an offload tier (CPU memory, disk) is worth, against 1
    /// for a GPU hit. In 0..=1.
    pub offload_hit_credit: f64,
    pub active_blocks: ActiveBlocks,
    /// Weight of a worker's outstanding prefill (uncached prompt blocks of requests routed
    /// there whose first response bytes have not come back) in the cost.
    pub prefill_load_weight: f64,
    /// A worker's outstanding prefill counts less what it has computed since it began
    /// draining, at the rate its ended prefills were computed at
    /// ([`crate::layout::SlotLoad::draining_prefill`]), in the cost, the wait limit and the
    /// holder tie; `false`: as charged, until each request's first token.
    pub prefill_drain: bool,
    /// The wait limit ([`crate::score`]): the blocks of extra prefill queueing each cache hit
    /// may buy against the least-waiting worker. `None`: no limit.
    pub wait_slack_per_hit: Option<f64>,
    /// The wait limit's slack while some worker has no prefill outstanding, so that a
    /// request passed over would start at once there. `None`: `wait_slack_per_hit` always.
    /// No effect without `wait_slack_per_hit`.
    pub idle_wait_slack_per_hit: Option<f64>,
    /// The wait limit's growth with the fleet's backlog ([`crate::score`]): with every
    /// worker's prefill queue non-empty, α grows by this much per request's worth of prefill
    /// the quickest worker has outstanding. `None`: α stays. No effect without
    /// `wait_slack_per_hit`.
    pub wait_slack_backlog: Option<f64>,
    /// The wait limit's cap for a request with much of its own to prefill
    /// ([`crate::score`]): while some worker is idle, a hit buys at most this many blocks ÷
    /// the request's own uncached blocks on the worker. `None`: no cap. No effect without
    /// `wait_slack_per_hit`.
    pub wait_slack_own_cap: Option<f64>,
    /// The holder tie ([`crate::score`]): the blocks of extra cost each extra cache hit may
    /// buy when the request would start its prefill no later on the holder. `None`: no tie.
    pub holder_tie_per_hit: Option<f64>,
    /// The holder tie's load test ([`crate::score`]): a holder whose in-flight blocks exceed
    /// the cheapest worker's by at most this many times the request's blocks ties whatever
    /// its cost. `None` (the default): the cost test alone. No effect without
    /// `holder_tie_per_hit`.
    pub holder_tie_load_slack: Option<f64>,
    /// The memory limit ([`crate::score`]): the KV blocks each engine can hold, learned by
    /// default.
    pub kv_capacity_blocks: KvCapacity,
    pub tie_break: TieBreak,
    /// Add the other gateway replicas' load (`crate::peerload`) to this gateway's when
    /// ranking: their in-flight blocks on each worker less the request's cache hits there
    /// (what a peer has in flight on a holder is mostly the prefix the request shares,
    /// which the engine holds once), and their outstanding prefill.
    pub peer_load: bool,
}

/// Loading a block back from CPU memory is several times cheaper than recomputing it but
/// not free (and disk tiers cost more): half a GPU hit.
pub const DEFAULT_OFFLOAD_HIT_CREDIT: f64 = 0.5;

/// Chosen by the routing-quality benchmark (docs/benchmarks.md).
pub const DEFAULT_PREFILL_LOAD_WEIGHT: f64 = 1.0;

/// Chosen by the head-to-head benchmark (docs/benchmarks.md, "The prefill drain"): with
/// the own cap, 2.4 more hit points on a hot prefix and no longer a tail; level elsewhere.
pub const DEFAULT_PREFILL_DRAIN: bool = true;

/// Chosen by the head-to-head benchmark (docs/benchmarks.md, "The wait limit").
pub const DEFAULT_WAIT_SLACK_PER_HIT: f64 = 0.5;

/// Chosen by the head-to-head benchmark (docs/benchmarks.md, "The wait limit"): with an
/// idle worker, 0.5 let a request with a long question wait for a sibling's whole cold
/// prefill (zipf_hot's tail); below ~0.35 a burst of a dozen same-prefix requests splits.
/// Everywhere (not only with an idle worker) 0.45 cost the mocker's zipf_hot its hit rate.
pub const DEFAULT_IDLE_WAIT_SLACK_PER_HIT: f64 = 0.45;

/// Chosen by the head-to-head benchmark (docs/benchmarks.md, "The wait limit", "In a
/// backlog"): at a fixed α the fleet's zipf_busy and the mocker's zipf_hot, past capacity,
/// copied their hot prefix into other queues, each copy prefill the others waited behind.
pub const DEFAULT_WAIT_SLACK_BACKLOG: f64 = 1.0;

/// Chosen by the head-to-head benchmark (docs/benchmarks.md, "The own cap"): with the
/// queue drained at its rate, α let zipf_hot's 64-block questions wait behind their
/// prefix's cold prefill while a worker was idle; 8 caps them at 16 blocks over 128 hits
/// and leaves bursts' 4-block questions (2 a hit) and agent steps' ~18 (0.44) at α.
pub const DEFAULT_WAIT_SLACK_OWN_CAP: f64 = 8.0;

/// Chosen by the head-to-head benchmark (docs/benchmarks.md, "Cache keys").
pub const DEFAULT_CACHE_KEY_SPREAD: f64 = 2.0;

/// Long enough that a session whose requests each take tens of seconds (long outputs, a
/// slow engine) keeps counting while it works: at 10 s, the mocker's agents (steps of
/// ~12 s) dropped out of the counts in flight and a fifth agent landed beside four
/// (docs/benchmarks.md, "Cache keys"). Ended sessions stop counting within two minutes.
pub const DEFAULT_CACHE_KEY_LIVE_MS: u64 = 60_000;

/// Measured (docs/benchmarks.md, "Implicit keys"): the agentic loop without client keys
/// as with them (TTFT p50 89–90 against 91–111 at seeds 1–5); no request of the other
/// five workloads got one.
pub const DEFAULT_IMPLICIT_CACHE_KEYS: bool = true;

/// Off: measured level alone on both simulators; with the memory limit off, +0.7–1.4
/// points on the mocker's agentic loop at seeds 1–3 but level at seeds 4–5, and level on
/// both simulators' other workloads (docs/benchmarks.md, "Implicit keys").
pub const DEFAULT_IMPLICIT_KEY_CHARGE_CONTINUATIONS: bool = false;

/// Chosen by the head-to-head benchmark (docs/benchmarks.md): 0.5 and 1 lose the agentic loop.
pub const DEFAULT_HOLDER_TIE_PER_HIT: f64 = 0.25;

fn header_name(key: &str, v: &str) -> Result<String, ConfigError> {
    let ok = !v.is_empty() && v.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if ok {
        Ok(v.to_string())
    } else {
        Err(bad(key, format!("{v:?} is not a lowercase HTTP header name")))
    }
}

fn weight(key: &str, v: f64) -> Result<f64, ConfigError> {
    if v.is_finite() && (0.0..=1.0e6).contains(&v) {
        Ok(v)
    } else {
        Err(bad(key, format!("{v} is not a weight in [0, 1e6]")))
    }
}

impl FilterConfig {
    pub fn from_json(bytes: &[u8]) -> Result<FilterConfig, ConfigError> {
        let raw: RawFilterConfig = parse_json(bytes)?;
        if !(1..=1024).contains(&raw.block_size) {
            return Err(bad("block_size", format!("{} is not in 1..=1024", raw.block_size)));
        }
        if !(1..=1 << 22).contains(&raw.max_tokens) {
            return Err(bad("max_tokens", format!("{} is not in 1..=4194304", raw.max_tokens)));
        }
        if !(1..=16).contains(&raw.max_endpoints) {
            return Err(bad("max_endpoints", format!("{} is not in 1..=16", raw.max_endpoints)));
        }
        if raw.inflight_lease_ms < 1_000 {
            return Err(bad("inflight_lease_ms", "must be at least 1000"));
        }
        let prefill_load_weight = weight("prefill_load_weight", raw.prefill_load_weight)?;
        let wait_slack_per_hit = raw.wait_slack_per_hit.map(|v| weight("wait_slack_per_hit", v)).transpose()?;
        let idle_wait_slack_per_hit =
            raw.idle_wait_slack_per_hit.map(|v| weight("idle_wait_slack_per_hit", v)).transpose()?;
        let wait_slack_backlog = raw.wait_slack_backlog.map(|v| weight("wait_slack_backlog", v)).transpose()?;
        let wait_slack_own_cap = raw.wait_slack_own_cap.map(|v| weight("wait_slack_own_cap", v)).transpose()?;
        let holder_tie_per_hit = raw.holder_tie_per_hit.map(|v| weight("holder_tie_per_hit", v)).transpose()?;
        let holder_tie_load_slack =
            raw.holder_tie_load_slack.map(|v| weight("holder_tie_load_slack", v)).transpose()?;
        if raw.kv_capacity_blocks == Some(KvCapacity::Blocks(0)) {
            return Err(bad("kv_capacity_blocks", "must be at least 1"));
        }
        let overlap_weight = weight("overlap_weight", raw.overlap_weight)?;
        let prefill = match raw.prefill_overlap_weight {
            Some(v) => weight("prefill_overlap_weight", v)?,
            None => overlap_weight,
        };
        let decode = match raw.decode_overlap_weight {
            Some(v) => weight("decode_overlap_weight", v)?,
            None => overlap_weight,
        };
        let token_header = header_name("token_header", &raw.token_header)?;
        let token_header_b64 = header_name("token_header_b64", &raw.token_header_b64)?;
        let destination_header = header_name("destination_header", &raw.destination_header)?;
        let prefiller_header = header_name("prefiller_header", &raw.prefiller_header)?;
        let optional = |key: &str, h: Option<String>| h.map(|h| header_name(key, &h)).transpose();
        let debug_header = optional("debug_header", raw.debug_header)?;
        let lora_header = optional("lora_header", raw.lora_header)?;
        let cache_salt_header = optional("cache_salt_header", raw.cache_salt_header)?;
        let cache_key_header = optional("cache_key_header", raw.cache_key_header)?;
        let cache_key_spread = raw.cache_key_spread.map(|v| weight("cache_key_spread", v)).transpose()?;
        if !(1_000..=86_400_000).contains(&raw.cache_key_window_ms) {
            return Err(bad("cache_key_window_ms", format!("{} is not in 1000..=86400000", raw.cache_key_window_ms)));
        }
        let cache_key_live_ms = raw.cache_key_live_ms.unwrap_or(DEFAULT_CACHE_KEY_LIVE_MS.min(raw.cache_key_window_ms));
        if !(100..=raw.cache_key_window_ms).contains(&cache_key_live_ms) {
            let why = format!("{cache_key_live_ms} is not in 100..=cache_key_window_ms ({})", raw.cache_key_window_ms);
            return Err(bad("cache_key_live_ms", why));
        }
        // No two settings may name the same header.
        let named = [
            ("token_header", Some(&token_header)),
            ("token_header_b64", Some(&token_header_b64)),
            ("destination_header", Some(&destination_header)),
            ("prefiller_header", Some(&prefiller_header)),
            ("debug_header", debug_header.as_ref()),
            ("lora_header", lora_header.as_ref()),
            ("cache_salt_header", cache_salt_header.as_ref()),
            ("cache_key_header", cache_key_header.as_ref()),
        ];
        for (j, (key, h)) in named.iter().enumerate() {
            let Some(h) = h else { continue };
            if let Some((other, _)) = named[..j].iter().find(|(_, o)| *o == Some(*h)) {
                return Err(bad(key, format!("{h:?} is also `{other}`")));
            }
        }
        Ok(FilterConfig {
            token_header,
            token_header_b64,
            max_tokens: raw.max_tokens,
            block_size: raw.block_size,
            overlap_weight,
            prefill_overlap_weight: prefill,
            decode_overlap_weight: decode,
            mode: raw.mode,
            destination_header,
            destination_via: raw.destination_via,
            prefiller_header,
            max_endpoints: raw.max_endpoints,
            predict_on_route: raw.predict_on_route,
            prediction_ttl_ms: raw.prediction_ttl_ms,
            inflight_lease_ms: raw.inflight_lease_ms,
            debug_header,
            forward_token_headers: raw.forward_token_headers,
            lora_header,
            cache_salt_header,
            cache_key_header,
            cache_key_spread,
            cache_key_window_ms: raw.cache_key_window_ms,
            cache_key_live_ms,
            implicit_cache_keys: raw.implicit_cache_keys,
            implicit_key_charge_continuations: raw.implicit_key_charge_continuations,
            offload_hit_credit: match raw.offload_hit_credit {
                c if (0.0..=1.0).contains(&c) => c,
                c => return Err(bad("offload_hit_credit", format!("{c} is not in 0..=1"))),
            },
            active_blocks: raw.active_blocks,
            prefill_load_weight,
            prefill_drain: raw.prefill_drain,
            wait_slack_per_hit,
            idle_wait_slack_per_hit,
            wait_slack_backlog,
            wait_slack_own_cap,
            holder_tie_per_hit,
            holder_tie_load_slack,
            kv_capacity_blocks: raw.kv_capacity_blocks.unwrap_or(KvCapacity::Off),
            tie_break: raw.tie_break,
            peer_load: raw.peer_load,
        })
    }

    /// The cost's weights for one ranking: `overlap` is the mode's overlap weight, and
    /// `prefills` whether the chosen worker computes the prefill. The wait limit and the
    /// holder tie apply only where it does: a PD decode worker waits for no prefill.
    pub fn weights(&self, overlap: f64, prefills: bool) -> Weights {
        let if_prefills = |v: Option<f64>| v.filter(|_| prefills);
        Weights {
            overlap,
            prefill_load: self.prefill_load_weight,
            offload_hit_credit: self.offload_hit_credit,
            wait_slack_per_hit: if_prefills(self.wait_slack_per_hit),
            idle_wait_slack_per_hit: if_prefills(self.idle_wait_slack_per_hit),
            wait_slack_backlog: if_prefills(self.wait_slack_backlog),
            wait_slack_own_cap: if_prefills(self.wait_slack_own_cap),
            holder_tie_per_hit: if_prefills(self.holder_tie_per_hit),
            holder_tie_load_slack: if_prefills(self.holder_tie_load_slack),
        }
    }

    /// Every request header the filter owns: removed from client requests before routing,
    /// so no client can pick the upstream host or forge a decision.
    pub fn routing_headers(&self) -> impl Iterator<Item = &str> {
        [self.destination_header.as_str(), self.prefiller_header.as_str()]
            .into_iter()
            .chain(self.debug_header.as_deref())
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawSyncConfig {
    feed_cluster: String,
    feed_authority: String,
    feed_path: String,
    poll_timeout_ms: u64,
    feed_linger_ms: u64,
    retry_interval_ms: u64,
    stale_after_ms: u64,
    n_buckets: u32,
    max_frame_bytes: usize,
    load_report_interval_ms: u64,
    load_path: String,
    gateway_id: Option<String>,
}

impl Default for RawSyncConfig {
    fn default() -> Self {
        RawSyncConfig {
            feed_cluster: "kvroute_sidecar".into(),
            feed_authority: "kvroute-sidecar".into(),
            feed_path: "/v1/kv/feed".into(),
            poll_timeout_ms: 5_000,
            feed_linger_ms: DEFAULT_FEED_LINGER_MS,
            retry_interval_ms: 1_000,
            stale_after_ms: 15_000,
            n_buckets: DEFAULT_BUCKETS,
            max_frame_bytes: 64 << 20,
            load_report_interval_ms: DEFAULT_LOAD_REPORT_INTERVAL_MS,
            load_path: "/v1/load".into(),
            gateway_id: None,
        }
    }
}

/// How long the sidecar holds a feed answer once it has a change to send, so that changes
/// close together reach the gateway in one answer: each answer costs Envoy's main thread a
/// whole callout, 0.13-0.5 ms of CPU (docs/benchmarks.md, "The feed's linger").
pub const DEFAULT_FEED_LINGER_MS: u64 = 2;

/// How often the sync service reports its gateway's load and reads the other gateways'.
pub const DEFAULT_LOAD_REPORT_INTERVAL_MS: u64 = 100;

/// The sync service's configuration (`root_id` `kvroute-sync`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncConfig {
    /// Envoy cluster of the sidecar's feed.
    pub feed_cluster: String,
    pub feed_authority: String,
    pub feed_path: String,
    /// How long the sidecar may hold a poll open when nothing changed.
    pub poll_timeout_ms: u64,
    /// How long the sidecar holds an answer once it has a change to send, gathering more:
    /// fewer polls per second, paid in freshness (0: answer at once).
    pub feed_linger_ms: u64,
    /// Wait after a failed poll.
    pub retry_interval_ms: u64,
    /// With no successful poll for this long the index is marked not live and requests are
    /// routed by load only (the last known workers stay routable).
    pub stale_after_ms: u64,
    /// Number of bucket keys. Fixed key space: shared-data keys can never be deleted.
    pub n_buckets: u32,
    /// Largest feed response accepted; a larger one is an error, counted.
    pub max_frame_bytes: usize,
    /// Load shared between gateway replicas (`crate::peerload`): how often this gateway's
    /// load is reported to the sidecar, whose answer is the other gateways' (0: never).
    pub load_report_interval_ms: u64,
    pub load_path: String,
    /// This gateway's name in the reports (`None`: a random one, drawn at start).
    pub gateway_id: Option<String>,
}

impl SyncConfig {
    pub fn from_json(bytes: &[u8]) -> Result<SyncConfig, ConfigError> {
        let raw: RawSyncConfig = parse_json(bytes)?;
        if raw.feed_cluster.is_empty() {
            return Err(bad("feed_cluster", "must not be empty"));
        }
        if raw.feed_authority.is_empty() {
            return Err(bad("feed_authority", "must not be empty"));
        }
        if !raw.feed_path.starts_with('/') || raw.feed_path.contains('?') {
            return Err(bad("feed_path", "must be an absolute path without a query"));
        }
        if !(100..=60_000).contains(&raw.poll_timeout_ms) {
            return Err(bad("poll_timeout_ms", "must be in 100..=60000"));
        }
        if raw.feed_linger_ms > 1_000 {
            return Err(bad("feed_linger_ms", "must be in 0..=1000"));
        }
        if !(10..=60_000).contains(&raw.retry_interval_ms) {
            return Err(bad("retry_interval_ms", "must be in 10..=60000"));
        }
        if raw.stale_after_ms <= raw.poll_timeout_ms {
            return Err(bad("stale_after_ms", "must exceed `poll_timeout_ms`"));
        }
        if !raw.n_buckets.is_power_of_two() || !(16..=1 << 20).contains(&raw.n_buckets) {
            return Err(bad("n_buckets", format!("{} is not a power of two in 16..=1048576", raw.n_buckets)));
        }
        if raw.max_frame_bytes < 4096 {
            return Err(bad("max_frame_bytes", "must be at least 4096"));
        }
        if raw.load_report_interval_ms != 0 && !(100..=10_000).contains(&raw.load_report_interval_ms) {
            return Err(bad("load_report_interval_ms", "must be 0 (off) or in 100..=10000"));
        }
        if !raw.load_path.starts_with('/') || raw.load_path.contains('?') {
            return Err(bad("load_path", "must be an absolute path without a query"));
        }
        if let Some(id) = &raw.gateway_id {
            let printable = id.bytes().all(|b| b.is_ascii_graphic());
            if id.is_empty() || id.len() > crate::peerload::MAX_GATEWAY_ID || !printable {
                return Err(bad("gateway_id", "must be 1 to 128 printable ASCII characters without spaces"));
            }
        }
        Ok(SyncConfig {
            feed_cluster: raw.feed_cluster,
            feed_authority: raw.feed_authority,
            feed_path: raw.feed_path,
            poll_timeout_ms: raw.poll_timeout_ms,
            feed_linger_ms: raw.feed_linger_ms,
            retry_interval_ms: raw.retry_interval_ms,
            stale_after_ms: raw.stale_after_ms,
            n_buckets: raw.n_buckets,
            max_frame_bytes: raw.max_frame_bytes,
            load_report_interval_ms: raw.load_report_interval_ms,
            load_path: raw.load_path,
            gateway_id: raw.gateway_id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn defaults_load_from_empty() {
        let c = FilterConfig::from_json(b"").unwrap();
        assert_eq!(c.block_size, 16);
        assert_eq!(c.overlap_weight, 1.0);
        assert_eq!(c.prefill_overlap_weight, 1.0);
        assert_eq!(c.mode, Mode::Aggregated);
        assert_eq!((c.active_blocks, c.prefill_load_weight), (ActiveBlocks::Potential, DEFAULT_PREFILL_LOAD_WEIGHT));
        assert!(c.prefill_drain && c.wait_slack_own_cap == Some(DEFAULT_WAIT_SLACK_OWN_CAP));
        let charged = FilterConfig::from_json(br#"{"prefill_drain": false, "wait_slack_own_cap": null}"#).unwrap();
        assert_eq!((charged.prefill_drain, charged.wait_slack_own_cap), (false, None));
        assert_eq!(FilterConfig::from_json(b"{}").unwrap(), c);
        let literal = FilterConfig::from_json(br#"{"active_blocks": "in_flight", "prefill_load_weight": 0}"#).unwrap();
        assert_eq!((literal.active_blocks, literal.prefill_load_weight), (ActiveBlocks::InFlight, 0.0));
        assert_eq!(c.lora_header.as_deref(), Some("x-kvroute-lora"));
        let off = FilterConfig::from_json(br#"{"lora_header": null, "cache_salt_header": null}"#).unwrap();
        assert_eq!((off.lora_header, off.cache_salt_header), (None, None));
        assert_eq!(c.wait_slack_per_hit, Some(DEFAULT_WAIT_SLACK_PER_HIT));
        assert_eq!(c.tie_break, TieBreak::LeastCached);
        assert!(!c.peer_load && FilterConfig::from_json(br#"{"peer_load": true}"#).unwrap().peer_load);
        let hash = FilterConfig::from_json(br#"{"tie_break": "hash"}"#).unwrap();
        assert_eq!(hash.tie_break, TieBreak::Hash);
        assert!(FilterConfig::from_json(br#"{"tie_break": "random"}"#).is_err());
        let unlimited = FilterConfig::from_json(br#"{"wait_slack_per_hit": null}"#).unwrap();
        assert_eq!(unlimited.wait_slack_per_hit, None);
        assert_eq!(c.idle_wait_slack_per_hit, Some(DEFAULT_IDLE_WAIT_SLACK_PER_HIT));
        let one = FilterConfig::from_json(br#"{"idle_wait_slack_per_hit": null}"#).unwrap();
        assert_eq!((one.wait_slack_per_hit, one.idle_wait_slack_per_hit), (Some(DEFAULT_WAIT_SLACK_PER_HIT), None));
        assert_eq!(c.wait_slack_backlog, Some(DEFAULT_WAIT_SLACK_BACKLOG));
        let flat = FilterConfig::from_json(br#"{"wait_slack_backlog": null}"#).unwrap();
        assert_eq!((flat.wait_slack_per_hit, flat.wait_slack_backlog), (Some(DEFAULT_WAIT_SLACK_PER_HIT), None));
        assert_eq!(c.holder_tie_per_hit, Some(DEFAULT_HOLDER_TIE_PER_HIT));
        let untied = FilterConfig::from_json(br#"{"holder_tie_per_hit": null}"#).unwrap();
        assert_eq!(untied.holder_tie_per_hit, None);
        assert_eq!(c.holder_tie_load_slack, None);
        let load_test = FilterConfig::from_json(br#"{"holder_tie_load_slack": 1}"#).unwrap();
        assert_eq!(load_test.holder_tie_load_slack, Some(1.0));
        assert_eq!(c.kv_capacity_blocks, KvCapacity::Learned);
        let limited = FilterConfig::from_json(br#"{"kv_capacity_blocks": 512}"#).unwrap();
        assert_eq!(limited.kv_capacity_blocks, KvCapacity::Blocks(512));
        let learned = FilterConfig::from_json(br#"{"kv_capacity_blocks": "learned"}"#).unwrap();
        assert_eq!(learned.kv_capacity_blocks, KvCapacity::Learned);
        let off = FilterConfig::from_json(br#"{"kv_capacity_blocks": null}"#).unwrap();
        assert_eq!(off.kv_capacity_blocks, KvCapacity::Off);
        assert_eq!(c.destination_via, DestinationVia::Header);
        let native = FilterConfig::from_json(br#"{"destination_via": "upstream_override"}"#).unwrap();
        assert_eq!(native.destination_via, DestinationVia::UpstreamOverride);
        let s = SyncConfig::from_json(b" ").unwrap();
        assert_eq!(s.n_buckets, crate::layout::DEFAULT_BUCKETS);
        assert_eq!((s.load_report_interval_ms, s.load_path.as_str(), s.gateway_id), (100, "/v1/load", None));
        assert_eq!(s.feed_linger_ms, DEFAULT_FEED_LINGER_MS);
        let eager = SyncConfig::from_json(br#"{"feed_linger_ms": 0}"#).unwrap();
        assert_eq!(eager.feed_linger_ms, 0);
        let off = SyncConfig::from_json(br#"{"load_report_interval_ms": 0, "gateway_id": "gw-a"}"#).unwrap();
        assert_eq!((off.load_report_interval_ms, off.gateway_id.as_deref()), (0, Some("gw-a")));
    }

    #[test]
    fn a_ranking_takes_the_configured_weights_and_the_wait_terms_only_where_it_prefills() {
        let c = FilterConfig::from_json(br#"{"prefill_load_weight": 0.5, "holder_tie_load_slack": 1}"#).unwrap();
        let w = c.weights(2.0, true);
        assert_eq!((w.overlap, w.prefill_load, w.offload_hit_credit), (2.0, 0.5, DEFAULT_OFFLOAD_HIT_CREDIT));
        assert_eq!(
            (w.wait_slack_per_hit, w.idle_wait_slack_per_hit, w.wait_slack_backlog, w.wait_slack_own_cap),
            (
                Some(DEFAULT_WAIT_SLACK_PER_HIT),
                Some(DEFAULT_IDLE_WAIT_SLACK_PER_HIT),
                Some(DEFAULT_WAIT_SLACK_BACKLOG),
                Some(DEFAULT_WAIT_SLACK_OWN_CAP)
            )
        );
        assert_eq!((w.holder_tie_per_hit, w.holder_tie_load_slack), (Some(DEFAULT_HOLDER_TIE_PER_HIT), Some(1.0)));
        // A PD decode worker: the same cost, no wait limit nor holder tie.
        let d = c.weights(2.0, false);
        assert_eq!(
            (d.overlap, d.prefill_load, d.offload_hit_credit),
            (w.overlap, w.prefill_load, w.offload_hit_credit)
        );
        assert_eq!(
            [d.wait_slack_per_hit, d.idle_wait_slack_per_hit, d.wait_slack_backlog, d.wait_slack_own_cap],
            [None; 4]
        );
        assert_eq!((d.holder_tie_per_hit, d.holder_tie_load_slack), (None, None));
    }

    #[test]
    fn role_weights_fall_back_to_global() {
        let c =
            FilterConfig::from_json(br#"{"overlap_weight": 3, "decode_overlap_weight": 2.0, "mode": "pd"}"#).unwrap();
        assert_eq!((c.prefill_overlap_weight, c.decode_overlap_weight), (3.0, 2.0));
        assert_eq!(c.mode, Mode::Pd);
    }

    #[test]
    fn bad_configs_name_the_key() {
        let cases: &[(&str, &str)] = &[
            (r#"{"overlap_wieght": 1}"#, "overlap_wieght"),
            (r#"{"overlap_weight": -1}"#, "overlap_weight"),
            (r#"{"overlap_weight": "high"}"#, "`overlap_weight`: invalid type"),
            (r#"{"block_size": 0}"#, "block_size"),
            (r#"{"mode": "disagg"}"#, "`mode`: unknown variant"),
            (r#"{"max_endpoints": 0}"#, "max_endpoints"),
            (r#"{"token_header": "X-Tokens"}"#, "token_header"),
            (r#"{"token_header_b64": "x-prompt-token-ids"}"#, "token_header_b64"),
            (r#"{"decode_overlap_weight": 1e9}"#, "decode_overlap_weight"),
            (r#"{"lora_header": "x-prompt-token-ids"}"#, "lora_header"),
            (r#"{"cache_salt_header": "x-kvroute-lora"}"#, "cache_salt_header"),
            (r#"{"lora_header": "Lora"}"#, "lora_header"),
            (r#"{"offload_hit_credit": 1.5}"#, "offload_hit_credit"),
            (r#"{"offload_hit_credit": -0.1}"#, "offload_hit_credit"),
            (r#"{"prefill_load_weight": -2}"#, "prefill_load_weight"),
            (r#"{"prefill_load_weight": null}"#, "`prefill_load_weight`: invalid type"),
            (r#"{"prefill_drain": "yes"}"#, "`prefill_drain`: invalid type"),
            (r#"{"wait_slack_per_hit": -0.5}"#, "wait_slack_per_hit"),
            (r#"{"idle_wait_slack_per_hit": -0.5}"#, "idle_wait_slack_per_hit"),
            (r#"{"wait_slack_backlog": 1e7}"#, "wait_slack_backlog"),
            (r#"{"wait_slack_own_cap": -8}"#, "wait_slack_own_cap"),
            (r#"{"wait_slack_per_hit": "some"}"#, "`wait_slack_per_hit`: invalid type"),
            (r#"{"holder_tie_per_hit": -1}"#, "holder_tie_per_hit"),
            (r#"{"holder_tie_per_hit": "yes"}"#, "`holder_tie_per_hit`: invalid type"),
            (r#"{"holder_tie_load_slack": -1}"#, "holder_tie_load_slack"),
            (r#"{"holder_tie_load_slack": 1e7}"#, "holder_tie_load_slack"),
            (r#"{"kv_capacity_blocks": 0}"#, "kv_capacity_blocks"),
            (r#"{"kv_capacity_blocks": -1}"#, "`kv_capacity_blocks`: invalid value"),
            (r#"{"kv_capacity_blocks": 0.5}"#, "`kv_capacity_blocks`: invalid type"),
            (r#"{"kv_capacity_blocks": 4294967296}"#, "`kv_capacity_blocks`: invalid value"),
            (r#"{"kv_capacity_blocks": "auto"}"#, "`kv_capacity_blocks`: invalid value"),
            (r#"{"kv_capacity_blocks": true}"#, "`kv_capacity_blocks`: invalid type"),
            (r#"{"cache_key_spread": -1}"#, "cache_key_spread"),
            (r#"{"cache_key_window_ms": 999}"#, "cache_key_window_ms"),
            (r#"{"cache_key_window_ms": 86400001}"#, "cache_key_window_ms"),
            (r#"{"cache_key_live_ms": 99}"#, "cache_key_live_ms"),
            (r#"{"cache_key_live_ms": 60001}"#, "cache_key_live_ms"),
            (r#"{"cache_key_window_ms": 5000, "cache_key_live_ms": 5001}"#, "cache_key_live_ms"),
            (r#"{"cache_key_header": "x-kvroute-cache-salt"}"#, "cache_key_header"),
            (r#"{"cache_key_header": "X-Key"}"#, "cache_key_header"),
            (r#"{"active_blocks": "current"}"#, "`active_blocks`: unknown variant"),
            (r#"{"destination_via": "cookie"}"#, "`destination_via`: unknown variant"),
            (r#"[1]"#, "invalid"),
            (r#"{"#, "invalid"),
        ];
        for (json, needle) in cases {
            let e = FilterConfig::from_json(json.as_bytes()).unwrap_err();
            assert!(e.0.contains(needle), "{json}: {e}");
        }
        let sync_cases: &[(&str, &str)] = &[
            (r#"{"n_buckets": 1000}"#, "n_buckets"),
            (r#"{"feed_cluster": ""}"#, "feed_cluster"),
            (r#"{"feed_path": "v1/kv/feed"}"#, "feed_path"),
            (r#"{"stale_after_ms": 100}"#, "stale_after_ms"),
            (r#"{"feed_linger_ms": 1001}"#, "feed_linger_ms"),
            (r#"{"feed_linger_ms": -1}"#, "`feed_linger_ms`: invalid value"),
            (r#"{"stale_after_ms": "10s"}"#, "`stale_after_ms`: invalid type"),
            (r#"{} {}"#, "trailing characters"),
            (r#"{"feed": 1}"#, "unknown field"),
            (r#"{"load_report_interval_ms": 50}"#, "load_report_interval_ms"),
            (r#"{"load_report_interval_ms": 10001}"#, "load_report_interval_ms"),
            (r#"{"load_path": "v1/load"}"#, "load_path"),
            (r#"{"load_path": "/v1/load?x=1"}"#, "load_path"),
            (r#"{"gateway_id": ""}"#, "gateway_id"),
            (r#"{"gateway_id": "two words"}"#, "gateway_id"),
        ];
        for (json, needle) in sync_cases {
            let e = SyncConfig::from_json(json.as_bytes()).unwrap_err();
            assert!(e.0.contains(needle), "{json}: {e}");
        }
    }
}
