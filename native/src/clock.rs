//! The wall clock, as proxy-wasm's `get_current_time` gives it to the wasm build.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch; 0 if the system clock is before it (the core reads 0
/// as "no time": entries look old, the safe side).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
