//! The built-in split callback for Llama-family decoders (the assignments of llama.cpp's
//! `llama_meta_device_get_split_state`, see `shared/reference/upstream-meta-facts.md`):
//! Q/K/V and gate/up column-parallel (axis 1), attention output and down projection
//! row-parallel (axis 0, giving partial sums), the output projection vocabulary-split, the KV
//! cache split by KV heads (axis 0), norms and the token embedding mirrored.
//!
//! Attention is split in whole GQA groups (a group = one KV head and the query heads that read
//! it), the MLP in whole quantization blocks; the rounding remainder rotates with the layer
//! index. `--tensor-split` ratios are honoured in the same units. With more devices than
//! groups some devices get no attention heads (zero extents) unless attention is mirrored.
//!
//! [`by_layer`] is the general form the planner uses: per layer, attention and MLP split or
//! mirrored ([`LayerSplit`]); the output projection and the token embedding split by
//! vocabulary or mirrored ([`DecoderSplit`]); [`megatron`] is its every-layer case.
//!
//! Sequence parallelism ([`DecoderSplit::sequence_parallel`], [`sequence_parallel_hints`]) is
//! not a split of weights but of the residual stream: state hints put the residual adds
//! `l{i}.attn_out` and `l{i}.out` (`[n_embd, T]`) on Axis1 with even token shares, so each
//! split block's partial output is reduce-scattered into the token split instead of
//! all-reduced; the norms after them then run on each device's tokens (their cheapest
//! pattern), and the normed activation is hinted Mirrored, all-gathered before the next
//! column-parallel products. [`policy`] gives the callback and the hints together.

use super::decoder::DecoderConfig;
use crate::meta::{HintFn, NodeInfo, SplitFn, SplitPolicy, TensorInfo};
use crate::op::{BinaryOp, Op};
use crate::split_state::{Granularity, SplitState, split_even, split_ratios};
use crate::{Error, Result};
use std::sync::Arc;

/// Options of the built-in split.
#[derive(Clone, Debug, Default)]
pub struct SplitOptions {
    /// Per-device shares (`--tensor-split 3,1`); even when absent.
    pub ratios: Option<Vec<f64>>,
    /// Keep attention (Q, K, V, output, KV cache) mirrored instead of head-split.
    pub mirror_attention: bool,
}

/// What a decoder tensor name refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Q,
    K,
    V,
    AttnOut,
    Gate,
    Up,
    Down,
    CacheK,
    CacheV,
    Output,
    Embedding,
    Other,
}

/// Parse `blk.N.kind.weight`, `cache_k_lN`, `output.weight` into (role, layer).
pub fn role(name: &str) -> (Role, usize) {
    if let Some(rest) = name.strip_prefix("blk.") {
        let mut it = rest.splitn(2, '.');
        let layer = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        let kind = it.next().unwrap_or("");
        let r = match kind {
            "attn_q.weight" => Role::Q,
            "attn_k.weight" => Role::K,
            "attn_v.weight" => Role::V,
            "attn_output.weight" => Role::AttnOut,
            "ffn_gate.weight" => Role::Gate,
            "ffn_up.weight" => Role::Up,
            "ffn_down.weight" => Role::Down,
            _ => Role::Other,
        };
        return (r, layer);
    }
    for (p, r) in [("cache_k_l", Role::CacheK), ("cache_v_l", Role::CacheV)] {
        if let Some(l) = name.strip_prefix(p).and_then(|s| s.parse().ok()) {
            return (r, l);
        }
    }
    if name == "output.weight" {
        return (Role::Output, 0);
    }
    if name == "token_embd.weight" {
        return (Role::Embedding, 0);
    }
    (Role::Other, 0)
}

