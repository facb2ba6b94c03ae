//! The filter's and the sync service's JSON configurations ([`kvroute::config`]).
//!
//! Input: a selector byte (even: the filter's `kvroute` config, odd: `kvroute-sync`), then
//! the configuration bytes as Envoy hands them to `on_configure`.
//! - a configuration that loads is inside every documented range (what the rest of the
//!   code relies on without checking again), and no two settings name one header;
//! - a filter configuration that loads routes a request on an empty store (no table: the
//!   documented fallback) without panicking.

use kvroute::config::{FilterConfig, KvCapacity, SyncConfig};
use kvroute::router::{Fallback, Router, TokenSource};
use kvroute::store::MemStore;

pub fn check(data: &[u8]) {
    let (sel, config) = crate::selector(data);
    if sel % 2 == 0 {
        let Ok(c) = FilterConfig::from_json(config) else { return };
        assert!((1..=1024).contains(&c.block_size) && (1..=1 << 22).contains(&c.max_tokens), "{c:?}");
        assert!((1..=16).contains(&c.max_endpoints) && c.inflight_lease_ms >= 1_000, "{c:?}");
        for w in [c.overlap_weight, c.prefill_overlap_weight, c.decode_overlap_weight, c.prefill_load_weight]
            .into_iter()
            .chain(c.wait_slack_per_hit)
            .chain(c.idle_wait_slack_per_hit)
            .chain(c.wait_slack_backlog)
            .chain(c.wait_slack_own_cap)
            .chain(c.holder_tie_per_hit)
            .chain(c.holder_tie_load_slack)
        {
            assert!(w.is_finite() && (0.0..=1e6).contains(&w), "weight {w}");
        }
        assert!((0.0..=1.0).contains(&c.offload_hit_credit));
        assert!(c.kv_capacity_blocks != KvCapacity::Blocks(0), "{c:?}");
        let headers: Vec<&str> = [&c.token_header, &c.token_header_b64, &c.destination_header, &c.prefiller_header]
            .into_iter()
            .map(String::as_str)
            .chain(c.debug_header.as_deref())
            .chain(c.lora_header.as_deref())
            .chain(c.cache_salt_header.as_deref())
            .collect();
        for (i, h) in headers.iter().enumerate() {
            assert!(
                !h.is_empty()
                    && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
            );
            assert!(!headers[..i].contains(h), "header {h} named twice");
        }
        let d = Router::new(c).route(&MemStore::new(), TokenSource::Missing, 0, 0);
        assert_eq!((d.fallback, d.destinations.len()), (Some(Fallback::NoTable), 0));
    } else {
        let Ok(c) = SyncConfig::from_json(config) else { return };
        assert!(!c.feed_cluster.is_empty() && !c.feed_authority.is_empty(), "{c:?}");
        assert!(c.feed_path.starts_with('/') && !c.feed_path.contains('?'), "{c:?}");
        assert!((100..=60_000).contains(&c.poll_timeout_ms) && (10..=60_000).contains(&c.retry_interval_ms));
        assert!(c.stale_after_ms > c.poll_timeout_ms && c.max_frame_bytes >= 4096, "{c:?}");
        assert!(c.n_buckets.is_power_of_two() && (16..=1 << 20).contains(&c.n_buckets), "{c:?}");
        let interval = c.load_report_interval_ms;
        assert!(interval == 0 || (100..=10_000).contains(&interval), "{c:?}");
        assert!(c.load_path.starts_with('/') && !c.load_path.contains('?'), "{c:?}");
        if let Some(id) = &c.gateway_id {
            assert!((1..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic()), "{c:?}");
        }
    }
}
