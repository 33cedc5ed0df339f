//! Model file formats: GGUF written by `GgufWriter` and read back (every value type, v2 and
//! v3, several alignments), every malformation giving an error that names the file and the
//! field, truncated copies of the real SmolLM2 file, the real file compared with gguf-py,
//! safetensors (MiniLM compared with its header as Python's json reads it, corrupted
//! copies), JSON configs, and never-panic fuzzing of the GGUF parser.
//!
//! Model files come from `$METASHARD_MODELS` or `<repo>/models-cache` (see
//! `scripts/fetch_models.sh`). Comparisons with Python are skipped with a note when python3
//! or the `gguf` package is missing, unless `METASHARD_REQUIRE_REF=1`.

use metashard::DType;
use metashard::io::{
    GgufArray, GgufFile, GgufType, GgufValue, GgufWriter, JsonConfig, SafetensorsFile,
};
use proptest::prelude::*;
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn models_dir() -> PathBuf {
    let dir = std::env::var_os("METASHARD_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models-cache"));
    assert!(
        dir.join("smollm2").is_dir() && dir.join("minilm").is_dir(),
        "model files not found in {} (set METASHARD_MODELS or run scripts/fetch_models.sh)",
        dir.display()
    );
    dir
}

fn smollm_path() -> PathBuf {
    models_dir().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// A scratch file path unique to this process and `name`; removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("metashard-io-{}-{name}", std::process::id()));
        Scratch(p)
    }
    fn write(name: &str, bytes: &[u8]) -> Scratch {
        let s = Scratch::new(name);
        std::fs::write(&s.0, bytes).unwrap();
        s
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs python3 on `script` with `args`; None (with a note) when python3 or gguf is missing.
fn python(script: &str, args: &[&str]) -> Option<String> {
    let skip = |why: String| {
        if std::env::var("METASHARD_REQUIRE_REF").as_deref() == Ok("1") {
            panic!("outside reference unavailable and METASHARD_REQUIRE_REF=1: {why}");
        }
        eprintln!("NOTE: skipping the comparison with Python: {why}");
        None
    };
    let out = match Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .output()
    {
        Ok(o) => o,
        Err(e) => return skip(format!("python3 cannot be started: {e}")),
    };
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if err.contains("ModuleNotFoundError") {
            return skip(err.trim().to_string());
        }
        panic!("python failed: {err}");
    }
    Some(String::from_utf8(out.stdout).unwrap())
}

