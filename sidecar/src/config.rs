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
#[command(args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// TOML configuration file; flags override its settings and add workers.
    #[arg(long)]
    pub config: Option<String>,
    /// Tokens per KV block; must equal the engines' --block-size / --page-size (or divide it).
    #[arg(long)]
    pub block_size: Option<u32>,
    /// How KV events arrive: `zmq` (from each engine) or `nats` (from a JetStream stream
    /// that `kvroute-sidecar relay` fills beside each engine).
    #[arg(long)]
    pub kv_event_transport: Option<String>,
    /// NATS server(s) for `--kv-event-transport nats` (default nats://127.0.0.1:4222).
    #[arg(long)]
    pub nats_url: Option<String>,
    /// Address to serve the feed, admin and metrics on (default 127.0.0.1:9100).
    #[arg(long)]
    pub listen: Option<String>,
    /// File to keep the caches in across restarts (ZMQ transport); none by default.
    #[arg(long)]
    pub state_file: Option<String>,
    /// A worker: `ID=EVENTS[,replay=ENDPOINT][,role=both|prefill|decode][,dp=N]`, where ID is
    /// the `ip:port` Envoy routes to and EVENTS its ZMQ publisher, e.g.
    /// `10.0.0.5:8000=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558`. Repeatable.
    #[arg(long = "worker")]
    pub workers: Vec<String>,
    /// Where the worker list comes from: `static` (the configured workers), `dns` or `etcd`.
    #[arg(long)]
    pub discovery_backend: Option<String>,
    /// etcd client endpoint (`http://host:2379`), for `--discovery-backend etcd`. Repeatable.
    #[arg(long = "etcd-endpoint")]
    pub etcd_endpoints: Vec<String>,
    /// Key prefix workers register under (default `/kvroute/workers/`).
    #[arg(long)]
    pub etcd_prefix: Option<String>,
    /// The name `--discovery-backend dns` resolves (A/AAAA), e.g. a headless service.
    #[arg(long)]
    pub dns_name: Option<String>,
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Registers one engine in etcd under a lease and keeps the lease alive until stopped
    /// (SIGTERM/SIGINT revoke it: the worker leaves at once).
    Register(crate::discovery::register::RegisterArgs),
    /// Reads one host's engines' ZMQ KV events and publishes them, in order and complete,
    /// to the NATS JetStream stream the sidecars read (`--kv-event-transport nats`).
    Relay(crate::nats::relay::RelayArgs),
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
    state_file: Option<String>,
    checkpoint_interval_ms: Option<u64>,
    discovery_backend: Option<String>,
    #[serde(default)]
    etcd_endpoints: Vec<String>,
    etcd_prefix: Option<String>,
    etcd_model: Option<String>,
    dns_name: Option<String>,
    dns_http_port: Option<u16>,
    dns_events_port: Option<u16>,
    dns_replay_port: Option<u16>,
    dns_role: Option<String>,
    dns_dp_ranks: Option<u32>,
    dns_interval_ms: Option<u64>,
    nats_url: Option<String>,
    nats_stream: Option<String>,
    nats_subject_prefix: Option<String>,
    nats_max_age_s: Option<u64>,
    nats_max_bytes: Option<i64>,
    nats_max_msgs_per_subject: Option<i64>,
    nats_duplicate_window_s: Option<u64>,
    nats_replicas: Option<usize>,
    nats_storage: Option<String>,
    load_exchange: Option<String>,
    load_exchange_subject: Option<String>,
    peer_load_ttl_ms: Option<u64>,
    #[serde(default)]
    workers: Vec<FileWorker>,
}

/// A worker as written by hand or registered in discovery, before validation.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileWorker {
    pub id: String,
    pub events: String,
    pub replay: Option<String>,
    pub role: Option<String>,
    pub dp_ranks: Option<u32>,
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
    /// Where the caches are checkpointed (`crate::checkpoint`); `None`: not kept.
    pub state_file: Option<std::path::PathBuf>,
    pub checkpoint_interval: Duration,
    /// The workers of `Discovery::Static`; empty with any other backend.
    pub workers: Vec<WorkerConfig>,
    pub discovery: Discovery,
    pub transport: Transport,
    /// How gateway load reports reach the other sidecars (`crate::peerload`); `None`: only
    /// the gateways that report to this sidecar see each other's.
    pub load_exchange: Option<LoadExchange>,
    /// A gateway's report counts for this long after it arrived.
    pub peer_load_ttl: Duration,
}

