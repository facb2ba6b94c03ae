//! Microbenchmarks of the routing core: token parsing, block hashing, ranking, and a whole
//! routing decision (scan, score, in-flight acquire + release) over an in-memory store
//! with the host's semantics. `cargo bench --bench core`; results in docs/benchmarks.md.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute::config::FilterConfig;
use kvroute::feed::{FeedBlock, FeedWorker, Frame, Op};
use kvroute::hash::block_hashes_le;
use kvroute::index::{publish, SyncIndex};
use kvroute::role::Role;
use kvroute::router::{Router, TokenSource};
use kvroute::score::{rank, worker_key, Candidate};
use kvroute::store::MemStore;
use kvroute::tokens::{decode_tokens, encode_base64, encode_decimal, TokenEncoding};

const SIZES: [usize; 3] = [1024, 8192, 32768];

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (seed.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(40_503)) % 151_000).collect()
}

fn parsing(c: &mut Criterion) {
    let mut g = c.benchmark_group("tokens");
    for n in SIZES {
        let p = prompt(1, n);
        let dec = encode_decimal(&p);
        let b64 = encode_base64(&p);
        let mut out = Vec::new();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("decimal", n), &dec, |b, v| {
            b.iter(|| decode_tokens(black_box(v.as_bytes()), TokenEncoding::Decimal, 1 << 20, &mut out))
        });
        g.bench_with_input(BenchmarkId::new("base64", n), &b64, |b, v| {
            b.iter(|| decode_tokens(black_box(v.as_bytes()), TokenEncoding::Base64LeU32, 1 << 20, &mut out))
        });
    }
    g.finish();
}

fn hashing(c: &mut Criterion) {
    let mut g = c.benchmark_group("hash");
    for n in SIZES {
        let le: Vec<u8> = prompt(2, n).iter().flat_map(|t| t.to_le_bytes()).collect();
        let mut out = Vec::new();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("blocks16", n), &le, |b, v| {
            b.iter(|| block_hashes_le(black_box(v), 16, 0, &mut out))
        });
    }
    g.finish();
}

fn ranking(c: &mut Criterion) {
    let mut g = c.benchmark_group("rank");
    for workers in [16usize, 128] {
        let cands: Vec<Candidate> = (0..workers)
            .map(|s| Candidate {
                slot: s,
                cache_hits: (s as u32 * 7) % 100,
                offloaded_hits: 0,
                active_blocks: (s as u32 * 13) % 500,
                pending_prefill: (s as u32 * 5) % 200,
                wait: (s as u32 * 11) % 300,
                own_prefill: (s as u32 * 3) % 100,
                cached_blocks: (s as u32 * 17) % 1000,
                memory_blocks: (s as u32 * 13) % 500,
                kv_capacity_blocks: Some(400),
                worker_key: worker_key(&format!("10.0.{}.{}:8000", s / 250, s % 250)),
                key_load: 0,
            })
            .collect();
        let mut out = Vec::new();
        // The shipped weights, so the bench measures what ships.
        let weights = FilterConfig::from_json(b"{}").expect("the defaults load").weights(1.0, true);
        g.bench_with_input(BenchmarkId::new("workers", workers), &cands, |b, cands| {
            b.iter(|| rank(black_box(cands), weights, 128, 42, &mut out))
        });
    }
    g.finish();
}

/// A fleet whose workers each cache a few shared prefixes plus some of the request's.
fn fleet(workers: usize, request: &[u32]) -> MemStore {
    let store = MemStore::new();
    let mut ix = SyncIndex::new(4096);
    let feed_workers: Vec<FeedWorker> = (0..workers)
        .map(|i| FeedWorker { id: format!("10.0.{}.{}:8000", i / 250, i % 250), role: Role::Both, up: true })
        .collect();
    let blocks = |tokens: &[u32]| FeedBlock::chain(tokens, 16);
    let mut ops = Vec::new();
    for w in 0..workers {
        // Each worker: 8 unrelated 2k-token conversations…
        for k in 0..8 {
            ops.push(Op::Store { worker: w as u32, blocks: blocks(&prompt(1000 + (w * 8 + k) as u32, 2048)) });
        }
        // …and a share of the request's prefix, different per worker.
        let share = request.len() * (w + 1) / (workers + 1) / 16 * 16;
        ops.push(Op::Store { worker: w as u32, blocks: blocks(&request[..share]) });
    }
    let frame = Frame::snapshot(1, 1, 16, feed_workers, ops);
    ix.apply(&frame).expect("snapshot applies");
    ix.set_live(true);
    publish(&mut ix, &store);
    store
}