/// The error text of `r`, which must be an error naming `path` and containing every one of
/// `needles`.
fn expect_err<T: std::fmt::Debug>(
    r: metashard::Result<T>,
    path: &Path,
    needles: &[&str],
) -> String {
    let e = r.expect_err("expected an error").to_string();
    assert!(
        e.contains(&path.display().to_string()),
        "error does not name the file: {e}"
    );
    for n in needles {
        assert!(e.contains(n), "error lacks {n:?}: {e}");
    }
    e
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// One key of every scalar type, a string, and arrays of every element type (nested too).
fn every_type() -> Vec<(String, GgufValue)> {
    let s = |x: &str| x.to_string();
    vec![
        (s("t.u8"), GgufValue::U8(200)),
        (s("t.i8"), GgufValue::I8(-100)),
        (s("t.u16"), GgufValue::U16(60000)),
        (s("t.i16"), GgufValue::I16(-30000)),
        (s("t.u32"), GgufValue::U32(4_000_000_000)),
        (s("t.i32"), GgufValue::I32(-2_000_000_000)),
        (s("t.f32"), GgufValue::F32(1.5e-5)),
        (s("t.bool"), GgufValue::Bool(true)),
        (
            s("t.string"),
            GgufValue::String("héllo\n\"world\" 😀".into()),
        ),
        (s("t.u64"), GgufValue::U64(u64::MAX - 1)),
        (s("t.i64"), GgufValue::I64(i64::MIN + 1)),
        (s("t.f64"), GgufValue::F64(-2.25e300)),
        (s("a.u8"), GgufValue::Array(GgufArray::U8(vec![0, 1, 255]))),
        (s("a.i8"), GgufValue::Array(GgufArray::I8(vec![-128, 127]))),
        (s("a.u16"), GgufValue::Array(GgufArray::U16(vec![1, 65535]))),
        (s("a.i16"), GgufValue::Array(GgufArray::I16(vec![-1, 2]))),
        (s("a.u32"), GgufValue::Array(GgufArray::U32(vec![7]))),
        (s("a.i32"), GgufValue::Array(GgufArray::I32(vec![-7, 1, 3]))),
        (
            s("a.f32"),
            GgufValue::Array(GgufArray::F32(vec![0.5, -1.0])),
        ),
        (
            s("a.bool"),
            GgufValue::Array(GgufArray::Bool(vec![true, false, true])),
        ),
        (
            s("a.string"),
            GgufValue::Array(GgufArray::String(vec![s("a"), s(""), s("ü b")])),
        ),
        (s("a.u64"), GgufValue::Array(GgufArray::U64(vec![u64::MAX]))),
        (s("a.i64"), GgufValue::Array(GgufArray::I64(vec![i64::MIN]))),
        (s("a.f64"), GgufValue::Array(GgufArray::F64(vec![1e-300]))),
        (
            s("a.empty"),
            GgufValue::Array(GgufArray::empty(GgufType::F32)),
        ),
        (
            s("a.nested"),
            GgufValue::Array(GgufArray::Array(vec![
                GgufArray::I32(vec![1, 2]),
                GgufArray::String(vec![s("x")]),
                GgufArray::Array(vec![GgufArray::Bool(vec![false])]),
            ])),
        ),
    ]
}

struct Fixture {
    writer: GgufWriter,
    tensors: Vec<(&'static str, DType, Vec<usize>, Vec<u8>)>,
}

fn fixture(version: u32, alignment: Option<u32>) -> Fixture {
    let mut w = GgufWriter::new();
    w.set_version(version);
    if let Some(a) = alignment {
        w.set_alignment(a).unwrap();
    }
    for (k, v) in every_type() {
        w.add(k, v);
    }
    let q8: Vec<u8> = (0..2 * 2 * 34).map(|i| (i * 7 % 251) as u8).collect();
    let q41: Vec<u8> = (0..20).map(|i| i as u8).collect();
    let tensors = vec![
        (
            "w.f32",
            DType::F32,
            vec![5, 3],
            f32_bytes(&(0..15).map(|i| i as f32).collect::<Vec<_>>()),
        ),
        (
            "w.f16",
            DType::F16,
            vec![7],
            (0..14).map(|i| i as u8).collect(),
        ),
        ("w.q8_0", DType::Q8_0, vec![64, 2], q8),
        ("w.q4_1", DType::Q4_1, vec![32], q41),
        ("w.i32", DType::I32, vec![1, 1, 1, 3], vec![1; 12]),
        ("w.bf16", DType::BF16, vec![2, 2, 2], vec![9; 16]),
    ];
    for (name, dt, ne, data) in &tensors {
        w.add_tensor(*name, *dt, ne, data.clone()).unwrap();
    }
    Fixture { writer: w, tensors }
}

#[test]
fn synthetic_files_round_trip_every_type_version_and_alignment() {
    for version in [2, 3] {
        for alignment in [None, Some(1), Some(8), Some(64), Some(256)] {
            let fx = fixture(version, alignment);
            let f = Scratch::write(
                &format!("rt-{version}-{alignment:?}.gguf"),
                &fx.writer.to_bytes(),
            );
            let g = GgufFile::open(&f.0).unwrap();
            let align = alignment.unwrap_or(32) as usize;
            assert_eq!(g.version(), version);
            assert_eq!(g.alignment(), align);
            assert_eq!(g.data_offset() % align, 0);
            let mut want = every_type();
            if let Some(a) = alignment {
                want.insert(0, ("general.alignment".into(), GgufValue::U32(a)));
            }
            assert_eq!(g.metadata(), &want[..]);
            for (k, v) in &want {
                assert_eq!(g.get(k), Some(v), "{k}");
            }
            assert_eq!(g.tensors().len(), fx.tensors.len());
            for (name, dt, ne, data) in &fx.tensors {
                let t = g.tensor(name).unwrap();
                assert_eq!(t.dtype, Some(*dt));
                assert_eq!(&t.ne[..ne.len()], &ne[..]);
                assert!(t.ne[ne.len()..].iter().all(|&d| d == 1));
                assert_eq!(t.offset % align, 0, "{name} offset");
                assert_eq!(g.tensor_data(t).unwrap(), &data[..], "{name} data");
            }
        }
    }
}

#[test]
fn typed_getters_convert_and_name_key_and_file_on_error() {
    let fx = fixture(3, None);
    let g = GgufFile::from_bytes("mem.gguf", fx.writer.to_bytes()).unwrap();
    let p = Path::new("mem.gguf");
    assert_eq!(g.get_u32("t.u8").unwrap(), 200);
    assert_eq!(g.get_u64("t.u64").unwrap(), u64::MAX - 1);
    assert_eq!(g.get_i64("t.i32").unwrap(), -2_000_000_000);
    assert_eq!(g.get_f32("t.f32").unwrap(), 1.5e-5);
    assert!(g.get_bool("t.bool").unwrap());
    assert_eq!(g.get_str("t.string").unwrap(), "héllo\n\"world\" 😀");
    assert_eq!(g.get_str_array("a.string").unwrap(), ["a", "", "ü b"]);
    assert_eq!(g.get_i32_array("a.u16").unwrap(), vec![1, 65535]);
    assert_eq!(g.get_f32_array("a.f32").unwrap(), [0.5, -1.0]);
    assert_eq!(g.opt_u32("no.such.key").unwrap(), None);
    expect_err(
        g.get_u32("no.such.key"),
        p,
        &["metadata key 'no.such.key'", "missing"],
    );
    expect_err(
        g.get_u32("t.i8"),
        p,
        &["metadata key 't.i8'", "u32", "i8 -100"],
    );
    expect_err(g.get_u32("t.u64"), p, &["metadata key 't.u64'"]);
    expect_err(
        g.get_str("t.f32"),
        p,
        &["metadata key 't.f32'", "expected a string"],
    );
    expect_err(
        g.get_i32_array("a.u64"),
        p,
        &["metadata key 'a.u64'", "element 0"],
    );
    expect_err(g.get_str_array("a.i32"), p, &["'a.i32'", "array of 3 i32"]);
}

/// The written file as gguf-py reads it: every field's types and values, every tensor.
#[test]
fn synthetic_file_matches_gguf_py() {
    let fx = fixture(3, Some(64));
    let f = Scratch::write("pyref.gguf", &fx.writer.to_bytes());
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
            list(bytes(t.data.tobytes()))] for t in r.tensors]
print(json.dumps({"fields": fields, "tensors": tensors}))
"#;
    let Some(out) = python(script, &[f.0.to_str().unwrap()]) else {
        return;
    };
    let j: Value = serde_json::from_str(&out).unwrap();
    let g = GgufFile::open(&f.0).unwrap();
    for (k, v) in g.metadata() {
        let (types, value) = (&j["fields"][k][0], &j["fields"][k][1]);
        assert_eq!(
            types[0].as_str().unwrap(),
            gguf_py_type_name(v.value_type()),
            "{k}"
        );
        // gguf-py's `contents()` flattens arrays of arrays (it returned [1, 2, 120, false]
        // here), so for nested arrays only the types are compared; that it parsed the keys
        // after this one shows it agrees on the nested array's layout.
        if !matches!(v, GgufValue::Array(GgufArray::Array(_))) {
            assert_eq!(*value, to_json(v), "{k}");
        }
    }
    assert_eq!(j["fields"].as_object().unwrap().len(), g.metadata().len());
    let pt = j["tensors"].as_array().unwrap();
    assert_eq!(pt.len(), g.tensors().len());
    for (t, p) in g.tensors().iter().zip(pt) {
        assert_eq!(p[0], t.name.as_str());
        assert_eq!(p[1], t.ggml_type);
        let shape: Vec<usize> = serde_json::from_value(p[2].clone()).unwrap();
        assert_eq!(shape, t.ne[..t.n_dims], "{}", t.name);
        assert_eq!(p[3], t.offset, "{} offset", t.name);
        let data: Vec<u8> = serde_json::from_value(p[4].clone()).unwrap();
        assert_eq!(data, g.tensor_data(t).unwrap(), "{} data", t.name);
    }
}

