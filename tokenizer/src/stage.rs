//! The stage: an OpenAI request body in, the prompt's token ids (and the LoRA adapter and
//! cache salt it names) out, as vLLM 0.33 computes them. Anything vLLM would refuse, or the
//! stage cannot read, is a [`Skip`] with its reason: the request is then routed by load,
//! never failed.

use crate::chat::{self, ChatInput};
use crate::model::{EncodeParams, Model, ModelSpec, Reject};
use crate::template::Renderer;
use serde_json::{Map, Value};
use std::collections::HashMap;

/// The OpenAI endpoints the stage reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    /// The endpoint of a request path (the query ignored).
    pub fn of_path(path: &str) -> Option<Endpoint> {
        match path.split('?').next().unwrap_or(path) {
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            _ => None,
        }
    }
}

/// What routing needs from a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    /// The LoRA adapter `model` names, if it names one.
    pub lora: Option<String>,
    pub cache_salt: Option<String>,
    /// The request's cache key (OpenAI's `prompt_cache_key`), as the hex of its hash: a
    /// header value whatever the client's string holds.
    pub cache_key: Option<String>,
    /// Prompts in the request (a completions batch is routed by its first).
    pub prompts: usize,
}

/// Why a request is not tokenized (each a counter).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// The body is not a JSON object.
    NotJson,
    /// `model` names no served model or adapter (or is missing with several served).
    UnknownModel(String),
    /// vLLM would refuse the request (400), or its shape is not one vLLM reads.
    Invalid(String),
    /// Inputs the stage does not tokenize: prompt embeddings, a request's own chat template
    /// when they are not trusted.
    Unsupported(String),
}

impl Skip {
    pub fn label(&self) -> &'static str {
        match self {
            Skip::NotJson => "not_json",
            Skip::UnknownModel(_) => "unknown_model",
            Skip::Invalid(_) => "invalid",
            Skip::Unsupported(_) => "unsupported",
        }
    }

    /// The HTTP status and message vLLM answers such a request with: 404 for a model it
    /// does not serve, 400 for the rest.
    pub fn vllm_error(&self) -> (u16, String) {
        match self {
            Skip::UnknownModel(m) => (404, format!("The model `{m}` does not exist.")),
            other => (400, other.to_string()),
        }
    }
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Skip::NotJson => f.write_str("the body is not a JSON object"),
            Skip::UnknownModel(m) => write!(f, "unknown model {m:?}"),
            Skip::Invalid(why) | Skip::Unsupported(why) => f.write_str(why),
        }
    }
}

impl From<Reject> for Skip {
    fn from(r: Reject) -> Skip {
        Skip::Invalid(r.0)
    }
}

pub struct Stage {
    models: Vec<Model>,
    /// Request `model` → (model index, adapter name).
    names: HashMap<String, (usize, Option<String>)>,
    renderer: Renderer,
    trust_request_chat_template: bool,
    /// The one model serves requests that name any model (it was given without a name).
    any_model_name: bool,
}

fn invalid<T>(why: impl Into<String>) -> Result<T, Skip> {
    Err(Skip::Invalid(why.into()))
}

impl Stage {
    pub fn new(specs: &[ModelSpec], trust_request_chat_template: bool, any_model_name: bool) -> Result<Stage, String> {
        let mut models = Vec::with_capacity(specs.len());
        let mut names = HashMap::new();
        for (i, spec) in specs.iter().enumerate() {
            let m = Model::load(spec).map_err(|e| format!("model {}: {e}", spec.name))?;
            if names.insert(spec.name.clone(), (i, None)).is_some() {
                return Err(format!("model name {} given twice", spec.name));
            }
            models.push(m);
        }
        // vLLM looks adapters up first: a LoRA wins over a model of the same name.
        for (i, spec) in specs.iter().enumerate() {
            for lora in &spec.loras {
                if let Some((j, Some(_))) = names.insert(lora.clone(), (i, Some(lora.clone()))) {
                    return Err(format!("LoRA adapter {lora} served by models {} and {}", specs[j].name, spec.name));
                }
            }
        }
        if models.is_empty() {
            return Err("no model to tokenize for".into());
        }
        if any_model_name && models.len() != 1 {
            return Err("only a single model can serve any model name".into());
        }
        Ok(Stage { models, names, renderer: Renderer::new(), trust_request_chat_template, any_model_name })
    }

    pub fn models(&self) -> &[Model] {
        &self.models
    }

    /// The model (and adapter) a request names; none named: the only model served.
    pub fn resolve(&self, body: &Map<String, Value>) -> Result<(&Model, Option<String>), Skip> {
        match body.get("model") {
            None | Some(Value::Null) => self.only_model(),
            Some(Value::String(s)) if s.is_empty() => self.only_model(),
            Some(Value::String(s)) => match self.names.get(s) {
                Some((i, lora)) => Ok((&self.models[*i], lora.clone())),
                None if self.any_model_name => Ok((&self.models[0], None)),
                None => Err(Skip::UnknownModel(s.clone())),
            },
            Some(_) => invalid("model is not a string"),
        }
    }

