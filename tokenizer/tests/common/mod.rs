//! What the tokenizer's integration tests share: the real Qwen3 tokenizer's folder.

use std::path::PathBuf;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn qwen3_dir() -> PathBuf {
    let dir = std::env::var_os("KVROUTE_TEST_TOKENIZER")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/tokenizers/qwen3"));
    assert!(
        dir.join("tokenizer.json").exists(),
        "{} has no tokenizer.json: run scripts/fetch-tokenizer.sh",
        dir.display()
    );
    dir
}