fn gguf_py_type_name(t: GgufType) -> &'static str {
    match t {
        GgufType::U8 => "UINT8",
        GgufType::I8 => "INT8",
        GgufType::U16 => "UINT16",
        GgufType::I16 => "INT16",
        GgufType::U32 => "UINT32",
        GgufType::I32 => "INT32",
        GgufType::F32 => "FLOAT32",
        GgufType::Bool => "BOOL",
        GgufType::String => "STRING",
        GgufType::Array => "ARRAY",
        GgufType::U64 => "UINT64",
        GgufType::I64 => "INT64",
        GgufType::F64 => "FLOAT64",
    }
}

/// Values as the Python script prints them (floats as their Python repr).
fn to_json(v: &GgufValue) -> Value {
    let fl = |x: f64| Value::String(py_float_repr(x));
    match v {
        GgufValue::F32(x) => fl(*x as f64),
        GgufValue::F64(x) => fl(*x),
        GgufValue::Array(a) => array_json(a),
        GgufValue::String(s) => Value::String(s.clone()),
        GgufValue::Bool(b) => Value::Bool(*b),
        other => int_json(other.as_integer().unwrap()),
    }
}

fn int_json(i: i128) -> Value {
    serde_json::from_str(&i.to_string()).unwrap()
}

fn array_json(a: &GgufArray) -> Value {
    match a {
        GgufArray::F32(v) => v
            .iter()
            .map(|&x| Value::String(py_float_repr(x as f64)))
            .collect(),
        GgufArray::F64(v) => v.iter().map(|&x| Value::String(py_float_repr(x))).collect(),
        GgufArray::Bool(v) => v.iter().map(|&b| Value::Bool(b)).collect(),
        GgufArray::String(v) => v.iter().map(|s| Value::String(s.clone())).collect(),
        GgufArray::Array(v) => v.iter().map(array_json).collect(),
        _ => (0..a.len())
            .map(|i| int_json(a.integer_at(i).unwrap()))
            .collect(),
    }
}

