//! What the stage does with one HTTP request's ext_proc messages:
//! - request headers: client copies of the routing headers are removed (unless the operator
//!   trusts clients' tokens); a request the stage will not read (not `POST` to an OpenAI
//!   endpoint, a body over the limit, client tokens trusted) is answered at once (with the
//!   body switched off by a mode override, where Envoy honours one);
//! - the request body, tokenized on the blocking pool: the token header (and
//!   `x-kvroute-lora` / `x-kvroute-cache-salt` / `x-kvroute-cache-key`) set by a header
//!   mutation, the route cache cleared so the filters after see them. Anything else: no
//!   mutation, counted. Two ways, told apart by the stream's protocol configuration:
//!   - one round trip (`STREAMED` with `send_body_without_waiting_for_header_response`):
//!     Envoy sends the body's chunks behind the headers without waiting; the stage gathers
//!     them and answers the headers once the body is whole, with the token header in that
//!     answer, then every chunk;
//!   - two (`BUFFERED`): the headers are answered at once, the body arrives whole in one
//!     message and its answer carries the token header.
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
use bytes::Bytes;
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
        StreamState { p: self, delayed: false, read: Read::Pass }
    }
}

pub struct StreamState {
    p: Arc<StageProcessor>,
    /// Envoy streams the body without waiting for the headers' answer (one round trip):
    /// the headers are answered once the body is read.
    delayed: bool,
    read: Read,
}

/// Where a request's reading stands.
enum Read {
    /// Not read: every message is answered as it comes.
    Pass,
    /// The headers are answered; the body comes whole (`BUFFERED`), for this endpoint.
    Whole(Endpoint),
    /// The headers wait for the body ([`StreamState::delayed`]).
    Gathering(Gathered),
}

/// A body gathered behind headers that wait for it.
struct Gathered {
    endpoint: Endpoint,
    /// The client copies of the routing headers, removed in the headers' answer.
    removals: Option<HeaderMutation>,
    chunks: Vec<Bytes>,
    size: usize,
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
    fn on_headers(&mut self, h: &HttpHeaders) -> Vec<ProcessingResponse> {
        let p = &self.p;
        let hd = &p.headers;
        let client_has_tokens = header(h, &hd.tokens_b64).is_some() || header(h, &hd.tokens_decimal).is_some();
        let mut removals = None;
        if !p.trust_client_tokens {
            let present: Vec<String> = [&hd.tokens_b64, &hd.tokens_decimal, &hd.lora, &hd.cache_salt, &hd.cache_key]
                .into_iter()
                .filter(|n| header(h, n).is_some())
                .cloned()
                .collect();
            if !present.is_empty() {
                p.stats.count(Outcome::ClientHeadersRemoved);
                removals = Some(HeaderMutation { set_headers: Vec::new(), remove_headers: present });
            }
        }
        let method = header(h, ":method").unwrap_or_default();
        let path = header(h, ":path").map(|b| String::from_utf8_lossy(b).into_owned()).unwrap_or_default();
        let length =
            header(h, "content-length").and_then(|v| std::str::from_utf8(v).ok()?.trim().parse::<usize>().ok());
        let skip = match Endpoint::of_path(&path) {
            _ if p.trust_client_tokens && client_has_tokens => Err(Outcome::ClientTokensTrusted),
            Some(_) if method != b"POST" => Err(Outcome::NotOpenAi),
            None => Err(Outcome::NotOpenAi),
            Some(_) if h.end_of_stream => Err(Outcome::NoBody),
            Some(_) if length.is_some_and(|n| n > p.max_body_bytes) => Err(Outcome::TooLarge),
            Some(e) => Ok(e),
        };
        match skip {
            Ok(endpoint) if self.delayed => {
                self.read = Read::Gathering(Gathered { endpoint, removals, chunks: Vec::new(), size: 0 });
                return Vec::new();
            }
            Ok(endpoint) => self.read = Read::Whole(endpoint),
            Err(o) => {
                p.stats.count(o);
                self.read = Read::Pass;
            }
        }
        // Envoy ignores a mode override once it may have sent the body (delayed).
        let body_off = skip.is_err() && !h.end_of_stream && !self.delayed;
        vec![headers_response(removals, false, body_off.then(skip_body))]
    }

