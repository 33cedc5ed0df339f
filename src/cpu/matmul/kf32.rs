//! K-quant weights (Q4_K, Q5_K, Q6_K) times f32 activations, fused: each super-block is
//! dequantized in registers, 16 weights at a time (`q * (d * sc) - dm * mn` in one FMA, the
//! reference's `d * sc * q - dmin * m` with one rounding where it rounds twice; Q6_K's
//! `d * sc * (q - 32)` exactly), and multiplied with the f32 activations in place: no 8-bit
//! rounding of the activations and no scratch. Layouts and the [`Head`] form: [`super::kquant`].
//!
//! Levels: AVX-512 (16 weights per vector, tiles 8 x 1 for M = 1, 4 x {4, 3, 2, 1}
//! otherwise); AVX2 (8 per vector, tiles 4 x 1 and 2 x {2, 1}); scalar: the reference
//! dequantization of a super-block, then dot products with 8 partial sums. On AVX-512, Q4_K
//! and Q5_K take each weight from a table of the 16 or 32 values its sub-block can hold
//! (`vpermps` / `vpermt2ps`; each entry computed by the same FMA, so bit-identical to the
//! per-weight path), with each row's scales decoded by vector byte shuffles (`scales_k45`);
//! Q6_K unpacks each half super-block's 128 quants with two 512-bit byte operations
//! (`k6_bytes`). On AVX2, matrix-vector products (M = 1) do not dequantize: each group's
//! integer quants are dotted with the activations and scaled once (`gemv_tile`), the scales
//! decoded with `vcvtph2ps` instead of the f16 table (so an M = 1 product's output may differ
//! from the same row's output at M > 1 by f32 rounding). The AVX2 tiles decode each row's
//! quants to bytes one super-block ahead and widen them to f32 from memory
//! (`avx2::decode_ahead`; 1.2-1.8x over widening from registers on Zen 2, docs/kernels.md).
//! Q3_K and IQ4_XS matrix-vector products on AVX2 come here too (from `lowf32`,
//! [`gemv_low_avx2`]): the same tile with Q6_K's form (signed quants: Q3_K's `q - 4`, IQ4_XS's
//! codebook values; no minimum), IQ4_XS's scales per 32.
//! Which tile computes an output depends
//! only on the whole product's M (`KF32Block::gemv`), never on how threads cut its rows, so
//! results do not depend on the thread count.

use super::KQuantW as KW;
use super::kquant::{K3, K4, K5, K6, KX, kblock_bytes};
#[cfg(target_arch = "x86_64")]
use super::kquant::{f16_at, head, prefetch_rows_ahead};
use super::lowf32::LowF32Block;
use crate::cpu::simd::Isa;
use crate::dtype::QK_K;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// One block of `dst[m][n] = dot(w[n], x[m])` with K-quant weights and f32 activations.
#[derive(Clone, Copy)]
pub(crate) struct KF32Block {
    /// First weight row: `nblk` super-blocks of `wt` at `w + n * ldw` bytes.
    pub w: *const u8,
    pub ldw: usize,
    pub wt: KW,
    /// First activation row; row `m` at `x + m * ldx` elements.
    pub x: *const f32,
    pub ldx: usize,
    /// Output: `dst[m][n]` at `d + m * ldd + n` elements.
    pub d: *mut f32,
    pub ldd: usize,
    pub n: usize,
    pub m: usize,
    /// Super-blocks per row (K / 256).
    pub nblk: usize,
    /// The whole product has one activation row (`plan.m == 1`, not this block's `m`: a
    /// block of one row cut from a longer product must take the same tiles as at one thread,
    /// so that results do not depend on the thread count).
    pub gemv: bool,
}

