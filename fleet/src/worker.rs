//! The mock engine as a server: vLLM's OpenAI API (`/v1/completions`,
//! `/v1/chat/completions`, streaming and not), `/health`, `/v1/models`, `/metrics` with
//! vLLM's metric names, `POST /reset_prefix_cache`, the mock's own `POST
//! /reset_tokenizer_cache`; the [`Engine`] driven by timers (not
//! spinning: many workers share two cores); KV events published as vLLM does.

use crate::engine::{Engine, Output, Request, Timing};
use crate::kvcache::KvCache;
use crate::kvevents::{encode_batch, KvEventsConfig, Publisher, WireForm};
use crate::prompts::Prompts;
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt};
use hyper::body::{Body, Frame, Incoming};
use hyper::{Method, Request as HttpRequest, Response, StatusCode};
use kvroute_tokenizer::stage::{Endpoint, Skip};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};

#[derive(clap::Args, Debug, Clone)]
pub struct WorkerArgs {
    /// Address to serve on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Model name served (`/v1/models`, the `model` of responses).
    #[arg(long, default_value = "mock-llm")]
    pub model: String,
    /// Tokens per KV block (vLLM `--block-size`).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV-cache capacity in blocks (vLLM's `# GPU blocks` for the model and GPU).
    #[arg(long, default_value_t = 4096)]
    pub num_gpu_blocks: usize,
    /// vLLM's `--kv-events-config` JSON, e.g.
    /// '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'.
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// The KV-event wire form: vLLM 0.33's by default, or an older release's (events,
    /// batch and replay replies as that release sends them).
    #[arg(long, value_enum, default_value = "vllm-0.33")]
    pub kv_events_wire: WireForm,
    /// Data-parallel rank reported in event batches.
    #[arg(long, default_value_t = 0)]
    pub data_parallel_rank: u32,
    /// Milliseconds to start a prefill.
    #[arg(long, default_value_t = 30.0)]
    pub prefill_overhead_ms: f64,
    /// Milliseconds per uncached prompt token.
    #[arg(long, default_value_t = 0.2)]
    pub prefill_ms_per_token: f64,
    /// Milliseconds per output token at small batch.
    #[arg(long, default_value_t = 12.0)]
    pub itl_ms: f64,
    /// Running sequences at which the time per output token has doubled.
    #[arg(long, default_value_t = 64.0)]
    pub itl_knee: f64,
    /// Prompt tokens per scheduler step (vLLM `--max-num-batched-tokens`).
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Run this many times faster than real time (every modelled duration is divided).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// The tokenizer directory (vLLM's `--tokenizer`: `tokenizer.json`, `tokenizer_config.json`,
    /// a chat template): text prompts and chats are tokenized as vLLM does. Without one the
    /// engine takes token-id prompts only, as vLLM with `--skip-tokenizer-init`.
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,
    /// vLLM's `--max-model-len`; default: what the KV cache holds (blocks × block size).
    #[arg(long)]
    pub max_model_len: Option<usize>,
}

impl WorkerArgs {
    pub fn max_model_len(&self) -> usize {
        self.max_model_len.unwrap_or(self.num_gpu_blocks * self.block_size)
    }

    pub fn timing(&self) -> Result<Timing, String> {
        let ms = |v: f64, name: &str| {
            if v.is_finite() && v >= 0.0 {
                Ok(Duration::from_secs_f64(v / 1000.0))
            } else {
                Err(format!("--{name}: {v} is not a non-negative number"))
            }
        };
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(format!("--speedup: {} must be positive", self.speedup));
        }
        if self.itl_knee <= 0.0 || self.max_num_batched_tokens == 0 || self.block_size == 0 || self.num_gpu_blocks == 0
        {
            return Err(
                "--itl-knee, --max-num-batched-tokens, --block-size and --num-gpu-blocks must be positive".into()
            );
        }
        Ok(Timing {
            prefill_overhead: ms(self.prefill_overhead_ms, "prefill-overhead-ms")?,
            prefill_per_token: ms(self.prefill_ms_per_token, "prefill-ms-per-token")?,
            itl: ms(self.itl_ms, "itl-ms")?,
            itl_knee: self.itl_knee,
            step_token_budget: self.max_num_batched_tokens,
        })
    }
}

