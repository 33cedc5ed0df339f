//! Row gathers and scatters: `get_rows` (table rows of any dtype picked by I32 ids, to f32)
//! and `set_rows` (f32 rows written into f32/f16/bf16 rows picked by ids, e.g. a KV cache).
//! An id outside the table is reported as [`KernelError::RowId`] before anything is read or
//! written with it; the thread's remaining rows are skipped.

use super::{KernelError, read_row_f32, thread_scratch, write_row_f32};
use crate::DType;
use crate::cpu::view::{ComputeParams, TensorView};

#[inline]
fn id_at(ids: &TensorView, i0: usize, i1: usize, i2: usize) -> i64 {
    // SAFETY: callers index within ids' extents (checked by the graph builder's shape rules).
    unsafe { ids.ptr(i0, i1, i2, 0).cast::<i32>().read_unaligned() as i64 }
}

/// The row named by `ids[at]`, if it is one of `rows`.
fn checked_row(ids: &TensorView, at: [usize; 3], rows: usize) -> Result<usize, KernelError> {
    let id = id_at(ids, at[0], at[1], at[2]);
    if id < 0 || id as usize >= rows {
        return Err(KernelError::RowId { id, at, rows });
    }
    Ok(id as usize)
}

/// `dst [ne0, n, e2, e3] = table[:, ids[i, e2, e3], e2, e3]`.
pub fn get_rows(
    p: &ComputeParams,
    dst: &TensorView,
    table: &TensorView,
    ids: &TensorView,
) -> Result<(), KernelError> {
    let [_, n, e2, _] = dst.ne;
    // SAFETY: row_scratch reserved at least ne0 floats per thread.
    let buf = unsafe { thread_scratch(p, dst.ne[0]) };
    for r in p.range(dst.nrows()) {
        let (i, j2, j3) = (r % n, (r / n) % e2, r / (n * e2));
        let row = checked_row(ids, [i, j2, j3], table.ne[1])?;
        // SAFETY: row < table.ne1, j2 < table.ne2, j3 < table.ne3 (builder); dst row owned.
        unsafe {
            if dst.dtype == DType::I32 {
                for i0 in 0..dst.ne[0] {
                    let v = table.ptr(i0, row, j2, j3).cast::<i32>().read_unaligned();
                    dst.ptr(i0, i, j2, j3).cast::<i32>().write_unaligned(v);
                }
            } else {
                read_row_f32(table, row, j2, j3, buf);
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
) -> Result<(), KernelError> {
    let [_, n, d2, _] = rows.ne;
    // SAFETY: row_scratch reserved at least ne0 floats per thread.
    let buf = unsafe { thread_scratch(p, rows.ne[0]) };
    for r in p.range(rows.nrows()) {
        let (i, j2, j3) = (r % n, (r / n) % d2, r / (n * d2));
        let row = checked_row(ids, [i, j2 % ids.ne[1], j3 % ids.ne[2]], dst.ne[1])?;
        // SAFETY: indices in range (builder + check above); distinct ids give disjoint rows.
        unsafe {
            read_row_f32(rows, i, j2, j3, buf);
            write_row_f32(dst, row, j2, j3, buf);
        }
    }
    Ok(())
}
