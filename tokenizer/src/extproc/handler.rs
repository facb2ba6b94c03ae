//! What the stage does with one HTTP request's ext_proc messages:
//! - request headers: client copies of the routing headers are removed (unless the operator
//!   trusts clients' tokens); a request the stage will not read (not `POST` to an OpenAI
//!   endpoint, a body over the limit, client tokens trusted) switches its body off with a
//!   mode override, so Envoy neither buffers it for the stage nor waits;
//! - the request body (buffered whole): tokenized on the blocking pool, the token header
//!   (and `x-kvroute-lora` / `x-kvroute-cache-salt`) set by a header mutation, the route
//!   cache cleared so the filters after see them. Anything else: no mutation, counted.
//!
//! It never fails a request: every path answers `CONTINUE`.

use super::proto::{
    processing_request::Request as Req, processing_response::Response as Resp, BodyResponse, BodySendMode,
    CommonResponse, HeaderAppendAction, HeaderMutation, HeaderValue, HeaderValueOption, HeadersResponse, HttpHeaders,
    ProcessingMode, ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use super::server::{HandlerFactory, StreamHandler};
use crate::stage::{Endpoint, Prompt, Stage};
use crate::stats::{Outcome, Stats};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Semaphore;
use tonic::codegen::BoxFuture;
use tonic::Status;

/// The headers the stage writes (the kvroute filter's defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct Headers {
    /// Token ids as base64 of little-endian u32 (the filter's `token_header_b64`).
    pub tokens_b64: String,
    /// The decimal form, also removed from client requests (the filter's `token_header`).
    pub tokens_decimal: String,
    pub lora: String,
    pub cache_salt: String,
    pub cache_key: String,
}

impl Default for Headers {
    fn default() -> Self {
        Headers {
            tokens_b64: "x-prompt-token-ids-b64".into(),
            tokens_decimal: "x-prompt-token-ids".into(),
            lora: "x-kvroute-lora".into(),
            cache_salt: "x-kvroute-cache-salt".into(),
            cache_key: "x-kvroute-cache-key".into(),
        }
    }
}

pub struct StageProcessor {
    pub stage: Arc<Stage>,
    pub stats: Arc<Stats>,
    pub headers: Headers,
    /// Keep clients' own token / LoRA / salt headers (they are trusted to be right).
    pub trust_client_tokens: bool,
    /// Bodies larger than this are not read (Envoy is told not to send them).
    pub max_body_bytes: usize,
    /// Tokenizations running at once (the rest wait; Envoy's message timeout bounds the wait).
    pub limiter: Arc<Semaphore>,
}

impl HandlerFactory for StageProcessor {
    type Handler = StreamState;

    fn new_stream(self: Arc<Self>) -> StreamState {
        StreamState { p: self, endpoint: None }
    }
}

pub struct StreamState {
    p: Arc<StageProcessor>,
    /// The OpenAI endpoint the request goes to, once its headers said it will be read.
    endpoint: Option<Endpoint>,
}

fn header<'a>(h: &'a HttpHeaders, name: &str) -> Option<&'a [u8]> {
    h.headers.as_ref()?.headers.iter().find(|v| v.key.eq_ignore_ascii_case(name)).map(HeaderValue::bytes)
}

fn common(mutation: Option<HeaderMutation>, clear_route_cache: bool) -> Option<CommonResponse> {
    Some(CommonResponse { status: 0, header_mutation: mutation, clear_route_cache })
}

fn set(key: &str, value: String) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: key.into(), value: String::new(), raw_value: value.into_bytes() }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
    }
}

fn skip_body() -> ProcessingMode {
    ProcessingMode { request_body_mode: BodySendMode::None as i32, ..ProcessingMode::default() }
}

