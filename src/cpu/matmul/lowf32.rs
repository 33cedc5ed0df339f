//! Q2_K, Q3_K, IQ4_XS, Q5_1 and IQ4_NL weights times f32 activations, fused, for small M
//! (`plan::fused_max_m`):
//! each block is decoded in registers ([`super::low`]: small integers and per-16 scales),
//! every weight formed as `q * dl - ml` in one FMA (the reference's `dl * q` exactly where
//! there is no minimum; Q2_K's `dl * q - ml` and Q5_1's `q * d + m` with one rounding where
//! the reference rounds twice), and multiplied with the f32 activations in place: no 8-bit
//! rounding of the activations and no scratch.
//!
//! Levels: AVX-512 (16 weights per vector, tiles 8 x 1 for M = 1, 4 x {4, 3, 2, 1}
//! otherwise); AVX2 (8 per vector, tiles 4 x 1 and 2 x {2, 1}; the quants decoded 256
//! weights a row ahead into bytes and widened from memory, but for Q5_1 and IQ4_NL at
//! M > 1; Q3_K and IQ4_XS matrix-vector products go to `kf32`'s tile, 1.5x and 1.4x faster
//! on Zen 3); scalar: the reference
//! dequantization of a block, then dot products with 8 partial sums. An output's operations
//! do not depend on the tile it lands in, so results do not depend on the thread count.

use super::LowW;
use super::low::{self, L2K, L3K, L51, LNL, LXS, bytes, elems};
use crate::cpu::simd::Isa;
use crate::dtype::QK_K;

#[cfg(target_arch = "x86_64")]
use super::low::{f32_scales, prefetch, quants_avx2};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// One block of `dst[m][n] = dot(w[n], x[m])` with weights of a [`LowW`] type and f32
/// activations.
#[derive(Clone, Copy)]
pub(crate) struct LowF32Block {
    /// First weight row: `nblk` blocks of `wt` at `w + n * ldw` bytes.
    pub w: *const u8,
    pub ldw: usize,
    pub wt: LowW,
    /// First activation row; row `m` at `x + m * ldx` elements.
    pub x: *const f32,
    pub ldx: usize,
    /// Output: `dst[m][n]` at `d + m * ldd + n` elements.
    pub d: *mut f32,
    pub ldd: usize,
    pub n: usize,
    pub m: usize,
    /// Blocks per row (K / 256 or K / 32).
    pub nblk: usize,
    /// The whole product has one activation row (as `KF32Block::gemv`): Q3_K and IQ4_XS take
    /// `kf32`'s matrix-vector tile then on AVX2.
    pub gemv: bool,
}

