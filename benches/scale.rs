//! Scale simulation: the filter's routing decision and the sync service's index, in
//! process (no sleeping, no Envoy), as the fleet grows — 8 → 1024 workers, 10k → 10M
//! cached (worker, block) entries. For each point: the time to load the index from a
//! snapshot and write it as shared data, the index's memory and the shared data's bytes,
//! and the mean cost of one routing decision + release for a 2k-token prompt that shares
//! most of its prefix with cached conversations.
//!
//!     cargo bench --bench scale                 # every point that fits in memory here
//!     cargo bench --bench scale -- --quick      # up to 1M entries
//!     cargo bench --bench scale -- --buckets 16384 --workers 8,1024 --entries 10000000

use kvroute::config::FilterConfig;
use kvroute::feed::{FeedBlock, FeedWorker, Frame, FrameKind, Op};
use kvroute::index::{publish, SyncIndex};
use kvroute::layout::DEFAULT_BUCKETS;
use kvroute::role::Role;
use kvroute::router::{Router, TokenSource};
use kvroute::store::MemStore;
use kvroute::tokens::{encode_base64, TokenEncoding};
use std::time::Instant;

const CHAIN_TOKENS: usize = 2048; // a cached conversation: 128 blocks
const PAGE: usize = 1_000_000;

fn tokens(chain: u64, n: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| 1000 + ((chain.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(40_503)) % 30_000) as u32)
        .collect()
}

struct Point {
    workers: usize,
    entries: usize,
    load_s: f64,
    index_mb: f64,
    shared_mb: f64,
    route_us: f64,
    reads: f64,
}

fn run(workers: usize, entries: usize, n_buckets: u32) -> Point {
    let chains = entries.div_ceil(CHAIN_TOKENS / 16);
    let feed_workers: Vec<FeedWorker> = (0..workers)
        .map(|i| FeedWorker {
            id: format!("10.{}.{}.{}:8000", i / 65536, (i / 256) % 256, i % 256),
            role: Role::Both,
            up: true,
        })
        .collect();
    // Conversation c is cached on worker c % workers.
    let mut pages: Vec<Vec<Op>> = vec![Vec::new()];
    let mut in_page = 0;
    for c in 0..chains as u64 {
        let blocks = FeedBlock::chain(&tokens(c, CHAIN_TOKENS), 16);
        if in_page + blocks.len() > PAGE {
            pages.push(Vec::new());
            in_page = 0;
        }
        in_page += blocks.len();
        if let Some(p) = pages.last_mut() {
            p.push(Op::Store { worker: (c % workers as u64) as u32, blocks });
        }
    }
    let n = pages.len();
    let t = Instant::now();
    let mut ix = SyncIndex::new(n_buckets);
    let store = MemStore::new();
    for (i, ops) in pages.into_iter().enumerate() {
        let frame = Frame {
            kind: if i == 0 { FrameKind::SnapshotStart } else { FrameKind::SnapshotMore },
            epoch: 1,
            from_version: 0,
            to_version: 1,
            next_cursor: if i + 1 < n { i as u64 + 1 } else { 0 },
            block_size: 16,
            workers: feed_workers.clone(),
            ops,
        };
        ix.apply(&frame).expect("snapshot page applies");
        ix.set_live(true);
        while publish(&mut ix, &store).more {}
    }
    let load_s = t.elapsed().as_secs_f64();

    // Requests: a cached conversation's first 1536 tokens, then 512 new ones.
    let mut router = Router::new(FilterConfig::from_json(br#"{"max_endpoints": 3}"#).expect("config"));
    let reqs: Vec<String> = (0..200u64)
        .map(|r| {
            let c = (r.wrapping_mul(7919)) % chains as u64;
            let mut p = tokens(c, 1536);
            p.extend(tokens(1 << 40 | r, 512));
            encode_base64(&p)
        })
        .collect();
    let (r0, _) = store.calls();
    let t = Instant::now();
    let rounds = 5;
    for round in 0..rounds {
        for (i, b64) in reqs.iter().enumerate() {
            let now = 10 + (round * reqs.len() + i) as u64;
            let d = router.route(
                &store,
                TokenSource::Header { value: b64.as_bytes(), encoding: TokenEncoding::Base64LeU32, namespace: 0 },
                now,
                now,
            );
            assert!(d.hits >= 96 || d.fallback.is_some(), "a cached prefix is found");
            router.release(&store, &d.held, now);
        }
    }
    let decisions = (rounds * reqs.len()) as f64;
    let route_us = t.elapsed().as_secs_f64() * 1e6 / decisions;
    let (r1, _) = store.calls();
    Point {
        workers,
        entries: chains * CHAIN_TOKENS / 16,
        load_s,
        index_mb: ix.heap_bytes() as f64 / 1048576.0,
        shared_mb: store.bytes() as f64 / 1048576.0,
        route_us,
        reads: (r1 - r0) as f64 / decisions,
    }
}

/// The value after `flag`, as a comma-separated list.
fn list_arg(flag: &str) -> Option<Vec<usize>> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == flag)?;
    let v = args.get(i + 1).unwrap_or_else(|| panic!("{flag} needs a value"));
    Some(v.split(',').map(|x| x.parse().unwrap_or_else(|_| panic!("{flag}: {x} is not a number"))).collect())
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let max = if quick { 1_000_000 } else { 10_000_000 };
    let n_buckets = list_arg("--buckets").map_or(DEFAULT_BUCKETS, |v| v[0] as u32);
    let fleet_sizes = list_arg("--workers").unwrap_or(vec![8, 64, 256, 1024]);
    let index_sizes = list_arg("--entries").unwrap_or(vec![10_000, 100_000, 1_000_000, 10_000_000]);
    println!("| workers | cached (worker, block) | load + publish | index MB | shared data MB | route + release | shared reads |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for &workers in &fleet_sizes {
        for &entries in &index_sizes {
            // About the most an entry can take: in the index a hash and up to two masks of
            // ceil(workers/64) words (the offloaded one only once some worker offloads), in
            // shared data one more mask. Skip points that would not fit this machine's memory.
            let est = entries as f64 * 8.0 * (1.0 + 3.0 * workers.div_ceil(64) as f64);
            if entries > max || est > 6e9 {
                continue;
            }
            let p = run(workers, entries, n_buckets);
            println!(
                "| {} | {} | {:.2} s | {:.0} | {:.0} | {:.1} µs | {:.1} |",
                p.workers, p.entries, p.load_s, p.index_mb, p.shared_mb, p.route_us, p.reads
            );
        }
    }
}
