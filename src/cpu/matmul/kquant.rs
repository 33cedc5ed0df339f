//! K-quant weights (Q4_K, Q5_K, Q6_K: 256-element super-blocks) times 8-bit activations:
//! activations quantized to Q8_K (ggml's `block_q8_K`: f32 `d`, 256 i8 quants, 16 sums of 16
//! quants), then integer dot products per super-block, scaled once per super-block (the
//! numbers of ggml-cpu's `ggml_vec_dot_q4_K_q8_K` and friends).
//!
//! Every K-quant here is read in one form: element `e` of a super-block is
//! `d * sc[e / 16] * q[e] - dm * mn[e / 16]` with unsigned quants `q` and integer scales `sc`
//! and minimums `mn` per 16 elements ([`Head`]). Layouts per ggml-common.h:
//! - `block_q4_K` (144 bytes): f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and minimums per 32
//!   elements (packed as `get_scale_min_k4` reads them), 128 bytes of nibbles: elements
//!   `64 p + i` (i < 32) in the low nibble of `qs[32 p + i]`, `64 p + 32 + i` in its high
//!   nibble; `sc`, `mn` = the 6-bit scale and minimum of the 32, `dm = dmin`.
//! - `block_q5_K` (176 bytes): as Q4_K with 32 bytes `qh` after the scales: bit `e / 32` of
//!   `qh[e % 32]` is the quant's fifth bit.
//! - `block_q6_K` (210 bytes): 128 bytes `ql` (low nibbles), 64 bytes `qh` (2 high bits), 16
//!   signed 8-bit scales per 16 elements, f16 `d`; element `128 h + 32 t + i` has its low
//!   nibble in `ql[64 h + 32 (t % 2) + i]` (high nibble if `t >= 2`) and its high bits at
//!   `2 t` in `qh[32 h + i]`; the value is `d * sc * (q - 32)`, so `mn = 32 sc`, `dm = d`.
//! - `block_q2_K` (84 bytes; its 8-bit path only, routed here by [`super::lowq8`]): 16 bytes of
//!   scales (`sc` the low nibble, `mn` the high nibble per 16 elements), 64 bytes of 2-bit
//!   quants (element `128 h + 32 t + i` at bits `2 t` of `qs[32 h + i]`), f16 `d`, f16 `dmin`.
//! - `block_q3_K` (110 bytes; likewise): 32 bytes `hmask`, the 2-bit quants as Q2_K's, 12
//!   bytes of 6-bit scales (as `q3k_scale_words` unpacks them, each minus 32), f16 `d`; the
//!   value is `d * sc * (q - 4)` with `q = low + 4 h`, `h` bit `e / 32` of `hmask[e % 32]`
//!   (the reference's `low - 4` where that bit is clear), so `mn = 4 sc`, `dm = d`.
//! - `block_iq4_xs` (136 bytes; likewise, kernel type [`KX`]): f16 `d`, u16 `scales_h` (2 bits
//!   per 32 elements), 4 bytes `scales_l` (a nibble per 32), 128 bytes of codebook indices
//!   (elements `32 ib + i` and `32 ib + 16 + i`, i < 16, in the low and high nibble of
//!   `qs[16 ib + i]`). The one exception to the form above: `q` is the signed codebook value
//!   (`KVALUES_IQ4NL`, -127..113), multiplied as `|q|` times the activations with q's signs
//!   (ggml's `mul_add_epi8`); `sc` = the 6-bit scale less 32, no minimum.
//!
//! Integer ranges: `|q| <= 127` times `|y| <= 127` summed in pairs fits i16 (`vpmaddubsw`); times
//! a scale `|sc| <= 128` summed in pairs fits i32 (`vpmaddwd`), and so does the sum over 256
//! elements (< 2^28). The minimum term `sum(mn * bsums)` uses the activations' sums of 16.
//!
//! Levels: AVX2 (`vpmaddubsw` + `vpmaddwd`, tiles 4 x 1 for M = 1, 2 x {2, 1} otherwise; also
//! Q2_K, Q3_K and IQ4_XS, through [`block_low_avx2`]);
//! AVX-512 with VNNI in [`super::kquant512`] (64 quants per vector, `vpdpwssd`); scalar: the
//! same integer sums. Every output's operations are the same whatever
//! tile it lands in, so results do not depend on the thread count.

use super::KQuantW as KW;
use super::Weights;
use crate::DType;
use crate::cpu::simd::Isa;
use crate::dtype::{KVALUES_IQ4NL, QK_K};

#[cfg(target_arch = "x86_64")]
use super::quant::{PF_ROWS, prefetch};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Weight types as const-generic parameters (here and in `kf32`).
pub(super) const K4: u8 = 0;
pub(super) const K5: u8 = 1;
pub(super) const K6: u8 = 2;
/// Q2_K and Q3_K: only this file's AVX2 tiles take them (their other paths are `low*.rs`).
pub(super) const K2: u8 = 3;
pub(super) const K3: u8 = 4;
/// IQ4_XS: likewise at the AVX2 level (this file's tiles for 8-bit activations, `kf32`'s
/// matrix-vector tile for f32 ones); signed codebook values.
pub(super) const KX: u8 = 5;

