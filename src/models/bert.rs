//! The BERT encoder (sentence-transformers models such as all-MiniLM-L6-v2): configuration from
//! `config.json`, weights from `model.safetensors` (named and shaped by the `bert` entry of the
//! architecture table) placed in any buffer type (a meta buffer splits them with
//! [`bert_split`] or any [`by_layer`](super::split::by_layer) assignment), the forward graph for
//! a padded batch, and [`BertEncoder`], which tokenizes, runs and reads the embeddings on any
//! device (a plain one or a meta device the runtime opened).
//!
//! The model, per the BERT paper (post-LayerNorm) and the sentence-transformers module list of
//! the model folder (`modules.json`: Transformer -> Pooling(mean) -> Normalize):
//!
//! ```text
//! x = LN(word[id] + pos[t] + type[type_id])
//! per layer: a = LN(x + (softmax(q kᵀ / sqrt(d) + mask) v) Wo + bo)
//!            x = LN(a + GELU(a Wi + bi) Wd + bd)
//! embedding = L2-normalize(mean of x over the non-padding tokens)
//! ```
//!
//! A safetensors `Linear` weight is row-major `[out, in]`, i.e. ggml `ne = [in, out]`: exactly
//! the layout of `mul_mat`'s first operand, so weights are used as stored.

