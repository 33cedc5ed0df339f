//! The Llama-family decoder step graph: token embedding lookup, per layer RMSNorm, attention
//! (Q/K/V projections, RoPE, an F16 KV cache written with `set_rows`, grouped-query heads, either
//! the fused `flash_attn` kernel or batched `mul_mat` + `soft_max` per head), the output
//! projection and residual, RMSNorm, SwiGLU MLP and residual; then the final norm and the
//! output projection for the requested rows. Weights and caches are bound storage (`WeightRef`),
//! so the same builder runs on one device or on a meta device.
//!
//! Tensor names follow GGUF's llama convention (`blk.N.attn_q.weight`, ...), which the built-in
//! split callback (`split.rs`) matches.

use crate::buffer::Storage;
use crate::graph::{Graph, TensorId};
use crate::op::{RopeMode, RopeParams};
use crate::tensor::Layout;
use crate::{DType, Error, Result};

/// Hyper-parameters of a Llama-family decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderConfig {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub n_vocab: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub rope_mode: RopeMode,
    /// Rotated dimensions per head (usually the head size).
    pub rope_dims: usize,
    /// Use the fused attention kernel instead of mul_mat + soft_max + mul_mat.
    pub fused_attn: bool,
}

impl DecoderConfig {
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }
    pub fn n_embd_kv(&self) -> usize {
        self.head_dim() * self.n_head_kv
    }
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_head / self.n_head_kv
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |r: String| {
            Err(Error::Model {
                model: "decoder".into(),
                reason: r,
            })
        };
        if self.n_layer == 0 || self.n_embd == 0 || self.n_ff == 0 || self.n_vocab == 0 {
            return bad(format!(
                "n_layer {}, n_embd {}, n_ff {} and n_vocab {} must all be at least 1",
                self.n_layer, self.n_embd, self.n_ff, self.n_vocab
            ));
        }
        if self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            return bad(format!(
                "n_embd {} is not a multiple of n_head {}",
                self.n_embd, self.n_head
            ));
        }
        if self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(format!(
                "n_head {} is not a multiple of n_head_kv {}",
                self.n_head, self.n_head_kv
            ));
        }
        if self.rope_dims == 0
            || self.rope_dims > self.head_dim()
            || !self.rope_dims.is_multiple_of(2)
        {
            return bad(format!(
                "rope dims {} do not fit head size {}",
                self.rope_dims,
                self.head_dim()
            ));
        }
        Ok(())
    }
}

/// A tensor living in a buffer across steps (a weight or a cache), declared in each step graph.
#[derive(Clone, Debug)]
pub struct WeightRef {
    pub name: String,
    pub layout: Layout,
    pub storage: Storage,
}

impl WeightRef {
    /// Declare this tensor in `g` and bind its storage.
    pub fn leaf(&self, g: &mut Graph) -> Result<TensorId> {
        let id = g.weight(&self.name, self.layout.dtype, self.layout.ne)?;
        g.bind(id, self.storage.clone())?;
        Ok(id)
    }
}

/// One layer's weights.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: WeightRef,
    pub wq: WeightRef,
    pub wk: WeightRef,
    pub wv: WeightRef,
    pub wo: WeightRef,
    pub ffn_norm: WeightRef,
    pub w_gate: WeightRef,
    pub w_up: WeightRef,
    pub w_down: WeightRef,
}

/// All weights of a decoder.
#[derive(Clone, Debug)]
pub struct DecoderWeights {
    pub token_embd: WeightRef,
    pub output_norm: WeightRef,
    /// The output projection (the token embedding when tied).
    pub output: WeightRef,
    pub layers: Vec<LayerWeights>,
}

/// The KV cache: per layer `k` and `v` of shape `[n_embd_kv, size]` (F16).
#[derive(Clone, Debug)]
pub struct KvCache {
    pub k: Vec<WeightRef>,
    pub v: Vec<WeightRef>,
    pub size: usize,
}

