//! A rule for every op: given the current states of a node's sources, the admissible
//! *patterns*, each a list of required source states and the output state that follows. The
//! meta planner takes the cheapest pattern (counting the conversions it needs), so a rule only
//! says what is correct, never what to communicate.
//!
//! Rules are data where possible: element-wise ops keep any split and (when linear) Partial;
//! row-wise ops (`rms_norm`, `norm`, `soft_max`, `sum_rows`, `mean`, `argmax`) keep any split but
//! of dimension 0, which they reduce; `mul_mat` follows upstream's column/row/head patterns plus
//! a batched head split (axis 2/3, with GQA broadcast); `flash_attn` splits heads; `get_rows`,
//! `set_rows`, `rope`, `concat` and `cpy` as documented per arm. Views are derived in `view.rs`.
//! Every op also admits all-Mirrored, so a rule always exists for ops with kernels.

use super::{SplitAxis, SplitState};
use crate::graph::{Graph, TensorId};
use crate::op::{BinaryOp, Op};

/// Required source states and the resulting output state.
#[derive(Clone, Debug, PartialEq)]
pub struct Pattern {
    pub inputs: Vec<SplitState>,
    pub output: SplitState,
}

fn pat(inputs: Vec<SplitState>, output: SplitState) -> Pattern {
    Pattern { inputs, output }
}

fn all_mirrored(n: usize, nsrc: usize) -> Pattern {
    pat(vec![SplitState::mirrored(n); nsrc], SplitState::mirrored(n))
}

/// `s` with every extent multiplied by `mul` (a GQA ratio), moved to `axis`.
fn scaled(s: &SplitState, axis: usize, mul: usize) -> Option<SplitState> {
    s.rescaled(axis, mul, 1)
}

/// `s` with every extent divided exactly by `div`.
fn divided(s: &SplitState, axis: usize, div: usize) -> Option<SplitState> {
    s.rescaled(axis, 1, div)
}

/// Whether every extent of an axis-0 split `s` is a whole number of `dtype`'s blocks (a split
/// of another axis always is).
fn whole_blocks(s: &SplitState, dtype: crate::DType) -> bool {
    let bs = dtype.block_size();
    s.split_dim() != Some(0) || s.extents().iter().all(|e| e % bs == 0)
}

/// Whether an op is linear in all its sources jointly (so Partial inputs give Partial output).
fn linear_unary(op: &Op, g: &Graph, id: TensorId) -> bool {
    match *op {
        Op::Scale { bias, .. } => bias == 0.0,
        Op::Cont => g.layout(id).dtype.is_float(),
        Op::Rope(_) | Op::SumRows => true,
        _ => false,
    }
}

