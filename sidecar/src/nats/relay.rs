//! `kvroute-sidecar relay`: runs beside an engine, reads its ZMQ KV events, and publishes
//! each batch, in order and complete, to the JetStream stream the gateways' sidecars read.
//!
//! It sequences the engine's stream as a sidecar does ([`Sequencer`] over the same
//! [`ZmqSource`]), so a gap is repaired from the engine's replay socket before anything is
//! published; what it publishes is therefore the engine's batches in order, each once. On
//! start it reads the last batch the stream holds for each DP rank and continues after it
//! (the engine replays what the relay missed while it was down); a batch published twice
//! across a restart is dropped by JetStream's deduplication ([`super::msg_id`]).
//!
//! A gap the engine cannot replay, or an engine restart, is passed on as it is: every
//! sidecar sees the same jump and clears the worker's rank the same way.
//!
//! A batch JetStream did not take because the stream is gone (a memory stream whose lone
//! server restarted, a stream deleted) or did not answer in time starts a *resync*: the
//! relay makes the stream again if it must, reads what it holds as on start, and asks each
//! engine again for everything after that. Batches already on their way to the publisher
//! are dropped (the replay carries them, in order), so a stream made anew holds the
//! engines' buffers in order and sidecars that read it from its first message lose only
//! what those buffers no longer reach.

use super::{msg_id, seq_of, subject, NatsKeys, NatsSettings, SEQ_HEADER};
use crate::config::{parse_worker_flag, worker, WorkerConfig};
use crate::fleet::ResetReason;
use crate::ingest::{worker_streams, Arrival, Source, StreamSpec, POLL_INTERVAL};
use crate::sequence::{Count, Sequencer, Sink};
use crate::zmq_source::ZmqSource;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

#[derive(clap::Args, Debug, Clone)]
pub struct RelayArgs {
    /// The engine, as the sidecar's `--worker` takes it:
    /// `ID=EVENTS[,replay=ENDPOINT][,role=…][,dp=N]`. Repeatable (one relay per host is
    /// enough for all its engines).
    #[arg(long = "worker", required = true)]
    pub workers: Vec<String>,
    /// ZMQ subscription prefix (the engines' kv-events `topic`).
    #[arg(long, default_value = "")]
    pub topic: String,
    #[arg(long)]
    pub nats_url: Option<String>,
    #[arg(long)]
    pub nats_stream: Option<String>,
    #[arg(long)]
    pub nats_subject_prefix: Option<String>,
    /// Limits the stream is created with, if this relay creates it (sidecar/README.md).
    #[arg(long)]
    pub nats_max_age_s: Option<u64>,
    #[arg(long)]
    pub nats_max_bytes: Option<i64>,
    #[arg(long)]
    pub nats_max_msgs_per_subject: Option<i64>,
    #[arg(long)]
    pub nats_duplicate_window_s: Option<u64>,
    #[arg(long)]
    pub nats_replicas: Option<usize>,
    /// `file` (default) or `memory` (sidecar/README.md).
    #[arg(long)]
    pub nats_storage: Option<String>,
    #[arg(long, default_value_t = 2000)]
    pub replay_timeout_ms: u64,
    #[arg(long, default_value_t = 100_000)]
    pub max_pending_batches: usize,
}

impl RelayArgs {
    fn settings(&self) -> Result<NatsSettings, String> {
        NatsKeys {
            url: self.nats_url.clone(),
            stream: self.nats_stream.clone(),
            subject_prefix: self.nats_subject_prefix.clone(),
            max_age_s: self.nats_max_age_s,
            max_bytes: self.nats_max_bytes,
            max_msgs_per_subject: self.nats_max_msgs_per_subject,
            duplicate_window_s: self.nats_duplicate_window_s,
            replicas: self.nats_replicas,
            storage: self.nats_storage.clone(),
        }
        .settings()
    }

    fn workers(&self) -> Result<Vec<WorkerConfig>, String> {
        let mut out: Vec<WorkerConfig> = Vec::new();
        for (i, spec) in self.workers.iter().enumerate() {
            let w = worker(&format!("--worker #{}", i + 1), parse_worker_flag(spec)?)?;
            if out.iter().any(|o| o.id == w.id) {
                return Err(format!("--worker: id `{}` appears twice", w.id));
            }
            out.push(w);
        }
        Ok(out)
    }
}

