//! The ASCII encoder against HF `tokenizers`, side by side, on the text a first sighting
//! costs most: new texts of random one-token words of the real Qwen3 vocabulary (what the
//! simulated fleet writes; ~24k distinct words, so a word cache helps little at first), cut
//! into the segmenter's 256-byte chunks. Then the same texts again (every word cached).
//!
//!     ./scripts/fetch-tokenizer.sh
//!     cargo bench -p kvroute-tokenizer --bench ascii_bpe
//!
//! One thread; µs per token, medians over texts; both encoders start with empty caches.
//! Then the ASCII encoder on one thread against two (the stage tokenizes on several): the
//! same texts, half on each, wall time for all of them (medians of seven rounds), the
//! caches emptied before each.

use kvroute_tokenizer::ascii_bpe::AsciiBpe;
use kvroute_tokenizer::segments::CHUNK_BYTES;
use std::path::PathBuf;
use std::sync::Barrier;
use std::time::Instant;
use tokenizers::Tokenizer;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const TEXTS: usize = 30;
const WORDS_PER_TEXT: usize = 2048;

fn chunks(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while rest.len() > CHUNK_BYTES {
        let cut = CHUNK_BYTES + rest[CHUNK_BYTES..].find(' ').unwrap_or(rest.len() - CHUNK_BYTES);
        out.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    out.push(rest);
    out
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// µs per token of `encode` over each text's chunks; the ids, to compare.
fn per_token(texts: &[String], encode: impl Fn(&str) -> Vec<u32>) -> (f64, Vec<Vec<u32>>) {
    let mut times = Vec::new();
    let mut all = Vec::new();
    for t in texts {
        let parts = chunks(t);
        let start = Instant::now();
        let ids: Vec<u32> = parts.iter().flat_map(|c| encode(c)).collect();
        times.push(start.elapsed().as_secs_f64() * 1e6 / ids.len() as f64);
        all.push(ids);
    }
    (median(times), all)
}

fn main() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/tokenizers/qwen3/tokenizer.json");
    let tok = Tokenizer::from_file(&path).expect("run scripts/fetch-tokenizer.sh");
    let ascii = AsciiBpe::new(&tok).expect("Qwen3 is a GPT-4-style byte-level BPE");
    let mut words: Vec<(u32, String)> = tok
        .get_vocab(false)
        .into_iter()
        .filter_map(|(piece, id)| {
            let w = piece.strip_prefix('Ġ')?;
            ((3..=12).contains(&w.len()) && w.bytes().all(|b| b.is_ascii_lowercase())).then(|| (id, format!(" {w}")))
        })
        .collect();
    words.sort();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let texts: Vec<String> = (0..TEXTS)
        .map(|_| {
            (0..WORDS_PER_TEXT)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    words[(x % words.len() as u64) as usize].1.as_str()
                })
                .collect()
        })
        .collect();
    let hf = |c: &str| tok.encode_fast(c, false).expect("encodes").get_ids().to_vec();
    let fast = |c: &str| ascii.encode(c).expect("ASCII");
    println!("{TEXTS} texts of {WORDS_PER_TEXT} random words of {} one-token words", words.len());
    for pass in ["first sighting", "seen before"] {
        let (hf_us, hf_ids) = per_token(&texts, hf);
        let (fast_us, fast_ids) = per_token(&texts, fast);
        assert_eq!(hf_ids, fast_ids, "the encoders disagree");
        println!(
            "{pass:>15}: HF {hf_us:.3} µs/token, ASCII encoder {fast_us:.3} µs/token ({:.1}× faster)",
            hf_us / fast_us
        );
    }
    for pass in ["first sighting", "seen before"] {
        // Seven rounds, one thread then two; the medians. For "seen before" each thread
        // encodes its part once first, then all start at once.
        let mut wall = [Vec::new(), Vec::new()];
        for _ in 0..7 {
            for (k, threads) in [1, 2].into_iter().enumerate() {
                ascii.forget();
                let start = Barrier::new(threads);
                let encode_all =
                    |part: &[String]| part.iter().for_each(|t| chunks(t).iter().for_each(|c| drop(fast(c))));
                let ms = std::thread::scope(|s| {
                    let spawned: Vec<_> = texts
                        .chunks(texts.len().div_ceil(threads))
                        .map(|part| {
                            let start = &start;
                            s.spawn(move || {
                                if pass == "seen before" {
                                    encode_all(part);
                                }
                                start.wait();
                                let t = Instant::now();
                                encode_all(part);
                                t.elapsed().as_secs_f64() * 1e3
                            })
                        })
                        .collect();
                    spawned.into_iter().map(|h| h.join().expect("encodes")).fold(0.0, f64::max)
                });
                wall[k].push(ms);
            }
        }
        let [one, two] = wall.map(median);
        println!(
            "{pass:>15}: ASCII encoder, all texts on 1 thread {one:.1} ms, on 2 threads {two:.1} ms ({:.2}×)",
            one / two
        );
    }
}
