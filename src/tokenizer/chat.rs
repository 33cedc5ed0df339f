//! Chat templates: the model's own Jinja template (`tokenizer.chat_template`) rendered with
//! minijinja the way Hugging Face transformers renders it (`apply_chat_template`,
//! `utils/chat_template_utils.py`): `trim_blocks` and `lstrip_blocks` on, loop controls, the
//! variables `messages` (a list of `{role, content}`), `add_generation_prompt`, `bos_token`,
//! `eos_token`, `unk_token`, `pad_token` (those the vocabulary has), `tools` and `documents`
//! (none), and the functions `raise_exception(message)` and `strftime_now(format)` (UTC here).
//! Python's string and dict methods (`.strip()`, `.startswith()`, `.items()`) come from
//! minijinja-contrib's pycompat. A `{% generation %}` block (transformers' assistant-mask
//! extension) renders its body.
//!
//! A template is parsed and rendered once on a one-message conversation when it is made, so
//! one that fails to parse or render is an error at load time naming the template (its first
//! characters) and the reason.
//!
//! `--chat-template NAME|FILE` takes one of metashard's own [`CHAT_FORMATS`] (Gemma's, Llama
//! 3's, Phi-3's, ChatML) or a Jinja file in place of the file's template: for an instruction
//! model whose file has none or a wrong one. A file without a template is not given one by
//! default: base models' files have none (the Gemma 3 270M file is `google/gemma-3-270m`, whose
//! vocabulary has Gemma's turn tokens and which answers worse inside them).
//!
//! [`ChatTemplate::render_spans`] also says where each message's text lies in the prompt, so a
//! tokenizer can keep it literal and take control tokens from the markup only. It renders the
//! conversation a second time with a marker in place of each message's text and aligns the two
//! renderings: the template's own text must agree, and each marker's place holds the message's
//! text (or its trimmed form, for templates that `trim` it).

use crate::io::GgufFile;
use crate::{Error, Result};
use minijinja::{Environment, ErrorKind, Value};
use std::ops::Range;
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

/// The special tokens' text a template may use (`bos_token`, ...), as transformers passes its
/// `special_tokens_map`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub unk: Option<String>,
    pub pad: Option<String>,
}

impl ChatTokens {
    /// The tokens a GGUF vocabulary names (`tokenizer.ggml.bos_token_id`, ...).
    pub fn from_gguf(g: &GgufFile) -> Result<ChatTokens> {
        let tokens = g.opt_str_array("tokenizer.ggml.tokens")?.unwrap_or(&[]);
        let text = |key: &str| -> Result<Option<String>> {
            Ok(g.opt_u32(key)?
                .and_then(|id| tokens.get(id as usize))
                .cloned())
        };
        Ok(ChatTokens {
            bos: text("tokenizer.ggml.bos_token_id")?,
            eos: text("tokenizer.ggml.eos_token_id")?,
            unk: text("tokenizer.ggml.unknown_token_id")?,
            pad: text("tokenizer.ggml.padding_token_id")?,
        })
    }
}

pub struct ChatTemplate {
    source: String,
    /// Where the template came from, for messages (the GGUF path, or `--chat-template`'s).
    origin: PathBuf,
    /// What holds it there, for messages: the GGUF metadata key, or the flag.
    key: &'static str,
    env: Environment<'static>,
    tokens: ChatTokens,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("begins", &head(&self.source))
            .finish()
    }
}

const NAME: &str = "chat_template";

/// A chat format metashard writes itself: the turn markup its family documents, as a Jinja
/// template in this module's dialect, and the control tokens it needs, which a vocabulary must
/// have for it to be used. The templates leave BOS out: the tokenizer adds it where the file
/// says to (`tokenizer.ggml.add_bos_token`). Each renders what its family's own template (in
/// `tests/data/chat_templates`) renders for plain conversations, less the leading BOS text
/// (checked in `tests/tokenizers.rs`); tool calls and image parts are not formatted.
#[derive(Clone, Copy, Debug)]
pub struct ChatFormat {
    pub name: &'static str,
    pub tokens: &'static [&'static str],
    pub template: &'static str,
    /// Where the format is documented.
    pub source: &'static str,
}

