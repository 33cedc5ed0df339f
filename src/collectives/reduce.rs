//! Element-wise sums over ranks for the reducing collectives: `src_0 + src_1 + ... +
//! src_{n-1}`, added in that order in f32 (F16 and BF16 are widened exactly, summed in f32 and
//! rounded to nearest-even once per element at the end). AVX2/F16C kernels that keep the sums
//! in registers where the CPU has them, portable loops otherwise. Both give bit-identical
//! results, except which NaN payload survives when several inputs of an element are NaN.

use crate::DType;
use half::{bf16, f16};

/// Elements per block: a block of the result is still in L1 when it is copied to the other
/// destinations, and the portable kernel's f32 accumulator (4 KiB) fits there too.
const BLOCK: usize = 1024;

/// Whether the reducing collectives take `dtype`.
pub(crate) fn reducible(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// The element size of `dtype` if the reducing collectives take it and `bytes` (of `what`) is
/// a whole number of its elements; otherwise why not.
pub(crate) fn check_reducible(
    dtype: DType,
    what: &str,
    bytes: usize,
) -> std::result::Result<usize, String> {
    if !reducible(dtype) {
        return Err(format!("dtype {dtype} cannot be summed (F32, F16 or BF16)"));
    }
    let esz = dtype.type_size();
    if !bytes.is_multiple_of(esz) {
        return Err(format!(
            "{what} of {bytes} B is not a whole number of {dtype} elements"
        ));
    }
    Ok(esz)
}

/// Sum `m <= BLOCK` elements at byte offset `off` of every source, in order, into `dst`.
type SumFn = unsafe fn(srcs: &[*const u8], off: usize, dst: *mut u8, m: usize);

fn kernel(dtype: DType) -> SumFn {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        return match dtype {
            DType::F16 => x86::sum::<x86::F16>,
            DType::BF16 => x86::sum::<x86::Bf16>,
            _ => x86::sum::<x86::F32>,
        };
    }
    portable_kernel(dtype)
}

fn portable_kernel(dtype: DType) -> SumFn {
    match dtype {
        DType::F16 => portable_sum::<F16>,
        DType::BF16 => portable_sum::<Bf16>,
        _ => portable_sum::<F32>,
    }
}

/// `dst[i] = srcs[0][i] + srcs[1][i] + ...` for every `dst` in `dsts`, over `n` elements of
/// `dtype` (F32, F16 or BF16; anything else is treated as F32, so callers check
/// [`reducible`] first). The sum is rounded into `dsts[0]`, then copied to the others.
///
/// # Safety
/// Every `srcs[k]` must be valid for reads and every `dsts[k]` for reads and writes of
/// `n * dtype.type_size()` bytes, no other thread may access a destination range or write a
/// source range during the call, and a destination may overlap a source or another
/// destination only by being equal to it (each block is read from every source before any
/// destination block is written). No alignment is required.
pub(crate) unsafe fn sum_into(dtype: DType, dsts: &[*mut u8], srcs: &[*const u8], n: usize) {
    // SAFETY: forwarded from this function's contract.
    unsafe { sum_with(kernel(dtype), dtype, dsts, srcs, n) }
}

/// # Safety
/// As [`sum_into`].
unsafe fn sum_with(k: SumFn, dtype: DType, dsts: &[*mut u8], srcs: &[*const u8], n: usize) {
    let Some((out, copies)) = dsts.split_first() else {
        return;
    };
    if srcs.is_empty() {
        return;
    }
    let esz = dtype.type_size();
    let mut i = 0;
    while i < n {
        let m = BLOCK.min(n - i);
        let at = i * esz;
        // SAFETY: elements i..i+m lie inside every range the caller vouched for. The kernel
        // reads all sources of an element before writing it, so `out` equal to a source is
        // fine; each copy goes to a destination distinct from `out` (equal ones are skipped,
        // as a copy onto itself would overlap).
        unsafe {
            k(srcs, at, out.add(at), m);
            for d in copies.iter().filter(|d| **d != *out) {
                std::ptr::copy_nonoverlapping(out.add(at), d.add(at), m * esz);
            }
        }
        i += m;
    }
}

