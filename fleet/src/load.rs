//! The load generator: sends a workload through the gateway as an OpenAI client does (the
//! prompt in the body: token ids, text, or chat messages; the gateway's tokenizer stage
//! works out the token ids), and measures what users feel: time to first token,
//! end-to-end latency, which worker served, how much of the prompt was cached.
//!
//! Workloads are planned in token ids; text is written from them with the tokenizer's
//! one-token words ([`crate::text`]), so shared planned prefixes are shared text. Every
//! request asks for vLLM's `return_token_ids`: the engine's own prompt ids are what the
//! oracle hit rate is computed on.

use crate::text::Words;
use crate::workload::{self, Chat, Planned, Popularity, Rng, SharedPrefix};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkloadKind {
    SharedPrefix,
    Chat,
    /// Agents sharing one system prompt, each looping: an answer (a tool call), then a
    /// tool result appended, sent again (`--conversations` agents of `--turns` steps).
    Agentic,
    Mooncake,
}

/// How a prompt is sent.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptForm {
    /// `/v1/completions` with `"prompt": [token ids]`.
    Tokens,
    /// `/v1/completions` with `"prompt": "text"`.
    Text,
    /// `/v1/chat/completions` with `messages` (a chat's turns as user and assistant messages).
    Chat,
}

#[derive(clap::Args, Debug, Clone)]
pub struct LoadArgs {
    /// The gateway (Envoy's listener), host:port; several gateway replicas comma-separated,
    /// taken in turn per request (as a layer-4 balancer in front of them spreads new
    /// connections).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub target: String,
    /// With several targets: a request's gateway follows its key (the conversation in
    /// chat and agentic, the group in shared-prefix), as a balancer with session affinity
    /// does, instead of taking the gateways in turn.
    #[arg(long)]
    pub sticky: bool,
    /// How prompts are sent: token ids, text or chat messages in the body.
    #[arg(long = "send", value_enum, default_value_t = PromptForm::Tokens)]
    pub form: PromptForm,
    /// The `model` every request names.
    #[arg(long, default_value = "mock-llm")]
    pub model: String,
    /// The tokenizer directory whose words text is written in (`--send text` and `chat`;
    /// the engines' and the stage's tokenizer).
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,
    /// Also send the prompt's token ids in `x-prompt-token-ids-b64` (base64 of u32 LE), as
    /// a client-side tokenizer would: how kvroute was driven before the tokenizer stage.
    /// The stage removes the header unless it trusts client tokens.
    #[arg(long)]
    pub token_header: bool,
    #[arg(long, value_enum, default_value_t = WorkloadKind::SharedPrefix)]
    pub workload: WorkloadKind,
    /// Requests (shared prefix: groups × prompts per group; mooncake: the first N).
    #[arg(long, default_value_t = 8)]
    pub groups: usize,
    #[arg(long, default_value_t = 16)]
    pub prompts_per_group: usize,
    #[arg(long, default_value_t = 2048)]
    pub system_prompt_len: usize,
    #[arg(long, default_value_t = 128)]
    pub question_len: usize,
    #[arg(long, default_value_t = 32)]
    pub output_len: usize,
    /// Zipf exponent of group popularity; 0 = uniform.
    #[arg(long, default_value_t = 0.0)]
    pub zipf: f64,
    /// Chat and agentic: conversations (agents) and turns (steps) each. Chat: the first
    /// prompt is `--system-prompt-len` tokens of its own, each next question
    /// `--question-len`. Agentic: every agent starts with the same `--system-prompt-len`
    /// tokens, then a task of `--question-len`; each tool result is `--question-len`.
    #[arg(long, default_value_t = 16)]
    pub conversations: usize,
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// Mooncake: the trace file, how many requests, and the scales (lengths ÷, times ÷).
    #[arg(long, default_value = "benches/data/mooncake/conversation_trace_2000.jsonl")]
    pub trace: String,
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    #[arg(long, default_value_t = 8.0)]
    pub length_scale: f64,
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Arrivals per second (Poisson); `inf` sends everything at once. Mooncake: the trace's
    /// own times.
    #[arg(long, default_value_t = 4.0)]
    pub rate: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A name for this run in reports (e.g. the routing policy).
    #[arg(long, default_value = "run")]
    pub label: String,
    /// Write the result (summary and every sample) as JSON here.
    #[arg(long)]
    pub json: Option<String>,
    /// Mock engines (host:port) whose /metrics to read before and after, for per-worker
    /// busy time and prefix-cache counters. Repeatable.
    #[arg(long = "engine")]
    pub engines: Vec<String>,
    /// No progress line on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Also send `x-prefix-hash`: a hash of the prompt's first N 16-token blocks (for
    /// Envoy's ring-hash "prefix affinity" baseline); 0 = not sent.
    #[arg(long, default_value_t = 0)]
    pub prefix_hash_blocks: usize,
    /// Also send OpenAI's `prompt_cache_key` in the body: the request's key (the
    /// conversation in chat and agentic, the group in shared-prefix), as agent clients do;
    /// with `--token-header`, also in `x-kvroute-cache-key`.
    #[arg(long)]
    pub cache_key: bool,
    /// Shared prefix: each group's prompts arrive together, as one burst (at `--rate`
    /// bursts per second) — many same-prefix requests within one event round trip.
    #[arg(long)]
    pub burst: bool,
    /// A request with no complete answer after this many seconds fails (counted, logged;
    /// a chat or agent ends there): a router that stalls ends the run instead of hanging it.
    #[arg(long, default_value_t = 300.0, value_parser = positive_seconds)]
    pub request_timeout_s: f64,
}

fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        // Finite is not enough: `Duration::from_secs_f64` panics past ~5.8e11 years.
        Ok(v) if v > 0.0 && Duration::try_from_secs_f64(v).is_ok() => Ok(v),
        _ => Err(format!("`{s}`: a positive number of seconds")),
    }
}

/// Tokens per block for the oracle and the prefix hash (the fleet's block size).
const BLOCK: usize = 16;
/// The response header a router explains its decision in (kvroute's `debug_header` as the
/// benchmarks set it).
const ROUTE_HEADER: &str = "x-kvroute-debug";

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub key: u64,
    pub ok: bool,
    pub ttft_ms: f64,
    pub e2e_ms: f64,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub worker: String,
    /// Seconds from the start of the run to the send.
    pub sent_s: f64,
    /// The router's account of its decision, when it sends one (kvroute's `debug_header`,
    /// `x-kvroute-debug`): for reading why a slow request went where it did.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub route: String,
    #[serde(skip)]
    pub answer: String,
    #[serde(skip)]
    pub answer_ids: Vec<u32>,
    /// The prompt's ids: the engine's (`return_token_ids`), else the planned ones.
    #[serde(skip)]
    pub prompt: Vec<u32>,
}

/// The hit rate of one infinite prefix cache that saw every request in the order they
/// were sent: the most prefix reuse the workload allows (cached ÷ prompt tokens).
pub fn oracle_hit_rate(samples: &[Sample]) -> f64 {
    let mut order: Vec<&Sample> = samples.iter().collect();
    order.sort_by(|a, b| a.sent_s.total_cmp(&b.sent_s));
    let mut seen = std::collections::HashSet::new();
    let (mut hit, mut total) = (0usize, 0usize);
    for s in order {
        let hashes = kvroute::hash::block_hashes(&s.prompt, BLOCK);
        let lead = hashes.iter().take_while(|h| seen.contains(*h)).count();
        // As an engine does, the last prompt token is always computed.
        hit += (lead * BLOCK).min(s.prompt.len().saturating_sub(1));
        total += s.prompt.len();
        seen.extend(hashes);
    }
    hit as f64 / total.max(1) as f64
}

/// `x-prefix-hash`: the prompt's first `blocks` blocks, hashed.
fn prefix_hash(prompt: &[u32], blocks: usize) -> String {
    let n = (blocks * BLOCK).min(prompt.len());
    let bytes: Vec<u8> = prompt[..n].iter().flat_map(|t| t.to_le_bytes()).collect();
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes))
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn percentiles(mut v: Vec<f64>) -> Value {
    v.sort_by(f64::total_cmp);
    json!({"p50": round2(pct(&v, 50.0)), "p90": round2(pct(&v, 90.0)), "p99": round2(pct(&v, 99.0)),
           "mean": round2(if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 })})
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// A request's prompt, as the client puts it in the body.
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    /// The planned ids themselves.
    Tokens,
    Text(String),
    Chat(Vec<(&'static str, String)>),
}

/// A prompt being built, turn by turn: its planned ids and its body.
#[derive(Debug, Clone)]
pub struct Conversation {
    pub planned: Vec<u32>,
    pub body: Body,
}

impl Conversation {
    fn path(&self) -> &'static str {
        match self.body {
            Body::Chat(_) => "/v1/chat/completions",
            Body::Tokens | Body::Text(_) => "/v1/completions",
        }
    }

    fn json(&self, model: &str, max_tokens: usize) -> Value {
        let mut v = json!({"model": model, "max_tokens": max_tokens, "stream": true, "return_token_ids": true});
        match &self.body {
            Body::Tokens => v["prompt"] = json!(self.planned),
            Body::Text(t) => v["prompt"] = json!(t),
            Body::Chat(m) => {
                v["messages"] = m.iter().map(|(role, content)| json!({"role": role, "content": content})).collect()
            }
        }
        v
    }
}

