//! Configuration: a TOML file and command-line flags, validated once into [`Config`].
//! Anything wrong is an error naming the field; the sidecar refuses to start with it.
//! Reference: `sidecar/README.md`; example: `sidecar/sidecar.example.toml`.

use clap::Parser;
use kvroute::role::Role;
use serde::Deserialize;
use std::net::SocketAddr;
use std::time::Duration;

#[derive(Parser, Debug, Default)]
#[command(name = "kvroute-sidecar", version, about = "Mirrors vLLM/SGLang KV-cache events into the kvroute feed")]
pub struct Cli {
    /// TOML configuration file; flags override its settings and add workers.
    #[arg(long)]
    pub config: Option<String>,
    /// Tokens per KV block; must equal the engines' --block-size / --page-size (or divide it).
    #[arg(long)]
    pub block_size: Option<u32>,
    /// How workers publish KV events (only `zmq`).
    #[arg(long)]
    pub kv_event_transport: Option<String>,
    /// Address to serve the feed, admin and metrics on (default 127.0.0.1:9100).
    #[arg(long)]
    pub listen: Option<String>,
    /// A worker: `ID=EVENTS[,replay=ENDPOINT][,role=both|prefill|decode][,dp=N]`, where ID is
    /// the `ip:port` Envoy routes to and EVENTS its ZMQ publisher, e.g.
    /// `10.0.0.5:8000=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558`. Repeatable.
    #[arg(long = "worker")]
    pub workers: Vec<String>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    block_size: Option<u32>,
    kv_event_transport: Option<String>,
    listen: Option<String>,
    topic: Option<String>,
    health_path: Option<String>,
    health_interval_ms: Option<u64>,
    silent_after_ms: Option<u64>,
    replay_timeout_ms: Option<u64>,
    max_pending_batches: Option<usize>,
    log_max_blocks: Option<usize>,
    snapshot_page_blocks: Option<usize>,
    #[serde(default)]
    workers: Vec<FileWorker>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct FileWorker {
    id: String,
    events: String,
    replay: Option<String>,
    role: Option<String>,
    dp_ranks: Option<u32>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    /// `ip:port` exactly as Envoy's `workers` cluster lists the host.
    pub id: String,
    /// ZMQ endpoint of DP rank 0's publisher; rank r publishes on port + r.
    pub events: String,
    /// ZMQ endpoint of rank 0's replay ROUTER, if the engine has one.
    pub replay: Option<String>,
    pub role: Role,
    pub dp_ranks: u32,
}

impl WorkerConfig {
    /// The publisher endpoint of DP rank `rank` (vLLM offsets the port by the rank).
    pub fn events_for(&self, rank: u32) -> String {
        offset_port(&self.events, rank)
    }
    pub fn replay_for(&self, rank: u32) -> Option<String> {
        self.replay.as_deref().map(|e| offset_port(e, rank))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub block_size: u32,
    pub listen: SocketAddr,
    /// ZMQ subscription prefix (the engines' `topic`, default empty = everything).
    pub topic: String,
    /// HTTP path probed on each worker (`http://{id}{path}`) while its publisher is silent;
    /// `None` disables probing.
    pub health_path: Option<String>,
    pub health_interval: Duration,
    /// A publisher silent this long has its worker probed; a failed probe marks it down.
    pub silent_after: Duration,
    pub replay_timeout: Duration,
    /// Live batches held per stream while a replay runs; beyond this the replay is abandoned.
    pub max_pending_batches: usize,
    pub log_max_blocks: usize,
    pub snapshot_page_blocks: usize,
    pub workers: Vec<WorkerConfig>,
}

pub const MAX_WORKERS: usize = kvroute::feed::MAX_WORKERS;
const MAX_DP_RANKS: u32 = 64;

impl Config {
    pub fn load(cli: &Cli) -> Result<Config, String> {
        Self::from_parts(kvroute_serve::read_toml(cli.config.as_deref())?, cli)
    }

    /// From TOML text and flags (tests use this).
    pub fn from_toml(text: &str, cli: &Cli) -> Result<Config, String> {
        Self::from_parts(kvroute_serve::parse_toml(text)?, cli)
    }

