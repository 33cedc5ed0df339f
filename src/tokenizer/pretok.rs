//! Pre-tokenizers for byte-level BPE, written by hand (no regex engine), and GPT-2's
//! byte-to-unicode mapping.
//!
//! GPT-2 split: the pattern `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|
//! \s+(?!\S)|\s+` (OpenAI's GPT-2 `encoder.py`, also HF tokenizers' ByteLevel), applied with
//! leftmost-first alternation: at each position the first alternative that matches wins, and
//! each run is as long as possible. `\s+(?!\S)` leaves the last whitespace of a run that is
//! followed by a non-space, so that " word" keeps its space.
//!
//! SmolLM (llama.cpp `LLAMA_VOCAB_PRE_TYPE_SMOLLM`, grouped there with starcoder, refact,
//! command-r, codeshell and exaone): first isolate every `\p{N}` character (HF
//! `Digits(individual_digits=true)`), then apply the GPT-2 split to the pieces in between.
//!
//! Llama 3 (`tokenizer.ggml.pre` = "llama-bpe", llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3` in
//! `src/llama-vocab.cpp`, the pattern of Llama 3's `tokenizer.json`):
//! `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//! ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`. Qwen2 (`pre` = "qwen2",
//! `LLAMA_VOCAB_PRE_TYPE_QWEN2`) is the same pattern with `\p{N}` (one digit) in place of
//! `\p{N}{1,3}`. Both are applied leftmost-first as a regex engine does (see [`llama3_split`]).

use super::unicode::{is_letter, is_number};

/// Which pre-tokenization rule a vocabulary was trained with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// The GPT-2 pattern alone (`tokenizer.ggml.pre` = "gpt2", "mpt", "olmo", ...).
    Gpt2,
    /// Every number character alone, then the GPT-2 pattern (`pre` = "smollm", ...).
    DigitsThenGpt2,
    /// Llama 3's pattern: numbers in groups of up to three (`pre` = "llama-bpe", ...).
    Llama3,
    /// Qwen2's pattern: Llama 3's with every number character alone (`pre` = "qwen2", ...).
    Qwen2,
}

impl PreTokenizer {
    /// The rule for a `tokenizer.ggml.pre` name, per llama.cpp's llama-vocab.cpp grouping.
    pub fn from_gguf_pre(pre: &str) -> Option<PreTokenizer> {
        match pre {
            "gpt2" | "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" => Some(PreTokenizer::Gpt2),
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" => {
                Some(PreTokenizer::DigitsThenGpt2)
            }
            // llama.cpp maps "llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral" and
            // "dbrx"/"smaug-bpe" to the Llama 3 pattern; "qwen2", "deepseek-r1-qwen" and
            // "megrez" to Qwen2's.
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe" => {
                Some(PreTokenizer::Llama3)
            }
            "qwen2" | "deepseek-r1-qwen" | "megrez" => Some(PreTokenizer::Qwen2),
            _ => None,
        }
    }

    /// Splits `text` into words, appended to `out` as slices of `text`.
    pub fn split<'a>(self, text: &'a str, out: &mut Vec<&'a str>) {
        match self {
            PreTokenizer::Gpt2 => gpt2_split(text, out),
            PreTokenizer::DigitsThenGpt2 => {
                let mut start = 0;
                for (i, c) in text.char_indices() {
                    if is_number(c) {
                        gpt2_split(&text[start..i], out);
                        let end = i + c.len_utf8();
                        out.push(&text[i..end]);
                        start = end;
                    }
                }
                gpt2_split(&text[start..], out);
            }
            PreTokenizer::Llama3 => llama3_split(text, 3, out),
            PreTokenizer::Qwen2 => llama3_split(text, 1, out),
        }
    }

    /// The names [`PreTokenizer::from_gguf_pre`] accepts, for messages.
    pub const SUPPORTED: &'static str = "gpt2, gpt-2, phi-2, mpt, olmo, jais, smollm, starcoder, \
        refact, command-r, codeshell, exaone, llama3, llama-v3, llama-bpe, falcon3, pixtral, dbrx, \
        smaug-bpe, qwen2, deepseek-r1-qwen, megrez";
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    /// Neither whitespace, letter nor number.
    Other,
    Space,
}

fn class(c: char) -> Class {
    if c.is_whitespace() {
        Class::Space
    } else if is_letter(c) {
        Class::Letter
    } else if is_number(c) {
        Class::Number
    } else {
        Class::Other
    }
}

