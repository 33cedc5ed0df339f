//! The mixture-of-experts feed-forward block, as llama.cpp's `build_moe_ffn`
//! (`src/llama-graph.cpp`) builds it with softmax gating and SwiGLU experts: the router's
//! logits `[n_expert, n_tokens]`, their softmax, the `n_expert_used` largest per token (`top_k`:
//! a descending `argsort` and a view), their probabilities picked by `get_rows` from
//! `[1, n_expert, n_tokens]` and, where the family normalises them, divided by their sum; the
//! experts' gate, up and down products by `mul_mat_id`; each expert's output times its weight;
//! the `n_expert_used` outputs of a token added. Qwen2-MoE adds a shared expert scaled by the
//! sigmoid of its gate (llama.cpp's `LLM_ARCH_QWEN2MOE` graph).
//!
//! Node names (layer `l`, for `run --dump` and the routing counts of `bench model`):
//! `l{l}.moe.logits`, `l{l}.moe.probs`, `l{l}.moe.argsort` (every expert by falling
//! probability), [`chosen_name`] (its first `n_expert_used` per token: the router's choice, a
//! view of the argsort), `l{l}.moe.weights`, `l{l}.moe.out`.

use super::arch::Tensor;
use super::hparams::Moe;
use super::weights::Weights;
use crate::Result;
use crate::graph::{Graph, TensorId};

/// The name of layer `l`'s chosen experts (`[n_expert_used, n_tokens]` I32 ids, each token's
/// experts by falling weight).
pub fn chosen_name(l: usize) -> String {
    format!("l{l}.moe.chosen_by_router")
}

/// The layer of a [`chosen_name`].
pub fn parse_chosen_name(name: &str) -> Option<usize> {
    let l = name
        .strip_prefix('l')?
        .strip_suffix(".moe.chosen_by_router")?;
    (!l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()))
        .then(|| l.parse().ok())
        .flatten()
}

/// Layer `l`'s block over `x [n_embd, n_tokens]`, giving `[n_embd, n_tokens]`.
pub fn moe_ffn(g: &mut Graph, m: &Moe, l: usize, lw: &Weights, x: TensorId) -> Result<TensorId> {
    let [n_embd, n_tokens, ..] = g.layout(x).ne;
    let (n_expert, k) = (m.n_expert, m.n_expert_used);
    let router = lw.get(Tensor::FfnGateInp)?.leaf(g)?;
    let logits = g.mul_mat(router, x)?;
    g.set_name(logits, format!("l{l}.moe.logits"));
    let probs = g.soft_max(logits, None, 1.0)?;
    g.set_name(probs, format!("l{l}.moe.probs"));
    let chosen = g.top_k(probs, k)?;
    g.set_name(chosen, chosen_name(l));
    if let Some(sorted) = g.node(chosen).view_src {
        g.set_name(sorted, format!("l{l}.moe.argsort"));
    }
    let p3 = g.reshape(probs, [1, n_expert, n_tokens, 1])?;
    let mut w = g.get_rows(p3, chosen)?;
    if m.norm_weights {
        let w2 = g.reshape(w, [k, n_tokens, 1, 1])?;
        let sum = g.sum_rows(w2)?;
        let w2 = g.div(w2, sum)?;
        w = g.reshape(w2, [1, k, n_tokens, 1])?;
    }
    g.set_name(w, format!("l{l}.moe.weights"));
    let x3 = g.reshape(x, [n_embd, 1, n_tokens, 1])?;
    let [wg, wu, wd] = [Tensor::FfnGateExps, Tensor::FfnUpExps, Tensor::FfnDownExps]
        .map(|t| lw.get(t).and_then(|r| r.leaf(g)));
    let gate = g.mul_mat_id(wg?, x3, chosen)?;
    let up = g.mul_mat_id(wu?, x3, chosen)?;
    let h = g.swiglu(gate, up)?;
    let y = g.mul_mat_id(wd?, h, chosen)?;
    let y = g.mul(y, w)?;
    let nb = g.layout(y).nb;
    let mut out = g.view_2d(y, n_embd, n_tokens, nb[2], 0)?;
    for e in 1..k {
        let slot = g.view_2d(y, n_embd, n_tokens, nb[2], e * nb[1])?;
        out = g.add(out, slot)?;
    }
    if m.n_ff_shexp > 0 {
        let shared = shared_expert(g, lw, x)?;
        out = g.add(out, shared)?;
    }
    Ok(g.set_name(out, format!("l{l}.moe.out")))
}

/// Qwen2-MoE's shared expert: `sigmoid(gate_inp_shexp · x) * down(silu(gate x) * up x)`.
fn shared_expert(g: &mut Graph, lw: &Weights, x: TensorId) -> Result<TensorId> {
    let [gi, wg, wu, wd] = [
        Tensor::FfnGateInpShexp,
        Tensor::FfnGateShexp,
        Tensor::FfnUpShexp,
        Tensor::FfnDownShexp,
    ]
    .map(|t| lw.get(t).and_then(|r| r.leaf(g)));
    let gate = g.mul_mat(wg?, x)?;
    let up = g.mul_mat(wu?, x)?;
    let h = g.swiglu(gate, up)?;
    let y = g.mul_mat(wd?, h)?;
    let s = g.mul_mat(gi?, x)?;
    let s = g.sigmoid(s)?;
    g.mul(y, s)
}
