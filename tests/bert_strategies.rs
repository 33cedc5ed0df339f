//! The named strategies on the BERT encoder (all-MiniLM-L6-v2): for every strategy that
//! applies to an encoder (all but `auto` and `sequence-parallel`), on cpu:2x1 and cpu:3x1,
//! the embeddings equal the single device's, each device holds exactly the weight bytes the
//! strategy implies, and the meta backend communicates what it implies (all-reduces per split
//! part); the per-layer callback `by_layer` (which tensors each flag splits, ratios,
//! `output` ignored, `bert_split` as its every-layer case); `metashard embed --strategy`.

use metashard::meta::{ConversionKind, MetaDevice, TensorInfo};
use metashard::models::bert::{BertConfig, bert_split, build_graph, cosine, weight_layouts};
use metashard::models::paths::models_dir;
use metashard::models::split::{DecoderSplit, LayerSplit, by_layer};
use metashard::planner::Strategy;
use metashard::runtime::open_encoder;
use metashard::split_state::SplitState;
use metashard::tensor::Layout;
use metashard::{DType, Error, parse_devices};
use std::path::PathBuf;
use std::process::Command;

fn minilm_dir() -> PathBuf {
    models_dir().join("minilm")
}

/// Every named strategy but `auto` and `sequence-parallel` (decoders only), with its
/// assignment for `n_layer` layers.
fn encoder_strategies(n_layer: usize) -> Vec<(Strategy, DecoderSplit)> {
    let v: Vec<_> = Strategy::ALL
        .into_iter()
        .filter(|&s| s != Strategy::SequenceParallel)
        .filter_map(|s| s.split(n_layer, false).map(|sp| (s, sp)))
        .collect();
    assert_eq!(
        v.len(),
        Strategy::ALL.len() - 2,
        "all but auto and sequence-parallel"
    );
    v
}

/// Padded batch of varied lengths (the empty sentence is [CLS] [SEP] only).
const TEXTS: [&str; 4] = [
    "A man is eating food.",
    "Hi",
    "",
    "Café naïve résumé: 東京 is the capital of Japan, and tensor parallelism splits it.",
];

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

fn tensor_bytes(l: &Layout) -> usize {
    l.nelements() * 4
}

/// Bytes of the tensors `split` cuts (from the names alone: what each flag claims to split).
fn split_bytes(cfg: &BertConfig, split: &DecoderSplit) -> usize {
    weight_layouts(cfg)
        .iter()
        .filter(|(name, _)| {
            if name == "embeddings.word_embeddings.weight" {
                return split.embedding;
            }
            let Some(rest) = name.strip_prefix("encoder.layer.") else {
                return false;
            };
            let (layer, kind) = rest.split_once('.').unwrap();
            let l = split.layers[layer.parse::<usize>().unwrap()];
            let attn =
                kind.starts_with("attention.self.") || kind == "attention.output.dense.weight";
            let mlp = kind.starts_with("intermediate.dense.") || kind == "output.dense.weight";
            (attn && l.attention) || (mlp && l.mlp)
        })
        .map(|(_, l)| tensor_bytes(l))
        .sum()
}

