//! The real Gemma 3 270M Q4_K_M file (F32, Q8_0, Q5_0, Q4_K and Q6_K tensors; fetched by
//! `scripts/fetch_models.sh`, docs/models.md): every tensor dequantized with our formats equals
//! gguf-py's dequantization (the CRC-32 of its float32 bytes per tensor), the loader reads every
//! tensor as its own type, and it refuses a file naming the first tensor of a type without
//! kernels and that type (tests/gemma3_file.rs runs the file).

use super::*;
use metashard::DType;
use metashard::dtype::format_of;
use metashard::io::{GgufFile, GgufWriter};
use metashard::models::hparams::DecoderConfig;
use metashard::models::loader::DecoderModel;
use metashard::models::synthetic::gguf_bytes;
use std::collections::BTreeMap;

fn gemma_path() -> PathBuf {
    let p = metashard::models::paths::models_dir().join("gemma3/gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.is_file(),
        "{} not found (set METASHARD_MODELS or run scripts/fetch_models.sh)",
        p.display()
    );
    p
}

/// zlib's CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320) of `bytes`, continuing from
/// `crc` as `zlib.crc32(bytes, crc)` does: the checksum `quants_ref.py` gives each tensor.
fn crc32(crc: u32, bytes: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        std::array::from_fn(|i| {
            (0..8).fold(i as u32, |c, _| {
                if c & 1 != 0 {
                    0xedb8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                }
            })
        })
    });
    !bytes.iter().fold(!crc, |c, &b| {
        table[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8)
    })
}

#[test]
fn gemma3_q4_k_m_dequantizes_as_gguf_py() {
    let path = gemma_path();
    // gguf-py runs while we compute ours.
    let py = quants_ref(&["tensors", path.to_str().unwrap()]);
    let g = GgufFile::open(&path).unwrap();
    let mut types = BTreeMap::new();
    let mut ours = Vec::new();
    for t in g.tensors() {
        *types.entry(t.type_label()).or_insert(0) += 1;
        let f = format_of(t.ggml_type)
            .unwrap_or_else(|| panic!("{}: no format for {}", t.name, t.type_label()));
        let data = g.raw_tensor_data(t).unwrap();
        let row_bytes = f.ggml.row_size(t.ne[0]);
        let mut row = vec![0f32; t.ne[0]];
        let mut crc = 0;
        for r in data.chunks_exact(row_bytes) {
            f.row_to_f32(r, &mut row).unwrap();
            crc = crc32(crc, &f32_bytes(&row));
        }
        ours.push((t, crc));
    }
    let want: BTreeMap<String, usize> = [
        ("f32 (id 0)", 109),
        ("q5_0 (id 6)", 81),
        ("q8_0 (id 8)", 10),
        ("q4_k (id 12)", 27),
        ("q6_k (id 14)", 9),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(types, want, "tensor types of the file");
    assert_eq!(crc32(0, b"123456789"), 0xcbf4_3926, "CRC-32's check value");
    let Some(out) = finish(py) else {
        return;
    };
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let theirs = j.as_array().unwrap();
    assert_eq!(theirs.len(), ours.len());
    for ((t, crc), p) in ours.iter().zip(theirs) {
        assert_eq!(p["name"], t.name.as_str());
        assert_eq!(p["type"], t.ggml_type, "{}", t.name);
        let ne: Vec<usize> = serde_json::from_value(p["ne"].clone()).unwrap();
        assert_eq!(ne, t.ne[..t.n_dims], "{}", t.name);
        assert_eq!(p["elements"], t.n_elements(), "{}", t.name);
        assert_eq!(
            p["crc32"],
            *crc,
            "{} ({}): dequantized values differ from gguf-py's",
            t.name,
            t.type_label()
        );
    }
    eprintln!("{} tensors equal gguf-py's: {types:?}", ours.len());
}

/// The file's Q5_0 / Q4_K / Q6_K weights are `DType`s: the loader places every tensor as its
/// own type.
#[test]
fn the_gemma3_file_loads_every_tensor_as_its_own_type() {
    let path = gemma_path();
    let bt = metashard::cpu::CpuBufferType;
    DecoderModel::load(&path, &bt, &|_, _| {}).unwrap();
    let g = GgufFile::open(&path).unwrap();
    for (name, dtype) in [
        ("blk.0.attn_k.weight", DType::Q5_0),
        ("blk.0.attn_output.weight", DType::Q4_K),
        ("blk.0.ffn_down.weight", DType::Q6_K),
        ("token_embd.weight", DType::Q8_0),
    ] {
        let t = g.tensor(name).unwrap();
        assert_eq!(t.dtype, Some(dtype), "{name}");
        assert_eq!(g.tensor_data(t).unwrap().len(), t.nbytes, "{name}");
    }
}

/// A llama file whose `blk.1.attn_output.weight` is Q8_K (ggml's activation type for the
/// K-quants: a block format metashard reads, no weight kernels; quantized with our reference
/// quantizer) is refused naming that tensor and its type, before anything is placed.
#[test]
fn a_weight_of_a_type_without_kernels_is_refused_naming_the_tensor_and_the_type() {
    let cfg = DecoderConfig::llama(2, 256, 512, 4, 2, 300);
    let src = GgufFile::from_bytes(
        "synthetic.gguf",
        gguf_bytes(&cfg, DType::F32, true, 512, 3).unwrap(),
    )
    .unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.add(k.clone(), v.clone());
    }
    let q8k = format("q8_k");
    for t in src.tensors() {
        let data = src.tensor_data(t).unwrap().to_vec();
        let dims: Vec<u64> = t.ne[..t.n_dims].iter().map(|&d| d as u64).collect();
        if t.name == "blk.1.attn_output.weight" {
            let x: Vec<f32> = data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            w.add_raw_tensor(t.name.clone(), 15, dims, q8k.quantize(&x).unwrap());
        } else {
            w.add_raw_tensor(t.name.clone(), t.ggml_type, dims, data);
        }
    }
    let dir = Scratch::new("q4k-llama");
    let path = dir.0.join("q4k.gguf");
    std::fs::write(&path, w.to_bytes()).unwrap();
    let e = DecoderModel::load(&path, &metashard::cpu::CpuBufferType, &|_, _| {})
        .err()
        .expect("Q8_K has no weight kernels")
        .to_string();
    assert!(
        e.contains("tensor `blk.1.attn_output.weight` has ggml type q8_k (id 15), which metashard cannot run"),
        "{e}"
    );
    assert!(e.contains(&path.display().to_string()), "{e}");
}
