//! Row gathers and scatters: `get_rows` (table rows of any dtype picked by I32 ids, to f32)
//! and `set_rows` (f32 rows written into f32/f16/bf16 rows picked by ids, e.g. a KV cache).
//! An id outside the table is reported as [`KernelError::RowId`] before anything is read or
//! written with it; the thread's remaining rows are skipped.
//!
//! With a [`RowWindow`] (one device's share of a table or destination split by rows), the
//! operand holds only the window's rows: an id the window holds is read or written at its local
//! row, any other valid id gives a row of zeros (`get_rows`) or is skipped (`set_rows`), and
//! validity is checked against the whole tensor's rows.

use super::{KernelError, read_row_f32, thread_scratch, write_row_f32};
use crate::DType;
use crate::cpu::view::{ComputeParams, TensorView};
use crate::op::RowWindow;

#[inline]
fn id_at(ids: &TensorView, i0: usize, i1: usize, i2: usize) -> i64 {
    // SAFETY: callers index within ids' extents (checked by the graph builder's shape rules).
    unsafe { ids.ptr(i0, i1, i2, 0).cast::<i32>().read_unaligned() as i64 }
}

/// The local row named by `ids[at]`: `Some` if the operand (of `rows` rows) holds it, `None`
/// if the window leaves it to another device, an error if it is no row of the whole tensor.
fn local_row(
    ids: &TensorView,
    at: [usize; 3],
    rows: usize,
    window: Option<RowWindow>,
) -> Result<Option<usize>, KernelError> {
    let id = id_at(ids, at[0], at[1], at[2]);
    let w = window.unwrap_or(RowWindow::whole(rows));
    if !w.valid(id) {
        return Err(KernelError::RowId {
            id,
            at,
            rows: w.rows,
        });
    }
    Ok(w.local_row(id as usize))
}

/// `dst [ne0, n, e2, e3] = table[:, ids[i, e2, e3], e2, e3]`.
pub fn get_rows(
    p: &ComputeParams,
    dst: &TensorView,
    table: &TensorView,
    ids: &TensorView,
    window: Option<RowWindow>,
) -> Result<(), KernelError> {
    let [_, n, e2, _] = dst.ne;
    // SAFETY: row_scratch reserved at least ne0 floats per thread.
    let buf = unsafe { thread_scratch(p, dst.ne[0]) };
    for r in p.range(dst.nrows()) {
        let (i, j2, j3) = (r % n, (r / n) % e2, r / (n * e2));
        let row = local_row(ids, [i, j2, j3], table.ne[1], window)?;
        // SAFETY: row < table.ne1 (the builder keeps a window's rows within the table),
        // j2 < table.ne2, j3 < table.ne3 (builder); dst row owned.
        unsafe {
            if dst.dtype == DType::I32 {
                for i0 in 0..dst.ne[0] {
                    let v = match row {
                        Some(row) => table.ptr(i0, row, j2, j3).cast::<i32>().read_unaligned(),
                        None => 0,
                    };
                    dst.ptr(i0, i, j2, j3).cast::<i32>().write_unaligned(v);
                }
            } else {
                match row {
                    Some(row) => read_row_f32(table, row, j2, j3, buf),
                    None => buf.fill(0.0),
                }
                write_row_f32(dst, i, j2, j3, buf);
            }
        }
    }
    Ok(())
}

/// `dst[:, ids[i, j2 % e2, j3 % e3], j2, j3] = rows[:, i, j2, j3]`. Work is split by source
/// rows; two source rows naming the same destination row write the same bytes (last wins, as
/// in ggml), which is the caller's mistake to avoid.
pub fn set_rows(
    p: &ComputeParams,
    dst: &TensorView,
    rows: &TensorView,
    ids: &TensorView,
    window: Option<RowWindow>,
) -> Result<(), KernelError> {
    let [_, n, d2, _] = rows.ne;
    // SAFETY: row_scratch reserved at least ne0 floats per thread.
    let buf = unsafe { thread_scratch(p, rows.ne[0]) };
    for r in p.range(rows.nrows()) {
        let (i, j2, j3) = (r % n, (r / n) % d2, r / (n * d2));
        let at = [i, j2 % ids.ne[1], j3 % ids.ne[2]];
        let Some(row) = local_row(ids, at, dst.ne[1], window)? else {
            continue;
        };
        // SAFETY: indices in range (builder + check above); distinct ids give disjoint rows.
        unsafe {
            read_row_f32(rows, i, j2, j3, buf);
            write_row_f32(dst, row, j2, j3, buf);
        }
    }
    Ok(())
}
