//! The core's host traits over proxy-wasm host calls. None of them panics: the SDK's trait
//! helpers panic on unexpected statuses, and a panic kills the VM, so every call here goes
//! to `hostcalls` and turns an error into a value.

use kvroute_core::host::{Clock, FeedClient, Host, RequestHeaders, SidecarCall, StatId, StatKind, Stats};
use kvroute_core::store::{SharedStore, StoreError, Versioned};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
use std::time::{Duration, UNIX_EPOCH};

pub fn property_string(path: &[&str]) -> Option<String> {
    let bytes = hostcalls::get_property(path.to_vec()).ok()??;
    String::from_utf8(bytes).ok()
}

/// Entropy for a root context: the clock in nanoseconds and Envoy's node id. The sync
/// service names its gateway from it, so replicas that start in the same millisecond from
/// the same configuration (a Deployment's pods) still get names of their own; the node id
/// differs per pod under Istio, the nanoseconds elsewhere.
pub fn seed() -> u64 {
    let nanos = since_epoch().map_or(0, |d| d.as_nanos() as u64);
    let node = hostcalls::get_property(vec!["node", "id"]).ok().flatten().unwrap_or_default();
    nanos ^ xxhash_rust::xxh3::xxh3_64(&node)
}

/// Envoy's wall clock; `None` before the epoch or if the host will not say.
fn since_epoch() -> Option<Duration> {
    hostcalls::get_current_time().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok())
}

pub fn plugin_configuration(size: usize) -> Vec<u8> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size).ok().flatten().unwrap_or_default()
}

pub fn http_call_body(size: usize) -> Option<Vec<u8>> {
    hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size).ok().flatten()
}

pub fn http_call_status() -> Option<u32> {
    let v = hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status").ok()??;
    std::str::from_utf8(&v).ok()?.parse().ok()
}

pub fn add_response_header(name: &str, value: &str) {
    let _ = hostcalls::add_map_value_bytes(MapType::HttpResponseHeaders, name, value.as_bytes());
}

/// The VM's host: shared data of this VM's `vm_id`, Envoy's clock and stats, its HTTP
/// calls.
pub struct WasmHost;

impl Host for WasmHost {
    type Store = HostStore;
    fn store(&self) -> &HostStore {
        &HostStore
    }
}

impl Clock for WasmHost {
    fn now_ms(&self) -> u64 {
        since_epoch().map_or(0, |d| d.as_millis() as u64)
    }
}

impl Stats for WasmHost {
    fn define_stat(&self, kind: StatKind, name: &str) -> Option<StatId> {
        let kind = match kind {
            StatKind::Counter => MetricType::Counter,
            StatKind::Gauge => MetricType::Gauge,
        };
        hostcalls::define_metric(kind, name).ok().map(StatId)
    }
    fn add_to_counter(&self, id: StatId, n: u64) {
        let _ = hostcalls::increment_metric(id.0, n.min(i64::MAX as u64) as i64);
    }
    fn set_gauge(&self, id: StatId, value: u64) {
        let _ = hostcalls::record_metric(id.0, value);
    }
}

impl FeedClient for WasmHost {
    fn dispatch(&self, r: &SidecarCall<'_>) -> Result<u64, String> {
        let mut headers =
            vec![(":method", r.method), (":path", r.path), (":authority", r.authority), ("accept", r.accept)];
        if r.body.is_some() {
            headers.push(("content-type", "application/json"));
        }
        hostcalls::dispatch_http_call(r.cluster, headers, r.body, vec![], r.timeout)
            .map(u64::from)
            .map_err(|s| format!("{s:?}"))
    }
}

/// proxy-wasm shared data of this VM's `vm_id`.
pub struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Result<Versioned, StoreError> {
        hostcalls::get_shared_data(key).map_err(|s| StoreError::Other(format!("{s:?}")))
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(s) => Err(StoreError::Other(format!("{s:?}"))),
        }
    }
}

/// The current stream's request headers.
pub struct StreamRequestHeaders;

impl RequestHeaders for StreamRequestHeaders {
    fn get(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name).ok().flatten()
    }
    fn set(&mut self, name: &str, value: &str) {
        let _ = hostcalls::set_map_value_bytes(MapType::HttpRequestHeaders, name, Some(value.as_bytes()));
    }
    fn remove(&mut self, name: &str) {
        let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, name);
    }
}
