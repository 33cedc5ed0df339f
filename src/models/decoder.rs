//! The decoder step graph every decoder architecture runs: token embedding lookup, then per
//! layer a pre-norm attention block (Q/K/V projections with their biases where the model has
//! them, or Q | K | V from one fused matrix, RoPE in the architecture's pairing, an F16 KV cache written with `set_rows`,
//! grouped-query heads, either the fused `flash_attn` kernel or batched `mul_mat` + `soft_max`
//! per head, the output projection) added to the residual, and a pre-norm feed-forward block
//! ([`blocks::ffn`], the architecture's MLP) added to the residual; then the final norm and
//! the output projection for the requested rows. Weights and caches are bound storage
//! ([`WeightRef`](super::weights::WeightRef)), so the same builder runs on one device or on a
//! meta device.
//!
//! Node names the split policies and the plan report rely on: `inp_embd`, `l{i}.attn_out`
//! (the residual after layer i's attention), `l{i}.out` (after its MLP), `logits`.

use super::arch::Tensor;
use super::blocks::{self, NormKind};
use super::hparams::DecoderConfig;
use super::weights::{KvCache, ModelWeights, Weights};
use crate::graph::{Graph, TensorId};
use crate::op::RopeParams;
use crate::{DType, Error, Result};

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

/// The inputs of a step of one sequence, owned: `tokens` at positions `start..`, written to
/// the cache rows of their positions, attending to cache rows `0..n_kv` of which those past
/// the last token hold nothing yet (masked).
#[derive(Clone, Debug)]
pub struct SequenceStep {
    pub tokens: Vec<i32>,
    pub positions: Vec<i32>,
    pub kv_positions: Vec<i32>,
}

impl SequenceStep {
    pub fn new(tokens: &[i32], start: usize, n_kv: usize) -> SequenceStep {
        let end = start + tokens.len();
        SequenceStep {
            tokens: tokens.to_vec(),
            positions: (start..end).map(|p| p as i32).collect(),
            kv_positions: (0..n_kv)
                .map(|j| if j < end { j as i32 } else { -1 })
                .collect(),
        }
    }

    /// The step's input, with logits for `logits_rows`.
    pub fn input(&self, logits_rows: std::ops::Range<usize>) -> StepInput<'_> {
        StepInput {
            tokens: &self.tokens,
            positions: &self.positions,
            slots: &self.positions,
            n_kv: self.kv_positions.len(),
            kv_positions: &self.kv_positions,
            logits_rows,
        }
    }
}

/// The nodes a step graph exposes.
pub struct StepGraph {
    pub graph: Graph,
    pub logits: TensorId,
    /// The leaves holding the step's values, for [`StepGraph::refill`].
    pub leaves: StepLeaves,
}

/// The input leaves of a step graph: what differs between two steps of one structure.
#[derive(Clone, Copy, Debug)]
pub struct StepLeaves {
    pub tokens: TensorId,
    pub positions: TensorId,
    pub slots: TensorId,
    pub mask: TensorId,
    /// The sliding-window mask and its window, for models with one.
    pub mask_swa: Option<(TensorId, usize)>,
}

impl StepGraph {
    /// Put the values of step `inp` (its sequences `seqs`) into this graph's input leaves, so
    /// the graph computes that step: for a step with the token count, cache rows and logits
    /// rows this graph was built for (the graph [`build_step_seqs`] builds for `inp` then
    /// differs from this one only in those values). A step of another token count or cache
    /// size is refused (the leaves' sizes differ); the logits rows and the step's own checks
    /// (`check_step`) are the caller's.
    fn refill(&mut self, inp: &StepInput, seqs: Option<&StepSeqs>) -> Result<()> {
        let (g, l) = (&mut self.graph, self.leaves);
        let t = inp.tokens.len();
        let (tl, ml) = (g.layout(l.tokens).ne, g.layout(l.mask).ne);
        if tl[0] != t || ml[0] != inp.n_kv {
            return Err(Error::shape(
                "refill",
                [t, inp.n_kv, 1, 1],
                [tl[0], ml[0], 1, 1],
                "a step graph takes steps of the token count and cache rows it was built for",
            ));
        }
        g.set_i32(l.tokens, inp.tokens)?;
        g.set_i32(l.positions, inp.positions)?;
        g.set_i32(l.slots, inp.slots)?;
        g.set_f32(l.mask, &causal_mask(inp, seqs, None))?;
        if let Some((m, window)) = l.mask_swa {
            g.set_f32(m, &causal_mask(inp, seqs, Some(window)))?;
        }
        Ok(())
    }
}

