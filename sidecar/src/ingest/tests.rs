//! The ingest loop over a scripted source and a real fleet: each arrival reaches its own
//! stream's sequencer, replays are asked of the source for the right stream, and the
//! fleet counts what happened.

use super::*;
use crate::config::Cli;
use std::collections::VecDeque;

/// A source that returns prepared arrivals, one list per poll, and records what it was
/// asked.
#[derive(Default)]
struct Scripted {
    polls: VecDeque<Vec<(usize, Arrival)>>,
    can_replay: bool,
    replays: Vec<(usize, u64)>,
    ended: Vec<usize>,
    added: Vec<String>,
    removed: Vec<usize>,
}

impl Source for Scripted {
    fn poll(&mut self, _timeout: Duration) -> Vec<(usize, Arrival)> {
        self.polls.pop_front().unwrap_or_default()
    }
    fn request_replay(&mut self, stream: usize, from: u64) -> bool {
        self.replays.push((stream, from));
        self.can_replay
    }
    fn end_replay(&mut self, stream: usize) {
        self.ended.push(stream);
    }
    fn add_stream(&mut self, spec: &StreamSpec) -> Result<(), String> {
        if spec.events.contains("refused") {
            return Err("refused".into());
        }
        self.added.push(spec.label.clone());
        Ok(())
    }
    fn remove_stream(&mut self, stream: usize) {
        self.removed.push(stream);
    }
}

const CONFIG: &str = "replay_timeout_ms = 30\n\
    [[workers]]\nid = \"127.0.0.1:8101\"\nevents = \"tcp://127.0.0.1:5557\"\nreplay = \"tcp://127.0.0.1:5558\"\n\
    [[workers]]\nid = \"127.0.0.1:8102\"\nevents = \"tcp://127.0.0.1:5567\"\ndp_ranks = 2\n";

fn ingest(can_replay: bool) -> Ingest<Scripted> {
    let config = Config::from_toml(CONFIG, &Cli::default()).unwrap();
    let fleet = Arc::new(Mutex::new(Fleet::new(&config, 1)));
    let specs = streams(&config);
    Ingest::new(&config, &specs, Scripted { can_replay, ..Scripted::default() }, fleet)
}

/// An event batch with no events, `[ts, [], 0]`: it decodes and changes nothing.
fn empty_batch() -> Vec<u8> {
    let mut p = vec![0x93, 0xcb];
    p.extend_from_slice(&1.5f64.to_bits().to_be_bytes());
    p.extend_from_slice(&[0x90, 0x00]);
    p
}

fn live(seq: u64) -> Arrival {
    Arrival::Live(seq, empty_batch())
}

fn stats(i: &Ingest<Scripted>) -> (u64, u64, u64, u64, u64) {
    let s = &lock(&i.fleet).stats;
    (s.gaps, s.replays_ok, s.replays_failed, s.batches_bad, s.frames_bad)
}

#[test]
fn streams_name_every_rank_with_its_endpoints() {
    let config = Config::from_toml(CONFIG, &Cli::default()).unwrap();
    let s = streams(&config);
    assert_eq!(s.len(), 3);
    assert_eq!((s[0].worker, s[0].rank, s[0].replay.as_deref()), (0, 0, Some("tcp://127.0.0.1:5558")));
    assert_eq!((s[2].worker, s[2].rank, s[2].label.as_str()), (1, 1, "127.0.0.1:8102 rank 1"));
    // Rank r publishes on port + r.
    assert_eq!(s[2].events, "tcp://127.0.0.1:5568");
    assert_eq!(s[2].replay, None);
}

#[test]
fn a_gap_on_one_stream_is_replayed_from_that_stream_only() {
    let mut i = ingest(true);
    i.source.polls.push_back(vec![(0, live(0)), (2, live(0)), (0, live(1)), (2, live(1))]);
    // Stream 0 skips seq 2.
    i.source.polls.push_back(vec![(0, live(3)), (2, live(2))]);
    i.source.polls.push_back(vec![
        (0, Arrival::Replay(ReplayReply::Batch(2, empty_batch()))),
        (0, Arrival::Replay(ReplayReply::Batch(3, empty_batch()))),
        (0, Arrival::Replay(ReplayReply::End)),
        (0, live(4)),
    ]);
    for _ in 0..3 {
        i.turn(Duration::ZERO);
    }
    assert_eq!(i.source.replays, vec![(0, 2)]);
    assert_eq!(i.source.ended, vec![0]);
    assert_eq!(stats(&i), (1, 1, 0, 0, 0));
}

