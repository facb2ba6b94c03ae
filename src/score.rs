//! The cost function and the ranking of workers.
//!
//! ```text
//! cost(w) = overlap_weight × (request_blocks − cache_hits(w)) + active_blocks(w)
//!         + prefill_load_weight × pending_prefill(w) + key_load(w)
//! ```
//!
//! The first line is the specification's cost. `cache_hits(w)` is the number of *leading
//! consecutive* request blocks `w` holds (an engine's prefix cache stops at the first
//! miss); `active_blocks(w)` is the number of distinct in-flight prompt blocks on `w` — by
//! default with this request's own blocks added (the router computes it, see
//! [`crate::config::ActiveBlocks`]). `pending_prefill(w)` is the uncached prompt blocks of
//! requests routed to `w` whose prefill has not finished. `key_load(w)` is 0 but for the first
//! request of a cache key new to the router ([`crate::cachekey`]): the keys live on `w`
//! × `cache_key_spread` × the request's blocks. Lowest cost wins. A hit `w` holds
//! only in an offload tier (CPU memory, disk) counts `offload_hit_credit` (< 1) of a GPU
//! hit: loading it back is cheaper than recomputing it, not free.
//!
//! The wait limit (`wait_slack_per_hit`, α): the cost ranks workers by blocks, and a worker
//! whose cache saves a request much prefill can keep winning while its queue grows, so a
//! hot prefix's holder makes requests wait longer than a cold prefill elsewhere would
//! take. With α set, a worker is passed over when the prefill the request waits for there
//! (`wait(w)`: the worker's outstanding prefill, sibling work included, plus the request's
//! own) exceeds both the least wait of any worker and the request's own prefill there by
//! more than α × its cache hits: each hit may buy at most α blocks of queueing beyond the
//! quickest worker's. A worker with nothing queued is never passed over: what keeps a
//! request waiting there is its own prefill, which the cost already prices. The admissible
//! workers come first, in cost order, then the rest (for retries), also in cost order.
//! While some worker has no prefill outstanding, α is `idle_wait_slack_per_hit`
//! (smaller): a request passed over then starts at once there, and the copy of its prefix
//! it makes costs no one queueing; with every worker busy, a copy's prefill lands in
//! another worker's queue and the holder is kept longer. How much longer grows with the
//! fleet's backlog (`wait_slack_backlog`, β): α × (1 + β × the least prefill any worker has
//! outstanding ÷ the request's blocks). In a backlog a spilled request starts no sooner than
//! the quickest queue lets it, and the prefix it copies is prefill every later request there
//! waits behind: a fleet past its capacity serves fewer requests per block computed twice.
//! The own cap (`wait_slack_own_cap`, c, 8): while some worker is idle, α is at most c ÷
//! the request's own uncached blocks on the worker. A request kept on a busy holder adds
//! its own prefill to the queue every later request of its prefix waits behind there,
//! while its copy on the idle worker delays no one: a long question over a shared prefix
//! (64 own blocks over 128 held: 0.125 a hit) buys less waiting than a burst's short ones
//! (4 over 128), which keep α. With every worker busy a copy lands in another queue, and
//! the slack is uncapped, grown by the backlog.
//!
//! The memory limit (`kv_capacity_blocks`; by default each engine's capacity as learned
//! from its evictions): a worker whose in-flight requests would hold more distinct blocks
//! than its engine's KV cache, with this request's new blocks added (`memory_blocks`), is
//! passed over while another has room, as the wait limit passes over one. An engine whose
//! capacity is not known has room. The engine cannot run them all at once: the request
//! waits for memory there, and while it waits the engine evicts the cached prefix it was
//! sent for. The cost does not see it: it weighs blocks in flight against blocks to
//! prefill, never against what an engine holds, and a shared system prompt makes one more
//! long-lived session on its holder look cheap (docs/benchmarks.md, "On the second
//! simulator").
//!
//! The holder tie (`holder_tie_per_hit`, τ): at weight 1 a worker holding the request's
//! prefix while it prefills another request's cold prompt carries that prompt twice, as
//! load and as queue, and can cost a few blocks more than an idle worker holding nothing,
//! though the request would wait as long on either. Sending it to the idle worker makes a
//! second copy of the prefix: its whole prefill computed again and its blocks cached twice,
//! with the fleet's later hits split between the two. So a worker with more cache hits is
//! put first when it would start the request's prefill no later than τ blocks per extra
//! hit after the cheapest worker would finish it (its outstanding prefill ≤ the cheapest's
//! wait + τ × the extra hits: the cold prompt ahead is usually part done, and a sibling's
//! few queued blocks must not tip it), the wait limit admits it, and its cost is within τ
//! per extra hit of the cheapest's. With several, the one with the most hits. Decode load
//! stays priced: a holder far busier decoding costs far more than τ per hit.
//!
//! The holder tie's load test (`holder_tie_load_slack`, k; off by default): a holder also
//! ties, its cost aside, when its in-flight blocks exceed the cheapest's by at most k × the
//! request's blocks (at k 1, one more request like this one). It covers a holder busy with
//! one other request of the same size, which costs about that request's blocks more than
//! an idle worker (128 more for 128 extra hits with a 128-block prefix in 192-block
//! requests, four times τ 0.25). It keeps more hits on hot prefixes at the cost of their
//! tail latency and the agentic loop's (docs/benchmarks.md, "The holder tie's load test").
//!
//! Ties, in order: more cache hits (a tie between locality and load goes to locality,
//! which is cheaper in prefill); then fewer cached blocks (`cached_blocks`, when the caller
//! read them: the router does for a prefix no worker holds, see [`tied_at_top`]); then the
//! lowest rendezvous hash of (request key, worker) — deterministic for a given request, and
//! spread evenly over workers across requests, so equal-cost cold requests do not all pile
//! onto the first worker in the table. The cached blocks come before the hash because the
//! hash spreads prefixes only on average: 16 prefixes hashed over 8 engines put four or
//! more on one engine in 79% of draws, and a later request of a prefix whose holder is busy
//! with another's prefill then makes a second copy elsewhere. The emptiest engine also has
//! the most room, so a new prefix evicts nothing a fuller one still serves.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// One worker's inputs to the cost function.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub slot: usize,
    pub cache_hits: u32,
    /// Of `cache_hits`, the blocks held only in an offload tier.
    pub offloaded_hits: u32,
    pub active_blocks: u32,
    pub pending_prefill: u32,
    /// The prefill blocks the request would wait for on `w`: its outstanding prefill (a
    /// sibling's shared blocks included: the request waits for them) plus its own.
    pub wait: u32,
    /// Of `wait`, the request's own: its blocks `w` neither holds nor has in flight.
    pub own_prefill: u32,
    /// Blocks the worker holds in GPU memory, for tie-breaking; 0 when not read.
    pub cached_blocks: u32,
    /// The distinct blocks the worker's in-flight requests would hold with this request
    /// added, for the memory limit.
    pub memory_blocks: u32,
    /// The memory limit (module docs): the KV blocks the worker's engine holds; `None`: no
    /// limit on it.
    pub kv_capacity_blocks: Option<u32>,
    /// Stable hash of the worker's id, for tie-breaking (see [`worker_key`]).
    pub worker_key: u64,
    /// The first request of a new cache key: the blocks it is charged for the keys live on
    /// the worker ([`crate::cachekey`]); 0 otherwise.
    pub key_load: u32,
}

