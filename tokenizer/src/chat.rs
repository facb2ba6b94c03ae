//! A chat request's prompt text, as vLLM 0.33 renders it (HF renderer; `renderers/
//! online_renderer.py` `preprocess_chat`, `renderers/chat_utils/chat_message.py`,
//! `renderers/hf.py` `safe_apply_chat_template`) through transformers'
//! `apply_chat_template(tokenize=False)`:
//! - messages rebuilt with only the keys vLLM keeps, content flattened or wrapped for the
//!   template's content format, tool-call arguments parsed into objects, developer
//!   messages turned into one merged system message for templates that know no developer;
//! - the template's keyword arguments merged as vLLM merges them and filtered to what the
//!   template reads;
//! - `continue_final_message` as transformers' tag-and-cut.

use crate::model::Reject;
use crate::template::{content_format, ContentFormat, Renderer};
use serde_json::{json, Map, Value};

/// The names of transformers' `apply_chat_template` parameters: a request keyword argument
/// named like one of them is kept even if the template does not read it.
const APPLY_CHAT_TEMPLATE_PARAMS: [&str; 15] = [
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "sanitize_control_tokens",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
];

const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

fn reject<T>(why: impl Into<String>) -> Result<T, Reject> {
    Err(Reject(why.into()))
}

/// What besides the messages a chat request (or a chat-style `/tokenize`) says about the
/// prompt.
pub struct ChatInput<'a> {
    pub messages: &'a [Value],
    pub tools: Option<&'a [Value]>,
    pub documents: Option<&'a Value>,
    pub chat_template_kwargs: Option<&'a Map<String, Value>>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    pub reasoning_effort: Option<&'a str>,
    /// The request's own template (only used when the operator trusts them).
    pub chat_template: Option<&'a str>,
    /// `tools: []` is allowed (vLLM's `/tokenize`), else refused (chat completions).
    pub tools_may_be_empty: bool,
}

/// `merge_kwargs`: `overrides` win, except where they are `None` or `"auto"`.
fn merge(defaults: &mut Map<String, Value>, overrides: Map<String, Value>) {
    for (k, v) in overrides {
        if !(v.is_null() || v == "auto") {
            defaults.insert(k, v);
        }
    }
}

/// The prompt text for `input`, with `templates` resolving which template applies.
pub fn render(
    renderer: &Renderer,
    template_source: impl Fn(Option<&str>, bool) -> Result<String, String>,
    special_tokens: &Map<String, Value>,
    input: &ChatInput<'_>,
) -> Result<String, Reject> {
    if input.continue_final_message && input.add_generation_prompt {
        return reject("continue_final_message and add_generation_prompt are not compatible");
    }
    // Tools as vLLM's pydantic model dumps them.
    let tools: Option<Vec<Value>> = match input.tools {
        None => None,
        Some([]) if !input.tools_may_be_empty => return reject("tools must not be empty"),
        Some(list) => Some(list.iter().map(tool_dict).collect::<Result<_, _>>()?),
    };
    // build_chat_params: the request's fields over its chat_template_kwargs.
    let mut request_kwargs = input.chat_template_kwargs.cloned().unwrap_or_default();
    let mut fields = Map::new();
    fields.insert("add_generation_prompt".into(), input.add_generation_prompt.into());
    fields.insert("continue_final_message".into(), input.continue_final_message.into());
    fields.insert("documents".into(), input.documents.cloned().unwrap_or(Value::Null));
    fields.insert("reasoning_effort".into(), input.reasoning_effort.map_or(Value::Null, |e| e.into()));
    if let Some(effort) = input.reasoning_effort {
        if !request_kwargs.contains_key("enable_thinking") {
            fields.insert("enable_thinking".into(), (effort != "none").into());
        }
    }
    merge(&mut request_kwargs, fields);
    // preprocess_chat: server defaults {tools, tokenize: false} under the request's.
    let mut kwargs = Map::new();
    kwargs.insert("tools".into(), tools.map_or(Value::Null, Value::Array));
    kwargs.insert("tokenize".into(), false.into());
    merge(&mut kwargs, request_kwargs);
    if kwargs.get("tokenize").is_some_and(|t| t != &Value::Bool(false)) {
        return reject("chat_template_kwargs.tokenize is not supported by the stage");
    }

    let requested = input.chat_template.filter(|t| !t.is_empty());
    let with_tools = !kwargs.get("tools").is_none_or(Value::is_null);
    let template = template_source(requested, with_tools).map_err(Reject)?;
    let format = content_format(&template);

    let mut messages = Vec::with_capacity(input.messages.len());
    for m in input.messages {
        messages.push(normalize_message(m, format)?);
    }
    if messages.is_empty() {
        return reject("Cannot apply chat template to an empty conversation");
    }
    let messages = developer_fixups(messages, &template);

    // safe_apply_chat_template: keep what the template reads or apply_chat_template names.
    let declared = renderer.variables(&template).map_err(Reject)?;
    let tools = kwargs.remove("tools").unwrap_or(Value::Null);
    kwargs.remove("tokenize");
    if kwargs.contains_key("chat_template") {
        return reject("chat_template may not be given in chat_template_kwargs");
    }
    kwargs.retain(|k, _| declared.contains(k) || APPLY_CHAT_TEMPLATE_PARAMS.contains(&k.as_str()));
    let add_generation_prompt = kwargs.get("add_generation_prompt").is_some_and(Value::as_bool_or_false);
    let continue_final = kwargs.remove("continue_final_message").is_some_and(|v| v.as_bool() == Some(true));
    let documents = kwargs.remove("documents").unwrap_or(Value::Null);
    if let Some(docs) = documents.as_array() {
        if docs.iter().any(|d| !d.is_object()) {
            return reject("documents must be objects");
        }
    }
    if continue_final && add_generation_prompt {
        return reject("continue_final_message and add_generation_prompt are not compatible");
    }

    // transformers' render: special tokens under the kwargs, then the named variables.
    let mut messages = messages;
    let final_text = if continue_final { Some(tag_final_message(&mut messages, &template)?) } else { None };
    // (apply_chat_template's own parameters are not template variables; the ones that are
    // go in below.)
    let mut ctx = special_tokens.clone();
    for (k, v) in kwargs {
        if !APPLY_CHAT_TEMPLATE_PARAMS.contains(&k.as_str()) {
            ctx.insert(k, v);
        }
    }
    ctx.insert("messages".into(), Value::Array(messages));
    ctx.insert("tools".into(), tools);
    ctx.insert("documents".into(), documents);
    ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
    let rendered = renderer.render(&template, &Value::Object(ctx)).map_err(Reject)?;
    match final_text {
        None => Ok(rendered),
        Some(text) => cut_at_tag(rendered, &text),
    }
}

