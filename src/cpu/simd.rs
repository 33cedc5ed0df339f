//! Vectorized building blocks shared by CPU kernels: the instruction set chosen at run time
//! ([`Isa`]), f16/bf16 <-> f32 row conversion, f32 dot product and sum, dot products and
//! `y += w * x` with f16 rows converted in registers (attention over an f16 KV cache), and a
//! table of every f16 value (quantized blocks' scales).
//!
//! Every helper comes in two forms: `name(..)` uses [`Isa::detect`], `name_with(isa, ..)` runs
//! the given level (tests force [`Isa::Scalar`] to check the portable fallback against the SIMD
//! paths on the same machine). A level above what the CPU supports is lowered to
//! [`Isa::detect`], so `*_with` never executes an unsupported instruction.

use std::sync::OnceLock;

mod halfrows;
pub use halfrows::*;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The SIMD level a kernel runs at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust without explicit SIMD (the compiler may still vectorize for the baseline
    /// target). Used on CPUs without AVX2 and in tests.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (Haswell, Zen 1 and later).
    Avx2,
    /// `Avx2` plus AVX-512 F/BW/VL/VNNI (Ice Lake, Zen 4 and later).
    Avx512,
}

impl Isa {
    /// The best level this CPU supports, detected once. The environment variable
    /// `METASHARD_CPU_ISA` (`scalar`, `avx2`, `avx512`) caps it, for benchmarks and debugging.
    pub fn detect() -> Isa {
        static CACHE: OnceLock<Isa> = OnceLock::new();
        *CACHE.get_or_init(|| {
            let best = Isa::best_supported();
            match std::env::var("METASHARD_CPU_ISA").ok().as_deref() {
                Some(s) => Isa::from_name(s).map_or(best, |cap| cap.min(best)),
                None => best,
            }
        })
    }

    fn best_supported() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            let avx512 = avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni");
            if avx512 {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Every level this CPU can run, lowest first (always starts with `Scalar`).
    pub fn available() -> Vec<Isa> {
        let best = Isa::best_supported();
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|&i| i <= best)
            .collect()
    }

    /// `self`, lowered to what the CPU supports.
    pub fn clamp(self) -> Isa {
        self.min(Isa::best_supported())
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    pub fn from_name(s: &str) -> Option<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(s))
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

// ---- reductions -------------------------------------------------------------------------------

/// `x` rounded to the nearest integer, ties to even, for |x| < 2^22 (quantization to 8 bits,
/// where |x| <= 127): adding and subtracting 1.5 * 2^23 rounds in the current (nearest-even)
/// mode, the same result as `f32::round_ties_even`, which below SSE4.1 is a call to libm's
/// `rintf` per element and keeps loops scalar.
#[inline(always)]
pub fn round_small(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0;
    (x + ROUND) - ROUND
}

/// `sum(a[i] * b[i])` in f32 with several partial sums (the order differs from a sequential
/// loop, so results agree to rounding).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_f32_with(Isa::detect(), a, b)
}

pub fn dot_f32_with(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32: length mismatch");
    // SAFETY: both slices hold a.len() elements.
    unsafe { dot_f32_raw(isa, a.as_ptr(), b.as_ptr(), a.len()) }
}

