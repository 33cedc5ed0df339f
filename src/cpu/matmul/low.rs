//! Weight blocks of Q2_K, Q3_K, IQ4_XS (256-element super-blocks) and Q5_1, IQ4_NL (blocks of
//! 32) decoded for the fused kernels ([`super::lowf32`], [`super::lowq8`]): every weight as a
//! small integer `q` (an i8), with per-16 scales, so that the weight is `dl[j] * q - ml[j]`
//! (f32 form) or `da * sc[j] * q - db * mn[j]` (integer form) for sub-block `j` of 16.
//!
//! Layouts after ggml-org/ggml `ggml-common.h` (`block_q2_K`, `block_q3_K`, `block_iq4_xs`,
//! `block_q5_1`, `block_iq4_nl`, `kvalues_iq4nl`), element orders as `crate::dtype`'s
//! reference dequantizers:
//! - Q2_K (84 bytes): `scales[16]` (low nibble scale, high nibble minimum), `qs[64]` (2-bit q
//!   of element e in byte `32 (e / 128) + e % 32` at bit `2 ((e % 128) / 32)`), f16 `d` at 80,
//!   f16 `dmin` at 82; `w = d sc q - dmin mn`.
//! - Q3_K (110 bytes): `hmask[32]` (bit `e / 32` of byte `e % 32`, clear: subtract 4), `qs[64]`
//!   as Q2_K, 12 bytes of 6-bit scales, f16 `d` at 108; `w = d (sc - 32) (q - 4 [h = 0])`. The
//!   kernels take the signed `q - 4 [h = 0]` in -4..3 and `dl = d (sc - 32)`, the reference's
//!   two f32 roundings (`dl`, then `dl * q`) exactly.
//! - IQ4_XS (136 bytes): f16 `d`, u16 `scales_h`, `scales_l[4]`, `qs[128]` (32 elements per
//!   16 bytes: low nibbles first); `w = d (ls - 32) kvalues[idx]`, q = the codebook value.
//! - Q5_1 (24 bytes): f16 `d`, f16 `m`, u32 `qh`, `qs[16]`; `w = d q + m`, q in 0..31
//!   (`ml = -m`).
//! - IQ4_NL (18 bytes): f16 `d`, `qs[16]`; `w = d kvalues[idx]`.
//!
//! Types are const generic codes ([`L2K`] ..), so each kernel is compiled per type.

use super::LowW;
use crate::dtype::{KVALUES_IQ4NL, QK_K};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

pub(super) const L2K: u8 = 0;
pub(super) const L3K: u8 = 1;
pub(super) const LXS: u8 = 2;
pub(super) const L51: u8 = 3;
pub(super) const LNL: u8 = 4;

/// The const code of a type.
pub(super) const fn code(w: LowW) -> u8 {
    match w {
        LowW::Q2_K => L2K,
        LowW::Q3_K => L3K,
        LowW::IQ4_XS => LXS,
        LowW::Q5_1 => L51,
        LowW::IQ4_NL => LNL,
    }
}

/// Elements per block (256 for the super-block types, 32 for Q5_1 and IQ4_NL).
pub(super) const fn elems(t: u8) -> usize {
    if t == L51 || t == LNL { 32 } else { QK_K }
}

/// Bytes per block (ggml-common.h's `static_assert`s).
pub(super) const fn bytes(t: u8) -> usize {
    match t {
        L2K => 84,
        L3K => 110,
        LXS => 136,
        L51 => 24,
        _ => 18,
    }
}

/// Whether `q` takes negative values (then the integer kernels use the sign trick).
pub(super) const fn signed(t: u8) -> bool {
    t == L3K || t == LXS || t == LNL
}

/// Whether the weight has a minimum term (`ml`, `mn`, `db` not zero).
pub(super) const fn has_min(t: u8) -> bool {
    t == L2K || t == L51
}

/// Ask for the cache line at `p` ahead of use (a hint: never faults, any address). The
/// kernels fetch the same block of the weight rows one tile below the ones they read: rows
/// are short, too short for the hardware stream prefetchers to ramp up on each.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch(p: *const u8) {
    // SAFETY: prefetch has no architectural effect; any address is allowed.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
}

