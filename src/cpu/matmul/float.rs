//! Small-M matrix products with float weights (F32, F16, BF16) and f32 activations: the decode
//! (GEMV, M = 1) and short-batch shapes. Each kernel computes a register tile of `RN` weight
//! rows x `RM` activation rows over the whole of K, converting weights to f32 in registers, so
//! weights are read once per tile and activations stay in cache across the weight rows.
//!
//! Levels: AVX2 + FMA + F16C (ymm, 8 lanes), AVX-512 (zmm, 16 lanes, 32 registers for bigger
//! tiles), and a portable scalar fallback.

use super::FloatW as WType;
use crate::cpu::simd::Isa;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// One block of `dst[m][n] = dot(w[n][..k], x[m][..k])` for `n < self.n`, `m < self.m`.
#[derive(Clone, Copy)]
pub(crate) struct FloatBlock {
    /// First weight row; row `n` starts at `w + n * ldw` bytes, elements of type `wt`.
    pub w: *const u8,
    pub ldw: usize,
    pub wt: WType,
    /// First activation row (f32); row `m` starts at `x + m * ldx` elements.
    pub x: *const f32,
    pub ldx: usize,
    /// Output: `dst[m][n]` at `d + m * ldd + n` elements.
    pub d: *mut f32,
    pub ldd: usize,
    pub n: usize,
    pub m: usize,
    pub k: usize,
}

/// Compute one block at the given level.
///
/// # Safety
/// Every weight row `n < b.n` is readable for `b.k` elements of `b.wt`, every activation row
/// `m < b.m` for `b.k` f32, and `dst[m][n]` is writable and not accessed by another thread.
pub(crate) unsafe fn block(isa: Isa, b: &FloatBlock) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = isa.clamp();
        // SAFETY: the level is supported (clamped); the caller guarantees the bounds.
        unsafe {
            match (isa, b.wt) {
                (Isa::Avx512, WType::F32) => return avx512::block::<F32>(b),
                (Isa::Avx512, WType::F16) => return avx512::block::<F16>(b),
                (Isa::Avx512, WType::BF16) => return avx512::block::<BF16>(b),
                (Isa::Avx2, WType::F32) => return avx2::block::<F32>(b),
                (Isa::Avx2, WType::F16) => return avx2::block::<F16>(b),
                (Isa::Avx2, WType::BF16) => return avx2::block::<BF16>(b),
                _ => {}
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    // SAFETY: forwarded caller guarantees.
    unsafe { scalar_block(b) }
}

const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;

const fn elem_size(wt: u8) -> usize {
    if wt == F32 { 4 } else { 2 }
}

/// Weight element `i` of the row at `p`, as f32.
///
/// # Safety
/// `p` must be readable for `i + 1` elements.
#[inline(always)]
unsafe fn load_scalar<const WT: u8>(p: *const u8, i: usize) -> f32 {
    // SAFETY: the caller keeps i in the row.
    unsafe {
        match WT {
            F32 => p.cast::<f32>().add(i).read_unaligned(),
            F16 => half::f16::from_bits(p.cast::<u16>().add(i).read_unaligned()).to_f32(),
            _ => f32::from_bits((p.cast::<u16>().add(i).read_unaligned() as u32) << 16),
        }
    }
}

/// The portable fallback: per 256-element chunk of K, convert each weight row to f32 once and
/// take its dot product with every activation row in 8 partial sums.
unsafe fn scalar_block(b: &FloatBlock) {
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match b.wt {
            WType::F32 => scalar_block_t::<F32>(b),
            WType::F16 => scalar_block_t::<F16>(b),
            WType::BF16 => scalar_block_t::<BF16>(b),
        }
    }
}

