//! The rule of `mul_mat_id` (`[as, b, ids]`, ggml's expert product): the dense product's
//! column and row patterns applied inside every expert (the expert weights split on axis 1 give
//! the output split on axis 0; split on axis 0 with the activations alike, partial sums), and
//! tokens split alike on `b`'s axis 2, `ids`' axis 1 and the output's axis 2; and whole
//! experts per device (expert parallelism: `as` split on axis 2, one segment): each device
//! multiplies the rows routed to its experts and leaves zeros in the others, a `Routed` output
//! keyed by the ids node. The activations are Mirrored (the gate and up products) or Routed by
//! the same ids over the same experts (the down product, after the activation kept them).
//! Experts over groups of devices (`ExpertGroups`): with axis 1 split inside a group and the
//! activations Mirrored, each device multiplies its columns of the rows routed to its group's
//! experts (`GroupRouted`); with axis 0 split inside a group and the activations GroupRouted
//! alike (the same ids, groups and extents), each device's rows are a partial sum of the
//! rows routed to its group and zeros elsewhere: Partial.
//!
//! | as | b | ids | output |
//! |---|---|---|---|
//! | Axis(1) | Mirrored | Mirrored | Axis(0), as's extents |
//! | Axis(0) | Axis(0) alike | Mirrored | Partial |
//! | Mirrored | Axis(0) in whole blocks | Mirrored | Partial (b alike on `as`) |
//! | Mirrored | Axis(2) (tokens) | Axis(1) alike | Axis(2) |
//! | Axis(2) (experts) | Mirrored, or Routed by these ids alike | Mirrored | Routed |
//! | ExpertGroups(1) | Mirrored | Mirrored | GroupRouted by these ids |
//! | ExpertGroups(0) | GroupRouted by these ids alike, or Mirrored (sliced per device) | Mirrored | Partial |
//! | every source Mirrored | | | Mirrored |

use super::{Ctx, Pattern, moved, pat, whole_blocks};
use crate::split_state::{SplitAxis, SplitState};

