//! Token ids per segment, cached: the text between two added tokens (`<|im_start|>`,
//! `<think>`, …) is tokenized on its own by HF `tokenizers` (its `AddedVocabulary` splits
//! the input on them before normalizing and pre-tokenizing each piece), so a repeated
//! system prompt or chat turn can be looked up instead of tokenized again.
//!
//! That holds when every added token is matched on the raw text with no stripping
//! (`normalized`, `lstrip`, `rstrip`, `single_word` all false) and the pre-tokenizer treats
//! every piece alike (no `Metaspace` that prepends only to the first): [`Segmenter::new`]
//! checks both, and also encodes a probe text both ways. A tokenizer that fails any check
//! is encoded whole, uncached (counted, and logged at start).
//!
//! A long segment (a plain-text completion is one) is cut further into chunks, so that two
//! texts sharing a prefix share its chunks. A cut goes before a space between two ASCII
//! letters (`word| word`), the first such place at least [`CHUNK_BYTES`] after the last
//! cut: it depends only on the text before it, so a shared prefix is cut alike in every
//! text. Such a cut is a pre-token boundary only for pre-tokenizers whose letter runs
//! stop at a space and whose next run starts with it, the GPT-2 byte-level regex and the
//! GPT-4-style split of Qwen2/3 and Llama 3 ([`chunk_safe`]), under a normalizer that
//! leaves ASCII alone; BPE then never merges across it. Other tokenizers keep whole
//! segments. The probe checks chunks too.
//!
//! A piece or chunk not in the cache is tokenized by the stage's ASCII encoder
//! ([`crate::ascii_bpe`]) when it is ASCII and the tokenizer is one that encoder
//! reproduces (checked at load on probe texts), else by HF `tokenizers`.
//!
//! One tokenization per piece at a time: a request that needs a piece another request is
//! tokenizing waits for it instead of tokenizing it too. A burst of requests over one new
//! document then tokenizes it once, the followers a chunk behind the leader, not N times
//! over on the same cores.

use crate::ascii_bpe::{gpt4_split, keeps_ascii, pre_tokenizer_json, AsciiBpe};
use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use kvroute_serve::lock;
use lru::LruCache;
use std::collections::HashSet;
use std::sync::{Condvar, Mutex};
use tokenizers::Tokenizer;

/// Bytes an entry costs beyond its key and ids (map slot, list links, allocations).
const ENTRY_OVERHEAD: usize = 96;

/// The least length of a chunk but the last of a segment: ~60 tokens of English, so a
/// 2k-token prefix is ~35 lookups and a text that diverges retokenizes ~1 chunk of it.
pub const CHUNK_BYTES: usize = 256;

/// Splits text on a tokenizer's added tokens and caches the pieces' token ids.
pub struct Segmenter {
    /// The added tokens, leftmost-longest, as `AddedVocabulary` matches them; `None`: the
    /// tokenizer is not segment-safe, encode whole texts.
    matcher: Option<(AhoCorasick, Vec<u32>)>,
    /// Segments are cut into chunks ([`chunk_safe`]).
    chunked: bool,
    /// Chunks of ASCII text encoded without HF `tokenizers` ([`crate::ascii_bpe`]); or why
    /// not.
    ascii: Result<AsciiBpe, String>,
    cache: Mutex<Cache>,
    /// Signalled whenever a piece leaves `Cache::pending`.
    done: Condvar,
}

struct Cache {
    map: LruCache<Box<str>, Box<[u32]>>,
    /// Pieces being tokenized by some request now.
    pending: HashSet<Box<str>>,
    bytes: usize,
    cap: usize,
    hits: u64,
    misses: u64,
    /// Lookups that waited for another request's tokenization of the same piece.
    waits: u64,
    /// Misses the ASCII encoder tokenized (the rest went to HF).
    ascii: u64,
}

