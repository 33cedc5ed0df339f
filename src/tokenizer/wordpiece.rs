//! BERT WordPiece from a HF `tokenizer.json`: BertNormalizer, BertPreTokenizer, WordPiece,
//! TemplateProcessing/BertProcessing, truncation, and padded batches with attention masks.
//!
//! Algorithms per Google's BERT `tokenization.py` and HF tokenizers' `BertNormalizer`,
//! `BertPreTokenizer`, `WordPiece` model and decoder: clean text (drop NUL, U+FFFD and `C*`
//! chars other than \t \n \r; map whitespace to ' '), pad CJK ideographs with spaces, NFD and
//! drop `Mn` marks when stripping accents, lowercase char by char; split on whitespace and
//! isolate each punctuation char (ASCII punctuation or `\p{P}`); then greedy
//! longest-match-first WordPiece with the `##` continuation prefix, a word longer than
//! `max_input_chars_per_word` chars or with an unmatched rest becoming the unknown token.

use super::unicode::{is_nonspacing_mark, is_other, is_punctuation};
use super::{Segment, SpecialMatcher, Tokenizer};
use crate::{Error, Result};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use unicode_normalization::UnicodeNormalization;

/// BertNormalizer settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BertNormalizer {
    pub clean_text: bool,
    pub handle_chinese_chars: bool,
    /// `None` follows `lowercase`, as in HF tokenizers.
    pub strip_accents: Option<bool>,
    pub lowercase: bool,
}

/// CJK Unified Ideographs blocks, as in BERT's `_is_chinese_char`, except that Extension E
/// starts at U+2B920 as in HF tokenizers' BertNormalizer (BERT's Python code says U+2B820):
/// U+2B820..U+2B91F are not padded, so this matches the fast tokenizer that
/// sentence-transformers users run (checked by the reference test).
fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF | 0x3400..=0x4DBF | 0x20000..=0x2A6DF | 0x2A700..=0x2B73F
        | 0x2B740..=0x2B81F | 0x2B920..=0x2CEAF | 0xF900..=0xFAFF | 0x2F800..=0x2FA1F)
}

impl BertNormalizer {
    pub fn normalize(&self, text: &str) -> String {
        let mut s = String::with_capacity(text.len() + 8);
        for c in text.chars() {
            let c = if self.clean_text {
                if c == '\0' || c == '\u{FFFD}' || (is_other(c) && !matches!(c, '\t' | '\n' | '\r'))
                {
                    continue;
                }
                if c.is_whitespace() { ' ' } else { c }
            } else {
                c
            };
            if self.handle_chinese_chars && is_cjk(c) {
                s.push(' ');
                s.push(c);
                s.push(' ');
            } else {
                s.push(c);
            }
        }
        if self.strip_accents.unwrap_or(self.lowercase) {
            s = s.nfd().filter(|&c| !is_nonspacing_mark(c)).collect();
        }
        if self.lowercase {
            // Char by char (no final-sigma rule), as HF tokenizers does.
            s = s.chars().flat_map(char::to_lowercase).collect();
        }
        s
    }
}

/// BertPreTokenizer: whitespace separates words and is dropped; each punctuation char is a
/// word of its own.
pub fn bert_pre_tokenize<'a>(text: &'a str, out: &mut Vec<&'a str>) {
    let mut start = None;
    for (i, c) in text.char_indices() {
        let punct = c.is_ascii_punctuation() || is_punctuation(c);
        if c.is_whitespace() || punct {
            if let Some(s) = start.take() {
                out.push(&text[s..i]);
            }
            if punct {
                out.push(&text[i..i + c.len_utf8()]);
            }
        } else if start.is_none() {
            start = Some(i);
        }
    }
    if let Some(s) = start {
        out.push(&text[s..]);
    }
}

/// Padded batch: `ids`, `attention_mask` and `type_ids` are `batch * seq_len`, row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchEncoding {
    pub batch: usize,
    pub seq_len: usize,
    pub ids: Vec<u32>,
    pub attention_mask: Vec<u32>,
    pub type_ids: Vec<u32>,
    /// Unpadded length of each sequence.
    pub lengths: Vec<usize>,
}

