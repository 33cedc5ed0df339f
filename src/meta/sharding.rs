//! Pass 1 of the meta backend, the *sharding* of a graph: the split state of every node and
//! the conversions its sources need, with no device work. (One name per concept: a
//! [`Sharding`] is this derivation; `GraphPlan` is a backend's prepared graph, the matmul
//! `Plan` a kernel choice.) In graph order:
//!
//! - *leaves*: weights and caches placed in a meta buffer carry the state the split
//!   callback gave them; every other leaf (inline inputs, host buffers) is mirrored.
//! - *every other node*: a view takes its state from its root (`split_state::view`),
//!   gathering the root first when the view cannot be cut per device; any other node takes the
//!   cheapest pattern of its op's rule (`split_state::rules`), where each source whose state
//!   differs from the pattern's costs its conversion (local slice: nearly free; reductions and
//!   gathers: the bytes they move plus a fixed latency; a conversion an earlier consumer
//!   already caused costs nothing). The chosen conversions are recorded.
//!
//! In explicit mode, gathers and all-to-alls are refused: a pattern needing one is skipped, and
//! if no pattern remains the error names the node, the source and the states.

use crate::graph::{Graph, TensorId};
use crate::split_state::rules::{Pattern, patterns};
use crate::split_state::view::{ViewSplit, derive_view};
use crate::split_state::{SplitAxis, SplitState};
use crate::tensor::Layout;
use crate::{Error, Result};
use std::collections::HashMap;

/// How a tensor moves from one state to another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConversionKind {
    /// Mirrored -> Axis: each device keeps its slice; no communication.
    Slice,
    /// Mirrored -> Partial: device 0 keeps the value, the others zeros; no communication.
    ToPartial,
    /// Axis -> Partial: each device pads its slice with zeros to the full shape; no
    /// communication.
    PadToPartial,
    /// Partial -> Mirrored.
    AllReduce,
    /// Partial -> Axis.
    ReduceScatter,
    /// Axis -> Mirrored.
    AllGather,
    /// Axis -> another Axis split: all-gather, then slice.
    AllToAll,
}

impl ConversionKind {
    pub fn name(self) -> &'static str {
        match self {
            ConversionKind::Slice => "slice",
            ConversionKind::ToPartial => "to-partial",
            ConversionKind::PadToPartial => "pad-to-partial",
            ConversionKind::AllReduce => "all-reduce",
            ConversionKind::ReduceScatter => "reduce-scatter",
            ConversionKind::AllGather => "all-gather",
            ConversionKind::AllToAll => "all-to-all",
        }
    }

    /// Moves data between devices.
    pub fn communicates(self) -> bool {
        !matches!(
            self,
            ConversionKind::Slice | ConversionKind::ToPartial | ConversionKind::PadToPartial
        )
    }

    /// Allowed in explicit mode: local work and the reduction of partial sums.
    pub fn planned(self) -> bool {
        !matches!(self, ConversionKind::AllGather | ConversionKind::AllToAll)
    }
}

/// The conversion from `from` to `to`, if there is one (`None`: equal states, or impossible
/// when `from != to`).
pub fn conversion_kind(from: &SplitState, to: &SplitState) -> Option<ConversionKind> {
    use SplitAxis::*;
    if from == to {
        return None;
    }
    Some(match (from.axis, to.axis) {
        (Mirrored, Axis(_)) => ConversionKind::Slice,
        (Mirrored, Partial) => ConversionKind::ToPartial,
        (Partial, Mirrored) => ConversionKind::AllReduce,
        (Partial, Axis(_)) => ConversionKind::ReduceScatter,
        (Axis(_), Mirrored) => ConversionKind::AllGather,
        (Axis(_), Axis(_)) => ConversionKind::AllToAll,
        (Axis(_), Partial) => ConversionKind::PadToPartial,
        _ => return None,
    })
}

/// Fixed cost of one collective, in byte-equivalents (a latency term).
const COLLECTIVE_LATENCY: f64 = 8192.0;

