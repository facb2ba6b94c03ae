//! kvroute as an Envoy dynamic module (`libkvroute_native.so`): the same routing core as
//! `kvroute.wasm`, loaded as a native shared library by Envoy's
//! `envoy.extensions.filters.http.dynamic_modules` HTTP filter ([`http`]) and
//! `envoy.bootstrap.dynamic_modules` bootstrap extension ([`bootstrap`]), which replace the
//! wasm filter and the `kvroute-sync` singleton. Both extension points name the same file;
//! Envoy loads it once, so they share the process-wide store ([`shared`]) that takes the
//! place of proxy-wasm shared data.
//!
//! - [`abi`]: the FFI declarations against Envoy 1.40's ABI (`v0.2.0`), written from its
//!   documented signatures and checked against the Envoy binary by `native/check_abi.py`;
//!   `native/ABI-NOTES.md` has the call order, ownership and threading rules.
//! - [`boundary`]: every hook's body runs under `catch_unwind`: nothing unwinds into Envoy.
//! - [`pin`]: the module pins itself in memory at load (it is never unloaded).
//!
//! No hook blocks a worker thread on I/O: the filter reads and updates the in-process store
//! (short, sharded locks), the sync service's I/O is Envoy's own callouts on the main thread.

pub mod abi;
mod bootstrap;
mod boundary;
mod buffers;
mod clock;
mod envoy_log;
mod http;
mod pin;
mod shared;

use abi::AbiVersionModulePtr;

/// The ABI version Envoy 1.40 expects; it only warns on another.
const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// Envoy's first call, once per process: the logger, the pin, the ABI version. Null makes
/// Envoy refuse to load the module, with the log line above it saying why.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> AbiVersionModulePtr {
    boundary::guard("program_init", std::ptr::null(), || {
        envoy_log::init();
        if let Err(e) = pin::never_unload() {
            log::error!("kvroute: cannot pin the module in memory ({e}); refusing to load");
            return std::ptr::null();
        }
        ABI_VERSION.as_ptr().cast()
    })
}
