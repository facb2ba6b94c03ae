//! The threads that tokenize: tokio's blocking pool, every thread started and warmed
//! before the first request, and kept.
//!
//! Tokenizing on a thread for the first time is slow: the allocator gives the thread a
//! heap of its own, and the kernel backs it with new pages (with transparent huge pages,
//! a 2 MiB page zeroed per first touch). Measured in a burst on a two-core VM, such a
//! first tokenization took 35–75 ms instead of ~2, while the requests behind it waited
//! for its permit (docs/benchmarks.md, "The stage's stalls on new memory").
//! Tokio starts blocking threads on demand and ends them after 10 s idle, so that cost
//! fell on the first requests after a start and, whenever a thread was started or ended,
//! in the middle of traffic. Here every thread of the pool is started at once, made to
//! tokenize a probe text, and kept for a day idle; the pool's size is its cap, so no
//! thread is started later.

use crate::stage::Stage;
use kvroute_serve::lock;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long an idle pool thread is kept: in practice, for the process's life.
pub const KEEP_ALIVE: Duration = Duration::from_secs(24 * 3600);

/// How long warming waits for every thread to be running at once before it gives up
/// (the threads it did start stay warm).
const WARM_TIMEOUT: Duration = Duration::from_secs(10);

/// A multi-threaded runtime whose blocking pool is `threads` threads, kept when idle.
pub fn runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(threads)
        .thread_keep_alive(KEEP_ALIVE)
        .build()
}

/// Starts `threads` pool threads, each tokenizing a probe with every model; returns how
/// many threads were warmed (all of them, unless the OS refused a thread or they did not
/// all start within [`WARM_TIMEOUT`]).
pub async fn warm(stage: Arc<Stage>, threads: usize) -> usize {
    let probe = Arc::new(probe_text());
    let warmed = Arc::new(Mutex::new(HashSet::new()));
    let deadline = Instant::now() + WARM_TIMEOUT;
    let tasks: Vec<_> = (0..threads)
        .map(|_| {
            let (stage, probe, warmed) = (stage.clone(), probe.clone(), warmed.clone());
            tokio::task::spawn_blocking(move || {
                for m in stage.models() {
                    // HF tokenizers directly: nothing cached, no counter moved.
                    let _ = m.tokenizer().encode(probe.as_str(), false);
                }
                // Each task holds its thread until all are warm, so that each gets a
                // thread of its own.
                lock(&warmed).insert(std::thread::current().id());
                while lock(&warmed).len() < threads && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    let n = lock(&warmed).len();
    n
}

/// ~4k tokens of plain text: about the allocation a long prompt's tokenization makes.
fn probe_text() -> String {
    (0..400).map(|i| format!("Line {i}: the quick brown fox jumps over the lazy dog. ")).collect()
}
