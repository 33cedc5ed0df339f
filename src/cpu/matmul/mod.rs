//! PLACEHOLDER until the tuned kernels land: a correct, slow `mul_mat` (rows dequantized to
//! f32, scalar dots) with the kernel contract the executor uses.

use crate::DType;
use crate::cpu::ops_support::read_row_f32;
use crate::cpu::view::{ComputeParams, TensorView};

pub fn supports(src0: &TensorView, src1: &TensorView, dst: &TensorView) -> Result<(), String> {
    if !src0.rows_contiguous() {
        return Err("src0 rows must be packed".into());
    }
    if src1.dtype != DType::F32 || dst.dtype != DType::F32 || dst.nb[0] != 4 {
        return Err("src1 and dst must be f32".into());
    }
    Ok(())
}

pub fn work_size(
    src0: &TensorView,
    _src1: &TensorView,
    _dst: &TensorView,
    nth: usize,
    _exact: bool,
) -> usize {
    nth * 2 * src0.ne[0] * 4 + 64
}

pub fn forward(p: &ComputeParams, src0: &TensorView, src1: &TensorView, dst: &TensorView) {
    let k = src0.ne[0];
    // SAFETY: work_size reserved 2k floats per thread.
    let buf =
        unsafe { std::slice::from_raw_parts_mut(p.wdata.cast::<f32>().add(p.ith * 2 * k), 2 * k) };
    let (a, b) = buf.split_at_mut(k);
    let (r2, r3) = (dst.ne[2] / src0.ne[2].max(1), dst.ne[3] / src0.ne[3].max(1));
    let rows = dst.ne[0] * dst.ne[1] * dst.ne[2] * dst.ne[3];
    for r in p.range(rows) {
        let n = r % dst.ne[0];
        let m = (r / dst.ne[0]) % dst.ne[1];
        let i2 = (r / (dst.ne[0] * dst.ne[1])) % dst.ne[2];
        let i3 = r / (dst.ne[0] * dst.ne[1] * dst.ne[2]);
        // SAFETY: indices in range by the mul_mat shape rules; dst element owned by this thread.
        unsafe {
            read_row_f32(src0, n, i2 / r2, i3 / r3, a);
            read_row_f32(src1, m, i2, i3, b);
            let s: f64 = a
                .iter()
                .zip(b.iter())
                .map(|(x, y)| *x as f64 * *y as f64)
                .sum();
            dst.set_f32(n, m, i2, i3, s as f32);
        }
    }
}
