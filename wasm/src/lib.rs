//! kvroute.wasm: the proxy-wasm glue of the routing core. One `.wasm`, two roles, chosen
//! by the plugin's `root_id`:
//!
//! - `kvroute`: the HTTP filter ([`kvroute_core::filter`]), one VM per Envoy worker thread;
//! - `kvroute-sync`: the sync service ([`kvroute_core::sync`]), an `envoy.bootstrap.wasm`
//!   singleton with the same `vm_id`, so both see the same shared data.
//!
//! Every decision lives in the core; this crate maps proxy-wasm callbacks onto it and host
//! calls onto its host traits ([`host`]). Natively it compiles to nothing.

#![cfg(target_arch = "wasm32")]

mod host;

use host::{StreamRequestHeaders, WasmHost};
use kvroute_core::filter::{self, Filter};
use kvroute_core::sync::{self, SyncService};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use std::cell::RefCell;
use std::rc::Rc;

proxy_wasm::main! {{
    // The host's log level is not readable during `_initialize`; see `on_configure`. The
    // first call also installs the SDK's panic hook: a panic is logged (critical) before
    // the VM traps, never silent.
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::Unconfigured) });
}}

const FILTER_ROOT_ID: &str = "kvroute";
const SYNC_ROOT_ID: &str = "kvroute-sync";

/// The VM's filter, shared by its streams (one Envoy worker thread: no locking).
type SharedFilter = Rc<RefCell<Filter<WasmHost>>>;

/// The root context takes its role at `on_configure`, from the `plugin_root_id` property.
enum Root {
    Unconfigured,
    Filter(SharedFilter),
    Sync(Box<SyncService<WasmHost>>),
}

impl Root {
    fn configure(root_id: &str, config: &[u8]) -> Option<Root> {
        match root_id {
            FILTER_ROOT_ID => {
                match Filter::configure(WasmHost, config, host::seed()) {
                    Ok(f) => {
                        // Errors ignored: without ticks stats still flush every few requests.
                        let _ = proxy_wasm::hostcalls::set_tick_period(filter::FLUSH_PERIOD);
                        Some(Root::Filter(Rc::new(RefCell::new(f))))
                    }
                    Err(e) => {
                        log::error!("kvroute: refusing filter configuration: {e}");
                        None
                    }
                }
            }
            SYNC_ROOT_ID => match SyncService::configure(WasmHost, config, host::seed()) {
                Ok(s) => {
                    if proxy_wasm::hostcalls::set_tick_period(sync::TICK).is_err() {
                        log::error!("kvroute-sync: cannot set a tick period");
                        return None;
                    }
                    Some(Root::Sync(Box::new(s)))
                }
                Err(e) => {
                    log::error!("kvroute-sync: refusing configuration: {e}");
                    None
                }
            },
            other => {
                log::error!("kvroute: unknown root_id {other:?}: use {FILTER_ROOT_ID:?} (HTTP filter) or {SYNC_ROOT_ID:?} (bootstrap singleton)");
                None
            }
        }
    }
}

impl Context for Root {
    fn on_done(&mut self) -> bool {
        // The VM is going away: nothing may stay counted in flight.
        if let Root::Filter(f) = self {
            if let Ok(mut f) = f.try_borrow_mut() {
                f.flush();
            }
        }
        true
    }

    fn on_http_call_response(&mut self, token: u32, _n_headers: usize, body_size: usize, _n_trailers: usize) {
        if let Root::Sync(s) = self {
            s.on_response(u64::from(token), host::http_call_status(), body_size, || host::http_call_body(body_size));
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        // Follow Envoy's level so debug logs cost nothing unless asked for.
        if let Ok(level) = proxy_wasm::hostcalls::get_log_level() {
            proxy_wasm::set_log_level(level);
        }
        let root_id = host::property_string(&["plugin_root_id"]).unwrap_or_default();
        match Root::configure(&root_id, &host::plugin_configuration(size)) {
            Some(root) => {
                *self = root;
                true
            }
            None => false,
        }
    }

    fn on_tick(&mut self) {
        match self {
            Root::Sync(s) => s.on_tick(),
            Root::Filter(f) => {
                if let Ok(mut f) = f.try_borrow_mut() {
                    f.flush();
                }
            }
            Root::Unconfigured => {}
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        match self {
            Root::Filter(f) => Some(Box::new(Stream { filter: Rc::clone(f), state: filter::Stream::default() })),
            _ => None,
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        match self {
            Root::Sync(_) => None,
            _ => Some(ContextType::HttpContext),
        }
    }
}

/// One HTTP stream. The borrows cannot fail (one thread, no re-entry); if one did, the
/// stream would be routed by Envoy's fallback policy and its lease would reclaim anything
/// held.
struct Stream {
    filter: SharedFilter,
    state: filter::Stream,
}

impl Stream {
    fn end(&mut self) {
        if let Ok(mut f) = self.filter.try_borrow_mut() {
            f.on_stream_end(&mut self.state);
        }
    }
}

impl Context for Stream {
    fn on_done(&mut self) -> bool {
        self.end();
        true
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let Ok(mut f) = self.filter.try_borrow_mut() {
            self.state = f.on_request_headers(&mut StreamRequestHeaders);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        if let Ok(mut f) = self.filter.try_borrow_mut() {
            f.on_response_body(&mut self.state, body_size);
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let Ok(f) = self.filter.try_borrow() {
            if let Some((name, value)) = f.debug_header(&self.state) {
                host::add_response_header(name, value);
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        // Runs for every stream end: completion, client abort, upstream reset.
        self.end();
    }
}
