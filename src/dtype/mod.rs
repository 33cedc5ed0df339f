//! Element types: `DType` and the one type table it is declared from (`table.rs`: name, GGUF
//! id, block size, bytes per block, kind, reference conversions), ggml's block layouts with
//! their reference quantizers (`formats.rs`: blocks of 32; `kquants.rs` with the scale
//! searches of `kscales.rs`: the K-quants; `iquants.rs`: IQ4_NL, IQ4_XS), byte views
//! (`pod.rs`), and conversions of whole rows to and from `f32` through the table. Block
//! formats that are not `DType`s (Q8_K) are reached by GGUF id, as every written one, through
//! [`format_of`] / [`dequantize_row`].
//!
//! Block layouts follow ggml's `ggml-common.h` and the reference quantizers in `ggml-quants.c`,
//! so GGUF files load bit for bit (see `formats.rs`). Fast SIMD versions of these conversions
//! live in `cpu/`; the functions here are the definition they are tested against.

mod formats;
mod iquants;
mod kquants;
mod kscales;
mod pod;
mod table;

#[cfg(test)]
pub use formats::{BlockFake, QK_FAKE};
pub use formats::{
    BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1, GgmlBlock, QK4_0, QK4_1,
    QK5_0, QK5_1, QK8_0, QK8_1, dequantize, quantize,
};
pub use iquants::{BlockIq4Nl, BlockIq4Xs, KVALUES_IQ4NL, QK4_NL};
pub use kquants::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, K_SCALE_SIZE, QK_K};
pub use pod::{Pod, as_bytes, as_bytes_mut, cast_slice, cast_slice_mut};
pub use table::{
    DType, Format, FromF32, GgmlType, Kind, ToF32, TypeTraits, dequantize_row, format_of, formats,
    ggml_type, ggml_type_label, ggml_types,
};

use crate::Result;

impl DType {
    /// The types a weight may be stored in: every float and quantized type of the table (not
    /// I32). A backend runs `mul_mat` on the ones its `kernels_for` knows and refuses the
    /// others, naming them.
    pub const WEIGHT_TYPES: &[DType] = &weight_types();

    /// Elements per block: 1 for plain types.
    pub const fn block_size(self) -> usize {
        self.traits().ggml.block_size
    }

    /// Bytes per block (per element for plain types).
    pub const fn type_size(self) -> usize {
        self.traits().ggml.type_size
    }

    /// What the elements hold.
    pub const fn kind(self) -> Kind {
        self.traits().kind
    }

    pub const fn is_quantized(self) -> bool {
        matches!(self.kind(), Kind::Quantized)
    }

    /// Floating-point types that kernels read and write element by element.
    pub const fn is_float(self) -> bool {
        matches!(self.kind(), Kind::Float)
    }

    /// Bytes of a contiguous row of `ne0` elements. `ne0` must be a multiple of the block size
    /// (see [`DType::check_row`]).
    pub const fn row_size(self, ne0: usize) -> usize {
        self.traits().ggml.row_size(ne0)
    }

    /// An error if `ne0` is not a whole number of blocks.
    pub fn check_row(self, ne0: usize, what: &str) -> Result<()> {
        self.traits().ggml.check_row(ne0, what)
    }

    /// ggml's name of the type ("q4_0").
    pub const fn name(self) -> &'static str {
        self.traits().ggml.name
    }

    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
    }

    /// The `ggml_type` number used in GGUF tensor infos (ggml.h `enum ggml_type`).
    pub const fn ggml_type(self) -> u32 {
        self.traits().ggml.id
    }

    pub fn from_ggml_type(t: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.ggml_type() == t)
    }
}

/// How many of `DType::ALL` are weight types.
const fn weight_count() -> usize {
    let mut n = 0;
    let mut i = 0;
    while i < DType::ALL.len() {
        if !matches!(DType::ALL[i].kind(), Kind::Int) {
            n += 1;
        }
        i += 1;
    }
    n
}

