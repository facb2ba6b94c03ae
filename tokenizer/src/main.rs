//! kvroute-tokenizer: Envoy's ext_proc gRPC service on `grpc_listen`, `/tokenize` and
//! `/metrics` on `http_listen`. Exits with status 2 on a bad configuration.

use clap::Parser;
use kvroute_tokenizer::config::{Cli, Config};
use kvroute_tokenizer::extproc::handler::StageProcessor;
use kvroute_tokenizer::extproc::server::ExternalProcessorServer;
use kvroute_tokenizer::http;
use kvroute_tokenizer::pool;
use kvroute_tokenizer::stage::Stage;
use kvroute_tokenizer::stats::Stats;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Semaphore;

// HF tokenizers allocates and frees per pre-token: under glibc malloc that was about half
// of a first-sighting tokenization's time, under mimalloc a small share (README, "Cost").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    // Microseconds: a request's debug line can then be placed among a burst's.
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_timestamp_micros()
        .init();
    no_huge_pages();
    let cli = Cli::parse();
    let config = match Config::load(&cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvroute-tokenizer: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(config) {
        eprintln!("kvroute-tokenizer: {e}");
        std::process::exit(1);
    }
}

/// Opts the process out of transparent huge pages. Where the kernel gives them on every
/// fault (`enabled: always`), a request that first touches a 2 MiB range waits while the
/// kernel zeroes a whole huge page: 15–100 ms on a two-core VM, in the stage's own
/// tokenizations (docs/benchmarks.md, "The stage's stalls on new memory"), whenever an
/// allocation grows into new memory, as a cache table does. Small pages spread that cost.
/// Databases advise the same for their latency (Redis, MongoDB).
fn no_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes an integer flag and touches no memory of ours.
    if unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) } != 0 {
        log::warn!("transparent huge pages not turned off: {}", std::io::Error::last_os_error());
    }
}

fn run(config: Config) -> Result<(), String> {
    let t = Instant::now();
    let stage = Arc::new(Stage::new(&config.models, config.trust_request_chat_template, config.any_model_name)?);
    for m in stage.models() {
        log::info!("model {}: max_model_len {}, LoRA adapters {:?}", m.name, m.max_model_len, m.loras);
    }
    log::info!("tokenizers loaded in {:.2} s", t.elapsed().as_secs_f64());
    let stats = Arc::new(Stats::default());
    // The ext_proc permits, and two for /tokenize.
    let threads = config.max_concurrency.max(1) + 2;
    let rt = pool::runtime(threads).map_err(|e| format!("tokio runtime: {e}"))?;
    rt.block_on(async move {
        let t = Instant::now();
        let warmed = pool::warm(stage.clone(), threads).await;
        if warmed < threads {
            log::warn!(
                "only {warmed} of {threads} tokenizing threads started at once; later requests may start the rest"
            );
        }
        log::info!("{warmed} tokenizing threads warmed in {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
        let processor = StageProcessor {
            stage: stage.clone(),
            stats: stats.clone(),
            headers: config.headers.clone(),
            trust_client_tokens: config.trust_client_tokens,
            max_body_bytes: config.max_body_bytes,
            limiter: Arc::new(Semaphore::new(config.max_concurrency)),
        };
        // A buffered body arrives whole in one message: allow it, and a little for framing.
        let grpc = ExternalProcessorServer::new(Arc::new(processor), config.max_body_bytes + 64 * 1024);
        let grpc_listener = tokio::net::TcpListener::bind(config.grpc_listen)
            .await
            .map_err(|e| format!("grpc_listen {}: {e}", config.grpc_listen))?;
        let http_listener = tokio::net::TcpListener::bind(config.http_listen)
            .await
            .map_err(|e| format!("http_listen {}: {e}", config.http_listen))?;
        log::info!("ext_proc on {}, /tokenize and /metrics on {}", config.grpc_listen, config.http_listen);
        if !config.self_check.is_empty() {
            let model = if config.any_model_name { None } else { stage.models().first().map(|m| m.name.clone()) };
            let (stage, urls, stats) = (stage.clone(), config.self_check.clone(), stats.clone());
            tokio::spawn(kvroute_tokenizer::selfcheck::run(stage, urls, model, stats));
        }
        let app = Arc::new(http::App { stage, stats, max_body_bytes: config.max_body_bytes });
        tokio::spawn(kvroute_serve::serve_http1(http_listener, move |req| http::handle(app.clone(), req)));
        // Each answer is one small frame: without TCP_NODELAY it waits out Envoy's delayed
        // ACK (Nagle), ~40 ms per request (tonic sets it only on listeners it binds itself).
        let incoming =
            tokio_stream::StreamExt::map(tokio_stream::wrappers::TcpListenerStream::new(grpc_listener), |s| {
                s.inspect(|s| {
                    if let Err(e) = s.set_nodelay(true) {
                        log::warn!("ext_proc connection: TCP_NODELAY: {e}");
                    }
                })
            });
        tonic::transport::Server::builder()
            .add_service(grpc)
            .serve_with_incoming_shutdown(incoming, kvroute_serve::shutdown_signal())
            .await
            .map_err(|e| format!("ext_proc server: {e}"))?;
        log::info!("stopped");
        Ok(())
    })
}