use super::arch::{BERT, Dim, Mlp, Tensor};
use super::blocks::{self, NormKind};
use super::decoder::{attn_out_name, layer_out_name};
use super::split::{DecoderSplit, LayerSplit, SplitDims, by_layer};
use super::weights::{ModelWeights, TensorDecl, Weights, model_layouts, place};
use crate::backend::{Backend, Device};
use crate::buffer::{Buffer, BufferType, BufferUsage};
use crate::graph::{Graph, TensorId};
use crate::io::{JsonConfig, SafetensorsFile};
use crate::meta::{MetaBuffer, SplitFn};
use crate::op::UnaryOp;
use crate::tokenizer::{BatchEncoding, WordPieceTokenizer};
use crate::{DType, Error, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Hyper-parameters of a BERT encoder (`config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct BertConfig {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_ff: usize,
    pub n_vocab: usize,
    /// `max_position_embeddings`: the longest sequence the model takes.
    pub n_pos: usize,
    /// `type_vocab_size`.
    pub n_type: usize,
    pub ln_eps: f32,
    /// The activation of the intermediate dense layer.
    pub act: UnaryOp,
}

impl BertConfig {
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Read `dir/config.json` (and check `dir/1_Pooling/config.json` asks for mean pooling).
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<BertConfig> {
        let dir = dir.as_ref();
        let cfg = BertConfig::from_config(&JsonConfig::open_model_config(dir)?)?;
        let pool = dir.join("1_Pooling").join("config.json");
        if pool.is_file() {
            let p = JsonConfig::open(&pool)?;
            if p.opt_bool("pooling_mode_mean_tokens")? != Some(true) {
                return Err(Error::format(
                    &pool,
                    "key 'pooling_mode_mean_tokens'",
                    "only mean pooling is implemented",
                ));
            }
        }
        Ok(cfg)
    }

    /// The configuration of a parsed `config.json`, every count within the bounds of
    /// [`limits`](super::limits) (errors name the file and the key).
    pub fn from_config(c: &JsonConfig) -> Result<BertConfig> {
        let bad =
            |key: &str, reason: String| Error::format(c.path(), format!("key '{key}'"), reason);
        // Activation names per HF transformers' ACT2FN: "gelu" is the erf form.
        let act = match c.opt_str("hidden_act")?.unwrap_or("gelu") {
            "gelu" => UnaryOp::GeluErf,
            "gelu_new" | "gelu_pytorch_tanh" => UnaryOp::Gelu,
            "relu" => UnaryOp::Relu,
            other => {
                return Err(bad(
                    "hidden_act",
                    format!("'{other}' is not supported (gelu, gelu_new, relu)"),
                ));
            }
        };
        if let Some(p) = c.opt_str("position_embedding_type")?
            && p != "absolute"
        {
            return Err(bad(
                "position_embedding_type",
                format!("'{p}': only absolute position embeddings are supported"),
            ));
        }
        let eps = c.get_f64("layer_norm_eps")?;
        // Finite in f32, the precision it is used in (1e300 is a finite f64).
        if !((eps as f32).is_finite() && eps >= 0.0) {
            return Err(bad(
                "layer_norm_eps",
                format!("{eps} must be finite (as an f32) and >= 0"),
            ));
        }
        let cfg = BertConfig {
            n_layer: c.get_usize("num_hidden_layers")?,
            n_embd: c.get_usize("hidden_size")?,
            n_head: c.get_usize("num_attention_heads")?,
            n_ff: c.get_usize("intermediate_size")?,
            n_vocab: c.get_usize("vocab_size")?,
            n_pos: c.get_usize("max_position_embeddings")?,
            n_type: c.opt_usize("type_vocab_size")?.unwrap_or(2),
            ln_eps: eps as f32,
            act,
        };
        // Bounded before anything (the list of weights, the file check) is sized by a count.
        super::limits::check_encoder(&cfg, super::limits::Source::ConfigJson(c.path()))?;
        Ok(cfg)
    }

    /// Dimensions that make a model: every count within the bounds of
    /// [`limits`](super::limits), heads dividing the width, the tensors and the whole model
    /// within the address space.
    pub fn validate(&self) -> Result<()> {
        super::limits::check_encoder(self, super::limits::Source::Named("bert"))
    }
}

impl BertConfig {
    /// The extent of `d` for this model.
    pub fn dim(&self, d: Dim) -> Option<usize> {
        Some(match d {
            Dim::One => 1,
            Dim::Embd | Dim::Q | Dim::Kv => self.n_embd,
            Dim::HeadDim => self.head_dim(),
            Dim::Ff => self.n_ff,
            Dim::Vocab => self.n_vocab,
            Dim::Pos => self.n_pos,
            Dim::Types => self.n_type,
            Dim::Ctx
            | Dim::RopeHalf
            | Dim::Qkv
            | Dim::Ff2
            | Dim::Expert
            | Dim::FfExp
            | Dim::FfShexp => return None,
        })
    }

    /// The feed-forward block: BERT's plain MLP with this model's activation.
    pub fn mlp(&self) -> Mlp {
        Mlp::Plain(self.act)
    }
}

impl From<&BertConfig> for SplitDims {
    fn from(c: &BertConfig) -> SplitDims {
        SplitDims {
            arch: &BERT,
            n_layer: c.n_layer,
            n_head: c.n_head,
            n_head_kv: c.n_head,
            head_dim: c.head_dim(),
            n_embd: c.n_embd,
            n_ff: c.n_ff,
            n_vocab: c.n_vocab,
            moe: None,
            blocks: None,
        }
    }
}

/// The tensors an encoder of `cfg` holds, with their safetensors names (without a `bert.`
/// prefix) and F32 layouts, in the architecture table's order.
pub fn weight_decls(cfg: &BertConfig) -> Result<Vec<TensorDecl>> {
    model_layouts(
        &BERT,
        cfg.n_layer,
        &|d| cfg.dim(d),
        &|_, _| DType::F32,
        &|_, _| false,
    )
}

/// Names (as in the file, without a `bert.` prefix) and F32 layouts of the weights used.
pub fn weight_layouts(cfg: &BertConfig) -> Vec<(String, crate::tensor::Layout)> {
    weight_decls(cfg)
        .map(|d| d.into_iter().map(|d| (d.name, d.layout)).collect())
        .unwrap_or_default()
}

/// The built-in callback for an encoder with this configuration: attention and the MLP split
/// in every layer, the embeddings mirrored ([`by_layer`] with every layer `{ attention: true,
/// mlp: true }` and `embedding: false`). Heads are split in whole units (12 heads on 5 devices:
/// 3, 3, 2, 2, 2), the intermediate width in whole units of 32 where it divides; the rounding
/// remainder rotates with the layer index.
pub fn bert_split(cfg: &BertConfig) -> SplitFn {
    let layer = LayerSplit {
        attention: true,
        mlp: true,
    };
    by_layer(cfg, DecoderSplit::uniform(cfg.n_layer, layer, false, false))
}

/// One more than the largest `N` of an `[bert.]encoder.layer.N.*` tensor (0 when none).
fn layers_present(file: &SafetensorsFile) -> usize {
    file.tensors()
        .iter()
        .filter_map(|t| {
            let name = t.name.strip_prefix("bert.").unwrap_or(&t.name);
            name.strip_prefix("encoder.layer.")?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .map(|i| i.saturating_add(1))
        .max()
        .unwrap_or(0)
}

/// Load the weights of `file` (checked against `cfg`: every tensor present, with the expected
/// shape, F32/F16/BF16, converted to F32) into one buffer of `bt`.
pub fn load_weights(
    file: &SafetensorsFile,
    cfg: &BertConfig,
    bt: &dyn BufferType,
) -> Result<(Arc<dyn Buffer>, ModelWeights)> {
    // The layer count sizes the list below: check it against the layers present first.
    let present = layers_present(file);
    if cfg.n_layer != present {
        return Err(Error::format(
            file.path(),
            "encoder layers",
            format!(
                "config.json's num_hidden_layers is {}, but this file holds tensors for {present} \
                 layers (encoder.layer.0 to encoder.layer.{})",
                cfg.n_layer,
                present.saturating_sub(1)
            ),
        ));
    }
    let decls = weight_decls(cfg)?;
    let tensors: Vec<(String, crate::tensor::Layout)> =
        decls.iter().map(|d| (d.name.clone(), d.layout)).collect();
    // Some checkpoints (BertForX) prefix the encoder's names with `bert.`.
    let prefix = if file.tensor(&tensors[0].0).is_none()
        && file.tensor(&format!("bert.{}", tensors[0].0)).is_some()
    {
        "bert."
    } else {
        ""
    };
    // Check everything before allocating.
    let mut sources = Vec::with_capacity(tensors.len());
    for (name, layout) in &tensors {
        let full = format!("{prefix}{name}");
        let t = file.tensor(&full).ok_or_else(|| {
            Error::format(
                file.path(),
                format!("tensor '{full}'"),
                "missing (the model does not look like a BERT encoder of this config.json)",
            )
        })?;
        // Biases and norms are [n] in the file and [n, 1] here: compare element counts per dim.
        if t.ne != layout.ne {
            return Err(Error::format(
                file.path(),
                format!("tensor '{full}' shape"),
                format!(
                    "{:?} does not match config.json, which implies {:?} (row-major)",
                    t.shape,
                    layout
                        .ne
                        .iter()
                        .rev()
                        .copied()
                        .skip_while(|&d| d == 1)
                        .collect::<Vec<_>>()
                ),
            ));
        }
        match t.dtype {
            Some(DType::F32 | DType::F16 | DType::BF16) => {}
            _ => {
                return Err(Error::format(
                    file.path(),
                    format!("tensor '{full}' dtype"),
                    format!("{} is not supported (F32, F16, BF16)", t.file_dtype),
                ));
            }
        }
        sources.push(t);
    }
    let (buf, refs) = place(bt, &tensors, BufferUsage::Weights)?;
    for (r, t) in refs.iter().zip(sources) {
        let bytes = file.tensor_data(t)?;
        let dt = t.dtype.expect("checked above");
        if dt == DType::F32 {
            r.storage.set(&r.layout, bytes)?;
        } else {
            let v = crate::dtype::bytes_to_f32(dt, bytes, r.layout.nelements())?;
            r.storage.set(&r.layout, crate::dtype::as_bytes(&v))?;
        }
    }
    Ok((buf, ModelWeights::assemble(cfg.n_layer, &decls, &refs)))
}

/// A forward graph and the nodes it exposes.
pub struct BertGraph {
    pub graph: Graph,
    /// L2-normalized embeddings `[n_embd, batch]`.
    pub embeddings: TensorId,
    /// Last hidden states `[n_embd, seq_len * batch]` (before pooling); mark it with
    /// `graph.set_output` before computing to read it.
    pub hidden: TensorId,
}

/// Check a padded batch against the model: sizes, token and type ids in range, at least one
/// real token per sequence (mean pooling divides by the count).
pub fn check_batch(cfg: &BertConfig, enc: &BatchEncoding) -> Result<()> {
    let (b, t) = (enc.batch, enc.seq_len);
    let bad = |what: String, expected: String, got: String| {
        Err(Error::invalid_input("bert batch", what, expected, got))
    };
    if b == 0 || t == 0 {
        return bad(
            "sequences x tokens".into(),
            "at least 1 x 1".into(),
            format!("{b} x {t}"),
        );
    }
    let n = b.saturating_mul(t);
    for (what, len) in [
        ("ids", enc.ids.len()),
        ("attention mask values", enc.attention_mask.len()),
        ("type ids", enc.type_ids.len()),
    ] {
        if len != n {
            return bad(what.into(), format!("{b} x {t} = {n}"), len.to_string());
        }
    }
    if t > cfg.n_pos {
        return bad(
            "sequence length".into(),
            format!("at most max_position_embeddings {}", cfg.n_pos),
            t.to_string(),
        );
    }
    if let Some(i) = enc.ids.iter().position(|&id| id as usize >= cfg.n_vocab) {
        return bad(
            format!("sequence {} token {}: id", i / t, i % t),
            format!("below vocab_size {}", cfg.n_vocab),
            enc.ids[i].to_string(),
        );
    }
    if let Some(i) = enc
        .type_ids
        .iter()
        .position(|&id| id as usize >= cfg.n_type)
    {
        return bad(
            format!("sequence {} token {}: type id", i / t, i % t),
            format!("below type_vocab_size {}", cfg.n_type),
            enc.type_ids[i].to_string(),
        );
    }
    for s in 0..b {
        if enc.attention_mask[s * t..(s + 1) * t]
            .iter()
            .all(|&m| m == 0)
        {
            return bad(
                format!("sequence {s}"),
                "at least one unmasked token".into(),
                "none".into(),
            );
        }
    }
    Ok(())
}

/// `LN(x) * w + b` over dimension 0, with the weight and bias of roles `w` and `b`.
fn layer_norm(
    g: &mut Graph,
    lw: &Weights,
    w: Tensor,
    b: Tensor,
    x: TensorId,
    eps: f32,
) -> Result<TensorId> {
    let (w, b) = (lw.get(w)?.leaf(g)?, lw.get(b)?.leaf(g)?);
    blocks::norm(g, NormKind::Layer, x, w, Some(b), eps)
}

/// `x W + b` (a Linear layer) of the roles `w` and `b`.
fn linear(g: &mut Graph, lw: &Weights, w: Tensor, b: Tensor, x: TensorId) -> Result<TensorId> {
    blocks::linear(g, x, lw.get(w)?, Some(lw.get(b)?))
}

/// Sequences and tokens per sequence of a padded batch.
#[derive(Clone, Copy)]
struct Batch {
    b: usize,
    t: usize,
}

/// One post-norm encoder layer: `a = LN(x + attention(x))`, `LN(a + ffn(a))`.
fn encoder_layer(
    g: &mut Graph,
    cfg: &BertConfig,
    l: usize,
    lw: &Weights,
    Batch { b, t }: Batch,
    kq_mask: TensorId,
    x: TensorId,
) -> Result<TensorId> {
    let (nh, hd, e) = (cfg.n_head, cfg.head_dim(), cfg.n_embd);
    let scale = 1.0 / (hd as f32).sqrt();
    // Self-attention, heads as batched matrices.
    let q = linear(g, lw, Tensor::AttnQ, Tensor::AttnQBias, x)?;
    let k = linear(g, lw, Tensor::AttnK, Tensor::AttnKBias, x)?;
    let v = linear(g, lw, Tensor::AttnV, Tensor::AttnVBias, x)?;
    let q = g.reshape(q, [hd, nh, t, b])?;
    let q = g.permute(q, [0, 2, 1, 3])?; // [hd, t, nh, b]
    let k = g.reshape(k, [hd, nh, t, b])?;
    let k = g.permute(k, [0, 2, 1, 3])?; // [hd, t, nh, b]
    // [t_kv, t_q, nh, b] after the softmax; values [t, hd, nh, b].
    let kqv = blocks::attention_core(g, q, k, kq_mask, scale, |g| {
        let v = g.reshape(v, [hd, nh, t, b])?;
        let vt = g.permute(v, [1, 2, 0, 3])?;
        g.cont(vt)
    })?; // [hd, t_q, nh, b]
    let o = g.permute(kqv, [0, 2, 1, 3])?; // [hd, nh, t_q, b]
    let o = g.cont(o)?;
    let o = g.reshape(o, [e, b * t, 1, 1])?;
    let o = linear(g, lw, Tensor::AttnOut, Tensor::AttnOutBias, o)?;
    let a = g.add(o, x)?;
    let norm = (Tensor::AttnOutNorm, Tensor::AttnOutNormBias);
    let a = layer_norm(g, lw, norm.0, norm.1, a, cfg.ln_eps)?;
    g.set_name(a, attn_out_name(l));
    // Feed-forward.
    let f = blocks::ffn(g, cfg.mlp(), lw, a)?;
    let f = g.add(f, a)?;
    let norm = (Tensor::LayerOutNorm, Tensor::LayerOutNormBias);
    let x = layer_norm(g, lw, norm.0, norm.1, f, cfg.ln_eps)?;
    g.set_name(x, layer_out_name(l));
    Ok(x)
}

/// The forward graph of a padded batch (`enc` from `WordPieceTokenizer::encode_batch`).
///
/// Activations are `[n_embd, seq_len * batch]` (token-major within a sequence). Attention runs
/// as batched `mul_mat` over `[head_dim, seq_len, n_head, batch]`, so a meta device splits it
/// by heads (axis 2); the padding mask `[seq_len, seq_len, 1, batch]` (-inf at padding keys)
/// broadcasts over heads. Mean pooling is a `mul_mat` of the hidden states `[seq_len, n_embd,
/// batch]` with per-sequence weights `mask / count` `[seq_len, 1, batch]`; the L2 norm is
/// `rms_norm(x, eps) / sqrt(n_embd)` = `x / sqrt(|x|² + n_embd * eps)`.
pub fn build_graph(cfg: &BertConfig, w: &ModelWeights, enc: &BatchEncoding) -> Result<BertGraph> {
    cfg.validate()?;
    check_batch(cfg, enc)?;
    if w.layers.len() != cfg.n_layer {
        return Err(Error::invalid_input(
            "bert graph",
            "layers of weights",
            format!("num_hidden_layers {}", cfg.n_layer),
            w.layers.len(),
        ));
    }
    let (b, t, e) = (enc.batch, enc.seq_len, cfg.n_embd);
    let n = b * t;
    let mut g = Graph::new();
    let to_i32 = |v: &[u32]| v.iter().map(|&x| x as i32).collect::<Vec<i32>>();
    let ids = g.input_i32("input_ids", [n, 1, 1, 1], &to_i32(&enc.ids))?;
    let pos: Vec<i32> = (0..n).map(|i| (i % t) as i32).collect();
    let pos = g.input_i32("position_ids", [n, 1, 1, 1], &pos)?;
    let typ = g.input_i32("token_type_ids", [n, 1, 1, 1], &to_i32(&enc.type_ids))?;
    // Attention mask [t_kv, t_q, 1, b]: padding keys of sequence s get -inf for every query.
    let mut kq_mask = vec![0f32; t * t * b];
    for s in 0..b {
        for q in 0..t {
            for k in 0..t {
                if enc.attention_mask[s * t + k] == 0 {
                    kq_mask[(s * t + q) * t + k] = f32::NEG_INFINITY;
                }
            }
        }
    }
    let kq_mask = g.input_f32("kq_mask", [t, t, 1, b], &kq_mask)?;
    // Pooling weights [t, 1, b]: mask / count per sequence.
    let mut pool = vec![0f32; n];
    for s in 0..b {
        let m = &enc.attention_mask[s * t..(s + 1) * t];
        let count = m.iter().filter(|&&x| x != 0).count() as f32;
        for (k, &x) in m.iter().enumerate() {
            if x != 0 {
                pool[s * t + k] = 1.0 / count;
            }
        }
    }
    let pool = g.input_f32("pool_weights", [t, 1, b, 1], &pool)?;

    // Embeddings.
    let m = &w.model;
    let word = m.get(Tensor::TokenEmbd)?.leaf(&mut g)?;
    let pos_t = m.get(Tensor::PosEmbd)?.leaf(&mut g)?;
    let typ_t = m.get(Tensor::TokenTypes)?.leaf(&mut g)?;
    let x = g.get_rows(word, ids)?;
    let p = g.get_rows(pos_t, pos)?;
    let x = g.add(x, p)?;
    let ty = g.get_rows(typ_t, typ)?;
    let x = g.add(x, ty)?;
    let norm = (Tensor::TokenEmbdNorm, Tensor::TokenEmbdNormBias);
    let mut x = layer_norm(&mut g, m, norm.0, norm.1, x, cfg.ln_eps)?;
    g.set_name(x, "emb_out");
    let shape = Batch { b, t };
    for (l, lw) in w.layers.iter().enumerate() {
        x = encoder_layer(&mut g, cfg, l, lw, shape, kq_mask, x)?;
    }
    let hidden = x;

    // Mean pooling: [t, e, b] x [t, 1, b] -> [e, 1, b].
    let h = g.reshape(x, [e, t, b, 1])?;
    let ht = g.permute(h, [1, 0, 2, 3])?;
    let ht = g.cont(ht)?;
    let pooled = g.mul_mat(ht, pool)?;
    let pooled = g.reshape(pooled, [e, b, 1, 1])?;
    // L2 normalization: x / sqrt(|x|² + 1e-24), close to sentence-transformers'
    // x / max(|x|, 1e-12) (torch.nn.functional.normalize).
    let y = g.rms_norm(pooled, 1e-24 / e as f32)?;
    let y = g.scale(y, 1.0 / (e as f32).sqrt())?;
    g.set_name(y, "embeddings");
    g.set_output(y);
    Ok(BertGraph {
        graph: g,
        embeddings: y,
        hidden,
    })
}

/// The embeddings of one batch, with its encoding.
#[derive(Clone, Debug)]
pub struct Embeddings {
    pub encoding: BatchEncoding,
    /// One L2-normalized vector of `n_embd` floats per sequence.
    pub vectors: Vec<Vec<f32>>,
}

/// A loaded encoder ready to embed text on one device or a meta device.
pub struct BertEncoder {
    dir: PathBuf,
    cfg: BertConfig,
    weights: ModelWeights,
    tokenizer: WordPieceTokenizer,
    device: Arc<dyn Device>,
    backend: Arc<dyn Backend>,
    buffer: Arc<dyn Buffer>,
}

impl BertEncoder {
    /// Load the model folder `dir` (`config.json`, `model.safetensors`, `tokenizer.json`) onto
    /// any device (a plain device, or a meta device with any split callback: see
    /// `runtime::open_encoder`).
    pub fn load_on(dir: impl AsRef<Path>, device: Arc<dyn Device>) -> Result<BertEncoder> {
        let dir = dir.as_ref();
        let cfg = BertConfig::from_model_dir(dir)?;
        let mut tokenizer = WordPieceTokenizer::from_model_dir(dir)?;
        // Never longer than the position table.
        let max = tokenizer.max_len().map_or(cfg.n_pos, |m| m.min(cfg.n_pos));
        tokenizer.set_max_len(Some(max));
        let file = SafetensorsFile::open(dir.join("model.safetensors"))?;
        let (buffer, weights) = load_weights(&file, &cfg, device.buffer_type().as_ref())?;
        let backend = device.init_backend()?;
        Ok(BertEncoder {
            dir: dir.to_path_buf(),
            cfg,
            weights,
            tokenizer,
            device,
            backend,
            buffer,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    pub fn config(&self) -> &BertConfig {
        &self.cfg
    }
    pub fn weights(&self) -> &ModelWeights {
        &self.weights
    }
    pub fn tokenizer(&self) -> &WordPieceTokenizer {
        &self.tokenizer
    }
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// Weight bytes held by each device: one entry on a plain device, one per device (its
    /// slices of split tensors plus a full copy of each mirrored one) on a meta device.
    pub fn weight_bytes_per_device(&self) -> Vec<usize> {
        match self.buffer.as_any().downcast_ref::<MetaBuffer>() {
            Some(mb) => mb.device_bytes(),
            None => vec![self.buffer.size()],
        }
    }

    /// Tokenize, pad to the longest and truncate at the tokenizer's maximum length.
    pub fn encode(&self, texts: &[&str]) -> Result<BatchEncoding> {
        if texts.is_empty() {
            return Err(Error::invalid_input(
                "bert",
                "sentences",
                "at least one",
                "none",
            ));
        }
        self.tokenizer.encode_batch(texts)
    }

    /// Run one padded batch; one vector per sequence.
    pub fn embed_batch(&self, enc: &BatchEncoding) -> Result<Vec<Vec<f32>>> {
        let mut bg = build_graph(&self.cfg, &self.weights, enc)?;
        self.backend.graph_compute(&mut bg.graph)?;
        let flat = bg.graph.read_f32(bg.embeddings)?;
        Ok(flat.chunks(self.cfg.n_embd).map(<[f32]>::to_vec).collect())
    }

    /// Embed sentences in one batch.
    pub fn embed(&self, texts: &[&str]) -> Result<Embeddings> {
        let encoding = self.encode(texts)?;
        let vectors = self.embed_batch(&encoding)?;
        Ok(Embeddings { encoding, vectors })
    }
}

/// Cosine similarity of two vectors (0 when either is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        dot / (na * nb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_batches_name_what_and_where() {
        let cfg = BertConfig {
            n_layer: 1,
            n_embd: 8,
            n_head: 2,
            n_ff: 16,
            n_vocab: 100,
            n_pos: 4,
            n_type: 2,
            ln_eps: 1e-12,
            act: UnaryOp::GeluErf,
        };
        let enc = |ids: Vec<u32>, mask: Vec<u32>| BatchEncoding {
            batch: 2,
            seq_len: 2,
            type_ids: vec![0; ids.len()],
            ids,
            attention_mask: mask,
            lengths: vec![2, 2],
        };
        check_batch(&cfg, &enc(vec![1, 2, 3, 4], vec![1; 4])).unwrap();
        let cases = [
            (enc(vec![1, 2, 3], vec![1; 3]), "ids", "2 x 2 = 4", "3"),
            (
                enc(vec![1, 2, 3, 100], vec![1; 4]),
                "sequence 1 token 1: id",
                "below vocab_size 100",
                "100",
            ),
            (
                enc(vec![1, 2, 3, 4], vec![1, 1, 0, 0]),
                "sequence 1",
                "at least one unmasked token",
                "none",
            ),
        ];
        for (e, what, expected, got) in cases {
            match check_batch(&cfg, &e).unwrap_err() {
                Error::InvalidInput {
                    context: "bert batch",
                    what: w,
                    expected: x,
                    got: g,
                } => assert_eq!((w.as_str(), x.as_str(), g.as_str()), (what, expected, got)),
                other => panic!("{other:?}"),
            }
        }
    }
}
