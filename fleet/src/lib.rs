//! kvroute's simulated fleet: mock engines that behave like vLLM where a router can tell
//! (paged prefix cache, prefill/decode timing, KV events in vLLM's wire format), and the
//! load generator that drives them.
//!
//! - [`kvcache`]: the paged prefix cache and its KV events;
//! - [`engine`]: the scheduler and timing model;

pub mod engine;
pub mod kvcache;
pub mod kvevents;
pub mod tokenizer;
pub mod worker;

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        if let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            tokio::select! {
                _ = ctrl_c => {},
                _ = term.recv() => {},
            }
            return;
        }
    }
    let _ = ctrl_c.await;
}
