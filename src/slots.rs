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
///
/// Every operation touches only the words in use (`used`: every word past it is zero), so
/// a fleet of 16 workers pays for one word of the 16 a full set has: the scan does a dozen
/// set operations per block of a request.
#[derive(Clone, Copy, Eq)]
pub struct SlotSet {
    words: [u64; WORDS],
    used: usize,
}

impl PartialEq for SlotSet {
    fn eq(&self, other: &SlotSet) -> bool {
        // Words past `used` are zero on both sides.
        self.words == other.words
    }
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
    pub const EMPTY: SlotSet = SlotSet { words: [0; WORDS], used: 0 };
    pub const FULL: SlotSet = SlotSet { words: [u64::MAX; WORDS], used: WORDS };

    /// Adds `slot`; slots at or above [`MAX_SLOTS`] are ignored (they are never assigned).
    #[inline]
    pub fn insert(&mut self, slot: usize) {
        if slot < MAX_SLOTS {
            self.words[slot / 64] |= 1 << (slot % 64);
            self.used = self.used.max(slot / 64 + 1);
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

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.words[..self.used].iter().all(|w| *w == 0)
    }

    pub fn len(&self) -> usize {
        self.words[..self.used].iter().map(|w| w.count_ones() as usize).sum()
    }

    /// ORs in a mask stored as little-endian `u64` words (the shared-data form).
    #[inline]
    pub fn union_le_words(&mut self, le_words: &[u8]) {
        for (i, chunk) in le_words.chunks_exact(8).take(WORDS).enumerate() {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            self.words[i] |= u64::from_le_bytes(b);
            self.used = self.used.max(i + 1);
        }
    }

    /// `self ∩ other`.
    #[inline]
    pub fn intersection(&self, other: &SlotSet) -> SlotSet {
        let mut out = SlotSet::EMPTY;
        out.used = self.used.min(other.used);
        for i in 0..out.used {
            out.words[i] = self.words[i] & other.words[i];
        }
        out
    }

    /// `self ∪ other`.
    #[inline]
    pub fn union(&self, other: &SlotSet) -> SlotSet {
        let mut out = *self;
        out.used = self.used.max(other.used);
        for i in 0..other.used {
            out.words[i] |= other.words[i];
        }
        out
    }

    /// `self \ other`.
    #[inline]
    pub fn difference(&self, other: &SlotSet) -> SlotSet {
        let mut out = *self;
        for i in 0..self.used.min(other.used) {
            out.words[i] &= !other.words[i];
        }
        out
    }

    /// Slots in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.words[..self.used].iter().enumerate().flat_map(|(i, &w)| {
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

    /// Sets of different widths (a low slot only, a high slot too) combine as sets do,
    /// and compare equal by their slots alone.
    #[test]
    fn operations_across_widths() {
        let (mut low, mut high) = (SlotSet::EMPTY, SlotSet::EMPTY);
        low.insert(3);
        high.insert(3);
        high.insert(700);
        assert_eq!(low.union(&high).iter().collect::<Vec<_>>(), vec![3, 700]);
        assert_eq!(high.union(&low).iter().collect::<Vec<_>>(), vec![3, 700]);
        assert_eq!(high.intersection(&low), low);
        assert_eq!(low.intersection(&high), low);
        assert_eq!(high.difference(&low).iter().collect::<Vec<_>>(), vec![700]);
        assert!(low.difference(&high).is_empty());
        high.remove(700);
        assert_eq!(high, low);
        assert_eq!(SlotSet::FULL.intersection(&low), low);
        assert_eq!(SlotSet::FULL.difference(&SlotSet::FULL), SlotSet::EMPTY);
        assert_eq!(SlotSet::FULL.len(), MAX_SLOTS);
    }
}
