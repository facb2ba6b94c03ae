//! The stage's HTTP port: `POST /tokenize` in vLLM's request and response shape (so its
//! answer can be compared with an engine's own `/tokenize`), `GET /metrics`, `GET /healthz`.

use crate::stage::{encode_params, Skip, Stage};
use crate::stats::Stats;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use kvroute_serve::respond;
use serde_json::{json, Map, Value};
use std::sync::Arc;

pub struct App {
    pub stage: Arc<Stage>,
    pub stats: Arc<Stats>,
    pub max_body_bytes: usize,
}

type Resp = Response<Full<Bytes>>;

/// vLLM's `ErrorResponse`.
fn error(status: StatusCode, message: &str) -> Resp {
    let kind = if status == StatusCode::NOT_FOUND { "NotFoundError" } else { "BadRequestError" };
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}});
    respond(status, "application/json", body.to_string())
}

pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Result<Resp, std::convert::Infallible> {
    let path = req.uri().path().to_string();
    Ok(match (req.method(), path.as_str()) {
        (&Method::POST, "/tokenize") => tokenize(&app, req).await,
        (&Method::GET, "/metrics") => {
            respond(StatusCode::OK, "text/plain; version=0.0.4", app.stats.render(&app.stage))
        }
        (&Method::GET, "/healthz") => respond(StatusCode::OK, "application/json", r#"{"status":"ok"}"#),
        (_, "/tokenize") => error(StatusCode::METHOD_NOT_ALLOWED, "POST /tokenize"),
        _ => error(StatusCode::NOT_FOUND, "no such path"),
    })
}

async fn tokenize(app: &App, req: Request<Incoming>) -> Resp {
    let json_body = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json")));
    if !json_body {
        return error(StatusCode::BAD_REQUEST, "Unsupported Media Type: Only 'application/json' is allowed");
    }
    let body = match Limited::new(req.into_body(), app.max_body_bytes).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return error(StatusCode::PAYLOAD_TOO_LARGE, "the body is over the limit"),
    };
    let stage = app.stage.clone();
    let answer = tokio::task::spawn_blocking(move || tokenize_body(&stage, &body)).await;
    match answer {
        Ok(Ok(v)) => respond(StatusCode::OK, "application/json", v.to_string()),
        Ok(Err(skip)) => {
            let (status, message) = skip.vllm_error();
            error(StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST), &message)
        }
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &format!("tokenization failed: {e}")),
    }
}

/// vLLM's `/tokenize`: a completion-style `{prompt}` (a string) or chat-style `{messages}`,
/// tokenized with no truncation and no length limit; `{count, max_model_len, tokens,
/// token_strs}`.
pub fn tokenize_body(stage: &Stage, body: &[u8]) -> Result<Value, Skip> {
    let req: Map<String, Value> = Stage::parse(body)?;
    let (model, _lora) = stage.resolve(&req)?;
    let (text, special_default) = if req.contains_key("messages") {
        (stage.chat_text(model, &req, true)?, false)
    } else {
        match req.get("prompt") {
            Some(Value::String(s)) => (s.clone(), true),
            _ => return Err(Skip::Invalid("prompt must be a string (or send messages)".into())),
        }
    };
    let mut p = encode_params(&req, special_default, None, model)?;
    p.truncate_prompt_tokens = None;
    let tokens = model.encode_unbounded(&text, p.add_special_tokens)?;
    let token_strs = match req.get("return_token_strs") {
        Some(Value::Bool(true)) => {
            let tok = model.tokenizer();
            Value::Array(tokens.iter().map(|t| tok.id_to_token(*t).map_or(Value::Null, Value::String)).collect())
        }
        _ => Value::Null,
    };
    Ok(json!({"count": tokens.len(), "max_model_len": model.max_model_len, "tokens": tokens, "token_strs": token_strs}))
}
