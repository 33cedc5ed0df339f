//! Storage formats and their reference conversions to and from `f32`: plain element rows
//! (f32, f16, bf16, i32, little-endian) and ggml's blocks of 32 (`QK8_0`, `QK4_0`, `QK4_1`,
//! `QK5_0`, `QK5_1`, `QK8_1`), each block type with its own block-size constant. The
//! super-blocks of 256 are in `kquants.rs`, the non-linear 4-bit blocks in `iquants.rs`.
//!
//! Block layouts follow ggml's `ggml-common.h` (ggml-org/ggml, `block_q8_0`, `block_q4_0`,
//! `block_q4_1`, `block_q5_0`, `block_q5_1`, `block_q8_1`) and the reference quantizers in
//! `ggml-quants.c` (`quantize_row_q*_ref`, `dequantize_row_q*`), so GGUF files load bit for
//! bit. The
//! [`GgmlBlock`] trait has the shape of one row of ggml's `type_traits[]` (`blck_size`,
//! `to_float`, `from_float_ref`) and of candle-core's `k_quants::GgmlType` (`BLCK_SIZE`,
//! `to_float`, `from_float`). Fast SIMD conversions live in `cpu/`; these are the definition
//! they are tested against.

use super::pod::Pod;
use half::{bf16, f16};

/// Elements per `block_q8_0` (ggml-common.h `QK8_0`).
pub const QK8_0: usize = 32;
/// Elements per `block_q4_0` (ggml-common.h `QK4_0`).
pub const QK4_0: usize = 32;
/// Elements per `block_q4_1` (ggml-common.h `QK4_1`).
pub const QK4_1: usize = 32;
/// Elements per `block_q8_1` (ggml-common.h `QK8_1`).
pub const QK8_1: usize = 32;
/// Elements per `block_q5_0` (ggml-common.h `QK5_0`).
pub const QK5_0: usize = 32;
/// Elements per `block_q5_1` (ggml-common.h `QK5_1`).
pub const QK5_1: usize = 32;

/// `block_q8_0`: 34 bytes; x = d * q.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK8_0],
}

/// `block_q4_0`: 18 bytes; x = d * (q - 8). Byte j holds element j in its low nibble and element
/// j + 16 in its high nibble.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK4_0 / 2],
}

/// `block_q4_1`: 20 bytes; x = d * q + m, nibble order as [`BlockQ4_0`].
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK4_1 / 2],
}

/// `block_q8_1`: 36 bytes. Not a tensor dtype: the 8-bit form activations take for the dot
/// product with [`BlockQ4_1`] weights; `s` = d * sum(qs).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; QK8_1],
}

/// `block_q5_0`: 22 bytes; x = d * (q - 16) with 5-bit q: the low 4 bits as in [`BlockQ4_0`]'s
/// nibbles, the fifth bit of element j in bit j of `qh` (a little-endian u32).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK5_0 / 2],
}

/// `block_q5_1`: 24 bytes; x = d * q + m, the 5-bit q packed as in [`BlockQ5_0`].
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK5_1 / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == 36);

/// A ggml block type: its element count and its reference conversions.
pub trait GgmlBlock: Pod + Default {
    /// Elements per block.
    const BLOCK: usize;
    /// The block's values into `out` (`out.len() == Self::BLOCK`).
    fn dequantize(&self, out: &mut [f32]);
    /// The reference quantization of `x` (`x.len() == Self::BLOCK`).
    fn quantize(x: &[f32]) -> Self;
}

/// The largest magnitude of `x`, and the scale `d = amax / 127` with its inverse (0 for an
/// all-zero block): the 8-bit blocks' scale (`quantize_row_q8_0_ref`).
fn scale_8bit(x: &[f32]) -> (f32, f32) {
    let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let d = amax / 127.0;
    (d, if d != 0.0 { 1.0 / d } else { 0.0 })
}

/// `q * d` for every quant of an 8-bit block.
fn dequantize_8bit(d: f16, qs: &[i8], out: &mut [f32]) {
    let d = d.to_f32();
    for (o, &q) in out.iter_mut().zip(qs) {
        *o = q as f32 * d;
    }
}

impl GgmlBlock for BlockQ8_0 {
    const BLOCK: usize = QK8_0;

    fn dequantize(&self, out: &mut [f32]) {
        dequantize_8bit(self.d, &self.qs, out);
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, id) = scale_8bit(x);
        let mut b = BlockQ8_0 {
            d: f16::from_f32(d),
            ..Default::default()
        };
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
        b
    }
}

impl GgmlBlock for BlockQ8_1 {
    const BLOCK: usize = QK8_1;

    fn dequantize(&self, out: &mut [f32]) {
        dequantize_8bit(self.d, &self.qs, out);
    }