/// Bytes of one super-block of kernel type `t` (the type table's figure).
pub(super) const fn kblock_bytes(t: u8) -> usize {
    let dt = match t {
        K4 => Weights::KQuant(KW::Q4_K).dtype(),
        K5 => Weights::KQuant(KW::Q5_K).dtype(),
        K6 => Weights::KQuant(KW::Q6_K).dtype(),
        K2 => DType::Q2_K,
        K3 => DType::Q3_K,
        KX => DType::IQ4_XS,
        _ => panic!("not a K-quant kernel type"),
    };
    dt.type_size()
}

/// Offset of the 12 packed scale bytes (Q4_K, Q5_K), of `qh` (Q5_K: 32 bytes, Q6_K: 64), of
/// the nibbles (`qs` / `ql`), and of Q6_K's scales and `d`.
const K45_SCALES: usize = 4;
pub(super) const K5_QH: usize = 16;
pub(super) const K6_QH: usize = 128;
pub(super) const K6_SCALES: usize = 192;
pub(super) const K6_D: usize = 208;
const K2_D: usize = 80;
pub(super) const K3_SCALES: usize = 96;
pub(super) const K3_D: usize = 108;
/// IQ4_XS: f16 `d`, u16 `scales_h` at 2, 4 bytes `scales_l` at 4, the nibbles at 8.
const KX_SCALES_H: usize = 2;
const KX_SCALES_L: usize = 4;
const KX_QS: usize = 8;
pub(super) const fn qs_off(t: u8) -> usize {
    match t {
        K4 | K2 => 16,
        K5 => 48,
        K3 => 32,
        _ => 0,
    }
}

/// One super-block's integer scales and minimums per 16 elements and its two multipliers.
#[derive(Clone, Copy)]
pub(super) struct Head {
    pub sc: [i16; 16],
    pub mn: [i16; 16],
    pub d: f32,
    pub dm: f32,
}

/// The f16 at `p` through the table of every f16 value.
///
/// # Safety
/// `p` readable for 2 bytes; `tab` the 65536-entry table.
#[inline(always)]
pub(super) unsafe fn f16_at(tab: *const f32, p: *const u8) -> f32 {
    // SAFETY: the caller's guarantees; every 16-bit pattern has an entry.
    unsafe { *tab.add(p.cast::<u16>().read_unaligned() as usize) }
}

/// Q4_K / Q5_K's 8 six-bit scales and 8 minimums from their 12 packed bytes: bytes 0-3 hold
/// scales 0-3 (low 6 bits), bytes 4-7 minimums 0-3; scales and minimums 4-7 have their low 4
/// bits in bytes 8-11 (scale low nibble, minimum high nibble) and their top 2 bits in the top
/// bits of bytes 0-3 (scales) and 4-7 (minimums) (ggml-common.h, `get_scale_min_k4`).
/// Returned as four little-endian words: scales 0-3, scales 4-7, minimums 0-3, minimums 4-7.
///
/// # Safety
/// `p` readable for 12 bytes.
#[inline(always)]
pub(super) unsafe fn scales_k4(p: *const u8) -> [u32; 4] {
    // SAFETY: the caller's 12 bytes.
    let w = |i: usize| unsafe { p.add(4 * i).cast::<u32>().read_unaligned() };
    let (w0, w1, w2) = (w(0), w(1), w(2));
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const TOP2: u32 = 0x0303_0303;
    [
        w0 & LOW6,
        (w2 & LOW4) | (((w0 >> 6) & TOP2) << 4),
        w1 & LOW6,
        ((w2 >> 4) & LOW4) | (((w1 >> 6) & TOP2) << 4),
    ]
}

/// Q3_K's 16 six-bit scales from their 12 packed bytes, as four little-endian words of four
/// (groups `4 w .. 4 w + 4`), not yet offset by -32: the low nibbles of groups 0-7 and 8-15
/// are the low and high nibbles of bytes 0-7, the top 2 bits of group `g` are bits `2 (g /
/// 4)` of byte `8 + g % 4` (ggml-common.h `block_q3_K`; the words as ggml-cpu's AVX2
/// `ggml_vec_dot_q3_K_q8_K` forms them).
///
/// # Safety
/// `p` readable for 12 bytes.
#[inline(always)]
pub(super) unsafe fn q3k_scale_words(p: *const u8) -> [u32; 4] {
    // SAFETY: the caller's 12 bytes.
    let w = |i: usize| unsafe { p.add(4 * i).cast::<u32>().read_unaligned() };
    let (w0, w1, top) = (w(0), w(1), w(2));
    const LOW4: u32 = 0x0f0f_0f0f;
    const TOP2: u32 = 0x0303_0303;
    [
        (w0 & LOW4) | ((top & TOP2) << 4),
        (w1 & LOW4) | (((top >> 2) & TOP2) << 4),
        ((w0 >> 4) & LOW4) | (((top >> 4) & TOP2) << 4),
        ((w1 >> 4) & LOW4) | (((top >> 6) & TOP2) << 4),
    ]
}