/// One iteration: a whole routing decision and its release at stream end, time advancing
/// 1 ms per request.
fn route_and_release(b: &mut criterion::Bencher<'_>, router: &mut Router, store: &MemStore, b64: &str) {
    let mut now = 10;
    b.iter(|| {
        now += 1;
        let d = router.route(
            store,
            TokenSource::Header {
                value: black_box(b64.as_bytes()),
                encoding: TokenEncoding::Base64LeU32,
                namespace: 0,
            },
            now,
            now,
        );
        router.release(store, &d.held, now);
    })
}

fn routing(c: &mut Criterion) {
    let mut g = c.benchmark_group("route");
    for tokens in [2048usize, 32768] {
        for workers in [16usize, 128] {
            let request = prompt(7, tokens);
            let store = fleet(workers, &request);
            let b64 = encode_base64(&request);
            let mut router = Router::new(FilterConfig::from_json(b"{}").expect("defaults"));
            let (r0, w0) = store.calls();
            let d = router.route(
                &store,
                TokenSource::Header { value: b64.as_bytes(), encoding: TokenEncoding::Base64LeU32, namespace: 0 },
                0,
                1,
            );
            let (r1, w1) = store.calls();
            router.release(&store, &d.held, 1);
            let (r2, w2) = store.calls();
            println!(
                "route/{tokens}tok/{workers}w: hits {} of {} blocks; shared-data gets/sets: route {}/{}, release {}/{}",
                d.hits,
                d.request_blocks,
                r1 - r0,
                w1 - w0,
                r2 - r1,
                w2 - w1
            );
            g.throughput(Throughput::Elements(1));
            g.bench_function(BenchmarkId::new(format!("{tokens}tok"), workers), |b| {
                route_and_release(b, &mut router, &store, &b64)
            });
        }
    }
    g.finish();
}

/// Every block of the request in flight on every worker (a shared prefix served by the
/// whole fleet): the case whose cost grows with (blocks × workers) in flight.
fn replicated_in_flight(store: &MemStore, request: &[u32], workers: u16) {
    use kvroute::hash::segments;
    use kvroute::inflight::{apply, keys, Change};
    use kvroute::layout::{bucket_key, bucket_of, encode_bucket, Bucket};
    use kvroute::store::SharedStore;
    let hashes = kvroute::hash::block_hashes(request, 16);
    let slots: Vec<u16> = (0..workers).collect();
    for seg in segments(hashes.len()) {
        let key = bucket_key(bucket_of(hashes[seg.start], 4096));
        let value = store.get(&key).expect("get").0.unwrap_or_default();
        let bucket = Bucket::parse(&value).expect("bucket");
        let mut sorted = hashes[seg].to_vec();
        sorted.sort_unstable();
        let mut k = Vec::new();
        keys(&sorted, &slots, &mut k);
        let (n_fly, fly) = bucket.fly_raw();
        let mut out = Vec::new();
        let (n, _) = apply(fly, n_fly, &k, Change::Acquire { lease_ms: 1 << 40 }, 0, &mut out);
        store.set(&key, &encode_bucket(bucket.index_part(), n, &out, u64::MAX), None).expect("set");
    }
}

fn routing_replicated(c: &mut Criterion) {
    let mut g = c.benchmark_group("route_replicated");
    for tokens in [2048usize, 32768] {
        let request = prompt(7, tokens);
        let store = fleet(16, &request);
        replicated_in_flight(&store, &request, 16);
        let b64 = encode_base64(&request);
        let mut router = Router::new(FilterConfig::from_json(b"{}").expect("defaults"));
        g.bench_function(BenchmarkId::new(format!("{tokens}tok"), 16), |b| {
            route_and_release(b, &mut router, &store, &b64)
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    targets = parsing, hashing, ranking, routing, routing_replicated
}
criterion_main!(benches);
