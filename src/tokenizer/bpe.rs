//! GPT-2-style byte-level BPE built from GGUF metadata (`tokenizer.ggml.model` = "gpt2").
//!
//! Pipeline (GPT-2's `encoder.py`, HF tokenizers' ByteLevel + BPE, llama.cpp's
//! `llm_tokenizer_bpe`): split out special tokens written in the text (control tokens only
//! where the caller allows: not in the user's text of a chat prompt), pre-tokenize each
//! text piece into words ([`PreTokenizer`]), map each word's UTF-8 bytes to GPT-2's printable
//! byte chars, then merge adjacent symbols by merge rank (lowest first, leftmost on ties)
//! until no ranked pair is left. Merges are `tokenizer.ggml.merges` strings "a b" whose rank
//! is their index. Token types (`tokenizer.ggml.token_type`) follow llama.cpp's
//! `llama_token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.

use super::pretok::{PreTokenizer, byte_to_char_table, char_to_byte_table};
use super::{GgufVocab, Piece, Specials, TOKEN_TYPE_UNKNOWN, Tokenizer};
pub use super::{TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED};
use crate::io::GgufFile;
use crate::{Error, Result};
use parking_lot::Mutex;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Words cached before the cache is cleared (bounds memory on long inputs).
const CACHE_LIMIT: usize = 65_536;

/// A multiplicative hasher for the u64 merge keys (two u32 ids); SipHash costs more than the
/// merge itself.
#[derive(Default)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type PairMap = HashMap<u64, (u32, u32), BuildHasherDefault<PairHasher>>;

fn pair_key(a: u32, b: u32) -> u64 {
    ((a as u64) << 32) | b as u64
}

/// Everything a BPE vocabulary is made of, independent of where it was read.
#[derive(Clone, Debug)]
pub struct BpeVocab {
    /// Tokens, types, special ids and add-BOS/EOS.
    pub vocab: GgufVocab,
    /// "left right" strings, rank = index.
    pub merges: Vec<String>,
    pub pre: PreTokenizer,
}

pub struct BpeTokenizer {
    vocab: GgufVocab,
    ids: HashMap<String, u32>,
    merges: PairMap,
    /// Token id of each single byte's char, when the vocabulary has it.
    byte_ids: [Option<u32>; 256],
    char_to_byte: [i16; 324],
    /// Control, unknown and user-defined tokens.
    specials: Specials,
    pre: PreTokenizer,
    eog: Vec<u32>,
    cache: Mutex<HashMap<String, Vec<u32>>>,
}

impl std::fmt::Debug for BpeTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BpeTokenizer")
            .field("source", &self.vocab.source)
            .field("vocab", &self.vocab.tokens.len())
            .field("merges", &self.merges.len())
            .field("pre", &self.pre)
            .finish()
    }
}

/// A symbol of a word being merged: a token id in a doubly linked list.
#[derive(Clone, Copy)]
struct Sym {
    id: u32,
    prev: u32,
    next: u32,
}

const NONE: u32 = u32::MAX;