pub(super) fn rule(cx: &Ctx, src: &[SplitState]) -> Vec<Pattern> {
    let (sa, sb, si) = (&src[0], &src[1], &src[2]);
    let m = cx.mirrored();
    let mut out = Vec::new();
    match sa.axis {
        // Column-parallel inside every expert.
        SplitAxis::Axis(1) => out.push(pat(vec![sa.clone(), m.clone(), m.clone()], moved(sa, 0))),
        // Row-parallel inside every expert: K split alike on both gives partial sums.
        SplitAxis::Axis(0) => out.push(pat(vec![sa.clone(), sa.clone(), m.clone()], cx.partial())),
        // Whole experts per device: the rows routed to them, zeros elsewhere.
        SplitAxis::Axis(2) if sa.n_segments() == 1 => {
            let routed = SplitState::routed(cx.node.src[2].index(), sa.extents());
            if sb == &routed {
                out.push(pat(vec![sa.clone(), sb.clone(), m.clone()], routed.clone()));
            }
            out.push(pat(vec![sa.clone(), m.clone(), m.clone()], routed));
        }
        // Experts over groups, columns inside a group.
        SplitAxis::ExpertGroups(1) => {
            let routed = SplitState::group_routed(cx.node.src[2].index(), sa);
            out.push(pat(vec![sa.clone(), m.clone(), m.clone()], routed));
        }
        // Experts over groups, rows inside a group: the columns product's rows, alike.
        SplitAxis::ExpertGroups(0) => {
            let routed = SplitState::group_routed(cx.node.src[2].index(), sa);
            out.push(pat(vec![sa.clone(), routed, m.clone()], cx.partial()));
            // Mirrored activations: each device takes its group's slice of their columns.
            out.push(pat(vec![sa.clone(), m.clone(), m.clone()], cx.partial()));
        }
        _ => {}
    }
    if sb.split_dim() == Some(0) && whole_blocks(sb, cx.src_dtype(0)) {
        out.push(pat(vec![sb.clone(), sb.clone(), m.clone()], cx.partial()));
    }
    // Tokens split: each device multiplies its tokens by the experts they chose.
    let tokens = if sb.split_dim() == Some(2) {
        Some(sb)
    } else if si.split_dim() == Some(1) {
        Some(si)
    } else {
        None
    };
    if let Some(t) = tokens {
        out.push(pat(vec![m.clone(), moved(t, 2), moved(t, 1)], moved(t, 2)));
    }
    out.push(cx.all_mirrored());
    out
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::DType;
    use crate::graph::{Graph, TensorId};
    use crate::split_state::SplitState;

    #[test]
    fn columns_rows_and_tokens() {
        let mut g = Graph::new();
        let w = f32_in(&mut g, "experts", [8, 6, 4, 1]);
        let x = f32_in(&mut g, "x", [8, 1, 3, 1]);
        let ids = g.input("ids", DType::I32, [2, 3, 1, 1]).unwrap();
        let y = g.mul_mat_id(w, x, ids).unwrap();
        g.set_name(y, "y");
        keeps(&g, y, &[ax(1, &[4, 2]), m(), m()], ax(0, &[4, 2]));
        keeps(&g, y, &[ax(0, &[4, 4]), ax(0, &[4, 4]), m()], p());
        keeps(
            &g,
            y,
            &[m(), ax(2, &[1, 2]), ax(1, &[1, 2])],
            ax(2, &[1, 2]),
        );
        keeps(&g, y, &[m(), m(), m()], m());
        // Partial activations are not a pattern.
        refuses(&g, y, &[m(), p(), m()]);
    }

    /// 5 experts: an up product `y` routed by `ids`, the down product `z` of it by the same
    /// ids, and `z2` of it by other ids.
    fn up_down() -> (Graph, TensorId, TensorId, TensorId, TensorId) {
        let mut g = Graph::new();
        let w = f32_in(&mut g, "experts", [8, 6, 5, 1]);
        let x = f32_in(&mut g, "x", [8, 1, 3, 1]);
        let ids = g.input("ids", DType::I32, [2, 3, 1, 1]).unwrap();
        let other = g.input("other", DType::I32, [2, 3, 1, 1]).unwrap();
        let y = g.mul_mat_id(w, x, ids).unwrap();
        let down = f32_in(&mut g, "down", [6, 8, 5, 1]);
        let z = g.mul_mat_id(down, y, ids).unwrap();
        let z2 = g.mul_mat_id(down, y, other).unwrap();
        (g, ids, y, z, z2)
    }

    #[test]
    fn whole_experts_give_rows_routed_by_the_ids() {
        let (g, ids, y, z, z2) = up_down();
        let routed = SplitState::routed(ids.index(), &[3, 2]);
        // Uneven experts (3 + 2); the output names the ids it is routed by.
        keeps(&g, y, &[ax(2, &[3, 2]), m(), m()], routed.clone());
        // The down product takes activations routed alike, and no others.
        keeps(
            &g,
            z,
            &[ax(2, &[3, 2]), routed.clone(), m()],
            routed.clone(),
        );
        refuses(&g, z, &[ax(2, &[2, 3]), routed.clone(), m()]);
        refuses(&g, z2, &[ax(2, &[3, 2]), routed.clone(), m()]);
        // A segmented expert split is not a pattern.
        refuses(
            &g,
            y,
            &[
                SplitState::segmented(2, &[vec![1, 1], vec![2, 1]]),
                m(),
                m(),
            ],
        );
    }

    #[test]
    fn expert_groups_give_group_routed_columns_then_partial_rows() {
        let (g, ids, y, z, z2) = up_down();
        // One group of two devices holding every expert (N = 2 throughout these tests).
        let cols = SplitState::expert_groups(1, &[(5, vec![4, 2])]);
        let rows = SplitState::expert_groups(0, &[(5, vec![4, 2])]);
        let routed = SplitState::group_routed(ids.index(), &cols);
        keeps(&g, y, &[cols.clone(), m(), m()], routed.clone());
        keeps(&g, z, &[rows.clone(), routed.clone(), m()], p());
        keeps(&g, z, &[rows.clone(), m(), m()], p());
        // Rows routed by other ids, or split otherwise, are not the row product's input.
        refuses(&g, z2, &[rows.clone(), routed.clone(), m()]);
        let uneven = SplitState::expert_groups(0, &[(5, vec![2, 4])]);
        refuses(&g, z, &[uneven, routed, m()]);
        // Expert groups are not taken with split activations.
        refuses(&g, y, &[cols, ax(0, &[4, 4]), m()]);
    }
}
