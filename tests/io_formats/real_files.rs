//! The real model files: SmolLM2 against gguf-py and truncated copies of it, MiniLM's
//! safetensors against its header and numpy, corrupted safetensors, and JSON configs.

use super::*;
use metashard::io::{JsonConfig, SafetensorsFile};

#[test]
fn smollm2_matches_gguf_py() {
    let path = smollm_path();
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.architecture().unwrap(), "llama");
    assert_eq!(g.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(g.tensors().len(), 272);
    let script = r#"
import json, sys, gguf
r = gguf.GGUFReader(sys.argv[1])
def plain(x):
    if isinstance(x, list): return [plain(y) for y in x]
    if isinstance(x, float): return repr(x)
    return x
fields = {k: [[t.name for t in f.types], plain(f.contents())] for k, f in r.fields.items()
          if not k.startswith("GGUF.")}
tensors = [[t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset),
            int(t.n_bytes)] for t in r.tensors]
sums = {t.name: float(t.data.astype("float64").sum()) for t in r.tensors if int(t.tensor_type) == 0}
print(json.dumps({"version": int(r.fields["GGUF.version"].contents()),
                  "fields": fields, "tensors": tensors, "f32_sums": sums}))
"#;
    let Some(out) = python(script, &[path.to_str().unwrap()]) else {
        return;
    };
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["version"], g.version());
    assert_eq!(j["fields"].as_object().unwrap().len(), g.metadata().len());
    for (k, v) in g.metadata() {
        let (types, value) = (&j["fields"][k][0], &j["fields"][k][1]);
        assert_eq!(
            types[0].as_str().unwrap(),
            gguf_py_type_name(v.value_type()),
            "{k}"
        );
        if let GgufValue::Array(a) = v {
            assert_eq!(
                types[1].as_str().unwrap(),
                gguf_py_type_name(a.elem_type()),
                "{k}"
            );
        }
        assert_eq!(*value, to_json(v), "{k}");
    }
    let pt = j["tensors"].as_array().unwrap();
    assert_eq!(pt.len(), g.tensors().len());
    for (t, p) in g.tensors().iter().zip(pt) {
        assert_eq!(p[0], t.name.as_str());
        assert_eq!(p[1], t.ggml_type, "{}", t.name);
        let shape: Vec<usize> = serde_json::from_value(p[2].clone()).unwrap();
        assert_eq!(shape, t.ne[..t.n_dims], "{}", t.name);
        assert_eq!(p[3], t.offset, "{} offset", t.name);
        assert_eq!(p[4], t.nbytes, "{} size", t.name);
    }
    let sums = j["f32_sums"].as_object().unwrap();
    assert_eq!(sums.len(), 61, "61 F32 norm weights");
    for (name, want) in sums {
        let t = g.tensor(name).unwrap();
        let data = g.tensor_data(t).unwrap();
        let ours: f64 = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .sum();
        let want = want.as_f64().unwrap();
        assert!(
            (ours - want).abs() <= 1e-9 * want.abs().max(1.0),
            "{name}: {ours} vs {want}"
        );
    }
    let emb = g.tensor("token_embd.weight").unwrap();
    assert_eq!((emb.dtype, emb.ne), (Some(DType::Q8_0), [576, 49152, 1, 1]));
    let q = g.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!((q.dtype, q.ne), (Some(DType::Q4_1), [576, 576, 1, 1]));
}

