//! What a proxy gives the filter and the sync service: the seams between the routing policy
//! ([`crate::filter`], [`crate::sync`]) and a host ABI (the proxy-wasm glue in `wasm/`; a
//! native Envoy module next). A host's methods never fail to the caller: it turns its own
//! errors into values (`None`, an `Err` string, a stat that does nothing), because nothing
//! in the policy may panic.

use crate::store::SharedStore;
use std::time::Duration;

/// What the filter and the sync service need of every host: shared data, the time, stats.
pub trait Host: Clock + Stats {
    type Store: SharedStore;
    fn store(&self) -> &Self::Store;
    /// Whether the host calls [`crate::filter::Filter::flush`] every
    /// [`crate::filter::FLUSH_PERIOD`] (proxy-wasm's ticks). A host without a tick on the
    /// threads that route (a native module's worker threads) gets every stat and every
    /// ended stream's release pushed at once instead of batched.
    fn ticks(&self) -> bool {
        true
    }
    /// Whether the host can hand Envoy an upstream host for the request directly
    /// ([`crate::config::DestinationVia::UpstreamOverride`]); proxy-wasm cannot.
    fn overrides_upstream(&self) -> bool {
        false
    }
}

/// Wall-clock time. Read once per event and passed down, so the policy's tests set it.
pub trait Clock {
    /// Milliseconds since the Unix epoch; 0 if the host will not say (entries then look
    /// old, the safe side: predictions expire, nothing is held longer than asked).
    fn now_ms(&self) -> u64;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatKind {
    Counter,
    Gauge,
}

/// A stat the host defined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StatId(pub u32);

/// The host's stats (Envoy: `wasmcustom.<name>`).
pub trait Stats {
    /// `None`: the host refused; the stat is then a no-op, not an error on every request.
    fn define_stat(&self, kind: StatKind, name: &str) -> Option<StatId>;
    /// A gauge of one worker (`kvroute.active_blocks` of `10.0.0.1:8000`), defined when the
    /// worker first shows up. By default the stat `<name>.<worker>`, with every character
    /// of the worker id that is not a letter or digit as `_` (stat names split on `.`). A
    /// host that can define stats only at configuration time labels one gauge instead.
    fn define_worker_gauge(&self, name: &str, worker: &str) -> Option<StatId> {
        let worker: String = worker.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        self.define_stat(StatKind::Gauge, &format!("{name}.{worker}"))
    }
    fn add_to_counter(&self, id: StatId, n: u64);
    fn set_gauge(&self, id: StatId, value: u64);
}

/// The request headers of the stream being routed.
pub trait RequestHeaders {
    fn get(&self, name: &str) -> Option<Vec<u8>>;
    fn set(&mut self, name: &str, value: &str);
    fn remove(&mut self, name: &str);
}

/// One call to the sidecar: a long poll of its feed (`GET`), or a load report (`POST`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SidecarCall<'a> {
    /// The Envoy cluster that reaches the sidecar.
    pub cluster: &'a str,
    pub authority: &'a str,
    /// `GET` or `POST`.
    pub method: &'a str,
    pub path: &'a str,
    /// The answer's media type (the `accept` header).
    pub accept: &'a str,
    /// A `POST`'s body, sent as `application/json`.
    pub body: Option<&'a [u8]>,
    pub timeout: Duration,
}

/// The call driver: sends a call and later hands its answer to
/// [`crate::sync::SyncService::on_response`] with the token returned here.
pub trait FeedClient {
    fn dispatch(&self, call: &SidecarCall<'_>) -> Result<u64, String>;
}

/// A counter, or nothing if the host refused to define it.
#[derive(Clone, Copy, Debug)]
pub struct Counter(Option<StatId>);

impl Counter {
    pub fn define(stats: &dyn Stats, name: &str) -> Counter {
        Counter(stats.define_stat(StatKind::Counter, name))
    }
    pub fn add(self, stats: &dyn Stats, n: u64) {
        if let (Some(id), true) = (self.0, n > 0) {
            stats.add_to_counter(id, n);
        }
    }
}

/// A gauge, or nothing if the host refused to define it.
#[derive(Clone, Copy, Debug)]
pub struct Gauge(Option<StatId>);

impl Gauge {
    pub fn define(stats: &dyn Stats, name: &str) -> Gauge {
        Gauge(stats.define_stat(StatKind::Gauge, name))
    }
    pub fn define_for_worker(stats: &dyn Stats, name: &str, worker: &str) -> Gauge {
        Gauge(stats.define_worker_gauge(name, worker))
    }
    pub fn set(self, stats: &dyn Stats, value: u64) {
        if let Some(id) = self.0 {
            stats.set_gauge(id, value);
        }
    }
}

/// A counter whose increments collect in the policy and reach the host on
/// [`flush`](BatchedCounter::flush): one host call per flush instead of one per request
/// and counter.
#[derive(Debug)]
pub struct BatchedCounter {
    counter: Counter,
    pending: u64,
}

impl BatchedCounter {
    pub fn define(stats: &dyn Stats, name: &str) -> BatchedCounter {
        BatchedCounter { counter: Counter::define(stats, name), pending: 0 }
    }
    pub fn add(&mut self, n: u64) {
        self.pending = self.pending.saturating_add(n);
    }
    pub fn inc(&mut self) {
        self.add(1);
    }
    pub fn flush(&mut self, stats: &dyn Stats) {
        self.counter.add(stats, std::mem::take(&mut self.pending));
    }
}

/// A host for the policy's tests: shared data in a [`crate::store::MemStore`], a clock
/// the test sets, stats and headers in maps, polls recorded.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::store::MemStore;
    use std::cell::{Cell, RefCell};
    use std::collections::BTreeMap;

