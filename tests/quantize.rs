//! `metashard quantize` (issue 17 item 5) on a synthetic F32 llama GGUF: the written file is
//! read by gguf-py with the types llama.cpp's mix gives each tensor, its Q8_0 / Q4_0 / Q4_1 /
//! Q5_0 / Q5_1 tensors equal gguf-py's own quantizer byte for byte, it runs, and its logits
//! stay close to the F32 model's; bad requests are errors naming the flag or the tensor. A
//! synthetic Mixtral (8 experts) gets llama.cpp's expert rules (issue 19) and runs on one
//! device and with its experts split over two.

use metashard::DType;
use metashard::cpu::Precision;
use metashard::models::arch::{MIXTRAL, Mlp};
use metashard::models::hparams::{DecoderConfig, Moe};
use metashard::models::layer_split::SplitMode;
use metashard::models::synthetic::gguf_bytes;
use metashard::runtime::{OpenOptions, open_decoder};
use metashard::verify::{greedy, nmse};
use std::path::{Path, PathBuf};
use std::process::Command;

const PROMPT: &[u32] = &[72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100];

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("metashard-quantize-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A 4-layer llama of width 256 (whole K-quant blocks), 8 heads over 2 KV heads, its own
/// output projection.
fn model(name: &str, cfg: &DecoderConfig) -> PathBuf {
    let p = dir().join(name);
    std::fs::write(&p, gguf_bytes(cfg, DType::F32, false, 256, 3).unwrap()).unwrap();
    p
}

fn quantize(input: &Path, out: &Path, ty: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_metashard"))
        .arg("quantize")
        .arg(input)
        .arg(out)
        .args(["--type", ty])
        .output()
        .unwrap()
}

/// gguf-py's view of `out`: each tensor's type name, and for each tensor of a type gguf-py
/// quantizes, whether its bytes equal gguf-py's quantization of the same tensor of `input`.
const PY: &str = r#"
import json, sys
import numpy as np
from gguf import GGUFReader, GGMLQuantizationType as T
from gguf.quants import quantize
src = {t.name: t for t in GGUFReader(sys.argv[1]).tensors}
out = GGUFReader(sys.argv[2])
types, equal = {}, {}
for t in out.tensors:
    types[t.name] = t.tensor_type.name
    if t.tensor_type in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        s = src[t.name]
        x = np.asarray(s.data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(s.shape)))
        ref = quantize(x, t.tensor_type)
        equal[t.name] = bool(np.array_equal(ref.reshape(-1).view(np.uint8), np.asarray(t.data).reshape(-1).view(np.uint8)))
print(json.dumps({"types": types, "equal": equal}))
"#;

/// `None` when gguf-py is missing and METASHARD_SKIP_PYREF=1 allows it.
fn gguf_py(input: &Path, out: &Path) -> Option<serde_json::Value> {
    let o = Command::new("python3")
        .args(["-c", PY])
        .arg(input)
        .arg(out)
        .output()
        .unwrap();
    if !o.status.success() {
        let e = String::from_utf8_lossy(&o.stderr);
        if std::env::var("METASHARD_SKIP_PYREF").as_deref() == Ok("1") {
            eprintln!("NOTE: METASHARD_SKIP_PYREF=1: no gguf-py check ({e})");
            return None;
        }
        panic!("gguf-py failed: {e}");
    }
    Some(serde_json::from_slice(&o.stdout).unwrap())
}

fn logits(path: &Path) -> (Vec<f32>, Vec<u32>) {
    logits_on(path, "cpu:1x1", 1)
}

/// Prompt logits and `steps` greedy tokens on `devices` (the default split).
fn logits_on(path: &Path, devices: &str, steps: usize) -> (Vec<f32>, Vec<u32>) {
    let opts = OpenOptions {
        precision: Precision::Exact,
        split_mode: SplitMode::Tensor,
        ..OpenOptions::default()
    };
    let (set, m) = open_decoder(path.to_str().unwrap(), devices, &opts, &|_, _| {}).unwrap();
    greedy(&m, &set, PROMPT, steps).unwrap()
}

