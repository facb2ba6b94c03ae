//! Where Envoy calls in: nothing may unwind out of a hook (a panic crossing into Envoy's
//! C++ aborts the whole proxy), so every hook runs its body through [`guard`].

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};

/// Panics caught at the boundary since the module was loaded; the sync service publishes it
/// as the gauge `kvroute.native_panics` ([`crate::bootstrap`]).
pub static PANICS: AtomicU64 = AtomicU64::new(0);

/// Runs a hook's body; a panic is logged, counted and turned into `fallback`, the answer
/// that lets the request (or Envoy) go on as if kvroute were not there.
pub fn guard<R>(hook: &'static str, fallback: R, body: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(r) => r,
        Err(payload) => {
            PANICS.fetch_add(1, Ordering::Relaxed);
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            log::error!("kvroute: panic in {hook}, caught at the module boundary: {what}");
            fallback
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_the_fallback_and_is_counted() {
        let before = PANICS.load(Ordering::Relaxed);
        assert_eq!(guard("test", 7, || -> u32 { panic!("boom") }), 7);
        assert_eq!(guard("test", 7, || 3), 3);
        assert_eq!(PANICS.load(Ordering::Relaxed), before + 1);
    }
}
