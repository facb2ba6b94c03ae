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
    /// Send a workload through the gateway and measure it (JSON result).
    Load(kvroute_fleet::load::LoadArgs),
    /// An SVG of time-to-first-token CDFs from load results (one line per result file).
    Plot {
        /// Result files written by `load --json`.
        results: Vec<String>,
        #[arg(long, default_value = "ttft.svg")]
        out: String,
        #[arg(long, default_value = "Time to first token")]
        title: String,
    },
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
            Command::Load(args) => {
                let json_out = args.json.clone();
                let result = kvroute_fleet::load::run(args).await?;
                let mut summary = result.clone();
                if let Some(o) = summary.as_object_mut() {
                    o.remove("samples");
                }
                println!("{}", serde_json::to_string_pretty(&summary).unwrap_or_default());
                if let Some(path) = json_out {
                    std::fs::write(&path, result.to_string()).map_err(|e| format!("{path}: {e}"))?;
                }
                Ok(())
            }
            Command::Plot { results, out, title } => plot(&results, &out, &title),
        }
    });
    if let Err(e) = result {
        eprintln!("kvroute-fleet: {e}");
        std::process::exit(2);
    }
}

fn plot(results: &[String], out: &str, title: &str) -> Result<(), String> {
    let mut series = Vec::new();
    for path in results {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
        let label = v.get("label").and_then(|l| l.as_str()).unwrap_or(path).to_string();
        let ttft: Vec<f64> = v
            .get("samples")
            .and_then(|s| s.as_array())
            .map(|a| {
                a.iter()
                    .filter(|s| s.get("ok").and_then(|o| o.as_bool()) == Some(true))
                    .filter_map(|s| s.get("ttft_ms").and_then(|t| t.as_f64()))
                    .collect()
            })
            .unwrap_or_default();
        series.push((label, ttft));
    }
    std::fs::write(out, kvroute_fleet::plot::cdf_svg(title, &series)).map_err(|e| format!("{out}: {e}"))
}
