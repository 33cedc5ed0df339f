//! The rules of attention ops: `rope` (heads split with shared positions, tokens split with
//! positions split alike, Partial kept as the rotation is linear) and `flash_attn` (heads split
//! on q, k and v with grouped-query heads kept together, or the batch split; the mask is
//! shared).

use super::{Ctx, Pattern, divided, moved, pat, scaled};
use crate::split_state::{SplitAxis, SplitState};

/// The attention ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// `[x [head_dim, n_head, n_tokens, 1], positions [n_tokens]]`.
    Rope,
    /// `[q, k, v, mask?]` -> `[dv, n_head, n_q, batch]`.
    FlashAttn,
}

pub(super) fn rule(cx: &Ctx, src: &[SplitState], kind: Attention) -> Vec<Pattern> {
    match kind {
        Attention::Rope => rope(cx, src),
        Attention::FlashAttn => flash_attn(cx, src),
    }
}

fn rope(cx: &Ctx, src: &[SplitState]) -> Vec<Pattern> {
    let s = &src[0];
    // Frequency factors (a third source) are per dimension pair: every device needs them all.
    let with_factors = |mut v: Vec<SplitState>| {
        if cx.n_src() == 3 {
            v.push(cx.mirrored());
        }
        v
    };
    let mut out = Vec::new();
    match s.axis {
        // Heads split: positions are shared.
        SplitAxis::Axis(1) | SplitAxis::Partial => {
            out.push(pat(with_factors(vec![s.clone(), cx.mirrored()]), s.clone()))
        }
        // Tokens split: positions split alike.
        SplitAxis::Axis(2) => out.push(pat(with_factors(vec![s.clone(), moved(s, 0)]), s.clone())),
        _ => {}
    }
    out.push(cx.all_mirrored());
    out
}

fn flash_attn(cx: &Ctx, src: &[SplitState]) -> Vec<Pattern> {
    let (nq, nk) = (cx.ne(0), cx.ne(1));
    let group = nq[2].checked_div(nk[2]).unwrap_or(1);
    let with_mask = |mut v: Vec<SplitState>| {
        if cx.n_src() == 4 {
            v.push(cx.mirrored());
        }
        v
    };
    let mut out = Vec::new();
    // Heads (axis 2 of q, k, v) -> axis 1 of the output; batch (axis 3) -> axis 3.
    if src[0].split_dim() == Some(2)
        && let Some(kv) = divided(&src[0], 2, group)
    {
        out.push(pat(
            with_mask(vec![src[0].clone(), kv.clone(), kv]),
            moved(&src[0], 1),
        ));
    }
    if src[1].split_dim() == Some(2) {
        let q = scaled(&src[1], 2, group);
        let o = moved(&q, 1);
        out.push(pat(with_mask(vec![q, src[1].clone(), src[1].clone()]), o));
    }
    if src[0].split_dim() == Some(3) {
        let s = src[0].clone();
        out.push(pat(with_mask(vec![s.clone(), s.clone(), s.clone()]), s));
    }
    out.push(cx.all_mirrored());
    out
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::DType;
    use crate::graph::Graph;
    use crate::op::{RopeMode, RopeParams};

    #[test]
    fn rope_splits_heads_or_tokens() {
        let mut g = Graph::new();
        let x = f32_in(&mut g, "q", [8, 4, 5, 1]);
        let pos = g.input("pos", DType::I32, [5, 1, 1, 1]).unwrap();
        let params = RopeParams {
            mode: RopeMode::NeoX,
            n_dims: 8,
            freq_base: 1e4,
            freq_scale: 1.0,
        };
        let r = g.rope(x, pos, params).unwrap();
        g.set_name(r, "q_rope");
        keeps(&g, r, &[ax(1, &[3, 1]), m()], ax(1, &[3, 1]));
        keeps(&g, r, &[p(), m()], p());
        keeps(&g, r, &[ax(2, &[2, 3]), ax(0, &[2, 3])], ax(2, &[2, 3]));
        admits(
            &g,
            r,
            &[ax(2, &[2, 3]), m()],
            &[
                pt(&[ax(2, &[2, 3]), ax(0, &[2, 3])], ax(2, &[2, 3])),
                pt(&[m(), m()], m()),
            ],
        );
        // The rotated pairs lie along dimension 0: it cannot be split.
        let msg = refuses(&g, r, &[ax(0, &[4, 4]), m()]);
        assert!(msg.contains("rope") && msg.contains("`q_rope`"), "{msg}");
        refuses(&g, r, &[ax(1, &[3, 1]), ax(0, &[2, 3])]);
    }

    #[test]
    fn flash_attn_splits_whole_query_groups_or_the_batch() {
        let mut g = Graph::new();
        // 6 query heads over 2 kv heads (groups of 3), batch 2, with a mask.
        let q = f32_in(&mut g, "q", [4, 3, 6, 2]);
        let k = f32_in(&mut g, "k", [4, 5, 2, 2]);
        let v = f32_in(&mut g, "v", [4, 5, 2, 2]);
        let mask = f32_in(&mut g, "mask", [5, 3, 1, 1]);
        let o = g.flash_attn(q, k, v, Some(mask), 0.5).unwrap();
        let (kv, qh) = (ax(2, &[1, 1]), ax(2, &[3, 3]));
        keeps(
            &g,
            o,
            &[qh.clone(), kv.clone(), kv.clone(), m()],
            ax(1, &[3, 3]),
        );
        let b = ax(3, &[1, 1]);
        keeps(&g, o, &[b.clone(), b.clone(), b.clone(), m()], b.clone());
        // Led by k: q follows in whole groups.
        admits(
            &g,
            o,
            &[m(), kv.clone(), m(), m()],
            &[
                pt(&[qh.clone(), kv.clone(), kv.clone(), m()], ax(1, &[3, 3])),
                pt(&[m(), m(), m(), m()], m()),
            ],
        );
        // A query split that cuts a group has no kv split to go with it.
        admits(
            &g,
            o,
            &[ax(2, &[4, 2]), m(), m(), m()],
            &[pt(&[m(), m(), m(), m()], m())],
        );
        refuses(&g, o, &[qh.clone(), kv.clone(), kv.clone(), ax(0, &[2, 3])]);
        refuses(&g, o, &[p(), m(), m(), m()]);
    }
}