/// f16 at `p` through the 65536-entry table.
///
/// # Safety
/// `p` readable for 2 bytes; `tab` the table of `crate::cpu::simd::f16_table`.
#[inline(always)]
pub(super) unsafe fn f16_at(tab: *const f32, p: *const u8) -> f32 {
    // SAFETY: the caller's 2 bytes; every 16-bit pattern has an entry.
    unsafe { *tab.add(p.cast::<u16>().read_unaligned() as usize) }
}

/// Q3_K's 6-bit scale of group `g` (0..16), offset to -32..=31 (ggml-common.h: low 4 bits of
/// groups 0-7 and 8-15 in the low and high nibbles of bytes 0-7, the top 2 bits of group g in
/// byte `8 + g % 4` at bit `2 (g / 4)`).
#[cfg(test)]
fn q3_scale(s: &[u8; 12], g: usize) -> i32 {
    let low = (s[g % 8] >> (4 * (g / 8))) & 0x0f;
    let high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
    (low | (high << 4)) as i32 - 32
}

/// IQ4_XS's 6-bit scale of group `g` (0..8) offset to -32..=31.
#[inline(always)]
fn xs_scale(scales_h: u16, scales_l: &[u8; 4], g: usize) -> i32 {
    let low = (scales_l[g / 2] >> (4 * (g % 2))) & 0x0f;
    let high = ((scales_h >> (2 * g)) & 3) as u8;
    (low | (high << 4)) as i32 - 32
}

/// The integer form of a block: `w = da * sc[j] * q - db * mn[j]` for sub-block j of 16
/// (only the first `elems / 16` used); Q5_1: `w = da * q + db` (`mn` unused).
#[derive(Clone, Copy)]
pub(super) struct IntScales {
    pub sc: [i16; 16],
    pub mn: [i16; 16],
    pub da: f32,
    pub db: f32,
}

/// The integer scales of the block at `b`.
///
/// # Safety
/// `b` readable for one block of `T`.
#[inline(always)]
pub(super) unsafe fn int_scales<const T: u8>(b: *const u8, tab: *const f32) -> IntScales {
    let mut s = IntScales {
        sc: [0; 16],
        mn: [0; 16],
        da: 0.0,
        db: 0.0,
    };
    // SAFETY: offsets inside the block.
    unsafe {
        match T {
            L2K => {
                for j in 0..16 {
                    let v = *b.add(j);
                    s.sc[j] = (v & 0x0f) as i16;
                    s.mn[j] = (v >> 4) as i16;
                }
                s.da = f16_at(tab, b.add(80));
                s.db = f16_at(tab, b.add(82));
            }
            L3K => {
                // Four words of four 6-bit scales (groups 4w..4w + 4; the layout `q3_scale`
                // reads).
                let words = super::kquant::q3k_scale_words(b.add(96));
                for (j, v) in s.sc.iter_mut().enumerate() {
                    *v = (words[j / 4] >> (8 * (j % 4)) & 0xff) as i16 - 32;
                }
                s.da = f16_at(tab, b.add(108));
            }
            LXS => {
                let sh = b.add(2).cast::<u16>().read_unaligned();
                let sl = &*b.add(4).cast::<[u8; 4]>();
                for g in 0..8 {
                    let v = xs_scale(sh, sl, g) as i16;
                    s.sc[2 * g] = v;
                    s.sc[2 * g + 1] = v;
                }
                s.da = f16_at(tab, b);
            }
            L51 => {
                s.sc[..2].fill(1);
                s.da = f16_at(tab, b);
                s.db = f16_at(tab, b.add(2));
            }
            _ => {
                s.sc[..2].fill(1);
                s.da = f16_at(tab, b);
            }
        }
    }
    s
}

/// The f32 form of a block: `(dl, ml)` per sub-block of 16, `w = dl * q - ml`, each `dl` and
/// `ml` the reference dequantizer's f32 value (`d * sc`, `dmin * mn`; Q5_1: `d`, `-m`).
///
/// # Safety
/// `b` readable for one block of `T`.
#[inline(always)]
pub(super) unsafe fn f32_scales<const T: u8>(
    b: *const u8,
    tab: *const f32,
) -> ([f32; 16], [f32; 16]) {
    // SAFETY: forwarded.
    let s = unsafe { int_scales::<T>(b, tab) };
    let (mut dl, mut ml) = ([0f32; 16], [0f32; 16]);
    let n = elems(T) / 16;
    for j in 0..n {
        if T == L51 {
            dl[j] = s.da;
            ml[j] = -s.db;
        } else if T == LNL {
            dl[j] = s.da;
        } else {
            dl[j] = s.da * s.sc[j] as f32;
            ml[j] = s.db * s.mn[j] as f32;
        }
    }
    (dl, ml)
}

