//! Writes the seed corpus of every target but `kv_events` (whose seeds come from the
//! engines' own encoders: `fuzz/seeds.py`; run it first, the checkpoint seeds apply them)
//! into `fuzz/corpus/<target>/`, one file per input named by its content's hash. Seeds
//! are what the real encoders produce: the sidecar's frames, the sync service's table and
//! buckets, a routed request's in-flight entries, the shipped configurations, the golden
//! tokenizer requests, the sidecar's checkpoints.
//!
//! `cargo run -p kvroute-invariants --example seeds`

use kvroute::config::FilterConfig;
use kvroute::feed::{FeedBlock, FeedWorker, Frame, FrameKind, Op};
use kvroute::hash::BASE_NAMESPACE;
use kvroute::index::{publish, SyncIndex};
use kvroute::layout::{bucket_key, bucket_of, EpochCount, LoadVector, PrefillRate, SlotLoad, LOAD_KEY, TABLE_KEY};
use kvroute::role::Role;
use kvroute::router::{Router, TokenSource};
use kvroute::store::{MemStore, SharedStore};
use kvroute::tokens::TokenEncoding;
use std::path::{Path, PathBuf};

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let corpus = root.join("fuzz/corpus");
    let mut n = 0;
    // `sel`: the target's selector byte, if it takes one.
    let mut put = |target: &str, sel: Option<u8>, body: &[u8]| {
        let dir = corpus.join(target);
        std::fs::create_dir_all(&dir).expect("corpus folder");
        let data = [sel.as_slice(), body].concat();
        let name = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&data));
        std::fs::write(dir.join(name), &data).expect("seed file");
        n += 1;
    };

    // token_header: decimal (even selector) and base64 (odd), including SIMD-length ones.
    for ids in [vec![0u32], vec![1, 2, 3], (0..40).map(|i| i * 7_919).collect(), vec![u32::MAX, 151_643]] {
        let decimal = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        put("token_header", Some(0), decimal.as_bytes());
        let le: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        put("token_header", Some(1), base64(&le).as_bytes());
        put("token_header", Some(1), base64(&le).trim_end_matches('=').as_bytes());
    }
    put("token_header", Some(0), b" 1 ,\t2,3 ");

    // feed_frame: a snapshot, a paged snapshot, a delta with every op.
    let tokens: Vec<u32> = (0..64).collect();
    let blocks = FeedBlock::chain(&tokens, 16);
    let workers = vec![
        FeedWorker { id: "10.0.0.1:8000".into(), role: Role::Both, up: true },
        FeedWorker { id: "10.0.0.2:8000".into(), role: Role::Prefill, up: true },
        FeedWorker { id: "[fd00::3]:8000".into(), role: Role::Decode, up: false },
    ];
    let snapshot = Frame::snapshot(
        7,
        42,
        16,
        workers.clone(),
        vec![
            Op::Store { worker: 0, blocks: blocks.clone() },
            Op::Store { worker: 1, blocks: blocks[..2].to_vec() },
            Op::StoreOffloaded { worker: 2, blocks: blocks[2..].to_vec() },
        ],
    );
    put("feed_frame", None, &snapshot.encode());
    let paged = Frame { kind: FrameKind::SnapshotMore, next_cursor: 9, ..snapshot.clone() };
    put("feed_frame", None, &paged.encode());
    let delta = Frame {
        kind: FrameKind::Delta,
        from_version: 42,
        to_version: 45,
        ops: vec![
            Op::Store { worker: 1, blocks: blocks[2..].to_vec() },
            Op::Remove { worker: 0, blocks: blocks[..1].to_vec() },
            Op::Clear { worker: 2 },
        ],
        ..snapshot.clone()
    };
    put("feed_frame", None, &delta.encode());

    // shared_layouts: what the sync service publishes for the snapshot, then the same after
    // a routed request wrote its in-flight entries.
    let mut index = SyncIndex::new(16);
    index.apply(&snapshot).expect("snapshot applies");
    index.set_live(true);
    let store = MemStore::new();
    publish(&mut index, &store);
    let load = LoadVector(vec![
        SlotLoad {
            active: 3,
            prefill: EpochCount { epoch: 16, now: 2, before: 0 },
            prefill_since_ms: 960_100,
            prefill_rate: PrefillRate { blocks: 160, ms: 800 },
        },
        SlotLoad::default(),
        SlotLoad { active: 9, ..SlotLoad::default() },
    ]);
    store.set(LOAD_KEY, &load.encode(), None).expect("load");
    let bucket = bucket_key(bucket_of(blocks[0].anchor, 16));
    let get = |key: &str| store.get(key).ok().and_then(|(v, _)| v).unwrap_or_default();
    let layouts = |sel: u8, bucket_value: &[u8]| {
        let (table, load) = (get(TABLE_KEY), get(LOAD_KEY));
        let mut s = Vec::new();
        for part in [&table, &load] {
            s.extend_from_slice(&(part.len() as u16).to_le_bytes());
            s.extend_from_slice(part);
        }
        s.extend_from_slice(bucket_value);
        (sel, s)
    };
    let (sel, s) = layouts(3, &get(&bucket));
    put("shared_layouts", Some(sel), &s);
    let cfg = FilterConfig::from_json(b"{}").expect("defaults");
    let header = tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let source =
        TokenSource::Header { value: header.as_bytes(), encoding: TokenEncoding::Decimal, namespace: BASE_NAMESPACE };
    Router::new(cfg).route(&store, source, 1_000_000, 0);
    let (sel, s) = layouts(3, &get(&bucket));
    put("shared_layouts", Some(sel), &s);
    let (sel, s) = layouts(0, &[]);
    put("shared_layouts", Some(sel), &s);

    // filter_configs: the shipped Envoy configurations' plugin configs, and the defaults.
    for c in [
        &br#"{}"#[..],
        br#"{"block_size": 16, "overlap_weight": 1.0, "debug_header": "x-kvroute-debug", "mode": "pd"}"#,
        br#"{"destination_via": "upstream_override", "wait_slack_per_hit": null, "active_blocks": "in_flight"}"#,
    ] {
        put("filter_configs", Some(0), c);
    }
    for c in [&br#"{}"#[..], br#"{"feed_cluster": "kvroute_sidecar", "n_buckets": 1024, "poll_timeout_ms": 2000}"#] {
        put("filter_configs", Some(1), c);
    }

    // sidecar_config: the example file, a worker table, etcd discovery, `--worker` lines.
    let example = std::fs::read_to_string(root.join("sidecar/sidecar.example.toml")).expect("example config");
    put("sidecar_config", Some(0), example.as_bytes());
    put(
        "sidecar_config",
        Some(0),
        b"block_size = 16\n[[workers]]\nid = \"10.0.0.1:8000\"\nevents = \"tcp://10.0.0.1:5557\"\nreplay = \"tcp://10.0.0.1:5558\"\ndp_ranks = 2\n",
    );
    put("sidecar_config", Some(0), b"discovery_backend = \"etcd\"\netcd_endpoints = [\"http://127.0.0.1:2379\"]\n");
    put(
        "sidecar_config",
        Some(1),
        b"10.0.0.1:8000=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5558,role=prefill,dp=2\n[::1]:8001=ipc:///tmp/kv\n",
    );

    // stage_request: every golden request of the tokenizer vectors.
    let vectors = read_json(&root.join("tests/vectors/tokenizer/qwen3.json"));
    for case in vectors["cases"].as_array().expect("cases") {
        let sel = u8::from(case["endpoint"].as_str() != Some("completions"));
        put("stage_request", Some(sel), serde_json::to_string(&case["request"]).expect("json").as_bytes());
    }
    // text_ids: the golden requests' text prompts and messages, and ASCII of every kind.
    for case in vectors["cases"].as_array().expect("cases") {
        let r = &case["request"];
        let texts = r["prompt"]
            .as_str()
            .into_iter()
            .chain(r["messages"].as_array().into_iter().flatten().filter_map(|m| m["content"].as_str()));
        for t in texts {
            put("text_ids", None, t.as_bytes());
        }
    }
    for t in [
        "It's the user's   turn: they'RE here, I'M done, she'LL see.\n\n  indented\n\treturn foo_bar(1234567);\r\n",
        "x = [12345, 3.14159]; if (a && b) { return -1; }  \x0b\x0c\x1c\x00\x7f ' 'll '",
        "================================================================================================",
    ] {
        put("text_ids", None, t.as_bytes());
    }
    // checkpoint: the fleet's checkpoint (as a body, which the check seals) before any
    // event, and after the engines' own kv_events seeds and chains of engine blocks were
    // applied across its ranks.
    let body = |file: Vec<u8>| file[8..file.len() - 8].to_vec();
    let mut fleet = kvroute_invariants::checkpoint::fleet(1);
    put("checkpoint", None, &body(fleet.checkpoint()));
    // Chains of engine blocks the size of the router's and twice it, on GPU and offloaded.
    use kvroute_sidecar::events::{Batch, BatchTail, BlockStored, Event, Medium};
    let chain = |first: u64, parent: Option<u64>, n: u64, block_size: u32, medium: Medium| {
        let tokens = (0..n as u32 * block_size).map(|t| t + first as u32 * 1000).collect();
        let hashes: Vec<u64> = (first..first + n).collect();
        Event::Stored(BlockStored { medium, ..BlockStored::on_gpu(&hashes, parent, tokens, block_size) })
    };
    let mut events: Vec<_> = std::fs::read_dir(corpus.join("kv_events")).expect("kv_events seeds").flatten().collect();
    events.sort_by_key(|e| e.file_name());
    let now = std::time::Instant::now();
    for (seq, entry) in events.iter().enumerate() {
        let data = std::fs::read(entry.path()).expect("seed");
        let (worker, rank) = [(0, 0), (1, 0), (1, 1)][seq % 3];
        // (The selector byte first; a payload that does not decode just leaves its rank as is.)
        let _ = fleet.apply_payload(worker, rank, seq as u64, &data[1..], now, 0.0);
    }
    let tail = BatchTail { ts: 0.0, dp_rank: None, unknown: 0, first_unknown: None };
    let batch = |events| Batch { events, tail: tail.clone() };
    fleet.apply_batch(
        0,
        0,
        0,
        &batch(vec![chain(1, None, 4, 16, Medium::Gpu), chain(5, Some(4), 2, 32, Medium::Gpu)]),
        now,
        0.0,
    );
    fleet.apply_batch(
        1,
        1,
        0,
        &batch(vec![chain(1, None, 3, 16, Medium::Gpu), chain(1, None, 3, 16, Medium::Offloaded)]),
        now,
        0.0,
    );
    // Then a batch with no events on every rank (`[1.5, [], 0]`), so each has a resume point.
    let mut empty = vec![0x93, 0xcb];
    empty.extend_from_slice(&1.5f64.to_be_bytes());
    empty.extend_from_slice(&[0x90, 0x00]);
    for (worker, rank) in [(0, 0), (1, 0), (1, 1)] {
        fleet.apply_payload(worker, rank, events.len() as u64, &empty, now, 0.0).expect("an empty batch");
    }
    put("checkpoint", None, &body(fleet.checkpoint()));
    println!("{n} seeds written under {}", corpus.display());
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).expect("vectors")).expect("vectors json")
}

fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let v = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            s.push(if i <= chunk.len() { ABC[(v >> (18 - 6 * i)) as usize & 63] as char } else { '=' });
        }
    }
    s
}
