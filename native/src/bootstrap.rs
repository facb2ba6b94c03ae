//! The bootstrap extension (`envoy.bootstrap.dynamic_modules`): the sync service
//! ([`kvroute::sync::SyncService`]) on Envoy's main thread, as the wasm build's
//! `kvroute-sync` singleton. It long-polls the sidecar through Envoy's cluster (a callout
//! answered on the main thread, never a blocking call) and writes the index into the
//! in-process store of its `extension_name` ([`crate::shared`]), which the HTTP filters of
//! the same `filter_name` route over.
//!
//! All 17 hooks run on the main thread; the 1.40 loader requires every one of them.

use crate::abi::{self, http_callout_init_result, http_callout_result};
use crate::abi::{
    BootstrapExtensionConfigEnvoyPtr, BootstrapExtensionConfigModulePtr, BootstrapExtensionEnvoyPtr,
    BootstrapExtensionModulePtr, BootstrapExtensionTimerModulePtr, EnvoyBuffer, EnvoyHttpHeader, EventCb,
    HttpCalloutResult, ModuleBuffer,
};
use crate::boundary::{guard, PANICS};
use crate::buffers::{array, bytes, header_value, lend, lend_header};
use crate::{clock, envoy_log, shared};
use kvroute::host::{Clock, FeedClient, Gauge, Host, SidecarCall, StatId, StatKind, Stats};
use kvroute::store::ProcessStore;
use kvroute::sync::{SyncService, TICK, WORKER_GAUGES};
use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The label of the per-worker load gauges: Envoy freezes stat definitions once the
/// configuration is created, before any worker is known, so each is one gauge labelled
/// by worker (`kvroute.active_blocks` with `worker=10.0.0.1:8000`), not one per name.
const WORKER_LABEL: &str = "worker";

/// A stat of the sync service: kind, Envoy's id, and the worker label's value if any.
struct SyncStat {
    kind: StatKind,
    envoy_id: usize,
    worker: Option<String>,
}

/// The sync service's host: the main thread's view of Envoy.
pub struct SyncHost {
    envoy: BootstrapExtensionConfigEnvoyPtr,
    store: Arc<ProcessStore>,
    stats: RefCell<Vec<SyncStat>>,
    /// The labelled per-worker gauges, by name: Envoy's id.
    worker_gauges: Vec<(&'static str, usize)>,
}

impl SyncHost {
    fn define(&self, kind: StatKind, name: &str, labels: &[&str]) -> Option<usize> {
        let mut names: Vec<ModuleBuffer> = labels.iter().map(|l| lend(l.as_bytes())).collect();
        let mut id = 0usize;
        // SAFETY: the configuration pointer is live; the buffers are lent for the call.
        let result = unsafe {
            let define = match kind {
                StatKind::Counter => abi::envoy_dynamic_module_callback_bootstrap_extension_config_define_counter,
                StatKind::Gauge => abi::envoy_dynamic_module_callback_bootstrap_extension_config_define_gauge,
            };
            define(self.envoy, lend(name.as_bytes()), names.as_mut_ptr(), names.len(), &mut id)
        };
        if result != abi::metrics_result::SUCCESS {
            log::warn!("kvroute-sync: Envoy refused to define stat {name} (result {result})");
            return None;
        }
        Some(id)
    }

    fn push(&self, stat: SyncStat) -> StatId {
        let mut stats = self.stats.borrow_mut();
        stats.push(stat);
        StatId(stats.len() as u32 - 1)
    }

