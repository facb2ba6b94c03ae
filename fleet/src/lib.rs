//! kvroute's simulated fleet: mock engines that behave like vLLM where a router can tell
//! (paged prefix cache, prefill/decode timing, KV events in vLLM's wire format), and the
//! load generator that drives them.
//!
//! - [`kvcache`]: the paged prefix cache and its KV events;
//! - [`engine`]: the scheduler and timing model;
//! - [`kvevents`]: vLLM's KV-event wire format and publisher;
//! - [`worker`]: the mock engine's HTTP server (vLLM's OpenAI API), [`prompts`]: what it
//!   reads from a request (the prompt's token ids, as vLLM computes them);
//! - [`text`]: a real tokenizer's one-token words, for text the fleet writes;
//! - [`workload`], [`load`], [`plot`]: the load generator and its reports.

pub mod engine;
pub mod kvcache;
pub mod kvevents;
pub mod load;
pub mod plot;
pub mod prompts;
pub mod text;
pub mod worker;
pub mod workload;