/// What [`rank`] did beyond sorting by cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankOutcome {
    /// The wait limit passed over the cheapest worker.
    pub spilled: bool,
    /// The memory limit passed over the cheapest worker.
    pub memory_limited: bool,
    /// The holder tie put a worker with more cache hits before the cheapest.
    pub kept_on_holder: bool,
    /// The first two tied on cost and hits and the one with fewer cached blocks came first.
    pub least_cached: bool,
}

/// A candidate with its cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scored {
    pub candidate: Candidate,
    pub cost: f64,
    tiebreak: u64,
}

/// The weights of the cost's terms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Weights {
    pub overlap: f64,
    pub prefill_load: f64,
    pub offload_hit_credit: f64,
    /// α of the wait limit (module docs); `None`: the cost alone ranks.
    pub wait_slack_per_hit: Option<f64>,
    /// α of the wait limit while some worker has no prefill outstanding (module docs);
    /// `None`: `wait_slack_per_hit` throughout.
    pub idle_wait_slack_per_hit: Option<f64>,
    /// β of the wait limit's backlog (module docs): with every worker busy, α grows by this
    /// much per request's worth of prefill the quickest worker has outstanding. `None`: α
    /// stays.
    pub wait_slack_backlog: Option<f64>,
    /// c of the wait limit's own cap (module docs): while some worker is idle, a hit buys
    /// at most c ÷ the request's own uncached blocks on the worker. `None`: no cap.
    pub wait_slack_own_cap: Option<f64>,
    /// τ of the holder tie (module docs); `None`: no tie.
    pub holder_tie_per_hit: Option<f64>,
    /// k of the holder tie (module docs), in the request's blocks; `None`: the cost test
    /// alone.
    pub holder_tie_load_slack: Option<f64>,
}

/// The specification's cost function.
#[inline]
pub fn cost(overlap_weight: f64, request_blocks: u32, cache_hits: u32, active_blocks: u32) -> f64 {
    cost_of_hits(overlap_weight, request_blocks, f64::from(cache_hits), active_blocks)
}

/// [`cost`] with (possibly credited, so fractional) hits.
#[inline]
fn cost_of_hits(overlap_weight: f64, request_blocks: u32, hits: f64, active_blocks: u32) -> f64 {
    overlap_weight * (f64::from(request_blocks) - hits).max(0.0) + f64::from(active_blocks)
}

impl Candidate {
    /// Cache hits with offloaded ones credited at `offload_hit_credit`.
    #[inline]
    pub fn effective_hits(&self, offload_hit_credit: f64) -> f64 {
        let off = self.offloaded_hits.min(self.cache_hits);
        f64::from(self.cache_hits - off) + offload_hit_credit * f64::from(off)
    }
}

/// Stable key of a worker id for tie-breaking.
pub fn worker_key(id: &str) -> u64 {
    xxh3_64_with_seed(id.as_bytes(), 0)
}

/// Whether the first two of a ranking are equally cheap with as many hits: then the order
/// of the two is the tie-breaks', and a caller that has not read the cached-block counts
/// should, and rank again.
pub fn tied_at_top(ranked: &[Scored], offload_hit_credit: f64) -> bool {
    match ranked {
        [a, b, ..] => {
            a.cost == b.cost
                && a.candidate.effective_hits(offload_hit_credit) == b.candidate.effective_hits(offload_hit_credit)
        }
        _ => false,
    }
}