/// The type llama.cpp's Q4_K_M mix gives each tensor of the 4-layer model: attn_v and
/// ffn_down of layers 2 and 3 (`use_more_bits(i, 4)`) and the output in Q6_K, the other
/// matrices Q4_K, the norms kept F32.
fn q4_k_m_type(name: &str) -> &'static str {
    let more = name.starts_with("blk.2.") || name.starts_with("blk.3.");
    if name == "output.weight"
        || (more && (name.contains("attn_v.weight") || name.contains("ffn_down")))
    {
        "Q6_K"
    } else if name.contains("norm") {
        "F32"
    } else {
        "Q4_K"
    }
}

#[test]
fn quantized_files_have_llama_cpp_types_equal_gguf_py_and_run() {
    let cfg = DecoderConfig::llama(4, 256, 512, 8, 2, 300);
    let input = model("f32.gguf", &cfg);
    let (want, _) = logits(&input);
    let mut errors = Vec::new();
    // Bounds about twice the measured NMSE (random weights, 4 layers).
    for (ty, bound) in [
        ("q8_0", 3e-4),
        ("q4_0", 1e-1),
        ("q4_1", 1e-1),
        ("q5_0", 3e-2),
        ("q5_1", 3e-2),
        ("q4_k_m", 1e-1),
        ("q6_k", 6e-3),
    ] {
        let out = dir().join(format!("{ty}.gguf"));
        let o = quantize(&input, &out, ty);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{ty}: {stderr}");
        // Progress: one line per tensor.
        assert!(stderr.contains("blk.3.ffn_down.weight"), "{stderr}");
        let (got, _) = logits(&out);
        let e = nmse(&got, &want);
        eprintln!("{ty}: logits NMSE {e:.2e} against the F32 model");
        assert!(e < bound, "{ty}: NMSE {e:.3e}");
        errors.push(e);
        let Some(v) = gguf_py(&input, &out) else {
            continue;
        };
        let types = v["types"].as_object().unwrap();
        assert_eq!(types.len(), 3 + 9 * cfg.n_layer, "{v}");
        for (name, t) in types {
            let t = t.as_str().unwrap();
            let want = match ty {
                "q4_k_m" => q4_k_m_type(name),
                _ if name.contains("norm") => "F32",
                // llama.cpp gives the output projection Q6_K unless the type is Q8_0.
                _ if name == "output.weight" && ty != "q8_0" => "Q6_K",
                _ => ty,
            };
            assert!(
                t.eq_ignore_ascii_case(want),
                "{ty}: {name} is {t}, want {want}"
            );
        }
        for (name, eq) in v["equal"].as_object().unwrap() {
            assert_eq!(eq, true, "{ty}: {name} differs from gguf-py's quantizer");
        }
        if ty == "q4_0" {
            assert!(v["equal"].as_object().unwrap().len() >= 8, "{v}");
        }
    }
    // More bits, closer logits: Q8_0 < Q6_K < Q5_0 < Q4_0.
    let [q8, q4, _, q5, _, _, q6] = errors[..] else {
        panic!("{errors:?}")
    };
    assert!(q8 < q6 && q6 < q5 && q5 < q4, "{errors:?}");
}

/// llama.cpp's Q4_K_M type of each tensor of a 4-layer Mixtral (8 experts): the router kept
/// F32, attn_v and attn_k Q8_0, attn_output Q5_K (`n_expert == 8`), the experts' down
/// projections by `use_more_bits` like a dense ffn_down, the other matrices Q4_K.
fn mixtral_q4_k_m_type(name: &str) -> &'static str {
    let more = name.starts_with("blk.2.") || name.starts_with("blk.3.");
    if name.contains("norm") || name.contains("ffn_gate_inp") {
        "F32"
    } else if name.contains("attn_v.") || name.contains("attn_k.") {
        "Q8_0"
    } else if name.contains("attn_output") {
        "Q5_K"
    } else if name == "output.weight" || (more && name.contains("ffn_down")) {
        "Q6_K"
    } else {
        "Q4_K"
    }
}

