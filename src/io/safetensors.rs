//! safetensors reader: memory-maps a `.safetensors` file, validates it with the `safetensors`
//! crate, and lists its tensors with metashard dtypes and ggml-order shapes.
//!
//! Format (per the safetensors crate docs): u64 little-endian header length N, N bytes of JSON
//! header `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`, then the
//! data, offsets relative to byte 8 + N. Shapes are row-major, so ggml's `ne` is the reversed
//! shape.

use super::Backing;
use crate::{DType, Error, Result};
use ::safetensors::SafeTensors;
use ::safetensors::tensor::{Dtype, SafeTensorError};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One tensor: the file's dtype name, the metashard DType when it maps to one, the row-major
/// shape, `ne` in ggml order, and its absolute byte range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SafetensorsTensorInfo {
    pub name: String,
    /// The dtype as the file names it ("F32", "I64", ...).
    pub file_dtype: String,
    pub dtype: Option<DType>,
    /// Row-major shape as stored in the header.
    pub shape: Vec<usize>,
    /// ggml order: `ne[0]` is the last (contiguous) dimension; padded with 1s.
    pub ne: [usize; 4],
    pub offset: usize,
    pub nbytes: usize,
}

pub struct SafetensorsFile {
    path: PathBuf,
    backing: Backing,
    tensors: Vec<SafetensorsTensorInfo>,
    index: HashMap<String, usize>,
    metadata: HashMap<String, String>,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn map_dtype(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::F16 => Some(DType::F16),
        Dtype::BF16 => Some(DType::BF16),
        Dtype::I32 => Some(DType::I32),
        _ => None,
    }
}

/// A sentence for each crate error, saying which part of the file is at fault.
fn describe(e: &SafeTensorError, len: usize) -> (String, String) {
    let header = "header".to_string();
    match e {
        SafeTensorError::HeaderTooSmall => (
            "header length".into(),
            format!("file has {len} bytes; the u64 header length needs 8"),
        ),
        SafeTensorError::HeaderTooLarge | SafeTensorError::InvalidHeaderLength => (
            "header length".into(),
            format!("{e} (the header length does not fit in the {len}-byte file)"),
        ),
        SafeTensorError::InvalidHeader(_)
        | SafeTensorError::InvalidHeaderDeserialization(_)
        | SafeTensorError::JsonError(_) => ("header JSON".into(), e.to_string()),
        SafeTensorError::InvalidOffset(name) => (
            format!("tensor '{name}' data_offsets"),
            "offsets must be contiguous, in order, starting at 0".into(),
        ),
        SafeTensorError::MetadataIncompleteBuffer => (
            "data section".into(),
            format!(
                "the tensors' data_offsets do not end exactly at the end of the file ({len} \
                 bytes): the file is truncated or has trailing bytes"
            ),
        ),
        _ => (header, e.to_string()),
    }
}

impl SafetensorsFile {
    /// Memory-maps and validates `path`. The file must not be modified while it is open.
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsFile> {
        let path = path.as_ref();
        let backing = Backing::map(path)?;
        SafetensorsFile::parse(path.to_path_buf(), backing)
    }

    /// Parses an image held in memory; `name` stands for the file in messages.
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<SafetensorsFile> {
        SafetensorsFile::parse(name.into(), Backing::Owned(bytes))
    }

    fn parse(path: PathBuf, backing: Backing) -> Result<SafetensorsFile> {
        let bytes = backing.bytes();
        let (n, meta) = SafeTensors::read_metadata(bytes).map_err(|e| {
            let (field, reason) = describe(&e, bytes.len());
            Error::format(&path, field, reason)
        })?;
        let data_start = 8 + n;
        let mut tensors = Vec::new();
        for name in meta.offset_keys() {
            let info = meta.info(&name).expect("offset_keys lists known tensors");
            let (begin, end) = info.data_offsets;
            let shape = info.shape.clone();
            if shape.len() > 4 {
                return Err(Error::format(
                    &path,
                    format!("tensor '{name}' shape"),
                    format!(
                        "{} dimensions {shape:?}; at most 4 are supported",
                        shape.len()
                    ),
                ));
            }
            let mut ne = [1usize; 4];
            for (i, &d) in shape.iter().rev().enumerate() {
                ne[i] = d;
            }
            tensors.push(SafetensorsTensorInfo {
                name: name.clone(),
                file_dtype: format!("{:?}", info.dtype),
                dtype: map_dtype(info.dtype),
                shape,
                ne,
                offset: data_start + begin,
                nbytes: end - begin,
            });
        }
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        let metadata = meta.metadata().clone().unwrap_or_default();
        Ok(SafetensorsFile {
            path,
            backing,
            tensors,
            index,
            metadata,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensors in data order.
    pub fn tensors(&self) -> &[SafetensorsTensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&SafetensorsTensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The `__metadata__` string map (empty when absent).
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// The data bytes of `t`; an error naming the tensor when its dtype is not one metashard
    /// computes with.
    pub fn tensor_data(&self, t: &SafetensorsTensorInfo) -> Result<&[u8]> {
        if t.dtype.is_none() {
            return Err(Error::format(
                &self.path,
                format!("tensor '{}' dtype", t.name),
                format!(
                    "dtype {} is not supported (supported: F32, F16, BF16, I32)",
                    t.file_dtype
                ),
            ));
        }
        self.raw_tensor_data(t)
    }

    /// The data bytes of `t` whatever its dtype.
    pub fn raw_tensor_data(&self, t: &SafetensorsTensorInfo) -> Result<&[u8]> {
        let bytes = self.backing.bytes();
        t.offset
            .checked_add(t.nbytes)
            .and_then(|end| bytes.get(t.offset..end))
            .ok_or_else(|| {
                Error::format(
                    &self.path,
                    format!("tensor '{}' data", t.name),
                    format!(
                        "{} bytes at offset {} are not in this file ({} bytes)",
                        t.nbytes,
                        t.offset,
                        bytes.len()
                    ),
                )
            })
    }

    /// Looks `name` up and returns its data, or an error naming the missing tensor.
    pub fn data_of(&self, name: &str) -> Result<(&SafetensorsTensorInfo, &[u8])> {
        let t = self.tensor(name).ok_or_else(|| {
            Error::format(&self.path, format!("tensor '{name}'"), "no such tensor")
        })?;
        Ok((t, self.tensor_data(t)?))
    }
}
