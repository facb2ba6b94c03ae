//! The HTTP filter (`envoy.extensions.filters.http.dynamic_modules`) over
//! [`kvroute::filter::Filter`]: the same JSON configuration, headers, fallbacks and stats
//! as the wasm filter.
//!
//! Envoy creates the configuration on the main thread and runs each stream on one worker
//! thread. The core's filter keeps per-thread scratch state, so each worker thread gets
//! its own [`Filter`] of a configuration, made on the thread's first stream; all of them
//! route over the one in-process store the sync service writes ([`crate::shared`]), so
//! in-flight accounting is exact across threads as proxy-wasm shared data makes it.
//!
//! Stats are defined with Envoy while the configuration is created (Envoy refuses
//! definitions later), by configuring the core's filter once on the main thread; the
//! worker threads' filters find the ids by name.

use crate::abi::{self, body_status, headers_status, http_body_type, http_header_type, trailers_status};
use crate::abi::{
    EnvoyBuffer, EnvoyHttpHeader, HttpCalloutResult, HttpFilterConfigEnvoyPtr, HttpFilterConfigModulePtr,
    HttpFilterEnvoyPtr, HttpFilterModulePtr, HttpStreamResetReason,
};
use crate::boundary::guard;
use crate::buffers::{bytes, lend};
use crate::{clock, envoy_log, shared};
use kvroute::filter::{Filter, Stream};
use kvroute::host::{Clock, Host, RequestHeaders, StatId, StatKind, Stats};
use kvroute::store::ProcessStore;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Envoy's configuration object. Stat updates through it are safe from any thread: the ids
/// are fixed once the configuration is created and Envoy's stats are atomic.
#[derive(Clone, Copy)]
struct EnvoyConfig(HttpFilterConfigEnvoyPtr);
// SAFETY: used only for stat updates, which Envoy allows from every thread (above).
unsafe impl Send for EnvoyConfig {}
// SAFETY: as above.
unsafe impl Sync for EnvoyConfig {}

/// A stat the core defined: its name, kind and Envoy's id.
type DefinedStat = (String, StatKind, usize);

/// One filter configuration (`on_http_filter_config_new`), shared by the worker threads'
/// filters.
pub struct HttpConfig {
    envoy: EnvoyConfig,
    /// The validated plugin configuration, configured again on each worker thread.
    json: Vec<u8>,
    store: Arc<ProcessStore>,
    stats: Vec<DefinedStat>,
    /// Set when Envoy destroys the configuration: worker threads drop their filter of it.
    destroyed: AtomicBool,
}

/// The host of a worker thread's filter.
pub struct WorkerHost {
    config: Arc<HttpConfig>,
}

impl Host for WorkerHost {
    type Store = ProcessStore;
    fn store(&self) -> &ProcessStore {
        &self.config.store
    }
    fn ticks(&self) -> bool {
        false
    }
    fn overrides_upstream(&self) -> bool {
        true
    }
}

impl Clock for WorkerHost {
    fn now_ms(&self) -> u64 {
        clock::now_ms()
    }
}

impl Stats for WorkerHost {
    fn define_stat(&self, kind: StatKind, name: &str) -> Option<StatId> {
        let i = self.config.stats.iter().position(|(n, k, _)| n == name && *k == kind)?;
        Some(StatId(i as u32))
    }
    fn add_to_counter(&self, id: StatId, n: u64) {
        if let Some((_, _, envoy_id)) = self.config.stats.get(id.0 as usize) {
            // SAFETY: the configuration outlives its filters' streams; no labels.
            unsafe {
                abi::envoy_dynamic_module_callback_http_filter_config_increment_counter(
                    self.config.envoy.0,
                    *envoy_id,
                    std::ptr::null_mut(),
                    0,
                    n,
                )
            };
        }
    }
    fn set_gauge(&self, id: StatId, value: u64) {
        if let Some((_, _, envoy_id)) = self.config.stats.get(id.0 as usize) {
            // SAFETY: as add_to_counter.
            unsafe {
                abi::envoy_dynamic_module_callback_http_filter_config_set_gauge(
                    self.config.envoy.0,
                    *envoy_id,
                    std::ptr::null_mut(),
                    0,
                    value,
                )
            };
        }
    }
}

/// The host of the filter configured once in `on_http_filter_config_new`: it validates the
/// configuration and defines every stat with Envoy; it never routes.
struct DefiningHost {
    envoy: HttpFilterConfigEnvoyPtr,
    store: Arc<ProcessStore>,
    stats: RefCell<Vec<DefinedStat>>,
}