#[test]
fn every_encoder_strategy_equals_one_device_and_holds_the_bytes_it_implies() {
    let cfg = BertConfig::from_model_dir(minilm_dir()).unwrap();
    let total: usize = weight_layouts(&cfg)
        .iter()
        .map(|(_, l)| tensor_bytes(l))
        .sum();
    let single = open_encoder(minilm_dir(), parse_devices("cpu:1x1").unwrap(), None).unwrap();
    let want = single.embed(&TEXTS).unwrap();
    assert!(want.encoding.lengths.iter().min() < want.encoding.lengths.iter().max());
    let one = single.weight_bytes_per_device();
    assert_eq!(one.len(), 1);
    assert!(one[0] >= total, "one device holds {} of {total}", one[0]);
    drop(single);

    for (devices, n) in [("cpu:2x1", 2usize), ("cpu:3x1", 3)] {
        let mut held = Vec::new();
        for (s, split) in encoder_strategies(cfg.n_layer) {
            let name = s.name();
            let enc = open_encoder(
                minilm_dir(),
                parse_devices(devices).unwrap(),
                Some(split.clone()),
            )
            .unwrap();
            let got = enc.embed(&TEXTS).unwrap();
            assert_eq!(got.encoding.ids, want.encoding.ids);
            let d = max_abs_diff(&got.vectors, &want.vectors);
            let worst = got
                .vectors
                .iter()
                .zip(&want.vectors)
                .map(|(a, b)| cosine(a, b))
                .fold(f64::INFINITY, f64::min);
            // Bytes: mirrored tensors whole on every device, split ones in equal shares (12
            // heads, 48 units of 32 and 30522 vocabulary rows all divide evenly by 2 and 3).
            let bytes = enc.weight_bytes_per_device();
            let cut = split_bytes(&cfg, &split);
            assert_eq!(cut % n, 0);
            let expect = total - cut + cut / n;
            eprintln!(
                "{name} on {devices}: max |diff| {d:.3e}, worst 1 - cos {:.3e}, weight bytes per \
                 device {bytes:?} (expected {expect} each; one device {total})",
                1.0 - worst
            );
            assert!(d < 1e-5, "{name} on {devices}: max |diff| {d}");
            assert!(
                worst > 0.9999 && 1.0 - worst < 1e-8,
                "{name} on {devices}: cosine {worst}"
            );
            assert_eq!(
                bytes,
                vec![expect; n],
                "{name} on {devices}: weight bytes per device"
            );

            // What the meta backend communicates: one all-reduce per split part of a layer
            // (row-parallel partial sums), one more for a vocabulary-split lookup, no gathers.
            let meta = enc
                .device()
                .as_any()
                .downcast_ref::<MetaDevice>()
                .expect("a meta device");
            let bg = build_graph(&cfg, enc.weights(), &got.encoding).unwrap();
            let plan = meta.meta_backend().unwrap().sharding(&bg.graph).unwrap();
            let parts: usize = split
                .layers
                .iter()
                .map(|l| usize::from(l.attention) + usize::from(l.mlp))
                .sum::<usize>()
                + usize::from(split.embedding);
            let kinds: Vec<_> = plan.conversions.iter().map(|c| c.kind).collect();
            assert_eq!(
                plan.count(ConversionKind::AllReduce),
                parts,
                "{name} on {devices}: {kinds:?}"
            );
            for k in [
                ConversionKind::AllGather,
                ConversionKind::AllToAll,
                ConversionKind::ReduceScatter,
            ] {
                assert_eq!(plan.count(k), 0, "{name} on {devices}: {kinds:?}");
            }
            held.push((s, bytes[0]));
        }
        let of = |s: Strategy| held.iter().find(|(x, _)| *x == s).unwrap().1;
        assert_eq!(of(Strategy::Mirrored), total, "mirrored holds everything");
        assert!(of(Strategy::Megatron) < of(Strategy::Mirrored));
        assert!(of(Strategy::Memory) < of(Strategy::Megatron));
        for (s, b) in &held {
            assert!(
                of(Strategy::Memory) <= *b,
                "memory is least, {s:?} holds {b}"
            );
            assert!(*b <= total, "{s:?} holds {b} > {total}");
        }
    }
}

fn state(f: &metashard::meta::SplitFn, name: &str, ne: [usize; 4], n: usize) -> SplitState {
    let l = Layout::contiguous(DType::F32, ne);
    f(&TensorInfo {
        name,
        layout: &l,
        n_devices: n,
    })
    .unwrap()
}

