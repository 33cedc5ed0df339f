//! K-quant weights times f32 activations through integer dot products (AVX-512 with VNNI, the
//! default precision's matrix-vector products: Q6_K at M <= 2, Q5_K at M = 1, [`use_limbs`]):
//! no rounding of the activations to 8 bits, and fewer vector operations per weight than
//! dequantizing in registers ([`super::kf32`]): about 15 per 64 weights for Q6_K against 20.
//!
//! **Activations.** Each super-block of 256 activations is scaled by a power of two `2^k`
//! (exact) so that its largest magnitude lies in `[2^28, 2^29)`, rounded to an integer (ties
//! to even) and split into two 15-bit limbs, `v = hi * 2^15 + lo` with `lo` in `0..2^15`.
//! An element within a factor 16 of its block's largest keeps all 24 bits of its f32
//! significand; any element is off by at most `2^-29` of the block's largest magnitude. The
//! limbs are stored as words, each 64-element chunk as four vectors of 32 (high limbs of the
//! even elements, of the odd ones, low limbs of the even, of the odd), with the block's 16
//! sums of 16 activations (f32, for Q5_K's minimums) and its `2^-k` ([`LimbLayout`]); every
//! thread makes the limbs of its own items' rows in its per-thread scratch, the same bytes
//! whoever makes them: about 1.0 us per row of 4096 (1.4 with the sums) for each item, so a
//! thread with 4 items of a decoding step's product makes the same row 4 times (0.6 % of a
//! 4096 x 4096 Q6_K product; more for small models' products). Making them once per thread
//! and node, as `Plan::private_src1` does for 8-bit activations, would save that. A block whose largest magnitude is not finite or lies outside
//! `[2^-60, 2^60]` (nor zero) sends the whole item back to [`super::kf32`], which propagates
//! NaN and infinity as f32 arithmetic does.
//!
//! **Weights** (ggml-common.h `block_q6_K`, `block_q5_K`, `block_q4_K`). Each 64-weight chunk's
//! quants become words in the limbs' order without a shuffle: Q6_K's are unpacked to bytes as
//! [`super::kf32`] does, less 32, and split into even and odd words by shifts; Q4_K's / Q5_K's
//! two nibbles per byte are shifted out of the `qs` words per half vector, with Q5_K's fifth
//! bit from `qh`. Each word is multiplied by its group's scale (`vpmullw`; `|sc * (q - 32)| <=
//! 4096` for Q6_K, `sc * q <= 63 * 31` for Q5_K), so that one `vpdpwssd` per limb and 32
//! weights sums `scale * quant * limb` exactly in 32-bit lanes: 16 products per lane and
//! super-block, at most `16 * 4096 * (2^15 - 1) < 2^31`. Per super-block the two lane sums
//! are converted to f32 and scaled by `d * 2^-k` (`2^15` more for the high limb), and Q4_K /
//! Q5_K subtract `dmin * m` times each sub-block's activation sum: the only roundings are f32
//! ones after the exact integer sums.
//!
//! Results do not depend on the thread count (each output is one row's sums, whatever the
//! tile), but differ from [`super::kf32`]'s by rounding, so which route computes a product is
//! decided by its whole M and the machine's SIMD level ([`use_limbs`]), never by how threads
//! cut it. Error against an f64 reference (a prototype, Q6_K, 4096 x 4096 and 4096 x 14336,
//! activations with outliers): at most 1.3-2.4e-7 of the largest output, against 2.9-6.2e-7
//! for the dequantizing path; the tests hold every type to the f32 dot product's error.

use super::KQuantW as KW;
use super::kf32::KF32Block;
#[cfg(target_arch = "x86_64")]
use super::kquant::{K4, K5, K5_QH, K6, K6_QH, head_v, kblock_bytes, prefetch_rows_ahead, qs_off};
#[cfg(target_arch = "x86_64")]
use super::quant::prefetch_l2;
use crate::cpu::simd::Isa;
use crate::dtype::QK_K;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Bytes of one super-block's limbs (4 chunks x 4 vectors x 32 words), then its 16 sums of 16
/// activations (f32, for the minimums of Q4_K and Q5_K; written only for them).
const LIMB_BLOCK: usize = 1024 + SUMS_BYTES;
const SUMS_OFF: usize = 1024;
const SUMS_BYTES: usize = 64;

