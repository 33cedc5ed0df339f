//! The BERT encoder (sentence-transformers models such as all-MiniLM-L6-v2): configuration from
//! `config.json`, weights from `model.safetensors` placed in any buffer type (a meta buffer
//! splits them with [`bert_split`](super::bert_split::bert_split) or any
//! [`bert_by_layer`](super::bert_split::bert_by_layer) assignment), the forward graph for a
//! padded batch, and [`BertEncoder`], which tokenizes, runs and reads the embeddings on one
//! device or on a meta device.
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

use super::bert_split::{bert_by_layer, bert_split};
use super::decoder::WeightRef;
use super::split::DecoderSplit;
use super::synthetic::place;
use crate::backend::{Backend, Device};
use crate::buffer::{Buffer, BufferType, BufferUsage};
use crate::graph::{Graph, TensorId};
use crate::io::{JsonConfig, SafetensorsFile};
use crate::meta::{MetaBuffer, MetaDevice};
use crate::op::UnaryOp;
use crate::tensor::Layout;
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
        let c = JsonConfig::open_model_config(dir)?;
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
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(bad(
                "layer_norm_eps",
                format!("{eps} must be finite and >= 0"),
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
        cfg.validate().map_err(|e| match e {
            Error::Model { reason, .. } => Error::format(c.path(), "model dimensions", reason),
            e => e,
        })?;
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

    /// Dimensions that make a model: non-zero, heads dividing the width, bounded sizes.
    pub fn validate(&self) -> Result<()> {
        let bad = |r: String| {
            Err(Error::Model {
                model: "bert".into(),
                reason: r,
            })
        };
        let dims = [
            ("num_hidden_layers", self.n_layer),
            ("hidden_size", self.n_embd),
            ("num_attention_heads", self.n_head),
            ("intermediate_size", self.n_ff),
            ("vocab_size", self.n_vocab),
            ("max_position_embeddings", self.n_pos),
            ("type_vocab_size", self.n_type),
        ];
        for (name, v) in dims {
            // Bounds far above any BERT, so a corrupt config cannot ask for huge allocations
            // before the weights file is checked against it.
            if v == 0 || v > 1 << 24 {
                return bad(format!("{name} = {v} must be in 1..=16777216"));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return bad(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.n_embd, self.n_head
            ));
        }
        Ok(())
    }
}

/// One encoder layer's weights (names as in the safetensors file).
#[derive(Clone, Debug)]
pub struct BertLayerWeights {
    pub wq: WeightRef,
    pub bq: WeightRef,
    pub wk: WeightRef,
    pub bk: WeightRef,
    pub wv: WeightRef,
    pub bv: WeightRef,
    pub wo: WeightRef,
    pub bo: WeightRef,
    pub ln1_w: WeightRef,
    pub ln1_b: WeightRef,
    pub wi: WeightRef,
    pub bi: WeightRef,
    pub wd: WeightRef,
    pub bd: WeightRef,
    pub ln2_w: WeightRef,
    pub ln2_b: WeightRef,
}

/// All weights of an encoder.
#[derive(Clone, Debug)]
pub struct BertWeights {
    pub word: WeightRef,
    pub pos: WeightRef,
    pub typ: WeightRef,
    pub ln_w: WeightRef,
    pub ln_b: WeightRef,
    pub layers: Vec<BertLayerWeights>,
}

/// Names (as in the file, without a `bert.` prefix) and F32 layouts of the weights used.
pub fn weight_layouts(cfg: &BertConfig) -> Vec<(String, Layout)> {
    let (e, f) = (cfg.n_embd, cfg.n_ff);
    let l = |ne0, ne1| Layout::contiguous(DType::F32, [ne0, ne1, 1, 1]);
    let mut t = vec![
        (
            "embeddings.word_embeddings.weight".into(),
            l(e, cfg.n_vocab),
        ),
        (
            "embeddings.position_embeddings.weight".into(),
            l(e, cfg.n_pos),
        ),
        (
            "embeddings.token_type_embeddings.weight".into(),
            l(e, cfg.n_type),
        ),
        ("embeddings.LayerNorm.weight".into(), l(e, 1)),
        ("embeddings.LayerNorm.bias".into(), l(e, 1)),
    ];
    for i in 0..cfg.n_layer {
        let p = |k: &str| format!("encoder.layer.{i}.{k}");
        for k in ["query", "key", "value"] {
            t.push((p(&format!("attention.self.{k}.weight")), l(e, e)));
            t.push((p(&format!("attention.self.{k}.bias")), l(e, 1)));
        }
        t.push((p("attention.output.dense.weight"), l(e, e)));
        t.push((p("attention.output.dense.bias"), l(e, 1)));
        t.push((p("attention.output.LayerNorm.weight"), l(e, 1)));
        t.push((p("attention.output.LayerNorm.bias"), l(e, 1)));
        t.push((p("intermediate.dense.weight"), l(e, f)));
        t.push((p("intermediate.dense.bias"), l(f, 1)));
        t.push((p("output.dense.weight"), l(f, e)));
        t.push((p("output.dense.bias"), l(e, 1)));
        t.push((p("output.LayerNorm.weight"), l(e, 1)));
        t.push((p("output.LayerNorm.bias"), l(e, 1)));
    }
    t
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

fn assemble(cfg: &BertConfig, refs: &[WeightRef]) -> BertWeights {
    // `refs` is in `weight_layouts` order: 5 embedding tensors, then 16 per layer.
    let layers = (0..cfg.n_layer)
        .map(|i| {
            let r = |k: usize| refs[5 + 16 * i + k].clone();
            BertLayerWeights {
                wq: r(0),
                bq: r(1),
                wk: r(2),
                bk: r(3),
                wv: r(4),
                bv: r(5),
                wo: r(6),
                bo: r(7),
                ln1_w: r(8),
                ln1_b: r(9),
                wi: r(10),
                bi: r(11),
                wd: r(12),
                bd: r(13),
                ln2_w: r(14),
                ln2_b: r(15),
            }
        })
        .collect();
    BertWeights {
        word: refs[0].clone(),
        pos: refs[1].clone(),
        typ: refs[2].clone(),
        ln_w: refs[3].clone(),
        ln_b: refs[4].clone(),
        layers,
    }
}

/// Load the weights of `file` (checked against `cfg`: every tensor present, with the expected
/// shape, F32/F16/BF16, converted to F32) into one buffer of `bt`.
pub fn load_weights(
    file: &SafetensorsFile,
    cfg: &BertConfig,
    bt: &dyn BufferType,
) -> Result<(Arc<dyn Buffer>, BertWeights)> {
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
    let tensors = weight_layouts(cfg);
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
    Ok((buf, assemble(cfg, &refs)))
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

/// `LN(x) * w + b` over dimension 0.
fn layer_norm(g: &mut Graph, x: TensorId, w: TensorId, b: TensorId, eps: f32) -> Result<TensorId> {
    let y = g.norm(x, eps)?;
    let y = g.mul(y, w)?;
    g.add(y, b)
}

/// `x W + b` (a Linear layer): `mul_mat(W [in, out], x [in, n]) + b [out]`.
fn linear(g: &mut Graph, x: TensorId, w: &WeightRef, b: &WeightRef) -> Result<TensorId> {
    let w = w.leaf(g)?;
    let b = b.leaf(g)?;
    let y = g.mul_mat(w, x)?;
    g.add(y, b)
}

/// The forward graph of a padded batch (`enc` from `WordPieceTokenizer::encode_batch`).
///
/// Activations are `[n_embd, seq_len * batch]` (token-major within a sequence). Attention runs
/// as batched `mul_mat` over `[head_dim, seq_len, n_head, batch]`, so a meta device splits it
/// by heads (axis 2); the padding mask `[seq_len, seq_len, 1, batch]` (-inf at padding keys)
/// broadcasts over heads. Mean pooling is a `mul_mat` of the hidden states `[seq_len, n_embd,
/// batch]` with per-sequence weights `mask / count` `[seq_len, 1, batch]`; the L2 norm is
/// `rms_norm(x, eps) / sqrt(n_embd)` = `x / sqrt(|x|² + n_embd * eps)`.
pub fn build_graph(cfg: &BertConfig, w: &BertWeights, enc: &BatchEncoding) -> Result<BertGraph> {
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
    let (nh, hd) = (cfg.n_head, cfg.head_dim());
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
    let word = w.word.leaf(&mut g)?;
    let pos_t = w.pos.leaf(&mut g)?;
    let typ_t = w.typ.leaf(&mut g)?;
    let x = g.get_rows(word, ids)?;
    let p = g.get_rows(pos_t, pos)?;
    let x = g.add(x, p)?;
    let ty = g.get_rows(typ_t, typ)?;
    let x = g.add(x, ty)?;
    let (lw, lb) = (w.ln_w.leaf(&mut g)?, w.ln_b.leaf(&mut g)?);
    let mut x = layer_norm(&mut g, x, lw, lb, cfg.ln_eps)?;
    g.set_name(x, "emb_out");

    let scale = 1.0 / (hd as f32).sqrt();
    for (l, lw) in w.layers.iter().enumerate() {
        // Self-attention, heads as batched matrices.
        let q = linear(&mut g, x, &lw.wq, &lw.bq)?;
        let k = linear(&mut g, x, &lw.wk, &lw.bk)?;
        let v = linear(&mut g, x, &lw.wv, &lw.bv)?;
        let q = g.reshape(q, [hd, nh, t, b])?;
        let q = g.permute(q, [0, 2, 1, 3])?; // [hd, t, nh, b]
        let k = g.reshape(k, [hd, nh, t, b])?;
        let k = g.permute(k, [0, 2, 1, 3])?; // [hd, t, nh, b]
        let kq = g.mul_mat(k, q)?; // [t_kv, t_q, nh, b]
        let kq = g.soft_max(kq, Some(kq_mask), scale)?;
        let v = g.reshape(v, [hd, nh, t, b])?;
        let vt = g.permute(v, [1, 2, 0, 3])?; // [t, hd, nh, b]
        let vt = g.cont(vt)?;
        let kqv = g.mul_mat(vt, kq)?; // [hd, t_q, nh, b]
        let o = g.permute(kqv, [0, 2, 1, 3])?; // [hd, nh, t_q, b]
        let o = g.cont(o)?;
        let o = g.reshape(o, [e, n, 1, 1])?;
        let o = linear(&mut g, o, &lw.wo, &lw.bo)?;
        let a = g.add(o, x)?;
        let (w1, b1) = (lw.ln1_w.leaf(&mut g)?, lw.ln1_b.leaf(&mut g)?);
        let a = layer_norm(&mut g, a, w1, b1, cfg.ln_eps)?;
        g.set_name(a, format!("l{l}.attn_out"));
        // Feed-forward.
        let h = linear(&mut g, a, &lw.wi, &lw.bi)?;
        let h = g.unary(cfg.act, h)?;
        let f = linear(&mut g, h, &lw.wd, &lw.bd)?;
        let f = g.add(f, a)?;
        let (w2, b2) = (lw.ln2_w.leaf(&mut g)?, lw.ln2_b.leaf(&mut g)?);
        x = layer_norm(&mut g, f, w2, b2, cfg.ln_eps)?;
        g.set_name(x, format!("l{l}.out"));
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
    weights: BertWeights,
    tokenizer: WordPieceTokenizer,
    device: Arc<dyn Device>,
    backend: Arc<dyn Backend>,
    buffer: Arc<dyn Buffer>,
}

impl BertEncoder {
    /// Load the model folder `dir` (`config.json`, `model.safetensors`, `tokenizer.json`)
    /// onto `devices`: one device runs the graph itself; several form a meta device with the
    /// built-in split [`bert_split`].
    pub fn load(dir: impl AsRef<Path>, devices: Vec<Arc<dyn Device>>) -> Result<BertEncoder> {
        Self::load_with(dir, devices, None)
    }

    /// As [`load`](Self::load), with several devices split by `split` (a per-layer assignment,
    /// e.g. `planner::Strategy::split(n_layer)`, see [`bert_by_layer`]) instead of the
    /// built-in split when given. One device ignores it (there is nothing to split).
    pub fn load_with(
        dir: impl AsRef<Path>,
        devices: Vec<Arc<dyn Device>>,
        split: Option<DecoderSplit>,
    ) -> Result<BertEncoder> {
        let dir = dir.as_ref();
        let cfg = BertConfig::from_model_dir(dir)?;
        let device: Arc<dyn Device> = match devices.len() {
            0 => {
                return Err(Error::invalid_input(
                    "bert",
                    "devices",
                    "at least one",
                    "none",
                ));
            }
            1 => devices.into_iter().next().expect("one device"),
            _ => {
                let f = match split {
                    Some(s) => bert_by_layer(&cfg, s),
                    None => bert_split(&cfg),
                };
                MetaDevice::new(devices, f)?
            }
        };
        Self::load_on(dir, device)
    }

    /// Load onto any device (a plain device or a `MetaDevice` with any split callback).
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
    pub fn weights(&self) -> &BertWeights {
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
