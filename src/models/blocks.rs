//! Graph blocks shared by the architectures' layer builders: norms (RMS or LayerNorm, optional
//! bias), linear layers with optional biases, the feed-forward block ([`Mlp`]: gated or plain,
//! with its activation) and the attention core over batched heads. Each block declares its
//! weights as leaves and adds its nodes in a fixed order, so a graph's structure (and the
//! meta backend's cached plan for it) depends only on the model.

use super::arch::{Mlp, Tensor};
use super::weights::{WeightRef, Weights};
use crate::graph::{Graph, TensorId};
use crate::op::UnaryOp;
use crate::{DType, Result};

/// How a norm normalizes: RMS (decoders) or mean and variance (BERT's LayerNorm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    Rms,
    Layer,
    /// RMS in two ops a meta device can take with the rows split by columns (OLMoE's norms
    /// over whole Q and K projections, split by heads): `sum_sqr_rows` (each device sums the
    /// squares of its own columns: partial sums, joined by one all-reduce of a value per row)
    /// and `rms_norm_sums` with the weight (each device scales its own columns, the weight cut
    /// alike). As one `rms_norm` a split row would be all-gathered first, `ne0` values per
    /// row. With virtual KV heads (each repeated `r` times) K's width and its sum of squares
    /// both grow `r`-fold, so the mean is the file's.
    RmsSums,
}

/// `normalize(x) * w (+ b)`.
pub fn norm(
    g: &mut Graph,
    kind: NormKind,
    x: TensorId,
    w: TensorId,
    b: Option<TensorId>,
    eps: f32,
) -> Result<TensorId> {
    let y = match kind {
        NormKind::Rms => {
            let y = g.rms_norm(x, eps)?;
            g.mul(y, w)?
        }
        NormKind::Layer => {
            let y = g.norm(x, eps)?;
            g.mul(y, w)?
        }
        NormKind::RmsSums => {
            let sums = g.sum_sqr_rows(x)?;
            let n = g.layout(x).ne[0];
            g.rms_norm_sums(x, sums, w, eps, n)?
        }
    };
    match b {
        Some(b) => g.add(y, b),
        None => Ok(y),
    }
}

/// The norm of role `w` (and its bias role `b`, when the layer has it) applied to `x`: the
/// weight (and bias) declared first.
pub fn norm_of(
    g: &mut Graph,
    kind: NormKind,
    lw: &Weights,
    w: Tensor,
    b: Option<Tensor>,
    x: TensorId,
    eps: f32,
) -> Result<TensorId> {
    let wt = lw.get(w)?.leaf(g)?;
    let bt = leaf_opt(g, lw, b)?;
    norm(g, kind, x, wt, bt, eps)
}

/// The leaf of role `t` if the scope has it.
pub fn leaf_opt(g: &mut Graph, lw: &Weights, t: Option<Tensor>) -> Result<Option<TensorId>> {
    match t.and_then(|t| lw.opt(t)) {
        Some(r) => Ok(Some(r.leaf(g)?)),
        None => Ok(None),
    }
}

/// `x + b` when there is a bias.
pub fn add_bias(g: &mut Graph, x: TensorId, b: Option<TensorId>) -> Result<TensorId> {
    match b {
        Some(b) => g.add(x, b),
        None => Ok(x),
    }
}

/// A linear layer: `mul_mat(W [in, out], x [in, n]) (+ b [out])`, the weight and the bias
/// declared right before the product.
pub fn linear(
    g: &mut Graph,
    x: TensorId,
    w: &WeightRef,
    b: Option<&WeightRef>,
) -> Result<TensorId> {
    let w = w.leaf(g)?;
    let b = match b {
        Some(b) => Some(b.leaf(g)?),
        None => None,
    };
    let y = g.mul_mat(w, x)?;
    add_bias(g, y, b)
}

/// The Q, K and V projections of a layer's normed input `cur` `[n_embd, t]`, each `[rows, t]`
/// with its bias where the layer has one: from three matrices (each product made when asked,
/// after all weights are declared), or from Q | K | V in one matrix (Phi-3's `attn_qkv`, as
/// llama.cpp's `build_qkv` reads it): one product at declaration, then each segment's rows
/// viewed and made contiguous. Under tensor parallelism the fused weight is split per segment,
/// so each device's view holds its own heads' rows.
pub enum Qkv {
    Separate {
        cur: TensorId,
        w: [TensorId; 3],
        b: [Option<TensorId>; 3],
    },
    Fused {
        qkv: TensorId,
        q_rows: usize,
        kv_rows: usize,
    },
}

impl Qkv {
    /// Declare the layer's Q/K/V weights (and make the fused product).
    pub fn declare(
        g: &mut Graph,
        lw: &Weights,
        cur: TensorId,
        q_rows: usize,
        kv_rows: usize,
    ) -> Result<Qkv> {
        if let Some(w) = lw.opt(Tensor::AttnQkv) {
            let qkv = linear(g, cur, w, None)?;
            return Ok(Qkv::Fused {
                qkv,
                q_rows,
                kv_rows,
            });
        }
        let w = [
            lw.get(Tensor::AttnQ)?.leaf(g)?,
            lw.get(Tensor::AttnK)?.leaf(g)?,
            lw.get(Tensor::AttnV)?.leaf(g)?,
        ];
        let b = [
            leaf_opt(g, lw, Some(Tensor::AttnQBias))?,
            leaf_opt(g, lw, Some(Tensor::AttnKBias))?,
            leaf_opt(g, lw, Some(Tensor::AttnVBias))?,
        ];
        Ok(Qkv::Separate { cur, w, b })
    }

