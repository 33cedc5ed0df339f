//! Q4_0, Q4_1 and Q8_0 weights times 8-bit activations on AVX-512 (VNNI) for 8 or more activation
//! rows, with 16 weight rows across the lanes of each vector: lane `p` of every vector belongs
//! to one weight row (output), so one `vpdpbusd` takes four quants of 16 rows against four
//! activation bytes broadcast from memory, a block's integer dot products of 16 outputs end in
//! one vector, and its scales are applied once per 16 outputs (one conversion, one multiply and
//! one or two multiply-adds) instead of once per output as in [`super::quant512`]'s tiles. No
//! horizontal sum is left at the end.
//!
//! The weights stay in ggml's layout (`block_q4_0`, `block_q4_1`, `block_q8_0`); each block
//! of 16 rows is transposed in registers: 16 bytes of each row are loaded four rows to a
//! vector (one row per 128-bit lane) and a 4 x 4 transpose of 32-bit words inside each 128-bit
//! lane (`vpunpck{l,h}dq`, `vpunpck{l,h}qdq`) leaves in vector `g` (`g < 4`) bytes
//! `4g..4g + 4` of every row. Q4: the low nibbles are quants `4g..4g + 4`, the high ones quants
//! `16 + 4g..`, as the activation bytes at the same positions; Q8_0 transposes its two halves
//! and flips the sign bits (`u = w + 128`). The transpose puts row `4a + l` in lane `4l + a`
//! (an involution), so the scales are gathered in that order and the sums are stored back in
//! row order by the same permutation.
//!
//! Numbers as [`super::quant512`] (and ggml-cpu's `ggml_vec_dot_q4_{0,1}_q8_{0,1}`): an exact
//! integer dot per block, `d_w * d_y` times it, plus `m_w * s_y` (Q4_1) or with
//! `-off * sum(y)` added to the integer dot (Q4_0: off = 8, Q8_0: off = 128). Each output adds
//! its blocks' terms one after another in one lane, where [`super::quant512`] spreads them over
//! 16 lanes and sums those at the end, so the two agree to f32 rounding, not bit for bit; which
//! of them computes an output depends only on its position (whole groups of 16 weight rows and
//! 8 activation rows, which the work items never cut: `plan::grid`), not on the thread count.

use super::quant::{ActLayout, BLK, PAIR_VEC_BYTES, Q4_0, Q4_1, Q8_0, QuantBlock, block_bytes};
use std::arch::x86_64::*;

/// Weight rows per tile (lanes of a 512-bit vector of i32).
pub(super) const ROWS: usize = 16;
/// Activation rows per tile.
pub(super) const ACTS: usize = 8;

/// Lane `p`'s weight row: the 4 x 4 transpose's permutation (`4l + a` <-> `4a + l`).
const fn row_of_lane(p: usize) -> usize {
    (p % 4) * 4 + p / 4
}

/// Whether [`tile`] can run `b` (weights Q4_0, Q4_1 or Q8_0): 16 weight rows of a block whose row stride fits the gather's
/// 32-bit offsets.
pub(super) fn fits(b: &QuantBlock) -> bool {
    b.n >= ROWS && b.m >= ACTS && ROWS * b.ldw < i32::MAX as usize
}

