//! Quantized matrix products: activations quantized to 8 bits per 32-element block (the
//! numbers of ggml's `block_q8_0` / `block_q8_1`), then integer dot products with Q8_0, Q4_0,
//! Q4_1 and Q5_0 weight blocks (Q5_0: the unsigned `q` with `off = 16`, as Q4_0's nibbles with
//! `off = 8`), scaled per block (ggml-cpu `ggml_vec_dot_q4_0_q8_0` and friends:
//! integer products summed pairwise, one float multiply-add per block).
//!
//! Activation rows live in the node's scratch as structure-of-arrays ([`ActLayout`]): the 32
//! quants of each block (one vector load), then the block scales `d` (f32
//! holding the f16-rounded value, as `block_q8_0.d`), then `s / 8` with `s = d * sum(q)` (the
//! `block_q8_1.s` term, kept in f32 and divided by 8 so that adding it to each of 8 lanes adds
//! `s` after the final horizontal sum).
//!
//! Dot products use an unsigned form of the weights: `u = w + off` (Q8_0: off = 128, by
//! flipping the sign bit; Q4_0: the raw nibble, off = 8; Q4_1: the raw nibble, off = 0), so
//! `dot(w, y) = dot(u, y) - off * sum(y)`. With AVX-512 VNNI, `vpdpbusd` multiplies u8 by i8
//! and accumulates into i32 lanes that start at `-off * sum(y)`, so the offset costs nothing per
//! weight row (two blocks per 512-bit vector, [`super::quant512`]; with 8 or more activation
//! rows 16 weight rows across the lanes, [`super::lanes512`]). With AVX2, `vpmaddubsw` +
//! `vpmaddwd` (Q4: unsigned nibbles times signed activations cannot saturate 16 bits; Q8_0 uses
//! ggml's sign trick, |w| times sign-adjusted y; Q4_0 and Q5_0 subtract `off * sum(y)`, computed
//! once per activation block for all the tile's rows).

use super::QuantW as WType;
use super::Weights;
#[cfg(target_arch = "x86_64")]
use super::dequant::{f16_bits_to_f32, nibbles_avx2, q5_0_avx2};
use super::dequant::{nibble, q5_0, read_f16};
use crate::cpu::simd::Isa;
use crate::dtype::{QK4_0, QK4_1, QK5_0, QK8_0, QK8_1};
use half::f16;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Elements per block in these kernels and in [`super::qf32`]: the activation blocks' `QK8_1`.
/// The integer kernels pair each weight block with one activation block, so they take only
/// weight types with blocks of the same length (asserted below); a type with other blocks
/// needs kernels of its own.
pub(crate) const BLK: usize = QK8_1;
const _: () = assert!(QK8_0 == BLK && QK4_0 == BLK && QK4_1 == BLK && QK5_0 == BLK);

/// Where activation row `r`'s quants, scales and sums live in the scratch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ActLayout {
    /// Blocks per row (K / 32).
    pub nblk: usize,
    /// Bytes per row, a multiple of 64.
    pub row_bytes: usize,
    /// Whether each row ends with the 512-bit kernel's scale vectors ([`Self::v_off`]).
    pub vectors: bool,
    /// The weight type's offset `off` (see the module doc), which the vectors' `-off * sum(y)`
    /// lanes use.
    pub off: i32,
}

