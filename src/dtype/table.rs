//! The type table: every ggml tensor type a file can contain, with its name, GGUF id, block
//! size and bytes per block, written once. The types metashard computes with are the rows that
//! name a `DType` variant: the table's macro declares the enum from them, and they add the
//! kind of number held and the reference conversions of a row to and from f32. The rest of
//! ggml's types are known by name and size (their data can be sized, skipped and named in
//! errors: "iq1_s (id 19)"); Q8_K, whose block format is written (`kquants.rs`),
//! also carries its reference conversions, so files in it can be read and
//! written, without being a `DType` that a backend would have to run (a [`Format`]: "formats
//! without kernels", docs/kernels.md).
//!
//! After ggml's `type_traits[]` (ggml.c: `type_name`, `blck_size`, `type_size`, `is_quantized`,
//! `to_float`, `from_float_ref`) and candle-core's `GgmlDType` / `GgmlType`. Ids follow ggml.h
//! `enum ggml_type`; sizes ggml-common.h's block structs (the figures of gguf-py's
//! `GGML_QUANT_SIZES`, which the tests compare against). Kernels are not here: each backend
//! maps a `DType` to its kernels with an exhaustive match (`kernels_for`), so a new row does
//! not compile until every backend has said whether it can run it.

use super::formats::{self, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, GgmlBlock};
use super::formats::{QK4_0, QK4_1, QK8_0};
use super::iquants::{BlockIq4Nl, BlockIq4Xs};
use super::kquants::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K};
use crate::{Error, Result};
use std::mem::size_of;

/// One ggml tensor type as files name and size it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgmlType {
    /// The `ggml_type` number in GGUF tensor infos.
    pub id: u32,
    /// ggml's `type_name` ("q4_0").
    pub name: &'static str,
    /// Elements per block along ne[0] (1 for plain types).
    pub block_size: usize,
    /// Bytes per block (per element for plain types).
    pub type_size: usize,
}

impl GgmlType {
    const fn new(id: u32, name: &'static str, block_size: usize, type_size: usize) -> GgmlType {
        GgmlType {
            id,
            name,
            block_size,
            type_size,
        }
    }
}

impl GgmlType {
    /// Bytes of a contiguous row of `ne0` elements (`ne0` a multiple of the block size).
    pub const fn row_size(&self, ne0: usize) -> usize {
        ne0 / self.block_size * self.type_size
    }

    /// An error naming `what` unless `ne0` is a whole number of blocks.
    pub fn check_row(&self, ne0: usize, what: &str) -> Result<()> {
        if !ne0.is_multiple_of(self.block_size) {
            return Err(Error::PartialBlock {
                what: what.to_string(),
                ne0,
                dtype: self.name,
                block: self.block_size,
            });
        }
        Ok(())
    }

    /// An error unless `n` elements are whole blocks taking exactly `bytes` bytes.
    fn check_row_bytes(&self, what: &'static str, n: usize, bytes: usize) -> Result<()> {
        self.check_row(n, what)?;
        if bytes != self.row_size(n) {
            return Err(Error::RowBytes {
                what,
                dtype: self.name,
                elements: n,
                expected: self.row_size(n),
                got: bytes,
            });
        }
        Ok(())
    }
}

/// A packed row of whole blocks (any alignment) to f32 (ggml's `to_float`).
pub type ToF32 = fn(&[u8], &mut [f32]);
/// f32 to a packed row of whole blocks (ggml's `from_float_ref`: the reference quantizer).
pub type FromF32 = fn(&[f32], &mut [u8]);

/// A ggml type whose storage format metashard implements: its row of the table with its
/// reference conversions. Every `DType` has one ([`DType::format`]); so has every name-only
/// row whose blocks are written ([`format_of`]), which files can then be read and written in
/// though no backend computes with it.
#[derive(Clone, Copy, Debug)]
pub struct Format {
    pub ggml: GgmlType,
    pub to_f32: ToF32,
    pub from_f32: FromF32,
}

impl Format {
    /// Converts one packed row (`src`: exactly `row_size(dst.len())` bytes, any alignment).
    pub fn row_to_f32(&self, src: &[u8], dst: &mut [f32]) -> Result<()> {
        self.ggml
            .check_row_bytes("row_to_f32", dst.len(), src.len())?;
        (self.to_f32)(src, dst);
        Ok(())
    }