#[test]
fn a_gap_without_a_replay_clears_the_stream_and_carries_on() {
    let mut i = ingest(false);
    i.source.polls.push_back(vec![(1, live(0)), (1, live(5))]);
    i.turn(Duration::ZERO);
    // Asked, refused: the stream is cleared and carries on from what follows.
    assert_eq!(i.source.replays, vec![(1, 1)]);
    let fleet = lock(&i.fleet);
    let gap_not_replayed = ResetReason::ALL.iter().position(|r| *r == ResetReason::GapNotReplayed).unwrap();
    assert_eq!((fleet.stats.gaps, fleet.stats.resets[gap_not_replayed]), (1, 1));
    // Stream 1 is worker 1's rank 0; nothing reached worker 0 or worker 1's rank 1.
    let w = fleet.workers_json(Instant::now());
    assert_eq!(w["workers"][1]["dp_ranks"][0]["last_seq"], 5, "{w}");
    assert!(w["workers"][1]["dp_ranks"][1]["last_seq"].is_null(), "{w}");
    assert!(w["workers"][0]["last_seq"].is_null(), "{w}");
}

#[test]
fn a_replay_that_never_answers_times_out_on_the_loops_clock() {
    let mut i = ingest(true);
    // The first batch seen has seq 7: catch up from 0.
    i.source.polls.push_back(vec![(0, live(7))]);
    i.turn(Duration::ZERO);
    assert_eq!(i.source.replays, vec![(0, 0)]);
    i.turn(Duration::ZERO);
    assert!(i.source.ended.is_empty());
    std::thread::sleep(Duration::from_millis(40));
    i.turn(Duration::ZERO);
    assert_eq!(i.source.ended, vec![0]);
    assert_eq!(stats(&i).2, 1);
}

#[test]
fn malformed_messages_and_undecodable_batches_are_counted() {
    let mut i = ingest(true);
    i.source.polls.push_back(vec![
        (0, Arrival::Malformed("message that is not [topic, seq, payload]")),
        (0, live(0)),
        (0, Arrival::Live(1, vec![0xc1])),
        // A stream the source made up is ignored, not a panic.
        (9, live(0)),
    ]);
    i.turn(Duration::ZERO);
    assert_eq!(stats(&i), (0, 0, 0, 1, 1));
}

#[test]
fn a_failed_replay_connection_ends_the_replay() {
    let mut i = ingest(true);
    i.source.polls.push_back(vec![(0, live(0)), (0, live(3))]);
    i.source.polls.push_back(vec![(0, Arrival::ReplayFailed), (0, live(4))]);
    i.turn(Duration::ZERO);
    i.turn(Duration::ZERO);
    assert_eq!(i.source.ended, vec![0]);
    assert_eq!(stats(&i).2, 1);
}

