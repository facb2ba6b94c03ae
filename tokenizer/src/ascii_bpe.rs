//! Byte-level BPE for ASCII text, without HF `tokenizers`' per-call machinery.
//!
//! A text no one has sent before is tokenized on the request's path, and HF `tokenizers`
//! spends most of that time around BPE, not in it: the onig regex of the pre-tokenizer
//! (~2 µs per word here), an `Encoding` with a `String` per token, and a word cache of
//! 10,000 entries that stops filling once full. For the tokenizers whose pipeline on ASCII
//! text is simple enough to write down exactly, this module does the same steps directly:
//!
//! - the GPT-4-style split of Qwen2/2.5/3 and Llama 3 ([`GPT4_SPLITS`]), written out for
//!   ASCII (letters `A-Za-z`, digits `0-9`, whitespace `\t\n\v\f\r `), with the regex's
//!   alternation order and backtracking;
//! - the byte-level alphabet (GPT-2's `bytes_to_unicode`), as ids;
//! - BPE merges by rank, leftmost first (what HF's merge queue does), with a word cache
//!   that is cleared when full.
//!
//! The normalizers these tokenizers use (none, or a Unicode normal form) leave ASCII as it
//! is. Anything else is left to HF: a text with a non-ASCII byte, a pre-token longer than
//! [`MAX_WORD`] bytes, a tokenizer of another shape ([`AsciiBpe::new`] says why). The
//! segmenter checks this encoder against HF on a probe text at load
//! ([`crate::segments`]); `tests/ascii_bpe.rs` does so on random ASCII texts.

use ahash::AHashMap;
use kvroute_serve::lock;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Mutex;
use tokenizers::Tokenizer;

/// Pre-tokenizer split patterns this module implements, with the longest digit run each
/// keeps in one pre-token.
pub const GPT4_SPLITS: [(&str, usize); 2] = [
    // Qwen2, Qwen2.5, Qwen3
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        1,
    ),
    // Llama 3 (cl100k-style, digits in threes)
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        3,
    ),
];

/// Longer pre-tokens are left to HF (its merge queue is O(n log n); the scan here is
/// O(n²), cheap for words and runs of spaces, not for a 10k-byte run of punctuation).
pub const MAX_WORD: usize = 256;

/// Words cached before the cache is cleared: ~6 MB, several times an English vocabulary.
const WORD_CACHE_ENTRIES: usize = 1 << 16;

pub struct AsciiBpe {
    /// The vocabulary id of each ASCII byte's byte-level character.
    byte_id: [u32; 128],
    /// (left id, right id) → (rank, merged id).
    merges: AHashMap<u64, (u32, u32)>,
    /// `ignore_merges` (Llama 3): a pre-token that is a vocabulary entry is that token.
    whole: Option<AHashMap<Box<[u8]>, u32>>,
    /// The longest run of digits in one pre-token.
    digits: usize,
    words: Mutex<WordCache>,
}

/// Pre-token bytes → ids.
type WordCache = AHashMap<Box<[u8]>, Box<[u32]>>;

/// The fields of HF's BPE model this module reads, as `tokenizers` serializes it.
#[derive(Deserialize)]
struct BpeJson {
    #[serde(rename = "type")]
    kind: String,
    dropout: Option<f64>,
    continuing_subword_prefix: Option<String>,
    end_of_word_suffix: Option<String>,
    #[serde(default)]
    ignore_merges: bool,
    vocab: AHashMap<String, u32>,
    merges: Vec<MergeJson>,
}

/// `["a", "b"]`, or `"a b"` in older files.
#[derive(Deserialize)]
#[serde(untagged)]
enum MergeJson {
    Pair(String, String),
    Joined(String),
}

fn pair(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

/// GPT-2's `bytes_to_unicode`: printable bytes stand for themselves, the rest are shifted
/// past U+00FF in byte order.
fn byte_level_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return char::from(b);
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shifted).unwrap_or('\u{FFFD}')
}

