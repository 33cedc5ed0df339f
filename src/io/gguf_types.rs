//! GGUF value model: metadata value types and values (scalars, strings, nested arrays). Tensor
//! types (ids, names, block layouts used to size tensor data) are the type table of
//! `dtype/table.rs`, re-exported here.
//!
//! Value type ids follow ggml's `docs/gguf.md` (`enum gguf_metadata_value_type`).

use crate::DType;
pub use crate::dtype::{GgmlType, ggml_type, ggml_type_label};

/// The type tag of a metadata value (`gguf_metadata_value_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgufType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl GgufType {
    pub const ALL: [GgufType; 13] = [
        GgufType::U8,
        GgufType::I8,
        GgufType::U16,
        GgufType::I16,
        GgufType::U32,
        GgufType::I32,
        GgufType::F32,
        GgufType::Bool,
        GgufType::String,
        GgufType::Array,
        GgufType::U64,
        GgufType::I64,
        GgufType::F64,
    ];

    /// The id written in the file.
    pub const fn id(self) -> u32 {
        match self {
            GgufType::U8 => 0,
            GgufType::I8 => 1,
            GgufType::U16 => 2,
            GgufType::I16 => 3,
            GgufType::U32 => 4,
            GgufType::I32 => 5,
            GgufType::F32 => 6,
            GgufType::Bool => 7,
            GgufType::String => 8,
            GgufType::Array => 9,
            GgufType::U64 => 10,
            GgufType::I64 => 11,
            GgufType::F64 => 12,
        }
    }

    pub fn from_id(id: u32) -> Option<GgufType> {
        GgufType::ALL.into_iter().find(|t| t.id() == id)
    }

    pub const fn name(self) -> &'static str {
        match self {
            GgufType::U8 => "u8",
            GgufType::I8 => "i8",
            GgufType::U16 => "u16",
            GgufType::I16 => "i16",
            GgufType::U32 => "u32",
            GgufType::I32 => "i32",
            GgufType::F32 => "f32",
            GgufType::Bool => "bool",
            GgufType::String => "string",
            GgufType::Array => "array",
            GgufType::U64 => "u64",
            GgufType::I64 => "i64",
            GgufType::F64 => "f64",
        }
    }

    /// Bytes of one value of a fixed-size type; `None` for strings and arrays.
    pub const fn fixed_size(self) -> Option<usize> {
        match self {
            GgufType::U8 | GgufType::I8 | GgufType::Bool => Some(1),
            GgufType::U16 | GgufType::I16 => Some(2),
            GgufType::U32 | GgufType::I32 | GgufType::F32 => Some(4),
            GgufType::U64 | GgufType::I64 | GgufType::F64 => Some(8),
            GgufType::String | GgufType::Array => None,
        }
    }

    /// The fewest bytes one value of this type can occupy in a file: a string is at least its
    /// u64 length, an array at least its u32 element type and u64 count. Used to reject
    /// absurd counts before allocating.
    pub const fn min_size(self) -> usize {
        match self.fixed_size() {
            Some(n) => n,
            None => match self {
                GgufType::String => 8,
                _ => 12,
            },
        }
    }
}

impl std::fmt::Display for GgufType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// An array value: one typed vector per element type, so a large array costs what its
/// elements cost (no per-element enum tag). Arrays of arrays nest.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufValue {
    pub fn value_type(&self) -> GgufType {
        match self {
            GgufValue::U8(_) => GgufType::U8,
            GgufValue::I8(_) => GgufType::I8,
            GgufValue::U16(_) => GgufType::U16,
            GgufValue::I16(_) => GgufType::I16,
            GgufValue::U32(_) => GgufType::U32,
            GgufValue::I32(_) => GgufType::I32,
            GgufValue::F32(_) => GgufType::F32,
            GgufValue::Bool(_) => GgufType::Bool,
            GgufValue::String(_) => GgufType::String,
            GgufValue::Array(_) => GgufType::Array,
            GgufValue::U64(_) => GgufType::U64,
            GgufValue::I64(_) => GgufType::I64,
            GgufValue::F64(_) => GgufType::F64,
        }
    }

    /// Any integer value, widened to i128 so every integer type converts losslessly.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// An f32 or f64 value as f64.
    pub fn as_float(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A short description for error messages: "u32 30", "string 'llama'", "array of 3 f32".
    pub fn describe(&self) -> String {
        match self {
            GgufValue::String(s) => {
                let short: String = s.chars().take(40).collect();
                let more = if short.len() < s.len() { "..." } else { "" };
                format!("string {short:?}{more}")
            }
            GgufValue::Array(a) => format!("array of {} {}", a.len(), a.elem_type()),
            GgufValue::U8(v) => format!("u8 {v}"),
            GgufValue::I8(v) => format!("i8 {v}"),
            GgufValue::U16(v) => format!("u16 {v}"),
            GgufValue::I16(v) => format!("i16 {v}"),
            GgufValue::U32(v) => format!("u32 {v}"),
            GgufValue::I32(v) => format!("i32 {v}"),
            GgufValue::F32(v) => format!("f32 {v}"),
            GgufValue::Bool(v) => format!("bool {v}"),
            GgufValue::U64(v) => format!("u64 {v}"),
            GgufValue::I64(v) => format!("i64 {v}"),
            GgufValue::F64(v) => format!("f64 {v}"),
        }
    }
}