impl BpeTokenizer {
    /// Reads `tokenizer.ggml.*` from a GGUF file. Errors name the file and the key.
    pub fn from_gguf(g: &GgufFile) -> Result<BpeTokenizer> {
        let fmt = |field: &str, reason: String| Error::format(g.path(), field, reason);
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(fmt(
                "metadata key 'tokenizer.ggml.model' value",
                format!(
                    "tokenizer model '{model}' is not byte-level BPE ('gpt2'); \
                     GgufTokenizer::from_gguf reads every supported model"
                ),
            ));
        }
        let pre = match g.opt_str("tokenizer.ggml.pre")? {
            Some(p) => PreTokenizer::from_gguf_pre(p).ok_or_else(|| {
                fmt(
                    "metadata key 'tokenizer.ggml.pre' value",
                    format!(
                        "pre-tokenizer '{p}' is not supported (supported: {})",
                        PreTokenizer::SUPPORTED
                    ),
                )
            })?,
            None => {
                tracing::warn!(
                    "{}: no tokenizer.ggml.pre; using the GPT-2 pattern",
                    g.path().display()
                );
                PreTokenizer::Gpt2
            }
        };
        BpeTokenizer::new(BpeVocab {
            // llama.cpp's BPE defaults: no special ids, no BOS added unless the file says so.
            vocab: GgufVocab::from_gguf(g, (None, None, None, false))?,
            merges: g.get_str_array("tokenizer.ggml.merges")?.to_vec(),
            pre,
        })
    }

    /// Builds the tokenizer and checks the vocabulary: ids in range, token types one per
    /// token, every merge "a b" naming two tokens whose concatenation is a token.
    pub fn new(v: BpeVocab) -> Result<BpeTokenizer> {
        v.vocab.check()?;
        let fmt = |key: &str, reason: String| {
            Error::format(
                &v.vocab.source,
                format!("metadata key 'tokenizer.ggml.{key}'"),
                reason,
            )
        };
        let ids = v.vocab.ids();
        let mut merges = PairMap::with_capacity_and_hasher(v.merges.len(), Default::default());
        for (rank, m) in v.merges.iter().enumerate() {
            let bad = |why: &str| fmt("merges", format!("element {rank} {m:?}: {why}"));
            let (a, b) = m
                .split_once(' ')
                .ok_or_else(|| bad("expected two tokens separated by a space"))?;
            let ia = *ids
                .get(a)
                .ok_or_else(|| bad(&format!("{a:?} is not a token")))?;
            let ib = *ids
                .get(b)
                .ok_or_else(|| bad(&format!("{b:?} is not a token")))?;
            let joined = format!("{a}{b}");
            let ij = *ids
                .get(&joined)
                .ok_or_else(|| bad(&format!("the merged {joined:?} is not a token")))?;
            // The first (lowest) rank of a pair wins.
            merges.entry(pair_key(ia, ib)).or_insert((rank as u32, ij));
        }
        let table = byte_to_char_table();
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = ids.get(table[b].to_string().as_str()).copied();
        }
        Ok(BpeTokenizer {
            specials: v.vocab.specials(),
            eog: v.vocab.eog(),
            vocab: v.vocab,
            ids,
            merges,
            byte_ids,
            char_to_byte: char_to_byte_table(),
            pre: v.pre,
            cache: Mutex::new(HashMap::new()),
        })
    }

    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }

    pub fn pad(&self) -> Option<u32> {
        self.vocab.pad
    }

    pub fn unk(&self) -> Option<u32> {
        self.vocab.unk
    }

    /// Whether BOS/EOS are added by `encode(.., add_special = true)`.
    pub fn adds_bos_eos(&self) -> (bool, bool) {
        (self.vocab.add_bos, self.vocab.add_eos)
    }

    pub fn token_type(&self, id: u32) -> i32 {
        self.vocab.token_type(id)
    }

    /// Control tokens (`<|im_end|>`, ...).
    pub fn is_control(&self, id: u32) -> bool {
        self.token_type(id) == TOKEN_TYPE_CONTROL
    }

    /// EOS and the tokens that end a turn (`<|im_end|>`, `<|eot_id|>`, ...).
    pub fn eog(&self) -> &[u32] {
        &self.eog
    }

    /// Encodes with an explicit choice: `parse_special` recognizes control tokens written
    /// in the text (user-defined tokens are always recognized).
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

    /// Encodes `text` recognizing control tokens only outside the `literal` byte ranges
    /// (sorted, disjoint, on character boundaries): a chat prompt's markup gives control
    /// tokens while the user's text in it stays text, so `<|im_end|>` typed by a user cannot
    /// close a turn. User-defined tokens are recognized everywhere. Text on both sides of a
    /// range boundary is pre-tokenized as one piece, so without control tokens in the literal
    /// ranges the ids are those of [`Tokenizer::encode`].
    pub fn encode_with_literals(
        &self,
        text: &str,
        add_special: bool,
        literal: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>> {
        let pieces = self.specials.pieces(text, literal)?;
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.vocab.add_bos {
            out.extend(self.vocab.bos);
        }
        let mut words = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Special(id) => out.push(id),
                Piece::Text(r) => {
                    words.clear();
                    self.pre.split(&text[r], &mut words);
                    for w in &words {
                        self.encode_word(w, &mut out)?;
                    }
                }
            }
        }
        if add_special && self.vocab.add_eos {
            out.extend(self.vocab.eos);
        }
        Ok(out)
    }

    fn encode_word(&self, word: &str, out: &mut Vec<u32>) -> Result<()> {
        if let Some(ids) = self.cache.lock().get(word) {
            out.extend_from_slice(ids);
            return Ok(());
        }
        let ids = self.bpe(word)?;
        out.extend_from_slice(&ids);
        let mut cache = self.cache.lock();
        if cache.len() >= CACHE_LIMIT {
            cache.clear();
        }
        cache.insert(word.to_owned(), ids);
        Ok(())
    }

    /// BPE of one word: a linked list of symbols and a min-heap of (rank, position) of the
    /// ranked adjacent pairs; stale heap entries are skipped when popped.
    fn bpe(&self, word: &str) -> Result<Vec<u32>> {
        let mut syms: Vec<Sym> = Vec::with_capacity(word.len());
        for (i, b) in word.bytes().enumerate() {
            let id = self.byte_ids[b as usize]
                .or(self.vocab.unk)
                .ok_or_else(|| Error::Model {
                    model: self.vocab.source.display().to_string(),
                    reason: format!(
                        "byte {b:#04x} has no token and the vocabulary has no unknown token"
                    ),
                })?;
            let prev = if i == 0 { NONE } else { i as u32 - 1 };
            syms.push(Sym {
                id,
                prev,
                next: i as u32 + 1,
            });
        }
        if let Some(last) = syms.last_mut() {
            last.next = NONE;
        }
        let mut heap = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<_>, syms: &[Sym], pos: u32| {
            let s = syms[pos as usize];
            if s.next == NONE {
                return;
            }
            let right = syms[s.next as usize].id;
            if let Some(&(rank, _)) = self.merges.get(&pair_key(s.id, right)) {
                heap.push(std::cmp::Reverse((rank, pos, s.id, right)));
            }
        };
        for pos in 0..syms.len() as u32 {
            push(&mut heap, &syms, pos);
        }
        let mut dead = vec![false; syms.len()];
        while let Some(std::cmp::Reverse((_, pos, left, right))) = heap.pop() {
            let s = syms[pos as usize];
            if dead[pos as usize] || s.id != left || s.next == NONE {
                continue;
            }
            let r = s.next as usize;
            if syms[r].id != right {
                continue;
            }
            let (_, merged) = self.merges[&pair_key(left, right)];
            // Merge the right symbol into the left one.
            let after = syms[r].next;
            syms[pos as usize].id = merged;
            syms[pos as usize].next = after;
            if after != NONE {
                syms[after as usize].prev = pos;
            }
            dead[r] = true;
            if s.prev != NONE {
                push(&mut heap, &syms, s.prev);
            }
            push(&mut heap, &syms, pos);
        }
        let mut ids = Vec::new();
        let mut at = if syms.is_empty() { NONE } else { 0 };
        while at != NONE {
            ids.push(syms[at as usize].id);
            at = syms[at as usize].next;
        }
        Ok(ids)
    }

    fn check_id(&self, id: u32) -> Result<&str> {
        check_id(&self.vocab, id)
    }

    /// The bytes token `id` contributes to decoded text: control and user-defined tokens
    /// as written, normal tokens through the inverse byte map (chars outside it as UTF-8).
    pub fn token_bytes(&self, id: u32, out: &mut Vec<u8>) -> Result<()> {
        let piece = self.check_id(id)?;
        let ty = self.token_type(id);
        if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED || ty == TOKEN_TYPE_UNKNOWN {
            out.extend_from_slice(piece.as_bytes());
            return Ok(());
        }
        for c in piece.chars() {
            match self.char_to_byte.get(c as usize) {
                Some(&b) if b >= 0 => out.push(b as u8),
                _ => {
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
        Ok(())
    }

    /// Decoded bytes of `ids` (may end inside a UTF-8 sequence; for streaming output).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for &id in ids {
            self.token_bytes(id, &mut out)?;
        }
        Ok(out)
    }
}

