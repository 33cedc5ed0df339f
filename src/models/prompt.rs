//! Turning a user's prompt into tokens: through the model's chat template (with an optional
//! system message) unless raw; the user's text literal unless asked otherwise (control tokens
//! come from the chat template's markup).

use super::loader::DecoderModel;
use crate::Result;
use crate::tokenizer::{ChatMessage, Tokenizer};

/// How a prompt becomes tokens.
#[derive(Clone, Copy, Debug, Default)]
pub struct PromptOptions<'a> {
    /// System message for the chat template (the template's default when absent).
    pub system: Option<&'a str>,
    /// Feed the prompt as is, without the chat template.
    pub raw: bool,
    /// Recognize control tokens (`<|im_start|>`, `<|im_end|>`, ...) written in the user's
    /// text (the prompt and the system message). Off by default: the user's text stays text,
    /// so it cannot open or close chat turns; the chat template's own markup gives control
    /// tokens either way.
    pub special: bool,
}

/// Prompt tokens: through the model's chat template (with an optional system message) unless
/// `raw` or the model has none. Control tokens come from the template's markup only, unless
/// `special` (see [`PromptOptions`]).
pub fn prompt_tokens(m: &DecoderModel, prompt: &str, opts: &PromptOptions) -> Result<Vec<u32>> {
    match (&m.chat, opts.raw) {
        (Some(t), false) => {
            let mut msgs = Vec::new();
            if let Some(s) = opts.system {
                msgs.push(ChatMessage::new("system", s));
            }
            msgs.push(ChatMessage::new("user", prompt));
            if opts.special {
                m.tokenizer.encode(&t.render(&msgs, true)?, true)
            } else {
                let (text, user) = t.render_spans(&msgs, true)?;
                m.tokenizer.encode_with_literals(&text, true, &user)
            }
        }
        _ => m.tokenizer.encode_with(prompt, true, opts.special),
    }
}
