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
//!   Unless it is a batch applied already (same number, same payload digest, among the
//!   last [`RECENT_BATCHES`]): a replay reaches as far as the publisher's buffer, past
//!   live batches still on their way, which then arrive again; so does a batch the network
//!   delayed behind the next. Those are dropped and counted.
//! - first batch seen with `seq > 0`: catch up by replaying from 0 if possible (what the
//!   engine cached before the sidecar subscribed).
//!
//! A batch that does not decode clears the stream (what it changed is unknown).
//!
//! A stream restored from a checkpoint ([`Sequencer::resume_verified`]) starts with a replay
//! from the checkpoint's last batch: the publisher must send that very batch (same sequence
//! number and payload digest) before anything after it is applied; otherwise (another
//! batch, an empty buffer, no replay, a timeout) the rank is cleared and caught up from 0
//! as at a fresh start.

use crate::checkpoint::{payload_digest, ResumePoint};
use crate::fleet::ResetReason;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Applied batches remembered per stream to tell a batch that comes again from a restarted
/// publisher's (16 bytes each). A replay runs ahead of the live stream by what the
/// subscription has not read yet; a duplicate older than this is taken for a restart, which
/// clears and rebuilds the rank: never wrong, only slower.
pub const RECENT_BATCHES: usize = 4096;

