//! Block identity: the one implementation the filter, the sync service and the sidecar
//! share: how a block is hashed, chained onto its parent, placed in a namespace, and which
//! segment (and so which shared-data bucket) it belongs to.
//!
//! A prompt is cut into blocks of `block_size` tokens (the engines' `--block-size` /
//! `--page-size`); the trailing partial block is not hashed, as the engines do not cache
//! it either. For block `i`, with its tokens as little-endian `u32` bytes:
//!
//! ```text
//! local_i = xxh3_64_with_seed(le_u32_bytes(block_i), 1337)
//! seq_0   = local_0
//! seq_i   = xxh3_64_with_seed(le_u64(seq_{i-1}) ++ le_u64(local_i), 1337)
//! ```
//!
//! `local_i` equals the `tokens_hash` of NVIDIA Dynamo's KV router, so block identities
//! interoperate with it; the chain is ours. `seq_i` names block `i` *and everything before
//! it*, so two requests share block `i` exactly when they share the first `i + 1` blocks.
//!
//! **Namespaces.** An engine hashes a LoRA adapter's name and a request's cache salt into
//! its block hashes: the same tokens under adapter X are other blocks than the base
//! model's. The router does the same by chaining the first block onto a namespace id
//! instead of nothing: `seq_0 = xxh3_64_with_seed(le_u64(ns) ++ le_u64(local_0), 1337)`
//! when `ns` ≠ 0 ([`namespace`]); the base model is `ns = 0` and keeps `seq_0 = local_0`.
//! Test vectors: `tests/vectors/block_hashes.json`.
//!
//! **Segments.** A chain's blocks are grouped into segments whose lengths double,
//! `[0,32) [32,64) [64,128) …` ([`segments`]); a block is filed under its segment's first
//! block, its *anchor* ([`anchor_position`]). [`Chain`] extends a chain block by block
//! and gives each block its hash, anchor and position: the feed's and the sidecar's
//! blocks come from it, and [`block_hashes_le`] (the request path) from the same steps.

use std::ops::Range;
use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// Seed of both hashes (Dynamo's `XXH3_SEED`).
pub const HASH_SEED: u64 = 1337;

/// Default tokens per block; must equal the engines' block/page size.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Hash of one block's tokens, given as little-endian `u32` bytes.
#[inline]
pub fn local_hash(block_le: &[u8]) -> u64 {
    xxh3_64_with_seed(block_le, HASH_SEED)
}

/// Chains a block's local hash onto its parent's sequence hash.
#[inline]
pub fn chain_hash(parent_seq: u64, local: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent_seq.to_le_bytes());
    buf[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&buf, HASH_SEED)
}

/// The sequence hash of a block given its parent's (`None` for the first block).
#[inline]
pub fn seq_hash(parent_seq: Option<u64>, block_le: &[u8]) -> u64 {
    let local = local_hash(block_le);
    match parent_seq {
        None => local,
        Some(parent) => chain_hash(parent, local),
    }
}

/// Blocks in the first segment; each later segment is as long as everything before it.
pub const SEGMENT_BASE_BLOCKS: usize = 32;

/// Position of the anchor (first block) of the segment holding block `pos`.
#[inline]
pub fn anchor_position(pos: usize) -> usize {
    if pos < SEGMENT_BASE_BLOCKS {
        0
    } else {
        // Largest SEGMENT_BASE_BLOCKS * 2^k <= pos.
        let k = usize::BITS - 1 - (pos / SEGMENT_BASE_BLOCKS).leading_zeros();
        SEGMENT_BASE_BLOCKS << k
    }
}

/// The segments of a request of `n_blocks` blocks, in order.
pub fn segments(n_blocks: usize) -> impl Iterator<Item = Range<usize>> {
    let mut start = 0usize;
    std::iter::from_fn(move || {
        if start >= n_blocks {
            return None;
        }
        let end = if start == 0 { SEGMENT_BASE_BLOCKS } else { start * 2 };
        let r = start..end.min(n_blocks);
        start = end;
        Some(r)
    })
}

/// A block's identity: its chain hash, its segment's anchor, and its 0-based position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockId {
    pub hash: u64,
    pub anchor: u64,
    pub pos: u32,
}

/// A chain being extended one block at a time.
#[derive(Clone, Copy, Debug)]
pub struct Chain {
    /// The last block so far; `None` at the start.
    last: Option<BlockId>,
    /// What the first block hangs off ([`root_parent`]).
    root: Option<u64>,
}

impl Chain {
    /// A chain's start, in `namespace`.
    pub fn start(namespace: u64) -> Chain {
        Chain { last: None, root: root_parent(namespace) }
    }

    /// The rest of a chain whose last block so far is `parent` (its namespace is in its hash).
    pub fn after(parent: BlockId) -> Chain {
        Chain { last: Some(parent), root: None }
    }