    /// `block_q8_0`'s quants and scale, and `s` from the unrounded scale
    /// (`quantize_row_q8_1_ref`).
    fn quantize(x: &[f32]) -> Self {
        let q = BlockQ8_0::quantize(x);
        let sum: i32 = q.qs.iter().map(|&v| v as i32).sum();
        BlockQ8_1 {
            d: q.d,
            s: f16::from_f32(sum as f32 * scale_8bit(x).0),
            qs: q.qs,
        }
    }
}

/// The value of largest magnitude with its sign (the Q4_0 scale maps it to -8).
fn signed_max(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    max
}

impl GgmlBlock for BlockQ4_0 {
    const BLOCK: usize = QK4_0;

    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for j in 0..QK4_0 / 2 {
            out[j] = ((self.qs[j] & 0x0f) as i32 - 8) as f32 * d;
            out[j + QK4_0 / 2] = ((self.qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let d = signed_max(x) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut b = BlockQ4_0 {
            d: f16::from_f32(d),
            ..Default::default()
        };
        for j in 0..QK4_0 / 2 {
            let q0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
            let q1 = ((x[QK4_0 / 2 + j] * id + 8.5) as i8).min(15) as u8;
            b.qs[j] = q0 | (q1 << 4);
        }
        b
    }
}

/// The smallest and largest values as ggml's `quantize_row_q4_1_ref` finds them (strict
/// comparisons from `FLT_MAX` and `-FLT_MAX`): of 0.0 and -0.0, the first one met is kept,
/// which `f32::min` does not promise (it decides whether `m` is stored as 0x0000 or 0x8000).
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

impl GgmlBlock for BlockQ4_1 {
    const BLOCK: usize = QK4_1;

    fn dequantize(&self, out: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        for j in 0..QK4_1 / 2 {
            out[j] = (self.qs[j] & 0x0f) as f32 * d + m;
            out[j + QK4_1 / 2] = (self.qs[j] >> 4) as f32 * d + m;
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut b = BlockQ4_1 {
            d: f16::from_f32(d),
            m: f16::from_f32(min),
            ..Default::default()
        };
        for j in 0..QK4_1 / 2 {
            let q0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
            let q1 = (((x[QK4_1 / 2 + j] - min) * id + 0.5) as i8).min(15) as u8;
            b.qs[j] = q0 | (q1 << 4);
        }
        b
    }
}

/// Element j's 5-bit quant of a `block_q5_0` / `block_q5_1` (ggml's `dequantize_row_q5_0`).
fn q5(qh: [u8; 4], qs: &[u8; 16], j: usize) -> u8 {
    let nibble = if j < 16 {
        qs[j] & 0x0f
    } else {
        qs[j - 16] >> 4
    };
    let high = (u32::from_le_bytes(qh) >> j) & 1;
    nibble | ((high as u8) << 4)
}

/// Packs 32 5-bit quants: low nibbles as Q4_0's, fifth bits into `qh` (bit j for element j).
fn pack_q5(q: &[u8; 32]) -> ([u8; 4], [u8; 16]) {
    let mut qs = [0u8; 16];
    let mut qh = 0u32;
    for j in 0..16 {
        qs[j] = (q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4);
        qh |= u32::from((q[j] >> 4) & 1) << j;
        qh |= u32::from((q[j + 16] >> 4) & 1) << (j + 16);
    }
    (qh.to_le_bytes(), qs)
}

impl GgmlBlock for BlockQ5_0 {
    const BLOCK: usize = QK5_0;

    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (j, o) in out.iter_mut().enumerate().take(QK5_0) {
            *o = (q5(self.qh, &self.qs, j) as i32 - 16) as f32 * d;
        }
    }

    /// `quantize_row_q5_0_ref`: the value of largest magnitude maps to -16, q = trunc(x / d +
    /// 16.5) capped at 31.
    fn quantize(x: &[f32]) -> Self {
        let d = signed_max(x) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut q = [0u8; QK5_0];
        for (q, &v) in q.iter_mut().zip(x) {
            *q = ((v * id + 16.5) as i8).min(31) as u8;
        }
        let (qh, qs) = pack_q5(&q);
        BlockQ5_0 {
            d: f16::from_f32(d),
            qh,
            qs,
        }
    }
}

impl GgmlBlock for BlockQ5_1 {
    const BLOCK: usize = QK5_1;

    fn dequantize(&self, out: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        for (j, o) in out.iter_mut().enumerate().take(QK5_1) {
            *o = q5(self.qh, &self.qs, j) as f32 * d + m;
        }
    }

    /// `quantize_row_q5_1_ref`: d = (max - min) / 31, q = trunc((x - min) / d + 0.5).
    fn quantize(x: &[f32]) -> Self {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut q = [0u8; QK5_1];
        for (q, &v) in q.iter_mut().zip(x) {
            *q = ((v - min) * id + 0.5) as u8;
        }
        let (qh, qs) = pack_q5(&q);
        BlockQ5_1 {
            d: f16::from_f32(d),
            m: f16::from_f32(min),
            qh,
            qs,
        }
    }
}

/// Quantize `x` (whole blocks) into `y`, block by block, with the reference quantizer.
pub fn quantize<B: GgmlBlock>(x: &[f32], y: &mut [B]) {
    for (xb, yb) in x.chunks_exact(B::BLOCK).zip(y.iter_mut()) {
        *yb = B::quantize(xb);
    }
}

/// Dequantize blocks `x` into `y` (`B::BLOCK` values per block).
pub fn dequantize<B: GgmlBlock>(x: &[B], y: &mut [f32]) {
    for (xb, yb) in x.iter().zip(y.chunks_exact_mut(B::BLOCK)) {
        xb.dequantize(yb);
    }
}

/// A packed row of `B` blocks (`src`, any alignment) to f32: a type table's `to_f32`.
pub(super) fn blocks_to_f32<B: GgmlBlock>(src: &[u8], dst: &mut [f32]) {
    let bs = std::mem::size_of::<B>();
    for (b, o) in src.chunks_exact(bs).zip(dst.chunks_exact_mut(B::BLOCK)) {
        // SAFETY: the chunk holds exactly one block; B is Pod, so any bytes are a valid B.
        let blk: B = unsafe { b.as_ptr().cast::<B>().read_unaligned() };
        blk.dequantize(o);
    }
}

/// f32 (whole blocks) to a packed row of `B` blocks (`dst`, any alignment): a type table's
/// `from_f32`.
pub(super) fn blocks_from_f32<B: GgmlBlock>(src: &[f32], dst: &mut [u8]) {
    let bs = std::mem::size_of::<B>();
    for (x, b) in src.chunks_exact(B::BLOCK).zip(dst.chunks_exact_mut(bs)) {
        // SAFETY: the chunk has room for exactly one block; B is Pod (no padding).
        unsafe { b.as_mut_ptr().cast::<B>().write_unaligned(B::quantize(x)) };
    }
}

// ---- plain element rows (little-endian) ---------------------------------------------------

pub(super) fn f32_to_f32(src: &[u8], dst: &mut [f32]) {
    for (o, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

pub(super) fn f32_from_f32(src: &[f32], dst: &mut [u8]) {
    for (c, &v) in dst.chunks_exact_mut(4).zip(src) {
        c.copy_from_slice(&v.to_le_bytes());
    }
}

pub(super) fn f16_to_f32(src: &[u8], dst: &mut [f32]) {
    for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
    }
}

pub(super) fn f16_from_f32(src: &[f32], dst: &mut [u8]) {
    for (c, &v) in dst.chunks_exact_mut(2).zip(src) {
        c.copy_from_slice(&f16::from_f32(v).to_le_bytes());
    }
}

pub(super) fn bf16_to_f32(src: &[u8], dst: &mut [f32]) {
    for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
    }
}

pub(super) fn bf16_from_f32(src: &[f32], dst: &mut [u8]) {
    for (c, &v) in dst.chunks_exact_mut(2).zip(src) {
        c.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
    }
}

pub(super) fn i32_to_f32(src: &[u8], dst: &mut [f32]) {
    for (o, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *o = i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32;
    }
}

pub(super) fn i32_from_f32(src: &[f32], dst: &mut [u8]) {
    for (c, &v) in dst.chunks_exact_mut(4).zip(src) {
        c.copy_from_slice(&(v as i32).to_le_bytes());
    }
}

// ---- the test builds' fake type ------------------------------------------------------------

/// Elements per [`BlockFake`].
#[cfg(test)]
pub const QK_FAKE: usize = 16;

/// The block of [`super::DType::FakeQ4x16`], a quantized type that exists only in the
/// library's test builds (`cargo test --lib`) and has no kernels on any backend: 10 bytes, an
/// f16 scale `d` and 8 bytes of nibbles (element j low, j + 8 high), x = d * (q - 8). Its
/// blocks are neither 32 elements nor the size of any real block, so a kernel of another type
/// run on it would read the wrong layout; the tests check that none is.
#[cfg(test)]
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockFake {
    pub d: f16,
    pub qs: [u8; QK_FAKE / 2],
}

#[cfg(test)]
const _: () = assert!(std::mem::size_of::<BlockFake>() == 10);

// SAFETY: repr(C) of an f16 and u8s, 10 bytes (asserted above: no padding); any bit pattern
// is a valid f16 or u8.
#[cfg(test)]
unsafe impl Pod for BlockFake {}

#[cfg(test)]
impl GgmlBlock for BlockFake {
    const BLOCK: usize = QK_FAKE;

    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for j in 0..QK_FAKE / 2 {
            out[j] = ((self.qs[j] & 0x0f) as i32 - 8) as f32 * d;
            out[j + QK_FAKE / 2] = ((self.qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 7.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q = |v: f32| ((v * id).round() as i32 + 8).clamp(0, 15) as u8;
        let mut b = BlockFake {
            d: f16::from_f32(d),
            ..Default::default()
        };
        for j in 0..QK_FAKE / 2 {
            b.qs[j] = q(x[j]) | (q(x[j + QK_FAKE / 2]) << 4);
        }
        b
    }
}
