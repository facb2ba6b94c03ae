//! `kvroute-fleet`: the simulated fleet. `kvroute-fleet worker --help` for a mock engine.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kvroute-fleet", version, about = "Simulated vLLM fleet for kvroute: mock engines and load")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// A mock engine: vLLM's OpenAI API, a paged prefix cache, vLLM's KV events.
    Worker(kvroute_fleet::worker::WorkerArgs),
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-fleet: tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Worker(args) => kvroute_fleet::worker::run(args).await,
        }
    });
    if let Err(e) = result {
        eprintln!("kvroute-fleet: {e}");
        std::process::exit(2);
    }
}
