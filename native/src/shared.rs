//! Process-wide state: the in-process stores the sync service writes and the filters read,
//! one per name, as proxy-wasm keeps one shared-data map per `vm_id`. The bootstrap
//! extension's `extension_name` and the HTTP filter's `filter_name` play the `vm_id`'s part:
//! equal names share a store.
//!
//! The module is loaded once per process and never unloaded (see [`crate::pin`]), so these
//! statics outlive every configuration, as shared data outlives a wasm VM.

use kvroute::store::ProcessStore;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The name used when a configuration gives none (an empty `filter_name` or
/// `extension_name`).
pub const DEFAULT_NAME: &str = "kvroute";

/// A configuration's store name from Envoy's bytes: empty or not UTF-8 means the default.
pub fn name(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok("") | Err(_) => DEFAULT_NAME.to_string(),
        Ok(n) => n.to_string(),
    }
}

#[derive(Default)]
struct Registry {
    stores: HashMap<String, Arc<ProcessStore>>,
    /// Names a sync service (bootstrap extension) was configured under.
    synced: Vec<String>,
}

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    // Held only for a map lookup at configuration time (main thread), never on a request.
    REGISTRY.get_or_init(Mutex::default).lock().unwrap_or_else(|p| p.into_inner())
}

/// The store shared under `name`, made on first use.
pub fn store(name: &str) -> Arc<ProcessStore> {
    Arc::clone(registry().stores.entry(name.to_string()).or_default())
}

/// Notes that a sync service feeds the store under `name`.
pub fn mark_synced(name: &str) {
    let mut r = registry();
    if !r.synced.iter().any(|n| n == name) {
        r.synced.push(name.to_string());
    }
}

/// Whether a sync service was configured under `name` (bootstrap extensions are created
/// before any HTTP filter, so a filter configured without one will never see an index).
pub fn is_synced(name: &str) -> bool {
    registry().synced.iter().any(|n| n == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_default_and_stores_are_shared_by_name() {
        assert_eq!(name(b""), DEFAULT_NAME);
        assert_eq!(name(b"\xff"), DEFAULT_NAME);
        assert_eq!(name(b"tenant-a"), "tenant-a");
        assert!(std::sync::Arc::ptr_eq(&store("test-a"), &store("test-a")));
        assert!(!std::sync::Arc::ptr_eq(&store("test-a"), &store("test-b")));
        assert!(!is_synced("test-c"));
        mark_synced("test-c");
        assert!(is_synced("test-c") && !is_synced("test-a"));
    }
}
