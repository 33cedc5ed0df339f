//! The rules of element-wise ops: binary ops (`src1` broadcasting over `src0`), one-source maps
//! (`scale`, `clamp`, unary functions) and `swiglu`. Any split is kept; Partial only where the
//! op is linear in it; Routed (an expert product's rows, each on one device, zeros elsewhere)
//! where the op keeps zero at zero: maps with f(0) = 0, `swiglu` of two values routed alike,
//! products with a Mirrored factor or of two values routed alike, sums and differences of two
//! values routed alike. Any other use of a Routed value takes it as Partial. GroupRouted (the
//! columns of rows routed to a group of devices) is kept the same ways, except products with a
//! Mirrored factor (whose columns the device does not slice); any other use pads it into a
//! Partial.

use super::{Ctx, Pattern, keep_state, pat};
use crate::op::BinaryOp;
use crate::split_state::SplitState;

/// The element-wise ops, as far as their rules differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elementwise {
    Binary(BinaryOp),
    /// One source, element by element; `linear` maps (`scale` without bias) keep Partial,
    /// maps that `keeps_zero` (f(0) = 0) keep Routed.
    Map {
        linear: bool,
        keeps_zero: bool,
    },
    /// `[gate, up]`, or `[fused]` with gate and up as the two halves of dimension 0.
    Swiglu,
}

pub(super) fn rule(cx: &Ctx, src: &[SplitState], kind: Elementwise) -> Vec<Pattern> {
    match kind {
        Elementwise::Binary(op) => binary(cx, src, op),
        Elementwise::Map { linear, keeps_zero } => keep_state(cx, src, linear, keeps_zero),
        Elementwise::Swiglu => swiglu(cx, src),
    }
}

fn binary(cx: &Ctx, src: &[SplitState], op: BinaryOp) -> Vec<Pattern> {
    let (na, nb) = (cx.ne(0), cx.ne(1));
    let mut out = Vec::new();
    // Follow a's split; b follows it, or is shared when it broadcasts along the axis.
    if let Some(k) = src[0].split_dim() {
        let s = &src[0];
        if nb[k] == na[k] {
            out.push(pat(vec![s.clone(), s.clone()], s.clone()));
        } else if nb[k] == 1 {
            out.push(pat(vec![s.clone(), cx.mirrored()], s.clone()));
        }
    }
    // Follow b's split when b spans a along that axis.
    if src[1].split_dim().is_some_and(|k| nb[k] == na[k]) {
        out.push(pat(vec![src[1].clone(), src[1].clone()], src[1].clone()));
    }
    routed_binary(cx, src, op, &mut out);
    // Partial: sums and differences of partial sums; products and quotients with one
    // partial factor (the numerator of a quotient).
    let (pa, pb) = (src[0].is_partial(), src[1].is_partial());
    let (partial, mirrored) = (cx.partial(), cx.mirrored());
    match op {
        BinaryOp::Add | BinaryOp::Sub if pa || pb => {
            out.push(pat(vec![partial.clone(), partial.clone()], partial))
        }
        BinaryOp::Mul | BinaryOp::Div if pa => {
            out.push(pat(vec![partial.clone(), mirrored], partial))
        }
        BinaryOp::Mul if pb => out.push(pat(vec![mirrored, partial.clone()], partial)),
        _ => {}
    }
    out.push(cx.all_mirrored());
    out
}

