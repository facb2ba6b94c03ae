//! NATS JetStream as the KV-event transport (`kv_event_transport = "nats"`): what the relay
//! beside each engine ([`relay`]) and the gateways' sidecars ([`source`]) agree on.
//!
//! Every engine batch is one JetStream message on `{subject_prefix}.{worker}.{rank}`, its
//! payload the engine's msgpack bytes unchanged, its engine sequence number in the
//! `Kvroute-Seq` header, and a `Nats-Msg-Id` of worker, rank, sequence and payload hash, so
//! that a relay that restarts and replays from the engine publishes nothing twice (within
//! the stream's duplicate window). The stream is the history: a sidecar that starts (or
//! restarts) reads it from its first message and converges to the same index as every
//! other reader of it; the engine's own replay buffer is only the relay's business.

pub mod relay;
pub mod source;

use async_nats::jetstream;
use std::time::Duration;

/// The engine's sequence number of the batch, decimal.
pub const SEQ_HEADER: &str = "Kvroute-Seq";

/// Stream name, subjects and limits, validated. The limits apply when the stream is
/// created (by the first relay or sidecar to start); an existing stream keeps its own
/// (change them with `nats stream edit`), and a mismatch is logged.
#[derive(Debug, Clone, PartialEq)]
pub struct NatsSettings {
    pub url: String,
    pub stream: String,
    pub subject_prefix: String,
    /// Messages older than this are dropped (0: kept until another limit drops them).
    pub max_age: Duration,
    /// The stream's size bound; the oldest messages go first.
    pub max_bytes: i64,
    /// Per (worker, rank) subject; -1: unbounded.
    pub max_msgs_per_subject: i64,
    /// How long a message id is remembered for deduplication.
    pub duplicate_window: Duration,
    pub replicas: usize,
    /// Where the server keeps the stream: `File` (the default: it survives a server
    /// restart) or `Memory` (a shorter event-path tail; a lone server's restart loses it).
    pub storage: jetstream::stream::StorageType,
}

pub const DEFAULT_URL: &str = "nats://127.0.0.1:4222";
pub const DEFAULT_STREAM: &str = "KVROUTE_EVENTS";
pub const DEFAULT_SUBJECT_PREFIX: &str = "kvroute.events";

/// The settings as a file or flags give them; `None` takes the default.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct NatsKeys {
    pub url: Option<String>,
    pub stream: Option<String>,
    pub subject_prefix: Option<String>,
    pub max_age_s: Option<u64>,
    pub max_bytes: Option<i64>,
    pub max_msgs_per_subject: Option<i64>,
    pub duplicate_window_s: Option<u64>,
    pub replicas: Option<usize>,
    pub storage: Option<String>,
}

impl NatsKeys {
    /// Validated settings; Err names the key (`nats_…`).
    pub fn settings(&self) -> Result<NatsSettings, String> {
        let url = self.url.clone().unwrap_or_else(|| DEFAULT_URL.into());
        for u in url.split(',') {
            if !(u.starts_with("nats://") || u.starts_with("tls://")) || u.parse::<async_nats::ServerAddr>().is_err() {
                return Err(format!("nats_url: `{u}` must be nats://host:port (several: comma-separated)"));
            }
        }
        let stream = self.stream.clone().unwrap_or_else(|| DEFAULT_STREAM.into());
        if stream.is_empty()
            || stream.len() > 64
            || !stream.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(format!("nats_stream: `{stream}` must be 1-64 of A-Z a-z 0-9 _ -"));
        }
        let subject_prefix = self.subject_prefix.clone().unwrap_or_else(|| DEFAULT_SUBJECT_PREFIX.into());
        if subject_prefix.split('.').any(|t| !valid_token(t)) {
            return Err(format!(
                "nats_subject_prefix: `{subject_prefix}` must be dot-separated tokens without spaces or wildcards"
            ));
        }
        let max_bytes = self.max_bytes.unwrap_or(1 << 30);
        if max_bytes < 1 << 20 {
            return Err(format!("nats_max_bytes: {max_bytes} is below 1 MiB"));
        }
        let max_msgs_per_subject = self.max_msgs_per_subject.unwrap_or(-1);
        if max_msgs_per_subject == 0 || max_msgs_per_subject < -1 {
            return Err(format!("nats_max_msgs_per_subject: {max_msgs_per_subject} (positive, or -1 for no limit)"));
        }
        let duplicate_window = Duration::from_secs(self.duplicate_window_s.unwrap_or(120));
        if duplicate_window.is_zero() {
            return Err("nats_duplicate_window_s: must be at least 1".into());
        }
        let max_age = Duration::from_secs(self.max_age_s.unwrap_or(24 * 3600));
        if !max_age.is_zero() && max_age < duplicate_window {
            return Err("nats_max_age_s: must not be shorter than nats_duplicate_window_s".into());
        }
        let replicas = self.replicas.unwrap_or(1);
        if !(1..=5).contains(&replicas) {
            return Err(format!("nats_replicas: {replicas} is not in 1..=5"));
        }
        let storage = match self.storage.as_deref().unwrap_or("file") {
            "file" => jetstream::stream::StorageType::File,
            "memory" => jetstream::stream::StorageType::Memory,
            other => return Err(format!("nats_storage: `{other}` is not one of file, memory")),
        };
        Ok(NatsSettings {
            url,
            stream,
            subject_prefix,
            max_age,
            max_bytes,
            max_msgs_per_subject,
            duplicate_window,
            replicas,
            storage,
        })
    }
}