/// Writes planned prompts in the chosen form.
pub struct Writer {
    form: PromptForm,
    words: Option<Words>,
}

impl Writer {
    pub fn new(form: PromptForm, words: Option<Words>) -> Result<Writer, String> {
        if form != PromptForm::Tokens && words.is_none() {
            return Err("--send text and --send chat need --tokenizer (the words text is written in)".into());
        }
        Ok(Writer { form, words })
    }

    fn text(&self, planned: &[u32]) -> String {
        self.words.as_ref().map(|w| w.text(planned)).unwrap_or_default()
    }

    /// A first prompt: the whole planned prompt (a chat: its first `system_len` tokens as a
    /// system message, the rest as a user message).
    pub fn start(&self, planned: Vec<u32>, system_len: usize) -> Conversation {
        let body = match self.form {
            PromptForm::Tokens => Body::Tokens,
            PromptForm::Text => Body::Text(self.text(&planned)),
            PromptForm::Chat => {
                let (system, user) = planned.split_at(system_len.min(planned.len()));
                let mut m = Vec::with_capacity(2);
                if !system.is_empty() {
                    m.push(("system", self.text(system)));
                }
                m.push(("user", self.text(user)));
                Body::Chat(m)
            }
        };
        Conversation { planned, body }
    }

    /// The next turn: everything so far, the answer, then a new question. False when the
    /// answer's ids are unknown (the stream had none and its text is not in our words):
    /// the planned ids then lack them, and so does the oracle.
    pub fn next_turn(&self, c: &mut Conversation, answer: &Sample, question: &[u32]) -> bool {
        let mut known = true;
        if !answer.answer_ids.is_empty() || answer.answer.is_empty() {
            c.planned.extend(&answer.answer_ids);
        } else if let Some(ids) = self.words.as_ref().and_then(|w| w.read_back(&answer.answer)) {
            c.planned.extend(ids);
        } else {
            known = false;
        }
        c.planned.extend(question);
        match &mut c.body {
            Body::Tokens => {}
            Body::Text(t) => {
                t.push_str(&answer.answer);
                t.push_str(&self.text(question));
            }
            Body::Chat(m) => {
                m.push(("assistant", answer.answer.clone()));
                m.push(("user", self.text(question)));
            }
        }
        known
    }
}

/// How to send: the gateway, the model, which headers a client-side tokenizer writes.
#[derive(Clone)]
pub struct Sender {
    pub targets: Arc<[String]>,
    /// Requests sent so far: the next one goes to `targets[sent % len]`.
    pub sent: Arc<AtomicUsize>,
    /// `targets[key % len]` instead.
    pub sticky: bool,
    pub model: String,
    pub token_header: bool,
    pub prefix_hash_blocks: usize,
    pub cache_key: bool,
    pub start: Instant,
    pub timeout: Duration,
}

