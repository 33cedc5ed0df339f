//! GGUF writer: builds a v2/v3 GGUF image from metadata and tensor bytes (layout per ggml's
//! `docs/gguf.md`, as read by `gguf.rs`). Used to make test fixtures and small model files; it
//! can also emit deliberately broken entries (raw types, raw offsets) for malformation tests.

use super::gguf::DEFAULT_ALIGNMENT;
use super::gguf_types::{GgufArray, GgufValue};
use crate::{DType, Error, Result};
use std::path::Path;

struct PendingTensor {
    name: String,
    ggml_type: u32,
    dims: Vec<u64>,
    data: Vec<u8>,
    /// `Some`: write this offset and no data (malformed fixtures).
    raw_offset: Option<u64>,
}

/// Collects metadata and tensors, then lays them out with aligned, packed data.
pub struct GgufWriter {
    version: u32,
    alignment: usize,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter::new()
    }
}

impl GgufWriter {
    /// A version 3 writer with the default alignment (32).
    pub fn new() -> GgufWriter {
        GgufWriter {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// The version number written in the header (2 and 3 share one layout).
    pub fn set_version(&mut self, version: u32) -> &mut Self {
        self.version = version;
        self
    }

    /// Sets the data alignment and records it as `general.alignment` (u32).
    pub fn set_alignment(&mut self, alignment: u32) -> Result<&mut Self> {
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(Error::invalid_argument(
                "GgufWriter: alignment",
                alignment,
                "not a power of two",
            ));
        }
        self.alignment = alignment as usize;
        self.metadata.retain(|(k, _)| k != "general.alignment");
        self.metadata
            .push(("general.alignment".into(), GgufValue::U32(alignment)));
        Ok(self)
    }

    /// Adds a key-value (no duplicate check: duplicates are how a test makes a bad file).
    pub fn add(&mut self, key: impl Into<String>, value: GgufValue) -> &mut Self {
        self.metadata.push((key.into(), value));
        self
    }

    /// Adds a tensor of `dtype` with `ne` in ggml order; `data` must be exactly its size.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        ne: &[usize],
        data: Vec<u8>,
    ) -> Result<&mut Self> {
        let name = name.into();
        if ne.is_empty() || ne.len() > 4 {
            return Err(Error::invalid_argument(
                format!("GgufWriter: dimensions of tensor '{name}'"),
                ne.len(),
                "a tensor has 1 to 4 dimensions",
            ));
        }
        dtype.check_row(ne[0], &format!("GgufWriter: tensor '{name}'"))?;
        let n = ne
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| {
                Error::invalid_argument(
                    format!("GgufWriter: shape of tensor '{name}'"),
                    format!("{ne:?}"),
                    "its element count overflows",
                )
            })?;
        let want = dtype.row_size(n);
        if data.len() != want {
            return Err(Error::invalid_argument(
                format!("GgufWriter: data of tensor '{name}' ({dtype} {ne:?})"),
                format!("{} bytes", data.len()),
                format!("the tensor needs exactly {want} bytes"),
            ));
        }
        let dims = ne.iter().map(|&d| d as u64).collect();
        Ok(self.add_raw_tensor(name, dtype.ggml_type(), dims, data))
    }

    /// Adds a tensor with any type id and dimensions, unchecked.
    pub fn add_raw_tensor(
        &mut self,
        name: impl Into<String>,
        ggml_type: u32,
        dims: Vec<u64>,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.into(),
            ggml_type,
            dims,
            data,
            raw_offset: None,
        });
        self
    }

    /// Adds a tensor info with a given relative offset and no data, unchecked.
    pub fn add_raw_tensor_info(
        &mut self,
        name: impl Into<String>,
        ggml_type: u32,
        dims: Vec<u64>,
        offset: u64,
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.into(),
            ggml_type,
            dims,
            data: Vec::new(),
            raw_offset: Some(offset),
        });
        self
    }

    /// The complete file image.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&v.value_type().id().to_le_bytes());
            put_value(&mut out, v);
        }
        let mut next = 0u64;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.to_le_bytes());
            let offset = match t.raw_offset {
                Some(o) => o,
                None => {
                    let o = next;
                    next = (o + t.data.len() as u64).div_ceil(align as u64) * align as u64;
                    o
                }
            };
            out.extend_from_slice(&offset.to_le_bytes());
        }
        out.resize(out.len().div_ceil(align) * align, 0);
        let data_start = out.len();
        for t in self.tensors.iter().filter(|t| t.raw_offset.is_none()) {
            out.resize(
                (out.len() - data_start).div_ceil(align) * align + data_start,
                0,
            );
            out.extend_from_slice(&t.data);
        }
        out
    }

    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_bytes()).map_err(|e| Error::io(path, e))
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(*x as u8),
        GgufValue::String(s) => put_str(out, s),
        GgufValue::Array(a) => put_array(out, a),
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(out: &mut Vec<u8>, a: &GgufArray) {
    out.extend_from_slice(&a.elem_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! le {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        GgufArray::U8(v) => out.extend_from_slice(v),
        GgufArray::I8(v) => le!(v),
        GgufArray::U16(v) => le!(v),
        GgufArray::I16(v) => le!(v),
        GgufArray::U32(v) => le!(v),
        GgufArray::I32(v) => le!(v),
        GgufArray::F32(v) => le!(v),
        GgufArray::U64(v) => le!(v),
        GgufArray::I64(v) => le!(v),
        GgufArray::F64(v) => le!(v),
        GgufArray::Bool(v) => out.extend(v.iter().map(|&b| b as u8)),
        GgufArray::String(v) => v.iter().for_each(|s| put_str(out, s)),
        GgufArray::Array(v) => v.iter().for_each(|x| put_array(out, x)),
    }
}