/// One subject token: not empty, no whitespace, wildcard or separator.
pub(crate) fn valid_token(t: &str) -> bool {
    !t.is_empty() && !t.contains(|c: char| c.is_whitespace() || c == '*' || c == '>' || c == '.')
}

/// The subject of one worker's DP rank. A worker id (`ip:port`, `[v6]:port`) is made one
/// subject token by a substitution that cannot map two ids to one token: `.` → `_`,
/// `:` → `-`, brackets dropped (an IPv6 address has no `.` but a mapped IPv4 tail, and
/// the port is always last).
pub fn subject(prefix: &str, worker_id: &str, rank: u32) -> String {
    let token: String = worker_id
        .chars()
        .filter_map(|c| match c {
            '.' => Some('_'),
            ':' => Some('-'),
            '[' | ']' => None,
            c => Some(c),
        })
        .collect();
    format!("{prefix}.{token}.{rank}")
}

/// Names one batch for JetStream's deduplication. The payload's hash is part of it
/// because an engine that restarts counts from 0 again: its new batch 0 must not be taken
/// for the old one (vLLM's batches carry their timestamp, so two are never equal).
pub fn msg_id(worker_id: &str, rank: u32, seq: u64, payload: &[u8]) -> String {
    format!("{worker_id}/{rank}/{seq}/{:016x}", xxhash_rust::xxh3::xxh3_64(payload))
}

pub async fn connect(settings: &NatsSettings) -> Result<(async_nats::Client, jetstream::Context), String> {
    let client = async_nats::ConnectOptions::new()
        .name("kvroute")
        // Keep trying forever: a NATS outage must not end the process.
        .max_reconnects(None)
        .retry_on_initial_connect()
        .connect(settings.url.split(',').collect::<Vec<_>>())
        .await
        .map_err(|e| format!("nats {}: {e}", settings.url))?;
    let js = jetstream::new(client.clone());
    Ok((client, js))
}

/// A runtime for the NATS client (one thread beside the caller's, which stays synchronous),
/// connected, with the stream made sure of: what the relay and the sidecar's source share.
pub fn open(
    settings: &NatsSettings,
) -> Result<(tokio::runtime::Runtime, jetstream::Context, jetstream::stream::Stream), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("nats")
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let (js, stream) = rt.block_on(async {
        let (_client, js) = connect(settings).await?;
        let stream = ensure_stream(&js, settings).await?;
        Ok::<_, String>((js, stream))
    })?;
    Ok((rt, js, stream))
}

