//! Model file formats: the GGUF reader and writer, safetensors, and a model folder's
//! `config.json`. Every reader memory-maps its file, validates it completely before handing
//! out bytes, and reports bad input as `Error::Format` naming the file and the field; files a
//! user names are regular files, and small ones are read up to a size limit (`file.rs`).

pub mod config;
pub mod file;
pub mod gguf;
mod gguf_parse;
mod gguf_stack;
pub mod gguf_types;
pub mod gguf_writer;
pub mod safetensors;

pub use config::JsonConfig;
pub use file::{
    MAX_JSON_BYTES, MAX_TOKENIZER_JSON_BYTES, parse_json, read_json_text, read_limited,
    read_text_limited, regular_file,
};
pub use gguf::{GgufFile, GgufTensorInfo};
pub use gguf_types::{GgmlType, GgufArray, GgufType, GgufValue, ggml_type, ggml_type_label};
pub use gguf_writer::GgufWriter;
pub use safetensors::{SafetensorsFile, SafetensorsTensorInfo};

use crate::{Error, Result};
use std::path::Path;

/// The bytes of a file: a read-only memory map, or an owned buffer (tests, fuzzing, files
/// built in memory).
pub(crate) enum Backing {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }

    /// Memory-maps `path` read-only. An empty file becomes an empty owned buffer (mapping a
    /// zero-length file is an error on some platforms).
    pub(crate) fn map(path: &Path) -> Result<Backing> {
        // A FIFO would block the open, a device map nothing sensible: regular files only.
        regular_file(path)?;
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if len == 0 {
            return Ok(Backing::Owned(Vec::new()));
        }
        // SAFETY: the mapping is read-only and lives as long as `Backing`, which owns it. The
        // one thing Rust cannot see is another process truncating or rewriting the file while
        // it is mapped; like every mmap-based model loader we require model files not to be
        // modified while open (documented on `GgufFile::open` and `SafetensorsFile::open`).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Ok(Backing::Mmap(map))
    }
}

/// Bytes of file-backed memory this process has mapped and touched (`RssFile` of
/// `/proc/self/status`): after loading a model, what it read from the memory-mapped file.
pub fn rss_file_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("RssFile:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
