//! Decoders from GGUF files ([`DecoderModel::load`]): the architecture and hyper-parameters
//! from the metadata (`hparams.rs`), every tensor of the file checked against the
//! architecture's table before anything is placed (an unknown tensor, a missing required one,
//! a wrong shape or an element type metashard cannot run is an error naming it), the weights
//! placed in any buffer type (a meta buffer scatters them to the devices as they are placed),
//! the tokenizer the file names (byte-level BPE or SentencePiece-style) and its own chat
//! template (a template that cannot be parsed or rendered is an error naming it). A file
//! with llama.cpp's older per-expert tensors reads as one with the 3-D expert tensors
//! (`legacy_experts.rs`).
//!
//! With virtual KV heads ([`LoadOptions::kv_repeat`]) each KV head's rows of K, V and their
//! biases are placed `r` times (`weights::repeat_kv_rows`, a byte copy).
//!
//! When the output projection is tied to the token embedding (no `output.weight`), the
//! embedding's bytes are placed a second time as `output.weight`, so the embedding can stay
//! mirrored for the row lookup while the output projection is vocabulary-split; where both
//! lie alike ([`LoadOptions::share_tied`]) the output is another name of the same bytes.

use super::arch::{Arch, Need, Scope, Tensor};
use super::hparams::{DecoderConfig, config_from_gguf, context_length_from_gguf};
use super::weights::{
    KvRepeat, ModelWeights, TensorDecl, decoder_layouts, place_decoder_shared, repeat_kv_decl,
    repeat_kv_rows,
};
use crate::buffer::{Buffer, BufferType};
use crate::io::gguf::{GgufFile, GgufTensorInfo};
use crate::tokenizer::chat::{ChatTemplate, ChatTokens};
use crate::tokenizer::{GgufTokenizer, Tokenizer};
use crate::{DType, Error, Result};
use std::path::Path;
use std::sync::Arc;

/// How [`DecoderModel::load_with`] places a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Copies of each KV head (`DecoderConfig::with_kv_repeat`: the model's configuration
    /// says `n_head_kv * kv_repeat` KV heads, and K, V and their biases are placed with each
    /// head's rows copied; virtual KV heads). 1: none.
    pub kv_repeat: usize,
    /// A tied output projection takes the embedding's bytes instead of a copy of them: right
    /// when both lie alike on the devices (one device; both split by vocabulary or both
    /// mirrored), never on the scheduler (it places them on different backends by name).
    pub share_tied: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            kv_repeat: 1,
            share_tied: false,
        }
    }
}

/// A loaded decoder.
pub struct DecoderModel {
    pub name: String,
    pub cfg: DecoderConfig,
    pub weights: ModelWeights,
    pub weight_buffer: Arc<dyn Buffer>,
    pub tokenizer: GgufTokenizer,
    /// The file's chat template (none: the prompt is fed raw, as a base model's files have
    /// none); `--chat-template` sets or replaces it ([`DecoderModel::choose_chat`]).
    pub chat: Option<ChatTemplate>,
    /// The special tokens' text a chat template may use (`bos_token`, ...).
    pub chat_tokens: ChatTokens,
    pub context_length: usize,
    /// Bytes of all weights as stored (the tied output counted once).
    pub weight_bytes: usize,
    /// Bytes of the memory-mapped file's tensor data this process touched while placing the
    /// weights (resident file pages before and after, Linux only): with ranks as processes,
    /// about the rank's own slices plus the mirrored tensors.
    pub file_bytes_read: Option<u64>,
}

fn model_err(g: &GgufFile, reason: String) -> Error {
    Error::Model {
        model: g.path().display().to_string(),
        reason,
    }
}

