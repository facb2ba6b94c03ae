//! The fleet's deterministic tokenizer, shared by the mock engine and the load generator
//! (which sends the token ids ahead, as a tokenizer stage in front of Envoy would).
//!
//! Whitespace-separated words; a word `t<N>` is token N (so generated text, written as
//! such words, tokenizes back to the same ids and a chat's next turn reuses them), any
//! other word hashes into the range real vocabularies use.

use xxhash_rust::xxh3::xxh3_64;

const VOCAB_START: u32 = 1000;
const VOCAB: u64 = 150_000;

pub fn tokenize(text: &str) -> Vec<u32> {
    text.split_whitespace().map(word_token).collect()
}

fn word_token(w: &str) -> u32 {
    if let Some(n) = w.strip_prefix('t').and_then(|d| d.parse::<u32>().ok()) {
        return n;
    }
    VOCAB_START + (xxh3_64(w.as_bytes()) % VOCAB) as u32
}

/// Text that tokenizes back to `ids`: ` t12 t34 …` (a leading space, as a continuation).
pub fn detokenize(ids: &[u32]) -> String {
    let mut s = String::with_capacity(ids.len() * 7);
    for id in ids {
        s.push_str(" t");
        s.push_str(&id.to_string());
    }
    s
}

/// A chat's messages as one prompt text (`role: content` per message, then the assistant
/// turn), tokenized.
pub fn chat_prompt(messages: &[(String, String)]) -> Vec<u32> {
    let mut text = String::new();
    for (role, content) in messages {
        text.push_str(role);
        text.push_str(": ");
        text.push_str(content);
        text.push('\n');
    }
    text.push_str("assistant:");
    tokenize(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_text_round_trips() {
        let ids = vec![5, 1234, 99_999];
        assert_eq!(tokenize(&detokenize(&ids)), ids);
        let prompt = format!("Hello world{}", detokenize(&ids));
        let t = tokenize(&prompt);
        assert_eq!(&t[2..], &ids[..]);
        assert_eq!(t[0], tokenize("Hello")[0]);
        assert!(t[0] >= VOCAB_START);
    }
}
