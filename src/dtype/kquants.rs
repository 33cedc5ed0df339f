//! ggml's K-quants: super-blocks of `QK_K` = 256 elements with per-sub-block scales quantized
//! against one or two f16 super-block scales: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and Q8_K (f32
//! scale, the 8-bit form ggml gives activations for products with the others).
//!
//! Layouts after ggml-org/ggml `ggml-common.h` (`block_q2_K` .. `block_q8_K`); dequantizers
//! and reference quantizers after `ggml-quants.c` (`dequantize_row_q*_K`,
//! `quantize_row_q*_K_ref`), written from the algorithms with the searches of `kscales.rs`,
//! in the same f32 operations in the same order, so quantized bytes equal ggml's and
//! dequantized values equal ggml's and gguf-py's bit for bit.
//!
//! Element order, shared by the types below: Q2_K / Q3_K keep 2-bit quants four to a byte,
//! element `e` in byte `32 (e / 128) + e % 32` at bit `2 ((e % 128) / 32)`; Q4_K / Q5_K keep
//! 4-bit quants two to a byte, element `e` in byte `32 (e / 64) + e % 32`, low nibble when
//! `e % 64 < 32`; a high bit (Q3_K's `hmask`, Q5_K's `qh`) of element `e` is bit `e / 32` of
//! byte `e % 32`.

use super::formats::GgmlBlock;
use super::kscales::{
    GROUP_MAX_EPS, Q2K_SEARCH, Q4K_SEARCH, Q5K_SEARCH, Qkx2, make_q3_quants, make_qkx2_quants,
    make_qx_quants, nearest_int, pack_scale_min_k4, scale_min_k4, signed_amax,
};
use super::pod::Pod;
use half::f16;

/// Elements per K-quant super-block (ggml-common.h `QK_K`).
pub const QK_K: usize = 256;
/// Bytes of Q4_K / Q5_K's packed 6-bit scales and minimums (ggml-common.h `K_SCALE_SIZE`).
pub const K_SCALE_SIZE: usize = 12;

/// `block_q2_K`: 84 bytes. 16 groups of 16; group g's byte `scales[g]` holds a 4-bit scale
/// (low) and a 4-bit minimum (high); x = d * scale * q - dmin * min with 2-bit q.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: f16,
    pub dmin: f16,
}

/// `block_q3_K`: 110 bytes. 16 groups of 16 with 6-bit signed scales (`scales`: low 4 bits of
/// groups 0-7 and 8-15 in the low and high nibbles of bytes 0-7, top 2 bits of group g in byte
/// `8 + g % 4` at bit `2 (g / 4)`); x = d * (scale - 32) * (q - 4) with 3-bit q whose high bit
/// is in `hmask` (a clear bit subtracts 4).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: f16,
}

/// `block_q4_K`: 144 bytes. 8 groups of 32 with 6-bit scales and minimums
/// (`kscales::pack_scale_min_k4`); x = d * scale * q - dmin * min with 4-bit q.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}

/// `block_q5_K`: 176 bytes. As [`BlockQ4K`] with a fifth bit per quant in `qh`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// `block_q6_K`: 210 bytes. 16 groups of 16 with signed 8-bit scales; x = d * scale * (q - 32)
/// with 6-bit q: low 4 bits in `ql`, high 2 bits in `qh`. Within each half of 128 elements,
/// element `r` (0..128) has its low bits in `ql[64 h + r % 32 + 32 ((r / 32) % 2)]` (nibble
/// `r / 64`) and its high bits in `qh[32 h + r % 32]` at bit `2 (r / 32)`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

/// `block_q8_K`: 292 bytes, an f32 scale, 256 signed quants and their sums by 16
/// (`bsums`, for the dot products with the K-quants); x = d * q.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84);
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110);
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);

// SAFETY: each is repr(C) of f16/f32/i16/i8/u8 fields (arrays of them) with the sizes asserted
// above equal to the sums of their fields (no padding), and every bit pattern is a valid value
// of each field.
unsafe impl Pod for BlockQ2K {}
// SAFETY: as above.
unsafe impl Pod for BlockQ3K {}
// SAFETY: as above.
unsafe impl Pod for BlockQ4K {}
// SAFETY: as above.
unsafe impl Pod for BlockQ5K {}
// SAFETY: as above.
unsafe impl Pod for BlockQ6K {}
// SAFETY: as above.
unsafe impl Pod for BlockQ8K {}

