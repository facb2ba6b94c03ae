//! kvroute-sidecar: vLLM/SGLang KV-cache events in, the kvroute feed out.
//!
//! - [`events`] decodes the engines' msgpack payloads ([`msgpack`] is the reader);
//! - [`cache`] mirrors one worker's cache in the router's hash space; [`checkpoint`] keeps
//!   the caches on disk across restarts;
//! - [`fleet`] holds every worker, the feed version and its [`changelog`];
//! - [`sequence`] decides, per event stream, what to apply, clear or replay (no I/O);
//! - [`ingest`] runs each stream's sequencer over a [`ingest::Source`]; [`zmq_source`] is
//!   the ZMQ one: the subscriptions and replay connections; [`nats`] the NATS JetStream
//!   one ([`nats::source`]) and the relay that fills the stream ([`nats::relay`]);
//! - [`server`], [`metrics`] and [`health`] are the HTTP side and liveness;
//! - [`peerload`] shares each gateway's load with the others (`/v1/load`, a NATS subject);
//! - [`discovery`] keeps the worker list current (static, DNS, etcd); [`eds`] hands it to
//!   Envoy's `workers` cluster.

pub mod cache;
pub mod changelog;
pub mod checkpoint;
pub mod config;
pub mod discovery;
pub mod eds;
pub mod events;
pub mod fleet;
pub mod health;
pub mod ingest;
pub mod metrics;
pub mod msgpack;
pub mod nats;
pub mod peerload;
pub mod sequence;
pub mod server;
pub mod table;
pub mod zmq_source;
