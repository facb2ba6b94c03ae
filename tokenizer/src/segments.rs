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

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use lru::LruCache;
use std::sync::Mutex;
use tokenizers::Tokenizer;

/// Bytes an entry costs beyond its key and ids (map slot, list links, allocations).
const ENTRY_OVERHEAD: usize = 96;

/// Splits text on a tokenizer's added tokens and caches the pieces' token ids.
pub struct Segmenter {
    /// The added tokens, leftmost-longest, as `AddedVocabulary` matches them; `None`: the
    /// tokenizer is not segment-safe, encode whole texts.
    matcher: Option<(AhoCorasick, Vec<u32>)>,
    cache: Mutex<Cache>,
}

struct Cache {
    map: LruCache<Box<str>, Box<[u32]>>,
    bytes: usize,
    cap: usize,
    hits: u64,
    misses: u64,
}

/// What the cache holds and has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub entries: usize,
    pub bytes: usize,
    pub hits: u64,
    pub misses: u64,
}

fn entry_bytes(key: &str, ids: &[u32]) -> usize {
    key.len() + 4 * ids.len() + ENTRY_OVERHEAD
}

impl Segmenter {
    /// `cap_bytes`: the cache's memory bound (0: no cache). Why a tokenizer cannot be
    /// segmented comes back as the second value.
    pub fn new(tok: &Tokenizer, cap_bytes: usize) -> (Segmenter, Option<String>) {
        let cache = Mutex::new(Cache { map: LruCache::unbounded(), bytes: 0, cap: cap_bytes, hits: 0, misses: 0 });
        let (matcher, why_not) = match segment_safe(tok) {
            Ok(m) => (Some(m), None),
            Err(why) => (None, Some(why)),
        };
        let s = Segmenter { matcher, cache };
        if s.matcher.is_some() {
            if let Err(why) = s.probe(tok) {
                return (Segmenter { matcher: None, ..s }, Some(why));
            }
        }
        (s, why_not)
    }

    pub fn segmented(&self) -> bool {
        self.matcher.is_some()
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

    fn piece(&self, tok: &Tokenizer, piece: &str, out: &mut Vec<u32>) -> Result<(), String> {
        {
            let mut c = lock(&self.cache);
            if let Some(ids) = c.map.get(piece) {
                out.extend_from_slice(ids);
                c.hits += 1;
                return Ok(());
            }
            c.misses += 1;
        }
        // Tokenized outside the lock: other requests go on meanwhile.
        let ids = encode_plain(tok, piece)?;
        out.extend_from_slice(&ids);
        let mut c = lock(&self.cache);
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

    pub fn stats(&self) -> CacheStats {
        let c = lock(&self.cache);
        CacheStats { entries: c.map.len(), bytes: c.bytes, hits: c.hits, misses: c.misses }
    }

    /// Encodes a text with added tokens in it both ways; they must agree.
    fn probe(&self, tok: &Tokenizer) -> Result<(), String> {
        let mut added: Vec<String> = tok.get_added_tokens_decoder().into_values().map(|t| t.content).collect();
        added.sort();
        let mut text = String::from("  Hello,\u{00e9}  world!\n");
        for (i, a) in added.iter().take(8).enumerate() {
            text.push_str(a);
            text.push_str(["x", " y", "\n\n z", "  ", "1234", "ünïcödé", "\t", ""][i % 8]);
        }
        text.push_str(" the end ");
        let segmented = self.encode(tok, &text)?;
        let whole = encode_plain(tok, &text)?;
        let mut c = lock(&self.cache);
        c.map.clear();
        (c.bytes, c.hits, c.misses) = (0, 0, 0);
        if segmented == whole {
            Ok(())
        } else {
            Err("a probe text tokenizes differently in pieces than whole".into())
        }
    }
}

fn lock(c: &Mutex<Cache>) -> std::sync::MutexGuard<'_, Cache> {
    c.lock().unwrap_or_else(|p| p.into_inner())
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