/// The quants of the block at `b` (portable form): `elems(T)` values.
///
/// # Safety
/// `b` readable for one block of `T`.
pub(super) unsafe fn quants<const T: u8>(b: *const u8, q: &mut [i8; QK_K]) {
    // SAFETY: offsets inside the block.
    let at = |i: usize| unsafe { *b.add(i) };
    let nib = |qs: usize, j: usize| {
        if j < 16 {
            at(qs + j) & 0x0f
        } else {
            at(qs + j - 16) >> 4
        }
    };
    match T {
        L2K | L3K => {
            let qs = if T == L2K { 16 } else { 32 };
            for (e, v) in q.iter_mut().enumerate() {
                let low = (at(qs + 32 * (e / 128) + e % 32) >> (2 * ((e % 128) / 32))) & 3;
                *v = if T == L2K {
                    low as i8
                } else {
                    let h = at(e % 32) >> (e / 32) & 1;
                    low as i8 - if h == 0 { 4 } else { 0 }
                };
            }
        }
        LXS => {
            for (e, v) in q.iter_mut().enumerate() {
                *v = KVALUES_IQ4NL[nib(8 + 16 * (e / 32), e % 32) as usize];
            }
        }
        L51 => {
            // SAFETY: the 4 bytes of qh.
            let qh = unsafe { b.add(4).cast::<u32>().read_unaligned() };
            for (j, v) in q.iter_mut().take(32).enumerate() {
                *v = (nib(8, j) | (((qh >> j) & 1) as u8) << 4) as i8;
            }
        }
        _ => {
            for (j, v) in q.iter_mut().take(32).enumerate() {
                *v = KVALUES_IQ4NL[nib(2, j) as usize];
            }
        }
    }
}

