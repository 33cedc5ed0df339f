//! Quantized weights (Q8_0, Q4_0, Q4_1, Q5_0) times f32 activations, fused: each weight block is
//! dequantized in registers and multiplied with the f32 activations directly, with no 8-bit
//! rounding of the activations and no scratch round trip. A register tile of `RN` weight rows x
//! `RM` activation rows dequantizes each weight block once and uses it for the `RM` rows.
//!
//! Weight values are those of the reference dequantization (`dtype.rs`, after ggml's
//! `dequantize_row_q4_0` and friends): Q8_0 `q * d`, Q4_0 `(q - 8) * d` (both one rounding, so
//! bit-identical), Q4_1 `q * d + m` in one fused multiply-add (one rounding where the reference
//! rounds twice). Block layouts per ggml-common.h (`block_q8_0`: f16 d, 32 i8; `block_q4_0`: f16
//! d, 16 bytes of nibbles, element j < 16 in the low nibble of byte j, element j + 16 in its
//! high nibble; `block_q4_1`: f16 d, f16 m, the same nibbles; `block_q5_0`: f16 d, u32 qh of
//! fifth bits, the same nibbles, value `(q - 16) * d`, one rounding: taken as signed bytes
//! through Q8_0's code).
//!
//! Levels:
//! - AVX-512: a Q4 block's 16 possible values are computed once per block and row
//!   (`(j - 8) * d` or `j * d + m` for j in 0..16, one vector) and the 32 weights are looked up
//!   with two `vpermps` indexed by the nibbles (the instruction uses the low 4 bits of each
//!   index lane, so the low nibbles need no masking); Q8_0 widens the bytes and converts them.
//!   Tiles 8 x 1 for M = 1, 4 x {4, 3, 2, 1} otherwise.
//! - AVX2 + FMA + F16C: nibbles widened to i32, converted, scaled with one FMA per 8 weights.
//!   Matrix-vector products (M = 1) scale the block's dot product with the integer quants
//!   instead (Q8_0 `q`, Q4_0 `q - 8` as signed bytes, Q4_1 `q` plus `m * sum(x)`), so no
//!   dequantized weights stay live and the 4-row tile fits the 16 registers.
//!   Tiles 4 x 1 for M = 1, 2 x {2, 1} otherwise (two accumulators per output).
//! - Scalar: a block dequantized into 32 floats, then dotted with each activation row.

use super::QuantW as WType;
use super::dequant::q5_0;
#[cfg(target_arch = "x86_64")]
use super::dequant::q5_0_avx2;
use super::quant::{BLK, Q4_0, Q4_1, Q5_0, Q8_0, block_bytes};
#[cfg(target_arch = "x86_64")]
use super::quant::{PF_ROWS, l2_stream, prefetch, prefetch_l2};
use crate::cpu::simd::{self, Isa};
use half::f16;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// One block of `dst[m][n] = dot(w[n], x[m])` with quantized weights and f32 activations.
#[derive(Clone, Copy)]
pub(crate) struct QF32Block {
    /// First weight row: `nblk` blocks of `wt` starting at `w + n * ldw` bytes.
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
    /// Blocks of 32 per row (K / 32).
    pub nblk: usize,
    /// The node is a matrix-vector product (M = 1 in every batch): Q8_0 blocks may scale
    /// each block's dot product instead of the weights (one operation fewer per block). Set
    /// per node, never per tile, so outputs do not depend on how threads split the rows.
    pub gemv: bool,
}