/// Patterns for node `id` given its sources' current states (views and leaves excluded).
pub fn patterns(g: &Graph, id: TensorId, src: &[SplitState]) -> Vec<Pattern> {
    let node = g.node(id);
    let n = src.first().map_or(1, |s| s.n_devices());
    let ne = |i: usize| g.layout(node.src[i]).ne;
    let mut out = Vec::new();
    match node.op {
        Op::Leaf | Op::Reshape | Op::View { .. } | Op::Permute { .. } | Op::Collective(_) => {}
        Op::MulMat => {
            let (sa, sb) = (&src[0], &src[1]);
            let (na, nb) = (ne(0), ne(1));
            match sa.axis {
                // Column-parallel: output features split like the weight's rows.
                SplitAxis::Axis(1) => out.push(pat(
                    vec![sa.clone(), SplitState::mirrored(n)],
                    scaled(sa, 0, 1).unwrap(),
                )),
                // Row-parallel: K split on both gives partial sums.
                SplitAxis::Axis(0) => {
                    out.push(pat(vec![sa.clone(), sa.clone()], SplitState::partial(n)))
                }
                SplitAxis::Partial => out.push(pat(
                    vec![sa.clone(), SplitState::mirrored(n)],
                    SplitState::partial(n),
                )),
                _ => {}
            }
            match sb.axis {
                // Row-parallel led by the activation: a follows b's K split, which for a
                // quantized a must cut whole blocks.
                SplitAxis::Axis(0) if whole_blocks(sb, g.layout(node.src[0]).dtype) => {
                    out.push(pat(vec![sb.clone(), sb.clone()], SplitState::partial(n)))
                }
                SplitAxis::Axis(1) => {
                    out.push(pat(vec![SplitState::mirrored(n), sb.clone()], sb.clone()))
                }
                SplitAxis::Partial => out.push(pat(
                    vec![SplitState::mirrored(n), sb.clone()],
                    SplitState::partial(n),
                )),
                _ => {}
            }
            // Batched split over dims 2 or 3 (attention heads), with a broadcast of a over b.
            for k in [2usize, 3] {
                if na[k] == 0 || nb[k] % na[k] != 0 {
                    continue;
                }
                let r = nb[k] / na[k];
                if sb.split_dim() == Some(k)
                    && let Some(ra) = divided(sb, k, r)
                {
                    out.push(pat(vec![ra, sb.clone()], sb.clone()));
                }
                if sa.split_dim() == Some(k) {
                    let rb = scaled(sa, k, r).unwrap();
                    out.push(pat(vec![sa.clone(), rb.clone()], rb));
                }
            }
            out.push(all_mirrored(n, 2));
        }
        Op::Binary(op) => {
            let (na, nb) = (ne(0), ne(1));
            // Follow a's split; b follows it, or is shared when it broadcasts along the axis.
            if let Some(k) = src[0].split_dim() {
                let s = &src[0];
                if nb[k] == na[k] {
                    out.push(pat(vec![s.clone(), s.clone()], s.clone()));
                } else if nb[k] == 1 {
                    out.push(pat(vec![s.clone(), SplitState::mirrored(n)], s.clone()));
                }
            }
            // Follow b's split when b spans a along that axis.
            if let Some(k) = src[1].split_dim().filter(|&k| nb[k] == na[k]) {
                let _ = k;
                out.push(pat(vec![src[1].clone(), src[1].clone()], src[1].clone()));
            }
            let (pa, pb) = (src[0].is_partial(), src[1].is_partial());
            let partial = SplitState::partial(n);
            let mirrored = SplitState::mirrored(n);
            match op {
                BinaryOp::Add | BinaryOp::Sub if pa || pb => {
                    out.push(pat(vec![partial.clone(), partial.clone()], partial.clone()))
                }
                BinaryOp::Mul | BinaryOp::Div if pa => out.push(pat(
                    vec![partial.clone(), mirrored.clone()],
                    partial.clone(),
                )),
                BinaryOp::Mul if pb => out.push(pat(
                    vec![mirrored.clone(), partial.clone()],
                    partial.clone(),
                )),
                _ => {}
            }
            out.push(all_mirrored(n, 2));
        }
        Op::Scale { .. } | Op::Clamp { .. } | Op::Unary(_) | Op::Cont => {
            let s = &src[0];
            // A cast to a quantized type keeps an axis-0 split only in whole blocks.
            if (!s.is_partial() || linear_unary(&node.op, g, id))
                && whole_blocks(s, g.layout(id).dtype)
            {
                out.push(pat(vec![s.clone()], s.clone()));
            }
            out.push(all_mirrored(n, 1));
        }
        Op::Swiglu => {
            let s = &src[0];
            if node.src.len() == 2 {
                if s.split_dim().is_some() {
                    out.push(pat(vec![s.clone(), s.clone()], s.clone()));
                }
                if src[1].split_dim().is_some() {
                    out.push(pat(vec![src[1].clone(), src[1].clone()], src[1].clone()));
                }
            } else {
                match s.split_dim() {
                    // Fused [gate | up] split per segment: each device holds gate_d | up_d.
                    Some(0)
                        if s.n_segments() == 2
                            && (0..n).all(|d| s.extent(0, d) == s.extent(1, d)) =>
                    {
                        let gate: Vec<usize> = (0..n).map(|d| s.extent(0, d)).collect();
                        out.push(pat(vec![s.clone()], SplitState::axis(0, &gate)));
                    }
                    Some(0) => {}
                    Some(_) => out.push(pat(vec![s.clone()], s.clone())),
                    None => {}
                }
            }
            out.push(all_mirrored(n, node.src.len()));
        }
        Op::RmsNorm { .. } | Op::Norm { .. } => {
            let s = &src[0];
            if s.split_dim().is_some_and(|k| k > 0) {
                out.push(pat(vec![s.clone()], s.clone()));
            }
            out.push(all_mirrored(n, 1));
        }
        Op::SoftMax { .. } => {
            let s = &src[0];
            if let Some(k) = s.split_dim().filter(|&k| k > 0) {
                let na = ne(0);
                let mut ins = vec![s.clone()];
                let mut ok = true;
                if node.src.len() == 2 {
                    let nm = ne(1);
                    if nm[k] == 1 {
                        ins.push(SplitState::mirrored(n));
                    } else if nm[k] == na[k] {
                        ins.push(s.clone());
                    } else {
                        ok = false;
                    }
                }
                if ok {
                    out.push(pat(ins, s.clone()));
                }
            }
            out.push(all_mirrored(n, node.src.len()));
        }
        Op::SumRows | Op::Mean => {
            let s = &src[0];
            match s.axis {
                SplitAxis::Axis(k) if k > 0 => out.push(pat(vec![s.clone()], s.clone())),
                SplitAxis::Axis(0) if node.op == Op::SumRows => {
                    out.push(pat(vec![s.clone()], SplitState::partial(n)))
                }
                SplitAxis::Partial => out.push(pat(vec![s.clone()], s.clone())),
                _ => {}
            }
            out.push(all_mirrored(n, 1));
        }
        Op::Argmax => {
            let s = &src[0];
            if s.split_dim() == Some(1) {
                out.push(pat(vec![s.clone()], scaled(s, 0, 1).unwrap()));
            }
            out.push(all_mirrored(n, 1));
        }
        Op::Rope(_) => {
            let s = &src[0];
            match s.axis {
                // Heads split: positions are shared.
                SplitAxis::Axis(1) | SplitAxis::Partial => {
                    out.push(pat(vec![s.clone(), SplitState::mirrored(n)], s.clone()))
                }
                // Tokens split: positions split alike.
                SplitAxis::Axis(2) => {
                    out.push(pat(vec![s.clone(), scaled(s, 0, 1).unwrap()], s.clone()))
                }
                _ => {}
            }
            out.push(all_mirrored(n, 2));
        }
        Op::GetRows => {
            let (st, si) = (&src[0], &src[1]);
            let m = SplitState::mirrored(n);
            match st.axis {
                SplitAxis::Axis(0) | SplitAxis::Partial => {
                    out.push(pat(vec![st.clone(), m.clone()], st.clone()))
                }
                _ => {}
            }
            if let Some(k) = si.split_dim().filter(|&k| k < 3) {
                // ids [n, e2, e3] split on k gives output split on k + 1.
                let table = if k == 0 {
                    m.clone()
                } else {
                    scaled(si, k + 1, 1).unwrap()
                };
                out.push(pat(vec![table, si.clone()], scaled(si, k + 1, 1).unwrap()));
            }
            out.push(all_mirrored(n, 2));
        }
        Op::SetRows => {
            // The destination cannot be converted: rows and ids follow it.
            let sd = &src[0];
            let m = SplitState::mirrored(n);
            match sd.axis {
                SplitAxis::Mirrored => out.push(all_mirrored(n, 3)),
                SplitAxis::Axis(0) => out.push(pat(vec![sd.clone(), sd.clone(), m], sd.clone())),
                SplitAxis::Axis(k) if k >= 2 => {
                    let k = k as usize;
                    let ni = ne(2);
                    let ids = if ni[k - 1] == 1 {
                        Some(m)
                    } else if ni[k - 1] == ne(1)[k] {
                        scaled(sd, k - 1, 1)
                    } else {
                        None
                    };
                    if let Some(ids) = ids {
                        out.push(pat(vec![sd.clone(), sd.clone(), ids], sd.clone()));
                    }
                }
                _ => {}
            }
        }
        Op::Cpy => {
            // The source follows the destination (which cannot be converted); a quantized
            // source cannot follow an axis-0 split that cuts its blocks, nor be Partial
            // (partial sums are of float types).
            let sd = &src[1];
            let st = g.layout(node.src[0]).dtype;
            if (ne(0) == ne(1) || sd.is_mirrored())
                && whole_blocks(sd, st)
                && (st.is_float() || !sd.is_partial())
            {
                out.push(pat(vec![sd.clone(), sd.clone()], sd.clone()));
            }
        }
        Op::Concat { dim } => {
            for s in [&src[0], &src[1]] {
                if s.split_dim().is_some_and(|k| k != dim) {
                    out.push(pat(vec![s.clone(), s.clone()], s.clone()));
                }
            }
            out.push(all_mirrored(n, 2));
        }
        Op::FlashAttn { .. } => {
            let (nq, nk) = (ne(0), ne(1));
            let group = nq[2].checked_div(nk[2]).unwrap_or(1);
            let m = SplitState::mirrored(n);
            let with_mask = |mut v: Vec<SplitState>| {
                if node.src.len() == 4 {
                    v.push(m.clone());
                }
                v
            };
            // Heads (axis 2 of q, k, v) -> axis 1 of the output; batch (axis 3) -> axis 3.
            if src[0].split_dim() == Some(2)
                && let Some(kv) = divided(&src[0], 2, group)
            {
                out.push(pat(
                    with_mask(vec![src[0].clone(), kv.clone(), kv]),
                    scaled(&src[0], 1, 1).unwrap(),
                ));
            }
            if src[1].split_dim() == Some(2) {
                let q = scaled(&src[1], 2, group).unwrap();
                let o = scaled(&q, 1, 1).unwrap();
                out.push(pat(with_mask(vec![q, src[1].clone(), src[1].clone()]), o));
            }
            if src[0].split_dim() == Some(3) {
                let s = src[0].clone();
                out.push(pat(with_mask(vec![s.clone(), s.clone(), s.clone()]), s));
            }
            out.push(all_mirrored(n, node.src.len()));
        }
    }
    out
}
