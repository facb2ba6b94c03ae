//! What the mock engine computes from a request body: the prompt's token ids, as vLLM
//! does. With a tokenizer directory this is kvroute-tokenizer's stage (the same rules the
//! tokenizer stage in front of Envoy applies, checked against Python transformers by its
//! golden vectors), so a text prompt or a chat reaches the same ids in the gateway and in
//! the engine. Without one the engine takes token ids only, as vLLM with
//! `--skip-tokenizer-init`.

use kvroute_tokenizer::model::{Model, ModelSpec};
use kvroute_tokenizer::stage::{Endpoint, Skip, Stage};
use serde_json::{Map, Value};
use std::path::Path;

/// A request the engine refuses is a [`Skip`]: the stage's reasons, answered with vLLM's
/// status and message ([`Skip::vllm_error`]).
fn bad<T>(why: impl Into<String>) -> Result<T, Skip> {
    Err(Skip::Invalid(why.into()))
}

pub struct Prompts {
    model: String,
    max_model_len: usize,
    stage: Option<Stage>,
}

impl Prompts {
    /// `tokenizer`: the tokenizer directory, or `None` for token ids only.
    pub fn new(model: &str, tokenizer: Option<&Path>, max_model_len: usize) -> Result<Prompts, String> {
        let stage = match tokenizer {
            None => None,
            Some(dir) => {
                let spec = ModelSpec {
                    name: model.to_string(),
                    path: dir.to_path_buf(),
                    max_model_len: Some(max_model_len),
                    loras: Vec::new(),
                    chat_template: None,
                    cache_bytes: 64 << 20,
                };
                // vLLM refuses a request's own chat template unless trusted; so does the mock.
                Some(Stage::new(&[spec], false, false).map_err(|e| format!("--tokenizer: {e}"))?)
            }
        };
        Ok(Prompts { model: model.to_string(), max_model_len, stage })
    }

    /// Forgets what the tokenizer has cached, as a new engine process would start.
    pub fn forget_cached(&self) {
        for m in self.stage.iter().flat_map(|s| s.models()) {
            m.forget_cached();
        }
    }

    pub fn model(&self) -> Option<&Model> {
        self.stage.as_ref().and_then(|s| s.models().first())
    }

    /// The prompt's token ids for a request body to `endpoint`.
    pub fn prompt(&self, endpoint: Endpoint, body: &[u8]) -> Result<Vec<u32>, Skip> {
        self.prompt_of(endpoint, &Stage::parse(body)?)
    }

    /// [`Prompts::prompt`] of a body already parsed.
    pub fn prompt_of(&self, endpoint: Endpoint, req: &Map<String, Value>) -> Result<Vec<u32>, Skip> {
        let Some(stage) = &self.stage else { return self.token_ids_only(endpoint, req) };
        let p = stage.prompt_of(endpoint, req)?;
        if p.prompts > 1 {
            return bad("the mock engine serves one prompt per request");
        }
        if p.cache_salt.is_some() {
            // Its prefix cache and KV events have no salted blocks: refused, not ignored.
            return bad("the mock engine does not simulate cache_salt");
        }
        Ok(p.tokens)
    }

    /// vLLM's `POST /tokenize`.
    pub fn tokenize(&self, body: &[u8]) -> Result<Value, Skip> {
        match &self.stage {
            Some(stage) => kvroute_tokenizer::http::tokenize_body(stage, body),
            None => bad("this engine has no tokenizer (start it with --tokenizer)"),
        }
    }