/// Load reports published on, and read from, a NATS core subject (not JetStream: only the
/// latest report of each gateway matters, and a lost one is replaced within an interval).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadExchange {
    pub url: String,
    pub subject: String,
}

/// How KV events reach the sidecar.
#[derive(Debug, Clone, PartialEq)]
pub enum Transport {
    /// A SUB socket per engine publisher (and its replay socket).
    Zmq,
    /// A JetStream stream (`crate::nats`); the workers' ZMQ endpoints are the relays'.
    Nats(crate::nats::NatsSettings),
}

/// Where the worker list comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum Discovery {
    /// `workers` as configured, for the process's life.
    Static,
    Dns(DnsDiscovery),
    Etcd(EtcdDiscovery),
}

/// A name resolved to A/AAAA records every `interval`; each address is one worker, its
/// endpoints made from the ports below.
#[derive(Debug, Clone, PartialEq)]
pub struct DnsDiscovery {
    pub name: String,
    pub http_port: u16,
    pub events_port: u16,
    pub replay_port: Option<u16>,
    pub role: Role,
    pub dp_ranks: u32,
    pub interval: Duration,
}

/// Workers registered under `prefix` in etcd (one key each, under a lease), watched.
#[derive(Debug, Clone, PartialEq)]
pub struct EtcdDiscovery {
    pub endpoints: Vec<String>,
    pub prefix: String,
    /// Only registrations naming this model are workers (others are left alone).
    pub model: Option<String>,
}

pub const DEFAULT_ETCD_PREFIX: &str = "/kvroute/workers/";

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
        let discovery = discovery(&file, cli)?;
        let transport = transport(&file, cli)?;
        let load_exchange = load_exchange(&file, &transport)?;
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

        let state_file = match cli.state_file.clone().or(file.state_file) {
            None => None,
            Some(p) if p.is_empty() => return Err("state_file: empty (leave it out to keep no state)".into()),
            Some(_) if transport != Transport::Zmq => {
                return Err("state_file: only for the zmq transport (a NATS stream keeps the history itself)".into())
            }
            Some(p) => Some(std::path::PathBuf::from(p)),
        };
        if file.checkpoint_interval_ms.is_some() && state_file.is_none() {
            return Err("checkpoint_interval_ms: set, but no state_file to write".into());
        }
        let mut workers = Vec::new();
        for (i, w) in file.workers.into_iter().enumerate() {
            workers.push(worker(&format!("workers[{i}]"), w)?);
        }
        for (i, spec) in cli.workers.iter().enumerate() {
            workers.push(worker(&format!("--worker #{}", i + 1), parse_worker_flag(spec)?)?);
        }
        match (&discovery, workers.is_empty()) {
            (Discovery::Static, true) => {
                return Err("workers: none configured (use [[workers]] in the file or --worker)".into())
            }
            (Discovery::Dns(_) | Discovery::Etcd(_), false) => {
                return Err("workers: configured workers and a discovery backend both name the fleet; use one \
                     (discovery_backend = \"static\" for a fixed list)"
                    .into())
            }
            _ => {}
        }
        if workers.len() > MAX_WORKERS {
            return Err(format!("workers: {} configured, at most {MAX_WORKERS}", workers.len()));
        }
        for (i, w) in workers.iter().enumerate() {
            if workers[..i].iter().any(|o| o.id == w.id) {
                return Err(format!("workers: id `{}` appears twice", w.id));
            }
        }
        let peer_load_ttl = match file.peer_load_ttl_ms.unwrap_or(1000) {
            n @ 100..=60_000 => Duration::from_millis(n),
            n => return Err(format!("peer_load_ttl_ms: {n} is not in 100..=60000")),
        };
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
            state_file,
            checkpoint_interval: ms(file.checkpoint_interval_ms, 5000, "checkpoint_interval_ms")?,
            workers,
            discovery,
            transport,
            load_exchange,
            peer_load_ttl,
        })
    }
}