/// Extents of `units` units of `unit` each over `n` devices (even or by ratios), rotated by
/// `rotation`.
pub(crate) fn extents(
    units: usize,
    unit: usize,
    n: usize,
    ratios: Option<&[f64]>,
    rotation: usize,
) -> Result<Vec<usize>> {
    let v = match ratios {
        Some(r) => {
            if r.len() != n {
                return Err(Error::invalid_input(
                    "tensor split",
                    "split ratios",
                    format!("one per device ({n})"),
                    r.len(),
                ));
            }
            split_ratios(units, r, Granularity(1), rotation)?
        }
        None => split_even(units, n, Granularity(1), rotation)?,
    };
    Ok(v.into_iter().map(|u| u * unit).collect())
}

/// What one layer splits: attention by whole KV-head groups (Q, K, V, output, KV cache),
/// the MLP column then row (gate/up by columns, down by rows). What is not split is mirrored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct LayerSplit {
    pub attention: bool,
    pub mlp: bool,
}

/// Which parts of a decoder are split, per layer and at the ends; the shares of the devices.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DecoderSplit {
    /// One entry per layer.
    pub layers: Vec<LayerSplit>,
    /// The output projection split by vocabulary (logits gathered on read).
    pub output: bool,
    /// The token embedding split by vocabulary (rows looked up where they live, summed).
    pub embedding: bool,
    /// Per-device shares (in whole heads and blocks); even when absent.
    pub ratios: Option<Vec<f64>>,
    /// Sequence parallelism: the residual stream after each split block split along tokens
    /// (reduce-scatter and all-gather in place of the all-reduce; see
    /// [`sequence_parallel_hints`]). Absent in older plan files: off.
    #[serde(default)]
    pub sequence_parallel: bool,
}

impl DecoderSplit {
    /// Every layer alike.
    pub fn uniform(n_layer: usize, layer: LayerSplit, output: bool, embedding: bool) -> Self {
        DecoderSplit {
            layers: vec![layer; n_layer],
            output,
            embedding,
            ratios: None,
            sequence_parallel: false,
        }
    }
}

/// The residual add a node name refers to: `l{i}.attn_out` (after attention: true) or
/// `l{i}.out` (after the MLP: false), with the layer.
fn residual(name: &str) -> Option<(usize, bool)> {
    let rest = name.strip_prefix('l')?;
    let (layer, kind) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    match kind {
        "attn_out" => Some((layer, true)),
        "out" => Some((layer, false)),
        _ => None,
    }
}

/// The norm weight a tensor name refers to: `blk.{i}.attn_norm.weight` (before attention:
/// true) or `blk.{i}.ffn_norm.weight` (before the MLP: false), with the layer.
fn norm_weight(name: &str) -> Option<(usize, bool)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, kind) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    match kind {
        "attn_norm.weight" => Some((layer, true)),
        "ffn_norm.weight" => Some((layer, false)),
        _ => None,
    }
}