/// Length in chars of a contraction (`'s 't 're 've 'm 'll 'd`, case-sensitive as in GPT-2)
/// starting at `chars[i]`, or 0.
fn contraction(chars: &[(usize, char)], i: usize) -> usize {
    let at = |k: usize| chars.get(i + k).map(|&(_, c)| c);
    if at(0) != Some('\'') {
        return 0;
    }
    match (at(1), at(2)) {
        (Some('s' | 't' | 'm' | 'd'), _) => 2,
        (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => 3,
        _ => 0,
    }
}

/// The GPT-2 split of `s` (see the module docs).
pub fn gpt2_split<'a>(s: &'a str, out: &mut Vec<&'a str>) {
    if s.is_empty() {
        return;
    }
    let chars: Vec<(usize, char)> = s.char_indices().collect();
    let classes: Vec<Class> = chars.iter().map(|&(_, c)| class(c)).collect();
    let n = chars.len();
    let byte_at = |k: usize| if k < n { chars[k].0 } else { s.len() };
    let mut i = 0;
    while i < n {
        let k = contraction(&chars, i);
        if k > 0 {
            out.push(&s[byte_at(i)..byte_at(i + k)]);
            i += k;
            continue;
        }
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional ASCII space, then a run of
        // one class.
        let first = if chars[i].1 == ' ' && i + 1 < n && classes[i + 1] != Class::Space {
            i + 1
        } else {
            i
        };
        let cl = classes[first];
        if cl != Class::Space {
            let mut j = first + 1;
            while j < n && classes[j] == cl {
                j += 1;
            }
            out.push(&s[byte_at(i)..byte_at(j)]);
            i = j;
            continue;
        }
        // `\s+(?!\S)|\s+`: a whitespace run; when a non-space follows a run of two or more,
        // its last whitespace char is left to start the next word.
        let mut j = i;
        while j < n && classes[j] == Class::Space {
            j += 1;
        }
        if j < n && j - i > 1 {
            j -= 1;
        }
        out.push(&s[byte_at(i)..byte_at(j)]);
        i = j;
    }
}

/// Length in chars of a case-insensitive contraction (`'s 't 're 've 'm 'll 'd`, any case)
/// starting at `chars[i]`, or 0.
fn contraction_ci(chars: &[(usize, char)], i: usize) -> usize {
    let at = |k: usize| chars.get(i + k).map(|&(_, c)| c.to_ascii_lowercase());
    if chars.get(i).map(|&(_, c)| c) != Some('\'') {
        return 0;
    }
    match (at(1), at(2)) {
        (Some('s' | 't' | 'm' | 'd'), _) => 2,
        (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => 3,
        _ => 0,
    }
}

/// The Llama 3 / Qwen2 split of `s` (module docs), with runs of at most `max_digits` number
/// characters. Each alternative is tried in order at the current position and the first that
/// matches wins; the lengths below are what a backtracking regex engine gives:
///
/// 1. a contraction;
/// 2. `[^\r\n\p{L}\p{N}]?\p{L}+`: one optional char that is none of those, then letters;
/// 3. `\p{N}{1,max}`;
/// 4. ` ?[^\s\p{L}\p{N}]+[\r\n]*`: an optional space, symbols, then any CR/LF;
/// 5. `\s*[\r\n]+`: whitespace up to and including the last CR/LF of the whitespace run;
/// 6. `\s+(?!\S)`: a whitespace run at the end of the text, or all of it but its last char;
/// 7. `\s+`: the whitespace run (one char here, since 6 failed).
pub fn llama3_split<'a>(s: &'a str, max_digits: usize, out: &mut Vec<&'a str>) {
    if s.is_empty() {
        return;
    }
    let chars: Vec<(usize, char)> = s.char_indices().collect();
    let classes: Vec<Class> = chars.iter().map(|&(_, c)| class(c)).collect();
    let n = chars.len();
    let byte_at = |k: usize| if k < n { chars[k].0 } else { s.len() };
    let is_crlf = |k: usize| matches!(chars[k].1, '\r' | '\n');
    let mut i = 0;
    while i < n {
        let end = llama3_match(&chars, &classes, i, max_digits, &is_crlf);
        out.push(&s[byte_at(i)..byte_at(end)]);
        i = end;
    }
}

