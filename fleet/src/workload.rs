//! Workloads for the load generator: what to send and when.
//!
//! - **shared prefix** (SGLang's `generated-shared-prefix` benchmark): `groups` system
//!   prompts of `system_prompt_len` tokens, `prompts_per_group` questions of
//!   `question_len` tokens each; groups drawn uniformly or by Zipf popularity;
//! - **chat**: multi-turn conversations; each turn's prompt is the previous prompt, the
//!   answer and a new question (the answer comes back from the engine, so turns are
//!   built as the run goes: see `load`);
//! - **mooncake**: the Mooncake conversation trace, each `hash_id` expanded into a
//!   deterministic block of tokens, lengths and times scaled to fit the fleet.
//!
//! Everything is deterministic in `seed`.

use serde::Deserialize;
use std::time::Duration;

/// splitmix64: a small, fast, seedable generator (tests and runs must repeat).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// Exponential with the given mean (Poisson inter-arrival times).
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

/// Token ids of ordinary text: the range the fleet's tokenizer maps words into.
pub fn random_tokens(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| 1000 + rng.below(30_000) as u32).collect()
}

/// One request to send at `at` (from the start of the run).
#[derive(Debug, Clone)]
pub struct Planned {
    pub at: Duration,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// A group or conversation id, for reports.
    pub key: u64,
    /// Leading tokens that are a system prompt (sent as a system message in a chat).
    pub system_len: usize,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Popularity {
    Uniform,
    /// Zipf with exponent `s`: group `k` (1-based) has weight `1 / k^s`.
    Zipf(f64),
}

#[derive(Debug, Clone)]
pub struct SharedPrefix {
    pub groups: usize,
    pub prompts_per_group: usize,
    pub system_prompt_len: usize,
    pub question_len: usize,
    pub output_len: usize,
    pub popularity: Popularity,
}

/// Poisson arrivals at `rate` requests per second (all at once if `rate` is infinite).
pub fn poisson_times(rng: &mut Rng, n: usize, rate: f64) -> Vec<Duration> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            if rate.is_finite() && rate > 0.0 {
                t += rng.exp(1.0 / rate);
            }
            Duration::from_secs_f64(t)
        })
        .collect()
}

impl SharedPrefix {
    /// `burst`: each group's prompts arrive at once (bursts at `rate` per second).
    pub fn plan(&self, seed: u64, rate: f64, burst: bool) -> Vec<Planned> {
        if burst {
            return self.plan_bursts(seed, rate);
        }
        let mut rng = Rng::new(seed);
        let systems: Vec<Vec<u32>> =
            (0..self.groups).map(|_| random_tokens(&mut rng, self.system_prompt_len)).collect();
        let n = self.groups * self.prompts_per_group;
        let weights: Vec<f64> = (1..=self.groups)
            .map(|k| match self.popularity {
                Popularity::Uniform => 1.0,
                Popularity::Zipf(s) => 1.0 / (k as f64).powf(s),
            })
            .collect();
        let total: f64 = weights.iter().sum();
        let times = poisson_times(&mut rng, n, rate);
        let mut out = Vec::with_capacity(n);
        for (i, at) in times.into_iter().enumerate() {
            let g = match self.popularity {
                // Every group gets its prompts_per_group, in a shuffled order.
                Popularity::Uniform => i % self.groups,
                Popularity::Zipf(_) => {
                    let mut x = rng.unit() * total;
                    weights
                        .iter()
                        .position(|w| {
                            x -= w;
                            x < 0.0
                        })
                        .unwrap_or(self.groups - 1)
                }
            };
            let mut prompt = systems[g].clone();
            prompt.extend(random_tokens(&mut rng, self.question_len));
            out.push(self.planned(at, prompt, g));
        }
        if self.popularity == Popularity::Uniform {
            // Shuffle which group comes when (Fisher–Yates), keeping the arrival times.
            let mut prompts: Vec<(Vec<u32>, u64)> = out.iter().map(|p| (p.prompt.clone(), p.key)).collect();
            for i in (1..prompts.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                prompts.swap(i, j);
            }
            for (p, (prompt, key)) in out.iter_mut().zip(prompts) {
                p.prompt = prompt;
                p.key = key;
            }
        }
        out
    }
}

impl SharedPrefix {
    fn planned(&self, at: Duration, prompt: Vec<u32>, group: usize) -> Planned {
        Planned { at, prompt, max_tokens: self.output_len, key: group as u64, system_len: self.system_prompt_len }
    }

    fn plan_bursts(&self, seed: u64, rate: f64) -> Vec<Planned> {
        let mut rng = Rng::new(seed);
        let times = poisson_times(&mut rng, self.groups, rate);
        let mut out = Vec::new();
        for (g, at) in times.into_iter().enumerate() {
            let system = random_tokens(&mut rng, self.system_prompt_len);
            for _ in 0..self.prompts_per_group {
                let mut prompt = system.clone();
                prompt.extend(random_tokens(&mut rng, self.question_len));
                out.push(self.planned(at, prompt, g));
            }
        }
        out
    }
}

/// Multi-turn chat: `conversations` of `turns` turns; conversations start as a Poisson
/// process at `rate`; each next turn is sent when the previous answer is complete.
/// An agentic loop is the same with a `system` prompt every conversation starts with
/// (the agents' shared instructions and tools), a task of `first_len` tokens, and a tool
/// result of `question_len` tokens after each answer.
#[derive(Debug, Clone)]
pub struct Chat {
    pub conversations: usize,
    pub turns: usize,
    /// Shared by every conversation (empty: none).
    pub system: Vec<u32>,
    pub first_len: usize,
    pub question_len: usize,
    pub output_len: usize,
}