/// What the cache holds and has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub entries: usize,
    pub bytes: usize,
    pub hits: u64,
    pub misses: u64,
    /// Lookups that found the piece being tokenized for another request and waited for
    /// it (counted as hits once it came, or as misses when it was not cached after all).
    pub waits: u64,
    /// Of `misses`, the pieces the ASCII encoder tokenized; HF tokenized the others.
    pub ascii: u64,
}

fn entry_bytes(key: &str, ids: &[u32]) -> usize {
    key.len() + 4 * ids.len() + ENTRY_OVERHEAD
}

/// Whether `piece`'s entry fits in a cache of `cap` bytes whatever its ids: a byte-level
/// BPE gives at most one id (4 bytes) per byte.
fn surely_fits(piece: &str, cap: usize) -> bool {
    5 * piece.len() + ENTRY_OVERHEAD <= cap
}

/// A piece some request is tokenizing; dropped, it is no longer, and waiters wake.
struct Pending<'a> {
    cache: &'a Mutex<Cache>,
    done: &'a Condvar,
    piece: &'a str,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        lock(self.cache).pending.remove(self.piece);
        self.done.notify_all();
    }
}

impl Segmenter {
    /// `cap_bytes`: the cache's memory bound (0: no cache). Why a tokenizer cannot be
    /// segmented comes back as the second value.
    pub fn new(tok: &Tokenizer, cap_bytes: usize) -> (Segmenter, Option<String>) {
        let cache = Mutex::new(Cache {
            map: LruCache::unbounded(),
            pending: HashSet::new(),
            bytes: 0,
            cap: cap_bytes,
            hits: 0,
            misses: 0,
            waits: 0,
            ascii: 0,
        });
        let (matcher, why_not) = match segment_safe(tok) {
            Ok(m) => (Some(m), None),
            Err(why) => (None, Some(why)),
        };
        let chunked = matcher.is_some() && chunk_safe(tok).is_ok();
        let ascii = if chunked {
            AsciiBpe::new(tok).and_then(|a| probe_ascii(&a, tok).map(|()| a))
        } else {
            Err("segments are not chunked".into())
        };
        let s = Segmenter { matcher, chunked, ascii, cache, done: Condvar::new() };
        if s.matcher.is_some() {
            if let Err(why) = s.probe(tok) {
                let ascii = Err("segments are not cached".into());
                return (Segmenter { matcher: None, chunked: false, ascii, ..s }, Some(why));
            }
        }
        (s, why_not)
    }

    /// Whether ASCII chunks are encoded without HF `tokenizers`, or why not.
    pub fn ascii_encoder(&self) -> Result<(), &str> {
        self.ascii.as_ref().map(|_| ()).map_err(String::as_str)
    }

    pub fn segmented(&self) -> bool {
        self.matcher.is_some()
    }

    /// Long segments are cut into chunks.
    pub fn chunked(&self) -> bool {
        self.chunked
    }

    /// The token ids of `text` without special tokens added (`add_special_tokens=False`),
    /// from the cache where its pieces were seen before.
    pub fn encode(&self, tok: &Tokenizer, text: &str) -> Result<Vec<u32>, String> {
        let Some((ac, ids)) = &self.matcher else {
            return encode_plain(tok, text);
        };
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut at = 0;
        for m in ac.find_iter(text) {
            if at < m.start() {
                self.piece(tok, &text[at..m.start()], &mut out)?;
            }
            out.push(ids[m.pattern().as_usize()]);
            at = m.end();
        }
        if at < text.len() {
            self.piece(tok, &text[at..], &mut out)?;
        }
        Ok(out)
    }

    /// A segment's ids, chunk by chunk where it is chunked.
    fn piece(&self, tok: &Tokenizer, piece: &str, out: &mut Vec<u32>) -> Result<(), String> {
        if !self.chunked {
            return self.lookup(tok, piece, out);
        }
        let mut rest = piece;
        while let Some(cut) = next_cut(rest) {
            self.lookup(tok, &rest[..cut], out)?;
            rest = &rest[cut..];
        }
        self.lookup(tok, rest, out)
    }

