//! GGUF parsing: a bounds-checked little-endian cursor that reads and validates the header,
//! the metadata key-values, the tensor infos and the data section layout of a GGUF image
//! (layout per ggml's `docs/gguf.md`; see `gguf.rs`). Every count and length is checked
//! against the bytes left before anything is allocated.

use super::gguf::{DEFAULT_ALIGNMENT, GGUF_MAGIC, GgufTensorInfo, MAX_ARRAY_DEPTH, MAX_DIMS};
use super::gguf_types::{GgufArray, GgufType, GgufValue, ggml_type};
use crate::{DType, Error, Result};
use std::collections::HashMap;
use std::path::Path;

/// Fewest bytes of one tensor info: empty name (8), n_dims (4), one dimension (8), type (4),
/// offset (8).
const MIN_TENSOR_INFO: usize = 32;
/// Fewest bytes of one key-value: empty key (8), type (4), a one-byte value.
const MIN_KV: usize = 13;

/// What the parser hands back.
pub(crate) struct Parsed {
    pub(crate) version: u32,
    pub(crate) alignment: usize,
    pub(crate) data_offset: usize,
    pub(crate) metadata: Vec<(String, GgufValue)>,
    pub(crate) key_index: HashMap<String, usize>,
    pub(crate) tensors: Vec<GgufTensorInfo>,
    pub(crate) tensor_index: HashMap<String, usize>,
}