/// The bytes a byte-level token stands for, if they are all ASCII.
fn ascii_bytes(token: &str, to_byte: &AHashMap<char, u8>) -> Option<Vec<u8>> {
    token.chars().map(|c| to_byte.get(&c).copied().filter(u8::is_ascii)).collect()
}

impl AsciiBpe {
    /// The encoder for `tok`, or why its pipeline is not one this module reproduces.
    pub fn new(tok: &Tokenizer) -> Result<AsciiBpe, String> {
        let digits = split_digits(tok)?;
        // Read through a typed form, not a `Value` tree: a 150k-entry vocabulary and merge
        // list as `Value`s would cost tens of MB at load, kept by the allocator afterwards.
        let json = serde_json::to_vec(tok.get_model()).map_err(|e| e.to_string())?;
        let model: BpeJson = serde_json::from_slice(&json).map_err(|e| format!("model: {e}"))?;
        drop(json);
        if model.kind != "BPE" {
            return Err(format!("model {}", model.kind));
        }
        if model.dropout.is_some() {
            return Err("BPE dropout".into());
        }
        let empty = |v: &Option<String>| v.as_deref().is_none_or(str::is_empty);
        if !empty(&model.continuing_subword_prefix) || !empty(&model.end_of_word_suffix) {
            return Err("BPE subword prefix or suffix".into());
        }
        let vocab = &model.vocab;
        let mut byte_id = [0u32; 128];
        for (b, slot) in byte_id.iter_mut().enumerate() {
            let c = byte_level_char(b as u8).to_string();
            *slot = *vocab.get(c.as_str()).ok_or_else(|| format!("byte {b:#04x} ({c:?}) is not in the vocabulary"))?;
        }
        let mut merges = AHashMap::with_capacity(model.merges.len());
        let mut joined = String::new();
        for (rank, m) in model.merges.iter().enumerate() {
            let (a, b) = match m {
                MergeJson::Pair(a, b) => (a.as_str(), b.as_str()),
                MergeJson::Joined(s) => s.split_once(' ').unwrap_or((s.as_str(), "")),
            };
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            let (Some(&ia), Some(&ib), Some(&merged)) = (vocab.get(a), vocab.get(b), vocab.get(joined.as_str())) else {
                return Err(format!("merge {a:?} {b:?} names a token not in the vocabulary"));
            };
            // HF serializes its merge map: each pair once, in rank order, so the index is
            // the rank up to gaps, which do not change which pair merges first.
            merges.insert(pair(ia, ib), (rank as u32, merged));
        }
        let whole = if model.ignore_merges {
            let to_byte: AHashMap<char, u8> = (0..=255u8).map(|b| (byte_level_char(b), b)).collect();
            Some(vocab.iter().filter_map(|(t, &id)| Some((ascii_bytes(t, &to_byte)?.into_boxed_slice(), id))).collect())
        } else {
            None
        };
        Ok(AsciiBpe { byte_id, merges, whole, digits, words: Mutex::new(AHashMap::new()) })
    }

    /// Forgets every word it has cached.
    pub fn forget(&self) {
        lock(&self.words).clear();
    }

    /// The ids of `text` (no special tokens), or `None` where HF must do it: a non-ASCII
    /// byte, or a pre-token longer than [`MAX_WORD`].
    pub fn encode(&self, text: &str) -> Option<Vec<u32>> {
        let b = text.as_bytes();
        if !b.is_ascii() {
            return None;
        }
        let mut out = Vec::with_capacity(b.len() / 4 + 1);
        let mut words = lock(&self.words);
        let mut at = 0;
        while at < b.len() {
            let end = pre_token_end(b, at, self.digits);
            let word = &b[at..end];
            at = end;
            if let [one] = word {
                out.push(self.byte_id[usize::from(*one)]);
                continue;
            }
            if word.len() > MAX_WORD {
                return None;
            }
            if let Some(ids) = words.get(word) {
                out.extend_from_slice(ids);
                continue;
            }
            let start = out.len();
            self.merge(word, &mut out);
            if words.len() >= WORD_CACHE_ENTRIES {
                words.clear();
            }
            words.insert(word.into(), out[start..].into());
        }
        Some(out)
    }