/// Python's repr of a float: shortest round-trip digits, like Rust's `{:?}` except for the
/// exponent spelling.
fn py_float_repr(x: f64) -> String {
    let s = format!("{x:?}");
    match s.split_once('e') {
        Some((m, e)) => {
            let (sign, digits) = e.strip_prefix('-').map_or(("+", e), |d| ("-", d));
            let m = m.strip_suffix(".0").unwrap_or(m);
            format!("{m}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

// ---- malformed GGUF --------------------------------------------------------------------

/// A one-key file: `key` with `value`, no tensors.
fn one_key(key: &str, value: GgufValue) -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add(key, value);
    w.to_bytes()
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// Opens `bytes` from a scratch file and expects an error naming the file and `needles`.
fn bad(name: &str, bytes: &[u8], needles: &[&str]) -> String {
    let f = Scratch::write(&format!("bad-{name}.gguf"), bytes);
    expect_err(GgufFile::open(&f.0), &f.0, needles)
}

#[test]
fn malformed_headers_and_metadata_are_named_errors() {
    let base = one_key("k", GgufValue::Bool(true));
    // Layout: magic 0, version 4, tensor_count 8, kv_count 16, key length 24, key 32,
    // value type 33, value 37.
    let mut b = base.clone();
    b[0] = b'X';
    bad("magic", &b, &["header magic", "not a GGUF file"]);
    for (v, want) in [
        (1u32, "version 1"),
        (4, "unsupported GGUF version 4"),
        (0x0300_0000, "big-endian"),
    ] {
        let mut b = base.clone();
        put_u32(&mut b, 4, v);
        bad("version", &b, &["header version", want]);
    }
    bad("empty", &[], &["header magic", "truncated"]);
    bad("short", &base[..13], &["header tensor_count", "truncated"]);
    let mut b = base.clone();
    put_u64(&mut b, 8, u64::MAX / 2);
    bad("tensor-count", &b, &["header tensor_count", "cannot fit"]);
    let mut b = base.clone();
    put_u64(&mut b, 16, 1 << 40);
    bad("kv-count", &b, &["header kv_count", "cannot fit"]);
    let mut b = base.clone();
    put_u64(&mut b, 24, 1 << 62);
    bad(
        "key-len",
        &b,
        &["metadata entry 0 key", "string length 4611686018427387904"],
    );
    let mut b = base.clone();
    b[32] = 0xFF;
    bad("key-utf8", &b, &["metadata entry 0 key", "not valid UTF-8"]);
    let mut b = base.clone();
    put_u32(&mut b, 33, 13);
    bad(
        "value-type",
        &b,
        &["metadata key 'k' type", "unknown value type id 13"],
    );
    let mut b = base.clone();
    b[37] = 2;
    bad("bool", &b, &["metadata key 'k' value", "must be 0 or 1"]);
    bad(
        "cut-value",
        &base[..37],
        &["metadata key 'k' value", "truncated"],
    );

    let arr = one_key("arr", GgufValue::Array(GgufArray::U8(vec![1, 2, 3])));
    // Key "arr" at 32..35, value type at 35, element type at 39, count at 43.
    let mut b = arr.clone();
    put_u64(&mut b, 43, 1 << 62);
    bad(
        "array-count",
        &b,
        &["metadata key 'arr' value (array count)", "array count"],
    );
    let mut b = arr.clone();
    put_u32(&mut b, 39, 77);
    bad(
        "array-type",
        &b,
        &["metadata key 'arr' value (array element type)", "77"],
    );
    let strs = one_key(
        "s",
        GgufValue::Array(GgufArray::String(vec!["ab".into(), "cd".into()])),
    );
    let cd = strs.windows(2).position(|w| w == b"cd").unwrap();
    bad(
        "cut-string",
        &strs[..cd + 1],
        &["metadata key 's' value (array element 1)", "truncated"],
    );

    let mut deep = GgufArray::U8(vec![1]);
    for _ in 0..10 {
        deep = GgufArray::Array(vec![deep]);
    }
    bad(
        "deep",
        &one_key("d", GgufValue::Array(deep)),
        &["metadata key 'd' value", "nested deeper"],
    );

    let mut w = GgufWriter::new();
    w.add("x", GgufValue::U8(1)).add("x", GgufValue::U8(2));
    bad(
        "dup-key",
        &w.to_bytes(),
        &["metadata entry 1 key", "duplicate key 'x'"],
    );
    for (v, what) in [
        (GgufValue::U32(3), "u32 3"),
        (GgufValue::U32(0), "u32 0"),
        (GgufValue::U64(32), "u64 32"),
    ] {
        let b = one_key("general.alignment", v);
        bad(
            "align",
            &b,
            &[
                "metadata key 'general.alignment' value",
                "power of two",
                what,
            ],
        );
    }
}

#[test]
fn malformed_tensor_infos_are_named_errors() {
    let f32s = |n: usize| vec![0u8; 4 * n];
    let mk = |f: &dyn Fn(&mut GgufWriter)| {
        let mut w = GgufWriter::new();
        w.add("general.architecture", GgufValue::String("test".into()));
        w.add_tensor("ok", DType::F32, &[8], f32s(8)).unwrap();
        f(&mut w);
        w.to_bytes()
    };
    bad(
        "5-dims",
        &mk(&|w| {
            w.add_raw_tensor("t5", 0, vec![1, 1, 1, 1, 2], f32s(2));
        }),
        &["tensor info 1 (t5) n_dims", "5 dimensions"],
    );
    bad(
        "0-dims",
        &mk(&|w| {
            w.add_raw_tensor("t0", 0, vec![], f32s(1));
        }),
        &["tensor info 1 (t0) n_dims", "0 dimensions"],
    );
    bad(
        "zero-dim",
        &mk(&|w| {
            w.add_raw_tensor("z", 0, vec![4, 0], vec![]);
        }),
        &["tensor info 1 (z) dimension 1", "dimension is 0"],
    );
    bad(
        "overflow",
        &mk(&|w| {
            w.add_raw_tensor("huge", 0, vec![1 << 40, 1 << 40], vec![]);
        }),
        &["tensor info 1 (huge) dimension 1", "overflows"],
    );
    bad(
        "dup-name",
        &mk(&|w| {
            w.add_tensor("ok", DType::F32, &[8], f32s(8)).unwrap();
        }),
        &["tensor info 1 (ok) name", "duplicate tensor name"],
    );
    bad(
        "misaligned",
        &mk(&|w| {
            w.add_raw_tensor_info("m", 0, vec![4], 36);
        }),
        &[
            "tensor info 1 (m) offset",
            "not a multiple of the alignment 32",
        ],
    );
    bad(
        "far",
        &mk(&|w| {
            w.add_raw_tensor_info("far", 0, vec![4], 1 << 40);
        }),
        &["tensor info 1 (far) offset", "past the end of the file"],
    );
    bad(
        "past-end",
        &mk(&|w| {
            w.add_raw_tensor_info("big", 0, vec![1024], 32);
        }),
        &["tensor info 1 (big) data", "truncated", "4096 bytes"],
    );
    bad(
        "overlap",
        &mk(&|w| {
            w.add_raw_tensor_info("o", 0, vec![8], 0);
        }),
        &["tensor info 1 (o) offset", "overlaps", "tensor info 0 (ok)"],
    );
    bad(
        "block",
        &mk(&|w| {
            w.add_raw_tensor("q", DType::Q4_0.ggml_type(), vec![33], vec![0; 36]);
        }),
        &[
            "tensor info 1 (q) dimension 0",
            "row length 33",
            "q4_0 block size 32",
        ],
    );
    let b = mk(&|_| {});
    let name_at = b
        .windows(10)
        .position(|w| w == b"\x02\0\0\0\0\0\0\0ok")
        .unwrap();
    // Cut inside the dimensions of tensor info 0.
    bad(
        "cut-info",
        &b[..name_at + 16],
        &["tensor info 0 (ok) dimension 0", "truncated"],
    );
    bad(
        "cut-offset",
        &b[..name_at + 30],
        &["tensor info 0 (ok) offset", "truncated"],
    );
}

#[test]
fn unknown_and_unsupported_types_keep_metadata_readable() {
    let mut w = GgufWriter::new();
    w.add("general.architecture", GgufValue::String("test".into()));
    w.add_raw_tensor("q4k", 12, vec![256, 2], vec![7; 288]);
    w.add_raw_tensor("mystery", 99, vec![16], vec![0; 64]);
    w.add_tensor("ok", DType::F32, &[2], vec![0; 8]).unwrap();
    let f = Scratch::write("types.gguf", &w.to_bytes());
    let g = GgufFile::open(&f.0).unwrap();
    assert_eq!(g.architecture().unwrap(), "test");
    let q4k = g.tensor("q4k").unwrap();
    assert_eq!((q4k.dtype, q4k.nbytes), (None, 288));
    expect_err(
        g.tensor_data(q4k),
        &f.0,
        &["tensor info 0 (q4k) type", "q4_k (id 12)", "not supported"],
    );
    assert_eq!(g.raw_tensor_data(q4k).unwrap(), &[7u8; 288][..]);
    let m = g.tensor("mystery").unwrap();
    assert_eq!((m.ggml_type, m.dtype), (99, None));
    expect_err(
        g.tensor_data(m),
        &f.0,
        &["tensor info 1 (mystery) type", "unknown ggml type (id 99)"],
    );
    expect_err(
        g.raw_tensor_data(m),
        &f.0,
        &["tensor info 1 (mystery)", "id 99"],
    );
    assert_eq!(
        g.tensor_data(g.tensor("ok").unwrap()).unwrap(),
        &[0u8; 8][..]
    );
}

// ---- the real SmolLM2 file -------------------------------------------------------------

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

// ---- fuzzing: the parser never panics --------------------------------------------------

/// A small valid file with a tokenizer, so mutations also reach the tokenizer loader.
fn fuzz_base() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add("general.architecture", GgufValue::String("llama".into()));
    w.add("llama.block_count", GgufValue::U32(2));
    w.add("tokenizer.ggml.model", GgufValue::String("gpt2".into()));
    w.add("tokenizer.ggml.pre", GgufValue::String("smollm".into()));
    let table = metashard::tokenizer::pretok::byte_to_char_table();
    let mut toks: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    toks.extend(["ab".to_string(), "<|s|>".to_string()]);
    let mut types = vec![1i32; toks.len()];
    *types.last_mut().unwrap() = 3;
    w.add(
        "tokenizer.ggml.tokens",
        GgufValue::Array(GgufArray::String(toks)),
    );
    w.add(
        "tokenizer.ggml.token_type",
        GgufValue::Array(GgufArray::I32(types)),
    );
    w.add(
        "tokenizer.ggml.merges",
        GgufValue::Array(GgufArray::String(vec!["a b".into()])),
    );
    w.add(
        "a.nested",
        GgufValue::Array(GgufArray::Array(vec![GgufArray::U16(vec![1, 2])])),
    );
    w.add_tensor("w", DType::Q8_0, &[32, 2], vec![3; 68])
        .unwrap();
    w.add_tensor("n", DType::F32, &[4], vec![0; 16]).unwrap();
    w.to_bytes()
}

/// Parses `bytes`; when that succeeds, touches everything a loader would.
fn exercise(bytes: Vec<u8>) {
    use metashard::tokenizer::{BpeTokenizer, ChatTemplate, Tokenizer};
    if let Ok(g) = GgufFile::from_bytes("fuzz.gguf", bytes) {
        for (_, v) in g.metadata() {
            let _ = v.describe();
        }
        for t in g.tensors() {
            let _ = g.tensor_data(t);
            let _ = g.raw_tensor_data(t);
        }
        let _ = g.get_u32("llama.block_count");
        if let Ok(tok) = BpeTokenizer::from_gguf(&g) {
            if let Ok(ids) = tok.encode("ab <|s|> 12 ab", true) {
                let _ = tok.decode(&ids);
            }
        }
        let _ = ChatTemplate::from_gguf(&g);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn fuzz_random_bytes_never_panic(tail in prop::collection::vec(any::<u8>(), 0..600), header in any::<bool>()) {
        let mut b = if header { b"GGUF\x03\0\0\0".to_vec() } else { Vec::new() };
        b.extend(tail);
        exercise(b);
    }

    #[test]
    fn fuzz_truncations_never_panic(frac in 0.0f64..1.0) {
        let base = fuzz_base();
        let cut = (base.len() as f64 * frac) as usize;
        exercise(base[..cut].to_vec());
    }

    #[test]
    fn fuzz_byte_flips_never_panic(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut b = fuzz_base();
        for (i, v) in flips {
            let at = i.index(b.len());
            b[at] = v;
        }
        exercise(b);
    }
}

#[test]
fn fuzz_base_is_valid_and_loads_its_tokenizer() {
    use metashard::tokenizer::{BpeTokenizer, Tokenizer};
    let g = GgufFile::from_bytes("fuzz.gguf", fuzz_base()).unwrap();
    let tok = BpeTokenizer::from_gguf(&g).unwrap();
    let ids = tok.encode("ab<|s|>", false).unwrap();
    assert_eq!(ids, vec![256, 257]);
    let _ = std::io::stderr().flush();
}