/// `ROWS x ACTS` outputs over all blocks: weight rows `0..16` at `w`, activation rows `0..8`
/// at `a`.
///
/// # Safety
/// As [`super::quant512::block`] for these rows; `ROWS * ldw` below `i32::MAX`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn tile<const WQ: u8>(
    w: *const u8,
    ldw: usize,
    a: *const u8,
    lay: ActLayout,
    d: *mut f32,
    ldd: usize,
) {
    let bs = const { block_bytes(WQ) };
    let qoff = if WQ == Q4_1 { 4 } else { 2 };
    debug_assert!(WQ == Q4_0 || WQ == Q4_1 || WQ == Q8_0);
    let mut lane_rows = [0i32; ROWS];
    for (p, o) in lane_rows.iter_mut().enumerate() {
        *o = (row_of_lane(p) * ldw) as i32;
    }
    // SAFETY: 16 i32.
    let gidx = unsafe { _mm512_loadu_si512(lane_rows.as_ptr().cast()) };
    let perm = gidx_perm();
    let nib = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); ACTS];
    for blk in 0..lay.nblk {
        // SAFETY (whole block): weight rows 0..16 hold block blk; activation rows 0..8 hold
        // block blk's quants, scale and sum, and their pair's vectors.
        unsafe {
            let wb = w.add(blk * bs);
            let u: [__m512i; 8] = if WQ == Q8_0 {
                // Bytes 4g..4g + 4 of each lane's row, made unsigned (u = w + 128).
                let lo = quads(wb.add(qoff), ldw);
                let hi = quads(wb.add(qoff + 16), ldw);
                let flip = _mm512_set1_epi8(-128);
                std::array::from_fn(|g| {
                    _mm512_xor_si512(if g < 4 { lo[g] } else { hi[g - 4] }, flip)
                })
            } else {
                // Quants 4g..4g + 4 (g < 4) and 16 + 4g.. (the high nibbles) of each lane's
                // row.
                let wq = quads(wb.add(qoff), ldw);
                std::array::from_fn(|g| {
                    if g < 4 {
                        _mm512_and_si512(wq[g], nib)
                    } else {
                        _mm512_and_si512(_mm512_srli_epi32::<4>(wq[g - 4]), nib)
                    }
                })
            };
            // Each lane's block header: the f16 scale, then (Q4_1) the f16 minimum.
            let hdr = _mm512_i32gather_epi32::<1>(gidx, wb.cast());
            let dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr));
            let mw = if WQ == Q4_1 {
                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(hdr)))
            } else {
                _mm512_setzero_ps()
            };
            for (m, accm) in acc.iter_mut().enumerate() {
                let ar = a.add(m * lay.row_bytes);
                let q = ar.add(blk * BLK).cast::<i32>();
                let mut p = if WQ == Q4_1 {
                    _mm512_setzero_si512()
                } else {
                    // -off * sum(y) of block blk, from its pair's vectors (first lane of its half).
                    let v = ar.add(lay.v_off() + blk / 2 * PAIR_VEC_BYTES + 64);
                    _mm512_set1_epi32(*v.cast::<i32>().add(blk % 2 * 8))
                };
                for (g, ug) in u.iter().enumerate() {
                    p = _mm512_dpbusd_epi32(p, *ug, _mm512_set1_epi32(q.add(g).read_unaligned()));
                }
                let dy = *ar.add(lay.d_off()).cast::<f32>().add(blk);
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(dy));
                *accm = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, *accm);
                if WQ == Q4_1 {
                    // s / 8 is stored; the minimum's term is m_w * s.
                    let s = *ar.add(lay.s_off()).cast::<f32>().add(blk) * 8.0;
                    *accm = _mm512_fmadd_ps(mw, _mm512_set1_ps(s), *accm);
                }
            }
        }
    }
    for (m, v) in acc.iter().enumerate() {
        // SAFETY: outputs 0..16 of activation row m are in the caller's block.
        unsafe { _mm512_storeu_ps(d.add(m * ldd), _mm512_permutexvar_ps(perm, *v)) };
    }
}

/// Sixteen bytes at `p` of each of 16 rows `ldw` apart, transposed in 32-bit words: vector `g`
/// holds bytes `4g..4g + 4` of row [`row_of_lane`]`(l)` in lane `l`.
///
/// # Safety
/// The 16 rows' bytes are readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn quads(p: *const u8, ldw: usize) -> [__m512i; 4] {
    // Rows 4a..4a + 4, one per 128-bit lane.
    // SAFETY: the caller's rows.
    let z: [__m512i; 4] = std::array::from_fn(|j| unsafe {
        let r = |i: usize| p.add((4 * j + i) * ldw).cast::<__m128i>();
        let v = _mm512_castsi128_si512(_mm_loadu_si128(r(0)));
        let v = _mm512_inserti32x4::<1>(v, _mm_loadu_si128(r(1)));
        let v = _mm512_inserti32x4::<2>(v, _mm_loadu_si128(r(2)));
        _mm512_inserti32x4::<3>(v, _mm_loadu_si128(r(3)))
    });
    let t0 = _mm512_unpacklo_epi32(z[0], z[1]);
    let t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    let t2 = _mm512_unpacklo_epi32(z[2], z[3]);
    let t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    [
        _mm512_unpacklo_epi64(t0, t2),
        _mm512_unpackhi_epi64(t0, t2),
        _mm512_unpacklo_epi64(t1, t3),
        _mm512_unpackhi_epi64(t1, t3),
    ]
}

/// The permutation back to row order (lane `p` takes the sum of the lane holding row `p`).
#[target_feature(enable = "avx512f")]
#[inline]
fn gidx_perm() -> __m512i {
    let mut idx = [0i32; ROWS];
    for (p, i) in idx.iter_mut().enumerate() {
        // row_of_lane is its own inverse.
        *i = row_of_lane(p) as i32;
    }
    // SAFETY: 16 i32.
    unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
}

/// `b`'s first `n / 16 * 16` weight rows times its first `m / 8 * 8` activation rows in tiles;
/// returns the rows done `(n16, m8)`.
///
/// # Safety
/// As [`super::quant512::block`]; [`fits`] holds for `b`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn block<const WQ: u8>(b: &QuantBlock) -> (usize, usize) {
    let (n16, m8) = (b.n / ROWS * ROWS, b.m / ACTS * ACTS);
    for n0 in (0..n16).step_by(ROWS) {
        for m0 in (0..m8).step_by(ACTS) {
            // SAFETY: weight rows n0..n0 + 16 <= b.n, activation rows m0..m0 + 8 <= b.m and
            // their outputs are inside the caller's block.
            unsafe {
                tile::<WQ>(
                    b.w.add(n0 * b.ldw),
                    b.ldw,
                    b.a.add(m0 * b.lay.row_bytes),
                    b.lay,
                    b.d.add(m0 * b.ldd + n0),
                    b.ldd,
                );
            }
        }
    }
    (n16, m8)
}
