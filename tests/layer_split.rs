//! SmolLM2 with its layers split across devices on the scheduler (`--split-mode layer`, as
//! llama.cpp's `-sm layer`) and the hybrid split (groups of devices, each a meta device): the
//! greedy tokens equal one device's on cpu:2x1 and cpu:4x1; each device holds only its layers'
//! weights and caches; the plan of a decode step has one split per device and copies only
//! the residual stream between them; uneven shares move layers.

use metashard::cpu::Precision;
use metashard::devices::DeviceSet;
use metashard::models::arch::Tensor;
use metashard::models::layer_split::SplitMode;
use metashard::models::loader::DecoderModel;
use metashard::models::prompt::{PromptOptions, prompt_tokens};
use metashard::models::session::Session;
use metashard::runtime::{OpenOptions, open_decoder};
use metashard::verify::greedy;
use std::sync::OnceLock;

const STEPS: usize = 24;
const PROMPT: &str = "The quick brown fox jumps over the lazy dog. The dog";

fn load(devices: &str, mode: SplitMode, ratios: Option<Vec<f64>>) -> (DeviceSet, DecoderModel) {
    let opts = OpenOptions {
        precision: Precision::Exact,
        ratios,
        split_mode: mode,
        ..OpenOptions::default()
    };
    open_decoder("smollm2", devices, &opts, &|_, _| {}).unwrap()
}

fn prompt(m: &DecoderModel) -> Vec<u32> {
    let opts = PromptOptions {
        raw: true,
        ..PromptOptions::default()
    };
    prompt_tokens(m, PROMPT, &opts).unwrap()
}

fn single() -> &'static (Vec<f32>, Vec<u32>) {
    static S: OnceLock<(Vec<f32>, Vec<u32>)> = OnceLock::new();
    S.get_or_init(|| {
        let (set, m) = load("cpu:1x1", SplitMode::Tensor, None);
        greedy(&m, &set, &prompt(&m), STEPS).unwrap()
    })
}

#[test]
fn layer_split_gives_one_devices_greedy_tokens_on_2_and_4_devices() {
    let (want_logits, want) = single();
    for devices in ["cpu:2x1", "cpu:4x1"] {
        let (set, m) = load(devices, SplitMode::Layer, None);
        let (logits, toks) = greedy(&m, &set, &prompt(&m), STEPS).unwrap();
        assert_eq!(&toks, want, "{devices}: greedy tokens differ");
        // The same kernels on one thread each: the logits are bit-identical too.
        assert_eq!(&logits, want_logits, "{devices}");
        // Each device holds its own layers: about 1/N of the layer weights each.
        let w = set.bytes_per_device(&[&m.weight_buffer]);
        let n = set.devices.len();
        assert_eq!(
            w.iter().sum::<usize>(),
            m.weight_bytes + m.weights.model.get(Tensor::Output).unwrap().layout.nbytes()
        );
        let layer_bytes: usize = m.weights.layers[0]
            .get(Tensor::FfnUp)
            .unwrap()
            .layout
            .nbytes();
        for (d, b) in w.iter().enumerate() {
            assert!(
                *b > layer_bytes * (m.cfg.n_layer / n - 1),
                "{devices}: device {d} {b}"
            );
        }
    }
}

#[test]
fn hybrid_split_gives_one_devices_greedy_tokens_on_2_and_4_devices() {
    let (_, want) = single();
    for devices in ["cpu:2x1", "cpu:4x1"] {
        let (set, m) = load(devices, SplitMode::Hybrid, None);
        let (_, toks) = greedy(&m, &set, &prompt(&m), STEPS).unwrap();
        assert_eq!(&toks, want, "{devices}: greedy tokens differ");
        let (sched, groups) = set.sched.as_ref().unwrap();
        assert_eq!(sched.n_backends(), 2);
        assert_eq!(groups.len(), 2);
        let names = sched.backend_names().join(",");
        let want_names = if devices == "cpu:4x1" {
            "meta(2),meta(2)"
        } else {
            "cpu0,cpu1"
        };
        assert_eq!(names, want_names);
    }
}

#[test]
fn a_decode_step_copies_only_the_stream_between_devices_and_shares_move_layers() {
    let (set, m) = load("cpu:2x1", SplitMode::Layer, Some(vec![3.0, 1.0]));
    let (sched, _) = set.sched.as_ref().unwrap();
    let mut s = Session::new(&m, set.backend.clone(), set.buffer_type.as_ref(), 64).unwrap();
    s.eval(&prompt(&m), false).unwrap();
    s.eval(&[42], false).unwrap();
    let plan = sched.last_plan().unwrap();
    let d = plan.describe();
    assert_eq!(plan.n_splits(), 2, "{d}");
    // 30 layers at 3:1: layers 0..23 on cpu0 (rounded), 23..30 on cpu1.
    let split1 = &plan.splits.splits[1];
    assert!(d.contains("split 1 on cpu1"), "{d}");
    assert!(
        d.lines()
            .any(|l| l.contains("`l22.out`") && l.contains("-> cpu0")),
        "{d}"
    );
    assert!(
        d.lines()
            .any(|l| l.contains("`l23.out`") && l.contains("-> cpu1")),
        "{d}"
    );
    // The copies are [576, 1] f32 vectors: the stream and its norm.
    assert!(!split1.copies.is_empty() && split1.copies.len() <= 2, "{d}");
    for c in &split1.copies {
        assert_eq!(c.bytes, 576 * 4, "{d}");
    }
    // One plan per shape: the prompt and the decode step.
    let made = sched.plans_made();
    s.eval(&[43], false).unwrap();
    assert_eq!(sched.plans_made(), made);
    // Weights follow the layers: cpu0 holds 23 blocks, cpu1 7 (and the embedding and the
    // output projection one each).
    let sb = m
        .weight_buffer
        .as_any()
        .downcast_ref::<metashard::sched::SchedBuffer>()
        .unwrap();
    let mut blocks = [0usize; 2];
    for p in sb.placed() {
        if p.name.starts_with("blk.") {
            blocks[p.backend] += p.layout.nbytes();
        }
    }
    let r = blocks[0] as f64 / blocks[1] as f64;
    assert!((r - 23.0 / 7.0).abs() < 0.05, "{blocks:?}");
}

