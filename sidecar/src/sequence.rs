//! One event stream's sequencing, with no I/O: what to do with each batch a publisher
//! sends, so that the worker's view stays exact across gaps, replays and restarts. A
//! source (ZMQ today, `ingest`) feeds it what arrived and the time; it tells the source's
//! [`Sink`] what to apply, what to clear and when to ask for a replay.
//!
//! `expected` is the next sequence number:
//! - `seq == expected`: apply.
//! - `seq > expected`: a gap. Replay from `expected`, holding live batches meanwhile; if the
//!   replay cannot cover the gap (no replay endpoint, buffer too short, timeout, too many
//!   live batches held), the stream's blocks are cleared and rebuilt from what follows.
//! - `seq < expected`: the publisher restarted; its cache started empty, so clear it too.
//! - first batch seen with `seq > 0`: catch up by replaying from 0 if possible (what the
//!   engine cached before the sidecar subscribed).
//!
//! A batch that does not decode clears the stream (what it changed is unknown).

use crate::fleet::ResetReason;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What the sequencer counts (the sidecar's metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Count {
    Gap,
    ReplayOk,
    ReplayFailed,
    BadBatch,
}

/// The source's side of a stream.
pub trait Sink {
    /// Applies one batch to the worker's cache; an error: it did not decode.
    fn apply(&mut self, seq: u64, payload: &[u8]) -> Result<(), String>;
    /// Clears the stream's blocks.
    fn reset(&mut self, reason: ResetReason);
    /// Asks the publisher to replay from `from`; false if it cannot be asked (no replay
    /// endpoint, the request failed).
    fn request_replay(&mut self, from: u64) -> bool;
    /// The replay is over (done, abandoned or timed out): stop listening for it.
    fn end_replay(&mut self);
    fn count(&mut self, what: Count);
}

struct Replay {
    deadline: Instant,
    /// Catching up after subscribing: a buffer that does not reach back to 0 is expected,
    /// not a failure.
    catch_up: bool,
    /// The replay could not cover the gap and the stream was already cleared.
    gave_up: bool,
}

/// A replay's message, as the source read it.
#[derive(Debug, PartialEq, Eq)]
pub enum ReplayReply {
    Batch(u64, Vec<u8>),
    End,
}

pub struct Sequencer {
    label: String,
    expected: Option<u64>,
    replay: Option<Replay>,
    /// Live batches held while a replay runs.
    pending: VecDeque<(u64, Vec<u8>)>,
    max_pending: usize,
    replay_timeout: Duration,
    /// Problems seen on this stream; each is counted in the metrics, but logged only at
    /// the 1st, 2nd, 4th, 8th… occurrence, so a stream of garbage cannot flood the log.
    problems: u64,
}

impl Sequencer {
    pub fn new(label: String, max_pending: usize, replay_timeout: Duration) -> Sequencer {
        Sequencer {
            label,
            expected: None,
            replay: None,
            pending: VecDeque::new(),
            max_pending,
            replay_timeout,
            problems: 0,
        }
    }

    /// Continues after `seq`, applied elsewhere before (the relay: the last batch its NATS
    /// stream holds). A later first batch is then a gap, replayed from the publisher.
    pub fn resume_after(&mut self, seq: u64) {
        self.expected = Some(seq.wrapping_add(1));
    }

