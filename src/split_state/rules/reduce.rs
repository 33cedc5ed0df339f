//! The rules of reductions along dimension 0: `sum_rows` and `mean` keep any split of the other
//! dimensions and Partial (they are linear); a split of dimension 0 gives partial sums for
//! `sum_rows` only (a mean of partial means would need each device's count), and for
//! `sum_sqr_rows`, which keeps the other splits but not Partial (squares of partial sums do
//! not add up). `argmax` of a
//! 2-D tensor split by rows gives its indices split alike; `argsort` sorts within rows, so any
//! split of the other dimensions is kept.

use super::{Ctx, Pattern, moved, pat};
use crate::split_state::{SplitAxis, SplitState};

/// The reductions of dimension 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// `sum_rows`
    Sum,
    /// `sum_sqr_rows`
    SumSqr,
    /// `mean`
    Mean,
    /// `argmax`: I32 `[ne1]` of a 2-D input.
    Argmax,
    /// `argsort`: I32 indices of the input's shape.
    Argsort,
}

pub(super) fn rule(cx: &Ctx, src: &[SplitState], kind: Reduction) -> Vec<Pattern> {
    let s = &src[0];
    let mut out = Vec::new();
    match kind {
        Reduction::Sum | Reduction::Mean => match s.axis {
            SplitAxis::Axis(k) if k > 0 => out.push(pat(vec![s.clone()], s.clone())),
            SplitAxis::Axis(0) if kind == Reduction::Sum => {
                out.push(pat(vec![s.clone()], cx.partial()))
            }
            SplitAxis::Partial => out.push(pat(vec![s.clone()], s.clone())),
            _ => {}
        },
        Reduction::SumSqr => match s.axis {
            SplitAxis::Axis(0) => out.push(pat(vec![s.clone()], cx.partial())),
            SplitAxis::Axis(_) => out.push(pat(vec![s.clone()], s.clone())),
            _ => {}
        },
        Reduction::Argsort => {
            if matches!(s.axis, SplitAxis::Axis(k) if k > 0) {
                out.push(pat(vec![s.clone()], s.clone()));
            }
        }
        Reduction::Argmax => {
            if s.split_dim() == Some(1) {
                out.push(pat(vec![s.clone()], moved(s, 0)));
            }
        }
    }
    out.push(cx.all_mirrored());
    out
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::graph::Graph;

    #[test]
    fn sums_means_and_argmax() {
        let mut g = Graph::new();
        let x = f32_in(&mut g, "x", [8, 4, 1, 1]);
        let sum = g.sum_rows(x).unwrap();
        let mean = g.mean(x).unwrap();
        g.set_name(mean, "pooled");
        let arg = g.argmax(x).unwrap();
        for id in [sum, mean] {
            keeps(&g, id, &[ax(1, &[1, 3])], ax(1, &[1, 3]));
            keeps(&g, id, &[p()], p());
            keeps(&g, id, &[m()], m());
        }
        // Splitting the summed dimension leaves partial sums.
        keeps(&g, sum, &[ax(0, &[2, 6])], p());
        admits(&g, mean, &[ax(0, &[2, 6])], &[pt(&[m()], m())]);
        let msg = refuses(&g, mean, &[ax(0, &[2, 6])]);
        assert!(msg.contains("mean") && msg.contains("`pooled`"), "{msg}");
        // argmax of rows split by rows: the indices are split alike.
        keeps(&g, arg, &[ax(1, &[3, 1])], ax(0, &[3, 1]));
        refuses(&g, arg, &[ax(0, &[4, 4])]);
        refuses(&g, arg, &[p()]);
    }
}
