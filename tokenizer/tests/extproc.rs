//! The stage's ext_proc exchanges, message by message, on the real Qwen3 tokenizer
//! (`scripts/fetch-tokenizer.sh`): which answers each message lets go, and what they carry.
//! tests/integration/test_tokenizer.py runs the same exchanges through a real Envoy.

mod common;

use common::qwen3_dir;
use kvroute_tokenizer::extproc::handler::{Headers, StageProcessor};
use kvroute_tokenizer::extproc::proto::{
    processing_request::Request as Req, processing_response::Response as Resp, BodySendMode, HeaderMap, HeaderValue,
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use kvroute_tokenizer::extproc::server::{HandlerFactory, StreamHandler};
use kvroute_tokenizer::model::ModelSpec;
use kvroute_tokenizer::stage::Stage;
use kvroute_tokenizer::stats::Stats;
use std::sync::Arc;
use tokio::sync::Semaphore;

const CHAT: &str = r#"{"model": "qwen3", "messages": [{"role": "user", "content": "Where is the KV cache?"}]}"#;

fn processor(max_body_bytes: usize) -> Arc<StageProcessor> {
    let spec = ModelSpec {
        name: "qwen3".into(),
        path: qwen3_dir(),
        max_model_len: None,
        loras: Vec::new(),
        chat_template: None,
        cache_bytes: 1 << 20,
    };
    Arc::new(StageProcessor {
        stage: Arc::new(Stage::new(&[spec], false, false).unwrap()),
        stats: Arc::new(Stats::default()),
        headers: Headers::default(),
        trust_client_tokens: false,
        max_body_bytes,
        limiter: Arc::new(Semaphore::new(2)),
    })
}

/// The first message of a stream: the request headers, with the stream's body mode.
fn headers(streamed_behind: bool, extra: &[(&str, &str)]) -> ProcessingRequest {
    let mut h = vec![(":method", "POST"), (":path", "/v1/chat/completions")];
    h.extend_from_slice(extra);
    let headers = h
        .iter()
        .map(|(k, v)| HeaderValue { key: (*k).into(), value: String::new(), raw_value: v.as_bytes().to_vec() })
        .collect();
    let mode = if streamed_behind { BodySendMode::Streamed } else { BodySendMode::Buffered };
    ProcessingRequest {
        request: Some(Req::RequestHeaders(HttpHeaders { headers: Some(HeaderMap { headers }), end_of_stream: false })),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: BodySendMode::None as i32,
            send_body_without_waiting_for_header_response: streamed_behind,
        }),
        ..ProcessingRequest::default()
    }
}

fn body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Req::RequestBody(HttpBody { body: bytes.to_vec().into(), end_of_stream })),
        ..ProcessingRequest::default()
    }
}

fn trailers() -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Req::RequestTrailers(HttpTrailers { trailers: None })),
        ..ProcessingRequest::default()
    }
}

/// Each answer's kind, the headers it sets and removes, and whether it clears the route cache.
fn shape(r: &ProcessingResponse) -> (&'static str, Vec<String>, Vec<String>, bool) {
    let (kind, common) = match r.response.as_ref().unwrap() {
        Resp::RequestHeaders(h) => ("headers", h.response.as_ref()),
        Resp::RequestBody(b) => ("body", b.response.as_ref()),
        Resp::RequestTrailers(_) => ("trailers", None),
        _ => ("other", None),
    };
    let m = common.and_then(|c| c.header_mutation.as_ref());
    (
        kind,
        m.map(|m| m.set_headers.iter().map(|s| s.header.as_ref().unwrap().key.clone()).collect()).unwrap_or_default(),
        m.map(|m| m.remove_headers.clone()).unwrap_or_default(),
        common.is_some_and(|c| c.clear_route_cache),
    )
}

fn run(p: &Arc<StageProcessor>, msgs: Vec<ProcessingRequest>) -> Vec<Vec<ProcessingResponse>> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let mut stream = p.clone().new_stream();
    rt.block_on(async { answer_all(&mut stream, msgs).await })
}

