//! The rule of `mul_mat` (`[a, b]`, contracting dimension 0 of both): upstream's column, row
//! and head patterns, plus a batched split of dimension 2 or 3 (attention heads) with a GQA
//! broadcast of `a` over `b`.

use super::{Ctx, Pattern, divided, moved, pat, scaled, whole_blocks};
use crate::split_state::{SplitAxis, SplitState};

pub(super) fn rule(cx: &Ctx, src: &[SplitState]) -> Vec<Pattern> {
    let (sa, sb) = (&src[0], &src[1]);
    let (na, nb) = (cx.ne(0), cx.ne(1));
    let mut out = Vec::new();
    match sa.axis {
        // Column-parallel: output features split like the weight's rows.
        SplitAxis::Axis(1) => out.push(pat(vec![sa.clone(), cx.mirrored()], moved(sa, 0))),
        // Row-parallel: K split on both gives partial sums.
        SplitAxis::Axis(0) => out.push(pat(vec![sa.clone(), sa.clone()], cx.partial())),
        SplitAxis::Partial => out.push(pat(vec![sa.clone(), cx.mirrored()], cx.partial())),
        _ => {}
    }
    match sb.axis {
        // Row-parallel led by the activation: a follows b's K split, which for a quantized a
        // must cut whole blocks.
        SplitAxis::Axis(0) if whole_blocks(sb, cx.src_dtype(0)) => {
            out.push(pat(vec![sb.clone(), sb.clone()], cx.partial()))
        }
        SplitAxis::Axis(1) => out.push(pat(vec![cx.mirrored(), sb.clone()], sb.clone())),
        SplitAxis::Partial => out.push(pat(vec![cx.mirrored(), sb.clone()], cx.partial())),
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
            let rb = scaled(sa, k, r);
            out.push(pat(vec![sa.clone(), rb.clone()], rb));
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
    fn column_row_and_head_splits() {
        let mut g = Graph::new();
        let w = f32_in(&mut g, "w", [8, 6, 1, 1]);
        let x = f32_in(&mut g, "x", [8, 3, 1, 1]);
        let y = g.mul_mat(w, x).unwrap();
        g.set_name(y, "y");
        // Column-parallel: the weight's rows become the output's features.
        keeps(&g, y, &[ax(1, &[4, 2]), m()], ax(0, &[4, 2]));
        // Row-parallel: K split alike on both gives partial sums.
        keeps(&g, y, &[ax(0, &[4, 4]), ax(0, &[4, 4])], p());
        keeps(&g, y, &[p(), m()], p());
        keeps(&g, y, &[m(), ax(1, &[1, 2])], ax(1, &[1, 2]));
        // Every admissible pattern for a column-split weight and a mirrored activation.
        admits(
            &g,
            y,
            &[ax(1, &[4, 2]), m()],
            &[
                pt(&[ax(1, &[4, 2]), m()], ax(0, &[4, 2])),
                pt(&[m(), m()], m()),
            ],
        );
        // Refused: K split on the weight alone, or differently on the two.
        refuses(&g, y, &[ax(0, &[4, 4]), m()]);
        let msg = refuses(&g, y, &[ax(0, &[4, 4]), ax(0, &[2, 6])]);
        assert!(msg.contains("mul_mat") && msg.contains("`y`"), "{msg}");

        // Heads: k [D, T, 2 heads] against q [D, T, 6 heads] (GQA ratio 3).
        let mut g = Graph::new();
        let k = f32_in(&mut g, "k", [4, 5, 2, 1]);
        let q = f32_in(&mut g, "q", [4, 3, 6, 1]);
        let kq = g.mul_mat(k, q).unwrap();
        keeps(&g, kq, &[ax(2, &[1, 1]), ax(2, &[3, 3])], ax(2, &[3, 3]));
        // Led by q: its heads must be whole groups of k's.
        admits(
            &g,
            kq,
            &[m(), ax(2, &[3, 3])],
            &[
                pt(&[ax(2, &[1, 1]), ax(2, &[3, 3])], ax(2, &[3, 3])),
                pt(&[m(), m()], m()),
            ],
        );
        admits(&g, kq, &[m(), ax(2, &[4, 2])], &[pt(&[m(), m()], m())]);
    }

    #[test]
    fn a_quantized_weight_follows_an_activation_split_in_whole_blocks() {
        let mut g = Graph::new();
        let w = g.weight("w", DType::Q8_0, [64, 4, 1, 1]).unwrap();
        let x = f32_in(&mut g, "x", [64, 3, 1, 1]);
        let y = g.mul_mat(w, x).unwrap();
        keeps(&g, y, &[ax(0, &[32, 32]), ax(0, &[32, 32])], p());
        admits(&g, y, &[m(), ax(0, &[16, 48])], &[pt(&[m(), m()], m())]);
    }
}
