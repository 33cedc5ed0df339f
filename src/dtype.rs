//! Element types: `DType` with its block size and bytes per block, the ggml block layouts of the
//! quantized types, and scalar reference conversions to and from `f32` (row at a time).
//!
//! Block layouts follow ggml's `ggml-common.h` (ggml-org/ggml, `block_q8_0`, `block_q4_0`,
//! `block_q4_1`, `block_q8_1`) and the reference quantizers in `ggml-quants.c`
//! (`quantize_row_q*_ref`), so GGUF files load bit for bit. Fast SIMD versions of these
//! conversions live in `cpu/`; the functions here are the definition they are tested against.

use crate::{Error, Result};
use half::{bf16, f16};

/// Elements per block of every quantized type.
pub const QK: usize = 32;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// 32-bit signed integers: token ids, positions, row indices, argmax results.
    I32,
    /// Blocks of 32: one f16 scale `d`, 32 signed bytes; x = d * q.
    Q8_0,
    /// Blocks of 32: one f16 scale `d`, 16 bytes of nibbles; x = d * (q - 8).
    Q4_0,
    /// Blocks of 32: f16 scale `d`, f16 minimum `m`, 16 bytes of nibbles; x = d * q + m.
    Q4_1,
}

impl DType {
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
    ];

    /// The types a weight may be stored in, each taken by the `mul_mat` kernels as src0: the
    /// float types and every quantized type (not I32).
    pub const WEIGHT_TYPES: &[DType] = &[
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
    ];

    /// Elements per block: 1 for plain types, 32 for the quantized ones.
    pub const fn block_size(self) -> usize {
        match self {
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => QK,
            _ => 1,
        }
    }

    /// Bytes per block (per element for plain types).
    pub const fn type_size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => std::mem::size_of::<BlockQ8_0>(),
            DType::Q4_0 => std::mem::size_of::<BlockQ4_0>(),
            DType::Q4_1 => std::mem::size_of::<BlockQ4_1>(),
        }
    }

    pub const fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Floating-point types that kernels read and write element by element.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Bytes of a contiguous row of `ne0` elements. `ne0` must be a multiple of the block size
    /// (see [`DType::check_row`]).
    pub const fn row_size(self, ne0: usize) -> usize {
        ne0 / self.block_size() * self.type_size()
    }

    /// An error if `ne0` is not a whole number of blocks.
    pub fn check_row(self, ne0: usize, what: &str) -> Result<()> {
        if !ne0.is_multiple_of(self.block_size()) {
            return Err(Error::PartialBlock {
                what: what.to_string(),
                ne0,
                dtype: self,
                block: self.block_size(),
            });
        }
        Ok(())
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
        }
    }

    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
    }

    /// The `ggml_type` number used in GGUF tensor infos (ggml.h `enum ggml_type`).
    pub const fn ggml_type(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q8_0 => 8,
            DType::I32 => 26,
            DType::BF16 => 30,
        }
    }

    pub fn from_ggml_type(t: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.ggml_type() == t)
    }
}

/// Written by name (`q4_0`), as profiles and plans show it.
impl serde::Serialize for DType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `block_q8_0`: 34 bytes.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

/// `block_q4_0`: 18 bytes. Byte j holds element j in its low nibble and element j+16 in its high.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

/// `block_q4_1`: 20 bytes, nibble order as [`BlockQ4_0`].
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}

/// `block_q8_1`: 36 bytes. Not a tensor dtype: the 8-bit form activations take for the dot
/// product with [`BlockQ4_1`] weights; `s` = d * sum(qs).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; QK],
}

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == 36);

/// Marker for plain-old-data block types that may be viewed from raw bytes.
///
/// # Safety
/// Implementors are `repr(C)`, have no padding and accept any bit pattern.
pub unsafe trait Pod: Copy + 'static {}
// SAFETY: each is repr(C) of f16/i8/u8 fields with sizes asserted above (no padding), and every
// bit pattern is a valid f16, i8 or u8.
unsafe impl Pod for BlockQ8_0 {}
// SAFETY: as above.
unsafe impl Pod for BlockQ4_0 {}
// SAFETY: as above.
unsafe impl Pod for BlockQ4_1 {}
// SAFETY: as above.
unsafe impl Pod for BlockQ8_1 {}
// SAFETY: primitive numeric types accept every bit pattern and have no padding.
unsafe impl Pod for f32 {}
// SAFETY: as above.
unsafe impl Pod for f16 {}
// SAFETY: as above.
unsafe impl Pod for bf16 {}
// SAFETY: as above.
unsafe impl Pod for i32 {}
// SAFETY: as above.
unsafe impl Pod for u8 {}
// SAFETY: as above.
unsafe impl Pod for i8 {}