impl ActLayout {
    /// Quants, scales and sums.
    pub fn new(k: usize) -> Self {
        let nblk = k / BLK;
        ActLayout {
            nblk,
            row_bytes: (nblk * (BLK + 8)).next_multiple_of(64),
            vectors: false,
            off: 0,
        }
    }
    /// [`Self::new`] followed by the vectors of the AVX-512 kernel for weights of type `wt`.
    pub fn with_vectors(k: usize, wt: WType) -> Self {
        let lay = ActLayout::new(k);
        ActLayout {
            row_bytes: lay.row_bytes + lay.nblk.div_ceil(2) * PAIR_VEC_BYTES,
            vectors: true,
            off: match wt {
                WType::Q8_0 => 128,
                WType::Q4_0 => 8,
                WType::Q5_0 => 16,
                WType::Q4_1 => 0,
            },
            ..lay
        }
    }
    /// Offset of the `d` array within a row.
    pub fn d_off(&self) -> usize {
        self.nblk * BLK
    }
    /// Offset of the `s / 8` array within a row.
    pub fn s_off(&self) -> usize {
        self.nblk * (BLK + 4)
    }
    /// Offset of the vectors (64-byte aligned): for each pair of blocks `(2p, 2p + 1)`, 16 f32
    /// holding `d` of block `2p` in lanes 0-7 and of block `2p + 1` in lanes 8-15, then for
    /// Q4_1 (`off` = 0) 16 f32 of `s / 8` in the same lanes, for the other types 16 i32 with
    /// `-off * sum(y)` of each block in its first lane (lanes 0 and 8) and zero elsewhere (an
    /// odd last block's upper lanes all zero): what [`super::quant512`]'s two-block vectors
    /// need from an activation row, formed once per row instead of once per weight tile.
    pub fn v_off(&self) -> usize {
        (self.nblk * (BLK + 8)).next_multiple_of(64)
    }
}

/// Bytes of one pair's vectors in [`ActLayout::v_off`]'s section.
pub(crate) const PAIR_VEC_BYTES: usize = 128;

/// Write blocks `blk..blk + count`'s lanes of row `row`'s scale vectors from its `d` and
/// `s / 8` arrays (and zero the upper lanes of an odd last block's pair).
///
/// # Safety
/// `row` is a row of `lay` (with vectors) whose blocks `blk..blk + count` are quantized; lanes
/// of other blocks are not touched, so threads may fill disjoint block ranges of one row.
pub(crate) unsafe fn fill_vectors(row: *mut u8, lay: ActLayout, blk: usize, count: usize) {
    // SAFETY: the caller's row; every write is inside this row's vector section.
    unsafe {
        let d = row.add(lay.d_off()).cast::<f32>();
        let s8 = row.add(lay.s_off()).cast::<f32>();
        let v = row.add(lay.v_off()).cast::<f32>();
        for b in blk..blk + count {
            let lanes = v.add((b / 2) * (PAIR_VEC_BYTES / 4) + (b % 2) * 8);
            for l in 0..8 {
                *lanes.add(l) = *d.add(b);
            }
            if lay.off == 0 {
                // Q4_1: `s / 8` in every lane of the block's half.
                for l in 0..8 {
                    *lanes.add(16 + l) = *s8.add(b);
                }
            } else {
                // The others: `-off * sum(y)` in the first lane of the block's half.
                let q = std::slice::from_raw_parts(row.add(b * BLK).cast::<i8>(), BLK);
                let sum = q.iter().map(|&x| x as i32).sum::<i32>();
                let init = lanes.add(16).cast::<i32>();
                for l in 0..8 {
                    *init.add(l) = if l == 0 { -lay.off * sum } else { 0 };
                }
            }
            if b + 1 == lay.nblk && b % 2 == 0 {
                for l in 8..16 {
                    *lanes.add(l) = 0.0;
                    *lanes.add(16 + l) = 0.0;
                }
            }
        }
    }
}

// ---- activation quantization -------------------------------------------------------------

