//! The sync service's poll cycle over the test host: when polls go out and what they ask,
//! what each kind of answer does to the index, shared data and the stats.

use super::*;
use crate::config::DEFAULT_FEED_LINGER_MS;
use crate::feed::{FeedBlock, FeedWorker, Op};
use crate::host::testing::TestHost;
use crate::layout::SlotState;
use crate::role::Role;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const CONFIG: &str = r#"{"n_buckets": 16, "retry_interval_ms": 1000, "stale_after_ms": 15000}"#;

fn service() -> SyncService<TestHost> {
    SyncService::configure(TestHost::new(), CONFIG.as_bytes(), 7).unwrap()
}

fn workers(n: usize) -> Vec<FeedWorker> {
    (0..n).map(|i| FeedWorker { id: format!("10.0.0.{i}:8000"), role: Role::Both, up: true }).collect()
}

fn snapshot(epoch: u64, version: u64) -> Vec<u8> {
    let blocks = FeedBlock::chain(&(0..64).collect::<Vec<u32>>(), 16);
    Frame::snapshot(epoch, version, 16, workers(2), vec![Op::Store { worker: 1, blocks }]).encode()
}

/// A service that has polled once and applied the snapshot (epoch 5, version 3) of two
/// workers, worker 1 holding 4 blocks.
fn synced() -> SyncService<TestHost> {
    let mut s = service();
    s.on_tick();
    answer(&mut s, 200, &snapshot(5, 3));
    s
}

fn polls(s: &SyncService<TestHost>) -> usize {
    s.host().polls.borrow().len()
}

fn last_path(s: &SyncService<TestHost>) -> String {
    s.host().polls.borrow().last().map(|p| p.2.clone()).unwrap_or_default()
}

/// Answers the poll in flight (token 1, the test host's) with `status` and `body`.
fn answer(s: &mut SyncService<TestHost>, status: u32, body: &[u8]) {
    s.on_response(1, Some(status), body.len(), || Some(body.to_vec()));
}

fn table(s: &SyncService<TestHost>) -> WorkerTable {
    WorkerTable::decode(&s.host().store.get(TABLE_KEY).unwrap().0.unwrap()).unwrap()
}

#[test]
fn configuring_creates_every_key_and_the_first_tick_polls_for_a_snapshot() {
    let mut s = service();
    let store = &s.host().store;
    for key in (0..16).map(bucket_key).chain([LOAD_KEY.to_string()]) {
        assert_eq!(store.get(&key).unwrap().0, Some(vec![]), "{key}");
    }
    assert_eq!(polls(&s), 0);
    s.on_tick();
    let p = s.host().polls.borrow()[0].clone();
    assert_eq!(p.0, "kvroute_sidecar");
    assert_eq!(p.1, "kvroute-sidecar");
    assert_eq!(p.2, poll_path("/v1/kv/feed", 0, 0, 0, 5_000, DEFAULT_FEED_LINGER_MS));
    assert_eq!(p.3, Duration::from_millis(10_000));
    // One poll at a time.
    s.on_tick();
    assert_eq!(polls(&s), 1);
}

#[test]
fn a_good_answer_is_published_and_the_next_poll_goes_at_once() {
    let mut s = synced();
    let t = table(&s);
    assert!(t.index_live);
    assert_eq!((t.epoch, t.version, t.slots.len()), (5, 3, 2));
    assert_eq!(polls(&s), 2);
    assert_eq!(last_path(&s), poll_path("/v1/kv/feed", 5, 3, 0, 5_000, DEFAULT_FEED_LINGER_MS));
    let host = s.host();
    assert_eq!(host.stat("kvroute_sync.polls_ok"), Some(1));
    assert_eq!(host.stat("kvroute_sync.blocks_stored"), Some(4));
    assert_eq!(host.stat("kvroute_sync.index_entries"), Some(4));
    assert_eq!((host.stat("kvroute_sync.index_live"), host.stat("kvroute_sync.version")), (Some(1), Some(3)));
    // The first snapshot is not a resync; one of a new epoch is.
    assert_eq!(host.stat("kvroute_sync.resyncs"), Some(0));
    answer(&mut s, 200, &snapshot(6, 1));
    assert_eq!(s.host().stat("kvroute_sync.resyncs"), Some(1));
}

#[test]
fn failures_back_off_to_four_retry_intervals() {
    let mut s = service();
    s.on_tick();
    // Failure n waits retry × 2^min(n,3) / 2: 1 s, 2 s, 4 s, 4 s.
    for wait in [1_000, 2_000, 4_000, 4_000] {
        answer(&mut s, 503, b"");
        let before = polls(&s);
        s.host().advance(wait - 1);
        s.on_tick();
        assert_eq!(polls(&s), before, "polled before {wait} ms");
        s.host().advance(1);
        s.on_tick();
        assert_eq!(polls(&s), before + 1, "not polled at {wait} ms");
    }
    assert_eq!(s.host().stat("kvroute_sync.polls_failed"), Some(4));
    // A good answer resets the backoff.
    answer(&mut s, 200, &snapshot(1, 1));
    answer(&mut s, 503, b"");
    s.host().advance(1_000);
    let before = polls(&s);
    s.on_tick();
    assert_eq!(polls(&s), before + 1);
}