/// Predicted cost (byte-equivalents) of converting a tensor of `bytes` bytes.
fn cost(from: &SplitState, to: &SplitState, bytes: usize, n: usize, explicit: bool) -> f64 {
    if from == to {
        return 0.0;
    }
    let b = bytes as f64;
    let frac = (n.saturating_sub(1)) as f64 / n.max(1) as f64;
    match conversion_kind(from, to) {
        None => f64::INFINITY,
        Some(k) if explicit && !k.planned() => f64::INFINITY,
        Some(ConversionKind::Slice) => 0.05 * b / n.max(1) as f64,
        Some(ConversionKind::ToPartial) | Some(ConversionKind::PadToPartial) => 0.05 * b,
        Some(ConversionKind::AllReduce) => 2.0 * frac * b + COLLECTIVE_LATENCY,
        Some(ConversionKind::ReduceScatter) | Some(ConversionKind::AllGather) => {
            frac * b + COLLECTIVE_LATENCY
        }
        Some(ConversionKind::AllToAll) => frac * b + 0.05 * b + COLLECTIVE_LATENCY,
    }
}

/// One conversion the sharding inserts.
#[derive(Clone, Debug)]
pub struct Conversion {
    /// The node whose source is converted (the first consumer needing it).
    pub consumer: TensorId,
    /// The converted tensor.
    pub source: TensorId,
    pub from: SplitState,
    pub to: SplitState,
    pub kind: ConversionKind,
    /// Bytes of the full tensor.
    pub bytes: usize,
}

/// The sharding of one graph on a meta device of `n` devices: states and conversions.
#[derive(Clone, Debug)]
pub struct Sharding {
    pub n: usize,
    /// The state of every node's output.
    pub states: Vec<SplitState>,
    /// Per node, the state each source is consumed in (for a view: its root's).
    pub required: Vec<Vec<SplitState>>,
    /// Per view node, its per-device layouts.
    pub views: Vec<Option<ViewSplit>>,
    /// Each distinct conversion once, in the order it first happens.
    pub conversions: Vec<Conversion>,
}

impl Sharding {
    /// Count conversions of a kind.
    pub fn count(&self, kind: ConversionKind) -> usize {
        self.conversions.iter().filter(|c| c.kind == kind).count()
    }

    /// Bytes moved between devices, summed over conversions, as the cost model predicts them.
    pub fn communicated_bytes(&self) -> usize {
        self.conversions
            .iter()
            .filter(|c| c.kind.communicates())
            .map(|c| c.bytes)
            .sum()
    }

    /// A readable sharding: one line per node with its state, and the conversions.
    pub fn describe(&self, g: &Graph) -> String {
        let mut s = String::new();
        for id in g.ids() {
            let n = g.node(id);
            s += &format!(
                "{:>4} {:<12} {:<28} {}\n",
                id.index(),
                n.op.name(),
                n.name,
                self.states[id.index()]
            );
            for c in self.conversions.iter().filter(|c| c.consumer == id) {
                s += &format!(
                    "       <- {} `{}`: {} -> {} ({} bytes)\n",
                    c.kind.name(),
                    g.name(c.source),
                    c.from,
                    c.to,
                    c.bytes
                );
            }
        }
        s
    }
}

