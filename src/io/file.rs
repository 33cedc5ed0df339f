//! Opening files a user names, safely: only regular files (a FIFO would block the reader
//! forever, `/dev/zero` would never end), and small ones read whole only up to a size limit
//! ([`MAX_JSON_BYTES`] for JSON configs, profiles, plans and timings), so a wrong path is an
//! error naming the file and the limit, never a hang or an out-of-memory abort.

use crate::{Error, Result};
use std::io::Read;
use std::path::Path;

/// The most bytes a JSON file (a model's `config.json` or `tokenizer_config.json`, a cluster
/// profile, a plan, collectives timed by `bench comm`) may have: 16 MiB, far above any of them.
pub const MAX_JSON_BYTES: u64 = 16 << 20;

/// The largest Hugging Face `tokenizer.json` read: vocabularies of 256k tokens with their
/// merges take about 35 MB (Gemma 3's is 33 MB).
pub const MAX_TOKENIZER_JSON_BYTES: u64 = 256 << 20;

/// An error about `path` with `reason`.
fn refuse(path: &Path, reason: String) -> Error {
    Error::io(
        path,
        std::io::Error::new(std::io::ErrorKind::InvalidInput, reason),
    )
}

/// What a file that is not a regular one is, in words.
fn kind(t: std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// The metadata of `path` (symbolic links followed) if it is a regular file, else an error
/// naming what it is; nothing is opened, so a FIFO cannot block.
pub fn regular_file(path: &Path) -> Result<std::fs::Metadata> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_file() {
        return Ok(meta);
    }
    Err(refuse(
        path,
        format!("is {}, not a regular file", kind(meta.file_type())),
    ))
}

/// The bytes of the regular file `path`, at most `limit` of them, else an error naming the
/// file and the limit. The file is opened without blocking (a FIFO swapped in after the check
/// is refused too) and read at most `limit + 1` bytes deep.
pub fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let too_big = |len: String| {
        refuse(
            path,
            format!(
                "{len} bytes, above the limit of {limit} bytes ({} MiB) for this kind of file",
                limit >> 20
            ),
        )
    };
    let meta = regular_file(path)?;
    if meta.len() > limit {
        return Err(too_big(meta.len().to_string()));
    }
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK);
    }
    let file = opts.open(path).map_err(|e| Error::io(path, e))?;
    let opened = file.metadata().map_err(|e| Error::io(path, e))?;
    if !opened.is_file() {
        return Err(refuse(
            path,
            format!("is {}, not a regular file", kind(opened.file_type())),
        ));
    }
    let mut buf = Vec::with_capacity(meta.len() as usize);
    file.take(limit + 1)
        .read_to_end(&mut buf)
        .map_err(|e| Error::io(path, e))?;
    if buf.len() as u64 > limit {
        return Err(too_big(format!("more than {limit}")));
    }
    Ok(buf)
}

/// The UTF-8 text of the JSON file `path`: [`read_limited`] to [`MAX_JSON_BYTES`].
pub fn read_json_text(path: &Path) -> Result<String> {
    read_text_limited(path, MAX_JSON_BYTES)
}

/// A `T` from the JSON `text` of `path`; an error names the file, what it is (`what`: "plan",
/// "cluster profile") and the path of the field at fault inside it (`devices[1].mem_bw`), with
/// serde's line and column.
pub fn parse_json<T: serde::de::DeserializeOwned>(
    path: &Path,
    what: &str,
    text: &str,
) -> Result<T> {
    let mut de = serde_json::Deserializer::from_str(text);
    let v: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let at = e.path().to_string();
        let field = if at == "." || at.is_empty() {
            what.to_string()
        } else {
            format!("{what}: {at}")
        };
        Error::format(path, field, e.into_inner().to_string())
    })?;
    de.end()
        .map_err(|e| Error::format(path, what.to_string(), e.to_string()))?;
    Ok(v)
}

/// The UTF-8 text of the regular file `path`, [`read_limited`] to `limit` bytes.
pub fn read_text_limited(path: &Path, limit: u64) -> Result<String> {
    let bytes = read_limited(path, limit)?;
    String::from_utf8(bytes).map_err(|e| {
        Error::format(
            path,
            "JSON",
            format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to()),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_errors_name_the_field_at_fault() {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct Dev {
            name: String,
            mem_bw: f64,
        }
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct C {
            devices: Vec<Dev>,
        }
        let p = Path::new("c.json");
        let text = r#"{"devices": [{"name": "a", "mem_bw": 1}, {"name": "b", "mem_bw": "fast"}]}"#;
        let e = parse_json::<C>(p, "cluster profile", text)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("c.json") && e.contains("devices[1].mem_bw") && e.contains("line 1"),
            "{e}"
        );
        let e = parse_json::<C>(p, "cluster profile", "{\"devices\": []} x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("trailing"), "{e}");
        assert_eq!(
            parse_json::<C>(p, "x", r#"{"devices": []}"#)
                .unwrap()
                .devices
                .len(),
            0
        );
    }

    #[test]
    fn special_and_oversized_files_are_refused_naming_them() {
        let e = read_json_text(Path::new("/dev/zero"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/dev/zero") && e.contains("character device"),
            "{e}"
        );
        let dir = std::env::temp_dir();
        let e = read_json_text(&dir).unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        let big = dir.join(format!("metashard-file-{}.json", std::process::id()));
        std::fs::write(&big, vec![b' '; 100]).unwrap();
        let e = read_limited(&big, 10).unwrap_err().to_string();
        assert!(e.contains("limit of 10 bytes"), "{e}");
        assert_eq!(read_limited(&big, 100).unwrap().len(), 100);
        std::fs::remove_file(&big).unwrap();
    }
}