/// The state hints of sequence parallelism for a decoder split as `plan` (None when
/// `plan.sequence_parallel` is off). Two kinds of node of a step of `T` tokens are hinted:
///
/// - the residual add after each split block (`l{i}.attn_out` when layer i's attention is
///   split, `l{i}.out` when its MLP is): Axis1 (tokens), even shares with the remainder on the
///   first devices, the same for every node so the stream never changes split. The block's
///   partial output is then reduce-scattered into it (the greedy choice would keep it Partial,
///   padding the residual locally, and all-reduce before the norm), and the RMS norm after it
///   keeps the split by itself (rows are independent);
/// - the normed activation after such a residual (the product with `blk.{i}.attn_norm.weight`
///   or `blk.{i}.ffn_norm.weight`): Mirrored, so it is all-gathered once for the
///   column-parallel products that read it. Without this hint a long prompt of a model with
///   small (quantized) weights would gather each weight instead (fewer bytes for that product,
///   but the attention after it then needs all-to-alls into the head-split cache).
///
/// Only steps of at least as many tokens as devices are hinted: a decode step (one token)
/// would leave all but one device idle for the price of two collectives instead of one, so it
/// keeps Megatron's all-reduce. The last layer's output is not hinted either: the step keeps
/// it Partial and reduces only the rows that get logits (usually one) before the final norm,
/// where a token split would gather the whole stream (a view of some rows of a token split is
/// not cut per device).
pub fn sequence_parallel_hints(plan: &DecoderSplit) -> Option<HintFn> {
    if !plan.sequence_parallel {
        return None;
    }
    let layers = plan.layers.clone();
    // Whether the residual stream after layer `layer`'s attention (or MLP) is token-split.
    let split_after = move |layer: usize, after_attention: bool| {
        layers.get(layer).is_some_and(|l| {
            if after_attention {
                l.attention
            } else {
                l.mlp && layer + 1 < layers.len()
            }
        })
    };
    Some(Arc::new(move |node: &NodeInfo| -> Option<SplitState> {
        let (n, ne) = (node.n_devices, node.layout().ne);
        if n < 2 || ne[1] < n || ne[2] * ne[3] != 1 {
            return None;
        }
        if let Some((layer, after_attention)) = residual(node.name()) {
            if !split_after(layer, after_attention) {
                return None;
            }
            let extents = split_even(ne[1], n, Granularity(1), 0).ok()?;
            return Some(SplitState::axis(1, &extents));
        }
        if !matches!(node.op(), Op::Binary(BinaryOp::Mul)) {
            return None;
        }
        let (layer, before_attention) = node.source_names().find_map(norm_weight)?;
        let input_split = if before_attention {
            layer > 0 && split_after(layer - 1, false)
        } else {
            split_after(layer, true)
        };
        input_split.then(|| SplitState::mirrored(n))
    }))
}

/// The split callback and the state hints of `plan` ([`by_layer`] and
/// [`sequence_parallel_hints`]).
pub fn policy(cfg: &DecoderConfig, plan: DecoderSplit) -> SplitPolicy {
    SplitPolicy {
        hints: sequence_parallel_hints(&plan),
        split: by_layer(cfg, plan),
    }
}

/// The built-in callback for a decoder with this configuration: attention and MLP split in
/// every layer (attention mirrored with `mirror_attention`), the output projection
/// vocabulary-split, the embedding mirrored.
pub fn megatron(cfg: &DecoderConfig, opts: SplitOptions) -> SplitFn {
    let layer = LayerSplit {
        attention: !opts.mirror_attention,
        mlp: true,
    };
    let mut plan = DecoderSplit::uniform(cfg.n_layer, layer, true, false);
    plan.ratios = opts.ratios;
    by_layer(cfg, plan)
}

