//! Configuration: a TOML file and command-line flags, validated once into [`Config`];
//! anything wrong is an error naming the field, and the stage refuses to start.
//! Reference: `tokenizer/README.md`.

use crate::extproc::handler::Headers;
use crate::model::ModelSpec;
use clap::Parser;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Parser, Debug, Default)]
#[command(
    name = "kvroute-tokenizer",
    version,
    about = "Tokenizes OpenAI requests as vLLM does, for kvroute (an Envoy ext_proc service)"
)]
pub struct Cli {
    /// TOML configuration file; flags override its settings and add models.
    #[arg(long)]
    pub config: Option<String>,
    /// A local tokenizer directory (tokenizer.json, tokenizer_config.json, optional
    /// chat_template.jinja and config.json), as `DIR` or `MODEL=DIR` where MODEL is the name
    /// requests use (vLLM's --served-model-name). Repeatable, one per model. A single DIR
    /// without a name serves requests for any model. No hub download happens.
    #[arg(long = "router-tokenizer-path")]
    pub tokenizer_paths: Vec<String>,
    /// vLLM's --max-model-len of every model given by flag (truncation and limits follow it).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// The ext_proc gRPC address Envoy calls (default 127.0.0.1:9200).
    #[arg(long)]
    pub grpc_listen: Option<String>,
    /// The HTTP address of /tokenize, /metrics, /healthz (default 127.0.0.1:9201).
    #[arg(long)]
    pub http_listen: Option<String>,
    /// Keep clients' own token, LoRA and cache-salt headers instead of removing them.
    #[arg(long)]
    pub trust_client_tokens: bool,
    /// A worker's base URL (e.g. http://10.0.0.5:8000) whose own POST /tokenize is asked
    /// about a few prompts at start; a difference is logged loudly. Repeatable.
    #[arg(long = "self-check")]
    pub self_check: Vec<String>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    grpc_listen: Option<String>,
    http_listen: Option<String>,
    trust_client_tokens: Option<bool>,
    trust_request_chat_template: Option<bool>,
    max_body_bytes: Option<usize>,
    max_concurrency: Option<usize>,
    cache_bytes: Option<usize>,
    #[serde(default)]
    self_check: Vec<String>,
    headers: Option<FileHeaders>,
    #[serde(default)]
    models: Vec<FileModel>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct FileHeaders {
    tokens_b64: Option<String>,
    tokens_decimal: Option<String>,
    lora: Option<String>,
    cache_salt: Option<String>,
    cache_key: Option<String>,
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct FileModel {
    name: Option<String>,
    path: String,
    max_model_len: Option<usize>,
    #[serde(default)]
    loras: Vec<String>,
    chat_template: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub grpc_listen: SocketAddr,
    pub http_listen: SocketAddr,
    pub trust_client_tokens: bool,
    pub trust_request_chat_template: bool,
    pub max_body_bytes: usize,
    /// Tokenizations at once (0 in the file: one per core).
    pub max_concurrency: usize,
    pub headers: Headers,
    pub models: Vec<ModelSpec>,
    /// The one model serves requests naming any model.
    pub any_model_name: bool,
    /// Workers whose `/tokenize` the stage compares itself with at start.
    pub self_check: Vec<String>,
}

const DEFAULT_CACHE_BYTES: usize = 256 << 20;
/// Envoy's buffer limit in the shipped config (`per_connection_buffer_limit_bytes`).
const DEFAULT_MAX_BODY: usize = 8 << 20;

fn addr(field: &str, v: Option<String>, default: &str) -> Result<SocketAddr, String> {
    let s = v.unwrap_or_else(|| default.to_string());
    s.parse().map_err(|_| format!("{field}: {s:?} is not an ip:port"))
}

fn header_name(field: &str, v: Option<String>, default: String) -> Result<String, String> {
    let h = v.unwrap_or(default);
    let ok = !h.is_empty() && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(h)
    } else {
        Err(format!("headers.{field}: {h:?} is not a lower-case header name"))
    }
}

impl Config {
    pub fn load(cli: &Cli) -> Result<Config, String> {
        Self::from_parts(kvroute_serve::read_toml(cli.config.as_deref())?, cli)
    }

    /// From TOML text and flags (tests use this).
    pub fn from_toml(text: &str, cli: &Cli) -> Result<Config, String> {
        Self::from_parts(kvroute_serve::parse_toml(text)?, cli)
    }

