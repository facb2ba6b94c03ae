//! `kvroute-sidecar`: subscribes to every worker's KV-cache events and serves the kvroute
//! feed (`docs/feed-protocol.md`) plus the admin API. Usage: `sidecar/README.md`.

use clap::Parser;
use kvroute_sidecar::{checkpoint, config, discovery, fleet, health, ingest, nats, peerload, server, zmq_source};
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let mut cli = config::Cli::parse();
    match cli.command.take() {
        Some(config::Command::Register(args)) => std::process::exit(discovery::register::main(args)),
        Some(config::Command::Relay(args)) => std::process::exit(nats::relay::main(args)),
        None => {}
    }
    let config = match config::Config::load(&cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvroute-sidecar: bad configuration: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(config) {
        eprintln!("kvroute-sidecar: {e}");
        std::process::exit(1);
    }
}

/// A random non-zero epoch: a restarted sidecar must look new to every client.
fn new_epoch() -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish().max(1)
}

/// The ingest loop over `source`, on its own thread, following discovery's worker lists.
fn start_ingest<S: ingest::Source + Send + 'static>(
    config: &config::Config,
    streams: &[ingest::StreamSpec],
    source: S,
    fleet: &Arc<Mutex<fleet::Fleet>>,
    membership: std::sync::mpsc::Receiver<Vec<config::WorkerConfig>>,
    stop: &Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<()>, String> {
    let mut ingest = ingest::Ingest::new(config, streams, source, fleet.clone());
    ingest.follow(membership);
    let stop = stop.clone();
    std::thread::Builder::new()
        .name("kv-ingest".into())
        .spawn(move || ingest.run(stop))
        .map_err(|e| format!("starting the ingest thread: {e}"))
}

fn run(config: config::Config) -> Result<(), String> {
    let started = Instant::now();
    let fleet = Arc::new(Mutex::new(fleet::Fleet::new(&config, new_epoch())));
    if let Some(path) = &config.state_file {
        read_checkpoint(path, &fleet);
    }
    let streams = ingest::streams(&config);
    let (membership_tx, membership_rx) = std::sync::mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let ingest_thread = match &config.transport {
        config::Transport::Zmq => {
            let source = zmq_source::ZmqSource::connect(&streams, &config.topic)?;
            start_ingest(&config, &streams, source, &fleet, membership_rx, &stop)?
        }
        config::Transport::Nats(settings) => {
            let source = nats::source::NatsSource::connect(settings, &streams)?;
            start_ingest(&config, &streams, source, &fleet, membership_rx, &stop)?
        }
    };

    let checkpoint_thread = match &config.state_file {
        Some(path) => {
            let (path, fleet, stop, every) = (path.clone(), fleet.clone(), stop.clone(), config.checkpoint_interval);
            let run = move || {
                let mut next = Instant::now() + every;
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(ingest::POLL_INTERVAL);
                    if Instant::now() >= next {
                        write_checkpoint(&path, &fleet);
                        next = Instant::now() + every;
                    }
                }
            };
            Some(
                std::thread::Builder::new()
                    .name("checkpoint".into())
                    .spawn(run)
                    .map_err(|e| format!("starting the checkpoint thread: {e}"))?,
            )
        }
        None => None,
    };

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let result = rt.block_on(async {
        let listener =
            tokio::net::TcpListener::bind(config.listen).await.map_err(|e| format!("listen {}: {e}", config.listen))?;
        log::info!("serving on {} ({} workers, block size {})", config.listen, config.workers.len(), config.block_size);
        let loads = Arc::new(Mutex::new(peerload::PeerLoads::new(config.peer_load_ttl)));
        let publisher = match &config.load_exchange {
            Some(exchange) => peerload::start_exchange(exchange, loads.clone()),
            None => peerload::Publisher::NONE,
        };
        let app = Arc::new(server::App { fleet: fleet.clone(), started, loads, publisher });
        tokio::spawn(health::run(config.clone(), fleet.clone(), started));
        {
            let (config, fleet) = (config.clone(), fleet.clone());
            tokio::spawn(async move { discovery::run(&config, fleet, membership_tx).await });
        }
        tokio::select! {
            _ = kvroute_serve::serve_http1(listener, move |req| server::handle(app.clone(), req)) => Ok(()),
            _ = kvroute_serve::shutdown_signal() => {
                log::info!("shutting down");
                Ok(())
            }
        }
    });
    stop.store(true, Ordering::Relaxed);
    let _ = ingest_thread.join();
    if let Some(t) = checkpoint_thread {
        let _ = t.join();
    }
    // The last one, of the state as ingest left it (after the thread's own last write).
    if let Some(path) = &config.state_file {
        write_checkpoint(path, &fleet);
    }
    result
}

/// Takes the checkpoint a previous run left (none yet is normal; a bad one is logged,
/// counted and ignored: the sidecar then starts empty, as without one).
fn read_checkpoint(path: &std::path::Path, fleet: &Mutex<fleet::Fleet>) {
    let loaded = match std::fs::read(path) {
        Ok(bytes) => fleet::lock(fleet).load_checkpoint(&bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            log::info!("no checkpoint at {} yet", path.display());
            return;
        }
        Err(e) => Err(e.to_string()),
    };
    match loaded {
        Ok(n) => log::info!("checkpoint {}: {n} workers' caches, restored as each joins", path.display()),
        Err(e) => {
            fleet::lock(fleet).stats.checkpoint_errors += 1;
            log::error!("checkpoint {} not used: {e}; starting empty", path.display());
        }
    }
}

/// Writes the fleet's checkpoint; the fleet is locked only while it is encoded.
fn write_checkpoint(path: &std::path::Path, fleet: &Mutex<fleet::Fleet>) {
    let bytes = fleet::lock(fleet).checkpoint();
    let result = checkpoint::write_file(path, &bytes);
    let mut f = fleet::lock(fleet);
    match result {
        Ok(()) => f.stats.checkpoints_written += 1,
        Err(e) => {
            f.stats.checkpoint_errors += 1;
            if f.stats.checkpoint_errors.is_power_of_two() {
                log::error!("checkpoint {}: {e} (#{})", path.display(), f.stats.checkpoint_errors);
            }
        }
    }
}