#[test]
fn truncated_copies_of_smollm2_name_the_field() {
    let path = smollm_path();
    let full = std::fs::read(&path).unwrap();
    let g = GgufFile::open(&path).unwrap();
    let data = g.data_offset();
    let cases: Vec<(usize, &[&str])> = vec![
        (3, &["header magic", "truncated"]),
        (13, &["header tensor_count", "truncated"]),
        // Before ~9 KB the 272 tensor infos cannot fit: the header's count is blamed.
        (30, &["header tensor_count", "truncated"]),
        (
            20_000,
            &[
                "metadata key 'tokenizer.ggml.tokens' value (array count)",
                "truncated",
            ],
        ),
        (
            600_000,
            &[
                "metadata key 'tokenizer.ggml.",
                "(array element",
                "truncated",
            ],
        ),
        (data - 5_000, &["tensor info", "truncated"]),
        (
            data,
            &["tensor info 0 (token_embd.weight) data", "truncated"],
        ),
        (50_000_000, &["tensor info", "past the end of the file"]),
        (full.len() - 1, &["tensor info", "past the end of the file"]),
    ];
    for (len, needles) in cases {
        let f = Scratch::write(&format!("cut-{len}.gguf"), &full[..len]);
        let e = expect_err(GgufFile::open(&f.0), &f.0, needles);
        eprintln!("{len} bytes: {e}");
    }
}

// ---- safetensors and JSON configs -------------------------------------------------------

fn minilm() -> PathBuf {
    models_dir().join("minilm")
}

#[test]
fn minilm_safetensors_matches_header_and_config() {
    let path = minilm().join("model.safetensors");
    let st = SafetensorsFile::open(&path).unwrap();
    let cfg = JsonConfig::open_model_config(minilm()).unwrap();
    let hidden = cfg.get_usize("hidden_size").unwrap();
    let ffn = cfg.get_usize("intermediate_size").unwrap();
    let layers = cfg.get_usize("num_hidden_layers").unwrap();
    let ne = |name: &str| st.tensor(name).unwrap_or_else(|| panic!("{name}")).ne;
    assert_eq!(
        ne("embeddings.word_embeddings.weight"),
        [hidden, cfg.get_usize("vocab_size").unwrap(), 1, 1]
    );
    assert_eq!(
        ne("embeddings.position_embeddings.weight"),
        [
            hidden,
            cfg.get_usize("max_position_embeddings").unwrap(),
            1,
            1
        ]
    );
    assert_eq!(
        ne("embeddings.token_type_embeddings.weight"),
        [hidden, cfg.get_usize("type_vocab_size").unwrap(), 1, 1]
    );
    for l in 0..layers {
        let p = format!("encoder.layer.{l}.");
        for w in [
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
        ] {
            assert_eq!(ne(&format!("{p}{w}.weight")), [hidden, hidden, 1, 1]);
            assert_eq!(ne(&format!("{p}{w}.bias")), [hidden, 1, 1, 1]);
        }
        assert_eq!(
            ne(&format!("{p}intermediate.dense.weight")),
            [hidden, ffn, 1, 1]
        );
        assert_eq!(ne(&format!("{p}output.dense.weight")), [ffn, hidden, 1, 1]);
    }
    assert!(
        st.tensor(&format!("encoder.layer.{layers}.output.dense.weight"))
            .is_none()
    );
    // position_ids is I64: listed, but data access names it and its dtype.
    let pos = st.tensor("embeddings.position_ids").unwrap();
    assert_eq!(
        (pos.dtype, pos.file_dtype.as_str(), pos.ne),
        (None, "I64", [512, 1, 1, 1])
    );
    expect_err(
        st.tensor_data(pos),
        &path,
        &["tensor 'embeddings.position_ids' dtype", "I64"],
    );
    assert_eq!(st.raw_tensor_data(pos).unwrap().len(), 4096);
    expect_err(
        st.data_of("nope"),
        &path,
        &["tensor 'nope'", "no such tensor"],
    );

    // The header as Python's json reads it, and a data checksum with numpy.
    let script = r#"
import json, struct, sys, numpy as np
f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n))
h.pop("__metadata__", None)
buf = np.fromfile(sys.argv[1], dtype=np.uint8)
out = {}
for k, v in h.items():
    b, e = v["data_offsets"]
    s = float(buf[8 + n + b: 8 + n + e].view(np.float32).astype(np.float64).sum()) if v["dtype"] == "F32" else None
    out[k] = [v["dtype"], v["shape"], 8 + n + b, e - b, s]
