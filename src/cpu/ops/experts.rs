//! `mul_mat_id` (ggml's expert product, ggml.c `ggml_mul_mat_id` / ggml-cpu's
//! `ggml_compute_forward_mul_mat_id`): `out[:, e, t] = as[:, :, ids[e, t]] · b[:, e % n_b, t]`.
//!
//! The step's rows are grouped by expert, so each selected expert's weights stream once per
//! node however many tokens chose it: thread 0 counts the rows per expert and lists them in
//! expert order in the shared scratch; all threads gather the activation rows into one packed
//! f32 matrix in that order; then for every expert with rows, the dense `mul_mat` kernels
//! (`cpu::matmul`, every weight type and path they have) multiply that expert's slice of the
//! weights by its rows, on all threads; last, the rows are scattered to their `(e, t)` places.
//! A decoding step (one token, one activation row, each expert chosen once) skips the gather:
//! the kernels read the row in place; threads wait for each other between experts only where
//! the dense kernels use shared scratch (not the fused paths at f32 activations). Measured
//! (Q4_K, 2 of 8 experts of [4096, 2048], one token, cpu:1x1, a loaded machine): 1.66 ms
//! against 1.63 ms for `mul_mat` over the same bytes. Under `--q8` each expert's product
//! takes the dense rows rule (`matmul::node_precision`) for its own row count.
//!
//! With a window (one device's share of experts split whole: `op::RowWindow`), the weights
//! hold only the window's experts; the rows of ids outside it are grouped last, as if under one
//! more expert, and written as zeros.
//!
//! Shared scratch, in order (each part 64-byte aligned): the per-expert row offsets (u32,
//! `n_expert + 2`: the last group is the rows of ids outside the window), the rows in expert
//! order (u32 `e + n_used * t`), the gathered activations (f32 `[K, rows]`), the products (f32
//! `[N, rows]`), and the dense kernels' own scratch (the most any expert's share can need).

use super::KernelError;
use crate::DType;
use crate::cpu::matmul;
use crate::cpu::view::{ComputeParams, Precision, TensorView, split_range};
use crate::op::RowWindow;

const ALIGN: usize = 64;

