//! The split-state rule of every op: given the current states of a node's sources, the
//! admissible *patterns*, each a list of required source states and the output state that
//! follows. The meta planner takes the cheapest pattern (counting the conversions it needs), so
//! a rule only says what is correct, never what to communicate.
//!
//! [`family`] sorts every `Op` variant into the family whose rule it follows (exhaustively: a
//! new op does not compile until it is given one), and [`patterns`] calls that family's rule:
//!
//! | family | ops | file |
//! |---|---|---|
//! | matmul | `mul_mat` | `matmul.rs` |
//! | experts | `mul_mat_id` | `experts.rs` |
//! | element-wise | binary ops, `scale`, `clamp`, unary ops, `swiglu` | `elementwise.rs` |
//! | norms | `rms_norm`, `norm`, `soft_max`, `rms_norm_sums` | `norm.rs` |
//! | attention | `rope`, `flash_attn` | `attention.rs` |
//! | rows | `get_rows`, `set_rows` | `rows.rs` |
//! | views and copies | `reshape`, `view`, `permute`, `cont`, `cpy`, `concat` | `copy.rs` |
//! | reductions | `sum_rows`, `sum_sqr_rows`, `mean`, `argmax`, `argsort` | `reduce.rs` |
//!
//! Leaves and collectives have no rule (they are placed, not derived), nor do views (derived
//! from their root in `view.rs`). Every op with a kernel also admits all-Mirrored, except those
//! writing into a destination that cannot be converted (`set_rows`, `cpy`), so a rule always
//! exists for them; [`output_state`] says whether one takes the sources as they are.

mod attention;
mod copy;
mod elementwise;
mod experts;
mod matmul;
mod norm;
mod reduce;
mod rows;

pub use attention::Attention;
pub use copy::ViewCopy;
pub use elementwise::Elementwise;
pub use norm::Norm;
pub use reduce::Reduction;
pub use rows::Rows;

use super::SplitState;
use crate::graph::{Graph, Node, TensorId};
use crate::op::Op;
use crate::{DType, Error, Result};

/// Required source states and the resulting output state.
#[derive(Clone, Debug, PartialEq)]
pub struct Pattern {
    pub inputs: Vec<SplitState>,
    pub output: SplitState,
}

/// The rule an op follows, with the parameters of the op the rule depends on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Family {
    MatMul,
    MatMulId,
    Elementwise(Elementwise),
    Norm(Norm),
    Attention(Attention),
    Rows(Rows),
    ViewCopy(ViewCopy),
    Reduction(Reduction),
    /// Leaves take the state they are placed with; collectives exist only in per-device
    /// programs. Neither has a rule.
    Placed,
}

/// The family of `op`. No wildcard: a new op must be given a family here.
pub fn family(op: &Op) -> Family {
    match *op {
        Op::Leaf | Op::Collective(_) => Family::Placed,
        Op::Reshape | Op::View { .. } | Op::Permute { .. } => Family::ViewCopy(ViewCopy::View),
        Op::Cont => Family::ViewCopy(ViewCopy::Cont),
        Op::Cpy => Family::ViewCopy(ViewCopy::Cpy),
        Op::Concat { dim } => Family::ViewCopy(ViewCopy::Concat { dim }),
        Op::MulMat => Family::MatMul,
        // The rule sees whole ops, as for the row ops' windows.
        Op::MulMatId { .. } => Family::MatMulId,
        Op::Binary(op) => Family::Elementwise(Elementwise::Binary(op)),
        // Linear (so Partial in gives Partial out) only without a bias.
        Op::Scale { scale: _, bias } => Family::Elementwise(Elementwise::Map {
            linear: bias == 0.0,
            keeps_zero: bias == 0.0,
        }),
        Op::Clamp { min, max } => Family::Elementwise(Elementwise::Map {
            linear: false,
            keeps_zero: min <= 0.0 && 0.0 <= max,
        }),
        Op::Unary(u) => Family::Elementwise(Elementwise::Map {
            linear: false,
            keeps_zero: u.keeps_zero(),
        }),
        Op::Swiglu => Family::Elementwise(Elementwise::Swiglu),
        Op::RmsNorm { .. } | Op::Norm { .. } => Family::Norm(Norm::Row),
        Op::SoftMax { .. } => Family::Norm(Norm::SoftMax),
        Op::RmsNormSums { .. } => Family::Norm(Norm::Sums),
        Op::Rope(_) => Family::Attention(Attention::Rope),
        Op::FlashAttn { .. } => Family::Attention(Attention::FlashAttn),
        // A window addresses rows within the operand it is given; the rules see whole ops.
        Op::GetRows { .. } => Family::Rows(Rows::Get),
        Op::SetRows { .. } => Family::Rows(Rows::Set),
        Op::SumRows => Family::Reduction(Reduction::Sum),
        Op::SumSqrRows => Family::Reduction(Reduction::SumSqr),
        Op::Mean => Family::Reduction(Reduction::Mean),
        Op::Argmax => Family::Reduction(Reduction::Argmax),
        Op::Argsort { .. } => Family::Reduction(Reduction::Argsort),
    }
}