/// `load_exchange`: `nats` (the default with the NATS transport, on its server) or `none`.
fn load_exchange(file: &FileConfig, transport: &Transport) -> Result<Option<LoadExchange>, String> {
    let default = match transport {
        Transport::Nats(_) => "nats",
        Transport::Zmq => "none",
    };
    let subject = file.load_exchange_subject.clone().unwrap_or_else(|| "kvroute.load".into());
    match (file.load_exchange.as_deref().unwrap_or(default), transport) {
        ("none", _) if file.load_exchange_subject.is_some() => {
            Err("load_exchange_subject: set, but load_exchange is `none`".into())
        }
        ("none", _) => Ok(None),
        ("nats", Transport::Nats(n)) => {
            let tokens_ok = subject.split('.').all(crate::nats::valid_token);
            let in_stream = subject == n.subject_prefix || subject.starts_with(&format!("{}.", n.subject_prefix));
            if !tokens_ok || in_stream {
                return Err(format!(
                    "load_exchange_subject: `{subject}` must be a subject without wildcards, outside the event \
                     stream's `{}.>`",
                    n.subject_prefix
                ));
            }
            Ok(Some(LoadExchange { url: n.url.clone(), subject }))
        }
        ("nats", Transport::Zmq) => Err("load_exchange: `nats` needs kv_event_transport = \"nats\"".into()),
        (other, _) => Err(format!("load_exchange: `{other}` is not one of nats, none")),
    }
}

fn transport(file: &FileConfig, cli: &Cli) -> Result<Transport, String> {
    let name = cli.kv_event_transport.clone().or(file.kv_event_transport.clone()).unwrap_or_else(|| "zmq".into());
    let keys = crate::nats::NatsKeys {
        url: cli.nats_url.clone().or(file.nats_url.clone()),
        stream: file.nats_stream.clone(),
        subject_prefix: file.nats_subject_prefix.clone(),
        max_age_s: file.nats_max_age_s,
        max_bytes: file.nats_max_bytes,
        max_msgs_per_subject: file.nats_max_msgs_per_subject,
        duplicate_window_s: file.nats_duplicate_window_s,
        replicas: file.nats_replicas,
        storage: file.nats_storage.clone(),
    };
    let nats_set = keys != crate::nats::NatsKeys::default();
    match name.as_str() {
        "zmq" if nats_set => Err("nats_*: set, but kv_event_transport is `zmq` (use `nats`)".into()),
        "zmq" => Ok(Transport::Zmq),
        "nats" => Ok(Transport::Nats(keys.settings()?)),
        other => Err(format!("kv_event_transport: `{other}` is not one of zmq, nats")),
    }
}

fn discovery(file: &FileConfig, cli: &Cli) -> Result<Discovery, String> {
    let backend = cli.discovery_backend.clone().or(file.discovery_backend.clone()).unwrap_or_else(|| "static".into());
    let etcd_set = !file.etcd_endpoints.is_empty()
        || !cli.etcd_endpoints.is_empty()
        || file.etcd_prefix.is_some()
        || cli.etcd_prefix.is_some()
        || file.etcd_model.is_some();
    let dns_set = file.dns_name.is_some()
        || cli.dns_name.is_some()
        || file.dns_http_port.is_some()
        || file.dns_events_port.is_some()
        || file.dns_replay_port.is_some()
        || file.dns_role.is_some()
        || file.dns_dp_ranks.is_some()
        || file.dns_interval_ms.is_some();
    // Settings of a backend that is not in use are a mistake, not something to ignore.
    if etcd_set && backend != "etcd" {
        return Err(format!("etcd_*: set, but discovery_backend is `{backend}` (use `etcd`)"));
    }
    if dns_set && backend != "dns" {
        return Err(format!("dns_*: set, but discovery_backend is `{backend}` (use `dns`)"));
    }
    match backend.as_str() {
        "static" => Ok(Discovery::Static),
        "etcd" => {
            let mut endpoints = file.etcd_endpoints.clone();
            endpoints.extend(cli.etcd_endpoints.iter().cloned());
            if endpoints.is_empty() {
                return Err("etcd_endpoints: none (use --etcd-endpoint http://host:2379)".into());
            }
            for e in &endpoints {
                etcd_endpoint(e)?;
            }
            let prefix =
                cli.etcd_prefix.clone().or(file.etcd_prefix.clone()).unwrap_or_else(|| DEFAULT_ETCD_PREFIX.into());
            if prefix.is_empty() {
                return Err("etcd_prefix: must not be empty (every key of the cluster would be a worker)".into());
            }
            Ok(Discovery::Etcd(EtcdDiscovery { endpoints, prefix, model: file.etcd_model.clone() }))
        }
        "dns" => {
            let name = cli.dns_name.clone().or(file.dns_name.clone()).unwrap_or_default();
            if name.is_empty() || name.len() > 253 || name.contains(|c: char| c.is_whitespace() || c == ':' || c == '/')
            {
                return Err(format!("dns_name: `{name}` must be a host name (e.g. vllm.default.svc.cluster.local)"));
            }
            let dp_ranks = file.dns_dp_ranks.unwrap_or(1);
            if !(1..=MAX_DP_RANKS).contains(&dp_ranks) {
                return Err(format!("dns_dp_ranks: {dp_ranks} is not in 1..={MAX_DP_RANKS}"));
            }
            let port = |v: Option<u16>, default: u16, field: &str| match v.unwrap_or(default) {
                0 => Err(format!("{field}: must be a port in 1..=65535")),
                p if u32::from(p) + dp_ranks - 1 > u32::from(u16::MAX) => {
                    Err(format!("{field}: {p} + dns_dp_ranks exceeds 65535"))
                }
                p => Ok(p),
            };
            let interval = match file.dns_interval_ms.unwrap_or(1000) {
                0 => return Err("dns_interval_ms: must be at least 1".into()),
                n => Duration::from_millis(n),
            };
            Ok(Discovery::Dns(DnsDiscovery {
                name,
                http_port: port(file.dns_http_port, 8000, "dns_http_port")?,
                events_port: port(file.dns_events_port, 5557, "dns_events_port")?,
                replay_port: file.dns_replay_port.map(|p| port(Some(p), p, "dns_replay_port")).transpose()?,
                role: role("dns_role", file.dns_role.as_deref())?,
                dp_ranks,
                interval,
            }))
        }
        other => Err(format!("discovery_backend: `{other}` is not one of static, dns, etcd")),
    }
}

