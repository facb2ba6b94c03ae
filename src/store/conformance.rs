//! What every [`SharedStore`] must do, and what [`update`] does over it: one suite, run
//! over each implementation that can run natively (`MemStore` today; an in-process store
//! for a native host would run it too).

use super::{update, Edit, SharedStore, StoreError, UpdateError, CAS_ATTEMPTS};
use std::cell::Cell;

/// Every check, each on a fresh store from `make`.
pub(crate) fn check_all<S: SharedStore>(make: impl Fn() -> S) {
    missing_keys_read_as_nothing(&make());
    writes_give_new_tokens_and_stale_tokens_lose(&make());
    token_zero_is_unconditional(&make());
    an_update_writes_what_its_edit_says(&make());
    keep_and_reject_write_nothing(&make());
    a_lost_race_reads_and_edits_again(&make());
    an_update_gives_up_after_its_attempts(&make());
    a_stale_first_read_is_read_again(&make());
}

fn missing_keys_read_as_nothing(s: &dyn SharedStore) {
    assert_eq!(s.get("absent"), Ok((None, None)));
}

fn writes_give_new_tokens_and_stale_tokens_lose(s: &dyn SharedStore) {
    s.set("k", b"one", None).unwrap();
    let (v, t1) = s.get("k").unwrap();
    assert_eq!(v.as_deref(), Some(&b"one"[..]));
    let t1 = t1.expect("a token");
    assert_ne!(t1, 0, "0 means unconditional: never a key's token");
    s.set("k", b"two", Some(t1)).unwrap();
    let (v, t2) = s.get("k").unwrap();
    assert_eq!(v.as_deref(), Some(&b"two"[..]));
    assert_ne!(t2, Some(t1), "every write gives the key a new token");
    assert_eq!(s.set("k", b"three", Some(t1)), Err(StoreError::CasMismatch));
    assert_eq!(s.get("k").unwrap().0.as_deref(), Some(&b"two"[..]), "a lost write leaves the value");
}

fn token_zero_is_unconditional(s: &dyn SharedStore) {
    s.set("k", b"a", None).unwrap();
    s.set("k", b"b", Some(0)).unwrap();
    assert_eq!(s.get("k").unwrap().0.as_deref(), Some(&b"b"[..]));
}

/// Appends a byte to the value: the edit the update checks use.
fn append(byte: u8) -> impl FnMut(&[u8]) -> Result<Edit<usize>, ()> {
    move |v: &[u8]| {
        let mut new = v.to_vec();
        new.push(byte);
        let n = new.len();
        Ok(Edit::Write(new, n))
    }
}

fn an_update_writes_what_its_edit_says(s: &dyn SharedStore) {
    let mut reads = 0;
    // A missing key edits from empty.
    assert_eq!(update(s, "k", None, &mut reads, append(b'x')), Ok(1));
    assert_eq!(update(s, "k", None, &mut reads, append(b'y')), Ok(2));
    assert_eq!(s.get("k").unwrap().0.as_deref(), Some(&b"xy"[..]));
    assert_eq!(reads, 2);
}

fn keep_and_reject_write_nothing(s: &dyn SharedStore) {
    s.set("k", b"v", None).unwrap();
    let before = s.get("k").unwrap();
    let mut reads = 0;
    assert_eq!(update(s, "k", None, &mut reads, |_| Ok::<_, ()>(Edit::Keep(7))), Ok(7));
    assert_eq!(update(s, "k", None, &mut reads, |_| Err::<Edit<()>, _>("bad")), Err(UpdateError::Rejected("bad")));
    assert_eq!(s.get("k").unwrap(), before, "neither wrote (the token is unchanged)");
}

/// A store whose next `races` writes each lose to another writer that appends `!` first.
struct Racing<'a> {
    inner: &'a dyn SharedStore,
    races: Cell<u32>,
}

impl SharedStore for Racing<'_> {
    fn get(&self, key: &str) -> Result<super::Versioned, StoreError> {
        self.inner.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        if self.races.get() > 0 {
            self.races.set(self.races.get() - 1);
            let (v, _) = self.inner.get(key)?;
            let mut v = v.unwrap_or_default();
            v.push(b'!');
            self.inner.set(key, &v, None)?;
        }
        self.inner.set(key, value, cas)
    }
}

fn a_lost_race_reads_and_edits_again(s: &dyn SharedStore) {
    s.set("k", b"a", None).unwrap();
    let racing = Racing { inner: s, races: Cell::new(3) };
    let mut reads = 0;
    let mut edits = 0;
    let got = update(&racing, "k", None, &mut reads, |v| {
        edits += 1;
        append(b'z')(v)
    });
    // Three lost races, then the edit applies to the other writer's value: nothing lost.
    assert_eq!(got, Ok(5));
    assert_eq!(s.get("k").unwrap().0.as_deref(), Some(&b"a!!!z"[..]));
    assert_eq!((reads, edits), (4, 4));
}

fn an_update_gives_up_after_its_attempts(s: &dyn SharedStore) {
    // (A missing key's token is 0, unconditional: no race to lose.)
    s.set("k", b"a", None).unwrap();
    let racing = Racing { inner: s, races: Cell::new(CAS_ATTEMPTS) };
    let mut reads = 0;
    assert_eq!(update(&racing, "k", None, &mut reads, append(b'z')), Err(UpdateError::Contended));
    assert_eq!(reads, CAS_ATTEMPTS);
    let (v, _) = s.get("k").unwrap();
    assert!(!v.unwrap_or_default().contains(&b'z'), "a given-up update wrote nothing");
}

fn a_stale_first_read_is_read_again(s: &dyn SharedStore) {
    s.set("k", b"a", None).unwrap();
    let stale = s.get("k").unwrap();
    s.set("k", b"ab", None).unwrap();
    let mut reads = 0;
    // The caller's read is used first (no read counted), loses, and the retry reads.
    assert_eq!(update(s, "k", Some(stale), &mut reads, append(b'c')), Ok(3));
    assert_eq!(s.get("k").unwrap().0.as_deref(), Some(&b"abc"[..]));
    assert_eq!(reads, 1);
}
