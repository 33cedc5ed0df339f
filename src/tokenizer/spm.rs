//! The SentencePiece-style vocabulary GGUF calls `llama` (`tokenizer.ggml.model` = "llama"),
//! as Gemma, Llama 2, Mistral and Phi-3 files carry it, encoded and decoded as llama.cpp does
//! (`llm_tokenizer_spm_session` and `llama_vocab::impl::tokenize` / `token_to_piece` in
//! `src/llama-vocab.cpp`).
//!
//! Vocabulary: tokens with scores (`tokenizer.ggml.scores`) and token types; byte tokens
//! `<0x00>`..`<0xFF>` (type 6); spaces written as U+2581 ("▁"). Keys and defaults: BOS 1, EOS 2,
//! UNK 0 unless the file names them; `add_bos_token` (default true), `add_eos_token` (default
//! false), `add_space_prefix` (default true).
//!
//! Encoding: special tokens are split out first (control and unknown tokens only where the
//! caller allows, user-defined tokens everywhere). Each text piece gets a leading space when
//! `add_space_prefix` and it starts the input or follows a special token; its spaces become
//! "▁"; then its characters are merged pairwise, always the adjacent pair whose concatenation
//! is the token with the highest score (the leftmost on ties), until no adjacent pair forms a
//! token. A final symbol that is not a token is written as its bytes' `<0xXX>` tokens (byte
//! fallback), or the unknown token where the vocabulary has no byte tokens.
//!
//! Decoding: normal tokens with "▁" turned back into spaces, byte tokens as their byte,
//! control, unknown and user-defined tokens as written, unused tokens as nothing; with
//! `add_space_prefix`, the first token loses one leading space.

use super::bpe::check_id;
use super::{
    GgufVocab, Piece, Specials, TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED, Tokenizer,
};
use crate::io::GgufFile;
use crate::{Error, Result};
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// SentencePiece's space marker, U+2581.
pub const SPACE_MARKER: char = '\u{2581}';

pub struct SpmTokenizer {
    vocab: GgufVocab,
    scores: Vec<f32>,
    ids: HashMap<String, u32>,
    /// The `<0xXX>` token of each byte, when the vocabulary has it.
    byte_ids: [Option<u32>; 256],
    specials: Specials,
    add_space_prefix: bool,
    eog: Vec<u32>,
}

impl std::fmt::Debug for SpmTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpmTokenizer")
            .field("source", &self.vocab.source)
            .field("vocab", &self.vocab.tokens.len())
            .field("add_space_prefix", &self.add_space_prefix)
            .finish()
    }
}

/// A candidate merge: the adjacent symbols `left` and `right` form a token of `score`.
#[derive(Clone, Copy)]
struct Bigram {
    score: f32,
    left: u32,
    right: u32,
    /// Bytes of the merged text, to see whether the entry is stale when popped.
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    /// The heap's top is the highest score, then the leftmost position (llama.cpp's
    /// `llm_bigram_spm::comparator`).
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
    }
}

/// A symbol being merged: a byte range of the text in a doubly linked list (`len` 0: merged
/// into its left neighbour).
#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    len: usize,
    prev: u32,
    next: u32,
}

const NONE: u32 = u32::MAX;

impl SpmTokenizer {
    /// Reads `tokenizer.ggml.*` from a GGUF file whose model is "llama". Errors name the file
    /// and the key.
    pub fn from_gguf(g: &GgufFile) -> Result<SpmTokenizer> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "llama" {
            return Err(Error::format(
                g.path(),
                "metadata key 'tokenizer.ggml.model' value",
                format!("tokenizer model '{model}' is not SentencePiece-style ('llama')"),
            ));
        }
        // llama.cpp's defaults for this model: BOS 1, EOS 2, UNK 0, BOS added.
        let vocab = GgufVocab::from_gguf(g, (Some(1), Some(2), Some(0), true))?;
        let scores = match g.opt_f32_array("tokenizer.ggml.scores")? {
            Some(s) => s.to_vec(),
            None => vec![0.0; vocab.tokens.len()],
        };
        let add_space_prefix = g
            .opt_bool("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(true);
        SpmTokenizer::new(vocab, scores, add_space_prefix)
    }

