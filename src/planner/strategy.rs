//! Named strategies and device shares. A strategy is an assignment of split states to a
//! decoder's weights ([`DecoderSplit`]: per layer, attention by KV-head groups or mirrored, the
//! MLP column/row or mirrored; the output projection and the token embedding by vocabulary or
//! mirrored, a tied embedding as the output; sequence parallelism of the residual stream, as state hints); `auto` is the
//! search's answer for a workload. A plan file holds one assignment, so a plan is an ordinary
//! split callback (with its hints: `models::split::policy`).

use super::cluster::Cluster;
use super::shape::ModelShape;
use crate::DType;
use crate::models::split::{DecoderSplit, ExpertSplit, LayerSplit};
use crate::{Error, Result};

/// The built-in strategies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Attention by KV-head groups and the MLP column/row in every layer, the output by
    /// vocabulary (llama.cpp's assignment; two all-reduces per layer), a tied embedding with
    /// it.
    Megatron,
    /// Only the MLP split; attention mirrored (one all-reduce per layer).
    MlpOnly,
    /// Only attention split; the MLP mirrored (one all-reduce per layer).
    AttnOnly,
    /// Everything mirrored: no communication, every device does all the work.
    Mirrored,
    /// Layers mirrored, the output projection and the embedding split by vocabulary.
    VocabSplit,
    /// Everything that can be split is (least memory per device).
    Memory,
    /// Megatron's weights with the residual stream split along tokens between the blocks:
    /// each block's partial output is reduce-scattered to the token split, the residual adds
    /// and norms run on each device's tokens, the normed activation is all-gathered before the
    /// next column-parallel products (same bytes as the all-reduce; prompts only, decode
    /// steps of fewer tokens than devices stay Megatron).
    SequenceParallel,
    /// The search's choice for the workload (see `search.rs`).
    Auto,
    /// Megatron's assignment with the experts of a mixture of experts split whole over the
    /// devices (expert parallelism: one all-reduce joins the rows each device's experts
    /// computed) instead of column then row inside every expert. Only for models with experts
    /// ([`Strategy::for_model`]); on a dense model it is Megatron.
    ExpertParallel,
    /// Megatron's assignment with the experts split whole over [`EXPERT_GROUPS`] groups of
    /// devices and column then row inside each group (`--experts both`: expert parallelism
    /// between the groups, tensor parallelism inside them; the same one all-reduce). Only for
    /// models with experts, as `expert-parallel`.
    ExpertGroups,
}

/// The groups of the `expert-groups` strategy (one per device on fewer devices).
pub const EXPERT_GROUPS: usize = 2;

impl Strategy {
    pub const ALL: [Strategy; 8] = [
        Strategy::Megatron,
        Strategy::MlpOnly,
        Strategy::AttnOnly,
        Strategy::Mirrored,
        Strategy::VocabSplit,
        Strategy::Memory,
        Strategy::SequenceParallel,
        Strategy::Auto,
    ];

    /// The strategies that apply to a model (`experts`: it has a mixture of experts): every
    /// one of [`Strategy::ALL`], and `expert-parallel` and `expert-groups` for a model with
    /// experts.
    pub fn for_model(experts: bool) -> Vec<Strategy> {
        let mut v = Strategy::ALL.to_vec();
        if experts {
            v.insert(1, Strategy::ExpertParallel);
            v.insert(2, Strategy::ExpertGroups);
        }
        v
    }

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Megatron => "megatron",
            Strategy::ExpertParallel => "expert-parallel",
            Strategy::ExpertGroups => "expert-groups",
            Strategy::MlpOnly => "mlp-only",
            Strategy::AttnOnly => "attn-only",
            Strategy::Mirrored => "mirrored",
            Strategy::VocabSplit => "vocab-split",
            Strategy::Memory => "memory",
            Strategy::SequenceParallel => "sequence-parallel",
            Strategy::Auto => "auto",
        }
    }

    pub fn parse(s: &str) -> Result<Strategy> {
        let all = Strategy::for_model(true);
        all.iter().copied().find(|x| x.name() == s).ok_or_else(|| {
            let names: Vec<&str> = all.iter().map(|x| x.name()).collect();
            Error::invalid_argument("--strategy", s, format!("one of {}", names.join(", ")))
        })
    }

    /// The assignment of a fixed strategy for `n_layer` layers (`None` for `auto`); for a
    /// `tied` model (the output projection is the token embedding) the embedding is split as
    /// the output is, one table shared by both (`DecoderSplit::tied`).
    pub fn split(self, n_layer: usize, tied: bool) -> Option<DecoderSplit> {
        let l = |attention, mlp| LayerSplit { attention, mlp };
        let (layer, output, embedding) = match self {
            Strategy::Megatron
            | Strategy::SequenceParallel
            | Strategy::ExpertParallel
            | Strategy::ExpertGroups => (l(true, true), true, false),
            Strategy::MlpOnly => (l(false, true), true, false),
            Strategy::AttnOnly => (l(true, false), true, false),
            Strategy::Mirrored => (l(false, false), false, false),
            Strategy::VocabSplit => (l(false, false), true, true),
            Strategy::Memory => (l(true, true), true, true),
            Strategy::Auto => return None,
        };
        let mut split = DecoderSplit::uniform(n_layer, layer, output, embedding).tied(tied);
        split.sequence_parallel = self == Strategy::SequenceParallel;
        if self == Strategy::ExpertParallel {
            split.experts = ExpertSplit::Expert;
        }
        if self == Strategy::ExpertGroups {
            split.experts = ExpertSplit::Both {
                groups: EXPERT_GROUPS,
            };
        }
        Some(split)
    }
}

