//! Element-wise sums over ranks for the reducing collectives: `src_0 + src_1 + ... +
//! src_{n-1}`, added in that order in f32 (F16 and BF16 are widened exactly, summed in f32 and
//! rounded to nearest-even once per element at the end). AVX2/F16C kernels where the CPU has
//! them, portable loops otherwise; both give bit-identical results.

use crate::DType;
use half::{bf16, f16};

/// Elements per block: the f32 accumulator (4 KiB) stays in L1 while every source streams
/// through it once.
const BLOCK: usize = 1024;

/// Whether the reducing collectives take `dtype`.
pub(crate) fn reducible(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// Widen `acc.len()` elements at `src` into `acc` (`add == false`) or add them (`add == true`).
type LoadFn = unsafe fn(src: *const u8, acc: &mut [f32], add: bool);
/// Round `acc` to the element type and write it to `dst`.
type StoreFn = unsafe fn(acc: &[f32], dst: *mut u8);

struct Kernels {
    load: LoadFn,
    store: StoreFn,
}

fn kernels(dtype: DType) -> Kernels {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        return match dtype {
            DType::F16 => Kernels {
                load: x86::load_f16,
                store: x86::store_f16,
            },
            DType::BF16 => Kernels {
                load: x86::load_bf16,
                store: x86::store_bf16,
            },
            _ => Kernels {
                load: x86::load_f32,
                store: store_f32,
            },
        };
    }
    portable_kernels(dtype)
}

fn portable_kernels(dtype: DType) -> Kernels {
    match dtype {
        DType::F16 => Kernels {
            load: load_f16,
            store: store_f16,
        },
        DType::BF16 => Kernels {
            load: load_bf16,
            store: store_bf16,
        },
        _ => Kernels {
            load: load_f32,
            store: store_f32,
        },
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
    unsafe { sum_with(kernels(dtype), dtype, dsts, srcs, n) }
}

/// # Safety
/// As [`sum_into`].
unsafe fn sum_with(k: Kernels, dtype: DType, dsts: &[*mut u8], srcs: &[*const u8], n: usize) {
    let (Some((first, rest)), Some((out, copies))) = (srcs.split_first(), dsts.split_first())
    else {
        return;
    };
    let esz = dtype.type_size();
    let mut acc = [0f32; BLOCK];
    let mut i = 0;
    while i < n {
        let m = BLOCK.min(n - i);
        let acc = &mut acc[..m];
        let at = i * esz;
        // SAFETY: elements i..i+m lie inside every range the caller vouched for; `acc` is a
        // local array, so it overlaps none of them. Destination blocks are written only after
        // every source block was read, which makes a destination equal to a source fine, and
        // `out` is distinct from every `copies` entry or equal to it (copying onto itself
        // would overlap, so equal pointers are skipped).
        unsafe {
            (k.load)(first.add(at), acc, false);
            for s in rest {
                (k.load)(s.add(at), acc, true);
            }
            (k.store)(acc, out.add(at));
            for d in copies.iter().filter(|d| **d != *out) {
                std::ptr::copy_nonoverlapping(out.add(at), d.add(at), m * esz);
            }
        }
        i += m;
    }
}

/// Read element `j` (of `N` bytes) at `src`.
///
/// # Safety
/// `src` must be valid for reads of `(j + 1) * N` bytes.
#[inline(always)]
unsafe fn elem<const N: usize>(src: *const u8, j: usize) -> [u8; N] {
    // SAFETY: in bounds by the caller's contract; `[u8; N]` has alignment 1.
    unsafe { src.add(j * N).cast::<[u8; N]>().read() }
}

/// # Safety
/// `src` valid for reads of `4 * acc.len()` bytes.
unsafe fn load_f32(src: *const u8, acc: &mut [f32], add: bool) {
    for (j, a) in acc.iter_mut().enumerate() {
        // SAFETY: j < acc.len().
        let v = f32::from_ne_bytes(unsafe { elem::<4>(src, j) });
        *a = if add { *a + v } else { v };
    }
}

/// # Safety
/// `dst` valid for writes of `4 * acc.len()` bytes, not overlapping `acc`.
unsafe fn store_f32(acc: &[f32], dst: *mut u8) {
    // SAFETY: sizes match and the ranges are disjoint by the contract.
    unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr().cast::<u8>(), dst, 4 * acc.len()) }
}

