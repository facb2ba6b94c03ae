//! Chat templates rendered as transformers renders them for vLLM: Jinja2's
//! `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with
//! `loopcontrols`, the `{% generation %}` tag, Python's string and dict methods, and the
//! globals and filters transformers adds (`tojson` as `json.dumps`, `raise_exception`,
//! `strftime_now`). minijinja with `minijinja-contrib`'s pycompat renders the same text
//! given those; its own `tojson` escapes `< > & '` and is replaced.

use crate::pyjson;
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Mutex;

/// A tokenizer's chat templates, as transformers loads them: `chat_template.jinja` (the
/// default) and `additional_chat_templates/*.jinja` (named) take priority over
/// `tokenizer_config.json`'s `chat_template`, a string or a list of `{name, template}`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatTemplates {
    /// The single template, or the one named `default`.
    pub default: Option<String>,
    /// Templates by name (`tool_use`, `rag`, …), the default among them when there are several.
    pub named: BTreeMap<String, String>,
}

impl ChatTemplates {
    pub fn load(dir: &Path, config: Option<&serde_json::Value>) -> Result<ChatTemplates, String> {
        let mut t = ChatTemplates::default();
        let jinja = dir.join("chat_template.jinja");
        let extra_dir = dir.join("additional_chat_templates");
        let file = read_opt(&jinja)?;
        let mut extra = BTreeMap::new();
        if extra_dir.is_dir() {
            let entries = std::fs::read_dir(&extra_dir).map_err(|e| format!("{}: {e}", extra_dir.display()))?;
            for entry in entries.flatten() {
                let p = entry.path();
                if p.extension().is_some_and(|e| e == "jinja") {
                    if let (Some(name), Some(src)) = (p.file_stem().and_then(|s| s.to_str()), read_opt(&p)?) {
                        extra.insert(name.to_string(), src);
                    }
                }
            }
        }
        if file.is_some() || !extra.is_empty() {
            if let Some(f) = file {
                if !extra.is_empty() {
                    t.named.insert("default".into(), f.clone());
                }
                t.default = Some(f);
            }
            t.named.extend(extra);
            return Ok(t);
        }
        match config.and_then(|c| c.get("chat_template")) {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::String(s)) => t.default = Some(s.clone()),
            Some(serde_json::Value::Array(list)) => {
                for item in list {
                    let (Some(name), Some(src)) =
                        (item.get("name").and_then(|v| v.as_str()), item.get("template").and_then(|v| v.as_str()))
                    else {
                        return Err("tokenizer_config.json: chat_template list entries need name and template".into());
                    };
                    t.named.insert(name.to_string(), src.to_string());
                }
                t.default = t.named.get("default").cloned();
            }
            Some(_) => return Err("tokenizer_config.json: chat_template is neither a string nor a list".into()),
        }
        Ok(t)
    }

    /// The template for a request: `requested` (a template's text, or one of the names) if
    /// given; else, with several named templates, `tool_use` when tools are sent, then
    /// `default` (transformers' `get_chat_template`).
    pub fn resolve<'a>(&'a self, requested: Option<&'a str>, with_tools: bool) -> Result<&'a str, String> {
        if let Some(r) = requested {
            return Ok(self.named.get(r).map(String::as_str).unwrap_or(r));
        }
        if !self.named.is_empty() {
            if with_tools {
                if let Some(t) = self.named.get("tool_use") {
                    return Ok(t);
                }
            }
            return self
                .named
                .get("default")
                .map(String::as_str)
                .ok_or_else(|| "the tokenizer has several chat templates and no default".into());
        }
        self.default.as_deref().ok_or_else(|| "the model has no chat template".into())
    }
}

fn read_opt(p: &Path) -> Result<Option<String>, String> {
    match std::fs::read_to_string(p) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", p.display())),
    }
}

/// How a template reads message content: as a string, or as a list of parts it loops over
/// (vLLM's "openai" content format).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    String,
    OpenAi,
}

/// vLLM's detection (`renderers/hf.py`, `_iter_nodes_assign_content_item`): "openai" when the
/// template loops over a message's `content` (`for x in m.content`, `m['content']`) or over a
/// bare `content`. Read here from the source text: a `for` whose iterable is one of those.
pub fn content_format(template: &str) -> ContentFormat {
    let mut rest = template;
    while let Some(i) = rest.find("for ") {
        let after = &rest[i + 4..];
        rest = after;
        let Some(in_at) = after.find(" in ") else { break };
        let head = &after[..in_at];
        if !head.chars().all(|c| c.is_alphanumeric() || c == '_' || c == ',' || c == ' ') {
            continue;
        }
        let iter: String = after[in_at + 4..]
            .trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || matches!(c, '_' | '.' | '[' | ']' | '\'' | '"'))
            .collect();
        let iter = iter.replace(['\'', '"'], "").replace("[content]", ".content");
        if iter == "content" || iter.ends_with(".content") {
            return ContentFormat::OpenAi;
        }
    }
    ContentFormat::String
}

/// Compiles and renders chat templates; each distinct template text is compiled once.
pub struct Renderer {
    env: Mutex<Environment<'static>>,
}

