//! Process-wide key/value data with compare-and-swap, as proxy-wasm shared data, and the
//! one read-modify-write loop every writer of it goes through.
//!
//! Writers of a key race: the filters on every Envoy worker thread and the sync service
//! update the same buckets and the same load vector. Each update reads a value with its
//! CAS token, computes the new value and writes it only if the token still holds;
//! otherwise it reads again. [`update`] is that loop; [`MemStore`] a single-threaded
//! in-process store with the host's semantics (tests, benches); [`ProcessStore`] the same
//! for many threads at once (a native host's); `conformance` (tests) the suite every
//! implementation must pass.

mod mem;
mod process;

pub use mem::MemStore;
pub use process::ProcessStore;

/// A shared-data write that did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// Someone else wrote the key since it was read: read again and redo.
    CasMismatch,
    Other(String),
}

/// A value as read, with its CAS token (`None`, `None` for a key that does not exist).
pub type Versioned = (Option<Vec<u8>>, Option<u32>);

/// `get` returns the value and its CAS token; `set` with `Some(cas)` fails with
/// [`StoreError::CasMismatch`] if the key changed since. A token of `0` (or `None`) is
/// unconditional, as the host treats it.
pub trait SharedStore {
    fn get(&self, key: &str) -> Result<Versioned, StoreError>;
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

/// Whether a write with token `cas` may replace a key whose token is `current` (`None`: the
/// key does not exist). A token of `0` or `None`, or a missing key, is unconditional.
pub(crate) fn cas_holds(cas: Option<u32>, current: Option<u32>) -> bool {
    match (cas, current) {
        (Some(c), Some(cur)) => c == 0 || c == cur,
        _ => true,
    }
}

/// A store shared by owners on several threads (the native host's, behind an `Arc`).
impl<S: SharedStore + ?Sized> SharedStore for std::sync::Arc<S> {
    fn get(&self, key: &str) -> Result<Versioned, StoreError> {
        (**self).get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        (**self).set(key, value, cas)
    }
}

/// Compare-and-swap attempts before an update is given up (and counted).
pub const CAS_ATTEMPTS: u32 = 16;

/// What an edit does with the value it was given.
pub enum Edit<T> {
    /// Write this value (if the key is unchanged since the read), then return `T`.
    Write(Vec<u8>, T),
    /// Leave the value as it is and return `T`: nothing to change.
    Keep(T),
}

/// Why an [`update`] wrote nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpdateError<E> {
    /// The edit refused the value it read (it did not decode, say).
    Rejected(E),
    /// The store failed a read or a write.
    Store(StoreError),
    /// Every write (of [`CAS_ATTEMPTS`], unless fewer were asked for) lost a race.
    Contended,
}

/// Read-modify-write of `key`: `edit` gets the current value (empty for a missing key) and
/// says what to write; a lost race reads again and edits again, up to [`CAS_ATTEMPTS`]
/// times. `first_read`, if given, is used instead of the first read (a value the caller
/// has just read for another purpose); every read this call makes adds 1 to `reads`.
pub fn update<T, E>(
    store: &dyn SharedStore,
    key: &str,
    first_read: Option<Versioned>,
    reads: &mut u32,
    edit: impl FnMut(&[u8]) -> Result<Edit<T>, E>,
) -> Result<T, UpdateError<E>> {
    update_tries(store, key, first_read, reads, CAS_ATTEMPTS, edit)
}

/// [`update`] in at most `attempts` writes: with 1 and a `first_read`, the write happens
/// only if `key` is unchanged since that read ([`UpdateError::Contended`] if not).
pub fn update_tries<T, E>(
    store: &dyn SharedStore,
    key: &str,
    mut first_read: Option<Versioned>,
    reads: &mut u32,
    attempts: u32,
    mut edit: impl FnMut(&[u8]) -> Result<Edit<T>, E>,
) -> Result<T, UpdateError<E>> {
    for _ in 0..attempts {
        let (value, cas) = match first_read.take() {
            Some(r) => r,
            None => {
                *reads += 1;
                store.get(key).map_err(UpdateError::Store)?
            }
        };
        let (new, out) = match edit(value.as_deref().unwrap_or_default()).map_err(UpdateError::Rejected)? {
            Edit::Keep(out) => return Ok(out),
            Edit::Write(new, out) => (new, out),
        };
        match store.set(key, &new, Some(cas.unwrap_or(0))) {
            Ok(()) => return Ok(out),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(UpdateError::Store(e)),
        }
    }
    Err(UpdateError::Contended)
}

#[cfg(test)]
pub(crate) mod conformance;