/// Quantize `count` consecutive blocks of f32 at `x` (element `i` at `x + i * stride` bytes,
/// any alignment) into `qs` (32 bytes per block), `d` and `s8` (one f32 per block each).
///
/// # Safety
/// `x` must be readable for `32 * count` strided f32, `qs` writable for `32 * count` bytes,
/// `d` and `s8` for `count` f32 each.
pub(crate) unsafe fn quantize_blocks(
    isa: Isa,
    x: *const u8,
    stride: usize,
    qs: *mut i8,
    d: *mut f32,
    s8: *mut f32,
    count: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if stride == 4 && isa.clamp() >= Isa::Avx2 {
        // SAFETY: supported level; the caller's bounds cover `count` blocks.
        unsafe { quantize_blocks_avx2(x.cast(), qs, d, s8, count) };
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    let mut buf = [0f32; BLK];
    for b in 0..count {
        for (j, v) in buf.iter_mut().enumerate() {
            // SAFETY: element b * 32 + j of the caller's strided range.
            *v = unsafe { x.add((b * BLK + j) * stride).cast::<f32>().read_unaligned() };
        }
        let amax = buf.iter().fold(0f32, |a, v| a.max(v.abs()));
        let (dv, id) = block_scale(amax);
        let mut sum = 0i32;
        for (j, v) in buf.iter().enumerate() {
            let q = crate::cpu::simd::round_small(v * id) as i32;
            sum += q;
            // SAFETY: byte b * 32 + j of the caller's range.
            unsafe { *qs.add(b * BLK + j) = q as i8 };
        }
        // SAFETY: element b of the caller's ranges.
        unsafe {
            *d.add(b) = dv;
            *s8.add(b) = dv * sum as f32 * 0.125;
        }
    }
}

/// The stored scale (f16-rounded `amax / 127`, as `block_q8_0.d`) and the multiplier used to
/// quantize (`127 / amax` before rounding, as ggml's `quantize_row_q8_0`).
#[inline(always)]
fn block_scale(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    (f16::from_f32(d).to_f32(), id)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_blocks_avx2(
    x: *const f32,
    qs: *mut i8,
    d: *mut f32,
    s8: *mut f32,
    count: usize,
) {
    let sign = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..count {
        // SAFETY: 32 floats of block b are in the caller's range.
        let v: [__m256; 4] = unsafe {
            let p = x.add(b * BLK);
            [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ]
        };
        let mx = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
        );
        let m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        let (dv, id) = block_scale(_mm_cvtss_f32(m4));
        let idv = _mm256_set1_ps(id);
        // Round to nearest even (the default MXCSR mode), as the scalar path.
        let q: [__m256i; 4] = [
            _mm256_cvtps_epi32(_mm256_mul_ps(v[0], idv)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[1], idv)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[2], idv)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[3], idv)),
        ];
        let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s4 = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256::<1>(sum),
        );
        let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32::<0b01_00_11_10>(s4));
        let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32::<0b10_11_00_01>(s4));
        let isum = _mm_cvtsi128_si32(s4);
        // Pack 32 x i32 into 32 x i8; the in-lane packs interleave, the permute restores order.
        let p16a = _mm256_packs_epi32(q[0], q[1]);
        let p16b = _mm256_packs_epi32(q[2], q[3]);
        let p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), perm);
        // SAFETY: block b's 32 bytes and its d / s8 slots are in the caller's range.
        unsafe {
            _mm256_storeu_si256(qs.add(b * BLK).cast(), p8);
            *d.add(b) = dv;
            *s8.add(b) = dv * isum as f32 * 0.125;
        }
    }
}

/// Prefetch distance in weight rows (see `prefetch`).
pub(super) const PF_ROWS: usize = 4;
/// Ask for the cache line at `p` ahead of use. Weight rows of quantized types are short (2.3 KB
/// for Q4_0 at K = 4096), too short for the hardware stream prefetchers to ramp up on each, so
/// the tile kernels fetch the same block of the rows `PF_ROWS` below the ones they read.
/// A prefetch never faults, so `p` may point past the weights.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch(p: *const u8) {
    // SAFETY: prefetch is a hint with no architectural effect; any address is allowed.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
}

/// Tiles ahead of the current one that the L2 stream prefetch reads.
#[cfg(target_arch = "x86_64")]
pub(super) const L2_AHEAD_TILES: usize = 2;

/// Rows this long or longer (bytes) are left to the hardware prefetchers (see [`l2_stream`]).
#[cfg(target_arch = "x86_64")]
pub(super) const L2_STREAM_ROW_BYTES: usize = 2048;