#[derive(Clone, Debug)]
enum Piece {
    Special(Vec<u32>),
    Sequence,
}

pub struct WordPieceTokenizer {
    path: PathBuf,
    tokens: Vec<String>,
    vocab: HashMap<String, u32>,
    unk: u32,
    prefix: String,
    max_chars: usize,
    normalizer: Option<BertNormalizer>,
    /// Added tokens matched on the raw text (`normalized: false`) and after normalization.
    raw_added: SpecialMatcher,
    normalized_added: SpecialMatcher,
    special_ids: HashSet<u32>,
    template: Vec<Piece>,
    pad_id: u32,
    max_len: Option<usize>,
    cleanup: bool,
    cls: Option<u32>,
    sep: Option<u32>,
}

impl std::fmt::Debug for WordPieceTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WordPieceTokenizer")
            .field("path", &self.path)
            .field("vocab", &self.tokens.len())
            .field("max_len", &self.max_len)
            .finish()
    }
}

fn fmt_err(path: &Path, field: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::format(path, field, reason)
}

impl WordPieceTokenizer {
    /// Loads a HF `tokenizer.json` with a WordPiece model. The maximum length comes from its
    /// `truncation.max_length` (if any); see [`WordPieceTokenizer::from_model_dir`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<WordPieceTokenizer> {
        let path = path.as_ref();
        let text = crate::io::read_text_limited(path, crate::io::MAX_TOKENIZER_JSON_BYTES)?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| fmt_err(path, "JSON", format!("line {}: {e}", e.line())))?;
        WordPieceTokenizer::from_json(path, &json)
    }

    /// Loads `dir/tokenizer.json`; the maximum length is `sentence_bert_config.json`'s
    /// `max_seq_length` when present (what sentence-transformers uses), else the JSON's
    /// truncation length, else `tokenizer_config.json`'s `model_max_length`.
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<WordPieceTokenizer> {
        let dir = dir.as_ref();
        let mut t = WordPieceTokenizer::from_file(dir.join("tokenizer.json"))?;
        let sbert = dir.join("sentence_bert_config.json");
        let tcfg = dir.join("tokenizer_config.json");
        let sbert_len = match sbert.exists() {
            true => crate::io::JsonConfig::open(&sbert)?.opt_usize("max_seq_length")?,
            false => None,
        };
        if sbert_len.is_some() {
            t.max_len = sbert_len;
        } else if t.max_len.is_none() && tcfg.exists() {
            t.max_len = crate::io::JsonConfig::open(&tcfg)?.opt_usize("model_max_length")?;
        }
        Ok(t)
    }

    pub fn from_json(path: &Path, j: &Value) -> Result<WordPieceTokenizer> {
        let model = &j["model"];
        let ty = model["type"].as_str().unwrap_or("(none)");
        if ty != "WordPiece" {
            return Err(fmt_err(
                path,
                "model.type",
                format!("'{ty}' is not WordPiece"),
            ));
        }
        let vocab_obj = model["vocab"]
            .as_object()
            .ok_or_else(|| fmt_err(path, "model.vocab", "expected an object"))?;
        let mut tokens = vec![String::new(); vocab_obj.len()];
        let mut vocab = HashMap::with_capacity(vocab_obj.len());
        for (tok, id) in vocab_obj {
            let id = id
                .as_u64()
                .filter(|&i| (i as usize) < tokens.len())
                .ok_or_else(|| {
                    fmt_err(
                        path,
                        format!("model.vocab[{tok:?}]"),
                        format!("bad id {id}"),
                    )
                })?;
            tokens[id as usize] = tok.clone();
            vocab.insert(tok.clone(), id as u32);
        }
        let str_field = |k: &str, default: &str| model[k].as_str().unwrap_or(default).to_string();
        let unk_token = str_field("unk_token", "[UNK]");
        let unk = *vocab.get(&unk_token).ok_or_else(|| {
            fmt_err(
                path,
                "model.unk_token",
                format!("{unk_token:?} is not in the vocabulary"),
            )
        })?;
        let normalizer = match &j["normalizer"] {
            Value::Null => None,
            n if n["type"] == "BertNormalizer" => Some(BertNormalizer {
                clean_text: n["clean_text"].as_bool().unwrap_or(true),
                handle_chinese_chars: n["handle_chinese_chars"].as_bool().unwrap_or(true),
                strip_accents: n["strip_accents"].as_bool(),
                lowercase: n["lowercase"].as_bool().unwrap_or(true),
            }),
            n => {
                return Err(fmt_err(
                    path,
                    "normalizer.type",
                    format!("{} is not supported (BertNormalizer or none)", n["type"]),
                ));
            }
        };
        let pre = &j["pre_tokenizer"];
        if pre["type"] != "BertPreTokenizer" {
            return Err(fmt_err(
                path,
                "pre_tokenizer.type",
                format!("{} is not supported (BertPreTokenizer)", pre["type"]),
            ));
        }
        let mut raw = Vec::new();
        let mut normed = Vec::new();
        let mut special_ids = HashSet::new();
        for (i, a) in j["added_tokens"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let (Some(content), Some(id)) = (a["content"].as_str(), a["id"].as_u64()) else {
                return Err(fmt_err(
                    path,
                    format!("added_tokens[{i}]"),
                    "needs content and id",
                ));
            };
            let id = u32::try_from(id).map_err(|_| {
                fmt_err(
                    path,
                    format!("added_tokens[{i}].id"),
                    format!("bad id {id}"),
                )
            })?;
            if a["special"].as_bool().unwrap_or(false) {
                special_ids.insert(id);
            }
            let entry = (content.to_string(), id);
            if a["normalized"].as_bool().unwrap_or(true) {
                normed.push(entry);
            } else {
                raw.push(entry);
            }
        }
        let template = parse_post_processor(path, &j["post_processor"], &vocab)?;
        let max_len = j["truncation"]["max_length"].as_u64().map(|n| n as usize);
        let pad_id = j["padding"]["pad_id"]
            .as_u64()
            .map(|p| p as u32)
            .or_else(|| vocab.get("[PAD]").copied())
            .unwrap_or(0);
        let cleanup = match &j["decoder"] {
            Value::Null => true,
            d => d["cleanup"].as_bool().unwrap_or(true),
        };
        Ok(WordPieceTokenizer {
            path: path.to_path_buf(),
            cls: vocab.get("[CLS]").copied(),
            sep: vocab.get("[SEP]").copied(),
            prefix: str_field("continuing_subword_prefix", "##"),
            max_chars: model["max_input_chars_per_word"].as_u64().unwrap_or(100) as usize,
            tokens,
            vocab,
            unk,
            normalizer,
            raw_added: SpecialMatcher::new(raw),
            normalized_added: SpecialMatcher::new(normed),
            special_ids,
            template,
            pad_id,
            max_len,
            cleanup,
        })
    }

    /// Longest encoded sequence, special tokens included (`None`: no truncation).
    pub fn max_len(&self) -> Option<usize> {
        self.max_len
    }

    pub fn set_max_len(&mut self, max_len: Option<usize>) {
        self.max_len = max_len;
    }

    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// The normalizer's output for `text` (identity when the JSON has none).
    pub fn normalize(&self, text: &str) -> String {
        match &self.normalizer {
            Some(n) => n.normalize(text),
            None => text.to_string(),
        }
    }

    fn word_piece(&self, word: &str, out: &mut Vec<u32>) {
        if word.chars().count() > self.max_chars {
            out.push(self.unk);
            return;
        }
        let mark = out.len();
        let mut start = 0;
        let mut buf = String::new();
        while start < word.len() {
            let mut end = word.len();
            let mut found = None;
            while end > start {
                buf.clear();
                if start > 0 {
                    buf.push_str(&self.prefix);
                }
                buf.push_str(&word[start..end]);
                if let Some(&id) = self.vocab.get(&buf) {
                    found = Some(id);
                    break;
                }
                end -= 1;
                while !word.is_char_boundary(end) {
                    end -= 1;
                }
            }
            match found {
                Some(id) => out.push(id),
                None => {
                    out.truncate(mark);
                    out.push(self.unk);
                    return;
                }
            }
            start = end;
        }
    }

    /// Ids of `text` without special tokens added and without truncation.
    fn encode_raw(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        for seg in self.raw_added.split(text) {
            let t = match seg {
                Segment::Special(id) => {
                    out.push(id);
                    continue;
                }
                Segment::Text(t) => t,
            };
            let normalized = self.normalize(t);
            for seg in self.normalized_added.split(&normalized) {
                match seg {
                    Segment::Special(id) => out.push(id),
                    Segment::Text(t) => {
                        let mut words = Vec::new();
                        bert_pre_tokenize(t, &mut words);
                        for w in &words {
                            self.word_piece(w, &mut out);
                        }
                    }
                }
            }
        }
        out
    }

    /// Pads every encoding to the longest (ids `pad_id`, mask 0). Each row is encoded with
    /// special tokens and truncated to `max_len`.
    pub fn encode_batch(&self, texts: &[&str]) -> Result<BatchEncoding> {
        let rows = texts
            .iter()
            .map(|t| self.encode(t, true))
            .collect::<Result<Vec<_>>>()?;
        let seq_len = rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut b = BatchEncoding {
            batch: rows.len(),
            seq_len,
            ids: Vec::with_capacity(rows.len() * seq_len),
            attention_mask: Vec::with_capacity(rows.len() * seq_len),
            type_ids: vec![0; rows.len() * seq_len],
            lengths: rows.iter().map(Vec::len).collect(),
        };
        for r in &rows {
            b.ids.extend_from_slice(r);
            b.ids
                .extend(std::iter::repeat_n(self.pad_id, seq_len - r.len()));
            b.attention_mask.extend(std::iter::repeat_n(1, r.len()));
            b.attention_mask
                .extend(std::iter::repeat_n(0, seq_len - r.len()));
        }
        Ok(b)
    }

    fn n_special(&self) -> usize {
        self.template
            .iter()
            .map(|p| match p {
                Piece::Special(ids) => ids.len(),
                Piece::Sequence => 0,
            })
            .sum()
    }
}