    /// BPE of one pre-token: the lowest-ranked adjacent pair merged first, the leftmost of
    /// equals, until no pair merges.
    fn merge(&self, word: &[u8], out: &mut Vec<u32>) {
        if let Some(id) = self.whole.as_ref().and_then(|w| w.get(word)) {
            out.push(*id);
            return;
        }
        let mut ids: Vec<u32> = word.iter().map(|&c| self.byte_id[usize::from(c)]).collect();
        let rank_of = |a: u32, b: u32| self.merges.get(&pair(a, b)).map_or((u32::MAX, 0), |&m| m);
        // ranks[i]: the merge of ids[i] and ids[i + 1].
        let mut ranks: Vec<(u32, u32)> = ids.windows(2).map(|w| rank_of(w[0], w[1])).collect();
        while let Some((i, &(rank, merged))) = ranks.iter().enumerate().min_by_key(|(i, r)| (r.0, *i)) {
            if rank == u32::MAX {
                break;
            }
            ids[i] = merged;
            ids.remove(i + 1);
            ranks.remove(i);
            if i > 0 {
                ranks[i - 1] = rank_of(ids[i - 1], ids[i]);
            }
            if i + 1 < ids.len() {
                ranks[i] = rank_of(ids[i], ids[i + 1]);
            }
        }
        out.extend_from_slice(&ids);
    }
}

/// The digit run length of `tok`'s pre-tokenizer, if its pipeline is a GPT-4-style split
/// then byte level (no prefix space), under a normalizer that leaves ASCII alone; else why
/// not.
fn split_digits(tok: &Tokenizer) -> Result<usize, String> {
    keeps_ascii(tok)?;
    match gpt4_split(&pre_tokenizer_json(tok)?) {
        Some((digits, Some(false))) => Ok(digits),
        _ => Err("a pre-tokenizer other than a GPT-4-style split then byte level".into()),
    }
}

/// Whether `tok`'s normalizer leaves ASCII as it is: none, or a Unicode normal form (which
/// also never composes across an ASCII space); else which one it is.
pub(crate) fn keeps_ascii(tok: &Tokenizer) -> Result<(), String> {
    let normalizer = match tok.get_normalizer() {
        Some(n) => serde_json::to_value(n).map_err(|e| e.to_string())?,
        None => return Ok(()),
    };
    if ["NFC", "NFD", "NFKC", "NFKD"].iter().any(|f| normalizer["type"] == *f) {
        return Ok(());
    }
    Err(format!("normalizer {}", normalizer["type"]))
}

/// `tok`'s pre-tokenizer as `tokenizer.json` writes it.
pub(crate) fn pre_tokenizer_json(tok: &Tokenizer) -> Result<Value, String> {
    match tok.get_pre_tokenizer() {
        Some(p) => serde_json::to_value(p).map_err(|e| e.to_string()),
        None => Err("no pre-tokenizer".into()),
    }
}

/// If `pre` is a split by one of [`GPT4_SPLITS`] (isolated) then byte level without a
/// regex of its own: the split's digit run, and the byte level's `add_prefix_space`.
pub(crate) fn gpt4_split(pre: &Value) -> Option<(usize, Option<bool>)> {
    let (Some("Sequence"), Some([split, bytes])) =
        (pre["type"].as_str(), pre["pretokenizers"].as_array().map(Vec::as_slice))
    else {
        return None;
    };
    let pattern = split["pattern"]["Regex"].as_str()?;
    let (_, digits) = GPT4_SPLITS.iter().find(|(p, _)| *p == pattern)?;
    let isolated = split["type"] == "Split" && split["behavior"] == "Isolated" && split["invert"] == false;
    let byte_level = bytes["type"] == "ByteLevel" && bytes["use_regex"] == false;
    (isolated && byte_level).then(|| (*digits, bytes["add_prefix_space"].as_bool()))
}