/// The L2 stream prefetch of an `RN`-row tile: `(distance in bytes, lines per block step)`.
/// A tile's `RN` weight rows are one contiguous region of `RN * ldw` bytes, and consecutive
/// tiles are consecutive regions, so the tiles sweep the weights linearly; but with short rows
/// (K = 576: 612 bytes per Q8_0 row) each row is too short a stream for the hardware
/// prefetchers, and a cold Q8_0 GEMV ran at 8 GB/s per core against 17 at K = 4096. Fetching
/// the region `L2_AHEAD_TILES` tiles ahead into L2, a few lines per block step so it is done
/// when the tile is, brings K = 576 to 17-20 GB/s per core and 26-31 GB/s on two
/// (docs/kernels.md). Single-row tiles (the remainder) do without, and so do rows of
/// [`L2_STREAM_ROW_BYTES`] or more: there the hardware prefetchers keep up, and the extra
/// prefetches cost a third of the speed on Zen 2 (Q8_0 4096 x 14336 at M = 1, `--q8`, two
/// threads: 20 GB/s with them, 30 GB/s without; docs/kernels.md, 2026-11-27).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn l2_stream<const RN: usize>(ldw: usize, nblk: usize) -> (usize, usize) {
    if RN == 1 || ldw >= L2_STREAM_ROW_BYTES {
        return (0, 0);
    }
    let region = RN * ldw;
    (L2_AHEAD_TILES * region, region.div_ceil(64 * nblk.max(1)))
}

/// A hint to fetch the cache line at `p` into L2; never faults.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_l2(p: *const u8) {
    // SAFETY: prefetch is a hint with no architectural effect; any address is allowed.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
}

// ---- dot-product blocks --------------------------------------------------------------------

/// One block of `dst[m][n] = dot(w[n], a[m])` with quantized weights and activations.
#[derive(Clone, Copy)]
pub(crate) struct QuantBlock {
    /// First weight row: `nblk` blocks of `wt` starting at `w + n * ldw` bytes.
    pub w: *const u8,
    pub ldw: usize,
    pub wt: WType,
    /// First activation row in the [`ActLayout`] form; row `m` at `a + m * lay.row_bytes`.
    pub a: *const u8,
    pub lay: ActLayout,
    /// Output: `dst[m][n]` at `d + m * ldd + n` elements.
    pub d: *mut f32,
    pub ldd: usize,
    pub n: usize,
    pub m: usize,
}

/// Weight types as const-generic parameters of the tile kernels (here and in `qf32`).
pub(super) const Q8_0: u8 = 0;
pub(super) const Q4_0: u8 = 1;
pub(super) const Q4_1: u8 = 2;
pub(super) const Q5_0: u8 = 3;

/// Bytes of one block of weights of kernel type `wq`: the type table's figure for its dtype.
pub(super) const fn block_bytes(wq: u8) -> usize {
    let wt = match wq {
        Q8_0 => WType::Q8_0,
        Q4_0 => WType::Q4_0,
        Q4_1 => WType::Q4_1,
        Q5_0 => WType::Q5_0,
        _ => panic!("not a weight type of the quantized kernels"),
    };
    Weights::Quant(wt).dtype().type_size()
}

/// Compute one block at the given level.
///
/// # Safety
/// Weight rows `n < b.n` hold `b.lay.nblk` blocks of `b.wt`, activation rows `m < b.m` are in
/// the [`ActLayout`] form, and `dst[m][n]` is writable and owned by the
/// caller's thread.
pub(crate) unsafe fn block(isa: Isa, b: &QuantBlock) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = isa.clamp();
        // SAFETY: supported level (clamped); forwarded caller guarantees.
        unsafe {
            match (isa, b.wt) {
                (Isa::Avx512, WType::Q8_0) => return super::quant512::block::<Q8_0>(b),
                (Isa::Avx512, WType::Q4_0) => return super::quant512::block::<Q4_0>(b),
                (Isa::Avx512, WType::Q4_1) => return super::quant512::block::<Q4_1>(b),
                (Isa::Avx512, WType::Q5_0) => return super::quant512::block::<Q5_0>(b),
                (Isa::Avx2, WType::Q8_0) => return avx2::block::<Q8_0>(b),
                (Isa::Avx2, WType::Q4_0) => return avx2::block::<Q4_0>(b),
                (Isa::Avx2, WType::Q4_1) => return avx2::block::<Q4_1>(b),
                (Isa::Avx2, WType::Q5_0) => return avx2::block::<Q5_0>(b),
                _ => {}
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match b.wt {
            WType::Q8_0 => scalar_block::<Q8_0>(b),
            WType::Q4_0 => scalar_block::<Q4_0>(b),
            WType::Q4_1 => scalar_block::<Q4_1>(b),
            WType::Q5_0 => scalar_block::<Q5_0>(b),
        }
    }
}