/// Compute one block at the given level.
///
/// # Safety
/// Weight rows `n < b.n` hold `b.nblk` blocks of `b.wt`, activation rows `m < b.m` hold
/// `32 * b.nblk` f32, and `dst[m][n]` is writable and owned by the caller's thread.
pub(crate) unsafe fn block(isa: Isa, b: &QF32Block) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = isa.clamp();
        let tab = F16Tab(simd::f16_table().as_ptr());
        // SAFETY: supported level (clamped); forwarded caller guarantees.
        unsafe {
            match (isa, b.wt) {
                (Isa::Avx512, WType::Q8_0) => return avx512::block::<Q8_0>(b, tab),
                (Isa::Avx512, WType::Q4_0) => return avx512::block::<Q4_0>(b, tab),
                (Isa::Avx512, WType::Q4_1) => return avx512::block::<Q4_1>(b, tab),
                (Isa::Avx512, WType::Q5_0) => return avx512::block::<Q5_0>(b, tab),
                (Isa::Avx2, WType::Q8_0) => return avx2::block::<Q8_0>(b, tab),
                (Isa::Avx2, WType::Q4_0) => return avx2::block::<Q4_0>(b, tab),
                (Isa::Avx2, WType::Q4_1) => return avx2::block::<Q4_1>(b, tab),
                (Isa::Avx2, WType::Q5_0) => return avx2::block::<Q5_0>(b, tab),
                _ => {}
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match b.wt {
            WType::Q8_0 => scalar_block::<Q8_0>(b),
            WType::Q4_0 => scalar_block::<Q4_0>(b),
            WType::Q4_1 => scalar_block::<Q4_1>(b),
            WType::Q5_0 => scalar_block::<Q5_0>(b),
        }
    }
}

/// The f32 value of every f16 bit pattern ([`simd::f16_table`]): a block's scale is one table
/// load, which the SIMD tiles broadcast straight from memory (a vector f16 conversion plus a
/// broadcast per block and row cost about a third of the M = 1 tile's time on Zen 4).
#[derive(Clone, Copy)]
#[cfg(target_arch = "x86_64")]
struct F16Tab(*const f32);

#[cfg(target_arch = "x86_64")]
impl F16Tab {
    /// The f16 at `p` as f32.
    ///
    /// # Safety
    /// `p` must be readable for 2 bytes.
    #[inline(always)]
    unsafe fn get(self, p: *const u8) -> f32 {
        // SAFETY: the caller guarantees two readable bytes; the table has an entry for every
        // 16-bit pattern.
        unsafe { *self.0.add(p.cast::<u16>().read_unaligned() as usize) }
    }
}

/// # Safety
/// `p` must be readable for 2 bytes.
#[inline(always)]
unsafe fn read_f16(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees two readable bytes.
    f16::from_bits(unsafe { p.cast::<u16>().read_unaligned() }).to_f32()
}

/// Dequantize one block at `wb` into `out`, as the reference does.
///
/// # Safety
/// `wb` must be readable for one block of `WQ`.
#[inline(always)]
unsafe fn dequant_block<const WQ: u8>(wb: *const u8, out: &mut [f32; BLK]) {
    // SAFETY: the block's header and quants are in the caller's range.
    unsafe {
        let d = read_f16(wb);
        match WQ {
            Q8_0 => {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = *wb.add(2 + j) as i8 as f32 * d;
                }
            }
            Q5_0 => {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = (q5_0(wb, j) as i32 - 16) as f32 * d;
                }
            }
            _ => {
                let (qs, m) = if WQ == Q4_0 {
                    (wb.add(2), 0.0)
                } else {
                    (wb.add(4), read_f16(wb.add(2)))
                };
                for j in 0..BLK / 2 {
                    let byte = *qs.add(j);
                    let (lo, hi) = ((byte & 0x0f) as f32, (byte >> 4) as f32);
                    if WQ == Q4_0 {
                        out[j] = (lo - 8.0) * d;
                        out[j + BLK / 2] = (hi - 8.0) * d;
                    } else {
                        out[j] = lo.mul_add(d, m);
                        out[j + BLK / 2] = hi.mul_add(d, m);
                    }
                }
            }
        }
    }
}