/// The [`Head`] of the super-block at `b` (portable form).
///
/// # Safety
/// `b` readable for one super-block of `T`.
#[inline(always)]
pub(super) unsafe fn head<const T: u8>(b: *const u8, tab: *const f32) -> Head {
    let mut h = Head {
        sc: [0; 16],
        mn: [0; 16],
        d: 0.0,
        dm: 0.0,
    };
    // SAFETY: offsets inside the super-block.
    unsafe {
        if T == K6 {
            h.d = f16_at(tab, b.add(K6_D));
            h.dm = h.d;
            for j in 0..16 {
                h.sc[j] = *b.add(K6_SCALES + j) as i8 as i16;
                h.mn[j] = 32 * h.sc[j];
            }
        } else if T == K2 {
            h.d = f16_at(tab, b.add(K2_D));
            h.dm = f16_at(tab, b.add(K2_D + 2));
            for j in 0..16 {
                h.sc[j] = (*b.add(j) & 0x0f) as i16;
                h.mn[j] = (*b.add(j) >> 4) as i16;
            }
        } else if T == K3 {
            h.d = f16_at(tab, b.add(K3_D));
            h.dm = h.d;
            let bytes: [u8; 16] = std::mem::transmute(q3k_scale_words(b.add(K3_SCALES)));
            for (j, &v) in bytes.iter().enumerate() {
                h.sc[j] = v as i16 - 32;
                h.mn[j] = 4 * h.sc[j];
            }
        } else if T == KX {
            h.d = f16_at(tab, b);
            let high = b.add(KX_SCALES_H).cast::<u16>().read_unaligned();
            for j in 0..16 {
                let ib = j / 2;
                let low = (*b.add(KX_SCALES_L + ib / 2) >> (4 * (ib % 2))) & 0x0f;
                let top = (high >> (2 * ib)) & 3;
                h.sc[j] = (low as i16 | (top as i16) << 4) - 32;
            }
        } else {
            h.d = f16_at(tab, b);
            h.dm = f16_at(tab, b.add(2));
            let words = scales_k4(b.add(K45_SCALES));
            let bytes: [u8; 16] = std::mem::transmute(words);
            for j in 0..16 {
                h.sc[j] = bytes[j / 2] as i16;
                h.mn[j] = bytes[8 + j / 2] as i16;
            }
        }
    }
    h
}

/// The 32 unsigned quants of elements `32 c .. 32 c + 32` of the super-block at `b` (for
/// [`KX`], the signed codebook values as bytes).
///
/// # Safety
/// `b` readable for one super-block of `T`; `c < 8`.
#[inline(always)]
pub(super) unsafe fn chunk<const T: u8>(b: *const u8, c: usize) -> [u8; 32] {
    let mut q = [0u8; 32];
    // SAFETY: offsets inside the super-block.
    unsafe {
        if T == K6 {
            let (h, t) = (c / 4, c % 4);
            let ql = b.add(64 * h + 32 * (t % 2));
            let qh = b.add(K6_QH + 32 * h);
            for (i, v) in q.iter_mut().enumerate() {
                let lo = (*ql.add(i) >> (4 * (t / 2))) & 0x0f;
                *v = lo | (((*qh.add(i) >> (2 * t)) & 3) << 4);
            }
        } else if T == KX {
            let qs = b.add(KX_QS + 16 * c);
            for i in 0..16 {
                q[i] = KVALUES_IQ4NL[(*qs.add(i) & 0x0f) as usize] as u8;
                q[16 + i] = KVALUES_IQ4NL[(*qs.add(i) >> 4) as usize] as u8;
            }
        } else if T == K2 || T == K3 {
            let qs = b.add(qs_off(T) + 32 * (c / 4));
            for (i, v) in q.iter_mut().enumerate() {
                *v = (*qs.add(i) >> (2 * (c % 4))) & 3;
                if T == K3 {
                    *v |= ((*b.add(i) >> c) & 1) << 2;
                }
            }
        } else {
            let qs = b.add(qs_off(T) + 32 * (c / 2));
            for (i, v) in q.iter_mut().enumerate() {
                *v = (*qs.add(i) >> (4 * (c % 2))) & 0x0f;
                if T == K5 {
                    *v |= ((*b.add(K5_QH + i) >> c) & 1) << 4;
                }
            }
        }
    }
    q
}

// ---- Q8_K activations ----------------------------------------------------------------------

/// Where activation row `r`'s Q8_K quants, scales and sums live in the scratch: the 256
/// quants of each super-block, then one f32 `d` per super-block, then 16 i16 sums per
/// super-block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KActLayout {
    /// Super-blocks per row (K / 256).
    pub nblk: usize,
    /// Bytes per row, a multiple of 64.
    pub row_bytes: usize,
}

impl KActLayout {
    pub fn new(k: usize) -> Self {
        let nblk = k / QK_K;
        KActLayout {
            nblk,
            row_bytes: (nblk * (QK_K + 4 + 32)).next_multiple_of(64),
        }
    }
    pub fn d_off(&self) -> usize {
        self.nblk * QK_K
    }
    pub fn s_off(&self) -> usize {
        self.nblk * (QK_K + 4)
    }
}