/// An error unless every tensor of the file is one the architecture has, in a layer the
/// model has: a tensor metashard would not use is refused by name rather than ignored.
fn check_known_tensors(g: &GgufFile, cfg: &DecoderConfig) -> Result<()> {
    let arch = cfg.arch;
    for t in g.tensors() {
        match arch.parse(&t.name) {
            Some((tensor, layer)) if tensor.scope() != Scope::Cache => {
                if layer.is_some_and(|l| l >= cfg.n_layer) {
                    return Err(model_err(
                        g,
                        format!(
                            "tensor `{}` is beyond the {} layers of the model",
                            t.name, cfg.n_layer
                        ),
                    ));
                }
            }
            _ => {
                return Err(model_err(
                    g,
                    format!(
                        "tensor `{}` is not part of the `{}` architecture as metashard runs it \
                         (known: {})",
                        t.name,
                        arch.name,
                        known_names(arch)
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The tensor names an architecture has, for messages (`blk.N.` for per-layer ones).
fn known_names(arch: &Arch) -> String {
    arch.tensor_list()
        .map(|(t, _)| match t.scope() {
            Scope::Model => arch.name(t, 0),
            _ => arch.name(t, 0).replacen("blk.0.", "blk.N.", 1),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The element type metashard runs a file tensor in, or an error naming the tensor and its
/// ggml type.
fn dtype_of(g: &GgufFile, t: &GgufTensorInfo) -> Result<DType> {
    t.dtype.ok_or_else(|| {
        model_err(
            g,
            format!(
                "tensor `{}` has ggml type {}, which metashard cannot run (supported: {})",
                t.name,
                t.type_label(),
                DType::WEIGHT_TYPES
                    .iter()
                    .map(|d| d.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    })
}

/// The file tensor holding the bytes of a declared tensor: its own, or for a tied tensor
/// absent from the file, the one it is tied to.
fn source<'g>(g: &'g GgufFile, cfg: &DecoderConfig, d: &TensorDecl) -> Result<&'g GgufTensorInfo> {
    if let Some(t) = g.tensor(&d.name) {
        return Ok(t);
    }
    let tied = match cfg.arch.need(d.tensor) {
        Some(Need::TiedTo(to)) => g.tensor(&cfg.arch.name(to, d.layer.unwrap_or(0))),
        _ => None,
    };
    tied.ok_or_else(|| model_err(g, format!("tensor `{}` is missing", d.name)))
}

/// Whether the output projection of a file of `cfg` is the token embedding (tied: the
/// architecture allows it and the file has no output tensor of its own).
pub fn output_tied(g: &GgufFile, cfg: &DecoderConfig) -> bool {
    matches!(cfg.arch.need(Tensor::Output), Some(Need::TiedTo(_)))
        && g.tensor(&cfg.arch.name(Tensor::Output, 0)).is_none()
}

/// What the model places, each with the file tensor its bytes come from, checked: shapes as
/// the metadata implies, norms and biases in F32, element types metashard runs.
fn declare<'g>(
    g: &'g GgufFile,
    cfg: &DecoderConfig,
) -> Result<(Vec<TensorDecl>, Vec<&'g GgufTensorInfo>)> {
    let arch = cfg.arch;
    let file_dtype = |t: Tensor, l: Option<usize>| -> Result<DType> {
        let d = TensorDecl {
            name: arch.name(t, l.unwrap_or(0)),
            tensor: t,
            layer: l,
            layout: crate::tensor::Layout::contiguous(DType::F32, [1, 1, 1, 1]),
        };
        dtype_of(g, source(g, cfg, &d)?)
    };
    // Types are looked up first (an unknown type is named before any shape check).
    let mut types = std::collections::HashMap::new();
    for (t, need) in arch.tensor_list() {
        let layers: Vec<Option<usize>> = match t.scope() {
            Scope::Model => vec![None],
            _ => (0..cfg.n_layer).map(Some).collect(),
        };
        for l in layers {
            let present = g.tensor(&arch.name(t, l.unwrap_or(0))).is_some();
            if need == Need::Optional && !present {
                continue;
            }
            types.insert((t, l), file_dtype(t, l)?);
        }
    }
    let decls = decoder_layouts(
        cfg,
        &|t, l| types.get(&(t, l)).copied().unwrap_or(DType::F32),
        &|t, l| g.tensor(&arch.name(t, l.unwrap_or(0))).is_some(),
    )?;
    let mut sources = Vec::with_capacity(decls.len());
    for d in &decls {
        let src = source(g, cfg, d)?;
        if src.ne != d.layout.ne {
            return Err(model_err(
                g,
                format!(
                    "tensor `{}` has shape {} but the metadata implies {}",
                    src.name,
                    crate::Shape(src.ne),
                    crate::Shape(d.layout.ne)
                ),
            ));
        }
        let dtype = dtype_of(g, src)?;
        if d.tensor.is_vector() && dtype != DType::F32 {
            let what = if d.name.ends_with(".bias") {
                "bias"
            } else {
                "norm"
            };
            return Err(model_err(
                g,
                format!("{what} `{}` is {dtype}, expected f32", src.name),
            ));
        }
        sources.push(src);
    }
    Ok((decls, sources))
}

/// The tensors a GGUF decoder of `cfg` places, with their types as the file stores them,
/// checked as the loader checks them (before anything is read): what the split callbacks need
/// to keep whole blocks of every tensor.
pub fn file_tensors(g: &GgufFile, cfg: &DecoderConfig) -> Result<Vec<TensorDecl>> {
    check_known_tensors(g, cfg)?;
    Ok(declare(g, cfg)?.0)
}

/// Whether `text` is one special token of the vocabulary (a chat format's turn marker).
fn one_token(t: &GgufTokenizer, text: &str) -> bool {
    t.encode_with(text, false, true).is_ok_and(|ids| {
        ids.len() == 1 && t.token_type(ids[0]) != crate::tokenizer::TOKEN_TYPE_NORMAL
    })
}

impl DecoderModel {
    /// `--chat-template NAME|FILE`: one of metashard's chat formats or a Jinja file in place of
    /// the file's template ([`ChatTemplate::choose`]).
    pub fn choose_chat(&mut self, choice: &str) -> Result<()> {
        let t = &self.tokenizer;
        self.chat = Some(ChatTemplate::choose(
            choice,
            self.chat_tokens.clone(),
            &|text| one_token(t, text),
        )?);
        Ok(())
    }

    /// Load a GGUF decoder, placing its weights in `bt`; `progress(done_bytes, total_bytes)` is
    /// called as tensors are placed.
    pub fn load(
        path: &Path,
        bt: &dyn BufferType,
        progress: &dyn Fn(usize, usize),
    ) -> Result<DecoderModel> {
        Self::load_with(path, bt, &LoadOptions::default(), progress)
    }

    /// [`DecoderModel::load`] as `opts` says: each KV head repeated, the tied output sharing
    /// the embedding's bytes; `progress` counts the file's bytes.
    pub fn load_with(
        path: &Path,
        bt: &dyn BufferType,
        opts: &LoadOptions,
        progress: &dyn Fn(usize, usize),
    ) -> Result<DecoderModel> {
        let kv_repeat = opts.kv_repeat.max(1);
        let g = super::legacy_experts::open_gguf(path)?;
        let file_cfg = config_from_gguf(&g)?;
        check_known_tensors(&g, &file_cfg)?;
        let (file_decls, sources) = declare(&g, &file_cfg)?;
        let total: usize = file_decls.iter().map(|d| d.layout.nbytes()).sum();
        let cfg = file_cfg.with_kv_repeat(kv_repeat)?;
        let kv = KvRepeat {
            r: kv_repeat,
            n_head_kv: file_cfg.n_head_kv,
            head_dim: file_cfg.head_dim,
        };
        let decls: Vec<TensorDecl> = file_decls.iter().map(|d| repeat_kv_decl(d, kv)).collect();
        // A tied output (its bytes the embedding's) placed as another name of them.
        let shared: Vec<(usize, usize)> = match opts.share_tied {
            true => (0..decls.len())
                .filter(|&i| sources[i].name != decls[i].name)
                .filter_map(|i| {
                    let j = decls.iter().position(|d| d.name == sources[i].name)?;
                    Some((i, j))
                })
                .collect(),
            false => Vec::new(),
        };
        let (buf, refs, weights) = place_decoder_shared(&cfg, &decls, bt, &shared)?;
        let rss_before = crate::io::rss_file_bytes();
        let mut done = 0;
        for (i, ((r, src), fd)) in refs.iter().zip(&sources).zip(&file_decls).enumerate() {
            done += fd.layout.nbytes();
            if shared.iter().any(|&(s, _)| s == i) {
                progress(done, total);
                continue;
            }
            let data = g.tensor_bytes(src)?;
            if r.layout == fd.layout {
                r.storage.set(&r.layout, &data)?;
            } else {
                let rows = repeat_kv_rows(&r.name, fd.tensor, &fd.layout, kv, &data)?;
                r.storage.set(&r.layout, &rows)?;
            }
            progress(done, total);
        }
        let file_bytes_read = crate::io::rss_file_bytes()
            .zip(rss_before)
            .map(|(a, b)| a.saturating_sub(b));
        let tokenizer = GgufTokenizer::from_gguf(&g)?;
        if tokenizer.vocab_size() != cfg.n_vocab {
            return Err(model_err(
                &g,
                format!(
                    "tokenizer has {} tokens, the output {}",
                    tokenizer.vocab_size(),
                    cfg.n_vocab
                ),
            ));
        }
        // Bytes placed twice (a tied output) are counted once.
        let tied: usize = file_decls
            .iter()
            .zip(&sources)
            .filter(|(d, s)| s.name != d.name)
            .map(|(d, _)| d.layout.nbytes())
            .sum();
        let chat_tokens = ChatTokens::from_gguf(&g)?;
        let chat = ChatTemplate::from_gguf(&g)?;
        Ok(DecoderModel {
            name: g
                .opt_str("general.name")?
                .unwrap_or(cfg.arch.name)
                .to_string(),
            chat,
            chat_tokens,
            context_length: context_length_from_gguf(&g)?,
            cfg,
            weights,
            weight_buffer: buf,
            tokenizer,
            weight_bytes: total - tied,
            file_bytes_read,
        })
    }

    /// Bytes read from weights per generated token (every matrix once; the embedding lookup
    /// reads one row; a mixture of experts' 3-D expert tensors only the `k` of `E` experts the
    /// token is routed to).
    pub fn bytes_per_token(&self) -> usize {
        let (used, experts) = self
            .cfg
            .moe
            .map_or((1, 1), |m| (m.n_expert_used, m.n_expert));
        self.weights
            .iter()
            .map(|(t, r)| match t {
                Tensor::TokenEmbd => r.layout.row_size(),
                _ if t.info().ne2 == super::arch::Dim::Expert => {
                    r.layout.nbytes() / experts.max(1) * used
                }
                _ => r.layout.nbytes(),
            })
            .sum()
    }
}
