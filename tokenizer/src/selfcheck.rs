//! The startup self-check: a few prompts sent to a worker's own `POST /tokenize` (vLLM's
//! endpoint) and compared with what the stage computes for them. Any difference means
//! routing would never hit (a different tokenizer, template or vLLM version): logged loudly
//! and counted, never fatal (the engine may come up later; operators decide).

use crate::http::tokenize_body;
use crate::stage::Stage;
use crate::stats::Stats;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// What the checks found, for `/metrics`.
#[derive(Default)]
pub struct SelfCheck {
    pub agree: AtomicU64,
    pub differ: AtomicU64,
    pub unreachable: AtomicU64,
}

/// The prompts: a chat with a system prompt, one with tools and a thinking switch, and text
/// with special tokens and non-ASCII characters.
pub fn prompts(model: Option<&str>) -> Vec<Value> {
    let tool = json!({"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}});
    let mut out = vec![
        json!({"messages": [{"role": "system", "content": "You are a careful assistant."},
                            {"role": "user", "content": "Summarize the plot of Hamlet in two sentences."}]}),
        json!({"messages": [{"role": "user", "content": "What does “sonder” mean?"}], "tools": [tool],
               "chat_template_kwargs": {"enable_thinking": false}}),
        json!({"prompt": "<|im_start|>user\nGrüße aus Köln — 東京 👋 12345<|im_end|>\n"}),
        json!({"prompt": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"}),
    ];
    if let Some(m) = model {
        for p in &mut out {
            p["model"] = m.into();
        }
    }
    out
}

async fn post_tokenize(url: &str, body: &Value) -> Result<Vec<u64>, String> {
    let uri: hyper::Uri =
        format!("{}/tokenize", url.trim_end_matches('/')).parse().map_err(|e| format!("{url}: {e}"))?;
    let host = uri.host().ok_or(format!("{url}: no host"))?.to_string();
    let port = uri.port_u16().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((host.as_str(), port)).await.map_err(|e| format!("{url}: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    tokio::spawn(conn);
    let req = hyper::Request::post(uri.path())
        .header("host", format!("{host}:{port}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let resp = send.send_request(req).await.map_err(|e| format!("{url}: {e}"))?;
    let status = resp.status();
    let bytes = resp.into_body().collect().await.map_err(|e| format!("{url}: {e}"))?.to_bytes();
    if !status.is_success() {
        return Err(format!("{url}/tokenize answered {status}: {}", String::from_utf8_lossy(&bytes)));
    }
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| format!("{url}/tokenize: {e}"))?;
    v.get("tokens")
        .and_then(Value::as_array)
        .map(|t| t.iter().filter_map(Value::as_u64).collect())
        .ok_or(format!("{url}/tokenize: no tokens in the answer"))
}

/// Checks every worker URL (retrying an unreachable one a few times: engines start slowly).
pub async fn run(stage: std::sync::Arc<Stage>, urls: Vec<String>, model: Option<String>, stats: std::sync::Arc<Stats>) {
    let out = &stats.self_check;
    for url in urls {
        let mut agreed = 0;
        for (i, p) in prompts(model.as_deref()).iter().enumerate() {
            let mut theirs = Err(String::new());
            for attempt in 0..10 {
                theirs = post_tokenize(&url, p).await;
                if theirs.is_ok() || attempt == 9 {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            let theirs = match theirs {
                Ok(t) => t,
                Err(e) => {
                    out.unreachable.fetch_add(1, Relaxed);
                    log::error!("self-check against {url}: prompt {i}: {e}");
                    continue;
                }
            };
            let ours = match tokenize_body(&stage, p.to_string().as_bytes()) {
                Ok(v) => v["tokens"].as_array().map(|t| t.iter().filter_map(Value::as_u64).collect::<Vec<_>>()),
                Err(e) => {
                    log::error!("self-check: the stage cannot tokenize its own prompt {i}: {e}");
                    None
                }
            };
            if ours.as_ref() == Some(&theirs) {
                out.agree.fetch_add(1, Relaxed);
                agreed += 1;
            } else {
                out.differ.fetch_add(1, Relaxed);
                let ours = ours.unwrap_or_default();
                let at = ours.iter().zip(&theirs).position(|(a, b)| a != b).unwrap_or(ours.len().min(theirs.len()));
                log::error!(
                    "SELF-CHECK FAILED against {url}: prompt {i} tokenizes to {} ids there and {} here, first \
                     difference at {at}. Requests will not hit their cache: check the tokenizer directory, chat \
                     template and max_model_len against the engine's.",
                    theirs.len(),
                    ours.len()
                );
            }
        }
        log::info!("self-check against {url}: {agreed} of {} prompts agree", prompts(None).len());
    }
}
