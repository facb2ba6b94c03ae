//! The mock engine's scheduler: one GPU, steps of continuous batching, as vLLM runs them
//! where a router can tell.
//!
//! Each step packs prefill chunks, first come first served, up to `step_token_budget`
//! uncached tokens (a prefill in progress first, then waiting requests; the last one may
//! get a partial chunk and go on next step), and one decode token for every running
//! sequence. A chunk's full blocks enter the prefix cache when it is scheduled, as in
//! vLLM, so a request scheduled behind it in the same step hits them.
//!
//! ```text
//! step time = [prefill_overhead if a prefill starts] + prefill_per_token × chunk tokens
//!           + [itl × (1 + running / itl_knee) if any sequence decodes]
//! ```
//!
//! So a request's time to first token grows with its *uncached* tokens and with the
//! prefill tokens queued ahead of it, and decoding slows as the batch grows. The core is
//! pure: `plan` schedules the next step and says how long it takes; the caller sleeps that
//! long (divided by its speed-up) and calls `complete`. Defaults: [`Timing::default`].

use crate::kvcache::{Allocation, BlockHash, KvCache, KvEvent};
use std::collections::VecDeque;
use std::time::Duration;

/// The timing model. Defaults: a 7–8B model on one H100 (vLLM, bf16): ~30 ms fixed cost for
/// a step that starts prefills, ~0.2 ms per uncached prompt token, ~12 ms per output token
/// at small batch, twice that at 64 running sequences; 8192 tokens per step (vLLM's
/// default `max_num_batched_tokens` with chunked prefill).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    pub prefill_overhead: Duration,
    pub prefill_per_token: Duration,
    pub itl: Duration,
    pub itl_knee: f64,
    pub step_token_budget: usize,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            prefill_overhead: Duration::from_millis(30),
            prefill_per_token: Duration::from_micros(200),
            itl: Duration::from_millis(12),
            itl_knee: 64.0,
            step_token_budget: 8192,
        }
    }
}

/// A request as the engine sees it.
#[derive(Debug, Clone)]
pub struct Request {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
}

/// What a step produced for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// The prompt is computed: `cached_tokens` of it came from the prefix cache.
    FirstToken {
        id: u64,
        token: u32,
        cached_tokens: usize,
    },
    Token {
        id: u64,
        token: u32,
    },
    /// Generated `max_tokens`; the request's blocks are released.
    Finished {
        id: u64,
    },
    /// Prompt and `max_tokens` need more blocks than the whole cache holds.
    Rejected {
        id: u64,
    },
}

#[derive(Debug)]
struct Prefill {
    req: Request,
    alloc: Allocation,
    hashes: Vec<BlockHash>,
    /// Uncached prompt tokens still to compute.
    left: usize,
    /// Tokens of the step being run (`plan` sets it, `complete` applies it).
    chunk: usize,
    started: bool,
}

#[derive(Debug)]
struct Running {
    req: Request,
    alloc: Allocation,
    /// Prompt + generated tokens so far.
    tokens: Vec<u32>,
    generated: usize,
}

/// The next step, as scheduled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plan {
    pub duration: Duration,
    /// Uncached prompt tokens computed, over `prefills` requests.
    pub prefill_tokens: usize,
    pub prefills: usize,
    pub decoding: usize,
}

#[derive(Debug)]
pub struct Engine {
    pub cache: KvCache,
    timing: Timing,
    waiting: VecDeque<Request>,
    prefilling: VecDeque<Prefill>,
    running: Vec<Running>,
    /// Requests whose clients went away, dropped at the next plan.
    aborted: Vec<u64>,
    /// Counters for `/metrics`.
    pub stats: EngineStats,
    /// What tokens are generated from (empty: any ordinary id).
    output_words: Vec<u32>,
}

#[derive(Debug, Default, Clone)]
pub struct EngineStats {
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub generation_tokens: u64,
    pub requests_finished: u64,
    /// Σ over steps of the step time, for utilisation.
    pub busy: Duration,
}

/// A generated token: deterministic in the request and position; one of `words` (the
/// tokenizer's one-token words, so the answer reads back as the same ids), or without a
/// tokenizer an id in the range ordinary vocabularies have.
fn output_token(words: &[u32], id: u64, pos: usize) -> u32 {
    let h = xxhash_rust::xxh3::xxh3_64_with_seed(&(pos as u64).to_le_bytes(), id);
    match words.len() {
        0 => 1000 + (h % 30_000) as u32,
        n => words[(h % n as u64) as usize],
    }
}