impl Host for DefiningHost {
    type Store = ProcessStore;
    fn store(&self) -> &ProcessStore {
        &self.store
    }
    fn ticks(&self) -> bool {
        false
    }
    fn overrides_upstream(&self) -> bool {
        true
    }
}

impl Clock for DefiningHost {
    fn now_ms(&self) -> u64 {
        clock::now_ms()
    }
}

impl Stats for DefiningHost {
    fn define_stat(&self, kind: StatKind, name: &str) -> Option<StatId> {
        let mut id = 0usize;
        // SAFETY: called inside on_http_filter_config_new, with Envoy's live config pointer.
        let result = unsafe {
            let define = match kind {
                StatKind::Counter => abi::envoy_dynamic_module_callback_http_filter_config_define_counter,
                StatKind::Gauge => abi::envoy_dynamic_module_callback_http_filter_config_define_gauge,
            };
            define(self.envoy, lend(name.as_bytes()), std::ptr::null_mut(), 0, &mut id)
        };
        if result != abi::metrics_result::SUCCESS {
            log::warn!("kvroute: Envoy refused to define stat {name} (result {result})");
            return None;
        }
        let mut stats = self.stats.borrow_mut();
        stats.push((name.to_string(), kind, id));
        Some(StatId(stats.len() as u32 - 1))
    }
    fn add_to_counter(&self, _: StatId, _: u64) {}
    fn set_gauge(&self, _: StatId, _: u64) {}
}

/// The request headers of the stream being routed.
struct EnvoyRequestHeaders(HttpFilterEnvoyPtr);

impl RequestHeaders for EnvoyRequestHeaders {
    fn get(&self, name: &str) -> Option<Vec<u8>> {
        let mut value = EnvoyBuffer { ptr: std::ptr::null(), length: 0 };
        // SAFETY: called from a stream hook with its filter pointer; the value is copied
        // before any setter could invalidate it.
        unsafe {
            let found = abi::envoy_dynamic_module_callback_http_get_header(
                self.0,
                http_header_type::REQUEST_HEADER,
                lend(name.as_bytes()),
                &mut value,
                0,
                std::ptr::null_mut(),
            );
            (found && !value.ptr.is_null()).then(|| bytes(value).to_vec())
        }
    }
    fn set(&mut self, name: &str, value: &str) {
        // An empty value would remove the header (the ABI's only remove).
        if value.is_empty() {
            return;
        }
        // SAFETY: as get; Envoy copies both buffers.
        unsafe {
            abi::envoy_dynamic_module_callback_http_set_header(
                self.0,
                http_header_type::REQUEST_HEADER,
                lend(name.as_bytes()),
                lend(value.as_bytes()),
            )
        };
    }
    fn remove(&mut self, name: &str) {
        // SAFETY: as get; a null value removes every value of the header.
        unsafe {
            abi::envoy_dynamic_module_callback_http_set_header(
                self.0,
                http_header_type::REQUEST_HEADER,
                lend(name.as_bytes()),
                abi::ModuleBuffer { ptr: std::ptr::null(), length: 0 },
            )
        };
    }
}

type SharedFilter = Rc<RefCell<Filter<WorkerHost>>>;

thread_local! {
    /// This worker thread's filter of each live configuration.
    static FILTERS: RefCell<Vec<SharedFilter>> = const { RefCell::new(Vec::new()) };
}

/// This thread's filter of `config`, configured on first use.
fn thread_filter(config: &Arc<HttpConfig>) -> Option<SharedFilter> {
    FILTERS.with(|filters| {
        let mut filters = filters.try_borrow_mut().ok()?;
        // A destroyed configuration's filter holds nothing: each stream released its
        // blocks when it ended.
        filters.retain(|f| f.try_borrow().map(|f| !f.host().config.destroyed.load(Ordering::Acquire)).unwrap_or(true));
        if let Some(f) = filters.iter().find(|f| f.try_borrow().is_ok_and(|f| Arc::ptr_eq(&f.host().config, config))) {
            return Some(Rc::clone(f));
        }
        // Tie-breaks differ per thread and per Envoy.
        match Filter::configure(WorkerHost { config: Arc::clone(config) }, &config.json, clock::random_seed()) {
            Ok(f) => {
                let f = Rc::new(RefCell::new(f));
                filters.push(Rc::clone(&f));
                Some(f)
            }
            Err(e) => {
                // Validated on the main thread already: not expected, but never fatal.
                log::error!("kvroute: worker thread cannot configure the filter: {e}");
                None
            }
        }
    })
}

/// One stream: its thread's filter (none if it could not be configured: the stream then
/// passes untouched, routed by the cluster's own policy) and the core's stream state.
struct StreamContext {
    filter: Option<SharedFilter>,
    state: Stream,
}

