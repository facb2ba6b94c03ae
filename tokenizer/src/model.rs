//! One model's tokenizer, loaded from a local directory as vLLM 0.33 loads it (through
//! transformers 5: `tokenizer.json`, whose post-processor decides BOS/EOS; the named special
//! tokens and `model_max_length` of `tokenizer_config.json`; the chat templates), and the
//! text → token ids step of vLLM's `TokenizeParams` (`renderers/params.py`): truncation,
//! special tokens, length limits.

use crate::segments::{CacheStats, Segmenter};
use crate::template::ChatTemplates;
use std::path::{Path, PathBuf};
use tokenizers::PostProcessor;
use tokenizers::{Encoding, Token, Tokenizer};

/// The named special tokens transformers 5 passes to a chat template when set.
const NAMED_SPECIAL: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// What an operator says about one served model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// The `model` name requests use (vLLM's `--served-model-name`).
    pub name: String,
    /// The tokenizer directory (vLLM's `--tokenizer`, the specification's `--router-tokenizer-path`).
    pub path: PathBuf,
    /// vLLM's `--max-model-len`; default: `config.json`'s `max_position_embeddings` (if the
    /// directory has one), capped by `tokenizer_config.json`'s `model_max_length`.
    pub max_model_len: Option<usize>,
    /// LoRA adapters served on this model (vLLM's `--lora-modules` names).
    pub loras: Vec<String>,
    /// vLLM's `--chat-template`: a file's text, or a template name.
    pub chat_template: Option<String>,
    /// Bytes of token ids cached per segment (0: no cache).
    pub cache_bytes: usize,
}

/// A request vLLM would refuse (400), which the stage therefore routes by load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject(pub String);

/// How a prompt is tokenized: the request's `add_special_tokens`, `truncate_prompt_tokens`,
/// `truncation_side` and output budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EncodeParams {
    pub add_special_tokens: bool,
    /// `None`: no truncation; `Some(-1)`: as much as the model takes.
    pub truncate_prompt_tokens: Option<i64>,
    /// `Some(true)`: "left" (keep the last tokens); `Some(false)`: "right"; `None`: the
    /// tokenizer's side, left in vLLM's generation servers.
    pub truncate_left: Option<bool>,
    /// `max_tokens` (completions) or `max_completion_tokens` (chat), if given.
    pub max_output_tokens: Option<u64>,
}

pub struct Model {
    pub name: String,
    pub loras: Vec<String>,
    pub templates: ChatTemplates,
    /// The server's `--chat-template`, if any.
    pub server_template: Option<String>,
    /// Named special tokens that are set, for the chat template.
    pub special_tokens: serde_json::Map<String, serde_json::Value>,
    pub max_model_len: usize,
    tokenizer: Tokenizer,
    segmenter: Segmenter,
    max_chars_per_token: usize,
    /// Highest token id the engine accepts (the tokenizer's, or the model's vocabulary).
    pub max_token_id: u32,
    /// Tokens the post-processor adds to one sequence with `add_special_tokens`.
    added_special: usize,
}

