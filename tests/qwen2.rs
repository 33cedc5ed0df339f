//! Qwen2 (GGUF architecture `qwen2`: llama's layer with Q/K/V biases and NeoX RoPE), added
//! as one architecture file: a synthetic Qwen2 GGUF written by the project's GGUF writer loads
//! with its biases and RoPE pairing, and gives one device's greedy tokens on cpu:2x1 and
//! cpu:3x1 (tensor split: the Q/K/V biases split with their columns, more devices than KV
//! heads) and with a layer split (its logits against the numpy reference: tests/families.rs).
//! Files that do not fit the table are refused naming what is wrong.

use metashard::cpu::Precision;
use metashard::devices::DeviceSet;
use metashard::io::{GgufFile, GgufValue, GgufWriter};
use metashard::meta::MetaBuffer;
use metashard::models::arch::{QWEN2, Tensor};
use metashard::models::hparams::DecoderConfig;
use metashard::models::layer_split::SplitMode;
use metashard::models::loader::DecoderModel;
use metashard::models::synthetic::gguf_bytes;
use metashard::op::RopeMode;
use metashard::runtime::{OpenOptions, open_decoder};
use metashard::split_state::SplitAxis;
use metashard::verify::{greedy, nmse};
use metashard::{DType, Error};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const STEPS: usize = 12;
const PROMPT: &[u32] = &[72, 101, 108, 108, 111, 44, 32, 81, 119, 101, 110];

/// Width 128, 8 query heads over 2 KV heads of 16, FFN 256, 3 layers, 300 tokens.
fn cfg() -> DecoderConfig {
    DecoderConfig {
        arch: &QWEN2,
        rope_mode: RopeMode::NeoX,
        rope_base: 1_000_000.0,
        rms_eps: 1e-6,
        ..DecoderConfig::llama(3, 128, 256, 8, 2, 300)
    }
}

fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("metashard-qwen2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// The synthetic Qwen2 file (F32 weights, its own output projection: a tied random model
/// predicts its input token, and greedy decoding would repeat one token).
fn model_file() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        write(
            "qwen2.gguf",
            &gguf_bytes(&cfg(), DType::F32, false, 512, 7).unwrap(),
        )
    })
}

fn open(devices: &str, mode: SplitMode) -> (DeviceSet, DecoderModel) {
    let opts = OpenOptions {
        precision: Precision::Exact,
        split_mode: mode,
        ..OpenOptions::default()
    };
    open_decoder(model_file().to_str().unwrap(), devices, &opts, &|_, _| {}).unwrap()
}

fn single() -> &'static (Vec<f32>, Vec<u32>) {
    static S: OnceLock<(Vec<f32>, Vec<u32>)> = OnceLock::new();
    S.get_or_init(|| {
        let (set, m) = open("cpu:1x1", SplitMode::Tensor);
        greedy(&m, &set, PROMPT, STEPS).unwrap()
    })
}

#[test]
fn the_file_loads_as_qwen2_with_its_biases_and_neox_rope() {
    let (_, m) = open("cpu:1x1", SplitMode::Tensor);
    assert_eq!(m.cfg.arch.name, "qwen2");
    assert_eq!(m.cfg.rope_mode, RopeMode::NeoX);
    assert_eq!(m.cfg.rope_base, 1_000_000.0);
    for l in &m.weights.layers {
        for t in [Tensor::AttnQBias, Tensor::AttnKBias, Tensor::AttnVBias] {
            assert!(l.opt(t).is_some(), "{t:?}");
        }
        assert!(l.opt(Tensor::AttnOutBias).is_none());
    }
    let out = m.weights.model.get(Tensor::Output).unwrap();
    assert_eq!(out.layout.ne, [128, 300, 1, 1]);
    // The same model tied (as Qwen2.5-0.5B ships): the embedding's bytes placed as the
    // output projection, counted once.
    let tied = write(
        "tied.gguf",
        &gguf_bytes(&cfg(), DType::F32, true, 512, 7).unwrap(),
    );
    let t = DecoderModel::load(&tied, &metashard::cpu::CpuBufferType, &|_, _| {}).unwrap();
    assert_eq!(t.weight_bytes + 128 * 300 * 4, m.weight_bytes);
}

#[test]
fn tensor_and_layer_splits_give_one_devices_tokens() {
    let (want_logits, want) = single();
    for (devices, mode) in [
        ("cpu:2x1", SplitMode::Tensor),
        ("cpu:3x1", SplitMode::Tensor),
        ("cpu:2x1", SplitMode::Layer),
    ] {
        let (set, m) = open(devices, mode);
        let (logits, toks) = greedy(&m, &set, PROMPT, STEPS).unwrap();
        let e = nmse(&logits, want_logits);
        assert_eq!(&toks, want, "{devices} {mode}: greedy tokens");
        assert!(e < 1e-10, "{devices} {mode}: logits NMSE {e:.3e}");
        if mode == SplitMode::Tensor {
            // The biases follow their columns: by KV-head groups, like the weights.
            let state = |t: Tensor| {
                let r = m.weights.layers[0].get(t).unwrap();
                let mb = r
                    .storage
                    .buffer
                    .as_any()
                    .downcast_ref::<MetaBuffer>()
                    .unwrap();
                mb.tensor_at(r.storage.offset).unwrap().state.clone()
            };
            for (w, b) in [
                (Tensor::AttnQ, Tensor::AttnQBias),
                (Tensor::AttnK, Tensor::AttnKBias),
                (Tensor::AttnV, Tensor::AttnVBias),
            ] {
                assert_eq!(state(w).axis, SplitAxis::Axis(1), "{devices} {w:?}");
                assert_eq!(state(b).axis, SplitAxis::Axis(0), "{devices} {b:?}");
                assert_eq!(state(w).extents(), state(b).extents(), "{devices} {b:?}");
            }
            // 2 KV heads over 3 devices: each repeated (virtual KV heads, biases too), so
            // every device holds some.
            if devices == "cpu:3x1" {
                assert!(m.cfg.kv_repeat > 1, "{:?}", m.cfg);
                assert!(!state(Tensor::AttnKBias).extents().contains(&0));
            }
        }
    }
}

