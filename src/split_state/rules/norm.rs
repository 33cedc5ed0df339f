//! The rules of row-wise normalizations: `rms_norm` and `norm` (which reduce dimension 0, so
//! keep any split but of it, and never Partial), `soft_max` (likewise, with an optional
//! mask that follows the input's split or broadcasts along it), and `rms_norm_sums`, whose
//! rows' sums of squares come as a source: it keeps any split of its input, dimension 0's
//! too (the sums then Mirrored, the weight split alike), which is what it is for.

use super::{Ctx, Pattern, pat};
use crate::split_state::SplitState;

/// The row-wise normalizations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    /// `rms_norm`, `norm`: one source.
    Row,
    /// `soft_max`: `[x, mask?]`.
    SoftMax,
    /// `rms_norm_sums`: `[x, sums, w]`.
    Sums,
}

pub(super) fn rule(cx: &Ctx, src: &[SplitState], kind: Norm) -> Vec<Pattern> {
    let s = &src[0];
    let mut out = Vec::new();
    match kind {
        Norm::Row => {
            if s.split_dim().is_some_and(|k| k > 0) {
                out.push(pat(vec![s.clone()], s.clone()));
            }
        }
        Norm::SoftMax => {
            if let Some(k) = s.split_dim().filter(|&k| k > 0)
                && let Some(ins) = with_mask(cx, s, k)
            {
                out.push(pat(ins, s.clone()));
            }
        }
        Norm::Sums => {
            if let Some(k) = s.split_dim() {
                // The sums ([1, ...]) and the weight ([ne0]) each span dimension k (split
                // alike) or broadcast along it (Mirrored).
                let ne = cx.ne(0);
                let follow = |i: usize| {
                    let ni = cx.ne(i);
                    if ni[k] == ne[k] {
                        Some(s.clone())
                    } else if ni[k] == 1 {
                        Some(cx.mirrored())
                    } else {
                        None
                    }
                };
                if let (Some(sums), Some(w)) = (follow(1), follow(2)) {
                    out.push(pat(vec![s.clone(), sums, w], s.clone()));
                }
            }
        }
    }
    out.push(cx.all_mirrored());
    out
}

/// Sources of `soft_max` for the input split `s` on dimension `k`: the mask broadcasts along k
/// (shared) or spans it (split alike); `None` if it does neither.
fn with_mask(cx: &Ctx, s: &SplitState, k: usize) -> Option<Vec<SplitState>> {
    let mut ins = vec![s.clone()];
    if cx.n_src() == 2 {
        let (na, nm) = (cx.ne(0), cx.ne(1));
        if nm[k] == 1 {
            ins.push(cx.mirrored());
        } else if nm[k] == na[k] {
            ins.push(s.clone());
        } else {
            return None;
        }
    }
    Some(ins)
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::graph::Graph;

    #[test]
    fn row_norms_keep_splits_of_other_dimensions() {
        let mut g = Graph::new();
        let x = f32_in(&mut g, "x", [8, 4, 2, 1]);
        let rms = g.rms_norm(x, 1e-6).unwrap();
        g.set_name(rms, "attn_norm");
        let ln = g.norm(x, 1e-5).unwrap();
        for id in [rms, ln] {
            keeps(&g, id, &[ax(1, &[3, 1])], ax(1, &[3, 1]));
            keeps(&g, id, &[ax(2, &[1, 1])], ax(2, &[1, 1]));
            keeps(&g, id, &[m()], m());
            admits(&g, id, &[ax(0, &[4, 4])], &[pt(&[m()], m())]);
            refuses(&g, id, &[p()]);
        }
        // The reduced dimension cannot be split: the error says what is admitted.
        let msg = refuses(&g, rms, &[ax(0, &[4, 4])]);
        assert!(
            msg.contains("rms_norm")
                && msg.contains("`attn_norm`")
                && msg.contains("Axis0[4, 4]")
                && msg.contains("[Mirrored] -> Mirrored"),
            "{msg}"
        );
    }

    /// `sum_sqr_rows` of a row split by columns gives partial sums; `rms_norm_sums` then keeps
    /// the columns' split with the sums Mirrored and the weight split alike, and a token split
    /// with the sums split alike and the weight Mirrored.
    #[test]
    fn norms_from_sums_keep_a_split_of_the_row() {
        let mut g = Graph::new();
        let x = f32_in(&mut g, "q", [8, 4, 1, 1]);
        let w = f32_in(&mut g, "q_norm", [8, 1, 1, 1]);
        let sums = g.sum_sqr_rows(x).unwrap();
        let y = g.rms_norm_sums(x, sums, w, 1e-6, 8).unwrap();
        keeps(&g, sums, &[ax(0, &[5, 3])], p());
        keeps(&g, sums, &[ax(1, &[3, 1])], ax(1, &[3, 1]));
        // Squares of partial sums do not add up.
        admits(&g, sums, &[p()], &[pt(&[m()], m())]);
        let cols = ax(0, &[5, 3]);
        admits(
            &g,
            y,
            &[cols.clone(), p(), m()],
            &[
                pt(&[cols.clone(), m(), cols.clone()], cols.clone()),
                pt(&[m(), m(), m()], m()),
            ],
        );
        keeps(&g, y, &[cols.clone(), m(), cols.clone()], cols);
        let toks = ax(1, &[3, 1]);
        keeps(&g, y, &[toks.clone(), toks.clone(), m()], toks);
        refuses(&g, y, &[ax(0, &[5, 3]), m(), ax(0, &[4, 4])]);
    }

    #[test]
    fn soft_max_masks_follow_or_broadcast() {
        let mut g = Graph::new();
        // Scores [kv 6, q 3, heads 4]; the mask [6, 3] broadcasts over heads.
        let x = f32_in(&mut g, "kq", [6, 3, 4, 1]);
        let mask = f32_in(&mut g, "mask", [6, 3, 1, 1]);
        let sm = g.soft_max(x, Some(mask), 0.125).unwrap();
        let plain = g.soft_max(x, None, 1.0).unwrap();
        keeps(&g, sm, &[ax(2, &[3, 1]), m()], ax(2, &[3, 1]));
        keeps(&g, sm, &[ax(1, &[2, 1]), ax(1, &[2, 1])], ax(1, &[2, 1]));
        keeps(&g, plain, &[ax(2, &[2, 2])], ax(2, &[2, 2]));
        // The mask must be shared along the heads it broadcasts over.
        refuses(&g, sm, &[ax(2, &[3, 1]), ax(2, &[3, 1])]);
        refuses(&g, sm, &[ax(0, &[3, 3]), m()]);
        refuses(&g, plain, &[p()]);
    }
}
