//! The filter's decisions, over the test host: what it reads, sets and removes, what it
//! counts and when the counts reach the host, when in-flight blocks go.

use super::*;
use crate::feed::{FeedBlock, FeedWorker, Frame, Op};
use crate::host::testing::{TestHeaders, TestHost};
use crate::index::SyncIndex;
use crate::layout::{prefill_epoch, LoadVector, LOAD_KEY, TABLE_KEY};
use crate::role::Role;
use crate::router::tests::sync_write;
use crate::store::SharedStore;
use crate::tokens::encode_base64;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const B64: &str = "x-prompt-token-ids-b64";
const DEC: &str = "x-prompt-token-ids";
const DEST: &str = "x-gateway-destination-endpoint";
const LORA: &str = "x-kvroute-lora";

fn prompt(prefix: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| prefix * 100_000 + i).collect()
}

fn decimal(tokens: &[u32]) -> String {
    tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// A filter over a fleet of `n` workers (`10.0.0.<i>:8000`) whose caches hold `ops`.
fn filter_over(n: usize, ops: Vec<Op>, config: &str) -> Filter<TestHost> {
    filter_on(TestHost::new(), n, ops, config)
}

fn filter_on(host: TestHost, n: usize, ops: Vec<Op>, config: &str) -> Filter<TestHost> {
    let workers = (0..n).map(|i| FeedWorker { id: format!("10.0.0.{i}:8000"), role: Role::Both, up: true }).collect();
    let mut ix = SyncIndex::new(256);
    sync_write(&host.store, &mut ix, &Frame::snapshot(1, 1, 16, workers, ops));
    Filter::configure(host, config.as_bytes(), 7).unwrap()
}

/// Worker 2 holds the first 8 blocks of `prompt(1, 160)`.
fn fleet_with_prefix(config: &str) -> (Filter<TestHost>, Vec<u32>) {
    fleet_with_prefix_on(TestHost::new(), config)
}

fn fleet_with_prefix_on(host: TestHost, config: &str) -> (Filter<TestHost>, Vec<u32>) {
    let p = prompt(1, 160);
    let f = filter_on(host, 4, vec![Op::Store { worker: 2, blocks: FeedBlock::chain(&p[..128], 16) }], config);
    (f, p)
}

/// A host like a native module's: no ticks, and it can set the upstream host.
fn native_host() -> TestHost {
    TestHost { ticks: false, overrides_upstream: true, ..TestHost::new() }
}

fn active(f: &Filter<TestHost>, slot: usize) -> u32 {
    LoadVector::decode(&f.host().store.get(LOAD_KEY).unwrap().0.unwrap_or_default()).get(slot)
}

fn pending_prefill(f: &Filter<TestHost>, slot: usize) -> u32 {
    let load = LoadVector::decode(&f.host().store.get(LOAD_KEY).unwrap().0.unwrap_or_default());
    load.pending_prefill(slot, prefill_epoch(f.host().now_ms.get()))
}

#[test]
fn routes_by_the_token_header_and_strips_what_clients_may_not_send() {
    let (mut f, p) = fleet_with_prefix("{}");
    let mut h = TestHeaders::with(&[
        (B64, &encode_base64(&p)),
        (DEC, "1,2,3"),
        (DEST, "6.6.6.6:80"),
        ("x-prefiller-host-port", "6.6.6.6:81"),
    ]);
    let s = f.on_request_headers(&mut h);
    let dest = h.value(DEST).unwrap();
    assert!(dest.starts_with("10.0.0.2:8000,") && dest.split(',').count() == 3, "{dest}");
    // The forged prefiller is gone and none is set outside PD mode.
    assert_eq!(h.value("x-prefiller-host-port"), None);
    // Both token headers go (the decimal one was not read, so it may have been there).
    assert!(!h.map.contains_key(B64) && !h.map.contains_key(DEC));
    assert!(!h.reads.borrow().iter().any(|r| r == DEC));
    assert!(s.held.is_some());
    assert_eq!(active(&f, 2), 10);
    f.flush();
    let host = f.host();
    assert_eq!(host.stat("kvroute.requests"), Some(1));
    assert_eq!(host.stat("kvroute.scored"), Some(1));
    assert_eq!((host.stat("kvroute.blocks_requested"), host.stat("kvroute.blocks_hit")), (Some(10), Some(8)));
}

#[test]
fn the_decimal_header_serves_when_the_base64_one_is_absent() {
    let (mut f, p) = fleet_with_prefix("{}");
    let mut h = TestHeaders::with(&[(DEC, &decimal(&p))]);
    f.on_request_headers(&mut h);
    assert!(h.value(DEST).unwrap().starts_with("10.0.0.2:8000"));
    assert!(!h.map.contains_key(DEC));
    // Nothing is removed that was known to be absent: one host call per header present
    // (the routing headers are always removed).
    assert!(!h.removes.iter().any(|r| r == B64 || r == LORA));
}

#[test]
fn without_tokens_the_namespace_headers_are_not_read_and_load_decides() {
    let (mut f, _) = fleet_with_prefix("{}");
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..32 {
        let mut h = TestHeaders::with(&[(LORA, "sql-adapter")]);
        f.on_request_headers(&mut h);
        assert!(!h.reads.borrow().iter().any(|r| r == LORA));
        // Not read, so not removed either: it reaches the engine, which may want it.
        assert_eq!(h.value(LORA), Some("sql-adapter"));
        seen.insert(h.value(DEST).unwrap().split(',').next().unwrap().to_string());
    }
    // Equal idle workers: the tie-break entropy changes per request.
    assert!(seen.len() > 1, "{seen:?}");
    f.flush();
    assert_eq!(f.host().stat("kvroute.fallback.no_tokens"), Some(32));
    assert_eq!(f.host().stat("kvroute.scored"), Some(0));
}

#[test]
fn a_prompt_is_routed_in_its_namespace_and_the_namespace_header_removed() {
    let p = prompt(1, 160);
    let adapter = crate::hash::namespace(Some(b"sql-adapter"), None);
    let ops = vec![
        Op::Store { worker: 1, blocks: FeedBlock::chain_in(&p, 16, adapter) },
        Op::Store { worker: 3, blocks: FeedBlock::chain(&p, 16) },
    ];
    let mut f = filter_over(4, ops, "{}");
    let mut h = TestHeaders::with(&[(B64, &encode_base64(&p)), (LORA, "sql-adapter")]);
    f.on_request_headers(&mut h);
    assert!(h.value(DEST).unwrap().starts_with("10.0.0.1:8000"));
    assert_eq!(h.value(LORA), None);
}

#[test]
fn forwarded_token_headers_stay() {
    let (mut f, p) = fleet_with_prefix(r#"{"forward_token_headers": true}"#);
    let b64 = encode_base64(&p);
    let mut h = TestHeaders::with(&[(B64, &b64), (LORA, "x")]);
    f.on_request_headers(&mut h);
    assert_eq!((h.value(B64), h.value(LORA)), (Some(b64.as_str()), Some("x")));
}

#[test]
fn a_bad_token_header_is_counted_by_reason_and_routed_by_load() {
    let (mut f, _) = fleet_with_prefix("{}");
    let mut h = TestHeaders::with(&[(DEC, "1,2,x")]);
    f.on_request_headers(&mut h);
    assert!(h.value(DEST).is_some());
    f.flush();
    assert_eq!(f.host().stat("kvroute.fallback.bad_tokens"), Some(1));
    assert_eq!(f.host().stat("kvroute.token_errors.malformed"), Some(1));
}

#[test]
fn the_debug_header_answers_and_cannot_be_forged() {
    let (mut f, p) = fleet_with_prefix(r#"{"debug_header": "x-kvroute-debug"}"#);
    let mut h = TestHeaders::with(&[(B64, &encode_base64(&p)), ("x-kvroute-debug", "forged")]);
    let s = f.on_request_headers(&mut h);
    assert_eq!(h.value("x-kvroute-debug"), None);
    let (name, value) = f.debug_header(&s).unwrap();
    assert_eq!(name, "x-kvroute-debug");
    assert!(value.starts_with("worker=10.0.0.2:8000;hits=8;blocks=10;"), "{value}");
    // Not configured: nothing to add.
    let (mut f, p) = fleet_with_prefix("{}");
    let s = f.on_request_headers(&mut TestHeaders::with(&[(B64, &encode_base64(&p))]));
    assert_eq!(f.debug_header(&s), None);
}

#[test]
fn stats_reach_the_host_in_batches() {
    let (mut f, _) = fleet_with_prefix("{}");
    for _ in 0..FLUSH_EVERY - 1 {
        f.on_request_headers(&mut TestHeaders::default());
    }
    assert_eq!(f.host().stat_calls.get(), 0);
    assert_eq!(f.host().stat("kvroute.requests"), Some(0));
    f.on_request_headers(&mut TestHeaders::default());
    assert_eq!(f.host().stat("kvroute.requests"), Some(u64::from(FLUSH_EVERY)));
    // Only counters that changed cost a host call.
    let calls = f.host().stat_calls.get();
    assert!(calls <= 4, "{calls} calls for one batch");
    f.on_request_headers(&mut TestHeaders::default());
    f.flush();
    assert_eq!(f.host().stat("kvroute.requests"), Some(u64::from(FLUSH_EVERY) + 1));
}

#[test]
fn a_refused_stat_is_a_no_op() {
    let mut host = TestHost::new();
    host.refused_stats.push("kvroute.requests".into());
    let mut f = Filter::configure(host, b"{}", 1).unwrap();
    f.on_request_headers(&mut TestHeaders::default());
    f.flush();
    assert_eq!(f.host().stat("kvroute.requests"), None);
    assert_eq!(f.host().stat("kvroute.fallback.no_table"), Some(1));
}

#[test]
fn ended_streams_are_released_in_batches() {
    let (mut f, p) = fleet_with_prefix(r#"{"predict_on_route": false}"#);
    let mut s = f.on_request_headers(&mut TestHeaders::with(&[(B64, &encode_base64(&p))]));
    // Another Envoy worker's request holds 5 blocks there too.
    let store = &f.host().store;
    let (v, cas) = store.get(LOAD_KEY).unwrap();
    let mut load = LoadVector::decode(&v.unwrap());
    load.0[2].active += 5;
    store.set(LOAD_KEY, &load.encode(), cas).unwrap();
    f.on_stream_end(&mut s);
    // Queued, still counted, until the tick.
    assert_eq!(active(&f, 2), 15);
    // A second end (on_log then on_done) releases nothing twice.
    f.on_stream_end(&mut s);
    f.host().advance(10);
    f.flush();
    assert_eq!(active(&f, 2), 5);
    assert_eq!(f.host().stat("kvroute.update_failures"), Some(0));

    // A full batch goes without waiting for the tick.
    let mut streams: Vec<_> = (0..RELEASE_BATCH)
        .map(|i| f.on_request_headers(&mut TestHeaders::with(&[(B64, &encode_base64(&prompt(10 + i as u32, 32)))])))
        .collect();
    let total: u32 = (0..4).map(|w| active(&f, w)).sum();
    assert_eq!(total, 5 + 2 * RELEASE_BATCH as u32);
    for s in &mut streams {
        f.on_stream_end(s);
    }
    assert_eq!((0..4).map(|w| active(&f, w)).sum::<u32>(), 5);
}

#[test]
fn the_first_response_bytes_end_the_prefill() {
    let (mut f, p) = fleet_with_prefix("{}");
    let mut s = f.on_request_headers(&mut TestHeaders::with(&[(B64, &encode_base64(&p))]));
    assert_eq!(pending_prefill(&f, 2), 2);
    // Headers only, or an empty chunk: prefill is not over.
    f.on_response_body(&mut s, 0);
    assert_eq!(pending_prefill(&f, 2), 2);
    f.on_response_body(&mut s, 120);
    assert_eq!(pending_prefill(&f, 2), 0);
    // Later chunks change nothing.
    f.on_response_body(&mut s, 120);
    f.flush();
    assert_eq!(f.host().stat("kvroute.prefill_releases"), Some(1));
    // The blocks stay in flight until the stream ends.
    assert_eq!(active(&f, 2), 10);
}

#[test]
fn an_undecodable_table_is_counted_and_routed_by_envoy() {
    let host = TestHost::new();
    host.store.set(TABLE_KEY, b"not a table", None).unwrap();
    let mut f = Filter::configure(host, b"{}", 1).unwrap();
    let mut h = TestHeaders::with(&[(B64, &encode_base64(&prompt(1, 32)))]);
    let s = f.on_request_headers(&mut h);
    assert_eq!(h.value(DEST), None);
    assert!(s.held.is_none());
    f.flush();
    assert_eq!(f.host().stat("kvroute.layout_errors"), Some(1));
    assert_eq!(f.host().stat("kvroute.fallback.no_table"), Some(1));
    assert_eq!(f.problems_seen, 1);
}

#[test]
fn a_bad_configuration_refuses_to_load() {
    let e = Filter::configure(TestHost::new(), br#"{"block_size": 0}"#, 1).err().unwrap();
    assert!(e.to_string().contains("block_size"), "{e}");
    assert!(Filter::configure(TestHost::new(), b"{", 1).is_err());
}

#[test]
fn without_ticks_stats_and_releases_reach_the_host_at_once() {
    let (mut f, p) = fleet_with_prefix_on(native_host(), "{}");
    let mut s = f.on_request_headers(&mut TestHeaders::with(&[(B64, &encode_base64(&p))]));
    assert_eq!(f.host().stat("kvroute.requests"), Some(1));
    assert_eq!((active(&f, 2), pending_prefill(&f, 2)), (10, 2));
    f.on_response_body(&mut s, 64);
    assert_eq!(f.host().stat("kvroute.prefill_releases"), Some(1));
    assert_eq!(pending_prefill(&f, 2), 0);
    // No tick will come: the end releases the blocks itself.
    f.on_stream_end(&mut s);
    assert_eq!(active(&f, 2), 0);
    assert_eq!(f.host().stat("kvroute.update_failures"), Some(0));
}

#[test]
fn the_upstream_override_takes_the_best_worker_and_the_header_the_rest() {
    let (mut f, p) = fleet_with_prefix_on(native_host(), r#"{"destination_via": "upstream_override"}"#);
    let mut h = TestHeaders::with(&[(B64, &encode_base64(&p)), (DEST, "6.6.6.6:80")]);
    let mut s = f.on_request_headers(&mut h);
    assert_eq!(s.upstream_override(), Some("10.0.0.2:8000"));
    let rest = h.value(DEST).unwrap().to_string();
    assert!(rest.split(',').count() == 2 && !rest.contains("10.0.0.2:8000") && !rest.contains("6.6.6.6"), "{rest}");
    // Envoy refuses it: the whole ranking goes in the header, counted.
    f.on_upstream_override_refused(&mut s, &mut h);
    assert_eq!(h.value(DEST).unwrap(), format!("10.0.0.2:8000,{rest}"));
    assert_eq!(s.upstream_override(), None);
    assert_eq!(f.host().stat("kvroute.upstream_override_refused"), Some(1));
    // The header mode hands Envoy nothing directly.
    let (mut f, p) = fleet_with_prefix_on(native_host(), "{}");
    let s = f.on_request_headers(&mut TestHeaders::with(&[(B64, &encode_base64(&p))]));
    assert_eq!(s.upstream_override(), None);
}

#[test]
fn the_upstream_override_needs_a_host_that_has_it() {
    let config = br#"{"destination_via": "upstream_override"}"#;
    let e = Filter::configure(TestHost::new(), config, 1).err().unwrap();
    assert!(e.to_string().contains("destination_via"), "{e}");
    assert!(Filter::configure(native_host(), config, 1).is_ok());
}

#[test]
fn a_cache_key_is_read_counted_when_new_and_removed() {
    const KEY: &str = "x-kvroute-cache-key";
    let (mut f, p) = fleet_with_prefix("{}");
    let b64 = encode_base64(&p);
    for _ in 0..2 {
        let mut h = TestHeaders::with(&[(B64, &b64), (KEY, "0123456789abcdef")]);
        let s = f.on_request_headers(&mut h);
        assert_eq!(h.value(KEY), None);
        f.on_stream_end(&mut { s });
    }
    // Empty: no key.
    let mut h = TestHeaders::with(&[(B64, &b64), (KEY, "")]);
    f.on_request_headers(&mut h);
    f.flush();
    assert_eq!(f.host().stat("kvroute.new_cache_keys"), Some(1));
}