impl Chat {
    /// A conversation's first prompt: the shared system prompt, then its own opening.
    pub fn first_prompt(&self, rng: &mut Rng) -> Vec<u32> {
        let mut p = self.system.clone();
        p.extend(random_tokens(rng, self.first_len));
        p
    }
}

#[derive(Deserialize)]
struct TraceLine {
    timestamp: u64,
    input_length: usize,
    output_length: usize,
    hash_ids: Vec<u64>,
}

/// The Mooncake trace (512-token blocks named by `hash_ids`), scaled: every length divided
/// by `length_scale`, every time divided by `time_scale`; the first `limit` requests.
pub fn mooncake(
    text: &str,
    length_scale: f64,
    time_scale: f64,
    limit: usize,
    max_tokens_cap: usize,
) -> Result<Vec<Planned>, String> {
    const TRACE_BLOCK: usize = 512;
    let block = ((TRACE_BLOCK as f64 / length_scale).round() as usize).max(1);
    let mut out = Vec::new();
    for (n, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate().take(limit) {
        let t: TraceLine = serde_json::from_str(line).map_err(|e| format!("trace line {}: {e}", n + 1))?;
        let len = ((t.input_length as f64 / length_scale).round() as usize).max(1);
        let mut prompt = Vec::with_capacity(len);
        for id in &t.hash_ids {
            let mut rng = Rng::new(id.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0xA5A5);
            prompt.extend(random_tokens(&mut rng, block));
            if prompt.len() >= len {
                break;
            }
        }
        prompt.truncate(len);
        let max_tokens = ((t.output_length as f64 / length_scale).round() as usize).clamp(1, max_tokens_cap.max(1));
        let at = Duration::from_secs_f64(t.timestamp as f64 / 1000.0 / time_scale);
        out.push(Planned { at, prompt, max_tokens, key: t.hash_ids.first().copied().unwrap_or(0), system_len: 0 });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agents_share_the_system_prompt_and_nothing_after_it() {
        let mut rng = Rng::new(3);
        let chat = Chat {
            conversations: 2,
            turns: 3,
            system: random_tokens(&mut rng, 64),
            first_len: 20,
            question_len: 10,
            output_len: 4,
        };
        let (a, b) = (chat.first_prompt(&mut Rng::new(1)), chat.first_prompt(&mut Rng::new(2)));
        assert_eq!((a.len(), b.len()), (84, 84));
        assert_eq!(a[..64], chat.system[..]);
        assert_eq!(b[..64], chat.system[..]);
        assert_ne!(a[64..], b[64..]);
        let plain = Chat { system: Vec::new(), ..chat };
        assert_eq!(plain.first_prompt(&mut Rng::new(1)).len(), 20);
    }

    #[test]
    fn shared_prefix_groups_share_their_system_prompt() {
        let w = SharedPrefix {
            groups: 4,
            prompts_per_group: 5,
            system_prompt_len: 100,
            question_len: 10,
            output_len: 3,
            popularity: Popularity::Uniform,
        };
        let plan = w.plan(1, 10.0, false);
        assert_eq!(plan.len(), 20);
        for g in 0..4u64 {
            let members: Vec<_> = plan.iter().filter(|p| p.key == g).collect();
            assert_eq!(members.len(), 5);
            assert!(members.iter().all(|p| p.prompt[..100] == members[0].prompt[..100]));
        }
        assert_ne!(plan[0].prompt[100..], plan[1].prompt[100..]);
        assert!(plan.windows(2).all(|w| w[0].at <= w[1].at));
        // Deterministic in the seed.
        assert_eq!(w.plan(1, 10.0, false)[7].prompt, plan[7].prompt);
        let bursts = w.plan(1, 10.0, true);
        assert!(bursts[..5].iter().all(|p| p.key == 0 && p.at == bursts[0].at));
    }

    #[test]
    fn zipf_favours_the_first_groups() {
        let w = SharedPrefix {
            groups: 10,
            prompts_per_group: 100,
            system_prompt_len: 4,
            question_len: 1,
            output_len: 1,
            popularity: Popularity::Zipf(1.2),
        };
        let plan = w.plan(2, f64::INFINITY, false);
        let count = |g| plan.iter().filter(|p| p.key == g).count();
        assert!(count(0) > 3 * count(9), "{} vs {}", count(0), count(9));
        assert!(plan.iter().all(|p| p.at == Duration::ZERO));
    }

    #[test]
    fn mooncake_blocks_repeat_where_hash_ids_do() {
        let trace = r#"{"timestamp": 0, "input_length": 1200, "output_length": 20, "hash_ids": [1, 2, 3]}
{"timestamp": 2000, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}"#;
        let p = mooncake(trace, 4.0, 2.0, 10, 64).unwrap();
        assert_eq!((p[0].prompt.len(), p[1].prompt.len()), (300, 250));
        assert_eq!(p[0].prompt[..250], p[1].prompt[..]);
        assert_eq!((p[1].at, p[0].max_tokens), (Duration::from_secs(1), 5));
        assert!(mooncake("{", 1.0, 1.0, 1, 1).is_err());
    }
}
