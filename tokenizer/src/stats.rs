//! The stage's counters, and `/metrics` in the Prometheus text format: every request the
//! stage sees ends in one outcome, so an operator can tell why one was routed by load.

use crate::stage::{Prompt, Stage};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// How the stage handled a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Tokenized; the headers were set.
    Tokenized,
    /// Not `POST /v1/completions` or `/v1/chat/completions`: not read.
    NotOpenAi,
    /// A request with no body.
    NoBody,
    /// A body over the limit (or not buffered whole): not read.
    TooLarge,
    /// The client's own token headers kept (`trust_client_tokens`).
    ClientTokensTrusted,
    /// Read, and routed by load for this reason (a [`crate::stage::Skip`] label).
    Skipped(&'static str),
    /// Tokenization failed unexpectedly (a bug): routed by load.
    Failed,
    /// Client copies of the routing headers removed (counted besides the outcome).
    ClientHeadersRemoved,
}

const SKIPS: [&str; 4] = ["not_json", "unknown_model", "invalid", "unsupported"];

/// Upper bounds (ms) of the stage-latency histogram: time from the buffered body to its
/// token ids, queueing for a tokenizer thread included.
const BUCKETS_MS: [f64; 12] = [0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0];

#[derive(Default)]
pub struct Stats {
    tokenized: AtomicU64,
    not_openai: AtomicU64,
    no_body: AtomicU64,
    too_large: AtomicU64,
    trusted: AtomicU64,
    failed: AtomicU64,
    client_headers_removed: AtomicU64,
    one_round_trip: AtomicU64,
    skipped: [AtomicU64; SKIPS.len()],
    prompt_tokens: AtomicU64,
    batches: AtomicU64,
    latency_buckets: [AtomicU64; BUCKETS_MS.len()],
    latency_us_sum: AtomicU64,
    /// The startup self-check's results.
    pub self_check: crate::selfcheck::SelfCheck,
}

impl Stats {
    pub fn count(&self, o: Outcome) {
        let c = match o {
            Outcome::Tokenized => &self.tokenized,
            Outcome::NotOpenAi => &self.not_openai,
            Outcome::NoBody => &self.no_body,
            Outcome::TooLarge => &self.too_large,
            Outcome::ClientTokensTrusted => &self.trusted,
            Outcome::Failed => &self.failed,
            Outcome::ClientHeadersRemoved => &self.client_headers_removed,
            Outcome::Skipped(label) => match SKIPS.iter().position(|s| *s == label) {
                Some(i) => &self.skipped[i],
                None => &self.failed,
            },
        };
        c.fetch_add(1, Relaxed);
    }

    /// A request whose headers waited for its body: one round trip.
    pub fn one_round_trip(&self) {
        self.one_round_trip.fetch_add(1, Relaxed);
    }

    pub fn tokenized(&self, p: &Prompt, took: Duration) {
        self.count(Outcome::Tokenized);
        self.prompt_tokens.fetch_add(p.tokens.len() as u64, Relaxed);
        if p.prompts > 1 {
            self.batches.fetch_add(1, Relaxed);
        }
        let ms = took.as_secs_f64() * 1000.0;
        if let Some(i) = BUCKETS_MS.iter().position(|b| ms <= *b) {
            self.latency_buckets[i].fetch_add(1, Relaxed);
        }
        self.latency_us_sum.fetch_add(took.as_micros() as u64, Relaxed);
    }

