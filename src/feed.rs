//! The feed: frames the sidecar sends the sync service. Protocol: `docs/feed-protocol.md`.
//!
//! A frame is binary, little-endian, self-delimiting; counts and lengths are checked
//! against the bytes actually present before anything is allocated or decoded, so a
//! truncated or hostile frame is an error, never a panic or a huge allocation.

use crate::layout::{LayoutError, Reader};
use crate::role::Role;
use crate::wire::capacity_for;
use std::fmt;

pub const MAGIC: &[u8; 4] = b"KVRF";
pub const VERSION: u16 = 1;
/// Fixed header length in bytes.
pub const HEADER_LEN: usize = 52;
/// Most workers a frame may list.
pub const MAX_WORKERS: usize = crate::slots::MAX_SLOTS;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// Changes from `from_version` to `to_version`.
    Delta = 0,
    /// First page of a snapshot: everything before it is replaced.
    SnapshotStart = 1,
    /// A later page of the snapshot started by a `SnapshotStart`.
    SnapshotMore = 2,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedWorker {
    pub id: String,
    pub role: Role,
    pub up: bool,
}

/// A block as the feed names it: its router hash and the hash of its segment's anchor
/// (the block at [`crate::hash::anchor_position`] of its chain), which picks its bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeedBlock {
    pub hash: u64,
    pub anchor: u64,
}

impl FeedBlock {
    /// The feed blocks of a whole chain of tokens in the base namespace: every whole
    /// block's router hash and its segment anchor.
    pub fn chain(tokens: &[u32], block_size: usize) -> Vec<FeedBlock> {
        Self::chain_in(tokens, block_size, crate::hash::BASE_NAMESPACE)
    }

    /// [`FeedBlock::chain`] in a namespace ([`crate::hash::namespace`]).
    pub fn chain_in(tokens: &[u32], block_size: usize, namespace: u64) -> Vec<FeedBlock> {
        crate::hash::block_ids_in(tokens, block_size, namespace)
            .into_iter()
            .map(|b| FeedBlock { hash: b.hash, anchor: b.anchor })
            .collect()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// The worker (index into the frame's worker list) now holds these blocks (in GPU
    /// memory, or in a tier the client was not told apart).
    Store { worker: u32, blocks: Vec<FeedBlock> },
    /// The worker now holds these blocks only in an offload tier (CPU memory, disk): hits
    /// that cost a load instead of a recompute. Sent only to clients that asked (`tiers=1`).
    StoreOffloaded { worker: u32, blocks: Vec<FeedBlock> },
    /// The worker no longer holds these blocks.
    Remove { worker: u32, blocks: Vec<FeedBlock> },
    /// The worker holds nothing (engine restart, `AllBlocksCleared`).
    Clear { worker: u32 },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub epoch: u64,
    pub from_version: u64,
    pub to_version: u64,
    /// For snapshot pages: the cursor to ask for the next page; 0 on the last page.
    pub next_cursor: u64,
    pub block_size: u32,
    /// The whole fleet as of `to_version`; a worker absent from it has left.
    pub workers: Vec<FeedWorker>,
    pub ops: Vec<Op>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameError(pub String);

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bad feed frame: {}", self.0)
    }
}

impl From<LayoutError> for FrameError {
    fn from(e: LayoutError) -> Self {
        FrameError(format!("truncated at {}", e.0))
    }
}

const OP_STORE: u8 = 1;
const OP_REMOVE: u8 = 2;
const OP_CLEAR: u8 = 3;
const OP_STORE_OFFLOADED: u8 = 4;
const BLOCK_LEN: usize = 16;

