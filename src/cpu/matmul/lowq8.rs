//! Q2_K, Q3_K, IQ4_XS, Q5_1 and IQ4_NL weights times 8-bit activations (`--q8`), paired as
//! ggml pairs them (`ggml-cpu.c` type traits, `vec_dot_type`): Q8_K for the 256-element
//! types (activations as [`super::kquant`] lays them out: quants, one f32 `d` and 16 i16
//! sums per super-block), Q8_1-style blocks of 32 for Q5_1 and IQ4_NL (as [`super::quant`]:
//! quants, `d`, `s / 8` with `s = d * sum(q)`; IQ4_NL, whose ggml partner is Q8_0, ignores
//! `s`).
//!
//! Each weight block is decoded ([`super::low`]), multiplied with the activation quants by
//! `vpmaddubsw` (unsigned quants directly; signed ones, Q3_K and the IQ4 codebook values,
//! through `|q|` and the activation's sign moved onto it), the i16 pair sums weighted by the
//! sub-block scales with `vpmaddwd` into i32 lanes, and the block's lanes added to f32
//! accumulators scaled by `da * dx`; minimums (Q2_K: `dmin * dx * sum(mn * bsum)`, Q5_1:
//! `m * s`) go to a scalar sum per output. Exact integer sums, one f32 order per output:
//! results do not depend on the tile or the thread count.
//!
//! Levels: AVX2 (tiles 4 x 1 for M = 1, 2 x {2, 1} otherwise), except Q2_K, Q3_K and IQ4_XS,
//! which take the K-quant tiles of [`super::kquant`] there (each chunk decoded in registers as
//! it is multiplied, scales and minimums by SIMD: 1.4-2.7x this file's tiles for Q2_K and Q3_K,
//! 1.3-1.7x for IQ4_XS on the Zen 3 host); AVX-512: this file's code compiled with AVX-512
//! enabled for all five (wider registers are left for
//! later); scalar: the same integer sums, one block at a time.

use super::LowW;
use super::low::{
    self, IntScales, L2K, L3K, L51, LNL, LXS, bytes, elems, has_min, int_scales, quants,
};
use crate::cpu::simd::Isa;
use crate::dtype::QK_K;

#[cfg(target_arch = "x86_64")]
use super::kquant;
#[cfg(target_arch = "x86_64")]
use super::low::{prefetch, quants_avx2, signed};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether the activations of `w` are Q8_K (else blocks of 32).
pub(super) const fn k_act(w: LowW) -> bool {
    elems(low::code(w)) == QK_K
}

/// One block of `dst[m][n] = dot(w[n], a[m])` with weights of a [`LowW`] type and 8-bit
/// activations.
#[derive(Clone, Copy)]
pub(crate) struct LowQ8Block {
    /// First weight row: `nblk` blocks of `wt` at `w + n * ldw` bytes.
    pub w: *const u8,
    pub ldw: usize,
    pub wt: LowW,
    /// First activation row, quantized; row `m` at `x + m * ldx` bytes, its `d` array at
    /// `d_off` and its sums at `s_off` within the row.
    pub x: *const u8,
    pub ldx: usize,
    pub d_off: usize,
    pub s_off: usize,
    /// Output: `dst[m][n]` at `d + m * ldd + n` elements.
    pub d: *mut f32,
    pub ldd: usize,
    pub n: usize,
    pub m: usize,
    /// Blocks per row (K / 256 or K / 32).
    pub nblk: usize,
}