fn letter(c: u8) -> bool {
    c.is_ascii_alphabetic()
}

fn digit(c: u8) -> bool {
    c.is_ascii_digit()
}

/// onig's `\s` on ASCII (Unicode White_Space): tab, LF, VT, FF, CR, space.
fn space(c: u8) -> bool {
    matches!(c, b'\t'..=b'\r' | b' ')
}

fn newline(c: u8) -> bool {
    c == b'\r' || c == b'\n'
}

/// `[^\s\p{L}\p{N}]`
fn other(c: u8) -> bool {
    !space(c) && !letter(c) && !digit(c)
}

fn run(b: &[u8], from: usize, class: impl Fn(u8) -> bool) -> usize {
    b[from..].iter().position(|&c| !class(c)).map_or(b.len(), |n| from + n)
}

/// Where the pre-token at `at` ends: the first alternative of the split pattern that
/// matches there, as the regex engine tries them. `at < b.len()`; the result is past `at`.
fn pre_token_end(b: &[u8], at: usize, digits: usize) -> usize {
    let n = b.len();
    let c = b[at];
    let next = |i: usize| b.get(at + i).map(u8::to_ascii_lowercase);
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if c == b'\'' {
        match (next(1), next(2)) {
            (Some(b's' | b't' | b'm' | b'd'), _) => return at + 2,
            (Some(b'r' | b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => return at + 3,
            _ => {}
        }
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if letter(c) {
        return run(b, at, letter);
    }
    if !newline(c) && !digit(c) && at + 1 < n && letter(b[at + 1]) {
        return run(b, at + 1, letter);
    }
    // \p{N} or \p{N}{1,3}
    if digit(c) {
        return run(b, at, digit).min(at + digits);
    }
    // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    let from = if c == b' ' { at + 1 } else { at };
    if from < n && other(b[from]) {
        return run(b, run(b, from, other), newline);
    }
    // Only whitespace is left: c is one.
    let end = run(b, at, space);
    // \s*[\r\n]+ : up to the run's last newline
    if let Some(last) = b[at..end].iter().rposition(|&c| newline(c)) {
        return at + last + 1;
    }
    // \s+(?!\S) : the run, but its last space if a non-space follows
    if end < n && end - at >= 2 {
        return end - 1;
    }
    // \s+
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(text: &str, digits: usize) -> Vec<&str> {
        let b = text.as_bytes();
        let mut at = 0;
        let mut out = Vec::new();
        while at < b.len() {
            let end = pre_token_end(b, at, digits);
            assert!(end > at && end <= b.len());
            out.push(&text[at..end]);
            at = end;
        }
        out
    }

    #[test]
    fn splits_as_the_gpt4_pattern() {
        assert_eq!(split("Hello world", 1), ["Hello", " world"]);
        assert_eq!(split("it's 'RE 'x", 1), ["it", "'s", " '", "RE", " '", "x"]);
        assert_eq!(split("12345", 1), ["1", "2", "3", "4", "5"]);
        assert_eq!(split("12345", 3), ["123", "45"]);
        assert_eq!(split("a  b", 1), ["a", " ", " b"]);
        assert_eq!(split("a  \n\n  b  ", 1), ["a", "  \n\n", " ", " b", "  "]);
        assert_eq!(split("x, y!!\n\nz", 1), ["x", ",", " y", "!!\n\n", "z"]);
        assert_eq!(split("\tfoo_bar(", 1), ["\tfoo", "_bar", "("]);
        assert_eq!(split("\nfoo", 1), ["\n", "foo"]);
        assert_eq!(split("  ...", 1), [" ", " ..."]);
    }

    #[test]
    fn byte_level_alphabet_is_gpt2s() {
        assert_eq!(byte_level_char(b'a'), 'a');
        assert_eq!(byte_level_char(b' '), 'Ġ');
        assert_eq!(byte_level_char(b'\n'), 'Ċ');
        assert_eq!(byte_level_char(0x7f), 'ġ');
        assert_eq!(byte_level_char(0), 'Ā');
    }
}
