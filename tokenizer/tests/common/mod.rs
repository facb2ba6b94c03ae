//! What the tokenizer's integration tests share: the real Qwen3 tokenizer's folder, and
//! seeded random texts.

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

/// xorshift: the same texts every run.
#[allow(dead_code)] // (not every test file draws texts)
pub struct Rng(pub u64);

#[allow(dead_code)]
impl Rng {
    pub fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}