    fn only_model(&self) -> Result<(&Model, Option<String>), Skip> {
        match self.models.as_slice() {
            [m] => Ok((m, None)),
            _ => Err(Skip::UnknownModel(String::new())),
        }
    }

    /// Parses a request body.
    pub fn parse(body: &[u8]) -> Result<Map<String, Value>, Skip> {
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(m)) => Ok(m),
            _ => Err(Skip::NotJson),
        }
    }

    pub fn prompt(&self, endpoint: Endpoint, body: &[u8]) -> Result<Prompt, Skip> {
        self.prompt_of(endpoint, &Self::parse(body)?)
    }

    /// [`Stage::prompt`] of a body already parsed.
    pub fn prompt_of(&self, endpoint: Endpoint, req: &Map<String, Value>) -> Result<Prompt, Skip> {
        let (model, lora) = self.resolve(req)?;
        let cache_salt = cache_salt(req)?;
        let cache_key = cache_key(req)?;
        let (tokens, prompts) = match endpoint {
            Endpoint::Completions => self.completion_tokens(model, req)?,
            Endpoint::ChatCompletions => (self.chat_tokens(model, req)?, 1),
        };
        Ok(Prompt { tokens, lora, cache_salt, cache_key, prompts })
    }

    /// `/v1/completions`: the first prompt's token ids, and how many prompts there are.
    fn completion_tokens(&self, model: &Model, req: &Map<String, Value>) -> Result<(Vec<u32>, usize), Skip> {
        if req.get("prompt_embeds").is_some_and(|v| !v.is_null()) {
            return Err(Skip::Unsupported("prompt_embeds".into()));
        }
        if req.get("suffix").is_some_and(|v| !v.is_null()) {
            return invalid("suffix is only supported for models with FIM completion rendering");
        }
        let max_tokens = match req.get("max_tokens") {
            None | Some(Value::Null) => Some(16),
            Some(v) => Some(v.as_u64().ok_or(Skip::Invalid("max_tokens is not a count".into()))?),
        };
        let p = encode_params(req, true, max_tokens, model)?;
        let prompt = req.get("prompt").ok_or(Skip::Invalid("You must pass at least one prompt".into()))?;
        match prompt {
            Value::String(s) => Ok((model.encode_text(s, &p)?, 1)),
            Value::Array(items) if items.is_empty() => invalid("You must pass at least one prompt"),
            Value::Array(items) => match &items[0] {
                // One prompt of token ids (vLLM looks at the first element).
                Value::Number(_) => Ok((model.check_tokens(token_ids(items)?, &p)?, 1)),
                Value::String(first) => {
                    if !items.iter().all(Value::is_string) {
                        return invalid("prompt mixes strings and other values");
                    }
                    Ok((model.encode_text(first, &p)?, items.len()))
                }
                Value::Array(first) => {
                    if !items.iter().all(Value::is_array) {
                        return invalid("prompt mixes token lists and other values");
                    }
                    Ok((model.check_tokens(token_ids(first)?, &p)?, items.len()))
                }
                _ => invalid("prompt is not text or token ids"),
            },
            _ => invalid("prompt is not text or token ids"),
        }
    }

    /// `/v1/chat/completions`: the rendered conversation's token ids.
    fn chat_tokens(&self, model: &Model, req: &Map<String, Value>) -> Result<Vec<u32>, Skip> {
        let max_out = match req.get("max_completion_tokens").filter(|v| !v.is_null()).or_else(|| req.get("max_tokens"))
        {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().ok_or(Skip::Invalid("max_tokens is not a count".into()))?),
        };
        let p = encode_params(req, false, max_out, model)?;
        // Disaggregated decode: vLLM takes the prefill's token ids as they are.
        if let Some(ids) = req.get("kv_transfer_params").and_then(|k| k.get("prompt_token_ids")) {
            let ids = ids.as_array().ok_or(Skip::Invalid("prompt_token_ids is not a list".into()))?;
            return Ok(model.check_tokens(token_ids(ids)?, &p)?);
        }
        let text = self.chat_text(model, req, false)?;
        Ok(model.encode_text(&text, &p)?)
    }

    /// The rendered prompt of a chat request (or a chat-style `/tokenize` request, which
    /// allows `tools: []`).
    pub fn chat_text(&self, model: &Model, req: &Map<String, Value>, tokenize_endpoint: bool) -> Result<String, Skip> {
        let messages = match req.get("messages") {
            Some(Value::Array(m)) => m.as_slice(),
            _ => return invalid("messages is not a list"),
        };
        let chat_template = match req.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.is_empty() => None,
            Some(Value::String(s)) if self.trust_request_chat_template => Some(s.as_str()),
            Some(Value::String(_)) => return Err(Skip::Unsupported("a request's own chat template".into())),
            Some(_) => return invalid("chat_template is not a string"),
        };
        let tools = match req.get("tools") {
            None | Some(Value::Null) => None,
            Some(Value::Array(t)) => Some(t.as_slice()),
            Some(_) => return invalid("tools is not a list"),
        };
        let kwargs = match req.get("chat_template_kwargs") {
            None | Some(Value::Null) => None,
            Some(Value::Object(k)) => Some(k),
            Some(_) => return invalid("chat_template_kwargs is not an object"),
        };
        let flag = |name: &str, default: bool| -> Result<bool, Skip> {
            match req.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => invalid(format!("{name} is not a boolean")),
            }
        };
        let add_generation_prompt = flag("add_generation_prompt", true)?;
        let continue_final_message = flag("continue_final_message", false)?;
        let reasoning_effort = if tokenize_endpoint {
            None
        } else {
            match req.get("reasoning_effort") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.as_str()),
                Some(_) => return invalid("reasoning_effort is not a string"),
            }
        };
        let documents = if tokenize_endpoint { None } else { req.get("documents").filter(|d| !d.is_null()) };
        let input = ChatInput {
            messages,
            tools,
            documents,
            chat_template_kwargs: kwargs,
            add_generation_prompt,
            continue_final_message,
            reasoning_effort,
            chat_template,
            tools_may_be_empty: tokenize_endpoint,
        };
        let source = |requested: Option<&str>, with_tools: bool| -> Result<String, String> {
            let requested = requested.or(model.server_template.as_deref());
            model.templates.resolve(requested, with_tools).map(str::to_string)
        };
        Ok(chat::render(&self.renderer, source, &model.special_tokens, &input)?)
    }
}