impl Frame {
    /// A single-page snapshot of the state at `version`.
    pub fn snapshot(epoch: u64, version: u64, block_size: u32, workers: Vec<FeedWorker>, ops: Vec<Op>) -> Frame {
        Frame {
            kind: FrameKind::SnapshotStart,
            epoch,
            from_version: 0,
            to_version: version,
            next_cursor: 0,
            block_size,
            workers,
            ops,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let blocks: usize = self
            .ops
            .iter()
            .map(|o| match o {
                Op::Store { blocks, .. } | Op::StoreOffloaded { blocks, .. } | Op::Remove { blocks, .. } => {
                    blocks.len()
                }
                Op::Clear { .. } => 0,
            })
            .sum();
        let mut out =
            Vec::with_capacity(HEADER_LEN + self.workers.len() * 24 + self.ops.len() * 9 + blocks * BLOCK_LEN);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.push(self.kind as u8);
        out.push(0);
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&self.from_version.to_le_bytes());
        out.extend_from_slice(&self.to_version.to_le_bytes());
        out.extend_from_slice(&self.next_cursor.to_le_bytes());
        out.extend_from_slice(&self.block_size.to_le_bytes());
        out.extend_from_slice(&(self.workers.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.ops.len() as u32).to_le_bytes());
        for w in &self.workers {
            let id = &w.id.as_bytes()[..w.id.len().min(255)];
            out.push(id.len() as u8);
            out.extend_from_slice(id);
            out.push(w.role as u8);
            out.push(u8::from(!w.up));
        }
        for op in &self.ops {
            let (code, worker, blocks) = match op {
                Op::Store { worker, blocks } => (OP_STORE, *worker, Some(blocks)),
                Op::StoreOffloaded { worker, blocks } => (OP_STORE_OFFLOADED, *worker, Some(blocks)),
                Op::Remove { worker, blocks } => (OP_REMOVE, *worker, Some(blocks)),
                Op::Clear { worker } => (OP_CLEAR, *worker, None),
            };
            out.push(code);
            out.extend_from_slice(&worker.to_le_bytes());
            if let Some(blocks) = blocks {
                out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
                for b in blocks {
                    out.extend_from_slice(&b.hash.to_le_bytes());
                    out.extend_from_slice(&b.anchor.to_le_bytes());
                }
            }
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Frame, FrameError> {
        let mut r = Reader::new(bytes);
        if r.take(4, "magic")? != MAGIC {
            return Err(FrameError("not a kvroute feed frame (magic)".into()));
        }
        let version = r.u16("version")?;
        if version != VERSION {
            return Err(FrameError(format!("protocol version {version}, expected {VERSION}")));
        }
        let kind = match r.u8("kind")? {
            0 => FrameKind::Delta,
            1 => FrameKind::SnapshotStart,
            2 => FrameKind::SnapshotMore,
            k => return Err(FrameError(format!("unknown frame kind {k}"))),
        };
        r.u8("flags")?;
        let epoch = r.u64("epoch")?;
        let from_version = r.u64("from_version")?;
        let to_version = r.u64("to_version")?;
        let next_cursor = r.u64("next_cursor")?;
        let block_size = r.u32("block_size")?;
        let n_workers = r.u32("worker count")? as usize;
        let n_ops = r.u32("op count")? as usize;
        if block_size == 0 {
            return Err(FrameError("block_size 0".into()));
        }
        if kind == FrameKind::Delta && to_version < from_version {
            return Err(FrameError("delta goes back in version".into()));
        }
        // Each worker takes >= 3 bytes and each op >= 5: bound counts by what is present.
        if n_workers > MAX_WORKERS || n_workers > r.remaining() / 3 {
            return Err(FrameError(format!("worker count {n_workers} exceeds the frame")));
        }
        let mut workers = Vec::with_capacity(capacity_for::<FeedWorker>(n_workers, r.remaining(), 3));
        for _ in 0..n_workers {
            let len = usize::from(r.u8("worker id length")?);
            let id = std::str::from_utf8(r.take(len, "worker id")?)
                .map_err(|_| FrameError("worker id is not UTF-8".into()))?;
            if id.is_empty() {
                return Err(FrameError("empty worker id".into()));
            }
            let role = Role::from_u8(r.u8("worker role")?).ok_or_else(|| FrameError("unknown worker role".into()))?;
            let up = match r.u8("worker state")? {
                0 => true,
                1 => false,
                _ => return Err(FrameError("unknown worker state".into())),
            };
            if workers.iter().any(|w: &FeedWorker| w.id == id) {
                return Err(FrameError(format!("worker {id} listed twice")));
            }
            workers.push(FeedWorker { id: id.to_string(), role, up });
        }
        if n_ops > r.remaining() / 5 {
            return Err(FrameError(format!("op count {n_ops} exceeds the frame")));
        }
        let mut ops = Vec::with_capacity(capacity_for::<Op>(n_ops, r.remaining(), 5));
        for _ in 0..n_ops {
            let code = r.u8("op code")?;
            let worker = r.u32("op worker")?;
            if worker as usize >= workers.len() {
                return Err(FrameError(format!("op names worker {worker} of {}", workers.len())));
            }
            let op = match code {
                OP_STORE | OP_STORE_OFFLOADED | OP_REMOVE => {
                    let n = r.u32("block count")? as usize;
                    if n > r.remaining() / BLOCK_LEN {
                        return Err(FrameError(format!("block count {n} exceeds the frame")));
                    }
                    let mut blocks = Vec::with_capacity(capacity_for::<FeedBlock>(n, r.remaining(), BLOCK_LEN));
                    for _ in 0..n {
                        blocks.push(FeedBlock { hash: r.u64("block hash")?, anchor: r.u64("block anchor")? });
                    }
                    match code {
                        OP_STORE => Op::Store { worker, blocks },
                        OP_STORE_OFFLOADED => Op::StoreOffloaded { worker, blocks },
                        _ => Op::Remove { worker, blocks },
                    }
                }
                OP_CLEAR => Op::Clear { worker },
                c => return Err(FrameError(format!("unknown op code {c}"))),
            };
            ops.push(op);
        }
        if r.remaining() != 0 {
            return Err(FrameError(format!("{} trailing bytes", r.remaining())));
        }
        Ok(Frame { kind, epoch, from_version, to_version, next_cursor, block_size, workers, ops })
    }
}

/// The path and query of a feed poll (see the protocol document); `tiers=1` asks for
/// `STORE_OFFLOADED` ops; `linger_ms` (sent when not 0), how long the sidecar holds an
/// answer once it has a change to send.
pub fn poll_path(base: &str, epoch: u64, since: u64, cursor: u64, timeout_ms: u64, linger_ms: u64) -> String {
    let mut path = format!("{base}?epoch={epoch}&since={since}&cursor={cursor}&timeout_ms={timeout_ms}&tiers=1");
    if linger_ms > 0 {
        path.push_str(&format!("&linger_ms={linger_ms}"));
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    pub(crate) fn sample() -> Frame {
        Frame {
            kind: FrameKind::Delta,
            epoch: 3,
            from_version: 10,
            to_version: 12,
            next_cursor: 0,
            block_size: 16,
            workers: vec![
                FeedWorker { id: "127.0.0.1:8101".into(), role: Role::Both, up: true },
                FeedWorker { id: "127.0.0.1:8102".into(), role: Role::Prefill, up: false },
            ],
            ops: vec![
                Op::Store {
                    worker: 0,
                    blocks: vec![FeedBlock { hash: 1, anchor: 1 }, FeedBlock { hash: 2, anchor: 1 }],
                },
                Op::Remove { worker: 1, blocks: vec![FeedBlock { hash: u64::MAX, anchor: 7 }] },
                Op::Clear { worker: 1 },
            ],
        }
    }

    #[test]
    fn round_trip() {
        let f = sample();
        let bytes = f.encode();
        assert_eq!(&bytes[..4], MAGIC);
        assert_eq!(Frame::decode(&bytes), Ok(f));
    }

    #[test]
    fn header_is_52_bytes() {
        let mut f = sample();
        f.workers.clear();
        f.ops.clear();
        assert_eq!(f.encode().len(), HEADER_LEN);
    }

    #[test]
    fn every_truncation_and_corruption_is_an_error() {
        let bytes = sample().encode();
        for cut in 0..bytes.len() {
            assert!(Frame::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(Frame::decode(&extra).is_err());
        // Flip every byte in turn: decoding must never panic (it may still succeed when
        // the byte is a hash).
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0xA5;
            let _ = Frame::decode(&b);
        }
    }

    #[test]
    fn huge_counts_are_rejected_before_allocating() {
        let mut f = sample();
        f.ops.clear();
        let mut bytes = f.encode();
        // op count field at offset 48
        bytes[48..52].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Frame::decode(&bytes).unwrap_err().0.contains("op count"));
        let mut bytes = sample().encode();
        bytes[44..48].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Frame::decode(&bytes).unwrap_err().0.contains("worker count"));
    }

    #[test]
    fn semantic_errors() {
        let mut f = sample();
        f.ops = vec![Op::Clear { worker: 9 }];
        assert!(Frame::decode(&f.encode()).unwrap_err().0.contains("worker 9"));
        let mut f = sample();
        f.workers[1].id = f.workers[0].id.clone();
        assert!(Frame::decode(&f.encode()).unwrap_err().0.contains("twice"));
        let mut f = sample();
        f.to_version = 1;
        assert!(Frame::decode(&f.encode()).is_err());
    }
}