/// Portable fallback: exact integer dot per block, scaled and summed in f32.
unsafe fn scalar_block<const WQ: u8>(b: &QuantBlock) {
    let bs = const { block_bytes(WQ) };
    let lay = b.lay;
    for n in 0..b.n {
        for m in 0..b.m {
            let mut acc = 0f32;
            for blk in 0..lay.nblk {
                // SAFETY: block blk of weight row n and activation row m are in range.
                unsafe {
                    let wb = b.w.add(n * b.ldw + blk * bs);
                    let ar = b.a.add(m * lay.row_bytes);
                    let y = ar.add(blk * BLK).cast::<i8>();
                    let dy = *ar.add(lay.d_off()).cast::<f32>().add(blk);
                    let mut isum = 0i32;
                    for j in 0..BLK {
                        let wv = match WQ {
                            Q8_0 => *wb.add(2 + j) as i8 as i32,
                            Q4_0 => nibble(wb.add(2), j) as i32 - 8,
                            Q5_0 => q5_0(wb, j) as i32 - 16,
                            _ => nibble(wb.add(4), j) as i32,
                        };
                        isum += wv * *y.add(j) as i32;
                    }
                    acc += read_f16(wb) * dy * isum as f32;
                    if WQ == Q4_1 {
                        let s8 = *ar.add(lay.s_off()).cast::<f32>().add(blk);
                        acc += read_f16(wb.add(2)) * s8 * 8.0;
                    }
                }
            }
            // SAFETY: the caller owns this output element.
            unsafe { *b.d.add(m * b.ldd + n) = acc };
        }
    }
}