fn byte_view_error<T>(bytes: &[u8]) -> Error {
    Error::ByteView {
        len: bytes.len(),
        addr: bytes.as_ptr() as usize,
        elem: std::any::type_name::<T>(),
        size: std::mem::size_of::<T>(),
        align: std::mem::align_of::<T>(),
    }
}

/// View bytes as a slice of `T`. Errors if the length is not a multiple of `size_of::<T>()` or
/// the pointer is misaligned for `T`.
pub fn cast_slice<T: Pod>(bytes: &[u8]) -> Result<&[T]> {
    let sz = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(sz)
        || !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        return Err(byte_view_error::<T>(bytes));
    }
    // SAFETY: length and alignment checked above; T is Pod so any bytes are a valid T.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / sz) })
}

/// Mutable version of [`cast_slice`].
pub fn cast_slice_mut<T: Pod>(bytes: &mut [u8]) -> Result<&mut [T]> {
    let sz = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(sz)
        || !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        return Err(byte_view_error::<T>(bytes));
    }
    // SAFETY: length and alignment checked above; T is Pod so any bytes are a valid T, and the
    // exclusive borrow of `bytes` is moved into the result.
    Ok(unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<T>(), bytes.len() / sz) })
}

/// View a slice of `T` as bytes.
pub fn as_bytes<T: Pod>(v: &[T]) -> &[u8] {
    // SAFETY: T is Pod (no padding), so all its bytes are initialized.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Mutable byte view of a slice of `T`.
pub fn as_bytes_mut<T: Pod>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: T is Pod: every byte pattern written through the view is a valid T.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

// ---- reference conversions (ggml-quants.c `quantize_row_*_ref`, `dequantize_row_*`) --------

pub fn quantize_q8_0(x: &[f32], y: &mut [BlockQ8_0]) {
    for (xb, yb) in x.chunks_exact(QK).zip(y.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        yb.d = f16::from_f32(d);
        for (q, &v) in yb.qs.iter_mut().zip(xb) {
            *q = (v * id).round() as i8;
        }
    }
}

pub fn quantize_q8_1(x: &[f32], y: &mut [BlockQ8_1]) {
    for (xb, yb) in x.chunks_exact(QK).zip(y.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in yb.qs.iter_mut().zip(xb) {
            *q = (v * id).round() as i8;
            sum += *q as i32;
        }
        yb.d = f16::from_f32(d);
        yb.s = f16::from_f32(sum as f32 * d);
    }
}

pub fn quantize_q4_0(x: &[f32], y: &mut [BlockQ4_0]) {
    for (xb, yb) in x.chunks_exact(QK).zip(y.iter_mut()) {
        // The value of largest magnitude, with its sign, maps to -8.
        let mut amax = 0f32;
        let mut max = 0f32;
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        yb.d = f16::from_f32(d);
        for j in 0..QK / 2 {
            let x0 = xb[j] * id;
            let x1 = xb[QK / 2 + j] * id;
            let q0 = ((x0 + 8.5) as i8).min(15) as u8;
            let q1 = ((x1 + 8.5) as i8).min(15) as u8;
            yb.qs[j] = q0 | (q1 << 4);
        }
    }
}

pub fn quantize_q4_1(x: &[f32], y: &mut [BlockQ4_1]) {
    for (xb, yb) in x.chunks_exact(QK).zip(y.iter_mut()) {
        let min = xb.iter().copied().fold(f32::MAX, f32::min);
        let max = xb.iter().copied().fold(-f32::MAX, f32::max);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        yb.d = f16::from_f32(d);
        yb.m = f16::from_f32(min);
        for j in 0..QK / 2 {
            let x0 = (xb[j] - min) * id;
            let x1 = (xb[QK / 2 + j] - min) * id;
            let q0 = ((x0 + 0.5) as i8).min(15) as u8;
            let q1 = ((x1 + 0.5) as i8).min(15) as u8;
            yb.qs[j] = q0 | (q1 << 4);
        }
    }
}

pub fn dequantize_q8_0(x: &[BlockQ8_0], y: &mut [f32]) {
    for (xb, yb) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = xb.d.to_f32();
        for (o, &q) in yb.iter_mut().zip(&xb.qs) {
            *o = q as f32 * d;
        }
    }
}