/// Activation rows in the limb form: `nblk` blocks of [`LIMB_BLOCK`] bytes, then each block's
/// scale `2^-k` (f32); rows `row_bytes` apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LimbLayout {
    pub nblk: usize,
    pub row_bytes: usize,
}

impl LimbLayout {
    pub fn new(k: usize) -> Self {
        let nblk = k / QK_K;
        LimbLayout {
            nblk,
            row_bytes: (nblk * (LIMB_BLOCK + 4)).next_multiple_of(64),
        }
    }
    fn s_off(&self) -> usize {
        self.nblk * LIMB_BLOCK
    }
}

/// Whether a product of `wt` weights with `m` rows of f32 activations takes the limb route: on
/// AVX-512 (whose level includes VNNI), Q6_K up to M = 2 and Q5_K at M = 1. Measured on a Xeon
/// (2026-11-28, `bench ops --threads 2 --no-rotate`, 4096 x 4096 / 4096 x 14336, two rounds,
/// before / after, us): Q6_K M = 1 1082-1094 / 3691-3804 -> 656 / 2206-2335, M = 2 1254-1284 /
/// 4375-4417 -> 1047-1072 / 3477-3624, M = 8 3610-3712 / 9771-12911 -> 3254-3422 /
/// 11673-11718 (no clear gain: not taken); Q5_K M = 1 1081-1129 / 3836-5838 -> 762-857 /
/// 2697-2712, M = 2 1090-1099 / 3760-3770 -> 1375-2006 / 4559-4628 (slower). Q4_K is slower at
/// every M (M = 1 580-637 / 1790-2143 -> 596-619 / 2262-2914: its table lookups already cost
/// about what the words and `vpmullw` do) and keeps [`super::kf32`]. The machine's level
/// ([`Isa::detect`]), as for the scratch sizes; a kernel forced to a lower level ignores the
/// limbs' scratch.
pub(crate) fn use_limbs(wt: KW, m: usize) -> bool {
    Isa::detect() == Isa::Avx512
        && match wt {
            KW::Q6_K => m <= 2,
            KW::Q5_K => m == 1,
            KW::Q4_K => false,
        }
}

/// A [`KF32Block`] whose activations are made into limbs in `scratch`.
#[derive(Clone, Copy)]
pub(crate) struct LimbBlock {
    pub f: KF32Block,
    pub lay: LimbLayout,
    /// At least `f.m * lay.row_bytes` bytes, 64-byte aligned, this thread's own.
    pub scratch: *mut u8,
}