    /// Runs `update(envoy_id, labels, n_labels)` for a defined stat.
    fn update(&self, id: StatId, kind: StatKind, update: impl FnOnce(usize, *mut ModuleBuffer, usize)) {
        let stats = self.stats.borrow();
        let Some(stat) = stats.get(id.0 as usize).filter(|s| s.kind == kind) else { return };
        match &stat.worker {
            Some(w) => {
                let mut label = [lend(w.as_bytes())];
                update(stat.envoy_id, label.as_mut_ptr(), 1);
            }
            None => update(stat.envoy_id, std::ptr::null_mut(), 0),
        }
    }
}

impl Host for SyncHost {
    type Store = ProcessStore;
    fn store(&self) -> &ProcessStore {
        &self.store
    }
}

impl Clock for SyncHost {
    fn now_ms(&self) -> u64 {
        clock::now_ms()
    }
}

impl Stats for SyncHost {
    fn define_stat(&self, kind: StatKind, name: &str) -> Option<StatId> {
        let envoy_id = self.define(kind, name, &[])?;
        Some(self.push(SyncStat { kind, envoy_id, worker: None }))
    }
    fn define_worker_gauge(&self, name: &str, worker: &str) -> Option<StatId> {
        let envoy_id = self.worker_gauges.iter().find(|(n, _)| *n == name)?.1;
        Some(self.push(SyncStat { kind: StatKind::Gauge, envoy_id, worker: Some(worker.to_string()) }))
    }
    fn add_to_counter(&self, id: StatId, n: u64) {
        self.update(id, StatKind::Counter, |envoy_id, labels, n_labels| {
            // SAFETY: main thread, live configuration, labels lent for the call.
            unsafe {
                abi::envoy_dynamic_module_callback_bootstrap_extension_config_increment_counter(
                    self.envoy, envoy_id, labels, n_labels, n,
                )
            };
        });
    }
    fn set_gauge(&self, id: StatId, value: u64) {
        self.update(id, StatKind::Gauge, |envoy_id, labels, n_labels| {
            // SAFETY: as add_to_counter.
            unsafe {
                abi::envoy_dynamic_module_callback_bootstrap_extension_config_set_gauge(
                    self.envoy, envoy_id, labels, n_labels, value,
                )
            };
        });
    }
}

impl FeedClient for SyncHost {
    fn dispatch(&self, r: &SidecarCall<'_>) -> Result<u64, String> {
        let mut headers = vec![
            lend_header(":method", r.method),
            lend_header(":path", r.path),
            lend_header("host", r.authority),
            lend_header("accept", r.accept),
        ];
        if r.body.is_some() {
            headers.push(lend_header("content-type", "application/json"));
        }
        let mut id = 0u64;
        // SAFETY: main thread (the timer and callout hooks), live configuration; Envoy
        // copies the headers.
        let result = unsafe {
            abi::envoy_dynamic_module_callback_bootstrap_extension_http_callout(
                self.envoy,
                &mut id,
                lend(r.cluster.as_bytes()),
                headers.as_mut_ptr(),
                headers.len(),
                r.body.map_or(ModuleBuffer { ptr: std::ptr::null(), length: 0 }, lend),
                r.timeout.as_millis() as u64,
            )
        };
        match result {
            http_callout_init_result::SUCCESS => Ok(id),
            http_callout_init_result::CLUSTER_NOT_FOUND => Err(format!("no cluster named {:?}", r.cluster)),
            http_callout_init_result::MISSING_REQUIRED_HEADERS => Err("missing required headers".into()),
            other => Err(format!("callout refused (result {other})")),
        }
    }
}

/// One bootstrap extension configuration: the sync service and its tick.
struct SyncExtension {
    service: RefCell<SyncService<SyncHost>>,
    timer: BootstrapExtensionTimerModulePtr,
    panics: Gauge,
}

/// # Safety
/// `ptr` is a pointer `config_new` returned and `config_destroy` has not freed; main thread.
unsafe fn extension<'a>(ptr: BootstrapExtensionConfigModulePtr) -> Option<&'a SyncExtension> {
    // SAFETY: per the contract.
    unsafe { ptr.cast::<SyncExtension>().as_ref() }
}

/// # Safety
/// Envoy's hook: main thread, buffers valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_config_new(
    envoy: BootstrapExtensionConfigEnvoyPtr,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> BootstrapExtensionConfigModulePtr {
    guard("bootstrap_extension_config_new", std::ptr::null(), || {
        envoy_log::follow_envoy_level();
        // SAFETY: Envoy's buffers are valid during this call.
        let (name, config) = unsafe { (bytes(name), bytes(config)) };
        let name = shared::name(name);
        if shared::is_synced(&name) {
            log::error!(
                "kvroute-sync: a sync extension named {name:?} already runs in this Envoy; refusing a second \
                 (give each kvroute deployment its own extension_name and filter_name)"
            );
            return std::ptr::null();
        }
        let mut host =
            SyncHost { envoy, store: shared::store(&name), stats: RefCell::default(), worker_gauges: vec![] };
        for gauge in WORKER_GAUGES {
            if let Some(id) = host.define(StatKind::Gauge, gauge, &[WORKER_LABEL]) {
                host.worker_gauges.push((gauge, id));
            }
        }
        let panics = Gauge::define(&host, "kvroute.native_panics");
        // Gateway names differ per Envoy, also between containers whose Envoy is process 1
        // and starts in the same millisecond: the seed is the OS's randomness.
        let seed = crate::clock::random_seed();
        let service = match SyncService::configure(host, config, seed) {
            Ok(s) => s,
            Err(e) => {
                log::error!("kvroute-sync: refusing configuration: {e}");
                return std::ptr::null();
            }
        };
        shared::mark_synced(&name);
        // SAFETY: main thread, live configuration.
        let timer = unsafe { abi::envoy_dynamic_module_callback_bootstrap_extension_timer_new(envoy) };
        if timer.is_null() {
            log::error!("kvroute-sync: Envoy gave no timer");
            return std::ptr::null();
        }
        // SAFETY: main thread; the timer is ours until config_destroy deletes it.
        unsafe {
            abi::envoy_dynamic_module_callback_bootstrap_extension_timer_enable(timer, TICK.as_millis() as u64);
            // Traffic is not held for the first sync: until the index arrives the filters
            // route by load, as the wasm build's do.
            abi::envoy_dynamic_module_callback_bootstrap_extension_config_signal_init_complete(envoy);
        }
        let ext = SyncExtension { service: RefCell::new(service), timer, panics };
        Box::into_raw(Box::new(ext)).cast()
    })
}

/// # Safety
/// Envoy's hook: main thread, a pointer `config_new` returned, destroyed once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_config_destroy(
    module: BootstrapExtensionConfigModulePtr,
) {
    guard("bootstrap_extension_config_destroy", (), || {
        if module.is_null() {
            return;
        }
        // SAFETY: per the contract; freed here, once.
        let ext = unsafe { Box::from_raw(module as *mut SyncExtension) };
        // SAFETY: main thread, our timer.
        unsafe { abi::envoy_dynamic_module_callback_bootstrap_extension_timer_delete(ext.timer) };
    })
}