impl Engine {
    pub fn new(cache: KvCache, timing: Timing) -> Engine {
        Engine {
            cache,
            timing,
            waiting: VecDeque::new(),
            prefilling: VecDeque::new(),
            running: Vec::new(),
            aborted: Vec::new(),
            stats: EngineStats::default(),
            output_words: Vec::new(),
        }
    }

    /// Generates tokens from these ids (see [`output_token`]).
    pub fn with_output_words(mut self, ids: Vec<u32>) -> Engine {
        self.output_words = ids;
        self
    }

    /// Drops a request (its client went away) before the next step; its blocks are freed.
    pub fn abort(&mut self, id: u64) {
        self.aborted.push(id);
    }

    fn drop_aborted(&mut self) {
        for id in std::mem::take(&mut self.aborted) {
            if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
                self.waiting.remove(i);
            } else if let Some(i) = self.prefilling.iter().position(|p| p.req.id == id) {
                if let Some(p) = self.prefilling.remove(i) {
                    self.cache.release(p.alloc);
                }
            } else if let Some(i) = self.running.iter().position(|r| r.req.id == id) {
                let r = self.running.swap_remove(i);
                self.cache.release(r.alloc);
            }
        }
    }

    pub fn submit(&mut self, req: Request) {
        self.waiting.push_back(req);
    }

    /// Requests waiting for cache space or for their prefill.
    pub fn queued(&self) -> usize {
        self.waiting.len() + self.prefilling.len()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.prefilling.is_empty() && self.running.is_empty()
    }

    /// Admits the next waiting request, its cache hits looked up now (as vLLM does when it
    /// schedules a request, so it finds what the chunks scheduled before it cached). A
    /// request that could never fit is rejected; `false` when none can be admitted yet.
    fn admit_next(&mut self, rejected: &mut Vec<Output>) -> bool {
        loop {
            let Some(req) = self.waiting.front() else { return false };
            let bs = self.cache.block_size();
            let total = (req.prompt.len() + req.max_tokens).div_ceil(bs);
            if !self.cache.fits(total) {
                rejected.push(Output::Rejected { id: req.id });
                self.waiting.pop_front();
                continue;
            }
            let hashes = self.cache.hashes(&req.prompt);
            let Some(alloc) = self.cache.admit(&hashes, total) else { return false };
            let Some(req) = self.waiting.pop_front() else { return false };
            let cached = (alloc.hit_blocks * bs).min(req.prompt.len());
            // vLLM recomputes at least the last prompt token to produce the first output.
            let left = (req.prompt.len() - cached).max(1);
            self.prefilling.push_back(Prefill { req, alloc, hashes, left, chunk: 0, started: false });
            return true;
        }
    }

    /// Schedules the next step, or `None` when there is nothing to do; `rejected` gets the
    /// requests that can never run.
    pub fn plan(&mut self, rejected: &mut Vec<Output>) -> Option<Plan> {
        self.drop_aborted();
        let t = self.timing;
        let mut budget = t.step_token_budget;
        let (mut prefill_tokens, mut prefills, mut starts) = (0, 0, false);
        while budget > 0 {
            if prefills == self.prefilling.len() && !self.admit_next(rejected) {
                break;
            }
            let bs = self.cache.block_size();
            let Some(p) = self.prefilling.get_mut(prefills) else { break };
            p.chunk = p.left.min(budget);
            starts |= !p.started;
            // The chunk's full blocks are cached as it is scheduled.
            let computed = p.req.prompt.len() - (p.left - p.chunk); // cached or computed by then
            let full = (computed / bs).min(p.hashes.len());
            let from = p.alloc.chain.len();
            if full > from {
                self.cache.commit(&mut p.alloc, &p.hashes[from..full], &p.req.prompt[from * bs..full * bs]);
            }
            budget -= p.chunk;
            prefill_tokens += p.chunk;
            prefills += 1;
        }
        let mut duration = t.prefill_per_token * prefill_tokens as u32;
        if starts {
            duration += t.prefill_overhead;
        }
        let decoding = self.running.len();
        if decoding > 0 {
            duration += t.itl.mul_f64(1.0 + decoding as f64 / t.itl_knee);
        }
        if prefill_tokens == 0 && decoding == 0 {
            return None;
        }
        Some(Plan { duration, prefill_tokens, prefills, decoding })
    }

    /// Carries out `plan` (after its duration has passed): outputs per request, and the KV
    /// events of the step.
    pub fn complete(&mut self, plan: Plan) -> (Vec<Output>, Vec<KvEvent>) {
        self.stats.busy += plan.duration;
        let mut out = Vec::new();
        // Decode first: the sequences that were running when the step began.
        let bs = self.cache.block_size();
        let mut finished = Vec::new();
        for (i, r) in self.running.iter_mut().enumerate().take(plan.decoding) {
            let token = output_token(&self.output_words, r.req.id, r.generated);
            r.tokens.push(token);
            r.generated += 1;
            self.stats.generation_tokens += 1;
            out.push(Output::Token { id: r.req.id, token });
            cache_filled_block(&mut self.cache, r);
            if r.generated >= r.req.max_tokens {
                finished.push(i);
            }
        }
        for i in finished.into_iter().rev() {
            let r = self.running.swap_remove(i);
            self.cache.release(r.alloc);
            self.stats.requests_finished += 1;
            out.push(Output::Finished { id: r.req.id });
        }
        // Then the prefill chunks: every one but perhaps the last completes its prompt.
        for p in self.prefilling.iter_mut().take(plan.prefills) {
            p.started = true;
            p.left -= p.chunk;
        }
        while self.prefilling.front().is_some_and(|p| p.left == 0) {
            let Some(p) = self.prefilling.pop_front() else { break };
            let cached = (p.alloc.hit_blocks * bs).min(p.req.prompt.len());
            self.stats.prompt_tokens += p.req.prompt.len() as u64;
            self.stats.cached_prompt_tokens += cached as u64;
            let token = output_token(&self.output_words, p.req.id, 0);
            out.push(Output::FirstToken { id: p.req.id, token, cached_tokens: cached });
            self.stats.generation_tokens += 1;
            let mut tokens = p.req.prompt.clone();
            tokens.push(token);
            let mut r = Running { req: p.req, alloc: p.alloc, tokens, generated: 1 };
            cache_filled_block(&mut self.cache, &mut r);
            if r.generated >= r.req.max_tokens {
                self.cache.release(r.alloc);
                self.stats.requests_finished += 1;
                out.push(Output::Finished { id: r.req.id });
            } else {
                self.running.push(r);
            }
        }
        (out, self.cache.take_events())
    }
}