unsafe fn scalar_block_t<const WT: u8>(b: &FloatBlock) {
    const CH: usize = 256;
    let mut wrow = [0f32; CH];
    for n in 0..b.n {
        // SAFETY: n < b.n, so the row is inside the weights.
        let wp = unsafe { b.w.add(n * b.ldw) };
        for m in 0..b.m {
            // SAFETY: m < b.m, n < b.n: the caller owns this output element.
            unsafe { *b.d.add(m * b.ldd + n) = 0.0 };
        }
        let mut k0 = 0;
        while k0 < b.k {
            let len = CH.min(b.k - k0);
            for (j, v) in wrow[..len].iter_mut().enumerate() {
                // SAFETY: k0 + j < b.k.
                *v = unsafe { load_scalar::<WT>(wp, k0 + j) };
            }
            for m in 0..b.m {
                // SAFETY: activation row m holds b.k elements; k0 + len <= b.k.
                let xr = unsafe { std::slice::from_raw_parts(b.x.add(m * b.ldx + k0), len) };
                let mut acc = [0f32; 8];
                let mut wc = wrow[..len].chunks_exact(8);
                let mut xc = xr.chunks_exact(8);
                for (wv, xv) in (&mut wc).zip(&mut xc) {
                    for l in 0..8 {
                        acc[l] += wv[l] * xv[l];
                    }
                }
                let mut s: f32 = acc.iter().sum();
                for (wv, xv) in wc.remainder().iter().zip(xc.remainder()) {
                    s += wv * xv;
                }
                // SAFETY: as above, the caller owns this output element.
                unsafe { *b.d.add(m * b.ldd + n) += s };
            }
            k0 += len;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use crate::cpu::simd::hsum256;

    /// Load 8 weights as f32 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8<const WT: u8>(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements at p.
        unsafe {
            match WT {
                F32 => _mm256_loadu_ps(p.cast()),
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128(p.cast()),
                ))),
            }
        }
    }

    /// `RN x RM` outputs over all of K. Accumulators: RN*RM ymm registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const WT: u8, const RN: usize, const RM: usize>(
        w: *const u8,
        ldw: usize,
        x: *const f32,
        ldx: usize,
        d: *mut f32,
        ldd: usize,
        k: usize,
    ) {
        let es = elem_size(WT);
        let mut acc = [[_mm256_setzero_ps(); RM]; RN];
        let mut i = 0;
        while i + 8 <= k {
            let mut xv = [_mm256_setzero_ps(); RM];
            for (m, v) in xv.iter_mut().enumerate() {
                // SAFETY: i + 8 <= k elements of activation row m.
                *v = unsafe { _mm256_loadu_ps(x.add(m * ldx + i)) };
            }
            for (r, accr) in acc.iter_mut().enumerate() {
                // SAFETY: i + 8 <= k elements of weight row r.
                let wv = unsafe { load8::<WT>(w.add(r * ldw + i * es)) };
                for (a, xm) in accr.iter_mut().zip(&xv) {
                    *a = _mm256_fmadd_ps(wv, *xm, *a);
                }
            }
            i += 8;
        }
        for (r, accr) in acc.iter().enumerate() {
            for (m, a) in accr.iter().enumerate() {
                let mut s = hsum256(*a);
                for j in i..k {
                    // SAFETY: j < k inside both rows.
                    unsafe { s += load_scalar::<WT>(w.add(r * ldw), j) * *x.add(m * ldx + j) };
                }
                // SAFETY: the output element is in the caller's block.
                unsafe { *d.add(m * ldd + r) = s };
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn block<const WT: u8>(b: &FloatBlock) {
        if b.m == 1 {
            drive_tiles!(b, tile, WT, 8, [1], (b.k));
        } else {
            drive_tiles!(b, tile, WT, 4, [3, 2, 1], (b.k));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;

    /// Load 16 weights as f32 lanes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn load16<const WT: u8>(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements at p.
        unsafe {
            match WT {
                F32 => _mm512_loadu_ps(p.cast()),
                F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256(p.cast()),
                ))),
            }
        }
    }

    /// Load the first `n < 16` weights as f32 lanes, the rest zero.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn load16_tail<const WT: u8>(p: *const u8, mask: __mmask16) -> __m512 {
        // SAFETY: masked-off lanes are not read (AVX-512 masked loads do not fault on them).
        unsafe {
            match WT {
                F32 => _mm512_maskz_loadu_ps(mask, p.cast()),
                F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.cast())),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_maskz_loadu_epi16(mask, p.cast()),
                ))),
            }
        }
    }

    /// `RN x RM` outputs over all of K, 16 lanes, K tail by masked loads.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn tile<const WT: u8, const RN: usize, const RM: usize>(
        w: *const u8,
        ldw: usize,
        x: *const f32,
        ldx: usize,
        d: *mut f32,
        ldd: usize,
        k: usize,
    ) {
        let es = elem_size(WT);
        let mut acc = [[_mm512_setzero_ps(); RM]; RN];
        let mut i = 0;
        while i + 16 <= k {
            let mut xv = [_mm512_setzero_ps(); RM];
            for (m, v) in xv.iter_mut().enumerate() {
                // SAFETY: i + 16 <= k elements of activation row m.
                *v = unsafe { _mm512_loadu_ps(x.add(m * ldx + i)) };
            }
            for (r, accr) in acc.iter_mut().enumerate() {
                // SAFETY: i + 16 <= k elements of weight row r.
                let wv = unsafe { load16::<WT>(w.add(r * ldw + i * es)) };
                for (a, xm) in accr.iter_mut().zip(&xv) {
                    *a = _mm512_fmadd_ps(wv, *xm, *a);
                }
            }
            i += 16;
        }
        if i < k {
            let mask: __mmask16 = (1u32 << (k - i)) as u16 - 1;
            let mut xv = [_mm512_setzero_ps(); RM];
            for (m, v) in xv.iter_mut().enumerate() {
                // SAFETY: only the k - i in-range lanes are read.
                *v = unsafe { _mm512_maskz_loadu_ps(mask, x.add(m * ldx + i)) };
            }
            for (r, accr) in acc.iter_mut().enumerate() {
                // SAFETY: only the k - i in-range lanes are read.
                let wv = unsafe { load16_tail::<WT>(w.add(r * ldw + i * es), mask) };
                for (a, xm) in accr.iter_mut().zip(&xv) {
                    *a = _mm512_fmadd_ps(wv, *xm, *a);
                }
            }
        }
        for (r, accr) in acc.iter().enumerate() {
            for (m, a) in accr.iter().enumerate() {
                // SAFETY: the output element is in the caller's block.
                unsafe { *d.add(m * ldd + r) = _mm512_reduce_add_ps(*a) };
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn block<const WT: u8>(b: &FloatBlock) {
        if b.m == 1 {
            drive_tiles!(b, tile, WT, 8, [1], (b.k));
        } else {
            drive_tiles!(b, tile, WT, 4, [6, 4, 2, 1], (b.k));
        }
    }
}
