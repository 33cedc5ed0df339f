//! The built-in split callbacks, one for every architecture (the assignments of llama.cpp's
//! `llama_meta_device_get_split_state`, see `shared/reference/upstream-meta-facts.md`), read
//! from the architecture table's per-role cuts (`arch/tensor.rs`): Q/K/V and gate/up
//! column-parallel (axis 1, their biases along axis 0 with the same extents), attention output
//! and down projection row-parallel (axis 0, giving partial sums), the output projection
//! vocabulary-split, the KV cache split by KV heads (axis 0); norms, the biases added after a
//! reduction and the position and type tables mirrored; the token embedding mirrored unless
//! split by vocabulary rows.
//!
//! Attention is split in whole GQA groups (a group = one KV head and the query heads that read
//! it; BERT's groups are single heads), the MLP in units of at least 32 features and whole
//! blocks of the weights' type; the rounding remainder rotates with the layer index.
//! `--tensor-split` ratios are honoured in the same units. With more devices than groups some
//! devices would get no attention heads (zero extents): [`kv_repeat`] says how many times the
//! run repeats each KV head (virtual KV heads, `DecoderConfig::with_kv_repeat`) so that every
//! device gets whole groups; the callbacks then split the repeated heads like any others.
//!
//! A mixture of experts is split with the MLP: its shared expert as a dense MLP, its experts
//! either column then row inside every expert (`ExpertSplit::Tensor`, the default: every
//! device holds a slice of every expert) or whole experts per device
//! (`ExpertSplit::Expert`, expert parallelism: the experts' tensors cut on `ne[2]`, even shares
//! with the remainder rotating by layer, or by `--tensor-split`; each device multiplies the
//! rows routed to its experts and one all-reduce joins them, see `split_state`'s `Routed`),
//! or both (`ExpertSplit::Both`, `--experts both --expert-groups G`: the devices in G groups
//! of consecutive devices, as even as they go, the experts cut whole over the groups as
//! expert parallelism cuts them over devices, and inside a group each expert's gate and up
//! columns and down rows as the dense MLP's; `split_state`'s `ExpertGroups`). The router is
//! mirrored.
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

use super::arch::{Arch, Cut, Dim, Naming, Part, Tensor, Unit};
use super::decoder::{INP_EMBD, parse_residual_name};
use super::hparams::{DecoderConfig, Moe};
use super::weights::TensorDecl;
use crate::meta::{HintFn, NodeInfo, SplitFn, SplitPolicy, TensorInfo};
use crate::op::{BinaryOp, Op};
use crate::split_state::{Granularity, SplitState, split_even, split_ratios};
use crate::{Error, Result};
use std::sync::Arc;

/// The smallest unit the MLP is split in (features), when the width allows: whole units of 32
/// keep column groups aligned for the kernels; a weight type with larger blocks raises it.
pub const FFN_UNIT: usize = 32;

/// Options of the built-in split.
#[derive(Clone, Debug, Default)]
pub struct SplitOptions {
    /// Per-device shares (`--tensor-split 3,1`); even when absent.
    pub ratios: Option<Vec<f64>>,
    /// Keep attention (Q, K, V, output, KV cache) mirrored instead of head-split.
    pub mirror_attention: bool,
    /// How the experts of a mixture of experts are split.
    pub experts: ExpertSplit,
}

/// How a split MLP of experts divides them over the devices.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum ExpertSplit {
    /// Column then row inside every expert, as the dense MLP (every device a slice of each).
    #[default]
    Tensor,
    /// Whole experts per device (expert parallelism).
    Expert,
    /// Whole experts per group of devices (`groups` groups of consecutive devices, as even as
    /// they go), column then row inside every expert within its group. On fewer devices than
    /// `groups`, one group per device (`--expert-groups` is checked against the devices
    /// before: [`ExpertSplit::check_groups`]).
    Both { groups: usize },
}

impl ExpertSplit {
    /// The splits without a parameter (each test and strategy list adds `Both` with its
    /// groups).
    pub const ALL: [ExpertSplit; 2] = [ExpertSplit::Tensor, ExpertSplit::Expert];

