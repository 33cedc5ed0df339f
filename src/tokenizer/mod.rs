//! Tokenizers: the [`Tokenizer`] trait, the tokenizer a GGUF decoder names
//! ([`GgufTokenizer`]: GPT-2-style byte-level BPE ([`bpe`]) or the SentencePiece-style
//! vocabulary GGUF calls `llama` ([`spm`])), BERT WordPiece from a HF `tokenizer.json`
//! ([`wordpiece`]), hand-written pre-tokenizers ([`pretok`]), Unicode character classes
//! ([`unicode`]) and chat templates rendered by a Jinja engine ([`chat`]). The shared pieces
//! here are [`SpecialMatcher`], which finds special tokens written literally in the input
//! before the normal pipeline runs, [`Specials`], which splits a prompt into text and special
//! tokens keeping the user's text literal, and [`GgufVocab`], the keys every GGUF vocabulary has.

pub mod bpe;
pub mod chat;
pub mod gguf;
pub mod pretok;
pub mod spm;
pub mod unicode;
pub mod wordpiece;

pub use bpe::BpeTokenizer;
pub use chat::{ChatMessage, ChatTemplate};
pub use gguf::GgufTokenizer;
pub use pretok::PreTokenizer;
pub use spm::SpmTokenizer;
pub use wordpiece::{BatchEncoding, WordPieceTokenizer};

use crate::io::GgufFile;
use crate::{Error, Result};
use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;

/// Token types of `tokenizer.ggml.token_type`, llama.cpp's `llama_token_type`.
pub const TOKEN_TYPE_NORMAL: i32 = 1;
pub const TOKEN_TYPE_UNKNOWN: i32 = 2;
pub const TOKEN_TYPE_CONTROL: i32 = 3;
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;
pub const TOKEN_TYPE_UNUSED: i32 = 5;
pub const TOKEN_TYPE_BYTE: i32 = 6;

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

/// The keys every GGUF vocabulary has (`tokenizer.ggml.*`), read and checked: ids inside the
/// vocabulary, one token type per token, add-BOS/EOS as the file says or the model type's
/// default (llama.cpp `llama_vocab::impl::load`).
#[derive(Clone, Debug)]
pub struct GgufVocab {
    /// Names the source in messages (the GGUF path).
    pub source: PathBuf,
    pub tokens: Vec<String>,
    /// One per token; empty means all normal.
    pub token_types: Vec<i32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
}