/// Raw form of [`dot_f32`].
///
/// # Safety
/// `a` and `b` must be readable for `n` f32 each (f32 alignment not required).
pub unsafe fn dot_f32_raw(isa: Isa, a: *const f32, b: *const f32, n: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.clamp() >= Isa::Avx2 {
        // SAFETY: the level is supported; the caller's bounds cover n elements.
        return unsafe { dot_f32_avx2(a, b, n) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    let mut acc = [0f32; 8];
    let mut i = 0;
    while i + 8 <= n {
        for (l, s) in acc.iter_mut().enumerate() {
            // SAFETY: i + l < n.
            unsafe { *s += a.add(i + l).read_unaligned() * b.add(i + l).read_unaligned() };
        }
        i += 8;
    }
    let mut s: f32 = acc.iter().sum();
    for j in i..n {
        // SAFETY: j < n.
        unsafe { s += a.add(j).read_unaligned() * b.add(j).read_unaligned() };
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32_avx2(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (u, s) in acc.iter_mut().enumerate() {
            // SAFETY: i + 8u + 8 <= n.
            unsafe {
                let x = _mm256_loadu_ps(a.add(i + 8 * u));
                let y = _mm256_loadu_ps(b.add(i + 8 * u));
                *s = _mm256_fmadd_ps(x, y, *s);
            }
        }
        i += 32;
    }
    while i + 8 <= n {
        // SAFETY: i + 8 <= n.
        unsafe {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc[0]);
        }
        i += 8;
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut s = hsum256(v);
    for j in i..n {
        // SAFETY: j < n.
        unsafe { s += *a.add(j) * *b.add(j) };
    }
    s
}

/// `sum(a[i])` with several partial sums. Also the streaming-read bandwidth probe of the
/// benchmarks (it reads every byte once and does almost no arithmetic).
pub fn sum_f32(a: &[f32]) -> f32 {
    sum_f32_with(Isa::detect(), a)
}

pub fn sum_f32_with(isa: Isa, a: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.clamp() >= Isa::Avx2 {
        // SAFETY: the level is supported; the slice bounds the reads.
        return unsafe { sum_f32_avx2(a) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    let mut acc = [0f32; 16];
    let mut chunks = a.chunks_exact(16);
    for c in &mut chunks {
        for (s, v) in acc.iter_mut().zip(c) {
            *s += v;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sum_f32_avx2(a: &[f32]) -> f32 {
    let p = a.as_ptr();
    let n = a.len();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (u, s) in acc.iter_mut().enumerate() {
            // SAFETY: i + 8u + 8 <= n.
            *s = _mm256_add_ps(*s, unsafe { _mm256_loadu_ps(p.add(i + 8 * u)) });
        }
        i += 32;
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    hsum256(v) + a[i..].iter().sum::<f32>()
}

/// Sum of the 8 lanes of `v`.
///
/// # Safety
/// The CPU must support AVX2 (call it from a function compiled with the same features).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `n` pseudo-random values in [-4, 4) (xorshift), shared by the SIMD tests.
    pub(crate) fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 8.0 - 4.0
            })
            .collect()
    }

    #[test]
    fn round_small_rounds_ties_to_even() {
        let ties = (-300..300).map(|i| i as f32 + 0.5);
        let near = data(10_000, 9).into_iter().map(|x| x * 40.0);
        let edges = [
            0.0,
            -0.0,
            0.49999997,
            -0.49999997,
            127.0,
            -127.5,
            4_194_303.5,
        ];
        for x in ties.chain(near).chain(edges) {
            assert_eq!(round_small(x), x.round_ties_even(), "{x}");
        }
    }

    #[test]
    fn dot_and_sum_match_f64() {
        for n in [0, 1, 7, 8, 31, 32, 33, 100, 1000] {
            let a = data(n, 3);
            let b = data(n, 4);
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let want_sum: f64 = a.iter().map(|&x| x as f64).sum();
            let scale: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (*x as f64 * *y as f64).abs())
                .sum();
            let scale_sum: f64 = a.iter().map(|&x| (x as f64).abs()).sum();
            for isa in Isa::available() {
                let got = dot_f32_with(isa, &a, &b) as f64;
                assert!((got - want).abs() <= 1e-5 * scale + 1e-6, "{isa} n={n}");
                let got = sum_f32_with(isa, &a) as f64;
                assert!(
                    (got - want_sum).abs() <= 1e-5 * scale_sum + 1e-6,
                    "{isa} n={n}"
                );
            }
        }
    }

    #[test]
    fn levels_are_ordered_and_named() {
        let av = Isa::available();
        assert_eq!(av[0], Isa::Scalar);
        assert!(av.contains(&Isa::detect().clamp()));
        for i in av {
            assert_eq!(Isa::from_name(i.name()), Some(i));
        }
    }
}