/// # Safety
/// `src` valid for reads of `2 * acc.len()` bytes.
unsafe fn load_f16(src: *const u8, acc: &mut [f32], add: bool) {
    for (j, a) in acc.iter_mut().enumerate() {
        // SAFETY: j < acc.len().
        let v = f16::from_bits(u16::from_ne_bytes(unsafe { elem::<2>(src, j) })).to_f32();
        *a = if add { *a + v } else { v };
    }
}

/// # Safety
/// `dst` valid for writes of `2 * acc.len()` bytes.
unsafe fn store_f16(acc: &[f32], dst: *mut u8) {
    for (j, &a) in acc.iter().enumerate() {
        let b = f16::from_f32(a).to_bits().to_ne_bytes();
        // SAFETY: j < acc.len(), so the two bytes are in bounds.
        unsafe { dst.add(2 * j).cast::<[u8; 2]>().write(b) }
    }
}

/// # Safety
/// `src` valid for reads of `2 * acc.len()` bytes.
unsafe fn load_bf16(src: *const u8, acc: &mut [f32], add: bool) {
    for (j, a) in acc.iter_mut().enumerate() {
        // SAFETY: j < acc.len().
        let v = bf16::from_bits(u16::from_ne_bytes(unsafe { elem::<2>(src, j) })).to_f32();
        *a = if add { *a + v } else { v };
    }
}

