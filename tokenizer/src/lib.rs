//! kvroute-tokenizer: the tokenizer stage in front of the kvroute filter. Plain OpenAI
//! requests in (`/v1/completions`, `/v1/chat/completions`), the prompt's token ids out, as
//! vLLM 0.33 computes them, so that kvroute routes them by KV cache.
//!
//! - [`model`]: one model's tokenizer directory, and vLLM's text → ids rules
//! - [`segments`]: token ids cached per segment between added tokens
//! - [`ascii_bpe`]: byte-level BPE of ASCII text without HF `tokenizers`, for a cold text
//! - [`template`]: chat templates rendered as transformers renders them ([`pyjson`]: `tojson`)
//! - [`chat`]: a chat request's prompt text, as vLLM prepares it
//! - [`stage`]: a request body → [`stage::Prompt`] or a counted [`stage::Skip`]
//! - [`extproc`]: Envoy's ext_proc protocol, the gRPC service and what it does per request
//! - [`stats`]: counters and `/metrics`
//! - [`http`]: `/tokenize` in vLLM's shape, `/metrics`, `/healthz`
//! - [`pool`]: the tokenizing threads, started and warmed before the first request
//! - [`selfcheck`]: the startup comparison with a worker's own `/tokenize`

pub mod ascii_bpe;
pub mod chat;
pub mod config;
pub mod extproc;
pub mod http;
pub mod model;
pub mod pool;
pub mod pyjson;
pub mod segments;
pub mod selfcheck;
pub mod stage;
pub mod stats;
pub mod template;