/// An element type summed through f32: exact widening, rounding narrowing.
trait Elem {
    const SIZE: usize;
    fn widen(b: &[u8]) -> f32;
    fn narrow(x: f32, b: &mut [u8]);
}

struct F32;
struct F16;
struct Bf16;

impl Elem for F32 {
    const SIZE: usize = 4;
    fn widen(b: &[u8]) -> f32 {
        f32::from_ne_bytes([b[0], b[1], b[2], b[3]])
    }
    fn narrow(x: f32, b: &mut [u8]) {
        b.copy_from_slice(&x.to_ne_bytes());
    }
}

impl Elem for F16 {
    const SIZE: usize = 2;
    fn widen(b: &[u8]) -> f32 {
        f16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f32()
    }
    fn narrow(x: f32, b: &mut [u8]) {
        b.copy_from_slice(&f16::from_f32(x).to_bits().to_ne_bytes());
    }
}

impl Elem for Bf16 {
    const SIZE: usize = 2;
    fn widen(b: &[u8]) -> f32 {
        bf16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f32()
    }
    fn narrow(x: f32, b: &mut [u8]) {
        b.copy_from_slice(&bf16::from_f32(x).to_bits().to_ne_bytes());
    }
}

/// The portable kernel: an f32 accumulator block, one pass per source.
///
/// # Safety
/// `m <= BLOCK`; every `srcs[k] + off` valid for reads and `dst` for writes of
/// `m * E::SIZE` bytes; `dst` overlaps no source except by being equal to `srcs[k] + off`.
unsafe fn portable_sum<E: Elem>(srcs: &[*const u8], off: usize, dst: *mut u8, m: usize) {
    let mut acc = [0f32; BLOCK];
    let acc = &mut acc[..m];
    for (k, s) in srcs.iter().enumerate() {
        // SAFETY: valid for m elements by the contract; the shared slice ends before `dst`
        // is written below.
        let src = unsafe { std::slice::from_raw_parts(s.add(off), m * E::SIZE) };
        for (a, b) in acc.iter_mut().zip(src.chunks_exact(E::SIZE)) {
            let v = E::widen(b);
            *a = if k == 0 { v } else { *a + v };
        }
    }
    // SAFETY: valid for m elements by the contract, and no source slice is alive any more.
    let out = unsafe { std::slice::from_raw_parts_mut(dst, m * E::SIZE) };
    for (a, b) in acc.iter().zip(out.chunks_exact_mut(E::SIZE)) {
        E::narrow(*a, b);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 + F16C kernels: 32 elements at a time in four 8-lane f32 accumulators, every
    //! source added in order before the sums are rounded and stored. Lane-wise they compute
    //! exactly what the portable kernel computes: one IEEE f32 add per source, F16 rounding
    //! by VCVTPS2PH with round-to-nearest-even, BF16 rounding by the add-0x7FFF-plus-lsb rule
    //! (NaNs quieted) that `half::bf16::from_f32` uses.
    use super::{BLOCK, Elem};
    use std::arch::x86_64::*;

    /// Eight lanes of an element type.
    pub(super) trait Lanes {
        type Scalar: Elem;
        /// Widen 8 elements at `p`.
        ///
        /// # Safety
        /// `p` valid for reads of 8 elements; the CPU has AVX2 and F16C.
        unsafe fn widen(p: *const u8) -> __m256;
        /// Round 8 lanes to the element type and store them at `p`.
        ///
        /// # Safety
        /// `p` valid for writes of 8 elements; the CPU has AVX2 and F16C.
        unsafe fn narrow(v: __m256, p: *mut u8);
    }

    pub(super) struct F32;
    pub(super) struct F16;
    pub(super) struct Bf16;

    impl Lanes for F32 {
        type Scalar = super::F32;
        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn widen(p: *const u8) -> __m256 {
            // SAFETY: 32 readable bytes by the contract; unaligned load.
            unsafe { _mm256_loadu_ps(p.cast()) }
        }
        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn narrow(v: __m256, p: *mut u8) {
            // SAFETY: 32 writable bytes by the contract; unaligned store.
            unsafe { _mm256_storeu_ps(p.cast(), v) }
        }
    }

    impl Lanes for F16 {
        type Scalar = super::F16;
        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn widen(p: *const u8) -> __m256 {
            // SAFETY: 16 readable bytes by the contract; unaligned load.
            _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
        }
        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn narrow(v: __m256, p: *mut u8) {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            // SAFETY: 16 writable bytes by the contract; unaligned store.
            unsafe { _mm_storeu_si128(p.cast(), h) }
        }
    }

    impl Lanes for Bf16 {
        type Scalar = super::Bf16;
        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn widen(p: *const u8) -> __m256 {
            // SAFETY: 16 readable bytes by the contract; unaligned load.
            let w = _mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(p.cast()) });
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
        }
        #[inline]
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn narrow(v: __m256, p: *mut u8) {
            let x = _mm256_castps_si256(v);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
            let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb);
            let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(x, bias));
            let nan = _mm256_or_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(0x40));
            let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            let r = _mm256_blendv_epi8(rounded, nan, is_nan);
            // 8 x u32 (each < 2^16) to 8 x u16: packus works per 128-bit lane, so the two
            // useful quarters are moved together afterwards.
            let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(r, r));
            // SAFETY: 16 writable bytes by the contract; unaligned store.
            unsafe { _mm_storeu_si128(p.cast(), _mm256_castsi256_si128(packed)) }
        }
    }

    /// The AVX2 kernel (see [`super::SumFn`]).
    ///
    /// # Safety
    /// As `portable_sum`, and the CPU has AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn sum<L: Lanes>(srcs: &[*const u8], off: usize, dst: *mut u8, m: usize) {
        let es = L::Scalar::SIZE;
        let Some((first, rest)) = srcs.split_first() else {
            return;
        };
        debug_assert!(m <= BLOCK);
        let mut j = 0;
        // SAFETY (whole loop): j + 32 <= m, so all 32 elements at j lie in every source's
        // range and in dst's; every source is read before dst is written.
        while j + 32 <= m {
            unsafe {
                let p = first.add(off + j * es);
                let mut a = [
                    L::widen(p),
                    L::widen(p.add(8 * es)),
                    L::widen(p.add(16 * es)),
                    L::widen(p.add(24 * es)),
                ];
                for s in rest {
                    let p = s.add(off + j * es);
                    for (q, acc) in a.iter_mut().enumerate() {
                        *acc = _mm256_add_ps(*acc, L::widen(p.add(8 * q * es)));
                    }
                }
                for (q, acc) in a.into_iter().enumerate() {
                    L::narrow(acc, dst.add((j + 8 * q) * es));
                }
            }
            j += 32;
        }
        while j + 8 <= m {
            // SAFETY: as above, for 8 elements.
            unsafe {
                let mut acc = L::widen(first.add(off + j * es));
                for s in rest {
                    acc = _mm256_add_ps(acc, L::widen(s.add(off + j * es)));
                }
                L::narrow(acc, dst.add(j * es));
            }
            j += 8;
        }
        if j < m {
            // SAFETY: the remaining m - j elements start j elements in.
            unsafe { super::portable_sum::<L::Scalar>(srcs, off + j * es, dst.add(j * es), m - j) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random bit patterns, including NaNs, infinities and subnormals, from a fixed LCG.
    fn patterns(n: usize, seed: u64) -> Vec<u32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 32) as u32
            })
            .collect()
    }

    #[test]
    fn simd_and_portable_kernels_agree_bit_for_bit() {
        // 2500 elements: several blocks, then 32-, 8- and 1-element tails; three sources,
        // offset by one byte to exercise unaligned access.
        let n = 2500;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let esz = dtype.type_size();
            let srcs: Vec<Vec<u8>> = (0..3)
                .map(|k| {
                    let mut v = vec![0u8; 1];
                    for p in patterns(n, k) {
                        v.extend_from_slice(&p.to_ne_bytes()[..esz]);
                    }
                    v
                })
                .collect();
            let ptrs: Vec<*const u8> = srcs.iter().map(|s| s[1..].as_ptr()).collect();
            let mut a = vec![0u8; n * esz];
            let mut a2 = vec![0u8; n * esz];
            let mut b = vec![0u8; n * esz];
            // SAFETY: every pointer covers n elements; a, a2 and b are separate buffers.
            unsafe {
                let fast = [a.as_mut_ptr(), a2.as_mut_ptr()];
                sum_with(kernel(dtype), dtype, &fast, &ptrs, n);
                sum_with(portable_kernel(dtype), dtype, &[b.as_mut_ptr()], &ptrs, n);
            }
            // Where several inputs are NaN, which payload survives may differ (the compiler
            // may swap the operands of a scalar add); every other result is bit-identical.
            let is_nan = |x: &[u8]| match dtype {
                DType::F32 => f32::from_ne_bytes([x[0], x[1], x[2], x[3]]).is_nan(),
                DType::F16 => f16::from_bits(u16::from_ne_bytes([x[0], x[1]])).is_nan(),
                _ => bf16::from_bits(u16::from_ne_bytes([x[0], x[1]])).is_nan(),
            };
            for (i, (x, y)) in a.chunks_exact(esz).zip(b.chunks_exact(esz)).enumerate() {
                assert!(
                    x == y || (is_nan(x) && is_nan(y)),
                    "{dtype} element {i}: {x:x?} != {y:x?}"
                );
            }
            assert!(
                a2 == a,
                "{dtype}: the copy differs from the first destination"
            );
        }
    }

    #[test]
    fn bf16_rounding_matches_half_on_edge_cases() {
        // Eight sums (one AVX2 vector) of three bf16 values whose exact f32 sum sits on a
        // rounding edge; the reference is half's rounding of the same f32 sum.
        let cases: [[u16; 3]; 8] = [
            [0x3f80, 0x3b80, 0x0000], // 1 + 2^-8: a tie with even lsb, rounds down
            [0x3f81, 0x3b80, 0x0000], // a tie with odd lsb, rounds up
            [0x3f80, 0x3b80, 0x3780], // 1 + 2^-8 + 2^-16: above the tie, rounds up
            [0x7f7f, 0x7b00, 0x0000], // max + half an ulp: a tie that rounds up to infinity
            [0x7fc1, 0x3f80, 0x0000], // NaN + 1 stays NaN
            [0xff80, 0x3f80, 0x0000], // -inf + 1
            [0x0001, 0x0001, 0x0000], // subnormals
            [0x8000, 0x8000, 0x8000], // -0 + -0 + -0 = -0
        ];
        let src = |k: usize| -> Vec<u8> { cases.iter().flat_map(|c| c[k].to_ne_bytes()).collect() };
        let srcs = [src(0), src(1), src(2)];
        let ptrs: Vec<*const u8> = srcs.iter().map(|v| v.as_ptr()).collect();
        for k in [kernel(DType::BF16), portable_kernel(DType::BF16)] {
            let mut got = vec![0u8; 2 * cases.len()];
            // SAFETY: every buffer holds cases.len() bf16 values.
            unsafe { sum_with(k, DType::BF16, &[got.as_mut_ptr()], &ptrs, cases.len()) };
            for (j, c) in cases.iter().enumerate() {
                let f: f32 = c.iter().map(|&b| bf16::from_bits(b).to_f32()).sum();
                let want = bf16::from_f32(f).to_bits();
                let have = u16::from_ne_bytes([got[2 * j], got[2 * j + 1]]);
                assert_eq!(have, want, "case {c:04x?}");
            }
        }
    }

    #[test]
    fn sums_in_rank_order_into_the_sources() {
        // The destinations are the sources: every result must use the old values.
        let mut x = [[1.0f32, 1e8, -3.0], [2.0, 1.0, 0.5], [4.0, -1e8, 0.25]];
        let ptrs: Vec<*mut u8> = x.iter_mut().map(|v| v.as_mut_ptr().cast::<u8>()).collect();
        let srcs: Vec<*const u8> = ptrs.iter().map(|p| p.cast_const()).collect();
        // SAFETY: three elements everywhere; destinations equal sources, which is allowed.
        unsafe { sum_into(DType::F32, &ptrs, &srcs, 3) };
        // (1e8 + 1) rounds to 1e8 in f32, then - 1e8 gives 0: the order is visible.
        for v in x {
            assert_eq!(v, [7.0, 0.0, -2.25]);
        }
    }
}