#[test]
fn experts_take_llama_cpp_s_moe_rules_and_run_split() {
    let Mlp::Moe(spec) = MIXTRAL.decoder().unwrap().mlp else {
        panic!("Mixtral has experts")
    };
    // Width and expert width 256: whole K-quant blocks in every row.
    let cfg = DecoderConfig {
        arch: &MIXTRAL,
        moe: Some(Moe {
            n_expert: 8,
            n_expert_used: 2,
            n_ff_exp: 256,
            n_ff_shexp: 0,
            norm_weights: spec.norm_weights,
        }),
        ..DecoderConfig::llama(4, 256, 512, 8, 2, 300)
    };
    let input = model("mixtral-f32.gguf", &cfg);
    let out = dir().join("mixtral-q4_k_m.gguf");
    let o = quantize(&input, &out, "q4_k_m");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(stderr.contains("blk.3.ffn_down_exps.weight"), "{stderr}");
    // Each expert's rows are whole blocks of its own slice, so the quantized experts run
    // where one device has them all and where two devices hold four each.
    let (want, _) = logits(&input);
    let (one, tokens_one) = logits_on(&out, "cpu:1x1", 4);
    let e = nmse(&one, &want);
    eprintln!("mixtral q4_k_m: logits NMSE {e:.2e} against the F32 model");
    assert!(e < 1e-1, "NMSE {e:.3e}");
    let (two, tokens_two) = logits_on(&out, "cpu:2x1", 4);
    assert!(nmse(&two, &one) < 1e-8, "cpu:2x1 against cpu:1x1");
    assert_eq!(tokens_two, tokens_one);
    let Some(v) = gguf_py(&input, &out) else {
        return;
    };
    let types = v["types"].as_object().unwrap();
    assert!(types.contains_key("blk.0.ffn_up_exps.weight"), "{v}");
    for (name, t) in types {
        let want = mixtral_q4_k_m_type(name);
        assert!(
            t.as_str().unwrap().eq_ignore_ascii_case(want),
            "{name} is {t}, want {want}"
        );
    }
    // The Q8_0 attention tensors equal gguf-py's quantizer.
    let equal = v["equal"].as_object().unwrap();
    assert_eq!(equal.len(), 2 * cfg.n_layer, "{v}");
    assert!(equal.values().all(|e| e == true), "{v}");
}