/// What the relay has done, for its periodic log line and its exit.
#[derive(Default)]
struct Counters {
    published: AtomicU64,
    duplicates: AtomicU64,
    failed: AtomicU64,
    gaps: AtomicU64,
    replays_ok: AtomicU64,
    replays_failed: AtomicU64,
    frames_bad: AtomicU64,
    resyncs: AtomicU64,
}

/// Between the relay's loop and its publisher: the resync epoch, and the publisher's call
/// for a resync.
#[derive(Default)]
struct Resync {
    /// Batches made before the current epoch are not published.
    epoch: AtomicU64,
    wanted: AtomicBool,
}

/// No more than one resync a second while the stream stays unreachable.
const RESYNC_INTERVAL: Duration = Duration::from_secs(1);

/// Runs the relay until SIGTERM/SIGINT; the process's exit status.
pub fn main(args: RelayArgs) -> i32 {
    match run(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kvroute-sidecar relay: {e}");
            2
        }
    }
}

/// One batch on its way to JetStream.
struct Outgoing {
    subject: String,
    id: String,
    seq: u64,
    payload: Vec<u8>,
    epoch: u64,
}

fn run(args: RelayArgs) -> Result<(), String> {
    let settings = args.settings()?;
    let workers = args.workers()?;
    let specs: Vec<StreamSpec> = workers.iter().enumerate().flat_map(|(k, w)| worker_streams(k as u32, w)).collect();
    let (rt, js, stream) = super::open(&settings)?;
    let subjects: Vec<String> =
        specs.iter().map(|spec| subject(&settings.subject_prefix, &spec.worker_id, spec.rank as u32)).collect();
    let last = rt.block_on(stored_up_to(&stream, &subjects));

    let counters = Arc::new(Counters::default());
    // One message per turn of the loop (all it took from the engines): one wake-up of the
    // publisher per turn, not per batch. Full (64 turns queued): the loop waits.
    let (tx, rx) = mpsc::channel::<Vec<Outgoing>>(64);
    let resync = Arc::new(Resync::default());
    let publisher = rt.spawn(publish(js.clone(), rx, counters.clone(), resync.clone()));
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        rt.spawn(async move {
            kvroute_serve::shutdown_signal().await;
            stop.store(true, Ordering::Relaxed);
        });
    }

    let source = ZmqSource::connect(&specs, &args.topic)?;
    let replay_timeout = Duration::from_millis(args.replay_timeout_ms.max(1));
    let sequencers: Vec<(Sequencer, String)> = specs
        .iter()
        .zip(subjects.iter().zip(&last))
        .map(|(spec, (subj, seq))| {
            let mut q = Sequencer::new(spec.label.clone(), args.max_pending_batches.max(1), replay_timeout);
            match seq {
                Some(s) => {
                    log::info!("{}: {subj} holds up to batch {s}; continuing after it", spec.label);
                    q.resume_after(*s);
                }
                None => log::info!("{}: {subj} holds nothing yet", spec.label),
            }
            (q, subj.clone())
        })
        .collect();
    let mut relay = Streams { sequencers, specs, source, out: Vec::new(), counters: counters.clone(), epoch: 0 };
    // Catch up now: what the engine sent while no relay ran (or before this one started).
    for i in 0..relay.specs.len() {
        relay.with(i, |q, sink| q.replay_now(Instant::now(), sink));
    }
    log::info!("relaying {} streams to NATS stream {} at {}", relay.specs.len(), settings.stream, settings.url);

    let mut reported = Instant::now();
    let mut resynced: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        if resync.wanted.load(Ordering::Relaxed) && resynced.is_none_or(|t| t.elapsed() >= RESYNC_INTERVAL) {
            resynced = Some(Instant::now());
            // From here the publisher drops what is on its way: the replay carries it.
            relay.epoch += 1;
            resync.epoch.store(relay.epoch, Ordering::Relaxed);
            resync.wanted.store(false, Ordering::Relaxed);
            match rt.block_on(async {
                let stream = super::ensure_stream(&js, &settings).await?;
                Ok::<_, String>(stored_up_to(&stream, &subjects).await)
            }) {
                Ok(last) => {
                    counters.resyncs.fetch_add(1, Ordering::Relaxed);
                    log::warn!("resync: the stream {} is there; asking the engines for what it lacks", settings.stream);
                    let now = Instant::now();
                    for (i, seq) in last.into_iter().enumerate() {
                        relay.with(i, |q, sink| {
                            q.restart_after(seq, sink);
                            q.replay_now(now, sink);
                        });
                    }
                }
                Err(e) => {
                    log::warn!("resync: {e}; trying again");
                    resync.wanted.store(true, Ordering::Relaxed);
                }
            }
        }
        for (i, arrival) in relay.source.poll(POLL_INTERVAL) {
            let now = Instant::now();
            relay.with(i, |q, sink| match arrival {
                Arrival::Live(s, payload) => q.live(s, payload, now, sink),
                Arrival::Replay(reply) => q.replay_reply(reply, now, sink),
                Arrival::ReplayFailed => q.replay_failed(now, sink),
                Arrival::Malformed(what) => {
                    sink.counters.frames_bad.fetch_add(1, Ordering::Relaxed);
                    if q.should_log() {
                        log::warn!("{}: dropped a {what} (problem #{})", q.label(), q.problems());
                    }
                }
            });
        }
        let now = Instant::now();
        for i in 0..relay.specs.len() {
            relay.with(i, |q, sink| q.tick(now, sink));
        }
        // Blocks while the publisher is 64 turns behind: the engines' publishers then
        // buffer (past their high-water mark they drop: a gap, replayed).
        if !relay.out.is_empty() && tx.blocking_send(std::mem::take(&mut relay.out)).is_err() {
            return Err("the publisher task has ended".into());
        }
        if reported.elapsed() >= Duration::from_secs(10) {
            reported = Instant::now();
            log::info!("{}", counters.line());
        }
    }
    // Everything taken from the engine is published before the process ends.
    drop(tx);
    let _ = rt.block_on(publisher);
    log::info!("stopped: {}", counters.line());
    Ok(())
}

