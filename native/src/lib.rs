//! kvroute as an Envoy dynamic module: the same routing core as `kvroute.wasm`, loaded as
//! a native shared library by Envoy's `envoy.extensions.filters.http.dynamic_modules` HTTP
//! filter and `envoy.bootstrap.dynamic_modules` bootstrap extension.
//!
//! In progress. What stands:
//! - [`abi`]: the FFI declarations against Envoy 1.40's ABI (`v0.2.0`): the types, the
//!   callbacks the filter and the bootstrap extension will call, and the tables of hooks the
//!   module must export. Each declared callback is checked against the Envoy binary by
//!   `native/check_abi.py` (exported, and its argument registers as declared), which the
//!   test suite runs; `native/ABI-NOTES.md` has the call order, ownership and threading
//!   rules the hooks must follow.
//! - the thread-safe shared-data store the module will route over,
//!   `kvroute::store::ProcessStore`, in the core, with the store suite and multi-threaded
//!   exactness tests.
//!
//! Next: the hooks (HTTP filter over `kvroute::filter::Filter`, bootstrap extension over
//! `kvroute::sync::SyncService`), each catching panics at the boundary.

pub mod abi;