    pub fn name(self) -> &'static str {
        match self {
            ExpertSplit::Tensor => "tensor",
            ExpertSplit::Expert => "expert",
            ExpertSplit::Both { .. } => "both",
        }
    }

    /// `tensor`, `expert` or `both` (its groups then 0, set by [`ExpertSplit::with_groups`]),
    /// else an error naming `flag`.
    pub fn parse(s: &str, flag: &str) -> Result<ExpertSplit> {
        match s {
            "both" => Ok(ExpertSplit::Both { groups: 0 }),
            _ => ExpertSplit::ALL
                .into_iter()
                .find(|e| e.name() == s)
                .ok_or_else(|| Error::invalid_argument(flag, s, "tensor, expert or both")),
        }
    }

    /// `--experts` (`experts`) with `--expert-groups` (`groups`): `both` takes the groups and
    /// needs them; the others take none. Errors name `--expert-groups`.
    pub fn with_groups(
        experts: Option<ExpertSplit>,
        groups: Option<usize>,
    ) -> Result<Option<Self>> {
        match (experts, groups) {
            (Some(ExpertSplit::Both { .. }), Some(g)) => Ok(Some(ExpertSplit::Both { groups: g })),
            (Some(ExpertSplit::Both { groups: 0 }), None) => Err(Error::invalid_argument(
                "--expert-groups",
                "(none)",
                "--experts both splits the experts over groups of devices: give their number, \
                 e.g. --expert-groups 2",
            )),
            (e, None) => Ok(e),
            (e, Some(g)) => Err(Error::invalid_argument(
                "--expert-groups",
                g,
                format!(
                    "only --experts both splits over groups (--experts is {})",
                    e.map_or("not given", |e| e.name())
                ),
            )),
        }
    }

    /// `Both`'s groups against `n` devices: 1..=n groups, else an error naming
    /// `--expert-groups`.
    pub fn check_groups(self, n: usize) -> Result<()> {
        match self {
            ExpertSplit::Both { groups } if groups == 0 || groups > n => {
                Err(Error::invalid_argument(
                    "--expert-groups",
                    groups,
                    format!("between 1 and the {n} devices (each group has at least one)"),
                ))
            }
            _ => Ok(()),
        }
    }
}

/// What a split needs to know of a model: its architecture (names), the counts that size the
/// units and check the cut dimensions, and, when known, the block sizes of its tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitDims {
    pub arch: &'static Arch,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_vocab: usize,
    /// The experts' counts of a mixture of experts.
    pub moe: Option<Moe>,
    /// Per layer, the blocks each part's cuts must keep whole ([`SplitDims::with_blocks`]);
    /// `None`: each tensor's own type decides (right when a layer's tensors share one block
    /// size, as in files of one quantized type).
    pub blocks: Option<Arc<[PartBlocks]>>,
}

/// The block sizes one layer's cuts must keep whole: of attention (the output projection's
/// rows are cut along its contracted axis) and of the MLP (the down projection's rows), the
/// least common multiple over the part's tensors cut along axis 0. Q/K/V and gate/up are cut
/// by columns in the same units, so a pair split together keeps the larger block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartBlocks {
    pub attention: usize,
    pub mlp: usize,
}

impl SplitDims {
    /// These dimensions with the block sizes of a model's tensors (`decls`, as the loader or
    /// the planner's model shape declares them).
    pub fn with_blocks(mut self, decls: &[TensorDecl]) -> SplitDims {
        let mut blocks = vec![
            PartBlocks {
                attention: 1,
                mlp: 1,
            };
            self.n_layer
        ];
        for d in decls {
            let (Some(l), Some(cut)) = (d.layer, d.tensor.cut()) else {
                continue;
            };
            if cut.axis != 0 || l >= self.n_layer {
                continue;
            }
            let g = Granularity(d.layout.dtype.block_size());
            let b = &mut blocks[l];
            match cut.part {
                Part::Attention => b.attention = Granularity(b.attention).and(g).0,
                Part::Mlp => b.mlp = Granularity(b.mlp).and(g).0,
                Part::Output | Part::Embedding => {}
            }
        }
        self.blocks = Some(blocks.into());
        self
    }
}

impl SplitDims {
    /// These dimensions with each KV head repeated `r` times (`DecoderConfig::with_kv_repeat`).
    pub fn with_kv_repeat(&self, r: usize) -> SplitDims {
        let mut d = self.clone();
        d.n_head_kv *= r;
        d
    }

    /// The extent of `d` (`None` where it is not a model count: cache rows, tables).
    fn dim(&self, d: Dim) -> Option<usize> {
        Some(match d {
            Dim::One => 1,
            Dim::Embd => self.n_embd,
            Dim::Ff => self.n_ff,
            Dim::Vocab => self.n_vocab,
            Dim::Q => self.n_head * self.head_dim,
            Dim::Kv => self.n_head_kv * self.head_dim,
            Dim::Qkv => (self.n_head + 2 * self.n_head_kv).saturating_mul(self.head_dim),
            Dim::Ff2 => self.n_ff.saturating_mul(2),
            Dim::HeadDim => self.head_dim,
            Dim::Expert => self.moe?.n_expert,
            Dim::FfExp => self.moe?.n_ff_exp,
            Dim::FfShexp => self.moe?.n_ff_shexp,
            // No cut is in these units.
            Dim::Pos | Dim::Types | Dim::Ctx | Dim::RopeHalf => return None,
        })
    }
}

