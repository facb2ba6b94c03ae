//! The process store passes the store suite, and stays exact with many threads writing:
//! as shared data must be across Envoy's worker threads.

use super::*;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

#[test]
fn passes_the_store_suite() {
    crate::store::conformance::check_all(ProcessStore::new);
    crate::store::conformance::check_all(|| std::sync::Arc::new(ProcessStore::new()));
}

/// Threads (not in wasm32, whose test runner has none).
#[cfg(not(target_arch = "wasm32"))]
mod threads {
    use super::*;
    use crate::feed::{FeedBlock, FeedWorker, Frame, Op};
    use crate::filter::Filter;
    use crate::host::testing::TestHeaders;
    use crate::host::{Clock, Host, StatId, StatKind, Stats};
    use crate::index::{publish, SyncIndex};
    use crate::layout::{prefill_epoch, LoadVector, LOAD_KEY};
    use crate::role::Role;
    use crate::store::{update, Edit, UpdateError};
    use crate::tokens::encode_base64;
    use std::sync::Arc;

    const THREADS: usize = 4;

    #[test]
    fn compare_and_swap_loses_no_update_across_threads() {
        let store = Arc::new(ProcessStore::new());
        let per_thread = 2_000u64;
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    let mut reads = 0;
                    for _ in 0..per_thread {
                        // Retried past CAS_ATTEMPTS: here only exactness is under test.
                        loop {
                            let r = update(&*store, "n", None, &mut reads, |v| {
                                let n = u64::from_le_bytes(v.try_into().unwrap_or([0; 8]));
                                Ok::<_, ()>(Edit::Write((n + 1).to_le_bytes().to_vec(), ()))
                            });
                            match r {
                                Ok(()) => break,
                                Err(UpdateError::Contended) => continue,
                                Err(e) => panic!("{e:?}"),
                            }
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let v = store.get("n").unwrap().0.unwrap();
        assert_eq!(u64::from_le_bytes(v.try_into().unwrap()), THREADS as u64 * per_thread);
    }

    /// One Envoy worker thread's host over the process-wide store.
    struct WorkerHost {
        store: Arc<ProcessStore>,
        stats: Arc<Mutex<HashMap<String, u64>>>,
        names: Mutex<Vec<String>>,
    }

    impl Host for WorkerHost {
        type Store = Arc<ProcessStore>;
        fn store(&self) -> &Arc<ProcessStore> {
            &self.store
        }
    }
    impl Clock for WorkerHost {
        fn now_ms(&self) -> u64 {
            1_000_000
        }
    }
    impl Stats for WorkerHost {
        fn define_stat(&self, _kind: StatKind, name: &str) -> Option<StatId> {
            let mut names = self.names.lock().unwrap();
            names.push(name.to_string());
            Some(StatId(names.len() as u32 - 1))
        }
        fn add_to_counter(&self, id: StatId, n: u64) {
            let name = self.names.lock().unwrap()[id.0 as usize].clone();
            *self.stats.lock().unwrap().entry(name).or_default() += n;
        }
        fn set_gauge(&self, _id: StatId, _value: u64) {}
    }

    fn prompt(group: u32, tail: u32) -> Vec<u32> {
        let mut p: Vec<u32> = (0..128).map(|i| group * 100_000 + i).collect();
        p.extend((0..32).map(|i| 50_000_000 + tail * 100 + i));
        p
    }

    /// Filters on four threads route and finish streams over one store at once; when all
    /// are done nothing is left in flight anywhere, and no update was given up.
    #[test]
    fn filters_on_many_threads_leave_nothing_in_flight() {
        let store = Arc::new(ProcessStore::new());
        let workers =
            (0..4).map(|i| FeedWorker { id: format!("10.0.0.{i}:8000"), role: Role::Both, up: true }).collect();
        // Worker 1 holds group 0's prefix.
        let ops = vec![Op::Store { worker: 1, blocks: FeedBlock::chain(&prompt(0, 0)[..128], 16) }];
        let mut ix = SyncIndex::new(256);
        ix.apply(&Frame::snapshot(1, 1, 16, workers, ops)).unwrap();
        ix.set_live(true);
        assert_eq!(publish(&mut ix, &*store).failures, 0);

        let stats = Arc::new(Mutex::new(HashMap::new()));
        let handles: Vec<_> = (0..THREADS as u32)
            .map(|t| {
                let (store, stats) = (Arc::clone(&store), Arc::clone(&stats));
                std::thread::spawn(move || {
                    let host = WorkerHost { store, stats, names: Mutex::default() };
                    let mut f = Filter::configure(host, b"{}", u64::from(t)).unwrap();
                    let mut open = Vec::new();
                    for i in 0..300u32 {
                        let p = prompt(i % 3, t * 1_000 + i);
                        let mut h = TestHeaders::with(&[("x-prompt-token-ids-b64", &encode_base64(&p))]);
                        let mut s = f.on_request_headers(&mut h);
                        if i % 2 == 0 {
                            f.on_response_body(&mut s, 10);
                        }
                        open.push(s);
                        // Streams end out of order, some while others start.
                        if open.len() > 8 {
                            let mut s = open.swap_remove((i as usize * 7) % open.len());
                            f.on_stream_end(&mut s);
                        }
                    }
                    for s in &mut open {
                        f.on_stream_end(s);
                    }
                    f.flush();
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let stats = stats.lock().unwrap();
        assert_eq!(stats.get("kvroute.scored"), Some(&(THREADS as u64 * 300)), "{stats:?}");
        assert_eq!(stats.get("kvroute.update_failures").copied().unwrap_or(0), 0, "{stats:?}");
        let load = LoadVector::decode(&store.get(LOAD_KEY).unwrap().0.unwrap());
        for slot in 0..4 {
            assert_eq!(load.get(slot), 0, "slot {slot}: {load:?}");
            assert_eq!(load.pending_prefill(slot, prefill_epoch(1_000_000)), 0, "slot {slot}: {load:?}");
        }
    }
}