/// # Safety
/// Envoy's hook: main thread, live pointers.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_timer_fired(
    _envoy: BootstrapExtensionConfigEnvoyPtr,
    module: BootstrapExtensionConfigModulePtr,
    timer: BootstrapExtensionTimerModulePtr,
) {
    guard("bootstrap_extension_timer_fired", (), || {
        // SAFETY: per the hook's contract.
        let Some(ext) = (unsafe { extension(module) }) else { return };
        if let Ok(mut service) = ext.service.try_borrow_mut() {
            service.on_tick();
            ext.panics.set(service.host(), PANICS.load(Ordering::Relaxed));
        }
    });
    // Re-armed even after a panic: the feed must keep flowing.
    // SAFETY: main thread, our timer.
    unsafe { abi::envoy_dynamic_module_callback_bootstrap_extension_timer_enable(timer, TICK.as_millis() as u64) };
}

/// # Safety
/// Envoy's hook: main thread; headers and body chunks valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_http_callout_done(
    _envoy: BootstrapExtensionConfigEnvoyPtr,
    module: BootstrapExtensionConfigModulePtr,
    callout_id: u64,
    result: HttpCalloutResult,
    headers: *mut EnvoyHttpHeader,
    headers_size: usize,
    body_chunks: *mut EnvoyBuffer,
    body_chunks_size: usize,
) {
    guard("bootstrap_extension_http_callout_done", (), || {
        // SAFETY: per the hook's contract.
        let Some(ext) = (unsafe { extension(module) }) else { return };
        // SAFETY: Envoy's arrays and buffers, valid during this call.
        let (headers, chunks) = unsafe { (array(headers, headers_size), array(body_chunks, body_chunks_size)) };
        let status = if result == http_callout_result::SUCCESS {
            // SAFETY: as above.
            unsafe { header_value(headers, ":status") }
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(|v| v.parse().ok())
        } else {
            None
        };
        let body_size = chunks.iter().map(|c| c.length).sum();
        let read_body = || {
            let mut body = Vec::with_capacity(body_size);
            for c in chunks {
                // SAFETY: as above.
                body.extend_from_slice(unsafe { bytes(*c) });
            }
            Some(body)
        };
        match ext.service.try_borrow_mut() {
            Ok(mut service) => service.on_response(callout_id, status, body_size, read_body),
            // Answered inside our own dispatch: the poll times out and is sent again.
            Err(_) => log::warn!("kvroute-sync: a feed answer arrived re-entrantly and was dropped"),
        }
    })
}