pub fn dequantize_q4_0(x: &[BlockQ4_0], y: &mut [f32]) {
    for (xb, yb) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = xb.d.to_f32();
        for j in 0..QK / 2 {
            yb[j] = ((xb.qs[j] & 0x0f) as i32 - 8) as f32 * d;
            yb[j + QK / 2] = ((xb.qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

pub fn dequantize_q4_1(x: &[BlockQ4_1], y: &mut [f32]) {
    for (xb, yb) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = xb.d.to_f32();
        let m = xb.m.to_f32();
        for j in 0..QK / 2 {
            yb[j] = (xb.qs[j] & 0x0f) as f32 * d + m;
            yb[j + QK / 2] = (xb.qs[j] >> 4) as f32 * d + m;
        }
    }
}

/// An error unless `n` elements of `dtype` are whole blocks taking exactly `bytes` bytes.
fn check_row_bytes(what: &'static str, dtype: DType, n: usize, bytes: usize) -> Result<()> {
    dtype.check_row(n, what)?;
    if bytes != dtype.row_size(n) {
        return Err(Error::RowBytes {
            what,
            dtype,
            elements: n,
            expected: dtype.row_size(n),
            got: bytes,
        });
    }
    Ok(())
}

/// Convert one contiguous row of `dtype` bytes to f32. `src` holds exactly
/// `dtype.row_size(dst.len())` bytes.
pub fn row_to_f32(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let n = dst.len();
    check_row_bytes("row_to_f32", dtype, n, src.len())?;
    match dtype {
        DType::F32 => dst.copy_from_slice(cast_unaligned_f32(src, n).as_slice()),
        DType::F16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::I32 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32;
            }
        }
        DType::Q8_0 => dequantize_q8_0(&read_blocks(src), dst),
        DType::Q4_0 => dequantize_q4_0(&read_blocks(src), dst),
        DType::Q4_1 => dequantize_q4_1(&read_blocks(src), dst),
    }
    Ok(())
}

/// Convert one row of f32 to `dtype` bytes (`dst.len() == dtype.row_size(src.len())`).
pub fn row_from_f32(dtype: DType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    let n = src.len();
    check_row_bytes("row_from_f32", dtype, n, dst.len())?;
    match dtype {
        DType::F32 => dst.copy_from_slice(as_bytes(src)),
        DType::F16 => {
            for (c, &v) in dst.chunks_exact_mut(2).zip(src) {
                c.copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        DType::BF16 => {
            for (c, &v) in dst.chunks_exact_mut(2).zip(src) {
                c.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
            }
        }
        DType::I32 => {
            for (c, &v) in dst.chunks_exact_mut(4).zip(src) {
                c.copy_from_slice(&(v as i32).to_le_bytes());
            }
        }
        DType::Q8_0 => {
            let mut b = vec![BlockQ8_0::default(); n / QK];
            quantize_q8_0(src, &mut b);
            dst.copy_from_slice(as_bytes(&b));
        }
        DType::Q4_0 => {
            let mut b = vec![BlockQ4_0::default(); n / QK];
            quantize_q4_0(src, &mut b);
            dst.copy_from_slice(as_bytes(&b));
        }
        DType::Q4_1 => {
            let mut b = vec![BlockQ4_1::default(); n / QK];
            quantize_q4_1(src, &mut b);
            dst.copy_from_slice(as_bytes(&b));
        }
    }
    Ok(())
}

/// Convert a whole f32 slice (a multiple of whole rows) into `dtype` bytes.
pub fn f32_to_bytes(dtype: DType, src: &[f32]) -> Result<Vec<u8>> {
    let mut out = vec![0u8; dtype.row_size(src.len())];
    row_from_f32(dtype, src, &mut out)?;
    Ok(out)
}

/// Convert `dtype` bytes holding `n` elements into f32.
pub fn bytes_to_f32(dtype: DType, src: &[u8], n: usize) -> Result<Vec<f32>> {
    let mut out = vec![0f32; n];
    row_to_f32(dtype, src, &mut out)?;
    Ok(out)
}

fn cast_unaligned_f32(src: &[u8], n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    v.extend(
        src.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
    );
    v
}

/// Copy blocks out of bytes that may be unaligned.
fn read_blocks<T: Pod + Default>(src: &[u8]) -> Vec<T> {
    let n = src.len() / std::mem::size_of::<T>();
    let mut v = vec![T::default(); n];
    as_bytes_mut(&mut v).copy_from_slice(&src[..n * std::mem::size_of::<T>()]);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect()
    }

    #[test]
    fn block_sizes_match_ggml() {
        assert_eq!(DType::Q8_0.type_size(), 34);
        assert_eq!(DType::Q4_0.type_size(), 18);
        assert_eq!(DType::Q4_1.type_size(), 20);
        assert_eq!(DType::Q4_0.row_size(4096), 4096 / 32 * 18);
        assert_eq!(DType::from_ggml_type(8), Some(DType::Q8_0));
        assert_eq!(DType::from_ggml_type(30), Some(DType::BF16));
        assert_eq!(DType::from_ggml_type(12), None);
    }

    #[test]
    fn quantize_round_trip_error_is_bounded() {
        let x = ramp(256);
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        for (dt, tol) in [
            (DType::Q8_0, amax / 127.0),
            (DType::Q4_0, amax / 8.0),
            (DType::Q4_1, 2.0 * amax / 15.0),
            (DType::F16, amax * 1e-3),
            (DType::BF16, amax * 1e-2),
        ] {
            let b = f32_to_bytes(dt, &x).unwrap();
            assert_eq!(b.len(), dt.row_size(x.len()));
            let y = bytes_to_f32(dt, &b, x.len()).unwrap();
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= tol, "{dt}: {a} vs {b} (tol {tol})");
            }
        }
    }

    #[test]
    fn q4_0_nibble_order() {
        // Element j in the low nibble of byte j, element j+16 in the high nibble.
        let mut x = vec![0f32; 32];
        x[0] = -8.0; // sets d = 1
        x[16] = 7.0;
        let b = f32_to_bytes(DType::Q4_0, &x).unwrap();
        let blk: &[BlockQ4_0] = &read_blocks(&b);
        assert_eq!(blk[0].d.to_f32(), 1.0);
        assert_eq!(blk[0].qs[0] & 0xf, 0);
        assert_eq!(blk[0].qs[0] >> 4, 15);
    }

    #[test]
    fn partial_blocks_are_an_error() {
        assert!(f32_to_bytes(DType::Q8_0, &[1.0; 31]).is_err());
        assert!(matches!(
            DType::Q4_1.check_row(48, "t"),
            Err(Error::PartialBlock {
                ne0: 48,
                dtype: DType::Q4_1,
                block: 32,
                ..
            })
        ));
    }

    #[test]
    fn rows_and_views_of_the_wrong_size_are_typed_errors() {
        let mut out = [0f32; 32];
        let e = row_to_f32(DType::Q8_0, &[0u8; 30], &mut out).unwrap_err();
        assert!(
            matches!(
                e,
                Error::RowBytes {
                    what: "row_to_f32",
                    dtype: DType::Q8_0,
                    elements: 32,
                    expected: 34,
                    got: 30,
                }
            ),
            "{e:?}"
        );
        let e = row_from_f32(DType::F16, &[0.0; 3], &mut [0u8; 8]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::RowBytes {
                    expected: 6,
                    got: 8,
                    ..
                }
            ),
            "{e:?}"
        );
        let e = row_to_f32(DType::Q4_0, &[0u8; 18], &mut out[..16]).unwrap_err();
        assert!(matches!(e, Error::PartialBlock { ne0: 16, .. }), "{e:?}");
        let bytes = [0i32; 4];
        let e = cast_slice::<f32>(&as_bytes(&bytes)[..6]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::ByteView {
                    len: 6,
                    size: 4,
                    ..
                }
            ),
            "{e}"
        );
        let e = cast_slice::<i32>(&as_bytes(&bytes)[1..5]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::ByteView {
                    len: 4,
                    align: 4,
                    ..
                }
            ),
            "{e}"
        );
    }
}
