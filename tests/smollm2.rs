//! SmolLM2-135M (GGUF, Q4_1) across devices: greedy tokens identical on N = 1..4 (uneven GQA
//! groups on 2, a device without heads on 4, mirrored attention, `--tensor-split` ratios),
//! against the independent numpy reference (`scripts/reference/smollm2_ref.py`), and
//! last-position logits NMSE against it in the default precision and in exact mode.

use metashard::cpu::Precision;
use metashard::devices::DeviceSet;
use metashard::models::loader::DecoderModel;
use metashard::models::paths::{ModelPath, resolve};
use metashard::models::prompt::{PromptOptions, prompt_tokens};
use metashard::runtime::{OpenOptions, open_decoder};
use metashard::verify::{greedy, max_abs, nmse, reference};
use std::path::PathBuf;
use std::sync::OnceLock;

const STEPS: usize = 32;
const REF_STEPS: usize = 16;

fn gguf() -> PathBuf {
    match resolve("smollm2") {
        Ok(ModelPath::Gguf(p)) => p,
        other => panic!("SmolLM2 is needed: run scripts/fetch_models.sh ({other:?})"),
    }
}

/// (chat?, prompt) pairs the tests use.
const PROMPTS: &[(bool, &str)] = &[
    (true, "What is the capital of France?"),
    (
        false,
        "The quick brown fox jumps over the lazy dog. The dog",
    ),
    (true, "Give me three tips for staying healthy."),
];

/// SmolLM2 on `devices` with the built-in split (or `ratios`), without progress output.
fn load(
    model: &str,
    devices: &str,
    precision: Precision,
    ratios: Option<Vec<f64>>,
    mirror_attention: bool,
) -> metashard::Result<(DeviceSet, DecoderModel)> {
    let opts = OpenOptions {
        precision,
        ratios,
        mirror_attention,
        ..OpenOptions::default()
    };
    open_decoder(model, devices, &opts, &|_, _| {})
}

fn tokens_of(m: &DecoderModel, i: usize) -> Vec<u32> {
    let (chat, p) = PROMPTS[i];
    let opts = PromptOptions {
        raw: !chat,
        ..PromptOptions::default()
    };
    prompt_tokens(m, p, &opts).unwrap()
}

/// The reference's greedy tokens and last-prompt-position logits.
type RefOut = Option<(Vec<u32>, Vec<f32>)>;

/// The numpy reference's tokens and logits per prompt, computed once.
fn references() -> &'static Vec<RefOut> {
    static R: OnceLock<Vec<RefOut>> = OnceLock::new();
    R.get_or_init(|| {
        let (_, m) = load("smollm2", "cpu:1x1", Precision::Exact, None, false).unwrap();
        (0..PROMPTS.len())
            .map(|i| match reference(&gguf(), &tokens_of(&m, i), REF_STEPS) {
                Ok(r) => Some(r),
                Err(e) if std::env::var("METASHARD_SKIP_PYREF").as_deref() == Ok("1") => {
                    eprintln!("NOTE: METASHARD_SKIP_PYREF=1: no numpy reference ({e})");
                    None
                }
                Err(e) => panic!(
                    "the numpy reference failed: {e}\ninstall its packages with \
                     `python3 -m pip install -r scripts/requirements.txt`, or set METASHARD_SKIP_PYREF=1"
                ),
            })
            .collect()
    })
}

/// Greedy tokens and prompt logits on `devices` for every prompt.
fn run_all(
    devices: &str,
    precision: Precision,
    ratios: Option<Vec<f64>>,
    mirror: bool,
) -> Vec<(Vec<f32>, Vec<u32>)> {
    let (set, m) = load("smollm2", devices, precision, ratios, mirror).unwrap();
    (0..PROMPTS.len())
        .map(|i| greedy(&m, &set, &tokens_of(&m, i), STEPS).unwrap())
        .collect()
}

fn single() -> &'static Vec<(Vec<f32>, Vec<u32>)> {
    static S: OnceLock<Vec<(Vec<f32>, Vec<u32>)>> = OnceLock::new();
    S.get_or_init(|| run_all("cpu:1x2", Precision::Exact, None, false))
}

#[test]
fn greedy_tokens_agree_with_the_numpy_reference() {
    let refs = references();
    for (i, (r, (logits, toks))) in refs.iter().zip(single()).enumerate() {
        let Some((rt, rl)) = r else { continue };
        let agree = rt.iter().zip(toks).take_while(|(a, b)| a == b).count();
        let e = nmse(logits, rl);
        eprintln!(
            "prompt {i}: {agree}/{REF_STEPS} greedy tokens agree, logits NMSE {e:.2e}, max abs {:.3}",
            max_abs(logits, rl)
        );
        assert!(
            agree >= REF_STEPS,
            "prompt {i}: ours {toks:?} vs reference {rt:?}"
        );
        assert!(
            e < 1e-3,
            "prompt {i}: last-position logits NMSE {e:.3e} >= 1e-3"
        );
    }
}

#[test]
fn exact_mode_logits_match_the_reference_closely() {
    let refs = references();
    let (set, m) = load("smollm2", "cpu:1x2", Precision::Exact, None, false).unwrap();
    for (i, r) in refs.iter().enumerate() {
        let Some((_, rl)) = r else { continue };
        let (logits, _) = greedy(&m, &set, &tokens_of(&m, i), 1).unwrap();
        let e = nmse(&logits, rl);
        eprintln!("prompt {i}: exact-mode logits NMSE {e:.2e}");
        assert!(e < 1e-5, "prompt {i}: exact-mode NMSE {e:.3e} >= 1e-5");
    }
}

