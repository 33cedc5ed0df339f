//! The real Gemma 3 270M Q4_K_M file (Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors; fetched by
//! `scripts/fetch_models.sh`, docs/models.md) runs on the CPU: its greedy tokens after a
//! prompt equal the independent numpy reference's (`scripts/reference/smollm2_ref.py`, which
//! dequantizes every weight with gguf-py and runs Hugging Face's Gemma 3 math in float32), its
//! logits agree with them, and the tensor split (4 query heads, 1 KV head) and the layer split
//! over two and three CPU devices give one device's tokens.

#[path = "support/decoders.rs"]
mod decoders;

use decoders::open;
use metashard::DType;
use metashard::models::layer_split::SplitMode;
use metashard::verify::{greedy, max_abs, nmse};
use std::path::{Path, PathBuf};

/// "<bos>The capital of France is" in the file's own vocabulary (metashard's tokenizer of
/// the file, `metashard run` prints the same ids).
const PROMPT: &[u32] = &[2, 818, 5279, 529, 7001, 563];
const STEPS: usize = 8;

fn gemma_path() -> PathBuf {
    let p = metashard::models::paths::models_dir().join("gemma3/gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.is_file(),
        "{} not found (set METASHARD_MODELS or run scripts/fetch_models.sh)",
        p.display()
    );
    p
}

/// The reference's greedy tokens and the logits of the last prompt position; `None` when the
/// Python packages are missing and METASHARD_SKIP_PYREF=1 allows it.
fn reference(path: &Path) -> Option<(Vec<u32>, Vec<f32>)> {
    let out =
        std::env::temp_dir().join(format!("metashard-gemma3-file-{}.f32", std::process::id()));
    let steps = STEPS.to_string();
    let (printed, logits) =
        decoders::reference(path, PROMPT, &["--steps", &steps], "--logits-out", &out)?;
    let _ = std::fs::remove_file(&out);
    Some((
        serde_json::from_value(printed["generated"].clone()).unwrap(),
        logits,
    ))
}

/// One device: the file's weight types as read, greedy tokens equal to the reference's, and
/// the last prompt position's logits close to them. What is left between the two is the KV
/// cache (F16 here, float32 there) and float32 sums in another order.
#[test]
fn gemma3_q4_k_m_runs_as_the_reference_and_splits_by_layers() {
    let path = gemma_path();
    // The reference runs while we compute ours.
    let py = std::thread::spawn({
        let path = path.clone();
        move || reference(&path)
    });
    let (set, m) = open(&path, "cpu:1x1", SplitMode::Tensor).unwrap();
    assert_eq!(m.cfg.arch.name, "gemma3");
    let (logits, toks) = greedy(&m, &set, PROMPT, STEPS).unwrap();
    eprintln!("greedy tokens {toks:?}");
    for (devices, mode) in [
        ("cpu:2x1", SplitMode::Tensor),
        ("cpu:3x1", SplitMode::Tensor),
        ("cpu:2x1", SplitMode::Layer),
        ("cpu:3x1", SplitMode::Layer),
    ] {
        let (set, m) = open(&path, devices, mode).unwrap();
        let (l, t) = greedy(&m, &set, PROMPT, STEPS).unwrap();
        assert_eq!(t, toks, "{devices} {mode}: greedy tokens");
        // Partial sums added in another order: f32 rounding only.
        let e = nmse(&l, &logits);
        eprintln!("{devices} {mode}: logits NMSE {e:.2e} against one device");
        assert!(e < 1e-7, "{devices} {mode}: logits NMSE {e:.3e}");
    }
    let Some((want_toks, want)) = py.join().unwrap() else {
        return;
    };
    assert_eq!(logits.len(), want.len());
    let e = nmse(&logits, &want);
    eprintln!(
        "gemma3 Q4_K_M: last prompt logits NMSE {e:.2e}, max abs {:.2e}; reference tokens {want_toks:?}",
        max_abs(&logits, &want)
    );
    assert_eq!(toks, want_toks, "greedy tokens against the numpy reference");
    // Measured 2.0e-8 (max abs 5.6e-3 on logits of magnitude ~20).
    assert!(e < 1e-6, "last prompt logits NMSE {e:.3e}");
}

/// The file (the base model) has no `tokenizer.chat_template`: a prompt is fed raw. With
/// `--chat-template gemma` it takes metashard's Gemma format: BOS, the user's turn, the
/// model's turn opened; `--chat-template chatml` is refused naming the token the vocabulary
/// lacks.
#[test]
fn gemma3_file_prompts_are_raw_or_in_the_gemma_chat_format() {
    use metashard::models::prompt::{PromptOptions, prompt_tokens};
    let (_set, mut m) = open(gemma_path(), "cpu:1x1", SplitMode::Tensor).unwrap();
    assert!(m.chat.is_none());
    let raw = prompt_tokens(&m, "Hi", &PromptOptions::default()).unwrap();
    let mut want = vec![2];
    want.extend(m.tokenizer.encode_with("Hi", false, false).unwrap());
    assert_eq!(raw, want);
    m.choose_chat("gemma").unwrap();
    let ids = prompt_tokens(&m, "Hi", &PromptOptions::default()).unwrap();
    let id = |t: &str| {
        let v = m.tokenizer.encode_with(t, false, true).unwrap();
        assert_eq!(v.len(), 1, "{t}: {v:?}");
        v[0]
    };
    let (start, end) = (id("<start_of_turn>"), id("<end_of_turn>"));
    let mut want = vec![2, start];
    want.extend(m.tokenizer.encode_with("user\nHi", false, false).unwrap());
    want.push(end);
    want.extend(m.tokenizer.encode_with("\n", false, false).unwrap());
    want.push(start);
    want.extend(m.tokenizer.encode_with("model\n", false, false).unwrap());
    assert_eq!(ids, want);
    // The turn's end is where generation stops.
    assert!(m.tokenizer.eog().contains(&end));
    let e = m.choose_chat("chatml").unwrap_err().to_string();
    assert!(
        e.contains("--chat-template") && e.contains("<|im_start|>"),
        "{e}"
    );
}

/// The file's weights are read as their own types, the K-quants among them.
#[test]
fn gemma3_q4_k_m_weights_keep_their_types() {
    let g = metashard::io::GgufFile::open(gemma_path()).unwrap();
    let types: std::collections::BTreeSet<DType> =
        g.tensors().iter().filter_map(|t| t.dtype).collect();
    let want = [
        DType::F32,
        DType::Q8_0,
        DType::Q5_0,
        DType::Q4_K,
        DType::Q6_K,
    ];
    assert_eq!(types, want.into_iter().collect());
    assert_eq!(g.tensors().iter().filter(|t| t.dtype.is_none()).count(), 0);
}
