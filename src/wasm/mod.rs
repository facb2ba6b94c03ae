//! proxy-wasm glue: one `.wasm`, two roles, chosen by the plugin's `root_id`.
//!
//! - `kvroute` — the HTTP filter ([`filter`]), one VM per Envoy worker thread;
//! - `kvroute-sync` — the sync service ([`sync`]), an `envoy.bootstrap.wasm` singleton with
//!   the same `vm_id`, so both see the same shared data.
//!
//! Host calls go through [`host`], which turns every host error into a value: the SDK's
//! trait helpers panic on unexpected statuses, and a panic kills the VM.

mod filter;
mod host;
mod sync;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

proxy_wasm::main! {{
    // The host's log level is not readable during `_initialize`; see `on_configure`. The
    // first call also installs the SDK's panic hook: a panic is logged (critical) before
    // the VM traps, never silent.
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::Unconfigured) });
}}

pub const FILTER_ROOT_ID: &str = "kvroute";
pub const SYNC_ROOT_ID: &str = "kvroute-sync";

/// The root context takes its role at `on_configure`, from the `plugin_root_id` property.
enum Root {
    Unconfigured,
    Filter(filter::FilterRoot),
    Sync(Box<sync::SyncRoot>),
}

impl Context for Root {
    fn on_done(&mut self) -> bool {
        // The VM is going away: nothing may stay counted in flight.
        if let Root::Filter(f) = self {
            f.flush();
        }
        true
    }

    fn on_http_call_response(&mut self, token: u32, n_headers: usize, body_size: usize, n_trailers: usize) {
        if let Root::Sync(s) = self {
            s.on_http_call_response(token, n_headers, body_size, n_trailers);
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
        let config = host::plugin_configuration(size);
        match root_id.as_str() {
            FILTER_ROOT_ID => match filter::FilterRoot::configure(&config) {
                Some(f) => {
                    *self = Root::Filter(f);
                    // Errors ignored: without ticks stats still flush every few requests.
                    let _ = proxy_wasm::hostcalls::set_tick_period(filter::FLUSH_PERIOD);
                    true
                }
                None => false,
            },
            SYNC_ROOT_ID => match sync::SyncRoot::configure(&config) {
                Some(s) => {
                    *self = Root::Sync(Box::new(s));
                    true
                }
                None => false,
            },
            other => {
                log::error!("kvroute: unknown root_id {other:?}: use {FILTER_ROOT_ID:?} (HTTP filter) or {SYNC_ROOT_ID:?} (bootstrap singleton)");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        match self {
            Root::Sync(s) => s.on_tick(),
            Root::Filter(f) => f.flush(),
            Root::Unconfigured => {}
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        match self {
            Root::Filter(f) => Some(Box::new(f.new_stream(context_id))),
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