/// What the sequencer counts (the sidecar's metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Count {
    Gap,
    ReplayOk,
    ReplayFailed,
    BadBatch,
    /// A live batch that had been applied already (module docs); dropped.
    Duplicate,
    /// A restored rank's resume point was confirmed by its publisher.
    RestoreVerified,
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
    /// A restored rank's resume point, until its publisher sends that batch again.
    verify: Option<ResumePoint>,
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
    /// Replays started so far: tells a source's replies to an ended replay from the next's.
    replays_started: u64,
    /// (seq, payload digest) of the last batches applied, oldest first.
    recent: VecDeque<(u64, u64)>,
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
            replays_started: 0,
            recent: VecDeque::new(),
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

    /// Forgets where the stream was and continues after `seq` (from nothing: `None`),
    /// ending a replay under way and dropping the live batches it held: the relay's
    /// resync, whose next [`Sequencer::replay_now`] asks the engine for all of them again.
    pub fn restart_after(&mut self, seq: Option<u64>, sink: &mut dyn Sink) {
        if self.replay.take().is_some() {
            sink.end_replay();
        }
        self.pending.clear();
        self.recent.clear();
        self.expected = seq.map(|s| s.wrapping_add(1));
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

    /// Continues a rank restored from a checkpoint after its last batch `at`, once the
    /// publisher confirms it (module docs); clears the rank at once if no replay can be
    /// asked for.
    pub fn resume_verified(&mut self, at: ResumePoint, now: Instant, sink: &mut dyn Sink) {
        self.expected = Some(at.seq.wrapping_add(1));
        if self.start_replay(at.seq, false, now, sink) {
            if let Some(r) = self.replay.as_mut() {
                r.verify = Some(at);
            }
        } else {
            self.unverified(now, sink);
        }
    }

    /// The restored rank could not be confirmed: cleared, and caught up from 0 (the held
    /// live batches after it).
    fn unverified(&mut self, now: Instant, sink: &mut dyn Sink) {
        if self.should_log() {
            log::warn!("{}: checkpoint not confirmed by the publisher; clearing", self.label);
        }
        sink.reset(ResetReason::RestoreUnverified);
        self.expected = None;
        if self.start_replay(0, true, now, sink) {
            self.expected = Some(0);
        } else {
            for (seq, payload) in std::mem::take(&mut self.pending) {
                self.live(seq, payload, now, sink);
            }
        }
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    /// Which replay is the latest (a count of those started): replies a source read for an
    /// earlier one must not be taken for this one's.
    pub fn replay_generation(&self) -> u64 {
        self.replays_started
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
                let digest = payload_digest(&payload);
                if self.recent.iter().rev().any(|&(s, d)| s == seq && d == digest) {
                    sink.count(Count::Duplicate);
                    return;
                }
                if self.should_log() {
                    log::warn!("{}: sequence went back from {e} to {seq}: publisher restarted", self.label);
                }
                sink.reset(ResetReason::PublisherRestart);
                self.recent.clear();
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
        if let Some(at) = self.replay.as_ref().and_then(|r| r.verify) {
            match &reply {
                ReplayReply::Batch(seq, _) if *seq < at.seq => return,
                ReplayReply::Batch(seq, payload) if *seq == at.seq && payload_digest(payload) == at.digest => {
                    if let Some(r) = self.replay.as_mut() {
                        r.verify = None;
                    }
                    self.recent.push_back((at.seq, at.digest)); // applied, before the restart
                    sink.count(Count::RestoreVerified);
                    return;
                }
                // Another batch at that number, the buffer no longer reaching back to it,
                // or nothing at all: not the history the checkpoint continues.
                _ => {
                    self.replay = None;
                    sink.end_replay();
                    return self.unverified(now, sink);
                }
            }
        }
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
        if self.recent.len() == RECENT_BATCHES {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, payload_digest(payload)));
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
        self.replays_started += 1;
        self.replay = Some(Replay { deadline: now + self.replay_timeout, catch_up, gave_up: false, verify: None });
        true
    }

    /// Ends the replay (at its end marker, a timeout, a failure or too many held batches),
    /// then applies the live batches held meanwhile.
    fn finish_replay(&mut self, now: Instant, sink: &mut dyn Sink) {
        let Some(replay) = self.replay.take() else { return };
        sink.end_replay();
        if replay.verify.is_some() {
            return self.unverified(now, sink);
        }
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
    fn a_restart_ends_the_replay_drops_what_it_held_and_asks_again() {
        let (mut q, mut k, t) = (seq(8), sink(true), Instant::now());
        q.live(0, vec![0], t, &mut k);
        q.live(3, vec![0], t, &mut k); // a gap: replaying from 1, 3 held
        q.restart_after(Some(0), &mut k);
        assert!(!q.replaying());
        q.replay_now(t, &mut k);
        for r in [batch(1), batch(2), batch(3), ReplayReply::End] {
            q.replay_reply(r, t, &mut k);
        }
        q.live(4, vec![0], t, &mut k);
        // 3 once: the held copy went with the restart.
        let after_restart =
            [EndReplay, Replay(1), Apply(1), Apply(2), Apply(3), EndReplay, Counted(Count::ReplayOk), Apply(4)];
        assert_eq!(k.did[3..], after_restart);

        // From nothing (a stream made anew): a catch-up from 0, whose buffer may start later.
        let mut k = sink(true);
        q.restart_after(None, &mut k);
        q.replay_now(t, &mut k);
        for r in [batch(2), batch(3), batch(4), ReplayReply::End] {
            q.replay_reply(r, t, &mut k);
        }
        assert_eq!(k.did, [Replay(0), Apply(2), Apply(3), Apply(4), EndReplay, Counted(Count::ReplayOk)]);
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
        // (The new publisher's batches are other batches: their payloads differ.)
        for (s, payload) in [(0, 0), (1, 1), (2, 2), (0, 10), (1, 11)] {
            q.live(s, vec![payload], t, &mut k);
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

    /// Resumed at batch 5, whose payload is `[0]`.
    fn resumed(k: &mut Record, t: Instant) -> Sequencer {
        let mut q = seq(8);
        q.resume_verified(ResumePoint { seq: 5, digest: payload_digest(&[0]) }, t, k);
        q
    }

    #[test]
    fn a_restored_stream_goes_on_once_its_publisher_confirms_the_last_batch() {
        let (mut k, t) = (sink(true), Instant::now());
        let mut q = resumed(&mut k, t);
        q.live(7, vec![0], t, &mut k); // held while the replay runs
        q.replay_reply(batch(5), t, &mut k);
        q.replay_reply(batch(6), t, &mut k);
        q.replay_reply(ReplayReply::End, t, &mut k);
        assert_eq!(
            k.did,
            [Replay(5), Counted(Count::RestoreVerified), Apply(6), EndReplay, Counted(Count::ReplayOk), Apply(7)]
        );
    }

    #[test]
    fn a_restored_stream_the_publisher_does_not_confirm_is_cleared_and_caught_up() {
        let unconfirmed = [Replay(5), EndReplay, Reset(ResetReason::RestoreUnverified), Replay(0)];
        // Another batch under that number (the engine restarted and went past it), a buffer
        // that starts after it, or none at all.
        for first in [ReplayReply::Batch(5, vec![1]), batch(8), ReplayReply::End] {
            let (mut k, t) = (sink(true), Instant::now());
            let mut q = resumed(&mut k, t);
            q.replay_reply(first, t, &mut k);
            assert_eq!(k.did, unconfirmed);
            // The catch-up from 0 then runs as at a fresh start.
            q.replay_reply(batch(0), t, &mut k);
            q.replay_reply(ReplayReply::End, t, &mut k);
            assert_eq!(k.did[4..], [Apply(0), EndReplay, Counted(Count::ReplayOk)]);
        }
        // No answer in time.
        let (mut k, t) = (sink(true), Instant::now());
        let mut q = resumed(&mut k, t);
        q.tick(t + Duration::from_secs(6), &mut k);
        assert_eq!(k.did, unconfirmed);
        // No replay socket: nothing can confirm it.
        let (mut k, t) = (sink(false), Instant::now());
        let mut q = resumed(&mut k, t);
        q.live(7, vec![0], t, &mut k);
        assert_eq!(k.did, [Reset(ResetReason::RestoreUnverified), Apply(7)]);
    }

    #[test]
    fn a_batch_that_comes_again_after_a_replay_applied_it_is_not_a_restart() {
        let (mut q, mut k, t) = (seq(8), sink(true), Instant::now());
        q.live(0, vec![0], t, &mut k);
        q.live(2, vec![2], t, &mut k); // 1 is late: a gap
        q.replay_reply(ReplayReply::Batch(1, vec![1]), t, &mut k);
        q.replay_reply(ReplayReply::Batch(2, vec![2]), t, &mut k);
        q.replay_reply(ReplayReply::Batch(3, vec![3]), t, &mut k); // ahead of the live stream
        q.replay_reply(ReplayReply::End, t, &mut k);
        k.did.clear();
        // 1 (delayed) and 3 (still on its way when the replay sent it) arrive: applied already.
        q.live(1, vec![1], t, &mut k);
        q.live(3, vec![3], t, &mut k);
        q.live(4, vec![4], t, &mut k);
        assert_eq!(k.did, [Counted(Count::Duplicate), Counted(Count::Duplicate), Apply(4)]);
        // The same number with another payload is a restarted publisher.
        q.live(1, vec![9], t, &mut k);
        assert_eq!(k.did[3..], [Reset(ResetReason::PublisherRestart), Replay(0)]);
    }
}