/// Caches the block a new token just filled (prefix caching covers generated tokens too).
fn cache_filled_block(cache: &mut KvCache, r: &mut Running) {
    let bs = cache.block_size();
    let n = r.tokens.len() / bs;
    if r.tokens.len().is_multiple_of(bs) && r.alloc.chain.len() + 1 == n {
        let block = &r.tokens[(n - 1) * bs..];
        let parent = match r.alloc.chain.last() {
            // A running request's blocks stay cached, so its last one is there.
            Some(&id) => match cache.block_hash(id) {
                Some(h) => Some(h),
                None => return,
            },
            None => None,
        };
        let h = BlockHash::of(parent.as_ref(), block);
        let block = block.to_vec();
        cache.commit(&mut r.alloc, &[h], &block);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine() -> Engine {
        Engine::new(KvCache::new(16, 1000), Timing::default())
    }

    fn req(id: u64, prefix: u32, n: usize, max_tokens: usize) -> Request {
        Request { id, prompt: (0..n as u32).map(|i| prefix * 100_000 + i).collect(), max_tokens }
    }

    /// Runs until idle; returns (time of each request's first token, outputs).
    fn run(e: &mut Engine) -> (Vec<(u64, Duration, usize)>, Vec<Output>) {
        let mut now = Duration::ZERO;
        let mut firsts = Vec::new();
        let mut all = Vec::new();
        while let Some(p) = e.plan(&mut Vec::new()) {
            now += p.duration;
            let (out, _) = e.complete(p);
            for o in &out {
                if let Output::FirstToken { id, cached_tokens, .. } = o {
                    firsts.push((*id, now, *cached_tokens));
                }
            }
            all.extend(out);
        }
        (firsts, all)
    }

    #[test]
    fn ttft_is_overhead_plus_uncached_tokens() {
        let mut e = engine();
        e.submit(req(1, 1, 1000, 1));
        let (f, _) = run(&mut e);
        assert_eq!(f, vec![(1, Duration::from_millis(30 + 200), 0)]);
        // The same prompt again: 992 tokens cached (62 blocks), the last 8 recomputed.
        e.submit(req(2, 1, 1000, 1));
        let (f, _) = run(&mut e);
        assert_eq!(f, vec![(2, Duration::from_micros(30_000 + 8 * 200), 992)]);
    }

    #[test]
    fn prefills_share_a_step_up_to_the_token_budget() {
        let mut e = engine();
        e.submit(req(1, 1, 500, 3));
        e.submit(req(2, 2, 500, 1));
        let (f, out) = run(&mut e);
        // One step computes both prompts: one step overhead, 1000 tokens.
        assert_eq!(f, vec![(1, Duration::from_millis(230), 0), (2, Duration::from_millis(230), 0)]);
        let tokens_of_1 = out.iter().filter(|o| matches!(o, Output::Token { id: 1, .. })).count();
        assert_eq!(tokens_of_1, 2); // first token from the prefill, then 2 decode steps
        assert!(out.contains(&Output::Finished { id: 1 }) && out.contains(&Output::Finished { id: 2 }));
        assert!(e.is_idle());

        // Past the budget, the rest waits for the next step, which also decodes.
        let mut e = engine();
        e.submit(req(3, 3, 6000, 2));
        e.submit(req(4, 4, 6000, 1));
        let p = e.plan(&mut Vec::new()).unwrap();
        assert_eq!((p.prefills, p.prefill_tokens), (2, 8192), "request 4 gets the 2192 tokens left");
        let (out, _) = e.complete(p);
        assert_eq!(out.len(), 1, "request 3's first token only: {out:?}");
        let p = e.plan(&mut Vec::new()).unwrap();
        assert_eq!((p.prefills, p.prefill_tokens, p.decoding), (1, 3808, 1));
        let itl1 = Duration::from_millis(12).mul_f64(1.0 + 1.0 / 64.0);
        assert_eq!(p.duration, Duration::from_micros(200) * 3808 + itl1, "no overhead: a prefill goes on");
    }

    #[test]
    fn a_request_scheduled_behind_the_same_prefix_finds_it_cached() {
        let mut e = engine();
        let mut a = req(1, 1, 1000, 1);
        let mut b = req(2, 1, 1000, 1);
        a.prompt.push(7);
        b.prompt.push(8);
        e.submit(a);
        e.submit(b); // arrives together with a (a burst)
        let (f, _) = run(&mut e);
        // One step: a computes 1001 tokens and caches 62 blocks as it is scheduled; b
        // then finds 992 tokens cached and computes 9.
        let step = Duration::from_micros(30_000 + (1001 + 9) * 200);
        assert_eq!(f, vec![(1, step, 0), (2, step, 992)]);
    }

    #[test]
    fn a_chunk_caches_its_blocks_when_scheduled() {
        let mut e = Engine::new(KvCache::new(16, 2000), Timing::default());
        e.submit(req(1, 1, 10_000, 1));
        let p = e.plan(&mut Vec::new()).unwrap();
        assert_eq!(p.prefill_tokens, 8192);
        assert_eq!(e.cache.cached_blocks(), 512, "the first chunk's blocks");
        let (_, events) = e.complete(p);
        assert!(matches!(&events[..], [KvEvent::Stored { hashes, .. }] if hashes.len() == 512));
        // A request for the first 4096 tokens, arriving now, hits them all.
        let mut head = req(2, 1, 4096, 1);
        head.prompt.push(9);
        e.submit(head);
        let (f, _) = run(&mut e);
        assert_eq!(f.iter().find(|x| x.0 == 2).map(|x| x.2), Some(4096));
    }

    #[test]
    fn aborted_requests_free_their_blocks() {
        let mut e = engine();
        e.submit(req(1, 1, 64, 100));
        let p = e.plan(&mut Vec::new()).unwrap();
        e.complete(p);
        assert_eq!(e.running(), 1);
        let used = e.cache.used();
        assert!(used > 4);
        e.abort(1);
        assert!(e.plan(&mut Vec::new()).is_none());
        assert_eq!((e.running(), e.cache.used()), (0, 4), "only the 4 cached prompt blocks stay");
    }

    #[test]
    fn generated_blocks_are_cached_and_stored() {
        let mut e = engine();
        e.submit(req(1, 1, 30, 10)); // 30 + 10 = 40 tokens: block 1 fills at token 32
        let mut stored = 0;
        while let Some(p) = e.plan(&mut Vec::new()) {
            let (_, ev) = e.complete(p);
            stored += ev.iter().filter(|x| matches!(x, KvEvent::Stored { .. })).count();
        }
        assert_eq!(stored, 2, "the prompt's first block, then the block completed by decode");
        assert_eq!(e.cache.cached_blocks(), 2);
    }
}