/// Drive a tile kernel `$tile::<WQ, RN, RM>(w, ldw, a, lay, d, ldd)` over a block: full
/// `$rn`-row tiles, leftover weight rows one at a time, activation rows in the widest listed
/// tile that fits.
macro_rules! drive_qblock {
    ($b:expr, $tile:ident, $rn:literal, [$($rm:literal),+]) => {{
        let b = $b;
        let mut n0 = 0;
        while n0 < b.n {
            let rows = if b.n - n0 >= $rn { $rn } else { 1 };
            let mut m0 = 0;
            while m0 < b.m {
                let left = b.m - m0;
                // SAFETY: weight rows n0..n0 + rows <= b.n, activation rows m0..m0 + cols <=
                // b.m and their outputs are inside the caller's block.
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
                                $tile::<WQ, $rn, $rm>(w, b.ldw, a, b.lay, d, b.ldd);
                            } else {
                                $tile::<WQ, 1, $rm>(w, b.ldw, a, b.lay, d, b.ldd);
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
    use super::*;
    use crate::cpu::simd::hsum256;

    /// `RN x RM` outputs over all blocks with `vpmaddubsw` + `vpmaddwd`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const WQ: u8, const RN: usize, const RM: usize>(
        w: *const u8,
        ldw: usize,
        a: *const u8,
        lay: ActLayout,
        d: *mut f32,
        ldd: usize,
    ) {
        let bs = const { block_bytes(WQ) };
        let tab = crate::cpu::simd::f16_table().as_ptr();
        let ones = _mm256_set1_epi16(1);
        let mask = _mm256_set1_epi8(0x0f);
        // The unsigned weights' offset (Q4_0: 8, Q5_0: 16), taken off the block's dot product
        // as `off * sum(y)`, computed once per activation block for all the tile's rows.
        let off = _mm256_set1_epi8(if WQ == Q5_0 { 16 } else { 8 });
        // Signed weights and ggml's sign trick instead (|w| times sign-adjusted y, no offset
        // term): Q8_0's own form, and Q5_0's when each weight block meets no other row of the
        // tile to share the offset term with (one weight row: 0.9x the time at M = 2).
        let signed = WQ == Q8_0 || (WQ == Q5_0 && RN == 1);
        let mut acc = [[_mm256_setzero_ps(); RM]; RN];
        let (ah, lps) = l2_stream::<RN>(ldw, lay.nblk);
        for blk in 0..lay.nblk {
            for i in 0..lps {
                prefetch_l2(w.wrapping_add(ah + (blk * lps + i) * 64));
            }
            let mut y = [_mm256_setzero_si256(); RM];
            let mut dyv = [_mm256_setzero_ps(); RM];
            let mut corr = [_mm256_setzero_si256(); RM];
            for m in 0..RM {
                // SAFETY: block blk of activation row m.
                y[m] = unsafe { _mm256_loadu_si256(a.add(m * lay.row_bytes + blk * BLK).cast()) };
                // SAFETY: the scale array of activation row m holds nblk entries.
                dyv[m] = _mm256_set1_ps(unsafe {
                    *a.add(m * lay.row_bytes + lay.d_off())
                        .cast::<f32>()
                        .add(blk)
                });
                if (WQ == Q4_0 || WQ == Q5_0) && !signed {
                    corr[m] = _mm256_madd_epi16(_mm256_maddubs_epi16(off, y[m]), ones);
                }
            }
            for (r, accr) in acc.iter_mut().enumerate() {
                // SAFETY: block blk of weight row r.
                let wb = unsafe { w.add(r * ldw + blk * bs) };
                prefetch(wb.wrapping_add(PF_ROWS * ldw));
                // SAFETY: the block's scale (and min) are its first bytes. The scale comes
                // from the f16 table and is broadcast from memory: no vector-pipe conversion,
                // which measured 2-4% faster on Zen 2, where these tiles are bound by the pipes.
                let dw = unsafe {
                    _mm256_broadcast_ss(&*tab.add(wb.cast::<u16>().read_unaligned() as usize))
                };
                let mw = if WQ == Q4_1 {
                    // SAFETY: as above.
                    _mm256_set1_ps(unsafe { f16_bits_to_f32(wb.add(2)) })
                } else {
                    _mm256_setzero_ps()
                };
                // SAFETY: the block's quants follow its header.
                let wq = unsafe {
                    match WQ {
                        Q8_0 => _mm256_loadu_si256(wb.add(2).cast()),
                        Q5_0 if signed => _mm256_sub_epi8(q5_0_avx2(wb), off),
                        Q5_0 => q5_0_avx2(wb),
                        Q4_0 => nibbles_avx2(wb.add(2), mask),
                        _ => nibbles_avx2(wb.add(4), mask),
                    }
                };
                let wabs = if signed { _mm256_sign_epi8(wq, wq) } else { wq };
                for (m, acc_rm) in accr.iter_mut().enumerate() {
                    let p16 = if signed {
                        _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(y[m], wq))
                    } else {
                        _mm256_maddubs_epi16(wq, y[m])
                    };
                    let mut p32 = _mm256_madd_epi16(p16, ones);
                    if (WQ == Q4_0 || WQ == Q5_0) && !signed {
                        p32 = _mm256_sub_epi32(p32, corr[m]);
                    }
                    // SAFETY: the scale and sum arrays of activation row m hold nblk entries.
                    let s8 = unsafe {
                        *a.add(m * lay.row_bytes + lay.s_off())
                            .cast::<f32>()
                            .add(blk)
                    };
                    let scale = _mm256_mul_ps(dw, dyv[m]);
                    *acc_rm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), scale, *acc_rm);
                    if WQ == Q4_1 {
                        *acc_rm = _mm256_fmadd_ps(mw, _mm256_set1_ps(s8), *acc_rm);
                    }
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

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn block<const WQ: u8>(b: &QuantBlock) {
        // Four weight rows per tile for one activation row (decoding); one weight row by four
        // activation rows from M = 4 (its 32 quants unpacked once for four products: Q8_0 and
        // Q5_0 1.14-1.21x faster at M = 4 and 8 than two by two, which spends half its work
        // unpacking; Q4_0, whose unpacking is cheap, the same; 2-core Zen 2, 2026-11-27; two
        // by four spills and is slower); four weight rows by two activation rows for M = 2
        // and 3 (against two by two: Q4_1 0.85-0.88x the time, Q5_0 0.95-1.00x, Q8_0 and
        // Q4_0 0.95-1.02x; 2 threads, 4096 x 4096 and 4096 x 14336, 2026-11-27), but Q5_0's
        // one by two there.
        if b.m == 1 {
            drive_qblock!(b, tile, 4, [1]);
        } else if b.m >= 4 {
            drive_qblock!(b, tile, 1, [4, 2, 1]);
        } else if WQ == Q5_0 {
            // One weight row by two activation rows: its 16 accumulators and decoding
            // constants fit the registers (4096 x 4096 and 4096 x 14336 at M = 2: 0.91-0.94x
            // the time of four by two; at M = 3 0.95-0.97x; two by two 1.01x; the other types
            // measured slower one by two: Q4_1 1.5x, Q8_0 0.87-1.15x, Q4_0 0.98-1.05x).
            drive_qblock!(b, tile, 1, [2, 1]);
        } else {
            drive_qblock!(b, tile, 4, [2, 1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{BlockQ8_1, quantize};

    #[test]
    fn activation_quantization_matches_the_reference_on_every_level() {
        // Values avoid exact .5 ties, where the reference rounds away from zero and the
        // kernels (like ggml's SIMD paths) round to even.
        let k = 96;
        let x: Vec<f32> = (0..k)
            .map(|i| ((i * 7919 % 613) as f32 - 300.3) / 17.0)
            .collect();
        let mut want = vec![BlockQ8_1::default(); k / BLK];
        quantize(&x, &mut want);
        for isa in Isa::available() {
            let mut qs = vec![0i8; k];
            let mut d = vec![0f32; k / BLK];
            let mut s8 = vec![0f32; k / BLK];
            // SAFETY: the buffers hold k / 32 blocks.
            unsafe {
                quantize_blocks(
                    isa,
                    x.as_ptr().cast(),
                    4,
                    qs.as_mut_ptr(),
                    d.as_mut_ptr(),
                    s8.as_mut_ptr(),
                    k / BLK,
                )
            };
            for (b, wb) in want.iter().enumerate() {
                assert_eq!(d[b], wb.d.to_f32(), "{isa} block {b} scale");
                assert_eq!(
                    &qs[b * BLK..(b + 1) * BLK],
                    &wb.qs[..],
                    "{isa} block {b} quants"
                );
                let sum: i32 = wb.qs.iter().map(|&q| q as i32).sum();
                assert_eq!(
                    s8[b] * 8.0,
                    wb.d.to_f32() * sum as f32,
                    "{isa} block {b} sum"
                );
            }
        }
    }

    #[test]
    fn zero_blocks_quantize_to_zero() {
        let x = vec![0f32; 64];
        for isa in Isa::available() {
            let mut qs = vec![1i8; 64];
            let mut d = vec![1f32; 2];
            let mut s8 = vec![1f32; 2];
            // SAFETY: the buffers hold 2 blocks.
            unsafe {
                quantize_blocks(
                    isa,
                    x.as_ptr().cast(),
                    4,
                    qs.as_mut_ptr(),
                    d.as_mut_ptr(),
                    s8.as_mut_ptr(),
                    2,
                )
            };
            assert!(
                qs.iter().all(|&q| q == 0) && d == [0.0, 0.0] && s8 == [0.0, 0.0],
                "{isa}"
            );
        }
    }
}
