//! [`GgufTokenizer`]: the tokenizer a GGUF decoder names in `tokenizer.ggml.model`, chosen at
//! load time: "gpt2" (byte-level BPE, [`BpeTokenizer`]) or "llama" (SentencePiece-style,
//! [`SpmTokenizer`]), as llama.cpp's `LLAMA_VOCAB_TYPE_BPE` / `LLAMA_VOCAB_TYPE_SPM`.

use super::{BpeTokenizer, SpmTokenizer, Tokenizer};
use crate::io::GgufFile;
use crate::{Error, Result};
use std::ops::Range;

/// A decoder's tokenizer, whichever model its file names (boxed: both are a few KB).
#[derive(Debug)]
pub enum GgufTokenizer {
    Bpe(Box<BpeTokenizer>),
    Spm(Box<SpmTokenizer>),
}

/// Calls the same method on whichever tokenizer is inside.
macro_rules! either {
    ($self:expr, $t:ident => $e:expr) => {
        match $self {
            GgufTokenizer::Bpe($t) => $e,
            GgufTokenizer::Spm($t) => $e,
        }
    };
}

impl GgufTokenizer {
    /// The tokenizer of a GGUF file; an unknown `tokenizer.ggml.model` is an error naming it.
    pub fn from_gguf(g: &GgufFile) -> Result<GgufTokenizer> {
        match g.get_str("tokenizer.ggml.model")? {
            "gpt2" => Ok(GgufTokenizer::Bpe(Box::new(BpeTokenizer::from_gguf(g)?))),
            "llama" => Ok(GgufTokenizer::Spm(Box::new(SpmTokenizer::from_gguf(g)?))),
            other => Err(Error::format(
                g.path(),
                "metadata key 'tokenizer.ggml.model' value",
                format!(
                    "tokenizer model '{other}' is not supported (supported: 'gpt2', byte-level \
                     BPE; 'llama', SentencePiece-style)"
                ),
            )),
        }
    }

    /// "gpt2" or "llama", as the file says.
    pub fn model(&self) -> &'static str {
        match self {
            GgufTokenizer::Bpe(_) => "gpt2",
            GgufTokenizer::Spm(_) => "llama",
        }
    }

    /// Encodes with an explicit choice: `parse_special` recognizes control tokens written in
    /// the text (user-defined tokens are always recognized).
    pub fn encode_with(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>> {
        either!(self, t => t.encode_with(text, add_special, parse_special))
    }

    /// Encodes recognizing control tokens only outside the `literal` byte ranges
    /// ([`BpeTokenizer::encode_with_literals`]).
    pub fn encode_with_literals(
        &self,
        text: &str,
        add_special: bool,
        literal: &[Range<usize>],
    ) -> Result<Vec<u32>> {
        either!(self, t => t.encode_with_literals(text, add_special, literal))
    }

    /// The bytes token `id` contributes to decoded text (for streaming output).
    pub fn token_bytes(&self, id: u32, out: &mut Vec<u8>) -> Result<()> {
        either!(self, t => t.token_bytes(id, out))
    }

    /// Decoded bytes of `ids` (may end inside a UTF-8 sequence).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        either!(self, t => t.decode_bytes(ids))
    }

    /// The token's `tokenizer.ggml.token_type` (1 normal, 3 control, ...).
    pub fn token_type(&self, id: u32) -> i32 {
        either!(self, t => t.token_type(id))
    }

    /// Control tokens (`<|im_end|>`, `<start_of_turn>`, ...).
    pub fn is_control(&self, id: u32) -> bool {
        self.token_type(id) == super::TOKEN_TYPE_CONTROL
    }

    /// EOS and the tokens that end a turn (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`).
    pub fn eog(&self) -> &[u32] {
        either!(self, t => t.eog())
    }

    /// Whether BOS/EOS are added by `encode(.., add_special = true)`.
    pub fn adds_bos_eos(&self) -> (bool, bool) {
        either!(self, t => t.adds_bos_eos())
    }
}

impl Tokenizer for GgufTokenizer {
    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        either!(self, t => t.encode(text, add_special))
    }
    fn decode(&self, ids: &[u32]) -> Result<String> {
        either!(self, t => t.decode(ids))
    }
    fn token_to_piece(&self, id: u32) -> Result<&str> {
        either!(self, t => t.token_to_piece(id))
    }
    fn token_id(&self, piece: &str) -> Option<u32> {
        either!(self, t => t.token_id(piece))
    }
    fn vocab_size(&self) -> usize {
        either!(self, t => t.vocab_size())
    }
    fn bos(&self) -> Option<u32> {
        either!(self, t => t.bos())
    }
    fn eos(&self) -> Option<u32> {
        either!(self, t => t.eos())
    }
}