/// Portable fallback: per block, dequantize the weight row's block into 32 floats and take its
/// dot product with every activation row in 8 partial sums (one set per output).
unsafe fn scalar_block<const WQ: u8>(b: &QF32Block) {
    let bs = const { block_bytes(WQ) };
    let mut wv = [0f32; BLK];
    for n in 0..b.n {
        for m in 0..b.m {
            let mut acc = [0f32; 8];
            for blk in 0..b.nblk {
                // SAFETY: block blk of weight row n and of activation row m are in range.
                unsafe {
                    dequant_block::<WQ>(b.w.add(n * b.ldw + blk * bs), &mut wv);
                    let x = std::slice::from_raw_parts(b.x.add(m * b.ldx + blk * BLK), BLK);
                    for (wc, xc) in wv.chunks_exact(8).zip(x.chunks_exact(8)) {
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

/// Longest weight row (bytes) that gets the L2 stream prefetch ([`l2_stream`]) in these
/// kernels; longer rows run a copy of the tile compiled without it (`LONG`: a run-time
/// condition in the one tile made the compiler lay out the K = 576 loop 1.1x slower). Long rows are streams the hardware prefetchers follow, and the extra prefetches
/// only compete with them for the core's outstanding misses. Measured on Zen 2 (`bench ops
/// --no-rotate`, one copy of the weights, M = 1): without the stream the Q8_0 product ran 1.1x
/// faster at K = 4096 (4352-byte rows, one thread) and 1.55x at K = 14336 (DRAM-bound), while
/// K = 576 (612-byte rows) ran 1.3x slower without it. (The 8-bit-activation kernels keep the
/// stream on every row length: the same rule there made the compiler lay out the Q4_1 M = 32
/// tile 1.7x slower on Zen 2.)
#[cfg(target_arch = "x86_64")]
const L2_STREAM_MAX_ROW: usize = 4096;

/// `short_tile` and `long_tile` of a level's module: its `tile` with and without the L2 stream
/// (`LONG`), compiled for the level's features (`$feat`).
#[cfg(target_arch = "x86_64")]
macro_rules! row_length_tiles {
    ($feat:literal) => {
        /// [`tile`] for rows of at most [`L2_STREAM_MAX_ROW`] bytes (with the L2 stream).
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn short_tile<const WQ: u8, const RN: usize, const RM: usize>(
            w: *const u8,
            ldw: usize,
            x: *const f32,
            ldx: usize,
            d: *mut f32,
            ldd: usize,
            nblk: usize,
            tab: F16Tab,
            late_scale: bool,
        ) {
            // SAFETY: forwarded caller guarantees.
            unsafe { tile::<WQ, RN, RM, false>(w, ldw, x, ldx, d, ldd, nblk, tab, late_scale) }
        }

        /// [`tile`] for longer rows (without the L2 stream).
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn long_tile<const WQ: u8, const RN: usize, const RM: usize>(
            w: *const u8,
            ldw: usize,
            x: *const f32,
            ldx: usize,
            d: *mut f32,
            ldd: usize,
            nblk: usize,
            tab: F16Tab,
            late_scale: bool,
        ) {
            // SAFETY: forwarded caller guarantees.
            unsafe { tile::<WQ, RN, RM, true>(w, ldw, x, ldx, d, ldd, nblk, tab, late_scale) }
        }
    };
}

/// Prefetch distance of an `RN`-row tile.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn pf_rows<const RN: usize>() -> usize {
    if RN > PF_ROWS { RN } else { PF_ROWS }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;

    /// `RN x RM` outputs over all blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const WQ: u8, const RN: usize, const RM: usize, const LONG: bool>(
        w: *const u8,
        ldw: usize,
        x: *const f32,
        ldx: usize,
        d: *mut f32,
        ldd: usize,
        nblk: usize,
        tab: F16Tab,
        late_scale: bool,
    ) {
        let bs = const { block_bytes(WQ) };
        let pf = pf_rows::<RN>() * ldw;
        // A Q4 block's 16 possible weights are `iota * d (+ m)`.
        let iota = if WQ == Q4_0 {
            _mm512_setr_ps(
                -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0,
                7.0,
            )
        } else {
            _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                15.0,
            )
        };
        let mut acc = [[_mm512_setzero_ps(); RM]; RN];
        let (ah, lps) = if LONG {
            (0, 0)
        } else {
            l2_stream::<RN>(ldw, nblk)
        };
        for blk in 0..nblk {
            for i in 0..lps {
                prefetch_l2(w.wrapping_add(ah + (blk * lps + i) * 64));
            }
            let mut xv = [[_mm512_setzero_ps(); 2]; RM];
            for (m, v) in xv.iter_mut().enumerate() {
                // SAFETY: block blk of activation row m (32 floats).
                unsafe {
                    let p = x.add(m * ldx + blk * BLK);
                    *v = [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))];
                }
            }
            for (r, accr) in acc.iter_mut().enumerate() {
                // SAFETY: block blk of weight row r (header and quants).
                let wb = unsafe { w.add(r * ldw + blk * bs) };
                prefetch(wb.wrapping_add(pf));
                // SAFETY: as above.
                let dv = _mm512_set1_ps(unsafe { tab.get(wb) });
                if WQ == Q8_0 || WQ == Q5_0 {
                    // SAFETY: the block's 32 quants follow its scale (Q5_0: its bits).
                    let (q0, q1) = unsafe {
                        if WQ == Q5_0 {
                            let b = _mm256_sub_epi8(q5_0_avx2(wb), _mm256_set1_epi8(16));
                            (
                                _mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)),
                                _mm512_cvtepi8_epi32(_mm256_extracti128_si256::<1>(b)),
                            )
                        } else {
                            (
                                _mm512_cvtepi8_epi32(_mm_loadu_si128(wb.add(2).cast())),
                                _mm512_cvtepi8_epi32(_mm_loadu_si128(wb.add(18).cast())),
                            )
                        }
                    };
                    let (q0, q1) = (_mm512_cvtepi32_ps(q0), _mm512_cvtepi32_ps(q1));
                    if late_scale {
                        // The block's dot product with the integer quants, scaled once: 3
                        // operations per output where scaling the weights first takes 4.
                        for (a, xm) in accr.iter_mut().zip(&xv) {
                            let t = _mm512_fmadd_ps(q1, xm[1], _mm512_mul_ps(q0, xm[0]));
                            *a = _mm512_fmadd_ps(t, dv, *a);
                        }
                    } else {
                        let (w0, w1) = (_mm512_mul_ps(q0, dv), _mm512_mul_ps(q1, dv));
                        for (a, xm) in accr.iter_mut().zip(&xv) {
                            *a = _mm512_fmadd_ps(w1, xm[1], _mm512_fmadd_ps(w0, xm[0], *a));
                        }
                    }
                    continue;
                }
                let (table, qs) = if WQ == Q4_0 {
                    (_mm512_mul_ps(iota, dv), wb.wrapping_add(2))
                } else {
                    // SAFETY: the block's min follows its scale.
                    let mv = _mm512_set1_ps(unsafe { tab.get(wb.add(2)) });
                    (_mm512_fmadd_ps(iota, dv, mv), wb.wrapping_add(4))
                };
                // The nibbles index the table: vpermps reads the low 4 bits of each lane, so
                // the low nibbles need no mask.
                // SAFETY: the block's 16 quant bytes.
                let idx = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(qs.cast()) });
                let w0 = _mm512_permutexvar_ps(idx, table);
                let w1 = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(idx), table);
                for (a, xm) in accr.iter_mut().zip(&xv) {
                    *a = _mm512_fmadd_ps(w1, xm[1], _mm512_fmadd_ps(w0, xm[0], *a));
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

    row_length_tiles!("avx512f,avx512bw,avx512vl,avx2,fma,f16c");

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn block<const WQ: u8>(b: &QF32Block, tab: F16Tab) {
        let late = b.gemv;
        match (b.m == 1, b.ldw > L2_STREAM_MAX_ROW) {
            (true, false) => drive_tiles!(b, short_tile, WQ, 8, [1], (b.nblk, tab, late)),
            (true, true) => drive_tiles!(b, long_tile, WQ, 8, [1], (b.nblk, tab, late)),
            (false, false) => {
                drive_tiles!(b, short_tile, WQ, 4, [4, 3, 2, 1], (b.nblk, tab, late))
            }
            (false, true) => drive_tiles!(b, long_tile, WQ, 4, [4, 3, 2, 1], (b.nblk, tab, late)),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use crate::cpu::simd::hsum256;

    /// The 32 weights of the block at `wb` as four vectors of 8, in element order.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dequant<const WQ: u8>(wb: *const u8, tab: F16Tab) -> [__m256; 4] {
        // SAFETY: the block (header and quants) is readable.
        unsafe {
            let d = _mm256_set1_ps(tab.get(wb));
            if WQ == Q5_0 {
                let (q, _) = q8_ints::<Q5_0>(wb, tab);
                return q.map(|v| _mm256_mul_ps(v, d));
            }
            if WQ == Q8_0 {
                let q = |i: usize| {
                    let b = _mm_loadl_epi64(wb.add(2 + 8 * i).cast());
                    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d)
                };
                return [q(0), q(1), q(2), q(3)];
            }
            // Q4_0: (q - 8) * d = q * d + (-8 d), exact in one FMA; Q4_1: q * d + m.
            let (c, qs) = if WQ == Q4_0 {
                (_mm256_mul_ps(_mm256_set1_ps(-8.0), d), wb.add(2))
            } else {
                (_mm256_set1_ps(tab.get(wb.add(2))), wb.add(4))
            };
            let bytes = _mm_loadu_si128(qs.cast());
            let mask = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(bytes, mask);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(bytes), mask);
            let f = |v: __m128i| _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), d, c);
            [
                f(lo),
                f(_mm_srli_si128::<8>(lo)),
                f(hi),
                f(_mm_srli_si128::<8>(hi)),
            ]
        }
    }

    /// The 32 integer quants of the Q8_0 block at `wb` as four vectors of 8, and its scale.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn q8_ints<const WQ: u8>(wb: *const u8, tab: F16Tab) -> ([__m256; 4], __m256) {
        // SAFETY: the block (scale and quants) is readable.
        unsafe {
            if WQ == Q5_0 {
                let b = _mm256_sub_epi8(q5_0_avx2(wb), _mm256_set1_epi8(16));
                let (lo, hi) = (_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b));
                let f = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
                let q = [
                    f(lo),
                    f(_mm_srli_si128::<8>(lo)),
                    f(hi),
                    f(_mm_srli_si128::<8>(hi)),
                ];
                return (q, _mm256_set1_ps(tab.get(wb)));
            }
            let q = |i: usize| {
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    wb.add(2 + 8 * i).cast(),
                )))
            };
            ([q(0), q(1), q(2), q(3)], _mm256_set1_ps(tab.get(wb)))
        }
    }

    /// `RN x RM` outputs over all blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const WQ: u8, const RN: usize, const RM: usize, const LONG: bool>(
        w: *const u8,
        ldw: usize,
        x: *const f32,
        ldx: usize,
        d: *mut f32,
        ldd: usize,
        nblk: usize,
        tab: F16Tab,
        late_scale: bool,
    ) {
        let bs = const { block_bytes(WQ) };
        let pf = pf_rows::<RN>() * ldw;
        // Two accumulators per output (even and odd vectors of a block) halve the FMA chains.
        let mut acc = [[[_mm256_setzero_ps(); 2]; RM]; RN];
        let (ah, lps) = if LONG {
            (0, 0)
        } else {
            l2_stream::<RN>(ldw, nblk)
        };
        let mask = _mm_set1_epi8(0x0f);
        for blk in 0..nblk {
            for i in 0..lps {
                prefetch_l2(w.wrapping_add(ah + (blk * lps + i) * 64));
            }
            // Q4_1 matrix-vector products: the block's activation sum (lane-wise), for the
            // min term `m * sum(x)`.
            let sx = if WQ == Q4_1 && late_scale {
                // SAFETY: 32 floats of block blk of activation row 0.
                unsafe {
                    let p = x.add(blk * BLK);
                    _mm256_add_ps(
                        _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))),
                        _mm256_add_ps(_mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))),
                    )
                }
            } else {
                _mm256_setzero_ps()
            };
            for (r, accr) in acc.iter_mut().enumerate() {
                // SAFETY: block blk of weight row r.
                let wb = unsafe { w.add(r * ldw + blk * bs) };
                prefetch(wb.wrapping_add(pf));
                if (WQ == Q4_0 || WQ == Q4_1) && late_scale {
                    // Q4 matrix-vector product: the dot product with the integer quants
                    // (`q - 8` for Q4_0, as signed bytes), scaled once per block, plus
                    // `m * sum(x)` for Q4_1; no dequantized weights live across the block,
                    // so the 4-row tile keeps everything in registers.
                    // SAFETY: the block's header and 16 quant bytes; 32 activations.
                    unsafe {
                        let qs = _mm_loadu_si128(wb.add(if WQ == Q4_0 { 2 } else { 4 }).cast());
                        let mut lo = _mm_and_si128(qs, mask);
                        let mut hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), mask);
                        if WQ == Q4_0 {
                            let eight = _mm_set1_epi8(8);
                            lo = _mm_sub_epi8(lo, eight);
                            hi = _mm_sub_epi8(hi, eight);
                        }
                        let f = |v: __m128i| {
                            _mm256_cvtepi32_ps(if WQ == Q4_0 {
                                _mm256_cvtepi8_epi32(v)
                            } else {
                                _mm256_cvtepu8_epi32(v)
                            })
                        };
                        let xp = x.add(blk * BLK);
                        let xv = |i: usize| _mm256_loadu_ps(xp.add(8 * i));
                        let t0 = _mm256_fmadd_ps(
                            f(_mm_srli_si128::<8>(lo)),
                            xv(1),
                            _mm256_mul_ps(f(lo), xv(0)),
                        );
                        let t1 = _mm256_fmadd_ps(
                            f(_mm_srli_si128::<8>(hi)),
                            xv(3),
                            _mm256_mul_ps(f(hi), xv(2)),
                        );
                        let a = &mut accr[0];
                        let dv = _mm256_set1_ps(tab.get(wb));
                        a[0] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), dv, a[0]);
                        if WQ == Q4_1 {
                            a[1] = _mm256_fmadd_ps(sx, _mm256_set1_ps(tab.get(wb.add(2))), a[1]);
                        }
                    }
                    continue;
                }
                if (WQ == Q8_0 || WQ == Q5_0) && late_scale {
                    // The block's dot products with the integer quants, scaled once per 16
                    // weights: 3 operations per 8 weights where scaling them first takes 4
                    // (10% of a cached M = 1 product on Zen 2).
                    // SAFETY: as above.
                    let (q, dv) = unsafe { q8_ints::<WQ>(wb, tab) };
                    for (m, a) in accr.iter_mut().enumerate() {
                        // SAFETY: 32 floats of block blk of activation row m.
                        let xv = |i: usize| unsafe {
                            _mm256_loadu_ps(x.add(m * ldx + blk * BLK + 8 * i))
                        };
                        let t0 = _mm256_fmadd_ps(q[1], xv(1), _mm256_mul_ps(q[0], xv(0)));
                        let t1 = _mm256_fmadd_ps(q[3], xv(3), _mm256_mul_ps(q[2], xv(2)));
                        a[0] = _mm256_fmadd_ps(t0, dv, a[0]);
                        a[1] = _mm256_fmadd_ps(t1, dv, a[1]);
                    }
                    continue;
                }
                // SAFETY: as above.
                let wv = unsafe { dequant::<WQ>(wb, tab) };
                for (m, a) in accr.iter_mut().enumerate() {
                    for (i, wi) in wv.iter().enumerate() {
                        // SAFETY: 8 floats of block blk of activation row m.
                        let xv = unsafe { _mm256_loadu_ps(x.add(m * ldx + blk * BLK + 8 * i)) };
                        a[i % 2] = _mm256_fmadd_ps(*wi, xv, a[i % 2]);
                    }
                }
            }
        }
        for (r, accr) in acc.iter().enumerate() {
            for (m, a) in accr.iter().enumerate() {
                // SAFETY: the output element is in the caller's block.
                unsafe { *d.add(m * ldd + r) = hsum256(_mm256_add_ps(a[0], a[1])) };
            }
        }
    }

    row_length_tiles!("avx2,fma,f16c");

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn block<const WQ: u8>(b: &QF32Block, tab: F16Tab) {
        match (b.m == 1, b.ldw > L2_STREAM_MAX_ROW) {
            (true, false) => drive_tiles!(b, short_tile, WQ, 4, [1], (b.nblk, tab, b.gemv)),
            (true, true) => drive_tiles!(b, long_tile, WQ, 4, [1], (b.nblk, tab, b.gemv)),
            (false, false) => drive_tiles!(b, short_tile, WQ, 2, [2, 1], (b.nblk, tab, false)),
            (false, true) => drive_tiles!(b, long_tile, WQ, 2, [2, 1], (b.nblk, tab, false)),
        }
    }
}
