//! The tokenizer stage's request reading ([`kvroute_tokenizer::stage`]): an OpenAI body to
//! the prompt's token ids, on the real Qwen3 tokenizer (`scripts/fetch-tokenizer.sh`; or
//! the folder in `KVROUTE_TEST_TOKENIZER`).
//!
//! Input: a selector byte (even: `/v1/completions`, odd: `/v1/chat/completions`), then the
//! request body.
//! - the answer is the same from a stage whose segment cache is warm (asked twice) and one
//!   with no cache: caching never changes a prompt's ids;
//! - every id is one the tokenizer has (token-id prompts are checked against it too), and
//!   a tokenized request has at least one prompt.

use kvroute_tokenizer::model::ModelSpec;
use kvroute_tokenizer::stage::{Endpoint, Stage};
use std::sync::OnceLock;

/// The model the stage serves, with one LoRA adapter so `model` can name either (as the
/// golden vectors in `tests/vectors/tokenizer` are served, which seed the corpus).
const MODEL: &str = "qwen3";

struct Stages {
    cached: Stage,
    uncached: Stage,
    vocab: u32,
}

fn stages() -> &'static Stages {
    static STAGES: OnceLock<Stages> = OnceLock::new();
    STAGES.get_or_init(|| {
        let path = crate::qwen3_dir();
        let spec = |cache_bytes| ModelSpec {
            name: MODEL.into(),
            path: path.clone(),
            max_model_len: Some(40960),
            loras: vec!["sql-lora".into()],
            chat_template: None,
            cache_bytes,
        };
        let stage = |cache_bytes| Stage::new(&[spec(cache_bytes)], false, false).unwrap_or_else(|e| panic!("{e}"));
        let cached = stage(8 << 20);
        let vocab = cached.models()[0].tokenizer().get_vocab(true).values().max().map_or(0, |m| m + 1);
        Stages { cached, uncached: stage(0), vocab }
    })
}

/// Loads the tokenizer (seconds under AddressSanitizer), so a fuzzer does it before its
/// first input rather than charging it to that input's time limit.
pub fn init() {
    stages();
}

pub fn check(data: &[u8]) {
    let (sel, body) = crate::selector(data);
    let endpoint = if sel % 2 == 0 { Endpoint::Completions } else { Endpoint::ChatCompletions };
    let s = stages();
    let first = s.cached.prompt(endpoint, body);
    let warm = s.cached.prompt(endpoint, body);
    let cold = s.uncached.prompt(endpoint, body);
    assert_eq!(first, warm, "a warm segment cache changed the answer");
    assert_eq!(first, cold, "the segment cache changed the answer");
    if let Ok(p) = &first {
        assert!(p.prompts >= 1);
        if let Some(t) = p.tokens.iter().find(|&&t| t >= s.vocab) {
            panic!("token id {t} outside the vocabulary (ids < {})", s.vocab);
        }
    }
}