/// A bounds-checked little-endian cursor over the file image.
pub(crate) struct Parser<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Parser<'a> {
    pub(crate) fn new(path: &'a Path, buf: &'a [u8]) -> Parser<'a> {
        Parser { path, buf, pos: 0 }
    }

    fn err(&self, field: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::format(self.path, field, reason)
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, field: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(
                field(),
                format!(
                    "file is truncated: {n} bytes needed at offset {}, but the file has {} bytes",
                    self.pos,
                    self.buf.len()
                ),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, field: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, field: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    /// A count or length that must fit in `remaining / min_size` items; checked before any
    /// allocation so a corrupt count cannot ask for more memory than the file could describe.
    fn count(&mut self, min_size: usize, what: &str, field: &dyn Fn() -> String) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(field)?;
        let room = (self.remaining() / min_size.max(1)) as u64;
        if n > room {
            return Err(self.err(
                field(),
                format!(
                    "{what} {n} (read at offset {at}) is larger than the {} bytes left in the \
                     file can hold: the file is truncated or the {what} is corrupt",
                    self.remaining()
                ),
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self, field: &dyn Fn() -> String) -> Result<String> {
        let n = self.count(1, "string length", field)?;
        let at = self.pos;
        let bytes = self.take(n, field)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.err(
                field(),
                format!("string at offset {at} is not valid UTF-8: {e}"),
            )),
        }
    }

    fn value_type(&mut self, field: &dyn Fn() -> String) -> Result<GgufType> {
        let at = self.pos;
        let id = self.u32(field)?;
        GgufType::from_id(id).ok_or_else(|| {
            self.err(
                field(),
                format!("unknown value type id {id} at offset {at} (known: 0..=12)"),
            )
        })
    }

    fn value(
        &mut self,
        ty: GgufType,
        depth: usize,
        field: &dyn Fn() -> String,
    ) -> Result<GgufValue> {
        Ok(match ty {
            GgufType::U8 => GgufValue::U8(u8::from_le_bytes(self.array(field)?)),
            GgufType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(field)?)),
            GgufType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(field)?)),
            GgufType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(field)?)),
            GgufType::U32 => GgufValue::U32(u32::from_le_bytes(self.array(field)?)),
            GgufType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(field)?)),
            GgufType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(field)?)),
            GgufType::U64 => GgufValue::U64(u64::from_le_bytes(self.array(field)?)),
            GgufType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(field)?)),
            GgufType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(field)?)),
            GgufType::Bool => GgufValue::Bool(self.bool(field)?),
            GgufType::String => GgufValue::String(self.string(field)?),
            GgufType::Array => GgufValue::Array(self.array_value(depth + 1, field)?),
        })
    }

    fn bool(&mut self, field: &dyn Fn() -> String) -> Result<bool> {
        let at = self.pos;
        match self.take(1, field)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.err(
                field(),
                format!("bool at offset {at} is {b}; a GGUF bool must be 0 or 1"),
            )),
        }
    }

    fn array_value(&mut self, depth: usize, field: &dyn Fn() -> String) -> Result<GgufArray> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(self.err(
                field(),
                format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels"),
            ));
        }
        let elem = self.value_type(&|| format!("{} (array element type)", field()))?;
        let n = self.count(elem.min_size(), "array count", &|| {
            format!("{} (array count)", field())
        })?;
        let mut arr = GgufArray::with_capacity(elem, n);
        macro_rules! fill {
            ($v:expr, $t:ty) => {{
                let bytes = self.take(n * std::mem::size_of::<$t>(), field)?;
                $v.extend(
                    bytes
                        .chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk size"))),
                );
            }};
        }
        match &mut arr {
            GgufArray::U8(v) => fill!(v, u8),
            GgufArray::I8(v) => fill!(v, i8),
            GgufArray::U16(v) => fill!(v, u16),
            GgufArray::I16(v) => fill!(v, i16),
            GgufArray::U32(v) => fill!(v, u32),
            GgufArray::I32(v) => fill!(v, i32),
            GgufArray::F32(v) => fill!(v, f32),
            GgufArray::U64(v) => fill!(v, u64),
            GgufArray::I64(v) => fill!(v, i64),
            GgufArray::F64(v) => fill!(v, f64),
            GgufArray::Bool(v) => {
                for i in 0..n {
                    v.push(self.bool(&|| format!("{} (array element {i})", field()))?);
                }
            }
            GgufArray::String(v) => {
                for i in 0..n {
                    v.push(self.string(&|| format!("{} (array element {i})", field()))?);
                }
            }
            GgufArray::Array(v) => {
                for i in 0..n {
                    v.push(
                        self.array_value(depth + 1, &|| {
                            format!("{} (array element {i})", field())
                        })?,
                    );
                }
            }
        }
        Ok(arr)
    }

    /// The whole image: header, metadata, tensor infos, then each tensor's place in the data
    /// section.
    pub(crate) fn parse(mut self) -> Result<Parsed> {
        let (version, tensor_count, kv_count) = self.header()?;
        let (metadata, key_index) = self.metadata(kv_count)?;
        let alignment = self.alignment(&metadata, &key_index)?;
        let (mut tensors, raw_offsets, tensor_index) = self.tensor_infos(tensor_count)?;
        let data_offset = self.place_data(&mut tensors, &raw_offsets, alignment)?;
        check_overlaps(self.path, &tensors)?;
        Ok(Parsed {
            version,
            alignment,
            data_offset,
            metadata,
            key_index,
            tensors,
            tensor_index,
        })
    }

    /// Magic, version and the two counts, each count checked against the bytes left.
    fn header(&mut self) -> Result<(u32, usize, usize)> {
        let magic: [u8; 4] = self.array(&|| "header magic".into())?;
        if magic != GGUF_MAGIC {
            return Err(self.err(
                "header magic",
                format!("expected \"GGUF\" (47 47 55 46), found {magic:02x?}; not a GGUF file"),
            ));
        }
        let version = self.u32(&|| "header version".into())?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(self.err(
                    "header version",
                    "GGUF version 1 (32-bit counts) is not supported; re-convert the model \
                     with a current converter (v2 or v3)",
                ));
            }
            v if v.swap_bytes() <= 3 => {
                return Err(self.err(
                    "header version",
                    format!(
                        "version reads as {v:#x}: this looks like a big-endian GGUF (version {}), \
                         which is not supported",
                        v.swap_bytes()
                    ),
                ));
            }
            v => {
                return Err(self.err(
                    "header version",
                    format!("unsupported GGUF version {v} (supported: 2, 3)"),
                ));
            }
        }
        let tensor_count = self.u64(&|| "header tensor_count".into())?;
        let kv_count = self.u64(&|| "header kv_count".into())?;
        let rest = self.remaining() as u64;
        if tensor_count > rest / MIN_TENSOR_INFO as u64 {
            return Err(self.err(
                "header tensor_count",
                format!(
                    "{tensor_count} tensors cannot fit in the {rest} bytes after the header \
                     (each tensor info takes at least {MIN_TENSOR_INFO} bytes): the file is \
                     truncated or the count is corrupt"
                ),
            ));
        }
        if kv_count > rest / MIN_KV as u64 {
            return Err(self.err(
                "header kv_count",
                format!(
                    "{kv_count} key-values cannot fit in the {rest} bytes after the header \
                     (each takes at least {MIN_KV} bytes): the file is truncated or the count \
                     is corrupt"
                ),
            ));
        }
        Ok((version, tensor_count as usize, kv_count as usize))
    }

    /// `kv_count` key-values in file order, and each key's position (duplicates refused).
    #[allow(clippy::type_complexity)]
    fn metadata(
        &mut self,
        kv_count: usize,
    ) -> Result<(Vec<(String, GgufValue)>, HashMap<String, usize>)> {
        let mut metadata = Vec::with_capacity(kv_count);
        let mut key_index = HashMap::with_capacity(kv_count);
        for i in 0..kv_count {
            let key = self.string(&|| format!("metadata entry {i} key"))?;
            let field = || format!("metadata key '{key}' value");
            let ty = self.value_type(&|| format!("metadata key '{key}' type"))?;
            let value = self.value(ty, 0, &field)?;
            if let Some(&prev) = key_index.get(&key) {
                return Err(self.err(
                    format!("metadata entry {i} key"),
                    format!("duplicate key '{key}' (first defined by entry {prev})"),
                ));
            }
            key_index.insert(key.clone(), i);
            metadata.push((key, value));
        }
        Ok((metadata, key_index))
    }

    /// `general.alignment`, a u32 power of two, or the default.
    fn alignment(
        &self,
        metadata: &[(String, GgufValue)],
        key_index: &HashMap<String, usize>,
    ) -> Result<usize> {
        match key_index.get("general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some(&i) => match metadata[i].1 {
                GgufValue::U32(a) if a != 0 && a.is_power_of_two() => Ok(a as usize),
                ref v => Err(self.err(
                    "metadata key 'general.alignment' value",
                    format!("expected a u32 power of two, found {}", v.describe()),
                )),
            },
        }
    }

    /// `tensor_count` tensor infos (not yet placed: offsets and sizes are filled in by
    /// [`Parser::place_data`]), their offsets relative to the data section, and each name's
    /// position (duplicates refused).
    #[allow(clippy::type_complexity)]
    fn tensor_infos(
        &mut self,
        tensor_count: usize,
    ) -> Result<(Vec<GgufTensorInfo>, Vec<u64>, HashMap<String, usize>)> {
        let mut tensors = Vec::with_capacity(tensor_count);
        let mut raw_offsets = Vec::with_capacity(tensor_count);
        let mut tensor_index: HashMap<String, usize> = HashMap::with_capacity(tensor_count);
        for i in 0..tensor_count {
            let (info, offset) = self.tensor_info(i)?;
            if let Some(&prev) = tensor_index.get(&info.name) {
                return Err(self.err(
                    format!("{} name", info.label()),
                    format!("duplicate tensor name (first used by tensor info {prev})"),
                ));
            }
            tensor_index.insert(info.name.clone(), i);
            raw_offsets.push(offset);
            tensors.push(info);
        }
        Ok((tensors, raw_offsets, tensor_index))
    }

    /// Tensor info `i`: name, dimensions (each non-zero, their product addressable), type, and
    /// its offset relative to the data section.
    fn tensor_info(&mut self, i: usize) -> Result<(GgufTensorInfo, u64)> {
        let name = self.string(&|| format!("tensor info {i} name"))?;
        let label = format!("tensor info {i} ({name})");
        let f = |what: &'static str| {
            let label = label.clone();
            move || format!("{label} {what}")
        };
        let n_dims = self.u32(&f("n_dims"))? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(self.err(
                f("n_dims")(),
                format!("{n_dims} dimensions; expected 1 to {MAX_DIMS}"),
            ));
        }
        let mut ne = [1usize; 4];
        let mut total: u64 = 1;
        for (d, slot) in ne.iter_mut().enumerate().take(n_dims) {
            let dim = self.u64(&|| format!("{label} dimension {d}"))?;
            if dim == 0 {
                return Err(self.err(format!("{label} dimension {d}"), "dimension is 0"));
            }
            total = total
                .checked_mul(dim)
                .filter(|&t| t <= i64::MAX as u64 && usize::try_from(t).is_ok())
                .ok_or_else(|| {
                    self.err(
                        format!("{label} dimension {d}"),
                        format!("element count overflows (dimension {dim})"),
                    )
                })?;
            *slot = dim as usize;
        }
        let ggml_type = self.u32(&f("type"))?;
        let offset = self.u64(&f("offset"))?;
        let info = GgufTensorInfo {
            name,
            index: i,
            ggml_type,
            dtype: DType::from_ggml_type(ggml_type),
            n_dims,
            ne,
            offset: 0,
            nbytes: 0,
        };
        Ok((info, offset))
    }

    /// The data section's offset (after the infos, aligned), and each tensor's absolute offset
    /// and byte size (for types the table knows), checked to lie in the file.
    fn place_data(
        &self,
        tensors: &mut [GgufTensorInfo],
        raw_offsets: &[u64],
        alignment: usize,
    ) -> Result<usize> {
        let data_offset = self.pos.div_ceil(alignment) * alignment;
        let file_len = self.buf.len();
        if !tensors.is_empty() && data_offset > file_len {
            return Err(self.err(
                "data section",
                format!(
                    "file is truncated: the data section starts at offset {data_offset}, but the \
                     file has {file_len} bytes"
                ),
            ));
        }
        for (t, &rel) in tensors.iter_mut().zip(raw_offsets) {
            self.place_tensor(t, rel, data_offset, alignment)?;
        }
        Ok(data_offset)
    }

    /// Tensor `t`'s absolute offset from `rel`, and its byte size when the table knows its type
    /// (else 0: its metadata stays readable, data access is an error naming the type).
    fn place_tensor(
        &self,
        t: &mut GgufTensorInfo,
        rel: u64,
        data_offset: usize,
        alignment: usize,
    ) -> Result<()> {
        let file_len = self.buf.len();
        let label = t.label();
        if !rel.is_multiple_of(alignment as u64) {
            return Err(self.err(
                format!("{label} offset"),
                format!("offset {rel} is not a multiple of the alignment {alignment}"),
            ));
        }
        let abs = usize::try_from(rel)
            .ok()
            .and_then(|r| r.checked_add(data_offset))
            .filter(|&a| a <= file_len)
            .ok_or_else(|| {
                self.err(
                    format!("{label} offset"),
                    format!(
                        "data offset {rel} (absolute {}) is past the end of the file \
                         ({file_len} bytes)",
                        rel as u128 + data_offset as u128
                    ),
                )
            })?;
        t.offset = abs;
        let Some(layout) = ggml_type(t.ggml_type) else {
            return Ok(()); // size unknown: metadata stays readable, data access errors
        };
        if !t.ne[0].is_multiple_of(layout.block_size) {
            return Err(self.err(
                format!("{label} dimension 0"),
                format!(
                    "row length {} is not a multiple of the {} block size {}",
                    t.ne[0], layout.name, layout.block_size
                ),
            ));
        }
        let nbytes = (t.n_elements() / layout.block_size)
            .checked_mul(layout.type_size)
            .ok_or_else(|| self.err(format!("{label} size"), "byte size overflows"))?;
        if nbytes > file_len - abs {
            return Err(self.err(
                format!("{label} data"),
                format!(
                    "file is truncated: {} {:?} needs {nbytes} bytes at offset {abs}, past \
                     the end of the file ({file_len} bytes)",
                    layout.name,
                    &t.ne[..t.n_dims]
                ),
            ));
        }
        t.nbytes = nbytes;
        Ok(())
    }
}

/// Two tensors whose data ranges intersect are an error naming both.
fn check_overlaps(path: &Path, tensors: &[GgufTensorInfo]) -> Result<()> {
    let mut order: Vec<&GgufTensorInfo> = tensors.iter().filter(|t| t.nbytes > 0).collect();
    order.sort_by_key(|t| (t.offset, t.index));
    for w in order.windows(2) {
        let (a, b) = (w[0], w[1]);
        if a.offset + a.nbytes > b.offset {
            let (first, second) = if a.index < b.index { (a, b) } else { (b, a) };
            return Err(Error::format(
                path,
                format!("{} offset", second.label()),
                format!(
                    "data [{}, {}) overlaps the data of {} [{}, {})",
                    second.offset,
                    second.offset + second.nbytes,
                    first.label(),
                    first.offset,
                    first.offset + first.nbytes
                ),
            ));
        }
    }
    Ok(())
}