    fn lookup(&self, tok: &Tokenizer, piece: &str, out: &mut Vec<u32>) -> Result<(), String> {
        let marked = {
            let mut c = lock(&self.cache);
            let mut waited = false;
            while c.pending.contains(piece) {
                waited = true;
                c = self.done.wait(c).unwrap_or_else(|p| p.into_inner());
            }
            c.waits += u64::from(waited);
            if let Some(ids) = c.map.get(piece) {
                out.extend_from_slice(ids);
                c.hits += 1;
                return Ok(());
            }
            c.misses += 1;
            // Only what the cache will keep: a follower that woke to a miss would tokenize
            // the piece itself, after the leader instead of beside it.
            let marked = surely_fits(piece, c.cap);
            if marked {
                c.pending.insert(piece.into());
            }
            marked
        };
        // Tokenized outside the lock: other requests go on meanwhile, and those that need
        // this piece wait for it (the guard clears it, on error too).
        let _pending = marked.then_some(Pending { cache: &self.cache, done: &self.done, piece });
        let ascii = self.ascii.as_ref().ok().and_then(|a| a.encode(piece));
        let by_ascii = ascii.is_some();
        let ids = match ascii {
            Some(ids) => ids,
            None => encode_plain(tok, piece)?,
        };
        out.extend_from_slice(&ids);
        let mut c = lock(&self.cache);
        c.ascii += u64::from(by_ascii);
        let size = entry_bytes(piece, &ids);
        if size <= c.cap && !c.map.contains(piece) {
            c.bytes += size;
            c.map.put(piece.into(), ids.into_boxed_slice());
            while c.bytes > c.cap {
                let Some((k, v)) = c.map.pop_lru() else { break };
                c.bytes -= entry_bytes(&k, &v);
            }
        }
        Ok(())
    }

    /// Forgets every cached piece and the ASCII encoder's words, as a new process would
    /// start (a piece being tokenized now is still cached when done); counts stay.
    pub fn forget(&self) {
        {
            let mut c = lock(&self.cache);
            c.map.clear();
            c.bytes = 0;
        }
        if let Ok(a) = &self.ascii {
            a.forget();
        }
    }

    pub fn stats(&self) -> CacheStats {
        let c = lock(&self.cache);
        CacheStats {
            entries: c.map.len(),
            bytes: c.bytes,
            hits: c.hits,
            misses: c.misses,
            waits: c.waits,
            ascii: c.ascii,
        }
    }

    /// Encodes a text with added tokens and long segments in it both ways; they must agree.
    fn probe(&self, tok: &Tokenizer) -> Result<(), String> {
        let mut added: Vec<String> = tok.get_added_tokens_decoder().into_values().map(|t| t.content).collect();
        added.sort();
        let mut text = String::from("  Hello,\u{00e9}  world!\n");
        // Chunk cuts after every kind of pre-token: words, contractions, digits,
        // punctuation, newlines, runs of spaces, non-ASCII letters and marks.
        let prose = "It's the user's   turn: 12345 cafe\u{0301} naïve Ωmega, don't STOP at 3.14.\n\n\
                     Then  again\t a new line of plain words wraps here and there again ";
        for _ in 0..2 * CHUNK_BYTES / prose.len() + 2 {
            text.push_str(prose);
        }
        for (i, a) in added.iter().take(8).enumerate() {
            text.push_str(a);
            text.push_str(["x", " y", "\n\n z", "  ", "1234", "ünïcödé", "\t", ""][i % 8]);
            if i == 0 {
                text.push_str(&prose.repeat(2 * CHUNK_BYTES / prose.len() + 2));
            }
        }
        text.push_str(" the end ");
        let segmented = self.encode(tok, &text)?;
        let whole = encode_plain(tok, &text)?;
        let mut c = lock(&self.cache);
        c.map.clear();
        (c.bytes, c.hits, c.misses, c.ascii) = (0, 0, 0, 0);
        if segmented == whole {
            Ok(())
        } else {
            Err("a probe text tokenizes differently in pieces than whole".into())
        }
    }
}

