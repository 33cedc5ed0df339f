//! The rules of row gathers and scatters. `get_rows` keeps a table split by features (or
//! Partial: picking rows is linear), gives a Partial lookup from a table split by rows (each
//! device looks up the ids its rows hold and zeros for the others: a vocabulary-split token
//! embedding), or splits its output like the ids (with the table split alike along the batch
//! dimensions it shares with them). `set_rows` writes into a destination that cannot be
//! converted (a KV cache), so the rows and ids follow it; a destination split by rows (a cache
//! split by slots) takes every row and id, and each device writes the rows its slots hold.
//!
//! | op | sources | output |
//! |---|---|---|
//! | `get_rows` | table Axis(0) or Partial, ids Mirrored | the table's state |
//! | `get_rows` | table Axis(1) (by rows), ids Mirrored | Partial (float tables) |
//! | `get_rows` | ids Axis(k < 3), table Mirrored (k = 0) or Axis(k + 1) alike | Axis(k + 1) |
//! | `set_rows` | dst Axis(0), rows alike, ids Mirrored | dst's state |
//! | `set_rows` | dst Axis(1) (by rows), rows and ids Mirrored | dst's state |
//! | `set_rows` | dst Axis(k >= 2), rows alike, ids Mirrored or alike | dst's state |
//! | both | every source Mirrored (`set_rows`: when dst is) | Mirrored |
//!
//! The rows a device holds are its window of the split (per segment); the meta rewrite gives
//! its local op that window (`op::RowWindow`).

use super::{Ctx, Pattern, moved, pat};
use crate::split_state::{SplitAxis, SplitState};

/// Row gathers and scatters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// `get_rows`: `[table, ids]`.
    Get,
    /// `set_rows`: `[dst, rows, ids]`.
    Set,
}

pub(super) fn rule(cx: &Ctx, src: &[SplitState], kind: Rows) -> Vec<Pattern> {
    match kind {
        Rows::Get => get_rows(cx, src),
        Rows::Set => set_rows(cx, src),
    }
}

fn get_rows(cx: &Ctx, src: &[SplitState]) -> Vec<Pattern> {
    let (st, si) = (&src[0], &src[1]);
    let mut out = Vec::new();
    if matches!(st.axis, SplitAxis::Axis(0) | SplitAxis::Partial) {
        out.push(pat(vec![st.clone(), cx.mirrored()], st.clone()));
    }
    // Split by rows: each device's lookup of the ids it holds, zeros elsewhere; their sum is
    // the lookup (partial sums are of float types: not for i32 tables).
    if st.axis == SplitAxis::Axis(1) && cx.dtype().is_float() {
        out.push(pat(vec![st.clone(), cx.mirrored()], cx.partial()));
    }
    if let Some(k) = si.split_dim().filter(|&k| k < 3) {
        // ids [n, e2, e3] split on k gives output split on k + 1.
        let table = if k == 0 {
            cx.mirrored()
        } else {
            moved(si, k + 1)
        };
        out.push(pat(vec![table, si.clone()], moved(si, k + 1)));
    }
    out.push(cx.all_mirrored());
    out
}