/// A step's shape as far as its graph goes: tokens, cache rows attended to, rows with logits.
pub type StepShape = (usize, usize, std::ops::Range<usize>);

/// A step graph kept for the next step of its shape ([`StepShape`]: every decoding step
/// within one `KV_PAD` of cache rows), with each node's storage as built: a backend binds the
/// results it computed, and the graph is put back as it was built (`put_back`) so that the
/// next computation finds the plans made for it. Building a 30-layer model's step graph and
/// freeing it took about a third of a millisecond per step (host time that does not shrink
/// on a faster device); refilling it takes microseconds.
pub struct KeptStep {
    shape: StepShape,
    step: StepGraph,
    storage: Vec<Option<crate::buffer::Storage>>,
}

impl KeptStep {
    /// The graph of step `inp` (sequences `seqs`) of the model `(cfg, w, cache)`: `last`'s,
    /// refilled (the step checked as a build checks it), where it has the step's shape, else
    /// one built anew. Take the graph out to compute it
    /// ([`KeptStep::take_graph`]) and give it back ([`KeptStep::put_back`]) to keep it.
    pub fn for_step(
        last: Option<KeptStep>,
        (cfg, w, cache): (&DecoderConfig, &ModelWeights, &KvCache),
        inp: &StepInput,
        seqs: Option<&StepSeqs>,
    ) -> Result<KeptStep> {
        let shape = (inp.tokens.len(), inp.n_kv, inp.logits_rows.clone());
        match last.filter(|k| k.shape == shape && !k.step.graph.is_empty()) {
            Some(mut k) => {
                check_step(cfg, w, cache, inp, seqs)?;
                k.step.refill(inp, seqs)?;
                Ok(k)
            }
            None => {
                let step = build_step_seqs(cfg, w, cache, inp, seqs)?;
                let storage = step
                    .graph
                    .nodes()
                    .iter()
                    .map(|n| n.storage.clone())
                    .collect();
                Ok(KeptStep {
                    shape,
                    step,
                    storage,
                })
            }
        }
    }

    /// The step's logits node.
    pub fn logits(&self) -> TensorId {
        self.step.logits
    }

    /// The graph, to compute (an empty graph is left in its place until `put_back`).
    pub fn take_graph(&mut self) -> Graph {
        std::mem::take(&mut self.step.graph)
    }

    /// The computed graph back in its place, each node's storage as built.
    pub fn put_back(&mut self, mut g: Graph) {
        for (id, st) in g.ids().zip(&self.storage) {
            let n = g.node_mut(id);
            if n.storage.is_some() || st.is_some() {
                n.storage = st.clone();
            }
        }
        self.step.graph = g;
    }
}

/// The name of the residual stream after layer `l`'s attention block.
pub fn attn_out_name(l: usize) -> String {
    format!("l{l}.attn_out")
}

/// The name of the residual stream before the first layer: the looked-up (and scaled) token
/// embeddings.
pub const INP_EMBD: &str = "inp_embd";

/// The name of the residual stream after layer `l` (its MLP block).
pub fn layer_out_name(l: usize) -> String {
    format!("l{l}.out")
}

/// The residual add a node name refers to: `l{i}.attn_out` (after attention: true) or
/// `l{i}.out` (after the MLP: false), with the layer.
pub fn parse_residual_name(name: &str) -> Option<(usize, bool)> {
    let rest = name.strip_prefix('l')?;
    let (layer, kind) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    match kind {
        "attn_out" => Some((layer, true)),
        "out" => Some((layer, false)),
        _ => None,
    }
}

