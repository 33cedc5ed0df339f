//! Malformed GGUF files: every header, metadata and tensor-info fault gives an error naming
//! the file and the field; unknown and unsupported tensor types keep metadata readable.

use super::*;

/// A one-key file: `key` with `value`, no tensors.
fn one_key(key: &str, value: GgufValue) -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add(key, value);
    w.to_bytes()
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
    w.add_raw_tensor("q8k", 15, vec![256], vec![1; 292]);
    let f = Scratch::write("types.gguf", &w.to_bytes());
    let g = GgufFile::open(&f.0).unwrap();
    assert_eq!(g.architecture().unwrap(), "test");
    let q4k = g.tensor("q4k").unwrap();
    // Q4_K is a weight type: sized, typed and readable.
    assert_eq!((q4k.dtype, q4k.nbytes), (Some(DType::Q4_K), 288));
    assert_eq!(
        (q4k.type_name(), q4k.type_label().as_str()),
        (Some("q4_k"), "q4_k (id 12)")
    );
    assert_eq!(g.tensor_data(q4k).unwrap(), &[7u8; 288][..]);
    // A type ggml has and metashard does not compute with (Q8_K, the K-quants' activation
    // type) is named, sized and refused.
    let q8k = g.tensor("q8k").unwrap();
    assert_eq!(
        (q8k.dtype, q8k.nbytes, q8k.type_label()),
        (None, 292, "q8_k (id 15)".into())
    );
    expect_err(
        g.tensor_data(q8k),
        &f.0,
        &["tensor info 3 (q8k) type", "q8_k (id 15)", "not supported"],
    );
    assert_eq!(g.raw_tensor_data(q8k).unwrap(), &[1u8; 292][..]);
    let m = g.tensor("mystery").unwrap();
    assert_eq!((m.ggml_type, m.dtype), (99, None));
    assert_eq!(
        (m.type_name(), m.type_label().as_str()),
        (None, "unknown ggml type (id 99)")
    );
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

/// A copy of `bytes` (a GGUF image) with the u32 metadata value of `key` set to `v`.
fn with_u32_key(bytes: &[u8], key: &str, v: u32) -> Vec<u8> {
    let mut pat = (key.len() as u64).to_le_bytes().to_vec();
    pat.extend_from_slice(key.as_bytes());
    pat.extend_from_slice(&GgufType::U32.id().to_le_bytes());
    let at = bytes
        .windows(pat.len())
        .position(|w| w == pat)
        .unwrap_or_else(|| panic!("no u32 key {key}"))
        + pat.len();
    let mut b = bytes.to_vec();
    put_u32(&mut b, at, v);
    b
}

/// The counts in the real SmolLM2 file that size allocations, mutated (4 bytes each): every
/// bad value is an error naming the file and the key, checked against the tensors present
/// before anything is allocated (`llama.block_count` = 2^31 - 1 used to abort the process
/// with `memory allocation of 4831838208 bytes failed`). The unmutated file still loads.
#[test]
fn count_keys_of_the_real_model_are_checked_against_its_tensors() {
    use metashard::models::hparams::{config_from_gguf, context_length_from_gguf};
    let src = std::fs::read(smollm_path()).unwrap();
    let name = Path::new("mutated-smollm2.gguf");
    let open = |b: Vec<u8>| GgufFile::from_bytes(name, b).unwrap();
    let cfg = config_from_gguf(&open(src.clone())).unwrap();
    assert_eq!(
        (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv),
        (30, 576, 9, 3)
    );
    let big = [i32::MAX as u32, u32::MAX];
    let cases: &[(&str, &[u32])] = &[
        ("llama.block_count", &[0, 1, 29, 31, big[0], big[1]]),
        (
            "llama.embedding_length",
            &[0, 575, 577, 1152, big[0], big[1]],
        ),
        ("llama.feed_forward_length", &[0, 1535, big[0], big[1]]),
        (
            "llama.attention.head_count",
            &[0, 5, 18, 576, big[0], big[1]],
        ),
        (
            "llama.attention.head_count_kv",
            &[0, 1, 2, 9, big[0], big[1]],
        ),
        ("llama.vocab_size", &[0, 49151, 49153, big[0], big[1]]),
        ("llama.rope.dimension_count", &[0, 3, 66, big[0], big[1]]),
        ("llama.context_length", &[0, big[1]]),
    ];
    let t = std::time::Instant::now();
    for &(key, values) in cases {
        for &v in values {
            let g = open(with_u32_key(&src, key, v));
            let r = config_from_gguf(&g).and_then(|_| context_length_from_gguf(&g));
            let e = expect_err(r, name, &["metadata key", &format!("'{key}'")]);
            assert!(e.contains(&v.to_string()), "{key} = {v}: {e}");
        }
    }
    assert!(t.elapsed().as_secs() < 60, "took {:?}", t.elapsed());
}
