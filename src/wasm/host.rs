//! Host calls that cannot panic: every error becomes a value the caller handles.

use crate::store::{SharedStore, StoreError, Versioned};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
use std::time::UNIX_EPOCH;

pub fn property_string(path: &[&str]) -> Option<String> {
    let bytes = hostcalls::get_property(path.to_vec()).ok()??;
    String::from_utf8(bytes).ok()
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

/// Wall-clock milliseconds (0 if the host will not say: entries then look old, which is
/// the safe side: predictions expire, nothing is held longer than asked).
pub fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub fn request_header(name: &str) -> Option<Vec<u8>> {
    hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name).ok().flatten()
}

pub fn set_request_header(name: &str, value: &str) -> bool {
    hostcalls::set_map_value_bytes(MapType::HttpRequestHeaders, name, Some(value.as_bytes())).is_ok()
}

pub fn remove_request_header(name: &str) -> bool {
    hostcalls::remove_map_value(MapType::HttpRequestHeaders, name).is_ok()
}

pub fn add_response_header(name: &str, value: &str) -> bool {
    hostcalls::add_map_value_bytes(MapType::HttpResponseHeaders, name, value.as_bytes()).is_ok()
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

/// An Envoy stat defined by the plugin. A metric the host refused is a no-op, not an error
/// on every request.
#[derive(Clone, Copy)]
pub struct Metric(Option<u32>);

impl Metric {
    pub fn counter(name: &str) -> Metric {
        Metric(hostcalls::define_metric(MetricType::Counter, name).ok())
    }
    pub fn gauge(name: &str) -> Metric {
        Metric(hostcalls::define_metric(MetricType::Gauge, name).ok())
    }
    pub fn add(self, n: u64) {
        if let (Some(id), true) = (self.0, n > 0) {
            let _ = hostcalls::increment_metric(id, n.min(i64::MAX as u64) as i64);
        }
    }
    pub fn inc(self) {
        self.add(1);
    }
    pub fn set(self, v: u64) {
        if let Some(id) = self.0 {
            let _ = hostcalls::record_metric(id, v);
        }
    }
}

/// A counter whose increments collect in the VM and reach the host on [`flush`]: one host
/// call per flush instead of one per request and counter.
///
/// [`flush`]: BatchedCounter::flush
pub struct BatchedCounter {
    metric: Metric,
    pending: std::cell::Cell<u64>,
}

impl BatchedCounter {
    pub fn new(name: &str) -> BatchedCounter {
        BatchedCounter { metric: Metric::counter(name), pending: std::cell::Cell::new(0) }
    }
    pub fn add(&self, n: u64) {
        self.pending.set(self.pending.get().saturating_add(n));
    }
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn flush(&self) {
        self.metric.add(self.pending.replace(0));
    }
}
