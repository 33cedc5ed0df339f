//! Weight rows converted to f32 (the exact-mode paths that multiply f32 tiles or call the
//! GEMM): Q8_0, Q4_0, Q4_1 and Q5_0 with AVX2 (bytes widened, one multiply and, for Q4_1, one
//! add per weight, as the reference rounds), the K-quants Q4_K, Q5_K and Q6_K with AVX2 (also
//! on the AVX-512 level; `d * sc * q - dmin * mn` per 16 elements, Q6_K `d * sc * (q - 32)`,
//! in the reference's operations), Q2_K, Q3_K, IQ4_XS, Q5_1 and IQ4_NL with AVX2 through
//! [`low`](super::low)'s block decoders (`dl * q - ml` per 16), everything else through the
//! type table's reference conversion.
//! Also the per-block helpers the quantized kernels share (nibbles, Q5_0's fifth bits, f16
//! scales). Layouts: ggml-common.h (`block_q4_0` .. `block_q6_K`).

use super::QuantW as WType;
use super::quant::BLK;
use super::{FloatW, Weights};
use crate::cpu::simd::Isa;
use half::f16;
#[cfg(target_arch = "x86_64")]
use {
    super::KQuantW as KW,
    super::kquant::{K4, K5, K6, chunk_avx2, head, kblock_bytes},
    crate::dtype::QK_K,
};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Convert one weight row of `k` elements of `w` at `src` into f32 at `dst`.
///
/// # Safety
/// `src` must be readable for one row of `k` elements of `w.dtype()` (any alignment) and
/// `dst` writable for `k` f32; `k` must be a multiple of the block size.
pub(crate) unsafe fn row_to_f32(isa: Isa, w: Weights, src: *const u8, dst: *mut f32, k: usize) {
    use crate::cpu::simd;
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match w {
            Weights::Float(FloatW::F32) => {
                std::ptr::copy_nonoverlapping(src, dst.cast::<u8>(), 4 * k)
            }
            Weights::Float(FloatW::F16) => simd::f16_to_f32_raw(isa, src, dst, k),
            Weights::Float(FloatW::BF16) => simd::bf16_to_f32_raw(isa, src, dst, k),
            Weights::Quant(wt) => dequant_row(isa, wt, src, dst, k),
            #[cfg(target_arch = "x86_64")]
            Weights::KQuant(kw) if isa.clamp() >= Isa::Avx2 => {
                // The AVX-512 level runs the AVX2 code (the scratch round trip, not the
                // conversion, dominates the convert path).
                let nblk = k / QK_K;
                match kw {
                    KW::Q4_K => kdequant_avx2::<K4>(src, dst, nblk),
                    KW::Q5_K => kdequant_avx2::<K5>(src, dst, nblk),
                    KW::Q6_K => kdequant_avx2::<K6>(src, dst, nblk),
                }
            }
            #[cfg(target_arch = "x86_64")]
            Weights::Low(lw) if isa.clamp() >= Isa::Avx2 => {
                use super::low::{L2K, L3K, L51, LNL, LXS};
                match super::low::code(lw) {
                    L2K => low_dequant_avx2::<L2K>(src, dst, k),
                    L3K => low_dequant_avx2::<L3K>(src, dst, k),
                    LXS => low_dequant_avx2::<LXS>(src, dst, k),
                    L51 => low_dequant_avx2::<L51>(src, dst, k),
                    _ => low_dequant_avx2::<LNL>(src, dst, k),
                }
            }
            Weights::KQuant(_) | Weights::Low(_) => {
                let d = w.dtype();
                let src = std::slice::from_raw_parts(src, d.row_size(k));
                let dst = std::slice::from_raw_parts_mut(dst, k);
                (d.traits().to_f32)(src, dst);
            }
        }
    }
}