/// Names and layouts of the cache tensors, for allocation.
pub fn kv_cache_layouts(cfg: &DecoderConfig, size: usize) -> Vec<(String, Layout)> {
    let mut v = Vec::new();
    for l in 0..cfg.n_layer {
        for kind in ["k", "v"] {
            v.push((
                format!("cache_{kind}_l{l}"),
                Layout::contiguous(DType::F16, [cfg.n_embd_kv(), size, 1, 1]),
            ));
        }
    }
    v
}

/// What one step computes.
#[derive(Clone, Debug)]
pub struct StepInput<'a> {
    pub tokens: &'a [i32],
    /// Position of each token.
    pub positions: &'a [i32],
    /// Cache row each token is written to.
    pub slots: &'a [i32],
    /// Cache rows attended to: `0..n_kv` (positions above a token's own are masked).
    pub n_kv: usize,
    /// Position held by each cache row `0..n_kv` (for the causal mask).
    pub kv_positions: &'a [i32],
    /// Which token rows get logits (e.g. only the last).
    pub logits_rows: std::ops::Range<usize>,
}

/// The nodes a step graph exposes.
pub struct StepGraph {
    pub graph: Graph,
    pub logits: TensorId,
}

/// Build one decoder step: `tokens` in, logits `[n_vocab, rows]` out.
pub fn build_step(
    cfg: &DecoderConfig,
    w: &DecoderWeights,
    cache: &KvCache,
    inp: &StepInput,
) -> Result<StepGraph> {
    cfg.validate()?;
    let t = inp.tokens.len();
    let bad = |what: &str, expected: String, got: String| {
        Err(Error::invalid_input("decoder step", what, expected, got))
    };
    if t == 0 {
        return bad("tokens", "at least one".into(), "none".into());
    }
    for (what, len) in [
        ("positions", inp.positions.len()),
        ("slots", inp.slots.len()),
    ] {
        if len != t {
            return bad(what, format!("one per token ({t})"), len.to_string());
        }
    }
    if inp.n_kv == 0 || inp.n_kv > cache.size {
        return bad("n_kv", format!("1..={}", cache.size), inp.n_kv.to_string());
    }
    if inp.kv_positions.len() != inp.n_kv {
        return bad(
            "kv_positions",
            format!("one per cache row in use ({})", inp.n_kv),
            inp.kv_positions.len().to_string(),
        );
    }
    if inp.logits_rows.is_empty() || inp.logits_rows.end > t {
        return bad(
            "logits rows",
            format!("a non-empty range within 0..{t}"),
            format!("{:?}", inp.logits_rows),
        );
    }
    let mut g = Graph::new();
    let tokens = g.input_i32("tokens", [t, 1, 1, 1], inp.tokens)?;
    let pos = g.input_i32("positions", [t, 1, 1, 1], inp.positions)?;
    let slots = g.input_i32("slots", [t, 1, 1, 1], inp.slots)?;
    // Causal mask [n_kv, t]: row i may see cache rows holding positions <= its own.
    let mut mask = vec![0f32; inp.n_kv * t];
    for i in 0..t {
        for j in 0..inp.n_kv {
            if inp.kv_positions[j] > inp.positions[i] || inp.kv_positions[j] < 0 {
                mask[i * inp.n_kv + j] = f32::NEG_INFINITY;
            }
        }
    }
    let mask = g.input_f32("kq_mask", [inp.n_kv, t, 1, 1], &mask)?;

    let embd = w.token_embd.leaf(&mut g)?;
    let mut x = g.get_rows(embd, tokens)?;
    g.set_name(x, "inp_embd");
    for (l, lw) in w.layers.iter().enumerate() {
        x = build_layer(&mut g, cfg, l, lw, cache, x, pos, slots, mask, inp.n_kv)?;
    }
    // Rows that need logits, before the final norm (a partial sum is reduced on fewer rows).
    let rows = inp.logits_rows.len();
    let nb1 = g.layout(x).nb[1];
    let x = if rows == t {
        x
    } else {
        g.view_2d(x, cfg.n_embd, rows, nb1, inp.logits_rows.start * nb1)?
    };
    let norm = w.output_norm.leaf(&mut g)?;
    let x = g.rms_norm(x, cfg.rms_eps)?;
    let x = g.mul(x, norm)?;
    let out = w.output.leaf(&mut g)?;
    let logits = g.mul_mat(out, x)?;
    g.set_name(logits, "logits");
    g.set_output(logits);
    Ok(StepGraph { graph: g, logits })
}