/// An etcd client URL: `http://host:port` (TLS is not supported yet).
fn etcd_endpoint(e: &str) -> Result<(), String> {
    let rest = e.strip_prefix("http://").unwrap_or(e);
    let ok = !rest.contains('/')
        && rest.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
    if ok {
        Ok(())
    } else {
        Err(format!("etcd_endpoints: `{e}` must be http://host:port"))
    }
}

fn role(field: &str, v: Option<&str>) -> Result<Role, String> {
    match v.unwrap_or("both") {
        "both" => Ok(Role::Both),
        "prefill" => Ok(Role::Prefill),
        "decode" => Ok(Role::Decode),
        other => Err(format!("{field}: `{other}` is not one of both, prefill, decode")),
    }
}

pub(crate) fn parse_worker_flag(spec: &str) -> Result<FileWorker, String> {
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

/// Validates one worker (`field` names it in errors).
pub(crate) fn worker(field: &str, w: FileWorker) -> Result<WorkerConfig, String> {
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
    let role = role(&format!("{field}.role"), w.role.as_deref())?;
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

    #[test]
    fn the_example_configuration_loads() {
        let c = Config::from_toml(include_str!("../sidecar.example.toml"), &Cli::default()).unwrap();
        assert_eq!(c.workers.len(), 2);
        assert!(matches!(c.discovery, Discovery::Static));
    }

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
            ("kv_event_transport = \"kafka\"", "kv_event_transport"),
            ("nats_stream = \"S\"\n[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:1\"", "nats_*"),
            ("kv_event_transport = \"nats\"\nnats_replicas = 9\n[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:1\"", "nats_replicas"),
            ("kv_event_transport = \"nats\"\nstate_file = \"/tmp/s\"\n[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:1\"", "state_file"),
            ("state_file = \"\"\n[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:1\"", "state_file"),
            ("checkpoint_interval_ms = 100\n[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:1\"", "checkpoint_interval_ms"),
            ("state_file = \"/tmp/s\"\ncheckpoint_interval_ms = 0\n[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:1\"", "checkpoint_interval_ms"),
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

    #[test]
    fn the_nats_transport_takes_its_settings() {
        let text = "kv_event_transport = \"nats\"\nnats_stream = \"KV\"\nnats_max_age_s = 600\n\
                    [[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:1\"";
        let cli = Cli { nats_url: Some("nats://10.0.0.2:4222".into()), ..Cli::default() };
        let Transport::Nats(n) = Config::from_toml(text, &cli).unwrap().transport else { panic!("not nats") };
        assert_eq!((n.url.as_str(), n.stream.as_str(), n.max_age.as_secs()), ("nats://10.0.0.2:4222", "KV", 600));
    }

    #[test]
    fn load_reports_are_exchanged_over_nats_by_default_with_the_nats_transport() {
        let w = "[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:1\"";
        let cfg = |extra: &str| Config::from_toml(&format!("{extra}\n{w}"), &Cli::default());
        let nats = cfg("kv_event_transport = \"nats\"").unwrap();
        let want = LoadExchange { url: crate::nats::DEFAULT_URL.into(), subject: "kvroute.load".into() };
        assert_eq!((nats.load_exchange, nats.peer_load_ttl), (Some(want), Duration::from_secs(1)));
        assert_eq!(cfg("").unwrap().load_exchange, None);
        assert_eq!(cfg("kv_event_transport = \"nats\"\nload_exchange = \"none\"").unwrap().load_exchange, None);
        for (extra, needle) in [
            ("load_exchange = \"nats\"", "kv_event_transport"),
            ("load_exchange = \"gossip\"", "gossip"),
            ("load_exchange_subject = \"x\"", "load_exchange_subject"),
            ("kv_event_transport = \"nats\"\nload_exchange_subject = \"kvroute.events.load\"", "outside"),
            ("kv_event_transport = \"nats\"\nload_exchange_subject = \"a.*\"", "wildcards"),
            ("peer_load_ttl_ms = 50", "peer_load_ttl_ms"),
        ] {
            let e = cfg(extra).unwrap_err();
            assert!(e.contains(needle), "{extra}: {e}");
        }
    }

    #[test]
    fn discovery_backends_are_validated() {
        let etcd = Config::from_toml(
            "discovery_backend = \"etcd\"\netcd_endpoints = [\"http://127.0.0.1:2379\"]\netcd_model = \"m\"",
            &Cli { etcd_endpoints: vec!["10.0.0.1:2379".into()], ..Cli::default() },
        )
        .unwrap();
        assert!(etcd.workers.is_empty());
        assert!(matches!(&etcd.discovery, Discovery::Etcd(d)
            if d.endpoints.len() == 2 && d.prefix == DEFAULT_ETCD_PREFIX && d.model.as_deref() == Some("m")));
        let dns = Config::from_toml(
            "discovery_backend = \"dns\"\ndns_name = \"vllm.default.svc\"\ndns_replay_port = 5558\ndns_dp_ranks = 2",
            &Cli::default(),
        )
        .unwrap();
        assert!(matches!(&dns.discovery, Discovery::Dns(d)
            if d.http_port == 8000 && d.events_port == 5557 && d.replay_port == Some(5558) && d.dp_ranks == 2));
        let w = "[[workers]]\nid=\"1.2.3.4:1\"\nevents=\"tcp://a:1\"\n";
        let cases = [
            ("discovery_backend = \"consul\"", "discovery_backend"),
            ("discovery_backend = \"etcd\"", "etcd_endpoints"),
            ("discovery_backend = \"etcd\"\netcd_endpoints = [\"http://h:2379/x\"]", "etcd_endpoints"),
            ("discovery_backend = \"etcd\"\netcd_endpoints = [\"h:2379\"]\netcd_prefix = \"\"", "etcd_prefix"),
            ("discovery_backend = \"dns\"", "dns_name"),
            ("discovery_backend = \"dns\"\ndns_name = \"a b\"", "dns_name"),
            ("discovery_backend = \"dns\"\ndns_name = \"a\"\ndns_http_port = 0", "dns_http_port"),
            (
                "discovery_backend = \"dns\"\ndns_name = \"a\"\ndns_events_port = 65535\ndns_dp_ranks = 2",
                "dns_events_port",
            ),
            ("discovery_backend = \"dns\"\ndns_name = \"a\"\ndns_role = \"boss\"", "dns_role"),
            ("dns_name = \"a\"", "discovery_backend is `static`"),
            ("etcd_prefix = \"/x/\"", "discovery_backend is `static`"),
        ];
        for (text, field) in cases {
            let text = if text.contains("backend") { text.to_string() } else { format!("{text}\n{w}") };
            let err = Config::from_toml(&text, &Cli::default()).unwrap_err();
            assert!(err.contains(field), "{text:?} → {err}");
        }
        // A fleet named twice is refused.
        let both = format!("discovery_backend = \"dns\"\ndns_name = \"a\"\n{w}");
        assert!(Config::from_toml(&both, &Cli::default()).unwrap_err().contains("use one"));
    }
}