struct Shared {
    args: WorkerArgs,
    id: String,
    engine: Mutex<Engine>,
    wake: Notify,
    streams: Mutex<HashMap<u64, mpsc::UnboundedSender<Output>>>,
    next_id: AtomicU64,
    publisher: Option<Publisher>,
    prompts: Prompts,
    started: Instant,
}

impl Shared {
    fn engine(&self) -> MutexGuard<'_, Engine> {
        kvroute_serve::lock(&self.engine)
    }
    fn streams(&self) -> MutexGuard<'_, HashMap<u64, mpsc::UnboundedSender<Output>>> {
        kvroute_serve::lock(&self.streams)
    }

    /// One step's KV events as one batch on the publisher (if events are on).
    fn publish(&self, events: &[crate::kvcache::KvEvent]) {
        let (Some(p), false) = (&self.publisher, events.is_empty()) else { return };
        let ts = kvroute_serve::unix_seconds();
        if !p.publish(encode_batch(self.args.kv_events_wire, ts, events, self.args.data_parallel_rank)) {
            log::warn!("kv events queue full: a batch was dropped");
        }
    }
}

/// Runs a mock engine until Ctrl-C / SIGTERM.
pub async fn run(args: WorkerArgs) -> Result<(), String> {
    let timing = args.timing()?;
    let events = match &args.kv_events_config {
        Some(j) => KvEventsConfig::from_json(j)?,
        None => KvEventsConfig::default(),
    };
    let publisher = if events.enabled() { Some(Publisher::start(&events, args.kv_events_wire)?) } else { None };
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .map_err(|_| format!("bad --host/--port {}:{}", args.host, args.port))?;
    let prompts = Prompts::new(&args.model, args.tokenizer.as_deref(), args.max_model_len())?;
    let words = match prompts.model() {
        Some(m) => crate::text::Words::of(m)?.ids().to_vec(),
        None => Vec::new(),
    };
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("listen {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    let shared = Arc::new(Shared {
        id: local.to_string(),
        engine: Mutex::new(
            Engine::new(KvCache::new(args.block_size, args.num_gpu_blocks), timing).with_output_words(words),
        ),
        wake: Notify::new(),
        streams: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(1),
        publisher,
        prompts,
        started: Instant::now(),
        args,
    });
    log::info!(
        "mock engine {} on {local}: {} blocks of {} tokens, speedup {}, tokenizer {}, kv events {}",
        shared.args.model,
        shared.args.num_gpu_blocks,
        shared.args.block_size,
        shared.args.speedup,
        shared.args.tokenizer.as_ref().map_or("none (token ids only)".into(), |d| d.display().to_string()),
        if shared.publisher.is_some() { events.endpoint.as_str() } else { "off" }
    );
    tokio::spawn(drive(shared.clone()));
    tokio::select! {
        _ = kvroute_serve::serve_http1(listener, move |req| handle(shared.clone(), req)) => Ok(()),
        _ = kvroute_serve::shutdown_signal() => Ok(()),
    }
}

/// The GPU: plans a step, sleeps its (scaled) duration, completes it, hands out tokens and
/// publishes the step's KV events as one batch.
async fn drive(shared: Arc<Shared>) {
    loop {
        let mut rejected = Vec::new();
        let plan = shared.engine().plan(&mut rejected);
        deliver(&shared, rejected);
        let Some(plan) = plan else {
            shared.wake.notified().await;
            continue;
        };
        tokio::time::sleep(plan.duration.div_f64(shared.args.speedup)).await;
        let (outputs, events) = shared.engine().complete(plan);
        deliver(&shared, outputs);
        shared.publish(&events);
    }
}