    /// Asks for everything from the next expected batch (from the first, if none was
    /// seen) without waiting for a live batch to show the gap: a relay that starts while
    /// its engine is idle catches up at once.
    pub fn replay_now(&mut self, now: Instant, sink: &mut dyn Sink) {
        if self.replay.is_some() {
            return;
        }
        let catch_up = self.expected.is_none();
        if self.start_replay(self.expected.unwrap_or(0), catch_up, now, sink) {
            self.expected.get_or_insert(0);
        }
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    /// A replay is running: the source listens for its replies.
    pub fn replaying(&self) -> bool {
        self.replay.is_some()
    }

    /// Counts a problem; whether to log it (rate-limited).
    pub fn should_log(&mut self) -> bool {
        self.problems += 1;
        self.problems.is_power_of_two()
    }

    pub fn problems(&self) -> u64 {
        self.problems
    }

    /// One live batch.
    pub fn live(&mut self, seq: u64, payload: Vec<u8>, now: Instant, sink: &mut dyn Sink) {
        if self.replay.is_some() {
            if self.pending.len() < self.max_pending {
                self.pending.push_back((seq, payload));
                return;
            }
            log::warn!("{}: replay too slow, {} live batches held; abandoning it", self.label, self.max_pending);
            self.finish_replay(now, sink);
            if self.replay.is_some() {
                self.pending.push_back((seq, payload));
                return;
            }
        }
        match self.expected {
            Some(e) if seq == e => self.apply(seq, &payload, sink),
            Some(e) if seq > e => {
                sink.count(Count::Gap);
                if self.should_log() {
                    log::warn!("{}: sequence gap, expected {e}, got {seq}", self.label);
                }
                if !self.start_replay(e, false, now, sink) {
                    sink.reset(ResetReason::GapNotReplayed);
                    self.apply(seq, &payload, sink);
                    return;
                }
                self.pending.push_back((seq, payload));
            }
            Some(e) => {
                if self.should_log() {
                    log::warn!("{}: sequence went back from {e} to {seq}: publisher restarted", self.label);
                }
                sink.reset(ResetReason::PublisherRestart);
                self.expected = None;
                self.live(seq, payload, now, sink);
            }
            None => {
                if seq > 0 && self.start_replay(0, true, now, sink) {
                    self.expected = Some(0);
                    self.pending.push_back((seq, payload));
                } else {
                    self.apply(seq, &payload, sink);
                }
            }
        }
    }

    /// One message of the running replay (ignored when none runs).
    pub fn replay_reply(&mut self, reply: ReplayReply, now: Instant, sink: &mut dyn Sink) {
        let (seq, payload) = match reply {
            ReplayReply::Batch(seq, payload) => (seq, payload),
            ReplayReply::End => return self.finish_replay(now, sink),
        };
        let Some(r) = self.replay.as_mut() else { return };
        let expected = self.expected.unwrap_or(0);
        if seq < expected {
            return; // already applied
        }
        if seq > expected {
            if r.catch_up && expected == 0 {
                log::info!("{}: replay buffer starts at {seq}; earlier history is gone", self.label);
            } else if !r.gave_up {
                // The publisher's buffer no longer reaches back to the gap.
                log::warn!("{}: replay starts at {seq}, needed {expected}", self.label);
                r.gave_up = true;
                sink.reset(ResetReason::GapNotReplayed);
            }
        }
        self.apply(seq, &payload, sink);
    }

    /// The replay's connection failed: it ends here.
    pub fn replay_failed(&mut self, now: Instant, sink: &mut dyn Sink) {
        self.finish_replay(now, sink);
    }

    /// Ends a replay that has run past its deadline.
    pub fn tick(&mut self, now: Instant, sink: &mut dyn Sink) {
        if self.replay.as_ref().is_some_and(|r| now >= r.deadline) {
            log::warn!("{}: replay timed out", self.label);
            self.finish_replay(now, sink);
        }
    }

    fn apply(&mut self, seq: u64, payload: &[u8], sink: &mut dyn Sink) {
        self.expected = Some(seq.wrapping_add(1));
        if let Err(e) = sink.apply(seq, payload) {
            if self.should_log() {
                log::warn!("{}: batch {seq} does not decode ({e}); clearing (problem #{})", self.label, self.problems);
            }
            sink.count(Count::BadBatch);
            sink.reset(ResetReason::UndecodableBatch);
        }
    }

    fn start_replay(&mut self, from: u64, catch_up: bool, now: Instant, sink: &mut dyn Sink) -> bool {
        if !sink.request_replay(from) {
            return false;
        }
        self.replay = Some(Replay { deadline: now + self.replay_timeout, catch_up, gave_up: false });
        true
    }

    /// Ends the replay (at its end marker, a timeout, a failure or too many held batches),
    /// then applies the live batches held meanwhile.
    fn finish_replay(&mut self, now: Instant, sink: &mut dyn Sink) {
        let Some(replay) = self.replay.take() else { return };
        sink.end_replay();
        let pending = std::mem::take(&mut self.pending);
        let expected = self.expected.unwrap_or(0);
        // Covered: the replay reached the first held live batch.
        let covered = pending.front().is_none_or(|(seq, _)| *seq <= expected);
        let nothing_to_lose = replay.catch_up && expected == 0;
        sink.count(if covered && !replay.gave_up { Count::ReplayOk } else { Count::ReplayFailed });
        if !covered && !nothing_to_lose && !replay.gave_up {
            sink.reset(ResetReason::GapNotReplayed);
        }
        let mut restart_at_first = !covered;
        for (seq, payload) in pending {
            if std::mem::take(&mut restart_at_first) {
                self.apply(seq, &payload, sink);
            } else if self.replay.is_none() && self.expected.is_some_and(|e| seq < e) {
                continue; // the replay already applied it
            } else {
                // (If a new gap among them started another replay, `live` holds the rest.)
                self.live(seq, payload, now, sink);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the sequencer asked for, in order.
    #[derive(Debug, PartialEq, Eq)]
    enum Did {
        Apply(u64),
        Reset(ResetReason),
        Replay(u64),
        EndReplay,
        Counted(Count),
    }

    #[derive(Default)]
    struct Record {
        did: Vec<Did>,
        /// Whether a replay can be asked for.
        replay_ok: bool,
        /// Payloads that do not decode.
        bad: Vec<u8>,
    }

    impl Sink for Record {
        fn apply(&mut self, seq: u64, payload: &[u8]) -> Result<(), String> {
            self.did.push(Did::Apply(seq));
            if payload.first().is_some_and(|b| self.bad.contains(b)) {
                return Err("bad".into());
            }
            Ok(())
        }
        fn reset(&mut self, reason: ResetReason) {
            self.did.push(Did::Reset(reason));
        }
        fn request_replay(&mut self, from: u64) -> bool {
            if self.replay_ok {
                self.did.push(Did::Replay(from));
            }
            self.replay_ok
        }
        fn end_replay(&mut self) {
            self.did.push(Did::EndReplay);
        }
        fn count(&mut self, what: Count) {
            self.did.push(Did::Counted(what));
        }
    }

    fn seq(max_pending: usize) -> Sequencer {
        Sequencer::new("w0 rank 0".into(), max_pending, Duration::from_secs(5))
    }

    fn sink(replay_ok: bool) -> Record {
        Record { replay_ok, ..Record::default() }
    }

    fn batch(s: u64) -> ReplayReply {
        ReplayReply::Batch(s, vec![0])
    }

    use Did::*;

    /// After batch 0 and a gap from 1: the replay abandoned, the stream cleared, and the
    /// held batches `then` applied.
    fn abandoned_after_gap_at_1(then: &[u64]) -> Vec<Did> {
        let mut did = vec![
            Apply(0),
            Counted(Count::Gap),
            Replay(1),
            EndReplay,
            Counted(Count::ReplayFailed),
            Reset(ResetReason::GapNotReplayed),
        ];
        did.extend(then.iter().map(|&s| Apply(s)));
        did
    }

    #[test]
    fn batches_in_order_are_applied() {
        let (mut q, mut k, t) = (seq(8), sink(true), Instant::now());
        for s in 0..3 {
            q.live(s, vec![0], t, &mut k);
        }
        assert_eq!(k.did, [Apply(0), Apply(1), Apply(2)]);
        assert!(!q.replaying());
    }

    #[test]
    fn a_gap_is_replayed_and_the_held_batches_follow() {
        let (mut q, mut k, t) = (seq(8), sink(true), Instant::now());
        q.live(0, vec![0], t, &mut k);
        q.live(3, vec![0], t, &mut k); // 1 and 2 missed
        q.live(4, vec![0], t, &mut k); // held
        assert!(q.replaying());
        for r in [batch(1), batch(2), batch(3), ReplayReply::End] {
            q.replay_reply(r, t, &mut k);
        }
        assert_eq!(
            k.did,
            [
                Apply(0),
                Counted(Count::Gap),
                Replay(1),
                Apply(1),
                Apply(2),
                Apply(3),
                EndReplay,
                Counted(Count::ReplayOk),
                Apply(4)
            ],
            "3 came in the replay: the held copy is skipped"
        );
        assert!(!q.replaying());
    }

    #[test]
    fn a_resumed_stream_replays_what_came_after_its_last_batch() {
        // The relay restarted: its stream ends at batch 4, the engine is at 7.
        let (mut q, mut k, t) = (seq(8), sink(true), Instant::now());
        q.resume_after(4);
        q.live(7, vec![0], t, &mut k);
        for r in [batch(4), batch(5), batch(6), ReplayReply::End] {
            q.replay_reply(r, t, &mut k);
        }
        assert_eq!(
            k.did,
            [Counted(Count::Gap), Replay(5), Apply(5), Apply(6), EndReplay, Counted(Count::ReplayOk), Apply(7)]
        );
        // Asked at once, before any live batch: the same replay.
        let (mut q, mut k) = (seq(8), sink(true));
        q.resume_after(4);
        q.replay_now(t, &mut k);
        for r in [batch(5), ReplayReply::End] {
            q.replay_reply(r, t, &mut k);
        }
        q.live(6, vec![0], t, &mut k);
        assert_eq!(k.did, [Replay(5), Apply(5), EndReplay, Counted(Count::ReplayOk), Apply(6)]);
        // The engine restarted meanwhile (its sequence went back): taken from its start.
        let (mut q, mut k) = (seq(8), sink(true));
        q.resume_after(4);
        q.live(0, vec![0], t, &mut k);
        assert_eq!(k.did, [Reset(ResetReason::PublisherRestart), Apply(0)]);
    }

    #[test]
    fn a_gap_that_cannot_be_replayed_clears_and_goes_on() {
        let (mut q, mut k, t) = (seq(8), sink(false), Instant::now());
        q.live(0, vec![0], t, &mut k);
        q.live(5, vec![0], t, &mut k);
        q.live(6, vec![0], t, &mut k);
        assert_eq!(k.did, [Apply(0), Counted(Count::Gap), Reset(ResetReason::GapNotReplayed), Apply(5), Apply(6)]);
    }

    #[test]
    fn a_sequence_that_goes_back_is_a_restarted_publisher() {
        let (mut q, mut k, t) = (seq(8), sink(false), Instant::now());
        for s in [0, 1, 2, 0, 1] {
            q.live(s, vec![0], t, &mut k);
        }
        assert_eq!(k.did, [Apply(0), Apply(1), Apply(2), Reset(ResetReason::PublisherRestart), Apply(0), Apply(1)]);
    }

    #[test]
    fn joining_late_catches_up_from_0_and_a_short_buffer_is_no_failure() {
        let (mut q, mut k, t) = (seq(8), sink(true), Instant::now());
        q.live(10, vec![0], t, &mut k);
        // The publisher's buffer begins at 7: earlier history is gone, nothing to clear.
        for r in [batch(7), batch(8), batch(9), batch(10), ReplayReply::End] {
            q.replay_reply(r, t, &mut k);
        }
        q.live(11, vec![0], t, &mut k);
        assert_eq!(
            k.did,
            [Replay(0), Apply(7), Apply(8), Apply(9), Apply(10), EndReplay, Counted(Count::ReplayOk), Apply(11)]
        );
    }

    #[test]
    fn a_replay_that_starts_past_the_gap_clears_once() {
        let (mut q, mut k, t) = (seq(8), sink(true), Instant::now());
        q.live(0, vec![0], t, &mut k);
        q.live(5, vec![0], t, &mut k);
        for r in [batch(3), batch(4), batch(5), ReplayReply::End] {
            q.replay_reply(r, t, &mut k);
        }
        assert_eq!(
            k.did,
            [
                Apply(0),
                Counted(Count::Gap),
                Replay(1),
                Reset(ResetReason::GapNotReplayed),
                Apply(3),
                Apply(4),
                Apply(5),
                EndReplay,
                Counted(Count::ReplayFailed),
            ]
        );
    }

    #[test]
    fn a_replay_past_its_deadline_ends_and_the_stream_restarts_at_the_held_batches() {
        let (mut q, mut k, t) = (seq(8), sink(true), Instant::now());
        q.live(0, vec![0], t, &mut k);
        q.live(4, vec![0], t, &mut k);
        q.live(5, vec![0], t, &mut k);
        q.tick(t + Duration::from_secs(4), &mut k);
        assert!(q.replaying(), "not yet due");
        q.tick(t + Duration::from_secs(5), &mut k);
        assert!(!q.replaying());
        assert_eq!(k.did, abandoned_after_gap_at_1(&[4, 5]));
        // Late replies of the finished replay change nothing.
        q.replay_reply(batch(2), t, &mut k);
        assert_eq!(k.did.len(), 8);
    }

    #[test]
    fn too_many_held_batches_abandon_the_replay() {
        let (mut q, mut k, t) = (seq(2), sink(true), Instant::now());
        q.live(0, vec![0], t, &mut k);
        for s in 3..6 {
            q.live(s, vec![0], t, &mut k); // 3 and 4 held, 5 is one too many
        }
        assert!(!q.replaying());
        assert_eq!(k.did, abandoned_after_gap_at_1(&[3, 4, 5]));
    }

    #[test]
    fn a_failed_replay_connection_ends_the_replay() {
        let (mut q, mut k, t) = (seq(8), sink(true), Instant::now());
        q.live(0, vec![0], t, &mut k);
        q.live(2, vec![0], t, &mut k);
        q.replay_failed(t, &mut k);
        assert!(!q.replaying());
        assert_eq!(k.did, abandoned_after_gap_at_1(&[2]));
    }

    #[test]
    fn an_undecodable_batch_clears_and_counts() {
        let (mut q, mut k, t) = (seq(8), sink(false), Instant::now());
        k.bad = vec![9];
        q.live(0, vec![9], t, &mut k);
        q.live(1, vec![0], t, &mut k);
        assert_eq!(k.did, [Apply(0), Counted(Count::BadBatch), Reset(ResetReason::UndecodableBatch), Apply(1)]);
        assert_eq!(q.problems(), 1);
    }
}