fn parse_post_processor(
    path: &Path,
    pp: &Value,
    vocab: &HashMap<String, u32>,
) -> Result<Vec<Piece>> {
    let id_of = |tok: &str, field: &str| {
        vocab.get(tok).copied().ok_or_else(|| {
            fmt_err(
                path,
                field.to_string(),
                format!("{tok:?} is not in the vocabulary"),
            )
        })
    };
    match pp["type"].as_str() {
        None => Ok(vec![Piece::Sequence]),
        Some("BertProcessing") => {
            let cls = pp["cls"][0].as_str().unwrap_or("[CLS]");
            let sep = pp["sep"][0].as_str().unwrap_or("[SEP]");
            Ok(vec![
                Piece::Special(vec![id_of(cls, "post_processor.cls")?]),
                Piece::Sequence,
                Piece::Special(vec![id_of(sep, "post_processor.sep")?]),
            ])
        }
        Some("TemplateProcessing") => {
            let mut out = Vec::new();
            for (i, item) in pp["single"].as_array().into_iter().flatten().enumerate() {
                let field = format!("post_processor.single[{i}]");
                if let Some(name) = item["SpecialToken"]["id"].as_str() {
                    let ids = pp["special_tokens"][name]["ids"]
                        .as_array()
                        .ok_or_else(|| {
                            fmt_err(path, &field, format!("special token {name:?} has no ids"))
                        })?
                        .iter()
                        .map(|v| v.as_u64().map(|x| x as u32))
                        .collect::<Option<Vec<u32>>>()
                        .ok_or_else(|| fmt_err(path, &field, "ids must be integers"))?;
                    out.push(Piece::Special(ids));
                } else if item["Sequence"]["id"] == "A" {
                    out.push(Piece::Sequence);
                } else {
                    return Err(fmt_err(path, field, format!("unsupported item {item}")));
                }
            }
            if !out.iter().any(|p| matches!(p, Piece::Sequence)) {
                return Err(fmt_err(path, "post_processor.single", "no Sequence A item"));
            }
            Ok(out)
        }
        Some(other) => Err(fmt_err(
            path,
            "post_processor.type",
            format!("'{other}' is not supported (TemplateProcessing, BertProcessing or none)"),
        )),
    }
}

