//! An in-process [`SharedStore`] with the host's semantics, for tests, benchmarks and the
//! scale simulation: compare-and-swap token `0` (or `None`) is unconditional, every write
//! gives the key a new token, and `get` copies the value as the host does.

use super::{SharedStore, StoreError, Versioned};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

#[derive(Default)]
pub struct MemStore {
    map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    next_cas: Cell<u32>,
    reads: Cell<u64>,
    writes: Cell<u64>,
}

impl MemStore {
    pub fn new() -> MemStore {
        MemStore::default()
    }

    /// `(gets, sets)` so far.
    pub fn calls(&self) -> (u64, u64) {
        (self.reads.get(), self.writes.get())
    }

    /// Bytes of every key and value held (what the host's shared data would hold).
    pub fn bytes(&self) -> usize {
        self.map.borrow().iter().map(|(k, (v, _))| k.len() + v.len()).sum()
    }
}

impl SharedStore for MemStore {
    fn get(&self, key: &str) -> Result<Versioned, StoreError> {
        self.reads.set(self.reads.get() + 1);
        Ok(match self.map.borrow().get(key) {
            Some((v, c)) => (Some(v.clone()), Some(*c)),
            None => (None, None),
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.writes.set(self.writes.get() + 1);
        let mut map = self.map.borrow_mut();
        if !super::cas_holds(cas, map.get(key).map(|(_, t)| *t)) {
            return Err(StoreError::CasMismatch);
        }
        // Tokens skip 0, which means "unconditional".
        let next = self.next_cas.get().wrapping_add(1).max(1);
        self.next_cas.set(next);
        map.insert(key.to_string(), (value.to_vec(), next));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn passes_the_store_suite() {
        super::super::conformance::check_all(super::MemStore::new);
    }
}
