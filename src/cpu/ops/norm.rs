//! Row-wise kernels (reduce dimension 0): `rms_norm`, `norm`, `soft_max` with mask and scale,
//! `sum_rows`/`mean`, `sum_sqr_rows` and `rms_norm_sums` (an RMS norm from sums of squares
//! computed apart, over rows split by columns), `argmax`, `argsort`. Sums accumulate in f64 as ggml's CPU backend does for norms
//! (`ggml_float`), so long rows do not drift.

use super::{read_row_f32, thread_scratch, unravel_row, write_row_f32};
use crate::cpu::view::{ComputeParams, TensorView};

/// Run `f(row_in_f32, i1, i2, i3)` over this thread's rows of `dst`, with the input row of `a`
/// converted to f32 in scratch; with `write_back`, `f` leaves the output row in the same
/// buffer and it is written to `dst` (same shape as `a`); otherwise `f` writes `dst` itself.
fn for_rows(
    p: &ComputeParams,
    dst: &TensorView,
    a: &TensorView,
    write_back: bool,
    mut f: impl FnMut(&mut [f32], usize, usize, usize),
) {
    // SAFETY: the node's work_size reserved nth rows of max(ne0) floats.
    let buf = unsafe { thread_scratch(p, a.ne[0].max(dst.ne[0])) };
    let ne = a.ne;
    for r in p.range(a.nrows()) {
        let (i1, i2, i3) = unravel_row(r, &ne);
        let row = &mut buf[..a.ne[0]];
        // SAFETY: rows in range (r < nrows); this thread owns dst row (i1, i2, i3).
        unsafe { read_row_f32(a, i1, i2, i3, row) };
        f(row, i1, i2, i3);
        if write_back {
            // SAFETY: as above.
            unsafe { write_row_f32(dst, i1, i2, i3, row) };
        }
    }
}

pub fn rms_norm(p: &ComputeParams, dst: &TensorView, a: &TensorView, eps: f32) {
    for_rows(p, dst, a, true, |row, _, _, _| {
        let n = row.len().max(1) as f64;
        let ss: f64 = row.iter().map(|&x| (x as f64) * (x as f64)).sum();
        let s = (1.0 / (ss / n + eps as f64).sqrt()) as f32;
        row.iter_mut().for_each(|x| *x *= s);
    });
}

pub fn norm(p: &ComputeParams, dst: &TensorView, a: &TensorView, eps: f32) {
    for_rows(p, dst, a, true, |row, _, _, _| {
        let n = row.len().max(1) as f64;
        let mean = row.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = row.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        let s = 1.0 / (var + eps as f64).sqrt();
        row.iter_mut()
            .for_each(|x| *x = ((*x as f64 - mean) * s) as f32);
    });
}

pub fn soft_max(
    p: &ComputeParams,
    dst: &TensorView,
    a: &TensorView,
    mask: Option<&TensorView>,
    scale: f32,
) {
    for_rows(p, dst, a, true, |row, i1, i2, i3| {
        for (i0, x) in row.iter_mut().enumerate() {
            *x *= scale;
            if let Some(m) = mask {
                // SAFETY: the builder checked mask.ne1 >= ne1 and that dims 2, 3 broadcast.
                *x += unsafe { m.get_f32(i0, i1, i2 % m.ne[2], i3 % m.ne[3]) };
            }
        }
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            // Every position masked: no valid distribution; emit zeros rather than NaN.
            row.iter_mut().for_each(|x| *x = 0.0);
            return;
        }
        let mut sum = 0f64;
        for x in row.iter_mut() {
            *x = (*x - max).exp();
            sum += *x as f64;
        }
        let inv = (1.0 / sum) as f32;
        row.iter_mut().for_each(|x| *x *= inv);
    });
}