    /// Builds the tokenizer; `scores` has one entry per token.
    pub fn new(vocab: GgufVocab, scores: Vec<f32>, add_space_prefix: bool) -> Result<SpmTokenizer> {
        vocab.check()?;
        if scores.len() != vocab.tokens.len() {
            return Err(Error::format(
                &vocab.source,
                "metadata key 'tokenizer.ggml.scores'",
                format!("{} scores for {} tokens", scores.len(), vocab.tokens.len()),
            ));
        }
        let ids = vocab.ids();
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = ids.get(format!("<0x{b:02X}>").as_str()).copied();
        }
        Ok(SpmTokenizer {
            specials: vocab.specials(),
            eog: vocab.eog(),
            vocab,
            scores,
            ids,
            byte_ids,
            add_space_prefix,
        })
    }

    pub fn token_type(&self, id: u32) -> i32 {
        self.vocab.token_type(id)
    }

    /// Whether a leading space is added to text that starts the input or follows a special
    /// token.
    pub fn adds_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// Whether BOS/EOS are added by `encode(.., add_special = true)`.
    pub fn adds_bos_eos(&self) -> (bool, bool) {
        (self.vocab.add_bos, self.vocab.add_eos)
    }

    /// EOS and the tokens that end a turn (`<end_of_turn>`, ...).
    pub fn eog(&self) -> &[u32] {
        &self.eog
    }

    /// Encodes `text` recognizing control tokens only outside the `literal` byte ranges (see
    /// [`crate::tokenizer::BpeTokenizer::encode_with_literals`]).
    pub fn encode_with_literals(
        &self,
        text: &str,
        add_special: bool,
        literal: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>> {
        let pieces = self.specials.pieces(text, literal)?;
        let mut out = Vec::with_capacity(text.len() / 2 + 2);
        if add_special && self.vocab.add_bos {
            out.extend(self.vocab.bos);
        }
        let mut prev_special = true;
        let mut buf = String::new();
        for piece in pieces {
            match piece {
                Piece::Special(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Piece::Text(r) => {
                    buf.clear();
                    if self.add_space_prefix && prev_special {
                        buf.push(SPACE_MARKER);
                    }
                    for c in text[r].chars() {
                        buf.push(if c == ' ' { SPACE_MARKER } else { c });
                    }
                    self.merge(&buf, &mut out)?;
                    prev_special = false;
                }
            }
        }
        if add_special && self.vocab.add_eos {
            out.extend(self.vocab.eos);
        }
        Ok(out)
    }

    /// Encodes with an explicit choice: `parse_special` recognizes control tokens written in
    /// the text (user-defined tokens are always recognized).
    pub fn encode_with(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>> {
        let whole = 0..text.len();
        let literal = if parse_special {
            &[]
        } else {
            std::slice::from_ref(&whole)
        };
        self.encode_with_literals(text, add_special, literal)
    }

    /// The score-ordered pair merging of one escaped text piece (module docs).
    fn merge(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            syms.push(Sym {
                start,
                len: c.len_utf8(),
                prev: if i == 0 { NONE } else { i as u32 - 1 },
                next: i as u32 + 1,
            });
        }
        let Some(last) = syms.last_mut() else {
            return Ok(());
        };
        last.next = NONE;
        let mut heap = BinaryHeap::new();
        let try_add = |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], left: u32, right: u32| {
            if left == NONE || right == NONE {
                return;
            }
            let (l, r) = (syms[left as usize], syms[right as usize]);
            let merged = &text[l.start..r.start + r.len];
            if let Some(&id) = self.ids.get(merged) {
                heap.push(Bigram {
                    score: self.scores[id as usize],
                    left,
                    right,
                    size: merged.len(),
                });
            }
        };
        for i in 1..syms.len() as u32 {
            try_add(&mut heap, &syms, i - 1, i);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (syms[b.left as usize], syms[b.right as usize]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                continue;
            }
            // Merge the right symbol into the left one.
            syms[b.left as usize].len += r.len;
            syms[b.left as usize].next = r.next;
            syms[b.right as usize].len = 0;
            if r.next != NONE {
                syms[r.next as usize].prev = b.left;
            }
            try_add(&mut heap, &syms, l.prev, b.left);
            try_add(&mut heap, &syms, b.left, r.next);
        }
        let mut at = 0;
        while at != NONE {
            let s = syms[at as usize];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for b in piece.bytes() {
                        let id = self.byte_ids[b as usize]
                            .or(self.vocab.unk)
                            .ok_or_else(|| Error::Model {
                                model: self.vocab.source.display().to_string(),
                                reason: format!(
                                    "byte {b:#04x} has no <0x{b:02X}> token and the vocabulary \
                                     has no unknown token"
                                ),
                            })?;
                        out.push(id);
                    }
                }
            }
            at = s.next;
        }
        Ok(())
    }

    /// The bytes token `id` contributes to decoded text (module docs; no space stripping).
    pub fn token_bytes(&self, id: u32, out: &mut Vec<u8>) -> Result<()> {
        let piece = check_id(&self.vocab, id)?;
        match self.token_type(id) {
            TOKEN_TYPE_NORMAL => {
                for c in piece.chars() {
                    let c = if c == SPACE_MARKER { ' ' } else { c };
                    let mut b = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
                }
            }
            TOKEN_TYPE_BYTE => match parse_byte_token(piece) {
                Some(b) => out.push(b),
                None => out.extend_from_slice(piece.as_bytes()),
            },
            TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN | TOKEN_TYPE_USER_DEFINED => {
                out.extend_from_slice(piece.as_bytes())
            }
            _ => {}
        }
        Ok(())
    }

    /// Decoded bytes of `ids` (may end inside a UTF-8 sequence); with `add_space_prefix` the
    /// first token loses one leading space, as llama.cpp's `detokenize` does.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let at = out.len();
            self.token_bytes(id, &mut out)?;
            if i == 0 && self.add_space_prefix && out.get(at) == Some(&b' ') {
                out.remove(at);
            }
        }
        Ok(out)
    }
}