/// Sends one request, streaming, and measures it. The planned ids go in the headers, and
/// stand for the prompt if the engine does not return its own.
pub async fn send(sender: &Sender, c: &Conversation, max_tokens: usize, key: u64) -> Sample {
    let planned = c.planned.as_slice();
    let turn = if sender.sticky { key as usize } else { sender.sent.fetch_add(1, Ordering::Relaxed) };
    let target = sender.targets[turn % sender.targets.len()].as_str();
    let t0 = Instant::now();
    let mut s = Sample {
        key,
        ok: false,
        ttft_ms: 0.0,
        e2e_ms: 0.0,
        prompt_tokens: planned.len(),
        cached_tokens: 0,
        worker: String::new(),
        sent_s: t0.duration_since(sender.start).as_secs_f64(),
        route: String::new(),
        answer: String::new(),
        answer_ids: Vec::new(),
        prompt: planned.to_vec(),
    };
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(target).await.map_err(|e| e.to_string())?;
        let _ = stream.set_nodelay(true);
        let (mut tx, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let mut req = hyper::Request::post(c.path()).header("host", target).header("content-type", "application/json");
        let cache_key = sender.cache_key.then(|| format!("kvroute-load-{key}"));
        if sender.token_header {
            req = req.header("x-prompt-token-ids-b64", kvroute::tokens::encode_base64(planned));
            // A client that tokenizes itself writes the key's header too (there is no stage
            // to copy it from the body).
            if let Some(k) = &cache_key {
                req = req.header("x-kvroute-cache-key", k.as_str());
            }
        }
        if sender.prefix_hash_blocks > 0 {
            req = req.header("x-prefix-hash", prefix_hash(planned, sender.prefix_hash_blocks));
        }
        let mut payload = c.json(&sender.model, max_tokens);
        if let Some(k) = cache_key {
            payload["prompt_cache_key"] = json!(k);
        }
        let payload = payload.to_string();
        let req = req.body(Full::new(Bytes::from(payload))).map_err(|e| e.to_string())?;
        let resp = tx.send_request(req).await.map_err(|e| e.to_string())?;
        if resp.status() != hyper::StatusCode::OK {
            let status = resp.status();
            let why = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            return Err(format!("status {status}: {}", String::from_utf8_lossy(&why[..why.len().min(300)])));
        }
        if let Some(route) = resp.headers().get(ROUTE_HEADER).and_then(|v| v.to_str().ok()) {
            s.route = route.to_string();
        }
        let mut body = resp.into_body();
        let mut buf = String::new();
        let mut last: Option<Value> = None;
        let mut prompt_ids_read = false;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| e.to_string())?;
            let Some(data) = frame.data_ref() else { continue };
            buf.push_str(&String::from_utf8_lossy(data));
            while let Some(end) = buf.find("\n\n") {
                let event: String = buf.drain(..end + 2).collect();
                let Some(payload) = event.trim().strip_prefix("data: ") else { continue };
                if payload == "[DONE]" {
                    continue;
                }
                if s.ttft_ms == 0.0 {
                    s.ttft_ms = t0.elapsed().as_secs_f64() * 1000.0;
                }
                let v: Value = serde_json::from_str(payload).map_err(|e| e.to_string())?;
                prompt_ids_read |= read_chunk(&v, &mut s);
                last = Some(v);
            }
        }
        read_last_chunk(&last.ok_or("empty stream")?, prompt_ids_read, &mut s);
        Ok::<(), String>(())
    };
    let result = tokio::time::timeout(sender.timeout, exchange)
        .await
        .unwrap_or_else(|_| Err(format!("no complete answer in {:?}", sender.timeout)));
    s.e2e_ms = t0.elapsed().as_secs_f64() * 1000.0;
    s.ok = result.is_ok();
    if let Err(e) = result {
        log::debug!("request failed: {e}");
    }
    s
}

/// One streamed chunk: its text and ids, and the prompt's ids if it carries them (the
/// first: top level in a chat chunk, in the choice in a completion chunk); true if it did.
fn read_chunk(v: &Value, s: &mut Sample) -> bool {
    let choice = v.pointer("/choices/0");
    let text = choice.and_then(|c| c.pointer("/delta/content").or_else(|| c.get("text"))).and_then(Value::as_str);
    s.answer.push_str(text.unwrap_or(""));
    let ids = |v: Option<&Value>| -> Option<Vec<u32>> {
        v?.as_array()?.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
    };
    s.answer_ids.extend(ids(choice.and_then(|c| c.get("token_ids"))).unwrap_or_default());
    let Some(p) = ids(v.get("prompt_token_ids")).or_else(|| ids(choice.and_then(|c| c.get("prompt_token_ids")))) else {
        return false;
    };
    s.prompt_tokens = p.len();
    s.prompt = p;
    true
}

/// The stream's last chunk: the usage (cached tokens; the prompt's count if no chunk
/// carried its ids) and the worker the mock engine names.
fn read_last_chunk(last: &Value, prompt_ids_read: bool, s: &mut Sample) {
    s.cached_tokens =
        last.pointer("/usage/prompt_tokens_details/cached_tokens").and_then(Value::as_u64).unwrap_or(0) as usize;
    if !prompt_ids_read {
        // A router that relays text only (Dynamo's frontend): the usage's count is the
        // engine's, where the planned ids can lack an earlier answer's.
        if let Some(n) = last.pointer("/usage/prompt_tokens").and_then(Value::as_u64) {
            s.prompt_tokens = n as usize;
        }
    }
    s.worker = last.get("kvroute_worker").and_then(Value::as_str).unwrap_or("").to_string();
}

