//! `HashTable`: a map from 64-bit hashes to small `Copy` values, for the per-worker caches,
//! which are most of the sidecar's memory.
//!
//! Why not `std::collections::HashMap`: it keeps its bucket count a power of two and grows
//! by doubling, so right after growing it is less than half full — with 24-byte entries a
//! cache could cost over 100 bytes per block. This table is open addressing with linear
//! probing over any number of slots, grows by half when 80% full (so it is always at least
//! 53% full once past its first growth), and keeps occupancy in a bitmap (one bit a slot)
//! instead of a control byte. Removal shifts the following run back (no tombstones).
//!
//! Keys are hashes already; they are mixed once more so that sequential keys (as tests and
//! some engines produce) spread too.

/// Slots per entry at the most before growing: 80% load.
const MAX_LOAD_NUM: usize = 4;
const MAX_LOAD_DEN: usize = 5;
const MIN_SLOTS: usize = 16;

#[derive(Debug, Clone)]
pub struct HashTable<V: Copy + Default> {
    slots: Vec<(u64, V)>,
    used: Vec<u64>,
    len: usize,
}

impl<V: Copy + Default> Default for HashTable<V> {
    fn default() -> Self {
        HashTable { slots: Vec::new(), used: Vec::new(), len: 0 }
    }
}

