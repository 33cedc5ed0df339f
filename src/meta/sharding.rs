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
//! *State hints* steer that greedy choice where a cheaper local step would lead somewhere
//! worse later (sequence parallelism: a residual add reduce-scattered into a token split
//! rather than kept Partial by padding the residual). A node with a hint takes only patterns
//! whose output is the hinted state: the rule is asked with the sources as they are and again
//! as if the sources spanning the hinted split already were in it (all of them, and each alone),
//! so a pattern to the hinted state exists wherever the rule allows one; the cheapest is taken.
//! When none is admissible (or the node is a leaf or a view, whose state is not chosen), the
//! hint is ignored with a `tracing` debug line and the node takes its usual state. A hint that
//! is not a valid state of its node is an error naming the node.
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
    /// Axis (or GroupRouted) -> Partial: each device pads its slice with zeros to the full
    /// shape; no communication.
    PadToPartial,
    /// Partial (Routed; GroupRouted, padded first) -> Mirrored.
    AllReduce,
    /// Partial (Routed; GroupRouted, padded first) -> Axis.
    ReduceScatter,
    /// Axis -> Mirrored.
    AllGather,
    /// Axis -> another Axis split: all-gather, then slice.
    AllToAll,
    /// Routed -> Partial: the same local tensors (a routed value is a partial sum); no work.
    AsPartial,
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
            ConversionKind::AsPartial => "as-partial",
        }
    }

    /// Moves data between devices.
    pub fn communicates(self) -> bool {
        !matches!(
            self,
            ConversionKind::Slice
                | ConversionKind::ToPartial
                | ConversionKind::PadToPartial
                | ConversionKind::AsPartial
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
        // A routed value is reduced like any partial sum.
        (Routed { .. }, Partial) => ConversionKind::AsPartial,
        (Routed { .. }, Mirrored) => ConversionKind::AllReduce,
        (Routed { .. }, Axis(_)) => ConversionKind::ReduceScatter,
        // A group-routed value is padded into a Partial first (the rewrite does both).
        (GroupRouted { .. }, Partial) => ConversionKind::PadToPartial,
        (GroupRouted { .. }, Mirrored) => ConversionKind::AllReduce,
        (GroupRouted { .. }, Axis(_)) => ConversionKind::ReduceScatter,
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
    // A group-routed value is padded before it is reduced.
    let pad = if from.is_group_routed() && !to.is_partial() {
        0.05 * b
    } else {
        0.0
    };
    pad + match conversion_kind(from, to) {
        None => f64::INFINITY,
        Some(k) if explicit && !k.planned() => f64::INFINITY,
        Some(ConversionKind::AsPartial) => 0.0,
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

/// No state hints: every node takes the cheapest pattern of its rule.
pub fn no_hints(_: TensorId) -> Option<SplitState> {
    None
}

/// Derive the sharding of `g` over `n` devices. `leaf_state(id)` gives a leaf's state (None:
/// mirrored); `hint(id)` a computed node's wanted state (None: the cheapest; see the module
/// doc; [`no_hints`] for none).
pub fn derive_sharding(
    g: &Graph,
    n: usize,
    explicit: bool,
    leaf_state: &dyn Fn(TensorId) -> Option<SplitState>,
    hint: &dyn Fn(TensorId) -> Option<SplitState>,
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
        let want = hint(id);
        if let Some(h) = &want {
            h.validate(&node.name, &node.layout, n)
                .map_err(|e| match e {
                    Error::InvalidSplit { tensor, reason } => Error::InvalidSplit {
                        tensor,
                        reason: format!("state hint {h}: {reason}"),
                    },
                    other => other,
                })?;
        }
        // Leaves.
        if node.is_leaf() {
            let st = leaf_state(id).unwrap_or_else(|| SplitState::mirrored(n));
            ignored_hint(
                g,
                id,
                want.as_ref(),
                &st,
                "a leaf keeps the state it was placed in",
            );
            p.states.push(st);
            p.required.push(Vec::new());
            continue;
        }
        // Views: derived from the root, gathered first when not representable.
        if node.op.is_view() {
            let root = g.root(id);
            let rl = g.layout(root);
            let rs = p.states[root.index()].clone();
            if matches!(rs.axis, SplitAxis::ExpertGroups(_)) {
                return Err(Error::NoSplitRule {
                    op: node.op.name().to_string(),
                    node: node.name.clone(),
                    states: format!("[{rs}]"),
                    reason: "a view of experts split over groups of devices (only `mul_mat_id` \
                             takes them)"
                        .into(),
                });
            }
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
            let why = "a view's state follows its root";
            ignored_hint(g, id, want.as_ref(), &vs.state, why);
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
        let cheapest = |pats: &[Pattern]| -> Option<Pattern> {
            pats.iter()
                .map(|pt| (total(pt, explicit), pt))
                .filter(|(c, _)| c.is_finite())
                .min_by(|a, b| a.0.total_cmp(&b.0))
                .map(|(_, pt)| pt.clone())
        };
        let hinted = want
            .as_ref()
            .and_then(|h| cheapest(&hinted_patterns(g, id, &cur, &pats, h)));
        let best = hinted.or_else(|| {
            let best = cheapest(&pats);
            if let Some(b) = &best {
                let why = "no admissible pattern gives it";
                ignored_hint(g, id, want.as_ref(), &b.output, why);
            }
            best
        });
        let Some(best) = best else {
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

/// The patterns of node `id` (sources in states `cur`, whose own patterns are `pats`) whose
/// output is `want`: among `pats`, and among the rule's patterns when the sources that span
/// `want`'s split (every source, for Mirrored or Partial) are taken as already in `want`, all
/// together and each alone. A source state that is not valid for the source is not tried.
fn hinted_patterns(
    g: &Graph,
    id: TensorId,
    cur: &[SplitState],
    pats: &[Pattern],
    want: &SplitState,
) -> Vec<Pattern> {
    let node = g.node(id);
    let n = want.n_devices();
    let spans = |i: usize| {
        let s = node.src[i];
        let l = g.layout(s);
        let fits = match want.split_dim() {
            Some(k) => l.ne[k] == node.layout.ne[k],
            None => true,
        };
        fits && want.validate(g.name(s), l, n).is_ok()
    };
    let spanning: Vec<usize> = (0..cur.len()).filter(|&i| spans(i)).collect();
    let mut alternatives: Vec<Vec<SplitState>> = Vec::new();
    let with = |which: &[usize]| {
        let mut v = cur.to_vec();
        for &i in which {
            v[i] = want.clone();
        }
        v
    };
    alternatives.push(with(&spanning));
    if spanning.len() > 1 {
        alternatives.extend(spanning.iter().map(|&i| with(&[i])));
    }
    let mut out: Vec<Pattern> = pats.iter().filter(|p| &p.output == want).cloned().collect();
    for alt in alternatives.iter().filter(|a| a.as_slice() != cur) {
        for p in patterns(g, id, alt) {
            if &p.output == want && !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// Log a hint node `id` does not follow (it takes `got` instead).
fn ignored_hint(g: &Graph, id: TensorId, want: Option<&SplitState>, got: &SplitState, why: &str) {
    if let Some(w) = want
        && w != got
    {
        tracing::debug!(
            node = %g.name(id),
            op = g.node(id).op.name(),
            hint = %w,
            state = %got,
            "state hint not followed: {why}"
        );
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    const N: usize = 2;

    fn ax1() -> SplitState {
        SplitState::axis(1, &[2, 2])
    }

    /// `x` (Partial) + `r` (Mirrored), then an RMS norm of the sum: a residual add after a
    /// row-parallel product, and the norm after it.
    fn residual() -> (Graph, TensorId, TensorId, TensorId) {
        let mut g = Graph::new();
        let x = g.input("x", DType::F32, [8, 4, 1, 1]).unwrap();
        let r = g.input("r", DType::F32, [8, 4, 1, 1]).unwrap();
        let sum = g.add(x, r).unwrap();
        g.set_name(sum, "sum");
        let norm = g.rms_norm(sum, 1e-6).unwrap();
        g.set_name(norm, "norm");
        (g, x, sum, norm)
    }

    fn shard(
        g: &Graph,
        partial: TensorId,
        explicit: bool,
        hint: &dyn Fn(TensorId) -> Option<SplitState>,
    ) -> Result<Sharding> {
        let leaf = |id: TensorId| (id == partial).then(|| SplitState::partial(N));
        derive_sharding(g, N, explicit, &leaf, hint)
    }

    fn kinds(s: &Sharding) -> Vec<ConversionKind> {
        s.conversions.iter().map(|c| c.kind).collect()
    }

    #[test]
    fn a_hinted_node_takes_the_hinted_state() {
        let (g, x, sum, norm) = residual();
        // Unhinted: the cheap local step (the mirrored residual made Partial), then an
        // all-reduce before the norm.
        let plain = shard(&g, x, false, &no_hints).unwrap();
        assert_eq!(plain.states[sum.index()], SplitState::partial(N));
        assert_eq!(
            kinds(&plain),
            [ConversionKind::ToPartial, ConversionKind::AllReduce]
        );
        // Hinted to a token split: the partial sum is reduce-scattered, the residual sliced,
        // and the norm keeps the split.
        let hint = |id: TensorId| (id == sum).then(ax1);
        let s = shard(&g, x, false, &hint).unwrap();
        assert_eq!(s.states[sum.index()], ax1());
        assert_eq!(s.required[sum.index()], [ax1(), ax1()]);
        assert_eq!(s.states[norm.index()], ax1());
        assert_eq!(
            kinds(&s),
            [ConversionKind::ReduceScatter, ConversionKind::Slice]
        );
        // A hint the cheapest pattern already gives changes nothing.
        let same = |id: TensorId| (id == sum).then(|| SplitState::partial(N));
        let s = shard(&g, x, false, &same).unwrap();
        assert_eq!(s.states, plain.states);
        assert_eq!(kinds(&s), kinds(&plain));
    }

    #[test]
    fn an_inadmissible_hint_falls_back_to_the_cheapest_pattern() {
        let (g, x, sum, norm) = residual();
        let plain = shard(&g, x, false, &no_hints).unwrap();
        // The norm reduces dimension 0: no pattern splits its output there.
        let hint = |id: TensorId| (id == norm).then(|| SplitState::axis(0, &[4, 4]));
        let s = shard(&g, x, false, &hint).unwrap();
        assert_eq!(s.states, plain.states);
        assert_eq!(kinds(&s), kinds(&plain));
        // Explicit mode refuses the all-gather a mirrored norm of a split sum would need.
        let hint = |id: TensorId| {
            if id == sum {
                Some(ax1())
            } else if id == norm {
                Some(SplitState::mirrored(N))
            } else {
                None
            }
        };
        let s = shard(&g, x, true, &hint).unwrap();
        assert_eq!(s.states[sum.index()], ax1());
        assert_eq!(s.states[norm.index()], ax1());
        assert_eq!(s.count(ConversionKind::AllGather), 0);
        // Without explicit mode the same hint is followed.
        let s = shard(&g, x, false, &hint).unwrap();
        assert_eq!(s.states[norm.index()], SplitState::mirrored(N));
        assert_eq!(s.count(ConversionKind::AllGather), 1);
        // Leaves keep the state they were placed in.
        let hint = |id: TensorId| (id == x).then(|| SplitState::mirrored(N));
        let s = shard(&g, x, false, &hint).unwrap();
        assert_eq!(s.states[x.index()], SplitState::partial(N));
    }

    #[test]
    fn an_invalid_hint_is_an_error_naming_the_node() {
        let (g, x, sum, _) = residual();
        let hint = |id: TensorId| (id == sum).then(|| SplitState::axis(1, &[3, 3]));
        let e = shard(&g, x, false, &hint).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(&e, Error::InvalidSplit { tensor, .. } if tensor == "sum")
                && msg.contains("state hint Axis1[3, 3]"),
            "{msg}"
        );
    }
}