#[test]
fn bert_by_layer_splits_what_each_flag_names() {
    let cfg = BertConfig::from_model_dir(minilm_dir()).unwrap();
    let (e, ff, v) = (cfg.n_embd, cfg.n_ff, cfg.n_vocab);
    let names = weight_layouts(&cfg);
    // bert_split is the megatron assignment; `output` (meaningless to an encoder) changes
    // nothing.
    let mut megatron = Strategy::Megatron.split(cfg.n_layer, false).unwrap();
    assert!(megatron.output && !megatron.embedding);
    let builtin = bert_split(&cfg);
    let per_layer = by_layer(&cfg, megatron.clone());
    megatron.output = false;
    let no_output = by_layer(&cfg, megatron);
    for n in [1, 2, 3, 5, 13] {
        for (name, l) in &names {
            let want = state(&builtin, name, l.ne, n);
            assert_eq!(state(&per_layer, name, l.ne, n), want, "{name} N={n}");
            assert_eq!(state(&no_output, name, l.ne, n), want, "{name} N={n}");
        }
    }

    // Per layer: layer 0 attention only, layer 1 MLP only, the rest mirrored; the word
    // embedding by vocabulary.
    let mut split = DecoderSplit::uniform(
        cfg.n_layer,
        LayerSplit {
            attention: false,
            mlp: false,
        },
        false,
        true,
    );
    split.layers[0].attention = true;
    split.layers[1].mlp = true;
    let f = by_layer(&cfg, split.clone());
    let q0 = state(
        &f,
        "encoder.layer.0.attention.self.query.weight",
        [e, e, 1, 1],
        2,
    );
    assert_eq!(q0, SplitState::axis(1, &[192, 192]));
    let b0 = state(
        &f,
        "encoder.layer.0.attention.self.value.bias",
        [e, 1, 1, 1],
        2,
    );
    assert_eq!(b0, SplitState::axis(0, &[192, 192]));
    let o0 = state(
        &f,
        "encoder.layer.0.attention.output.dense.weight",
        [e, e, 1, 1],
        2,
    );
    assert_eq!(o0, SplitState::axis(0, &[192, 192]));
    assert!(
        state(
            &f,
            "encoder.layer.0.intermediate.dense.weight",
            [e, ff, 1, 1],
            2
        )
        .is_mirrored()
    );
    assert!(
        state(
            &f,
            "encoder.layer.1.attention.self.key.weight",
            [e, e, 1, 1],
            2
        )
        .is_mirrored()
    );
    let i1 = state(
        &f,
        "encoder.layer.1.intermediate.dense.weight",
        [e, ff, 1, 1],
        3,
    );
    assert_eq!(i1, SplitState::axis(1, &[512, 512, 512]));
    let d1 = state(
        &f,
        "bert.encoder.layer.1.output.dense.weight",
        [ff, e, 1, 1],
        3,
    );
    assert_eq!(d1, SplitState::axis(0, &[512, 512, 512]));
    assert!(state(&f, "encoder.layer.2.output.dense.weight", [ff, e, 1, 1], 3).is_mirrored());
    let w = state(&f, "embeddings.word_embeddings.weight", [e, v, 1, 1], 3);
    assert_eq!(w, SplitState::axis(1, &[10174, 10174, 10174]));
    for name in [
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "encoder.layer.0.attention.output.dense.bias",
        "encoder.layer.1.output.dense.bias",
    ] {
        assert!(state(&f, name, [e, 512, 1, 1], 3).is_mirrored(), "{name}");
    }

    // Ratios share heads, 32s and vocabulary rows.
    split.ratios = Some(vec![3.0, 1.0]);
    let f = by_layer(&cfg, split.clone());
    let q0 = state(
        &f,
        "encoder.layer.0.attention.self.query.weight",
        [e, e, 1, 1],
        2,
    );
    assert_eq!(q0, SplitState::axis(1, &[288, 96]));
    let i1 = state(
        &f,
        "encoder.layer.1.intermediate.dense.bias",
        [ff, 1, 1, 1],
        2,
    );
    assert_eq!(i1, SplitState::axis(0, &[1152, 384]));
    let w = state(&f, "embeddings.word_embeddings.weight", [e, v, 1, 1], 2);
    assert_eq!(w.extents().iter().sum::<usize>(), v);
    assert!(w.extents()[0].abs_diff(3 * w.extents()[1]) <= 3, "{w:?}");

    // Errors name the tensor: ratios for another device count, a table of another size.
    let l = Layout::contiguous(DType::F32, [e, ff, 1, 1]);
    let err = f(&TensorInfo {
        name: "encoder.layer.1.intermediate.dense.weight",
        layout: &l,
        n_devices: 3,
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::InvalidSplit { .. }), "{err:?}");
    assert!(
        msg.contains("intermediate.dense.weight") && msg.contains("one per device (3)"),
        "{msg}"
    );
    let l = Layout::contiguous(DType::F32, [e, 1000, 1, 1]);
    let msg = f(&TensorInfo {
        name: "embeddings.word_embeddings.weight",
        layout: &l,
        n_devices: 2,
    })
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains("word_embeddings") && msg.contains(&v.to_string()),
        "{msg}"
    );
}

fn embed_json(args: &[&str]) -> Vec<Vec<f32>> {
    let out = Command::new(env!("CARGO_BIN_EXE_metashard"))
        .arg("embed")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "embed {args:?} failed: {err}");
    let v: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("JSON array");
    v.iter()
        .map(|r| serde_json::from_value(r["embedding"].clone()).unwrap())
        .collect()
}

#[test]
fn embed_command_takes_a_strategy() {
    let text = "a sentence about tensor parallelism";
    let plain = embed_json(&["--devices", "cpu:2x1", "--json", text]);
    let mlp = embed_json(&[
        "--devices",
        "cpu:2x1",
        "--strategy",
        "mlp-only",
        "--json",
        text,
    ]);
    let memory = embed_json(&[
        "--devices",
        "cpu:3x1",
        "--strategy",
        "memory",
        "--json",
        text,
    ]);
    assert_eq!(plain.len(), 1);
    assert_eq!(plain[0].len(), 384);
    for (what, got) in [
        ("mlp-only on cpu:2x1", &mlp),
        ("memory on cpu:3x1", &memory),
    ] {
        let d = max_abs_diff(got, &plain);
        assert!(d < 1e-5, "{what}: max |diff| {d}");
        assert!(cosine(&got[0], &plain[0]) > 0.9999, "{what}");
    }

    // Unknown names, `auto` and `sequence-parallel` are errors naming the flag, not panics.
    for (name, says) in [
        ("bogus", "one of megatron"),
        ("auto", "decoders"),
        ("sequence-parallel", "decoders"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_metashard"))
            .args(["embed", "--devices", "cpu:2x1", "--strategy", name, text])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert!(
            err.contains("--strategy") && err.contains(name) && err.contains(says),
            "{name}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        assert!(out.stdout.is_empty());
    }
}