    pub fn render(&self, stage: &Stage) -> String {
        let mut o = String::with_capacity(2048);
        let head = |o: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        head(&mut o, "kvroute_tokenizer_requests_total", "counter", "Requests the stage saw, by outcome.");
        let outcomes = [
            ("tokenized", self.tokenized.load(Relaxed)),
            ("not_openai", self.not_openai.load(Relaxed)),
            ("no_body", self.no_body.load(Relaxed)),
            ("too_large", self.too_large.load(Relaxed)),
            ("client_tokens_trusted", self.trusted.load(Relaxed)),
            ("failed", self.failed.load(Relaxed)),
        ];
        for (label, v) in outcomes {
            let _ = writeln!(o, "kvroute_tokenizer_requests_total{{outcome=\"{label}\"}} {v}");
        }
        for (i, label) in SKIPS.iter().enumerate() {
            let _ = writeln!(
                o,
                "kvroute_tokenizer_requests_total{{outcome=\"{label}\"}} {}",
                self.skipped[i].load(Relaxed)
            );
        }
        for (name, help, v) in [
            (
                "kvroute_tokenizer_client_headers_removed_total",
                "Requests whose own token, LoRA or salt headers were removed.",
                self.client_headers_removed.load(Relaxed),
            ),
            (
                "kvroute_tokenizer_one_round_trip_total",
                "Requests read in one ext_proc round trip (headers answered with their body's token ids).",
                self.one_round_trip.load(Relaxed),
            ),
            (
                "kvroute_tokenizer_prompt_tokens_total",
                "Prompt tokens written into headers.",
                self.prompt_tokens.load(Relaxed),
            ),
            (
                "kvroute_tokenizer_batches_total",
                "Completions batches, routed by their first prompt.",
                self.batches.load(Relaxed),
            ),
        ] {
            head(&mut o, name, "counter", help);
            let _ = writeln!(o, "{name} {v}");
        }
        head(&mut o, "kvroute_tokenizer_self_check_prompts_total", "counter", "Self-check prompts, by result.");
        for (label, c) in [
            ("agree", &self.self_check.agree),
            ("differ", &self.self_check.differ),
            ("unreachable", &self.self_check.unreachable),
        ] {
            let _ = writeln!(o, "kvroute_tokenizer_self_check_prompts_total{{result=\"{label}\"}} {}", c.load(Relaxed));
        }
        head(
            &mut o,
            "kvroute_tokenizer_latency_seconds",
            "histogram",
            "Buffered body to token ids, queueing included.",
        );
        let mut cum = 0;
        for (i, b) in BUCKETS_MS.iter().enumerate() {
            cum += self.latency_buckets[i].load(Relaxed);
            let _ = writeln!(o, "kvroute_tokenizer_latency_seconds_bucket{{le=\"{}\"}} {cum}", b / 1000.0);
        }
        let n = self.tokenized.load(Relaxed);
        let _ = writeln!(o, "kvroute_tokenizer_latency_seconds_bucket{{le=\"+Inf\"}} {n}");
        let _ = writeln!(o, "kvroute_tokenizer_latency_seconds_sum {}", self.latency_us_sum.load(Relaxed) as f64 / 1e6);
        let _ = writeln!(o, "kvroute_tokenizer_latency_seconds_count {n}");
        head(&mut o, "kvroute_tokenizer_segment_cache", "gauge", "The per-model segment cache: entries, bytes.");
        head(&mut o, "kvroute_tokenizer_segment_lookups_total", "counter", "Segment cache lookups, by result.");
        head(
            &mut o,
            "kvroute_tokenizer_segments_encoded_total",
            "counter",
            "Segment cache misses tokenized, by the stage's ASCII encoder or by HF tokenizers.",
        );
        head(
            &mut o,
            "kvroute_tokenizer_segment_waits_total",
            "counter",
            "Segment lookups that waited for another request tokenizing the same piece.",
        );
        for m in stage.models() {
            let s = m.cache_stats();
            let model = m.name.replace('"', "");
            let _ = writeln!(o, "kvroute_tokenizer_segment_cache{{model=\"{model}\",what=\"entries\"}} {}", s.entries);
            let _ = writeln!(o, "kvroute_tokenizer_segment_cache{{model=\"{model}\",what=\"bytes\"}} {}", s.bytes);
            let _ =
                writeln!(o, "kvroute_tokenizer_segment_lookups_total{{model=\"{model}\",result=\"hit\"}} {}", s.hits);
            let _ = writeln!(
                o,
                "kvroute_tokenizer_segment_lookups_total{{model=\"{model}\",result=\"miss\"}} {}",
                s.misses
            );
            for (by, n) in [("ascii", s.ascii), ("hf", s.misses.saturating_sub(s.ascii))] {
                let _ = writeln!(o, "kvroute_tokenizer_segments_encoded_total{{model=\"{model}\",by=\"{by}\"}} {n}");
            }
            let _ = writeln!(o, "kvroute_tokenizer_segment_waits_total{{model=\"{model}\"}} {}", s.waits);
        }
        o
    }
}