#[test]
fn bad_requests_are_named() {
    let cfg = DecoderConfig::llama(1, 256, 512, 8, 2, 300);
    let input = model("small.gguf", &cfg);
    let out = dir().join("bad.gguf");
    // The error output of a request that must fail.
    let fails = |input: &Path, ty: &str| {
        let o = quantize(input, &out, ty);
        assert!(!o.status.success(), "{ty} succeeded");
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    let e = fails(&input, "q4_x");
    assert!(e.contains("--type") && e.contains("q4_k_m"), "{e}");
    // Quantizing a quantized file.
    let q = dir().join("small-q8.gguf");
    assert!(quantize(&input, &q, "q8_0").status.success());
    let e = fails(&q, "q4_0");
    assert!(
        e.contains("token_embd.weight") && e.contains("already"),
        "{e}"
    );
    // Rows of 48 are no whole Q4_0 block: named. Q4_K_M falls back as llama.cpp does; its
    // Q8_0 output cannot take rows of 48 either (llama.cpp refuses it too).
    let narrow = DecoderConfig::llama(1, 48, 64, 4, 2, 300);
    let input = model("narrow.gguf", &narrow);
    for ty in ["q4_0", "q4_k_m"] {
        let e = fails(&input, ty);
        assert!(e.contains(".weight`") && e.contains("48"), "{e}");
    }
    // Rows of 96: Q4_K falls back to Q5_0, Q6_K to Q8_0; the file runs.
    let mid = DecoderConfig::llama(1, 96, 128, 4, 2, 300);
    let input = model("mid.gguf", &mid);
    let out = dir().join("mid-q4km.gguf");
    let o = quantize(&input, &out, "q4_k_m");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let g = metashard::io::GgufFile::open(&out).unwrap();
    let ty = |n: &str| g.tensor(n).unwrap().dtype.unwrap();
    assert_eq!(ty("blk.0.attn_q.weight"), DType::Q5_0);
    assert_eq!(ty("blk.0.attn_v.weight"), DType::Q8_0);
    assert_eq!(ty("output.weight"), DType::Q8_0);
    let (a, _) = logits(&input);
    let (b, _) = logits(&out);
    assert!(nmse(&a, &b) < 1e-2, "{:.3e}", nmse(&a, &b));
}

/// `metashard plan` with `--json` on `model` (extra flags after), as JSON.
fn plan_json(model: &Path, extra: &[&str]) -> serde_json::Value {
    let o = Command::new(env!("CARGO_BIN_EXE_metashard"))
        .args(["plan", "--model"])
        .arg(model)
        .args(["--cluster", "h100x8-nvswitch", "--strategy", "megatron"])
        .args(["--workload", "pp=64,tg=16,ctx=256", "--json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// `plan --quantize TYPE` prices the file `quantize --type TYPE` writes: the same weight bytes
/// on every device, for a dense llama with and without a tied output and for a Mixtral (the
/// expert rules), and the name says which type was planned.
#[test]
fn plan_quantize_prices_the_file_quantize_writes() {
    let Mlp::Moe(spec) = MIXTRAL.decoder().unwrap().mlp else {
        panic!("Mixtral has experts")
    };
    let mixtral = DecoderConfig {
        arch: &MIXTRAL,
        moe: Some(Moe {
            n_expert: 8,
            n_expert_used: 2,
            n_ff_exp: 512,
            n_ff_shexp: 0,
            norm_weights: spec.norm_weights,
        }),
        ..DecoderConfig::llama(4, 256, 512, 8, 2, 300)
    };
    let dense = DecoderConfig::llama(8, 256, 768, 8, 2, 300);
    let tied = dir().join("plan-tied-f32.gguf");
    std::fs::write(&tied, gguf_bytes(&dense, DType::F32, true, 256, 5).unwrap()).unwrap();
    let cases = [
        (model("plan-dense-f32.gguf", &dense), "q4_k_m"),
        (tied, "q5_k_m"),
        (model("plan-mixtral-f32.gguf", &mixtral), "q4_k_m"),
        (dir().join("plan-tied-f32.gguf"), "q8_0"),
    ];
    for (input, ty) in cases {
        let out = dir().join(format!("plan-{ty}.gguf"));
        let o = quantize(&input, &out, ty);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let (file, planned) = (plan_json(&out, &[]), plan_json(&input, &["--quantize", ty]));
        let weights = |v: &serde_json::Value| -> Vec<u64> {
            v["evaluation"]["memory"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d["weights"].as_u64().unwrap())
                .collect()
        };
        assert_eq!(
            weights(&planned),
            weights(&file),
            "{} as {ty}",
            input.display()
        );
        assert_ne!(weights(&planned), weights(&plan_json(&input, &[])), "{ty}");
        assert_eq!(planned["experts"], file["experts"], "{ty}");
        let name = planned["model"].as_str().unwrap_or_default().to_string();
        assert!(name.ends_with(&format!(" as {ty}")), "{name}");
    }
    // A type quantize does not write is named by the flag's values.
    let o = Command::new(env!("CARGO_BIN_EXE_metashard"))
        .args(["plan", "--model", "smollm2-135m", "--quantize", "q4_x"])
        .args(["--cluster", "h100x8-nvswitch"])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("q4_k_m") && e.contains("q4_x"),
        "{e}"
    );
}