    /// A chunk of a body whose headers wait for it: the answers, once it is whole (or over
    /// the limit).
    fn on_chunk(
        &mut self,
        mut g: Gathered,
        body: Bytes,
        end_of_stream: bool,
    ) -> BoxFuture<Option<Vec<ProcessingResponse>>, Status> {
        g.size += body.len();
        g.chunks.push(body);
        if g.size > self.p.max_body_bytes {
            self.p.stats.count(Outcome::TooLarge);
            return ready(answers(g.removals, Vec::new(), g.chunks.len()));
        }
        if !end_of_stream {
            self.read = Read::Gathering(g);
            return ready(Vec::new());
        }
        self.read_gathered(g, None)
    }

    /// The whole gathered body, read: the held headers' answer, each chunk's, then `last`
    /// (the trailers' answer, when they ended the body).
    fn read_gathered(
        &self,
        g: Gathered,
        last: Option<ProcessingResponse>,
    ) -> BoxFuture<Option<Vec<ProcessingResponse>>, Status> {
        let p = self.p.clone();
        p.stats.one_round_trip();
        Box::pin(async move {
            let Gathered { endpoint, removals, mut chunks, .. } = g;
            let n = chunks.len();
            let body = match n {
                1 => chunks.pop().unwrap_or_default(),
                _ => chunks.concat().into(),
            };
            let mut out = answers(removals, read_prompt(&p, endpoint, body).await, n);
            out.extend(last);
            Ok(Some(out))
        })
    }
}

/// The delayed headers' answer (their client copies removed, the stage's headers set) and
/// one answer per body chunk held behind them.
fn answers(removals: Option<HeaderMutation>, set: Vec<HeaderValueOption>, chunks: usize) -> Vec<ProcessingResponse> {
    let (mutation, routed) = mutation(removals, set);
    let mut out = Vec::with_capacity(chunks + 1);
    out.push(headers_response(mutation, routed, None));
    out.extend((0..chunks).map(|_| body_response(None, false)));
    out
}

/// The mutation that removes `removals`' headers and sets `set`'s, and whether it routes
/// the request (sets the token header: the route cache must then be cleared).
fn mutation(removals: Option<HeaderMutation>, set: Vec<HeaderValueOption>) -> (Option<HeaderMutation>, bool) {
    let routed = !set.is_empty();
    let mutation = match removals {
        Some(mut m) => {
            m.set_headers = set;
            Some(m)
        }
        None => routed.then(|| HeaderMutation { set_headers: set, remove_headers: Vec::new() }),
    };
    (mutation, routed)
}

fn headers_response(
    mutation: Option<HeaderMutation>,
    clear_route_cache: bool,
    mode_override: Option<ProcessingMode>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Resp::RequestHeaders(HeadersResponse { response: common(mutation, clear_route_cache) })),
        mode_override,
    }
}

fn body_response(mutation: Option<HeaderMutation>, clear_route_cache: bool) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Resp::RequestBody(BodyResponse { response: common(mutation, clear_route_cache) })),
        mode_override: None,
    }
}

fn ready(answers: Vec<ProcessingResponse>) -> BoxFuture<Option<Vec<ProcessingResponse>>, Status> {
    Box::pin(async move { Ok(Some(answers)) })
}

/// A body that came whole (`BUFFERED`) after its headers were answered.
async fn on_whole_body(
    p: Arc<StageProcessor>,
    endpoint: Endpoint,
    body: Bytes,
    end_of_stream: bool,
) -> ProcessingResponse {
    if !end_of_stream || body.len() > p.max_body_bytes {
        // Not BUFFERED whole (a misconfigured body mode, or no length header).
        p.stats.count(Outcome::TooLarge);
        return body_response(None, false);
    }
    let (mutation, routed) = mutation(None, read_prompt(&p, endpoint, body).await);
    body_response(mutation, routed)
}

