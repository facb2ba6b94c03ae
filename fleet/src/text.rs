//! Text for the simulated fleet, from a real tokenizer: its one-token words.
//!
//! The workloads are planned in token ids (a system prompt of N tokens, a question of M).
//! To send them as text, or to write an engine's answer as text, each id stands for one of
//! the tokenizer's words: a vocabulary entry that is a space and lower-case letters, and
//! that the tokenizer gives back as that one id when it encodes the word after a space.
//! A text of such words therefore tokenizes to exactly one id per word, so a workload's
//! token counts and shared prefixes survive the trip through text, a chat template and
//! the engine's tokenizer, as a model's own output does.

use kvroute_tokenizer::model::{Model, ModelSpec};
use std::collections::HashMap;
use std::path::Path;

/// The fewest words a tokenizer must have for the fleet to write text with it.
const MIN_WORDS: usize = 1000;

pub struct Words {
    /// Sorted by id: the n-th word is the same in every process that loads the tokenizer.
    ids: Vec<u32>,
    words: Vec<String>,
    /// Word (without its leading space) → id, to read an answer's text back as ids.
    by_word: HashMap<String, u32>,
}

impl Words {
    /// The words of the tokenizer in `dir` (a tokenizer directory, as the engines get).
    pub fn load(dir: &Path) -> Result<Words, String> {
        let spec = ModelSpec {
            name: dir.display().to_string(),
            path: dir.to_path_buf(),
            // Only the vocabulary is read.
            max_model_len: Some(1 << 20),
            loras: Vec::new(),
            chat_template: None,
            cache_bytes: 0,
        };
        Words::of(&Model::load(&spec).map_err(|e| format!("--tokenizer: {e}"))?)
    }

    /// The words of `model`'s tokenizer (byte-level `Ġword` or SentencePiece `▁word`).
    pub fn of(model: &Model) -> Result<Words, String> {
        let tok = model.tokenizer();
        let mut found: Vec<(u32, String)> = Vec::new();
        for (piece, id) in tok.get_vocab(false) {
            let Some(word) = piece.strip_prefix('Ġ').or_else(|| piece.strip_prefix('▁')) else { continue };
            if !(3..=12).contains(&word.len()) || !word.bytes().all(|b| b.is_ascii_lowercase()) {
                continue;
            }
            let text = format!(" {word}");
            match tok.encode_fast(text.as_str(), false) {
                Ok(e) if e.get_ids() == [id] => found.push((id, text)),
                _ => {}
            }
        }
        if found.len() < MIN_WORDS {
            return Err(format!(
                "model {}: its tokenizer has {} one-token words; the fleet needs {MIN_WORDS} to write text",
                model.name,
                found.len()
            ));
        }
        found.sort_unstable();
        let by_word = found.iter().map(|(id, w)| (w[1..].to_string(), *id)).collect();
        let (ids, words) = found.into_iter().unzip();
        Ok(Words { ids, words, by_word })
    }

    /// Every word's id, in the fixed order.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The token id of the word `n` names (any `n`: taken modulo the word count).
    pub fn id(&self, n: u64) -> u32 {
        self.ids[(n % self.ids.len() as u64) as usize]
    }

    /// A text with one word per planned id (` word word …`, a leading space): the same
    /// ids give the same text, so prompts that share planned ids share text.
    pub fn text(&self, planned: &[u32]) -> String {
        let mut s = String::with_capacity(planned.len() * 8);
        for &p in planned {
            s.push_str(&self.words[p as usize % self.words.len()]);
        }
        s
    }

    /// The ids of a text written in these words (` word word …`, as an engine's answer is),
    /// or `None` if any piece is not one of them. For routers that relay an answer's text
    /// without its ids (Dynamo's frontend): the next turn's ids are still known.
    pub fn read_back(&self, text: &str) -> Option<Vec<u32>> {
        let rest = text.strip_prefix(' ')?;
        rest.split(' ').map(|w| self.by_word.get(w).copied()).collect()
    }

    /// The ids the engine's tokenizer gives [`Words::text`] of `planned`.
    pub fn ids_of(&self, planned: &[u32]) -> Vec<u32> {
        planned.iter().map(|&p| self.ids[p as usize % self.ids.len()]).collect()
    }
}

/// The directory of the Qwen3 tokenizer `scripts/fetch-tokenizer.sh` fetches, for tests
/// (which fail, saying so, if it has not been fetched).
#[cfg(test)]
pub(crate) fn test_tokenizer_dir() -> std::path::PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/tokenizers/qwen3");
    assert!(dir.join("tokenizer.json").exists(), "{} missing: run scripts/fetch-tokenizer.sh", dir.display());
    dir
}

/// That tokenizer, loaded.
#[cfg(test)]
pub(crate) fn test_model() -> Model {
    Model::load(&ModelSpec {
        name: "qwen3".into(),
        path: test_tokenizer_dir(),
        max_model_len: Some(40960),
        loras: vec![],
        chat_template: None,
        cache_bytes: 0,
    })
    .expect("the Qwen3 tokenizer loads")
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_tokenizer::model::EncodeParams;

    #[test]
    fn a_text_of_words_tokenizes_to_one_id_per_word() {
        let model = test_model();
        let words = Words::of(&model).unwrap();
        assert!(words.len() > 10_000, "{}", words.len());
        let planned: Vec<u32> = (0..3000).map(|i| (i * 7919) % 40_000).collect();
        let text = words.text(&planned);
        let p = EncodeParams { add_special_tokens: true, ..Default::default() };
        assert_eq!(model.encode_text(&text, &p).unwrap(), words.ids_of(&planned));
        // After a chat template's "\n", and before its "<|im_end|>", too.
        let ids = model.encode_text(&format!("<|im_start|>user\n{text}<|im_end|>"), &p).unwrap();
        assert_eq!(&ids[3..ids.len() - 1], &words.ids_of(&planned)[..]);
        // Deterministic: the same words in the same order on every load.
        assert_eq!(Words::of(&model).unwrap().ids, words.ids);
        // An answer's text reads back as the ids it was written from; anything else as None.
        assert_eq!(words.read_back(&text), Some(words.ids_of(&planned)));
        assert_eq!(words.read_back(&format!("{text} Zebra")), None);
        assert_eq!(words.read_back("no leading space"), None);
    }
}
