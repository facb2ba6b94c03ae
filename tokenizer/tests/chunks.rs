//! Long texts cut into chunks (`segments`) tokenize exactly as whole texts, on the real
//! Qwen3 tokenizer, and a shared prefix is served from the cache.

mod common;

use common::Rng;
use kvroute_tokenizer::model::{Model, ModelSpec};
use kvroute_tokenizer::segments::CHUNK_BYTES;

fn qwen3(cache_bytes: usize) -> Model {
    Model::load(&ModelSpec {
        name: "qwen3".into(),
        path: common::qwen3_dir(),
        max_model_len: Some(1 << 20),
        loras: Vec::new(),
        chat_template: None,
        cache_bytes,
    })
    .unwrap()
}

/// Text of every kind of pre-token, cut points and near misses alike: words after one or
/// two spaces, contractions, digits, punctuation, newlines, tabs, capitals, accents as
/// combining marks, non-Latin letters, added tokens.
fn text(rng: &mut Rng, bytes: usize) -> String {
    const PIECES: [&str; 24] = [
        " the",
        " word",
        " Word",
        "'s",
        "'LL",
        " don't",
        " 1234",
        "5",
        ", ",
        ".",
        "!\n",
        "\n\n",
        "  ",
        "\t",
        " cafe\u{0301}",
        "\u{0301}",
        " naïve",
        " Ωmega",
        "日本語",
        " x",
        "y",
        " <|im_end|>",
        "<think>",
        "-",
    ];
    let mut s = String::new();
    while s.len() < bytes {
        s.push_str(PIECES[rng.below(PIECES.len())]);
    }
    s
}

#[test]
fn chunked_texts_tokenize_as_whole_texts() {
    let model = qwen3(64 << 20);
    assert!(model.chunked(), "Qwen3's tokenizer should be cut into chunks");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut differ = Vec::new();
    for i in 0..300 {
        let t = text(&mut rng, CHUNK_BYTES * (1 + i % 12));
        // Twice: the second time from cached chunks.
        for pass in 0..2 {
            let got = model.encode_unbounded(&t, false).unwrap();
            let want = model.tokenizer().encode_fast(t.as_str(), false).unwrap().get_ids().to_vec();
            if got != want {
                differ.push(format!("pass {pass}: {t:?}"));
            }
        }
    }
    assert!(differ.is_empty(), "{} texts tokenize differently in chunks:\n{}", differ.len(), differ[0]);
}

#[test]
fn a_shared_prefix_is_looked_up_not_tokenized_again() {
    let model = qwen3(64 << 20);
    let prefix = " plain words of a long system prompt".repeat(300);
    let first = format!("{prefix} and a first question");
    let second = format!("{prefix} then another one entirely");
    let want = model.tokenizer().encode_fast(second.as_str(), false).unwrap().get_ids().to_vec();
    model.encode_unbounded(&first, false).unwrap();
    let before = model.cache_stats();
    assert_eq!(model.encode_unbounded(&second, false).unwrap(), want);
    let after = model.cache_stats();
    let chunks = prefix.len() / CHUNK_BYTES;
    // Every chunk before the one where the texts part is a hit; at most two are new.
    assert!(after.hits - before.hits >= chunks as u64 - 1, "{before:?} -> {after:?}, {chunks} chunks");
    assert!(after.misses - before.misses <= 2, "{before:?} -> {after:?}");
}

#[test]
fn a_forgotten_cache_tokenizes_again_and_the_same() {
    let model = qwen3(64 << 20);
    let t = " plain words of a long system prompt".repeat(300);
    let ids = model.encode_unbounded(&t, false).unwrap();
    let warm = model.cache_stats();
    assert!(warm.entries > 0, "{warm:?}");
    model.forget_cached();
    assert_eq!((model.cache_stats().entries, model.cache_stats().bytes), (0, 0));
    // The same ids, found as the first time: the same misses, the same hits (the text
    // repeats itself, so it hits its own chunks).
    assert_eq!(model.encode_unbounded(&t, false).unwrap(), ids);
    let after = model.cache_stats();
    assert_eq!((after.hits - warm.hits, after.misses - warm.misses), (warm.hits, warm.misses), "{warm:?} -> {after:?}");
}