    /// Quantizes one row (`dst`: exactly `row_size(src.len())` bytes) with the reference
    /// quantizer.
    pub fn row_from_f32(&self, src: &[f32], dst: &mut [u8]) -> Result<()> {
        self.ggml
            .check_row_bytes("row_from_f32", src.len(), dst.len())?;
        (self.from_f32)(src, dst);
        Ok(())
    }

    /// The values of whole blocks `src` (an error naming the type unless `src` is a whole
    /// number of blocks).
    pub fn dequantize(&self, src: &[u8]) -> Result<Vec<f32>> {
        let n = src.len() / self.ggml.type_size * self.ggml.block_size;
        self.ggml.check_row_bytes("dequantize", n, src.len())?;
        let mut out = vec![0f32; n];
        (self.to_f32)(src, &mut out);
        Ok(out)
    }

    /// `src` (whole blocks) quantized with the reference quantizer.
    pub fn quantize(&self, src: &[f32]) -> Result<Vec<u8>> {
        self.ggml.check_row(src.len(), "quantize")?;
        let mut out = vec![0u8; self.ggml.row_size(src.len())];
        (self.from_f32)(src, &mut out);
        Ok(out)
    }
}

/// What the elements of a type hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Floating-point numbers kernels read and write element by element.
    Float,
    /// Integers (ids, positions).
    Int,
    /// Blocks of quantized values with per-block scales.
    Quantized,
}

/// A `DType`'s row: its ggml type, its kind and its reference row conversions.
#[derive(Clone, Copy, Debug)]
pub struct TypeTraits {
    pub ggml: GgmlType,
    pub kind: Kind,
    /// A packed row of whole blocks (any alignment) to f32 (ggml's `to_float`).
    pub to_f32: fn(&[u8], &mut [f32]),
    /// f32 to a packed row of whole blocks (ggml's `from_float_ref`: the reference quantizer).
    pub from_f32: fn(&[f32], &mut [u8]),
}

