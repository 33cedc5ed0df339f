//! GGUF reader: memory-maps a GGUF v2/v3 file, parses and validates the header, the metadata
//! key-values and the tensor infos, and hands out typed metadata and tensor bytes.
//!
//! Layout per ggml's `docs/gguf.md`: magic "GGUF", u32 version, u64 tensor_count, u64
//! kv_count (v1 used u32 counts and is rejected), then kv_count key-values (gguf string key,
//! u32 value type, value), then tensor_count tensor infos (string name, u32 n_dims, n_dims u64
//! dimensions, u32 ggml type, u64 offset relative to the data section), then padding to
//! `general.alignment` (default 32), then the data section. Strings are a u64 byte length and
//! UTF-8 bytes; arrays are a u32 element type, a u64 count and the elements. Little-endian.
//!
//! Nothing is trusted: every length and count is checked against the bytes left before
//! anything is allocated, and every failure is `Error::Format` naming the file and the field.

use super::Backing;
use super::gguf_parse::Parser;
use super::gguf_types::{GgufArray, GgufValue, ggml_type, ggml_type_label, supported_dtypes};
use crate::{DType, Error, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
pub const DEFAULT_ALIGNMENT: usize = 32;
/// ggml's GGML_MAX_DIMS.
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays deeper than this are rejected (a crafted file could otherwise nest deep
/// enough to overflow the parser's stack at 12 bytes per level).
pub const MAX_ARRAY_DEPTH: usize = 8;

/// One tensor's description. `offset` is absolute in the file; `nbytes` is 0 when the ggml
/// type is unknown (its size cannot be computed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Position in the file's tensor info list.
    pub index: usize,
    /// The raw `ggml_type` id from the file.
    pub ggml_type: u32,
    /// The DType for this type id, when metashard computes with it.
    pub dtype: Option<DType>,
    /// Number of dimensions in the file (1..=4); `ne` is padded with 1s.
    pub n_dims: usize,
    /// Element counts in ggml order (ne[0] contiguous).
    pub ne: [usize; 4],
    pub offset: usize,
    pub nbytes: usize,
}

impl GgufTensorInfo {
    pub fn n_elements(&self) -> usize {
        self.ne.iter().product()
    }

    /// "token_embd.weight" style label with the index, for messages.
    pub fn label(&self) -> String {
        format!("tensor info {} ({})", self.index, self.name)
    }

    /// ggml's name of the tensor's type ("q5_0"), or `None` for an id the type table does not
    /// know.
    pub fn type_name(&self) -> Option<&'static str> {
        ggml_type(self.ggml_type).map(|t| t.name)
    }

    /// The tensor's type for messages: "q5_0 (id 6)", or "unknown ggml type (id 99)".
    pub fn type_label(&self) -> String {
        ggml_type_label(self.ggml_type)
    }
}

/// An open, validated GGUF file.
pub struct GgufFile {
    path: PathBuf,
    backing: Backing,
    version: u32,
    alignment: usize,
    data_offset: usize,
    metadata: Vec<(String, GgufValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    /// Tensors stacked from others of the file (`gguf_stack.rs`), with their parts.
    stacks: HashMap<String, Vec<GgufTensorInfo>>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and validates `path`. The file must not be modified while it is open.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let backing = Backing::map(path)?;
        GgufFile::parse(path.to_path_buf(), backing)
    }

    /// Parses a GGUF image held in memory; `name` stands for the file in error messages.
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile> {
        GgufFile::parse(name.into(), Backing::Owned(bytes))
    }

