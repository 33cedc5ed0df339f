//! K-quant weights (Q4_K, Q5_K, Q6_K) times Q8_K activations on AVX-512 (BW + VNNI), 64
//! quants per vector: a super-block is four vectors of unsigned quants in element order, each
//! multiplied with 64 activation quants by `vpmaddubsw` (pairs summed to i16), then `vpdpwssd`
//! with the sub-block scales (each of the vector's four scales repeated over its 8 lanes)
//! into 16 i32 lanes; per super-block one `d * dy` multiply-add and the minimum term
//! `dm * dy * sum(mn * bsums)`, as [`super::kquant`] computes them (the numbers of ggml-cpu's
//! `ggml_vec_dot_q4_K_q8_K` and friends; layouts in [`super::kquant`]'s module doc).
//!
//! The quants of a weight super-block and its scale vectors are unpacked once per tile and
//! serve all of the tile's activation rows (ggml unpacks them once per row pair). Tiles 4 x 1
//! for M = 1 and 4 x {4, 2, 1} otherwise; every output's operations are the same whatever tile
//! it lands in, so results do not depend on the thread count.

use super::kquant::{
    K5, K5_QH, K6, K6_QH, KActLayout, KQuantBlock, act_rows, head_v, kblock_bytes,
    prefetch_rows_ahead, qs_off,
};
use super::quant512::for_tiles;
use std::arch::x86_64::*;

/// The super-block at `b` as four vectors of 64 unsigned quants (elements `64 z .. 64 z + 64`
/// in vector `z`).
///
/// # Safety
/// `b` readable for one super-block of `T`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn quants<const T: u8>(b: *const u8) -> [__m512i; 4] {
    let m4 = _mm512_set1_epi8(0x0f);
    let mut q = [_mm512_setzero_si512(); 4];
    // SAFETY: offsets inside the super-block.
    unsafe {
        if T == K6 {
            // Vector z = 2h + p: the low nibbles (p = 0) or high nibbles (p = 1) of
            // ql[64 h .. 64 h + 64]; the high bits of element 32 t + i of half h are bits
            // 2t of qh[32 h + i], t = 2p in the first 32 lanes and 2p + 1 in the others.
            for h in 0..2 {
                let ql = _mm512_loadu_si512(b.add(64 * h).cast());
                let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(K6_QH + 32 * h).cast()));
                for p in 0..2 {
                    let lo = if p == 0 {
                        _mm512_and_si512(ql, m4)
                    } else {
                        _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4)
                    };
                    let sh = _mm512_inserti64x4::<1>(
                        _mm512_set1_epi16(4 * p as i16),
                        _mm256_set1_epi16(4 * p as i16 + 2),
                    );
                    let hb = _mm512_and_si512(_mm512_srlv_epi16(qh, sh), _mm512_set1_epi8(3));
                    q[2 * h + p] = _mm512_or_si512(lo, _mm512_slli_epi16::<4>(hb));
                }
            }
        } else {
            // Vector g: the low nibbles of qs[32 g .. 32 g + 32] (chunk 2g), then their high
            // nibbles (chunk 2g + 1); Q5_K adds 16 where bit c of qh[i] is set (chunk c).
            let sh = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
            let qh = if T == K5 {
                _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(K5_QH).cast()))
            } else {
                _mm512_setzero_si512()
            };
            for (g, v) in q.iter_mut().enumerate() {
                let x =
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(qs_off(T) + 32 * g).cast()));
                *v = _mm512_and_si512(_mm512_srlv_epi16(x, sh), m4);
                if T == K5 {
                    let sel = _mm512_inserti64x4::<1>(
                        _mm512_set1_epi8(1 << (2 * g)),
                        _mm256_set1_epi8((1u8 << (2 * g + 1)) as i8),
                    );
                    let k = _mm512_test_epi8_mask(qh, sel);
                    *v = _mm512_mask_add_epi8(*v, k, *v, _mm512_set1_epi8(16));
                }
            }
        }
    }
    q
}