pub fn sum_rows(p: &ComputeParams, dst: &TensorView, a: &TensorView, mean: bool) {
    for_rows(p, dst, a, false, |row, i1, i2, i3| {
        let s: f64 = row.iter().map(|&x| x as f64).sum();
        let v = if mean { s / row.len() as f64 } else { s };
        // SAFETY: dst is [1, ne1, ne2, ne3]; this thread owns this row.
        unsafe { dst.set_f32(0, i1, i2, i3, v as f32) };
    });
}

/// The sum of squares of each row (accumulated in f64, as `rms_norm`'s), into f32 `[1, ne1,
/// ne2, ne3]`.
pub fn sum_sqr_rows(p: &ComputeParams, dst: &TensorView, a: &TensorView) {
    for_rows(p, dst, a, false, |row, i1, i2, i3| {
        let ss: f64 = row.iter().map(|&x| (x as f64) * (x as f64)).sum();
        // SAFETY: dst is [1, ne1, ne2, ne3]; this thread owns this row.
        unsafe { dst.set_f32(0, i1, i2, i3, ss as f32) };
    });
}

/// `x * w / sqrt(sums / width + eps)` row by row: `rms_norm`'s scale from the whole row's sum
/// of squares `sums` (`[1, ne1, ne2, ne3]`), applied to `x`'s elements, then the weight `w`
/// (`[ne0]`), in `rms_norm` then `mul`'s order.
pub fn rms_norm_sums(
    p: &ComputeParams,
    dst: &TensorView,
    src: &[TensorView],
    eps: f32,
    width: usize,
) {
    let (x, sums, w) = (&src[0], &src[1], &src[2]);
    if p.range(x.nrows()).is_empty() {
        return;
    }
    // The weight read once per thread, not per row and element.
    // SAFETY: the builder checked w is [ne0] and sums f32 [1, ne1, ne2, ne3].
    let wv: Vec<f32> = (0..w.ne[0])
        .map(|i0| unsafe { w.get_f32(i0, 0, 0, 0) })
        .collect();
    for_rows(p, dst, x, true, |row, i1, i2, i3| {
        // SAFETY: as above.
        let ss = unsafe { sums.get_f32(0, i1, i2, i3) } as f64;
        let s = (1.0 / (ss / width.max(1) as f64 + eps as f64).sqrt()) as f32;
        for (v, &wi) in row.iter_mut().zip(&wv) {
            *v = (*v * s) * wi;
        }
    });
}

pub fn argmax(p: &ComputeParams, dst: &TensorView, a: &TensorView) {
    for_rows(p, dst, a, false, |row, i1, _, _| {
        let mut best = 0usize;
        for (i, &x) in row.iter().enumerate() {
            if x > row[best] {
                best = i;
            }
        }
        // SAFETY: dst is I32 [ne1]; this thread owns element i1.
        unsafe {
            dst.ptr(i1, 0, 0, 0)
                .cast::<i32>()
                .write_unaligned(best as i32)
        };
    });
}

/// Each row's indices in sorted order into the packed I32 `dst` (ggml `argsort`): ascending or
/// descending by value, equal values by index (so the result is one permutation, whatever the
/// sort's algorithm).
pub fn argsort(p: &ComputeParams, dst: &TensorView, a: &TensorView, descending: bool) {
    for_rows(p, dst, a, false, |row, i1, i2, i3| {
        // SAFETY: dst is a packed I32 tensor of a's shape (built by `argsort`); this thread
        // owns row (i1, i2, i3), whose ne0 elements are adjacent.
        let out = unsafe {
            std::slice::from_raw_parts_mut(dst.row_ptr(i1, i2, i3).cast::<i32>(), row.len())
        };
        for (i, o) in out.iter_mut().enumerate() {
            *o = i as i32;
        }
        out.sort_unstable_by(|&i, &j| {
            let (x, y) = (row[i as usize], row[j as usize]);
            let by_value = if descending {
                y.total_cmp(&x)
            } else {
                x.total_cmp(&y)
            };
            by_value.then(i.cmp(&j))
        });
    });
}