/// The all-zero block of a [`Pod`] type (arrays over 32 elements have no `Default`).
pub(super) fn zeroed<T: Pod>() -> T {
    // SAFETY: Pod types accept every bit pattern, all zeros included.
    unsafe { std::mem::zeroed() }
}

macro_rules! zero_default {
    ($($t:ty),*) => {$(
        impl Default for $t {
            fn default() -> Self {
                zeroed()
            }
        }
    )*};
}
zero_default!(BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K);

/// The 2-bit quant of element `e` (Q2_K, Q3_K low bits).
fn bits2(qs: &[u8; QK_K / 4], e: usize) -> u8 {
    (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3
}

/// Packs 256 2-bit quants (Q2_K, Q3_K low bits) in the order `bits2` reads.
fn pack_bits2(l: &[u8; QK_K]) -> [u8; QK_K / 4] {
    let mut qs = [0u8; QK_K / 4];
    for (e, &q) in l.iter().enumerate() {
        qs[32 * (e / 128) + e % 32] |= (q & 3) << (2 * ((e % 128) / 32));
    }
    qs
}

/// The 4-bit quant of element `e` (Q4_K, Q5_K low bits).
fn nibble(qs: &[u8; QK_K / 2], e: usize) -> u8 {
    (qs[32 * (e / 64) + e % 32] >> (4 * ((e % 64) / 32))) & 0x0f
}

/// Packs 256 4-bit quants (Q4_K, Q5_K low bits) in the order `nibble` reads.
fn pack_nibbles(l: &[u8; QK_K]) -> [u8; QK_K / 2] {
    let mut qs = [0u8; QK_K / 2];
    for (e, &q) in l.iter().enumerate() {
        qs[32 * (e / 64) + e % 32] |= (q & 0x0f) << (4 * ((e % 64) / 32));
    }
    qs
}

/// The high bit of element `e` (Q3_K's `hmask`, Q5_K's `qh`).
fn high_bit(h: &[u8; QK_K / 8], e: usize) -> bool {
    h[e % 32] & (1 << (e / 32)) != 0
}

/// Q3_K's signed 6-bit scale of group `g` (0..16), in -32..=31.
fn q3_scale(scales: &[u8; 12], g: usize) -> i8 {
    let low = if g < 8 {
        scales[g] & 0x0f
    } else {
        scales[g - 8] >> 4
    };
    let high = (scales[8 + g % 4] >> (2 * (g / 4))) & 3;
    (low | (high << 4)) as i8 - 32
}

/// Packs Q3_K's 16 scales, each already offset to 0..=63.
fn pack_q3_scales(l: &[u8; 16]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for (g, &l) in l.iter().enumerate() {
        s[g % 8] |= (l & 0x0f) << (4 * (g / 8));
        s[8 + g % 4] |= (l >> 4) << (2 * (g / 4));
    }
    s
}

/// Scales `v` (one per group) to integers with `nearest_int(iscale * v)`, as ggml stores
/// them: truncated to a byte.
fn byte_scales<const N: usize>(v: &[f32; N], iscale: f32) -> [u8; N] {
    v.map(|s| nearest_int(iscale * s) as u8)
}

impl GgmlBlock for BlockQ2K {
    const BLOCK: usize = QK_K;

    fn dequantize(&self, out: &mut [f32]) {
        let (d, min) = (self.d.to_f32(), self.dmin.to_f32());
        for (g, o) in out.chunks_exact_mut(16).take(QK_K / 16).enumerate() {
            let sc = self.scales[g];
            let dl = d * (sc & 0x0f) as f32;
            let ml = min * (sc >> 4) as f32;
            for (i, o) in o.iter_mut().enumerate() {
                *o = dl * bits2(&self.qs, 16 * g + i) as f32 - ml;
            }
        }
    }

    /// `quantize_row_q2_K_ref`: per group of 16, `make_qkx2_quants` (weights |x|, absolute
    /// errors); scales and minimums to 4 bits against the largest of each; the quants
    /// recomputed from the stored scales.
    fn quantize(x: &[f32]) -> Self {
        let mut l = [0u8; QK_K];
        let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
        for g in 0..16 {
            let xg = &x[16 * g..16 * g + 16];
            let w: [f32; 16] = std::array::from_fn(|i| xg[i].abs());
            let l = &mut l[16 * g..16 * g + 16];
            (scales[g], mins[g]) = make_qkx2_quants(Q2K_SEARCH, xg, &w, l);
        }
        let max_scale = scales.iter().fold(0f32, |m, &s| if s > m { s } else { m });
        let max_min = mins.iter().fold(0f32, |m, &s| if s > m { s } else { m });
        let mut b = BlockQ2K::default();
        if max_scale > 0.0 {
            b.scales = byte_scales(&scales, 15.0 / max_scale);
            b.d = f16::from_f32(max_scale / 15.0);
        }
        if max_min > 0.0 {
            let lm = byte_scales(&mins, 15.0 / max_min);
            for (s, m) in b.scales.iter_mut().zip(lm) {
                *s |= m << 4;
            }
            b.dmin = f16::from_f32(max_min / 15.0);
        }
        let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
        for g in 0..16 {
            let dg = d * (b.scales[g] & 0x0f) as f32;
            if dg == 0.0 {
                continue;
            }
            let mg = dmin * (b.scales[g] >> 4) as f32;
            for i in 16 * g..16 * g + 16 {
                l[i] = nearest_int((x[i] + mg) / dg).clamp(0, 3) as u8;
            }
        }
        b.qs = pack_bits2(&l);
        b
    }
}

impl GgmlBlock for BlockQ3K {
    const BLOCK: usize = QK_K;

    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (g, o) in out.chunks_exact_mut(16).take(QK_K / 16).enumerate() {
            let dl = d * q3_scale(&self.scales, g) as f32;
            for (i, o) in o.iter_mut().enumerate() {
                let e = 16 * g + i;
                let q = bits2(&self.qs, e) as i8 - if high_bit(&self.hmask, e) { 0 } else { 4 };
                *o = dl * q as f32;
            }
        }
    }

    /// `quantize_row_q3_K_ref`: per group of 16, `make_q3_quants`; the scales to signed 6
    /// bits against the one of largest magnitude; the quants recomputed from the stored
    /// scales; high bits to `hmask`.
    fn quantize(x: &[f32]) -> Self {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        for g in 0..16 {
            scales[g] = make_q3_quants(4, &x[16 * g..16 * g + 16], &mut l[16 * g..16 * g + 16]);
        }
        let (max_scale, _) = signed_amax(&scales);
        let mut b = BlockQ3K::default();
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            let ls = scales.map(|s| ((nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8);
            b.scales = pack_q3_scales(&ls);
            b.d = f16::from_f32(1.0 / iscale);
        }
        let d = b.d.to_f32();
        for g in 0..16 {
            let dg = d * q3_scale(&b.scales, g) as f32;
            if dg == 0.0 {
                continue;
            }
            for i in 16 * g..16 * g + 16 {
                l[i] = nearest_int(x[i] / dg).clamp(-4, 3) as i8 + 4;
            }
        }
        let mut low = [0u8; QK_K];
        for (e, &q) in l.iter().enumerate() {
            if q > 3 {
                b.hmask[e % 32] |= 1 << (e / 32);
            }
            low[e] = if q > 3 { q - 4 } else { q } as u8;
        }
        b.qs = pack_bits2(&low);
        b
    }
}

/// The scales, minimums and quants Q4_K and Q5_K share (`quantize_row_q4_K_ref` and
/// `quantize_row_q5_K_ref`): per group of 32, `make_qkx2_quants` with weights
/// `sqrt(mean(x^2)) + |x|` and squared errors; scales and minimums to 6 bits against the
/// largest of each; the quants (0..=nmax) recomputed from the stored scales.
fn quantize_k4(x: &[f32], p: Qkx2) -> (f16, f16, [u8; K_SCALE_SIZE], [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    for g in 0..8 {
        let xg = &x[32 * g..32 * g + 32];
        let sum_x2 = xg.iter().fold(0f32, |s, &v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let w: [f32; 32] = std::array::from_fn(|i| av_x + xg[i].abs());
        (scales[g], mins[g]) = make_qkx2_quants(p, xg, &w, &mut l[32 * g..32 * g + 32]);
    }
    let max_scale = scales.iter().fold(0f32, |m, &s| if s > m { s } else { m });
    let max_min = mins.iter().fold(0f32, |m, &s| if s > m { s } else { m });
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let ls = byte_scales(&scales, inv_scale).map(|s| s.min(63));
    let lm = byte_scales(&mins, inv_min).map(|m| m.min(63));
    let packed = pack_scale_min_k4(&ls, &lm);
    let (d, dmin) = (
        f16::from_f32(max_scale / 63.0),
        f16::from_f32(max_min / 63.0),
    );
    for g in 0..8 {
        let (sc, m) = scale_min_k4(g, &packed);
        let dg = d.to_f32() * sc as f32;
        if dg == 0.0 {
            continue;
        }
        let mg = dmin.to_f32() * m as f32;
        for i in 32 * g..32 * g + 32 {
            l[i] = nearest_int((x[i] + mg) / dg).clamp(0, p.nmax) as u8;
        }
    }
    (d, dmin, packed, l)
}

/// Q4_K / Q5_K's values: `d * scale * q - dmin * min` per group of 32, with `q(e)` the quant.
fn dequantize_k4(d: f16, dmin: f16, scales: &[u8; 12], q: impl Fn(usize) -> u8, out: &mut [f32]) {
    let (d, min) = (d.to_f32(), dmin.to_f32());
    for (g, o) in out.chunks_exact_mut(32).take(8).enumerate() {
        let (sc, m) = scale_min_k4(g, scales);
        let (dl, ml) = (d * sc as f32, min * m as f32);
        for (i, o) in o.iter_mut().enumerate() {
            *o = dl * q(32 * g + i) as f32 - ml;
        }
    }
}

impl GgmlBlock for BlockQ4K {
    const BLOCK: usize = QK_K;

    fn dequantize(&self, out: &mut [f32]) {
        dequantize_k4(
            self.d,
            self.dmin,
            &self.scales,
            |e| nibble(&self.qs, e),
            out,
        );
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, dmin, scales, l) = quantize_k4(x, Q4K_SEARCH);
        BlockQ4K {
            d,
            dmin,
            scales,
            qs: pack_nibbles(&l),
        }
    }
}

impl GgmlBlock for BlockQ5K {
    const BLOCK: usize = QK_K;

    fn dequantize(&self, out: &mut [f32]) {
        let q = |e| nibble(&self.qs, e) + if high_bit(&self.qh, e) { 16 } else { 0 };
        dequantize_k4(self.d, self.dmin, &self.scales, q, out);
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, dmin, scales, l) = quantize_k4(x, Q5K_SEARCH);
        let mut qh = [0u8; QK_K / 8];
        for (e, &q) in l.iter().enumerate() {
            if q > 15 {
                qh[e % 32] |= 1 << (e / 32);
            }
        }
        BlockQ5K {
            d,
            dmin,
            scales,
            qh,
            qs: pack_nibbles(&l.map(|q| q & 0x0f)),
        }
    }
}

/// Where Q6_K keeps element `e`: its `ql` byte and nibble shift, its `qh` byte and bit shift.
fn q6_place(e: usize) -> (usize, u32, usize, u32) {
    let (h, r) = (e / 128, e % 128);
    let ql = 64 * h + r % 32 + 32 * ((r / 32) % 2);
    (
        ql,
        4 * (r / 64) as u32,
        32 * h + r % 32,
        2 * (r / 32) as u32,
    )
}

impl GgmlBlock for BlockQ6K {
    const BLOCK: usize = QK_K;

    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (g, o) in out.chunks_exact_mut(16).take(QK_K / 16).enumerate() {
            let dl = d * self.scales[g] as f32;
            for (i, o) in o.iter_mut().enumerate() {
                let (ql, sl, qh, sh) = q6_place(16 * g + i);
                let q = ((self.ql[ql] >> sl) & 0x0f) | (((self.qh[qh] >> sh) & 3) << 4);
                *o = dl * (q as i8 - 32) as f32;
            }
        }
    }

    /// `quantize_row_q6_K_ref`: per group of 16, `make_qx_quants` (nmax 32); the scales to
    /// signed 8 bits against the one of largest magnitude; the quants recomputed from the
    /// stored scales.
    fn quantize(x: &[f32]) -> Self {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        for g in 0..16 {
            scales[g] = make_qx_quants(32, &x[16 * g..16 * g + 16], &mut l[16 * g..16 * g + 16]);
        }
        let (max_scale, max_abs_scale) = signed_amax(&scales);
        let mut b = BlockQ6K::default();
        if max_abs_scale < GROUP_MAX_EPS {
            return b;
        }
        let iscale = -128.0 / max_scale;
        b.d = f16::from_f32(1.0 / iscale);
        b.scales = scales.map(|s| nearest_int(iscale * s).min(127) as i8);
        let d = b.d.to_f32();
        for g in 0..16 {
            let dg = d * b.scales[g] as f32;
            if dg == 0.0 {
                continue;
            }
            for i in 16 * g..16 * g + 16 {
                l[i] = (nearest_int(x[i] / dg).clamp(-32, 31) + 32) as i8;
            }
        }
        for (e, &q) in l.iter().enumerate() {
            let (ql, sl, qh, sh) = q6_place(e);
            b.ql[ql] |= ((q as u8) & 0x0f) << sl;
            b.qh[qh] |= ((q as u8) >> 4) << sh;
        }
        b
    }
}