/// `DType::ALL` without the integer types, in order.
const fn weight_types() -> [DType; weight_count()] {
    let mut out = [DType::F32; weight_count()];
    let (mut i, mut n) = (0, 0);
    while i < DType::ALL.len() {
        if !matches!(DType::ALL[i].kind(), Kind::Int) {
            out[n] = DType::ALL[i];
            n += 1;
        }
        i += 1;
    }
    out
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

/// Convert one contiguous row of `dtype` bytes (any alignment) to f32 with the table's
/// reference conversion. `src` holds exactly `dtype.row_size(dst.len())` bytes.
pub fn row_to_f32(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    dtype.format().row_to_f32(src, dst)
}

/// Convert one row of f32 to `dtype` bytes (`dst.len() == dtype.row_size(src.len())`) with the
/// table's reference conversion (for quantized types, ggml's reference quantizer).
pub fn row_from_f32(dtype: DType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    dtype.format().row_from_f32(src, dst)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

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
        assert_eq!(DType::from_ggml_type(12), Some(DType::Q4_K));
        assert_eq!(DType::Q4_K.row_size(4096), 16 * 144);
        assert_eq!(
            DType::from_ggml_type(15),
            None,
            "q8_k is an activation type only"
        );
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
        let mut blk = [BlockQ4_0::default()];
        as_bytes_mut(&mut blk).copy_from_slice(&b);
        assert_eq!(blk[0].d.to_f32(), 1.0);
        assert_eq!(blk[0].qs[0] & 0xf, 0);
        assert_eq!(blk[0].qs[0] >> 4, 15);
    }

    #[test]
    fn row_conversions_are_the_block_types_reference_conversions() {
        let x = ramp(96);
        fn check<B: GgmlBlock>(dt: DType, x: &[f32]) {
            let mut blocks = vec![B::default(); x.len() / B::BLOCK];
            quantize(x, &mut blocks);
            let bytes = f32_to_bytes(dt, x).unwrap();
            assert_eq!(bytes, as_bytes(&blocks), "{dt}");
            let mut want = vec![0f32; x.len()];
            dequantize(&blocks, &mut want);
            // Unaligned bytes read as well as aligned ones.
            let mut shifted = vec![0u8; bytes.len() + 1];
            shifted[1..].copy_from_slice(&bytes);
            assert_eq!(
                bytes_to_f32(dt, &shifted[1..], x.len()).unwrap(),
                want,
                "{dt}"
            );
        }
        check::<BlockQ8_0>(DType::Q8_0, &x);
        check::<BlockQ4_0>(DType::Q4_0, &x);
        check::<BlockQ4_1>(DType::Q4_1, &x);
        check::<BlockFake>(DType::FakeQ4x16, &x);
    }

    #[test]
    fn weight_types_are_the_tables_float_and_quantized_types() {
        use DType::*;
        // The fake type is a row of test builds only, after the real ones.
        assert_eq!(
            DType::WEIGHT_TYPES,
            [
                F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
                IQ4_XS, FakeQ4x16
            ]
        );
        assert_eq!(
            DType::ALL,
            [
                F32, F16, BF16, I32, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
                IQ4_NL, IQ4_XS, FakeQ4x16
            ]
        );
        assert!(FakeQ4x16.is_quantized() && !FakeQ4x16.is_float());
        assert_eq!((FakeQ4x16.block_size(), FakeQ4x16.type_size()), (16, 10));
        assert_eq!(DType::from_name("FAKE_q4x16"), Some(FakeQ4x16));
    }

    #[test]
    fn partial_blocks_are_an_error() {
        assert!(f32_to_bytes(DType::Q8_0, &[1.0; 31]).is_err());
        assert!(matches!(
            DType::Q4_1.check_row(48, "t"),
            Err(Error::PartialBlock {
                ne0: 48,
                dtype: "q4_1",
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
                    dtype: "q8_0",
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
        // The fake type's blocks of 16 are whole where Q4_0's are not.
        row_to_f32(DType::FakeQ4x16, &[0u8; 10], &mut out[..16]).unwrap();
        let e = row_to_f32(DType::FakeQ4x16, &[0u8; 10], &mut out[..8]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::PartialBlock {
                    ne0: 8,
                    block: 16,
                    ..
                }
            ),
            "{e:?}"
        );
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