/// Compute one block at the given level.
///
/// # Safety
/// Weight rows `n < b.n` hold `b.nblk` blocks of `b.wt`, activation rows `m < b.m` hold
/// `b.nblk` blocks' worth of f32, `dst[m][n]` is writable and owned by the caller's thread.
pub(crate) unsafe fn block(isa: Isa, b: &LowF32Block) {
    let tab = crate::cpu::simd::f16_table().as_ptr();
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: supported level (clamped); forwarded caller guarantees.
        unsafe {
            match (isa.clamp(), b.wt) {
                (Isa::Avx512, LowW::Q2_K) => return avx512::block::<L2K>(b, tab),
                (Isa::Avx512, LowW::Q3_K) => return avx512::block::<L3K>(b, tab),
                (Isa::Avx512, LowW::IQ4_XS) => return avx512::block::<LXS>(b, tab),
                (Isa::Avx512, LowW::Q5_1) => return avx512::block::<L51>(b, tab),
                (Isa::Avx512, LowW::IQ4_NL) => return avx512::block::<LNL>(b, tab),
                (Isa::Avx2, LowW::Q3_K) if b.gemv => {
                    return super::kf32::gemv_low_avx2::<{ super::kquant::K3 }>(b);
                }
                (Isa::Avx2, LowW::IQ4_XS) if b.gemv => {
                    return super::kf32::gemv_low_avx2::<{ super::kquant::KX }>(b);
                }
                (Isa::Avx2, LowW::Q2_K) => return avx2::block::<L2K>(b, tab),
                (Isa::Avx2, LowW::Q3_K) => return avx2::block::<L3K>(b, tab),
                (Isa::Avx2, LowW::IQ4_XS) => return avx2::block::<LXS>(b, tab),
                (Isa::Avx2, LowW::Q5_1) => return avx2::block::<L51>(b, tab),
                (Isa::Avx2, LowW::IQ4_NL) => return avx2::block::<LNL>(b, tab),
                _ => {}
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (isa, tab);
    // SAFETY: forwarded caller guarantees.
    unsafe { scalar_block(b) }
}

/// Portable fallback: the reference dequantization of each block, dotted with every
/// activation row in 8 partial sums.
unsafe fn scalar_block(b: &LowF32Block) {
    let t = low::code(b.wt);
    let (bs, ne) = (bytes(t), elems(t));
    let to_f32 = super::Weights::Low(b.wt).dtype().traits().to_f32;
    let mut wv = [0f32; QK_K];
    for n in 0..b.n {
        for m in 0..b.m {
            let mut acc = [0f32; 8];
            for blk in 0..b.nblk {
                // SAFETY: block blk of weight row n and of activation row m.
                unsafe {
                    let wb = std::slice::from_raw_parts(b.w.add(n * b.ldw + blk * bs), bs);
                    to_f32(wb, &mut wv[..ne]);
                    let x = std::slice::from_raw_parts(b.x.add(m * b.ldx + blk * ne), ne);
                    for (wc, xc) in wv[..ne].chunks_exact(8).zip(x.chunks_exact(8)) {
                        for l in 0..8 {
                            acc[l] = wc[l].mul_add(xc[l], acc[l]);
                        }
                    }
                }
            }
            // SAFETY: the caller owns this output element.
            unsafe { *b.d.add(m * b.ldd + n) = acc.iter().sum() };
        }
    }
}

/// The 16 bytes of sub-block `j` of decoded quants.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn sub16(q: &[__m256i; 8], j: usize) -> __m128i {
    if j.is_multiple_of(2) {
        _mm256_castsi256_si128(q[j / 2])
    } else {
        _mm256_extracti128_si256::<1>(q[j / 2])
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;

    /// `RN x RM` outputs over all blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const T: u8, const RN: usize, const RM: usize>(
        w: *const u8,
        ldw: usize,
        x: *const f32,
        ldx: usize,
        d: *mut f32,
        ldd: usize,
        nblk: usize,
        tab: *const f32,
    ) {
        let (bs, ne) = const { (bytes(T), elems(T)) };
        let mut acc = [[_mm512_setzero_ps(); RM]; RN];
        let mut q = [[_mm256_setzero_si256(); 8]; RN];
        let mut dl = [[0f32; 16]; RN];
        let mut ml = [[0f32; 16]; RN];
        for blk in 0..nblk {
            let wb = |r: usize| w.wrapping_add(r * ldw + blk * bs);
            for r in 0..RN {
                for l in 0..bs.div_ceil(64) {
                    prefetch(wb(r).wrapping_add(RN * ldw + 64 * l));
                }
                // SAFETY: block blk of weight row r.
                unsafe {
                    q[r] = quants_avx2::<T>(wb(r));
                    (dl[r], ml[r]) = f32_scales::<T>(wb(r), tab);
                }
            }
            // Sub-block-outer, row-inner: consecutive FMAs go to different accumulators.
            for j in 0..ne / 16 {
                let mut xv = [_mm512_setzero_ps(); RM];
                for (m, v) in xv.iter_mut().enumerate() {
                    // SAFETY: 16 activations of row m inside block blk.
                    *v = unsafe { _mm512_loadu_ps(x.add(m * ldx + blk * ne + 16 * j)) };
                }
                for (r, accr) in acc.iter_mut().enumerate() {
                    let qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sub16(&q[r], j)));
                    let wv =
                        _mm512_fmsub_ps(qf, _mm512_set1_ps(dl[r][j]), _mm512_set1_ps(ml[r][j]));
                    for (a, xm) in accr.iter_mut().zip(&xv) {
                        *a = _mm512_fmadd_ps(wv, *xm, *a);
                    }
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
    pub(super) unsafe fn block<const T: u8>(b: &LowF32Block, tab: *const f32) {
        if b.m == 1 {
            drive_tiles!(b, tile, T, 8, [1], (b.nblk, tab));
        } else {
            drive_tiles!(b, tile, T, 4, [4, 3, 2, 1], (b.nblk, tab));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use crate::cpu::simd::hsum256;

    /// Blocks `first..first + count` of each of the `RN` rows at `w + r * ldw`, decoded to
    /// their signed quants ([`quants_avx2`]), row r's block `first + j` at
    /// `out[r][j * elems..]`. The tile decodes the next 256 weights of each row while it
    /// multiplies these, and widens the stored bytes with a load-operand `vpmovsxbd`, as the
    /// K-quant tiles do (`kf32::avx2::decode_ahead`): no lane extracts or byte shifts, the same
    /// products in the same order.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn decode_group<const T: u8, const RN: usize>(
        out: &mut [[i8; QK_K]; RN],
        w: *const u8,
        ldw: usize,
        first: usize,
        count: usize,
    ) {
        let (bs, ne) = const { (bytes(T), elems(T)) };
        for (r, row) in out.iter_mut().enumerate() {
            for j in 0..count {
                // SAFETY: block first + j of row r.
                let q = unsafe { quants_avx2::<T>(w.add(r * ldw + (first + j) * bs)) };
                for (c, v) in q.iter().take(ne / 32).enumerate() {
                    // SAFETY: 32 bytes inside the row's 256 (count * ne <= 256).
                    unsafe {
                        _mm256_storeu_si256(row.as_mut_ptr().add(j * ne + 32 * c).cast(), *v)
                    };
                }
            }
        }
    }

    /// `RN x RM` outputs over all blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const T: u8, const RN: usize, const RM: usize>(
        w: *const u8,
        ldw: usize,
        x: *const f32,
        ldx: usize,
        d: *mut f32,
        ldd: usize,
        nblk: usize,
        tab: *const f32,
    ) {
        let (bs, ne) = const { (bytes(T), elems(T)) };
        // Blocks per decoded group: 256 weights a row.
        let group = const { QK_K / elems(T) };
        let mut acc = [[_mm256_setzero_ps(); RM]; RN];
        let mut dl = [[0f32; 16]; RN];
        let mut ml = [[0f32; 16]; RN];
        // Two groups of decoded quants ([`decode_group`]), but for the 32-element blocks at
        // M > 1 (Q5_1 measured 0.88x there with the buffer; IQ4_NL even): those widen each
        // block's quants from registers.
        let buffered = const { RM == 1 || elems(T) == QK_K };
        let mut buf = [[[0i8; QK_K]; RN]; 2];
        let mut q = [[_mm256_setzero_si256(); 8]; RN];
        if buffered && nblk > 0 {
            // SAFETY: blocks 0..count of every row.
            unsafe { decode_group::<T, RN>(&mut buf[0], w, ldw, 0, nblk.min(group)) };
        }
        for blk in 0..nblk {
            let (g, jb) = (blk / group, blk % group);
            if buffered && jb == 0 && (g + 1) * group < nblk {
                let first = (g + 1) * group;
                let count = (nblk - first).min(group);
                // SAFETY: as above, for the next group.
                unsafe { decode_group::<T, RN>(&mut buf[(g + 1) % 2], w, ldw, first, count) };
            }
            let wb = |r: usize| w.wrapping_add(r * ldw + blk * bs);
            for r in 0..RN {
                for l in 0..bs.div_ceil(64) {
                    prefetch(wb(r).wrapping_add(RN * ldw + 64 * l));
                }
                // SAFETY: block blk of weight row r.
                unsafe {
                    if !buffered {
                        q[r] = quants_avx2::<T>(wb(r));
                    }
                    (dl[r], ml[r]) = f32_scales::<T>(wb(r), tab);
                }
            }
            let qb = &buf[g % 2];
            for j in 0..ne / 16 {
                for (r, accr) in acc.iter_mut().enumerate() {
                    let (dv, mv) = (_mm256_set1_ps(dl[r][j]), _mm256_set1_ps(ml[r][j]));
                    for e in 0..2 {
                        let bytes = if buffered {
                            // SAFETY: quants 16j + 8e.. + 8 of block jb of the group's row r.
                            unsafe {
                                let p = qb[r].as_ptr().add(jb * ne + 16 * j + 8 * e);
                                _mm_loadl_epi64(p.cast())
                            }
                        } else if e == 0 {
                            sub16(&q[r], j)
                        } else {
                            _mm_srli_si128::<8>(sub16(&q[r], j))
                        };
                        let qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                        let wv = _mm256_fmsub_ps(qf, dv, mv);
                        for (m, a) in accr.iter_mut().enumerate() {
                            // SAFETY: 8 activations of row m inside block blk.
                            let xv = unsafe {
                                _mm256_loadu_ps(x.add(m * ldx + blk * ne + 16 * j + 8 * e))
                            };
                            *a = _mm256_fmadd_ps(wv, xv, *a);
                        }
                    }
                }
            }
        }
        for (r, accr) in acc.iter().enumerate() {
            for (m, a) in accr.iter().enumerate() {
                // SAFETY: the output element is in the caller's block.
                unsafe { *d.add(m * ldd + r) = hsum256(*a) };
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn block<const T: u8>(b: &LowF32Block, tab: *const f32) {
        if b.m == 1 {
            drive_tiles!(b, tile, T, 4, [1], (b.nblk, tab));
        } else {
            drive_tiles!(b, tile, T, 2, [2, 1], (b.nblk, tab));
        }
    }
}