/// Compute one block at the given level.
///
/// # Safety
/// Weight rows `n < b.n` hold `b.nblk` blocks of `b.wt`, activation rows `m < b.m` are in the
/// layout [`k_act`] names, `dst[m][n]` is writable and owned by the caller's thread.
pub(crate) unsafe fn block(isa: Isa, b: &LowQ8Block) {
    let tab = crate::cpu::simd::f16_table().as_ptr();
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: supported level (clamped); forwarded caller guarantees.
        unsafe {
            match (isa.clamp(), b.wt) {
                (Isa::Avx512, LowW::Q2_K) => return wide::block::<L2K>(b, tab),
                (Isa::Avx512, LowW::Q3_K) => return wide::block::<L3K>(b, tab),
                (Isa::Avx512, LowW::IQ4_XS) => return wide::block::<LXS>(b, tab),
                (Isa::Avx512, LowW::Q5_1) => return wide::block::<L51>(b, tab),
                (Isa::Avx512, LowW::IQ4_NL) => return wide::block::<LNL>(b, tab),
                (Isa::Avx2, LowW::Q2_K) => {
                    return kquant::block_low_avx2::<{ kquant::K2 }>(&k_block(b));
                }
                (Isa::Avx2, LowW::Q3_K) => {
                    return kquant::block_low_avx2::<{ kquant::K3 }>(&k_block(b));
                }
                (Isa::Avx2, LowW::IQ4_XS) => {
                    return kquant::block_low_avx2::<{ kquant::KX }>(&k_block(b));
                }
                (Isa::Avx2, LowW::Q5_1) => return avx2::block::<L51>(b, tab),
                (Isa::Avx2, LowW::IQ4_NL) => return avx2::block::<LNL>(b, tab),
                _ => {}
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match b.wt {
            LowW::Q2_K => scalar_block::<L2K>(b, tab),
            LowW::Q3_K => scalar_block::<L3K>(b, tab),
            LowW::IQ4_XS => scalar_block::<LXS>(b, tab),
            LowW::Q5_1 => scalar_block::<L51>(b, tab),
            LowW::IQ4_NL => scalar_block::<LNL>(b, tab),
        }
    }
}

/// `b` as the K-quant kernels' block (`kquant.rs`), whose AVX2 tiles take Q2_K and Q3_K: the
/// same rows in the same Q8_K layout ([`super::kquant::KActLayout`]).
#[cfg(target_arch = "x86_64")]
fn k_block(b: &LowQ8Block) -> super::kquant::KQuantBlock {
    let lay = super::kquant::KActLayout::new(b.nblk * QK_K);
    debug_assert_eq!(
        (lay.row_bytes, lay.d_off(), lay.s_off()),
        (b.ldx, b.d_off, b.s_off)
    );
    super::kquant::KQuantBlock {
        w: b.w,
        ldw: b.ldw,
        a: b.x,
        lay,
        d: b.d,
        ldd: b.ldd,
        n: b.n,
        m: b.m,
    }
}

/// The minimum term of block `blk` of activation row `xr` (scale `xd`) against weights with
/// scales `s`: subtracted from the output.
///
/// # Safety
/// `xr` is an activation row in the layout of `T`, with `blk` inside it.
#[inline(always)]
unsafe fn min_term<const T: u8>(
    s: &IntScales,
    xr: *const u8,
    s_off: usize,
    blk: usize,
    xd: f32,
) -> f32 {
    // SAFETY: the block's sums are in the caller's row.
    unsafe {
        if T == L51 {
            // w = d q + m: the sum gains m * d_x * sum(q_x), `s` stored divided by 8.
            -(s.db * (8.0 * *xr.add(s_off).cast::<f32>().add(blk)))
        } else {
            let bsum = xr.add(s_off + 32 * blk).cast::<i16>();
            let mut summ = 0i32;
            for j in 0..16 {
                summ += s.mn[j] as i32 * bsum.add(j).read_unaligned() as i32;
            }
            s.db * xd * summ as f32
        }
    }
}

/// Portable fallback: the same integer sums per block, accumulated in f32 one block at a
/// time.
unsafe fn scalar_block<const T: u8>(b: &LowQ8Block, tab: *const f32) {
    let (bs, ne) = (bytes(T), elems(T));
    let mut q = [0i8; QK_K];
    for n in 0..b.n {
        for m in 0..b.m {
            let (mut acc, mut accm) = (0f32, 0f32);
            // SAFETY: row m of the caller's activations.
            let xr = unsafe { b.x.add(m * b.ldx) };
            for blk in 0..b.nblk {
                // SAFETY: block blk of weight row n and of activation row m.
                unsafe {
                    let wb = b.w.add(n * b.ldw + blk * bs);
                    quants::<T>(wb, &mut q);
                    let s = int_scales::<T>(wb, tab);
                    let xd = *xr.add(b.d_off).cast::<f32>().add(blk);
                    let xq = xr.add(blk * ne).cast::<i8>();
                    let mut sumi = 0i32;
                    for j in 0..ne / 16 {
                        let mut dot = 0i32;
                        for (i, &qi) in q.iter().enumerate().skip(16 * j).take(16) {
                            dot += qi as i32 * *xq.add(i) as i32;
                        }
                        sumi += s.sc[j] as i32 * dot;
                    }
                    acc += s.da * xd * sumi as f32;
                    if has_min(T) {
                        accm += min_term::<T>(&s, xr, b.s_off, blk, xd);
                    }
                }
            }
            // SAFETY: the caller owns this output element.
            unsafe { *b.d.add(m * b.ldd + n) = acc - accm };
        }
    }
}

/// The tile kernels, compiled once per instruction set.
#[cfg(target_arch = "x86_64")]
macro_rules! low_q8_kernels {
    ($feat:literal) => {
        use super::*;
        use crate::cpu::simd::hsum256;

        /// `RN x RM` outputs over all blocks.
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn tile<const T: u8, const RN: usize, const RM: usize>(
            w: *const u8,
            ldw: usize,
            x: *const u8,
            ldx: usize,
            d: *mut f32,
            ldd: usize,
            nblk: usize,
            offs: (usize, usize),
            tab: *const f32,
        ) {
            let (bs, ne) = const { (bytes(T), elems(T)) };
            let (d_off, s_off) = offs;
            let mut acc = [[_mm256_setzero_ps(); RM]; RN];
            let mut accm = [[0f32; RM]; RN];
            for blk in 0..nblk {
                for (r, accr) in acc.iter_mut().enumerate() {
                    let wb = w.wrapping_add(r * ldw + blk * bs);
                    for l in 0..bs.div_ceil(64) {
                        prefetch(wb.wrapping_add(RN * ldw + 64 * l));
                    }
                    // SAFETY: block blk of weight row r.
                    let (q, s) = unsafe { (quants_avx2::<T>(wb), int_scales::<T>(wb, tab)) };
                    // Scales of chunk c for `vpmaddwd`: lanes 0-7 `sc[2c]`, 8-15 `sc[2c + 1]`
                    // (word c of the 16 i16 broadcast, then its two halves spread).
                    // SAFETY: 16 i16.
                    let all = unsafe { _mm256_loadu_si256(s.sc.as_ptr().cast()) };
                    let pick = _mm256_setr_epi8(
                        0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                        3, 2, 3, 2, 3, 2, 3,
                    );
                    let mut scv = [_mm256_setzero_si256(); 8];
                    for (c, v) in scv.iter_mut().enumerate().take(ne / 32) {
                        let pair = _mm256_permutevar8x32_epi32(all, _mm256_set1_epi32(c as i32));
                        *v = _mm256_shuffle_epi8(pair, pick);
                    }
                    let qa = if signed(T) {
                        q.map(|v| _mm256_sign_epi8(v, v))
                    } else {
                        q
                    };
                    for (m, a) in accr.iter_mut().enumerate() {
                        // SAFETY: block blk of activation row m, its scale and sums.
                        unsafe {
                            let xr = x.add(m * ldx);
                            let xd = *xr.add(d_off).cast::<f32>().add(blk);
                            let mut sumi = _mm256_setzero_si256();
                            for c in 0..ne / 32 {
                                let xv = _mm256_loadu_si256(xr.add(blk * ne + 32 * c).cast());
                                let xv = if signed(T) {
                                    _mm256_sign_epi8(xv, q[c])
                                } else {
                                    xv
                                };
                                let p = _mm256_maddubs_epi16(qa[c], xv);
                                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scv[c]));
                            }
                            let f = _mm256_set1_ps(s.da * xd);
                            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), f, *a);
                            if has_min(T) {
                                accm[r][m] += min_term::<T>(&s, xr, s_off, blk, xd);
                            }
                        }
                    }
                }
            }
            for (r, accr) in acc.iter().enumerate() {
                for (m, a) in accr.iter().enumerate() {
                    // SAFETY: the output element is in the caller's block.
                    unsafe { *d.add(m * ldd + r) = hsum256(*a) - accm[r][m] };
                }
            }
        }

        #[target_feature(enable = $feat)]
        pub(super) unsafe fn block<const T: u8>(b: &LowQ8Block, tab: *const f32) {
            let offs = (b.d_off, b.s_off);
            if b.m == 1 {
                drive_tiles!(b, tile, T, 4, [1], (b.nblk, offs, tab));
            } else {
                drive_tiles!(b, tile, T, 2, [2, 1], (b.nblk, offs, tab));
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    low_q8_kernels!("avx2,fma,f16c");
}

#[cfg(target_arch = "x86_64")]
mod wide {
    low_q8_kernels!("avx512f,avx512bw,avx512vl,avx2,fma,f16c");
}