/// Where the first chunk of `text` ends: before the first space between two ASCII letters
/// at or past [`CHUNK_BYTES`], if there is one.
fn next_cut(text: &str) -> Option<usize> {
    let b = text.as_bytes();
    let mut i = CHUNK_BYTES.max(1);
    while i + 1 < b.len() {
        let at = i + memchr::memchr(b' ', &b[i..b.len() - 1])?;
        if b[at - 1].is_ascii_alphabetic() && b[at + 1].is_ascii_alphabetic() {
            return Some(at);
        }
        i = at + 1;
    }
    None
}

/// Whether `word| word` is a pre-token boundary for this tokenizer (module docs).
fn chunk_safe(tok: &Tokenizer) -> Result<(), String> {
    keeps_ascii(tok)?;
    let pre = pre_tokenizer_json(tok)?;
    // GPT-2's byte-level regex, or a GPT-4-style split before a byte level without one.
    let gpt2 = pre["type"] == "ByteLevel" && pre["use_regex"] == true;
    if gpt2 || gpt4_split(&pre).is_some() {
        return Ok(());
    }
    Err("a pre-tokenizer not known to split at word| word".into())
}

/// Texts with every kind of ASCII pre-token and the places the split pattern backtracks:
/// the ASCII encoder must agree with HF on all of them before it is used.
fn probe_ascii(ascii: &AsciiBpe, tok: &Tokenizer) -> Result<(), String> {
    const PROBES: [&str; 8] = [
        "It's the user's   turn: they'RE here, we'VE gone, I'M done, she'LL see, he'D know, 'tis.",
        "x = [12345, 3.14159, 0x7f]; if (a && b) { return -1; }\n\treturn foo_bar(baz);\r\n",
        "  leading spaces, trailing spaces   \n\n\n  indented\n    more indented\n\t\ttabs \x0b\x0c end",
        "Hello,world!!! What?! ... --- *** ### @user #tag $100 50% ~home `code` \\path/to/file",
        "\x00\x01\x1b[31mred\x1b[0m \x1c\x1d\x1e\x1f \x7f del '' ' s 'll '",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "                                                                                !",
        " the quick brown fox jumps over the lazy dog THE QUICK BROWN FOX 0123456789",
    ];
    for p in PROBES {
        let want = encode_plain(tok, p)?;
        if ascii.encode(p).as_ref() != Some(&want) {
            return Err(format!("it encodes the probe {p:?} differently from HF"));
        }
    }
    Ok(())
}

fn encode_plain(tok: &Tokenizer, text: &str) -> Result<Vec<u32>, String> {
    tok.encode_fast(text, false).map(|e| e.get_ids().to_vec()).map_err(|e| format!("tokenizer: {e}"))
}

/// The matcher for a tokenizer whose pieces between added tokens tokenize independently.
fn segment_safe(tok: &Tokenizer) -> Result<(AhoCorasick, Vec<u32>), String> {
    if tok.get_encode_special_tokens() {
        return Err("it encodes special tokens as text".into());
    }
    let mut tokens: Vec<(String, u32)> = Vec::new();
    for (id, t) in tok.get_added_tokens_decoder() {
        if t.normalized || t.lstrip || t.rstrip || t.single_word {
            return Err(format!("added token {:?} is normalized or strips", t.content));
        }
        tokens.push((t.content, id));
    }
    if let Some(pre) = tok.get_pre_tokenizer() {
        let json = serde_json::to_string(pre).map_err(|e| e.to_string())?;
        if json.contains("\"Metaspace\"") && json.contains("\"first\"") {
            return Err("its Metaspace pre-tokenizer prepends to the first piece only".into());
        }
    }
    tokens.sort();
    let ac = AhoCorasickBuilder::new()
        .match_kind(MatchKind::LeftmostLongest)
        .build(tokens.iter().map(|(c, _)| c.as_str()))
        .map_err(|e| format!("added tokens: {e}"))?;
    Ok((ac, tokens.into_iter().map(|(_, id)| id).collect()))
}