/// Compute one block at the given level.
///
/// # Safety
/// Weight rows `n < b.n` hold `b.nblk` super-blocks of `b.wt`, activation rows `m < b.m` hold
/// `256 * b.nblk` f32, `dst[m][n]` is writable and owned by the caller's thread.
pub(crate) unsafe fn block(isa: Isa, b: &KF32Block) {
    let tab = crate::cpu::simd::f16_table().as_ptr();
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: supported level (clamped); forwarded caller guarantees.
        unsafe {
            match (isa.clamp(), b.wt) {
                (Isa::Avx512, KW::Q4_K) => return avx512::block::<K4>(b, tab),
                (Isa::Avx512, KW::Q5_K) => return avx512::block::<K5>(b, tab),
                (Isa::Avx512, KW::Q6_K) => return avx512::block::<K6>(b, tab),
                (Isa::Avx2, KW::Q4_K) => return avx2::block::<K4>(b, tab),
                (Isa::Avx2, KW::Q5_K) => return avx2::block::<K5>(b, tab),
                (Isa::Avx2, KW::Q6_K) => return avx2::block::<K6>(b, tab),
                _ => {}
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    let _ = tab;
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match b.wt {
            KW::Q4_K => scalar_block::<K4>(b),
            KW::Q5_K => scalar_block::<K5>(b),
            KW::Q6_K => scalar_block::<K6>(b),
        }
    }
}

/// Portable fallback: the reference dequantization of each super-block, dotted with every
/// activation row in 8 partial sums.
unsafe fn scalar_block<const T: u8>(b: &KF32Block) {
    let bs = const { kblock_bytes(T) };
    let dt = super::Weights::KQuant(b.wt).dtype();
    let to_f32 = dt.traits().to_f32;
    let mut wv = [0f32; QK_K];
    for n in 0..b.n {
        for m in 0..b.m {
            let mut acc = [0f32; 8];
            for blk in 0..b.nblk {
                // SAFETY: super-block blk of weight row n and of activation row m.
                unsafe {
                    let wb = std::slice::from_raw_parts(b.w.add(n * b.ldw + blk * bs), bs);
                    to_f32(wb, &mut wv);
                    let x = std::slice::from_raw_parts(b.x.add(m * b.ldx + blk * QK_K), QK_K);
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

/// The super-block's scales and minimums as f32 vectors (`d * sc`, `dm * mn`).
#[cfg(target_arch = "x86_64")]
mod unpack {
    use super::*;

    /// Q6_K: `(d * sc[j], 32 * d * sc[j])` for j in 0..16, as two vectors of 16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn scales_k6(b: *const u8, tab: *const f32) -> (__m512, __m512) {
        // SAFETY: offsets inside the super-block.
        unsafe {
            let d = _mm512_set1_ps(f16_at(tab, b.add(208)));
            let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(192).cast()));
            (
                _mm512_mul_ps(_mm512_cvtepi32_ps(sc), d),
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_slli_epi32::<5>(sc)), d),
            )
        }
    }

    /// Q4_K / Q5_K: `d * sc[j]` in lanes j = 0..8 and `dmin * mn[j]` in lanes 8 + j, one per
    /// 32 elements, decoded from the super-block's first 16 bytes (`d`, `dmin`, the 12 packed
    /// bytes of [`scales_k4`](super::super::kquant::scales_k4)) in about a dozen vector operations: the products `d * sc` of
    /// the scalar unpacking ([`head`]), bit for bit, without its ~15 scalar operations and
    /// four lane inserts per row and super-block.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn scales_k45(b: *const u8) -> __m512 {
        // SAFETY: the super-block's first 16 bytes.
        let v = unsafe { _mm_loadu_si128(b.cast()) };
        // Packed byte k is byte 4 + k of the block. Lanes of `a`: scales 0-3 (bytes 0-3), the
        // low-nibble bytes 8-11 (scales 4-7), minimums 0-3 (bytes 4-7), bytes 8-11 again
        // (minimums 4-7, high nibbles); `t`: the bytes whose top 2 bits complete scales and
        // minimums 4-7 (bytes 0-3 and 4-7), zero elsewhere.
        let a = _mm_shuffle_epi8(
            v,
            _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15),
        );
        let t = _mm_shuffle_epi8(
            v,
            _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11),
        );
        let lo = _mm_mask_blend_epi8(0xf000, a, _mm_srli_epi16::<4>(a));
        let hi = _mm_srli_epi16::<2>(_mm_and_si128(t, _mm_set1_epi8(0xc0u8 as i8)));
        let keep = _mm_setr_epi8(
            63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15,
        );
        // (lo & keep) | hi
        let q = _mm_ternarylogic_epi32::<0xea>(lo, keep, hi);
        let dd = _mm512_castps128_ps512(_mm_cvtph_ps(v));
        let dd = _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
            dd,
        );
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), dd)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::unpack::{scales_k6, scales_k45};
    use super::*;

    /// `RN x RM` outputs over all super-blocks.
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
        let bs = const { kblock_bytes(T) };
        let mut acc = [[_mm512_setzero_ps(); RM]; RN];
        let mut dl = [[0f32; 16]; RN];
        let mut ml = [[0f32; 16]; RN];
        for blk in 0..nblk {
            let wb = |r: usize| w.wrapping_add(r * ldw + blk * bs);
            for r in 0..RN {
                prefetch_rows_ahead(wb(r), ldw, bs);
                // Scales broadcast from memory (a load) rather than by a lane permute: the
                // permutes would compete with the byte widening for the one shuffle port.
                // SAFETY: super-block blk of weight row r; the arrays hold 16 f32.
                unsafe {
                    if T == K6 {
                        let (dv, mv) = scales_k6(wb(r), tab);
                        _mm512_storeu_ps(dl[r].as_mut_ptr(), dv);
                        _mm512_storeu_ps(ml[r].as_mut_ptr(), mv);
                    } else {
                        _mm512_storeu_ps(dl[r].as_mut_ptr(), scales_k45(wb(r)));
                    }
                }
            }
            // Left to itself the compiler forwards the stored vectors to the broadcasts
            // below and makes each one a lane shuffle (about 200 shuffle-port operations per
            // super-block of 8 rows, more than the table lookups themselves); past this
            // barrier it must read the scales back from memory, a load-port broadcast.
            let (dl, ml) = std::hint::black_box((&dl, &ml));
            if T != K6 {
                // SAFETY: super-block blk of every weight row and activation row.
                unsafe { k45_lut::<T, RN, RM>(&mut acc, wb(0), ldw, x.add(blk * QK_K), ldx, dl) };
                continue;
            }
            // SAFETY: super-block blk of every weight row and activation row.
            unsafe { k6_bytes::<RN, RM>(&mut acc, wb(0), ldw, x.add(blk * QK_K), ldx, dl, ml) };
        }
        for (r, accr) in acc.iter().enumerate() {
            for (m, a) in accr.iter().enumerate() {
                // SAFETY: the output element is in the caller's block.
                unsafe { *d.add(m * ldd + r) = _mm512_reduce_add_ps(*a) };
            }
        }
    }

    /// One Q4_K or Q5_K super-block of `RN` weight rows (at `w + r * ldw`) times `RM`
    /// activation rows (256 f32 at `x + m * ldx`), added to `acc`. Each sub-block's possible
    /// weights `q * (d * sc) - dm * mn` (q = 0..15, Q5_K: 0..31) are one vector (Q5_K: two),
    /// computed as the generic path computes each weight, and the quants pick from it with
    /// `vpermps` (low 4 bits of each lane) or `vpermt2ps` (low 5 bits; bit 4, Q5_K's `qh` bit,
    /// put in place with one `vpternlogd`). A 32-byte group of `qs` holds sub-block 2g in its
    /// low nibbles and 2g + 1 in its high ones, so two byte widenings serve 64 weights. Each
    /// accumulator gets the generic path's FMAs in the generic order: the same bits.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn k45_lut<const T: u8, const RN: usize, const RM: usize>(
        acc: &mut [[__m512; RM]; RN],
        w: *const u8,
        ldw: usize,
        x: *const f32,
        ldx: usize,
        s: &[[f32; 16]; RN],
    ) {
        let iota = _mm512_setr_ps(
            0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.,
        );
        let iota16 = _mm512_add_ps(iota, _mm512_set1_ps(16.));
        let (qs0, nib) = (super::super::kquant::qs_off(T), _mm512_set1_epi32(0x0f));
        // SAFETY (both): 16 bytes inside the super-block.
        let widen = |p: *const u8| unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())) };
        for g in 0..4 {
            for (r, accr) in acc.iter_mut().enumerate() {
                let p = w.wrapping_add(r * ldw);
                let q = p.wrapping_add(qs0 + 32 * g);
                let i = [widen(q), widen(q.wrapping_add(16))];
                let ih = [_mm512_srli_epi32::<4>(i[0]), _mm512_srli_epi32::<4>(i[1])];
                let t = |j: usize, io: __m512| {
                    _mm512_fmsub_ps(io, _mm512_set1_ps(s[r][j]), _mm512_set1_ps(s[r][8 + j]))
                };
                let (tlo, thi) = (t(2 * g, iota), t(2 * g + 1, iota));
                let wv = if T == K4 {
                    [
                        _mm512_permutexvar_ps(i[0], tlo),
                        _mm512_permutexvar_ps(i[1], tlo),
                        _mm512_permutexvar_ps(ih[0], thi),
                        _mm512_permutexvar_ps(ih[1], thi),
                    ]
                } else {
                    // qh bit c of byte l is bit 4 of quant l of sub-block c.
                    let h = [widen(p.wrapping_add(16)), widen(p.wrapping_add(32))];
                    let h = [_mm512_slli_epi32::<4>(h[0]), _mm512_slli_epi32::<4>(h[1])];
                    let sel = |a: __m512i, hh: __m512i, bit: usize| {
                        let b = _mm512_srlv_epi32(hh, _mm512_set1_epi32(bit as i32));
                        // bits 0..3 from a (where nib is 1), the rest from b
                        _mm512_ternarylogic_epi32::<0xE4>(a, b, nib)
                    };
                    let (tlo2, thi2) = (t(2 * g, iota16), t(2 * g + 1, iota16));
                    [
                        _mm512_permutex2var_ps(tlo, sel(i[0], h[0], 2 * g), tlo2),
                        _mm512_permutex2var_ps(tlo, sel(i[1], h[1], 2 * g), tlo2),
                        _mm512_permutex2var_ps(thi, sel(ih[0], h[0], 2 * g + 1), thi2),
                        _mm512_permutex2var_ps(thi, sel(ih[1], h[1], 2 * g + 1), thi2),
                    ]
                };
                for (k, wk) in wv.iter().enumerate() {
                    for (m, a) in accr.iter_mut().enumerate() {
                        // SAFETY: 16 activations of row m inside the super-block.
                        let xv = unsafe { _mm512_loadu_ps(x.add(m * ldx + 64 * g + 16 * k)) };
                        *a = _mm512_fmadd_ps(*wk, xv, *a);
                    }
                }
            }
        }
    }

    /// One Q6_K super-block of `RN` weight rows (at `w + r * ldw`) times `RM` activation rows
    /// (256 f32 at `x + m * ldx`), added to `acc`. Each half of the super-block (64 `ql` bytes,
    /// 32 `qh` bytes; ggml-common.h `block_q6_K`) is unpacked to its 128 six-bit quants in two
    /// 512-bit byte operations: the `ql` bytes as they lie hold quants 0-63 in their low
    /// nibbles and 64-127 in their high ones, and the `qh` bytes, loaded into both 256-bit
    /// halves and shifted per half by a per-word count, give each quant its two top bits
    /// (`vpsllvw` / `vpsrlvw`, masked, merged with one `vpternlogd`). The bytes are written
    /// to a stack buffer and widened to dwords 16 at a time (the compiler forwards the stores
    /// and extracts lanes instead; forcing the reloads measured no faster on a Xeon), then
    /// `q * (d * sc) - 32 * d * sc` in one FMA per 16 weights as before: the same weights, the
    /// same FMAs in the same order as the chunk-by-chunk form this replaced, in about 5
    /// operations per 16 weights instead of 7.5.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn k6_bytes<const RN: usize, const RM: usize>(
        acc: &mut [[__m512; RM]; RN],
        w: *const u8,
        ldw: usize,
        x: *const f32,
        ldx: usize,
        dl: &[[f32; 16]; RN],
        ml: &[[f32; 16]; RN],
    ) {
        let (m4, m30) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
        // Per 16-bit word: words 0-15 are quants 0-31 (of 64), words 16-31 quants 32-63.
        // Quants 0-31 take `qh` bits 0-1 (<< 4), 32-63 bits 2-3 (<< 2); of the high nibbles,
        // 64-95 take bits 4-5 (in place), 96-127 bits 6-7 (>> 2).
        let half_counts = |a: i16, b: i16| {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_set1_epi16(a)),
                _mm256_set1_epi16(b),
            )
        };
        let (sl, sr) = (half_counts(4, 2), half_counts(0, 2));
        let mut buf = [0u8; 128];
        for h in 0..2 {
            for (r, accr) in acc.iter_mut().enumerate() {
                let p = w.wrapping_add(r * ldw);
                // SAFETY: `ql` (bytes 0-127) and `qh` (128-191) of the super-block.
                let (ql, qh) = unsafe {
                    (
                        _mm512_loadu_si512(p.add(64 * h).cast()),
                        _mm512_broadcast_i64x4(_mm256_loadu_si256(
                            p.add(super::super::kquant::K6_QH + 32 * h).cast(),
                        )),
                    )
                };
                let hi1 = _mm512_and_si512(_mm512_sllv_epi16(qh, sl), m30);
                let hi2 = _mm512_and_si512(_mm512_srlv_epi16(qh, sr), m30);
                // (a & m4) | hi
                let u1 = _mm512_ternarylogic_epi32::<0xea>(ql, m4, hi1);
                let u2 = _mm512_ternarylogic_epi32::<0xea>(_mm512_srli_epi16::<4>(ql), m4, hi2);
                // SAFETY: the buffer holds 128 bytes.
                unsafe {
                    _mm512_storeu_si512(buf.as_mut_ptr().cast(), u1);
                    _mm512_storeu_si512(buf.as_mut_ptr().add(64).cast(), u2);
                }
                for k in 0..8 {
                    let j = 8 * h + k;
                    // SAFETY: 16 bytes inside the buffer.
                    let qb = unsafe { _mm_loadu_si128(buf.as_ptr().add(16 * k).cast()) };
                    let qf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(qb));
                    let wv =
                        _mm512_fmsub_ps(qf, _mm512_set1_ps(dl[r][j]), _mm512_set1_ps(ml[r][j]));
                    for (m, a) in accr.iter_mut().enumerate() {
                        // SAFETY: 16 activations of row m inside the super-block.
                        let xv = unsafe { _mm512_loadu_ps(x.add(m * ldx + 16 * j)) };
                        *a = _mm512_fmadd_ps(wv, xv, *a);
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn block<const T: u8>(b: &KF32Block, tab: *const f32) {
        if b.m == 1 {
            drive_tiles!(b, tile, T, 8, [1], (b.nblk, tab));
        } else {
            drive_tiles!(b, tile, T, 4, [4, 3, 2, 1], (b.nblk, tab));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::kquant::chunk_avx2 as chunk32;
    use super::*;
    use crate::cpu::simd::hsum256;

    /// `RN x RM` outputs over all super-blocks.
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
        let bs = const { kblock_bytes(T) };
        let mut acc = [[_mm256_setzero_ps(); RM]; RN];
        let mut dl = [[0f32; 16]; RN];
        let mut ml = [[0f32; 16]; RN];
        // The quants as bytes, one super-block ahead ([`decode_ahead`], unsigned here: Q6_K's
        // offset is in `ml`).
        let mut bytes = [[[0u8; QK_K]; RN]; 2];
        if nblk > 0 {
            // SAFETY: super-block 0 of every row.
            unsafe { decode_ahead::<T, RN, false>(&mut bytes[0], w, ldw) };
        }
        for blk in 0..nblk {
            let wb = |r: usize| w.wrapping_add(r * ldw + blk * bs);
            if blk + 1 < nblk {
                // SAFETY: super-block blk + 1 of every row.
                unsafe {
                    decode_ahead::<T, RN, false>(&mut bytes[(blk + 1) % 2], wb(0).add(bs), ldw)
                };
            }
            for r in 0..RN {
                prefetch_rows_ahead(wb(r), ldw, bs);
                // SAFETY: super-block blk of weight row r.
                let h = unsafe { head::<T>(wb(r), tab) };
                for j in 0..16 {
                    dl[r][j] = h.d * h.sc[j] as f32;
                    ml[r][j] = h.dm * h.mn[j] as f32;
                }
            }
            let qb = &bytes[blk % 2];
            // Chunk-outer, row-inner: consecutive FMAs go to different accumulators.
            for c in 0..8 {
                for (r, accr) in acc.iter_mut().enumerate() {
                    for half in 0..2 {
                        let j = 2 * c + half;
                        let (dv, mv) = (_mm256_set1_ps(dl[r][j]), _mm256_set1_ps(ml[r][j]));
                        for e in 0..2 {
                            // SAFETY: quants 16j + 8e.. + 8 of the row's 256.
                            let qf = unsafe {
                                let p = qb[r].as_ptr().add(16 * j + 8 * e);
                                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())))
                            };
                            let wv = _mm256_fmsub_ps(qf, dv, mv);
                            for (m, a) in accr.iter_mut().enumerate() {
                                // SAFETY: 8 activations of row m inside super-block blk.
                                let xv = unsafe {
                                    _mm256_loadu_ps(x.add(m * ldx + blk * QK_K + 16 * j + 8 * e))
                                };
                                *a = _mm256_fmadd_ps(wv, xv, *a);
                            }
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

    /// `RN x 1` outputs over all super-blocks (matrix-vector products): the weights are not
    /// dequantized. Per group of 32 (Q4_K, Q5_K) or 16 (Q6_K) weights, the dot product of the
    /// integer quants (as f32) with the activations is scaled once by `d * sc`, and the
    /// minimums' part `dm * mn * sum(x)` goes to a second accumulator, its lane sums of `x`
    /// formed once per tile; Q6_K reads `q - 32` as signed bytes and has no minimum term.
    /// About 4 vector operations per 8 weights where dequantizing first takes about 7 (the
    /// per-weight `fmsub` and the scalar scale products per 16); f32 rounding differs from
    /// the dequantizing tiles only by where the scale is applied. The quants come as bytes
    /// decoded one super-block ahead ([`decode_ahead`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemv_tile<const T: u8, const RN: usize, const RM: usize>(
        w: *const u8,
        ldw: usize,
        x: *const f32,
        _ldx: usize,
        d: *mut f32,
        _ldd: usize,
        nblk: usize,
        _tab: *const f32,
    ) {
        // drive_tiles calls this tile with RM = 1 only (M = 1 blocks).
        let bs = const { kblock_bytes(T) };
        // Scales and minimums per 32 with unsigned quants (Q4_K, Q5_K), scales per 32 with
        // signed quants and no minimum (IQ4_XS's codebook values), or scales per 16 with
        // signed quants and no minimum (Q6_K's `q - 32`, Q3_K's `q - 4`).
        let has_min = T == K4 || T == K5;
        let g32 = has_min || T == KX;
        let mut acc = [_mm256_setzero_ps(); RN];
        let mut accm = [_mm256_setzero_ps(); RN];
        let mut dl = [[0f32; 16]; RN];
        let mut ml = [[0f32; 8]; RN];
        // The quants of one super-block of every row as bytes (Q6_K's as `q - 32`), decoded
        // one super-block ahead of the products that widen them: see [`decode_ahead`].
        let mut bytes = [[[0u8; QK_K]; RN]; 2];
        if nblk > 0 {
            // SAFETY: super-block 0 of every row.
            unsafe { decode_ahead::<T, RN, true>(&mut bytes[0], w, ldw) };
        }
        for blk in 0..nblk {
            let wb = |r: usize| w.wrapping_add(r * ldw + blk * bs);
            if blk + 1 < nblk {
                // SAFETY: super-block blk + 1 of every row.
                unsafe {
                    decode_ahead::<T, RN, true>(&mut bytes[(blk + 1) % 2], wb(0).add(bs), ldw)
                };
            }
            for r in 0..RN {
                prefetch_rows_ahead(wb(r), ldw, bs);
                // The products `d * sc` and `dm * mn` of [`head`] (the same roundings), with
                // the f16 scales converted by `vcvtph2ps` rather than the 256 KiB table,
                // whose lookups per row and super-block missed L1 and L2.
                // SAFETY: super-block blk of weight row r; the arrays hold 16 and 8 f32.
                unsafe { scales_gemv::<T>(wb(r), &mut dl[r], &mut ml[r]) };
            }
            // SAFETY: super-block blk of the activation row.
            let xb = unsafe { x.add(blk * QK_K) };
            let qb = &bytes[blk % 2];
            for c in 0..8 {
                // SAFETY: 32 activations inside super-block blk.
                let xv = [0, 1, 2, 3].map(|e| unsafe { _mm256_loadu_ps(xb.add(32 * c + 8 * e)) });
                let s = if has_min {
                    _mm256_add_ps(_mm256_add_ps(xv[0], xv[1]), _mm256_add_ps(xv[2], xv[3]))
                } else {
                    _mm256_setzero_ps()
                };
                for r in 0..RN {
                    // Quants 8e..8e + 8 of chunk c, widened straight from memory.
                    // SAFETY: 8 bytes inside the row's 256.
                    let f = |e: usize| unsafe {
                        let v = _mm_loadl_epi64(qb[r].as_ptr().add(32 * c + 8 * e).cast());
                        _mm256_cvtepi32_ps(if has_min {
                            _mm256_cvtepu8_epi32(v)
                        } else {
                            _mm256_cvtepi8_epi32(v)
                        })
                    };
                    let t0 = _mm256_fmadd_ps(f(1), xv[1], _mm256_mul_ps(f(0), xv[0]));
                    let t1 = _mm256_fmadd_ps(f(3), xv[3], _mm256_mul_ps(f(2), xv[2]));
                    if g32 {
                        let t = _mm256_add_ps(t0, t1);
                        acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(dl[r][c]), acc[r]);
                        if has_min {
                            accm[r] = _mm256_fmadd_ps(s, _mm256_set1_ps(ml[r][c]), accm[r]);
                        }
                    } else {
                        acc[r] = _mm256_fmadd_ps(t0, _mm256_set1_ps(dl[r][2 * c]), acc[r]);
                        acc[r] = _mm256_fmadd_ps(t1, _mm256_set1_ps(dl[r][2 * c + 1]), acc[r]);
                    }
                }
            }
        }
        for r in 0..RN {
            // SAFETY: the output element is in the caller's block.
            unsafe { *d.add(r) = hsum256(_mm256_sub_ps(acc[r], accm[r])) };
        }
    }

    /// The 256 quants of the super-block at `w + r * ldw`, for each of the `RN` rows, as bytes
    /// in element order (Q6_K's as signed `q - 32` and Q3_K's as `q - 4` where `SIGNED`), 32 at a time with byte-wide vector
    /// operations ([`chunk32`]). The matrix-vector tile decodes super-block b + 1 while it
    /// multiplies super-block b, and widens the stored bytes with a load-operand
    /// `vpmovzxbd` / `vpmovsxbd` (the tiles for M > 1 likewise): on Zen 2 that measured 1.4-1.7x faster than widening the
    /// same bytes from registers (a lane extract, two byte shifts and four register
    /// widenings per 32 weights, all on the two shuffle pipes), with the same products in
    /// the same order, so the same bits. Widening right after the store instead stalls on
    /// store-to-load forwarding (measured slower than the register form); one super-block of
    /// distance avoids it.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn decode_ahead<const T: u8, const RN: usize, const SIGNED: bool>(
        out: &mut [[u8; QK_K]; RN],
        w: *const u8,
        ldw: usize,
    ) {
        for (r, row) in out.iter_mut().enumerate() {
            for c in 0..8 {
                // SAFETY: the caller's super-block of row r.
                let mut q = unsafe { chunk32::<T>(w.add(r * ldw), c) };
                if T == K6 && SIGNED {
                    q = _mm256_sub_epi8(q, _mm256_set1_epi8(32));
                } else if T == K3 && SIGNED {
                    q = _mm256_sub_epi8(q, _mm256_set1_epi8(4));
                }
                // SAFETY: 32 bytes inside the row's 256.
                unsafe { _mm256_storeu_si256(row.as_mut_ptr().add(32 * c).cast(), q) };
            }
        }
    }

    /// `d * sc[j]` (per 32 for Q4_K / Q5_K / IQ4_XS in `dl[0..8]`, per 16 for Q6_K and Q3_K)
    /// and `dm * mn[j]` (Q4_K / Q5_K, in `ml`) of the super-block at `b`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn scales_gemv<const T: u8>(b: *const u8, dl: &mut [f32; 16], ml: &mut [f32; 8]) {
        use super::super::kquant::{K3_D, K3_SCALES, K6_D, K6_SCALES};
        use super::super::kquant::{q3k_scales_i8, scales_k4};
        // SAFETY: offsets inside the super-block; the arrays hold 16 and 8 f32.
        unsafe {
            let half = |p: *const u8| {
                let h = p.cast::<u16>().read_unaligned() as i32;
                _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))))
            };
            if T == KX {
                let ls = _mm256_cvtepi32_ps(super::super::kquant::kx_scales(b));
                _mm256_storeu_ps(dl.as_mut_ptr(), _mm256_mul_ps(half(b), ls));
            } else if T == K6 || T == K3 {
                // 16 signed 8-bit scales (Q3_K's unpacked, less 32).
                let (d, sc) = if T == K6 {
                    (half(b.add(K6_D)), _mm_loadu_si128(b.add(K6_SCALES).cast()))
                } else {
                    (half(b.add(K3_D)), q3k_scales_i8(b.add(K3_SCALES)))
                };
                let f = |v: __m128i| _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
                _mm256_storeu_ps(dl.as_mut_ptr(), f(sc));
                _mm256_storeu_ps(dl.as_mut_ptr().add(8), f(_mm_srli_si128::<8>(sc)));
            } else {
                let w = scales_k4(b.add(4));
                let v = _mm_setr_epi32(w[0] as i32, w[1] as i32, w[2] as i32, w[3] as i32);
                let f = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
                _mm256_storeu_ps(dl.as_mut_ptr(), _mm256_mul_ps(half(b), f(v)));
                let mn = f(_mm_srli_si128::<8>(v));
                _mm256_storeu_ps(ml.as_mut_ptr(), _mm256_mul_ps(half(b.add(2)), mn));
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn block<const T: u8>(b: &KF32Block, tab: *const f32) {
        if b.gemv {
            drive_tiles!(b, gemv_tile, T, 4, [1], (b.nblk, tab));
        } else if b.m == 1 {
            drive_tiles!(b, tile, T, 4, [1], (b.nblk, tab));
        } else {
            drive_tiles!(b, tile, T, 2, [2, 1], (b.nblk, tab));
        }
    }

    /// [`gemv_tile`] over a Q3_K or IQ4_XS block that `lowf32` describes (the same
    /// geometry).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv_low<const T: u8>(b: &LowF32Block, tab: *const f32) {
        drive_tiles!(b, gemv_tile, T, 4, [1], (b.nblk, tab));
    }
}

/// Q3_K and IQ4_XS matrix-vector products (`b.gemv`; `T`: [`K3`], [`KX`]) with f32
/// activations through this file's AVX2 matrix-vector tile: `lowf32` sends them here, where
/// its own tiles (each block decoded into eight vectors, the scales formed by scalar code)
/// took 1.5x as long for Q3_K on the Zen 3 host (IQ4_XS: docs/kernels.md). Q2_K and the
/// Q3_K products of more rows measured the same either way and stay there.
///
/// # Safety
/// As [`super::lowf32::block`], with weights of type `T`, `b.gemv` and `b.m == 1`; AVX2
/// available.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn gemv_low_avx2<const T: u8>(b: &LowF32Block) {
    const { assert!(T == K3 || T == KX) };
    let tab = crate::cpu::simd::f16_table().as_ptr();
    // SAFETY: forwarded caller guarantees.
    unsafe { avx2::gemv_low::<T>(b, tab) }
}