// The rest of the 17 hooks the loader requires: the extension object is the configuration
// (one sync service per configuration), and server, worker, drain, file, cluster, listener
// and admin events need nothing of it.

/// # Safety
/// Envoy's hook; returns the configuration pointer as the extension (never null, which
/// would reject the extension), freed by `config_destroy`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_new(
    module: BootstrapExtensionConfigModulePtr,
    _envoy: BootstrapExtensionEnvoyPtr,
) -> BootstrapExtensionModulePtr {
    module
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_server_initialized(
    _: BootstrapExtensionEnvoyPtr,
    _: BootstrapExtensionModulePtr,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_worker_thread_initialized(
    _: BootstrapExtensionEnvoyPtr,
    _: BootstrapExtensionModulePtr,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_drain_started(
    _: BootstrapExtensionEnvoyPtr,
    _: BootstrapExtensionModulePtr,
) {
}

/// # Safety
/// Envoy's hook: calls the completion callback exactly once, as Envoy requires.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_shutdown(
    _: BootstrapExtensionEnvoyPtr,
    _: BootstrapExtensionModulePtr,
    completion: EventCb,
    context: *mut c_void,
) {
    if let Some(done) = completion {
        // SAFETY: Envoy's callback with its own context.
        unsafe { done(context) };
    }
}

/// # Safety
/// Envoy's hook; the extension is the configuration, freed by `config_destroy`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_destroy(_: BootstrapExtensionModulePtr) {}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_config_scheduled(
    _: BootstrapExtensionConfigEnvoyPtr,
    _: BootstrapExtensionConfigModulePtr,
    _event_id: u64,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_file_changed(
    _: BootstrapExtensionConfigEnvoyPtr,
    _: BootstrapExtensionConfigModulePtr,
    _path: EnvoyBuffer,
    _events: u32,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_cluster_add_or_update(
    _: BootstrapExtensionConfigEnvoyPtr,
    _: BootstrapExtensionConfigModulePtr,
    _cluster_name: EnvoyBuffer,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_cluster_removal(
    _: BootstrapExtensionConfigEnvoyPtr,
    _: BootstrapExtensionConfigModulePtr,
    _cluster_name: EnvoyBuffer,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_listener_add_or_update(
    _: BootstrapExtensionConfigEnvoyPtr,
    _: BootstrapExtensionConfigModulePtr,
    _listener_name: EnvoyBuffer,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_listener_removal(
    _: BootstrapExtensionConfigEnvoyPtr,
    _: BootstrapExtensionConfigModulePtr,
    _listener_name: EnvoyBuffer,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced. kvroute serves no admin path of its own: the
/// sidecar's admin API has the state.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_bootstrap_extension_admin_request(
    _: BootstrapExtensionConfigEnvoyPtr,
    _: BootstrapExtensionConfigModulePtr,
    _method: EnvoyBuffer,
    _path: EnvoyBuffer,
    _body: EnvoyBuffer,
) -> u32 {
    404
}