    pub struct TestHost {
        pub store: MemStore,
        pub now_ms: Cell<u64>,
        /// Defined stats, the id being the position: name, kind and value (a counter's
        /// sum, a gauge's last value).
        pub stats: RefCell<Vec<(String, StatKind, u64)>>,
        /// Host calls that changed a stat.
        pub stat_calls: Cell<u64>,
        /// Names the host refuses to define.
        pub refused_stats: Vec<String>,
        /// Every feed poll (`GET`) sent: cluster, authority, path, timeout.
        pub polls: RefCell<Vec<(String, String, String, Duration)>>,
        /// The next poll's outcome: a token, or the host's refusal.
        pub poll_result: RefCell<Result<u64, String>>,
        /// Every `POST` sent (load reports): path and body.
        pub posts: RefCell<Vec<(String, Vec<u8>)>>,
        /// The next `POST`'s outcome.
        pub post_result: RefCell<Result<u64, String>>,
        /// Whether the host ticks (see [`Host::ticks`]).
        pub ticks: bool,
        /// Whether the host can override the upstream host (see [`Host::overrides_upstream`]).
        pub overrides_upstream: bool,
    }

    impl TestHost {
        pub fn new() -> TestHost {
            TestHost {
                store: MemStore::default(),
                now_ms: Cell::new(1_000_000),
                stats: RefCell::default(),
                stat_calls: Cell::new(0),
                refused_stats: Vec::new(),
                polls: RefCell::default(),
                poll_result: RefCell::new(Ok(1)),
                posts: RefCell::default(),
                post_result: RefCell::new(Ok(1001)),
                ticks: true,
                overrides_upstream: false,
            }
        }
        pub fn advance(&self, ms: u64) {
            self.now_ms.set(self.now_ms.get() + ms);
        }
        /// A stat's value; `None` if never defined.
        pub fn stat(&self, name: &str) -> Option<u64> {
            self.stats.borrow().iter().find(|(n, _, _)| n == name).map(|(_, _, v)| *v)
        }
        fn change(&self, id: StatId, kind: StatKind, f: impl FnOnce(&mut u64)) {
            self.stat_calls.set(self.stat_calls.get() + 1);
            if let Some((_, k, v)) = self.stats.borrow_mut().get_mut(id.0 as usize) {
                assert_eq!(*k, kind, "stat used as the wrong kind");
                f(v);
            }
        }
    }

    impl Host for TestHost {
        type Store = MemStore;
        fn store(&self) -> &MemStore {
            &self.store
        }
        fn ticks(&self) -> bool {
            self.ticks
        }
        fn overrides_upstream(&self) -> bool {
            self.overrides_upstream
        }
    }

    impl Clock for TestHost {
        fn now_ms(&self) -> u64 {
            self.now_ms.get()
        }
    }

    impl Stats for TestHost {
        fn define_stat(&self, kind: StatKind, name: &str) -> Option<StatId> {
            if self.refused_stats.iter().any(|r| r == name) {
                return None;
            }
            let mut stats = self.stats.borrow_mut();
            let i = match stats.iter().position(|(n, _, _)| n == name) {
                Some(i) => i,
                None => {
                    stats.push((name.to_string(), kind, 0));
                    stats.len() - 1
                }
            };
            Some(StatId(i as u32))
        }
        fn add_to_counter(&self, id: StatId, n: u64) {
            self.change(id, StatKind::Counter, |v| *v += n);
        }
        fn set_gauge(&self, id: StatId, value: u64) {
            self.change(id, StatKind::Gauge, |v| *v = value);
        }
    }

    impl FeedClient for TestHost {
        fn dispatch(&self, r: &SidecarCall<'_>) -> Result<u64, String> {
            if r.method == "POST" {
                self.posts.borrow_mut().push((r.path.to_string(), r.body.unwrap_or_default().to_vec()));
                return self.post_result.borrow().clone();
            }
            self.polls.borrow_mut().push((
                r.cluster.to_string(),
                r.authority.to_string(),
                r.path.to_string(),
                r.timeout,
            ));
            self.poll_result.borrow().clone()
        }
    }

    /// A request's headers, by lower-case name, with every read and removal recorded.
    #[derive(Default, Debug)]
    pub struct TestHeaders {
        pub map: BTreeMap<String, Vec<u8>>,
        pub reads: RefCell<Vec<String>>,
        pub removes: Vec<String>,
    }

    impl TestHeaders {
        pub fn with(pairs: &[(&str, &str)]) -> TestHeaders {
            TestHeaders {
                map: pairs.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect(),
                ..TestHeaders::default()
            }
        }
        pub fn value(&self, name: &str) -> Option<&str> {
            self.map.get(name).and_then(|v| std::str::from_utf8(v).ok())
        }
    }

    impl RequestHeaders for TestHeaders {
        fn get(&self, name: &str) -> Option<Vec<u8>> {
            self.reads.borrow_mut().push(name.to_string());
            self.map.get(name).cloned()
        }
        fn set(&mut self, name: &str, value: &str) {
            self.map.insert(name.to_string(), value.as_bytes().to_vec());
        }
        fn remove(&mut self, name: &str) {
            self.removes.push(name.to_string());
            self.map.remove(name);
        }
    }
}
