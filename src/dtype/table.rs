//! The type table: every ggml tensor type a file can contain, with its name, GGUF id, block
//! size and bytes per block, written once. The types metashard computes with are the rows that
//! name a `DType` variant: the table's macro declares the enum from them, and they add the
//! kind of number held and the reference conversions of a row to and from f32. The rest of
//! ggml's types are known by name and size only (their data can be sized, skipped and named in
//! errors: "q5_0 (id 6)").
//!
//! After ggml's `type_traits[]` (ggml.c: `type_name`, `blck_size`, `type_size`, `is_quantized`,
//! `to_float`, `from_float_ref`) and candle-core's `GgmlDType` / `GgmlType`. Ids follow ggml.h
//! `enum ggml_type`; sizes ggml-common.h's block structs (the figures of gguf-py's
//! `GGML_QUANT_SIZES`, which the tests compare against). Kernels are not here: each backend
//! maps a `DType` to its kernels with an exhaustive match (`kernels_for`), so a new row does
//! not compile until every backend has said whether it can run it.

use super::formats::{self, BlockQ4_0, BlockQ4_1, BlockQ8_0, QK4_0, QK4_1, QK8_0};
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
    /// Test builds of the library only: a quantized type with blocks of 16 in 10 bytes
    /// ([`formats::BlockFake`]) and no kernels on any backend. Its id is not a ggml id.
    #[cfg(test)]
    FakeQ4x16 = (1000, "fake_q4x16", formats::QK_FAKE, size_of::<formats::BlockFake>(),
                 Quantized, formats::blocks_to_f32::<formats::BlockFake>,
                 formats::blocks_from_f32::<formats::BlockFake>),
}

/// The rest of ggml's types, which metashard knows by name and size only, by id. Ids 4, 5
/// (Q4_2, Q4_3), 31-33 and 36-38 (repacked CPU layouts) were removed from ggml and are unknown
/// here. Q8_1 is ggml-common.h's 36-byte `block_q8_1` (half d, half s, 32 int8).
const OTHER_GGML_TYPES: &[GgmlType] = &[
    GgmlType::new(6, "q5_0", 32, 22),
    GgmlType::new(7, "q5_1", 32, 24),
    GgmlType::new(9, "q8_1", formats::QK8_1, size_of::<formats::BlockQ8_1>()),
    GgmlType::new(10, "q2_k", 256, 84),
    GgmlType::new(11, "q3_k", 256, 110),
    GgmlType::new(12, "q4_k", 256, 144),
    GgmlType::new(13, "q5_k", 256, 176),
    GgmlType::new(14, "q6_k", 256, 210),
    GgmlType::new(15, "q8_k", 256, 292),
    GgmlType::new(16, "iq2_xxs", 256, 66),
    GgmlType::new(17, "iq2_xs", 256, 74),
    GgmlType::new(18, "iq3_xxs", 256, 98),
    GgmlType::new(19, "iq1_s", 256, 50),
    GgmlType::new(20, "iq4_nl", 32, 18),
    GgmlType::new(21, "iq3_s", 256, 110),
    GgmlType::new(22, "iq2_s", 256, 82),
    GgmlType::new(23, "iq4_xs", 256, 136),
    GgmlType::new(24, "i8", 1, 1),
    GgmlType::new(25, "i16", 1, 2),
    GgmlType::new(27, "i64", 1, 8),
    GgmlType::new(28, "f64", 1, 8),
    GgmlType::new(29, "iq1_m", 256, 56),
    GgmlType::new(34, "tq1_0", 256, 54),
    GgmlType::new(35, "tq2_0", 256, 66),
    GgmlType::new(39, "mxfp4", 32, 17),
];

/// Every row of the table: the `DType`s' (in `DType::ALL` order), then the others (by id).
pub fn ggml_types() -> impl Iterator<Item = GgmlType> {
    DType::ALL
        .into_iter()
        .map(|d| d.traits().ggml)
        .chain(OTHER_GGML_TYPES.iter().copied())
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
        OTHER_GGML_TYPES[i - DType::ALL.len()]
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
    fn every_dtype_is_one_row() {
        for d in DType::ALL {
            let rows: Vec<GgmlType> = ggml_types().filter(|t| t.name == d.name()).collect();
            assert_eq!(rows, [d.traits().ggml], "{d}");
        }
    }
}