impl Default for Renderer {
    fn default() -> Self {
        Renderer::new()
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> Result<String, Error> {
    // Local time, as transformers' `datetime.now().strftime(format)`.
    let now = jiff::Zoned::now();
    Ok(now.strftime(&format).to_string())
}

fn tojson(value: Value, kwargs: Kwargs) -> Result<String, Error> {
    let opts = pyjson::Options {
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        indent: match kwargs.get::<Option<Value>>("indent")? {
            None => None,
            Some(v) if v.is_none() => None,
            Some(v) => Some(match v.as_str() {
                Some(s) => s.to_string(),
                None => " ".repeat(usize::try_from(v.as_i64().unwrap_or(0).max(0)).unwrap_or(0)),
            }),
        },
        separators: match kwargs.get::<Option<Vec<String>>>("separators")? {
            Some(s) if s.len() == 2 => Some((s[0].clone(), s[1].clone())),
            Some(_) => return Err(Error::new(ErrorKind::InvalidOperation, "separators must be a pair")),
            None => None,
        },
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    if value.is_undefined() {
        return Err(Error::new(ErrorKind::UndefinedError, "Object of type Undefined is not JSON serializable"));
    }
    Ok(pyjson::dumps(&json, &opts))
}

/// `{% generation %}…{% endgeneration %}` (transformers' AssistantTracker) renders its body
/// unchanged: the same as `{% if true %}…{% endif %}`, whitespace control included.
fn without_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body, trail) = split_ws_control(inner);
        match body.trim() {
            "generation" => out.push_str(&format!("{{%{lead} if true {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn split_ws_control(inner: &str) -> (&str, &str, &str) {
    let lead = if inner.starts_with(['-', '+']) { &inner[..1] } else { "" };
    let body = &inner[lead.len()..];
    let trail = if body.ends_with(['-', '+']) { &body[body.len() - 1..] } else { "" };
    (lead, &body[..body.len() - trail.len()], trail)
}

impl Renderer {
    pub fn new() -> Renderer {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .keep_trailing_newline(false)
                .build()
                .unwrap_or_default(),
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        Renderer { env: Mutex::new(env) }
    }

    fn name_of(template: &str) -> String {
        format!("t{:016x}", xxhash_rust::xxh3::xxh3_64(template.as_bytes()))
    }

    fn with_template<T>(
        &self,
        template: &str,
        f: impl FnOnce(&minijinja::Template<'_, '_>) -> Result<T, Error>,
    ) -> Result<T, String> {
        let name = Self::name_of(template);
        let mut env = kvroute_serve::lock(&self.env);
        if env.get_template(&name).is_err() {
            env.add_template_owned(name.clone(), without_generation_tags(template))
                .map_err(|e| format!("chat template does not compile: {e}"))?;
        }
        let t = env.get_template(&name).map_err(|e| e.to_string())?;
        f(&t).map_err(|e| describe(&e))
    }

    /// The names a template reads but never sets (Jinja2's `find_undeclared_variables`).
    pub fn variables(&self, template: &str) -> Result<HashSet<String>, String> {
        self.with_template(template, |t| Ok(t.undeclared_variables(false)))
    }

    pub fn render(&self, template: &str, ctx: &serde_json::Value) -> Result<String, String> {
        self.with_template(template, |t| t.render(Value::from(minijinja::value::Serde(ctx))))
    }
}

fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_with_pythons_whitespace_and_methods() {
        let r = Renderer::new();
        let t = "{%- for m in messages %}\n  {%- if m.content.startswith('x') %}X{% endif %}\n{{ m.content.strip() }}|{% endfor %}\n";
        // (Expected strings from Jinja2 with transformers' settings.)
        let out = r.render(t, &json!({"messages": [{"content": "xa "}, {"content": "b"}]})).unwrap();
        assert_eq!(out, "Xxa|b|");
        assert!(r.render("{{ raise_exception('no') }}", &json!({})).unwrap_err().contains("no"));
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let r = Renderer::new();
        let ctx = json!({"x": {"b": [1, 2.0, "<a&'é>", null, true], "a": 1e-7}});
        assert_eq!(r.render("{{ x|tojson }}", &ctx).unwrap(), r#"{"b": [1, 2.0, "<a&'é>", null, true], "a": 1e-07}"#);
        assert_eq!(
            r.render("{{ x|tojson(indent=2, sort_keys=true) }}", &ctx).unwrap(),
            "{\n  \"a\": 1e-07,\n  \"b\": [\n    1,\n    2.0,\n    \"<a&'é>\",\n    null,\n    true\n  ]\n}"
        );
        assert_eq!(r.render("{{ x.b[2]|tojson(ensure_ascii=true) }}", &ctx).unwrap(), r#""<a&'\u00e9>""#);
    }

    #[test]
    fn generation_tags_render_their_body() {
        let r = Renderer::new();
        let t = "a\n{%- generation %}b{% endgeneration -%}\n c";
        assert_eq!(r.render(t, &json!({})).unwrap(), "abc"); // as Jinja2 renders `{% if true %}`
    }

    #[test]
    fn content_format_follows_the_loops() {
        assert_eq!(content_format("{% for m in messages %}{{ m.content }}{% endfor %}"), ContentFormat::String);
        assert_eq!(content_format("{% for p in message.content %}{{ p.text }}{% endfor %}"), ContentFormat::OpenAi);
        assert_eq!(content_format("{%- for c in m['content'] -%}x{% endfor %}"), ContentFormat::OpenAi);
        assert_eq!(content_format("{% for part in content %}{% endfor %}"), ContentFormat::OpenAi);
    }

    #[test]
    fn templates_are_chosen_as_transformers_does() {
        let mut t = ChatTemplates { default: Some("D".into()), named: BTreeMap::new() };
        assert_eq!(t.resolve(None, true).unwrap(), "D");
        assert_eq!(t.resolve(Some("{{x}}"), false).unwrap(), "{{x}}");
        t.named.insert("default".into(), "D".into());
        t.named.insert("tool_use".into(), "T".into());
        assert_eq!(t.resolve(None, true).unwrap(), "T");
        assert_eq!(t.resolve(None, false).unwrap(), "D");
        assert_eq!(t.resolve(Some("tool_use"), false).unwrap(), "T");
    }
}