/// Derive the sharding of `g` over `n` devices. `leaf_state(id)` gives a leaf's state (None:
/// mirrored).
pub fn derive_sharding(
    g: &Graph,
    n: usize,
    explicit: bool,
    leaf_state: &dyn Fn(TensorId) -> Option<SplitState>,
) -> Result<Sharding> {
    let len = g.len();
    let mut p = Sharding {
        n,
        states: Vec::with_capacity(len),
        required: Vec::with_capacity(len),
        views: vec![None; len],
        conversions: Vec::new(),
    };
    let mut seen: HashMap<(TensorId, SplitState), ()> = HashMap::new();
    for id in g.ids() {
        let node = g.node(id);
        let bytes_of = |t: TensorId| Layout::contiguous(g.layout(t).dtype, g.layout(t).ne).nbytes();
        // Leaves.
        if node.is_leaf() {
            p.states
                .push(leaf_state(id).unwrap_or_else(|| SplitState::mirrored(n)));
            p.required.push(Vec::new());
            continue;
        }
        // Views: derived from the root, gathered first when not representable.
        if node.op.is_view() {
            let root = g.root(id);
            let rl = g.layout(root);
            let rs = p.states[root.index()].clone();
            let (req, vs) = match derive_view(rl, &rs, &node.layout, node.view_offs) {
                Some(vs) => (rs, vs),
                None => {
                    let m = SplitState::mirrored(n);
                    if explicit && rs.split_dim().is_some() {
                        return Err(unrequested(g, id, root, &rs, &m));
                    }
                    let vs = derive_view(rl, &m, &node.layout, node.view_offs)
                        .expect("mirrored views always derive");
                    (m, vs)
                }
            };
            record(&mut p, &mut seen, id, root, &req, bytes_of(root));
            p.states.push(vs.state.clone());
            p.required.push(vec![req]);
            p.views[id.index()] = Some(vs);
            continue;
        }
        // Every other node: the cheapest admissible pattern.
        let cur: Vec<SplitState> = node
            .src
            .iter()
            .map(|s| p.states[s.index()].clone())
            .collect();
        let pats = patterns(g, id, &cur);
        let total = |pt: &Pattern, explicit: bool| -> f64 {
            node.src
                .iter()
                .zip(&pt.inputs)
                .zip(&cur)
                .map(|((&s, want), have)| {
                    // A conversion an earlier consumer already caused is free to reuse.
                    if seen.contains_key(&(s, want.clone())) {
                        0.0
                    } else {
                        cost(have, want, bytes_of(s), n, explicit)
                    }
                })
                .sum()
        };
        let best = pats
            .iter()
            .map(|pt| (total(pt, explicit), pt))
            .filter(|(c, _)| c.is_finite())
            .min_by(|a, b| a.0.total_cmp(&b.0));
        let Some((_, best)) = best else {
            // Explain: in explicit mode, name the first refused conversion of the best pattern.
            if explicit
                && let Some((_, pt)) = pats
                    .iter()
                    .map(|pt| (total(pt, false), pt))
                    .filter(|(c, _)| c.is_finite())
                    .min_by(|a, b| a.0.total_cmp(&b.0))
            {
                for (i, (want, have)) in pt.inputs.iter().zip(&cur).enumerate() {
                    if conversion_kind(have, want).is_some_and(|k| !k.planned()) {
                        return Err(unrequested(g, id, node.src[i], have, want));
                    }
                }
            }
            let states: Vec<String> = cur.iter().map(|s| s.to_string()).collect();
            return Err(Error::NoSplitRule {
                op: node.op.name().to_string(),
                node: node.name.clone(),
                states: format!("[{}]", states.join(", ")),
                reason: if pats.is_empty() {
                    "the op admits no split of these sources (a destination cannot be converted)"
                        .into()
                } else {
                    "every admissible pattern needs an impossible conversion".into()
                },
            });
        };
        for (&s, want) in node.src.iter().zip(&best.inputs) {
            record(&mut p, &mut seen, id, s, want, bytes_of(s));
        }
        p.states.push(best.output.clone());
        p.required.push(best.inputs.clone());
    }
    Ok(p)
}

fn record(
    p: &mut Sharding,
    seen: &mut HashMap<(TensorId, SplitState), ()>,
    consumer: TensorId,
    source: TensorId,
    want: &SplitState,
    bytes: usize,
) {
    let have = &p.states[source.index()];
    if let Some(kind) = conversion_kind(have, want)
        && seen.insert((source, want.clone()), ()).is_none()
    {
        p.conversions.push(Conversion {
            consumer,
            source,
            from: have.clone(),
            to: want.clone(),
            kind,
            bytes,
        });
    }
}

fn unrequested(
    g: &Graph,
    id: TensorId,
    src: TensorId,
    from: &SplitState,
    to: &SplitState,
) -> Error {
    Error::UnrequestedCommunication {
        node: g.name(id).to_string(),
        op: g.node(id).op.name().to_string(),
        source_name: g.name(src).to_string(),
        from: from.to_string(),
        to: to.to_string(),
        conversion: conversion_kind(from, to)
            .map_or("a conversion", |k| k.name())
            .to_string(),
    }
}
