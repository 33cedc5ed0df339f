//! Chat templates without a Jinja engine: a template from `tokenizer.chat_template` is
//! reduced to a canonical form and matched against the families metashard knows; a match
//! renders messages with plain Rust, anything else is an error that quotes the template.
//!
//! Canonical form: Jinja tags with trim markers (`{%- -%}`) applied and removed, whitespace
//! outside string literals removed, string escapes (`\n`, `\'`) resolved, strings re-quoted
//! with single quotes, and HF transformers' rendering options applied to the text between
//! tags (`trim_blocks`: drop the first newline after a block tag; `lstrip_blocks`: drop
//! spaces and tabs before a block tag at the start of a line).
//!
//! Families: ChatML (`<|im_start|>{role}\n{content}<|im_end|>\n` per message, then
//! `<|im_start|>assistant\n` for a generation prompt), optionally with a default system
//! prompt emitted when the first message is not a system message (SmolLM2's template).
//! [`ChatTemplate::render_spans`] also returns where the messages' text lies in the prompt,
//! so a tokenizer can keep it literal and take control tokens from the markup only.

use crate::io::GgufFile;
use crate::{Error, Result};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatFamily {
    ChatMl { default_system: Option<String> },
}

#[derive(Clone, Debug)]
pub struct ChatTemplate {
    family: ChatFamily,
    source: String,
}

const SYS: &str = "\u{0}SYSTEM\u{0}";

/// Canonical forms of the known templates; `SYS` stands for the default system prompt.
fn known() -> Vec<(String, bool)> {
    let turn = "{{'<|im_start|>'+message['role']+'\n'+message['content']+'<|im_end|>'+'\n'}}";
    let gen_prompt = "{%ifadd_generation_prompt%}{{'<|im_start|>assistant\n'}}{%endif%}";
    let plain = format!("{{%formessageinmessages%}}{turn}{{%endfor%}}{gen_prompt}");
    let with_sys = format!(
        "{{%formessageinmessages%}}{{%ifloop.firstandmessages[0]['role']!='system'%}}\
         {{{{'<|im_start|>system\n{SYS}<|im_end|>\n'}}}}{{%endif%}}{turn}{{%endfor%}}{gen_prompt}"
    );
    vec![(plain, false), (with_sys, true)]
}

impl ChatTemplate {
    /// The template in `tokenizer.chat_template`; errors name the file and key.
    pub fn from_gguf(g: &GgufFile) -> Result<ChatTemplate> {
        let text = g.get_str("tokenizer.chat_template")?;
        ChatTemplate::recognize(text).map_err(|reason| {
            Error::format(
                g.path(),
                "metadata key 'tokenizer.chat_template' value",
                reason,
            )
        })
    }

    /// Recognizes a template given as text; `source` names where it came from in errors.
    pub fn parse(text: &str, source: impl Into<PathBuf>) -> Result<ChatTemplate> {
        let source: PathBuf = source.into();
        ChatTemplate::recognize(text)
            .map_err(|reason| Error::format(source.as_path(), "chat template", reason))
    }

    fn recognize(text: &str) -> std::result::Result<ChatTemplate, String> {
        let unrecognized = |why: &str| {
            let head: String = text.chars().take(60).collect();
            format!(
                "unrecognized chat template ({why}; supported: ChatML, ChatML with a default \
                 system prompt); it begins: {head:?}"
            )
        };
        let canon = canonical(text).map_err(|e| unrecognized(&e))?;
        for (form, has_sys) in known() {
            if !has_sys {
                if canon == form {
                    return Ok(ChatTemplate {
                        family: ChatFamily::ChatMl {
                            default_system: None,
                        },
                        source: text.to_string(),
                    });
                }
                continue;
            }
            let (pre, post) = form.split_once(SYS).expect("form has the placeholder");
            if canon.len() >= pre.len() + post.len()
                && canon.starts_with(pre)
                && canon.ends_with(post)
            {
                let sys = &canon[pre.len()..canon.len() - post.len()];
                if !sys.contains('\'') {
                    return Ok(ChatTemplate {
                        family: ChatFamily::ChatMl {
                            default_system: Some(sys.to_string()),
                        },
                        source: text.to_string(),
                    });
                }
            }
        }
        Err(unrecognized("no known family matches"))
    }

    pub fn family(&self) -> &ChatFamily {
        &self.family
    }