/// Quantize `count` super-blocks of f32 at `x` (element `i` at `x + i * stride` bytes) as
/// ggml's `quantize_row_q8_K_ref`: the value of largest magnitude maps to -127, `q =
/// nearest_int(x * -127 / max)` (ties to even) capped at 127, `d = 1 / (-127 / max)`, sums of
/// 16 quants; an all-zero block is `d = 0` with zero quants and sums.
///
/// # Safety
/// `x` readable for `256 * count` strided f32, `qs` writable for `256 * count` bytes, `d` for
/// `count` f32, `sums` for `16 * count` i16.
pub(crate) unsafe fn quantize_blocks(
    x: *const u8,
    stride: usize,
    qs: *mut i8,
    d: *mut f32,
    sums: *mut i16,
    count: usize,
) {
    let mut buf = [0f32; QK_K];
    for b in 0..count {
        for (j, v) in buf.iter_mut().enumerate() {
            // SAFETY: element b * 256 + j of the caller's strided range.
            *v = unsafe {
                x.add((b * QK_K + j) * stride)
                    .cast::<f32>()
                    .read_unaligned()
            };
        }
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in &buf {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        // SAFETY: block b's quants, scale and sums are in the caller's ranges.
        unsafe {
            let q = qs.add(b * QK_K);
            if amax == 0.0 {
                std::ptr::write_bytes(q, 0, QK_K);
                std::ptr::write_bytes(sums.add(16 * b), 0, 16);
                *d.add(b) = 0.0;
                continue;
            }
            let iscale = -127.0 / max;
            for (g, c) in buf.chunks_exact(16).enumerate() {
                let mut s = 0i16;
                for (j, &v) in c.iter().enumerate() {
                    let v = (crate::cpu::simd::round_small(iscale * v) as i32).min(127);
                    s += v as i16;
                    *q.add(16 * g + j) = v as i8;
                }
                *sums.add(16 * b + g) = s;
            }
            *d.add(b) = 1.0 / iscale;
        }
    }
}

// ---- dot-product blocks --------------------------------------------------------------------

/// One block of `dst[m][n] = dot(w[n], a[m])` with K-quant weights and Q8_K activations.
#[derive(Clone, Copy)]
pub(crate) struct KQuantBlock {
    /// First weight row: `lay.nblk` super-blocks (of the type the caller names) at `w + n *
    /// ldw` bytes.
    pub w: *const u8,
    pub ldw: usize,
    /// First activation row in the [`KActLayout`] form; row `m` at `a + m * lay.row_bytes`.
    pub a: *const u8,
    pub lay: KActLayout,
    /// Output: `dst[m][n]` at `d + m * ldd + n` elements.
    pub d: *mut f32,
    pub ldd: usize,
    pub n: usize,
    pub m: usize,
}

/// Compute one block at the given level.
///
/// # Safety
/// Weight rows `n < b.n` hold `b.lay.nblk` super-blocks of `wt`, activation rows `m < b.m`
/// are in the [`KActLayout`] form, `dst[m][n]` is writable and owned by the caller's thread.
pub(crate) unsafe fn block(isa: Isa, wt: KW, b: &KQuantBlock) {
    let tab = crate::cpu::simd::f16_table().as_ptr();
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: supported level (clamped); forwarded caller guarantees.
        unsafe {
            match (isa.clamp(), wt) {
                (Isa::Avx512, KW::Q4_K) => return super::kquant512::block::<K4>(b, tab),
                (Isa::Avx512, KW::Q5_K) => return super::kquant512::block::<K5>(b, tab),
                (Isa::Avx512, KW::Q6_K) => return super::kquant512::block::<K6>(b, tab),
                (Isa::Avx2, KW::Q4_K) => return avx2::block::<K4>(b, tab),
                (Isa::Avx2, KW::Q5_K) => return avx2::block::<K5>(b, tab),
                (Isa::Avx2, KW::Q6_K) => return avx2::block::<K6>(b, tab),
                _ => {}
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match wt {
            KW::Q4_K => scalar_block::<K4>(b, tab),
            KW::Q5_K => scalar_block::<K5>(b, tab),
            KW::Q6_K => scalar_block::<K6>(b, tab),
        }
    }
}

/// Q2_K, Q3_K or IQ4_XS weights (`T`: [`K2`], [`K3`], [`KX`]) against Q8_K activations
/// through this file's AVX2 tiles: `lowq8` sends them here at the AVX2 level, where its
/// generic tiles (every quant decoded into eight vectors, the scales by scalar code) measured
/// 0.66-0.84x ggml's at M = 1 for Q2_K and Q3_K on the Zen 3 host, 0.93x for IQ4_XS
/// (docs/kernels.md).
///
/// # Safety
/// As [`block`], the weights of type `T`; AVX2 available.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn block_low_avx2<const T: u8>(b: &KQuantBlock) {
    const { assert!(T == K2 || T == K3 || T == KX) };
    let tab = crate::cpu::simd::f16_table().as_ptr();
    // SAFETY: forwarded caller guarantees.
    unsafe { avx2::block::<T>(b, tab) }
}

/// Portable fallback: the same integer sums per super-block, scaled and summed in f32.
unsafe fn scalar_block<const T: u8>(b: &KQuantBlock, tab: *const f32) {
    let bs = const { kblock_bytes(T) };
    let lay = b.lay;
    for n in 0..b.n {
        for m in 0..b.m {
            let mut acc = 0f32;
            for blk in 0..lay.nblk {
                // SAFETY: super-block blk of weight row n and of activation row m are in range.
                unsafe {
                    let wb = b.w.add(n * b.ldw + blk * bs);
                    let ar = b.a.add(m * lay.row_bytes);
                    let y = ar.add(blk * QK_K).cast::<i8>();
                    let dy = *ar.add(lay.d_off()).cast::<f32>().add(blk);
                    let sums = ar.add(lay.s_off()).cast::<i16>().add(16 * blk);
                    let h = head::<T>(wb, tab);
                    let (mut isum, mut msum) = (0i32, 0i32);
                    for c in 0..8 {
                        let q = chunk::<T>(wb, c);
                        for half in 0..2 {
                            let mut s = 0i32;
                            for (i, &qi) in q.iter().enumerate().skip(16 * half).take(16) {
                                s += qi as i32 * *y.add(32 * c + i) as i32;
                            }
                            isum += s * h.sc[2 * c + half] as i32;
                        }
                    }
                    for j in 0..16 {
                        msum += h.mn[j] as i32 * sums.add(j).read_unaligned() as i32;
                    }
                    acc += h.d * dy * isum as f32 - h.dm * dy * msum as f32;
                }
            }
            // SAFETY: the caller owns this output element.
            unsafe { *b.d.add(m * b.ldd + n) = acc };
        }
    }
}

/// Q3_K's 16 scales as signed bytes (each less 32) in one vector, from the 12 packed bytes at
/// `p` ([`q3k_scale_words`]).
///
/// # Safety
/// `p` readable for 12 bytes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn q3k_scales_i8(p: *const u8) -> __m128i {
    // SAFETY: the caller's 12 bytes; SSE2 is part of x86_64.
    unsafe {
        let w = q3k_scale_words(p);
        let v = _mm_setr_epi32(w[0] as i32, w[1] as i32, w[2] as i32, w[3] as i32);
        _mm_sub_epi8(v, _mm_set1_epi8(32))
    }
}