/// The step's inputs as graph tensors.
struct StepTensors {
    pos: TensorId,
    slots: TensorId,
    mask: TensorId,
    /// The sliding window's mask, for models with local layers.
    mask_swa: Option<TensorId>,
    /// RoPE frequency factors, for models that have them (Llama 3, LongRoPE).
    rope_factors: Option<TensorId>,
    /// LongRoPE's attention factor on each head's rotated dimensions (`[head_dim]`: the
    /// factor, then 1 for the dimensions RoPE leaves alone), multiplying Q and K after RoPE.
    rope_mscale: Option<TensorId>,
    n_kv: usize,
}

/// Which sequence each token of a step and each cache row `0..n_kv` belongs to, for a step
/// over several sequences ([`build_step_seqs`]): a token sees only its own sequence's rows.
#[derive(Clone, Copy, Debug)]
pub struct StepSeqs<'a> {
    /// One per token.
    pub tokens: &'a [i32],
    /// One per cache row attended to.
    pub kv_rows: &'a [i32],
}

/// The causal mask `[n_kv, t]` of a step: row i may see the cache rows holding positions at
/// or before its own (of its own sequence, with `seqs`), and with a `window`, only the last
/// `window` of them.
fn causal_mask(inp: &StepInput, seqs: Option<&StepSeqs>, window: Option<usize>) -> Vec<f32> {
    let t = inp.tokens.len();
    let mut mask = vec![0f32; inp.n_kv * t];
    for i in 0..t {
        for j in 0..inp.n_kv {
            let (kp, qp) = (inp.kv_positions[j], inp.positions[i]);
            let outside = window.is_some_and(|w| (qp as i64 - kp as i64) >= w as i64);
            let other = seqs.is_some_and(|s| s.kv_rows[j] != s.tokens[i]);
            if kp > qp || kp < 0 || outside || other {
                mask[i * inp.n_kv + j] = f32::NEG_INFINITY;
            }
        }
    }
    mask
}

/// Check a step's inputs against each other, the cache and the weights.
fn check_step(
    cfg: &DecoderConfig,
    w: &ModelWeights,
    cache: &KvCache,
    inp: &StepInput,
    seqs: Option<&StepSeqs>,
) -> Result<()> {
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
    if let Some(s) = seqs {
        if s.tokens.len() != t {
            return bad(
                "sequence ids",
                format!("one per token ({t})"),
                s.tokens.len().to_string(),
            );
        }
        if s.kv_rows.len() != inp.n_kv {
            return bad(
                "cache row sequence ids",
                format!("one per cache row in use ({})", inp.n_kv),
                s.kv_rows.len().to_string(),
            );
        }
    }
    if inp.logits_rows.is_empty() || inp.logits_rows.end > t {
        return bad(
            "logits rows",
            format!("a non-empty range within 0..{t}"),
            format!("{:?}", inp.logits_rows),
        );
    }
    for (what, len) in [
        ("layers of weights", w.layers.len()),
        ("layers of the K cache", cache.k.len()),
        ("layers of the V cache", cache.v.len()),
    ] {
        if len != cfg.n_layer {
            return bad(what, format!("n_layer {}", cfg.n_layer), len.to_string());
        }
    }
    Ok(())
}

/// Build one decoder step: `tokens` in, logits `[n_vocab, rows]` out.
pub fn build_step(
    cfg: &DecoderConfig,
    w: &ModelWeights,
    cache: &KvCache,
    inp: &StepInput,
) -> Result<StepGraph> {
    build_step_seqs(cfg, w, cache, inp, None)
}

/// Build one decoder step over tokens of several sequences (`seqs`; `None`: all one
/// sequence): each token attends to the cache rows of its own sequence only, through the
/// step's mask (as llama.cpp's unified KV cache does), so the graph is the one-sequence graph
/// with a different mask, and runs wherever that one runs.
pub fn build_step_seqs(
    cfg: &DecoderConfig,
    w: &ModelWeights,
    cache: &KvCache,
    inp: &StepInput,
    seqs: Option<&StepSeqs>,
) -> Result<StepGraph> {
    build(cfg, w, cache, inp, seqs, true)
}

