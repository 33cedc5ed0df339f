//! Copies and conversions: `cont` (to a packed tensor, casting), `cpy` (into any layout, same
//! element count, logical order), `concat`. Rows are converted through f32 unless source and
//! destination share a dtype, in which case bytes are copied.

use super::{read_row_f32, thread_scratch, unravel_row, write_row_f32};
use crate::cpu::view::{ComputeParams, TensorView};

/// Per-thread scratch bytes for kernels that convert whole rows: two rows of the widest operand.
pub fn row_scratch(src: &[TensorView], dst: &TensorView) -> usize {
    let ne0 = src
        .iter()
        .map(|s| s.ne[0])
        .chain([dst.ne[0]])
        .max()
        .unwrap_or(0);
    (2 * ne0 + 16) * 4
}

pub fn supports(src: &TensorView, dst: &TensorView) -> Result<(), String> {
    for (t, what) in [(src, "source"), (dst, "destination")] {
        if t.dtype.is_quantized() && !t.rows_contiguous() {
            return Err(format!("quantized {what} rows must be packed"));
        }
    }
    if (src.dtype.is_quantized() || dst.dtype.is_quantized()) && src.ne[0] != dst.ne[0] {
        return Err("a quantized copy must keep the row length".into());
    }
    Ok(())
}

/// Copy row `(i1, i2, i3)` of `src` into row `(j1, j2, j3)` of `dst`.
///
/// # Safety
/// Rows in range; this thread owns the destination row; `buf` holds `ne0` floats.
unsafe fn copy_row(
    src: &TensorView,
    (i1, i2, i3): (usize, usize, usize),
    dst: &TensorView,
    (j1, j2, j3): (usize, usize, usize),
    buf: &mut [f32],
) {
    // SAFETY: per the function's contract.
    unsafe {
        if src.dtype == dst.dtype && src.rows_contiguous() && dst.rows_contiguous() {
            let n = src.dtype.row_size(src.ne[0]);
            std::ptr::copy(src.row_ptr(i1, i2, i3), dst.row_ptr(j1, j2, j3), n);
        } else {
            read_row_f32(src, i1, i2, i3, buf);
            write_row_f32(dst, j1, j2, j3, buf);
        }
    }
}

pub fn cont(p: &ComputeParams, dst: &TensorView, src: &TensorView) {
    cpy(p, dst, src)
}

pub fn cpy(p: &ComputeParams, dst: &TensorView, src: &TensorView) {
    // SAFETY: row_scratch reserved two rows of max(ne0) floats for this thread.
    let buf = unsafe { thread_scratch(p, 2 * src.ne[0].max(dst.ne[0]) + 16) };
    if src.ne[0] == dst.ne[0] {
        // Row r of the source (in logical order) goes to row r of the destination.
        let buf = &mut buf[..src.ne[0]];
        for r in p.range(dst.nrows()) {
            // SAFETY: r < nrows of both (equal element counts and row lengths).
            unsafe {
                copy_row(
                    src,
                    unravel_row(r, &src.ne),
                    dst,
                    unravel_row(r, &dst.ne),
                    buf,
                )
            };
        }
        return;
    }
    // Different row lengths (plain types only): element k of src goes to element k of dst.
    // Split by destination rows so each thread owns its output bytes.
    let n0 = dst.ne[0];
    for r in p.range(dst.nrows()) {
        let (j1, j2, j3) = unravel_row(r, &dst.ne);
        for j0 in 0..n0 {
            let mut k = r * n0 + j0;
            let i0 = k % src.ne[0];
            k /= src.ne[0];
            let (i1, i2, i3) = unravel_row(k, &src.ne);
            // SAFETY: k < nelements, so the source index is in range; dst row owned.
            unsafe { dst.set_f32(j0, j1, j2, j3, src.get_f32(i0, i1, i2, i3)) };
        }
    }
}

pub fn concat(p: &ComputeParams, dst: &TensorView, a: &TensorView, b: &TensorView, dim: usize) {
    let ts = dst.dtype.type_size();
    for r in p.range(dst.nrows()) {
        let (i1, i2, i3) = unravel_row(r, &dst.ne);
        let mut idx = [0, i1, i2, i3];
        for i0 in 0..dst.ne[0] {
            idx[0] = i0;
            let (s, k) = if idx[dim] < a.ne[dim] {
                (a, idx)
            } else {
                let mut k = idx;
                k[dim] -= a.ne[dim];
                (b, k)
            };
            // SAFETY: k is inside the chosen source (dims other than `dim` are equal, and along
            // `dim` the index was shifted into range); this thread owns the destination row.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    s.ptr(k[0], k[1], k[2], k[3]),
                    dst.ptr(i0, i1, i2, i3),
                    ts,
                )
            };
        }
    }
}