/// `/metrics` of a mock engine, as name → value.
async fn engine_metrics(addr: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Ok(stream) = tokio::net::TcpStream::connect(addr).await else { return out };
    let Ok((mut tx, conn)) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await else {
        return out;
    };
    tokio::spawn(conn);
    let Ok(req) = hyper::Request::get("/metrics").header("host", addr).body(Full::new(Bytes::new())) else {
        return out;
    };
    let Ok(resp) = tx.send_request(req).await else { return out };
    let Ok(body) = resp.into_body().collect().await else { return out };
    for line in String::from_utf8_lossy(&body.to_bytes()).lines() {
        if line.starts_with('#') {
            continue;
        }
        if let Some((k, v)) = line.rsplit_once(' ') {
            if let Ok(v) = v.parse() {
                out.insert(k.split('{').next().unwrap_or(k).to_string(), v);
            }
        }
    }
    out
}

struct Progress {
    done: AtomicUsize,
    failed: AtomicUsize,
    /// Answers whose ids the next turn could not know (see [`Writer::next_turn`]).
    answers_unread: AtomicUsize,
}

pub async fn run(args: LoadArgs) -> Result<Value, String> {
    let before = all_metrics(&args.engines).await;
    let progress = Arc::new(Progress {
        done: AtomicUsize::new(0),
        failed: AtomicUsize::new(0),
        answers_unread: AtomicUsize::new(0),
    });
    let words = match &args.tokenizer {
        Some(dir) => Some(Words::load(dir)?),
        None => None,
    };
    let writer = Arc::new(Writer::new(args.form, words)?);
    let targets: Arc<[String]> = args.target.split(',').map(str::to_string).collect();
    if targets.iter().any(|t| t.is_empty()) {
        return Err(format!("--target `{}`: an empty gateway address", args.target));
    }
    // The schedule's clock starts once the tokenizer is loaded and the prompts are
    // written: started before, every arrival due during that set-up (~0.5 s of text
    // rendering on this machine) went out at once, a burst no workload asked for.
    let sender = |start| Sender {
        targets: targets.clone(),
        sent: Arc::new(AtomicUsize::new(0)),
        sticky: args.sticky,
        model: args.model.clone(),
        token_header: args.token_header,
        prefix_hash_blocks: args.prefix_hash_blocks,
        cache_key: args.cache_key,
        start,
        timeout: Duration::from_secs_f64(args.request_timeout_s),
    };
    let (total, samples, start) = match args.workload {
        WorkloadKind::SharedPrefix | WorkloadKind::Mooncake => {
            let written: Vec<_> = plan(&args)?
                .into_iter()
                .map(|p| {
                    let c = writer.start(p.prompt, p.system_len);
                    (p.at, p.max_tokens, p.key, c)
                })
                .collect();
            let total = written.len();
            let start = Instant::now();
            let sender = sender(start);
            let ticker = ticker(&args, progress.clone(), total);
            let mut handles = Vec::with_capacity(total);
            for (at, max_tokens, key, c) in written {
                let sender = sender.clone();
                let progress = progress.clone();
                handles.push(tokio::spawn(async move {
                    tokio::time::sleep_until(tokio::time::Instant::from_std(start + at)).await;
                    let s = send(&sender, &c, max_tokens, key).await;
                    progress.done.fetch_add(1, Ordering::Relaxed);
                    if !s.ok {
                        progress.failed.fetch_add(1, Ordering::Relaxed);
                    }
                    s
                }));
            }
            let mut samples = Vec::with_capacity(total);
            for h in handles {
                samples.push(h.await.map_err(|e| e.to_string())?);
            }
            ticker.abort();
            (total, samples, start)
        }
        WorkloadKind::Chat | WorkloadKind::Agentic => {
            let mut rng = Rng::new(args.seed);
            let agentic = args.workload == WorkloadKind::Agentic;
            let chat = Chat {
                conversations: args.conversations,
                turns: args.turns,
                system: if agentic { workload::random_tokens(&mut rng, args.system_prompt_len) } else { Vec::new() },
                first_len: if agentic { args.question_len } else { args.system_prompt_len },
                question_len: args.question_len,
                output_len: args.output_len,
            };
            let total = chat.conversations * chat.turns;
            let starts = workload::poisson_times(&mut rng, chat.conversations, args.rate);
            // First prompts written up front, like the shared-prefix plan; each next turn
            // is written when the answer it follows is back.
            let firsts: Vec<_> = starts
                .into_iter()
                .enumerate()
                .map(|(c, at)| {
                    let mut rng = Rng::new(args.seed ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9));
                    let conv = writer.start(chat.first_prompt(&mut rng), chat.system.len());
                    (c, at, rng, conv)
                })
                .collect();
            let start = Instant::now();
            let sender = sender(start);
            let ticker = ticker(&args, progress.clone(), total);
            let mut handles = Vec::new();
            for (c, at, mut rng, mut conv) in firsts {
                let sender = sender.clone();
                let progress = progress.clone();
                let chat = chat.clone();
                let writer = writer.clone();
                handles.push(tokio::spawn(async move {
                    tokio::time::sleep_until(tokio::time::Instant::from_std(start + at)).await;
                    let mut out = Vec::new();
                    for _ in 0..chat.turns {
                        let s = send(&sender, &conv, chat.output_len, c as u64).await;
                        progress.done.fetch_add(1, Ordering::Relaxed);
                        if !s.ok {
                            // No answer to go on from: the conversation ends here, and its
                            // turns not sent count as failed too.
                            let left = chat.turns - out.len();
                            progress.failed.fetch_add(left, Ordering::Relaxed);
                            progress.done.fetch_add(left - 1, Ordering::Relaxed);
                            let not_sent =
                                Sample { prompt_tokens: 0, cached_tokens: 0, prompt: Vec::new(), ..s.clone() };
                            out.push(s);
                            out.extend(std::iter::repeat_n(not_sent, left - 1));
                            break;
                        }
                        if !writer.next_turn(&mut conv, &s, &workload::random_tokens(&mut rng, chat.question_len)) {
                            progress.answers_unread.fetch_add(1, Ordering::Relaxed);
                        }
                        out.push(s);
                    }
                    out
                }));
            }
            let mut samples = Vec::with_capacity(total);
            for h in handles {
                samples.extend(h.await.map_err(|e| e.to_string())?);
            }
            ticker.abort();
            (total, samples, start)
        }
    };
    let elapsed = start.elapsed().as_secs_f64();
    if !args.quiet {
        eprintln!("\r[{}] {total}/{total} done in {elapsed:.1} s{:>20}", args.label, "");
    }
    let after = all_metrics(&args.engines).await;
    let unread = progress.answers_unread.load(Ordering::Relaxed);
    if unread > 0 {
        log::warn!("{unread} answers came back as text not in the tokenizer's words: the next turns' planned ids lack them, and the oracle hit rate is approximate");
    }
    let mut summary = summarize(&args, samples, elapsed, &before, &after);
    summary["answers_unread"] = json!(unread);
    Ok(summary)
}