/// Scores and sorts `candidates` best first into `out` (cleared first).
/// `request_key` identifies the request for tie-breaking: its first block's hash, so
/// requests with the same start agree, or a caller-supplied random number for requests
/// without blocks.
pub fn rank(
    candidates: &[Candidate],
    weights: Weights,
    request_blocks: u32,
    request_key: u64,
    out: &mut Vec<Scored>,
) -> RankOutcome {
    let offload_hit_credit = weights.offload_hit_credit;
    out.clear();
    out.extend(candidates.iter().map(|c| Scored {
        candidate: *c,
        cost: cost_of_hits(weights.overlap, request_blocks, c.effective_hits(offload_hit_credit), c.active_blocks)
            + weights.prefill_load * f64::from(c.pending_prefill)
            + f64::from(c.key_load),
        tiebreak: crate::hash::chain_hash(request_key, c.worker_key),
    }));
    out.sort_by(|a, b| {
        a.cost
            .total_cmp(&b.cost)
            .then(
                b.candidate
                    .effective_hits(offload_hit_credit)
                    .total_cmp(&a.candidate.effective_hits(offload_hit_credit)),
            )
            .then(a.candidate.cached_blocks.cmp(&b.candidate.cached_blocks))
            .then(a.tiebreak.cmp(&b.tiebreak))
            .then(a.candidate.slot.cmp(&b.candidate.slot))
    });
    let least = out.iter().map(|s| s.candidate.wait).min().unwrap_or(0);
    // The fleet's backlog: the least prefill any worker has outstanding. 0: some worker is
    // idle (its wait is the request's own).
    let backlog = out.iter().map(|s| s.candidate.wait.saturating_sub(s.candidate.own_prefill)).min().unwrap_or(0);
    let slack =
        weights.wait_slack_per_hit.map(|a| match (weights.idle_wait_slack_per_hit, weights.wait_slack_backlog) {
            (Some(idle), _) if backlog == 0 => idle,
            (_, Some(beta)) if request_blocks > 0 => a * (1.0 + beta * f64::from(backlog) / f64::from(request_blocks)),
            _ => a,
        });
    // The own cap, while some worker is idle (a copy there delays no one).
    let own_cap = weights.wait_slack_own_cap.filter(|_| backlog == 0);
    let slack_per_hit = |c: &Candidate| {
        slack.map(|per_hit| match own_cap {
            Some(cap) if c.own_prefill > 0 => per_hit.min(cap / f64::from(c.own_prefill)),
            _ => per_hit,
        })
    };
    // The memory limit applies while some worker has room for the request.
    let fits = |s: &Scored| s.candidate.kv_capacity_blocks.is_none_or(|cap| s.candidate.memory_blocks <= cap);
    let room = out.iter().any(fits);
    let overfills = |s: &Scored| room && !fits(s);
    let admissible = |s: &Scored| {
        let c = &s.candidate;
        !overfills(s)
            && slack_per_hit(c).is_none_or(|per_hit| {
                f64::from(c.wait)
                    <= f64::from(least.max(c.own_prefill)) + per_hit * c.effective_hits(offload_hit_credit)
            })
    };
    let mut outcome = RankOutcome::default();
    if let Some(cheapest) = out.first().copied().filter(|s| !admissible(s)) {
        // Stable: cost order within each side.
        out.sort_by_key(|s| !admissible(s));
        outcome.memory_limited = overfills(&cheapest);
        outcome.spilled = !outcome.memory_limited;
    }
    if let (Some(tau), Some(best)) = (weights.holder_tie_per_hit, out.first().copied()) {
        let load_reach = weights
            .holder_tie_load_slack
            .map(|k| f64::from(best.candidate.active_blocks) + k * f64::from(request_blocks));
        let hits = |s: &Scored| s.candidate.effective_hits(offload_hit_credit);
        let ties = |s: &Scored| {
            let more = hits(s) - hits(&best);
            more > 0.0
                && admissible(s)
                && f64::from(s.candidate.wait.saturating_sub(s.candidate.own_prefill))
                    <= f64::from(best.candidate.wait) + tau * more
                && (s.cost <= best.cost + tau * more
                    || load_reach.is_some_and(|reach| f64::from(s.candidate.active_blocks) <= reach))
        };
        // The most hits; among equals the earliest, i.e. the cheapest.
        let holder = out
            .iter()
            .enumerate()
            .filter(|(_, s)| ties(s))
            .max_by(|(i, a), (j, b)| hits(a).total_cmp(&hits(b)).then(j.cmp(i)))
            .map(|(i, _)| i);
        if let Some(i) = holder {
            out[..=i].rotate_right(1);
            outcome.kept_on_holder = true;
        }
    }
    outcome.least_cached =
        tied_at_top(out, offload_hit_credit) && out[0].candidate.cached_blocks < out[1].candidate.cached_blocks;
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn cand(slot: usize, hits: u32, active: u32) -> Candidate {
        Candidate {
            slot,
            cache_hits: hits,
            offloaded_hits: 0,
            active_blocks: active,
            pending_prefill: 0,
            wait: 0,
            own_prefill: 0,
            cached_blocks: 0,
            memory_blocks: 0,
            kv_capacity_blocks: None,
            worker_key: worker_key(&slot.to_string()),
            key_load: 0,
        }
    }

    fn w(overlap: f64, offload_hit_credit: f64) -> Weights {
        Weights {
            overlap,
            prefill_load: 0.0,
            offload_hit_credit,
            wait_slack_per_hit: None,
            idle_wait_slack_per_hit: None,
            wait_slack_backlog: None,
            wait_slack_own_cap: None,
            holder_tie_per_hit: None,
            holder_tie_load_slack: None,
        }
    }

    /// The specification's worked example: a 10-block prompt, weight 1.0.
    #[test]
    fn specification_worked_example() {
        let w0 = cand(0, 8, 6);
        let w1 = cand(1, 0, 1);
        assert_eq!(cost(1.0, 10, 8, 6), 8.0);
        assert_eq!(cost(1.0, 10, 0, 1), 11.0);
        let mut out = Vec::new();
        rank(&[w1, w0], w(1.0, 0.5), 10, 0, &mut out);
        assert_eq!(out[0].candidate.slot, 0);
        assert_eq!((out[0].cost, out[1].cost), (8.0, 11.0));
        // Raise the weight and W0 wins by more.
        rank(&[w1, w0], w(2.0, 0.5), 10, 0, &mut out);
        assert_eq!((out[0].cost, out[1].cost), (10.0, 21.0));
        // At 0 only active_blocks counts: W1 (1) beats W0 (6).
        rank(&[w1, w0], w(0.0, 0.5), 10, 0, &mut out);
        assert_eq!(out[0].candidate.slot, 1);
        assert_eq!((out[0].cost, out[1].cost), (1.0, 6.0));
    }

    #[test]
    fn offloaded_hits_count_at_their_credit() {
        // W0: 8 hits, 6 of them offloaded; W1: 5 GPU hits, 10-block prompt, no load.
        // Credit 0.75: W0 has 2 + 4.5 = 6.5 effective hits, cost 3.5, and wins. Credit 0.25:
        // 2 + 1.5 = 3.5 hits, cost 6.5: W1 (cost 5) wins.
        let mut w0 = cand(0, 8, 0);
        w0.offloaded_hits = 6;
        let w1 = cand(1, 5, 0);
        let mut out = Vec::new();
        rank(&[w1, w0], w(1.0, 0.75), 10, 0, &mut out);
        assert_eq!((out[0].candidate.slot, out[0].cost, out[1].cost), (0, 3.5, 5.0));
        rank(&[w1, w0], w(1.0, 0.25), 10, 0, &mut out);
        assert_eq!((out[0].candidate.slot, out[0].cost, out[1].cost), (1, 5.0, 6.5));
        // Credit 1 is the specification's plain count.
        rank(&[w1, w0], w(1.0, 1.0), 10, 0, &mut out);
        assert_eq!(out[0].cost, cost(1.0, 10, 8, 0));
    }

    #[test]
    fn ties_prefer_hits_then_are_stable_and_spread() {
        // Equal cost: 1×(10−4)+2 = 8 = 1×(10−2)+0; the one with more hits wins.
        let mut out = Vec::new();
        rank(&[cand(0, 2, 0), cand(1, 4, 2)], w(1.0, 0.5), 10, 0, &mut out);
        assert_eq!(out[0].candidate.slot, 1);
        // Fully equal: the winner depends only on the request key, and varies with it.
        let all: Vec<_> = (0..8).map(|s| cand(s, 0, 0)).collect();
        let mut winners = std::collections::BTreeSet::new();
        for key in 0..200u64 {
            rank(&all, w(1.0, 0.5), 10, key, &mut out);
            let first = out[0].candidate.slot;
            let mut rev = all.clone();
            rev.reverse();
            rank(&rev, w(1.0, 0.5), 10, key, &mut out);
            assert_eq!(out[0].candidate.slot, first, "order of candidates must not matter");
            winners.insert(first);
        }
        assert_eq!(winners.len(), 8, "ties spread over every worker");
    }

    #[test]
    fn a_tie_goes_to_the_fewest_cached_blocks_before_the_hash() {
        let mut out = Vec::new();
        // Eight idle cold workers; slot 5 holds the fewest blocks: it wins for every key.
        let mut all: Vec<_> = (0..8).map(|s| Candidate { cached_blocks: 500, ..cand(s, 0, 0) }).collect();
        all[5].cached_blocks = 130;
        for key in 0..50u64 {
            let outcome = rank(&all, w(1.0, 0.5), 10, key, &mut out);
            assert_eq!(out[0].candidate.slot, 5, "key {key}");
            assert!(outcome.least_cached && tied_at_top(&out, 0.5));
        }
        // Not a tie: cost first (slot 5 carries one block more), then hits.
        all[5].active_blocks = 1;
        let outcome = rank(&all, w(1.0, 0.5), 10, 0, &mut out);
        assert_ne!(out[0].candidate.slot, 5);
        assert!(!outcome.least_cached, "the rest tie on equal counts: the hash decided");
        let (holder, empty) = (cand(0, 4, 4), Candidate { cached_blocks: 0, ..cand(1, 0, 0) });
        let holder = Candidate { cached_blocks: 900, ..holder };
        let outcome = rank(&[empty, holder], w(1.0, 0.5), 10, 0, &mut out);
        assert_eq!(out[0].candidate.slot, 0, "equal cost: hits before cached blocks");
        assert!(!outcome.least_cached && !tied_at_top(&out, 0.5));
        assert!(!tied_at_top(&out[..1], 0.5), "one worker ties with none");
    }

    #[test]
    fn outstanding_prefill_counts_at_its_weight() {
        // Equal hits and active blocks; W0 has 40 blocks of prefill still queued.
        let mut w0 = cand(0, 8, 2);
        w0.pending_prefill = 40;
        let w1 = cand(1, 8, 2);
        let mut out = Vec::new();
        let weights = Weights { prefill_load: 0.5, ..w(1.0, 0.5) };
        rank(&[w0, w1], weights, 10, 0, &mut out);
        assert_eq!((out[0].candidate.slot, out[0].cost, out[1].cost), (1, 4.0, 24.0));
        // Weight 0: the prefill term is gone, and the cost is the specification's.
        rank(&[w0, w1], Weights { prefill_load: 0.0, ..weights }, 10, 0, &mut out);
        assert_eq!((out[0].cost, out[1].cost), (cost(1.0, 10, 8, 2), cost(1.0, 10, 8, 2)));
    }

    /// An agent's step: its holder has 234 of 252 blocks cached and 560 blocks in flight
    /// (the request's 18 new ones added: 578); an idle engine with the shared 128 would
    /// hold the request's 252. Engines of 512 blocks.
    #[test]
    fn the_memory_limit_passes_over_an_engine_the_request_would_overfill() {
        let holder = Candidate { memory_blocks: 578, ..cand(0, 234, 578) };
        let idle = Candidate { memory_blocks: 252, ..cand(1, 128, 252) };
        let capped = |c: Candidate, cap: u32| Candidate { kv_capacity_blocks: Some(cap), ..c };
        let mut out = Vec::new();
        // The cost alone: 18 + 578 against 124 + 252, the idle engine wins anyway at
        // weight 1; at weight 4 the holder (72 + 578 against 496 + 252).
        assert_eq!(rank(&[idle, holder], w(4.0, 0.5), 252, 0, &mut out), RankOutcome::default());
        assert_eq!(out[0].candidate.slot, 0);
        let limited = [capped(idle, 512), capped(holder, 512)];
        assert_eq!(
            rank(&limited, w(4.0, 0.5), 252, 0, &mut out),
            RankOutcome { memory_limited: true, ..RankOutcome::default() }
        );
        assert_eq!((out[0].candidate.slot, out[1].candidate.slot), (1, 0));
        // Room to spare: the limit does not move it.
        assert!(!rank(&[capped(idle, 578), capped(holder, 578)], w(4.0, 0.5), 252, 0, &mut out).memory_limited);
        assert_eq!(out[0].candidate.slot, 0);
        // No engine has room: the cost decides, as without a limit.
        let full = Candidate { memory_blocks: 600, ..idle };
        assert!(!rank(&[capped(full, 512), capped(holder, 512)], w(4.0, 0.5), 252, 0, &mut out).memory_limited);
        assert_eq!(out[0].candidate.slot, 0);
        // Capacities are per engine: an engine not yet learned has room, whatever it carries.
        assert!(rank(&[full, capped(holder, 512)], w(4.0, 0.5), 252, 0, &mut out).memory_limited);
        assert_eq!(out[0].candidate.slot, 1);
        // A larger engine holds what a smaller one cannot.
        assert!(!rank(&[capped(idle, 512), capped(holder, 1024)], w(4.0, 0.5), 252, 0, &mut out).memory_limited);
        assert_eq!(out[0].candidate.slot, 0);
    }

    /// A hot prefix's holder: 128 of a 192-block request cached, 300 blocks of prefill
    /// queued. A cold idle worker would make the request wait for its 192 blocks only.
    #[test]
    fn the_wait_limit_passes_over_a_holder_whose_queue_outweighs_its_hits() {
        let holder = Candidate { wait: 300 + 64, own_prefill: 64, ..cand(0, 128, 400) };
        let cold = Candidate { wait: 192, own_prefill: 192, ..cand(1, 0, 500) };
        let mut out = Vec::new();
        let off = w(1.0, 0.5);
        // The cost alone: 64 + 400 against 192 + 500, the holder.
        assert!(!rank(&[cold, holder], off, 192, 0, &mut out).spilled);
        assert_eq!(out[0].candidate.slot, 0);
        // α = 1: 364 ≤ 192 + 128 is false, so the holder is passed over (and stays in the
        // list for retries, second).
        assert!(rank(&[cold, holder], Weights { wait_slack_per_hit: Some(1.0), ..off }, 192, 0, &mut out).spilled);
        assert_eq!((out[0].candidate.slot, out[1].candidate.slot), (1, 0));
        // α = 2: 364 ≤ 192 + 256: the holder's hits buy its queue.
        assert!(!rank(&[cold, holder], Weights { wait_slack_per_hit: Some(2.0), ..off }, 192, 0, &mut out).spilled);
        assert_eq!(out[0].candidate.slot, 0);
        // Offloaded hits buy at their credit: 100 of the 128 offloaded at 0.5 give 78
        // effective hits, and α = 2 no longer covers the queue (364 > 192 + 156).
        let holder = Candidate { offloaded_hits: 100, ..holder };
        assert!(rank(&[cold, holder], Weights { wait_slack_per_hit: Some(2.0), ..off }, 192, 0, &mut out).spilled);
        assert_eq!(out[0].candidate.slot, 1);
    }

    /// A group's holder prefilling another group's cold prompt (132 blocks, as load and as
    /// queue) against an idle worker that holds nothing, for a 132-block request with 128
    /// blocks cached on the holder: the waits are 136 and 132 blocks, the costs 404 and 396.
    fn copy_case() -> [Candidate; 2] {
        let idle = Candidate { wait: 132, own_prefill: 132, pending_prefill: 132, ..cand(0, 0, 132) };
        let holder = Candidate { wait: 136, own_prefill: 4, pending_prefill: 136, ..cand(1, 128, 264) };
        [idle, holder]
    }

    fn shipped() -> Weights {
        crate::config::FilterConfig::from_json(b"{}").expect("the defaults load").weights(1.0, true)
    }

    /// The shipped weights without the own cap: what α alone does.
    fn uncapped() -> Weights {
        Weights { wait_slack_own_cap: None, ..shipped() }
    }

    /// Two requests of a new prefix close together: the first is prefilling its whole
    /// 192-block prompt on worker 0 when the second (128 blocks shared, a 64-block question
    /// of its own) arrives. Worker 0 is the cheaper (the shared blocks are computed once), but
    /// the request would wait for all of the first's prefill and then its own question, 256
    /// blocks against a cold 192 on the idle worker: 64 blocks longer, half a block per hit.
    /// With that worker idle the shipped limit is 0.45 per hit and spills it (measured: such
    /// requests were zipf_hot's slowest, ~1.35× a cold prefill); with no idle worker, 0.5.
    /// A burst's siblings with 4-block questions stay together: the 12th waits 176 blocks
    /// against 132, 44 more, within 0.45 × 128 (up to 15 stay whole).
    #[test]
    fn the_shipped_limit_spills_a_long_question_behind_a_siblings_cold_prefill() {
        let idle = Candidate { wait: 192, own_prefill: 192, pending_prefill: 192, ..cand(0, 0, 192) };
        let sibling = Candidate { wait: 256, own_prefill: 64, pending_prefill: 128, ..cand(1, 128, 256) };
        let mut out = Vec::new();
        let r = rank(&[idle, sibling], uncapped(), 192, 0, &mut out);
        assert_eq!((out[0].candidate.slot, out[0].cost, out[1].cost), (0, 576.0, 448.0));
        assert!(r.spilled, "the sibling's worker costs 448 against 576, but its wait is beyond the limit");
        assert!(
            !rank(&[idle, sibling], Weights { idle_wait_slack_per_hit: None, ..uncapped() }, 192, 0, &mut out).spilled
        );
        // The other worker busy too: 8 blocks outstanding there, so the request would not
        // start at once anywhere; 256 ≤ 200 + 0.5 × 128.
        let busy = Candidate { wait: 200, pending_prefill: 200, ..idle };
        assert!(!rank(&[busy, sibling], uncapped(), 192, 0, &mut out).spilled);
        assert_eq!(out[0].candidate.slot, 1);
        assert!(!rank(&[busy, sibling], shipped(), 192, 0, &mut out).spilled, "no idle worker: no own cap");
        // The burst: the 12th request of 132 blocks (128 shared) behind the first's prefill
        // and ten siblings' 4-block questions.
        let idle = Candidate { wait: 132, own_prefill: 132, pending_prefill: 132, ..cand(0, 0, 132) };
        let holder = Candidate { wait: 132 + 40 + 4, own_prefill: 4, pending_prefill: 48, ..cand(1, 128, 176) };
        let r = rank(&[idle, holder], shipped(), 132, 0, &mut out);
        assert!(!r.spilled);
        assert_eq!(out[0].candidate.slot, 1);
    }

    /// A fleet past its capacity: every worker has a queue. The quickest has 384 blocks of
    /// prefill outstanding (two 192-block requests' worth), so the request would wait 576
    /// there; the holder of its 128 shared blocks has 700, a wait of 764. That is 188 blocks
    /// more, beyond α × 128 = 64, and a fixed α passes the holder over. With the backlog
    /// counted (the shipped β 1: α × (1 + 384 ÷ 192) = 1.5, 192 blocks) the holder is kept;
    /// at 800 outstanding (288 more) it is passed over again.
    #[test]
    fn the_wait_limit_grows_with_the_fleets_backlog() {
        let quickest = Candidate { wait: 384 + 192, own_prefill: 192, pending_prefill: 576, ..cand(0, 0, 576) };
        let holder = |queued: u32| Candidate {
            wait: queued + 64,
            own_prefill: 64,
            pending_prefill: queued + 64,
            ..cand(1, 128, 100)
        };
        let (backlog, flat) = (shipped(), Weights { wait_slack_backlog: None, ..shipped() });
        let mut out = Vec::new();
        assert!(rank(&[quickest, holder(700)], flat, 192, 0, &mut out).spilled);
        assert_eq!(out[0].candidate.slot, 0);
        assert!(!rank(&[quickest, holder(700)], backlog, 192, 0, &mut out).spilled);
        assert_eq!(out[0].candidate.slot, 1);
        assert!(rank(&[quickest, holder(800)], backlog, 192, 0, &mut out).spilled);
        assert_eq!(out[0].candidate.slot, 0);
        // With a worker idle there is no backlog: the idle slack as before, whatever β.
        let idle = Candidate { wait: 192, own_prefill: 192, pending_prefill: 192, ..cand(0, 0, 192) };
        let near = holder(192);
        assert!(rank(&[idle, near], backlog, 192, 0, &mut out).spilled);
        assert!(rank(&[idle, near], flat, 192, 0, &mut out).spilled);
    }

    /// The own cap (the shipped c = 8): with a worker idle, a hit buys at most 8 ÷ the
    /// request's own blocks. A 64-block question over 128 held blocks, 30 blocks beyond the
    /// idle worker's wait (within 0.45 × 128 = 57.6), gets 8 ÷ 64 × 128 = 16 and is passed
    /// over; a burst sibling's 4-block question behind 44 blocks more keeps 0.45 a hit (8 ÷ 4
    /// is more). With no worker idle, or nothing of its own to prefill, the slack is α's.
    #[test]
    fn the_own_cap_shrinks_the_slack_of_a_long_question_while_a_worker_is_idle() {
        let capped = shipped();
        assert_eq!(capped.wait_slack_own_cap, Some(8.0));
        let mut out = Vec::new();
        let idle = Candidate { wait: 192, own_prefill: 192, pending_prefill: 192, ..cand(0, 0, 192) };
        let holder = |wait: u32| Candidate { wait, own_prefill: 64, pending_prefill: wait, ..cand(1, 128, 100) };
        assert!(!rank(&[idle, holder(222)], uncapped(), 192, 0, &mut out).spilled);
        assert!(rank(&[idle, holder(222)], capped, 192, 0, &mut out).spilled);
        assert_eq!(out[0].candidate.slot, 0);
        // 10 beyond, within 16.
        assert!(!rank(&[idle, holder(202)], capped, 192, 0, &mut out).spilled);
        assert_eq!(out[0].candidate.slot, 1);
        let idle132 = Candidate { wait: 132, own_prefill: 132, pending_prefill: 132, ..cand(0, 0, 132) };
        let sibling = Candidate { wait: 132 + 40 + 4, own_prefill: 4, pending_prefill: 48, ..cand(1, 128, 176) };
        assert!(!rank(&[idle132, sibling], capped, 132, 0, &mut out).spilled);
        assert_eq!(out[0].candidate.slot, 1);
        // The other worker busy (8 blocks queued): α 0.5 grown by 8 ÷ 192, uncapped.
        let busy = Candidate { wait: 200, pending_prefill: 200, ..idle };
        assert!(!rank(&[busy, holder(230)], capped, 192, 0, &mut out).spilled);
        // Everything held: nothing of its own to prefill, α as without the cap.
        let whole = Candidate { wait: 192 + 50, own_prefill: 0, pending_prefill: 242, ..cand(1, 192, 100) };
        assert!(!rank(&[idle, whole], capped, 192, 0, &mut out).spilled);
    }

    #[test]
    fn the_holder_tie_keeps_a_prefix_on_its_holder_at_equal_waits() {
        let mut out = Vec::new();
        let off = Weights { holder_tie_per_hit: None, ..shipped() };
        assert_eq!(rank(&copy_case(), off, 132, 0, &mut out), RankOutcome::default());
        assert_eq!((out[0].candidate.slot, out[0].cost, out[1].cost), (0, 396.0, 404.0));
        // τ = 0.25: 8 blocks dearer for 128 more hits is within 32.
        let r = rank(&copy_case(), shipped(), 132, 0, &mut out);
        assert_eq!(r, RankOutcome { kept_on_holder: true, ..RankOutcome::default() });
        assert_eq!((out[0].candidate.slot, out[1].candidate.slot), (1, 0));
        // τ = 0.05: 8 > 6.4, the cost decides.
        let r = rank(&copy_case(), Weights { holder_tie_per_hit: Some(0.05), ..shipped() }, 132, 0, &mut out);
        assert!(!r.kept_on_holder);
        assert_eq!(out[0].candidate.slot, 0);
    }

    #[test]
    fn the_load_test_keeps_a_holder_one_request_ahead_in_load() {
        // 192-block requests with a 128-block prefix: the holder prefills one other
        // request (192 blocks in flight and queued), the other worker is idle. Costs 704
        // against 576: 128 more, beyond τ × 128 = 32; the waits 256 and 192 (α 0.5 admits
        // 192 + 0.5 × 128; the shipped limit, 0.45 with an idle worker, does not: below). In
        // flight with the request: 384 against 192, one request's blocks more — within k = 1.
        let idle = Candidate { wait: 192, own_prefill: 192, pending_prefill: 192, ..cand(0, 0, 192) };
        let holder = Candidate { wait: 256, own_prefill: 64, pending_prefill: 256, ..cand(1, 128, 384) };
        let mut out = Vec::new();
        let a05 = Weights { idle_wait_slack_per_hit: None, ..uncapped() };
        // The cost test alone: the cost decides.
        assert!(!rank(&[idle, holder], a05, 192, 0, &mut out).kept_on_holder);
        assert_eq!((out[0].candidate.slot, out[0].cost, out[1].cost), (0, 576.0, 704.0));
        let k1 = Weights { holder_tie_load_slack: Some(1.0), ..a05 };
        let r = rank(&[idle, holder], k1, 192, 0, &mut out);
        assert_eq!(r, RankOutcome { kept_on_holder: true, ..RankOutcome::default() });
        assert_eq!(out[0].candidate.slot, 1);
        // k = 0.5: half a request of slack is not enough.
        let half = Weights { holder_tie_load_slack: Some(0.5), ..a05 };
        assert!(!rank(&[idle, holder], half, 192, 0, &mut out).kept_on_holder);
        // A second request decoding on the holder: two requests ahead, passed by.
        let busier = Candidate { active_blocks: 576, ..holder };
        assert!(!rank(&[idle, busier], k1, 192, 0, &mut out).kept_on_holder);
        assert_eq!(out[0].candidate.slot, 0);
        // The load test does not stand in for the tie's other conditions: none without τ,
        // and none past the wait limit (the shipped one: 256 > 192 + 0.45 × 128).
        let untied = Weights { holder_tie_per_hit: None, ..k1 };
        assert!(!rank(&[idle, holder], untied, 192, 0, &mut out).kept_on_holder);
        let limited = Weights { holder_tie_load_slack: Some(1.0), ..shipped() };
        assert!(!rank(&[idle, holder], limited, 192, 0, &mut out).kept_on_holder);
        assert_eq!(out[0].candidate.slot, 0);
    }

    #[test]
    fn the_holder_tie_holds_with_a_siblings_question_queued_behind_the_cold_prompt() {
        // The copy case with another request of the holder's group queued too (its 4-block
        // question, 8 more blocks in flight with it): the request would start there 8
        // blocks after it would have ended on the idle worker, and costs 24 more (420
        // against 396), both within τ × 128 = 32. Without the slack such requests copied
        // their group's document to an idle engine on the fleet's shared prefixes
        // (docs/benchmarks.md, "The holder tie's start").
        let [idle, holder] = copy_case();
        let holder = Candidate { wait: 144, pending_prefill: 144, active_blocks: 272, ..holder };
        let mut out = Vec::new();
        let off = Weights { holder_tie_per_hit: None, ..shipped() };
        rank(&[idle, holder], off, 132, 0, &mut out);
        assert_eq!((out[0].candidate.slot, out[0].cost, out[1].cost), (0, 396.0, 420.0));
        let r = rank(&[idle, holder], shipped(), 132, 0, &mut out);
        assert_eq!(r, RankOutcome { kept_on_holder: true, ..RankOutcome::default() });
        assert_eq!(out[0].candidate.slot, 1);
    }

    #[test]
    fn the_holder_tie_needs_the_prefill_to_start_in_time() {
        // The holder has 200 blocks queued ahead: the request would start there 68 blocks
        // after the idle worker had finished it (132), beyond τ × 128, though its cost is
        // within τ per hit.
        let [idle, holder] = copy_case();
        let holder = Candidate { wait: 204, pending_prefill: 204, active_blocks: 192, ..holder };
        let mut out = Vec::new();
        let r = rank(&[idle, holder], shipped(), 132, 0, &mut out);
        assert_eq!(out[1].cost - out[0].cost, 4.0);
        assert!(!r.kept_on_holder);
        assert_eq!(out[0].candidate.slot, 0);
    }

    #[test]
    fn the_holder_tie_leaves_decode_load_priced() {
        // The holder decodes 2000 blocks: 1748 dearer, far beyond 0.25 × 128.
        let holder = Candidate { wait: 20, own_prefill: 16, pending_prefill: 20, ..cand(0, 128, 2000) };
        let cold = Candidate { wait: 144, own_prefill: 144, pending_prefill: 144, ..cand(1, 0, 0) };
        let mut out = Vec::new();
        assert!(!rank(&[holder, cold], shipped(), 144, 0, &mut out).kept_on_holder);
        assert_eq!(out[0].candidate.slot, 1);
    }

    #[test]
    fn the_holder_tie_takes_the_most_hits_the_wait_limit_admits() {
        // Two holders within τ of the idle worker; the one with more hits (3) is passed
        // over by the wait limit (α = 0: no queue beyond the least wait), so 2 wins.
        let [idle, holder] = copy_case();
        let partial = Candidate {
            slot: 2,
            cache_hits: 120,
            own_prefill: 12,
            wait: 132,
            pending_prefill: 132,
            active_blocks: 264,
            ..holder
        };
        let fuller = Candidate { slot: 3, worker_key: 3, ..holder };
        let mut out = Vec::new();
        let r = rank(
            &[idle, fuller, partial],
            Weights { wait_slack_per_hit: Some(0.0), idle_wait_slack_per_hit: None, ..shipped() },
            132,
            0,
            &mut out,
        );
        assert!(r.kept_on_holder);
        assert_eq!(out[0].candidate.slot, 2);
        // Without the limit the fuller one.
        let r = rank(&[idle, fuller, partial], Weights { wait_slack_per_hit: None, ..shipped() }, 132, 0, &mut out);
        assert!(r.kept_on_holder);
        assert_eq!(out[0].candidate.slot, 3);
    }

    /// Passed-over workers keep their cost order behind the admissible ones.
    #[test]
    fn the_wait_limit_keeps_cost_order_on_each_side() {
        let mk = |slot, hits, active, wait, own_prefill| Candidate { wait, own_prefill, ..cand(slot, hits, active) };
        // Cost order: 0 (hits 9), 1 (hits 8), 2 and 3 (no hits, nothing queued, 3 busier
        // decoding).
        let all = [mk(3, 0, 30, 10, 10), mk(2, 0, 20, 10, 10), mk(1, 8, 1, 40, 2), mk(0, 9, 0, 50, 1)];
        let mut out = Vec::new();
        let weights = Weights { wait_slack_per_hit: Some(0.5), ..w(1.0, 0.5) };
        assert!(rank(&all, weights, 10, 0, &mut out).spilled);
        let order: Vec<usize> = out.iter().map(|s| s.candidate.slot).collect();
        // Admissible (wait ≤ 10 + 0.5 × hits): 2 and 3; then 0 and 1 in cost order.
        assert_eq!(order, [2, 3, 0, 1]);
    }

    /// The cost may send a request to a cold idle worker (the holder carries too much
    /// load): the holder's shorter wait does not make the cold worker inadmissible, since
    /// nothing is queued there.
    #[test]
    fn the_wait_limit_never_passes_over_an_empty_queue() {
        let holder = Candidate { wait: 20, own_prefill: 16, ..cand(0, 128, 2000) };
        let cold = Candidate { wait: 144, own_prefill: 144, ..cand(1, 0, 0) };
        let mut out = Vec::new();
        let weights = Weights { prefill_load: 1.0, wait_slack_per_hit: Some(0.5), ..w(1.0, 0.5) };
        assert!(!rank(&[holder, cold], weights, 144, 0, &mut out).spilled);
        assert_eq!(out[0].candidate.slot, 1);
    }
}
