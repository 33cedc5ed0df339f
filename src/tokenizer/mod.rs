//! Tokenizers: the [`Tokenizer`] trait, GPT-2-style byte-level BPE from GGUF metadata
//! ([`bpe`]), BERT WordPiece from a HF `tokenizer.json` ([`wordpiece`]), hand-written
//! pre-tokenizers ([`pretok`]), Unicode character classes ([`unicode`]) and chat templates
//! ([`chat`]). The shared piece here is [`SpecialMatcher`], which finds special tokens
//! written literally in the input before the normal pipeline runs.

pub mod bpe;
pub mod chat;
pub mod pretok;
pub mod unicode;
pub mod wordpiece;

pub use bpe::BpeTokenizer;
pub use chat::{ChatMessage, ChatTemplate};
pub use pretok::PreTokenizer;
pub use wordpiece::{BatchEncoding, WordPieceTokenizer};

use crate::Result;
use std::collections::HashMap;

/// What every tokenizer offers.
pub trait Tokenizer: Send + Sync {
    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`, `[SEP]`) are
    /// recognized; `add_special` adds what the model adds around a sequence (BOS, or
    /// [CLS] ... [SEP]).
    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>>;
    /// The text of `ids`; an error for an id outside the vocabulary.
    fn decode(&self, ids: &[u32]) -> Result<String>;
    /// The vocabulary entry of `id` as stored ("Ġthe", "##ing", "<|im_end|>").
    fn token_to_piece(&self, id: u32) -> Result<&str>;
    /// The id of a vocabulary entry.
    fn token_id(&self, piece: &str) -> Option<u32>;
    fn vocab_size(&self) -> usize;
    fn bos(&self) -> Option<u32>;
    fn eos(&self) -> Option<u32>;
}

/// One piece of input after special-token splitting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Segment<'a> {
    Text(&'a str),
    Special(u32),
}

/// Finds special tokens in text, leftmost first and longest at a position (the rule HF
/// tokenizers' added-token matching and llama.cpp's special-token partition follow).
#[derive(Clone, Debug, Default)]
pub struct SpecialMatcher {
    /// By first byte: (content, id), longest first.
    by_first: HashMap<u8, Vec<(String, u32)>>,
}

impl SpecialMatcher {
    pub fn new(tokens: impl IntoIterator<Item = (String, u32)>) -> SpecialMatcher {
        let mut by_first: HashMap<u8, Vec<(String, u32)>> = HashMap::new();
        for (s, id) in tokens {
            if let Some(&b) = s.as_bytes().first() {
                by_first.entry(b).or_default().push((s, id));
            }
        }
        for v in by_first.values_mut() {
            v.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
            v.dedup_by(|a, b| a.0 == b.0);
        }
        SpecialMatcher { by_first }
    }

    pub fn is_empty(&self) -> bool {
        self.by_first.is_empty()
    }

    /// Splits `text` into text and special-token segments (no empty text segments).
    pub fn split<'a>(&self, text: &'a str) -> Vec<Segment<'a>> {
        let mut out = Vec::new();
        if self.is_empty() {
            if !text.is_empty() {
                out.push(Segment::Text(text));
            }
            return out;
        }
        let bytes = text.as_bytes();
        let (mut start, mut i) = (0, 0);
        while i < bytes.len() {
            let hit = self.by_first.get(&bytes[i]).and_then(|cands| {
                cands
                    .iter()
                    .find(|(s, _)| bytes[i..].starts_with(s.as_bytes()))
            });
            match hit {
                Some((s, id)) => {
                    if start < i {
                        out.push(Segment::Text(&text[start..i]));
                    }
                    out.push(Segment::Special(*id));
                    i += s.len();
                    start = i;
                }
                None => i += 1,
            }
        }
        if start < text.len() {
            out.push(Segment::Text(&text[start..]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_matcher_prefers_leftmost_then_longest() {
        let m = SpecialMatcher::new([
            ("<a>".to_string(), 1),
            ("<a><b>".to_string(), 2),
            ("b>".to_string(), 3),
        ]);
        assert_eq!(
            m.split("x<a><b>y<a>b>"),
            vec![
                Segment::Text("x"),
                Segment::Special(2),
                Segment::Text("y"),
                Segment::Special(1),
                Segment::Special(3),
            ]
        );
        assert_eq!(m.split(""), vec![]);
        assert_eq!(m.split("é<a"), vec![Segment::Text("é<a")]);
    }
}
