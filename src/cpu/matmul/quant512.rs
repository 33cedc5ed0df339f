//! Q8_0, Q4_0, Q4_1 and Q5_0 weights times 8-bit activations on AVX-512 (VNNI), two blocks
//! per vector: the unsigned weights `u = w + off` of blocks `2p` and `2p + 1` (as
//! [`super::quant`] forms them) in one 512-bit vector, one `vpdpbusd` with the two activation
//! blocks into 16 i32 lanes that start at `-off * sum(y)` of their block, converted, multiplied
//! by the two activation scales and accumulated with the two weight scales: per 64 weights four
//! operations per output where the 256-bit kernel takes eight. Q4_1 (off = 0) adds its blocks'
//! minimums times `s / 8` of the activation blocks (ggml's `block_q8_1.s` term), one more
//! multiply-add. The weight vector and its scales are formed once per tile and serve the
//! tile's activation rows. Numbers as ggml-cpu's `ggml_vec_dot_q8_0_q8_0` and
//! `ggml_vec_dot_q4_1_q8_1` (integer dot per block, scaled by `d_w * d_y`, plus `m_w * s_y`).
//!
//! A row with an odd number of blocks ends with a half-filled vector (the upper lanes zero).
//! The activation scales of each pair come as vectors the quantization stage formed
//! ([`ActLayout::with_vectors`]). Tiles 2 x 8 for each 8 activation rows, then 4 x {4, 2, 1};
//! an output's operations do not depend on its tile, so results do not depend on the thread
//! count.

use super::dequant::{nibbles_avx2, q5_0_avx2};
use super::kquant::f16_at;
use super::lanes512;
use super::quant::{
    ActLayout, BLK, PAIR_VEC_BYTES, PF_ROWS, Q4_0, Q4_1, Q5_0, Q8_0, QuantBlock, block_bytes,
    l2_stream, prefetch, prefetch_l2,
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
            Q4_1 => nibbles_avx2(wb.add(4), _mm256_set1_epi8(0x0f)),
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

/// Weight blocks `blk` and, when `TWO`, `blk + 1` at `wb`: their unsigned quants, scales and
/// (Q4_1) minimums, block `blk` in the lower halves (the upper halves zero without `TWO`).
///
/// # Safety
/// `wb` readable for one block of `WQ`, two when `TWO`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn weights<const WQ: u8, const TWO: bool>(
    wb: *const u8,
    tab: *const f32,
) -> (__m512i, __m512, __m512) {
    let bs = const { block_bytes(WQ) };
    // Q4_1's minimum follows its scale.
    // SAFETY (whole body): the caller's blocks.
    let min = |b: *const u8| {
        if WQ == Q4_1 {
            unsafe { f16_at(tab, b.add(2)) }
        } else {
            0.0
        }
    };
    unsafe {
        if TWO {
            let u = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(unsigned::<WQ>(wb)),
                unsigned::<WQ>(wb.add(bs)),
            );
            let dw = halves(f16_at(tab, wb), f16_at(tab, wb.add(bs)));
            (u, dw, halves(min(wb), min(wb.add(bs))))
        } else {
            let u = _mm512_zextsi256_si512(unsigned::<WQ>(wb));
            (u, halves(f16_at(tab, wb), 0.0), halves(min(wb), 0.0))
        }
    }
}

/// One pair of blocks (`blk`, `blk + 1`; only `blk` without `TWO`) of an `RN x RM` tile:
/// each weight row's vectors formed once, then each activation row's quants and vectors loaded
/// once and used for every weight row.
///
/// # Safety
/// As [`tile`], `blk` (and `blk + 1` when `TWO`) below `lay.nblk`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
#[allow(clippy::needless_range_loop)] // m and r index the accumulators and the vectors
unsafe fn pair<const WQ: u8, const RN: usize, const RM: usize, const TWO: bool>(
    w: *const u8,
    ldw: usize,
    a: *const u8,
    lay: ActLayout,
    blk: usize,
    tab: *const f32,
    acc: &mut [[__m512; RM]; RN],
) {
    let bs = const { block_bytes(WQ) };
    let mut u = [_mm512_setzero_si512(); RN];
    let mut dw = [_mm512_setzero_ps(); RN];
    let mut mw = [_mm512_setzero_ps(); RN];
    for r in 0..RN {
        // SAFETY: blocks blk (and blk + 1) of weight row r.
        unsafe {
            let wb = w.add(r * ldw + blk * bs);
            prefetch(wb.wrapping_add(PF_ROWS * ldw));
            (u[r], dw[r], mw[r]) = weights::<WQ, TWO>(wb, tab);
        }
    }
    for m in 0..RM {
        // SAFETY: activation row m's quants from block blk on (64 bytes: for a last odd block
        // the upper 32 are the row's `d` array or vectors, multiplied by zero weights) and its
        // pair blk / 2's vectors: `d`, then `s / 8` (Q4_1) or `-off * sum(y)`.
        let (y, dy, sy, init) = unsafe {
            let ar = a.add(m * lay.row_bytes);
            let v = ar.add(lay.v_off() + blk / 2 * PAIR_VEC_BYTES).cast::<f32>();
            let (sy, init) = if WQ == Q4_1 {
                (_mm512_loadu_ps(v.add(16)), _mm512_setzero_si512())
            } else {
                (_mm512_setzero_ps(), _mm512_loadu_si512(v.add(16).cast()))
            };
            let y = _mm512_loadu_si512(ar.add(blk * BLK).cast());
            (y, _mm512_loadu_ps(v), sy, init)
        };
        for r in 0..RN {
            let p32 = _mm512_dpbusd_epi32(init, u[r], y);
            let t = _mm512_mul_ps(_mm512_cvtepi32_ps(p32), dy);
            acc[r][m] = _mm512_fmadd_ps(t, dw[r], acc[r][m]);
            if WQ == Q4_1 {
                acc[r][m] = _mm512_fmadd_ps(mw[r], sy, acc[r][m]);
            }
        }
    }
}