#[test]
fn a_refused_dispatch_is_a_failed_poll() {
    let mut s = service();
    *s.host().poll_result.borrow_mut() = Err("BadArgument".into());
    s.on_tick();
    assert_eq!(s.host().stat("kvroute_sync.polls_failed"), Some(1));
    // Nothing in flight: the next tick after the retry interval tries again.
    *s.host().poll_result.borrow_mut() = Ok(1);
    s.host().advance(1_000);
    s.on_tick();
    assert_eq!(polls(&s), 2);
    answer(&mut s, 200, &snapshot(1, 1));
    assert!(table(&s).index_live);
}

#[test]
fn an_oversized_frame_is_not_read() {
    let mut s = SyncService::configure(TestHost::new(), br#"{"n_buckets": 16, "max_frame_bytes": 4096}"#, 7).unwrap();
    s.on_tick();
    s.on_response(1, Some(200), 4097, || panic!("read an oversized body"));
    assert_eq!(s.host().stat("kvroute_sync.frames_bad"), Some(1));
    assert_eq!(s.host().stat("kvroute_sync.polls_failed"), Some(1));
}

#[test]
fn an_undecodable_frame_asks_for_a_snapshot() {
    let mut s = synced();
    answer(&mut s, 200, b"KVRF garbage");
    assert_eq!(s.host().stat("kvroute_sync.frames_bad"), Some(1));
    s.host().advance(1_000);
    s.on_tick();
    assert_eq!(last_path(&s), poll_path("/v1/kv/feed", 0, 0, 0, 5_000, DEFAULT_FEED_LINGER_MS));
}

#[test]
fn a_refused_frame_asks_for_a_snapshot_at_once() {
    let mut s = synced();
    // A delta that does not continue from version 3.
    let delta = Frame {
        kind: FrameKind::Delta,
        epoch: 5,
        from_version: 7,
        to_version: 8,
        next_cursor: 0,
        block_size: 16,
        workers: workers(2),
        ops: vec![],
    };
    answer(&mut s, 200, &delta.encode());
    assert_eq!(s.host().stat("kvroute_sync.polls_failed"), Some(0));
    s.on_tick();
    assert_eq!(last_path(&s), poll_path("/v1/kv/feed", 0, 0, 0, 5_000, DEFAULT_FEED_LINGER_MS));
}

#[test]
fn answers_to_other_polls_are_ignored() {
    let mut s = service();
    s.on_tick();
    s.on_response(99, Some(200), 0, || panic!("read another poll's body"));
    assert_eq!(s.host().stat("kvroute_sync.polls_ok"), Some(0));
    // Still waiting for its own.
    s.on_tick();
    assert_eq!(polls(&s), 1);
}

#[test]
fn a_poll_whose_answer_never_comes_is_given_up_and_sent_again() {
    let mut s = service();
    s.on_tick();
    // The poll's own timeout (5 s + grace) and the host's grace pass without an answer.
    s.host().advance(15_000);
    s.on_tick();
    assert_eq!((polls(&s), s.host().stat("kvroute_sync.polls_failed")), (1, Some(0)));
    s.host().advance(1);
    s.on_tick();
    assert_eq!(s.host().stat("kvroute_sync.polls_failed"), Some(1));
    // After the retry interval a new poll goes out, and its answer is taken.
    s.host().advance(1_000);
    s.on_tick();
    assert_eq!(polls(&s), 2);
    answer(&mut s, 200, &snapshot(5, 3));
    assert_eq!(s.host().stat("kvroute_sync.polls_ok"), Some(1));
}

#[test]
fn a_silent_sidecar_makes_the_index_stale() {
    let mut s = synced();
    // The long poll in flight never answers.
    s.host().advance(15_000);
    s.on_tick();
    assert!(table(&s).index_live);
    s.host().advance(1);
    s.on_tick();
    assert!(!table(&s).index_live);
    assert_eq!(s.host().stat("kvroute_sync.index_live"), Some(0));
    // The unanswered poll was given up with it; the next one goes out after the retry
    // interval, and the sidecar is back: live again.
    s.host().advance(1_000);
    s.on_tick();
    answer(&mut s, 200, &snapshot(5, 4));
    assert!(table(&s).index_live);
}

#[test]
fn slots_survive_a_new_vm_and_load_reaches_per_worker_gauges() {
    let mut s = synced();
    // A filter's in-flight blocks on slot 1.
    let mut load = LoadVector::decode(&[]);
    load.0.resize(2, Default::default());
    load.0[1].active = 12;
    s.host().store.set(LOAD_KEY, &load.encode(), None).unwrap();
    s.on_tick();
    assert_eq!(s.host().stat("kvroute.active_blocks.10_0_0_1_8000"), Some(12));
    assert_eq!(s.host().stat("kvroute.prefill_blocks.10_0_0_1_8000"), Some(0));

    // A new VM over the same shared data keeps worker 1 in slot 1, down until the
    // sidecar says otherwise.
    let host = TestHost::new();
    host.store.set(TABLE_KEY, &s.host().store.get(TABLE_KEY).unwrap().0.unwrap(), None).unwrap();
    let next = SyncService::configure(host, CONFIG.as_bytes(), 7).unwrap();
    let slots = next.index().table().slots;
    assert_eq!((slots[1].id.as_str(), slots[1].state), ("10.0.0.1:8000", SlotState::Down));
}

#[test]
fn a_bad_configuration_refuses_to_load() {
    let e = SyncService::configure(TestHost::new(), br#"{"max_frame_bytes": 100}"#, 7).err().unwrap();
    assert!(e.to_string().contains("max_frame_bytes"), "{e}");
    assert!(SyncService::configure(TestHost::new(), br#"{"feed_cluster": 3}"#, 7).is_err());
}

/// Answers the load report in flight (token 1001, the test host's) with `status` and `body`.
fn load_answer(s: &mut SyncService<TestHost>, status: u32, body: &[u8]) {
    s.on_response(1001, Some(status), body.len(), || Some(body.to_vec()));
}

fn reports(s: &SyncService<TestHost>) -> Vec<Report> {
    s.host()
        .posts
        .borrow()
        .iter()
        .map(|(path, body)| {
            assert_eq!(path, "/v1/load");
            Report::decode(body).unwrap()
        })
        .collect()
}

fn peer_load(s: &SyncService<TestHost>) -> PeerLoad {
    PeerLoad::decode(&s.host().store.get(PEERLOAD_KEY).unwrap().0.unwrap())
}

#[test]
fn the_gateways_load_is_reported_and_the_others_written_for_the_filters() {
    use crate::peerload::WorkerLoad;
    let mut s = synced();
    assert_eq!(reports(&s).len(), 1, "the first tick reports");
    assert!(s.gateway_id().starts_with("gw-") && reports(&s)[0].gateway == s.gateway_id());
    // This gateway's own load, by worker id.
    let mut load = LoadVector::default();
    load.apply(&[(1, 12)]);
    s.host().store.set(LOAD_KEY, &load.encode(), None).unwrap();
    // No second report while one is in flight, or before the interval.
    s.host().advance(150);
    s.on_tick();
    assert_eq!(reports(&s).len(), 1);
    let answer =
        Answer { gateways: 1, workers: [("10.0.0.0:8000".to_string(), WorkerLoad { active: 30, prefill: 9 })].into() };
    load_answer(&mut s, 200, &answer.encode());
    assert_eq!(peer_load(&s).0, vec![WorkerLoad { active: 30, prefill: 9 }]);
    assert!(table(&s).peer_load);
    assert_eq!(s.host().stat("kvroute_sync.peer_gateways"), Some(1));
    s.on_tick();
    let r = reports(&s);
    assert_eq!(r.len(), 2);
    assert_eq!(r[1].workers["10.0.0.1:8000"], WorkerLoad { active: 12, prefill: 0 });
    assert_eq!(s.host().stat("kvroute.peer_active_blocks.10_0_0_0_8000"), Some(30));
    assert_eq!(s.host().stat("kvroute.peer_prefill_blocks.10_0_0_0_8000"), Some(9));
    // The feed's own poll is still answered as the feed's.
    assert_eq!(polls(&s), 2);
    // The other gateway went away: the answer is empty and the flag goes off.
    load_answer(&mut s, 200, &Answer::default().encode());
    assert_eq!((peer_load(&s), table(&s).peer_load), (PeerLoad::default(), false));
}

#[test]
fn without_load_answers_the_others_load_is_dropped_and_reports_back_off() {
    use crate::peerload::WorkerLoad;
    let mut s = synced();
    let answer =
        Answer { gateways: 1, workers: [("10.0.0.1:8000".into(), WorkerLoad { active: 5, prefill: 0 })].into() };
    load_answer(&mut s, 200, &answer.encode());
    assert!(table(&s).peer_load);
    // A sidecar without the endpoint, a bad body, an unanswered call: failures, counted.
    for (status, body) in [(404, &b"{}"[..]), (200, b"not json")] {
        s.host().advance(2_000);
        s.on_tick();
        load_answer(&mut s, status, body);
    }
    assert_eq!(s.host().stat("kvroute_sync.load_reports_failed"), Some(2));
    // Ten intervals (at least 1 s) after the last good answer the filters stop adding it.
    assert_eq!((peer_load(&s), table(&s).peer_load), (PeerLoad::default(), false));
    let sent = reports(&s).len();
    s.host().advance(100);
    s.on_tick();
    assert_eq!(reports(&s).len(), sent, "backing off after two failures: 4 intervals");
    s.host().advance(300);
    s.on_tick();
    assert_eq!(reports(&s).len(), sent + 1);
}

#[test]
fn load_reports_can_be_turned_off() {
    let cfg = br#"{"n_buckets": 16, "load_report_interval_ms": 0, "gateway_id": "edge-1"}"#;
    let mut s = SyncService::configure(TestHost::new(), cfg, 7).unwrap();
    s.on_tick();
    s.host().advance(1_000);
    s.on_tick();
    assert_eq!((reports(&s).len(), s.gateway_id()), (0, "edge-1"));
}