impl GgufArray {
    pub fn elem_type(&self) -> GgufType {
        match self {
            GgufArray::U8(_) => GgufType::U8,
            GgufArray::I8(_) => GgufType::I8,
            GgufArray::U16(_) => GgufType::U16,
            GgufArray::I16(_) => GgufType::I16,
            GgufArray::U32(_) => GgufType::U32,
            GgufArray::I32(_) => GgufType::I32,
            GgufArray::F32(_) => GgufType::F32,
            GgufArray::Bool(_) => GgufType::Bool,
            GgufArray::String(_) => GgufType::String,
            GgufArray::Array(_) => GgufType::Array,
            GgufArray::U64(_) => GgufType::U64,
            GgufArray::I64(_) => GgufType::I64,
            GgufArray::F64(_) => GgufType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` of an integer array, widened to i128.
    pub fn integer_at(&self, i: usize) -> Option<i128> {
        Some(match self {
            GgufArray::U8(v) => (*v.get(i)?).into(),
            GgufArray::I8(v) => (*v.get(i)?).into(),
            GgufArray::U16(v) => (*v.get(i)?).into(),
            GgufArray::I16(v) => (*v.get(i)?).into(),
            GgufArray::U32(v) => (*v.get(i)?).into(),
            GgufArray::I32(v) => (*v.get(i)?).into(),
            GgufArray::U64(v) => (*v.get(i)?).into(),
            GgufArray::I64(v) => (*v.get(i)?).into(),
            _ => return None,
        })
    }

    /// An empty array of the given element type (nested arrays start empty too).
    pub fn empty(elem: GgufType) -> GgufArray {
        GgufArray::with_capacity(elem, 0)
    }

    pub(crate) fn with_capacity(elem: GgufType, n: usize) -> GgufArray {
        match elem {
            GgufType::U8 => GgufArray::U8(Vec::with_capacity(n)),
            GgufType::I8 => GgufArray::I8(Vec::with_capacity(n)),
            GgufType::U16 => GgufArray::U16(Vec::with_capacity(n)),
            GgufType::I16 => GgufArray::I16(Vec::with_capacity(n)),
            GgufType::U32 => GgufArray::U32(Vec::with_capacity(n)),
            GgufType::I32 => GgufArray::I32(Vec::with_capacity(n)),
            GgufType::F32 => GgufArray::F32(Vec::with_capacity(n)),
            GgufType::Bool => GgufArray::Bool(Vec::with_capacity(n)),
            GgufType::String => GgufArray::String(Vec::with_capacity(n)),
            GgufType::Array => GgufArray::Array(Vec::with_capacity(n)),
            GgufType::U64 => GgufArray::U64(Vec::with_capacity(n)),
            GgufType::I64 => GgufArray::I64(Vec::with_capacity(n)),
            GgufType::F64 => GgufArray::F64(Vec::with_capacity(n)),
        }
    }
}

/// The DTypes metashard computes with, as a list for messages.
pub(crate) fn supported_dtypes() -> String {
    DType::ALL
        .iter()
        .map(|d| d.name())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_type_ids_round_trip() {
        for t in GgufType::ALL {
            assert_eq!(GgufType::from_id(t.id()), Some(t));
        }
        assert_eq!(GgufType::from_id(13), None);
    }
}
