//! The ingest loop, whatever the transport: a [`Source`] moves publishers' messages, each
//! stream's [`Sequencer`] decides what they mean, and the fleet takes what is applied.
//!
//! A stream is one (worker, DP rank) publisher. The loop asks the source for what arrived,
//! hands each message to its stream's sequencer with a [`Sink`] over the fleet (batches,
//! resets, counts) and the source (replays), and then gives every sequencer the time, so a
//! replay that runs too long ends. The ZMQ source is [`crate::zmq_source`]; another
//! transport (NATS JetStream) is another `Source`, with this loop and the sequencing
//! unchanged.
//!
//! The worker list can change under a running loop ([`Ingest::set_workers`], fed by
//! discovery): a worker that joins gets its streams subscribed and sequenced from nothing
//! (its first batch asks its publisher to replay what came before), one that leaves has
//! its streams closed and its state dropped, both between two turns.

use crate::config::{Config, WorkerConfig};
use crate::fleet::{lock, Fleet, ResetReason, WorkerKey};
use crate::sequence::{Count, ReplayReply, Sequencer, Sink};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long one turn waits for messages: the pace of replay timeouts while all is quiet.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// One publisher to subscribe to, as the configuration names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamSpec {
    pub worker: WorkerKey,
    /// The worker's `ip:port` (the NATS transport's subjects are named after it).
    pub worker_id: String,
    pub rank: usize,
    /// `<worker id> rank <rank>`, for logs.
    pub label: String,
    /// Where its live batches are published.
    pub events: String,
    /// Where it answers replay requests, if it does.
    pub replay: Option<String>,
}

/// Every configured worker's publishers, in order (the index is the stream's number); the
/// workers' keys are their positions, as [`Fleet::new`] gives them.
pub fn streams(config: &Config) -> Vec<StreamSpec> {
    config.workers.iter().enumerate().flat_map(|(w, wc)| worker_streams(w as WorkerKey, wc)).collect()
}

/// One worker's publishers, one per DP rank.
pub fn worker_streams(key: WorkerKey, wc: &WorkerConfig) -> Vec<StreamSpec> {
    (0..wc.dp_ranks)
        .map(|rank| StreamSpec {
            worker: key,
            worker_id: wc.id.clone(),
            rank: rank as usize,
            label: format!("{} rank {rank}", wc.id),
            events: wc.events_for(rank),
            replay: wc.replay_for(rank),
        })
        .collect()
}

/// What a source read for one stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Arrival {
    /// A live batch: its sequence number and msgpack payload.
    Live(u64, Vec<u8>),
    /// A message of the running replay.
    Replay(ReplayReply),
    /// The running replay's connection failed.
    ReplayFailed,
    /// A message of the wrong shape (what it was, for the log): counted and dropped.
    Malformed(&'static str),
}

/// A transport for KV events: it moves messages and decides nothing.
pub trait Source {
    /// Waits up to `timeout` for messages and returns what arrived, each with its stream's
    /// number. Per stream, a replay's messages come before live ones, each in the order
    /// sent; a source bounds what it takes from one stream per call, so a flood on one
    /// cannot starve the others.
    fn poll(&mut self, timeout: Duration) -> Vec<(usize, Arrival)>;
    /// Asks stream `stream`'s publisher to replay from `from`; false if it cannot be asked.
    fn request_replay(&mut self, stream: usize, from: u64) -> bool;
    /// The stream's replay is over: stop listening for it.
    fn end_replay(&mut self, stream: usize);
    /// Starts listening to one more stream; it is numbered after the existing ones.
    fn add_stream(&mut self, spec: &StreamSpec) -> Result<(), String>;
    /// Stops listening to stream `stream`; the streams after it move down by one.
    fn remove_stream(&mut self, stream: usize);
}

struct Stream {
    worker: WorkerKey,
    rank: usize,
    seq: Sequencer,
}