/// Patterns for node `id` given its sources' current states (views and leaves have none). A
/// Routed source is also a Partial one, and a GroupRouted one becomes one by padding: the
/// patterns that take it as Partial follow the rule's own (the sharding converts it for free,
/// or nearly).
pub fn patterns(g: &Graph, id: TensorId, src: &[SplitState]) -> Vec<Pattern> {
    let cx = Ctx {
        g,
        id,
        node: g.node(id),
        n: src.first().map_or(1, |s| s.n_devices()),
    };
    let mut pats = family_patterns(&cx, src);
    let as_partial = |s: &SplitState| s.is_routed() || s.is_group_routed();
    if src.iter().any(as_partial) {
        let partial: Vec<SplitState> = src
            .iter()
            .map(|s| {
                if as_partial(s) {
                    cx.partial()
                } else {
                    s.clone()
                }
            })
            .collect();
        for p in family_patterns(&cx, &partial) {
            if !pats.contains(&p) {
                pats.push(p);
            }
        }
    }
    pats
}

/// The patterns of the node's family rule.
fn family_patterns(cx: &Ctx, src: &[SplitState]) -> Vec<Pattern> {
    match family(&cx.node.op) {
        Family::MatMul => matmul::rule(cx, src),
        Family::MatMulId => experts::rule(cx, src),
        Family::Elementwise(k) => elementwise::rule(cx, src, k),
        Family::Norm(k) => norm::rule(cx, src, k),
        Family::Attention(k) => attention::rule(cx, src, k),
        Family::Rows(k) => rows::rule(cx, src, k),
        Family::ViewCopy(k) => copy::rule(cx, src, k),
        Family::Reduction(k) => reduce::rule(cx, src, k),
        Family::Placed => Vec::new(),
    }
}

/// The state of node `id` when its sources keep the states `src`, or [`Error::NoSplitRule`]
/// naming the op, the node and the states when no pattern takes them without a conversion.
pub fn output_state(g: &Graph, id: TensorId, src: &[SplitState]) -> Result<SplitState> {
    let pats = patterns(g, id, src);
    if let Some(p) = pats.iter().find(|p| p.inputs.as_slice() == src) {
        return Ok(p.output.clone());
    }
    let node = g.node(id);
    let reason = if pats.is_empty() {
        "the op admits no split of these sources".to_string()
    } else {
        let each: Vec<String> = pats.iter().map(|p| p.to_string()).collect();
        format!("it admits only {}", each.join("; "))
    };
    Err(Error::NoSplitRule {
        op: node.op.name().to_string(),
        node: node.name.clone(),
        states: states_str(src),
        reason,
    })
}

fn states_str(s: &[SplitState]) -> String {
    let v: Vec<String> = s.iter().map(|s| s.to_string()).collect();
    format!("[{}]", v.join(", "))
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} -> {}", states_str(&self.inputs), self.output)
    }
}

