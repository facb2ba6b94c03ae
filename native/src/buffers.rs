//! Turning Envoy's borrowed buffers into Rust values and Rust values into lent buffers.

use crate::abi::{EnvoyBuffer, EnvoyHttpHeader, ModuleBuffer, ModuleHttpHeader};

/// Lends `s` to Envoy for one call.
pub fn lend(s: &[u8]) -> ModuleBuffer {
    ModuleBuffer { ptr: s.as_ptr().cast(), length: s.len() }
}

/// Lends a header to Envoy for one call.
pub fn lend_header<'a>(key: &'a str, value: &'a str) -> ModuleHttpHeader {
    ModuleHttpHeader {
        key_ptr: key.as_ptr().cast(),
        key_length: key.len(),
        value_ptr: value.as_ptr().cast(),
        value_length: value.len(),
    }
}

/// The bytes of an Envoy-owned buffer.
///
/// # Safety
/// `b` must point to `b.length` readable bytes (or be null), valid for `'a`: Envoy's
/// buffers live until the hook that handed them over returns.
pub unsafe fn bytes<'a>(b: EnvoyBuffer) -> &'a [u8] {
    if b.ptr.is_null() || b.length == 0 {
        return &[];
    }
    // SAFETY: per the caller's contract.
    unsafe { std::slice::from_raw_parts(b.ptr.cast(), b.length) }
}

/// An Envoy-owned array of `n` items (or null).
///
/// # Safety
/// `items` must point to `n` initialised items valid for `'a`.
pub unsafe fn array<'a, T>(items: *const T, n: usize) -> &'a [T] {
    if items.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: per the caller's contract.
    unsafe { std::slice::from_raw_parts(items, n) }
}

/// The value of header `name` in an Envoy-owned header array.
///
/// # Safety
/// As [`array`], and every header's key and value as [`bytes`].
pub unsafe fn header_value<'a>(headers: &'a [EnvoyHttpHeader], name: &str) -> Option<&'a [u8]> {
    headers.iter().find_map(|h| {
        // SAFETY: per the caller's contract.
        let key = unsafe { bytes(EnvoyBuffer { ptr: h.key_ptr, length: h.key_length }) };
        key.eq_ignore_ascii_case(name.as_bytes())
            // SAFETY: per the caller's contract.
            .then(|| unsafe { bytes(EnvoyBuffer { ptr: h.value_ptr, length: h.value_length }) })
    })
}
