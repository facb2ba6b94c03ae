//! The stage alone, in process: what one OpenAI request costs to tokenize (request body in,
//! token ids out, as the ext_proc handler calls it), at 2k and 32k tokens, with the segment
//! cache cold (off) and with the system prompt (a chat's, or a text prompt's shared
//! document) cached, on the real Qwen3 tokenizer.
//!
//!     ./scripts/fetch-tokenizer.sh
//!     cargo bench -p kvroute-tokenizer --bench stage [-- --json out.json --texts DIR]
//!
//! One thread: calls per second are per core. `--texts DIR` writes the rendered prompts of
//! the cold chat cases, which `benches/stage_latency.py` tokenizes with Python transformers
//! for the per-token comparison.

use kvroute_tokenizer::model::ModelSpec;
use kvroute_tokenizer::stage::{Endpoint, Stage};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The allocator the stage's binary runs with (src/main.rs).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// English-like text (common words, capitals, numbers, punctuation), deterministic: BPE has
/// real merges to do, unlike repeated filler.
fn prose(words: usize, seed: u64) -> String {
    const WORDS: &str = "\
        the of and to in a is that for it as was with be by on not he this are or his from \
        at which but have an had they you were their one all we can her has there been if \
        more when will would who so no cache worker prefix request token model engine \
        routing latency throughput memory gateway cluster Kubernetes Envoy vLLM attention \
        sequence scheduler prefill decode batch GPU context window document retrieval \
        answer question system assistant user tool function argument JSON schema deployment \
        replica region policy eviction block hash event stream timeout budget p99 2048 16 \
        3.5 x86_64 don't it's";
    let vocab: Vec<&str> = WORDS.split_whitespace().collect();
    let mut s = String::with_capacity(words * 7);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let w = vocab[(x % vocab.len() as u64) as usize];
        if i > 0 {
            s.push(' ');
        }
        if i % 13 == 0 {
            let mut c = w.chars();
            s.extend(c.next().map(|c| c.to_ascii_uppercase()));
            s.push_str(c.as_str());
        } else {
            s.push_str(w);
        }
        match x % 29 {
            0 => s.push('.'),
            1 => s.push(','),
            2 => s.push_str(":\n"),
            _ => {}
        }
    }
    s
}

fn stage(cache_bytes: usize) -> Stage {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/tokenizers/qwen3");
    assert!(dir.join("tokenizer.json").exists(), "{}: run scripts/fetch-tokenizer.sh", dir.display());
    let spec = ModelSpec {
        name: "qwen3".into(),
        path: dir,
        max_model_len: Some(40960),
        loras: vec![],
        chat_template: None,
        cache_bytes,
    };
    Stage::new(&[spec], false, false).expect("the Qwen3 tokenizer loads")
}

/// A system prompt of about `tokens` tokens.
fn system_prompt(stage: &Stage, tokens: usize) -> String {
    let model = &stage.models()[0];
    let text = prose(tokens, 7);
    let enc = model.tokenizer().encode(text.as_str(), false).expect("encodes"); // (encode_fast has no offsets)
    let cut = enc.get_offsets().get(tokens).map_or(text.len(), |o| o.0);
    text[..cut].to_string()
}

struct Case {
    name: String,
    endpoint: Endpoint,
    /// The n-th request's body (a new user question each time; the rest repeats).
    body: Box<dyn Fn(usize) -> Vec<u8>>,
}