async fn answer_all(stream: &mut impl StreamHandler, msgs: Vec<ProcessingRequest>) -> Vec<Vec<ProcessingResponse>> {
    let mut out = Vec::new();
    for m in msgs {
        out.push(stream.handle(m).await.unwrap().unwrap());
    }
    out
}

#[test]
fn streamed_behind_waiting_headers_the_headers_are_answered_with_the_token_header_once_the_body_is_whole() {
    let p = processor(1 << 20);
    let (a, b) = CHAT.as_bytes().split_at(20);
    let forged = [("x-prompt-token-ids", "1,2,3")];
    let answers = run(&p, vec![headers(true, &forged), body(a, false), body(b, true)]);
    // Nothing until the body is whole; then the headers' answer and one per chunk, in order.
    assert!(answers[0].is_empty() && answers[1].is_empty());
    let last: Vec<_> = answers[2].iter().map(shape).collect();
    assert_eq!(last.len(), 3);
    assert_eq!(last[0].0, "headers");
    assert_eq!(last[0].1, vec!["x-prompt-token-ids-b64".to_string()]);
    assert_eq!(last[0].2, vec!["x-prompt-token-ids".to_string()], "the forged copy goes in the same answer");
    assert!(last[0].3, "the route cache is cleared for the filters after");
    assert_eq!(&last[1..], &[("body", vec![], vec![], false), ("body", vec![], vec![], false)]);
    let m = p.stats.render(&p.stage);
    assert!(m.contains("kvroute_tokenizer_one_round_trip_total 1\n"), "{m}");
    assert!(m.contains("kvroute_tokenizer_requests_total{outcome=\"tokenized\"} 1\n"), "{m}");
}

#[test]
fn a_streamed_body_over_the_limit_is_answered_as_it_passes_it_unread() {
    let p = processor(30);
    let (a, b) = CHAT.as_bytes().split_at(20);
    let answers = run(&p, vec![headers(true, &[]), body(a, false), body(b, false), body(b"}", true)]);
    assert!(answers[0].is_empty() && answers[1].is_empty());
    let passed: Vec<_> = answers[2].iter().map(shape).collect();
    assert_eq!(passed.iter().map(|s| s.0).collect::<Vec<_>>(), ["headers", "body", "body"]);
    assert!(passed.iter().all(|s| s.1.is_empty()), "no token header for a body not read");
    // What comes after is passed on as it comes.
    assert_eq!(answers[3].iter().map(shape).collect::<Vec<_>>(), [("body", vec![], vec![], false)]);
    let m = p.stats.render(&p.stage);
    assert!(m.contains("kvroute_tokenizer_requests_total{outcome=\"too_large\"} 1\n"), "{m}");
    assert!(m.contains("kvroute_tokenizer_one_round_trip_total 0\n"), "{m}");
}

#[test]
fn trailers_end_a_streamed_body_and_it_is_read() {
    let p = processor(1 << 20);
    let answers = run(&p, vec![headers(true, &[]), body(CHAT.as_bytes(), false), trailers()]);
    let last: Vec<_> = answers[2].iter().map(shape).collect();
    assert_eq!(last.iter().map(|s| s.0).collect::<Vec<_>>(), ["headers", "body", "trailers"]);
    assert_eq!(last[0].1, vec!["x-prompt-token-ids-b64".to_string()]);
}

#[test]
fn buffered_the_headers_are_answered_at_once_and_the_body_carries_the_token_header() {
    let p = processor(1 << 20);
    let answers = run(&p, vec![headers(false, &[("x-kvroute-lora", "x")]), body(CHAT.as_bytes(), true)]);
    assert_eq!(
        answers[0].iter().map(shape).collect::<Vec<_>>(),
        [("headers", vec![], vec!["x-kvroute-lora".to_string()], false)]
    );
    assert_eq!(
        answers[1].iter().map(shape).collect::<Vec<_>>(),
        [("body", vec!["x-prompt-token-ids-b64".to_string()], vec![], true)]
    );
    assert!(p.stats.render(&p.stage).contains("kvroute_tokenizer_one_round_trip_total 0\n"));
}