/// Compute one block through the limbs if the level is AVX-512 and every activation block is
/// in range; `false` (nothing written) otherwise, for the caller's f32 route.
///
/// # Safety
/// `b.f` as [`super::kf32::block`] requires (with `b.lay.nblk` super-blocks per row), and the
/// scratch as documented.
pub(crate) unsafe fn block(isa: Isa, b: &LimbBlock) -> bool {
    #[cfg(target_arch = "x86_64")]
    if isa.clamp() == Isa::Avx512 {
        // SAFETY: AVX-512 (with VNNI, part of the level) is supported; caller's guarantees.
        unsafe {
            let sums = b.f.wt != KW::Q6_K;
            for m in 0..b.f.m {
                let row = b.scratch.add(m * b.lay.row_bytes);
                if !avx512::limbs_row(b.f.x.add(m * b.f.ldx), b.lay, sums, row) {
                    return false;
                }
            }
            avx512::block(b);
        }
        return true;
    }
    let _ = (isa, b);
    false
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;

    /// Weight rows ahead of the current one whose super-block is also fetched into L2 (two
    /// M = 1 tiles): the kernel runs fast enough that the `PF_ROWS` fetch alone leaves it
    /// waiting on memory. Q6_K 4096 x 4096 and 4096 x 14336 at M = 1, weights not in cache
    /// (`bench ops`, Xeon, two rounds): 1 thread 1562-1902 / 4793-8062 us without, 1420-1519 /
    /// 3645-4107 us with; with the weights in cache (`--no-rotate`, 2 threads, three rounds) no
    /// change (686-712 / 2093-2488 us against 718-729 / 2263-2459 us).
    const L2_AHEAD_ROWS: usize = 16;
    /// Largest block magnitude the limbs take (beyond it the f32 route keeps inf and NaN and
    /// the scale products stay finite), and smallest nonzero one.
    const MAX_EXP: i32 = 60;

    /// Word indices of the even (`e = 0`) or odd elements of two vectors of 32 words.
    fn parity_idx(e: i16) -> __m512i {
        let idx: [i16; 32] = std::array::from_fn(|i| 2 * i as i16 + e);
        // SAFETY: 64 bytes.
        unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
    }

    /// One activation row into the limb form at `out` (with the sums of 16 if `sums`);
    /// `false` if a block is out of range.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn limbs_row(
        x: *const f32,
        lay: LimbLayout,
        sums: bool,
        out: *mut u8,
    ) -> bool {
        let (ie, io) = (parity_idx(0), parity_idx(1));
        let absmask = _mm512_set1_epi32(0x7fff_ffff);
        let lomask = _mm512_set1_epi32(0x7fff);
        for blk in 0..lay.nblk {
            // SAFETY: 256 f32 of the row's block.
            let xb = unsafe { x.add(blk * QK_K) };
            let mut mx = _mm512_setzero_si512();
            for i in 0..16 {
                // SAFETY: as above.
                let v = unsafe { _mm512_loadu_si512(xb.add(16 * i).cast()) };
                // |x| as an integer orders like |x|; NaN sorts above infinity.
                mx = _mm512_max_epu32(mx, _mm512_and_si512(v, absmask));
            }
            let bits = _mm512_reduce_max_epu32(mx);
            let e = (bits >> 23) as i32 - 127;
            let k = if bits == 0 {
                0
            } else if (-MAX_EXP..=MAX_EXP).contains(&e) {
                28 - e
            } else {
                return false;
            };
            let scale = _mm512_set1_ps(f32::from_bits(((127 + k) as u32) << 23));
            // SAFETY: the block's limbs and scale inside the row's bytes.
            unsafe {
                let ob = out.add(blk * LIMB_BLOCK);
                for c in 0..4 {
                    let v: [__m512i; 4] = std::array::from_fn(|i| {
                        let f = _mm512_loadu_ps(xb.add(64 * c + 16 * i));
                        _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                            _mm512_mul_ps(f, scale),
                        )
                    });
                    let (he, ho) = act_words(v.map(|a| _mm512_srai_epi32::<15>(a)), ie, io);
                    let (le, lo) = act_words(v.map(|a| _mm512_and_si512(a, lomask)), ie, io);
                    let oc = ob.add(256 * c);
                    _mm512_storeu_si512(oc.cast(), he);
                    _mm512_storeu_si512(oc.add(64).cast(), ho);
                    _mm512_storeu_si512(oc.add(128).cast(), le);
                    _mm512_storeu_si512(oc.add(192).cast(), lo);
                }
                if sums {
                    // Sums of 16 activations, in one fixed order.
                    let v: [f32; 16] = std::array::from_fn(|j| {
                        _mm512_reduce_add_ps(_mm512_loadu_ps(xb.add(16 * j)))
                    });
                    std::ptr::copy_nonoverlapping(
                        v.as_ptr().cast::<u8>(),
                        ob.add(SUMS_OFF),
                        SUMS_BYTES,
                    );
                }
                let s = f32::from_bits(((127 - k) as u32) << 23);
                out.add(lay.s_off() + 4 * blk)
                    .cast::<f32>()
                    .write_unaligned(s);
            }
        }
        true
    }

    /// 64 elements (dwords, in order) as words, `(even elements, odd elements)`.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    fn act_words(v: [__m512i; 4], ie: __m512i, io: __m512i) -> (__m512i, __m512i) {
        let w = |a: __m512i, b: __m512i| {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm512_cvtepi32_epi16(a)),
                _mm512_cvtepi32_epi16(b),
            )
        };
        let (w0, w1) = (w(v[0], v[1]), w(v[2], v[3]));
        (
            _mm512_permutex2var_epi16(w0, ie, w1),
            _mm512_permutex2var_epi16(w0, io, w1),
        )
    }

    /// `acc += a . b` per 32-bit lane (pairs of words), as `vpdpwssd`. Written as assembly:
    /// LLVM otherwise splits a chain of them into `vpmaddwd` + `vpaddd` to shorten the chain's
    /// latency, two operations where one does (a prototype of this kernel, Q6_K rows in
    /// cache: 1.4x slower split). `kquant512.rs`'s chains, split the same way, measured no
    /// faster written like this (`--q8`, 2026-11-28).
    #[target_feature(enable = "avx512f,avx512vnni")]
    #[inline]
    fn dpwssd(acc: &mut __m512i, a: __m512i, b: __m512i) {
        // SAFETY: the instruction is supported (target feature); registers only.
        unsafe {
            std::arch::asm!(
                "vpdpwssd {0}, {1}, {2}",
                inout(zmm_reg) *acc,
                in(zmm_reg) a,
                in(zmm_reg) b,
                options(pure, nomem, nostack)
            )
        };
    }

    /// The constant vectors of [`quant_words`]'s unpacking.
    struct Consts {
        /// Q6_K: bytes 0x0f, 0x30 and 32; per-half `qh` shift counts (as `kf32::avx512::k6_bytes`:
        /// words 0-15 are quants 0-31 of 64, words 16-31 quants 32-63; `qh` bits 0-1 (<< 4)
        /// and 2-3 (<< 2) for the low nibbles, 4-5 and 6-7 (>> 2) for the high ones).
        m4: __m512i,
        m30: __m512i,
        c32: __m512i,
        sl: __m512i,
        sr: __m512i,
        /// Q4_K / Q5_K: words 0x000f; nibble shift counts of the even and odd words.
        w4: __m512i,
        ne: __m512i,
        no: __m512i,
    }

    /// Word `x` in lanes 0-15, `y` in lanes 16-31.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    fn halves(x: i16, y: i16) -> __m512i {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi16(x)),
            _mm256_set1_epi16(y),
        )
    }

    /// The quants of chunk `c` (elements `64c .. 64c + 64`) of the super-block at `p` as words
    /// in the limbs' order, `(even elements, odd elements)`: Q6_K's `q - 32`, Q4_K's and
    /// Q5_K's `q`. Q4_K / Q5_K: the chunk is sub-blocks `2c` (low nibbles of `qs[32c ..
    /// 32c + 32]`) and `2c + 1` (high nibbles), so word `i` of the 16 `qs` words holds even
    /// elements `2i` and `32 + 2i` (bits 0-3, 4-7) and odd ones `2i + 1`, `33 + 2i` (bits
    /// 8-11, 12-15): the 32 bytes in both halves, shifted per half; Q5_K's fifth bit is bit
    /// `2c` (`2c + 1` for the second sub-block) of `qh[l]` for element `l` of the sub-block.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn quant_words<const T: u8>(p: *const u8, c: usize, k: &Consts) -> (__m512i, __m512i) {
        // SAFETY (whole body): offsets inside the super-block.
        unsafe {
            if T == K6 {
                let (h, t) = (c / 2, c % 2);
                let ql = _mm512_loadu_si512(p.add(64 * h).cast());
                let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(K6_QH + 32 * h).cast()));
                // (a & m4) | hi: quants 0-63 of the half, then 64-127.
                let u = if t == 0 {
                    let hi = _mm512_and_si512(_mm512_sllv_epi16(qh, k.sl), k.m30);
                    _mm512_ternarylogic_epi32::<0xea>(ql, k.m4, hi)
                } else {
                    let hi = _mm512_and_si512(_mm512_srlv_epi16(qh, k.sr), k.m30);
                    _mm512_ternarylogic_epi32::<0xea>(_mm512_srli_epi16::<4>(ql), k.m4, hi)
                };
                let q = _mm512_sub_epi8(u, k.c32);
                return (
                    _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(q)),
                    _mm512_srai_epi16::<8>(q),
                );
            }
            let qs = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(qs_off(T) + 32 * c).cast()));
            let (e, o) = (_mm512_srlv_epi16(qs, k.ne), _mm512_srlv_epi16(qs, k.no));
            if T == K4 {
                return (_mm512_and_si512(e, k.w4), _mm512_and_si512(o, k.w4));
            }
            // Bit s of each `qh` word to bit 4 (left by 15 - s, right by 11; lower bits of `qh`
            // below it, in bits 0-3).
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(K5_QH).cast()));
            let s = 2 * c as i16;
            let he = _mm512_srli_epi16::<11>(_mm512_sllv_epi16(qh, halves(15 - s, 14 - s)));
            let ho = _mm512_srli_epi16::<11>(_mm512_sllv_epi16(qh, halves(7 - s, 6 - s)));
            // Bits 0-3 from the nibbles (where w4 is 1), the rest from h.
            (
                _mm512_ternarylogic_epi32::<0xe4>(e, he, k.w4),
                _mm512_ternarylogic_epi32::<0xe4>(o, ho, k.w4),
            )
        }
    }

    /// `RN x RM` outputs over all super-blocks: weight rows one after another inside a
    /// super-block (a row's words serve its `RM` activation rows), lane sums per row and
    /// activation row, scaled once per super-block; Q4_K / Q5_K subtract `dmin * m` times
    /// each sub-block's activation sum.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const T: u8, const RN: usize, const RM: usize>(
        w: *const u8,
        ldw: usize,
        a: *const u8,
        lda: usize,
        d: *mut f32,
        ldd: usize,
        lay: LimbLayout,
        tab: *const f32,
    ) {
        let bs = const { kblock_bytes(T) };
        let k = Consts {
            m4: _mm512_set1_epi8(0x0f),
            m30: _mm512_set1_epi8(0x30),
            c32: _mm512_set1_epi8(32),
            sl: halves(4, 2),
            sr: halves(0, 2),
            w4: _mm512_set1_epi16(0x0f),
            ne: halves(0, 4),
            no: halves(8, 12),
        };
        // The scale words of chunk c ([`head_v`]'s 16 words): Q6_K's groups 4c..4c + 4, 8
        // words each; Q4_K / Q5_K's sub-blocks 2c and 2c + 1 (words 4c and 4c + 2), 16 each.
        let idx: [__m512i; 4] = std::array::from_fn(|c| {
            let v: [i16; 32] = std::array::from_fn(|i| match T {
                K6 => (4 * c + i / 8) as i16,
                _ => (4 * c + 2 * (i / 16)) as i16,
            });
            // SAFETY: 64 bytes.
            unsafe { _mm512_loadu_si512(v.as_ptr().cast()) }
        });
        let mut acc = [[_mm512_setzero_ps(); RM]; RN];
        for blk in 0..lay.nblk {
            // SAFETY: the block's scale in each activation row.
            let xs: [f32; RM] = std::array::from_fn(|m| unsafe {
                a.add(m * lda + lay.s_off() + 4 * blk)
                    .cast::<f32>()
                    .read_unaligned()
            });
            let xb = |m: usize| a.wrapping_add(m * lda + blk * LIMB_BLOCK);
            for (r, accr) in acc.iter_mut().enumerate() {
                let p = w.wrapping_add(r * ldw + blk * bs);
                prefetch_rows_ahead(p, ldw, bs);
                for l in 0..bs.div_ceil(64) {
                    prefetch_l2(p.wrapping_add(L2_AHEAD_ROWS * ldw + 64 * l));
                }
                let mut hi = [_mm512_setzero_si512(); RM];
                let mut lo = [_mm512_setzero_si512(); RM];
                // SAFETY: super-block blk of weight row r and the block's limbs and sums of
                // every activation row.
                unsafe {
                    let (sc, mn, dw, dm) = head_v::<T>(p, tab);
                    let sc = _mm512_castsi256_si512(sc);
                    for (c, ic) in idx.iter().enumerate() {
                        let (qe, qo) = quant_words::<T>(p, c, &k);
                        let s = _mm512_permutexvar_epi16(*ic, sc);
                        let (we, wo) = (_mm512_mullo_epi16(qe, s), _mm512_mullo_epi16(qo, s));
                        for m in 0..RM {
                            let x = xb(m).add(256 * c);
                            dpwssd(&mut hi[m], we, _mm512_loadu_si512(x.cast()));
                            dpwssd(&mut hi[m], wo, _mm512_loadu_si512(x.add(64).cast()));
                            dpwssd(&mut lo[m], we, _mm512_loadu_si512(x.add(128).cast()));
                            dpwssd(&mut lo[m], wo, _mm512_loadu_si512(x.add(192).cast()));
                        }
                    }
                    for m in 0..RM {
                        let ds = dw * xs[m];
                        let mut v = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(hi[m]),
                            _mm512_set1_ps(ds * 32768.0),
                            accr[m],
                        );
                        v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[m]), _mm512_set1_ps(ds), v);
                        if T != K6 {
                            // Each minimum twice (one per 16 elements) against the sums of
                            // 16 activations.
                            let mnf = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(mn));
                            let sums = _mm512_loadu_ps(xb(m).add(SUMS_OFF).cast());
                            v = _mm512_fnmadd_ps(_mm512_mul_ps(mnf, sums), _mm512_set1_ps(dm), v);
                        }
                        accr[m] = v;
                    }
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

    /// The block's tiles over the limbs already in its scratch: 8 x 1 for one activation row,
    /// 4 x {4, 3, 2, 1} otherwise.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
    pub(super) unsafe fn block(b: &LimbBlock) {
        let tab = crate::cpu::simd::f16_table().as_ptr();
        // drive_tiles reads the activation rows at `x + m * ldx`: the limbs, rows apart.
        let f = &b.f;
        let lb = Rows {
            w: f.w,
            ldw: f.ldw,
            x: b.scratch.cast_const(),
            ldx: b.lay.row_bytes,
            d: f.d,
            ldd: f.ldd,
            n: f.n,
            m: f.m,
        };
        match (f.wt, f.m) {
            (KW::Q4_K, 1) => drive_tiles!(&lb, tile, K4, 8, [1], (b.lay, tab)),
            (KW::Q5_K, 1) => drive_tiles!(&lb, tile, K5, 8, [1], (b.lay, tab)),
            (KW::Q6_K, 1) => drive_tiles!(&lb, tile, K6, 8, [1], (b.lay, tab)),
            (KW::Q4_K, _) => drive_tiles!(&lb, tile, K4, 4, [4, 3, 2, 1], (b.lay, tab)),
            (KW::Q5_K, _) => drive_tiles!(&lb, tile, K5, 4, [4, 3, 2, 1], (b.lay, tab)),
            (KW::Q6_K, _) => drive_tiles!(&lb, tile, K6, 4, [4, 3, 2, 1], (b.lay, tab)),
        }
    }

    /// The fields [`drive_tiles`] reads, the activations being the limb rows.
    struct Rows {
        w: *const u8,
        ldw: usize,
        x: *const u8,
        ldx: usize,
        d: *mut f32,
        ldd: usize,
        n: usize,
        m: usize,
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::dtype::DType;

    const TYPES: [(KW, DType); 3] = [
        (KW::Q4_K, DType::Q4_K),
        (KW::Q5_K, DType::Q5_K),
        (KW::Q6_K, DType::Q6_K),
    ];

    /// Random rows of `dt` (quantized from random f32 with the reference quantizer) and their
    /// dequantized f32 values.
    fn rows(dt: DType, n: usize, k: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
        let mut s = seed;
        let mut rnd = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        };
        let f: Vec<f32> = (0..n * k).map(|_| rnd() as f32 * 0.05).collect();
        let row = dt.row_size(k);
        let mut q = vec![0u8; n * row];
        let mut back = vec![0f32; n * k];
        for r in 0..n {
            let qr = &mut q[r * row..(r + 1) * row];
            crate::dtype::row_from_f32(dt, &f[r * k..(r + 1) * k], qr).unwrap();
            crate::dtype::row_to_f32(dt, qr, &mut back[r * k..(r + 1) * k]).unwrap();
        }
        (q, back)
    }

    /// Run a block through the limbs; `None` if it fell back.
    fn limbs(
        t: (KW, DType),
        q: &[u8],
        n: usize,
        k: usize,
        x: &[f32],
        m: usize,
    ) -> Option<Vec<f32>> {
        let lay = LimbLayout::new(k);
        let mut scratch = vec![0u64; m * lay.row_bytes / 8 + 8];
        let base = scratch.as_mut_ptr().cast::<u8>();
        let off = base.align_offset(64);
        let mut d = vec![f32::NAN; n * m];
        let f = KF32Block {
            w: q.as_ptr(),
            ldw: t.1.row_size(k),
            wt: t.0,
            x: x.as_ptr(),
            ldx: k,
            d: d.as_mut_ptr(),
            ldd: n,
            n,
            m,
            nblk: lay.nblk,
            gemv: m == 1,
        };
        let b = LimbBlock {
            f,
            lay,
            // SAFETY: inside the vector (8 spare words for the alignment).
            scratch: unsafe { base.add(off) },
        };
        // SAFETY: shapes as built above.
        unsafe { block(Isa::Avx512, &b) }.then_some(d)
    }

    #[test]
    fn limbs_match_an_f64_reference_closer_than_f32() {
        if Isa::detect() != Isa::Avx512 {
            eprintln!("skipped: no AVX-512 with VNNI on this CPU");
            return;
        }
        let (n, k) = (19, 1024);
        for (t, m) in TYPES.into_iter().flat_map(|t| [1, 2, 3, 5].map(|m| (t, m))) {
            let (q, wf) = rows(t.1, n, k, 7);
            // Activations with outliers (x 300) and a block 2^-40 smaller than the rest.
            let mut s = 99u64 + m as u64;
            let x: Vec<f32> = (0..m * k)
                .map(|i| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let v = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
                    let big = if (s >> 20).is_multiple_of(97) {
                        300.0
                    } else {
                        1.0
                    };
                    let tiny = if (i % k) / QK_K == 2 {
                        2f32.powi(-40)
                    } else {
                        1.0
                    };
                    v * big * tiny
                })
                .collect();
            let got = limbs(t, &q, n, k, &x, m).expect("activations in range");
            for mm in 0..m {
                for r in 0..n {
                    let (w, xr) = (&wf[r * k..(r + 1) * k], &x[mm * k..(mm + 1) * k]);
                    let exact: f64 = w.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let f32dot: f32 = w.iter().zip(xr).fold(0.0, |s, (a, b)| a.mul_add(*b, s));
                    let mag: f64 = w
                        .iter()
                        .zip(xr)
                        .map(|(a, b)| (*a as f64 * *b as f64).abs())
                        .sum();
                    let g = got[mm * n + r] as f64;
                    // Within a few f32 roundings of the magnitude, and no worse than a
                    // sequential f32 dot product by more than that.
                    let tol = mag * 4.0 * f32::EPSILON as f64;
                    assert!(
                        (g - exact).abs() <= tol,
                        "{:?} m {mm} row {r}: {g} vs {exact} (tol {tol})",
                        t.1
                    );
                    assert!((g - exact).abs() <= (f32dot as f64 - exact).abs() + tol);
                }
            }
        }
    }

    #[test]
    fn out_of_range_activations_fall_back() {
        if Isa::detect() != Isa::Avx512 {
            eprintln!("skipped: no AVX-512 with VNNI on this CPU");
            return;
        }
        let (n, k) = (8, 512);
        let t = TYPES[2];
        let (q, _) = rows(t.1, n, k, 3);
        for bad in [f32::NAN, f32::INFINITY, -1e30, 1e-30] {
            let mut x = vec![0.5f32; k];
            x[300] = bad;
            if bad.abs() < 1.0 {
                // A block of only tiny values is out of range; a tiny value beside 0.5 is not.
                x[256..].iter_mut().for_each(|v| *v = bad);
            }
            assert!(limbs(t, &q, n, k, &x, 1).is_none(), "{bad} taken");
        }
        // Zero blocks are in range and give zero.
        let x = vec![0f32; k];
        assert!(limbs(t, &q, n, k, &x, 1).unwrap().iter().all(|v| *v == 0.0));
    }
}
