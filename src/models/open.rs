//! Open a GGUF decoder on a device set in one call: resolve the model name, open the devices
//! (one device, or a meta device with the built-in Megatron split or `--tensor-split` ratios,
//! or the scheduler for a layer or hybrid split),
//! load the weights with a progress callback, and turn a prompt into tokens (the user's text
//! literal unless asked otherwise: control tokens come from the chat template's markup).

use super::layer_split::SplitMode;
use super::llama::{LlamaModel, config_from_gguf};
use super::paths::{ModelPath, resolve};
use super::split::{DecoderSplit, SplitOptions, megatron, policy};
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
    /// A per-layer assignment (a strategy or a plan) instead of the built-in split; its
    /// layer count must be the model's. Its sequence parallelism becomes the meta device's
    /// state hints.
    pub split: Option<DecoderSplit>,
    pub meta: MetaOptions,
    /// Tensor parallelism (the meta device), or layer / hybrid split on the scheduler.
    pub split_mode: SplitMode,
    /// Device groups of the hybrid split (each a meta device); 2 when absent.
    pub groups: Option<usize>,
    /// How the devices are spread over processes (`Dist::Mpi`: `devices` is this process's
    /// one device, and every process of the MPI job loads its own rank's slices).
    pub dist: crate::dist::Dist,
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
    if opts.split_mode != SplitMode::Tensor {
        if opts.dist != crate::dist::Dist::Local {
            return Err(Error::invalid_argument(
                "--split-mode",
                opts.split_mode.name(),
                "a layer or hybrid split runs in one process; use --split-mode tensor with \
                 --dist mpi",
            ));
        }
        if opts.split.is_some() || opts.mirror_attention {
            return Err(Error::invalid_argument(
                "--split-mode",
                opts.split_mode.name(),
                "--strategy, --plan and --mirror-attention choose a tensor split; use \
                 --split-mode tensor with them",
            ));
        }
        let set = DeviceSet::open_layered(
            devices,
            opts.precision,
            opts.meta,
            &cfg,
            opts.split_mode,
            opts.ratios.as_deref(),
            opts.groups.unwrap_or(2),
        )?;
        let m = LlamaModel::load(&path, set.buffer_type.as_ref(), progress)?;
        return Ok((set, m));
    }
    let split_fn = match &opts.split {
        Some(plan) => {
            if plan.layers.len() != cfg.n_layer {
                return Err(Error::invalid_argument(
                    "split plan",
                    format!("{} layers", plan.layers.len()),
                    format!("the model has {} layers", cfg.n_layer),
                ));
            }
            let mut plan = plan.clone();
            if plan.ratios.is_none() {
                plan.ratios = opts.ratios.clone();
            }
            policy(&cfg, plan)
        }
        None => megatron(
            &cfg,
            SplitOptions {
                ratios: opts.ratios.clone(),
                mirror_attention: opts.mirror_attention,
            },
        )
        .into(),
    };
    let set = DeviceSet::open_dist(devices, opts.dist, opts.precision, opts.meta, |_| split_fn)?;
    let m = LlamaModel::load(&path, set.buffer_type.as_ref(), progress)?;
    Ok((set, m))
}

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
pub fn prompt_tokens(m: &LlamaModel, prompt: &str, opts: &PromptOptions) -> Result<Vec<u32>> {
    match (&m.chat, opts.raw) {
        (Some(t), false) => {
            let mut msgs = Vec::new();
            if let Some(s) = opts.system {
                msgs.push(ChatMessage::new("system", s));
            }
            msgs.push(ChatMessage::new("user", prompt));
            let (text, user) = t.render_spans(&msgs, true)?;
            if opts.special {
                m.tokenizer.encode(&text, true)
            } else {
                m.tokenizer.encode_with_literals(&text, true, &user)
            }
        }
        _ => m.tokenizer.encode_with(prompt, true, opts.special),
    }
}