fn deliver(shared: &Shared, outputs: Vec<Output>) {
    if outputs.is_empty() {
        return;
    }
    let mut streams = shared.streams();
    let mut gone = Vec::new();
    for o in outputs {
        let id = match &o {
            Output::FirstToken { id, .. }
            | Output::Token { id, .. }
            | Output::Finished { id }
            | Output::Rejected { id } => *id,
        };
        let last = matches!(o, Output::Finished { .. } | Output::Rejected { .. });
        if let Some(tx) = streams.get(&id) {
            if tx.send(o).is_err() {
                gone.push(id);
            }
        }
        if last {
            streams.remove(&id);
        }
    }
    drop(streams);
    if !gone.is_empty() {
        let mut e = shared.engine();
        for id in gone {
            shared.streams().remove(&id);
            e.abort(id);
        }
    }
}

type Resp = Response<BoxBody<Bytes, Infallible>>;

/// A whole response, boxed like the streaming ones.
fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Resp {
    kvroute_serve::respond(status, content_type, body).map(BodyExt::boxed)
}

fn error(status: StatusCode, msg: &str) -> Resp {
    // vLLM's error shape.
    full(
        status,
        "application/json",
        json!({"object": "error", "message": msg, "type": "BadRequestError", "code": status.as_u16()}).to_string(),
    )
}

async fn handle(shared: Arc<Shared>, req: HttpRequest<Incoming>) -> Result<Resp, Infallible> {
    let path = req.uri().path().to_string();
    let resp = match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => full(StatusCode::OK, "text/plain", ""),
        (Method::GET, "/v1/models") => full(
            StatusCode::OK,
            "application/json",
            json!({"object": "list", "data": [{"id": shared.args.model, "object": "model", "owned_by": "kvroute-fleet",
                   "max_model_len": shared.args.max_model_len()}]})
            .to_string(),
        ),
        (Method::GET, "/metrics") => full(StatusCode::OK, "text/plain; version=0.0.4", metrics(&shared)),
        // The mock's own: its whole prefix cache, for checking an index against it.
        (Method::GET, "/v1/kv/blocks") => {
            let (block_size, blocks) = {
                let e = shared.engine();
                (e.cache.block_size(), e.cache.block_ids())
            };
            full(StatusCode::OK, "application/json", json!({"block_size": block_size, "blocks": blocks}).to_string())
        }
        (Method::POST, "/reset_prefix_cache") => {
            let events = {
                let mut e = shared.engine();
                e.cache.reset();
                e.cache.take_events()
            };
            shared.publish(&events);
            full(StatusCode::OK, "text/plain", "")
        }
        // The mock's own: its tokenizer's caches emptied, so a benchmark's next router finds
        // the engines as the first one did (a prompt tokenized before costs less again).
        (Method::POST, "/reset_tokenizer_cache") => {
            shared.prompts.forget_cached();
            full(StatusCode::OK, "text/plain", "")
        }
        (Method::POST, "/v1/completions") => generate(shared, req, false).await,
        (Method::POST, "/v1/chat/completions") => generate(shared, req, true).await,
        (Method::POST, "/tokenize") => tokenize(shared, req).await,
        (
            _,
            "/health"
            | "/v1/models"
            | "/metrics"
            | "/v1/kv/blocks"
            | "/reset_prefix_cache"
            | "/reset_tokenizer_cache"
            | "/v1/completions"
            | "/v1/chat/completions"
            | "/tokenize",
        ) => error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
        _ => error(StatusCode::NOT_FOUND, "not found"),
    };
    Ok(resp)
}

/// Requests are read whole, up to this size (vLLM has no such limit; a mock needs one).
const MAX_BODY_BYTES: usize = 64 << 20;

async fn read_body(req: HttpRequest<Incoming>) -> Result<Bytes, Resp> {
    match http_body_util::Limited::new(req.into_body(), MAX_BODY_BYTES).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(_) => Err(error(StatusCode::BAD_REQUEST, "could not read the body (or it is over 64 MiB)")),
    }
}

fn refused(why: Skip) -> Resp {
    let (status, message) = why.vllm_error();
    error(StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST), &message)
}

/// Tokenizing can take milliseconds (a long uncached prompt): off the engine's thread.
async fn off_thread<T: Send + 'static>(
    shared: &Arc<Shared>,
    work: impl FnOnce(&Prompts) -> Result<T, Skip> + Send + 'static,
) -> Result<T, Resp> {
    let s = shared.clone();
    match tokio::task::spawn_blocking(move || work(&s.prompts)).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(r)) => Err(refused(r)),
        Err(e) => Err(error(StatusCode::INTERNAL_SERVER_ERROR, &format!("tokenizing failed: {e}"))),
    }
}

