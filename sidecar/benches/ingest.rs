//! Ingest benchmark: KV-event payloads (encoded by msgspec, as vLLM/SGLang send them)
//! decoded and applied to the fleet index on one core; then memory per cached block, and
//! what a checkpoint of it costs.
//!
//!     cargo bench -p kvroute-sidecar --bench ingest [-- vllm-0.33|vllm-0.22|sglang-0.5.22|…]
//!
//! (any form of `tests/integration/kvevents.py`). Decode + index goes through
//! `Fleet::apply_payload`, the ingest thread's path: events applied as they decode.
//!
//! The payload file is made once by `sidecar/benches/make_events.py` (1M blocks, 16
//! workers) and kept under `target/`.

use kvroute_sidecar::config::{Cli, Config};
use kvroute_sidecar::events::decode_batch;
use kvroute_sidecar::fleet::Fleet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

const BLOCKS: usize = 1_000_000;

fn payloads(form: &str) -> Vec<(usize, Vec<u8>)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let path = root.join("target").join(format!("bench-events-{form}-{BLOCKS}.bin"));
    if !path.exists() {
        let ok = Command::new("python3")
            .arg(root.join("sidecar/benches/make_events.py"))
            .arg(&path)
            .arg(form)
            .arg(BLOCKS.to_string())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "make_events.py failed (pip install msgspec pyzmq)");
    }
    let bytes = std::fs::read(&path).expect("read payloads");
    let mut out = Vec::new();
    let mut pos = 0;
    while pos + 8 <= bytes.len() {
        let w = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
        let n = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().unwrap()) as usize;
        out.push((w, bytes[pos + 8..pos + 8 + n].to_vec()));
        pos += 8 + n;
    }
    out
}

fn fleet() -> Fleet {
    let mut toml = String::new();
    for i in 0..16 {
        toml += &format!("[[workers]]\nid = \"10.0.0.{i}:8000\"\nevents = \"tcp://10.0.0.{i}:5557\"\n");
    }
    Fleet::new(&Config::from_toml(&toml, &Cli::default()).expect("config"), 1)
}

fn main() {
    let form = std::env::args().skip(1).find(|a| !a.starts_with('-')).unwrap_or_else(|| "vllm-0.33".into());
    let payloads = payloads(&form);
    let payload_bytes: usize = payloads.iter().map(|p| p.1.len()).sum();

    // Decode only.
    let t = Instant::now();
    let mut blocks = 0usize;
    for (_, p) in &payloads {
        let b = decode_batch(p).expect("decodes");
        blocks += b
            .events
            .iter()
            .map(|e| match e {
                kvroute_sidecar::events::Event::Stored(s) => s.block_hashes.len(),
                _ => 0,
            })
            .sum::<usize>();
    }
    let decode_s = t.elapsed().as_secs_f64();

    // Decode + apply (hash the tokens, index, change log), best of 3 fresh runs.
    let mut best = f64::MAX;
    let mut last = None;
    for _ in 0..3 {
        let mut f = fleet();
        let now = Instant::now();
        let t = Instant::now();
        for (seq, (w, p)) in payloads.iter().enumerate() {
            // A static fleet: each worker's key is its position.
            f.apply_payload(*w as u32, 0, seq as u64, p, now, 0.0).expect("decodes");
        }
        best = best.min(t.elapsed().as_secs_f64());
        last = Some(f);
    }
    let f = last.expect("ran");
    let held: usize = f.workers.iter().map(|w| w.cache.block_count()).sum();
    let heap: usize = f.workers.iter().map(|w| w.cache.heap_bytes()).sum();
    assert_eq!(held, blocks, "every stored block is held");

    println!(
        "form {form}: {} batches, {blocks} blocks, {:.1} payload bytes/block",
        payloads.len(),
        payload_bytes as f64 / blocks as f64
    );
    println!("decode only:          {:>10.0} blocks/s", blocks as f64 / decode_s);
    println!("decode + index:       {:>10.0} blocks/s  (target >= 1,000,000)", blocks as f64 / best);
    println!("index memory:         {:>10.1} bytes per (worker, block)  (target <= 100)", heap as f64 / held as f64);
    println!("change log:           {:>10} blocks kept for deltas", f.log_blocks());

    // A checkpoint of the whole fleet (state_file): encoding holds the fleet's lock, so its
    // time is how long ingest and the feed wait once per checkpoint_interval_ms.
    let t = Instant::now();
    let file = f.checkpoint();
    let encode_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut g = fleet();
    g.load_checkpoint(&file).expect("loads");
    for key in 0..16 {
        g.restore_worker(key);
    }
    let restore_s = t.elapsed().as_secs_f64();
    assert_eq!(g.workers.iter().map(|w| w.cache.block_count()).sum::<usize>(), held, "all restored");
    println!(
        "checkpoint:           {:>10.1} bytes per (worker, block); encoded in {:.0} ms (fleet locked), restored in {:.0} ms",
        file.len() as f64 / held as f64,
        encode_s * 1e3,
        restore_s * 1e3
    );

    // Memory depends on where a worker's table sizes fall between hashbrown's doublings:
    // one worker's cache filled to 10k, 15k, … 100k blocks.
    let batches: Vec<_> = payloads.iter().map(|(_, p)| decode_batch(p).expect("decodes")).collect();
    let mut samples = Vec::new();
    for target in (10_000..=100_000).step_by(5_000) {
        let mut c = kvroute_sidecar::cache::WorkerCache::new(1);
        let mut out = Vec::new();
        'fill: for b in &batches {
            for e in &b.events {
                if let kvroute_sidecar::events::Event::Stored(s) = e {
                    c.apply_stored(0, s, 16, &mut out);
                    out.clear();
                    if c.block_count() >= target {
                        break 'fill;
                    }
                }
            }
        }
        samples.push(c.heap_bytes() as f64 / c.block_count() as f64);
    }
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    let (min, max) = samples.iter().fold((f64::MAX, 0f64), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    println!("one worker, 10k..100k blocks: {min:.1} / {mean:.1} / {max:.1} bytes per block (min / mean / max)");
}