/// 16 i16 scales and minimums of the super-block at `b` (the [`Head`] in two vectors) and its
/// two multipliers.
///
/// # Safety
/// `b` readable for one super-block of `T`; `tab` the f16 table.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn head_v<const T: u8>(
    b: *const u8,
    tab: *const f32,
) -> (__m256i, __m256i, f32, f32) {
    // SAFETY: offsets inside the super-block.
    unsafe {
        if T == K6 {
            let d = f16_at(tab, b.add(K6_D));
            let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(K6_SCALES).cast()));
            (sc, _mm256_slli_epi16::<5>(sc), d, d)
        } else if T == K2 {
            let v = _mm_loadu_si128(b.cast());
            let m4 = _mm_set1_epi8(0x0f);
            let sc = _mm256_cvtepu8_epi16(_mm_and_si128(v, m4));
            let mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(v), m4));
            (
                sc,
                mn,
                f16_at(tab, b.add(K2_D)),
                f16_at(tab, b.add(K2_D + 2)),
            )
        } else if T == K3 {
            let sc = _mm256_cvtepi8_epi16(q3k_scales_i8(b.add(K3_SCALES)));
            let d = f16_at(tab, b.add(K3_D));
            (sc, _mm256_slli_epi16::<2>(sc), d, d)
        } else if T == KX {
            let ls = kx_scales(b);
            // Words [0 1 2 3 0 1 2 3 | 4 5 6 7 4 5 6 7], then each twice (one per 16).
            let w = _mm256_packs_epi32(ls, ls);
            let sc = _mm256_unpacklo_epi16(w, w);
            (sc, _mm256_setzero_si256(), f16_at(tab, b), 0.0)
        } else {
            let w = scales_k4(b.add(K45_SCALES));
            let v = _mm_setr_epi32(w[0] as i32, w[1] as i32, w[2] as i32, w[3] as i32);
            // Each scale and minimum twice: one per 16 elements.
            let sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
            let mn = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v));
            (sc, mn, f16_at(tab, b), f16_at(tab, b.add(2)))
        }
    }
}

/// IQ4_XS's eight 6-bit scales, each less 32, in i32 lanes 0-7 (32 elements each): the low
/// nibble of scale `ib` at bit `4 ib` of the four `scales_l` bytes, its top 2 bits at `2 ib`
/// of `scales_h`.
///
/// # Safety
/// `b` readable for one IQ4_XS super-block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn kx_scales(b: *const u8) -> __m256i {
    // SAFETY: offsets inside the super-block.
    let (low, top) = unsafe {
        (
            b.add(KX_SCALES_L).cast::<i32>().read_unaligned(),
            b.add(KX_SCALES_H).cast::<u16>().read_unaligned() as i32,
        )
    };
    let low = _mm256_srlv_epi32(
        _mm256_set1_epi32(low),
        _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
    );
    let top = _mm256_srlv_epi32(
        _mm256_set1_epi32(top),
        _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14),
    );
    let ls = _mm256_or_si256(
        _mm256_and_si256(low, _mm256_set1_epi32(0x0f)),
        _mm256_slli_epi32::<4>(_mm256_and_si256(top, _mm256_set1_epi32(3))),
    );
    _mm256_sub_epi32(ls, _mm256_set1_epi32(32))
}

