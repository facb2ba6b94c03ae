//! The sidecar's side of the NATS transport: an [`ingest::Source`] whose streams are
//! JetStream subjects, one ordered consumer each, read from the stream's first message.
//!
//! Replays are the stream's, not the engine's: a sidecar that starts reads the history
//! the stream keeps, then follows it live. The stream itself has no gaps the engine could
//! fill (the relay repairs its own from the engine before publishing), so a gap a sidecar
//! sees is one every reader sees; `request_replay` answers no, the sequencer clears the
//! worker's rank and rebuilds, and every sidecar does the same: they stay equal.

use super::{seq_of, subject, NatsSettings};
use crate::ingest::{Arrival, Source, StreamSpec};
use async_nats::jetstream::consumer::{pull, DeliverPolicy};
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::mpsc;

/// Messages taken per poll, all streams together: bounds one turn of the ingest loop.
const MAX_PER_POLL: usize = 4096;
/// Buffered between the consumers and the ingest thread; a full buffer makes the
/// consumers wait (JetStream keeps the rest), so nothing is dropped.
const CHANNEL: usize = 16384;

pub struct NatsSource {
    rt: tokio::runtime::Runtime,
    stream: async_nats::jetstream::stream::Stream,
    prefix: String,
    tx: mpsc::Sender<(u64, Arrival)>,
    rx: mpsc::Receiver<(u64, Arrival)>,
    /// Stream position → consumer id (ids are never reused, so a message of a stream that
    /// has left is recognised and dropped).
    ids: Vec<u64>,
    tasks: HashMap<u64, tokio::task::JoinHandle<()>>,
    next_id: u64,
}

impl NatsSource {
    /// Connects, makes sure the stream exists, and starts a consumer per stream.
    pub fn connect(settings: &NatsSettings, specs: &[StreamSpec]) -> Result<NatsSource, String> {
        let (rt, _js, stream) = super::open(settings)?;
        let (tx, rx) = mpsc::channel(CHANNEL);
        let mut source = NatsSource {
            rt,
            stream,
            prefix: settings.subject_prefix.clone(),
            tx,
            rx,
            ids: Vec::new(),
            tasks: HashMap::new(),
            next_id: 0,
        };
        for spec in specs {
            source.add_stream(spec)?;
        }
        Ok(source)
    }
}

impl Source for NatsSource {
    fn poll(&mut self, timeout: Duration) -> Vec<(usize, Arrival)> {
        let mut got = Vec::new();
        let rx = &mut self.rx;
        if let Ok(Some(first)) = self.rt.block_on(async { tokio::time::timeout(timeout, rx.recv()).await }) {
            got.push(first);
            while got.len() < MAX_PER_POLL {
                match self.rx.try_recv() {
                    Ok(m) => got.push(m),
                    Err(_) => break,
                }
            }
        }
        got.into_iter().filter_map(|(id, a)| Some((self.ids.iter().position(|&i| i == id)?, a))).collect()
    }

    fn request_replay(&mut self, _stream: usize, _from: u64) -> bool {
        false // the stream is the replay: everything it has was read in order
    }

    fn end_replay(&mut self, _stream: usize) {}

    fn add_stream(&mut self, spec: &StreamSpec) -> Result<(), String> {
        let id = self.next_id;
        self.next_id += 1;
        let subject = subject(&self.prefix, &spec.worker_id, spec.rank as u32);
        let task = self.rt.spawn(consume(self.stream.clone(), subject, spec.label.clone(), id, self.tx.clone()));
        self.ids.push(id);
        self.tasks.insert(id, task);
        Ok(())
    }

    fn remove_stream(&mut self, stream: usize) {
        if stream < self.ids.len() {
            let id = self.ids.remove(stream);
            if let Some(t) = self.tasks.remove(&id) {
                t.abort();
            }
        }
    }
}

impl Drop for NatsSource {
    fn drop(&mut self) {
        for t in self.tasks.values() {
            t.abort();
        }
    }
}

/// One subject, in order, from the stream's first message, for as long as the stream is
/// kept. A consumer that fails (the server restarted, the connection dropped longer than
/// the ordered consumer's own recovery) is made again from the message after the last
/// one read, so nothing is read twice or skipped. A stream made anew meanwhile (a server
/// that kept it in memory restarted, or someone deleted it; a relay then creates it again)
/// numbers its messages afresh: that one is read from its first message, since resuming
/// at the old position could skip batches this sidecar never saw.
async fn consume(
    stream: async_nats::jetstream::stream::Stream,
    subject: String,
    label: String,
    id: u64,
    tx: mpsc::Sender<(u64, Arrival)>,
) {
    use futures_util::StreamExt;
    let mut next: u64 = 0; // the stream sequence to start at; 0: from the first
    let mut created = stream.cached_info().created;
    let mut backoff = Duration::from_millis(200);
    let mut failures: u64 = 0;
    loop {
        if next > 0 {
            if let Ok(info) = stream.get_info().await {
                if info.created != created {
                    log::warn!("{label}: stream made anew since sequence {next}; reading {subject} from its start");
                    (created, next) = (info.created, 0);
                }
            }
        }
        let config = pull::OrderedConfig {
            filter_subject: subject.clone(),
            deliver_policy: if next == 0 {
                DeliverPolicy::All
            } else {
                DeliverPolicy::ByStartSequence { start_sequence: next }
            },
            ..Default::default()
        };
        let messages = match stream.create_consumer(config).await {
            Ok(c) => c.messages().await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let mut messages = match messages {
            Ok(m) => m,
            Err(e) => {
                failures += 1;
                if failures.is_power_of_two() {
                    log::warn!("{label}: nats consumer on {subject}: {e}; retrying (#{failures})");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        log::info!("{label}: consuming {subject} from stream sequence {}", next.max(1));
        while let Some(m) = messages.next().await {
            let m = match m {
                Ok(m) => m,
                Err(e) => {
                    failures += 1;
                    if failures.is_power_of_two() {
                        log::warn!("{label}: nats consumer on {subject}: {e}; resuming (#{failures})");
                    }
                    break;
                }
            };
            backoff = Duration::from_millis(200);
            if let Ok(info) = m.info() {
                next = info.stream_sequence + 1;
            }
            let arrival = match seq_of(m.headers.as_ref()) {
                Some(seq) => Arrival::Live(seq, m.payload.to_vec()),
                None => Arrival::Malformed("NATS message without a Kvroute-Seq header"),
            };
            if tx.send((id, arrival)).await.is_err() {
                return; // the source is gone
            }
        }
        tokio::time::sleep(backoff).await;
    }
}