impl Tokenizer for BpeTokenizer {
    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.encode_with(text, add_special, true)
    }

    /// Invalid UTF-8 (ids that cut a character) decodes to U+FFFD, as HF tokenizers does.
    fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    fn token_to_piece(&self, id: u32) -> Result<&str> {
        self.check_id(id)
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

/// The stored text of token `id`, or an error naming the vocabulary's source.
pub(crate) fn check_id(v: &GgufVocab, id: u32) -> Result<&str> {
    v.tokens
        .get(id as usize)
        .map(String::as_str)
        .ok_or_else(|| Error::Model {
            model: v.source.display().to_string(),
            reason: format!(
                "token id {id} is outside the vocabulary of {}",
                v.tokens.len()
            ),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny vocabulary: all 256 byte chars plus a few merges.
    fn tiny() -> BpeTokenizer {
        let table = byte_to_char_table();
        let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
        for t in ["ab", "abc", "Ġa", "aa", "<|x|>"] {
            tokens.push(t.to_string());
        }
        let mut types = vec![TOKEN_TYPE_NORMAL; tokens.len()];
        *types.last_mut().unwrap() = TOKEN_TYPE_CONTROL;
        BpeTokenizer::new(BpeVocab {
            vocab: GgufVocab {
                source: "tiny".into(),
                tokens,
                token_types: types,
                bos: None,
                eos: None,
                unk: None,
                pad: None,
                add_bos: false,
                add_eos: false,
            },
            merges: ["a b", "ab c", "Ġ a", "a a"].map(String::from).to_vec(),
            pre: PreTokenizer::Gpt2,
        })
        .unwrap()
    }

    #[test]
    fn merges_follow_rank_then_position() {
        let t = tiny();
        let id = |s: &str| t.token_id(s).unwrap();
        assert_eq!(t.encode("abc", false).unwrap(), vec![id("abc")]);
        // "aaa": one "a a" merge at the leftmost position, then "a".
        assert_eq!(t.encode("aaa", false).unwrap(), vec![id("aa"), id("a")]);
        // "a b" (rank 0) beats "Ġ a" (rank 2); in " aa", "Ġ a" (2) beats "a a" (3).
        assert_eq!(t.encode(" ab", false).unwrap(), vec![id("Ġ"), id("ab")]);
        assert_eq!(t.encode(" aa", false).unwrap(), vec![id("Ġa"), id("a")]);
        assert_eq!(
            t.encode("a<|x|>a", false).unwrap(),
            vec![id("a"), id("<|x|>"), id("a")]
        );
        assert_eq!(t.encode_with("<|x|>", false, false).unwrap().len(), 5);
        assert_eq!(
            t.decode(&t.encode("héllo <|x|> wörld", false).unwrap())
                .unwrap(),
            "héllo <|x|> wörld"
        );
        assert!(t.decode(&[9999]).is_err());
    }
}
