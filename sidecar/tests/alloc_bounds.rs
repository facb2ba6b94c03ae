//! No allocation on a header's word: every decoder the sidecar runs (its KV-event decoder)
//! or links (the feed frame and the shared-data worker table of the routing core), fed
//! payloads whose length prefixes claim as much as their length checks let through,
//! allocates at most about what the payload itself takes (the old reservations took 6-9×).
//! A counting allocator measures the peak.
//!
//! One test function: the counter is process-wide, and the harness runs tests on threads.

use kvroute::feed::{FeedWorker, Frame, FrameKind};
use kvroute::layout::WorkerTable;
use kvroute::role::Role;
use kvroute_sidecar::events::decode_batch;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Bytes allocated at the peak of `f`, beyond what was live before it.
fn peak_of<T>(f: impl FnOnce() -> T) -> usize {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    drop(f());
    PEAK.load(Ordering::Relaxed) - before
}

const MIB: usize = 1 << 20;

/// `prefix`, then a msgpack array32 header claiming as many elements as bytes follow it (the
/// most its length check lets through), then `filler` up to 1 MiB.
fn msgpack_claim(prefix: &[u8], filler: u8) -> Vec<u8> {
    let n = (MIB - prefix.len() - 5) as u32;
    let mut p = prefix.to_vec();
    p.push(0xdd);
    p.extend_from_slice(&n.to_be_bytes());
    p.resize(MIB, filler);
    p
}

#[test]
fn hostile_length_prefixes_allocate_no_more_than_their_payload() {
    let mut cases: Vec<(&str, Vec<u8>, bool)> = Vec::new();
    // KV-event batches (msgpack), each claiming one element per byte left, then holding
    // nil or junk: events, a BlockStored's hashes, its tokens, its extra keys, and the
    // strings of one extra-keys entry.
    cases.push(("events", msgpack_claim(&[0x92, 0x00], 0xc0), false));
    let mut stored = vec![0x92, 0x00, 0x91, 0x96, 0xab];
    stored.extend_from_slice(b"BlockStored");
    cases.push(("block hashes", msgpack_claim(&stored, 0xc0), false));
    let mut tokens = stored.clone();
    tokens.extend_from_slice(&[0x90, 0xc0]);
    cases.push(("token ids", msgpack_claim(&tokens, 0xc1), false));
    let mut keys = vec![0x92, 0x00, 0x91, 0x99, 0xab];
    keys.extend_from_slice(b"BlockStored");
    keys.extend_from_slice(&[0x90, 0xc0, 0x90, 0x10, 0xc0, 0xc0, 0xc0]);
    cases.push(("extra keys", msgpack_claim(&keys, 0xc1), false));
    keys.push(0x91);
    cases.push(("extra key strings", msgpack_claim(&keys, 0xc1), false));

    // A feed frame claiming MIB ops, and one op claiming MIB blocks.
    let worker = FeedWorker { id: "10.0.0.1:8000".into(), role: Role::Both, up: true };
    let frame = Frame {
        kind: FrameKind::Delta,
        epoch: 1,
        from_version: 0,
        to_version: 1,
        next_cursor: 0,
        block_size: 16,
        workers: vec![worker],
        ops: Vec::new(),
    };
    // As many as the bytes left could encode at their smallest: 5 bytes an op, 16 a block.
    let mut ops = frame.encode();
    let n_ops = ((MIB - ops.len()) / 5) as u32;
    ops[48..52].copy_from_slice(&n_ops.to_le_bytes());
    ops.resize(MIB, 0xee);
    cases.push(("feed ops", ops, true));
    let mut blocks = frame.encode();
    blocks[48..52].copy_from_slice(&1u32.to_le_bytes());
    blocks.push(1); // OP_STORE
    blocks.extend_from_slice(&0u32.to_le_bytes());
    let n_blocks = ((MIB - blocks.len() - 4) / 16) as u32;
    blocks.extend_from_slice(&n_blocks.to_le_bytes());
    blocks.resize(MIB, 0xee);
    cases.push(("feed blocks", blocks, true));

    for (what, payload, feed) in &cases {
        let peak = peak_of(|| if *feed { Frame::decode(payload).is_err() } else { decode_batch(payload).is_err() });
        // (what the decoder itself holds besides: a few hundred bytes)
        assert!(peak <= payload.len() + 4096, "{what}: {peak} bytes allocated for a {}-byte payload", payload.len());
    }
    // The shared-data worker table bounds its count by MAX_SLOTS as well.
    let mut table = vec![0u8; 32];
    table[0..2].copy_from_slice(&1u16.to_le_bytes()); // format
    table[8..12].copy_from_slice(&1u32.to_le_bytes()); // one bucket
    table[28..30].copy_from_slice(&1024u16.to_le_bytes()); // 1024 slots claimed, 2 bytes left
    assert!(WorkerTable::decode(&table).is_err());
    let peak = peak_of(|| WorkerTable::decode(&table).is_err());
    assert!(peak <= 64, "worker table: {peak} bytes for 32");

    // And an honest batch still decodes whole.
    let mut ok = vec![0x92, 0x00, 0x91, 0x95, 0xab];
    ok.extend_from_slice(b"BlockStored");
    ok.extend_from_slice(&[0x91, 0x07, 0xc0, 0x91, 0x05, 0x01]);
    assert_eq!(decode_batch(&ok).map(|b| b.events.len()), Ok(1));
}
