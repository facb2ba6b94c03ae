//! The invariants every kvroute decoder must hold for any input, one module per decoder.
//!
//! Each `check(data)` feeds arbitrary bytes to a decoder and panics if the decoder panics
//! *or* if what it returns breaks a property it promises (a round trip that does not come
//! back, a slot outside the table, a differential oracle that disagrees). Two drivers run
//! them: the libFuzzer targets in `fuzz/` (one per entry of [`TARGETS`], `scripts/fuzz.sh`),
//! and `tests/corpus.rs`, which replays the checked-in corpus and every crash case as an
//! ordinary test on stable, so CI never needs fuzzing time. `fuzz/README.md` says how to
//! add a target.

pub mod checkpoint;
pub mod feed_frame;
pub mod filter_configs;
pub mod kv_events;
pub mod shared_layouts;
pub mod sidecar_config;
pub mod stage_request;
pub mod text_ids;
pub mod token_header;

/// A fuzz target's check: panics on a broken invariant.
pub type Check = fn(&[u8]);

/// Every target, by the name of its `fuzz/fuzz_targets/<name>.rs` and its corpus folder.
pub const TARGETS: &[(&str, Check)] = &[
    ("token_header", token_header::check),
    ("kv_events", kv_events::check),
    ("feed_frame", feed_frame::check),
    ("shared_layouts", shared_layouts::check),
    ("filter_configs", filter_configs::check),
    ("sidecar_config", sidecar_config::check),
    ("stage_request", stage_request::check),
    ("checkpoint", checkpoint::check),
    ("text_ids", text_ids::check),
];

/// Splits `data` at its first byte: a selector (for targets that cover several decoders or
/// modes) and the rest.
pub(crate) fn selector(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((s, rest)) => (*s, rest),
        None => (0, data),
    }
}

/// The real Qwen3 tokenizer's folder (`scripts/fetch-tokenizer.sh`), or the one in
/// `KVROUTE_TEST_TOKENIZER`.
pub(crate) fn qwen3_dir() -> std::path::PathBuf {
    let path = std::env::var_os("KVROUTE_TEST_TOKENIZER")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/tokenizers/qwen3"));
    assert!(path.join("tokenizer.json").exists(), "{}: run scripts/fetch-tokenizer.sh", path.display());
    path
}
