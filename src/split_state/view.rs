//! Split states of views. Every view (reshape, permute, view with strides and offset) is
//! described against its root, which is packed; the root's split dimension k (stride `S_k`,
//! `E` units) is matched with the view's dimensions by their strides:
//!
//! - view dims with stride below `S_k` whose span stays below it are *inner*: unchanged locally;
//! - view dims with stride in `[S_k, S_k*E)` are *inside* k: they must nest contiguously
//!   (strides `S_k`, `S_k*f1`, ...) and the outermost one carries the split, extents divided by
//!   its factor (a reshape that splits the dimension, or the head axis of a KV-cache view);
//! - a view dim starting below `S_k` whose span ends exactly at `S_k*E` *merges* k with inner
//!   dims (a reshape that folds heads into features): extents are multiplied;
//! - view dims with stride a multiple of `S_k*E` are *outer*: their local stride is scaled to
//!   the device's local size.
//!
//! The view may cover dimension k fully, or exactly one segment of a segmented split (how Q, K
//! and V are cut out of a fused projection). Anything else (a single coordinate of k, a partial
//! range, interleaved strides) is not representable and the caller gathers the root first.

use super::SplitState;
use crate::tensor::{Layout, contiguous_strides};

/// Per-device layout of a view: shape, strides, and byte offset into the device's local root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalView {
    pub ne: [usize; 4],
    pub nb: [usize; 4],
    pub offset: usize,
}

/// The view's split state and its per-device layouts.
#[derive(Clone, Debug)]
pub struct ViewSplit {
    pub state: SplitState,
    pub local: Vec<LocalView>,
}

/// Derive the split of a view `(view, offs)` of a packed root `root` with state `rs`.
/// `None` if the view cannot be expressed per device (gather the root, then view it).
pub fn derive_view(
    root: &Layout,
    rs: &SplitState,
    view: &Layout,
    offs: usize,
) -> Option<ViewSplit> {
    let n = rs.n_devices();
    // An expert-group split is cut on two axes, differently per group: no view of it is one
    // per device.
    if rs.is_grouped() {
        return None;
    }
    let Some(k) = rs.split_dim() else {
        // Mirrored and Partial views are the same view on every device. A view of a Routed
        // value is Partial: its rows are no longer the rows the ids route.
        let lv = LocalView {
            ne: view.ne,
            nb: view.nb,
            offset: offs,
        };
        let state = if rs.is_routed() {
            SplitState::partial(n)
        } else {
            rs.clone()
        };
        return Some(ViewSplit {
            state,
            local: vec![lv; n],
        });
    };
    if root.dtype.is_quantized() && k == 0 {
        return None;
    }
    let s = contiguous_strides(root.dtype, root.ne);
    let sk = s[k];
    let e = root.ne[k];
    let sk1 = sk * e; // stride of the dim above k
    if e == 0 || view.nelements() == 0 {
        return None;
    }
    // Decompose the offset: outer part, coordinate along k, inner part.
    let (o_outer, o_k, o_inner) = (offs / sk1, (offs % sk1) / sk, offs % sk);

    let mut inside: Vec<(usize, usize)> = Vec::new(); // (view dim, factor)
    let mut merge: Option<usize> = None;
    for j in 0..4 {
        if view.ne[j] <= 1 {
            continue;
        }
        let st = view.nb[j];
        let span_end = st * view.ne[j];
        if st < sk {
            if span_end <= sk {
                continue; // inner
            }
            // Merges k with inner dims: must cover from its start through the whole of k.
            if span_end != sk1
                || o_inner != 0
                || o_k != 0
                || merge.is_some()
                || !sk.is_multiple_of(st)
            {
                return None;
            }
            merge = Some(j);
        } else if st < sk1 {
            if !st.is_multiple_of(sk) {
                return None;
            }
            inside.push((j, st / sk));
        } else if !st.is_multiple_of(sk1) {
            return None;
        }
    }

    // The range of k the view covers, and the split dim with its factor.
    let (jd, extents_of): (usize, Box<dyn Fn(usize) -> Option<usize>>) = if let Some(j) = merge {
        if !inside.is_empty() {
            return None;
        }
        let mul = sk / view.nb[j];
        (j, Box::new(move |x| Some(x * mul)))
    } else {
        inside.sort_by_key(|&(_, f)| f);
        // Contiguous nesting from factor 1.
        let mut expect = 1;
        for &(j, f) in &inside {
            if f != expect {
                return None;
            }
            expect = f * view.ne[j];
        }
        let &(j, f) = inside.last()?;
        let covered = f * view.ne[j];
        // Full range or exactly one segment.
        let seg = if o_k == 0 && covered == e {
            None
        } else {
            let s = (0..rs.n_segments())
                .find(|&s| rs.segment_start(s) == o_k && rs.segment_size(s) == covered)?;
            Some(s)
        };
        let state = match seg {
            None => rs.clone(),
            Some(s) => SplitState::axis(k, &(0..n).map(|d| rs.extent(s, d)).collect::<Vec<_>>()),
        };
        // Every extent must be whole units of the factor.
        let state = state.rescaled(j, 1, f)?;
        let local = (0..n)
            .map(|d| {
                local_view(
                    root,
                    rs,
                    view,
                    (o_outer, o_k, o_inner),
                    k,
                    seg,
                    d,
                    j,
                    state.local_extent(d),
                )
            })
            .collect();
        return Some(ViewSplit { state, local });
    };
    let state = rs.rescaled(jd, extents_of(1)?, 1)?;
    let local = (0..n)
        .map(|d| {
            local_view(
                root,
                rs,
                view,
                (o_outer, o_k, o_inner),
                k,
                None,
                d,
                jd,
                state.local_extent(d),
            )
        })
        .collect();
    Some(ViewSplit { state, local })
}

