//! Text → token ids in the tokenizer stage ([`kvroute_tokenizer::model`]: pieces between
//! added tokens, 256-byte chunks, the segment cache, the ASCII encoder of
//! [`kvroute_tokenizer::ascii_bpe`]) against HF `tokenizers` encoding the whole text, on
//! the real Qwen3 tokenizer (`scripts/fetch-tokenizer.sh`; or `KVROUTE_TEST_TOKENIZER`).
//!
//! Input: UTF-8 text (anything else is read lossily).
//! - the stage's ids equal HF's, asked once and again (from its caches);
//! - the ASCII encoder alone (on a text without added tokens) gives HF's ids for an ASCII
//!   text it takes, and takes every ASCII text no longer than [`MAX_WORD`] bytes (its
//!   pre-tokens cannot be longer); it takes no text with a non-ASCII byte.

use kvroute_tokenizer::ascii_bpe::{AsciiBpe, MAX_WORD};
use kvroute_tokenizer::model::{Model, ModelSpec};
use std::sync::OnceLock;

struct Encoders {
    model: Model,
    ascii: AsciiBpe,
    /// The added tokens' texts: the segmenter splits on them before the ASCII encoder sees
    /// a piece.
    added: Vec<String>,
}

fn encoders() -> &'static Encoders {
    static ENCODERS: OnceLock<Encoders> = OnceLock::new();
    ENCODERS.get_or_init(|| {
        let path = crate::qwen3_dir();
        let spec = ModelSpec {
            name: "qwen3".into(),
            path,
            max_model_len: Some(1 << 20),
            loras: vec![],
            chat_template: None,
            cache_bytes: 8 << 20,
        };
        let model = Model::load(&spec).unwrap_or_else(|e| panic!("{e}"));
        assert!(model.chunked(), "Qwen3 texts are cut into chunks");
        let ascii = AsciiBpe::new(model.tokenizer()).unwrap_or_else(|e| panic!("{e}"));
        let added = model.tokenizer().get_added_tokens_decoder().into_values().map(|t| t.content).collect();
        Encoders { model, ascii, added }
    })
}

/// Loads the tokenizer before the first input (see `stage_request::init`).
pub fn init() {
    encoders();
}

pub fn check(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let e = encoders();
    let hf = e.model.tokenizer().encode_fast(text.as_ref(), false).map(|enc| enc.get_ids().to_vec());
    let Ok(hf) = hf else { return };
    for pass in ["first", "cached"] {
        let ours =
            e.model.encode_unbounded(&text, false).unwrap_or_else(|r| panic!("{pass}: refused ({}): {text:?}", r.0));
        assert_eq!(ours, hf, "{pass}: the stage's ids differ from HF's for {text:?}");
    }
    if e.added.iter().any(|a| text.contains(a.as_str())) {
        return;
    }
    match e.ascii.encode(&text) {
        Some(ids) => assert_eq!(ids, hf, "the ASCII encoder differs from HF for {text:?}"),
        None => assert!(!text.is_ascii() || text.len() > MAX_WORD, "an ASCII text was refused: {text:?}"),
    }
}
