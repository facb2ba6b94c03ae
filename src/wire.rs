//! What the wire codecs here share (the feed and shared-data decoders in this crate, the
//! sidecar's KV-event decoder, the mock engine's encoder): how much to reserve for a length
//! prefix, and the field order of vLLM's positional KV events.
//!
//! A count in a header is a claim, not a fact. Reserving `claimed × size_of::<T>()` up
//! front lets a few hostile bytes ask for gigabytes: a 64 MiB msgpack payload claiming 16M
//! events, each ~150 bytes decoded, is a 2.4 GB reservation that aborts a process under a
//! memory limit (or traps the wasm VM) before the first element fails to decode. So a
//! decoder reserves at most what the bytes present can hold, and never more memory than
//! those bytes themselves; a `Vec` then grows only with elements actually decoded.

/// Elements of `T` to reserve for a length prefix claiming `claimed` of them, with
/// `remaining` bytes left of which each element takes at least `min_encoded`: no more than
/// the remaining bytes can encode, and at most `remaining` bytes of memory.
pub fn capacity_for<T>(claimed: usize, remaining: usize, min_encoded: usize) -> usize {
    let per_element = min_encoded.max(std::mem::size_of::<T>()).max(1);
    claimed.min(remaining / per_element)
}

/// vLLM's `BlockStored` fields in declaration order, as its positional (`array_like`) events
/// list them after the tag. Every release only appended: 0.9 the first five, 0.10.2
/// `medium`, 0.14 `lora_name`, 0.17 `extra_keys`, 0.20 `group_idx`, 0.22 the spec kind and
/// window (0.24 made events maps; later fields exist only there). From `extra_keys` on they
/// default to `None`.
pub const VLLM_BLOCK_STORED_FIELDS: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];

/// vLLM's `BlockRemoved` fields, likewise (0.10.2 `medium`, 0.20 `group_idx`).
pub const VLLM_BLOCK_REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn a_claim_is_bounded_by_the_bytes_present_and_their_size() {
        // 32-byte elements encoded in >= 5 bytes: 64 MiB can encode 13M of them, but only
        // 2M fit in 64 MiB of memory.
        assert_eq!(capacity_for::<[u8; 32]>(usize::MAX, 64 << 20, 5), (64 << 20) / 32);
        // Small elements: the encoding bounds it.
        assert_eq!(capacity_for::<u8>(1000, 100, 4), 25);
        // An honest claim is kept.
        assert_eq!(capacity_for::<u64>(10, 80, 1), 10);
        // Zero-sized elements and a zero minimum do not divide by zero.
        assert_eq!(capacity_for::<()>(7, 3, 0), 3);
        assert_eq!(capacity_for::<u64>(7, 0, 1), 0);
    }
}
