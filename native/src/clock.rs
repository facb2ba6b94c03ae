//! The wall clock, as proxy-wasm's `get_current_time` gives it to the wasm build, and the
//! entropy the core is seeded with.

use std::hash::{BuildHasher, RandomState};
use std::time::{SystemTime, UNIX_EPOCH};

/// 64 random bits: std's hasher keys come from the OS's randomness (once per thread).
pub fn random_seed() -> u64 {
    RandomState::new().hash_one(now_ms())
}

/// Milliseconds since the Unix epoch; 0 if the system clock is before it (the core reads 0
/// as "no time": entries look old, the safe side).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