impl From<&DecoderConfig> for SplitDims {
    fn from(c: &DecoderConfig) -> SplitDims {
        SplitDims {
            arch: c.arch,
            n_layer: c.n_layer,
            n_head: c.n_head,
            n_head_kv: c.n_head_kv,
            head_dim: c.head_dim,
            n_embd: c.n_embd,
            n_ff: c.n_ff,
            n_vocab: c.n_vocab,
            moe: c.moe,
            blocks: None,
        }
    }
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
    /// How a split MLP of experts divides them (absent in older plan files: tensor).
    #[serde(default)]
    pub experts: ExpertSplit,
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
            experts: ExpertSplit::Tensor,
        }
    }

    /// This assignment for a model whose output projection is its token embedding (`tied`:
    /// one table, no `output.weight` in the file): the embedding split as the output is, so
    /// the output is another name of the embedding's bytes (`LoadOptions::share_tied`)
    /// instead of a vocabulary-split copy beside a whole table on every device. A split table
    /// gives each device the rows it holds (a partial lookup), summed by one all-reduce of
    /// the step's embeddings. Untied models keep the assignment as it is.
    pub fn tied(mut self, tied: bool) -> Self {
        if tied {
            self.embedding = self.output;
        }
        self
    }

    /// Whether `part` of `layer` (for the ends: the output or the embedding) is split.
    pub fn splits(&self, part: Part, layer: usize) -> bool {
        let l = self.layers.get(layer).copied().unwrap_or(LayerSplit {
            attention: false,
            mlp: false,
        });
        match part {
            Part::Attention => l.attention,
            Part::Mlp => l.mlp,
            Part::Output => self.output,
            Part::Embedding => self.embedding,
        }
    }
}

