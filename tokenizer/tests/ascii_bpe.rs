//! The ASCII encoder (`ascii_bpe`) gives HF `tokenizers`' ids on random ASCII texts, on the
//! real Qwen3 tokenizer and on a Llama-3-shaped one (its split pattern, `ignore_merges`).

mod common;

use common::Rng;
use kvroute_tokenizer::ascii_bpe::{AsciiBpe, GPT4_SPLITS, MAX_WORD};
use tokenizers::Tokenizer;

fn qwen3_json() -> serde_json::Value {
    let text = std::fs::read_to_string(common::qwen3_dir().join("tokenizer.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn tokenizer(json: &serde_json::Value) -> Tokenizer {
    json.to_string().parse().unwrap()
}

/// ASCII text made of the pieces the split pattern decides on (contractions in any case,
/// letters, digit runs, punctuation, every kind of whitespace and control byte), glued at
/// random: the alternation order and its backtracking get exercised at every boundary.
fn text(rng: &mut Rng) -> String {
    const PIECES: [&str; 30] = [
        " the", "word", " Word", "'s", "'S", "'re", "'Ve", "'LL", "'d", "'m", "'t", "'x", "'", " '", "12345", "7",
        ", ", ".", "!!\n", "\r\n", "\n\n", "  ", "   ", "\t", "\x0b", "\x0c", "_", "\x1c", "\x00\x7f", " ...",
    ];
    let mut s = String::new();
    for _ in 0..1 + rng.below(40) {
        if rng.below(4) == 0 {
            s.push(char::from(rng.below(128) as u8));
        } else {
            s.push_str(PIECES[rng.below(PIECES.len())]);
        }
    }
    s
}

fn agree(tok: &Tokenizer, texts: usize, seed: u64) {
    let ascii = AsciiBpe::new(tok).unwrap();
    let mut rng = Rng(seed);
    for _ in 0..texts {
        let t = text(&mut rng);
        let want = tok.encode_fast(t.as_str(), false).unwrap().get_ids().to_vec();
        // Twice: the second from the word cache.
        for _ in 0..2 {
            assert_eq!(ascii.encode(&t).as_ref(), Some(&want), "{t:?}");
        }
    }
}

#[test]
fn qwen3_ids_are_hfs() {
    agree(&tokenizer(&qwen3_json()), 5_000, 0x9E37_79B9_7F4A_7C15);
}

#[test]
fn llama3_shaped_ids_are_hfs() {
    let mut json = qwen3_json();
    json["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = GPT4_SPLITS[1].0.into();
    json["model"]["ignore_merges"] = true.into();
    agree(&tokenizer(&json), 5_000, 7);
}

#[test]
fn threads_at_once_get_hfs_ids() {
    let tok = tokenizer(&qwen3_json());
    let ascii = AsciiBpe::new(&tok).unwrap();
    let mut rng = Rng(11);
    let texts: Vec<(String, Vec<u32>)> = (0..2_000)
        .map(|_| {
            let t = text(&mut rng);
            let ids = tok.encode_fast(t.as_str(), false).unwrap().get_ids().to_vec();
            (t, ids)
        })
        .collect();
    // Many threads on one encoder, each from another place in the texts: words merged by
    // one while the others wait for the cache, and met by them once it is free.
    const THREADS: usize = 20;
    std::thread::scope(|s| {
        for k in 0..THREADS {
            let (ascii, texts) = (&ascii, &texts);
            s.spawn(move || {
                for i in 0..texts.len() {
                    let (t, want) = &texts[(i + k * texts.len() / THREADS) % texts.len()];
                    assert_eq!(ascii.encode(t).as_ref(), Some(want), "{t:?}");
                }
            });
        }
    });
}

#[test]
fn what_it_leaves_to_hf() {
    let mut json = qwen3_json();
    let ascii = AsciiBpe::new(&tokenizer(&json)).unwrap();
    assert_eq!(ascii.encode("naïve"), None, "non-ASCII");
    assert_eq!(ascii.encode(&"=".repeat(MAX_WORD + 1)), None, "a pre-token too long to merge by scanning");
    assert!(ascii.encode(&"=".repeat(MAX_WORD)).is_some());

    let refused = |json: &serde_json::Value| AsciiBpe::new(&tokenizer(json)).err().unwrap_or_default();
    let mut other = json.clone();
    other["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+".into();
    assert!(refused(&other).contains("pre-tokenizer"), "{}", refused(&other));
    let mut other = json.clone();
    other["normalizer"] = serde_json::json!({"type": "Lowercase"});
    assert!(refused(&other).contains("normalizer"), "{}", refused(&other));
    json["model"]["dropout"] = 0.1.into();
    assert!(refused(&json).contains("dropout"), "{}", refused(&json));
}