/// Device `d`'s layout of the view: the split view dim gets the local extent, outer strides and
/// the outer part of the offset scale with the local size of dimension k.
#[allow(clippy::too_many_arguments)]
fn local_view(
    root: &Layout,
    rs: &SplitState,
    view: &Layout,
    (o_outer, o_k, o_inner): (usize, usize, usize),
    k: usize,
    seg: Option<usize>,
    d: usize,
    jd: usize,
    local_extent: usize,
) -> LocalView {
    let s = contiguous_strides(root.dtype, root.ne);
    let sk1 = s[k] * root.ne[k];
    let local_k = rs.local_extent(d);
    let sk1_local = s[k] * local_k;
    let mut ne = view.ne;
    let mut nb = view.nb;
    ne[jd] = local_extent;
    for st in nb.iter_mut() {
        if *st >= sk1 {
            *st = *st / sk1 * sk1_local;
        }
    }
    let k_local = match seg {
        Some(sg) => rs.local_start(sg, d),
        None => {
            debug_assert_eq!(o_k, 0);
            0
        }
    };
    LocalView {
        ne,
        nb,
        offset: o_outer * sk1_local + k_local * s[k] + o_inner,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn lay(ne: [usize; 4]) -> Layout {
        Layout::contiguous(DType::F32, ne)
    }

    #[test]
    fn permute_moves_the_axis() {
        let root = lay([8, 6, 4, 1]);
        let rs = SplitState::axis(1, &[4, 2]);
        let v = root.permute([0, 2, 1, 3]).unwrap(); // [8, 4, 6]
        let vs = derive_view(&root, &rs, &v, 0).unwrap();
        assert_eq!(vs.state, SplitState::axis(2, &[4, 2]));
        // Device 1 holds [8, 2, 4] packed: strides 4, 32, 64.
        assert_eq!(vs.local[1].ne, [8, 4, 2, 1]);
        assert_eq!(vs.local[1].nb, [4, 64, 32, 256]);
    }

    #[test]
    fn kv_cache_head_view() {
        // Cache [192 = 3 heads x 64, kv 100] split by whole heads [128, 64]; view the first 10
        // positions as [64, 10, 3] (head_dim, n_kv, heads).
        let root = lay([192, 100, 1, 1]);
        let rs = SplitState::axis(0, &[128, 64]);
        let v = Layout {
            dtype: DType::F32,
            ne: [64, 10, 3, 1],
            nb: [4, 192 * 4, 64 * 4, 192 * 4 * 100],
        };
        let vs = derive_view(&root, &rs, &v, 0).unwrap();
        assert_eq!(vs.state, SplitState::axis(2, &[2, 1]));
        assert_eq!(vs.local[0].ne, [64, 10, 2, 1]);
        assert_eq!(vs.local[0].nb[1], 128 * 4);
        assert_eq!(vs.local[1].nb[1], 64 * 4);
        // Viewing from position 5 scales the offset with the local row size.
        let vs = derive_view(&root, &rs, &v, 5 * 192 * 4).unwrap();
        assert_eq!(vs.local[1].offset, 5 * 64 * 4);
    }

    #[test]
    fn reshape_merges_and_splits_the_axis() {
        // [64, 9, T] split by heads [5, 4] reshaped to [576, T]: extents x 64.
        let root = lay([64, 9, 7, 1]);
        let rs = SplitState::axis(1, &[5, 4]);
        let v = lay([576, 7, 1, 1]);
        let vs = derive_view(&root, &rs, &v, 0).unwrap();
        assert_eq!(vs.state, SplitState::axis(0, &[320, 256]));
        assert_eq!(vs.local[1].ne, [256, 7, 1, 1]);
        assert_eq!(vs.local[1].nb, [4, 256 * 4, 256 * 4 * 7, 256 * 4 * 7]);
        // And back: [576, T] split [320, 256] to [64, 9, T].
        let vs = derive_view(&v, &SplitState::axis(0, &[320, 256]), &root, 0).unwrap();
        assert_eq!(vs.state, rs);
        // Not whole heads: not representable.
        assert!(derive_view(&v, &SplitState::axis(0, &[300, 276]), &root, 0).is_none());
    }

    #[test]
    fn segment_views_pick_each_devices_share() {
        // Fused QKV output [960 = 576 q + 192 k + 192 v, T] split per segment over 2 devices.
        let rs = SplitState::segmented(0, &[vec![320, 256], vec![128, 64], vec![128, 64]]);
        let root = lay([960, 5, 1, 1]);
        // The K segment: [192, T] at offset 576 floats.
        let v = Layout {
            dtype: DType::F32,
            ne: [192, 5, 1, 1],
            nb: [4, 960 * 4, 960 * 4 * 5, 960 * 4 * 5],
        };
        let vs = derive_view(&root, &rs, &v, 576 * 4).unwrap();
        assert_eq!(vs.state, SplitState::axis(0, &[128, 64]));
        // Device 0's local root is [320 + 128 + 128 = 576, T], device 1's [256 + 64 + 64, T].
        assert_eq!(vs.local[0].offset, 320 * 4);
        assert_eq!(vs.local[0].nb[1], 576 * 4);
        assert_eq!(vs.local[1].offset, 256 * 4);
        assert_eq!(vs.local[1].nb[1], (256 + 64 + 64) * 4);
        // A range that is not a segment is not representable.
        assert!(derive_view(&root, &rs, &v, 100 * 4).is_none());
    }

    #[test]
    fn single_coordinate_and_partial_ranges_need_a_gather() {
        let root = lay([8, 6, 1, 1]);
        let rs = SplitState::axis(1, &[3, 3]);
        // Row 2 only.
        let v = Layout {
            dtype: DType::F32,
            ne: [8, 1, 1, 1],
            nb: [4, 32, 32, 32],
        };
        assert!(derive_view(&root, &rs, &v, 2 * 32).is_none());
        // Rows 0..4 only.
        let v = lay([8, 4, 1, 1]);
        assert!(derive_view(&root, &rs, &v, 0).is_none());
        // Mirrored roots: the same view everywhere.
        let vs = derive_view(&root, &SplitState::mirrored(2), &v, 32).unwrap();
        assert!(vs.state.is_mirrored() && vs.local[1].offset == 32);
    }
}