impl Counters {
    fn line(&self) -> String {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "published {} (duplicates dropped by the stream {}, failed {}), gaps {}, replays ok {} failed {}, bad frames {}, \
             resyncs {}",
            g(&self.published),
            g(&self.duplicates),
            g(&self.failed),
            g(&self.gaps),
            g(&self.replays_ok),
            g(&self.replays_failed),
            g(&self.frames_bad),
            g(&self.resyncs)
        )
    }
}

/// The last batch the stream holds for each subject (`None`: nothing, a new worker or a
/// new stream, or history past the stream's limits).
async fn stored_up_to(stream: &async_nats::jetstream::stream::Stream, subjects: &[String]) -> Vec<Option<u64>> {
    let mut last = Vec::with_capacity(subjects.len());
    for subj in subjects {
        last.push(stream.get_last_raw_message_by_subject(subj).await.ok().and_then(|m| seq_of(Some(&m.headers))));
    }
    last
}

/// Publishes in arrival order, many in flight; acknowledgements are awaited in order by a
/// second task, so a slow ack never holds up the next publish.
async fn publish(
    js: async_nats::jetstream::Context,
    mut rx: mpsc::Receiver<Vec<Outgoing>>,
    counters: Arc<Counters>,
    resync: Arc<Resync>,
) {
    type Ack = (u64, u64, async_nats::jetstream::context::PublishAckFuture);
    let (ack_tx, mut ack_rx) = mpsc::channel::<Vec<Ack>>(64);
    let acks = {
        let (counters, resync) = (counters.clone(), resync.clone());
        tokio::spawn(async move {
            while let Some(turn) = ack_rx.recv().await {
                for (seq, epoch, ack) in turn {
                    match ack.await {
                        Ok(a) if a.duplicate => _ = counters.duplicates.fetch_add(1, Ordering::Relaxed),
                        Ok(_) => _ = counters.published.fetch_add(1, Ordering::Relaxed),
                        Err(e) => failed(&counters, &resync, seq, epoch, &e),
                    }
                }
            }
        })
    };
    while let Some(turn) = rx.recv().await {
        let mut pending = Vec::with_capacity(turn.len());
        for m in turn {
            if m.epoch != resync.epoch.load(Ordering::Relaxed) {
                continue; // made before a resync, whose replay carries it
            }
            let msg = async_nats::jetstream::message::PublishMessage::build()
                .payload(m.payload.into())
                .message_id(&m.id)
                .header(SEQ_HEADER, m.seq.to_string().as_str());
            match js.send_publish(m.subject, msg).await {
                Ok(ack) => pending.push((m.seq, m.epoch, ack)),
                Err(e) => failed(&counters, &resync, m.seq, m.epoch, &e),
            }
        }
        if ack_tx.send(pending).await.is_err() {
            break;
        }
    }
    drop(ack_tx);
    let _ = acks.await;
}

