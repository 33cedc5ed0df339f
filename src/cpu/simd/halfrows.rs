//! f16 and bf16 rows for the CPU kernels: conversions to and from f32 (round to nearest even,
//! NaN kept), a table of every f16 value, and dot products and `y += w * x` that read an f16
//! row in place, widening it in registers (attention over an f16 KV cache).

use super::Isa;
#[cfg(target_arch = "x86_64")]
use super::hsum256;
use half::{bf16, f16};
use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

// ---- f16 / bf16 <-> f32 rows ----------------------------------------------------------------

/// `dst[i] = src[i] as f32`; the slices must have the same length.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    f16_to_f32_with(Isa::detect(), src, dst)
}

pub fn f16_to_f32_with(isa: Isa, src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "f16_to_f32: length mismatch");
    // SAFETY: both slices hold `dst.len()` elements; the raw version reads and writes exactly
    // that many, unaligned.
    unsafe { f16_to_f32_raw(isa, src.as_ptr().cast(), dst.as_mut_ptr(), dst.len()) }
}

/// Raw form of [`f16_to_f32`]: `src` points at `n` f16 values (any alignment).
///
/// # Safety
/// `src` must be readable for `2 * n` bytes and `dst` writable for `n` f32 (any alignment for
/// `src`, f32 alignment for `dst`), and they must not overlap.
pub unsafe fn f16_to_f32_raw(isa: Isa, src: *const u8, dst: *mut f32, n: usize) {
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    match isa.clamp() {
        // SAFETY: the level is supported (clamped) and the caller's bounds cover `n` elements.
        Isa::Avx512 => return unsafe { f16_to_f32_avx512(src, dst, n) },
        // SAFETY: as above.
        Isa::Avx2 => i = unsafe { f16_to_f32_avx2(src, dst, n) },
        Isa::Scalar => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    let tab = f16_table();
    for j in i..n {
        // SAFETY: j < n, inside both ranges.
        unsafe {
            let h = src.add(2 * j).cast::<u16>().read_unaligned();
            dst.add(j).write(tab[h as usize]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn f16_to_f32_avx512(src: *const u8, dst: *mut f32, n: usize) {
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: elements i..i+16 are inside the caller's ranges.
        unsafe {
            let h = _mm256_loadu_si256(src.add(2 * i).cast());
            _mm512_storeu_ps(dst.add(i), _mm512_cvtph_ps(h));
        }
        i += 16;
    }
    if i < n {
        let mask = tail_mask(n - i);
        // SAFETY: only the n - i in-range lanes are read and written (masked).
        unsafe {
            let h = _mm256_maskz_loadu_epi16(mask, src.add(2 * i).cast());
            _mm512_mask_storeu_ps(dst.add(i), mask, _mm512_cvtph_ps(h));
        }
    }
}

/// A mask of the low `k < 16` lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn tail_mask(k: usize) -> __mmask16 {
    ((1u32 << k) - 1) as __mmask16
}

/// The f32 value of every f16 bit pattern (256 KiB, built once, on first use, with exact
/// conversions). Kernels that widen one f16 scale per quantized block look it up: one load,
/// which SIMD code broadcasts straight from memory, instead of a vector conversion and a
/// broadcast. The portable conversions use it too.
pub fn f16_table() -> &'static [f32; 65536] {
    static TABLE: OnceLock<Box<[f32; 65536]>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let v: Vec<f32> = (0..=u16::MAX).map(|b| f16::from_bits(b).to_f32()).collect();
        v.into_boxed_slice()
            .try_into()
            .expect("one entry per 16-bit pattern")
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_to_f32_avx2(src: *const u8, dst: *mut f32, n: usize) -> usize {
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements i..i+8 are inside the caller's ranges.
        unsafe {
            let h = _mm_loadu_si128(src.add(2 * i).cast());
            _mm256_storeu_ps(dst.add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    i
}

/// `dst[i] = f16(src[i])`, rounding to nearest even.
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    f32_to_f16_with(Isa::detect(), src, dst)
}

pub fn f32_to_f16_with(isa: Isa, src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_f16: length mismatch");
    // SAFETY: both slices hold `src.len()` elements.
    unsafe { f32_to_f16_raw(isa, src.as_ptr(), dst.as_mut_ptr().cast(), src.len()) }
}

/// Raw form of [`f32_to_f16`]: `dst` receives `n` f16 values (any alignment).
///
/// # Safety
/// `src` must be readable for `n` f32 (any alignment) and `dst` writable for `2 * n` bytes,
/// and they must not overlap.
pub unsafe fn f32_to_f16_raw(isa: Isa, src: *const f32, dst: *mut u8, n: usize) {
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    match isa.clamp() {
        // SAFETY: the level is supported (clamped); the caller's bounds cover n elements.
        Isa::Avx512 => return unsafe { f32_to_f16_avx512(src, dst, n) },
        // SAFETY: as above.
        Isa::Avx2 => i = unsafe { f32_to_f16_avx2(src, dst, n) },
        Isa::Scalar => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    for j in i..n {
        // SAFETY: j < n, inside both ranges.
        unsafe {
            let h = f16::from_f32(src.add(j).read_unaligned());
            dst.add(2 * j).cast::<u16>().write_unaligned(h.to_bits());
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn f32_to_f16_avx512(src: *const f32, dst: *mut u8, n: usize) {
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: elements i..i+16 are inside both ranges.
        unsafe {
            let v = _mm512_loadu_ps(src.add(i));
            let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm256_storeu_si256(dst.add(2 * i).cast(), h);
        }
        i += 16;
    }
    if i < n {
        let mask = tail_mask(n - i);
        // SAFETY: only the n - i in-range lanes are read and written (masked).
        unsafe {
            let v = _mm512_maskz_loadu_ps(mask, src.add(i));
            let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm256_mask_storeu_epi16(dst.add(2 * i).cast(), mask, h);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_to_f16_avx2(src: *const f32, dst: *mut u8, n: usize) -> usize {
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements i..i+8 are inside both slices.
        unsafe {
            let v = _mm256_loadu_ps(src.add(i));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm_storeu_si128(dst.add(2 * i).cast(), h);
        }
        i += 8;
    }
    i
}

/// `dst[i] = src[i] as f32` (bf16 is the upper half of an f32, so this is exact).
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    bf16_to_f32_with(Isa::detect(), src, dst)
}

pub fn bf16_to_f32_with(isa: Isa, src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "bf16_to_f32: length mismatch");
    // SAFETY: both slices hold `dst.len()` elements.
    unsafe { bf16_to_f32_raw(isa, src.as_ptr().cast(), dst.as_mut_ptr(), dst.len()) }
}

/// Raw form of [`bf16_to_f32`].
///
/// # Safety
/// As [`f16_to_f32_raw`].
pub unsafe fn bf16_to_f32_raw(isa: Isa, src: *const u8, dst: *mut f32, n: usize) {
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if isa.clamp() >= Isa::Avx2 {
        // SAFETY: the level is supported and the caller's bounds cover `n` elements.
        i = unsafe { bf16_to_f32_avx2(src, dst, n) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    for j in i..n {
        // SAFETY: j < n, inside both ranges.
        unsafe {
            let b = src.add(2 * j).cast::<u16>().read_unaligned();
            dst.add(j).write(f32::from_bits((b as u32) << 16));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bf16_to_f32_avx2(src: *const u8, dst: *mut f32, n: usize) -> usize {
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements i..i+8 are inside the caller's ranges.
        unsafe {
            let h = _mm_loadu_si128(src.add(2 * i).cast());
            let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
            _mm256_storeu_ps(dst.add(i), _mm256_castsi256_ps(w));
        }
        i += 8;
    }
    i
}

/// `dst[i] = bf16(src[i])`, rounding to nearest even; NaN stays NaN.
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    f32_to_bf16_with(Isa::detect(), src, dst)
}

pub fn f32_to_bf16_with(isa: Isa, src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_bf16: length mismatch");
    // SAFETY: both slices hold `src.len()` elements.
    unsafe { f32_to_bf16_raw(isa, src.as_ptr(), dst.as_mut_ptr().cast(), src.len()) }
}

/// Raw form of [`f32_to_bf16`].
///
/// # Safety
/// As [`f32_to_f16_raw`].
pub unsafe fn f32_to_bf16_raw(isa: Isa, src: *const f32, dst: *mut u8, n: usize) {
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if isa.clamp() >= Isa::Avx2 {
        // SAFETY: the level is supported; the caller's bounds cover n elements.
        i = unsafe { f32_to_bf16_avx2(src, dst, n) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    for j in i..n {
        // SAFETY: j < n, inside both ranges.
        unsafe {
            let b = bf16::from_f32(src.add(j).read_unaligned());
            dst.add(2 * j).cast::<u16>().write_unaligned(b.to_bits());
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_to_bf16_avx2(src: *const f32, dst: *mut u8, n: usize) -> usize {
    // Round to nearest even: add 0x7fff plus the lowest kept bit, then drop 16 bits. NaNs keep
    // their top bits with the quiet bit set, so they cannot round to infinity.
    let bias = _mm256_set1_epi32(0x7fff);
    let one = _mm256_set1_epi32(1);
    let quiet = _mm256_set1_epi32(0x0040_0000);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements i..i+8 are inside both slices.
        unsafe {
            let v = _mm256_loadu_ps(src.add(i));
            let x = _mm256_castps_si256(v);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), one);
            let rounded = _mm256_add_epi32(x, _mm256_add_epi32(bias, lsb));
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            let r = _mm256_blendv_epi8(rounded, _mm256_or_si256(x, quiet), nan);
            let hi = _mm256_srli_epi32::<16>(r);
            // Pack 8 x u32 (each < 65536) into 8 x u16.
            let packed = _mm256_packus_epi32(hi, hi);
            let packed = _mm256_permute4x64_epi64::<0b00_00_10_00>(packed);
            _mm_storeu_si128(dst.add(2 * i).cast(), _mm256_castsi256_si128(packed));
        }
        i += 8;
    }
    i
}

// ---- f16 rows used in place (attention over an f16 KV cache) -------------------------------

/// `sum(a[i] * b[i])` with `b` an f16 row converted in registers (no scratch row).
///
/// # Safety
/// `a` must be readable for `n` f32 (any alignment) and `b` for `2 * n` bytes.
pub unsafe fn dot_f16_f32_raw(isa: Isa, a: *const f32, b: *const u8, n: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    match isa.clamp() {
        // SAFETY: the level is supported (clamped); the caller's bounds cover n elements.
        Isa::Avx512 => return unsafe { dot_f16_f32_avx512(a, b, n) },
        // SAFETY: as above.
        Isa::Avx2 => return unsafe { dot_f16_f32_avx2(a, b, n) },
        Isa::Scalar => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    let tab = f16_table();
    // SAFETY: i < n for every read.
    let xy = |i: usize| unsafe {
        (
            a.add(i).read_unaligned(),
            tab[b.add(2 * i).cast::<u16>().read_unaligned() as usize],
        )
    };
    let mut acc = [0f32; 8];
    let mut i = 0;
    while i + 8 <= n {
        for (l, s) in acc.iter_mut().enumerate() {
            let (x, y) = xy(i + l);
            *s += x * y;
        }
        i += 8;
    }
    let mut s: f32 = acc.iter().sum();
    for j in i..n {
        let (x, y) = xy(j);
        s += x * y;
    }
    s
}

/// `acc[i] += w * v[i]` with `v` an f16 row converted in registers.
///
/// # Safety
/// `acc` must be valid for reading and writing `n` f32 (any alignment), `v` readable for
/// `2 * n` bytes, and they must not overlap.
pub unsafe fn axpy_f16_raw(isa: Isa, acc: *mut f32, w: f32, v: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    match isa.clamp() {
        // SAFETY: the level is supported (clamped); the caller's bounds cover n elements.
        Isa::Avx512 => return unsafe { axpy_f16_avx512(acc, w, v, n) },
        // SAFETY: as above.
        Isa::Avx2 => return unsafe { axpy_f16_avx2(acc, w, v, n) },
        Isa::Scalar => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    let tab = f16_table();
    for i in 0..n {
        // SAFETY: i < n, inside both ranges.
        unsafe {
            let y = tab[v.add(2 * i).cast::<u16>().read_unaligned() as usize];
            let p = acc.add(i);
            p.write_unaligned(p.read_unaligned() + w * y);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_f16_f32_avx512(a: *const f32, b: *const u8, n: usize) -> f32 {
    let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY: elements i..i+32 are inside both ranges.
        unsafe {
            let y0 = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(2 * i).cast()));
            let y1 = _mm512_cvtph_ps(_mm256_loadu_si256(b.add(2 * i + 32).cast()));
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(i)), y0, s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(i + 16)), y1, s1);
        }
        i += 32;
    }
    while i < n {
        let mask = if n - i >= 16 { !0 } else { tail_mask(n - i) };
        // SAFETY: only the in-range lanes are read (masked loads do not touch the others).
        unsafe {
            let y = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, b.add(2 * i).cast()));
            s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a.add(i)), y, s0);
        }
        i += 16;
    }
    _mm512_reduce_add_ps(_mm512_add_ps(s0, s1))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn axpy_f16_avx512(acc: *mut f32, w: f32, v: *const u8, n: usize) {
    let wv = _mm512_set1_ps(w);
    let mut i = 0;
    while i < n {
        let mask = if n - i >= 16 { !0 } else { tail_mask(n - i) };
        // SAFETY: only the in-range lanes are read and written (masked).
        unsafe {
            let y = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, v.add(2 * i).cast()));
            let a = _mm512_maskz_loadu_ps(mask, acc.add(i));
            _mm512_mask_storeu_ps(acc.add(i), mask, _mm512_fmadd_ps(wv, y, a));
        }
        i += 16;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16_f32_avx2(a: *const f32, b: *const u8, n: usize) -> f32 {
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: elements i..i+16 are inside both ranges.
        unsafe {
            let y0 = _mm256_cvtph_ps(_mm_loadu_si128(b.add(2 * i).cast()));
            let y1 = _mm256_cvtph_ps(_mm_loadu_si128(b.add(2 * i + 16).cast()));
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), y0, s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i + 8)), y1, s1);
        }
        i += 16;
    }
    if i + 8 <= n {
        // SAFETY: elements i..i+8 are inside both ranges.
        unsafe {
            let y = _mm256_cvtph_ps(_mm_loadu_si128(b.add(2 * i).cast()));
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), y, s0);
        }
        i += 8;
    }
    let mut s = hsum256(_mm256_add_ps(s0, s1));
    let tab = f16_table();
    for j in i..n {
        // SAFETY: j < n, inside both ranges.
        unsafe { s += *a.add(j) * tab[b.add(2 * j).cast::<u16>().read_unaligned() as usize] };
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_f16_avx2(acc: *mut f32, w: f32, v: *const u8, n: usize) {
    let wv = _mm256_set1_ps(w);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements i..i+8 are inside both ranges.
        unsafe {
            let y = _mm256_cvtph_ps(_mm_loadu_si128(v.add(2 * i).cast()));
            let p = acc.add(i);
            _mm256_storeu_ps(p, _mm256_fmadd_ps(wv, y, _mm256_loadu_ps(p)));
        }
        i += 8;
    }
    let tab = f16_table();
    for j in i..n {
        // SAFETY: j < n, inside both ranges.
        unsafe {
            let y = tab[v.add(2 * j).cast::<u16>().read_unaligned() as usize];
            *acc.add(j) = w.mul_add(y, *acc.add(j));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cpu::simd::tests::data;

    #[test]
    fn conversions_match_half_crate_on_every_level() {
        let mut x = data(67, 1);
        x.extend([
            f32::INFINITY,
            -0.0,
            1e-8,
            65504.0,
            70000.0,
            f32::NAN,
            3.0e38,
        ]);
        x.extend(data(9, 2));
        for isa in Isa::available() {
            let mut h = vec![f16::ZERO; x.len()];
            f32_to_f16_with(isa, &x, &mut h);
            let mut b = vec![bf16::ZERO; x.len()];
            f32_to_bf16_with(isa, &x, &mut b);
            for (i, &v) in x.iter().enumerate() {
                if v.is_nan() {
                    assert!(h[i].is_nan() && b[i].is_nan(), "{isa}: NaN lost at {i}");
                } else {
                    assert_eq!(h[i], f16::from_f32(v), "{isa}: f16 of {v}");
                    assert_eq!(b[i], bf16::from_f32(v), "{isa}: bf16 of {v}");
                }
            }
            let mut back = vec![0f32; x.len()];
            f16_to_f32_with(isa, &h, &mut back);
            for (i, &v) in back.iter().enumerate() {
                assert!(
                    v.to_bits() == h[i].to_f32().to_bits() || v.is_nan(),
                    "{isa}: {i}"
                );
            }
            bf16_to_f32_with(isa, &b, &mut back);
            for (i, &v) in back.iter().enumerate() {
                assert!(
                    v.to_bits() == b[i].to_f32().to_bits() || v.is_nan(),
                    "{isa}: {i}"
                );
            }
        }
    }

    #[test]
    fn bf16_rounds_ties_to_even() {
        // 1 + 2^-8 is halfway between two bf16 values; ties go to the even mantissa (1.0).
        let tie = f32::from_bits(0x3f80_8000);
        let above = f32::from_bits(0x3f80_8001);
        let odd_tie = f32::from_bits(0x3f81_8000);
        for isa in Isa::available() {
            let mut out = vec![bf16::ZERO; 8];
            f32_to_bf16_with(
                isa,
                &[tie, above, odd_tie, 0.0, 0.0, 0.0, 0.0, 0.0],
                &mut out,
            );
            assert_eq!(out[0].to_bits(), 0x3f80, "{isa}");
            assert_eq!(out[1].to_bits(), 0x3f81, "{isa}");
            assert_eq!(out[2].to_bits(), 0x3f82, "{isa}");
        }
    }

    #[test]
    fn the_f16_table_holds_every_value() {
        let t = f16_table();
        for b in 0..=u16::MAX {
            let want = f16::from_bits(b).to_f32();
            assert!(
                t[b as usize].to_bits() == want.to_bits()
                    || (want.is_nan() && t[b as usize].is_nan()),
                "{b:#06x}"
            );
        }
    }

    /// f16 bytes of `v` starting `off` bytes into a buffer of sentinel bytes.
    fn f16_bytes(v: &[f32], off: usize) -> Vec<u8> {
        let mut out = vec![0xeeu8; off + 2 * v.len() + 8];
        for (i, x) in v.iter().enumerate() {
            out[off + 2 * i..off + 2 * i + 2].copy_from_slice(&f16::from_f32(*x).to_le_bytes());
        }
        out
    }

    #[test]
    fn fused_f16_dot_and_axpy_match_f64_on_every_level() {
        for n in [0, 1, 7, 8, 15, 16, 17, 31, 32, 33, 48, 64, 100, 257] {
            let a = data(n + 1, 5);
            let v = data(n, 6);
            // The f16 row and the f32 row start at odd offsets (unaligned for their types).
            let vb = f16_bytes(&v, 1);
            let vh: Vec<f64> = v
                .iter()
                .map(|&x| f16::from_f32(x).to_f32() as f64)
                .collect();
            let af = &a[1..];
            let want: f64 = af.iter().zip(&vh).map(|(x, y)| *x as f64 * y).sum();
            let scale: f64 = af.iter().zip(&vh).map(|(x, y)| (*x as f64 * y).abs()).sum();
            let w = 0.37f32;
            for isa in Isa::available() {
                // SAFETY: af holds n floats, vb holds n f16 from byte 1.
                let got = unsafe { dot_f16_f32_raw(isa, af.as_ptr(), vb[1..].as_ptr(), n) };
                assert!(
                    (got as f64 - want).abs() <= 1e-6 * scale + 1e-7,
                    "{isa} n={n}: dot {got} vs {want}"
                );
                // acc sits between guard values that must survive.
                let mut acc = vec![f32::MAX; n + 2];
                acc[1..=n].copy_from_slice(&a[..n]);
                // SAFETY: acc[1..=n] is in range, vb holds n f16 from byte 1.
                unsafe { axpy_f16_raw(isa, acc[1..].as_mut_ptr(), w, vb[1..].as_ptr(), n) };
                assert!(
                    acc[0] == f32::MAX && acc[n + 1] == f32::MAX,
                    "{isa} n={n}: guard"
                );
                for i in 0..n {
                    let want = a[i] as f64 + w as f64 * vh[i];
                    let tol = 2e-7 * (a[i].abs() as f64 + (w as f64 * vh[i]).abs());
                    assert!(
                        (acc[i + 1] as f64 - want).abs() <= tol,
                        "{isa} n={n} i={i}: axpy {} vs {want}",
                        acc[i + 1]
                    );
                }
            }
        }
    }

    #[test]
    fn raw_conversions_handle_tails_and_odd_addresses() {
        for n in [0, 1, 15, 16, 17, 40] {
            let x = data(n, 9);
            for isa in Isa::available() {
                let mut h = vec![0xeeu8; 2 * n + 3];
                let mut back = vec![7f32; n + 1];
                // SAFETY: h has 2n bytes from offset 1; back has n + 1 floats.
                unsafe {
                    f32_to_f16_raw(isa, x.as_ptr(), h[1..].as_mut_ptr(), n);
                    f16_to_f32_raw(isa, h[1..].as_ptr(), back.as_mut_ptr(), n);
                }
                assert_eq!(h[0], 0xee, "{isa} n={n}");
                assert_eq!(&h[2 * n + 1..], &[0xee, 0xee], "{isa} n={n}");
                assert_eq!(back[n], 7.0, "{isa} n={n}");
                for i in 0..n {
                    assert_eq!(back[i], f16::from_f32(x[i]).to_f32(), "{isa} n={n} i={i}");
                }
                let mut b = vec![0xeeu8; 2 * n + 3];
                // SAFETY: b has 2n bytes from offset 1.
                unsafe { f32_to_bf16_raw(isa, x.as_ptr(), b[1..].as_mut_ptr(), n) };
                for i in 0..n {
                    let got = u16::from_le_bytes([b[1 + 2 * i], b[2 + 2 * i]]);
                    assert_eq!(got, bf16::from_f32(x[i]).to_bits(), "{isa} n={n} i={i}");
                }
            }
        }
    }
}