trait BoolOrFalse {
    fn as_bool_or_false(&self) -> bool;
}

impl BoolOrFalse for Value {
    /// Python truthiness of a kwarg value (for `add_generation_prompt`).
    fn as_bool_or_false(&self) -> bool {
        match self {
            Value::Bool(b) => *b,
            Value::Null => false,
            Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
            Value::String(s) => !s.is_empty(),
            Value::Array(a) => !a.is_empty(),
            Value::Object(o) => !o.is_empty(),
        }
    }
}

/// `ChatCompletionToolsParam.model_dump()`: `{type, function: {name, description,
/// parameters[, strict][, defer_loading]}}`, other keys dropped.
fn tool_dict(t: &Value) -> Result<Value, Reject> {
    let Some(f) = t.get("function").and_then(Value::as_object) else {
        return reject("a tool without a function");
    };
    let Some(name) = f.get("name").and_then(Value::as_str) else {
        return reject("a tool function without a name");
    };
    let mut fd = Map::new();
    fd.insert("name".into(), name.into());
    fd.insert("description".into(), f.get("description").cloned().unwrap_or(Value::Null));
    fd.insert("parameters".into(), f.get("parameters").cloned().unwrap_or(Value::Null));
    if let Some(s) = f.get("strict").filter(|v| !v.is_null()) {
        fd.insert("strict".into(), s.clone());
    }
    let defer = f.get("defer_loading").or_else(|| t.get("defer_loading")).filter(|v| !v.is_null());
    if let Some(d) = defer {
        fd.insert("defer_loading".into(), d.clone());
    }
    Ok(json!({"type": "function", "function": Value::Object(fd)}))
}

/// The text of a content part vLLM renders as text; `Ok(None)`: skipped (null text).
fn part_text(part: &Value) -> Result<Option<&str>, Reject> {
    if let Some(s) = part.as_str() {
        return Ok(Some(s));
    }
    let key = match part.get("type").and_then(Value::as_str) {
        Some("text" | "input_text" | "output_text") => "text",
        Some("refusal") => "refusal",
        Some("thinking") => "thinking",
        Some(other) => return reject(format!("content part {other:?} is not text")),
        None => return reject("a content part without a type"),
    };
    Ok(part.get(key).and_then(Value::as_str))
}

