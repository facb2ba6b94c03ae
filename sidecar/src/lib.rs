//! kvroute-sidecar: vLLM/SGLang KV-cache events in, the kvroute feed out.
//!
//! - [`events`] decodes the engines' msgpack payloads ([`msgpack`] is the reader);
//! - [`cache`] mirrors one worker's cache in the router's hash space;
//! - [`fleet`] holds every worker, the feed version and its [`changelog`];
//! - [`ingest`] runs the ZMQ subscriptions (sequence checks, replay);
//! - [`server`], [`metrics`] and [`health`] are the HTTP side and liveness.

pub mod cache;
pub mod changelog;
pub mod config;
pub mod events;
pub mod fleet;
pub mod health;
pub mod ingest;
pub mod metrics;
pub mod msgpack;
pub mod server;
pub mod table;
