//! The identity of a model's files, which the ranks of a job compare before they load it
//! (`dist::agree`): the size of the weights file and a hash of everything but the weights (a
//! GGUF file's header: its metadata, tokenizer included, and its tensor table; a safetensors
//! file's JSON header and the folder's JSON files: config, tokenizer, pooling). Cheap (a few
//! MiB read, not the weights), and different for two files that differ in architecture,
//! shapes, types, layout, tokenizer or size. A copy of the same file at another path has the
//! same identity.

use crate::io::gguf::GgufFile;
use crate::models::paths::{ModelPath, resolve};
use crate::{Error, Result};
use std::io::Read;
use std::path::Path;

/// The most header bytes hashed (GGUF headers are a few MiB: the tokenizer's vocabulary).
const MAX_HEADER: u64 = 256 << 20;

/// FNV-1a, 64 bits (Fowler, Noll, Vo; the offset basis and prime of the FNV reference,
/// http://www.isthe.com/chongo/tech/comp/fnv/), over `bytes` from state `h`.
fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// The 64-bit FNV-1a hash of `bytes`: what the ranks of a job compare of a file's content
/// (a plan file) when the file itself is too long to send.
pub fn content_hash(bytes: &[u8]) -> u64 {
    fnv1a(FNV_BASIS, bytes)
}

fn io_err(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The size of `path` and the hash of its first `len` bytes (at most [`MAX_HEADER`]). A FIFO
/// or a device is refused by name before it is opened (opening a FIFO blocks).
fn head_of(path: &Path, len: u64) -> Result<(u64, u64)> {
    crate::io::regular_file(path)?;
    let f = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    let size = f.metadata().map_err(|e| io_err(path, e))?.len();
    let mut head = Vec::new();
    f.take(len.min(MAX_HEADER).min(size))
        .read_to_end(&mut head)
        .map_err(|e| io_err(path, e))?;
    Ok((size, fnv1a(FNV_BASIS, &head)))
}

/// `model`'s identity: `SIZE B, header HASH` (see the module doc). `model` is a name or a
/// path, as `run --model` and `embed --model` take it.
pub fn model_identity(model: &str) -> Result<String> {
    match resolve(model)? {
        ModelPath::Gguf(path) => {
            let header = GgufFile::open(&path)?.data_offset() as u64;
            let (size, h) = head_of(&path, header)?;
            Ok(format!("{size} B, header {h:016x}"))
        }
        ModelPath::Safetensors(dir) => {
            let weights = dir.join("model.safetensors");
            // An 8-byte little-endian header length, then the JSON header (safetensors format).
            let (_, _) = head_of(&weights, 8)?;
            let mut n = [0u8; 8];
            std::fs::File::open(&weights)
                .and_then(|mut f| f.read_exact(&mut n))
                .map_err(|e| io_err(&weights, e))?;
            let header = u64::from_le_bytes(n).saturating_add(8);
            let (size, mut h) = head_of(&weights, header)?;
            let mut jsons: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
                .map_err(|e| io_err(&dir, e))?
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "json") && p.is_file())
                .collect();
            jsons.sort();
            let pooling = dir.join("1_Pooling").join("config.json");
            if pooling.is_file() {
                jsons.push(pooling);
            }
            for p in &jsons {
                // tokenizer.json is the largest of them.
                let bytes = crate::io::read_limited(p, crate::io::MAX_TOKENIZER_JSON_BYTES)?;
                h = fnv1a(h, p.file_name().map_or(&[][..], |n| n.as_encoded_bytes()));
                h = fnv1a(h, &bytes);
            }
            Ok(format!("{size} B, header and JSON files {h:016x}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_reference_values() {
        // Test vectors of the FNV reference (fnv-1a 64: "" and "a", "foobar").
        assert_eq!(fnv1a(FNV_BASIS, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(FNV_BASIS, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(FNV_BASIS, b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn a_gguf_file_s_identity_follows_its_header_and_size_not_its_path() {
        let dir = std::env::temp_dir().join(format!("metashard-identity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut cfg = crate::models::synthetic::small_config(1);
        cfg.n_vocab = 300;
        let bytes =
            crate::models::synthetic::gguf_bytes(&cfg, crate::DType::F32, true, 64, 1).unwrap();
        let (a, b) = (dir.join("a.gguf"), dir.join("b.gguf"));
        std::fs::write(&a, &bytes).unwrap();
        std::fs::write(&b, &bytes).unwrap();
        let id = |p: &Path| model_identity(p.to_str().unwrap()).unwrap();
        assert_eq!(id(&a), id(&b));
        assert!(id(&a).starts_with(&format!("{} B, header ", bytes.len())));
        // One more byte changes the size; another weight file of the same size, with another
        // vocabulary in its header, changes the hash.
        let mut other = bytes.clone();
        other.push(0);
        std::fs::write(&b, &other).unwrap();
        assert_ne!(id(&a), id(&b));
        let mut cfg2 = cfg.clone();
        cfg2.rope_base *= 2.0;
        let other =
            crate::models::synthetic::gguf_bytes(&cfg2, crate::DType::F32, true, 64, 1).unwrap();
        assert_eq!(other.len(), bytes.len());
        std::fs::write(&b, &other).unwrap();
        let (ia, ib) = (id(&a), id(&b));
        assert_ne!(ia, ib);
        assert_eq!(ia.split(", ").next(), ib.split(", ").next());
        std::fs::remove_dir_all(&dir).ok();
    }
}