/// Quants `32 c .. 32 c + 32` of the super-block at `b` as unsigned bytes ([`KX`]: signed).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn chunk_avx2<const T: u8>(b: *const u8, c: usize) -> __m256i {
    let m4 = _mm256_set1_epi8(0x0f);
    // SAFETY: offsets inside the super-block.
    unsafe {
        if T == K6 {
            let (h, t) = (c / 4, c % 4);
            let ql = _mm256_loadu_si256(b.add(64 * h + 32 * (t % 2)).cast());
            let lo = _mm256_and_si256(
                _mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (t / 2) as i32)),
                m4,
            );
            let qh = _mm256_loadu_si256(b.add(K6_QH + 32 * h).cast());
            let hi = _mm256_and_si256(
                _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t as i32)),
                _mm256_set1_epi8(3),
            );
            _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi))
        } else if T == KX {
            // The 16 bytes of chunk c in both lanes, the high lane shifted by a nibble: low
            // nibbles are elements 0-15, high nibbles 16-31; each looked up in the codebook.
            let v = _mm256_broadcastsi128_si256(_mm_loadu_si128(b.add(KX_QS + 16 * c).cast()));
            let v = _mm256_blend_epi32::<0xf0>(v, _mm256_srli_epi16::<4>(v));
            let kv = _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast()));
            _mm256_shuffle_epi8(kv, _mm256_and_si256(v, m4))
        } else if T == K2 || T == K3 {
            let qs = _mm256_loadu_si256(b.add(qs_off(T) + 32 * (c / 4)).cast());
            let lo = _mm256_and_si256(
                _mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * (c % 4) as i32)),
                _mm256_set1_epi8(3),
            );
            if T == K2 {
                return lo;
            }
            // Bit c of each `hmask` byte moved to bit 2 (within its byte: shifts of at most 5
            // bring no bit across), then kept: the 4 of `q = low + 4 h`.
            let hm = _mm256_loadu_si256(b.cast());
            let h = if c >= 2 {
                _mm256_srl_epi16(hm, _mm_cvtsi32_si128(c as i32 - 2))
            } else {
                _mm256_sll_epi16(hm, _mm_cvtsi32_si128(2 - c as i32))
            };
            _mm256_or_si256(lo, _mm256_and_si256(h, _mm256_set1_epi8(4)))
        } else {
            let qs = _mm256_loadu_si256(b.add(qs_off(T) + 32 * (c / 2)).cast());
            let lo = _mm256_and_si256(
                _mm256_srl_epi16(qs, _mm_cvtsi32_si128(4 * (c % 2) as i32)),
                m4,
            );
            if T != K5 {
                return lo;
            }
            let qh = _mm256_loadu_si256(b.add(K5_QH).cast());
            let hi = _mm256_and_si256(
                _mm256_srl_epi16(qh, _mm_cvtsi32_si128(c as i32)),
                _mm256_set1_epi8(1),
            );
            _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi))
        }
    }
}

/// Super-block `blk` of `RM` activation rows in the [`KActLayout`] form at `a`: each row's
/// quants, its scale `dy` and its 16 sums.
///
/// # Safety
/// `a` holds `RM` rows of `lay` with at least `blk + 1` super-blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn act_rows<const RM: usize>(
    a: *const u8,
    lay: KActLayout,
    blk: usize,
) -> ([*const u8; RM], [f32; RM], [__m256i; RM]) {
    let mut y = [std::ptr::null::<u8>(); RM];
    let mut dy = [0f32; RM];
    let mut sums = [_mm256_setzero_si256(); RM];
    for m in 0..RM {
        // SAFETY: super-block blk of activation row m, its scale and sums.
        unsafe {
            let ar = a.add(m * lay.row_bytes);
            y[m] = ar.add(blk * QK_K);
            dy[m] = *ar.add(lay.d_off()).cast::<f32>().add(blk);
            sums[m] = _mm256_loadu_si256(ar.add(lay.s_off() + 32 * blk).cast());
        }
    }
    (y, dy, sums)
}

/// Prefetch the super-block of `bs` bytes `PF_ROWS` weight rows below the one at `wb`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_rows_ahead(wb: *const u8, ldw: usize, bs: usize) {
    for l in 0..bs.div_ceil(64) {
        prefetch(wb.wrapping_add(PF_ROWS * ldw + 64 * l));
    }
}

/// The chunks `$c` of a super-block of weight row `$wb` against `$rm` activation rows `$y`,
/// into `$isum`, one after another: given as literals, every chunk's offsets, shifts and
/// scale mask are constants (the compiler leaves a loop over them rolled for Q5_K and Q6_K);
/// Q4_K passes its loop variable.
#[cfg(target_arch = "x86_64")]
macro_rules! k_chunks {
    ($t:ident, $rm:ident, $wb:ident, $y:ident, $halves:ident, $isum:ident; $($c:tt)+) => {$({
        // SAFETY: chunk $c of the super-block at $wb.
        let q = unsafe { chunk_avx2::<$t>($wb, $c) };
        let sv = chunk_scales(&$halves, $c);
        // Signed quants (IQ4_XS): `|q|` times the activations with q's signs.
        let qa = if $t == KX { _mm256_sign_epi8(q, q) } else { q };
        for m in 0..$rm {
            // SAFETY: 32 quants of activation row m.
            let yv = unsafe { _mm256_loadu_si256($y[m].add(32 * $c).cast()) };
            let yv = if $t == KX { _mm256_sign_epi8(yv, q) } else { yv };
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(qa, yv), sv);
            $isum[m] = _mm256_add_epi32($isum[m], p);
        }
    })+};
}