    /// The text of generated ids (special tokens skipped), or "" without a tokenizer, as
    /// vLLM with `--skip-tokenizer-init` answers.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.model().and_then(|m| m.tokenizer().decode(ids, true).ok()).unwrap_or_default()
    }

    fn token_ids_only(&self, endpoint: Endpoint, req: &Map<String, Value>) -> Result<Vec<u32>, Skip> {
        match req.get("model") {
            None | Some(Value::Null) => {}
            Some(Value::String(m)) if m == &self.model => {}
            Some(Value::String(m)) => return Err(Skip::UnknownModel(m.clone())),
            Some(_) => return bad("model is not a string"),
        }
        let no_text = "this engine has no tokenizer (vLLM's --skip-tokenizer-init): send token ids as the prompt";
        if endpoint == Endpoint::ChatCompletions {
            return bad(no_text);
        }
        let ids = match req.get("prompt") {
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_array() => a[0].as_array().map_or(&[][..], Vec::as_slice),
            Some(Value::Array(a)) if a.first().is_some_and(Value::is_number) => a.as_slice(),
            Some(Value::Array(a)) if a.first().is_some_and(Value::is_array) => {
                return bad("the mock engine serves one prompt per request")
            }
            Some(_) => return bad(no_text),
            None => return bad("You must pass at least one prompt"),
        };
        let ids: Vec<u32> = ids
            .iter()
            .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<_>>()
            .ok_or(Skip::Invalid("a token id is not valid".into()))?;
        match ids.len() {
            0 => bad("the prompt is empty"),
            n if n >= self.max_model_len => bad(format!("{n} prompt tokens, max_model_len {}", self.max_model_len)),
            _ => Ok(ids),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::{test_model, Words};

    fn qwen3() -> Prompts {
        Prompts::new("qwen3", Some(&crate::text::test_tokenizer_dir()), 40960).unwrap()
    }

    #[test]
    fn text_and_chats_are_tokenized_as_the_stage_does() {
        let p = qwen3();
        let chat = br#"{"model": "qwen3", "messages": [{"role": "user", "content": "Hi there"}]}"#;
        let ids = p.prompt(Endpoint::ChatCompletions, chat).unwrap();
        // <|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n
        assert_eq!(ids.len(), 10, "{ids:?}");
        assert_eq!(p.decode(&ids), "user\nHi there\nassistant\n");
        let text = br#"{"model": "qwen3", "prompt": "Hi there"}"#;
        assert_eq!(p.prompt(Endpoint::Completions, text).unwrap(), ids[3..5]);
        let tokens = br#"{"model": "qwen3", "prompt": [1, 2, 3]}"#;
        assert_eq!(p.prompt(Endpoint::Completions, tokens).unwrap(), [1, 2, 3]);
        let served = p.tokenize(br#"{"prompt": "Hi there"}"#).unwrap();
        assert_eq!(served["tokens"], serde_json::json!(ids[3..5]));
        // A generated answer of words reads back as the same ids.
        let words = Words::of(&test_model()).unwrap();
        let answer: Vec<u32> = (0..20).map(|i| words.id(i * 31)).collect();
        let next = format!(
            r#"{{"model": "qwen3", "messages": [{{"role": "user", "content": "Hi there"}},
                {{"role": "assistant", "content": {:?}}}, {{"role": "user", "content": "More"}}]}}"#,
            p.decode(&answer)
        );
        let next = p.prompt(Endpoint::ChatCompletions, next.as_bytes()).unwrap();
        assert_eq!(next[..10], ids[..]);
        assert_eq!(next[10..30], answer[..]);
    }

    #[test]
    fn refusals_are_vllms() {
        let p = qwen3();
        let r = |e: Endpoint, b: &str| p.prompt(e, b.as_bytes()).unwrap_err().vllm_error();
        let not_served = (404, "The model `other` does not exist.".to_string());
        assert_eq!(r(Endpoint::Completions, r#"{"model": "other", "prompt": "x"}"#), not_served);
        assert_eq!(r(Endpoint::Completions, r#"{"prompt": ["a", "b"]}"#).0, 400);
        assert_eq!(r(Endpoint::Completions, r#"{"prompt": "x", "cache_salt": "s"}"#).0, 400);
        assert_eq!(r(Endpoint::Completions, "not json").0, 400);

        let ids_only = Prompts::new("mock-llm", None, 100).unwrap();
        let r = |e: Endpoint, b: &str| ids_only.prompt(e, b.as_bytes()).map_err(|s| s.vllm_error());
        assert_eq!(r(Endpoint::Completions, r#"{"model": "mock-llm", "prompt": [5, 6]}"#), Ok(vec![5, 6]));
        assert_eq!(r(Endpoint::Completions, r#"{"prompt": [[5, 6]]}"#), Ok(vec![5, 6]));
        for body in [r#"{"prompt": "text"}"#, r#"{"prompt": []}"#, r#"{"prompt": [-1]}"#, r#"{"prompt": [[1], [2]]}"#] {
            assert!(matches!(r(Endpoint::Completions, body), Err((400, _))), "{body}");
        }
        let long = format!(r#"{{"prompt": {:?}}}"#, vec![1; 100]);
        assert!(matches!(r(Endpoint::Completions, &long), Err((400, _))));
        assert!(matches!(r(Endpoint::ChatCompletions, r#"{"messages": []}"#), Err((400, _))));
        let not_served = (404, "The model `x` does not exist.".to_string());
        assert_eq!(r(Endpoint::Completions, r#"{"model": "x", "prompt": [1]}"#), Err(not_served));
        assert_eq!(ids_only.decode(&[1, 2]), "");
        assert!(ids_only.tokenize(b"{}").is_err());
    }
}
