//! The module must never be unloaded: its statics hold the routing state every worker
//! thread reads, and Envoy `dlclose`s a module when the last configuration naming it goes
//! unless `do_not_close` was set on its *first* load. So the module pins itself at load,
//! whatever the configuration says: it reopens its own file with `RTLD_NODELETE`.

use std::ffi::{c_void, CStr};

/// Pins this shared object in memory for the life of the process. `Err`: why not (the
/// module then relies on `do_not_close: true` in every configuration that names it).
pub fn never_unload() -> Result<(), String> {
    // SAFETY: dladdr reads the loader's tables for an address inside this object; the
    // path it returns stays valid while the object is loaded, which it is during the call.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        let here = never_unload as *const c_void;
        if libc::dladdr(here, &mut info) == 0 || info.dli_fname.is_null() {
            return Err("dladdr found no file for this module".into());
        }
        // RTLD_NOLOAD: only take another reference to the copy already loaded (never a
        // second copy); RTLD_NODELETE: that copy is never unmapped.
        let handle = libc::dlopen(info.dli_fname, libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_NODELETE);
        if handle.is_null() {
            let path = CStr::from_ptr(info.dli_fname).to_string_lossy().into_owned();
            return Err(format!("dlopen({path}, RTLD_NODELETE) failed"));
        }
    }
    Ok(())
}