/// The AVX2 kernels, compiled for the feature list `$feat` with tiles `$m1` (M = 1) and
/// `$mm` (otherwise): `(RN, [RM..])`.
#[cfg(target_arch = "x86_64")]
macro_rules! k_q8_kernels {
    ($feat:literal, ($rn1:literal, [$($rm1:literal),+]), ($rn:literal, [$($rm:literal),+])) => {
        use super::*;
        use crate::cpu::simd::hsum256;

        /// Scales of chunk `c` for `vpmaddwd` (lanes 0-7 `sc[2c]`, lanes 8-15 `sc[2c + 1]`)
        /// from `halves`: the low and the high 128 bits of `sc` (`head_v`'s 16 scales), each
        /// in both lanes. Within a lane, one `vpshufb` (a lane-crossing `vpermd` per chunk
        /// took 8% longer at M = 1); with `c` a literal (`k_chunks`) the mask is a constant.
        #[target_feature(enable = $feat)]
        #[inline]
        fn chunk_scales(halves: &[__m256i; 2], c: usize) -> __m256i {
            // The bytes of scale j = 2c % 8 over the low lane, of j + 1 over the high lane.
            let a = (4 * c % 16) as i8;
            let b = a + 2;
            let pick = _mm256_setr_epi8(
                a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1,
                b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1,
            );
            _mm256_shuffle_epi8(halves[c / 4], pick)
        }

        /// `RN x RM` outputs over all super-blocks.
        #[target_feature(enable = $feat)]
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
            let mut acc = [[_mm256_setzero_ps(); RM]; RN];
            for blk in 0..lay.nblk {
                // SAFETY: super-block blk of the tile's activation rows.
                let (y, dy, sums) = unsafe { act_rows::<RM>(a, lay, blk) };
                for (r, accr) in acc.iter_mut().enumerate() {
                    // SAFETY: super-block blk of weight row r.
                    let wb = unsafe { w.add(r * ldw + blk * bs) };
                    prefetch_rows_ahead(wb, ldw, bs);
                    // SAFETY: as above.
                    let (sc, mn, dw, dm) = unsafe { head_v::<T>(wb, tab) };
                    let halves = [
                        _mm256_permute2x128_si256::<0x00>(sc, sc),
                        _mm256_permute2x128_si256::<0x11>(sc, sc),
                    ];
                    let mut isum = [_mm256_setzero_si256(); RM];
                    // Q5_K and Q6_K unrolled by hand (`k_chunks`): 18% less time for Q6_K at
                    // M = 1, the same for Q5_K; Q4_K's loop as the compiler lays it out is 8%
                    // faster than unrolled (4096 x 4096, 2 threads, weights in cache).
                    if T == K4 {
                        for c in 0..8 {
                            k_chunks!(T, RM, wb, y, halves, isum; c);
                        }
                    } else {
                        k_chunks!(T, RM, wb, y, halves, isum; 0 1 2 3 4 5 6 7);
                    }
                    for (m, a) in accr.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(isum[m]),
                            _mm256_set1_ps(dw * dy[m]),
                            *a,
                        );
                        if T == KX {
                            continue; // no minimums
                        }
                        let mins = _mm256_madd_epi16(mn, sums[m]);
                        *a = _mm256_fnmadd_ps(
                            _mm256_cvtepi32_ps(mins),
                            _mm256_set1_ps(dm * dy[m]),
                            *a,
                        );
                    }
                }
            }
            for (r, accr) in acc.iter().enumerate() {
                for (m, v) in accr.iter().enumerate() {
                    // SAFETY: the output element is in the caller's block.
                    unsafe { *d.add(m * ldd + r) = hsum256(*v) };
                }
            }
        }

        #[target_feature(enable = $feat)]
        pub(super) unsafe fn block<const T: u8>(b: &KQuantBlock, tab: *const f32) {
            if b.m == 1 {
                drive_ktiles!(b, tile, $rn1, [$($rm1),+], tab);
            } else {
                drive_ktiles!(b, tile, $rn, [$($rm),+], tab);
            }
        }
    };
}

