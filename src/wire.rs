//! What every wire decoder here shares (the feed and shared-data decoders in this crate, the
//! sidecar's msgpack event decoder): how much to reserve for a length prefix.
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