    /// Appends a block (its tokens as little-endian `u32` bytes) and names it.
    #[inline]
    pub fn push(&mut self, block_le: &[u8]) -> BlockId {
        let (parent, pos) = match self.last {
            Some(p) => (Some(p.hash), p.pos.saturating_add(1)),
            None => (self.root, 0),
        };
        let hash = seq_hash(parent, block_le);
        let anchor = match self.last {
            Some(p) if anchor_position(pos as usize) != pos as usize => p.anchor,
            _ => hash,
        };
        let id = BlockId { hash, anchor, pos };
        self.last = Some(id);
        id
    }
}

/// The base model's namespace.
pub const BASE_NAMESPACE: u64 = 0;

/// The namespace of blocks stored under LoRA adapter `lora` and/or cache salt `salt`
/// (absent or empty = none): `xxh3_64_with_seed("kvroute-ns/1" ++ parts, 1337)` where each
/// present part is a tag byte (1 = adapter name, 2 = cache salt), its length as `le_u32`,
/// and its bytes; 0 if neither is present (a hash of 0 becomes 1).
pub fn namespace(lora: Option<&[u8]>, salt: Option<&[u8]>) -> u64 {
    let lora = lora.filter(|l| !l.is_empty());
    let salt = salt.filter(|s| !s.is_empty());
    if lora.is_none() && salt.is_none() {
        return BASE_NAMESPACE;
    }
    let mut h = Xxh3::with_seed(HASH_SEED);
    h.update(b"kvroute-ns/1");
    for (tag, part) in [(1u8, lora), (2u8, salt)] {
        if let Some(p) = part {
            h.update(&[tag]);
            h.update(&(p.len() as u32).to_le_bytes());
            h.update(p);
        }
    }
    h.digest().max(1)
}

/// The parent a chain's first block is hashed onto: none for the base model.
#[inline]
pub fn root_parent(namespace: u64) -> Option<u64> {
    (namespace != BASE_NAMESPACE).then_some(namespace)
}

/// Sequence hashes of every whole block of `tokens_le` (token ids as little-endian `u32`
/// bytes) in `namespace`, appended to `out` after clearing it. `block_size` must be at
/// least 1.
pub fn block_hashes_le(tokens_le: &[u8], block_size: usize, namespace: u64, out: &mut Vec<u64>) {
    out.clear();
    let block_bytes = block_size.max(1) * 4;
    out.reserve(tokens_le.len() / block_bytes);
    let mut chain = Chain::start(namespace);
    out.extend(tokens_le.chunks_exact(block_bytes).map(|block| chain.push(block).hash));
}

/// [`block_hashes_le`] for token ids held as `u32`s, in the base namespace (tests' form).
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    block_hashes_in(tokens, block_size, BASE_NAMESPACE)
}

/// [`block_hashes_le`] for token ids held as `u32`s.
pub fn block_hashes_in(tokens: &[u32], block_size: usize, namespace: u64) -> Vec<u64> {
    block_ids_in(tokens, block_size, namespace).into_iter().map(|b| b.hash).collect()
}

