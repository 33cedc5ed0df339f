//! The rule of `mul_mat_id` (`[as, b, ids]`, ggml's expert product): the dense product's
//! column and row patterns applied inside every expert (the expert weights split on axis 1 give
//! the output split on axis 0; split on axis 0 with the activations alike, partial sums), and
//! tokens split alike on `b`'s axis 2, `ids`' axis 1 and the output's axis 2. Whole experts per
//! device (a split of axis 2 of `as`) is not a pattern yet: such a weight is converted to one
//! these take, or Mirrored.

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
    use crate::graph::Graph;

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
        // Whole experts per device, and partial activations, are not patterns yet.
        refuses(&g, y, &[ax(2, &[2, 2]), m(), m()]);
        refuses(&g, y, &[m(), p(), m()]);
    }
}
