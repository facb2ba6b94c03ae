//! A [`SharedStore`] in process memory that any number of threads use at once: the store a
//! native host (an Envoy dynamic module, whose worker threads share the process) puts under
//! the filter and the sync service, with proxy-wasm shared data's semantics exactly, so the
//! core runs over it unchanged.
//!
//! Keys are spread over shards, each behind its own lock, so filters on different worker
//! threads touching different buckets do not wait for each other. A lock is held only for
//! one map operation (a clone in, a clone out), never across a caller's edit.

use super::{SharedStore, StoreError, Versioned};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};

const SHARDS: usize = 64;

/// One shard's keys: value and CAS token. Keys are the store's own short names, not chosen
/// by clients, so a fast unkeyed hash serves: SipHash (the default) was about a third of
/// the store's time in the native module's profile.
type Shard = HashMap<String, (Vec<u8>, u32), BuildHasherDefault<KeyHasher>>;

/// XXH3 of a key's bytes.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.0);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

fn key_hash(key: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key.as_bytes())
}

pub struct ProcessStore {
    shards: Vec<Mutex<Shard>>,
    /// The last token handed out; tokens are process-wide, as the host's are.
    last_cas: AtomicU32,
}

impl Default for ProcessStore {
    fn default() -> Self {
        ProcessStore { shards: (0..SHARDS).map(|_| Mutex::default()).collect(), last_cas: AtomicU32::new(0) }
    }
}

impl ProcessStore {
    pub fn new() -> ProcessStore {
        ProcessStore::default()
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, Shard> {
        // A fixed hasher: the shard of a key is the same in every thread and every run.
        let i = key_hash(key) as usize % SHARDS;
        // A thread that panicked holding a shard left a whole map behind (the lock covers
        // one insert or one clone), so the data is sound: go on rather than fail every caller.
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    fn next_cas(&self) -> u32 {
        // Tokens skip 0, which means "unconditional".
        let mut t = self.last_cas.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        while t == 0 {
            t = self.last_cas.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        }
        t
    }
}

impl SharedStore for ProcessStore {
    fn get(&self, key: &str) -> Result<Versioned, StoreError> {
        Ok(match self.shard(key).get(key) {
            Some((v, c)) => (Some(v.clone()), Some(*c)),
            None => (None, None),
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut shard = self.shard(key);
        if !super::cas_holds(cas, shard.get(key).map(|(_, t)| *t)) {
            return Err(StoreError::CasMismatch);
        }
        // Taken under the shard's lock: a key's tokens change in the order of its writes.
        let token = self.next_cas();
        match shard.get_mut(key) {
            Some(entry) => {
                entry.0.clear();
                entry.0.extend_from_slice(value);
                entry.1 = token;
            }
            None => {
                shard.insert(key.to_string(), (value.to_vec(), token));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