/// The 16 i16 scales `sc` as four vectors of 32 lanes: vector z holds `sc[4 z + l / 8]` in
/// lane l (the i16 lanes `vpmaddubsw` gives for elements `64 z .. 64 z + 64`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn scale_vectors(sc: __m256i) -> [__m512i; 4] {
    let wide = _mm512_castsi256_si512(sc);
    let mut out = [_mm512_setzero_si512(); 4];
    for (z, v) in out.iter_mut().enumerate() {
        let z = 4 * z as i16;
        let idx = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_setr_epi16(
                z,
                z,
                z,
                z,
                z,
                z,
                z,
                z,
                z + 1,
                z + 1,
                z + 1,
                z + 1,
                z + 1,
                z + 1,
                z + 1,
                z + 1,
            )),
            _mm256_setr_epi16(
                z + 2,
                z + 2,
                z + 2,
                z + 2,
                z + 2,
                z + 2,
                z + 2,
                z + 2,
                z + 3,
                z + 3,
                z + 3,
                z + 3,
                z + 3,
                z + 3,
                z + 3,
                z + 3,
            ),
        );
        *v = _mm512_permutexvar_epi16(idx, wide);
    }
    out
}

/// `RN x RM` outputs over all super-blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const T: u8, const RN: usize, const RM: usize>(
    w: *const u8,
    ldw: usize,
    a: *const u8,
    lay: KActLayout,
    d: *mut f32,
    ldd: usize,
    tab: *const f32,
) {
    let bs = const { kblock_bytes(T) };
    let mut acc = [[_mm512_setzero_ps(); RM]; RN];
    for blk in 0..lay.nblk {
        // SAFETY: super-block blk of the tile's activation rows.
        let (y, dy, sums) = unsafe { act_rows::<RM>(a, lay, blk) };
        for (r, accr) in acc.iter_mut().enumerate() {
            // SAFETY: super-block blk of weight row r.
            let wb = unsafe { w.add(r * ldw + blk * bs) };
            prefetch_rows_ahead(wb, ldw, bs);
            // SAFETY: as above.
            let (sc, mn, dw, dm) = unsafe { head_v::<T>(wb, tab) };
            // SAFETY: as above.
            let q = unsafe { quants::<T>(wb) };
            let sv = scale_vectors(sc);
            for (m, acc_rm) in accr.iter_mut().enumerate() {
                let mut isum = _mm512_setzero_si512();
                for z in 0..4 {
                    // SAFETY: 64 quants of activation row m inside super-block blk.
                    let yv = unsafe { _mm512_loadu_si512(y[m].add(64 * z).cast()) };
                    isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q[z], yv), sv[z]);
                }
                let mins = _mm512_zextsi256_si512(_mm256_madd_epi16(mn, sums[m]));
                *acc_rm = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(isum),
                    _mm512_set1_ps(dw * dy[m]),
                    *acc_rm,
                );
                *acc_rm = _mm512_fnmadd_ps(
                    _mm512_cvtepi32_ps(mins),
                    _mm512_set1_ps(dm * dy[m]),
                    *acc_rm,
                );
            }
        }
    }
    for (r, accr) in acc.iter().enumerate() {
        for (m, v) in accr.iter().enumerate() {
            // SAFETY: the output element is in the caller's block.
            unsafe { *d.add(m * ldd + r) = _mm512_reduce_add_ps(*v) };
        }
    }
}

/// Compute one block: tiles of 4 weight rows (leftover rows one at a time) times 4, 2 or 1
/// activation rows.
///
/// # Safety
/// As [`super::kquant::block`]; the CPU has AVX-512 BW, VL and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn block<const T: u8>(b: &KQuantBlock, tab: *const f32) {
    for_tiles(b.n, b.m, |n0, m0, rows, cols| {
        // SAFETY: weight rows n0..n0 + rows <= b.n, activation rows m0..m0 + cols <= b.m and
        // their outputs are inside the caller's block.
        unsafe {
            let (w, a, d) = (
                b.w.add(n0 * b.ldw),
                b.a.add(m0 * b.lay.row_bytes),
                b.d.add(m0 * b.ldd + n0),
            );
            let (l, ld) = (b.ldw, b.ldd);
            match (rows, cols) {
                (4, 4) => tile::<T, 4, 4>(w, l, a, b.lay, d, ld, tab),
                (4, 2) => tile::<T, 4, 2>(w, l, a, b.lay, d, ld, tab),
                (4, _) => tile::<T, 4, 1>(w, l, a, b.lay, d, ld, tab),
                (_, 4) => tile::<T, 1, 4>(w, l, a, b.lay, d, ld, tab),
                (_, 2) => tile::<T, 1, 2>(w, l, a, b.lay, d, ld, tab),
                _ => tile::<T, 1, 1>(w, l, a, b.lay, d, ld, tab),
            }
        }
    });
}