impl Tokenizer for WordPieceTokenizer {
    /// With `add_special`, the single-sequence template ([CLS] A [SEP]) is applied and the
    /// sequence is truncated so that the total fits `max_len`.
    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let mut ids = self.encode_raw(text);
        let budget = self
            .max_len
            .map(|m| m.saturating_sub(if add_special { self.n_special() } else { 0 }));
        if let Some(b) = budget {
            ids.truncate(b);
        }
        if !add_special {
            return Ok(ids);
        }
        let mut out = Vec::with_capacity(ids.len() + self.n_special());
        for p in &self.template {
            match p {
                Piece::Special(s) => out.extend_from_slice(s),
                Piece::Sequence => out.extend_from_slice(&ids),
            }
        }
        Ok(out)
    }

    /// Special tokens are skipped; `##` pieces join the previous word; the decoder's
    /// cleanup removes the space before . ? ! , (HF WordPiece decoder).
    fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut out = String::new();
        let mut first = true;
        for &id in ids {
            let tok = self.token_to_piece(id)?;
            if self.special_ids.contains(&id) {
                continue;
            }
            let mut piece = match tok.strip_prefix(self.prefix.as_str()) {
                Some(rest) if !first => rest.to_string(),
                _ if first => tok.to_string(),
                _ => format!(" {tok}"),
            };
            first = false;
            if self.cleanup {
                for (from, to) in [
                    (" .", "."),
                    (" ?", "?"),
                    (" !", "!"),
                    (" ,", ","),
                    (" ' ", "'"),
                    (" n't", "n't"),
                    (" 'm", "'m"),
                    (" do not", " don't"),
                    (" 's", "'s"),
                    (" 've", "'ve"),
                    (" 're", "'re"),
                ] {
                    piece = piece.replace(from, to);
                }
            }
            out.push_str(&piece);
        }
        Ok(out)
    }

    fn token_to_piece(&self, id: u32) -> Result<&str> {
        self.tokens
            .get(id as usize)
            .map(String::as_str)
            .ok_or_else(|| Error::Model {
                model: self.path.display().to_string(),
                reason: format!(
                    "token id {id} is outside the vocabulary of {}",
                    self.tokens.len()
                ),
            })
    }

    fn token_id(&self, piece: &str) -> Option<u32> {
        self.vocab.get(piece).copied()
    }

    fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// BERT's sequence start, [CLS].
    fn bos(&self) -> Option<u32> {
        self.cls
    }

    /// BERT's separator, [SEP].
    fn eos(&self) -> Option<u32> {
        self.sep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bert_normalizer_steps() {
        let n = BertNormalizer {
            clean_text: true,
            handle_chinese_chars: true,
            strip_accents: None,
            lowercase: true,
        };
        assert_eq!(n.normalize("Héllo\tWÖRLD\u{200B}!"), "hello world!");
        assert_eq!(n.normalize("a中b"), "a 中 b");
        assert_eq!(n.normalize("ΣΑΣ"), "σασ");
    }

    #[test]
    fn pre_tokenizer_isolates_punctuation() {
        let mut v = Vec::new();
        bert_pre_tokenize("hi, you—there!  ok", &mut v);
        assert_eq!(v, ["hi", ",", "you", "—", "there", "!", "ok"]);
    }
}