/// The norm weight a tensor name refers to: layer i's norm before attention (true) or before
/// the MLP (false), with the layer.
fn norm_weight(name: &str) -> Option<(usize, bool)> {
    match Naming::Gguf.parse(name)? {
        (Tensor::AttnNorm, Some(l)) => Some((l, true)),
        (Tensor::FfnNorm, Some(l)) => Some((l, false)),
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
/// With a vocabulary-split embedding (partial lookups) and the first layer's attention split,
/// the first norm of the stream before it (`inp_embd`, its first consumer) is hinted to the
/// token split and the normed activation Mirrored: the lookups are reduce-scattered once for
/// the norm and the residual add both, as a split block's output, not also all-reduced. (The
/// lookup itself is not hinted: a table split by rows gives a Partial lookup only.)
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
    // A vocabulary-split embedding's lookups are partial too: the stream before the first
    // layer is token-split like a split block's output when the first attention is split
    // (else the partial sum would be both reduce-scattered into `l0.attn_out` and all-reduced
    // for the norm).
    let embedding_split = plan.embedding && split_after(0, true);
    Some(Arc::new(move |node: &NodeInfo| -> Option<SplitState> {
        let (n, ne) = (node.n_devices, node.layout().ne);
        if n < 2 || ne[1] < n || ne[2] * ne[3] != 1 {
            return None;
        }
        // The first norm of the embeddings (their first consumer: the partial sum is
        // reduce-scattered for it, and the residual add after attention reuses that).
        let first_norm = matches!(node.op(), Op::RmsNorm { .. } | Op::Norm { .. })
            && node.source_names().any(|s| s == INP_EMBD);
        let residual = match parse_residual_name(node.name()) {
            Some((layer, after_attention)) => Some(split_after(layer, after_attention)),
            None => first_norm.then_some(embedding_split),
        };
        if let Some(split) = residual {
            if !split {
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
            match layer {
                0 => embedding_split,
                _ => split_after(layer - 1, false),
            }
        } else {
            split_after(layer, true)
        };
        input_split.then(|| SplitState::mirrored(n))
    }))
}

/// The split callback and the state hints of `plan` ([`by_layer`] and
/// [`sequence_parallel_hints`]).
pub fn policy(dims: impl Into<SplitDims>, plan: DecoderSplit) -> SplitPolicy {
    SplitPolicy {
        hints: sequence_parallel_hints(&plan),
        split: by_layer(dims, plan),
    }
}

/// The built-in callback for a decoder with this configuration: attention and MLP split in
/// every layer (attention mirrored with `mirror_attention`), the output projection
/// vocabulary-split, the embedding mirrored.
pub fn megatron(dims: impl Into<SplitDims>, opts: SplitOptions) -> SplitFn {
    let dims: SplitDims = dims.into();
    let plan = megatron_plan(dims.n_layer, opts);
    by_layer(dims, plan)
}

/// The assignment [`megatron`] splits by: attention (unless `mirror_attention`) and the MLP in
/// each of `n_layer` layers, the output by vocabulary, the embedding mirrored, `opts.ratios`.
pub fn megatron_plan(n_layer: usize, opts: SplitOptions) -> DecoderSplit {
    let layer = LayerSplit {
        attention: !opts.mirror_attention,
        mlp: true,
    };
    let mut plan = DecoderSplit::uniform(n_layer, layer, true, false);
    plan.ratios = opts.ratios;
    plan.experts = opts.experts;
    plan
}

/// The callback for a per-layer choice of splits (`plan.layers[i]` for layer i; layers past
/// the list, and caches of such layers, are mirrored), for any architecture: each tensor's
/// role (from the architecture's names) says which part it belongs to and how it is cut.
///
/// A cut tensor whose cut dimension disagrees with the model's counts, a layer the model does
/// not have, or ratios not one per device are errors naming the tensor.
pub fn by_layer(dims: impl Into<SplitDims>, plan: DecoderSplit) -> SplitFn {
    let dims: SplitDims = dims.into();
    Arc::new(move |t: &TensorInfo| -> Result<SplitState> {
        let n = t.n_devices;
        let Some((role, layer)) = dims.arch.parse(t.name) else {
            return Ok(SplitState::mirrored(n));
        };
        let layer = layer.unwrap_or(0);
        let Some(mut cut) = role.cut().filter(|c| plan.splits(c.part, layer)) else {
            return Ok(SplitState::mirrored(n));
        };
        if let ExpertSplit::Both { groups } = plan.experts
            && role.info().ne2 == Dim::Expert
            && cut.axis < 2
        {
            return expert_groups(&dims, groups, cut, t, n, &plan, layer).map_err(|e| {
                Error::InvalidSplit {
                    tensor: t.name.to_string(),
                    reason: format!("{} split: {e}", dims.arch.name),
                }
            });
        }
        if plan.experts == ExpertSplit::Expert && role.info().ne2 == Dim::Expert {
            cut = Cut {
                part: cut.part,
                axis: 2,
                unit: Unit::Expert,
            };
        }
        let named = |reason: String| Error::InvalidSplit {
            tensor: t.name.to_string(),
            reason: format!("{} split: {reason}", dims.arch.name),
        };
        if role.scope() != super::arch::Scope::Model && layer >= dims.n_layer {
            return Err(named(format!(
                "layer {layer}, but the model has {} layers",
                dims.n_layer
            )));
        }
        let ne = t.layout.ne;
        let dim = match cut.axis {
            2 => role.info().ne2,
            a => role.info().shape[a],
        };
        if let Some(want) = dims.dim(dim)
            && ne[cut.axis] != want
        {
            return Err(named(format!(
                "dimension {} of {} is {}, the model's configuration implies {want}",
                cut.axis,
                t.layout.shape(),
                ne[cut.axis]
            )));
        }
        if let Unit::Segments(segments) = cut.unit {
            return segmented(&dims, segments, cut.axis, t, n, &plan, layer).map_err(named);
        }
        let extents = unit_extents(&dims, cut.unit, ne[cut.axis], t, n, &plan, layer)
            .map_err(|e| named(e.to_string()))?;
        Ok(SplitState::axis(cut.axis, &extents))
    })
}

/// An expert tensor's state under `ExpertSplit::Both`: `groups` groups (at most one per
/// device) of consecutive devices, as even as they go (the first groups one device more); the
/// experts over the groups as expert parallelism cuts them over devices (even, the remainder
/// rotating by layer; `ratios` do not apply to groups); inside a group the cut axis in the MLP's
/// units, by the group's devices' `ratios` where given.
fn expert_groups(
    dims: &SplitDims,
    groups: usize,
    cut: Cut,
    t: &TensorInfo,
    n: usize,
    plan: &DecoderSplit,
    layer: usize,
) -> Result<SplitState> {
    let g = groups.clamp(1, n.max(1));
    let sizes = extents(n, 1, g, None, 0)?;
    let experts = extents(t.layout.ne[2], 1, g, None, layer)?;
    let mut parts = Vec::with_capacity(g);
    let mut first = 0;
    for (&size, &e) in sizes.iter().zip(&experts) {
        let mut inner = plan.clone();
        inner.ratios = plan
            .ratios
            .as_ref()
            .map(|r| r[first.min(r.len())..(first + size).min(r.len())].to_vec());
        let total = t.layout.ne[cut.axis];
        let v = unit_extents(dims, cut.unit, total, t, size, &inner, layer)?;
        parts.push((e, v));
        first += size;
    }
    Ok(SplitState::expert_groups(cut.axis, &parts))
}

/// A fused tensor's state (Phi-3's Q | K | V, gate | up): each segment cut on its own in its
/// unit, as the unfused tensors would be, so device d holds its heads' Q, K and V rows (its
/// share of gate and of up) side by side.
fn segmented(
    dims: &SplitDims,
    segments: &[(Dim, Unit)],
    axis: usize,
    t: &TensorInfo,
    n: usize,
    plan: &DecoderSplit,
    layer: usize,
) -> std::result::Result<SplitState, String> {
    let mut cuts = Vec::with_capacity(segments.len());
    for &(dim, unit) in segments {
        let total = dims
            .dim(dim)
            .ok_or_else(|| format!("a segment of {dim:?} has no extent in a decoder"))?;
        cuts.push(unit_extents(dims, unit, total, t, n, plan, layer).map_err(|e| e.to_string())?);
    }
    SplitState::try_segmented(axis, &cuts).map_err(|e| e.to_string())
}

/// KV-head groups per device of `layer`'s attention over `n` devices: whole groups, as many
/// per unit as whole blocks of the layer's attention need (the remainder rotating with the
/// layer), or an error when such units do not divide the groups.
fn group_extents(
    dims: &SplitDims,
    n: usize,
    ratios: Option<&[f64]>,
    layer: usize,
) -> Result<Vec<usize>> {
    let hd = dims.head_dim;
    let group = dims.n_head / dims.n_head_kv.max(1);
    let blocks = dims.blocks.as_ref().and_then(|b| b.get(layer)).copied();
    // k groups per unit, so that k groups of query features are whole blocks.
    let block = blocks.map_or(1, |b| b.attention);
    let k = Granularity(hd * group).and(Granularity(block)).0 / (hd * group);
    if !dims.n_head_kv.is_multiple_of(k) {
        return Err(Error::invalid_input(
            "tensor split",
            "attention",
            format!(
                "whole blocks of {block} over {} KV-head groups of {} features",
                dims.n_head_kv,
                hd * group
            ),
            format!("{k} groups per block do not divide {}", dims.n_head_kv),
        ));
    }
    extents(dims.n_head_kv / k, k, n, ratios, layer)
}

/// Query heads per device of `layer`'s attention under `plan` on `n` devices (all on every
/// device where the layer's attention is mirrored): what `plan` reports per device.
pub fn query_heads(
    dims: &SplitDims,
    n: usize,
    plan: &DecoderSplit,
    layer: usize,
) -> Result<Vec<usize>> {
    if n < 2 || !plan.splits(Part::Attention, layer) {
        return Ok(vec![dims.n_head; n]);
    }
    let group = dims.n_head / dims.n_head_kv.max(1);
    let g = group_extents(dims, n, plan.ratios.as_deref(), layer)?;
    Ok(g.into_iter().map(|g| g * group).collect())
}

/// How many times to repeat each KV head (virtual KV heads, `DecoderConfig::with_kv_repeat`)
/// for `plan` on `n` devices: 1 unless some layer's attention is split and whole KV-head
/// groups leave a device with a share but no query heads (fewer groups than devices: Gemma 3
/// 270M's one KV head, Qwen2.5 0.5B's two on three devices); then the smallest divisor `r` of
/// the query heads per KV head that gives every device with a share at least one group in
/// every split layer, or, when none does, the largest (one query head per group). The
/// smallest such `r` costs the least memory: each device holds K, V and the cache of every
/// virtual head it computes (`r` copies of a head over the devices that share it).
pub fn kv_repeat(dims: &SplitDims, n: usize, plan: &DecoderSplit) -> usize {
    kv_repeat_groups(dims, &[(n, plan.clone())])
}

/// [`kv_repeat`] for several meta devices sharing one model (a hybrid split: each group of
/// `n` devices splits the layers its plan splits): the smallest repetition that spreads every
/// group's split layers, or, when none does, the largest that keeps whole blocks in all.
pub fn kv_repeat_groups(dims: &SplitDims, groups: &[(usize, DecoderSplit)]) -> usize {
    // Each group's devices and split layers (groups of one device, or with no split
    // attention, need no repetition).
    let groups: Vec<(usize, &DecoderSplit, Vec<usize>)> = groups
        .iter()
        .map(|(n, plan)| {
            let layers = (0..dims.n_layer)
                .filter(|&l| plan.splits(Part::Attention, l))
                .collect();
            (*n, plan, layers)
        })
        .filter(|(n, _, layers): &(usize, &DecoderSplit, Vec<usize>)| *n >= 2 && !layers.is_empty())
        .collect();
    if groups.is_empty() || dims.n_head_kv == 0 {
        return 1;
    }
    let group = dims.n_head / dims.n_head_kv;
    // Whether every split layer of every group cuts with `r` (and, `spread`, gives each
    // device with a share whole groups).
    let fits = |r: usize, spread: bool| {
        let v = dims.with_kv_repeat(r);
        groups.iter().all(|(n, plan, layers)| {
            let ratios = plan.ratios.as_deref();
            let shared = |d: usize| ratios.is_none_or(|r| r.get(d) > Some(&0.0));
            layers.iter().all(|&l| {
                group_extents(&v, *n, ratios, l).is_ok_and(|g| {
                    !spread || g.iter().enumerate().all(|(d, &x)| x > 0 || !shared(d))
                })
            })
        })
    };
    let divisors: Vec<usize> = (1..=group).filter(|r| group.is_multiple_of(*r)).collect();
    divisors
        .iter()
        .copied()
        .find(|&r| fits(r, true))
        // The largest repetition whose units still keep whole blocks.
        .or_else(|| divisors.iter().rev().copied().find(|&r| fits(r, false)))
        .unwrap_or(1)
}

/// Extents of `total` features cut in `unit`s over `n` devices for `layer`: whole KV-head
/// groups (as many per unit as whole blocks of the layer's attention need), or feed-forward
/// features in units of at least [`FFN_UNIT`] and whole blocks, or vocabulary rows.
fn unit_extents(
    dims: &SplitDims,
    unit: Unit,
    total: usize,
    t: &TensorInfo,
    n: usize,
    plan: &DecoderSplit,
    layer: usize,
) -> Result<Vec<usize>> {
    let ratios = plan.ratios.as_deref();
    let hd = dims.head_dim;
    let blocks = dims.blocks.as_ref().and_then(|b| b.get(layer)).copied();
    match unit {
        Unit::QGroup | Unit::KvHead => {
            let group = dims.n_head / dims.n_head_kv.max(1);
            let per = if unit == Unit::QGroup { hd * group } else { hd };
            let groups = group_extents(dims, n, ratios, layer)?;
            Ok(groups.into_iter().map(|g| g * per).collect())
        }
        Unit::Ffn => {
            // Whole blocks of the MLP's types (axis 0 of the down projection is its rows of
            // blocks), and at least FFN_UNIT features where the width allows.
            let block = blocks.map_or(t.layout.dtype.block_size(), |b| b.mlp);
            let unit = [FFN_UNIT.max(block), block]
                .into_iter()
                .map(|u| Granularity(u).and(Granularity(block)).0)
                .chain(std::iter::once(1).filter(|_| block == 1))
                .find(|u| total.is_multiple_of(*u))
                .ok_or_else(|| {
                    Error::invalid_input(
                        "tensor split",
                        "feed-forward width",
                        format!("whole blocks of {block}"),
                        total,
                    )
                })?;
            extents(total / unit, unit, n, ratios, layer)
        }
        Unit::Vocab => extents(total, 1, n, ratios, 0),
        Unit::Expert => extents(total, 1, n, ratios, layer),
        Unit::Segments(_) => Err(Error::invalid_input(
            "tensor split",
            "fused tensor",
            "one unit per segment",
            "segments within a segment",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::tensor::Layout;

    fn smol() -> DecoderConfig {
        DecoderConfig::llama(30, 576, 1536, 9, 3, 49152)
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
            ..SplitOptions::default()
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
            Error::InvalidSplit { tensor, reason } => {
                assert_eq!(tensor, "blk.0.ffn_up.weight");
                assert!(
                    reason.contains("split ratios: expected one per device (3), got 2"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn cuts_keep_whole_blocks_of_every_tensor_a_part_cuts() {
        // The MLP in blocks of 256 (K-quant down projections): gate, up and down agree.
        let mut dims = SplitDims::from(&smol());
        dims.blocks = Some(
            vec![
                PartBlocks {
                    attention: 1,
                    mlp: 256,
                };
                30
            ]
            .into(),
        );
        let f = megatron(dims.clone(), SplitOptions::default());
        let up = state(&f, "blk.0.ffn_up.weight", [576, 1536, 1, 1], 4);
        let down = state(&f, "blk.0.ffn_down.weight", [1536, 576, 1, 1], 4);
        assert_eq!(up, SplitState::axis(1, &[512, 512, 256, 256]));
        assert_eq!(down.extents(), up.extents());
        // Without the file's blocks, units of 32: 384 each.
        let plain = megatron(&smol(), SplitOptions::default());
        assert_eq!(
            state(&plain, "blk.0.ffn_up.weight", [576, 1536, 1, 1], 4),
            SplitState::axis(1, &[384, 384, 384, 384])
        );
        // Attention in blocks of 256: SmolLM2's groups (3 x 192 features) cannot be cut in
        // whole blocks; the error names the tensor.
        dims.blocks = Some(
            vec![
                PartBlocks {
                    attention: 256,
                    mlp: 32,
                };
                30
            ]
            .into(),
        );
        let f = megatron(dims, SplitOptions::default());
        let l = Layout::contiguous(DType::F32, [576, 576, 1, 1]);
        let e = f(&TensorInfo {
            name: "blk.0.attn_output.weight",
            layout: &l,
            n_devices: 2,
        })
        .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidSplit { tensor, .. } if tensor == "blk.0.attn_output.weight"),
            "{e:?}"
        );
        // 4 groups of 128 features in blocks of 256: two groups per unit, Q, K and the output
        // projection alike.
        let mut dims = SplitDims::from(&DecoderConfig::llama(1, 512, 1024, 8, 4, 64));
        dims.blocks = Some(
            vec![
                PartBlocks {
                    attention: 256,
                    mlp: 32,
                };
                1
            ]
            .into(),
        );
        let f = megatron(dims, SplitOptions::default());
        assert_eq!(
            state(&f, "blk.0.attn_q.weight", [512, 512, 1, 1], 2),
            SplitState::axis(1, &[256, 256])
        );
        assert_eq!(
            state(&f, "blk.0.attn_output.weight", [512, 512, 1, 1], 2),
            SplitState::axis(0, &[256, 256])
        );
        assert_eq!(
            state(&f, "blk.0.attn_k.weight", [512, 256, 1, 1], 3),
            SplitState::axis(1, &[128, 128, 0])
        );
    }

    #[test]
    fn fused_tensors_are_cut_per_segment() {
        // Phi-3's layout: 8 heads of 16 over 2 KV heads, FFN 256.
        let mut cfg = DecoderConfig::llama(2, 128, 256, 8, 2, 300);
        cfg.arch = &crate::models::arch::PHI3;
        let f = megatron(&cfg, SplitOptions::default());
        // Q | K | V rows (128 | 32 | 32): one KV group each on 2 devices; on 3, one gets none.
        assert_eq!(
            state(&f, "blk.0.attn_qkv.weight", [128, 192, 1, 1], 2),
            SplitState::segmented(1, &[vec![64, 64], vec![16, 16], vec![16, 16]])
        );
        assert_eq!(
            state(&f, "blk.0.attn_qkv.weight", [128, 192, 1, 1], 3),
            SplitState::segmented(1, &[vec![64, 64, 0], vec![16, 16, 0], vec![16, 16, 0]])
        );
        // The output projection follows the Q segment.
        assert_eq!(
            state(&f, "blk.0.attn_output.weight", [128, 128, 1, 1], 3),
            SplitState::axis(0, &[64, 64, 0])
        );
        // gate | up (256 | 256): each device its share of each; down by the same rows.
        let up = state(&f, "blk.0.ffn_up.weight", [128, 512, 1, 1], 3);
        let down = state(&f, "blk.0.ffn_down.weight", [256, 128, 1, 1], 3);
        assert_eq!(
            up,
            SplitState::segmented(1, &[vec![96, 96, 64], vec![96, 96, 64]])
        );
        assert_eq!(down, SplitState::axis(0, &[96, 96, 64]));
        // A fused tensor whose rows disagree with the configuration is named.
        let l = Layout::contiguous(DType::F32, [128, 256, 1, 1]);
        let e = f(&TensorInfo {
            name: "blk.0.ffn_up.weight",
            layout: &l,
            n_devices: 2,
        })
        .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidSplit { tensor, reason }
                if tensor == "blk.0.ffn_up.weight" && reason.contains("implies 512")),
            "{e:?}"
        );
    }

    #[test]
    fn blocks_come_from_the_tensors_each_part_cuts_along_axis_0() {
        let cfg = DecoderConfig::llama(2, 64, 128, 4, 2, 32);
        let mut decls = crate::models::synthetic::weight_decls(&cfg, DType::F32).unwrap();
        for d in &mut decls {
            if d.name == "blk.1.ffn_down.weight" || d.name == "blk.0.attn_output.weight" {
                d.layout = Layout::contiguous(DType::FakeQ4x16, d.layout.ne);
            }
        }
        let dims = SplitDims::from(&cfg).with_blocks(&decls);
        let b = dims.blocks.unwrap();
        assert_eq!(
            b.to_vec(),
            vec![
                PartBlocks {
                    attention: 16,
                    mlp: 1
                },
                PartBlocks {
                    attention: 1,
                    mlp: 16
                }
            ]
        );
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
        let hint = |h: &HintFn, name: &str, t: usize, n: usize| {
            let mut g = crate::Graph::new();
            let x = g.input("x", DType::F32, [576, t, 1, 1]).unwrap();
            let id = if name.starts_with("blk.") {
                let w = g.input(name, DType::F32, [576, 1, 1, 1]).unwrap();
                g.mul(x, w).unwrap()
            } else if let Some(src) = name.strip_prefix("norm(") {
                // An RMS norm of a node named `src`.
                g.set_name(x, src.trim_end_matches(')'));
                g.rms_norm(x, 1e-6).unwrap()
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
        assert_eq!(hint(&h, "l0.attn_out", 5, 2), tokens(&[3, 2]));
        assert_eq!(hint(&h, "l0.out", 5, 2), tokens(&[3, 2]));
        assert_eq!(hint(&h, "l2.attn_out", 7, 3), tokens(&[3, 2, 2]));
        // Layer 1's attention is mirrored: its output is not partial, nothing to scatter.
        assert_eq!(hint(&h, "l1.attn_out", 5, 2), None);
        assert_eq!(hint(&h, "l1.out", 5, 2), tokens(&[3, 2]));
        // The last layer's output, fewer tokens than devices, other nodes: no hint.
        assert_eq!(hint(&h, "l2.out", 5, 2), None);
        assert_eq!(hint(&h, "l0.out", 1, 2), None);
        assert_eq!(hint(&h, "l0.out", 2, 3), None);
        assert_eq!(hint(&h, "l3.out", 5, 2), None);
        assert_eq!(hint(&h, "l0.outer", 5, 2), None);
        // The normed activations after a token-split residual are gathered (mirrored).
        let m = Some(SplitState::mirrored(2));
        assert_eq!(hint(&h, "blk.0.ffn_norm.weight", 5, 2), m);
        assert_eq!(hint(&h, "blk.1.attn_norm.weight", 5, 2), m);
        assert_eq!(hint(&h, "blk.1.ffn_norm.weight", 5, 2), None);
        assert_eq!(hint(&h, "blk.2.attn_norm.weight", 5, 2), m);
        // Before the first layer the stream is the (mirrored) embedding.
        assert_eq!(hint(&h, "blk.0.attn_norm.weight", 5, 2), None);
        assert_eq!(hint(&h, "inp_embd", 5, 2), None);
        assert_eq!(hint(&h, "blk.0.ffn_norm.weight", 1, 2), None);
        assert_eq!(hint(&h, "output_norm.weight", 5, 2), None);
        // A vocabulary-split embedding (a tied model's): its partial lookups are token-split
        // as a split block's output, the first norm's output gathered.
        plan.embedding = true;
        let h = sequence_parallel_hints(&plan).unwrap();
        assert_eq!(hint(&h, "norm(inp_embd)", 5, 2), tokens(&[3, 2]));
        assert_eq!(hint(&h, "blk.0.attn_norm.weight", 5, 2), m);
        assert_eq!(hint(&h, "norm(inp_embd)", 1, 2), None);
        assert_eq!(hint(&h, "inp_embd", 5, 2), None);
        // Not when the first layer's attention is mirrored.
        plan.layers[0] = l(false, true);
        let h = sequence_parallel_hints(&plan).unwrap();
        assert_eq!(hint(&h, "norm(inp_embd)", 5, 2), None);
        assert_eq!(hint(&h, "blk.0.attn_norm.weight", 5, 2), None);
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