/// The quants of the block at `b` as vectors of 32 (elements `32 c ..`; Q5_1 and IQ4_NL fill
/// `[0]` only), the values of [`quants`].
///
/// # Safety
/// AVX2 available; `b` readable for one block of `T`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn quants_avx2<const T: u8>(b: *const u8) -> [__m256i; 8] {
    let mut out = [_mm256_setzero_si256(); 8];
    let m4 = _mm256_set1_epi8(0x0f);
    // SAFETY: loads inside the block.
    unsafe {
        let kv = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast());
        // 16 packed bytes at p: 32 nibble indices, low nibbles first.
        let nibbles = |p: *const u8| {
            let v = _mm_loadu_si128(p.cast());
            let v = _mm256_set_m128i(_mm_srli_epi16::<4>(v), v);
            _mm256_and_si256(v, m4)
        };
        let lookup = |i: __m256i| {
            let t = _mm256_set_m128i(kv, kv);
            _mm256_shuffle_epi8(t, i)
        };
        match T {
            L2K | L3K => {
                let qs = b.add(if T == L2K { 16 } else { 32 });
                let m3 = _mm256_set1_epi8(3);
                let hm = _mm256_loadu_si256(b.cast());
                for (c, o) in out.iter_mut().enumerate() {
                    let v = _mm256_loadu_si256(qs.add(32 * (c / 4)).cast());
                    let sh = _mm_cvtsi32_si128(2 * (c % 4) as i32);
                    let low = _mm256_and_si256(_mm256_srl_epi16(v, sh), m3);
                    *o = if T == L2K {
                        low
                    } else {
                        let h = _mm256_srl_epi16(hm, _mm_cvtsi32_si128(c as i32));
                        let h = _mm256_and_si256(h, _mm256_set1_epi8(1));
                        // q - 4 + 4 h
                        let q = _mm256_or_si256(low, _mm256_slli_epi16::<2>(h));
                        _mm256_sub_epi8(q, _mm256_set1_epi8(4))
                    };
                }
            }
            LXS => {
                for (g, o) in out.iter_mut().enumerate() {
                    *o = lookup(nibbles(b.add(8 + 16 * g)));
                }
            }
            L51 => {
                let qh = b.add(4).cast::<u32>().read_unaligned();
                // Byte i gets byte i / 8 of qh, then its bit i % 8 decides the fifth bit.
                let v = _mm256_set1_epi32(qh as i32);
                let spread = _mm256_setr_epi8(
                    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                    3, 3, 3, 3, 3, 3,
                );
                let v = _mm256_shuffle_epi8(v, spread);
                let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
                let high = _mm256_and_si256(set, _mm256_set1_epi8(0x10));
                out[0] = _mm256_or_si256(nibbles(b.add(8)), high);
            }
            _ => out[0] = lookup(nibbles(b.add(2))),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::cpu::matmul::{Weights, kernels_for};

    /// Random blocks of every type: the decoded form gives the reference dequantization's
    /// values bit for bit (f32 form through `fmsub` rounding once where the reference rounds
    /// the same product; Q2_K and Q5_1 to within one rounding of the difference), and the
    /// AVX2 quants equal the portable ones.
    #[test]
    fn decoded_blocks_equal_the_reference_dequantization() {
        fn check<const T: u8>(dt: DType) {
            let tab = crate::cpu::simd::f16_table().as_ptr();
            let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ T as u64;
            let mut next = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            let n = elems(T);
            for _ in 0..50 {
                let x: Vec<f32> = (0..n)
                    .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                let mut blk = vec![0u8; bytes(T)];
                crate::dtype::row_from_f32(dt, &x, &mut blk).unwrap();
                let mut want = vec![0f32; n];
                crate::dtype::row_to_f32(dt, &blk, &mut want).unwrap();
                let mut q = [0i8; QK_K];
                // SAFETY: one block.
                let ((dl, ml), s) = unsafe {
                    quants::<T>(blk.as_ptr(), &mut q);
                    (
                        f32_scales::<T>(blk.as_ptr(), tab),
                        int_scales::<T>(blk.as_ptr(), tab),
                    )
                };
                if T == L3K {
                    // SAFETY: the scales are inside the block.
                    let sc = unsafe { &*blk.as_ptr().add(96).cast::<[u8; 12]>() };
                    for j in 0..16 {
                        assert_eq!(s.sc[j] as i32, q3_scale(sc, j), "q3_k scale {j}");
                    }
                }
                for e in 0..n {
                    let j = e / 16;
                    let got = (q[e] as f32).mul_add(dl[j], -ml[j]);
                    let wq = s.da as f64 * s.sc[j] as f64 * q[e] as f64;
                    // Q5_1's minimum is `+ m` (db), the others' `- db * mn`.
                    let exact = if T == L51 {
                        wq + s.db as f64
                    } else {
                        wq - s.db as f64 * s.mn[j] as f64
                    };
                    let tol = if has_min(T) {
                        1e-6 * ((q[e] as f32 * dl[j]).abs() + ml[j].abs())
                    } else {
                        0.0
                    };
                    assert!(
                        (got - want[e]).abs() <= tol,
                        "{dt} element {e}: {got} {} q={} dl={dl:?} ml={ml:?}",
                        want[e],
                        q[e]
                    );
                    assert!((exact - want[e] as f64).abs() <= 1e-6, "{dt} element {e}");
                }
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: AVX2 checked; one block.
                    let v = unsafe { quants_avx2::<T>(blk.as_ptr()) };
                    // SAFETY: 8 vectors of 32 bytes.
                    let got: [i8; QK_K] = unsafe { std::mem::transmute(v) };
                    assert_eq!(got[..n], q[..n], "{dt}");
                }
            }
        }
        check::<L2K>(DType::Q2_K);
        check::<L3K>(DType::Q3_K);
        check::<LXS>(DType::IQ4_XS);
        check::<L51>(DType::Q5_1);
        check::<LNL>(DType::IQ4_NL);
        for (w, dt) in [
            (LowW::Q2_K, DType::Q2_K),
            (LowW::Q3_K, DType::Q3_K),
            (LowW::IQ4_XS, DType::IQ4_XS),
            (LowW::Q5_1, DType::Q5_1),
            (LowW::IQ4_NL, DType::IQ4_NL),
        ] {
            assert_eq!(kernels_for(dt), Some(Weights::Low(w)));
            assert_eq!(bytes(code(w)), dt.type_size());
            assert_eq!(elems(code(w)), dt.block_size());
        }
    }
}
