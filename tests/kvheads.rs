//! Fewer KV heads than devices (issue 18 item 3): virtual KV heads. Where whole KV-head groups
//! would leave a device without attention, the run repeats each KV head's rows of K and V
//! (`models::split::kv_repeat`, `DecoderConfig::with_kv_repeat`), so the query heads spread
//! over every device; one device's greedy tokens and logits (to f32 rounding) result, and
//! `verify --reference` (the numpy reference of the file) agrees. The real Gemma 3 270M file
//! (4 query heads, 1 KV head) on cpu:2x1, cpu:3x1, cpu:4x1; synthetic Qwen2-style files with 14
//! query / 2 KV heads on cpu:3x1 and 4 / 1 on cpu:4x1 (Q8_0 weights: rows copied as blocks);
//! the groups of a hybrid split (Gemma on cpu:4x1 and cpu:5x1) repeat them alike.

use metashard::cpu::Precision;
use metashard::devices::DeviceSet;
use metashard::meta::MetaBuffer;
use metashard::models::arch::{QWEN2, Tensor};
use metashard::models::hparams::DecoderConfig;
use metashard::models::layer_split::SplitMode;
use metashard::models::loader::DecoderModel;
use metashard::models::split::{DecoderSplit, LayerSplit, SplitDims, kv_repeat, kv_repeat_groups};
use metashard::planner::ModelShape;
use metashard::planner::report::HeadSplit;
use metashard::runtime::{OpenOptions, open_decoder};
use metashard::tokenizer::Tokenizer;
use metashard::verify::{greedy, nmse};
use metashard::{DType, Result};
use std::path::{Path, PathBuf};

const STEPS: usize = 6;

fn open(path: &Path, devices: &str) -> Result<(DeviceSet, DecoderModel)> {
    let opts = OpenOptions {
        precision: Precision::Exact,
        ..OpenOptions::default()
    };
    open_decoder(path.to_str().unwrap(), devices, &opts, &|_, _| {})
}

/// Query heads each device holds of layer `l` (from the placed Q weight's split state).
fn placed_heads(m: &DecoderModel, l: usize) -> Vec<usize> {
    let q = m.weights.layers[l].get(Tensor::AttnQ).unwrap();
    let mb = q
        .storage
        .buffer
        .as_any()
        .downcast_ref::<MetaBuffer>()
        .expect("a meta buffer");
    let t = mb.tensor_at(q.storage.offset).unwrap();
    t.state
        .extents()
        .iter()
        .map(|x| x / m.cfg.head_dim)
        .collect()
}

/// On `devices`, the model repeats each KV head `r` times, every device holds query heads of
/// every layer, the plan says the same heads, and the greedy tokens and logits are one
/// device's.
fn spreads_and_equals_one_device(path: &Path, devices: &str, n: usize, r: usize) {
    let (set, m) = open(path, "cpu:1x1").unwrap();
    assert_eq!(m.cfg.kv_repeat, 1);
    // One device holds the file's weights once: a tied output shares the embedding's bytes.
    let held = set.bytes_per_device(&[&m.weight_buffer])[0];
    assert!(
        held < m.weight_bytes + m.weight_bytes / 100,
        "{held} bytes held of {}",
        m.weight_bytes
    );
    let (want_logits, want) = greedy(&m, &set, &prompt(&m), STEPS).unwrap();
    let (set, m) = open(path, devices).unwrap();
    assert_eq!(m.cfg.kv_repeat, r, "{devices}: KV heads repeated");
    assert_eq!(m.cfg.n_head_kv, m.cfg.file_kv_heads() * r);
    for l in 0..m.cfg.n_layer {
        let heads = placed_heads(&m, l);
        assert_eq!(heads.iter().sum::<usize>(), m.cfg.n_head);
        assert!(
            heads.iter().all(|&h| h > 0),
            "{devices} layer {l}: {heads:?}"
        );
    }
    // The plan prices and shows the same placement.
    let shape = ModelShape::from_gguf(path).unwrap();
    let split = DecoderSplit::uniform(
        shape.n_layer(),
        LayerSplit {
            attention: true,
            mlp: true,
        },
        true,
        false,
    );
    let placed = shape.for_split(n, &split);
    assert_eq!(placed.cfg, m.cfg, "{devices}: the planner's configuration");
    let h = HeadSplit::of(&placed, n, &split).unwrap();
    assert_eq!(h.heads, placed_heads(&m, 0));
    assert_eq!(h.kv_repeat, r);
    eprintln!("{devices}: {}", h.line());
    let (logits, toks) = greedy(&m, &set, &prompt(&m), STEPS).unwrap();
    assert_eq!(toks, want, "{devices}: greedy tokens");
    let e = nmse(&logits, &want_logits);
    eprintln!("{devices}: logits NMSE {e:.2e} against one device");
    assert!(e < 1e-7, "{devices}: logits NMSE {e:.3e}");
}