/// The stream, created with `settings` if it does not exist.
pub async fn ensure_stream(js: &jetstream::Context, s: &NatsSettings) -> Result<jetstream::stream::Stream, String> {
    let config = jetstream::stream::Config {
        name: s.stream.clone(),
        subjects: vec![format!("{}.>", s.subject_prefix)],
        max_age: s.max_age,
        max_bytes: s.max_bytes,
        max_messages_per_subject: s.max_msgs_per_subject,
        duplicate_window: s.duplicate_window,
        num_replicas: s.replicas,
        storage: s.storage,
        ..Default::default()
    };
    let mut stream = js.get_or_create_stream(config).await.map_err(|e| format!("stream {}: {e}", s.stream))?;
    let info = stream.info().await.map_err(|e| format!("stream {}: {e}", s.stream))?;
    let want = format!("{}.>", s.subject_prefix);
    if !info.config.subjects.iter().any(|x| x == &want || x == ">") {
        return Err(format!(
            "stream {} takes subjects {:?}, not {want}: set nats_subject_prefix to match, or use another nats_stream",
            s.stream, info.config.subjects
        ));
    }
    if info.config.storage != s.storage {
        log::warn!(
            "stream {} exists with {:?} storage, not the {:?} configured; it stays so (a stream's storage cannot \
             change: delete it, or use another nats_stream)",
            s.stream,
            info.config.storage,
            s.storage
        );
    }
    if info.config.max_age != s.max_age || info.config.max_bytes != s.max_bytes {
        log::info!(
            "stream {} exists with its own limits (max_age {:?}, max_bytes {}); those apply",
            s.stream,
            info.config.max_age,
            info.config.max_bytes
        );
    }
    Ok(stream)
}

/// A batch's engine sequence number from its headers.
pub fn seq_of(headers: Option<&async_nats::HeaderMap>) -> Option<u64> {
    headers?.get(SEQ_HEADER)?.as_str().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_one_token_per_worker_and_never_collide() {
        assert_eq!(subject("kvroute.events", "10.0.0.11:8000", 0), "kvroute.events.10_0_0_11-8000.0");
        assert_eq!(subject("kv", "[fd00::5]:8000", 3), "kv.fd00--5-8000.3");
        let ids = ["[fd00::5]:8000", "[fd00::5:80]:0", "[::ffff:1.2.3.4]:80", "1.2.3.4:80", "[fd00::]:58000"];
        let subjects: std::collections::HashSet<_> = ids.iter().map(|i| subject("p", i, 0)).collect();
        assert_eq!(subjects.len(), ids.len());
        for s in &subjects {
            assert!(s.split('.').all(valid_token), "{s}");
        }
    }

    #[test]
    fn a_restarted_engine_batch_is_not_a_duplicate() {
        assert_eq!(msg_id("w:1", 0, 5, b"a"), msg_id("w:1", 0, 5, b"a"));
        assert_ne!(msg_id("w:1", 0, 0, b"[1.0,[]]"), msg_id("w:1", 0, 0, b"[2.0,[]]"));
        assert_ne!(msg_id("w:1", 0, 5, b"a"), msg_id("w:1", 1, 5, b"a"));
    }

    #[test]
    fn settings_are_validated() {
        let s = NatsKeys::default().settings().unwrap();
        assert!(NatsKeys { url: Some("nats://a:4222,nats://b:4222".into()), ..Default::default() }.settings().is_ok());
        assert_eq!((s.stream.as_str(), s.subject_prefix.as_str()), (DEFAULT_STREAM, DEFAULT_SUBJECT_PREFIX));
        assert_eq!((s.max_bytes, s.max_msgs_per_subject, s.replicas), (1 << 30, -1, 1));
        assert_eq!(s.storage, jetstream::stream::StorageType::File);
        let memory = NatsKeys { storage: Some("memory".into()), ..Default::default() }.settings().unwrap();
        assert_eq!(memory.storage, jetstream::stream::StorageType::Memory);
        for (keys, says) in [
            (NatsKeys { url: Some("http://x:4222".into()), ..Default::default() }, "nats_url"),
            (NatsKeys { url: Some("nats://a:4222,nats://b:x".into()), ..Default::default() }, "nats_url"),
            (NatsKeys { stream: Some("a.b".into()), ..Default::default() }, "nats_stream"),
            (NatsKeys { subject_prefix: Some("a.*".into()), ..Default::default() }, "nats_subject_prefix"),
            (NatsKeys { subject_prefix: Some("a..b".into()), ..Default::default() }, "nats_subject_prefix"),
            (NatsKeys { max_bytes: Some(10), ..Default::default() }, "nats_max_bytes"),
            (NatsKeys { max_msgs_per_subject: Some(0), ..Default::default() }, "nats_max_msgs_per_subject"),
            (NatsKeys { max_age_s: Some(10), ..Default::default() }, "nats_max_age_s"),
            (NatsKeys { replicas: Some(0), ..Default::default() }, "nats_replicas"),
            (NatsKeys { storage: Some("ram".into()), ..Default::default() }, "nats_storage"),
        ] {
            assert!(keys.settings().unwrap_err().contains(says), "{keys:?}");
        }
    }
}
