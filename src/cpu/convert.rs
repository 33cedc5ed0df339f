//! Row conversions between storage dtypes and f32 used by the op kernels: no allocation, half
//! types through the SIMD conversions of [`crate::cpu::simd`] (the same code the matmul and
//! attention kernels use), quantized blocks per ggml's layouts (see `dtype.rs`), unaligned
//! reads and writes allowed.

use crate::DType;
use crate::cpu::simd::{self, Isa};
use crate::dtype::{BlockQ4_0, BlockQ4_1, BlockQ8_0, QK};

/// Convert one packed row of `dtype` (`src.len() == dtype.row_size(out.len())`) to f32.
pub fn row_to_f32(dtype: DType, src: &[u8], out: &mut [f32]) {
    let n = out.len();
    debug_assert_eq!(src.len(), dtype.row_size(n));
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::I32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32;
            }
        }
        DType::F16 | DType::BF16 => {
            assert!(src.len() >= 2 * n, "row_to_f32: {dtype} row too short");
            // SAFETY: src holds n 16-bit values (checked), out n floats; they do not overlap
            // (one is borrowed shared, the other exclusively).
            unsafe {
                if dtype == DType::F16 {
                    simd::f16_to_f32_raw(Isa::detect(), src.as_ptr(), out.as_mut_ptr(), n);
                } else {
                    simd::bf16_to_f32_raw(Isa::detect(), src.as_ptr(), out.as_mut_ptr(), n);
                }
            }
        }
        DType::Q8_0 => {
            for (b, o) in src.chunks_exact(34).zip(out.chunks_exact_mut(QK)) {
                // SAFETY: the chunk holds exactly one block; read_unaligned copies it.
                let blk: BlockQ8_0 = unsafe { b.as_ptr().cast::<BlockQ8_0>().read_unaligned() };
                let d = blk.d.to_f32();
                for (y, &q) in o.iter_mut().zip(&blk.qs) {
                    *y = q as f32 * d;
                }
            }
        }
        DType::Q4_0 => {
            for (b, o) in src.chunks_exact(18).zip(out.chunks_exact_mut(QK)) {
                // SAFETY: as above.
                let blk: BlockQ4_0 = unsafe { b.as_ptr().cast::<BlockQ4_0>().read_unaligned() };
                let d = blk.d.to_f32();
                for j in 0..QK / 2 {
                    o[j] = ((blk.qs[j] & 15) as i32 - 8) as f32 * d;
                    o[j + QK / 2] = ((blk.qs[j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        DType::Q4_1 => {
            for (b, o) in src.chunks_exact(20).zip(out.chunks_exact_mut(QK)) {
                // SAFETY: as above.
                let blk: BlockQ4_1 = unsafe { b.as_ptr().cast::<BlockQ4_1>().read_unaligned() };
                let (d, m) = (blk.d.to_f32(), blk.m.to_f32());
                for j in 0..QK / 2 {
                    o[j] = (blk.qs[j] & 15) as f32 * d + m;
                    o[j + QK / 2] = (blk.qs[j] >> 4) as f32 * d + m;
                }
            }
        }
    }
}

/// Convert f32 values into one packed row of `dtype` (`dst.len() == dtype.row_size(src.len())`).
pub fn row_from_f32(dtype: DType, src: &[f32], dst: &mut [u8]) {
    debug_assert_eq!(dst.len(), dtype.row_size(src.len()));
    match dtype {
        DType::F32 => {
            for (c, &v) in dst.chunks_exact_mut(4).zip(src) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::I32 => {
            for (c, &v) in dst.chunks_exact_mut(4).zip(src) {
                c.copy_from_slice(&(v as i32).to_le_bytes());
            }
        }
        DType::F16 | DType::BF16 => {
            let n = src.len();
            assert!(dst.len() >= 2 * n, "row_from_f32: {dtype} row too short");
            // SAFETY: dst holds n 16-bit values (checked), src n floats; they do not overlap.
            unsafe {
                if dtype == DType::F16 {
                    simd::f32_to_f16_raw(Isa::detect(), src.as_ptr(), dst.as_mut_ptr(), n);
                } else {
                    simd::f32_to_bf16_raw(Isa::detect(), src.as_ptr(), dst.as_mut_ptr(), n);
                }
            }
        }
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => {
            // Quantizing is rare on the hot path (casts); the reference is exact to ggml's.
            let _ = crate::dtype::row_from_f32(dtype, src, dst);
        }
    }
}