/// [`build_step`] with zeros for the masks' values, for a graph that is sharded, measured and
/// costed but never run (the planner): a prompt chunk's mask is tokens times cache rows of f32
/// (64 MiB for 4096 tokens), which was built and copied each time a cost was asked (Llama-3-70B
/// at batch 64 took 2.7 s to plan on 8 H100s, most of it page faults).
pub fn build_step_shapes(
    cfg: &DecoderConfig,
    w: &ModelWeights,
    cache: &KvCache,
    inp: &StepInput,
) -> Result<StepGraph> {
    build(cfg, w, cache, inp, None, false)
}

fn build(
    cfg: &DecoderConfig,
    w: &ModelWeights,
    cache: &KvCache,
    inp: &StepInput,
    seqs: Option<&StepSeqs>,
    mask_values: bool,
) -> Result<StepGraph> {
    cfg.validate()?;
    check_step(cfg, w, cache, inp, seqs)?;
    let t = inp.tokens.len();
    let mut g = Graph::new();
    let tokens = g.input_i32("tokens", [t, 1, 1, 1], inp.tokens)?;
    let pos = g.input_i32("positions", [t, 1, 1, 1], inp.positions)?;
    let slots = g.input_i32("slots", [t, 1, 1, 1], inp.slots)?;
    let mut mask_input = |name: &str, window: Option<usize>| match mask_values {
        true => g.input_f32(name, [inp.n_kv, t, 1, 1], &causal_mask(inp, seqs, window)),
        false => {
            // Zeros shared by every leaf of that size in the process (`Graph::set_zeros`).
            let id = g.input(name, DType::F32, [inp.n_kv, t, 1, 1])?;
            g.set_zeros(id).map(|_| id)
        }
    };
    let mask = mask_input("kq_mask", None)?;
    let mask_swa = match cfg.swa {
        Some(w) => Some(mask_input("kq_mask_swa", Some(w.window))?),
        None => None,
    };
    let leaves = StepLeaves {
        tokens,
        positions: pos,
        slots,
        mask,
        mask_swa: mask_swa.zip(cfg.swa.map(|w| w.window)),
    };
    let (rope_factors, rope_mscale) = rope_scaling(&mut g, cfg, w, cache.size)?;
    let step = StepTensors {
        pos,
        slots,
        mask,
        mask_swa,
        rope_factors,
        rope_mscale,
        n_kv: inp.n_kv,
    };

    let embd = w.model.get(Tensor::TokenEmbd)?.leaf(&mut g)?;
    let mut x = g.get_rows(embd, tokens)?;
    if cfg.embd_scale != 1.0 {
        x = g.scale(x, cfg.embd_scale)?;
    }
    g.set_name(x, INP_EMBD);
    for (l, lw) in w.layers.iter().enumerate() {
        x = decoder_layer(&mut g, cfg, l, lw, cache, &step, x)?;
    }
    // Rows that need logits, before the final norm (a partial sum is reduced on fewer rows).
    let rows = inp.logits_rows.len();
    let nb1 = g.layout(x).nb[1];
    let x = if rows == t {
        x
    } else {
        g.view_2d(x, cfg.n_embd, rows, nb1, inp.logits_rows.start * nb1)?
    };
    let x = blocks::norm_of(
        &mut g,
        NormKind::Rms,
        &w.model,
        Tensor::OutputNorm,
        None,
        x,
        cfg.rms_eps,
    )?;
    let out = w.model.get(Tensor::Output)?.leaf(&mut g)?;
    let mut logits = g.mul_mat(out, x)?;
    if let Some(cap) = cfg.final_softcap {
        logits = softcap(&mut g, logits, 1.0, cap)?;
    }
    g.set_name(logits, "logits");
    g.set_output(logits);
    Ok(StepGraph {
        graph: g,
        logits,
        leaves,
    })
}