/// Part keys vLLM knows; any other key of a text part is carried into the "openai" format.
const KNOWN_PART_KEYS: [&str; 17] = [
    "type",
    "text",
    "image_url",
    "input_audio",
    "file",
    "refusal",
    "audio_url",
    "video_url",
    "image_pil",
    "uuid",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "data",
    "name",
    "thinking",
    "closed",
];

/// One message as vLLM rebuilds it (`parse_chat_message_content`, `_postprocess_messages`).
fn normalize_message(m: &Value, format: ContentFormat) -> Result<Value, Reject> {
    let Some(m) = m.as_object() else {
        return reject("a message is not an object");
    };
    let Some(role) = m.get("role").and_then(Value::as_str) else {
        return reject("a message without a role");
    };
    // `reasoning_content` moves to `reasoning` (protocol.py, _normalize_messages_before).
    let reasoning = m.get("reasoning").filter(|v| !v.is_null()).or_else(|| m.get("reasoning_content")).cloned();
    let reasoning = reasoning.filter(|v| !v.is_null());

    let mut parts: Vec<Value> = match m.get("content") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return reject("message content is neither a string nor a list"),
    };
    if role == "system" {
        parts = strip_billing_header(parts);
    }
    let content = match format {
        ContentFormat::String => {
            let mut texts = Vec::new();
            for p in &parts {
                if let Some(t) = part_text(p)? {
                    if !t.is_empty() {
                        texts.push(t);
                    }
                }
            }
            Value::String(texts.join("\n"))
        }
        ContentFormat::OpenAi => {
            let mut out = Vec::new();
            for p in &parts {
                let Some(t) = part_text(p)? else { continue };
                let mut part = Map::new();
                part.insert("type".into(), "text".into());
                part.insert("text".into(), t.into());
                if let Some(obj) = p.as_object() {
                    for (k, v) in obj {
                        if !KNOWN_PART_KEYS.contains(&k.as_str()) {
                            part.insert(k.clone(), v.clone());
                        }
                    }
                }
                out.push(Value::Object(part));
            }
            Value::Array(out)
        }
    };
    let mut out = Map::new();
    out.insert("role".into(), role.into());
    out.insert("content".into(), content);
    match role {
        "assistant" => {
            if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
                let calls = tool_calls(calls)?;
                if !calls.is_empty() {
                    out.insert("tool_calls".into(), Value::Array(calls));
                }
            }
            if let Some(r) = reasoning {
                out.insert("reasoning".into(), r.clone());
                out.insert("reasoning_content".into(), r);
            }
        }
        "tool" => {
            if let Some(id) = m.get("tool_call_id") {
                out.insert("tool_call_id".into(), id.clone());
            }
            // A tool result of text parts only is one string.
            if let Some(Value::Array(parts)) = out.get("content") {
                if parts.iter().all(|p| p.get("type").and_then(Value::as_str) == Some("text")) {
                    let texts: Vec<&str> = parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect();
                    out.insert("content".into(), texts.join("\n").into());
                }
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(v) = m.get(key).filter(|v| v.is_string()) {
            out.insert(key.into(), v.clone());
        }
    }
    if role == "developer" {
        out.insert("tools".into(), m.get("tools").cloned().unwrap_or(Value::Null));
    }
    Ok(Value::Object(out))
}

/// Tool calls as vLLM passes them: `{id, function: {arguments, name}, type, …}` (pydantic's
/// schema order), arguments parsed from their JSON string into an object (`{}` when empty,
/// invalid or not an object).
fn tool_calls(calls: &Value) -> Result<Vec<Value>, Reject> {
    let Some(list) = calls.as_array() else {
        return reject("tool_calls is not a list");
    };
    let mut out = Vec::with_capacity(list.len());
    for c in list {
        let Some(obj) = c.as_object() else {
            return reject("a tool call is not an object");
        };
        let Some(f) = obj.get("function").and_then(Value::as_object) else {
            return reject("a tool call without a function");
        };
        let args = match f.get("arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(Value::String(s)) if s.is_empty() => Value::Object(Map::new()),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(v @ Value::Object(_)) => v,
                _ => Value::Object(Map::new()),
            },
            Some(_) => return reject("tool call arguments must be a string"),
        };
        let mut func = Map::new();
        func.insert("arguments".into(), args);
        if let Some(n) = f.get("name") {
            func.insert("name".into(), n.clone());
        }
        for (k, v) in f {
            if k != "arguments" && k != "name" {
                func.insert(k.clone(), v.clone());
            }
        }
        let mut call = Map::new();
        if let Some(id) = obj.get("id") {
            call.insert("id".into(), id.clone());
        }
        call.insert("function".into(), Value::Object(func));
        if let Some(t) = obj.get("type") {
            call.insert("type".into(), t.clone());
        }
        for (k, v) in obj {
            if !matches!(k.as_str(), "id" | "function" | "type") {
                call.insert(k.clone(), v.clone());
            }
        }
        out.push(Value::Object(call));
    }
    Ok(out)
}