fn align(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Byte offsets of the parts of the shared scratch.
struct Parts {
    order: usize,
    xs: usize,
    ys: usize,
    mm: usize,
    end: usize,
}

/// The shape of one node: `k`, `n`, experts, ids per token, activation rows per token, tokens.
#[derive(Clone, Copy)]
struct Dims {
    k: usize,
    n: usize,
    n_expert: usize,
    n_used: usize,
    n_b: usize,
    n_tokens: usize,
}

impl Dims {
    fn of(experts: &TensorView, b: &TensorView, ids: &TensorView) -> Dims {
        Dims {
            k: experts.ne[0],
            n: experts.ne[1],
            n_expert: experts.ne[2],
            n_used: ids.ne[0],
            n_b: b.ne[1],
            n_tokens: ids.ne[1],
        }
    }

    fn rows(&self) -> usize {
        self.n_used * self.n_tokens
    }

    fn parts(&self, mm: usize) -> Parts {
        let order = align((self.n_expert + 2) * 4);
        let xs = order + align(self.rows() * 4);
        let ys = xs + align(self.rows() * self.k * 4);
        let mm_at = ys + align(self.rows() * self.n * 4);
        Parts {
            order,
            xs,
            ys,
            mm: mm_at,
            end: mm_at + mm,
        }
    }
}

/// Expert `e`'s weights `[K, N, 1, 1]`.
fn expert_view(experts: &TensorView, e: usize) -> TensorView {
    TensorView {
        // Pointer arithmetic only; e < n_expert keeps it inside the tensor.
        data: experts.data.wrapping_add(e * experts.nb[2]),
        dtype: experts.dtype,
        ne: [experts.ne[0], experts.ne[1], 1, 1],
        nb: experts.nb,
    }
}

/// A packed f32 matrix `[cols, rows]` at `data`.
fn packed_f32(data: *mut u8, cols: usize, rows: usize) -> TensorView {
    let nb1 = cols * 4;
    TensorView {
        data,
        dtype: DType::F32,
        ne: [cols, rows, 1, 1],
        nb: [4, nb1, nb1 * rows, nb1 * rows],
    }
}

/// Whether the CPU runs these operands: the dense kernels take an expert's slice of the weights,
/// `b` is f32, the output packed f32.
pub fn supports(src: &[TensorView], dst: &TensorView) -> Result<(), String> {
    let (experts, b, ids) = (&src[0], &src[1], &src[2]);
    if ids.dtype != DType::I32 || b.dtype != DType::F32 {
        return Err("mul_mat_id takes f32 activations and I32 ids".into());
    }
    if !dst.is_contiguous() || dst.dtype != DType::F32 {
        return Err("the output of mul_mat_id must be packed f32".into());
    }
    let w = expert_view(experts, 0);
    let x = packed_f32(std::ptr::null_mut(), b.ne[0], 1);
    let y = packed_f32(std::ptr::null_mut(), experts.ne[1], 1);
    matmul::supports(&w, &x, &y)
}

/// Shared scratch bytes for `nth` threads.
pub fn work_size(src: &[TensorView], nth: usize, precision: Precision) -> usize {
    let d = Dims::of(&src[0], &src[1], &src[2]);
    d.parts(mm_size(&src[0], &d, nth, precision)).end
}

/// The most scratch the dense kernels need for one expert's rows (any count up to all rows).
fn mm_size(experts: &TensorView, d: &Dims, nth: usize, precision: Precision) -> usize {
    let w = expert_view(experts, 0);
    (1..=d.rows())
        .map(|m| {
            let x = packed_f32(std::ptr::null_mut(), d.k, m);
            let y = packed_f32(std::ptr::null_mut(), d.n, m);
            matmul::work_size(&w, &x, &y, nth, expert_precision(&w, &x, precision))
        })
        .max()
        .unwrap_or(0)
}

/// The precision of one expert's product of `x`'s rows: the device's, but f32 activations
/// where 8-bit ones would be slower for that many rows (`matmul::node_precision`, the rule
/// the CPU backend applies to dense products; here the rows per expert are known only when
/// the step runs).
fn expert_precision(w: &TensorView, x: &TensorView, precision: Precision) -> Precision {
    matmul::node_precision(w, x, precision, matmul::Isa::detect())
}

/// The local expert of the id at `ids[e, t]` (the window's `n_local` for an id outside it),
/// the id checked against every expert (`w.rows`).
fn id_at(ids: &TensorView, e: usize, t: usize, w: &RowWindow) -> Result<usize, KernelError> {
    // SAFETY: e < ids.ne0 and t < ids.ne1 (callers loop within them); I32 elements.
    let id = unsafe { ids.ptr(e, t, 0, 0).cast::<i32>().read_unaligned() } as i64;
    if id < 0 || id as u64 >= w.rows as u64 {
        return Err(KernelError::RowId {
            id,
            at: [e, t, 0],
            rows: w.rows,
        });
    }
    let id = id as usize;
    Ok(if (w.lo..w.hi).contains(&id) {
        w.at + id - w.lo
    } else {
        // The group after the last local expert.
        usize::MAX
    })
}

/// Run the node on thread `p.ith` of `p.nth`, with the experts `window` holds (`None`: all).
/// Every thread checks every id first, so an id outside the experts returns the same error
/// from all threads before any barrier.
pub fn mul_mat_id(
    p: &ComputeParams,
    dst: &TensorView,
    src: &[TensorView],
    window: Option<RowWindow>,
) -> Result<(), KernelError> {
    let (experts, b, ids) = (&src[0], &src[1], &src[2]);
    let d = Dims::of(experts, b, ids);
    let w = window.unwrap_or(RowWindow::whole(d.n_expert));
    for t in 0..d.n_tokens {
        for e in 0..d.n_used {
            id_at(ids, e, t, &w)?;
        }
    }
    if d.rows() == 0 || d.n == 0 {
        return Ok(());
    }
    // The dense kernels' scratch is the rest of the node's (`work_size` sized it); they check
    // that it is enough.
    let parts = d.parts(0);
    assert!(
        p.wsize >= parts.end && !p.wdata.is_null(),
        "mul_mat_id: scratch of {} bytes is too small, {} needed",
        p.wsize,
        parts.end
    );
    // SAFETY: the shared scratch holds `parts.end` bytes (checked above), 64-byte aligned; the
    // offsets and order lists are written by thread 0 only, read after the barrier.
    let (offsets, order) = unsafe {
        (
            std::slice::from_raw_parts_mut(p.wdata.cast::<u32>(), d.n_expert + 2),
            std::slice::from_raw_parts_mut(p.wdata.add(parts.order).cast::<u32>(), d.rows()),
        )
    };
    if p.ith == 0 {
        group_by_expert(ids, &d, &w, offsets, order)?;
    }
    p.barrier();
    // SAFETY: in the scratch; parts are disjoint.
    let (xs, ys, mm) = unsafe {
        (
            p.wdata.add(parts.xs),
            p.wdata.add(parts.ys),
            p.wdata.add(parts.mm),
        )
    };
    // One token whose experts all read its one packed activation row, each expert once (a
    // decoding step): the kernels read that row in place; otherwise the rows are gathered.
    let direct = d.n_tokens == 1
        && d.n_b == 1
        && b.nb[0] == 4
        && offsets[..=d.n_expert].windows(2).all(|o| o[1] - o[0] <= 1);
    if !direct {
        // The rows of ids outside the window are not multiplied.
        gather(p, b, &d, &order[..offsets[d.n_expert] as usize], xs);
        p.barrier();
    }
    // One counter cannot serve several products: each expert's items are split by thread.
    let sub = ComputeParams {
        wdata: mm,
        wsize: p.wsize - parts.mm,
        items: None,
        ..*p
    };
    for e in 0..d.n_expert {
        let (lo, hi) = (offsets[e] as usize, offsets[e + 1] as usize);
        if lo == hi {
            continue;
        }
        let w = expert_view(experts, e);
        let x = if direct {
            // SAFETY: row (0, 0) of b exists (one token, one row) and is packed f32.
            packed_f32(unsafe { b.row_ptr(0, 0, 0) }, d.k, 1)
        } else {
            packed_f32(xs.wrapping_add(lo * d.k * 4), d.k, hi - lo)
        };
        let y = packed_f32(ys.wrapping_add(lo * d.n * 4), d.n, hi - lo);
        let sub = ComputeParams {
            precision: expert_precision(&w, &x, p.precision),
            ..sub
        };
        matmul::forward(&sub, &w, &x, &y);
        // The next expert's kernels reuse the dense kernels' shared scratch, if they have one
        // (the fused paths at f32 activations have none: no barrier).
        if matmul::work_size(&w, &x, &y, p.nth, sub.precision) > 0 {
            p.barrier();
        }
    }
    // Every thread wrote part of every expert's products.
    p.barrier();
    scatter(p, dst, &d, order, ys, offsets[d.n_expert] as usize);
    Ok(())
}

/// Rows `e + n_used * t` in local expert order (the rows of ids outside the window last), and
/// each group's first row in that order.
fn group_by_expert(
    ids: &TensorView,
    d: &Dims,
    w: &RowWindow,
    offsets: &mut [u32],
    order: &mut [u32],
) -> Result<(), KernelError> {
    let group = |e: usize, t: usize| id_at(ids, e, t, w).map(|x| x.min(d.n_expert));
    offsets.fill(0);
    for t in 0..d.n_tokens {
        for e in 0..d.n_used {
            offsets[group(e, t)? + 1] += 1;
        }
    }
    for x in 1..offsets.len() {
        offsets[x] += offsets[x - 1];
    }
    // Fill each expert's rows, moving its offset; then shift the offsets back.
    for t in 0..d.n_tokens {
        for e in 0..d.n_used {
            let x = group(e, t)?;
            order[offsets[x] as usize] = (e + d.n_used * t) as u32;
            offsets[x] += 1;
        }
    }
    for x in (1..offsets.len()).rev() {
        offsets[x] = offsets[x - 1];
    }
    offsets[0] = 0;
    Ok(())
}

/// This thread's rows of the packed activations in expert order: row `j` is
/// `b[:, e % n_b, t]` for `order[j] = e + n_used * t`.
fn gather(p: &ComputeParams, b: &TensorView, d: &Dims, order: &[u32], xs: *mut u8) {
    for j in split_range(order.len(), p.ith, p.nth) {
        let r = order[j] as usize;
        let (e, t) = (r % d.n_used, r / d.n_used);
        // SAFETY: row j of xs is this thread's (split_range partitions 0..rows); b's row
        // (e % n_b, t) is in range (the builder checked n_used % n_b and the token counts).
        unsafe {
            let out = std::slice::from_raw_parts_mut(xs.cast::<f32>().add(j * d.k), d.k);
            super::read_row_f32(b, e % d.n_b, t, 0, out);
        }
    }
}

/// This thread's rows of the output: product row `j` to `dst[:, e, t]`, zeros for the rows
/// from `outside` on (ids outside the window).
fn scatter(
    p: &ComputeParams,
    dst: &TensorView,
    d: &Dims,
    order: &[u32],
    ys: *mut u8,
    outside: usize,
) {
    for j in split_range(d.rows(), p.ith, p.nth) {
        let r = order[j] as usize;
        let (e, t) = (r % d.n_used, r / d.n_used);
        // SAFETY: dst is packed f32 [N, n_used, n_tokens]; row (e, t) is written by the one
        // thread that owns j; product row j (before `outside`) is in the scratch.
        unsafe {
            let to = dst.row_ptr(e, t, 0).cast::<f32>();
            if j < outside {
                std::ptr::copy_nonoverlapping(ys.cast::<f32>().add(j * d.n), to, d.n);
            } else {
                std::ptr::write_bytes(to, 0, d.n);
            }
        }
    }
}
