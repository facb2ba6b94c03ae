//! Worker slots and sets of them.
//!
//! Every worker the sync service has seen gets a small integer *slot*, stable for the life
//! of the Envoy process (shared data outlives VM restarts, and in-flight entries name
//! workers by slot). Block-holder sets are bitmasks over slots.

/// Most workers one Envoy process routes to. 1024 covers the largest fleets we simulate;
/// a mask over all of them is 128 bytes, cheap to keep on the stack.
pub const MAX_SLOTS: usize = 1024;
const WORDS: usize = MAX_SLOTS / 64;

/// A set of slots.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SlotSet {
    words: [u64; WORDS],
}

impl Default for SlotSet {
    fn default() -> Self {
        SlotSet::EMPTY
    }
}

impl std::fmt::Debug for SlotSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl SlotSet {
    pub const EMPTY: SlotSet = SlotSet { words: [0; WORDS] };
    pub const FULL: SlotSet = SlotSet { words: [u64::MAX; WORDS] };

    /// Adds `slot`; slots at or above [`MAX_SLOTS`] are ignored (they are never assigned).
    #[inline]
    pub fn insert(&mut self, slot: usize) {
        if slot < MAX_SLOTS {
            self.words[slot / 64] |= 1 << (slot % 64);
        }
    }

    #[inline]
    pub fn remove(&mut self, slot: usize) {
        if slot < MAX_SLOTS {
            self.words[slot / 64] &= !(1 << (slot % 64));
        }
    }

    #[inline]
    pub fn contains(&self, slot: usize) -> bool {
        slot < MAX_SLOTS && self.words[slot / 64] & (1 << (slot % 64)) != 0
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|w| *w == 0)
    }

    pub fn len(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// ORs in a mask stored as little-endian `u64` words (the shared-data form).
    #[inline]
    pub fn union_le_words(&mut self, le_words: &[u8]) {
        for (i, chunk) in le_words.chunks_exact(8).take(WORDS).enumerate() {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            self.words[i] |= u64::from_le_bytes(b);
        }
    }

    /// `self ∩ other`.
    #[inline]
    pub fn intersection(&self, other: &SlotSet) -> SlotSet {
        let mut out = *self;
        for (a, b) in out.words.iter_mut().zip(other.words.iter()) {
            *a &= *b;
        }
        out
    }

    /// `self ∪ other`.
    #[inline]
    pub fn union(&self, other: &SlotSet) -> SlotSet {
        let mut out = *self;
        for (a, b) in out.words.iter_mut().zip(other.words.iter()) {
            *a |= *b;
        }
        out
    }

    /// `self \ other`.
    #[inline]
    pub fn difference(&self, other: &SlotSet) -> SlotSet {
        let mut out = *self;
        for (a, b) in out.words.iter_mut().zip(other.words.iter()) {
            *a &= !*b;
        }
        out
    }

    /// Slots in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let bit = w.trailing_zeros() as usize;
                w &= w - 1;
                Some(i * 64 + bit)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn set_operations() {
        let mut a = SlotSet::EMPTY;
        for s in [0, 5, 63, 64, 1023, 1024, 5000] {
            a.insert(s);
        }
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![0, 5, 63, 64, 1023]);
        assert_eq!(a.len(), 5);
        let mut b = SlotSet::EMPTY;
        b.insert(5);
        b.insert(64);
        b.insert(7);
        assert_eq!(a.intersection(&b).iter().collect::<Vec<_>>(), vec![5, 64]);
        assert_eq!(a.difference(&b).iter().collect::<Vec<_>>(), vec![0, 63, 1023]);
        a.remove(63);
        assert!(!a.contains(63) && a.contains(64));
        let mut c = SlotSet::EMPTY;
        c.union_le_words(&[0b101, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(c.iter().collect::<Vec<_>>(), vec![0, 2, 64]);
        assert!(SlotSet::EMPTY.is_empty());
    }
}