fn read_json(p: &Path) -> Result<Option<serde_json::Value>, String> {
    match std::fs::read(p) {
        Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|e| format!("{}: {e}", p.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", p.display())),
    }
}

/// A special token as `tokenizer_config.json` writes it: a string or an `AddedToken` map.
fn token_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(m) => m.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

impl Model {
    pub fn load(spec: &ModelSpec) -> Result<Model, String> {
        let dir = &spec.path;
        let tj = dir.join("tokenizer.json");
        let mut tokenizer = Tokenizer::from_file(&tj)
            .map_err(|e| format!("{}: {e} (a fast tokenizer.json is required)", tj.display()))?;
        tokenizer.with_padding(None);
        tokenizer.with_truncation(None).map_err(|e| e.to_string())?;
        let config = read_json(&dir.join("tokenizer_config.json"))?;
        let model_config = read_json(&dir.join("config.json"))?;
        let templates = ChatTemplates::load(dir, config.as_ref())?;

        let mut special_tokens = serde_json::Map::new();
        if let Some(c) = &config {
            for name in NAMED_SPECIAL {
                if let Some(t) = c.get(name).and_then(token_text) {
                    special_tokens.insert(name.to_string(), serde_json::Value::String(t));
                }
            }
        }
        let model_max = config.as_ref().and_then(|c| c.get("model_max_length")).and_then(|v| v.as_u64());
        let positions = model_config.as_ref().and_then(|c| c.get("max_position_embeddings")).and_then(|v| v.as_u64());
        let max_model_len = match (spec.max_model_len, positions, model_max) {
            (Some(n), _, _) => n,
            (None, Some(p), Some(m)) => p.min(m) as usize,
            (None, Some(p), None) => p as usize,
            (None, None, Some(m)) => m as usize,
            (None, None, None) => return Err(format!("{}: no max_model_len given or found", dir.display())),
        };
        if max_model_len == 0 {
            return Err("max_model_len must be positive".into());
        }
        let vocab = tokenizer.get_vocab(true);
        let max_chars_per_token = vocab.keys().map(|k| k.chars().count()).max().unwrap_or(1);
        let tok_max = vocab.values().copied().max().unwrap_or(0).max(tokenizer.get_vocab_size(true) as u32 - 1);
        let model_vocab = model_config.as_ref().and_then(|c| c.get("vocab_size")).and_then(|v| v.as_u64());
        let max_token_id = tok_max.max(model_vocab.map_or(0, |v| v.saturating_sub(1) as u32));
        let added_special = tokenizer.get_post_processor().map_or(0, |p| p.added_tokens(false));
        let (segmenter, why_not) = Segmenter::new(&tokenizer, spec.cache_bytes);
        if let Some(why) = why_not {
            log::warn!(
                "model {}: token ids are not cached per segment ({why}); every text is tokenized whole",
                spec.name
            );
        } else if !segmenter.chunked() {
            log::info!("model {}: long segments are cached whole, not in chunks (its pre-tokenizer)", spec.name);
        }
        if let Err(why) = segmenter.ascii_encoder() {
            log::info!("model {}: ASCII text is tokenized by HF tokenizers ({why})", spec.name);
        }
        let server_template = spec.chat_template.clone();
        Ok(Model {
            name: spec.name.clone(),
            loras: spec.loras.clone(),
            templates,
            server_template,
            special_tokens,
            max_model_len,
            tokenizer,
            segmenter,
            max_chars_per_token,
            max_token_id,
            added_special,
        })
    }

    /// Forgets what its tokenizer has cached ([`Segmenter::forget`]).
    pub fn forget_cached(&self) {
        self.segmenter.forget();
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.segmenter.stats()
    }

    /// Long texts are cached in chunks (see [`crate::segments`]), not only whole segments.
    pub fn chunked(&self) -> bool {
        self.segmenter.chunked()
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Token ids of `text` as vLLM computes them for a prompt.
    pub fn encode_text(&self, text: &str, p: &EncodeParams) -> Result<Vec<u32>, Reject> {
        let max_input = self.max_model_len;
        if p.truncate_prompt_tokens.is_some_and(|n| n > max_input as i64) {
            return Err(Reject(format!("truncate_prompt_tokens exceeds max_model_len {max_input}")));
        }
        let max_chars = max_input.saturating_mul(self.max_chars_per_token);
        let mut text = text;
        if text.len() > max_chars {
            // (byte length bounds the count; count only when it can matter)
            let chars = text.chars().count();
            if chars > max_chars {
                match (p.truncate_prompt_tokens, p.truncate_left) {
                    (None, _) => return Err(Reject("the prompt is longer than the model can take".into())),
                    (Some(_), Some(true)) => {
                        let skip = chars - max_chars;
                        text = &text[text.char_indices().nth(skip).map_or(text.len(), |(i, _)| i)..];
                    }
                    (Some(_), Some(false)) => {
                        text = &text[..text.char_indices().nth(max_chars).map_or(text.len(), |(i, _)| i)];
                    }
                    (Some(_), None) => {}
                }
            }
        }
        let ids = self.segmenter.encode(&self.tokenizer, text).map_err(Reject)?;
        let ids = match (p.truncate_prompt_tokens, p.truncate_left) {
            // An explicit side: the whole prompt encoded, then cut (a BOS may go).
            (Some(n), Some(left)) => {
                cut(self.with_special(ids, p.add_special_tokens)?, self.truncation_len(n, p), left)
            }
            // Truncated inside the tokenizer on its side (left): room is kept for the special
            // tokens it adds, so a BOS stays. Without truncation the bound is max_model_len + 1,
            // only to bound the work; the length check below refuses it.
            (n, _) => {
                let max_length = n.map_or(max_input + 1, |n| self.truncation_len(n, p));
                let room =
                    if p.add_special_tokens { max_length.saturating_sub(self.added_special) } else { max_length };
                let kept = cut(ids, room, true);
                cut(
                    self.with_special(kept, p.add_special_tokens)?,
                    n.map_or(usize::MAX, |n| self.truncation_len(n, p)),
                    true,
                )
            }
        };
        self.check_length(ids)
    }

    /// Token ids of `text` with no truncation and no length limit (vLLM's `/tokenize`).
    pub fn encode_unbounded(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, Reject> {
        let ids = self.segmenter.encode(&self.tokenizer, text).map_err(Reject)?;
        self.with_special(ids, add_special_tokens)
    }

    /// A token-id prompt: used as it is, truncated and checked like text.
    pub fn check_tokens(&self, ids: Vec<u32>, p: &EncodeParams) -> Result<Vec<u32>, Reject> {
        if let Some(bad) = ids.iter().find(|&&t| t > self.max_token_id) {
            return Err(Reject(format!("token id {bad} is out of vocabulary")));
        }
        if p.truncate_prompt_tokens.is_some_and(|n| n > self.max_model_len as i64) {
            return Err(Reject(format!("truncate_prompt_tokens exceeds max_model_len {}", self.max_model_len)));
        }
        let ids = match p.truncate_prompt_tokens {
            Some(n) => cut(ids, self.truncation_len(n, p), p.truncate_left.unwrap_or(true)),
            None => ids,
        };
        self.check_length(ids)
    }

    /// `truncate_prompt_tokens` as a length: -1 is what generation can take.
    fn truncation_len(&self, n: i64, p: &EncodeParams) -> usize {
        match usize::try_from(n) {
            Ok(n) => n,
            Err(_) if p.max_output_tokens == Some(0) => self.max_model_len,
            Err(_) => self.max_model_len - 1,
        }
    }

    fn with_special(&self, ids: Vec<u32>, add_special_tokens: bool) -> Result<Vec<u32>, Reject> {
        if !add_special_tokens || self.added_special == 0 {
            return Ok(ids);
        }
        let tokens = ids.into_iter().map(|id| Token::new(id, String::new(), (0, 0))).collect();
        self.tokenizer
            .post_process(Encoding::from_tokens(tokens, 0), None, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Reject(format!("tokenizer post-processing: {e}")))
    }

    /// vLLM's engine takes 1 ..= max_model_len - 1 prompt tokens for generation.
    fn check_length(&self, ids: Vec<u32>) -> Result<Vec<u32>, Reject> {
        if ids.is_empty() {
            return Err(Reject("the prompt is empty".into()));
        }
        if ids.len() >= self.max_model_len {
            return Err(Reject(format!("{} prompt tokens, max_model_len {}", ids.len(), self.max_model_len)));
        }
        Ok(ids)
    }
}

/// Keeps `n` tokens: the last if `left` (dropping from the left), else the first.
fn cut(mut ids: Vec<u32>, n: usize, left: bool) -> Vec<u32> {
    if n >= ids.len() {
        return ids;
    }
    if left {
        ids.drain(..ids.len() - n);
    } else {
        ids.truncate(n);
    }
    ids
}