/// The headers to set for a whole body: its token ids and the namespace it names; none if
/// the stage cannot read it (counted).
async fn read_prompt(p: &StageProcessor, endpoint: Endpoint, body: Bytes) -> Vec<HeaderValueOption> {
    let started = Instant::now();
    let Ok(permit) = p.limiter.clone().acquire_owned().await else {
        return Vec::new();
    };
    let (stage, permitted) = (p.stage.clone(), started.elapsed());
    let result = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let began = started.elapsed();
        (stage.prompt(endpoint, &body), began, started.elapsed())
    })
    .await;
    let prompt = match result {
        Ok((Ok(prompt), began, ended)) => {
            // Where a request's time in the stage went (benches/access_paths.py reads it).
            log::debug!(
                "tokenized {} tokens: {} µs for a permit, {} µs for a thread, {} µs tokenizing, {} µs in all",
                prompt.tokens.len(),
                permitted.as_micros(),
                began.saturating_sub(permitted).as_micros(),
                ended.saturating_sub(began).as_micros(),
                started.elapsed().as_micros()
            );
            prompt
        }
        Ok((Err(skip), ..)) => {
            log::debug!("request routed by load: {skip}");
            p.stats.count(Outcome::Skipped(skip.label()));
            return Vec::new();
        }
        Err(e) => {
            // A panic in tokenization: counted, and the request goes on untouched.
            log::error!("tokenization failed: {e}");
            p.stats.count(Outcome::Failed);
            return Vec::new();
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
    set_headers
}

impl StreamHandler for StreamState {
    fn handle(&mut self, msg: ProcessingRequest) -> BoxFuture<Option<Vec<ProcessingResponse>>, Status> {
        if let Some(c) = &msg.protocol_config {
            self.delayed =
                c.send_body_without_waiting_for_header_response && c.request_body_mode == BodySendMode::Streamed as i32;
        }
        let reply = match msg.request {
            Some(Req::RequestHeaders(h)) => self.on_headers(&h),
            Some(Req::RequestBody(b)) => match std::mem::replace(&mut self.read, Read::Pass) {
                Read::Whole(endpoint) => {
                    let p = self.p.clone();
                    return Box::pin(async move {
                        Ok(Some(vec![on_whole_body(p, endpoint, b.body, b.end_of_stream).await]))
                    });
                }
                Read::Gathering(g) => return self.on_chunk(g, b.body, b.end_of_stream),
                Read::Pass => vec![body_response(None, false)],
            },
            Some(Req::RequestTrailers(_)) => {
                let trailers = ProcessingResponse {
                    response: Some(Resp::RequestTrailers(TrailersResponse { header_mutation: None })),
                    mode_override: None,
                };
                // Trailers end a body: one gathered so far is whole.
                match std::mem::replace(&mut self.read, Read::Pass) {
                    Read::Gathering(g) => return self.read_gathered(g, Some(trailers)),
                    _ => vec![trailers],
                }
            }
            Some(Req::ResponseHeaders(_)) => vec![ProcessingResponse {
                response: Some(Resp::ResponseHeaders(HeadersResponse { response: common(None, false) })),
                mode_override: None,
            }],
            Some(Req::ResponseBody(_)) => vec![ProcessingResponse {
                response: Some(Resp::ResponseBody(BodyResponse { response: common(None, false) })),
                mode_override: None,
            }],
            Some(Req::ResponseTrailers(_)) => vec![ProcessingResponse {
                response: Some(Resp::ResponseTrailers(TrailersResponse { header_mutation: None })),
                mode_override: None,
            }],
            None => return Box::pin(async { Ok(None) }),
        };
        ready(reply)
    }
}