/// The byte of a `<0xXX>` token.
fn parse_byte_token(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl Tokenizer for SpmTokenizer {
    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.encode_with(text, add_special, true)
    }

    /// Invalid UTF-8 (byte tokens that cut a character) decodes to U+FFFD.
    fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    fn token_to_piece(&self, id: u32) -> Result<&str> {
        check_id(&self.vocab, id)
    }

    fn token_id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece).copied()
    }

    fn vocab_size(&self) -> usize {
        self.vocab.tokens.len()
    }

    fn bos(&self) -> Option<u32> {
        self.vocab.bos
    }

    fn eos(&self) -> Option<u32> {
        self.vocab.eos
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes, a few pieces with scores, one control and one user-defined token.
    fn tiny(add_space_prefix: bool) -> SpmTokenizer {
        let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
        let mut types = vec![TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL];
        let mut scores = vec![0.0; 3];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(TOKEN_TYPE_BYTE);
            scores.push(0.0);
        }
        for (t, s) in [
            ("▁", -1.0),
            ("a", -2.0),
            ("b", -3.0),
            ("▁a", -4.0),
            ("ab", -5.0),
            ("▁ab", -6.0),
            ("bb", -0.5),
        ] {
            tokens.push(t.into());
            types.push(TOKEN_TYPE_NORMAL);
            scores.push(s);
        }
        tokens.push("<x>".into());
        types.push(TOKEN_TYPE_USER_DEFINED);
        scores.push(0.0);
        let vocab = GgufVocab {
            source: "tiny".into(),
            tokens,
            token_types: types,
            bos: Some(1),
            eos: Some(2),
            unk: Some(0),
            pad: None,
            add_bos: true,
            add_eos: false,
        };
        SpmTokenizer::new(vocab, scores, add_space_prefix).unwrap()
    }

    #[test]
    fn merges_by_score_with_byte_fallback() {
        let t = tiny(true);
        let id = |s: &str| t.token_id(s).unwrap();
        // "▁a" (-4) beats "ab" (-5): "▁ab" then forms from "▁a" + "b".
        assert_eq!(t.encode("ab", true).unwrap(), [1, id("▁ab")]);
        // "bb" (-0.5) is merged first.
        assert_eq!(t.encode("abb", false).unwrap(), [id("▁a"), id("bb")]);
        // "é" is not a token: its two UTF-8 bytes.
        assert_eq!(
            t.encode("é", false).unwrap(),
            [id("▁"), id("<0xC3>"), id("<0xA9>")]
        );
        // Special tokens split the text; a space prefix follows each.
        assert_eq!(
            t.encode("a<s>a<x>a", false).unwrap(),
            [id("▁a"), 1, id("▁a"), id("<x>"), id("▁a")]
        );
        assert_eq!(t.encode_with("<s>", false, false).unwrap().len(), 4);
        for s in ["ab é  b", " a"] {
            let ids = t.encode(s, false).unwrap();
            assert_eq!(t.decode(&ids).unwrap(), s, "{ids:?}");
        }
        let t = tiny(false);
        assert_eq!(t.encode("ab", false).unwrap(), [id("ab")]);
        let ids = t.encode("<x>a b<s>", false).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), "<x>a b<s>");
    }
}