/// Routed operands: a product with a Mirrored factor, or two values routed alike multiplied,
/// added or subtracted, stay Routed (zero rows stay zero), when the routed operand has the
/// output's shape (its rows are the output's rows).
fn routed_binary(cx: &Ctx, src: &[SplitState], op: BinaryOp, out: &mut Vec<Pattern>) {
    let (a, b) = (&src[0], &src[1]);
    let full = |i: usize| cx.ne(i) == cx.ne(0);
    if (a.is_routed() || a.is_group_routed()) && a == b && full(1) {
        if matches!(op, BinaryOp::Mul | BinaryOp::Add | BinaryOp::Sub) {
            out.push(pat(vec![a.clone(), a.clone()], a.clone()));
        }
        return;
    }
    if op == BinaryOp::Mul {
        if a.is_routed() {
            out.push(pat(vec![a.clone(), cx.mirrored()], a.clone()));
        } else if b.is_routed() && full(1) {
            out.push(pat(vec![cx.mirrored(), b.clone()], b.clone()));
        }
    }
}

fn swiglu(cx: &Ctx, src: &[SplitState]) -> Vec<Pattern> {
    let n = cx.n;
    let s = &src[0];
    let mut out = Vec::new();
    // silu(0) * 0 = 0: gate and up routed alike stay routed.
    if cx.n_src() == 2 && (s.is_routed() || s.is_group_routed()) && src[1] == *s {
        out.push(pat(vec![s.clone(), s.clone()], s.clone()));
    }
    if cx.n_src() == 2 {
        if s.split_dim().is_some() {
            out.push(pat(vec![s.clone(), s.clone()], s.clone()));
        }
        if src[1].split_dim().is_some() {
            out.push(pat(vec![src[1].clone(), src[1].clone()], src[1].clone()));
        }
    } else {
        match s.split_dim() {
            // Fused [gate | up] split per segment: each device holds gate_d | up_d.
            Some(0) if s.n_segments() == 2 && (0..n).all(|d| s.extent(0, d) == s.extent(1, d)) => {
                let gate: Vec<usize> = (0..n).map(|d| s.extent(0, d)).collect();
                out.push(pat(vec![s.clone()], SplitState::axis(0, &gate)));
            }
            // Any other split of dimension 0 cuts gate and up apart.
            Some(0) | None => {}
            Some(_) => out.push(pat(vec![s.clone()], s.clone())),
        }
    }
    out.push(cx.all_mirrored());
    out
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::graph::Graph;
    use crate::split_state::SplitState;

    #[test]
    fn binary_ops_follow_a_split_and_broadcast() {
        let mut g = Graph::new();
        let a = f32_in(&mut g, "a", [8, 4, 1, 1]);
        let b = f32_in(&mut g, "b", [8, 4, 1, 1]);
        let bias = f32_in(&mut g, "bias", [8, 1, 1, 1]);
        let add = g.add(a, b).unwrap();
        g.set_name(add, "sum");
        let mul = g.mul(a, bias).unwrap();
        keeps(&g, add, &[ax(1, &[1, 3]), ax(1, &[1, 3])], ax(1, &[1, 3]));
        keeps(&g, add, &[p(), p()], p());
        // The bias broadcasts along dimension 1: shared when a is split there.
        keeps(&g, mul, &[ax(1, &[2, 2]), m()], ax(1, &[2, 2]));
        keeps(&g, mul, &[p(), m()], p());
        admits(
            &g,
            add,
            &[ax(0, &[4, 4]), m()],
            &[
                pt(&[ax(0, &[4, 4]), ax(0, &[4, 4])], ax(0, &[4, 4])),
                pt(&[m(), m()], m()),
            ],
        );
        // Refused: a sum of a partial and a mirrored tensor (the mirrored one would count N
        // times), a product of two partial sums, and splits that disagree.
        refuses(&g, add, &[p(), m()]);
        refuses(&g, add, &[ax(1, &[1, 3]), ax(1, &[2, 2])]);
        let msg = refuses(&g, mul, &[p(), p()]);
        assert!(
            msg.contains("mul") && msg.contains("[Partial, Partial]"),
            "{msg}"
        );
    }

    #[test]
    fn maps_keep_any_split_and_partial_only_when_linear() {
        let mut g = Graph::new();
        let x = f32_in(&mut g, "x", [8, 4, 1, 1]);
        let scaled = g.scale(x, 0.5).unwrap();
        let biased = g.scale_bias(x, 0.5, 1.0).unwrap();
        let silu = g.silu(x).unwrap();
        for id in [scaled, biased, silu] {
            keeps(&g, id, &[ax(0, &[2, 6])], ax(0, &[2, 6]));
            keeps(&g, id, &[ax(3, &[1, 0])], ax(3, &[1, 0]));
            keeps(&g, id, &[m()], m());
        }
        keeps(&g, scaled, &[p()], p());
        refuses(&g, biased, &[p()]);
        let msg = refuses(&g, silu, &[p()]);
        assert!(
            msg.contains("silu") && msg.contains("[Mirrored] -> Mirrored"),
            "{msg}"
        );
    }

    #[test]
    fn swiglu_keeps_splits_and_cuts_fused_halves_per_segment() {
        let mut g = Graph::new();
        let gate = f32_in(&mut g, "gate", [8, 4, 1, 1]);
        let up = f32_in(&mut g, "up", [8, 4, 1, 1]);
        let fused = f32_in(&mut g, "fused", [16, 4, 1, 1]);
        let two = g.swiglu(gate, up).unwrap();
        let one = g.swiglu_fused(fused).unwrap();
        keeps(&g, two, &[ax(0, &[6, 2]), ax(0, &[6, 2])], ax(0, &[6, 2]));
        admits(
            &g,
            two,
            &[m(), ax(1, &[2, 2])],
            &[
                pt(&[ax(1, &[2, 2]), ax(1, &[2, 2])], ax(1, &[2, 2])),
                pt(&[m(), m()], m()),
            ],
        );
        // [gate | up] in two segments of [6, 2] each: device d gets gate_d | up_d.
        let seg = SplitState::segmented(0, &[vec![6, 2], vec![6, 2]]);
        keeps(&g, one, &[seg], ax(0, &[6, 2]));
        keeps(&g, one, &[ax(1, &[3, 1])], ax(1, &[3, 1]));
        // A plain split of dimension 0 separates gates from their ups; unequal segments too.
        refuses(&g, one, &[ax(0, &[8, 8])]);
        refuses(
            &g,
            one,
            &[SplitState::segmented(0, &[vec![6, 2], vec![4, 4]])],
        );
        refuses(&g, two, &[p(), p()]);
    }

    #[test]
    fn routed_rows_stay_routed_where_zero_stays_zero() {
        let mut g = Graph::new();
        let gate = f32_in(&mut g, "gate", [8, 2, 3, 1]);
        let up = f32_in(&mut g, "up", [8, 2, 3, 1]);
        let w = f32_in(&mut g, "weights", [1, 2, 3, 1]);
        let h = g.swiglu(gate, up).unwrap();
        let scaled = g.mul(gate, w).unwrap();
        let sum = g.add(gate, up).unwrap();
        let bias = g.add(gate, w).unwrap();
        let silu = g.silu(gate).unwrap();
        let sig = g.sigmoid(gate).unwrap();
        let r = SplitState::routed(7, &[3, 2]);
        let other = SplitState::routed(8, &[3, 2]);
        keeps(&g, h, &[r.clone(), r.clone()], r.clone());
        keeps(&g, scaled, &[r.clone(), m()], r.clone());
        keeps(&g, sum, &[r.clone(), r.clone()], r.clone());
        keeps(&g, silu, std::slice::from_ref(&r), r.clone());
        // Routed by other ids, a bias added, or f(0) != 0: reduced first (or taken as the
        // Partial sum it also is, where the op allows one).
        refuses(&g, h, &[r.clone(), other.clone()]);
        refuses(&g, bias, &[r.clone(), m()]);
        refuses(&g, sig, std::slice::from_ref(&r));
        admits(
            &g,
            sum,
            &[r.clone(), other],
            &[pt(&[m(), m()], m()), pt(&[p(), p()], p())],
        );
    }
}
