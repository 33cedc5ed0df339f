//! Q8_0, Q4_0 and Q5_0 weights times 8-bit activations on AVX-512 (VNNI), two blocks per
//! vector: the unsigned weights `u = w + off` of blocks `2p` and `2p + 1` (as [`super::quant`]
//! forms them) in one 512-bit vector, one `vpdpbusd` with the two activation blocks into 16
//! i32 lanes that start at `-off * sum(y)` of their block, converted, multiplied by the two
//! activation scales and accumulated with the two weight scales: per 64 weights four
//! operations per output where the 256-bit kernel takes eight. The weight vector and its
//! scales are formed once per tile and serve the tile's activation rows. Numbers as ggml-cpu's
//! `ggml_vec_dot_q8_0_q8_0` (integer dot per block, scaled by `d_w * d_y`).
//!
//! A row with an odd number of blocks ends with a half-filled vector (the upper lanes zero).
//! Tiles 4 x 1 for M = 1 and 4 x {4, 2, 1} otherwise; an output's operations do not depend on
//! its tile, so results do not depend on the thread count.

use super::dequant::{nibbles_avx2, q5_0_avx2};
use super::kquant::f16_at;
use super::quant::{
    ActLayout, BLK, PF_ROWS, Q5_0, Q8_0, QuantBlock, block_bytes, l2_stream, prefetch, prefetch_l2,
};
use std::arch::x86_64::*;

/// The 32 unsigned quants `u = w + off` of the block at `wb`.
///
/// # Safety
/// `wb` readable for one block of `WQ`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn unsigned<const WQ: u8>(wb: *const u8) -> __m256i {
    // SAFETY: the caller's block.
    unsafe {
        match WQ {
            Q8_0 => _mm256_xor_si256(_mm256_loadu_si256(wb.add(2).cast()), _mm256_set1_epi8(-128)),
            Q5_0 => q5_0_avx2(wb),
            _ => nibbles_avx2(wb.add(2), _mm256_set1_epi8(0x0f)),
        }
    }
}

/// Two 8-lane halves: `lo` in lanes 0-7, `hi` in lanes 8-15.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn halves(lo: f32, hi: f32) -> __m512 {
    let lo = _mm512_castps_pd(_mm512_set1_ps(lo));
    let hi = _mm256_castps_pd(_mm256_set1_ps(hi));
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(lo, hi))
}

/// `RN x RM` outputs over all blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const WQ: u8, const RN: usize, const RM: usize>(
    w: *const u8,
    ldw: usize,
    a: *const u8,
    lay: ActLayout,
    d: *mut f32,
    ldd: usize,
) {
    let bs = const { block_bytes(WQ) };
    let off = _mm512_set1_epi8(match WQ {
        Q8_0 => -128,
        Q5_0 => 16,
        _ => 8,
    });
    let tab = crate::cpu::simd::f16_table().as_ptr();
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); RM]; RN];
    let (ah, lps) = l2_stream::<RN>(ldw, lay.nblk);
    let mut blk = 0;
    while blk < lay.nblk {
        let two = blk + 1 < lay.nblk;
        // Each pair of blocks covers the prefetch of both.
        for i in 0..2 * lps {
            prefetch_l2(w.wrapping_add(ah + (blk * lps + i) * 64));
        }
        let mut y = [zero; RM];
        let mut init = [zero; RM];
        let mut dy = [_mm512_setzero_ps(); RM];
        for m in 0..RM {
            // SAFETY: blocks blk (and blk + 1) of activation row m, and their scales.
            unsafe {
                let ar = a.add(m * lay.row_bytes);
                let q = ar.add(blk * BLK);
                let ds = ar.add(lay.d_off()).cast::<f32>().add(blk);
                (y[m], dy[m]) = if two {
                    (_mm512_loadu_si512(q.cast()), halves(*ds, *ds.add(1)))
                } else {
                    let y0 = _mm256_loadu_si256(q.cast());
                    (_mm512_zextsi256_si512(y0), halves(*ds, 0.0))
                };
            }
            // -off * sum(y) of each block, spread over its 8 lanes.
            init[m] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, off, y[m]));
        }
        for (r, accr) in acc.iter_mut().enumerate() {
            // SAFETY: blocks blk (and blk + 1) of weight row r.
            let (u, dw) = unsafe {
                let wb = w.add(r * ldw + blk * bs);
                prefetch(wb.wrapping_add(PF_ROWS * ldw));
                if two {
                    let u = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(unsigned::<WQ>(wb)),
                        unsigned::<WQ>(wb.add(bs)),
                    );
                    (u, halves(f16_at(tab, wb), f16_at(tab, wb.add(bs))))
                } else {
                    let u = _mm512_zextsi256_si512(unsigned::<WQ>(wb));
                    (u, halves(f16_at(tab, wb), 0.0))
                }
            };
            for (m, a) in accr.iter_mut().enumerate() {
                let p32 = _mm512_dpbusd_epi32(init[m], u, y[m]);
                let t = _mm512_mul_ps(_mm512_cvtepi32_ps(p32), dy[m]);
                *a = _mm512_fmadd_ps(t, dw, *a);
            }
        }
        blk += 2;
    }
    for (r, accr) in acc.iter().enumerate() {
        for (m, v) in accr.iter().enumerate() {
            // SAFETY: the output element is in the caller's block.
            unsafe { *d.add(m * ldd + r) = _mm512_reduce_add_ps(*v) };
        }
    }
}

/// Walk an `n x m` block in tiles: 4 weight rows at a time (leftover rows one at a time),
/// activation rows 4, 2 or 1 at a time; `f(n0, m0, rows, cols)` computes one tile. Shared with
/// [`super::kquant512`].
#[inline(always)]
pub(super) fn for_tiles(n: usize, m: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
    let mut n0 = 0;
    while n0 < n {
        let rows = if n - n0 >= 4 { 4 } else { 1 };
        let mut m0 = 0;
        while m0 < m {
            let cols = match m - m0 {
                1 => 1,
                2 | 3 => 2,
                _ => 4,
            };
            f(n0, m0, rows, cols);
            m0 += cols;
        }
        n0 += rows;
    }
}

/// Compute one block (weights Q8_0, Q4_0 or Q5_0) in the tiles of [`for_tiles`].
///
/// # Safety
/// As [`super::quant::block`]; the CPU has AVX-512 BW, VL and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn block<const WQ: u8>(b: &QuantBlock) {
    for_tiles(b.n, b.m, |n0, m0, rows, cols| {
        // SAFETY: weight rows n0..n0 + rows <= b.n, activation rows m0..m0 + cols <= b.m and
        // their outputs are inside the caller's block.
        unsafe {
            let (w, a, d) = (
                b.w.add(n0 * b.ldw),
                b.a.add(m0 * b.lay.row_bytes),
                b.d.add(m0 * b.ldd + n0),
            );
            let (l, ly, ld) = (b.ldw, b.lay, b.ldd);
            match (rows, cols) {
                (4, 4) => tile::<WQ, 4, 4>(w, l, a, ly, d, ld),
                (4, 2) => tile::<WQ, 4, 2>(w, l, a, ly, d, ld),
                (4, _) => tile::<WQ, 4, 1>(w, l, a, ly, d, ld),
                (_, 4) => tile::<WQ, 1, 4>(w, l, a, ly, d, ld),
                (_, 2) => tile::<WQ, 1, 2>(w, l, a, ly, d, ld),
                _ => tile::<WQ, 1, 1>(w, l, a, ly, d, ld),
            }
        }
    });
}