pub struct Ingest<S: Source> {
    source: S,
    streams: Vec<Stream>,
    fleet: Arc<Mutex<Fleet>>,
    max_pending_batches: usize,
    replay_timeout: Duration,
    /// Worker lists from discovery, the whole fleet each; the newest is applied.
    membership: Option<std::sync::mpsc::Receiver<Vec<WorkerConfig>>>,
}

impl<S: Source> Ingest<S> {
    /// `specs`: the streams `source` was connected to, in the same order.
    pub fn new(config: &Config, specs: &[StreamSpec], source: S, fleet: Arc<Mutex<Fleet>>) -> Ingest<S> {
        let mut ingest = Ingest {
            source,
            streams: Vec::new(),
            fleet,
            max_pending_batches: config.max_pending_batches,
            replay_timeout: config.replay_timeout,
            membership: None,
        };
        ingest.streams = specs.iter().map(|s| ingest.stream(s)).collect();
        let mut keys: Vec<WorkerKey> = specs.iter().map(|s| s.worker).collect();
        keys.dedup();
        for key in keys {
            ingest.resume_restored(key);
        }
        ingest
    }

    /// Restores worker `key`'s cache from the checkpoint, if it has a record there, and has
    /// each restored rank's sequencer confirm its resume point with the publisher.
    fn resume_restored(&mut self, key: WorkerKey) {
        let points = lock(&self.fleet).restore_worker(key);
        for (i, stream) in self.streams.iter_mut().enumerate().filter(|(_, s)| s.worker == key) {
            if let Some(&Some(at)) = points.get(stream.rank) {
                let mut sink = FleetSink::of(&self.fleet, stream, i, &mut self.source);
                stream.seq.resume_verified(at, Instant::now(), &mut sink);
            }
        }
    }

    fn stream(&self, spec: &StreamSpec) -> Stream {
        Stream {
            worker: spec.worker,
            rank: spec.rank,
            seq: Sequencer::new(spec.label.clone(), self.max_pending_batches, self.replay_timeout),
        }
    }

    /// Takes the fleet's worker list from `rx` (discovery) from now on.
    pub fn follow(&mut self, rx: std::sync::mpsc::Receiver<Vec<WorkerConfig>>) {
        self.membership = Some(rx);
    }

    /// Runs until `stop` is set.
    pub fn run(mut self, stop: Arc<AtomicBool>) {
        while !stop.load(Ordering::Relaxed) {
            if let Some(workers) = self.membership.as_ref().and_then(|rx| rx.try_iter().last()) {
                self.set_workers(&workers);
            }
            self.turn(POLL_INTERVAL);
        }
    }

    /// Makes the fleet exactly `workers`: those not in it (or whose configuration changed)
    /// leave, the new ones join. A worker the fleet refuses (full) is counted and logged;
    /// the next list that still names it tries again.
    pub fn set_workers(&mut self, workers: &[WorkerConfig]) {
        let current: Vec<(WorkerKey, WorkerConfig)> =
            lock(&self.fleet).workers.iter().map(|w| (w.key, w.config.clone())).collect();
        for (key, config) in &current {
            if !workers.contains(config) {
                self.remove_worker(*key);
            }
        }
        for config in workers {
            if !current.iter().any(|(_, c)| c == config) {
                self.add_worker(config);
            }
        }
    }

    fn remove_worker(&mut self, key: WorkerKey) {
        for i in (0..self.streams.len()).rev() {
            if self.streams[i].worker == key {
                self.source.remove_stream(i);
                self.streams.remove(i);
            }
        }
        lock(&self.fleet).remove_worker(key);
    }

    fn add_worker(&mut self, config: &WorkerConfig) {
        let key = match lock(&self.fleet).add_worker(config.clone()) {
            Ok(k) => k,
            Err(e) => {
                let mut f = lock(&self.fleet);
                f.stats.workers_refused += 1;
                if f.stats.workers_refused.is_power_of_two() {
                    log::error!("discovery: {e} (#{})", f.stats.workers_refused);
                }
                return;
            }
        };
        let specs = worker_streams(key, config);
        for (n, spec) in specs.iter().enumerate() {
            if let Err(e) = self.source.add_stream(spec) {
                // Endpoints are validated before they get here; a transport that still
                // refuses one leaves the worker out rather than half subscribed.
                log::error!("{}: cannot subscribe: {e}; worker left out", spec.label);
                let first = self.streams.len() - n;
                for i in (first..self.streams.len()).rev() {
                    self.source.remove_stream(i);
                }
                self.streams.truncate(first);
                let mut f = lock(&self.fleet);
                f.remove_worker(key);
                f.stats.workers_refused += 1;
                return;
            }
            let stream = self.stream(spec);
            self.streams.push(stream);
        }
        self.resume_restored(key);
    }