fn plan(args: &LoadArgs) -> Result<Vec<Planned>, String> {
    match args.workload {
        WorkloadKind::SharedPrefix => Ok(SharedPrefix {
            groups: args.groups.max(1),
            prompts_per_group: args.prompts_per_group.max(1),
            system_prompt_len: args.system_prompt_len,
            question_len: args.question_len,
            output_len: args.output_len.max(1),
            popularity: if args.zipf > 0.0 { Popularity::Zipf(args.zipf) } else { Popularity::Uniform },
        }
        .plan(args.seed, args.rate, args.burst)),
        WorkloadKind::Mooncake => {
            let text = std::fs::read_to_string(&args.trace).map_err(|e| format!("--trace {}: {e}", args.trace))?;
            workload::mooncake(&text, args.length_scale, args.time_scale, args.requests, args.output_len.max(1))
        }
        WorkloadKind::Chat | WorkloadKind::Agentic => Ok(Vec::new()),
    }
}

/// A progress line on stderr every quarter second.
fn ticker(args: &LoadArgs, progress: Arc<Progress>, total: usize) -> tokio::task::JoinHandle<()> {
    let (label, quiet) = (args.label.clone(), args.quiet);
    tokio::spawn(async move {
        if quiet {
            return;
        }
        let start = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let done = progress.done.load(Ordering::Relaxed);
            let width = 30;
            let filled = done * width / total.max(1);
            eprint!(
                "\r[{label}] [{}{}] {done}/{total} {:.0} s, {} failed ",
                "#".repeat(filled),
                ".".repeat(width - filled),
                start.elapsed().as_secs_f64(),
                progress.failed.load(Ordering::Relaxed)
            );
        }
    })
}

/// Every engine's `/metrics`, in order (empty for one that does not answer).
async fn all_metrics(engines: &[String]) -> Vec<BTreeMap<String, f64>> {
    let mut out = Vec::with_capacity(engines.len());
    for e in engines {
        out.push(engine_metrics(e).await);
    }
    out
}