    fn from_parts(f: FileConfig, cli: &Cli) -> Result<Config, String> {
        let cache_bytes = f.cache_bytes.unwrap_or(DEFAULT_CACHE_BYTES);
        let mut models = Vec::new();
        let mut unnamed = 0;
        for (i, m) in f.models.into_iter().enumerate() {
            let path = PathBuf::from(&m.path);
            let name = match m.name {
                Some(n) if !n.is_empty() => n,
                Some(_) => return Err(format!("models[{i}].name is empty")),
                None => {
                    unnamed += 1;
                    dir_name(&path)
                }
            };
            if m.max_model_len == Some(0) {
                return Err(format!("models[{i}].max_model_len must be positive"));
            }
            let chat_template = match m.chat_template {
                None => None,
                Some(t) => Some(read_template(&t).map_err(|e| format!("models[{i}].chat_template: {e}"))?),
            };
            models.push(ModelSpec {
                name,
                path,
                max_model_len: m.max_model_len,
                loras: m.loras,
                chat_template,
                cache_bytes,
            });
        }
        for p in &cli.tokenizer_paths {
            let (name, dir) = match p.split_once('=') {
                Some((n, d)) if !n.is_empty() && !d.is_empty() => (n.to_string(), PathBuf::from(d)),
                Some(_) => return Err(format!("--router-tokenizer-path {p:?}: want DIR or MODEL=DIR")),
                None => {
                    unnamed += 1;
                    (dir_name(Path::new(p)), PathBuf::from(p))
                }
            };
            if cli.max_model_len == Some(0) {
                return Err("--max-model-len must be positive".into());
            }
            models.push(ModelSpec {
                name,
                path: dir,
                max_model_len: cli.max_model_len,
                loras: Vec::new(),
                chat_template: None,
                cache_bytes,
            });
        }
        if models.is_empty() {
            return Err("no model: give --router-tokenizer-path DIR (or [[models]] in --config)".into());
        }
        if unnamed > 0 && models.len() > 1 {
            return Err("with several models each needs a name (MODEL=DIR, or models[].name)".into());
        }
        for m in &models {
            if !m.path.join("tokenizer.json").is_file() {
                return Err(format!(
                    "{}: no tokenizer.json (a local directory is needed; nothing is downloaded)",
                    m.path.display()
                ));
            }
        }
        let h = f.headers.unwrap_or_default();
        let d = Headers::default();
        let headers = Headers {
            tokens_b64: header_name("tokens_b64", h.tokens_b64, d.tokens_b64)?,
            tokens_decimal: header_name("tokens_decimal", h.tokens_decimal, d.tokens_decimal)?,
            lora: header_name("lora", h.lora, d.lora)?,
            cache_salt: header_name("cache_salt", h.cache_salt, d.cache_salt)?,
            cache_key: header_name("cache_key", h.cache_key, d.cache_key)?,
        };
        let mut self_check = f.self_check;
        self_check.extend(cli.self_check.iter().cloned());
        for (i, u) in self_check.iter().enumerate() {
            if !u.starts_with("http://") || u.parse::<hyper::Uri>().map_or(true, |u| u.host().is_none()) {
                return Err(format!("self_check[{i}]: {u:?} is not an http:// URL"));
            }
        }
        let max_body_bytes = f.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY);
        if max_body_bytes == 0 {
            return Err("max_body_bytes must be positive".into());
        }
        let max_concurrency = match f.max_concurrency.unwrap_or(0) {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
            n => n,
        };
        Ok(Config {
            grpc_listen: addr("grpc_listen", cli.grpc_listen.clone().or(f.grpc_listen), "127.0.0.1:9200")?,
            http_listen: addr("http_listen", cli.http_listen.clone().or(f.http_listen), "127.0.0.1:9201")?,
            trust_client_tokens: cli.trust_client_tokens || f.trust_client_tokens.unwrap_or(false),
            trust_request_chat_template: f.trust_request_chat_template.unwrap_or(false),
            max_body_bytes,
            max_concurrency,
            headers,
            any_model_name: unnamed == 1,
            self_check,
            models,
        })
    }
}

fn dir_name(p: &Path) -> String {
    p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// vLLM's `--chat-template`: a file's text, else the value itself when it looks like a
/// template (it has `{`, `}` or a newline).
fn read_template(v: &str) -> Result<String, String> {
    match std::fs::read_to_string(v) {
        Ok(t) => Ok(t),
        Err(_) if v.contains(['{', '}', '\n']) => Ok(v.to_string()),
        Err(e) => Err(format!("{v}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_field() {
        let dir = std::env::temp_dir().join(format!("kvroute-tokenizer-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
        let d = dir.display();
        let cli = Cli::default();
        let ok = Config::from_toml(&format!("[[models]]\npath = \"{d}\"\nloras = [\"a\"]\n"), &cli).unwrap();
        assert!(ok.any_model_name && ok.models[0].loras == ["a"]);
        for (text, field) in [
            ("surprise = 1\n".to_string(), "surprise"),
            ("[[models]]\npath = \"/nonexistent\"\n".into(), "tokenizer.json"),
            ("[[models]]\nname = \"\"\npath = \"/x\"\n".into(), "models[0].name"),
            (format!("grpc_listen = \"nowhere\"\n[[models]]\npath = \"{d}\"\n"), "grpc_listen"),
            (format!("[headers]\nlora = \"X-Lora\"\n[[models]]\npath = \"{d}\"\n"), "headers.lora"),
            (format!("[[models]]\npath = \"{d}\"\n[[models]]\npath = \"{d}\"\n"), "each needs a name"),
            ("".into(), "no model"),
        ] {
            let e = Config::from_toml(&text, &cli).unwrap_err();
            assert!(e.contains(field), "{text:?}: {e}");
        }
        let cli = Cli { tokenizer_paths: vec!["=x".into()], ..Cli::default() };
        assert!(Config::from_toml("", &cli).unwrap_err().contains("MODEL=DIR"));
    }
}
