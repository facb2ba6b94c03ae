//! The stage against golden token ids from Python transformers with vLLM 0.33's request
//! rules (`tests/vectors/tokenizer/generate.py`), on the real Qwen3 tokenizer that
//! `scripts/fetch-tokenizer.sh` fetches (scripts/test.sh runs it first).

mod common;

use common::{qwen3_dir, root};
use kvroute_tokenizer::model::ModelSpec;
use kvroute_tokenizer::stage::{Endpoint, Stage};
use serde_json::Value;

#[test]
fn every_golden_request_tokenizes_as_vllm_does() {
    let vectors: Value =
        serde_json::from_slice(&std::fs::read(root().join("tests/vectors/tokenizer/qwen3.json")).unwrap()).unwrap();
    let served = &vectors["served"];
    let spec = ModelSpec {
        name: served["model"].as_str().unwrap().into(),
        path: qwen3_dir(),
        max_model_len: served["max_model_len"].as_u64().map(|n| n as usize),
        loras: served["loras"].as_array().unwrap().iter().map(|l| l.as_str().unwrap().to_string()).collect(),
        chat_template: None,
        cache_bytes: 64 << 20,
    };
    let stage = Stage::new(&[spec], false, false).unwrap();
    let cases = vectors["cases"].as_array().unwrap();
    assert!(cases.len() >= 30);
    let mut failures = Vec::new();
    // Twice: cold, then with every segment cached.
    for pass in ["cold", "cached"] {
        for c in cases {
            let name = c["name"].as_str().unwrap();
            let endpoint = match c["endpoint"].as_str().unwrap() {
                "completions" => Endpoint::Completions,
                _ => Endpoint::ChatCompletions,
            };
            let body = serde_json::to_vec(&c["request"]).unwrap();
            match (stage.prompt(endpoint, &body), c.get("tokens")) {
                (Ok(p), Some(want)) => {
                    let want: Vec<u32> = want.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
                    if p.tokens != want {
                        let text = c.get("text").and_then(Value::as_str).unwrap_or("");
                        failures.push(format!(
                            "{pass} {name}: {} tokens, want {}; text {text:?}",
                            p.tokens.len(),
                            want.len()
                        ));
                    }
                    if p.prompts as u64 != c["prompts"].as_u64().unwrap() || p.lora.as_deref() != c["lora"].as_str() {
                        failures.push(format!("{pass} {name}: prompts {} lora {:?}", p.prompts, p.lora));
                    }
                }
                (Err(skip), None) => {
                    let _ = skip; // vLLM refuses it, and so does the stage
                }
                (Ok(p), None) => {
                    failures.push(format!("{pass} {name}: tokenized ({} tokens), vLLM refuses it", p.tokens.len()))
                }
                (Err(skip), Some(_)) => failures.push(format!("{pass} {name}: skipped ({skip}), vLLM tokenizes it")),
            }
        }
    }
    let stats = stage.models()[0].cache_stats();
    assert!(stats.hits > 0 && stats.entries > 0, "{stats:?}");
    assert!(failures.is_empty(), "{} of {} cases differ:\n{}", failures.len() / 2, cases.len(), failures.join("\n"));
}
