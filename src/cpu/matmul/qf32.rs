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
//!   index lane, so the low nibbles need no masking); Q8_0 widens the bytes and converts them;
//!   Q5_0 widens its nibble bytes once and takes the fifth bits as lane masks (`q5_0_ints`).
//!   Tiles 8 x 1 for M = 1, 4 x {4, 3, 2, 1} otherwise.
//! - AVX2 + FMA + F16C: nibbles widened to i32 straight from memory (`vpmovzxbd`, each dword
//!   holding elements j and j + 16), Q5_0's quants decoded to bytes one group of 8 blocks
//!   ahead and widened from there, converted, scaled with one FMA per 8 weights.
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
                            q5_0_ints(wb)
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

    /// A Q5_0 block's 32 quants `q - 16` as i32 (elements 0..16, 16..32): the nibble bytes
    /// widened once to dwords, the low nibbles masked and the high ones shifted down, and the
    /// fifth bits taken as two 16-bit lane masks straight from `qh` (bit j is element j's,
    /// ggml-common.h `block_q5_0`): `q - 16` is the nibble minus 16 where the bit is clear.
    /// About 7 operations per block, one of them on the shuffle port, where going through
    /// [`q5_0_avx2`]'s bytes took about 12, seven on it.
    ///
    /// # Safety
    /// `wb` readable for one Q5_0 block.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn q5_0_ints(wb: *const u8) -> (__m512i, __m512i) {
        // SAFETY: `qh` (bytes 2..6) and the 16 quant bytes (6..22) of the block.
        // (Unaligned reads: a block is 22 bytes, so `qh` has no alignment to rely on.)
        let (b, k0, k1) = unsafe {
            (
                _mm512_cvtepu8_epi32(_mm_loadu_si128(wb.add(6).cast())),
                wb.add(2).cast::<u16>().read_unaligned(),
                wb.add(4).cast::<u16>().read_unaligned(),
            )
        };
        let s = _mm512_set1_epi32(16);
        let lo = _mm512_and_si512(b, _mm512_set1_epi32(0x0f));
        let hi = _mm512_srli_epi32::<4>(b);
        // The lanes whose fifth bit is clear get the nibble minus 16.
        (
            _mm512_mask_sub_epi32(lo, !k0, lo, s),
            _mm512_mask_sub_epi32(hi, !k1, hi, s),
        )
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
    use std::mem::MaybeUninit;

    /// Blocks per decoded group ([`decode_group`]): 256 weights a row, as the K-quants.
    const GROUP: usize = 8;

    /// The quants of the Q5_0 block at `wb` as 32 signed bytes `q - 16` in element order.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn quant_bytes(wb: *const u8) -> __m256i {
        // SAFETY: the caller guarantees one readable block.
        unsafe { _mm256_sub_epi8(q5_0_avx2(wb), _mm256_set1_epi8(16)) }
    }

    /// Q5_0 blocks `first..first + count` (`count <= GROUP`) of each of the `RN` rows at
    /// `w + r * ldw` as quant bytes ([`quant_bytes`]), row r's block `first + j` at
    /// `out + (r * GROUP + j) * 32`. The tile decodes group g + 1 while it multiplies group g,
    /// and widens the stored bytes with a load-operand `vpmovsxbd`: on Zen 2 (M = 1,
    /// K = N = 4096, one copy of the weights) that measured 1.2x faster than
    /// widening the same bytes from registers (a lane extract, two byte shifts and four
    /// register widenings per block, on the two shuffle pipes), with the same products in
    /// the same order, so the same bits. Widening right after the store stalls on
    /// store-to-load forwarding instead; one group of distance avoids it.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn decode_group<const RN: usize>(
        out: *mut u8,
        w: *const u8,
        ldw: usize,
        first: usize,
        count: usize,
    ) {
        let bs = const { block_bytes(Q5_0) };
        for r in 0..RN {
            for j in 0..count {
                // SAFETY: block first + j of row r exists; the buffer holds RN x GROUP blocks.
                unsafe {
                    let q = quant_bytes(w.add(r * ldw + (first + j) * bs));
                    _mm256_storeu_si256(out.add((r * GROUP + j) * BLK).cast(), q);
                }
            }
        }
    }

    /// The 32 quants at `p` as four vectors of 8 f32 in element order: Q5_0's decoded bytes
    /// and Q8_0's own, sign-extended; Q4_0's and Q4_1's 16 nibble bytes widened from
    /// memory eight at a time (`vpmovzxbd`), each dword's low nibble giving element j and its
    /// high nibble element j + 16 (Q4_0 less 8): the same integers as decoding them to bytes
    /// first, with no byte shuffles.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn ints<const WQ: u8>(p: *const u8) -> [__m256; 4] {
        // SAFETY (both): the caller guarantees 32 (Q4: 16) readable bytes.
        let load = |i: usize| unsafe { _mm_loadl_epi64(p.add(8 * i).cast()) };
        if WQ == Q4_0 || WQ == Q4_1 {
            let (mask, eight) = (_mm256_set1_epi32(0x0f), _mm256_set1_epi32(8));
            let v = [_mm256_cvtepu8_epi32(load(0)), _mm256_cvtepu8_epi32(load(1))];
            let q = [
                _mm256_and_si256(v[0], mask),
                _mm256_and_si256(v[1], mask),
                _mm256_srli_epi32::<4>(v[0]),
                _mm256_srli_epi32::<4>(v[1]),
            ];
            return q.map(|q| {
                _mm256_cvtepi32_ps(if WQ == Q4_0 {
                    _mm256_sub_epi32(q, eight)
                } else {
                    q
                })
            });
        }
        [0, 1, 2, 3].map(|i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load(i))))
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
        // Two groups of Q5_0's decoded quant bytes ([`decode_group`]); the others read their
        // own.
        let decoded = WQ == Q5_0;
        let mut buf = MaybeUninit::<[[[u8; GROUP * BLK]; RN]; 2]>::uninit();
        let buf = buf.as_mut_ptr().cast::<u8>();
        let slot = |g: usize| buf.wrapping_add((g % 2) * RN * GROUP * BLK);
        if decoded && nblk > 0 {
            // SAFETY: blocks 0..count of every row; slot 0 holds RN x GROUP blocks.
            unsafe { decode_group::<RN>(slot(0), w, ldw, 0, nblk.min(GROUP)) };
        }
        for blk in 0..nblk {
            let (g, j) = (blk / GROUP, blk % GROUP);
            if decoded && j == 0 && (g + 1) * GROUP < nblk {
                let first = (g + 1) * GROUP;
                // SAFETY: as above, for the next group and the other slot.
                unsafe {
                    decode_group::<RN>(slot(g + 1), w, ldw, first, (nblk - first).min(GROUP))
                };
            }
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
                let qp = match WQ {
                    Q5_0 => slot(g).wrapping_add((r * GROUP + j) * BLK).cast_const(),
                    Q4_1 => wb.wrapping_add(4),
                    _ => wb.wrapping_add(2),
                };
                // SAFETY: 32 quant bytes (decoded above, or the block's own).
                let q = unsafe { ints::<WQ>(qp) };
                // SAFETY: the block's f16 scale.
                let dv = _mm256_set1_ps(unsafe { tab.get(wb) });
                if (WQ == Q4_0 || WQ == Q4_1) && late_scale {
                    // Q4 matrix-vector product: the dot product with the integer quants
                    // (`q - 8` for Q4_0), scaled once per block, plus `m * sum(x)` for Q4_1;
                    // no dequantized weights live across the block, so the 4-row tile keeps
                    // everything in registers.
                    // SAFETY: 32 activations of block blk.
                    let xv = |i: usize| unsafe { _mm256_loadu_ps(x.add(blk * BLK + 8 * i)) };
                    let t0 = _mm256_fmadd_ps(q[1], xv(1), _mm256_mul_ps(q[0], xv(0)));
                    let t1 = _mm256_fmadd_ps(q[3], xv(3), _mm256_mul_ps(q[2], xv(2)));
                    let a = &mut accr[0];
                    a[0] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), dv, a[0]);
                    if WQ == Q4_1 {
                        // SAFETY: the block's f16 minimum.
                        let mv = _mm256_set1_ps(unsafe { tab.get(wb.add(2)) });
                        a[1] = _mm256_fmadd_ps(sx, mv, a[1]);
                    }
                    continue;
                }
                if (WQ == Q8_0 || WQ == Q5_0) && late_scale {
                    // The block's dot products with the integer quants, scaled once per 16
                    // weights: 3 operations per 8 weights where scaling them first takes 4
                    // (10% of a cached M = 1 product on Zen 2).
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
                // The weights: `q * d` (Q8_0; Q4_0 and Q5_0 with their offsets in `q`: one
                // rounding of the exact product, as the reference), or `q * d + m` in one FMA
                // (Q4_1).
                let wv = if WQ == Q4_1 {
                    // SAFETY: the block's f16 minimum.
                    let mv = _mm256_set1_ps(unsafe { tab.get(wb.add(2)) });
                    q.map(|v| _mm256_fmadd_ps(v, dv, mv))
                } else {
                    q.map(|v| _mm256_mul_ps(v, dv))
                };
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