    /// One turn: what arrived within `timeout`, then every stream's clock.
    pub fn turn(&mut self, timeout: Duration) {
        let arrivals = self.source.poll(timeout);
        // Replies read in this poll belong to the replay running when it was made; one that
        // ends midway (a restored rank not confirmed) is followed by another, which must not
        // take the first one's remaining replies for its own.
        let generation: Vec<u64> = self.streams.iter().map(|s| s.seq.replay_generation()).collect();
        for (i, arrival) in arrivals {
            let Some(stream) = self.streams.get_mut(i) else { continue };
            let stale = generation.get(i) != Some(&stream.seq.replay_generation());
            let mut sink = FleetSink::of(&self.fleet, stream, i, &mut self.source);
            let now = Instant::now();
            match arrival {
                Arrival::Live(seq, payload) => stream.seq.live(seq, payload, now, &mut sink),
                Arrival::Replay(_) | Arrival::ReplayFailed if stale => {}
                Arrival::Replay(reply) => stream.seq.replay_reply(reply, now, &mut sink),
                Arrival::ReplayFailed => stream.seq.replay_failed(now, &mut sink),
                Arrival::Malformed(what) => {
                    lock(&self.fleet).stats.frames_bad += 1;
                    if stream.seq.should_log() {
                        log::warn!("{}: dropped a {what} (problem #{})", stream.seq.label(), stream.seq.problems());
                    }
                }
            }
        }
        let now = Instant::now();
        for (i, stream) in self.streams.iter_mut().enumerate() {
            let mut sink = FleetSink::of(&self.fleet, stream, i, &mut self.source);
            stream.seq.tick(now, &mut sink);
        }
    }
}

/// A stream's [`Sink`]: the fleet for batches, resets and counts; the source for replays.
struct FleetSink<'a, S: Source> {
    fleet: &'a Mutex<Fleet>,
    worker: WorkerKey,
    rank: usize,
    stream: usize,
    source: &'a mut S,
}

impl<'a, S: Source> FleetSink<'a, S> {
    fn of(fleet: &'a Mutex<Fleet>, stream: &Stream, i: usize, source: &'a mut S) -> FleetSink<'a, S> {
        FleetSink { fleet, worker: stream.worker, rank: stream.rank, stream: i, source }
    }
}

impl<S: Source> Sink for FleetSink<'_, S> {
    fn apply(&mut self, seq: u64, payload: &[u8]) -> Result<(), String> {
        lock(self.fleet)
            .apply_payload(self.worker, self.rank, seq, payload, Instant::now(), kvroute_serve::unix_seconds())
            .map_err(|e| e.to_string())
    }

    fn reset(&mut self, reason: ResetReason) {
        lock(self.fleet).reset_rank(self.worker, self.rank, reason);
    }

    fn request_replay(&mut self, from: u64) -> bool {
        self.source.request_replay(self.stream, from)
    }

    fn end_replay(&mut self) {
        self.source.end_replay(self.stream);
    }

    fn count(&mut self, what: Count) {
        let stats = &mut lock(self.fleet).stats;
        match what {
            Count::Gap => stats.gaps += 1,
            Count::ReplayOk => stats.replays_ok += 1,
            Count::ReplayFailed => stats.replays_failed += 1,
            Count::BadBatch => stats.batches_bad += 1,
            Count::Duplicate => stats.batches_duplicate += 1,
            Count::RestoreVerified => stats.restores_verified += 1,
        }
    }
}

#[cfg(test)]
mod tests;