// ---- what every rule uses -------------------------------------------------------------

/// What a rule may look at: the graph, the node and the number of devices.
struct Ctx<'a> {
    g: &'a Graph,
    id: TensorId,
    node: &'a Node,
    n: usize,
}

impl Ctx<'_> {
    /// Shape of source `i`.
    fn ne(&self, i: usize) -> [usize; 4] {
        self.g.layout(self.node.src[i]).ne
    }

    /// Dtype of source `i`.
    fn src_dtype(&self, i: usize) -> DType {
        self.g.layout(self.node.src[i]).dtype
    }

    /// Dtype of the node itself.
    fn dtype(&self) -> DType {
        self.g.layout(self.id).dtype
    }

    fn n_src(&self) -> usize {
        self.node.src.len()
    }

    fn mirrored(&self) -> SplitState {
        SplitState::mirrored(self.n)
    }

    fn partial(&self) -> SplitState {
        SplitState::partial(self.n)
    }

    /// Every source and the output Mirrored: always correct, and the fallback of most ops.
    fn all_mirrored(&self) -> Pattern {
        pat(vec![self.mirrored(); self.n_src()], self.mirrored())
    }
}

fn pat(inputs: Vec<SplitState>, output: SplitState) -> Pattern {
    Pattern { inputs, output }
}

/// The split `s` with the same extents, on `axis`.
fn moved(s: &SplitState, axis: usize) -> SplitState {
    scaled(s, axis, 1)
}

/// The split `s` with every extent multiplied by `mul` (a GQA ratio), on `axis`.
fn scaled(s: &SplitState, axis: usize, mul: usize) -> SplitState {
    debug_assert!(s.split_dim().is_some(), "{s} is not split");
    s.rescaled(axis, mul, 1)
        .expect("a multiple divided by 1 is exact")
}

/// `s` with every extent divided exactly by `div`, moved to `axis`; `None` if inexact.
fn divided(s: &SplitState, axis: usize, div: usize) -> Option<SplitState> {
    s.rescaled(axis, 1, div)
}

/// Whether every extent of an axis-0 split `s` is a whole number of `dtype`'s blocks (a split
/// of another axis always is).
fn whole_blocks(s: &SplitState, dtype: DType) -> bool {
    let Some(k) = s.split_dim() else {
        return true;
    };
    let g = super::Granularity::of_axis(dtype, k).0;
    s.extents().iter().all(|e| e % g == 0)
}

/// The rule of a one-source op that maps elements to elements of the node's dtype (a map, a
/// copy, a cast): any state is kept, Partial only when the op is `linear`, Routed (and
/// GroupRouted) when it `keeps_zero` (the rows a device does not hold stay zero), and an axis-0 split only in whole
/// blocks of the output's dtype.
fn keep_state(cx: &Ctx, src: &[SplitState], linear: bool, keeps_zero: bool) -> Vec<Pattern> {
    let s = &src[0];
    let mut out = Vec::new();
    let kept = if s.is_partial() {
        linear
    } else if s.is_routed() || s.is_group_routed() {
        keeps_zero
    } else {
        true
    };
    if kept && whole_blocks(s, cx.dtype()) {
        out.push(pat(vec![s.clone()], s.clone()));
    }
    out.push(cx.all_mirrored());
    out
}

/// Helpers for the families' unit tests.
#[cfg(test)]
mod testing {
    use super::*;

    /// Two devices throughout.
    pub const N: usize = 2;

    pub fn ax(k: usize, extents: &[usize]) -> SplitState {
        SplitState::axis(k, extents)
    }

    pub fn m() -> SplitState {
        SplitState::mirrored(N)
    }

    pub fn p() -> SplitState {
        SplitState::partial(N)
    }

    pub fn f32_in(g: &mut Graph, name: &str, ne: [usize; 4]) -> TensorId {
        g.input(name, DType::F32, ne).unwrap()
    }

