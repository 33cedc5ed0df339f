//! Open a GGUF decoder on a device set in one call: resolve the model name, open the devices
//! (one device, or a meta device with the built-in Megatron split or `--tensor-split` ratios),
//! load the weights with a progress callback, and turn a prompt into tokens.

use super::llama::{LlamaModel, config_from_gguf};
use super::paths::{ModelPath, resolve};
use super::split::{SplitOptions, megatron};
use crate::cpu::Precision;
use crate::devices::DeviceSet;
use crate::meta::MetaOptions;
use crate::tokenizer::{ChatMessage, Tokenizer};
use crate::{Error, Result};

/// How to open a decoder.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    pub precision: Precision,
    /// Per-device shares of the split, e.g. `[3.0, 1.0]`; even when absent.
    pub ratios: Option<Vec<f64>>,
    /// Keep attention mirrored on every device instead of head-split.
    pub mirror_attention: bool,
    pub meta: MetaOptions,
}

/// Open `devices` and load the GGUF decoder `model` (`smollm2` or a path) on them.
/// `progress(done, total)` is called with bytes of the file as weights are placed.
pub fn open_decoder(
    model: &str,
    devices: &str,
    opts: &OpenOptions,
    progress: &dyn Fn(usize, usize),
) -> Result<(DeviceSet, LlamaModel)> {
    let ModelPath::Gguf(path) = resolve(model)? else {
        return Err(Error::Model {
            model: model.to_string(),
            reason: "this command needs a GGUF decoder; use `embed` for encoder models".into(),
        });
    };
    let g = crate::io::gguf::GgufFile::open(&path)?;
    let cfg = config_from_gguf(&g)?;
    drop(g);
    let split = SplitOptions {
        ratios: opts.ratios.clone(),
        mirror_attention: opts.mirror_attention,
    };
    let set = DeviceSet::open(devices, opts.precision, opts.meta, |_| {
        megatron(&cfg, split)
    })?;
    let m = LlamaModel::load(&path, set.buffer_type.as_ref(), progress)?;
    Ok((set, m))
}

/// Prompt tokens: through the model's chat template (with an optional system message) unless
/// `raw` or the model has none.
pub fn prompt_tokens(
    m: &LlamaModel,
    prompt: &str,
    system: Option<&str>,
    raw: bool,
) -> Result<Vec<u32>> {
    let text = match (&m.chat, raw) {
        (Some(t), false) => {
            let mut msgs = Vec::new();
            if let Some(s) = system {
                msgs.push(ChatMessage::new("system", s));
            }
            msgs.push(ChatMessage::new("user", prompt));
            t.render(&msgs, true)?
        }
        _ => prompt.to_string(),
    };
    m.tokenizer.encode(&text, true)
}