/// The RoPE frequency factors of a step with a cache of `ctx` rows (Llama 3's `rope_freqs`,
/// or LongRoPE's long factors past the original context and short ones within it, as
/// llama.cpp's `get_rope_factors` picks them by the session's context) and LongRoPE's
/// attention factor as a `[head_dim]` vector (None when it is 1).
fn rope_scaling(
    g: &mut Graph,
    cfg: &DecoderConfig,
    w: &ModelWeights,
    ctx: usize,
) -> Result<(Option<TensorId>, Option<TensorId>)> {
    let Some(lr) = cfg.long_rope else {
        return Ok((
            blocks::leaf_opt(g, &w.model, Some(Tensor::RopeFreqs))?,
            None,
        ));
    };
    let t = if ctx > lr.original_context {
        Tensor::RopeFactorsLong
    } else {
        Tensor::RopeFactorsShort
    };
    let factors = Some(w.model.get(t)?.leaf(g)?);
    if lr.attn_factor == 1.0 {
        return Ok((factors, None));
    }
    let m: Vec<f32> = (0..cfg.head_dim)
        .map(|i| {
            if i < cfg.rope_dims {
                lr.attn_factor
            } else {
                1.0
            }
        })
        .collect();
    let m = g.input_f32("rope_attn_factor", [cfg.head_dim, 1, 1, 1], &m)?;
    Ok((factors, Some(m)))
}

/// `x * m` where there is an `m`.
fn mul_opt(g: &mut Graph, x: TensorId, m: Option<TensorId>) -> Result<TensorId> {
    match m {
        Some(m) => g.mul(x, m),
        None => Ok(x),
    }
}

/// One layer: `x + attention(norm(x))`, then `+ ffn(norm(.))`.
fn decoder_layer(
    g: &mut Graph,
    cfg: &DecoderConfig,
    l: usize,
    lw: &Weights,
    cache: &KvCache,
    step: &StepTensors,
    x: TensorId,
) -> Result<TensorId> {
    let spec = cfg.arch.decoder()?;
    let cur = blocks::norm_of(g, NormKind::Rms, lw, Tensor::AttnNorm, None, x, cfg.rms_eps)?;
    let attn = self_attention(g, cfg, l, lw, cache, step, cur)?;
    let wo = lw.get(Tensor::AttnOut)?.leaf(g)?;
    let bo = blocks::leaf_opt(g, lw, Some(Tensor::AttnOutBias))?;
    let o = g.mul_mat(wo, attn)?;
    let o = blocks::add_bias(g, o, bo)?;
    let o = norm_where_present(g, cfg, lw, Tensor::AttnPostNorm, o)?;
    let x = g.add(o, x)?;
    g.set_name(x, attn_out_name(l));
    let cur = blocks::norm_of(g, NormKind::Rms, lw, Tensor::FfnNorm, None, x, cfg.rms_eps)?;
    let d = match &cfg.moe {
        Some(m) => super::moe::moe_ffn(g, m, l, lw, cur)?,
        None => blocks::ffn(g, spec.mlp, lw, cur)?,
    };
    let d = norm_where_present(g, cfg, lw, Tensor::FfnPostNorm, d)?;
    let x = g.add(d, x)?;
    g.set_name(x, layer_out_name(l));
    Ok(x)
}

/// `norm(x)` (RMS over ne0) with the layer's norm weight `t` where it has one, else `x`: the
/// post-block norms (Gemma 2 and 3), the per-head Q and K norms on `[hd, heads, t]`
/// (Qwen3, Gemma 3) and the whole-projection ones on `[hd * heads, t]` (OLMoE), those as
/// [`NormKind::RmsSums`] so a split attention keeps its heads' columns.
fn norm_where_present(
    g: &mut Graph,
    cfg: &DecoderConfig,
    lw: &Weights,
    t: Tensor,
    x: TensorId,
) -> Result<TensorId> {
    if lw.opt(t).is_none() {
        return Ok(x);
    }
    let kind = match t {
        Tensor::AttnQNormFull | Tensor::AttnKNormFull => NormKind::RmsSums,
        _ => NormKind::Rms,
    };
    blocks::norm_of(g, kind, lw, t, None, x, cfg.rms_eps)
}

/// `cap * tanh(x * scale / cap)`: soft-capping (Gemma 2's attention scores and logits).
fn softcap(g: &mut Graph, x: TensorId, scale: f32, cap: f32) -> Result<TensorId> {
    let x = g.scale(x, scale / cap)?;
    let x = g.unary(crate::op::UnaryOp::Tanh, x)?;
    g.scale(x, cap)
}