#[allow(clippy::too_many_arguments)]
fn build_layer(
    g: &mut Graph,
    cfg: &DecoderConfig,
    l: usize,
    lw: &LayerWeights,
    cache: &KvCache,
    x: TensorId,
    pos: TensorId,
    slots: TensorId,
    mask: TensorId,
    n_kv: usize,
) -> Result<TensorId> {
    let t = g.layout(x).ne[1];
    let (hd, nh, nkv) = (cfg.head_dim(), cfg.n_head, cfg.n_head_kv);
    let rope = RopeParams {
        mode: cfg.rope_mode,
        n_dims: cfg.rope_dims,
        freq_base: cfg.rope_base,
        freq_scale: 1.0,
    };
    // Attention.
    let an = lw.attn_norm.leaf(g)?;
    let cur = g.rms_norm(x, cfg.rms_eps)?;
    let cur = g.mul(cur, an)?;
    let wq = lw.wq.leaf(g)?;
    let wk = lw.wk.leaf(g)?;
    let wv = lw.wv.leaf(g)?;
    let q = g.mul_mat(wq, cur)?;
    let q = g.reshape(q, [hd, nh, t, 1])?;
    let q = g.rope(q, pos, rope)?;
    let k = g.mul_mat(wk, cur)?;
    let k = g.reshape(k, [hd, nkv, t, 1])?;
    let k = g.rope(k, pos, rope)?;
    let k = g.reshape(k, [hd * nkv, t, 1, 1])?;
    let v = g.mul_mat(wv, cur)?;
    let ck = cache.k[l].leaf(g)?;
    let cv = cache.v[l].leaf(g)?;
    let ck = g.set_rows(ck, k, slots)?;
    let cv = g.set_rows(cv, v, slots)?;
    // Cache views [hd, n_kv, heads_kv].
    let es = DType::F16.type_size();
    let row = hd * nkv * es;
    let kview = g.view_3d(ck, [hd, n_kv, nkv], row, hd * es, 0)?;
    let vview = g.view_3d(cv, [hd, n_kv, nkv], row, hd * es, 0)?;
    let q = g.permute(q, [0, 2, 1, 3])?; // [hd, t, nh]
    let scale = 1.0 / (hd as f32).sqrt();
    let attn = if cfg.fused_attn {
        let o = g.flash_attn(q, kview, vview, Some(mask), scale)?; // [hd, nh, t]
        g.reshape(o, [hd * nh, t, 1, 1])?
    } else {
        let kq = g.mul_mat(kview, q)?; // [n_kv, t, nh]
        let kq = g.soft_max(kq, Some(mask), scale)?;
        let vt = g.permute(vview, [1, 0, 2, 3])?; // [n_kv, hd, nkv]
        let vt = g.cast(vt, DType::F32)?;
        let kqv = g.mul_mat(vt, kq)?; // [hd, t, nh]
        let kqv = g.permute(kqv, [0, 2, 1, 3])?; // [hd, nh, t]
        let kqv = g.cont(kqv)?;
        g.reshape(kqv, [hd * nh, t, 1, 1])?
    };
    let wo = lw.wo.leaf(g)?;
    let o = g.mul_mat(wo, attn)?;
    let x = g.add(o, x)?;
    g.set_name(x, format!("l{l}.attn_out"));
    // MLP.
    let fnw = lw.ffn_norm.leaf(g)?;
    let cur = g.rms_norm(x, cfg.rms_eps)?;
    let cur = g.mul(cur, fnw)?;
    let wg = lw.w_gate.leaf(g)?;
    let wu = lw.w_up.leaf(g)?;
    let wd = lw.w_down.leaf(g)?;
    let gate = g.mul_mat(wg, cur)?;
    let up = g.mul_mat(wu, cur)?;
    let h = g.swiglu(gate, up)?;
    let d = g.mul_mat(wd, h)?;
    let x = g.add(d, x)?;
    g.set_name(x, format!("l{l}.out"));
    Ok(x)
}