impl StreamState {
    fn on_headers(&mut self, h: &HttpHeaders) -> ProcessingResponse {
        let p = &self.p;
        let hd = &p.headers;
        let client_has_tokens = header(h, &hd.tokens_b64).is_some() || header(h, &hd.tokens_decimal).is_some();
        let mut mutation = None;
        if !p.trust_client_tokens {
            let present: Vec<String> = [&hd.tokens_b64, &hd.tokens_decimal, &hd.lora, &hd.cache_salt, &hd.cache_key]
                .into_iter()
                .filter(|n| header(h, n).is_some())
                .cloned()
                .collect();
            if !present.is_empty() {
                p.stats.count(Outcome::ClientHeadersRemoved);
                mutation = Some(HeaderMutation { set_headers: Vec::new(), remove_headers: present });
            }
        }
        let method = header(h, ":method").unwrap_or_default();
        let path = header(h, ":path").map(|b| String::from_utf8_lossy(b).into_owned()).unwrap_or_default();
        let length =
            header(h, "content-length").and_then(|v| std::str::from_utf8(v).ok()?.trim().parse::<usize>().ok());
        let skip = match Endpoint::of_path(&path) {
            _ if p.trust_client_tokens && client_has_tokens => Some(Outcome::ClientTokensTrusted),
            Some(_) if method != b"POST" => Some(Outcome::NotOpenAi),
            None => Some(Outcome::NotOpenAi),
            Some(_) if h.end_of_stream => Some(Outcome::NoBody),
            Some(_) if length.is_some_and(|n| n > p.max_body_bytes) => Some(Outcome::TooLarge),
            Some(e) => {
                self.endpoint = Some(e);
                None
            }
        };
        if let Some(o) = skip {
            p.stats.count(o);
        }
        ProcessingResponse {
            response: Some(Resp::RequestHeaders(HeadersResponse { response: common(mutation, false) })),
            mode_override: skip.filter(|_| !h.end_of_stream).map(|_| skip_body()),
        }
    }
}

/// The buffered body of a request whose headers said it will be read.
async fn on_body(
    p: Arc<StageProcessor>,
    endpoint: Option<Endpoint>,
    body: bytes::Bytes,
    end_of_stream: bool,
) -> ProcessingResponse {
    let continue_as_is = || ProcessingResponse {
        response: Some(Resp::RequestBody(BodyResponse { response: common(None, false) })),
        mode_override: None,
    };
    let Some(endpoint) = endpoint else {
        return continue_as_is();
    };
    if !end_of_stream || body.len() > p.max_body_bytes {
        // Not BUFFERED whole (a misconfigured body mode, or no length header).
        p.stats.count(Outcome::TooLarge);
        return continue_as_is();
    }
    let started = Instant::now();
    let Ok(permit) = p.limiter.clone().acquire_owned().await else {
        return continue_as_is();
    };
    let stage = p.stage.clone();
    let result = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        stage.prompt(endpoint, &body)
    })
    .await;
    let prompt = match result {
        Ok(Ok(prompt)) => prompt,
        Ok(Err(skip)) => {
            log::debug!("request routed by load: {skip}");
            p.stats.count(Outcome::Skipped(skip.label()));
            return continue_as_is();
        }
        Err(e) => {
            // A panic in tokenization: counted, and the request goes on untouched.
            log::error!("tokenization failed: {e}");
            p.stats.count(Outcome::Failed);
            return continue_as_is();
        }
    };
    p.stats.tokenized(&prompt, started.elapsed());
    let mut set_headers = vec![set(&p.headers.tokens_b64, kvroute::tokens::encode_base64(&prompt.tokens))];
    let Prompt { lora, cache_salt, cache_key, .. } = prompt;
    if let Some(l) = lora {
        set_headers.push(set(&p.headers.lora, l));
    }
    if let Some(s) = cache_salt {
        set_headers.push(set(&p.headers.cache_salt, s));
    }
    if let Some(k) = cache_key {
        set_headers.push(set(&p.headers.cache_key, k));
    }
    ProcessingResponse {
        response: Some(Resp::RequestBody(BodyResponse {
            response: common(Some(HeaderMutation { set_headers, remove_headers: Vec::new() }), true),
        })),
        mode_override: None,
    }
}

impl StreamHandler for StreamState {
    fn handle(&mut self, msg: ProcessingRequest) -> BoxFuture<Option<ProcessingResponse>, Status> {
        let reply = match msg.request {
            Some(Req::RequestHeaders(h)) => Some(self.on_headers(&h)),
            Some(Req::RequestBody(b)) => {
                let (p, endpoint) = (self.p.clone(), self.endpoint.take());
                return Box::pin(async move { Ok(Some(on_body(p, endpoint, b.body, b.end_of_stream).await)) });
            }
            Some(Req::RequestTrailers(_)) => Some(ProcessingResponse {
                response: Some(Resp::RequestTrailers(TrailersResponse { header_mutation: None })),
                mode_override: None,
            }),
            Some(Req::ResponseHeaders(_)) => Some(ProcessingResponse {
                response: Some(Resp::ResponseHeaders(HeadersResponse { response: common(None, false) })),
                mode_override: None,
            }),
            Some(Req::ResponseBody(_)) => Some(ProcessingResponse {
                response: Some(Resp::ResponseBody(BodyResponse { response: common(None, false) })),
                mode_override: None,
            }),
            Some(Req::ResponseTrailers(_)) => Some(ProcessingResponse {
                response: Some(Resp::ResponseTrailers(TrailersResponse { header_mutation: None })),
                mode_override: None,
            }),
            None => None,
        };
        Box::pin(async move { Ok(reply) })
    }
}