    fn parse(path: PathBuf, backing: Backing) -> Result<GgufFile> {
        let parsed = Parser::new(&path, backing.bytes()).parse()?;
        Ok(GgufFile {
            path,
            backing,
            version: parsed.version,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            metadata: parsed.metadata,
            key_index: parsed.key_index,
            tensors: parsed.tensors,
            tensor_index: parsed.tensor_index,
            stacks: HashMap::new(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    pub fn file_size(&self) -> usize {
        self.backing.bytes().len()
    }

    /// All key-values in file order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// `stacked` listed in place of its `parts` (the first part's place; `gguf_stack.rs`).
    pub(super) fn replace_tensors(&mut self, stacked: GgufTensorInfo, parts: Vec<GgufTensorInfo>) {
        let first = self.tensor_index[&parts[0].name];
        self.tensors[first] = stacked.clone();
        let gone: std::collections::HashSet<&str> =
            parts[1..].iter().map(|p| p.name.as_str()).collect();
        self.tensors.retain(|t| !gone.contains(t.name.as_str()));
        self.tensor_index = (self.tensors.iter().enumerate())
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        self.stacks.insert(stacked.name, parts);
    }

    pub(super) fn stacks(&self) -> &HashMap<String, Vec<GgufTensorInfo>> {
        &self.stacks
    }

    /// The data bytes of `t`; an error when metashard does not compute with its type, or when
    /// `t` is stacked from several tensors of the file (read it with `tensor_bytes`).
    pub fn tensor_data(&self, t: &GgufTensorInfo) -> Result<&[u8]> {
        if let Some(parts) = self.stacks.get(&t.name) {
            return Err(self.err(
                t.label(),
                format!(
                    "stacked from {} tensors of the file ({} ..): read with tensor_bytes",
                    parts.len(),
                    parts[0].name
                ),
            ));
        }
        if t.dtype.is_none() {
            return Err(self.err(
                format!("{} type", t.label()),
                format!(
                    "ggml type {} is not supported (supported: {})",
                    t.type_label(),
                    supported_dtypes()
                ),
            ));
        }
        self.raw_tensor_data(t)
    }

    /// The data bytes of `t` for any type whose layout is known, supported or not.
    pub fn raw_tensor_data(&self, t: &GgufTensorInfo) -> Result<&[u8]> {
        if ggml_type(t.ggml_type).is_none() {
            return Err(self.err(
                format!("{} type", t.label()),
                format!("{}: the size of its data is unknown", t.type_label()),
            ));
        }
        let end = t.offset.checked_add(t.nbytes);
        end.and_then(|end| self.backing.bytes().get(t.offset..end))
            .ok_or_else(|| {
                self.err(
                    format!("{} data", t.label()),
                    format!(
                        "{} bytes at offset {} are not in this file ({} bytes); was the info \
                         taken from another file?",
                        t.nbytes,
                        t.offset,
                        self.file_size()
                    ),
                )
            })
    }

    fn err(&self, field: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::format(&self.path, field, reason)
    }

    fn key_err(&self, key: &str, reason: impl Into<String>) -> Error {
        self.err(format!("metadata key '{key}'"), reason)
    }

    /// The value of `key`, converted by `conv`; `Ok(None)` when the key is absent and an
    /// error naming the key when it holds something `conv` does not take.
    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        conv: impl FnOnce(&'a GgufValue) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match conv(v) {
                Some(t) => Ok(Some(t)),
                None => {
                    Err(self.key_err(key, format!("expected {expected}, found {}", v.describe())))
                }
            },
        }
    }

    fn required<T>(&self, key: &str, v: Result<Option<T>>) -> Result<T> {
        v?.ok_or_else(|| self.key_err(key, "missing"))
    }

    /// Any integer value that fits in u32.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        self.typed(key, "an integer in u32 range", |v| {
            v.as_integer().and_then(|i| u32::try_from(i).ok())
        })
    }

    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.required(key, self.opt_u32(key))
    }

    /// Any integer value that fits in u64.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "an integer in u64 range", |v| {
            v.as_integer().and_then(|i| u64::try_from(i).ok())
        })
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.required(key, self.opt_u64(key))
    }

    /// Any integer value that fits in usize.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let v = self.typed(key, "a non-negative integer", |v| {
            v.as_integer().and_then(|i| usize::try_from(i).ok())
        });
        self.required(key, v)
    }

    /// Any integer value that fits in i64.
    pub fn opt_i64(&self, key: &str) -> Result<Option<i64>> {
        self.typed(key, "an integer in i64 range", |v| {
            v.as_integer().and_then(|i| i64::try_from(i).ok())
        })
    }

    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.required(key, self.opt_i64(key))
    }

    /// An f32 or f64 value as f32.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.typed(key, "a float", |v| v.as_float().map(|f| f as f32))
    }

    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.required(key, self.opt_f32(key))
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", GgufValue::as_bool)
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.required(key, self.opt_bool(key))
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", GgufValue::as_str)
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.required(key, self.opt_str(key))
    }

    pub fn opt_array(&self, key: &str) -> Result<Option<&GgufArray>> {
        self.typed(key, "an array", GgufValue::as_array)
    }

    pub fn get_array(&self, key: &str) -> Result<&GgufArray> {
        self.required(key, self.opt_array(key))
    }

    pub fn opt_str_array(&self, key: &str) -> Result<Option<&[String]>> {
        self.typed(key, "an array of strings", |v| match v {
            GgufValue::Array(GgufArray::String(s)) => Some(s.as_slice()),
            _ => None,
        })
    }

    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        self.required(key, self.opt_str_array(key))
    }

    pub fn opt_f32_array(&self, key: &str) -> Result<Option<&[f32]>> {
        self.typed(key, "an array of f32", |v| match v {
            GgufValue::Array(GgufArray::F32(s)) => Some(s.as_slice()),
            _ => None,
        })
    }

    pub fn get_f32_array(&self, key: &str) -> Result<&[f32]> {
        self.required(key, self.opt_f32_array(key))
    }

    /// An array of any integer type whose elements all fit in i32 (token types, ...).
    pub fn opt_i32_array(&self, key: &str) -> Result<Option<Vec<i32>>> {
        let Some(arr) = self.opt_array(key)? else {
            return Ok(None);
        };
        let mut out = Vec::with_capacity(arr.len());
        for i in 0..arr.len() {
            let v = arr.integer_at(i).ok_or_else(|| {
                self.key_err(
                    key,
                    format!(
                        "expected an array of integers, found array of {}",
                        arr.elem_type()
                    ),
                )
            })?;
            let v = i32::try_from(v)
                .map_err(|_| self.key_err(key, format!("element {i} = {v} does not fit in i32")))?;
            out.push(v);
        }
        Ok(Some(out))
    }

    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.required(key, self.opt_i32_array(key))
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }
}