unsafe fn dequant_row(isa: Isa, wt: WType, src: *const u8, dst: *mut f32, k: usize) {
    let nblk = k / BLK;
    let bs = Weights::Quant(wt).dtype().type_size();
    #[cfg(target_arch = "x86_64")]
    if isa.clamp() >= Isa::Avx2 {
        // SAFETY: supported level; forwarded caller guarantees.
        unsafe { dequant_row_avx2(wt, src, dst, nblk) };
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    for b in 0..nblk {
        // SAFETY: block b is inside the row; dst has room for its 32 values.
        unsafe {
            let blk = src.add(b * bs);
            let dv = read_f16(blk);
            let out = dst.add(b * BLK);
            for j in 0..BLK {
                *out.add(j) = match wt {
                    WType::Q8_0 => *blk.add(2 + j) as i8 as f32 * dv,
                    WType::Q4_0 => (nibble(blk.add(2), j) as i32 - 8) as f32 * dv,
                    WType::Q4_1 => nibble(blk.add(4), j) as f32 * dv + read_f16(blk.add(2)),
                    WType::Q5_0 => (q5_0(blk, j) as i32 - 16) as f32 * dv,
                };
            }
        }
    }
}

/// The unsigned 5-bit quant `j < 32` of the Q5_0 block at `blk` (ggml-common.h `block_q5_0`:
/// f16 `d`, then `qh`, 32 fifth bits as a little-endian u32 (bit j for element j), then the
/// 16 nibble bytes as Q4_0's; the value is `(q - 16) * d`).
///
/// # Safety
/// `blk` must be readable for one Q5_0 block.
#[inline(always)]
pub(super) unsafe fn q5_0(blk: *const u8, j: usize) -> u8 {
    // SAFETY: the block's qh and quants.
    unsafe {
        let qh = blk.add(2).cast::<u32>().read_unaligned();
        nibble(blk.add(6), j) | ((((qh >> j) & 1) as u8) << 4)
    }
}

/// The 32 unsigned 5-bit quants of the Q5_0 block at `blk`, as bytes in element order: the
/// nibbles, plus 16 where byte j's bit of `qh` is set (the 4 bytes of `qh` spread over the
/// 4 quarters, each byte tested against its own bit).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn q5_0_avx2(blk: *const u8) -> __m256i {
    // SAFETY: the caller guarantees one readable block.
    unsafe {
        let nib = nibbles_avx2(blk.add(6), _mm256_set1_epi8(0x0f));
        let qh = _mm256_set1_epi32(blk.add(2).cast::<i32>().read_unaligned());
        let spread = _mm256_shuffle_epi8(
            qh,
            _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            ),
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(16)))
    }
}

/// Element `j < 32` of a block's 16 nibble bytes at `qs` (low nibbles are 0..16, high 16..32).
///
/// # Safety
/// `qs` must be readable for 16 bytes.
#[inline(always)]
pub(super) unsafe fn nibble(qs: *const u8, j: usize) -> u8 {
    // SAFETY: j % 16 < 16.
    let b = unsafe { *qs.add(j % 16) };
    if j < 16 { b & 0x0f } else { b >> 4 }
}

/// # Safety
/// `p` must be readable for 2 bytes.
#[inline(always)]
pub(super) unsafe fn read_f16(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees two readable bytes.
    f16::from_bits(unsafe { p.cast::<u16>().read_unaligned() }).to_f32()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_row_avx2(wt: WType, src: *const u8, dst: *mut f32, nblk: usize) {
    let bs = Weights::Quant(wt).dtype().type_size();
    let mask = _mm256_set1_epi8(0x0f);
    let eight = _mm256_set1_epi8(8);
    for b in 0..nblk {
        // SAFETY: block b is inside the row and dst has room for 32 floats at b * 32.
        unsafe {
            let blk = src.add(b * bs);
            let dv = _mm256_set1_ps(f16_bits_to_f32(blk));
            let bytes = match wt {
                WType::Q8_0 => _mm256_loadu_si256(blk.add(2).cast()),
                WType::Q4_0 => _mm256_sub_epi8(nibbles_avx2(blk.add(2), mask), eight),
                WType::Q4_1 => nibbles_avx2(blk.add(4), mask),
                WType::Q5_0 => _mm256_sub_epi8(q5_0_avx2(blk), _mm256_set1_epi8(16)),
            };
            let mv = if wt == WType::Q4_1 {
                _mm256_set1_ps(f16_bits_to_f32(blk.add(2)))
            } else {
                _mm256_setzero_ps()
            };
            let lo = _mm256_castsi256_si128(bytes);
            let hi = _mm256_extracti128_si256::<1>(bytes);
            let parts = [
                _mm256_cvtepi8_epi32(lo),
                _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lo)),
                _mm256_cvtepi8_epi32(hi),
                _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(hi)),
            ];
            for (i, p) in parts.iter().enumerate() {
                // Multiply then add (two roundings), as the scalar reference does.
                let v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(*p), dv), mv);
                _mm256_storeu_ps(dst.add(b * BLK + 8 * i), v);
            }
        }
    }
}