/// The attention of layer `l` on the normed `cur`, before the output projection: `[hd * nh,
/// t]`. Q, K, V with their biases where the layer has them, Q and K normalized (over the whole
/// projection, or per head) where the layer has those norms, RoPE on Q and K (the layer's base), K and V written to the cache
/// rows `slots`, then attention over the cache rows `0..n_kv` (through the sliding window on
/// local layers), soft-capped where the model says.
fn self_attention(
    g: &mut Graph,
    cfg: &DecoderConfig,
    l: usize,
    lw: &Weights,
    cache: &KvCache,
    step: &StepTensors,
    cur: TensorId,
) -> Result<TensorId> {
    let t = g.layout(cur).ne[1];
    let (hd, nh, nkv, n_kv) = (cfg.head_dim, cfg.n_head, cfg.n_head_kv, step.n_kv);
    let rope = RopeParams {
        mode: cfg.rope_mode,
        n_dims: cfg.rope_dims,
        freq_base: cfg.rope_base_of(l),
        freq_scale: 1.0,
    };
    let local = cfg.swa.is_some_and(|w| w.is_local(l));
    let mask = match step.mask_swa {
        Some(m) if local => m,
        _ => step.mask,
    };
    let proj = blocks::Qkv::declare(g, lw, cur, cfg.n_embd_q(), cfg.n_embd_kv())?;
    let q = proj.q(g)?;
    let q = norm_where_present(g, cfg, lw, Tensor::AttnQNormFull, q)?;
    let q = g.reshape(q, [hd, nh, t, 1])?;
    let q = norm_where_present(g, cfg, lw, Tensor::AttnQNorm, q)?;
    let q = g.rope_ext(q, step.pos, step.rope_factors, rope)?;
    let q = mul_opt(g, q, step.rope_mscale)?;
    let k = proj.k(g)?;
    let k = norm_where_present(g, cfg, lw, Tensor::AttnKNormFull, k)?;
    let k = g.reshape(k, [hd, nkv, t, 1])?;
    let k = norm_where_present(g, cfg, lw, Tensor::AttnKNorm, k)?;
    let k = g.rope_ext(k, step.pos, step.rope_factors, rope)?;
    let k = mul_opt(g, k, step.rope_mscale)?;
    let k = g.reshape(k, [hd * nkv, t, 1, 1])?;
    let v = proj.v(g)?;
    let ck = cache.k[l].leaf(g)?;
    let cv = cache.v[l].leaf(g)?;
    let ck = g.set_rows(ck, k, step.slots)?;
    let cv = g.set_rows(cv, v, step.slots)?;
    // Cache views [hd, n_kv, heads_kv].
    let es = DType::F16.type_size();
    let row = hd * nkv * es;
    let kview = g.view_3d(ck, [hd, n_kv, nkv], row, hd * es, 0)?;
    let vview = g.view_3d(cv, [hd, n_kv, nkv], row, hd * es, 0)?;
    let q = g.permute(q, [0, 2, 1, 3])?; // [hd, t, nh]
    let scale = cfg.attn_scale;
    if cfg.fused_attn && cfg.attn_softcap.is_none() {
        let o = g.flash_attn(q, kview, vview, Some(mask), scale)?; // [hd, nh, t]
        return g.reshape(o, [hd * nh, t, 1, 1]);
    }
    let values = |g: &mut Graph| {
        let vt = g.permute(vview, [1, 0, 2, 3])?; // [n_kv, hd, nkv]
        g.cast(vt, DType::F32)
    };
    // [hd, t, nh]
    let kqv = match cfg.attn_softcap {
        None => blocks::attention_core(g, q, kview, mask, scale, values)?,
        Some(cap) => {
            let kq = g.mul_mat(kview, q)?;
            let kq = softcap(g, kq, scale, cap)?;
            let kq = g.soft_max(kq, Some(mask), 1.0)?;
            let vt = values(g)?;
            g.mul_mat(vt, kq)?
        }
    };
    let kqv = g.permute(kqv, [0, 2, 1, 3])?; // [hd, nh, t]
    let kqv = g.cont(kqv)?;
    g.reshape(kqv, [hd * nh, t, 1, 1])
}