#[test]
fn tensor_split_flags_do_not_mix_with_the_layer_split() {
    let opts = OpenOptions {
        mirror_attention: true,
        split_mode: SplitMode::Layer,
        ..OpenOptions::default()
    };
    let e = open_decoder("smollm2", "cpu:2x1", &opts, &|_, _| {})
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("--split-mode") && e.contains("--mirror-attention"),
        "{e}"
    );
    let opts = OpenOptions {
        split_mode: SplitMode::Hybrid,
        groups: Some(3),
        ..OpenOptions::default()
    };
    let e = open_decoder("smollm2", "cpu:2x1", &opts, &|_, _| {})
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("--groups 3"), "{e}");
}

/// A prompt in chunks pipelined through the stages of a layer split (`graph_compute_many` on
/// the scheduler: stage k runs chunk j while stage k + 1 runs chunk j - 1) gives the logits
/// of the same chunks run one after another, bit for bit, and those of one device with the
/// whole prompt in one step within rounding; decoding after it gives one device's tokens.
#[test]
fn a_pipelined_prompt_equals_its_chunks_one_after_another() {
    let (one_set, one) = load("cpu:1x1", SplitMode::Tensor, None);
    let p = prompt(&one);
    assert!(p.len() >= 9, "{}", p.len());
    let nv = one.cfg.n_vocab;
    let mut s = Session::new(
        &one,
        one_set.backend.clone(),
        one_set.buffer_type.as_ref(),
        128,
    )
    .unwrap();
    let want = s.eval(&p, true).unwrap();
    let next = |s: &mut Session, l: &[f32]| {
        let mut tok = metashard::models::sampler::argmax(&l[l.len() - nv..]);
        let mut toks = vec![tok];
        for _ in 0..6 {
            tok = metashard::models::sampler::argmax(&s.eval(&[tok], false).unwrap());
            toks.push(tok);
        }
        toks
    };
    let want_tokens = next(&mut s, &want);
    for devices in ["cpu:2x1", "cpu:3x1"] {
        let (set, m) = load(devices, SplitMode::Layer, None);
        let session = || {
            let mut s =
                Session::new(&m, set.backend.clone(), set.buffer_type.as_ref(), 128).unwrap();
            s.ubatch = 3;
            s
        };
        // Pipelined: every chunk handed to the scheduler at once.
        let mut piped = session();
        let got = piped.eval(&p, true).unwrap();
        // One chunk per call: the stages strictly one after another.
        let mut seq = session();
        let mut one_by_one = Vec::new();
        for c in p.chunks(3) {
            one_by_one.extend(seq.eval(c, true).unwrap());
        }
        assert_eq!(got, one_by_one, "{devices}: pipelined logits differ");
        let nmse = metashard::metrics::nmse(&got, &want);
        assert!(nmse < 1e-6, "{devices}: NMSE {nmse} against one device");
        assert_eq!(next(&mut piped, &got), want_tokens, "{devices}");
    }
}

/// A batched step whose sequences are cut into micro-batches, pipelined through the stages of
/// a layer split, gives the logits of the whole step in one graph within rounding, and the
/// same greedy tokens, step after step (prompts of different lengths, then decoding).
#[test]
fn a_pipelined_batched_step_equals_the_whole_step() {
    use metashard::models::batch::{BatchSession, SeqInput};
    let (set, m) = load("cpu:3x1", SplitMode::Layer, None);
    let p = prompt(&m);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| p[..p.len() - i].to_vec()).collect();
    let run = |micro: usize| -> Vec<Vec<f32>> {
        let mut b =
            BatchSession::new(&m, set.backend.clone(), set.buffer_type.as_ref(), 4, 64).unwrap();
        b.micro_batches = micro;
        for _ in 0..4 {
            b.acquire().unwrap();
        }
        // One sequence per slot, each asking for its logits.
        fn seqs<T: AsRef<[u32]>>(tokens: &[T]) -> Vec<SeqInput<'_>> {
            (0..tokens.len())
                .map(|slot| SeqInput {
                    slot,
                    tokens: tokens[slot].as_ref(),
                    logits: true,
                })
                .collect()
        }
        let mut out: Vec<Vec<f32>> = b
            .step(&seqs(&prompts))
            .unwrap()
            .into_iter()
            .flatten()
            .collect();
        for _ in 0..4 {
            let next: Vec<[u32; 1]> = out[out.len() - 4..]
                .iter()
                .map(|l| [metashard::models::sampler::argmax(l)])
                .collect();
            out.extend(b.step(&seqs(&next)).unwrap().into_iter().flatten());
        }
        out
    };
    let whole = run(1);
    assert_eq!(whole.len(), 20);
    for micro in [2, 4] {
        let got = run(micro);
        for (i, (g, w)) in got.iter().zip(&whole).enumerate() {
            let nmse = metashard::metrics::nmse(g, w);
            assert!(
                nmse < 1e-6,
                "{micro} micro-batches, logits {i}: NMSE {nmse}"
            );
            assert_eq!(
                metashard::models::sampler::argmax(g),
                metashard::models::sampler::argmax(w),
                "{micro} micro-batches, logits {i}"
            );
        }
    }
}