/// The callback for a per-layer choice of splits (`plan.layers[i]` for layer i; layers past
/// the list, and caches of such layers, are mirrored).
pub fn by_layer(cfg: &DecoderConfig, plan: DecoderSplit) -> SplitFn {
    let cfg = cfg.clone();
    Arc::new(move |t: &TensorInfo| -> Result<SplitState> {
        let n = t.n_devices;
        let (role, layer) = role(t.name);
        let hd = cfg.head_dim();
        let groups = |unit: usize| extents(cfg.n_head_kv, unit, n, plan.ratios.as_deref(), layer);
        // The MLP in whole blocks of 32 (quantized rows along K need whole blocks).
        let ffn = |total: usize| -> Result<Vec<usize>> {
            if total.is_multiple_of(32) {
                extents(total / 32, 32, n, plan.ratios.as_deref(), layer)
            } else {
                extents(total, 1, n, plan.ratios.as_deref(), layer)
            }
        };
        let split = plan.layers.get(layer).copied().unwrap_or(LayerSplit {
            attention: false,
            mlp: false,
        });
        let (attn, mlp) = (split.attention, split.mlp);
        let vocab = |v: usize| extents(v, 1, n, plan.ratios.as_deref(), 0);
        Ok(match role {
            Role::Q if attn => SplitState::axis(1, &groups(hd * cfg.group())?),
            Role::K | Role::V if attn => SplitState::axis(1, &groups(hd)?),
            Role::AttnOut if attn => SplitState::axis(0, &groups(hd * cfg.group())?),
            Role::CacheK | Role::CacheV if attn => SplitState::axis(0, &groups(hd)?),
            Role::Gate | Role::Up if mlp => SplitState::axis(1, &ffn(t.layout.ne[1])?),
            Role::Down if mlp => SplitState::axis(0, &ffn(t.layout.ne[0])?),
            Role::Output if plan.output => SplitState::axis(1, &vocab(t.layout.ne[1])?),
            Role::Embedding if plan.embedding => SplitState::axis(1, &vocab(t.layout.ne[1])?),
            _ => SplitState::mirrored(n),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::op::RopeMode;
    use crate::tensor::Layout;

    fn smol() -> DecoderConfig {
        DecoderConfig {
            n_layer: 30,
            n_embd: 576,
            n_ff: 1536,
            n_head: 9,
            n_head_kv: 3,
            n_vocab: 49152,
            rms_eps: 1e-5,
            rope_base: 1e5,
            rope_mode: RopeMode::Normal,
            rope_dims: 64,
            fused_attn: false,
        }
    }

    fn state(f: &SplitFn, name: &str, ne: [usize; 4], n: usize) -> SplitState {
        let l = Layout::contiguous(DType::Q4_1, ne);
        f(&TensorInfo {
            name,
            layout: &l,
            n_devices: n,
        })
        .unwrap()
    }

    #[test]
    fn whole_groups_rotate_by_layer_and_zero_extents_appear() {
        let f = megatron(&smol(), SplitOptions::default());
        // 3 groups over 2 devices: 2 + 1 on layer 0, 1 + 2 on layer 1.
        assert_eq!(
            state(&f, "blk.0.attn_q.weight", [576, 576, 1, 1], 2),
            SplitState::axis(1, &[384, 192])
        );
        assert_eq!(
            state(&f, "blk.1.attn_q.weight", [576, 576, 1, 1], 2),
            SplitState::axis(1, &[192, 384])
        );
        assert_eq!(
            state(&f, "blk.0.attn_k.weight", [576, 192, 1, 1], 2),
            SplitState::axis(1, &[128, 64])
        );
        assert_eq!(
            state(&f, "cache_v_l1", [192, 64, 1, 1], 2),
            SplitState::axis(0, &[64, 128])
        );
        assert_eq!(
            state(&f, "blk.0.attn_output.weight", [576, 576, 1, 1], 2),
            SplitState::axis(0, &[384, 192])
        );
        // 4 devices: one gets no heads.
        assert_eq!(
            state(&f, "blk.0.attn_k.weight", [576, 192, 1, 1], 4),
            SplitState::axis(1, &[64, 64, 64, 0])
        );
        assert_eq!(
            state(&f, "blk.0.ffn_down.weight", [1536, 576, 1, 1], 3),
            SplitState::axis(0, &[512, 512, 512])
        );
        assert!(state(&f, "token_embd.weight", [576, 49152, 1, 1], 2).is_mirrored());
    }

    #[test]
    fn ratios_are_honoured_in_whole_groups() {
        let opts = SplitOptions {
            ratios: Some(vec![3.0, 1.0]),
            mirror_attention: false,
        };
        let f = megatron(&smol(), opts);
        assert_eq!(
            state(&f, "blk.0.attn_q.weight", [576, 576, 1, 1], 2),
            SplitState::axis(1, &[384, 192])
        );
        assert_eq!(
            state(&f, "blk.0.ffn_up.weight", [576, 1536, 1, 1], 2),
            SplitState::axis(1, &[1152, 384])
        );
        // Two ratios for three devices.
        let l = Layout::contiguous(DType::Q4_1, [576, 1536, 1, 1]);
        let e = f(&TensorInfo {
            name: "blk.0.ffn_up.weight",
            layout: &l,
            n_devices: 3,
        })
        .unwrap_err();
        match e {
            Error::InvalidInput {
                what,
                expected,
                got,
                ..
            } => assert_eq!(
                (what.as_str(), expected.as_str(), got.as_str()),
                ("split ratios", "one per device (3)", "2")
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn sequence_parallel_hints_the_residual_stream_of_split_blocks() {
        let l = |attention, mlp| LayerSplit { attention, mlp };
        let mut plan = DecoderSplit::uniform(3, l(true, true), true, false);
        assert!(sequence_parallel_hints(&plan).is_none());
        plan.sequence_parallel = true;
        plan.layers[1] = l(false, true);
        let h = sequence_parallel_hints(&plan).unwrap();
        // A residual add named `name`, or the product with the norm weight `name`, of `t`
        // tokens on `n` devices.
        let hint = |name: &str, t: usize, n: usize| {
            let mut g = crate::Graph::new();
            let x = g.input("x", DType::F32, [576, t, 1, 1]).unwrap();
            let id = if name.starts_with("blk.") {
                let w = g.input(name, DType::F32, [576, 1, 1, 1]).unwrap();
                g.mul(x, w).unwrap()
            } else {
                let a = g.add(x, x).unwrap();
                g.set_name(a, name);
                a
            };
            h(&NodeInfo {
                graph: &g,
                id,
                n_devices: n,
            })
        };
        let tokens = |e: &[usize]| Some(SplitState::axis(1, e));
        assert_eq!(hint("l0.attn_out", 5, 2), tokens(&[3, 2]));
        assert_eq!(hint("l0.out", 5, 2), tokens(&[3, 2]));
        assert_eq!(hint("l2.attn_out", 7, 3), tokens(&[3, 2, 2]));
        // Layer 1's attention is mirrored: its output is not partial, nothing to scatter.
        assert_eq!(hint("l1.attn_out", 5, 2), None);
        assert_eq!(hint("l1.out", 5, 2), tokens(&[3, 2]));
        // The last layer's output, fewer tokens than devices, other nodes: no hint.
        assert_eq!(hint("l2.out", 5, 2), None);
        assert_eq!(hint("l0.out", 1, 2), None);
        assert_eq!(hint("l0.out", 2, 3), None);
        assert_eq!(hint("l3.out", 5, 2), None);
        assert_eq!(hint("l0.outer", 5, 2), None);
        // The normed activations after a token-split residual are gathered (mirrored).
        let m = Some(SplitState::mirrored(2));
        assert_eq!(hint("blk.0.ffn_norm.weight", 5, 2), m);
        assert_eq!(hint("blk.1.attn_norm.weight", 5, 2), m);
        assert_eq!(hint("blk.1.ffn_norm.weight", 5, 2), None);
        assert_eq!(hint("blk.2.attn_norm.weight", 5, 2), m);
        // Before the first layer the stream is the (mirrored) embedding.
        assert_eq!(hint("blk.0.attn_norm.weight", 5, 2), None);
        assert_eq!(hint("blk.0.ffn_norm.weight", 1, 2), None);
        assert_eq!(hint("output_norm.weight", 5, 2), None);
    }

    #[test]
    fn plan_files_without_sequence_parallelism_still_load() {
        let old = r#"{"layers":[{"attention":true,"mlp":false}],"output":true,"embedding":false,"ratios":null}"#;
        let p: DecoderSplit = serde_json::from_str(old).unwrap();
        assert!(!p.sequence_parallel);
        let mut q = p.clone();
        q.sequence_parallel = true;
        let back: DecoderSplit = serde_json::from_str(&serde_json::to_string(&q).unwrap()).unwrap();
        assert_eq!(back, q);
    }
}