#[test]
fn sharded_runs_give_the_same_greedy_tokens_on_1_to_4_devices() {
    let want = single();
    for devices in ["cpu:1x1", "cpu:2x1", "cpu:3x1", "cpu:4x1"] {
        let got = run_all(devices, Precision::Exact, None, false);
        for (i, ((wl, wt), (gl, gt))) in want.iter().zip(&got).enumerate() {
            let e = nmse(gl, wl);
            eprintln!(
                "{devices} prompt {i}: logits NMSE vs one device {e:.2e}, max abs {:.4}",
                max_abs(gl, wl)
            );
            assert_eq!(gt, wt, "{devices} prompt {i}: greedy tokens differ");
            assert!(e < 1e-5, "{devices} prompt {i}: NMSE {e:.3e}");
        }
    }
}

#[test]
fn ratios_and_mirrored_attention_give_the_same_tokens() {
    let want = single();
    for (devices, ratios, mirror) in [
        ("cpu:2x1", Some(vec![3.0, 1.0]), false),
        ("cpu:4x1", None, true),
        ("cpu:3x1", Some(vec![1.0, 2.0, 1.0]), false),
    ] {
        let got = run_all(devices, Precision::Exact, ratios.clone(), mirror);
        for (i, ((_, wt), (_, gt))) in want.iter().zip(&got).enumerate() {
            assert_eq!(
                gt, wt,
                "{devices} ratios {ratios:?} mirror {mirror} prompt {i}"
            );
        }
    }
}

#[test]
fn the_chat_answer_is_coherent() {
    let (set, m) = load("smollm2", "cpu:2x1", Precision::Exact, None, false).unwrap();
    let (_, toks) = greedy(&m, &set, &tokens_of(&m, 0), 12).unwrap();
    let text = String::from_utf8_lossy(&m.tokenizer.decode_bytes(&toks).unwrap()).to_string();
    assert!(text.contains("Paris"), "{text}");
}

/// Generation is bounded by the context whatever `n` asks (`-n 18446744073709551615` used to
/// panic with `capacity overflow`, `-n 1000000000000` to abort allocating 4 TB) and says why
/// it stopped; greedy steps past the context and a context of 0 are errors naming them.
#[test]
fn generation_stops_at_the_context_and_says_so() {
    use metashard::models::sampler::{Sampler, SamplerConfig, StopReason, generate};
    use metashard::models::session::Session;
    let (set, m) = load("smollm2", "cpu:1x1", Precision::Exact, None, false).unwrap();
    let prompt = tokens_of(&m, 0);
    let session = |ctx| Session::new(&m, set.backend.clone(), set.buffer_type.as_ref(), ctx);
    let mut sampler = Sampler::new(SamplerConfig::default()).unwrap();
    let mut s = session(prompt.len() + 4).unwrap();
    let cap = s.capacity();
    assert!(cap > prompt.len() && cap < prompt.len() + 64, "{cap}");
    for n in [usize::MAX, 1_000_000_000_000] {
        s.reset();
        let t = std::time::Instant::now();
        let (out, stats) = generate(&mut s, &prompt, n, &mut sampler, true, |_| true).unwrap();
        assert_eq!(stats.stop, StopReason::Context);
        // Every position holds a token, and the last sampled one is not evaluated.
        assert_eq!(out.len(), cap - prompt.len() + 1);
        assert_eq!(s.n_past(), cap);
        assert!(t.elapsed().as_secs() < 60, "took {:?}", t.elapsed());
    }
    s.reset();
    let (out, stats) = generate(&mut s, &prompt, 3, &mut sampler, true, |_| true).unwrap();
    assert_eq!((out.len(), stats.stop), (3, StopReason::Count));
    s.reset();
    let (_, stats) = generate(&mut s, &prompt, 3, &mut sampler, true, |_| false).unwrap();
    assert_eq!(stats.stop, StopReason::Callback);
    s.reset();
    let (out, stats) = generate(&mut s, &prompt, 64, &mut sampler, false, |_| true).unwrap();
    assert_eq!(stats.stop, StopReason::Eos, "{out:?}");

    let e = session(0).err().expect("a context of 0").to_string();
    assert!(e.contains("context 0"), "{e}");
    for steps in [usize::MAX, m.context_length] {
        let e = greedy(&m, &set, &prompt, steps)
            .expect_err("steps past the context")
            .to_string();
        assert!(
            e.contains(&format!("steps {steps}"))
                && e.contains(&format!(
                    "at most {} steps",
                    m.context_length - prompt.len()
                )),
            "{e}"
        );
    }
}

#[test]
fn malformed_model_files_are_clear_errors() {
    let src = std::fs::read(gguf()).unwrap();
    let dir = std::env::temp_dir().join(format!("metashard-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("truncated.gguf", src[..src.len() / 2].to_vec(), "truncated"),
        ("header.gguf", src[..100].to_vec(), ""),
        (
            "magic.gguf",
            [b"GGUX".as_slice(), &src[4..4096]].concat(),
            "magic",
        ),
    ];
    for (name, bytes, needle) in cases {
        let p = dir.join(name);
        std::fs::write(&p, &bytes).unwrap();
        let bt = metashard::cpu::CpuBufferType;
        let err = DecoderModel::load(&p, &bt, &|_, _| {})
            .err()
            .unwrap_or_else(|| panic!("{name} must fail"))
            .to_string();
        assert!(
            err.contains(name),
            "{name}: the error must name the file: {err}"
        );
        assert!(err.to_lowercase().contains(needle), "{name}: {err}");
        // And through the command line.
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_metashard"))
            .args(["run", "--model"])
            .arg(&p)
            .args(["-n", "1"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{name}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(name));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