fn set_rows(cx: &Ctx, src: &[SplitState]) -> Vec<Pattern> {
    let sd = &src[0];
    let mut out = Vec::new();
    match sd.axis {
        SplitAxis::Mirrored => out.push(cx.all_mirrored()),
        // Features split: rows split alike, ids shared.
        SplitAxis::Axis(0) => {
            out.push(pat(vec![sd.clone(), sd.clone(), cx.mirrored()], sd.clone()))
        }
        // Rows (slots) split: every device sees every row and id, and writes those it holds.
        SplitAxis::Axis(1) => out.push(pat(
            vec![sd.clone(), cx.mirrored(), cx.mirrored()],
            sd.clone(),
        )),
        // Batch dimensions split: rows alike; ids too unless they broadcast along k.
        SplitAxis::Axis(k) if k >= 2 => {
            let k = k as usize;
            let ni = cx.ne(2);
            let ids = if ni[k - 1] == 1 {
                Some(cx.mirrored())
            } else if ni[k - 1] == cx.ne(1)[k] {
                Some(moved(sd, k - 1))
            } else {
                None
            };
            if let Some(ids) = ids {
                out.push(pat(vec![sd.clone(), sd.clone(), ids], sd.clone()));
            }
        }
        // Partial: no rule (a sum of destinations cannot take a write).
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::DType;
    use crate::graph::Graph;
    use crate::split_state::SplitState;

    #[test]
    fn get_rows_follows_the_table_or_the_ids() {
        let mut g = Graph::new();
        let table = f32_in(&mut g, "tok_embd", [8, 10, 1, 1]);
        let ids = g.input("tokens", DType::I32, [4, 1, 1, 1]).unwrap();
        let e = g.get_rows(table, ids).unwrap();
        g.set_name(e, "embd");
        keeps(&g, e, &[ax(0, &[2, 6]), m()], ax(0, &[2, 6]));
        keeps(&g, e, &[p(), m()], p());
        // Tokens split: each device looks up its own.
        keeps(&g, e, &[m(), ax(0, &[3, 1])], ax(1, &[3, 1]));
        admits(
            &g,
            e,
            &[ax(0, &[2, 6]), ax(0, &[3, 1])],
            &[
                pt(&[ax(0, &[2, 6]), m()], ax(0, &[2, 6])),
                pt(&[m(), ax(0, &[3, 1])], ax(1, &[3, 1])),
                pt(&[m(), m()], m()),
            ],
        );
        // A table split by rows (a vocabulary-split embedding): each device looks up the ids
        // it holds, a partial sum; even, uneven, zero and segmented extents alike.
        let segs = SplitState::segmented(1, &[vec![3, 0], vec![2, 5]]);
        for t in [ax(1, &[5, 5]), ax(1, &[9, 1]), ax(1, &[0, 10]), segs] {
            keeps(&g, e, &[t.clone(), m()], p());
            admits(
                &g,
                e,
                &[t.clone(), m()],
                &[pt(&[t.clone(), m()], p()), pt(&[m(), m()], m())],
            );
        }
        // With split ids too, no pattern takes both as they are.
        let msg = refuses(&g, e, &[ax(1, &[5, 5]), ax(0, &[2, 2])]);
        assert!(msg.contains("get_rows") && msg.contains("`embd`"), "{msg}");
        assert!(
            msg.contains("-> Partial"),
            "the row split's pattern is listed: {msg}"
        );
    }

    #[test]
    fn an_i32_table_split_by_rows_is_never_partial() {
        let mut g = Graph::new();
        let table = g.input("codes", DType::I32, [3, 10, 1, 1]).unwrap();
        let ids = g.input("tokens", DType::I32, [4, 1, 1, 1]).unwrap();
        let e = g.get_rows(table, ids).unwrap();
        let t = ax(1, &[4, 6]);
        admits(&g, e, &[t.clone(), m()], &[pt(&[m(), m()], m())]);
        refuses(&g, e, &[t, m()]);
    }

    #[test]
    fn set_rows_follows_its_destination_or_has_no_rule() {
        let mut g = Graph::new();
        // A cache [features 8, slots 6, heads 2] written with 3 rows per head.
        let cache = f32_in(&mut g, "k_cache", [8, 6, 2, 1]);
        let rows = f32_in(&mut g, "k_new", [8, 3, 2, 1]);
        let ids = g.input("slots", DType::I32, [3, 1, 1, 1]).unwrap();
        let w = g.set_rows(cache, rows, ids).unwrap();
        g.set_name(w, "k_cache_write");
        keeps(
            &g,
            w,
            &[ax(0, &[4, 4]), ax(0, &[4, 4]), m()],
            ax(0, &[4, 4]),
        );
        // Heads split: the ids broadcast over them, so they are shared.
        keeps(
            &g,
            w,
            &[ax(2, &[1, 1]), ax(2, &[1, 1]), m()],
            ax(2, &[1, 1]),
        );
        keeps(&g, w, &[m(), m(), m()], m());
        // Slots split (a cache split along its tokens): every row and id on every device,
        // each writing those its slots hold; uneven, zero and segmented extents alike.
        let segs = SplitState::segmented(1, &[vec![1, 2], vec![3, 0]]);
        for dst in [ax(1, &[3, 3]), ax(1, &[5, 1]), ax(1, &[0, 6]), segs] {
            keeps(&g, w, &[dst.clone(), m(), m()], dst.clone());
            // Split rows are gathered first: the only pattern wants them mirrored.
            admits(
                &g,
                w,
                &[dst.clone(), ax(1, &[2, 1]), m()],
                &[pt(&[dst.clone(), m(), m()], dst.clone())],
            );
            refuses(&g, w, &[dst, ax(1, &[2, 1]), m()]);
        }
        // The destination cannot be converted: a Partial one has no pattern at all.
        let src = [p(), m(), m()];
        admits(&g, w, &src, &[]);
        let msg = refuses(&g, w, &src);
        assert!(
            msg.contains("set_rows") && msg.contains("admits no split"),
            "{msg}"
        );
    }
}