impl StreamContext {
    fn end(&mut self) {
        if let Some(mut f) = self.filter.as_ref().and_then(|f| f.try_borrow_mut().ok()) {
            f.on_stream_end(&mut self.state);
        }
    }
}

/// # Safety
/// `ptr` must be a pointer [`envoy_dynamic_module_on_http_filter_new`] returned and
/// [`envoy_dynamic_module_on_http_filter_destroy`] has not freed.
unsafe fn stream<'a>(ptr: HttpFilterModulePtr) -> Option<&'a mut StreamContext> {
    // SAFETY: per the contract; Envoy calls a stream's hooks one at a time on its thread.
    unsafe { (ptr as *mut StreamContext).as_mut() }
}

/// # Safety
/// Called by Envoy on the main thread with its configuration pointer and buffers valid for
/// the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: HttpFilterConfigEnvoyPtr,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> HttpFilterConfigModulePtr {
    guard("http_filter_config_new", std::ptr::null(), || {
        envoy_log::follow_envoy_level();
        // SAFETY: Envoy's buffers are valid during this call; both are copied.
        let (name, json) = unsafe { (shared::name(bytes(name)), bytes(config).to_vec()) };
        let store = shared::store(&name);
        let host = DefiningHost { envoy, store: Arc::clone(&store), stats: RefCell::default() };
        let probe = match Filter::configure(host, &json, 0) {
            Ok(f) => f,
            Err(e) => {
                log::error!("kvroute: refusing filter configuration: {e}");
                return std::ptr::null();
            }
        };
        if !shared::is_synced(&name) {
            log::warn!(
                "kvroute: no kvroute bootstrap extension has extension_name {name:?}: this filter will route \
                 by load only (filter_name and extension_name must match, as the wasm build's vm_id)"
            );
        }
        let stats = probe.host().stats.take();
        let config = HttpConfig { envoy: EnvoyConfig(envoy), json, store, stats, destroyed: AtomicBool::new(false) };
        Arc::into_raw(Arc::new(config)).cast()
    })
}

/// # Safety
/// `config` is a pointer `on_http_filter_config_new` returned, destroyed once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: HttpFilterConfigModulePtr) {
    guard("http_filter_config_destroy", (), || {
        if config.is_null() {
            return;
        }
        // SAFETY: per the contract, this is the reference config_new handed out.
        let config = unsafe { Arc::from_raw(config.cast::<HttpConfig>()) };
        config.destroyed.store(true, Ordering::Release);
    })
}

/// # Safety
/// Called on a worker thread with a live configuration pointer.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: HttpFilterConfigModulePtr,
    _envoy: HttpFilterEnvoyPtr,
) -> HttpFilterModulePtr {
    let filter = guard("http_filter_new", None, || {
        let ptr = config.cast::<HttpConfig>();
        if ptr.is_null() {
            return None;
        }
        // SAFETY: Envoy holds the configuration alive while it makes streams of it; take
        // a counted reference of our own for the thread's filter.
        let config = unsafe {
            Arc::increment_strong_count(ptr);
            Arc::from_raw(ptr)
        };
        thread_filter(&config)
    });
    // Never null (that would close the stream): a stream without a filter passes untouched.
    Box::into_raw(Box::new(StreamContext { filter, state: Stream::default() })).cast()
}

/// # Safety
/// Envoy's stream hooks: live pointers from `on_http_filter_new`, on the stream's thread.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: HttpFilterEnvoyPtr,
    module: HttpFilterModulePtr,
    _end_of_stream: bool,
) -> u32 {
    guard("http_filter_request_headers", headers_status::CONTINUE, || {
        // SAFETY: per the hook's contract.
        let Some(s) = (unsafe { stream(module) }) else { return headers_status::CONTINUE };
        let Some(mut f) = s.filter.as_ref().and_then(|f| f.try_borrow_mut().ok()) else {
            return headers_status::CONTINUE;
        };
        let mut headers = EnvoyRequestHeaders(envoy);
        s.state = f.on_request_headers(&mut headers);
        if let Some(best) = s.state.upstream_override() {
            // strict = false: if the host is gone from the cluster, the cluster's own
            // policy picks (with the rest of the ranking in the header).
            // SAFETY: a stream hook with its filter pointer; Envoy copies the host.
            let taken = unsafe {
                abi::envoy_dynamic_module_callback_http_set_upstream_override_host(envoy, lend(best.as_bytes()), false)
            };
            if !taken {
                f.on_upstream_override_refused(&mut s.state, &mut headers);
            }
        }
        headers_status::CONTINUE
    })
}