impl GgufVocab {
    /// Reads the keys; `defaults` gives (BOS, EOS, UNK ids, add BOS) where the file has none.
    pub fn from_gguf(
        g: &GgufFile,
        defaults: (Option<u32>, Option<u32>, Option<u32>, bool),
    ) -> Result<GgufVocab> {
        let id = |key: &str, default: Option<u32>| -> Result<Option<u32>> {
            Ok(g.opt_u32(key)?.or(default))
        };
        let v = GgufVocab {
            source: g.path().to_path_buf(),
            tokens: g.get_str_array("tokenizer.ggml.tokens")?.to_vec(),
            token_types: g
                .opt_i32_array("tokenizer.ggml.token_type")?
                .unwrap_or_default(),
            bos: id("tokenizer.ggml.bos_token_id", defaults.0)?,
            eos: id("tokenizer.ggml.eos_token_id", defaults.1)?,
            unk: id("tokenizer.ggml.unknown_token_id", defaults.2)?,
            pad: id("tokenizer.ggml.padding_token_id", None)?,
            add_bos: g
                .opt_bool("tokenizer.ggml.add_bos_token")?
                .unwrap_or(defaults.3),
            add_eos: g.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false),
        };
        v.check()?;
        Ok(v)
    }

    fn err(&self, key: &str, reason: String) -> Error {
        Error::format(
            &self.source,
            format!("metadata key 'tokenizer.ggml.{key}'"),
            reason,
        )
    }

    /// Ids in range, one token type per token, a token for each added special.
    pub fn check(&self) -> Result<()> {
        let n = self.tokens.len();
        if n == 0 || n >= u32::MAX as usize {
            return Err(self.err("tokens", format!("vocabulary of {n} tokens")));
        }
        if !self.token_types.is_empty() && self.token_types.len() != n {
            return Err(self.err(
                "token_type",
                format!("{} token types for {n} tokens", self.token_types.len()),
            ));
        }
        for (name, id) in [
            ("bos", self.bos),
            ("eos", self.eos),
            ("unknown", self.unk),
            ("padding", self.pad),
        ] {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                return Err(self.err(
                    &format!("{name}_token_id"),
                    format!("id {id} is outside the vocabulary of {n} tokens"),
                ));
            }
        }
        for (key, add, id) in [
            ("bos", self.add_bos, self.bos),
            ("eos", self.add_eos, self.eos),
        ] {
            if add && id.is_none() {
                return Err(self.err(
                    &format!("add_{key}_token"),
                    format!("is true but the file has no {key}_token_id"),
                ));
            }
        }
        Ok(())
    }

    pub fn token_type(&self, id: u32) -> i32 {
        self.token_types
            .get(id as usize)
            .copied()
            .unwrap_or(TOKEN_TYPE_NORMAL)
    }

    /// Token ids by text; on duplicate strings the first id wins (llama.cpp's token_to_id).
    pub fn ids(&self) -> HashMap<String, u32> {
        let mut ids = HashMap::with_capacity(self.tokens.len());
        for (i, t) in self.tokens.iter().enumerate() {
            ids.entry(t.clone()).or_insert(i as u32);
        }
        ids
    }

    /// The special tokens llama.cpp partitions the input by: control and unknown tokens, and
    /// user-defined ones (`tokenizer_st_partition`).
    pub fn specials(&self) -> Specials {
        let pick = |want: &[i32]| {
            self.tokens
                .iter()
                .enumerate()
                .filter(|&(i, t)| want.contains(&self.token_type(i as u32)) && !t.is_empty())
                .map(|(i, t)| (t.clone(), i as u32))
                .collect::<Vec<_>>()
        };
        Specials {
            all: SpecialMatcher::new(pick(&[
                TOKEN_TYPE_CONTROL,
                TOKEN_TYPE_UNKNOWN,
                TOKEN_TYPE_USER_DEFINED,
            ])),
            user_defined: SpecialMatcher::new(pick(&[TOKEN_TYPE_USER_DEFINED])),
        }
    }

    /// The tokens that end a turn or the text: EOS and the tokens llama.cpp recognizes by
    /// text as end-of-generation (`special_eog_ids` in llama-vocab.cpp; not its "</s>", which
    /// is an ordinary HTML tag token in Gemma's vocabulary).
    pub fn eog(&self) -> Vec<u32> {
        const EOG: [&str; 9] = [
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "<|eom_id|>",
            "<EOT>",
            "<|end_of_text|>",
            "<end_of_utterance>",
        ];
        let mut out: Vec<u32> = self.eos.into_iter().collect();
        for (i, t) in self.tokens.iter().enumerate() {
            if EOG.contains(&t.as_str()) && !out.contains(&(i as u32)) {
                out.push(i as u32);
            }
        }
        out
    }
}

/// One piece of a prompt after special tokens are split out: a byte range of the text or a
/// special token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Text(Range<usize>),
    Special(u32),
}

/// The special tokens of a vocabulary: control (and unknown) tokens, recognized only outside
/// the user's literal text, and user-defined tokens, recognized everywhere (as llama.cpp does).
#[derive(Clone, Debug, Default)]
pub struct Specials {
    all: SpecialMatcher,
    user_defined: SpecialMatcher,
}

impl Specials {
    /// Splits `text` into pieces, recognizing control tokens only outside the `literal` byte
    /// ranges (sorted, disjoint, on character boundaries; an error otherwise). Adjacent text
    /// on both sides of a range boundary is one piece.
    pub fn pieces(&self, text: &str, literal: &[Range<usize>]) -> Result<Vec<Piece>> {
        let mut pos = 0;
        for r in literal {
            if r.start < pos
                || r.start > r.end
                || r.end > text.len()
                || !text.is_char_boundary(r.start)
                || !text.is_char_boundary(r.end)
            {
                return Err(Error::invalid_argument(
                    "literal range",
                    format!("{r:?}"),
                    format!(
                        "ranges must be sorted, disjoint and on character boundaries of the \
                         {}-byte text",
                        text.len()
                    ),
                ));
            }
            pos = r.end;
        }
        let mut pieces: Vec<Piece> = Vec::new();
        let base = text.as_ptr() as usize;
        let mut push = |part: Range<usize>, matcher: &SpecialMatcher| {
            for seg in matcher.split(&text[part]) {
                match seg {
                    Segment::Special(id) => pieces.push(Piece::Special(id)),
                    Segment::Text(t) => {
                        let start = t.as_ptr() as usize - base;
                        let r = start..start + t.len();
                        match pieces.last_mut() {
                            Some(Piece::Text(prev)) if prev.end == r.start => prev.end = r.end,
                            _ => pieces.push(Piece::Text(r)),
                        }
                    }
                }
            }
        };
        let mut pos = 0;
        for r in literal {
            push(pos..r.start, &self.all);
            push(r.clone(), &self.user_defined);
            pos = r.end;
        }
        push(pos..text.len(), &self.all);
        Ok(pieces)
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
