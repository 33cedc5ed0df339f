//! Decoder fixtures shared by `tests/families.rs`, `tests/batched.rs` and
//! `tests/gemma3_file.rs` (each includes this file alone, with `#[path]`, not the whole op
//! harness): each family's small configuration, synthetic files written so that tests running
//! at once never read one half written, opening a file with exact products, and the
//! independent numpy reference (`scripts/reference/smollm2_ref.py`).

#![allow(dead_code)]

use metashard::Result;
use metashard::cpu::Precision;
use metashard::devices::DeviceSet;
use metashard::models::arch::{Arch, Mlp};
use metashard::models::hparams::{DecoderConfig, Moe, SlidingWindow};
use metashard::models::layer_split::SplitMode;
use metashard::models::loader::DecoderModel;
use metashard::runtime::{OpenOptions, open_decoder};
use std::path::{Path, PathBuf};

/// A family's small configuration: width 128, 3 layers (Gemma: 7, so both kinds of layer
/// come twice), 300 tokens; each family's own parts switched on as its files have them.
pub fn config(arch: &'static Arch) -> DecoderConfig {
    let spec = arch.decoder().unwrap();
    let base = DecoderConfig::llama(3, 128, 256, 8, 2, 300);
    let mut c = DecoderConfig {
        arch,
        rope_mode: spec.rope_mode,
        rope_base: 1_000_000.0,
        rms_eps: 1e-6,
        ..base
    };
    if let Mlp::Moe(m) = spec.mlp {
        // 6 experts of 64 features, 2 per token (Qwen2-MoE: a shared expert of 96).
        c.moe = Some(Moe {
            n_expert: 6,
            n_expert_used: 2,
            n_ff_exp: 64,
            n_ff_shexp: if m.shared_expert { 96 } else { 0 },
            norm_weights: m.norm_weights,
        });
    }
    match arch.name {
        "qwen3" | "qwen3moe" => {
            // A head size the file gives (not 128 / 8).
            c.head_dim = 32;
            c.rope_dims = 32;
            c.attn_scale = 1.0 / 32f32.sqrt();
        }
        "gemma2" | "gemma3" => {
            c.n_layer = 7;
            c.n_head = 4;
            c.n_head_kv = 1;
            c.head_dim = 48;
            c.rope_dims = 48;
            c.attn_scale = 1.0 / 48f32.sqrt();
            c.embd_scale = 128f32.sqrt();
            let w = spec.swa.unwrap();
            c.swa = Some(SlidingWindow {
                window: 5,
                pattern: w.pattern,
                rope_base: w.rope_base.unwrap_or(c.rope_base),
            });
            if arch.name == "gemma2" {
                // Caps small enough that tanh bends the scores and the logits.
                c.attn_softcap = Some(0.75);
                c.final_softcap = Some(2.5);
            }
        }
        "olmoe" => {
            // OLMoE's files have as many KV heads as query heads (llama.cpp loads its
            // `attn_k_norm` as `[n_embd]`), and experts of `feed_forward_length` (its
            // converter writes no `expert_feed_forward_length`).
            c.n_head_kv = c.n_head;
            c.n_ff = 64;
        }
        "phi3" => {
            // Phi-4-mini's partial rotary (12 of 16 dimensions) and a window on every layer.
            c.rope_dims = 12;
            c.swa = Some(SlidingWindow {
                window: 5,
                pattern: 0,
                rope_base: c.rope_base,
            });
        }
        _ => {}
    }
    c
}

/// Write `bytes` as `name` in this process's folder for `suite` under the temporary folder.
/// Tests running at once write the same file: each writes a private copy, then renames it
/// into place (atomic), so no test opens it half written.
pub fn write(suite: &str, name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("metashard-{suite}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    let tmp = dir.join(format!("{name}.{:?}.part", std::thread::current().id()));
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, &p).unwrap();
    p
}

/// A decoder (a file, or a model name such as `smollm2`) on `devices` with exact products.
pub fn open(
    model: impl AsRef<Path>,
    devices: &str,
    mode: SplitMode,
) -> Result<(DeviceSet, DecoderModel)> {
    let opts = OpenOptions {
        precision: Precision::Exact,
        split_mode: mode,
        ..OpenOptions::default()
    };
    open_decoder(model.as_ref().to_str().unwrap(), devices, &opts, &|_, _| {})
}

/// The numpy reference on `model` after `tokens`, with `args`, writing its logits to `out`
/// (`out_flag`: `--prompt-logits-out` every prompt position's, `--logits-out` the last's):
/// what it prints (JSON, `Null` when it prints none) and the f32 logits. `None` when its
/// Python packages are missing and METASHARD_SKIP_PYREF=1 allows it.
pub fn reference(
    model: &Path,
    tokens: &[u32],
    args: &[&str],
    out_flag: &str,
    out: &Path,
) -> Option<(serde_json::Value, Vec<f32>)> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/reference/smollm2_ref.py");
    let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let run = std::process::Command::new("python3")
        .arg(&script)
        .arg("--model")
        .arg(model)
        .arg("--tokens")
        .arg(ids.join(","))
        .args(args)
        .arg(out_flag)
        .arg(out)
        .output()
        .unwrap();
    if !run.status.success() {
        let e = String::from_utf8_lossy(&run.stderr);
        if std::env::var("METASHARD_SKIP_PYREF").as_deref() == Ok("1") {
            eprintln!("NOTE: METASHARD_SKIP_PYREF=1: no numpy reference ({e})");
            return None;
        }
        panic!(
            "the numpy reference failed: {e}\ninstall its packages with \
             `python3 -m pip install -r scripts/requirements.txt`, or set METASHARD_SKIP_PYREF=1"
        );
    }
    let printed = serde_json::from_slice(&run.stdout).unwrap_or(serde_json::Value::Null);
    let logits = std::fs::read(out)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Some((printed, logits))
}