/// How the devices share split tensors.
#[derive(Clone, Debug, PartialEq)]
pub enum Shares {
    Even,
    Ratios(Vec<f64>),
    /// In proportion to each device's matrix-vector throughput for the model's main weight type
    /// (its decode speed), from the cluster profile.
    Throughput,
}

impl Shares {
    /// `even`, `throughput`, or ratios such as `3,1`.
    pub fn parse(s: &str) -> Result<Shares> {
        match s {
            "even" => Ok(Shares::Even),
            "throughput" => Ok(Shares::Throughput),
            _ => {
                let v = s
                    .split(',')
                    .map(|x| x.trim().parse::<f64>())
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|_| {
                        Error::invalid_argument(
                            "--shares",
                            s,
                            "even, throughput, or ratios like 3,1",
                        )
                    })?;
                Ok(Shares::Ratios(v))
            }
        }
    }

    /// Per-device ratios for `cluster` (None: even).
    pub fn ratios(&self, shape: &ModelShape, cluster: &Cluster) -> Result<Option<Vec<f64>>> {
        match self {
            Shares::Even => Ok(None),
            Shares::Ratios(r) => {
                if r.len() != cluster.n_devices() {
                    return Err(Error::invalid_argument(
                        "--shares",
                        format!("{r:?}"),
                        format!("one share per device ({})", cluster.n_devices()),
                    ));
                }
                let n = normalized(r).ok_or_else(|| {
                    Error::invalid_argument(
                        "--shares",
                        format!("{r:?}"),
                        "shares must be finite, non-negative and not all zero",
                    )
                })?;
                Ok(Some(n))
            }
            Shares::Throughput => {
                let dt: DType = shape.types.ffn_gate_up;
                let r: Vec<f64> = cluster.devices.iter().map(|d| d.gemv(dt)).collect();
                let first = r[0];
                Ok(
                    if r.iter().all(|x| (x - first).abs() <= 1e-9 * first.abs()) {
                        None
                    } else {
                        Some(r)
                    },
                )
            }
        }
    }
}

/// `shares` whose sum is finite: as given when it is, else scaled so the largest is 1
/// (`1e308,1e308,0` becomes `1,1,0`, not a sum overflowing to infinity that puts every layer
/// on the device of share 0); None unless they are finite, non-negative and not all zero.
pub fn normalized(shares: &[f64]) -> Option<Vec<f64>> {
    if shares.iter().any(|x| !x.is_finite() || *x < 0.0) {
        return None;
    }
    let max = shares.iter().copied().fold(0.0, f64::max);
    if max <= 0.0 {
        return None;
    }
    if shares.iter().sum::<f64>().is_finite() {
        return Some(shares.to_vec());
    }
    Some(shares.iter().map(|x| x / max).collect())
}

/// A one-line description of an assignment: runs of layers with the same splits.
pub fn describe(split: &DecoderSplit) -> String {
    let word = |l: &LayerSplit| match (l.attention, l.mlp) {
        (true, true) => "attn+mlp split",
        (false, true) => "mlp split",
        (true, false) => "attn split",
        (false, false) => "mirrored",
    };
    let mut parts = Vec::new();
    let mut i = 0;
    while i < split.layers.len() {
        let mut j = i;
        while j + 1 < split.layers.len() && split.layers[j + 1] == split.layers[i] {
            j += 1;
        }
        parts.push(if i == j {
            format!("layer {i}: {}", word(&split.layers[i]))
        } else {
            format!("layers {i}-{j}: {}", word(&split.layers[i]))
        });
        i = j + 1;
    }
    parts.push(format!(
        "output: {}",
        if split.output {
            "vocab split"
        } else {
            "mirrored"
        }
    ));
    parts.push(format!(
        "embedding: {}",
        if split.embedding {
            "vocab split"
        } else {
            "mirrored"
        }
    ));
    if split.sequence_parallel {
        parts.push("residual stream: split by tokens".into());
    }
    if split.experts == ExpertSplit::Expert {
        parts.push("experts: whole experts per device".into());
    }
    if let ExpertSplit::Both { groups } = split.experts {
        parts.push(format!(
            "experts: whole experts over {groups} groups of devices, columns and rows inside a \
             group"
        ));
    }
    parts.join("; ")
}