/// A Qwen2 file with one tensor changed by `edit` (name, type, shape, data), or removed.
fn edited(edit: impl Fn(&str) -> Option<(String, Vec<usize>)>) -> PathBuf {
    let src = GgufFile::open(model_file()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.add(k.clone(), v.clone());
    }
    for t in src.tensors() {
        let Some((name, ne)) = edit(&t.name) else {
            continue;
        };
        let dims = &t.ne[..t.n_dims];
        let ne = if ne.is_empty() { dims.to_vec() } else { ne };
        let data = src.tensor_data(t).unwrap().to_vec();
        w.add_tensor(name, t.dtype.unwrap(), &ne, data).unwrap();
    }
    write(&format!("edited-{}.gguf", rand_suffix()), &w.to_bytes())
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn load_err(p: &Path) -> String {
    let bt = metashard::cpu::CpuBufferType;
    match DecoderModel::load(p, &bt, &|_, _| {}) {
        Ok(_) => panic!("{} loaded", p.display()),
        Err(e) => {
            assert!(
                matches!(e, Error::Model { .. } | Error::Format { .. }),
                "{e:?}"
            );
            e.to_string()
        }
    }
}

#[test]
fn files_that_do_not_fit_the_table_are_refused_naming_the_tensor() {
    // A required bias missing.
    let p = edited(|n| (n != "blk.1.attn_k.bias").then(|| (n.to_string(), vec![])));
    let e = load_err(&p);
    assert!(
        e.contains("blk.1.attn_k.bias") && e.contains("missing"),
        "{e}"
    );
    // A tensor the architecture does not have (Llama 3's RoPE factors).
    let p = edited(|n| {
        Some(match n {
            "output_norm.weight" => ("rope_freqs.weight".into(), vec![]),
            _ => (n.to_string(), vec![]),
        })
    });
    let e = load_err(&p);
    assert!(
        e.contains("rope_freqs.weight") && e.contains("qwen2"),
        "{e}"
    );
    // A bias of the wrong length.
    let p = edited(|n| {
        Some(match n {
            "blk.0.attn_q.bias" => ("blk.0.attn_q.bias".into(), vec![64, 2]),
            _ => (n.to_string(), vec![]),
        })
    });
    let e = load_err(&p);
    assert!(
        e.contains("blk.0.attn_q.bias") && e.contains("shape"),
        "{e}"
    );
}

#[test]
fn architectures_outside_the_table_and_math_keys_are_refused_by_name() {
    let src = GgufFile::open(model_file()).unwrap();
    let with = |key: &str, value: GgufValue| {
        let mut w = GgufWriter::new();
        for (k, v) in src.metadata() {
            if k == key {
                continue;
            }
            w.add(k.clone(), v.clone());
        }
        w.add(key.to_string(), value);
        for t in src.tensors() {
            let data = src.tensor_data(t).unwrap().to_vec();
            w.add_tensor(t.name.clone(), t.dtype.unwrap(), &t.ne[..t.n_dims], data)
                .unwrap();
        }
        write(&format!("meta-{}.gguf", rand_suffix()), &w.to_bytes())
    };
    let e = load_err(&with(
        "general.architecture",
        GgufValue::String("falcon".into()),
    ));
    assert!(e.contains("`falcon`") && e.contains("qwen2"), "{e}");
    for key in [
        "qwen2.attention.sliding_window",
        "qwen2.rope.scaling.factor",
    ] {
        let e = load_err(&with(key, GgufValue::F32(4.0)));
        assert!(e.contains(key), "{e}");
    }
    let e = load_err(&with(
        "qwen2.rope.scaling.type",
        GgufValue::String("yarn".into()),
    ));
    assert!(
        e.contains("qwen2.rope.scaling.type") && e.contains("yarn"),
        "{e}"
    );
    // A head size the tensors do not have.
    let e = load_err(&with("qwen2.attention.key_length", GgufValue::U32(32)));
    assert!(e.contains("qwen2.attention.key_length"), "{e}");
    let e = load_err(&with("qwen2.attention.value_length", GgufValue::U32(32)));
    assert!(e.contains("qwen2.attention.value_length"), "{e}");
    // The values that leave the math as it is load: no scaling, a key length equal to the
    // head size (128 / 8).
    let bt = metashard::cpu::CpuBufferType;
    for (key, v) in [
        ("qwen2.rope.scaling.type", GgufValue::String("none".into())),
        ("qwen2.rope.scaling.factor", GgufValue::F32(1.0)),
        ("qwen2.attention.key_length", GgufValue::U32(16)),
    ] {
        DecoderModel::load(&with(key, v), &bt, &|_, _| {}).unwrap();
    }
}