/// A batch JetStream did not take. The stream gone or silent: a resync (once per epoch)
/// publishes it again. Refused (too large, say): the sidecars will see its gap and clear
/// that rank.
fn failed(
    counters: &Counters,
    resync: &Resync,
    seq: u64,
    epoch: u64,
    e: &async_nats::jetstream::context::PublishError,
) {
    use async_nats::jetstream::context::PublishErrorKind as Kind;
    let n = counters.failed.fetch_add(1, Ordering::Relaxed) + 1;
    let again = matches!(e.kind(), Kind::StreamNotFound | Kind::TimedOut | Kind::BrokenPipe);
    if again && epoch == resync.epoch.load(Ordering::Relaxed) {
        resync.wanted.store(true, Ordering::Relaxed);
    }
    if n.is_power_of_two() {
        let then = if again { "the relay resyncs" } else { "readers will clear at the gap" };
        log::error!("batch {seq} not stored: {e}; {then} (#{n})");
    }
}

/// The relay's streams: their sequencers (each with its subject), the ZMQ source, and the
/// turn's batches on their way to the publisher.
struct Streams {
    sequencers: Vec<(Sequencer, String)>,
    specs: Vec<StreamSpec>,
    source: ZmqSource,
    out: Vec<Outgoing>,
    counters: Arc<Counters>,
    /// The resync epoch this turn's batches belong to.
    epoch: u64,
}

impl Streams {
    /// Runs `f` on stream `i`'s sequencer with its sink (nothing if there is no such stream).
    fn with(&mut self, i: usize, f: impl FnOnce(&mut Sequencer, &mut RelaySink<'_>)) {
        let Some((q, subject)) = self.sequencers.get_mut(i) else { return };
        let mut sink = RelaySink {
            out: &mut self.out,
            subject,
            spec: &self.specs[i],
            stream: i,
            source: &mut self.source,
            counters: &self.counters,
            epoch: self.epoch,
        };
        f(q, &mut sink);
    }
}

/// A stream's [`Sink`] in the relay: applying a batch is publishing it.
struct RelaySink<'a> {
    /// This turn's batches, published together after it.
    out: &'a mut Vec<Outgoing>,
    subject: &'a str,
    spec: &'a StreamSpec,
    stream: usize,
    source: &'a mut ZmqSource,
    counters: &'a Counters,
    epoch: u64,
}

impl Sink for RelaySink<'_> {
    fn apply(&mut self, seq: u64, payload: &[u8]) -> Result<(), String> {
        self.out.push(Outgoing {
            subject: self.subject.to_string(),
            id: msg_id(&self.spec.worker_id, self.spec.rank as u32, seq, payload),
            seq,
            payload: payload.to_vec(),
            epoch: self.epoch,
        });
        Ok(())
    }

    fn reset(&mut self, reason: ResetReason) {
        // Nothing to clear here: readers see the same jump and clear themselves.
        log::info!("{}: passing on a {reason:?}", self.spec.label);
    }

    fn request_replay(&mut self, from: u64) -> bool {
        self.source.request_replay(self.stream, from)
    }

    fn end_replay(&mut self) {
        self.source.end_replay(self.stream);
    }

    fn count(&mut self, what: Count) {
        let c = match what {
            Count::Gap => &self.counters.gaps,
            Count::ReplayOk => &self.counters.replays_ok,
            Count::ReplayFailed => &self.counters.replays_failed,
            // The relay does not decode, nor restore checkpoints; a duplicate is not sent on.
            Count::BadBatch | Count::RestoreVerified | Count::Duplicate => return,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}
