//! kvroute: KV-cache-aware routing for LLM inference fleets: the routing core.
//!
//! It has no host imports: it builds and is tested natively and in wasm32, the sidecar and
//! the stage link it for the same hashing and feed encoding, and each proxy host (the
//! proxy-wasm glue in `wasm/`, producing `kvroute.wasm`) is glue over [`filter`] and
//! [`sync`] through the traits in [`host`].
//!
//! - [`tokens`]: token-id headers → little-endian token bytes
//! - [`hash`]: block identity: chained XXH3-64 hashes, namespaces, segments (shared with
//!   the sidecar)
//! - [`role`]: a worker's role (prefill, decode, both)
//! - [`score`]: the cost function and ranking
//! - [`layout`]: the shared-data layout the sync service writes and the filter reads
//! - [`inflight`]: in-flight / predicted blocks and `active_blocks`
//! - [`scan`]: `cache_hits` per worker over one segment bucket
//! - [`peerload`]: load shared between gateway replicas (reports, answers, per slot)
//! - [`cachekey`]: cache keys (a conversation, an agent): where each went, keys per worker
//! - [`router`]: one routing decision over a [`store::SharedStore`]
//! - [`store`]: the shared-data store, its read-modify-write loop, and an in-process
//!   store with the host's semantics (tests, benches)
//! - [`feed`]: the sidecar → sync service frame format
//! - [`index`]: the sync service's model of the fleet
//! - [`config`]: plugin configuration, validated
//! - [`wire`]: what the wire decoders share (bounded reservations)
//! - [`host`]: what a proxy host provides (headers, stats, the clock, the feed poll)
//! - [`filter`]: the HTTP filter's policy: headers, routing, stats and release batching
//! - [`sync`]: the sync service's policy: the poll cycle, backoff, staleness, publishing

// The filter must never panic: a panic kills the VM and every request it would serve.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod cachekey;
pub mod config;
pub mod feed;
pub mod filter;
pub mod hash;
pub mod host;
pub mod index;
pub mod inflight;
pub mod layout;
pub mod peerload;
pub mod role;
pub mod router;
pub mod scan;
pub mod score;
pub mod slots;
pub mod store;
pub mod sync;
pub mod tokens;
pub mod wire;
