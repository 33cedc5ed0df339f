//! Row conversions between storage dtypes and f32 used by the op kernels: no allocation, half
//! types through the SIMD conversions of [`crate::cpu::simd`] (the same code the matmul and
//! attention kernels use), quantized blocks through the type table's reference conversions
//! (`dtype/formats.rs`, ggml's layouts, per block, unaligned reads and writes allowed).
//!
//! Each function matches every `DType` by name: a new type does not compile until it is given
//! a conversion here (a quantized one takes its own row of the table, never another type's).

use crate::DType;
use crate::cpu::simd::{self, Isa};

/// Convert one packed row of `dtype` (`src.len() == dtype.row_size(out.len())`) to f32.
pub fn row_to_f32(dtype: DType, src: &[u8], out: &mut [f32]) {
    let n = out.len();
    debug_assert_eq!(src.len(), dtype.row_size(n));
    match dtype {
        DType::F32 | DType::I32 => (dtype.traits().to_f32)(src, out),
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
        DType::Q8_0
        | DType::Q4_0
        | DType::Q4_1
        | DType::Q5_0
        | DType::Q5_1
        | DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::IQ4_NL
        | DType::IQ4_XS => (dtype.traits().to_f32)(src, out),
        #[cfg(test)]
        DType::FakeQ4x16 => (dtype.traits().to_f32)(src, out),
    }
}

/// Convert f32 values into one packed row of `dtype` (`dst.len() == dtype.row_size(src.len())`).
pub fn row_from_f32(dtype: DType, src: &[f32], dst: &mut [u8]) {
    debug_assert_eq!(dst.len(), dtype.row_size(src.len()));
    match dtype {
        DType::F32 | DType::I32 => (dtype.traits().from_f32)(src, dst),
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
        // Quantizing is rare on the hot path (casts); the reference is exact to ggml's.
        DType::Q8_0
        | DType::Q4_0
        | DType::Q4_1
        | DType::Q5_0
        | DType::Q5_1
        | DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::IQ4_NL
        | DType::IQ4_XS => (dtype.traits().from_f32)(src, dst),
        #[cfg(test)]
        DType::FakeQ4x16 => (dtype.traits().from_f32)(src, dst),
    }
}