/// # Safety
/// `dst` valid for writes of `2 * acc.len()` bytes.
unsafe fn store_bf16(acc: &[f32], dst: *mut u8) {
    for (j, &a) in acc.iter().enumerate() {
        let b = bf16::from_f32(a).to_bits().to_ne_bytes();
        // SAFETY: j < acc.len(), so the two bytes are in bounds.
        unsafe { dst.add(2 * j).cast::<[u8; 2]>().write(b) }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 + F16C versions of the loads and stores, 8 lanes at a time with the portable
    //! loops for the tail. Lane-wise they compute exactly what the portable loops compute:
    //! one IEEE f32 add per element, F16 rounding by VCVTPS2PH with round-to-nearest-even,
    //! BF16 rounding by the same add-0x7FFF-plus-lsb rule (NaNs quieted) as `half::bf16`.
    use std::arch::x86_64::*;

    /// # Safety
    /// `src` valid for reads of `4 * acc.len()` bytes; the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn load_f32(src: *const u8, acc: &mut [f32], add: bool) {
        let n8 = acc.len() / 8 * 8;
        let a = acc.as_mut_ptr();
        for j in (0..n8).step_by(8) {
            // SAFETY: j + 8 <= acc.len(); unaligned loads and stores.
            unsafe {
                let v = _mm256_loadu_ps(src.add(4 * j).cast());
                let v = if add {
                    _mm256_add_ps(_mm256_loadu_ps(a.add(j)), v)
                } else {
                    v
                };
                _mm256_storeu_ps(a.add(j), v);
            }
        }
        // SAFETY: the tail starts 4 * n8 bytes in and has acc.len() - n8 elements.
        unsafe { super::load_f32(src.add(4 * n8), &mut acc[n8..], add) }
    }

    /// # Safety
    /// `src` valid for reads of `2 * acc.len()` bytes; the CPU has AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn load_f16(src: *const u8, acc: &mut [f32], add: bool) {
        let n8 = acc.len() / 8 * 8;
        let a = acc.as_mut_ptr();
        for j in (0..n8).step_by(8) {
            // SAFETY: j + 8 <= acc.len(); unaligned loads and stores.
            unsafe {
                let v = _mm256_cvtph_ps(_mm_loadu_si128(src.add(2 * j).cast()));
                let v = if add {
                    _mm256_add_ps(_mm256_loadu_ps(a.add(j)), v)
                } else {
                    v
                };
                _mm256_storeu_ps(a.add(j), v);
            }
        }
        // SAFETY: the tail starts 2 * n8 bytes in and has acc.len() - n8 elements.
        unsafe { super::load_f16(src.add(2 * n8), &mut acc[n8..], add) }
    }

    /// # Safety
    /// `dst` valid for writes of `2 * acc.len()` bytes; the CPU has AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn store_f16(acc: &[f32], dst: *mut u8) {
        let n8 = acc.len() / 8 * 8;
        let a = acc.as_ptr();
        for j in (0..n8).step_by(8) {
            // SAFETY: j + 8 <= acc.len(); unaligned loads and stores.
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(a.add(j)));
                _mm_storeu_si128(dst.add(2 * j).cast(), h);
            }
        }
        // SAFETY: the tail starts 2 * n8 bytes in and has acc.len() - n8 elements.
        unsafe { super::store_f16(&acc[n8..], dst.add(2 * n8)) }
    }

    /// # Safety
    /// `src` valid for reads of `2 * acc.len()` bytes; the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn load_bf16(src: *const u8, acc: &mut [f32], add: bool) {
        let n8 = acc.len() / 8 * 8;
        let a = acc.as_mut_ptr();
        for j in (0..n8).step_by(8) {
            // SAFETY: j + 8 <= acc.len(); unaligned loads and stores.
            unsafe {
                let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(src.add(2 * j).cast()));
                let v = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w));
                let v = if add {
                    _mm256_add_ps(_mm256_loadu_ps(a.add(j)), v)
                } else {
                    v
                };
                _mm256_storeu_ps(a.add(j), v);
            }
        }
        // SAFETY: the tail starts 2 * n8 bytes in and has acc.len() - n8 elements.
        unsafe { super::load_bf16(src.add(2 * n8), &mut acc[n8..], add) }
    }

    /// # Safety
    /// `dst` valid for writes of `2 * acc.len()` bytes; the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn store_bf16(acc: &[f32], dst: *mut u8) {
        let n8 = acc.len() / 8 * 8;
        let a = acc.as_ptr();
        let half_ulp = _mm256_set1_epi32(0x7fff);
        let one = _mm256_set1_epi32(1);
        let quiet = _mm256_set1_epi32(0x40);
        for j in (0..n8).step_by(8) {
            // SAFETY: j + 8 <= acc.len(); unaligned loads and stores.
            unsafe {
                let v = _mm256_loadu_ps(a.add(j));
                let x = _mm256_castps_si256(v);
                let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), one);
                let rounded =
                    _mm256_srli_epi32::<16>(_mm256_add_epi32(x, _mm256_add_epi32(half_ulp, lsb)));
                let nan = _mm256_or_si256(_mm256_srli_epi32::<16>(x), quiet);
                let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
                let r = _mm256_blendv_epi8(rounded, nan, is_nan);
                // Pack 8 x u32 (each < 2^16) to 8 x u16: packus works per 128-bit lane, so
                // the two useful quarters are moved together afterwards.
                let p = _mm256_packus_epi32(r, r);
                let p = _mm256_permute4x64_epi64::<0b1000>(p);
                _mm_storeu_si128(dst.add(2 * j).cast(), _mm256_castsi256_si128(p));
            }
        }
        // SAFETY: the tail starts 2 * n8 bytes in and has acc.len() - n8 elements.
        unsafe { super::store_bf16(&acc[n8..], dst.add(2 * n8)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random f32 bit patterns, including NaNs, infinities and subnormals, from a fixed LCG.
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
        // 1000 elements: not a multiple of 8, so tails run too; three sources, offset by one
        // byte to exercise unaligned access.
        let n = 1000;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let esz = dtype.type_size();
            let srcs: Vec<Vec<u8>> = (0..3)
                .map(|k| {
                    let mut v = vec![0u8; 1];
                    for p in patterns(n, k) {
                        // Keep half-type inputs finite-or-not from the raw bits too.
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
                sum_with(kernels(dtype), dtype, &fast, &ptrs, n);
                sum_with(portable_kernels(dtype), dtype, &[b.as_mut_ptr()], &ptrs, n);
            }
            assert_eq!(a, b, "{dtype}");
            assert_eq!(a2, b, "{dtype}: the copy");
        }
    }

    #[test]
    fn bf16_rounding_matches_half_on_edge_cases() {
        let cases = [
            0x3f80_8000u32, // tie, even lsb: rounds down
            0x3f81_8000,    // tie, odd lsb: rounds up
            0x3f80_8001,    // above the tie
            0x7f7f_ffff,    // rounds up to infinity
            0x7fc0_0001,    // NaN stays NaN
            0xff80_0000,    // -inf
            0x0000_0001,    // subnormal
        ];
        let acc: Vec<f32> = cases.iter().map(|&c| f32::from_bits(c)).collect();
        let mut fast = vec![0u8; 2 * acc.len()];
        // SAFETY: fast holds acc.len() bf16 values.
        unsafe { (kernels(DType::BF16).store)(&acc, fast.as_mut_ptr()) };
        for (j, &a) in acc.iter().enumerate() {
            let got = u16::from_ne_bytes([fast[2 * j], fast[2 * j + 1]]);
            assert_eq!(got, bf16::from_f32(a).to_bits(), "case {:#x}", cases[j]);
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