/// `RN x RM` outputs over all blocks. The activation rows' scales come as vectors from their
/// rows' [`ActLayout::v_off`] section.
///
/// # Safety
/// As [`block`], for weight rows `0..RN` at `w` and activation rows `0..RM` at `a`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const WQ: u8, const RN: usize, const RM: usize>(
    w: *const u8,
    ldw: usize,
    a: *const u8,
    lay: ActLayout,
    d: *mut f32,
    ldd: usize,
) {
    let tab = crate::cpu::simd::f16_table().as_ptr();
    let mut acc = [[_mm512_setzero_ps(); RM]; RN];
    let (ah, lps) = l2_stream::<RN>(ldw, lay.nblk);
    let mut blk = 0;
    while blk + 1 < lay.nblk {
        // Each pair of blocks covers the prefetch of both.
        for i in 0..2 * lps {
            prefetch_l2(w.wrapping_add(ah + (blk * lps + i) * 64));
        }
        // SAFETY: blocks blk and blk + 1 exist; the caller's rows.
        unsafe { pair::<WQ, RN, RM, true>(w, ldw, a, lay, blk, tab, &mut acc) };
        blk += 2;
    }
    if blk < lay.nblk {
        // SAFETY: the last block, alone in its pair; the caller's rows.
        unsafe { pair::<WQ, RN, RM, false>(w, ldw, a, lay, blk, tab, &mut acc) };
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

/// Compute one block (weights Q8_0, Q4_0, Q4_1 or Q5_0). Q4_0, Q4_1 and Q8_0 with 8 or more
/// activation rows and 16 or more weight rows go to [`super::lanes512`] in its 16 x 8 tiles,
/// the rest here.
///
/// # Safety
/// As [`super::quant::block`], with the activation rows in [`ActLayout::with_vectors`]'s form;
/// the CPU has AVX-512 BW, VL and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn block<const WQ: u8>(b: &QuantBlock) {
    if (WQ == Q4_0 || WQ == Q4_1 || WQ == Q8_0) && lanes512::fits(b) {
        // SAFETY: the caller's block; `fits` holds.
        let (n16, m8) = unsafe { lanes512::block::<WQ>(b) };
        // SAFETY: the two sub-blocks left are inside the caller's block.
        unsafe {
            tiles::<WQ>(&sub(b, n16, b.n - n16, 0, m8));
            tiles::<WQ>(&sub(b, 0, b.n, m8, b.m - m8));
        }
    } else {
        // SAFETY: the caller's block.
        unsafe { tiles::<WQ>(b) };
    }
}

/// Weight rows `n0..n0 + n` and activation rows `m0..m0 + m` of `b`.
///
/// # Safety
/// The rows are inside `b`.
unsafe fn sub(b: &QuantBlock, n0: usize, n: usize, m0: usize, m: usize) -> QuantBlock {
    // SAFETY: the caller's rows.
    unsafe {
        QuantBlock {
            w: b.w.add(n0 * b.ldw),
            a: b.a.add(m0 * b.lay.row_bytes),
            d: b.d.add(m0 * b.ldd + n0),
            n,
            m,
            ..*b
        }
    }
}

/// `b` in tiles: activation rows 8 at a time in 2 x 8 tiles (each weight pair decoded once
/// for 8 rows; 16 accumulators), the rest in the tiles of [`for_tiles`].
///
/// # Safety
/// As [`block`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tiles<const WQ: u8>(b: &QuantBlock) {
    let (l, ly, ld) = (b.ldw, b.lay, b.ldd);
    let m8 = b.m / 8 * 8;
    let mut n0 = 0;
    while n0 < b.n && m8 > 0 {
        let rows = if b.n - n0 >= 2 { 2 } else { 1 };
        for m0 in (0..m8).step_by(8) {
            // SAFETY: weight rows n0..n0 + rows <= b.n, activation rows m0..m0 + 8 <= b.m and
            // their outputs are inside the caller's block.
            unsafe {
                let (w, a, d) = (
                    b.w.add(n0 * l),
                    b.a.add(m0 * ly.row_bytes),
                    b.d.add(m0 * ld + n0),
                );
                match rows {
                    2 => tile::<WQ, 2, 8>(w, l, a, ly, d, ld),
                    _ => tile::<WQ, 1, 8>(w, l, a, ly, d, ld),
                }
            }
        }
        n0 += rows;
    }
    for_tiles(b.n, b.m - m8, |n0, m0, rows, cols| {
        let m0 = m0 + m8;
        // SAFETY: weight rows n0..n0 + rows <= b.n, activation rows m0..m0 + cols <= b.m and
        // their outputs are inside the caller's block.
        unsafe {
            let (w, a, d) = (
                b.w.add(n0 * l),
                b.a.add(m0 * ly.row_bytes),
                b.d.add(m0 * ld + n0),
            );
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