    /// Projection `i` (0: Q, 1: K, 2: V).
    fn get(&self, g: &mut Graph, i: usize) -> Result<TensorId> {
        match *self {
            Qkv::Separate { cur, w, b } => {
                let y = g.mul_mat(w[i], cur)?;
                add_bias(g, y, b[i])
            }
            Qkv::Fused {
                qkv,
                q_rows,
                kv_rows,
            } => {
                let l = g.layout(qkv);
                let (start, rows) = match i {
                    0 => (0, q_rows),
                    _ => (q_rows + (i - 1) * kv_rows, kv_rows),
                };
                let es = l.dtype.type_size();
                let view = g.view_2d(qkv, rows, l.ne[1], l.nb[1], start * es)?;
                g.cont(view)
            }
        }
    }

    pub fn q(&self, g: &mut Graph) -> Result<TensorId> {
        self.get(g, 0)
    }
    pub fn k(&self, g: &mut Graph) -> Result<TensorId> {
        self.get(g, 1)
    }
    pub fn v(&self, g: &mut Graph) -> Result<TensorId> {
        self.get(g, 2)
    }
}

/// The feed-forward block of a layer on `x` (its norm applied by the caller):
///
/// - [`Mlp::Gated`]: gate, up and down declared first, then `down(act(gate x) * (up x))`; SiLU
///   is the fused `swiglu` op (SwiGLU), another activation its unary op and a `mul`; with
///   gate | up in one matrix (Phi-3's `ffn_up`), one product and the fused `swiglu` over its
///   halves (SiLU only);
/// - [`Mlp::Plain`]: `down(act(up x + b_up)) + b_down`, each linear layer with its bias.
pub fn ffn(g: &mut Graph, mlp: Mlp, lw: &Weights, x: TensorId) -> Result<TensorId> {
    match mlp {
        Mlp::Gated(act) if lw.opt(Tensor::FfnGateUp).is_some() => {
            let wgu = lw.get(Tensor::FfnGateUp)?.leaf(g)?;
            let wd = lw.get(Tensor::FfnDown)?.leaf(g)?;
            if act != UnaryOp::Silu {
                return Err(crate::Error::Model {
                    model: "weights".into(),
                    reason: format!(
                        "a fused gate | up projection runs with SiLU only, not {act:?}"
                    ),
                });
            }
            let h = g.mul_mat(wgu, x)?;
            let h = g.swiglu_fused(h)?;
            g.mul_mat(wd, h)
        }
        Mlp::Gated(act) => {
            let wg = lw.get(Tensor::FfnGate)?.leaf(g)?;
            let wu = lw.get(Tensor::FfnUp)?.leaf(g)?;
            let wd = lw.get(Tensor::FfnDown)?.leaf(g)?;
            let bu = leaf_opt(g, lw, Some(Tensor::FfnUpBias))?;
            let bd = leaf_opt(g, lw, Some(Tensor::FfnDownBias))?;
            let gate = g.mul_mat(wg, x)?;
            let up = g.mul_mat(wu, x)?;
            let up = add_bias(g, up, bu)?;
            let h = if act == UnaryOp::Silu {
                g.swiglu(gate, up)?
            } else {
                let a = g.unary(act, gate)?;
                g.mul(a, up)?
            };
            let d = g.mul_mat(wd, h)?;
            add_bias(g, d, bd)
        }
        Mlp::Moe(_) => Err(crate::Error::Model {
            model: "weights".into(),
            reason: "a mixture of experts is built by `models::moe::moe_ffn` with the model's \
                     expert counts"
                .into(),
        }),
        Mlp::Plain(act) => {
            let h = linear(g, x, lw.get(Tensor::FfnUp)?, lw.opt(Tensor::FfnUpBias))?;
            let h = g.unary(act, h)?;
            linear(g, h, lw.get(Tensor::FfnDown)?, lw.opt(Tensor::FfnDownBias))
        }
    }
}

/// Attention over batched heads without a fused kernel: `k` `[hd, n_kv, heads_kv, ...]`, `q`
/// `[hd, t, heads, ...]`; `softmax(k q * scale + mask)`, then `vt kq` with `vt` `[n_kv, hd,
/// heads_kv, ...]` (F32) made by `values` after the softmax: `[hd, t, heads, ...]`. Query
/// heads share a KV head in groups (`mul_mat` broadcasts over the head axis).
pub fn attention_core(
    g: &mut Graph,
    q: TensorId,
    k: TensorId,
    mask: TensorId,
    scale: f32,
    values: impl FnOnce(&mut Graph) -> Result<TensorId>,
) -> Result<TensorId> {
    let kq = g.mul_mat(k, q)?;
    let kq = g.soft_max(kq, Some(mask), scale)?;
    let vt = values(g)?;
    g.mul_mat(vt, kq)
}

/// `x` cast to F32 unless it is F32 already.
pub fn to_f32(g: &mut Graph, x: TensorId) -> Result<TensorId> {
    if g.layout(x).dtype == DType::F32 {
        Ok(x)
    } else {
        g.cast(x, DType::F32)
    }
}