    /// Sources in the states `src` are taken as they are and give `want`.
    #[track_caller]
    pub fn keeps(g: &Graph, id: TensorId, src: &[SplitState], want: SplitState) {
        match output_state(g, id, src) {
            Ok(s) => assert_eq!(s, want, "{} of {}", g.node(id).op.name(), states_str(src)),
            Err(e) => panic!("expected {want}, got: {e}"),
        }
    }

    /// No pattern takes the sources in the states `src` as they are: the error is
    /// `NoSplitRule` naming the op, the node and every state. Returns the message.
    #[track_caller]
    pub fn refuses(g: &Graph, id: TensorId, src: &[SplitState]) -> String {
        let e = output_state(g, id, src).expect_err("no rule should take these states");
        let msg = e.to_string();
        let node = g.node(id);
        match &e {
            Error::NoSplitRule { op, node: name, .. } => {
                assert_eq!(op, node.op.name(), "{msg}");
                assert_eq!(name, &node.name, "{msg}");
            }
            other => panic!("expected NoSplitRule, got {other:?}"),
        }
        for s in src {
            assert!(msg.contains(&s.to_string()), "{s} missing from: {msg}");
        }
        msg
    }

    /// The complete list of patterns, in order.
    #[track_caller]
    pub fn admits(g: &Graph, id: TensorId, src: &[SplitState], want: &[Pattern]) {
        assert_eq!(patterns(g, id, src), want);
    }

    pub fn pt(inputs: &[SplitState], output: SplitState) -> Pattern {
        pat(inputs.to_vec(), output)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    use crate::op::{BinaryOp, CollectiveKind, RopeMode, RopeParams, UnaryOp};

    #[test]
    fn every_op_has_a_family() {
        let rope = RopeParams {
            mode: RopeMode::NeoX,
            n_dims: 8,
            freq_base: 1e4,
            freq_scale: 1.0,
        };
        let cases = [
            (Op::Leaf, Family::Placed),
            (Op::Collective(CollectiveKind::AllReduce), Family::Placed),
            (
                Op::Permute { axes: [1, 0, 2, 3] },
                Family::ViewCopy(ViewCopy::View),
            ),
            (
                Op::Concat { dim: 2 },
                Family::ViewCopy(ViewCopy::Concat { dim: 2 }),
            ),
            (
                Op::Binary(BinaryOp::Div),
                Family::Elementwise(Elementwise::Binary(BinaryOp::Div)),
            ),
            (
                Op::Scale {
                    scale: 2.0,
                    bias: 0.0,
                },
                Family::Elementwise(Elementwise::Map {
                    linear: true,
                    keeps_zero: true,
                }),
            ),
            (
                Op::Scale {
                    scale: 2.0,
                    bias: 1.0,
                },
                Family::Elementwise(Elementwise::Map {
                    linear: false,
                    keeps_zero: false,
                }),
            ),
            (
                Op::Unary(UnaryOp::Silu),
                Family::Elementwise(Elementwise::Map {
                    linear: false,
                    keeps_zero: true,
                }),
            ),
            (
                Op::Unary(UnaryOp::Sigmoid),
                Family::Elementwise(Elementwise::Map {
                    linear: false,
                    keeps_zero: false,
                }),
            ),
            (Op::SoftMax { scale: 1.0 }, Family::Norm(Norm::SoftMax)),
            (Op::Rope(rope), Family::Attention(Attention::Rope)),
            (Op::SetRows { window: None }, Family::Rows(Rows::Set)),
            (Op::Mean, Family::Reduction(Reduction::Mean)),
        ];
        for (op, want) in cases {
            assert_eq!(family(&op), want, "{}", op.name());
        }
    }

    #[test]
    fn leaves_and_views_have_no_patterns() {
        let mut g = Graph::new();
        let x = f32_in(&mut g, "x", [8, 4, 1, 1]);
        let v = g.reshape(x, [4, 8, 1, 1]).unwrap();
        assert!(patterns(&g, x, &[]).is_empty());
        assert!(patterns(&g, v, &[ax(0, &[4, 4])]).is_empty());
    }
}