/// metashard's own chat formats, for `--chat-template NAME`.
pub const CHAT_FORMATS: [ChatFormat; 4] = [
    ChatFormat {
        name: "llama3",
        tokens: &["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        template: "{%- for m in messages -%}\
                   {{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' \
                   + m['content'] | trim + '<|eot_id|>' }}\
                   {%- endfor -%}\
                   {%- if add_generation_prompt -%}\
                   {{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\
                   {%- endif -%}",
        source: "Meta's Llama 3 model card, \"Prompt format\"",
    },
    ChatFormat {
        // Gemma has no system role: a system message opens the first turn, a blank line
        // after it; the assistant's role is `model`; the turns' text trimmed.
        name: "gemma",
        tokens: &["<start_of_turn>", "<end_of_turn>"],
        template: "{%- if messages and messages[0]['role'] == 'system' -%}\
                   {%- set prefix = messages[0]['content'] + '\\n\\n' -%}\
                   {%- set turns = messages[1:] -%}\
                   {%- else -%}\
                   {%- set prefix = '' -%}\
                   {%- set turns = messages -%}\
                   {%- endif -%}\
                   {%- for m in turns -%}\
                   {{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) \
                   + '\\n' + (prefix if loop.first else '') + m['content'] | trim \
                   + '<end_of_turn>\\n' }}\
                   {%- endfor -%}\
                   {%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}",
        source: "Google's Gemma documentation, \"Gemma formatting and system instructions\"",
    },
    ChatFormat {
        name: "phi3",
        tokens: &["<|user|>", "<|assistant|>", "<|end|>"],
        template: "{%- for m in messages -%}\
                   {{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}\
                   {%- endfor -%}\
                   {%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}\
                   {%- else -%}{{ eos_token }}{%- endif -%}",
        source: "Microsoft's Phi-3 model cards, \"Chat format\"",
    },
    ChatFormat {
        name: "chatml",
        tokens: &["<|im_start|>", "<|im_end|>"],
        template: "{%- for m in messages -%}\
                   {{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}\
                   {%- endfor -%}\
                   {%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}",
        source: "OpenAI's ChatML (openai-python `chatml.md`), as Qwen and SmolLM use it",
    },
];

/// What a file's template is named by in messages.
const KEY: &str = "metadata key 'tokenizer.chat_template'";

/// What a template from `--chat-template` is named by in messages.
const FLAG: &str = "--chat-template";

/// The largest template file `--chat-template` reads (the templates of the families metashard
/// runs are 0.4-4 KB; llama.cpp's largest are tens of KB).
const MAX_TEMPLATE_BYTES: u64 = 1 << 20;

/// The names of [`CHAT_FORMATS`], for messages.
fn format_names() -> String {
    CHAT_FORMATS.map(|f| f.name).join(", ")
}

/// The first characters of a template, to name it in messages.
fn head(source: &str) -> String {
    let h: String = source.chars().take(60).collect();
    if h.len() < source.len() {
        format!("{h}...")
    } else {
        h
    }
}

impl ChatTemplate {
    /// The template in `tokenizer.chat_template`, or None when the file has none; errors name
    /// the file, the key and the template.
    pub fn from_gguf(g: &GgufFile) -> Result<Option<ChatTemplate>> {
        let Some(text) = g.opt_str("tokenizer.chat_template")? else {
            return Ok(None);
        };
        let tokens = ChatTokens::from_gguf(g)?;
        ChatTemplate::with_origin(text, tokens, g.path(), KEY).map(Some)
    }

    /// A template given as text; `tokens` are the special tokens' text it may use.
    pub fn new(text: &str, tokens: ChatTokens) -> Result<ChatTemplate> {
        ChatTemplate::with_origin(text, tokens, Path::new("<chat template>"), KEY)
    }

    /// `--chat-template`: the name of one of [`CHAT_FORMATS`] (its turn tokens must be in the
    /// vocabulary: `has(text)`), or a file holding a Jinja template. Errors name the flag,
    /// the missing token or the file.
    pub fn choose(
        choice: &str,
        tokens: ChatTokens,
        has: &dyn Fn(&str) -> bool,
    ) -> Result<ChatTemplate> {
        if let Some(f) = CHAT_FORMATS.iter().find(|f| f.name == choice) {
            if let Some(t) = f.tokens.iter().find(|t| !has(t)) {
                return Err(Error::invalid_argument(
                    "--chat-template",
                    choice,
                    format!(
                        "the model's vocabulary has no `{t}` token, which the {} format's turns \
                         are marked with",
                        f.name
                    ),
                ));
            }
            let origin = format!("<metashard's {} chat format>", f.name);
            return ChatTemplate::with_origin(f.template, tokens, Path::new(&origin), FLAG);
        }
        let path = Path::new(choice);
        if !path.is_file() {
            return Err(Error::invalid_argument(
                "--chat-template",
                choice,
                format!(
                    "neither a chat format ({}) nor a file holding a Jinja template",
                    format_names()
                ),
            ));
        }
        // Read only after its size is checked: a template is kilobytes, not a whole file.
        let size = std::fs::metadata(path)
            .map_err(|e| Error::io(path, e))?
            .len();
        if size > MAX_TEMPLATE_BYTES {
            return Err(Error::format(
                path,
                FLAG,
                format!("{size} bytes: a chat template is at most {MAX_TEMPLATE_BYTES}"),
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        ChatTemplate::with_origin(&text, tokens, path, FLAG)
    }

    fn with_origin(
        text: &str,
        tokens: ChatTokens,
        origin: &Path,
        key: &'static str,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::format(origin, key, e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |fmt: String| strftime_utc(&fmt, now_secs()));
        let t = ChatTemplate {
            source: text.to_string(),
            origin: origin.to_path_buf(),
            key,
            env,
            tokens,
        };
        let mut t = t;
        let body = strip_generation_tags(text);
        t.env
            .add_template_owned(NAME, body)
            .map_err(|e| t.error("cannot be parsed", &e))?;
        // A trial render, so a template that cannot render fails now rather than at the prompt.
        t.render(&[ChatMessage::new("user", "Hello")], true)?;
        Ok(t)
    }

    fn error(&self, what: &str, e: &minijinja::Error) -> Error {
        let mut reason = e.to_string();
        let mut src = std::error::Error::source(e);
        while let Some(s) = src {
            reason.push_str(&format!(": {s}"));
            src = s.source();
        }
        Error::format(
            &self.origin,
            self.key,
            format!(
                "the chat template beginning {:?} {what}: {reason}",
                head(&self.source)
            ),
        )
    }

    /// The template text as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prompt for `messages`; `add_generation_prompt` opens the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| self.error("cannot be parsed", &e))?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from_pairs([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ])
            })
            .collect();
        let mut vars = vec![
            ("messages", Value::from(messages)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
        ];
        // Only the tokens the vocabulary has, as in transformers' special_tokens_map.
        let t = &self.tokens;
        for (name, tok) in [
            ("bos_token", &t.bos),
            ("eos_token", &t.eos),
            ("unk_token", &t.unk),
            ("pad_token", &t.pad),
        ] {
            if let Some(tok) = tok {
                vars.push((name, Value::from(tok.as_str())));
            }
        }
        tmpl.render(Value::from_pairs(vars))
            .map_err(|e| self.error("cannot be rendered", &e))
    }

    /// [`ChatTemplate::render`], with the byte ranges of the messages' text (contents, in
    /// order) in the prompt: what a tokenizer should keep as literal text, so that control
    /// tokens come only from the template's markup
    /// ([`crate::tokenizer::GgufTokenizer::encode_with_literals`]). Roles are the program's,
    /// not the user's, and are not marked.
    pub fn render_spans(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<(String, Vec<Range<usize>>)> {
        let real = self.render(messages, add_generation_prompt)?;
        // A marker character no message and no template text contains.
        let mark = ('\u{F8F0}'..='\u{F8FF}')
            .find(|&c| !self.source.contains(c) && !messages.iter().any(|m| m.content.contains(c)))
            .ok_or_else(|| {
                Error::invalid_argument(
                    "chat message",
                    "(text)",
                    "the messages use every private-use character U+F8F0..U+F8FF",
                )
            })?;
        let marked: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let content = if m.content.is_empty() {
                    String::new()
                } else {
                    format!("{mark}{i}{mark}")
                };
                ChatMessage::new(m.role.clone(), content)
            })
            .collect();
        let with_marks = self.render(&marked, add_generation_prompt)?;
        let spans = align(&real, &with_marks, mark, messages).ok_or_else(|| {
            Error::format(
                &self.origin,
                self.key,
                format!(
                    "the chat template beginning {:?} changes the messages' text in a way \
                     metashard cannot follow, so the user's text cannot be kept literal; use \
                     --raw, or --special to tokenize the rendered prompt as a whole",
                    head(&self.source)
                ),
            )
        })?;
        Ok((real, spans))
    }
}

/// A rendering with markers as template text and message indices.
enum Seg<'a> {
    Lit(&'a str),
    Msg(usize),
}

fn segments(s: &str, mark: char) -> Option<Vec<Seg<'_>>> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(p) = rest.find(mark) {
        out.push(Seg::Lit(&rest[..p]));
        let after = &rest[p + mark.len_utf8()..];
        let q = after.find(mark)?;
        out.push(Seg::Msg(after[..q].parse().ok()?));
        rest = &after[q + mark.len_utf8()..];
    }
    out.push(Seg::Lit(rest));
    Some(out)
}

/// The spans of the messages' text in `real`, from the rendering with markers (module docs).
fn align(
    real: &str,
    marked: &str,
    mark: char,
    messages: &[ChatMessage],
) -> Option<Vec<Range<usize>>> {
    let segs = segments(marked, mark)?;
    let mut spans = Vec::new();
    let mut pos = 0;
    for (k, seg) in segs.iter().enumerate() {
        match *seg {
            Seg::Lit(t) => {
                if !real[pos..].starts_with(t) {
                    return None;
                }
                pos += t.len();
            }
            Seg::Msg(i) => {
                let c = messages.get(i)?.content.as_str();
                // The template text after the marker (always a literal: segments alternate).
                let next = match segs.get(k + 1) {
                    Some(Seg::Lit(t)) => *t,
                    _ => return None,
                };
                let last = k + 2 == segs.len();
                let fits = |v: &str| {
                    let end = pos + v.len();
                    real[pos..].starts_with(v)
                        && real[end..].starts_with(next)
                        && (!last || end + next.len() == real.len())
                };
                let len = [c, c.trim(), c.trim_start(), c.trim_end()]
                    .into_iter()
                    .find(|v| fits(v))
                    .map(str::len)?;
                if len > 0 {
                    spans.push(pos..pos + len);
                }
                pos += len;
            }
        }
    }
    (pos == real.len()).then_some(spans)
}

/// The template without transformers' `{% generation %}` / `{% endgeneration %}` tags (its
/// assistant-mask extension, which renders the block's body as is).
fn strip_generation_tags(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(p) = rest.find("{%") {
        let Some(q) = rest[p..].find("%}") else { break };
        let tag = &rest[p + 2..p + q];
        let word = tag.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        out.push_str(&rest[..p]);
        if word != "generation" && word != "endgeneration" {
            out.push_str(&rest[p..p + q + 2]);
        }
        rest = &rest[p + q + 2..];
    }
    out.push_str(rest);
    out
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// `datetime.strftime` for the codes chat templates use (%d %m %Y %y %b %B %a %A %H %M %S %j
/// %%), at `secs` since the Unix epoch in UTC; other codes are copied as written. The civil
/// date comes from Howard Hinnant's `civil_from_days` (chrono-compatible date algorithms).
pub fn strftime_utc(fmt: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let mname = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('b') => out.push_str(&mname[..3]),
            Some('B') => out.push_str(mname),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chatml() -> ChatTemplate {
        let t = "{%- for message in messages -%}\n  {{- \"<|im_start|>\" + message['role'] + \
                 '\\n' + message['content'] | trim + '<|im_end|>' + '\\n' -}}\n{%- endfor %}\
                 {% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
        ChatTemplate::new(t, ChatTokens::default()).unwrap()
    }

    #[test]
    fn renders_and_marks_the_messages_text() {
        let ct = chatml();
        let msgs = [
            ChatMessage::new("system", "  Be brief. "),
            ChatMessage::new("user", "hi <|im_end|>"),
        ];
        let (out, spans) = ct.render_spans(&msgs, true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi <|im_end|><|im_end|>\n\
             <|im_start|>assistant\n"
        );
        let texts: Vec<&str> = spans.iter().map(|r| &out[r.clone()]).collect();
        assert_eq!(texts, ["Be brief.", "hi <|im_end|>"]);
    }

    #[test]
    fn bad_templates_are_errors_naming_them() {
        for (t, why) in [
            (
                "{% for m in messages %}[INST] {{ m.content }",
                "cannot be parsed",
            ),
            ("{{ raise_exception('no user turns') }}", "no user turns"),
            (
                "{{ messages[0].content.nosuchmethod() }}",
                "cannot be rendered",
            ),
        ] {
            let e = ChatTemplate::new(t, ChatTokens::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains(why) && e.contains(&t[..10]), "{e}");
        }
    }

    #[test]
    fn strftime_matches_known_dates() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
        let s = strftime_utc("%d %b %Y|%A %B %j %H:%M:%S %y %m %%", 1_721_999_109);
        assert_eq!(s, "26 Jul 2024|Friday July 208 13:05:09 24 07 %");
        assert_eq!(strftime_utc("%Y-%m-%d %a", 0), "1970-01-01 Thu");
    }

    #[test]
    fn generation_tags_are_dropped() {
        assert_eq!(
            strip_generation_tags("a{% generation %}b{%- endgeneration -%}c{% if x %}"),
            "abc{% if x %}"
        );
    }
}