impl GgmlBlock for BlockQ8K {
    const BLOCK: usize = QK_K;

    fn dequantize(&self, out: &mut [f32]) {
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = self.d * q as f32;
        }
    }

    /// `quantize_row_q8_K_ref`: the value of largest magnitude maps to -127 (d = -max / 127
    /// as `1 / iscale`), q = nearest_int(x / d) capped at 127, sums of 16 quants. An all-zero
    /// block is d = 0 with zero quants; ggml leaves its `bsums` unwritten, here they are 0.
    fn quantize(x: &[f32]) -> Self {
        let mut b = BlockQ8K::default();
        let (max, amax) = signed_amax(x);
        if amax == 0.0 {
            return b;
        }
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = q.iter().map(|&q| q as i16).sum();
        }
        b.d = 1.0 / iscale;
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packings_round_trip_and_cover_every_bit() {
        let l: [u8; QK_K] = std::array::from_fn(|e| (e * 7 % 13) as u8);
        let (q2, q4) = (pack_bits2(&l.map(|v| v & 3)), pack_nibbles(&l));
        for (e, &v) in l.iter().enumerate() {
            assert_eq!(bits2(&q2, e), v & 3, "{e}");
            assert_eq!(nibble(&q4, e), v, "{e}");
        }
        // Each element has its own bits: Q6_K's places and the high bits are one-to-one.
        let mut seen = std::collections::HashSet::new();
        for e in 0..QK_K {
            let (ql, sl, qh, sh) = q6_place(e);
            assert!(seen.insert((ql, sl, qh, sh)), "{e}");
            assert!(ql < QK_K / 2 && qh < QK_K / 4 && sl <= 4 && sh <= 6);
            let mut h = [0u8; QK_K / 8];
            h[e % 32] = 1 << (e / 32);
            assert!((0..QK_K).all(|f| high_bit(&h, f) == (f == e)));
        }
        let ls: [u8; 16] = std::array::from_fn(|g| (g * 5 % 64) as u8);
        let s = pack_q3_scales(&ls);
        for (g, &l) in ls.iter().enumerate() {
            assert_eq!(q3_scale(&s, g), l as i8 - 32, "{g}");
        }
    }

    #[test]
    fn blocks_of_zeros_are_zeros() {
        let zero = [0f32; QK_K];
        let mut out = [1f32; QK_K];
        BlockQ2K::quantize(&zero).dequantize(&mut out);
        assert!(out.iter().all(|&v| v == 0.0));
        BlockQ3K::quantize(&zero).dequantize(&mut out);
        assert!(out.iter().all(|&v| v == 0.0));
        BlockQ4K::quantize(&zero).dequantize(&mut out);
        assert!(out.iter().all(|&v| v == 0.0));
        BlockQ5K::quantize(&zero).dequantize(&mut out);
        assert!(out.iter().all(|&v| v == 0.0));
        BlockQ6K::quantize(&zero).dequantize(&mut out);
        assert!(out.iter().all(|&v| v == 0.0));
        let q8 = BlockQ8K::quantize(&zero);
        assert_eq!((q8.d, q8.bsums), (0.0, [0; 16]));
    }
}