/// # Safety
/// As request_headers.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: HttpFilterEnvoyPtr,
    module: HttpFilterModulePtr,
    _end_of_stream: bool,
) -> u32 {
    guard("http_filter_response_headers", headers_status::CONTINUE, || {
        // SAFETY: per the hook's contract.
        let Some(s) = (unsafe { stream(module) }) else { return headers_status::CONTINUE };
        let Some(f) = s.filter.as_ref().and_then(|f| f.try_borrow().ok()) else { return headers_status::CONTINUE };
        if let Some((name, value)) = f.debug_header(&s.state) {
            // SAFETY: response headers exist from this hook on; Envoy copies both.
            unsafe {
                abi::envoy_dynamic_module_callback_http_add_header(
                    envoy,
                    http_header_type::RESPONSE_HEADER,
                    lend(name.as_bytes()),
                    lend(value.as_bytes()),
                )
            };
        }
        headers_status::CONTINUE
    })
}

/// # Safety
/// As request_headers.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy: HttpFilterEnvoyPtr,
    module: HttpFilterModulePtr,
    _end_of_stream: bool,
) -> u32 {
    guard("http_filter_response_body", body_status::CONTINUE, || {
        // SAFETY: per the hook's contract.
        let Some(s) = (unsafe { stream(module) }) else { return body_status::CONTINUE };
        let Some(mut f) = s.filter.as_ref().and_then(|f| f.try_borrow_mut().ok()) else {
            return body_status::CONTINUE;
        };
        // SAFETY: a response body hook: the received chunk is this call's.
        let size = unsafe {
            abi::envoy_dynamic_module_callback_http_get_body_size(envoy, http_body_type::RECEIVED_RESPONSE_BODY)
        };
        f.on_response_body(&mut s.state, size);
        body_status::CONTINUE
    })
}

/// # Safety
/// As request_headers. Runs for every stream end: completion, client abort, upstream reset.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _envoy: HttpFilterEnvoyPtr,
    module: HttpFilterModulePtr,
) {
    guard("http_filter_stream_complete", (), || {
        // SAFETY: per the hook's contract.
        if let Some(s) = unsafe { stream(module) } {
            s.end();
        }
    })
}

/// # Safety
/// `module` is a pointer `on_http_filter_new` returned, destroyed once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module: HttpFilterModulePtr) {
    guard("http_filter_destroy", (), || {
        if module.is_null() {
            return;
        }
        // SAFETY: per the contract; the box is freed here, once.
        let mut s = unsafe { Box::from_raw(module as *mut StreamContext) };
        // Normally done at stream_complete; a second end does nothing.
        s.end();
    })
}

// The hooks the 1.40 loader requires that kvroute has no use for: requests and trailers
// pass on, nothing is ever called out, scheduled or buffered.

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    _: HttpFilterEnvoyPtr,
    _: HttpFilterModulePtr,
    _: bool,
) -> u32 {
    body_status::CONTINUE
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    _: HttpFilterEnvoyPtr,
    _: HttpFilterModulePtr,
) -> u32 {
    trailers_status::CONTINUE
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _: HttpFilterEnvoyPtr,
    _: HttpFilterModulePtr,
) -> u32 {
    trailers_status::CONTINUE
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _: HttpFilterEnvoyPtr,
    _: HttpFilterModulePtr,
    _callout_id: u64,
    _result: HttpCalloutResult,
    _headers: *mut EnvoyHttpHeader,
    _headers_size: usize,
    _body_chunks: *mut EnvoyBuffer,
    _body_chunks_size: usize,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _: HttpFilterEnvoyPtr,
    _: HttpFilterModulePtr,
    _stream_id: u64,
    _headers: *mut EnvoyHttpHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _: HttpFilterEnvoyPtr,
    _: HttpFilterModulePtr,
    _stream_id: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _: HttpFilterEnvoyPtr,
    _: HttpFilterModulePtr,
    _stream_id: u64,
    _trailers: *mut EnvoyHttpHeader,
    _trailers_size: usize,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _: HttpFilterEnvoyPtr,
    _: HttpFilterModulePtr,
    _stream_id: u64,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _: HttpFilterEnvoyPtr,
    _: HttpFilterModulePtr,
    _stream_id: u64,
    _reason: HttpStreamResetReason,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _: HttpFilterEnvoyPtr,
    _: HttpFilterModulePtr,
    _event_id: u64,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _: HttpFilterEnvoyPtr,
    _: HttpFilterModulePtr,
) {
}

/// # Safety
/// Envoy's hook; nothing is dereferenced.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _: HttpFilterEnvoyPtr,
    _: HttpFilterModulePtr,
) {
}