/// `add_special_tokens`, `truncate_prompt_tokens`, `truncation_side` of a request.
pub fn encode_params(
    req: &Map<String, Value>,
    special_default: bool,
    max_output_tokens: Option<u64>,
    model: &Model,
) -> Result<EncodeParams, Skip> {
    let add_special_tokens = match req.get("add_special_tokens") {
        None | Some(Value::Null) => special_default,
        Some(Value::Bool(b)) => *b,
        Some(_) => return invalid("add_special_tokens is not a boolean"),
    };
    let truncate_prompt_tokens = match req.get("truncate_prompt_tokens") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(n) if n >= -1 => Some(n),
            _ => return invalid("truncate_prompt_tokens must be -1 or more"),
        },
    };
    let truncate_left = match req.get("truncation_side") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "left" => Some(true),
        Some(Value::String(s)) if s == "right" => Some(false),
        Some(_) => return invalid("truncation_side must be left or right"),
    };
    if max_output_tokens.is_some_and(|n| n > model.max_model_len as u64) {
        return invalid(format!("max_tokens cannot be greater than max_model_len={}", model.max_model_len));
    }
    Ok(EncodeParams { add_special_tokens, truncate_prompt_tokens, truncate_left, max_output_tokens })
}

/// A list of token ids (non-negative integers that fit u32).
fn token_ids(items: &[Value]) -> Result<Vec<u32>, Skip> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or(Skip::Invalid("a token id is not valid".into())))
        .collect()
}

/// OpenAI's `prompt_cache_key`: a non-empty string, at most 1024 bytes.
fn cache_key(req: &Map<String, Value>) -> Result<Option<String>, Skip> {
    match req.get("prompt_cache_key") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 1024 => {
            Ok(Some(format!("{:016x}", kvroute::cachekey::key_hash(s.as_bytes()))))
        }
        Some(_) => invalid("prompt_cache_key must be a string of 1..=1024 bytes"),
    }
}

/// vLLM's `cache_salt` check: a non-empty string of at most 128 characters without `@`,
/// `/`, `\` or NUL.
fn cache_salt(req: &Map<String, Value>) -> Result<Option<String>, Skip> {
    match req.get("cache_salt") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if !s.is_empty() && s.chars().count() <= 128 && !s.contains(['@', '/', '\\', '\0']) => {
            Ok(Some(s.clone()))
        }
        Some(_) => invalid("cache_salt must be 1..=128 characters without @ / \\ or NUL"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn req(v: Value) -> Map<String, Value> {
        match json!({ "prompt_cache_key": v }) {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_prompt_cache_key_becomes_the_hex_of_its_hash() {
        let k = cache_key(&req(json!("agent-7"))).unwrap().unwrap();
        assert_eq!(k, format!("{:016x}", kvroute::cachekey::key_hash(b"agent-7")));
        assert_eq!(cache_key(&req(Value::Null)).unwrap(), None);
        assert_eq!(cache_key(&Map::new()).unwrap(), None);
        for bad in [json!(""), json!(7), json!(["a"]), json!("x".repeat(1025))] {
            assert!(matches!(cache_key(&req(bad)), Err(Skip::Invalid(_))));
        }
    }
}