/// Every whole block of `tokens` (held as `u32`s) in `namespace`, named by [`Chain`].
pub fn block_ids_in(tokens: &[u32], block_size: usize, namespace: u64) -> Vec<BlockId> {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let mut chain = Chain::start(namespace);
    bytes.chunks_exact(block_size.max(1) * 4).map(|block| chain.push(block)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn segments_double() {
        let s: Vec<_> = segments(300).collect();
        assert_eq!(s, vec![0..32, 32..64, 64..128, 128..256, 256..300]);
        assert_eq!(segments(0).count(), 0);
        assert_eq!(segments(5).collect::<Vec<_>>(), vec![0..5]);
        assert_eq!(segments(128).count(), 3); // 2k tokens at block size 16
        assert_eq!(segments(2048).count(), 7); // 32k tokens
        for seg in segments(5000) {
            for p in seg.clone() {
                assert_eq!(anchor_position(p), seg.start, "pos {p}");
            }
        }
    }

    #[test]
    fn a_chain_resumed_after_any_block_names_the_rest_alike() {
        let tokens: Vec<u32> = (0..16 * 300u32).map(|i| i.wrapping_mul(2_654_435_761) >> 7).collect();
        let le: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        for ns in [BASE_NAMESPACE, namespace(Some(b"sql-lora"), None)] {
            let mut chain = Chain::start(ns);
            let whole: Vec<BlockId> = le.chunks_exact(64).map(|b| chain.push(b)).collect();
            // The request path's hashes (block_hashes_le) and the named blocks agree.
            let mut hashes = Vec::new();
            block_hashes_le(&le, 16, ns, &mut hashes);
            assert_eq!(whole.iter().map(|b| b.hash).collect::<Vec<_>>(), hashes);
            assert_eq!(block_ids_in(&tokens, 16, ns), whole);
            for (i, b) in whole.iter().enumerate() {
                assert_eq!(b.pos as usize, i);
                assert_eq!(b.anchor, whole[anchor_position(i)].hash, "block {i}");
            }
            // Split anywhere (as events split a chain), the rest is named the same.
            for cut in [1, 31, 32, 33, 64, 127, 128, 299] {
                let mut rest = Chain::after(whole[cut - 1]);
                let again: Vec<BlockId> = le.chunks_exact(64).skip(cut).map(|b| rest.push(b)).collect();
                assert_eq!(again, whole[cut..], "cut at {cut}");
            }
        }
    }

    #[derive(serde::Deserialize)]
    struct Vectors {
        seed: u64,
        cases: Vec<Case>,
    }

    #[derive(serde::Deserialize)]
    struct Case {
        name: String,
        block_size: usize,
        tokens: Vec<u32>,
        #[serde(default)]
        lora: Option<String>,
        #[serde(default)]
        cache_salt: Option<String>,
        /// Decimal u64; absent = the base namespace.
        #[serde(default)]
        namespace: Option<String>,
        local_hashes: Vec<String>,
        seq_hashes: Vec<String>,
    }

    fn le(tokens: &[u32]) -> Vec<u8> {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn local_hash_matches_dynamo() {
        // Dynamo 1.6.1 `compute_block_hash_for_seq` of tokens 1000..1015, block size 16.
        let tokens: Vec<u32> = (1000..1016).collect();
        assert_eq!(local_hash(&le(&tokens)), 17_863_182_269_597_592_868);
        assert_eq!(block_hashes(&tokens, 16), vec![17_863_182_269_597_592_868]);
    }

    #[test]
    fn chain_depends_on_every_earlier_block() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[3] = 999; // first block differs
        let ha = block_hashes(&a, 16);
        let hb = block_hashes(&b, 16);
        assert_eq!(ha.len(), 4);
        assert!(ha.iter().zip(&hb).all(|(x, y)| x != y));
        // Same first two blocks, different third: first two hashes agree, rest differ.
        let mut c = a.clone();
        c[40] = 7;
        let hc = block_hashes(&c, 16);
        assert_eq!(&ha[..2], &hc[..2]);
        assert_ne!(ha[2], hc[2]);
        assert_ne!(ha[3], hc[3]);
    }

    #[test]
    fn namespaces_separate_identical_tokens() {
        let t: Vec<u32> = (0..48).collect();
        let base = block_hashes(&t, 16);
        let x = namespace(Some(b"adapter-x"), None);
        let y = namespace(Some(b"adapter-y"), None);
        let salted = namespace(None, Some(b"adapter-x"));
        assert_eq!(namespace(None, None), BASE_NAMESPACE);
        assert_eq!(namespace(Some(b""), Some(b"")), BASE_NAMESPACE);
        // the adapter name and the salt are different parts, even with equal bytes
        assert!(x != y && x != salted && x != BASE_NAMESPACE);
        let hx = block_hashes_in(&t, 16, x);
        assert!(hx.iter().zip(&base).all(|(a, b)| a != b));
        assert_ne!(hx, block_hashes_in(&t, 16, y));
        // the first block is chained onto the namespace, the rest as usual
        assert_eq!(hx[0], chain_hash(x, local_hash(&le(&t[..16]))));
        assert_eq!(hx[1], chain_hash(hx[0], local_hash(&le(&t[16..32]))));
    }

    #[test]
    fn partial_block_is_not_hashed() {
        let t: Vec<u32> = (0..47).collect();
        assert_eq!(block_hashes(&t, 16).len(), 2);
        assert!(block_hashes(&t[..15], 16).is_empty());
    }

    #[test]
    fn published_vectors_hold() {
        let v: Vectors = serde_json::from_str(include_str!("../tests/vectors/block_hashes.json")).unwrap();
        assert_eq!(v.seed, HASH_SEED);
        assert!(v.cases.len() >= 4);
        assert!(v.cases.iter().any(|c| c.namespace.is_some()));
        for case in &v.cases {
            let ns = namespace(case.lora.as_deref().map(str::as_bytes), case.cache_salt.as_deref().map(str::as_bytes));
            assert_eq!(ns.to_string(), case.namespace.clone().unwrap_or_else(|| "0".into()), "{}", case.name);
            let seq = block_hashes_in(&case.tokens, case.block_size, ns);
            let seq: Vec<String> = seq.iter().map(u64::to_string).collect();
            assert_eq!(seq, case.seq_hashes, "{}", case.name);
            let local: Vec<String> =
                le(&case.tokens).chunks_exact(case.block_size * 4).map(|b| local_hash(b).to_string()).collect();
            assert_eq!(local, case.local_hashes, "{}", case.name);
        }
    }
}