/// vLLM's `POST /tokenize`.
async fn tokenize(shared: Arc<Shared>, req: HttpRequest<Incoming>) -> Resp {
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    match off_thread(&shared, move |p| p.tokenize(&body)).await {
        Ok(v) => full(StatusCode::OK, "application/json", v.to_string()),
        Err(r) => r,
    }
}

async fn generate(shared: Arc<Shared>, req: HttpRequest<Incoming>, chat: bool) -> Resp {
    let raw = match read_body(req).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let body: Map<String, Value> = match serde_json::from_slice(&raw) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("body is not a JSON object: {e}")),
    };
    let max_tokens = body
        .get(if chat && body.get("max_completion_tokens").is_some() { "max_completion_tokens" } else { "max_tokens" })
        .and_then(Value::as_u64)
        .unwrap_or(16)
        .clamp(1, 1 << 16) as usize;
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let return_token_ids = body.get("return_token_ids").and_then(Value::as_bool).unwrap_or(false);
    // Parsed once: the prompt is read from the same map, off the engine's thread.
    let endpoint = if chat { Endpoint::ChatCompletions } else { Endpoint::Completions };
    let prompt = match off_thread(&shared, move |p| p.prompt_of(endpoint, &body)).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::unbounded_channel();
    shared.streams().insert(id, tx);
    let prompt_ids = return_token_ids.then(|| prompt.clone());
    let prompt_len = prompt.len();
    shared.engine().submit(Request { id, prompt, max_tokens });
    shared.wake.notify_one();
    let reply = Reply { shared: shared.clone(), id, chat, prompt_len, prompt_ids, created: unix_secs() };
    if stream {
        reply.stream(rx)
    } else {
        reply.whole(rx).await
    }
}

fn unix_secs() -> u64 {
    kvroute_serve::unix_seconds() as u64
}

struct Reply {
    shared: Arc<Shared>,
    id: u64,
    chat: bool,
    prompt_len: usize,
    /// The prompt's ids, when the request asked for them (vLLM's `return_token_ids`).
    prompt_ids: Option<Vec<u32>>,
    created: u64,
}

