//! The tidy test's reader: Rust source as code tokens (identifiers, `::`, punctuation, with
//! their lines), without comments, literals and `#[cfg(test)] mod` blocks. Enough of Rust's
//! lexical grammar for finding paths (The Rust Reference, "Lexical structure": comments nest,
//! raw strings close with as many `#` as they open with, `'a` is a lifetime unless a `'`
//! follows the character).

#[derive(Clone, Debug, PartialEq)]
pub enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// A token and its 1-based line.
pub type Token = (Tok, usize);

/// The code tokens of Rust source: identifiers, `::` and single punctuation; comments, doc
/// comments, string, byte-string, raw-string and char literals, numbers and lifetimes dropped.
pub fn tokens(src: &str) -> Vec<Token> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    let ident_start = |ch: char| ch.is_alphabetic() || ch == '_';
    let ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    // Skip from an opening quote at `c[i]` to past its closing quote, counting newlines.
    let skip_quoted = |i: &mut usize, line: &mut usize, quote: char| {
        *i += 1;
        while *i < c.len() && c[*i] != quote {
            if c[*i] == '\\' {
                *i += 1;
            }
            if *i < c.len() && c[*i] == '\n' {
                *line += 1;
            }
            *i += 1;
        }
        *i += 1;
    };
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied().unwrap_or('\0');
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && next == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if ch == '"' {
            skip_quoted(&mut i, &mut line, '"');
        } else if (ch == 'r' || (ch == 'b' && next == 'r'))
            && matches!(c.get(i + 1 + usize::from(ch == 'b')), Some('"' | '#'))
            && raw_string_end(&c, i + 1 + usize::from(ch == 'b')).is_some()
        {
            let end = raw_string_end(&c, i + 1 + usize::from(ch == 'b')).expect("checked");
            line += c[i..end].iter().filter(|&&x| x == '\n').count();
            i = end;
        } else if ch == 'b' && (next == '"' || next == '\'') {
            i += 1;
            skip_quoted(&mut i, &mut line, next);
        } else if ch == '\'' {
            // A char literal ('a', '\n', '\u{1F600}') or a lifetime / label ('a, 'static).
            if next == '\\' || c.get(i + 2) == Some(&'\'') {
                skip_quoted(&mut i, &mut line, '\'');
            } else {
                i += 1;
                while i < c.len() && ident_char(c[i]) {
                    i += 1;
                }
            }
        } else if ch.is_ascii_digit() {
            while i < c.len() && (ident_char(c[i])) {
                i += 1;
            }
        } else if ident_start(ch) {
            let start = i;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            let mut word: String = c[start..i].iter().collect();
            if word == "r" && c.get(i) == Some(&'#') {
                // A raw identifier, r#type.
                i += 1;
                let s = i;
                while i < c.len() && ident_char(c[i]) {
                    i += 1;
                }
                word = c[s..i].iter().collect();
            }
            out.push((Tok::Ident(word), line));
        } else if ch == ':' && next == ':' {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

/// The index past a raw string starting at `c[i]` (`#`* then `"`), if it is one.
fn raw_string_end(c: &[char], mut i: usize) -> Option<usize> {
    let mut hashes = 0;
    while c.get(i) == Some(&'#') {
        hashes += 1;
        i += 1;
    }
    if c.get(i) != Some(&'"') {
        return None;
    }
    i += 1;
    while i < c.len() {
        if c[i] == '"' && (1..=hashes).all(|k| c.get(i + k) == Some(&'#')) {
            return Some(i + 1 + hashes);
        }
        i += 1;
    }
    None
}

pub fn is_ident(t: Option<&Token>, word: &str) -> bool {
    matches!(t, Some((Tok::Ident(w), _)) if w == word)
}

pub fn is_punct(t: Option<&Token>, p: char) -> bool {
    matches!(t, Some((Tok::Punct(x), _)) if *x == p)
}

/// The index past the group opened at `toks[i]` (`{`, `[` or `(`), or the end.
pub fn skip_group(toks: &[Token], i: usize) -> usize {
    let mut depth = 0i32;
    for (k, (t, _)) in toks.iter().enumerate().skip(i) {
        match t {
            Tok::Punct('{' | '[' | '(') => depth += 1,
            Tok::Punct('}' | ']' | ')') => {
                depth -= 1;
                if depth == 0 {
                    return k + 1;
                }
            }
            _ => {}
        }
    }
    toks.len()
}

/// `toks` without `#[cfg(test)] mod name { ... }` blocks (other attributes and a visibility
/// may stand between the `cfg` and the `mod`).
pub fn without_test_modules(toks: Vec<Token>) -> Vec<Token> {
    let cfg_test = |i: usize| {
        let want = ["#", "[", "cfg", "(", "test", ")", "]"];
        want.iter().enumerate().all(|(k, w)| match toks.get(i + k) {
            Some((Tok::Ident(x), _)) => x == w,
            Some((Tok::Punct(p), _)) => w.len() == 1 && w.starts_with(*p),
            _ => false,
        })
    };
    let mut out = Vec::with_capacity(toks.len());
    let mut i = 0;
    while i < toks.len() {
        if cfg_test(i) {
            let mut k = i + 7;
            while is_punct(toks.get(k), '#') && is_punct(toks.get(k + 1), '[') {
                k = skip_group(&toks, k + 1);
            }
            if is_ident(toks.get(k), "pub") {
                k += 1;
                if is_punct(toks.get(k), '(') {
                    k = skip_group(&toks, k);
                }
            }
            if is_ident(toks.get(k), "mod") && is_punct(toks.get(k + 2), '{') {
                i = skip_group(&toks, k + 2);
                continue;
            }
        }
        out.push(toks[i].clone());
        i += 1;
    }
    out
}