/// The end (in chars) of the Llama 3 pattern's match at `i` (see [`llama3_split`]).
fn llama3_match(
    chars: &[(usize, char)],
    classes: &[Class],
    i: usize,
    max_digits: usize,
    is_crlf: &dyn Fn(usize) -> bool,
) -> usize {
    let n = chars.len();
    let run = |from: usize, cl: Class| {
        let mut j = from;
        while j < n && classes[j] == cl {
            j += 1;
        }
        j
    };
    let k = contraction_ci(chars, i);
    if k > 0 {
        return i + k;
    }
    // 2: an optional prefix char (not CR/LF, letter or number), then letters.
    let prefix_ok = !is_crlf(i) && !matches!(classes[i], Class::Letter | Class::Number);
    if classes[i] == Class::Letter {
        return run(i, Class::Letter);
    }
    if prefix_ok && i + 1 < n && classes[i + 1] == Class::Letter {
        return run(i + 1, Class::Letter);
    }
    // 3: numbers.
    if classes[i] == Class::Number {
        let mut j = i;
        while j < n && j - i < max_digits && classes[j] == Class::Number {
            j += 1;
        }
        return j;
    }
    // 4: an optional space, symbols, then CR/LF.
    let first = if chars[i].1 == ' ' && i + 1 < n && classes[i + 1] == Class::Other {
        i + 1
    } else {
        i
    };
    if classes[first] == Class::Other {
        let mut j = run(first, Class::Other);
        while j < n && is_crlf(j) {
            j += 1;
        }
        return j;
    }
    // Whitespace from here on.
    let ws_end = run(i, Class::Space);
    // 5: up to the last CR/LF of the run.
    if let Some(last) = (i..ws_end).rev().find(|&k| is_crlf(k)) {
        return last + 1;
    }
    // 6 and 7.
    if ws_end == n || ws_end - i == 1 {
        ws_end
    } else {
        ws_end - 1
    }
}

/// GPT-2's `bytes_to_unicode`: printable Latin-1 bytes ('!'..='~', '¡'..='¬', '®'..='ÿ') map
/// to themselves, the other 68 bytes to U+0100, U+0101, ... in byte order.
pub fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).expect("codes below 0x144 are chars");
    }
    table
}

/// The inverse of [`byte_to_char_table`], indexed by code point (all mapped chars are below
/// U+0144); -1 where a code point is not a mapped byte.
pub fn char_to_byte_table() -> [i16; 324] {
    let mut inv = [-1i16; 324];
    for (b, c) in byte_to_char_table().iter().enumerate() {
        inv[*c as usize] = b as i16;
    }
    inv
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(p: PreTokenizer, s: &str) -> Vec<&str> {
        let mut v = Vec::new();
        p.split(s, &mut v);
        v
    }

    #[test]
    fn splits_always_cover_the_input() {
        for s in [
            "Hello world",
            "a  b\n\n c",
            "it's 12345 $",
            "  ",
            "\t\tx",
            "😀😀 ok",
            "'",
            "''s",
        ] {
            for p in [
                PreTokenizer::Gpt2,
                PreTokenizer::DigitsThenGpt2,
                PreTokenizer::Llama3,
                PreTokenizer::Qwen2,
            ] {
                let w = words(p, s);
                assert_eq!(w.concat(), s);
                assert!(w.iter().all(|w| !w.is_empty()), "{s:?} -> {w:?}");
            }
        }
    }

    #[test]
    fn llama3_pattern_alternatives() {
        let l3 = |s| words(PreTokenizer::Llama3, s);
        assert_eq!(l3("I'M 12345 x"), ["I", "'M", " ", "123", "45", " x"]);
        assert_eq!(l3("a  b\n\n  c"), ["a", " ", " b", "\n\n", " ", " c"]);
        assert_eq!(l3("(x) ...\n\ny \t"), ["(x", ")", " ...\n\n", "y", " \t"]);
        assert_eq!(l3("\tword"), ["\tword"]);
        assert_eq!(words(PreTokenizer::Qwen2, "x12"), ["x", "1", "2"]);
    }

    #[test]
    fn byte_table_is_a_bijection() {
        let t = byte_to_char_table();
        let inv = char_to_byte_table();
        for (b, c) in t.iter().enumerate() {
            assert_eq!(inv[*c as usize], b as i16);
        }
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'A' as usize], 'A');
    }
}