fn cases(stage: &Stage) -> Vec<Case> {
    let mut out = Vec::new();
    for tokens in [2048usize, 32768] {
        let system = system_prompt(stage, tokens);
        let chat_system = system.clone();
        out.push(Case {
            name: format!("chat_{}k", tokens / 1024),
            endpoint: Endpoint::ChatCompletions,
            body: Box::new(move |n| {
                serde_json::to_vec(&json!({"model": "qwen3", "max_tokens": 16, "messages": [
                    {"role": "system", "content": chat_system},
                    {"role": "user", "content": format!("Question {n}: {}", prose(24, n as u64 + 100))}]}))
                .unwrap_or_default()
            }),
        });
        // A plain-text completion: the same document, then a new question, in one string
        // (one segment: the chunk cache is what serves its shared part).
        let document = system.clone();
        out.push(Case {
            name: format!("text_{}k", tokens / 1024),
            endpoint: Endpoint::Completions,
            body: Box::new(move |n| {
                let prompt = format!("{document}\nQuestion {n}: {}", prose(24, n as u64 + 100));
                serde_json::to_vec(&json!({"model": "qwen3", "max_tokens": 16, "prompt": prompt})).unwrap_or_default()
            }),
        });
        let ids: Vec<u32> = (0..tokens as u32).map(|i| (i * 2_654_435_761u32) % 151_000).collect();
        out.push(Case {
            name: format!("token_array_{}k", tokens / 1024),
            endpoint: Endpoint::Completions,
            body: Box::new(move |n| {
                let mut ids = ids.clone();
                if let Some(last) = ids.last_mut() {
                    *last = n as u32 % 151_000;
                }
                serde_json::to_vec(&json!({"model": "qwen3", "max_tokens": 16, "prompt": ids})).unwrap_or_default()
            }),
        });
    }
    out
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

/// Calls `stage.prompt` on new bodies for about `budget` (bodies are built outside the
/// timing); µs p50 / p99 / mean, and calls per second on one core.
fn measure(stage: &Stage, case: &Case, budget: Duration) -> Value {
    for n in 0..3 {
        let _ = stage.prompt(case.endpoint, &(case.body)(1_000_000 + n));
    }
    let mut times = Vec::new();
    let mut tokens = 0;
    let start = Instant::now();
    let mut n = 0;
    while (start.elapsed() < budget || times.len() < 20) && times.len() < 5000 {
        let body = (case.body)(n);
        n += 1;
        let t0 = Instant::now();
        let p = stage.prompt(case.endpoint, &body);
        times.push(t0.elapsed());
        match p {
            Ok(p) => tokens = p.tokens.len(),
            Err(e) => panic!("{}: {e}", case.name),
        }
    }
    times.sort();
    let mean = times.iter().sum::<Duration>().as_secs_f64() / times.len() as f64;
    json!({"case": case.name, "tokens": tokens, "calls": times.len(),
           "p50_us": percentile(&times, 0.5).round(), "p99_us": percentile(&times, 0.99).round(),
           "mean_us": (mean * 1e6).round(), "calls_per_core_s": (1.0 / mean).round()})
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let budget = Duration::from_secs_f64(arg("--seconds").and_then(|s| s.parse().ok()).unwrap_or(2.0));
    let cold = stage(0);
    let cached = stage(256 << 20);
    let mut rows = Vec::new();
    for (cache, st) in [("cold", &cold), ("cached", &cached)] {
        for case in cases(st) {
            let mut r = measure(st, &case, budget);
            r["cache"] = json!(cache);
            println!(
                "{:>16} {:>6}: {:>6} tokens  p50 {:>8} µs  p99 {:>8} µs  {:>7} calls/s per core",
                r["case"].as_str().unwrap_or(""),
                cache,
                r["tokens"],
                r["p50_us"],
                r["p99_us"],
                r["calls_per_core_s"]
            );
            rows.push(r);
        }
    }
    // Uncached encoding alone, per token, on the rendered 32k chat (what Python's fast
    // tokenizer is compared on).
    let mut per_token = Vec::new();
    for case in cases(&cold).into_iter().filter(|c| c.endpoint == Endpoint::ChatCompletions) {
        let body = (case.body)(0);
        let req = Stage::parse(&body).expect("json");
        let model = &cold.models()[0];
        let text = cold.chat_text(model, &req, false).expect("renders");
        let mut times = Vec::new();
        let mut n = 0;
        for _ in 0..20 {
            let t0 = Instant::now();
            n = model.encode_unbounded(&text, false).expect("encodes").len();
            times.push(t0.elapsed());
        }
        times.sort();
        let us_per_token = percentile(&times, 0.5) / n as f64;
        println!("{:>16} uncached encode: {n} tokens, {us_per_token:.3} µs per token (median of 20)", case.name);
        per_token.push(json!({"case": case.name, "tokens": n, "us_per_token": us_per_token}));
        if let Some(dir) = arg("--texts") {
            let path = PathBuf::from(dir).join(format!("{}.txt", case.name));
            if let Err(e) = std::fs::write(&path, &text) {
                eprintln!("{}: {e}", path.display());
                std::process::exit(1);
            }
        }
    }
    if let Some(path) = arg("--json") {
        let out = json!({"stage": rows, "uncached_encode": per_token});
        if let Err(e) = std::fs::write(&path, serde_json::to_string_pretty(&out).unwrap_or_default()) {
            eprintln!("{path}: {e}");
            std::process::exit(1);
        }
    }
}