fn worker_config(id: &str, events: &str, dp_ranks: u32) -> WorkerConfig {
    crate::config::worker(
        "w",
        crate::config::FileWorker {
            id: id.into(),
            events: events.into(),
            dp_ranks: Some(dp_ranks),
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn a_new_worker_list_subscribes_joiners_and_closes_leavers() {
    let mut i = ingest(false);
    let kept = lock(&i.fleet).workers[1].config.clone(); // 2 ranks: streams 1 and 2
    let joiner = worker_config("127.0.0.1:8103", "tcp://127.0.0.1:5577", 1);
    i.set_workers(&[kept.clone(), joiner.clone()]);
    // Worker 0's stream (0) closed, the joiner's subscribed after the others.
    assert_eq!(i.source.removed, vec![0]);
    assert_eq!(i.source.added, vec!["127.0.0.1:8103 rank 0"]);
    assert_eq!(i.streams.iter().map(|s| (s.worker, s.rank)).collect::<Vec<_>>(), [(1, 0), (1, 1), (2, 0)]);
    // Arrivals reach the right worker through the renumbered streams.
    let mut stored = empty_batch();
    // [ts, [["BlockStored", [7], nil, [0..16], 16]], 0]
    stored.truncate(stored.len() - 2);
    stored.extend_from_slice(&[0x91, 0x95, 0xab]);
    stored.extend_from_slice(b"BlockStored");
    stored.extend_from_slice(&[0x91, 0x07, 0xc0, 0xdc, 0x00, 0x10]);
    stored.extend(0u8..16);
    stored.extend_from_slice(&[0x10, 0x00]);
    i.source.polls.push_back(vec![(2, Arrival::Live(0, stored))]);
    i.turn(Duration::ZERO);
    {
        let f = lock(&i.fleet);
        let ids: Vec<(&str, usize)> = f.workers.iter().map(|w| (w.config.id.as_str(), w.cache.block_count())).collect();
        assert_eq!(ids, [("127.0.0.1:8102", 0), ("127.0.0.1:8103", 1)]);
    }
    // The same list again changes nothing; a changed endpoint is a leave and a join.
    i.set_workers(&[kept.clone(), joiner.clone()]);
    assert_eq!((i.source.removed.len(), i.source.added.len()), (1, 1));
    let moved = worker_config("127.0.0.1:8103", "tcp://127.0.0.1:5580", 1);
    i.set_workers(&[kept.clone(), moved]);
    assert_eq!(i.source.removed, vec![0, 2]);
    assert_eq!(lock(&i.fleet).workers.iter().map(|w| w.key).collect::<Vec<_>>(), [1, 3]);
    // A worker the transport refuses is left out whole, and counted.
    let refused = worker_config("127.0.0.1:8104", "ipc:///refused", 2);
    i.set_workers(&[kept, refused]);
    let f = lock(&i.fleet);
    assert_eq!(f.workers.len(), 1);
    assert_eq!(f.stats.workers_refused, 1);
    assert_eq!(i.streams.len(), 2);
}

/// `[ts, [], 0]`: an empty batch whose payload (and digest) differs with `ts`.
fn empty_batch_at(ts: f64) -> Vec<u8> {
    let mut p = empty_batch();
    p[2..10].copy_from_slice(&ts.to_bits().to_be_bytes());
    p
}

#[test]
fn a_restored_rank_the_publisher_does_not_confirm_is_caught_up_by_a_fresh_replay() {
    let config = Config::from_toml(CONFIG, &Cli::default()).unwrap();
    let mut before = Fleet::new(&config, 1);
    before.apply_payload(0, 0, 1, &empty_batch_at(1.0), Instant::now(), 0.0).unwrap();
    let mut fleet = Fleet::new(&config, 2);
    fleet.load_checkpoint(&before.checkpoint()).unwrap();
    let specs = streams(&config);
    let mut i =
        Ingest::new(&config, &specs, Scripted { can_replay: true, ..Scripted::default() }, Arc::new(Mutex::new(fleet)));
    // Restored: asks for the checkpoint's last batch.
    assert_eq!(i.source.replays, vec![(0, 1)]);
    // The publisher restarted and sent another batch 1: the rank is cleared and a replay
    // from 0 asked for; what the first replay sent after that batch, read in the same
    // poll, is not taken for the second replay's.
    i.source.polls.push_back(vec![
        (0, Arrival::Replay(ReplayReply::Batch(1, empty_batch_at(9.0)))),
        (0, Arrival::Replay(ReplayReply::Batch(2, empty_batch_at(9.5)))),
        (0, Arrival::Replay(ReplayReply::End)),
    ]);
    i.source.polls.push_back(
        [0.0, 9.0, 9.5]
            .iter()
            .enumerate()
            .map(|(s, ts)| (0, Arrival::Replay(ReplayReply::Batch(s as u64, empty_batch_at(*ts)))))
            .chain([(0, Arrival::Replay(ReplayReply::End))])
            .collect(),
    );
    i.turn(Duration::ZERO);
    i.turn(Duration::ZERO);
    assert_eq!(i.source.replays, vec![(0, 1), (0, 0)]);
    let f = lock(&i.fleet);
    let unverified = ResetReason::ALL.iter().position(|r| *r == ResetReason::RestoreUnverified).unwrap();
    assert_eq!((f.stats.resets[unverified], f.stats.restores_verified, f.stats.replays_ok), (1, 0, 1));
    // The second replay's three batches, all of them.
    assert_eq!((f.stats.batches, f.workers[0].ranks[0].last_seq), (3, Some(2)));
}