/// A system text starting with `x-anthropic-billing-header` loses its first line (vLLM
/// strips Claude Code's billing header).
fn strip_billing_header(parts: Vec<Value>) -> Vec<Value> {
    let mut out = Vec::with_capacity(parts.len());
    for p in parts {
        let text = match &p {
            Value::String(s) => Some(s.as_str()),
            Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("text") => {
                o.get("text").and_then(Value::as_str)
            }
            _ => None,
        };
        match text {
            Some(t) if t.starts_with("x-anthropic-billing-header") => {
                let rest = t.split_once('\n').map_or("", |(_, r)| r);
                if !rest.is_empty() {
                    out.push(match &p {
                        Value::String(_) => Value::String(rest.into()),
                        Value::Object(o) => {
                            let mut o = o.clone();
                            o.insert("text".into(), rest.into());
                            Value::Object(o)
                        }
                        _ => p,
                    });
                }
            }
            _ => out.push(p),
        }
    }
    out
}

/// For a template that knows no `developer` role: developer messages become system ones,
/// and all system messages are merged into one at the start when they are not already a
/// single first message.
fn developer_fixups(mut messages: Vec<Value>, template: &str) -> Vec<Value> {
    let role = |m: &Value| m.get("role").and_then(Value::as_str).map(str::to_string);
    if !messages.iter().any(|m| role(m).as_deref() == Some("developer")) {
        return messages;
    }
    if template.contains("\"developer\"") || template.contains("'developer'") {
        return messages;
    }
    for m in &mut messages {
        if let Some(o) = m.as_object_mut() {
            if o.get("role").and_then(Value::as_str) == Some("developer") {
                o.insert("role".into(), "system".into());
            }
            if o.get("role").and_then(Value::as_str) == Some("system") {
                o.remove("tools");
            }
        }
    }
    let mut system = Vec::new();
    let mut rest = Vec::new();
    let mut merge_needed = false;
    for (i, m) in messages.iter().enumerate() {
        if role(m).as_deref() == Some("system") {
            if i > 0 || !system.is_empty() {
                merge_needed = true;
            }
            let text = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| p.as_str().or_else(|| p.get("text").and_then(Value::as_str)))
                    .collect::<Vec<_>>()
                    .join("\n"),
                _ => String::new(),
            };
            if !text.is_empty() {
                system.push(text);
            }
        } else {
            rest.push(m.clone());
        }
    }
    if !merge_needed {
        return messages;
    }
    let mut out = vec![json!({"role": "system", "content": system.join("\n\n")})];
    out.extend(rest);
    out
}

/// transformers: the final message's text gets a tag the template cannot mistake; the
/// rendered text is cut there. Returns the final message's text.
fn tag_final_message(messages: &mut [Value], template: &str) -> Result<String, Reject> {
    if !template.contains("content") {
        return reject("continue_final_message: the template never reads content");
    }
    let Some(last) = messages.last_mut().and_then(Value::as_object_mut) else {
        return reject("continue_final_message without messages");
    };
    match last.get_mut("content") {
        Some(Value::String(s)) => {
            let text = s.clone();
            s.push_str(CONTINUE_TAG);
            Ok(text)
        }
        Some(Value::Array(parts)) => {
            for p in parts.iter_mut().rev() {
                if let Some(Value::String(t)) = p.get_mut("text") {
                    let text = t.clone();
                    t.push_str(CONTINUE_TAG);
                    return Ok(text);
                }
            }
            reject("continue_final_message: no text to continue")
        }
        _ => reject("continue_final_message: the final message has no content"),
    }
}

fn cut_at_tag(rendered: String, final_text: &str) -> Result<String, Reject> {
    let tag = CONTINUE_TAG.trim_end();
    let Some(at) = rendered.rfind(tag) else {
        return reject("continue_final_message: the template dropped the final message");
    };
    if !rendered.contains(final_text.trim()) {
        return reject("continue_final_message: the template dropped the final message");
    }
    if rendered[at..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..at].to_string())
    } else {
        Ok(rendered[..at].trim_end().to_string())
    }
}