#[test]
fn no_cache_tokenizes_the_same() {
    let model = qwen3(0);
    let t = text(&mut Rng(7), 8 * CHUNK_BYTES);
    let want = model.tokenizer().encode_fast(t.as_str(), false).unwrap().get_ids().to_vec();
    assert_eq!(model.encode_unbounded(&t, false).unwrap(), want);
    assert_eq!(model.cache_stats().entries, 0);
}

#[test]
fn cached_and_unseen_pieces_of_one_text_keep_their_order() {
    // A segment seen before between two never seen (added tokens separate segments, each
    // cut on its own): looked-up and freshly tokenized pieces come out in the text's order.
    let model = qwen3(64 << 20);
    let mut rng = Rng(11);
    let seen = text(&mut rng, 6 * CHUNK_BYTES).replace("<|im_end|>", "").replace("<think>", "");
    model.encode_unbounded(&seen, false).unwrap();
    for i in 0..20 {
        let (a, c) = (text(&mut rng, CHUNK_BYTES * (2 + i % 7)), text(&mut rng, CHUNK_BYTES * (1 + i % 5)));
        let t = format!("{a}<|im_end|>{seen}<|im_end|>{c}");
        let before = model.cache_stats();
        let got = model.encode_unbounded(&t, false).unwrap();
        let want = model.tokenizer().encode_fast(t.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "text {i}");
        let after = model.cache_stats();
        assert!(after.hits - before.hits >= (seen.len() / CHUNK_BYTES) as u64 - 1, "{before:?} -> {after:?}");
    }
}

#[test]
fn ascii_chunks_are_encoded_by_the_stage_and_the_rest_by_hf() {
    let model = qwen3(64 << 20);
    model.encode_unbounded(&" plain ascii words".repeat(100), false).unwrap();
    let ascii = model.cache_stats();
    assert!(ascii.misses > 1 && ascii.ascii == ascii.misses, "{ascii:?}");
    let mixed = " naïve café".repeat(100);
    assert_eq!(
        model.encode_unbounded(&mixed, false).unwrap(),
        model.tokenizer().encode_fast(mixed.as_str(), false).unwrap().get_ids().to_vec()
    );
    let after = model.cache_stats();
    assert!(after.misses > ascii.misses && after.ascii == ascii.ascii, "{ascii:?} -> {after:?}");
}

#[test]
fn a_burst_over_one_new_document_tokenizes_each_chunk_once() {
    // Eight requests at once, one new document, each its own question: every distinct
    // chunk is tokenized by one of them (misses == entries), the rest wait for it, and
    // every request gets HF's ids.
    let model = qwen3(64 << 20);
    let doc = text(&mut Rng(23), 40 * CHUNK_BYTES).replace("<|im_end|>", "").replace("<think>", "");
    let texts: Vec<String> = (0..8).map(|i| format!("{doc} and question number {i} of the burst")).collect();
    let go = std::sync::Barrier::new(texts.len());
    let got: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = texts
            .iter()
            .map(|t| {
                let (model, go) = (&model, &go);
                s.spawn(move || {
                    go.wait();
                    model.encode_unbounded(t, false).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (t, ids) in texts.iter().zip(&got) {
        assert_eq!(ids, model.tokenizer().encode_fast(t.as_str(), false).unwrap().get_ids(), "{t:?}");
    }
    let s = model.cache_stats();
    assert_eq!(s.misses as usize, s.entries, "a chunk tokenized twice: {s:?}");
    // The document's chunks (all entries but each question's own last one) were looked up
    // by the seven others.
    assert!(s.hits as usize >= 7 * (s.entries - texts.len()), "{s:?}");
}