/// Declares `DType` from the table's rows that name a variant, with `DType::ALL` (in row order)
/// and `DType::traits`. A row with `#[cfg(..)]` exists only where the cfg holds.
macro_rules! type_table {
    ($(
        $(#[doc = $doc:literal])*
        $(#[cfg($cfg:meta)])?
        $v:ident = ($id:expr, $name:literal, $block:expr, $bytes:expr, $kind:ident,
                    $to:expr, $from:expr),
    )*) => {
        /// The element type of a tensor: one row of the type table (`dtype/table.rs`).
        // ggml's names (Q4_K, IQ4_NL), as users and files spell them.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum DType {
            $( $(#[doc = $doc])* $(#[cfg($cfg)])? $v, )*
        }

        impl DType {
            /// Every type, in the table's order.
            pub const ALL: [DType; [$( $(#[cfg($cfg)])? $name, )*].len()] =
                [$( $(#[cfg($cfg)])? DType::$v, )*];

            /// This type's row of the table.
            pub const fn traits(self) -> TypeTraits {
                match self {
                    $(
                        $(#[cfg($cfg)])?
                        DType::$v => TypeTraits {
                            ggml: GgmlType::new($id, $name, $block, $bytes),
                            kind: Kind::$kind,
                            to_f32: $to,
                            from_f32: $from,
                        },
                    )*
                }
            }
        }
    };
}

type_table! {
    F32 = (0, "f32", 1, 4, Float, formats::f32_to_f32, formats::f32_from_f32),
    F16 = (1, "f16", 1, 2, Float, formats::f16_to_f32, formats::f16_from_f32),
    BF16 = (30, "bf16", 1, 2, Float, formats::bf16_to_f32, formats::bf16_from_f32),
    /// 32-bit signed integers: token ids, positions, row indices, argmax results.
    I32 = (26, "i32", 1, 4, Int, formats::i32_to_f32, formats::i32_from_f32),
    /// Blocks of 32: one f16 scale `d`, 32 signed bytes; x = d * q.
    Q8_0 = (8, "q8_0", QK8_0, size_of::<BlockQ8_0>(), Quantized,
            formats::blocks_to_f32::<BlockQ8_0>, formats::blocks_from_f32::<BlockQ8_0>),
    /// Blocks of 32: one f16 scale `d`, 16 bytes of nibbles; x = d * (q - 8).
    Q4_0 = (2, "q4_0", QK4_0, size_of::<BlockQ4_0>(), Quantized,
            formats::blocks_to_f32::<BlockQ4_0>, formats::blocks_from_f32::<BlockQ4_0>),
    /// Blocks of 32: f16 scale `d`, f16 minimum `m`, 16 bytes of nibbles; x = d * q + m.
    Q4_1 = (3, "q4_1", QK4_1, size_of::<BlockQ4_1>(), Quantized,
            formats::blocks_to_f32::<BlockQ4_1>, formats::blocks_from_f32::<BlockQ4_1>),
    /// Blocks of 32: f16 scale `d`, 32 high bits, 16 bytes of nibbles; x = d * (q - 16).
    Q5_0 = (6, "q5_0", BlockQ5_0::BLOCK, size_of::<BlockQ5_0>(), Quantized,
            formats::blocks_to_f32::<BlockQ5_0>, formats::blocks_from_f32::<BlockQ5_0>),
    /// Blocks of 32: f16 scale `d`, f16 minimum `m`, 32 high bits, 16 bytes of nibbles; x = d * q + m.
    Q5_1 = (7, "q5_1", BlockQ5_1::BLOCK, size_of::<BlockQ5_1>(), Quantized,
            formats::blocks_to_f32::<BlockQ5_1>, formats::blocks_from_f32::<BlockQ5_1>),
    /// Super-blocks of 256: 16 sub-blocks of 16 with 4-bit scales and minimums, 2-bit values.
    Q2_K = (10, "q2_k", BlockQ2K::BLOCK, size_of::<BlockQ2K>(), Quantized,
            formats::blocks_to_f32::<BlockQ2K>, formats::blocks_from_f32::<BlockQ2K>),
    /// Super-blocks of 256: 16 sub-blocks of 16 with 6-bit scales, 3-bit values.
    Q3_K = (11, "q3_k", BlockQ3K::BLOCK, size_of::<BlockQ3K>(), Quantized,
            formats::blocks_to_f32::<BlockQ3K>, formats::blocks_from_f32::<BlockQ3K>),
    /// Super-blocks of 256: 8 sub-blocks of 32 with 6-bit scales and minimums, 4-bit values.
    Q4_K = (12, "q4_k", BlockQ4K::BLOCK, size_of::<BlockQ4K>(), Quantized,
            formats::blocks_to_f32::<BlockQ4K>, formats::blocks_from_f32::<BlockQ4K>),
    /// Super-blocks of 256: 8 sub-blocks of 32 with 6-bit scales and minimums, 5-bit values.
    Q5_K = (13, "q5_k", BlockQ5K::BLOCK, size_of::<BlockQ5K>(), Quantized,
            formats::blocks_to_f32::<BlockQ5K>, formats::blocks_from_f32::<BlockQ5K>),
    /// Super-blocks of 256: 16 sub-blocks of 16 with 8-bit scales, 6-bit values.
    Q6_K = (14, "q6_k", BlockQ6K::BLOCK, size_of::<BlockQ6K>(), Quantized,
            formats::blocks_to_f32::<BlockQ6K>, formats::blocks_from_f32::<BlockQ6K>),
    /// Blocks of 32: f16 scale, 4-bit indices into a fixed non-linear table.
    IQ4_NL = (20, "iq4_nl", BlockIq4Nl::BLOCK, size_of::<BlockIq4Nl>(), Quantized,
            formats::blocks_to_f32::<BlockIq4Nl>, formats::blocks_from_f32::<BlockIq4Nl>),
    /// Super-blocks of 256: 8 sub-blocks of 32 with 6-bit scales, 4-bit indices into IQ4_NL's table.
    IQ4_XS = (23, "iq4_xs", BlockIq4Xs::BLOCK, size_of::<BlockIq4Xs>(), Quantized,
            formats::blocks_to_f32::<BlockIq4Xs>, formats::blocks_from_f32::<BlockIq4Xs>),
    /// Test builds of the library only: a quantized type with blocks of 16 in 10 bytes
    /// ([`formats::BlockFake`]) and no kernels on any backend. Its id is not a ggml id.
    #[cfg(test)]
    FakeQ4x16 = (1000, "fake_q4x16", formats::QK_FAKE, size_of::<formats::BlockFake>(),
                 Quantized, formats::blocks_to_f32::<formats::BlockFake>,
                 formats::blocks_from_f32::<formats::BlockFake>),
}

/// A row of the table that is not a `DType`: its type, and its block format's reference
/// conversions where one is written.
#[derive(Clone, Copy)]
struct OtherRow {
    ggml: GgmlType,
    conversions: Option<(ToF32, FromF32)>,
}

/// A type known by name and size only.
const fn named(id: u32, name: &'static str, block_size: usize, type_size: usize) -> OtherRow {
    OtherRow {
        ggml: GgmlType::new(id, name, block_size, type_size),
        conversions: None,
    }
}

/// A type whose blocks `B` are written but that no backend computes with (a format without
/// kernels), sized by `B`. Making it a `DType` is moving the row into `type_table!` as
/// `V = (id, name, B::BLOCK, size_of::<B>(), Quantized, formats::blocks_to_f32::<B>,
/// formats::blocks_from_f32::<B>)` once every backend's `kernels_for` answers for it.
const fn blocks<B: GgmlBlock>(id: u32, name: &'static str) -> OtherRow {
    OtherRow {
        ggml: GgmlType::new(id, name, B::BLOCK, size_of::<B>()),
        conversions: Some((formats::blocks_to_f32::<B>, formats::blocks_from_f32::<B>)),
    }
}

/// The rest of ggml's types, which metashard does not compute with, by id: with their block
/// format where it is written, else by name and size only. Ids 4, 5 (Q4_2, Q4_3), 31-33 and
/// 36-38 (repacked CPU layouts) were removed from ggml and are unknown here. Q8_1 is
/// ggml-common.h's 36-byte `block_q8_1` (half d, half s, 32 int8).
const OTHER_GGML_TYPES: &[OtherRow] = &[
    named(9, "q8_1", formats::QK8_1, size_of::<formats::BlockQ8_1>()),
    blocks::<BlockQ8K>(15, "q8_k"),
    named(16, "iq2_xxs", 256, 66),
    named(17, "iq2_xs", 256, 74),
    named(18, "iq3_xxs", 256, 98),
    named(19, "iq1_s", 256, 50),
    named(21, "iq3_s", 256, 110),
    named(22, "iq2_s", 256, 82),
    named(24, "i8", 1, 1),
    named(25, "i16", 1, 2),
    named(27, "i64", 1, 8),
    named(28, "f64", 1, 8),
    named(29, "iq1_m", 256, 56),
    named(34, "tq1_0", 256, 54),
    named(35, "tq2_0", 256, 66),
    named(39, "mxfp4", 32, 17),
];

/// Every row of the table: the `DType`s' (in `DType::ALL` order), then the others (by id).
pub fn ggml_types() -> impl Iterator<Item = GgmlType> {
    DType::ALL
        .into_iter()
        .map(|d| d.traits().ggml)
        .chain(OTHER_GGML_TYPES.iter().map(|r| r.ggml))
}

/// Every type whose format is written: the `DType`s' (in `DType::ALL` order), then the
/// formats without kernels (by id).
pub fn formats() -> impl Iterator<Item = Format> {
    DType::ALL
        .into_iter()
        .map(DType::format)
        .chain(OTHER_GGML_TYPES.iter().filter_map(|r| {
            r.conversions.map(|(to_f32, from_f32)| Format {
                ggml: r.ggml,
                to_f32,
                from_f32,
            })
        }))
}

/// The format of the ggml type with GGUF id `id`, or `None` where it is not written (an
/// unknown id, or a type known by name and size only).
pub fn format_of(id: u32) -> Option<Format> {
    formats().find(|f| f.ggml.id == id)
}

/// The values of whole blocks `bytes` of ggml type `id` by its reference dequantizer: `None`
/// when its format is not written, an error naming the type when `bytes` is not whole blocks.
pub fn dequantize_row(id: u32, bytes: &[u8]) -> Option<Result<Vec<f32>>> {
    format_of(id).map(|f| f.dequantize(bytes))
}

impl DType {
    /// This type's row with its reference conversions.
    pub const fn format(self) -> Format {
        let t = self.traits();
        Format {
            ggml: t.ggml,
            to_f32: t.to_f32,
            from_f32: t.from_f32,
        }
    }
}

/// The ggml type with GGUF id `id`, or `None` for an id the table does not know.
pub fn ggml_type(id: u32) -> Option<GgmlType> {
    ggml_types().find(|t| t.id == id)
}

/// "q5_0 (id 6)", or "unknown ggml type (id 99)": a ggml type id for messages.
pub fn ggml_type_label(id: u32) -> String {
    match ggml_type(id) {
        Some(t) => format!("{} (id {id})", t.name),
        None => format!("unknown ggml type (id {id})"),
    }
}

const fn same_str(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Row `i` of the whole table (the `DType`s' first).
const fn row(i: usize) -> GgmlType {
    if i < DType::ALL.len() {
        DType::ALL[i].traits().ggml
    } else {
        OTHER_GGML_TYPES[i - DType::ALL.len()].ggml
    }
}

/// Checked when the crate compiles: ids and names are unique, plain types have blocks of one,
/// and a block-quantized type's blocks are whole bytes.
const _: () = {
    let n = DType::ALL.len() + OTHER_GGML_TYPES.len();
    let mut i = 0;
    while i < n {
        let a = row(i);
        assert!(
            a.block_size >= 1 && a.type_size >= 1,
            "empty block in the type table"
        );
        let mut j = i + 1;
        while j < n {
            let b = row(j);
            assert!(a.id != b.id, "two rows of the type table share an id");
            assert!(
                !same_str(a.name, b.name),
                "two rows of the type table share a name"
            );
            j += 1;
        }
        i += 1;
    }
    let mut d = 0;
    while d < DType::ALL.len() {
        let t = DType::ALL[d].traits();
        let quantized = matches!(t.kind, Kind::Quantized);
        assert!(
            quantized == (t.ggml.block_size > 1),
            "only quantized types have blocks"
        );
        d += 1;
    }
};

#[cfg(test)]
mod tests {
    use super::*;

    /// gguf-py's `GGML_QUANT_SIZES` (ggml-org/llama.cpp `gguf-py/gguf/constants.py`, with
    /// `GGMLQuantizationType` for the ids and ggml.c's `type_name`s): `(id, name, block size,
    /// bytes per block)` for every type a GGUF file can contain today.
    const PUBLISHED: &[(u32, &str, usize, usize)] = &[
        (0, "f32", 1, 4),
        (1, "f16", 1, 2),
        (2, "q4_0", 32, 2 + 16),
        (3, "q4_1", 32, 2 + 2 + 16),
        (6, "q5_0", 32, 2 + 4 + 16),
        (7, "q5_1", 32, 2 + 2 + 4 + 16),
        (8, "q8_0", 32, 2 + 32),
        (9, "q8_1", 32, 4 + 32),
        (10, "q2_k", 256, 2 + 2 + 256 / 16 + 256 / 4),
        (11, "q3_k", 256, 2 + 256 / 4 + 256 / 8 + 12),
        (12, "q4_k", 256, 2 + 2 + 256 / 2 + 12),
        (13, "q5_k", 256, 2 + 2 + 256 / 2 + 256 / 8 + 12),
        (14, "q6_k", 256, 2 + 256 / 2 + 256 / 4 + 256 / 16),
        (15, "q8_k", 256, 4 + 256 + 256 / 8),
        (16, "iq2_xxs", 256, 2 + 256 / 4),
        (17, "iq2_xs", 256, 2 + 256 / 4 + 256 / 32),
        (18, "iq3_xxs", 256, 2 + 256 / 4 + 256 / 8),
        (19, "iq1_s", 256, 2 + 256 / 8 + 256 / 16),
        (20, "iq4_nl", 32, 2 + 16),
        (21, "iq3_s", 256, 2 + 256 / 4 + 256 / 8 + 256 / 32 + 4),
        (22, "iq2_s", 256, 2 + 256 / 4 + 256 / 16),
        (23, "iq4_xs", 256, 2 + 2 + 256 / 2 + 256 / 64),
        (24, "i8", 1, 1),
        (25, "i16", 1, 2),
        (26, "i32", 1, 4),
        (27, "i64", 1, 8),
        (28, "f64", 1, 8),
        (29, "iq1_m", 256, 256 / 8 + 256 / 16 + 256 / 32),
        (30, "bf16", 1, 2),
        (34, "tq1_0", 256, 2 + 4 * 13),
        (35, "tq2_0", 256, 2 + 64),
        (39, "mxfp4", 32, 1 + 16),
    ];

    #[test]
    fn the_table_is_ggml_s_published_sizes() {
        for &(id, name, block_size, type_size) in PUBLISHED {
            let t = ggml_type(id).unwrap_or_else(|| panic!("{name} (id {id}) is missing"));
            assert_eq!(t, GgmlType::new(id, name, block_size, type_size));
        }
        // Every row is ggml's, except the test builds' fake type.
        for t in ggml_types() {
            let published = PUBLISHED.iter().any(|p| p.0 == t.id);
            assert!(
                published || t == DType::FakeQ4x16.traits().ggml,
                "{t:?} is not one of ggml's"
            );
        }
        assert_eq!(ggml_type(4), None);
        assert_eq!(ggml_type(99), None);
    }

    #[test]
    fn unknown_and_known_ids_are_labelled_by_name() {
        assert_eq!(ggml_type_label(6), "q5_0 (id 6)");
        assert_eq!(ggml_type_label(12), "q4_k (id 12)");
        assert_eq!(ggml_type_label(8), "q8_0 (id 8)");
        assert_eq!(ggml_type_label(99), "unknown ggml type (id 99)");
    }

    #[test]
    fn formats_without_kernels_are_reached_by_id() {
        for d in DType::ALL {
            assert_eq!(
                format_of(d.ggml_type()).unwrap().ggml,
                d.traits().ggml,
                "{d}"
            );
        }
        let written: Vec<&str> = OTHER_GGML_TYPES
            .iter()
            .filter(|r| r.conversions.is_some())
            .map(|r| r.ggml.name)
            .collect();
        // Q8_K is ggml's activation type for the K-quants: a format, not a weight type.
        assert_eq!(written, ["q8_k"]);
        for name in written {
            assert_eq!(DType::from_name(name), None, "{name} has no kernels yet");
        }
        for name in [
            "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs",
        ] {
            let d = DType::from_name(name).unwrap_or_else(|| panic!("{name} is a DType"));
            assert!(d.is_quantized(), "{name}");
        }
        assert!(format_of(16).is_none(), "iq2_xxs: name and size only");
        assert!(format_of(99).is_none());
        assert!(dequantize_row(19, &[0; 50]).is_none());
        assert_eq!(dequantize_row(12, &[0; 288]).unwrap().unwrap(), [0f32; 512]);
        let e = dequantize_row(12, &[0; 145]).unwrap().unwrap_err();
        assert!(
            matches!(
                e,
                Error::RowBytes {
                    what: "dequantize",
                    dtype: "q4_k",
                    elements: 256,
                    expected: 144,
                    got: 145
                }
            ),
            "{e:?}"
        );
        let q6 = format_of(14).unwrap();
        let e = q6.quantize(&[0.5; 100]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::PartialBlock {
                    ne0: 100,
                    dtype: "q6_k",
                    block: 256,
                    ..
                }
            ),
            "{e:?}"
        );
        let bytes = q6.quantize(&[0.5; 512]).unwrap();
        assert_eq!(bytes.len(), 420);
        let mut row = [0f32; 256];
        assert!(
            q6.row_to_f32(&bytes, &mut row).is_err(),
            "two blocks into one"
        );
        q6.row_to_f32(&bytes[210..], &mut row).unwrap();
        assert!(row.iter().all(|&v| (v - 0.5).abs() < 1e-3), "{row:?}");
    }

    #[test]
    fn every_dtype_is_one_row() {
        for d in DType::ALL {
            let rows: Vec<GgmlType> = ggml_types().filter(|t| t.name == d.name()).collect();
            assert_eq!(rows, [d.traits().ggml], "{d}");
        }
    }
}