    fn from_parts(file: FileConfig, cli: &Cli) -> Result<Config, String> {
        let transport = cli.kv_event_transport.clone().or(file.kv_event_transport).unwrap_or_else(|| "zmq".into());
        if transport != "zmq" {
            return Err(format!("kv_event_transport: `{transport}` is not supported (only `zmq`)"));
        }
        let block_size = cli.block_size.or(file.block_size).unwrap_or(kvroute::hash::DEFAULT_BLOCK_SIZE as u32);
        if block_size == 0 {
            return Err("block_size: must be at least 1".into());
        }
        let listen_s = cli.listen.clone().or(file.listen).unwrap_or_else(|| "127.0.0.1:9100".into());
        let listen = listen_s.parse().map_err(|_| format!("listen: `{listen_s}` is not an ip:port address"))?;
        let health_path = match file.health_path.as_deref() {
            None => Some("/health".to_string()),
            Some("") => None,
            Some(p) if p.starts_with('/') => Some(p.to_string()),
            Some(p) => return Err(format!("health_path: `{p}` must start with `/` (or be empty to disable)")),
        };
        let ms = |v: Option<u64>, default: u64, name: &str| -> Result<Duration, String> {
            match v.unwrap_or(default) {
                0 => Err(format!("{name}: must be at least 1")),
                n => Ok(Duration::from_millis(n)),
            }
        };
        let count = |v: Option<usize>, default: usize, name: &str| -> Result<usize, String> {
            match v.unwrap_or(default) {
                0 => Err(format!("{name}: must be at least 1")),
                n => Ok(n),
            }
        };

        let mut workers = Vec::new();
        for (i, w) in file.workers.into_iter().enumerate() {
            workers.push(worker(&format!("workers[{i}]"), w)?);
        }
        for (i, spec) in cli.workers.iter().enumerate() {
            workers.push(worker(&format!("--worker #{}", i + 1), parse_worker_flag(spec)?)?);
        }
        if workers.is_empty() {
            return Err("workers: none configured (use [[workers]] in the file or --worker)".into());
        }
        if workers.len() > MAX_WORKERS {
            return Err(format!("workers: {} configured, at most {MAX_WORKERS}", workers.len()));
        }
        for (i, w) in workers.iter().enumerate() {
            if workers[..i].iter().any(|o| o.id == w.id) {
                return Err(format!("workers: id `{}` appears twice", w.id));
            }
        }
        Ok(Config {
            block_size,
            listen,
            topic: file.topic.unwrap_or_default(),
            health_path,
            health_interval: ms(file.health_interval_ms, 1000, "health_interval_ms")?,
            silent_after: ms(file.silent_after_ms, 5000, "silent_after_ms")?,
            replay_timeout: ms(file.replay_timeout_ms, 2000, "replay_timeout_ms")?,
            max_pending_batches: count(file.max_pending_batches, 100_000, "max_pending_batches")?,
            log_max_blocks: count(file.log_max_blocks, 4_000_000, "log_max_blocks")?,
            // Each page is one callback on Envoy's main thread (decode + stage): 250k blocks
            // kept the longest admin wait of a 6.4M-entry resync at 0.1–0.25 s, against
            // 0.3–0.5 s with 1M (docs/benchmarks.md).
            snapshot_page_blocks: count(file.snapshot_page_blocks, 250_000, "snapshot_page_blocks")?,
            workers,
        })
    }
}

fn parse_worker_flag(spec: &str) -> Result<FileWorker, String> {
    let bad = |why: &str| format!("--worker `{spec}`: {why}");
    let (head, rest) = spec.split_once(',').unwrap_or((spec, ""));
    let (id, events) = head.split_once('=').ok_or_else(|| bad("expected ID=EVENTS_ENDPOINT"))?;
    let mut w = FileWorker { id: id.to_string(), events: events.to_string(), ..FileWorker::default() };
    for kv in rest.split(',').filter(|s| !s.is_empty()) {
        match kv.split_once('=') {
            Some(("replay", v)) => w.replay = Some(v.to_string()),
            Some(("role", v)) => w.role = Some(v.to_string()),
            Some(("dp", v)) => w.dp_ranks = Some(v.parse().map_err(|_| bad("dp must be a number"))?),
            _ => return Err(bad(&format!("unknown option `{kv}` (replay=, role=, dp=)"))),
        }
    }
    Ok(w)
}

fn worker(field: &str, w: FileWorker) -> Result<WorkerConfig, String> {
    if w.id.is_empty() || w.id.len() > 255 || w.id.parse::<SocketAddr>().is_err() {
        return Err(format!(
            "{field}.id: `{}` must be the ip:port Envoy routes to (e.g. 10.0.0.5:8000, [fd00::5]:8000)",
            w.id
        ));
    }
    let dp_ranks = w.dp_ranks.unwrap_or(1);
    if !(1..=MAX_DP_RANKS).contains(&dp_ranks) {
        return Err(format!("{field}.dp_ranks: {dp_ranks} is not in 1..={MAX_DP_RANKS}"));
    }
    endpoint(&format!("{field}.events"), &w.events, dp_ranks)?;
    if let Some(r) = &w.replay {
        endpoint(&format!("{field}.replay"), r, dp_ranks)?;
    }
    let role = match w.role.as_deref().unwrap_or("both") {
        "both" => Role::Both,
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        other => return Err(format!("{field}.role: `{other}` is not one of both, prefill, decode")),
    };
    Ok(WorkerConfig { id: w.id, events: w.events, replay: w.replay, role, dp_ranks })
}

fn endpoint(field: &str, ep: &str, dp_ranks: u32) -> Result<(), String> {
    if let Some(addr) = ep.strip_prefix("tcp://") {
        let port = addr.rsplit_once(':').and_then(|(host, p)| (!host.is_empty()).then_some(p));
        match port.and_then(|p| p.parse::<u16>().ok()) {
            Some(p) if u32::from(p) + dp_ranks - 1 <= u32::from(u16::MAX) => Ok(()),
            Some(_) => Err(format!("{field}: `{ep}`: port + dp_ranks exceeds 65535")),
            None => Err(format!("{field}: `{ep}` must be tcp://host:port")),
        }
    } else if ep.starts_with("ipc://") && ep.len() > 6 {
        Ok(())
    } else {
        Err(format!("{field}: `{ep}` must be tcp://host:port or ipc://path"))
    }
}

/// vLLM's rule: DP rank r of a TCP endpoint listens on port + r; IPC paths get `_dp{r}`.
fn offset_port(ep: &str, rank: u32) -> String {
    if rank == 0 {
        return ep.to_string();
    }
    if ep.starts_with("tcp://") {
        if let Some((base, port)) = ep.rsplit_once(':') {
            if let Ok(p) = port.parse::<u32>() {
                return format!("{base}:{}", p + rank);
            }
        }
    }
    format!("{ep}_dp{rank}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
block_size = 16
listen = "127.0.0.1:9100"
[[workers]]
id = "127.0.0.1:8101"
events = "tcp://127.0.0.1:5557"
replay = "tcp://127.0.0.1:5558"
role = "prefill"
dp_ranks = 2
"#;

    #[test]
    fn file_and_flags_combine() {
        let cli = Cli {
            block_size: Some(32),
            workers: vec!["127.0.0.1:8102=tcp://127.0.0.1:6557,role=decode".into()],
            ..Cli::default()
        };
        let c = Config::from_toml(GOOD, &cli).unwrap();
        assert_eq!(c.block_size, 32);
        assert_eq!(c.workers.len(), 2);
        assert_eq!(c.workers[0].role, Role::Prefill);
        assert_eq!(c.workers[0].events_for(1), "tcp://127.0.0.1:5558");
        assert_eq!(c.workers[0].replay_for(1).as_deref(), Some("tcp://127.0.0.1:5559"));
        assert_eq!(c.workers[1].role, Role::Decode);
        assert_eq!(c.health_path.as_deref(), Some("/health"));
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            ("block_size = 0\n[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:1\"", "block_size"),
            ("[[workers]]\nid=\"host-without-port\"\nevents=\"tcp://a:1\"", "workers[0].id"),
            ("[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"udp://a:1\"", "workers[0].events"),
            ("[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:1\"\nrole=\"boss\"", "workers[0].role"),
            ("[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:65535\"\ndp_ranks=2", "workers[0].events"),
            ("[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:1\"\ncolour=1", "colour"),
            ("kv_event_transport = \"nats\"", "kv_event_transport"),
            ("", "workers"),
            (
                "[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:1\"\n[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:2\"",
                "appears twice",
            ),
        ];
        for (text, field) in cases {
            let err = Config::from_toml(text, &Cli::default()).unwrap_err();
            assert!(err.contains(field), "{text:?} → {err}");
        }
        let cli = Cli { workers: vec!["1.2.3.4:1=tcp://a:1,colour=red".into()], ..Cli::default() };
        assert!(Config::from_toml("", &cli).unwrap_err().contains("--worker"));
    }
}
