//! The rules of row gathers and scatters. `get_rows` keeps a table split by features (or
//! Partial: picking rows is linear), or splits its output like the ids (with the table split
//! alike along the batch dimensions it shares with them). `set_rows` writes into a destination
//! that cannot be converted (a KV cache), so the rows and ids follow it.

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
        // The rows dimension itself, or Partial: no rule.
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::DType;
    use crate::graph::Graph;

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
        // A table split by rows would need each device to own the ids it holds.
        let msg = refuses(&g, e, &[ax(1, &[5, 5]), m()]);
        assert!(msg.contains("get_rows") && msg.contains("`embd`"), "{msg}");
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
        // The destination cannot be converted: a split of its rows or a Partial one has no
        // pattern at all.
        for dst in [ax(1, &[3, 3]), p()] {
            let src = [dst.clone(), m(), m()];
            admits(&g, w, &src, &[]);
            let msg = refuses(&g, w, &src);
            assert!(
                msg.contains("set_rows") && msg.contains("admits no split"),
                "{msg}"
            );
        }
    }
}
