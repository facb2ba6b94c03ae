//! Feed frames ([`kvroute::feed::Frame`]) and the sync service's index they feed.
//!
//! Input: one frame as the sidecar's feed endpoint serves it.
//! - a decoded frame encodes back to as many bytes and decodes to the same frame;
//! - applied to a fresh sync index and published, it yields a worker table that decodes,
//!   buckets that parse, and no holder bit for a slot the table does not have.

use crate::shared_layouts::assert_holders_within;
use kvroute::feed::Frame;
use kvroute::index::{publish, SyncIndex};
use kvroute::layout::{bucket_key, Bucket, WorkerTable, TABLE_KEY};
use kvroute::store::{MemStore, SharedStore};

const BUCKETS: u32 = 16;

pub fn check(data: &[u8]) {
    let Ok(frame) = Frame::decode(data) else { return };
    let bytes = frame.encode();
    assert_eq!(bytes.len(), data.len(), "re-encoded frame length");
    assert_eq!(Frame::decode(&bytes).as_ref(), Ok(&frame), "frame does not round-trip");

    let mut index = SyncIndex::new(BUCKETS);
    if index.apply(&frame).is_err() {
        return;
    }
    let store = MemStore::new();
    publish(&mut index, &store);
    let Ok((Some(table), _)) = store.get(TABLE_KEY) else { return };
    let table = WorkerTable::decode(&table).unwrap_or_else(|e| panic!("published table does not decode: {e}"));
    assert!(table.slots.len() <= frame.workers.len(), "more slots than the frame has workers");
    for b in 0..BUCKETS {
        let Ok((Some(value), _)) = store.get(&bucket_key(b)) else { continue };
        let bucket = Bucket::parse(&value).unwrap_or_else(|e| panic!("published bucket {b} does not parse: {e}"));
        assert_holders_within(&bucket, table.slots.len());
    }
}