fn summarize(
    args: &LoadArgs,
    samples: Vec<Sample>,
    elapsed: f64,
    before: &[BTreeMap<String, f64>],
    after: &[BTreeMap<String, f64>],
) -> Value {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let prompt: usize = ok.iter().map(|s| s.prompt_tokens).sum();
    let cached: usize = ok.iter().map(|s| s.cached_tokens).sum();
    let mut per_worker: BTreeMap<String, usize> = BTreeMap::new();
    for s in &ok {
        *per_worker.entry(s.worker.clone()).or_default() += 1;
    }
    // Busy time per engine over the run, and its imbalance (max / mean).
    let busy: Vec<f64> = before
        .iter()
        .zip(after)
        .map(|(b, a)| {
            a.get("kvroute_mock_busy_seconds_total").unwrap_or(&0.0)
                - b.get("kvroute_mock_busy_seconds_total").unwrap_or(&0.0)
        })
        .collect();
    let mean_busy = if busy.is_empty() { 0.0 } else { busy.iter().sum::<f64>() / busy.len() as f64 };
    let imbalance = if mean_busy > 0.0 { busy.iter().cloned().fold(0.0, f64::max) / mean_busy } else { 0.0 };
    json!({
        "label": args.label,
        "workload": format!("{:?}", args.workload),
        "sent_as": format!("{:?}", args.form).to_lowercase(),
        "token_header": args.token_header,
        "cache_key": args.cache_key,
        "requests": samples.len(),
        "failed": samples.len() - ok.len(),
        "duration_s": round2(elapsed),
        "throughput_rps": round2(ok.len() as f64 / elapsed.max(1e-9)),
        "ttft_ms": percentiles(ok.iter().map(|s| s.ttft_ms).collect()),
        "e2e_ms": percentiles(ok.iter().map(|s| s.e2e_ms).collect()),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": round2(cached as f64 / prompt.max(1) as f64 * 100.0) / 100.0,
        "oracle_hit_rate": round2(oracle_hit_rate(&samples) * 100.0) / 100.0,
        "per_worker": per_worker,
        "engine_busy_s": busy.iter().map(|b| round2(*b)).collect::<Vec<_>>(),
        "busy_imbalance": round2(imbalance),
        "samples": samples,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(prompt: Vec<u32>, sent_s: f64) -> Sample {
        Sample {
            key: 0,
            ok: true,
            ttft_ms: 0.0,
            e2e_ms: 0.0,
            prompt_tokens: prompt.len(),
            cached_tokens: 0,
            worker: String::new(),
            sent_s,
            route: String::new(),
            answer: String::new(),
            answer_ids: Vec::new(),
            prompt,
        }
    }

    #[test]
    fn oracle_counts_leading_blocks_seen_before_in_send_order() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a[..48].to_vec();
        b.extend(1000..1016);
        // Sent b after a: b's first 3 blocks are hits (48 of 64 tokens); a's first send: 0.
        let r = oracle_hit_rate(&[sample(b.clone(), 2.0), sample(a.clone(), 1.0)]);
        assert_eq!(r, 48.0 / 128.0);
        // The same prompt twice: the second hits all but its last token.
        assert_eq!(oracle_hit_rate(&[sample(a.clone(), 0.0), sample(a, 1.0)]), 63.0 / 128.0);
        assert_eq!(prefix_hash(&b, 2), prefix_hash(&(0..40).collect::<Vec<u32>>(), 2));
    }

    #[test]
    fn turns_are_written_in_each_form_and_chunks_read_back() {
        let first: Vec<u32> = (1000..1040).collect();
        let question: Vec<u32> = (2000..2008).collect();
        let mut answer = sample(vec![], 0.0);
        for chunk in [
            // A chat stream's first chunk carries the prompt's ids at the top level.
            json!({"prompt_token_ids": [7, 8, 9], "choices": [{"delta": {"content": " alpha"}, "token_ids": [11]}]}),
            json!({"choices": [{"delta": {"content": " beta"}, "token_ids": [12]}]}),
        ] {
            read_chunk(&chunk, &mut answer);
        }
        assert_eq!(
            (answer.answer.as_str(), &answer.answer_ids[..], &answer.prompt[..]),
            (" alpha beta", &[11, 12][..], &[7, 8, 9][..])
        );
        let mut completion = sample(vec![], 0.0);
        read_chunk(
            &json!({"choices": [{"text": " x", "token_ids": [5], "prompt_token_ids": [1, 2]}]}),
            &mut completion,
        );
        assert_eq!((completion.prompt_tokens, completion.answer.as_str()), (2, " x"));

        let tokens = Writer::new(PromptForm::Tokens, None).unwrap();
        let mut c = tokens.start(first.clone(), 0);
        tokens.next_turn(&mut c, &answer, &question);
        let expect: Vec<u32> = first.iter().chain(&[11, 12]).chain(&question).copied().collect();
        assert_eq!((c.body.clone(), c.planned.clone()), (Body::Tokens, expect.clone()));
        assert_eq!(c.json("qwen3", 4)["prompt"], json!(expect));
        assert_eq!(c.path(), "/v1/completions");
        assert!(Writer::new(PromptForm::Chat, None).is_err(), "text needs a tokenizer's words");

        let words = || Some(Words::of(&crate::text::test_model()).unwrap());
        let chat = Writer::new(PromptForm::Chat, words()).unwrap();
        let sys = chat.start(first.clone(), 30);
        let Body::Chat(m) = &sys.body else { panic!() };
        assert_eq!((m[0].0, m[0].1.split(' ').count(), m[1].0, m[1].1.split(' ').count()), ("system", 31, "user", 11));
        let mut c = chat.start(first.clone(), 0);
        chat.next_turn(&mut c, &answer, &question);
        let Body::Chat(m) = &c.body else { panic!("{:?}", c.body) };
        let roles: Vec<_> = m.iter().map(|(r, _)| *r).collect();
        assert_eq!((roles, m[1].1.as_str()), (vec!["user", "assistant", "user"], " alpha beta"));
        assert_eq!(m[0].1.split(' ').count(), 41);
        let v = c.json("qwen3", 4);
        assert_eq!((v["messages"][2]["role"].as_str(), v["return_token_ids"].as_bool()), (Some("user"), Some(true)));
        assert_eq!(c.path(), "/v1/chat/completions");

        let text = Writer::new(PromptForm::Text, words()).unwrap();
        let mut c = text.start(first.clone(), 0);
        assert!(text.next_turn(&mut c, &answer, &question));
        let Body::Text(t) = &c.body else { panic!() };
        assert!(t.contains(" alpha beta "), "{t}");
        assert_eq!(c.planned, expect);
    }

    #[test]
    fn a_request_timeout_is_a_positive_duration() {
        assert_eq!(positive_seconds("0.5"), Ok(0.5));
        for bad in ["0", "-1", "nan", "inf", "1e30", "soon"] {
            assert!(positive_seconds(bad).is_err(), "{bad}");
        }
    }

    /// A router that relays an answer's text without ids or prompt ids (Dynamo's
    /// frontend): the ids are read back from the words, the prompt count from the usage.
    #[test]
    fn a_text_only_stream_still_gives_the_ids_and_the_engines_count() {
        let words = Words::of(&crate::text::test_model()).unwrap();
        let said = words.ids_of(&[3, 4, 5]);
        let mut answer = sample(vec![], 0.0);
        read_chunk(&json!({"choices": [{"text": words.text(&[3, 4])}]}), &mut answer);
        let last = json!({"choices": [{"text": words.text(&[5])}],
                          "usage": {"prompt_tokens": 77, "prompt_tokens_details": {"cached_tokens": 48}}});
        assert!(!read_chunk(&last, &mut answer));
        read_last_chunk(&last, false, &mut answer);
        assert_eq!((answer.prompt_tokens, answer.cached_tokens, answer.answer_ids.len()), (77, 48, 0));
        let text = Writer::new(PromptForm::Text, Some(words)).unwrap();
        let mut c = text.start(vec![1, 2], 0);
        assert!(text.next_turn(&mut c, &answer, &[9]));
        assert_eq!(c.planned, [&[1, 2][..], &said, &[9]].concat());
        // Text that is not in the words: the turn goes on without the answer's ids, said so.
        answer.answer.push_str(" Zebra!");
        let mut c = text.start(vec![1, 2], 0);
        assert!(!text.next_turn(&mut c, &answer, &[9]));
        assert_eq!(c.planned, [1, 2, 9]);
        // The engine's own prompt ids win over the usage's count.
        let mut engine = sample(vec![], 0.0);
        assert!(read_chunk(&json!({"choices": [{"text": " x", "prompt_token_ids": [1, 2]}]}), &mut engine));
        read_last_chunk(&last, true, &mut engine);
        assert_eq!(engine.prompt_tokens, 2);
    }
}