/// `nblk` K-quant super-blocks of kernel type `T` at `src` to f32 at `dst` ([`store_scaled`], shared
/// with the 2-5 bit types' [`low_dequant_avx2`]), 8 at a time: per
/// 16 elements `dl = d * sc` and `ml = dm * mn` as the reference computes them, then
/// `dl * q - ml` (Q6_K: `dl * (q - 32)`), each operation rounded, as `dequantize_row_q4_K`
/// and friends (ggml-quants.c) do; the same bits as the type table's conversion.
///
/// # Safety
/// `src` readable for `nblk` super-blocks, `dst` writable for `256 * nblk` f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kdequant_avx2<const T: u8>(src: *const u8, dst: *mut f32, nblk: usize) {
    let bs = const { kblock_bytes(T) };
    let tab = crate::cpu::simd::f16_table().as_ptr();
    for blk in 0..nblk {
        // SAFETY: super-block blk of the row and its 256 outputs.
        unsafe {
            let b = src.add(blk * bs);
            let out = dst.add(blk * QK_K);
            let h = head::<T>(b, tab);
            let (mut dl, mut ml) = ([0f32; 16], [0f32; 16]);
            for j in 0..16 {
                dl[j] = h.d * h.sc[j] as f32;
                // Q6_K has no minimum: `(q - 32) * dl - 0` is `(q - 32) * dl` bit for bit.
                ml[j] = if T == K6 { 0.0 } else { h.dm * h.mn[j] as f32 };
            }
            for c in 0..8 {
                let q = chunk_avx2::<T>(b, c);
                // Q4_K and Q5_K quants (0..31) are the same bytes signed; Q6_K's (0..63) are
                // taken as the signed q - 32.
                let q = if T == K6 {
                    _mm256_sub_epi8(q, _mm256_set1_epi8(32))
                } else {
                    q
                };
                store_scaled(out.add(32 * c), q, &dl[2 * c..], &ml[2 * c..]);
            }
        }
    }
}

/// A row of `k` elements of a [`low`](super::low) type `T` (Q2_K, Q3_K, IQ4_XS, Q5_1, IQ4_NL)
/// converted to f32: each block decoded by `low::quants_avx2` into signed bytes and by
/// `low::f32_scales` into `(dl, ml)` per 16, then `dl * q - ml` in two roundings, the
/// reference dequantizer's operations (Q5_1's `d q + m` as `d q - (-m)`), so bit for bit.
///
/// # Safety
/// AVX2 available; `src` readable for the row's blocks, `dst` writable for `k` f32, `k` a
/// multiple of the block size.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn low_dequant_avx2<const T: u8>(src: *const u8, dst: *mut f32, k: usize) {
    use super::low;
    let (bs, ne) = (low::bytes(T), low::elems(T));
    let tab = crate::cpu::simd::f16_table().as_ptr();
    for blk in 0..k / ne {
        // SAFETY: block blk of the row and its `ne` outputs.
        unsafe {
            let b = src.add(blk * bs);
            let out = dst.add(blk * ne);
            let (dl, ml) = low::f32_scales::<T>(b, tab);
            let q = low::quants_avx2::<T>(b);
            for (c, qc) in q.iter().take(ne / 32).enumerate() {
                store_scaled(out.add(32 * c), *qc, &dl[2 * c..], &ml[2 * c..]);
            }
        }
    }
}

/// 32 signed quants `q` written as f32 at `out`: `q * dl[j] - ml[j]` for the two groups of
/// 16 (`j` = 0, 1), multiply then subtract, two roundings as the reference dequantizers.
///
/// # Safety
/// AVX2 available; `out` writable for 32 f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store_scaled(out: *mut f32, q: __m256i, dl: &[f32], ml: &[f32]) {
    let parts = [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)];
    for (j, p) in parts.iter().enumerate() {
        let (d, m) = (_mm256_set1_ps(dl[j]), _mm256_set1_ps(ml[j]));
        for e in 0..2 {
            let bytes = if e == 0 { *p } else { _mm_srli_si128::<8>(*p) };
            let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
            let w = _mm256_sub_ps(_mm256_mul_ps(v, d), m);
            // SAFETY: elements 16 j + 8 e .. + 8 of the caller's 32.
            unsafe { _mm256_storeu_ps(out.add(16 * j + 8 * e), w) };
        }
    }
}

/// f16 bits at `p` to f32 with F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn f16_bits_to_f32(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees two readable bytes.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// The 32 nibbles of a Q4 block (16 bytes at `qs`) as bytes in element order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn nibbles_avx2(qs: *const u8, mask: __m256i) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes.
    let q = unsafe { _mm_loadu_si128(qs.cast()) };
    let hi = _mm_srli_epi16::<4>(q);
    _mm256_and_si256(_mm256_set_m128i(hi, q), mask)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn dequantized_rows_match_the_reference() {
        let k = 512; // whole blocks of every type (K-quants: 256)
        let x: Vec<f32> = (0..k)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 9.0)
            .collect();
        // Every type with kernels, each converted by its own kernel type.
        for dt in DType::ALL {
            let Some(w) = super::super::kernels_for(dt) else {
                continue;
            };
            assert_eq!(w.dtype(), dt);
            let bytes = crate::dtype::f32_to_bytes(dt, &x).unwrap();
            let want = crate::dtype::bytes_to_f32(dt, &bytes, k).unwrap();
            for isa in Isa::available() {
                let mut got = vec![0f32; k];
                // SAFETY: bytes hold one row of k elements, got has room for k.
                unsafe { row_to_f32(isa, w, bytes.as_ptr(), got.as_mut_ptr(), k) };
                assert_eq!(got, want, "{isa} {dt}");
            }
        }
    }
}