    /// The template text as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn default_system_prompt(&self) -> Option<&str> {
        match &self.family {
            ChatFamily::ChatMl { default_system } => default_system.as_deref(),
        }
    }

    /// The prompt for `messages`; `add_generation_prompt` opens the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        Ok(self.render_spans(messages, add_generation_prompt)?.0)
    }

    /// [`ChatTemplate::render`], with the byte ranges of the text that came from the messages
    /// (roles and contents, in order): what a tokenizer should keep as literal text, so that
    /// control tokens come only from the template's markup
    /// ([`crate::tokenizer::BpeTokenizer::encode_with_literals`]).
    pub fn render_spans(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<(String, Vec<std::ops::Range<usize>>)> {
        let ChatFamily::ChatMl { default_system } = &self.family;
        let mut out = String::new();
        let mut spans = Vec::new();
        let mut literal = |out: &mut String, text: &str| {
            let start = out.len();
            out.push_str(text);
            if !text.is_empty() {
                spans.push(start..out.len());
            }
        };
        for (i, m) in messages.iter().enumerate() {
            if i == 0
                && messages[0].role != "system"
                && let Some(sys) = default_system
            {
                out.push_str("<|im_start|>system\n");
                out.push_str(sys);
                out.push_str("<|im_end|>\n");
            }
            out.push_str("<|im_start|>");
            literal(&mut out, &m.role);
            out.push('\n');
            literal(&mut out, &m.content);
            out.push_str("<|im_end|>\n");
        }
        if add_generation_prompt {
            out.push_str("<|im_start|>assistant\n");
        }
        Ok((out, spans))
    }
}

/// The canonical form described in the module docs; an error for an unterminated tag or
/// string.
fn canonical(t: &str) -> std::result::Result<String, String> {
    let mut out = String::new();
    let mut rest = t;
    // Whether the previous tag asked to trim what follows it ("-%}"), and whether it was a
    // block tag (trim_blocks removes one newline after it).
    let mut trim_next = false;
    let mut after_block = false;
    loop {
        let next = ["{%", "{{", "{#"]
            .iter()
            .filter_map(|o| rest.find(o).map(|p| (p, *o)))
            .min();
        let (pos, open) = match next {
            Some(x) => x,
            None => (rest.len(), ""),
        };
        let mut lit = &rest[..pos];
        if trim_next {
            lit = lit.trim_start();
        } else if after_block {
            lit = lit.strip_prefix('\n').unwrap_or(lit);
        }
        if open.is_empty() {
            out.push_str(lit);
            return Ok(out);
        }
        let after_open = &rest[pos + 2..];
        let trim_before = after_open.starts_with('-');
        if trim_before {
            lit = lit.trim_end();
        } else if open == "{%" {
            // lstrip_blocks: spaces and tabs between a line start and a block tag.
            let stripped = lit.trim_end_matches([' ', '\t']);
            let at_line_start = out.is_empty() || out.ends_with('\n');
            if stripped.ends_with('\n') || (stripped.is_empty() && at_line_start) {
                lit = stripped;
            }
        }
        out.push_str(lit);
        let close = match open {
            "{%" => "%}",
            "{{" => "}}",
            _ => "#}",
        };
        let (body, consumed) = tag_body(after_open, close)?;
        let mut body = body.strip_prefix('-').unwrap_or(body);
        trim_next = body.ends_with('-');
        if trim_next {
            body = &body[..body.len() - 1];
        }
        after_block = open != "{{";
        if open != "{#" {
            out.push_str(open);
            squeeze(body, &mut out)?;
            out.push_str(close);
        }
        rest = &after_open[consumed..];
    }
}

/// The body of a tag up to `close` (outside string literals) and the bytes consumed.
fn tag_body<'a>(s: &'a str, close: &str) -> std::result::Result<(&'a str, usize), String> {
    let mut quote = None;
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match quote {
            Some(q) => {
                if c == '\\' {
                    chars.next();
                } else if c == q {
                    quote = None;
                }
            }
            None if c == '\'' || c == '"' => quote = Some(c),
            None if s[i..].starts_with(close) => return Ok((&s[..i], i + close.len())),
            None => {}
        }
    }
    Err(format!("a tag is not closed with {close}"))
}

/// A tag body without whitespace outside strings, strings unescaped and single-quoted.
fn squeeze(body: &str, out: &mut String) -> std::result::Result<(), String> {
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        if c == '\'' || c == '"' {
            out.push('\'');
            loop {
                match chars.next() {
                    None => return Err("a string literal is not closed".into()),
                    Some(x) if x == c => break,
                    Some('\\') => match chars.next() {
                        Some('n') => out.push('\n'),
                        Some('t') => out.push('\t'),
                        Some(e) => out.push(e),
                        None => return Err("a string literal is not closed".into()),
                    },
                    Some(x) => out.push(x),
                }
            }
            out.push('\'');
        } else if !c.is_whitespace() {
            out.push(c);
        }
    }
    Ok(())
}

/// Where a template came from, for callers that only have text.
pub fn unnamed_source() -> &'static Path {
    Path::new("<chat template>")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_chatml_with_spacing_and_trim_markers() {
        let t = "{%- for message in messages -%}\n  {{- \"<|im_start|>\" + message['role'] + \
                 '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}\n{%- endfor %}\
                 {% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
        let ct = ChatTemplate::parse(t, unnamed_source()).unwrap();
        assert_eq!(ct.default_system_prompt(), None);
        let out = ct.render(&[ChatMessage::new("user", "hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn unknown_template_error_quotes_its_start() {
        let t = "{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}";
        let e = ChatTemplate::parse(t, unnamed_source())
            .unwrap_err()
            .to_string();
        assert!(e.contains("unrecognized chat template"), "{e}");
        assert!(e.contains("[INST]"), "{e}");
    }
}