/// The prompt in the file's own vocabulary, with its begin-of-sequence token where it has one.
fn prompt(m: &DecoderModel) -> Vec<u32> {
    m.tokenizer
        .encode("The capital of France is", true)
        .unwrap()
}

/// The real Gemma 3 270M Q4_K_M file: 1 KV head repeated 2x on two devices, 4x on three
/// (2, 1, 1 query heads) and four.
#[test]
fn gemma3_file_spreads_attention_over_two_three_and_four_devices() {
    let path = metashard::models::paths::models_dir().join("gemma3/gemma-3-270m-q4_k_m.gguf");
    assert!(
        path.is_file(),
        "{} not found (set METASHARD_MODELS or run scripts/fetch_models.sh)",
        path.display()
    );
    for (devices, n, r) in [("cpu:2x1", 2, 2), ("cpu:3x1", 3, 4), ("cpu:4x1", 4, 4)] {
        spreads_and_equals_one_device(&path, devices, n, r);
    }
}

/// A synthetic Qwen2-style file (Q/K/V biases: repeated too) with `n_head` query and
/// `n_head_kv` KV heads of 32 features (whole Q8_0 blocks of 32 per head: a head is the unit
/// the attention output projection's rows are cut in), Q8_0 matrices.
fn gqa_file(n_head: usize, n_head_kv: usize) -> PathBuf {
    let base = DecoderConfig::llama(2, 32 * n_head, 256, n_head, n_head_kv, 300);
    let cfg = DecoderConfig {
        arch: &QWEN2,
        rope_mode: QWEN2.decoder().unwrap().rope_mode,
        ..base
    };
    let bytes = metashard::models::synthetic::gguf_bytes(&cfg, DType::Q8_0, false, 256, 7).unwrap();
    let dir = std::env::temp_dir().join(format!("metashard-kvheads-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("qwen2-{n_head}-{n_head_kv}.gguf"));
    std::fs::write(&p, bytes).unwrap();
    p
}

/// `metashard verify --reference` on `devices`: the sharded run's greedy tokens are one
/// device's, and the numpy reference (gguf-py's dequantized weights, Hugging Face's math)
/// gives the same tokens and logits.
fn verify_reference(path: &Path, devices: &str) {
    let steps = 4;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_metashard"))
        .args(["verify", "--model", path.to_str().unwrap()])
        .args(["--devices", devices, "--reference", "--raw", "--json"])
        .args(["--prompt", "Hello, heads!", "--steps", &steps.to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if std::env::var("METASHARD_SKIP_PYREF").as_deref() == Ok("1") {
            eprintln!("NOTE: METASHARD_SKIP_PYREF=1: verify --reference failed: {stderr}");
            return;
        }
        panic!("{devices}: verify --reference failed: {stderr}");
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["greedy_tokens_equal"], steps, "{devices}: {v}");
    assert_eq!(v["reference_greedy_tokens_equal"], steps, "{devices}: {v}");
    let e = v["reference_logits_nmse"].as_f64().unwrap();
    eprintln!("{devices}: verify --reference NMSE {e:.2e}");
    assert!(e < 1e-5, "{devices}: NMSE {e:.3e} against the reference");
}

#[test]
fn gqa_14_by_2_on_three_devices() {
    let path = gqa_file(14, 2);
    spreads_and_equals_one_device(&path, "cpu:3x1", 3, 7);
    verify_reference(&path, "cpu:3x1");
}

#[test]
fn gqa_4_by_1_on_four_devices() {
    let path = gqa_file(4, 1);
    spreads_and_equals_one_device(&path, "cpu:4x1", 4, 4);
    verify_reference(&path, "cpu:4x1");
}

/// The repetition chosen: none where whole groups already reach every device (Llama 3 8B's 8
/// KV heads on 3, Qwen2.5's 2 on 2), the smallest that does otherwise, none where attention
/// is mirrored, and only devices with a share need heads.
#[test]
fn the_repetition_is_the_smallest_that_spreads() {
    let dims = |n_head, n_kv, hd| {
        let mut c = DecoderConfig::llama(4, n_head * hd, 256, n_head, n_kv, 300);
        c.head_dim = hd;
        SplitDims::from(&c)
    };
    let split = |attention: bool| {
        DecoderSplit::uniform(
            4,
            LayerSplit {
                attention,
                mlp: true,
            },
            true,
            false,
        )
    };
    let gemma = dims(4, 1, 256);
    let qwen = dims(14, 2, 64);
    let r = |d: &SplitDims, n| kv_repeat(d, n, &split(true));
    assert_eq!(
        (r(&gemma, 1), r(&gemma, 2), r(&gemma, 3), r(&gemma, 4)),
        (1, 2, 4, 4)
    );
    // More devices than query heads: one head per group, the most there is.
    assert_eq!(r(&gemma, 8), 4);
    assert_eq!((r(&qwen, 2), r(&qwen, 3), r(&qwen, 4)), (1, 7, 7));
    assert_eq!(r(&dims(32, 8, 128), 3), 1);
    assert_eq!(kv_repeat(&gemma, 4, &split(false)), 1);
    let mut shares = split(true);
    shares.ratios = Some(vec![1.0, 1.0, 0.0]);
    assert_eq!(kv_repeat(&gemma, 3, &shares), 2);
    // Groups of a hybrid split (3 + 2 devices, each its own layers): one repetition for the
    // model, the smallest that spreads every group; groups of one device need none.
    let own = |layers: std::ops::Range<usize>| {
        let mut p = split(true);
        for (l, ls) in p.layers.iter_mut().enumerate() {
            ls.attention = layers.contains(&l);
        }
        p
    };
    assert_eq!(
        kv_repeat_groups(&gemma, &[(3, own(0..2)), (2, own(2..4))]),
        4
    );
    assert_eq!(
        kv_repeat_groups(&gemma, &[(2, own(0..2)), (2, own(2..4))]),
        2
    );
    assert_eq!(
        kv_repeat_groups(&gemma, &[(1, own(0..2)), (1, own(2..4))]),
        1
    );
    assert_eq!(
        kv_repeat_groups(&qwen, &[(2, own(0..2)), (3, own(2..4))]),
        7
    );
}

/// A hybrid split (`--split-mode hybrid`: groups of devices, each a meta device, whole layers
/// per group) of the real Gemma 3 270M file repeats its one KV head as the tensor split does:
/// 2 groups of 2 devices, 2 copies; 3 + 2 devices, 4 copies; one device's greedy tokens and
/// logits (to f32 rounding).
#[test]
fn gemma3_file_hybrid_groups_repeat_kv_heads() {
    let path = metashard::models::paths::models_dir().join("gemma3/gemma-3-270m-q4_k_m.gguf");
    assert!(path.is_file(), "{} not found", path.display());
    let (set, m) = open(&path, "cpu:1x1").unwrap();
    let (want_logits, want) = greedy(&m, &set, &prompt(&m), STEPS).unwrap();
    for (devices, r) in [("cpu:4x1", 2), ("cpu:5x1", 4)] {
        let opts = OpenOptions {
            precision: Precision::Exact,
            split_mode: SplitMode::Hybrid,
            ..OpenOptions::default()
        };
        let (set, m) = open_decoder(path.to_str().unwrap(), devices, &opts, &|_, _| {}).unwrap();
        assert_eq!(m.cfg.kv_repeat, r, "{devices} hybrid: KV heads repeated");
        let (logits, toks) = greedy(&m, &set, &prompt(&m), STEPS).unwrap();
        assert_eq!(toks, want, "{devices} hybrid: greedy tokens");
        let e = nmse(&logits, &want_logits);
        eprintln!("{devices} hybrid: logits NMSE {e:.2e} against one device");
        assert!(e < 1e-7, "{devices} hybrid: logits NMSE {e:.3e}");
    }
}