print(json.dumps(out))
"#;
    let Some(out) = python(script, &[path.to_str().unwrap()]) else {
        return;
    };
    let j: Value = serde_json::from_str(&out).unwrap();
    let j = j.as_object().unwrap();
    assert_eq!(j.len(), st.tensors().len());
    for t in st.tensors() {
        let p = &j[&t.name];
        assert_eq!(p[0], t.file_dtype.as_str(), "{}", t.name);
        assert_eq!(
            serde_json::from_value::<Vec<usize>>(p[1].clone()).unwrap(),
            t.shape
        );
        assert_eq!(
            (
                p[2].as_u64().unwrap() as usize,
                p[3].as_u64().unwrap() as usize
            ),
            (t.offset, t.nbytes)
        );
        if let Some(want) = p[4].as_f64() {
            let ours: f64 = st
                .tensor_data(t)
                .unwrap()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                .sum();
            assert!(
                (ours - want).abs() <= 1e-9 * want.abs().max(1.0),
                "{}: {ours} vs {want}",
                t.name
            );
        }
    }
}

#[test]
fn corrupted_safetensors_are_named_errors() {
    let path = minilm().join("model.safetensors");
    let full = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(full[..8].try_into().unwrap()) as usize;
    let st_err = |name: &str, bytes: Vec<u8>, needles: &[&str]| {
        let p = PathBuf::from(format!("mem-{name}.safetensors"));
        let e = expect_err(SafetensorsFile::from_bytes(&p, bytes), &p, needles);
        eprintln!("{e}");
    };
    st_err("tiny", full[..4].to_vec(), &["header length", "4 bytes"]);
    let mut b = full[..4096].to_vec();
    put_u64(&mut b, 0, u64::MAX);
    st_err("huge-len", b, &["header length"]);
    let mut b = full[..n + 8 + 100].to_vec();
    put_u64(&mut b, 0, n as u64 + 50);
    st_err("len-off", b, &["header"]);
    let mut b = full[..n + 8 + 4096].to_vec();
    b[8] = b'X';
    st_err("json", b, &["header JSON", "invalid JSON"]);
    // A truncated copy on disk, through open().
    let f = Scratch::write("cut.safetensors", &full[..full.len() - 100]);
    expect_err(
        SafetensorsFile::open(&f.0),
        &f.0,
        &["data section", "truncated"],
    );
    // A synthetic file with a 5-dimensional tensor.
    let header = br#"{"x":{"dtype":"F32","shape":[1,1,1,1,2],"data_offsets":[0,8]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header);
    b.extend_from_slice(&[0; 8]);
    st_err("5d", b, &["tensor 'x' shape", "5 dimensions"]);
}

#[test]
fn json_config_getters_name_file_and_key() {
    let cfg = JsonConfig::open_model_config(minilm()).unwrap();
    let p = minilm().join("config.json");
    assert_eq!(cfg.get_usize("num_attention_heads").unwrap(), 12);
    assert_eq!(cfg.get_f64("layer_norm_eps").unwrap(), 1e-12);
    assert_eq!(cfg.get_str("model_type").unwrap(), "bert");
    assert!(!cfg.get_bool("gradient_checkpointing").unwrap());
    assert_eq!(cfg.opt_usize("no_such_key").unwrap(), None);
    expect_err(
        cfg.get_usize("no_such_key"),
        &p,
        &["key 'no_such_key'", "missing"],
    );
    expect_err(
        cfg.get_usize("model_type"),
        &p,
        &["key 'model_type'", "non-negative integer", "\"bert\""],
    );
    expect_err(
        cfg.get_str("hidden_size"),
        &p,
        &["key 'hidden_size'", "a number 384"],
    );
    let f = Scratch::write("bad.json", b"{\n  \"a\": 1,\n  \"b\": \n}");
    expect_err(JsonConfig::open(&f.0), &f.0, &["JSON", "line 4"]);
    let f = Scratch::write("arr.json", b"[1, 2]");
    expect_err(
        JsonConfig::open(&f.0),
        &f.0,
        &["JSON top level", "an array"],
    );
    let nested = JsonConfig::parse("n.json", r#"{"a": {"b": 5}}"#).unwrap();
    assert_eq!(nested.get_usize("a.b").unwrap(), 5);
}