#[inline]
fn mix(k: u64) -> u64 {
    // splitmix64's finalizer.
    let mut z = k.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl<V: Copy + Default> HashTable<V> {
    /// Room for `n` entries without growing. Filling a table in another table's order
    /// (a checkpoint's) must start at its final size: grown along the way, each smaller
    /// table takes the keys in the order of their home slots, piles them into one run, and
    /// every insert probes to the end of it (1M blocks restored in 31 s instead of 0.3).
    pub fn with_capacity(n: usize) -> Self {
        let slots = (n * MAX_LOAD_DEN / MAX_LOAD_NUM + 1).max(MIN_SLOTS);
        HashTable { slots: vec![(0, V::default()); slots], used: vec![0; slots.div_ceil(64)], len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of heap the table holds.
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<(u64, V)>() + self.used.capacity() * 8
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        // Multiply-shift onto [0, n): no power-of-two size needed.
        ((u128::from(mix(key)) * self.slots.len() as u128) >> 64) as usize
    }

    #[inline]
    fn is_used(&self, i: usize) -> bool {
        self.used[i / 64] & (1 << (i % 64)) != 0
    }

    #[inline]
    fn set_used(&mut self, i: usize, on: bool) {
        if on {
            self.used[i / 64] |= 1 << (i % 64);
        } else {
            self.used[i / 64] &= !(1 << (i % 64));
        }
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    /// The slot holding `key`, or the empty slot where it would go.
    #[inline]
    fn find(&self, key: u64) -> (usize, bool) {
        let mut i = self.home(key);
        loop {
            if !self.is_used(i) {
                return (i, false);
            }
            if self.slots[i].0 == key {
                return (i, true);
            }
            i = self.next(i);
        }
    }

    pub fn get(&self, key: &u64) -> Option<&V> {
        if self.len == 0 {
            return None;
        }
        match self.find(*key) {
            (i, true) => Some(&self.slots[i].1),
            _ => None,
        }
    }

    pub fn get_mut(&mut self, key: &u64) -> Option<&mut V> {
        if self.len == 0 {
            return None;
        }
        match self.find(*key) {
            (i, true) => Some(&mut self.slots[i].1),
            _ => None,
        }
    }

    /// Inserts or replaces; returns the value replaced.
    pub fn insert(&mut self, key: u64, value: V) -> Option<V> {
        self.reserve_one();
        let (i, found) = self.find(key);
        if found {
            return Some(std::mem::replace(&mut self.slots[i].1, value));
        }
        self.slots[i] = (key, value);
        self.set_used(i, true);
        self.len += 1;
        None
    }

    /// The value of `key`, inserted with `make` (which may record that it did) if absent.
    pub fn get_or_insert_with(&mut self, key: u64, make: impl FnOnce() -> V) -> &mut V {
        self.reserve_one();
        let (i, found) = self.find(key);
        if !found {
            self.slots[i] = (key, make());
            self.set_used(i, true);
            self.len += 1;
        }
        &mut self.slots[i].1
    }

    pub fn remove(&mut self, key: &u64) -> Option<V> {
        if self.len == 0 {
            return None;
        }
        let (mut hole, found) = self.find(*key);
        if !found {
            return None;
        }
        let removed = self.slots[hole].1;
        // Backward-shift: move later entries of the run into the hole when their home is
        // not between the hole and themselves (cyclically).
        let mut j = self.next(hole);
        while self.is_used(j) {
            let home = self.home(self.slots[j].0);
            let stays = if hole <= j { hole < home && home <= j } else { hole < home || home <= j };
            if !stays {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
            j = self.next(j);
        }
        self.slots[hole] = (0, V::default());
        self.set_used(hole, false);
        self.len -= 1;
        Some(removed)
    }

    pub fn clear(&mut self) {
        *self = HashTable::default();
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, &V)> + '_ {
        self.slots.iter().enumerate().filter(|(i, _)| self.is_used(*i)).map(|(_, (k, v))| (*k, v))
    }

    pub fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.iter().map(|(_, v)| v)
    }

    /// Takes every entry out, leaving the table empty.
    pub fn drain(&mut self) -> impl Iterator<Item = (u64, V)> {
        let old = std::mem::take(self);
        let used = old.used;
        old.slots.into_iter().enumerate().filter(move |(i, _)| used[i / 64] & (1 << (i % 64)) != 0).map(|(_, e)| e)
    }

    fn reserve_one(&mut self) {
        if (self.len + 1) * MAX_LOAD_DEN > self.slots.len() * MAX_LOAD_NUM {
            let mut n = (self.slots.len() * 3 / 2).max(MIN_SLOTS);
            while (self.len + 1) * MAX_LOAD_DEN > n * MAX_LOAD_NUM {
                n = n * 3 / 2;
            }
            self.rehash(n);
        }
    }

    fn rehash(&mut self, n: usize) {
        let old = std::mem::replace(
            self,
            HashTable { slots: vec![(0, V::default()); n], used: vec![0; n.div_ceil(64)], len: 0 },
        );
        let used = old.used;
        for (i, (k, v)) in old.slots.into_iter().enumerate() {
            if used[i / 64] & (1 << (i % 64)) != 0 {
                let (j, _) = self.find(k);
                self.slots[j] = (k, v);
                self.set_used(j, true);
                self.len += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn behaves_like_a_hashmap_under_random_operations() {
        let mut ours: HashTable<u32> = HashTable::default();
        let mut std: HashMap<u64, u32> = HashMap::new();
        let mut x = 0x1234_5678_u64;
        for step in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Small key space (sequential-ish keys, many collisions of homes) and a mix of
            // operations that grows and shrinks the table.
            let key = x % 5_000;
            match x % 7 {
                0..=2 => assert_eq!(ours.insert(key, step), std.insert(key, step)),
                3 | 4 => assert_eq!(ours.remove(&key), std.remove(&key)),
                5 => *ours.get_or_insert_with(key, || step) += 1,
                _ => assert_eq!(ours.get(&key), std.get(&key)),
            }
            if x % 7 == 5 {
                *std.entry(key).or_insert(step) += 1;
            }
            assert_eq!(ours.len(), std.len());
        }
        let mut a: Vec<(u64, u32)> = ours.iter().map(|(k, v)| (k, *v)).collect();
        let mut b: Vec<(u64, u32)> = std.into_iter().collect();
        a.sort();
        b.sort();
        assert_eq!(a, b);
        let drained: Vec<_> = ours.drain().collect();
        assert_eq!(drained.len(), a.len());
        assert!(ours.is_empty() && ours.get(&1).is_none());
    }

    #[test]
    fn stays_between_53_and_80_percent_full() {
        let mut t: HashTable<[u64; 2]> = HashTable::default();
        for k in 0..100_000u64 {
            t.insert(k.wrapping_mul(0x9E37_79B9_7F4A_7C15), [k, k]);
            if t.len() > 100 {
                let load = t.len() as f64 / t.slots.len() as f64;
                assert!((0.53..=0.80).contains(&load), "{} entries, load {load}", t.len());
            }
        }
    }

    #[test]
    fn a_table_made_for_n_entries_takes_them_without_growing() {
        let mut source = HashTable::default();
        for k in 0..10_000u64 {
            source.insert(k.wrapping_mul(0x9E37_79B9_7F4A_7C15), k);
        }
        // Filled in the source's order, as a checkpoint is read back.
        let mut t = HashTable::with_capacity(source.len());
        let before = t.heap_bytes();
        for (k, v) in source.iter() {
            t.insert(k, *v);
        }
        assert_eq!((t.len(), t.heap_bytes()), (10_000, before));
        assert!(source.iter().all(|(k, v)| t.get(&k) == Some(v)));
    }
}