impl Reply {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        }
    }

    fn usage(&self, completion: usize, cached: usize) -> Value {
        json!({"prompt_tokens": self.prompt_len, "completion_tokens": completion,
               "total_tokens": self.prompt_len + completion,
               "prompt_tokens_details": {"cached_tokens": cached}})
    }

    /// One choice: its text (whole, or a chunk's delta), the ids it was decoded from (if
    /// asked for), and for completions the prompt's ids in the first.
    fn choice(&self, ids: &[u32], finish: Option<&str>, chunk: bool, first: bool) -> Value {
        let text = self.shared.prompts.decode(ids);
        let mut c = if self.chat {
            let key = if chunk { "delta" } else { "message" };
            json!({"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text, "finish_reason": finish})
        };
        if self.prompt_ids.is_some() {
            c["token_ids"] = json!(ids);
            if first && !self.chat {
                c["prompt_token_ids"] = json!(self.prompt_ids);
            }
        }
        c
    }

    fn envelope(&self, choice: Value, chunk: bool, first: bool) -> Value {
        let mut v = json!({"id": format!("cmpl-{}-{}", self.shared.id, self.id), "object": self.object(chunk),
               "created": self.created, "model": self.shared.args.model, "choices": [choice],
               // Not in vLLM: which mock engine answered (benchmarks read it).
               "kvroute_worker": self.shared.id});
        if first && self.chat && self.prompt_ids.is_some() {
            v["prompt_token_ids"] = json!(self.prompt_ids);
        }
        v
    }

    async fn whole(self, mut rx: mpsc::UnboundedReceiver<Output>) -> Resp {
        let (mut tokens, mut cached) = (Vec::new(), 0);
        while let Some(o) = rx.recv().await {
            match o {
                Output::FirstToken { token, cached_tokens, .. } => {
                    cached = cached_tokens;
                    tokens.push(token);
                }
                Output::Token { token, .. } => tokens.push(token),
                Output::Finished { .. } => break,
                Output::Rejected { .. } => {
                    return error(StatusCode::BAD_REQUEST, "prompt and max_tokens exceed the KV cache");
                }
            }
        }
        let mut v = self.envelope(self.choice(&tokens, Some("length"), false, true), false, true);
        v["usage"] = self.usage(tokens.len(), cached);
        full(StatusCode::OK, "application/json", v.to_string())
    }

    /// Server-sent events: the first chunk when the prefill ends, one per token, `[DONE]`.
    fn stream(self, mut rx: mpsc::UnboundedReceiver<Output>) -> Resp {
        let (tx, body_rx) = mpsc::channel::<Bytes>(64);
        tokio::spawn(async move {
            let (mut n, mut cached) = (0usize, 0usize);
            while let Some(o) = rx.recv().await {
                let (token, finish) = match o {
                    Output::FirstToken { token, cached_tokens, .. } => {
                        cached = cached_tokens;
                        (Some(token), None)
                    }
                    Output::Token { token, .. } => (Some(token), None),
                    Output::Finished { .. } => (None, Some("length")),
                    Output::Rejected { .. } => {
                        let e = json!({"object": "error", "message": "prompt and max_tokens exceed the KV cache", "code": 400});
                        let _ = tx.send(Bytes::from(format!("data: {e}\n\n"))).await;
                        break;
                    }
                };
                let first = n == 0;
                n += usize::from(token.is_some());
                let ids: &[u32] = match &token {
                    Some(t) => std::slice::from_ref(t),
                    None => &[],
                };
                let mut v = self.envelope(self.choice(ids, finish, true, first), true, first);
                if finish.is_some() {
                    v["usage"] = self.usage(n, cached);
                }
                if tx.send(Bytes::from(format!("data: {v}\n\n"))).await.is_err() {
                    // The client went away: stop generating for it.
                    self.shared.streams().remove(&self.id);
                    self.shared.engine().abort(self.id);
                    return;
                }
                if finish.is_some() {
                    break;
                }
            }
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        });
        let mut r = Response::new(ChannelBody(body_rx).boxed());
        if let Ok(v) = "text/event-stream".parse() {
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
        }
        r
    }
}

/// A response body fed from a channel.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// `/metrics` with vLLM's names.
fn metrics(shared: &Shared) -> String {
    let e = shared.engine();
    let model = &shared.args.model;
    let s = &e.stats;
    let usage = e.cache.used() as f64 / e.cache.capacity().max(1) as f64;
    let rows: [(&str, &str, &str, f64); 10] = [
        ("vllm:num_requests_running", "gauge", "Requests in decode.", e.running() as f64),
        ("vllm:num_requests_waiting", "gauge", "Requests waiting for KV-cache space or prefill.", e.queued() as f64),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage, 0 to 1.", usage),
        ("vllm:prompt_tokens_total", "counter", "Prompt tokens processed.", s.prompt_tokens as f64),
        ("vllm:generation_tokens_total", "counter", "Tokens generated.", s.generation_tokens as f64),
        (
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            s.prompt_tokens as f64,
        ),
        (
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prompt tokens found in the prefix cache.",
            s.cached_prompt_tokens as f64,
        ),
        ("vllm:request_success_total", "counter", "Requests finished.", s.requests_finished as f64),
        (
            "kvroute_mock_busy_seconds_total",
            "counter",
            "Modelled GPU busy time (not divided by the speed-up).",
            s.busy.as_secs_f64(),
        ),
        ("kvroute_mock_cached_blocks", "gauge", "Blocks in the prefix cache.", e.cache.cached_blocks() as f64),
    ];
    let mut out = String::new();
    for (name, kind, help, v) in rows {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{model_name=\"{model}\"}} {v}\n"));
    }
    out.push_str(&format!(
        "# HELP kvroute_mock_uptime_seconds Seconds since start.\n# TYPE kvroute_mock_uptime_seconds gauge\nkvroute_mock_uptime_seconds {}\n",
        shared.started.elapsed().as_secs_f64()
    ));
    out
}
