//! The rules of views and copies. Views have none here: their state is derived from their
//! root's (`split_state::view`). `cont` (a copy or cast) keeps any state, Partial only into a
//! float type and an axis-0 split only in whole blocks of its output. `cpy` writes into a
//! destination that cannot be converted, so its source follows it. `concat` keeps a split of
//! either operand along another dimension than the joined one.

use super::{Ctx, Pattern, keep_state, pat, whole_blocks};
use crate::split_state::SplitState;

/// Views and copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ViewCopy {
    /// `reshape`, `view`, `permute`: no rule (derived from the root by `view.rs`).
    View,
    /// `[src]` copied or cast into a new packed tensor.
    Cont,
    /// `[src, dst]` copied into `dst`.
    Cpy,
    /// `[a, b]` joined along `dim`.
    Concat { dim: usize },
}

pub(super) fn rule(cx: &Ctx, src: &[SplitState], kind: ViewCopy) -> Vec<Pattern> {
    match kind {
        ViewCopy::View => Vec::new(),
        // Partial sums stay partial sums only in a float type.
        ViewCopy::Cont => {
            let float = cx.dtype().is_float();
            keep_state(cx, src, float, float)
        }
        ViewCopy::Cpy => cpy(cx, src),
        ViewCopy::Concat { dim } => concat(cx, src, dim),
    }
}

/// The source follows the destination; a quantized source cannot follow an axis-0 split that
/// cuts its blocks, nor be Partial (partial sums are of float types). Without the same shape
/// the elements do not correspond split by split, so only a mirrored destination will do.
fn cpy(cx: &Ctx, src: &[SplitState]) -> Vec<Pattern> {
    let sd = &src[1];
    let st = cx.src_dtype(0);
    let mut out = Vec::new();
    if (cx.ne(0) == cx.ne(1) || sd.is_mirrored())
        && whole_blocks(sd, st)
        && (st.is_float() || !sd.is_partial())
    {
        out.push(pat(vec![sd.clone(), sd.clone()], sd.clone()));
    }
    out
}

fn concat(cx: &Ctx, src: &[SplitState], dim: usize) -> Vec<Pattern> {
    let mut out = Vec::new();
    for s in [&src[0], &src[1]] {
        if s.split_dim().is_some_and(|k| k != dim) {
            out.push(pat(vec![s.clone(), s.clone()], s.clone()));
        }
    }
    out.push(cx.all_mirrored());
    out
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::DType;
    use crate::graph::Graph;

    #[test]
    fn cont_keeps_states_and_casts_in_whole_blocks() {
        let mut g = Graph::new();
        let x = f32_in(&mut g, "x", [64, 4, 1, 1]);
        let c = g.cont(x).unwrap();
        let q = g.cast(x, DType::Q8_0).unwrap();
        g.set_name(q, "x_q8");
        keeps(&g, c, &[ax(0, &[16, 48])], ax(0, &[16, 48]));
        keeps(&g, c, &[p()], p());
        keeps(&g, q, &[ax(0, &[32, 32])], ax(0, &[32, 32]));
        keeps(&g, q, &[ax(1, &[1, 3])], ax(1, &[1, 3]));
        // A quantized cast cannot cut a block, nor hold partial sums.
        refuses(&g, q, &[ax(0, &[16, 48])]);
        let msg = refuses(&g, q, &[p()]);
        assert!(msg.contains("cont") && msg.contains("`x_q8`"), "{msg}");
    }

    #[test]
    fn cpy_follows_its_destination() {
        let mut g = Graph::new();
        let x = f32_in(&mut g, "x", [8, 4, 1, 1]);
        let dst = g.input("dst", DType::F16, [8, 4, 1, 1]).unwrap();
        let flat = g.input("flat", DType::F32, [32, 1, 1, 1]).unwrap();
        let w = g.cpy(x, dst).unwrap();
        let wf = g.cpy(x, flat).unwrap();
        keeps(&g, w, &[ax(1, &[1, 3]), ax(1, &[1, 3])], ax(1, &[1, 3]));
        keeps(&g, w, &[p(), p()], p());
        admits(
            &g,
            w,
            &[m(), ax(0, &[4, 4])],
            &[pt(&[ax(0, &[4, 4]), ax(0, &[4, 4])], ax(0, &[4, 4]))],
        );
        // Another shape: only a mirrored destination; no fallback for a split one.
        keeps(&g, wf, &[m(), m()], m());
        let src = [ax(0, &[4, 4]), ax(0, &[16, 16])];
        admits(&g, wf, &src, &[]);
        let msg = refuses(&g, wf, &src);
        assert!(
            msg.contains("cpy") && msg.contains("admits no split"),
            "{msg}"
        );
    }

    #[test]
    fn concat_keeps_splits_of_other_dimensions_and_views_have_no_rule() {
        let mut g = Graph::new();
        let a = f32_in(&mut g, "a", [8, 4, 1, 1]);
        let b = f32_in(&mut g, "b", [8, 2, 1, 1]);
        let c = g.concat(a, b, 1).unwrap();
        keeps(&g, c, &[ax(0, &[4, 4]), ax(0, &[4, 4])], ax(0, &[4, 4]));
        keeps(&g, c, &[m(), m()], m());
        // Split along the joined dimension: the pieces would interleave.
        refuses(&g, c, &[ax(1, &[2, 2]), ax(1, &[1, 1])]);
        refuses(&g, c, &[p(), p()]);
        let t = g.transpose(a).unwrap();
        admits(&g, t, &[ax(0, &[4, 4])], &[]);
    }
}