/// Drive `$tile::<T, RN, RM>(w, ldw, a, lay, d, ldd, tab)` over a block: full `$rn`-row
/// tiles, leftover weight rows one at a time, activation rows in the widest listed tile.
macro_rules! drive_ktiles {
    ($b:expr, $tile:ident, $rn:literal, [$($rm:literal),+], $tab:expr) => {{
        let b = $b;
        let mut n0 = 0;
        while n0 < b.n {
            let rows = if b.n - n0 >= $rn { $rn } else { 1 };
            let mut m0 = 0;
            while m0 < b.m {
                let left = b.m - m0;
                // SAFETY: rows n0..n0 + rows <= b.n and m0..m0 + cols <= b.m and their
                // outputs are inside the caller's block.
                let (w, a, d) = unsafe {
                    (b.w.add(n0 * b.ldw), b.a.add(m0 * b.lay.row_bytes), b.d.add(m0 * b.ldd + n0))
                };
                let mut cols = 0;
                $(
                    if cols == 0 && left >= $rm {
                        cols = $rm;
                        // SAFETY: as above.
                        unsafe {
                            if rows == $rn {
                                $tile::<T, $rn, $rm>(w, b.ldw, a, b.lay, d, b.ldd, $tab);
                            } else {
                                $tile::<T, 1, $rm>(w, b.ldw, a, b.lay, d, b.ldd, $tab);
                            }
                        }
                    }
                )+
                m0 += cols;
            }
            n0 += rows;
        }
    }};
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    k_q8_kernels!("avx2,fma,f16c", (4, [1]), (2, [2, 1]));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::dtype::{BlockQ8K, quantize};
    use std::mem::transmute;

    #[test]
    fn activations_quantize_as_ggml_q8_k() {
        let k = 512;
        let mut x: Vec<f32> = (0..k)
            .map(|i| ((i * 7919 % 613) as f32 - 300.3) / 17.0)
            .collect();
        x[300] = -40.0; // the second block's extreme is negative
        let mut want = vec![BlockQ8K::default(); k / QK_K];
        quantize(&x, &mut want);
        let (mut qs, mut d, mut s) = (vec![0i8; k], vec![0f32; 2], vec![0i16; 32]);
        // SAFETY: the buffers hold two super-blocks.
        unsafe {
            quantize_blocks(
                x.as_ptr().cast(),
                4,
                qs.as_mut_ptr(),
                d.as_mut_ptr(),
                s.as_mut_ptr(),
                2,
            )
        };
        for (b, wb) in want.iter().enumerate() {
            assert_eq!(d[b], wb.d, "block {b} scale");
            assert_eq!(
                &qs[b * QK_K..(b + 1) * QK_K],
                &wb.qs[..],
                "block {b} quants"
            );
            assert_eq!(&s[16 * b..16 * b + 16], &wb.bsums[..], "block {b} sums");
        }
    }

    /// The AVX2 forms of a super-block's head and chunks ([`head_v`], [`chunk_avx2`]) hold
    /// the portable ones' values.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn assert_avx2_matches(
        dt: DType,
        t: u8,
        b: *const u8,
        h: &Head,
        q: &[u8],
        tab: *const f32,
    ) {
        // SAFETY: the caller's super-block; AVX2 enabled here.
        let ((sc, mn, d, dm), chunks) = unsafe {
            let v = match t {
                K4 => head_v::<K4>(b, tab),
                K5 => head_v::<K5>(b, tab),
                K6 => head_v::<K6>(b, tab),
                K2 => head_v::<K2>(b, tab),
                K3 => head_v::<K3>(b, tab),
                _ => head_v::<KX>(b, tab),
            };
            let c: Vec<[u8; 32]> = (0..8)
                .map(|c| {
                    let v = match t {
                        K4 => chunk_avx2::<K4>(b, c),
                        K5 => chunk_avx2::<K5>(b, c),
                        K6 => chunk_avx2::<K6>(b, c),
                        K2 => chunk_avx2::<K2>(b, c),
                        K3 => chunk_avx2::<K3>(b, c),
                        _ => chunk_avx2::<KX>(b, c),
                    };
                    std::mem::transmute::<__m256i, [u8; 32]>(v)
                })
                .collect();
            (v, c)
        };
        // SAFETY: plain reinterpretations of 256-bit vectors.
        let (sc, mn): ([i16; 16], [i16; 16]) = unsafe {
            (
                transmute::<__m256i, [i16; 16]>(sc),
                transmute::<__m256i, [i16; 16]>(mn),
            )
        };
        assert_eq!((sc, mn, d, dm), (h.sc, h.mn, h.d, h.dm), "{dt} head");
        assert_eq!(chunks.concat(), q, "{dt} quants");
    }

    #[test]
    fn heads_and_chunks_give_the_reference_values() {
        let x: Vec<f32> = (0..QK_K)
            .map(|i| ((i * 31 % 97) as f32 - 40.0) / 9.0)
            .collect();
        let tab = crate::cpu::simd::f16_table().as_ptr();
        let types = [
            (DType::Q4_K, K4),
            (DType::Q5_K, K5),
            (DType::Q6_K, K6),
            (DType::Q2_K, K2),
            (DType::Q3_K, K3),
            (DType::IQ4_XS, KX),
        ];
        for (dt, t) in types {
            let mut bytes = crate::dtype::f32_to_bytes(dt, &x).unwrap();
            if t == KX {
                // Every value of the 6-bit scales' top bits (`scales_h`: 0, 1, 2, 3, 3, 2, 1, 0)
                // and eight low nibbles (`scales_l`: 0, 8, 1, 9, 2, 10, 3, 11), which the
                // quantizer's scales near -32 leave mostly unset.
                bytes[2..8].copy_from_slice(&[0xe4, 0x1b, 0x80, 0x91, 0xa2, 0xb3]);
            }
            let want = crate::dtype::bytes_to_f32(dt, &bytes, QK_K).unwrap();
            // SAFETY: bytes hold one super-block.
            let (h, q) = unsafe {
                let h = match t {
                    K4 => head::<K4>(bytes.as_ptr(), tab),
                    K5 => head::<K5>(bytes.as_ptr(), tab),
                    K6 => head::<K6>(bytes.as_ptr(), tab),
                    K2 => head::<K2>(bytes.as_ptr(), tab),
                    K3 => head::<K3>(bytes.as_ptr(), tab),
                    _ => head::<KX>(bytes.as_ptr(), tab),
                };
                let q: Vec<u8> = (0..8)
                    .flat_map(|c| match t {
                        K4 => chunk::<K4>(bytes.as_ptr(), c),
                        K5 => chunk::<K5>(bytes.as_ptr(), c),
                        K6 => chunk::<K6>(bytes.as_ptr(), c),
                        K2 => chunk::<K2>(bytes.as_ptr(), c),
                        K3 => chunk::<K3>(bytes.as_ptr(), c),
                        _ => chunk::<KX>(bytes.as_ptr(), c),
                    })
                    .collect();
                (h, q)
            };
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
            {
                // SAFETY: AVX2 checked; bytes hold one super-block.
                unsafe { assert_avx2_matches(dt, t, bytes.as_ptr(), &h, &q, tab) };
            }
            for e in 0..QK_K {
                let dl = h.d * h.sc[e / 16] as f32;
                // IQ4_XS's quants are signed codebook values.
                let qe = if t == KX {
                    q[e] as i8 as f32
                } else {
                    q[e] as f32
                };
                let got = dl.mul_add(qe, -(h.dm * h.mn[e / 16] as f32));
                let tol = 1e-6 * (dl.abs() * if t == KX { 128.0 } else { 64.0 } + 1e-30);
                assert!(
                    (got - want[e]).abs() <= tol,
                    "{dt} element {e}: {got} vs {}",
                    want[e]
                );
            }
        }
    }
}
