//! Many sequences in one KV cache (`models::batch`) and the request scheduler over it
//! (`models::engine`): sequences decoded together, with mixed prompt lengths, staggered
//! arrivals, chunked prompts and reused slots, give exactly the greedy tokens each gives alone
//! on cpu, cpu:2x1, cpu:3x1 and a layer split (a llama and a Gemma 2 file: sliding window and
//! soft-capping); their logits agree with one sequence's and with the numpy reference; a
//! prompt past a slot's context is refused for that request only; cancelling frees the slot;
//! a stop string ends the text where it starts (SmolLM2).

#[path = "support/decoders.rs"]
mod decoders;

use decoders::config;
use metashard::devices::DeviceSet;
use metashard::models::arch::{Arch, GEMMA2, LLAMA};
use metashard::models::batch::{BatchSession, SeqInput};
use metashard::models::engine::{Engine, Event, FinishReason, GenRequest, RequestId};
use metashard::models::layer_split::SplitMode;
use metashard::models::loader::DecoderModel;
use metashard::models::prompt::{PromptOptions, prompt_tokens};
use metashard::models::sampler::SamplerConfig;
use metashard::models::session::Session;
use metashard::models::synthetic::gguf_bytes;
use metashard::verify::{greedy, nmse};
use metashard::{DType, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const STEPS: usize = 8;

/// A small file of `arch` (the families' configuration: Gemma 2 with its window of 5 and
/// caps small enough to bend the scores).
fn model_file(arch: &'static Arch) -> PathBuf {
    let tied = arch.name.starts_with("gemma");
    let bytes = gguf_bytes(&config(arch), DType::F32, tied, 512, 5).unwrap();
    decoders::write("batched", &format!("{}.gguf", arch.name), &bytes)
}

fn open(model: &str, devices: &str, mode: SplitMode) -> (DeviceSet, DecoderModel) {
    decoders::open(model, devices, mode).unwrap()
}

/// Prompts of 3 to 17 tokens.
fn prompts() -> Vec<Vec<u32>> {
    [3usize, 17, 9, 5, 12]
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| ((i * 37 + j * 11) % 250) as u32).collect())
        .collect()
}

fn request(prompt: &[u32], max_tokens: usize) -> GenRequest {
    GenRequest {
        prompt: prompt.to_vec(),
        max_tokens,
        sampling: SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        stop: Vec::new(),
        ignore_eos: true,
        logprobs: None,
        logit_bias: Vec::new(),
    }
}

/// Each request's tokens, text and finish reason from a run's events.
#[derive(Default, Debug)]
struct Outcome {
    tokens: Vec<u32>,
    text: String,
    reason: Option<FinishReason>,
}

fn collect(events: &[Event], out: &mut HashMap<RequestId, Outcome>) {
    for e in events {
        match e {
            Event::Token {
                id, token, text, ..
            } => {
                let o = out.entry(*id).or_default();
                o.tokens.push(*token);
                o.text.push_str(text);
            }
            Event::Finished {
                id, reason, text, ..
            } => {
                let o = out.entry(*id).or_default();
                assert!(o.reason.is_none(), "request {id} finished twice");
                o.text.push_str(text);
                o.reason = Some(*reason);
            }
        }
    }
}

/// Five requests on three slots of 64 positions (two slots reused), a budget of 8 tokens per
/// step (prompts in chunks), two arriving after two steps, and one prompt of 70 tokens that
/// is refused alone: each gets its own greedy tokens.
fn batched_equals_alone(model: &str, devices: &str, mode: SplitMode, want: &[Vec<u32>]) {
    let (set, m) = open(model, devices, mode);
    let batch =
        BatchSession::new(&m, set.backend.clone(), set.buffer_type.as_ref(), 3, 64).unwrap();
    let mut e = Engine::new(batch, 8);
    let ps = prompts();
    let mut ids = Vec::new();
    let mut out = HashMap::new();
    for p in &ps[..3] {
        ids.push(e.submit(request(p, STEPS)).unwrap());
    }
    let long = vec![1u32; 70];
    let err = e.submit(request(&long, STEPS)).unwrap_err().to_string();
    assert!(
        err.contains("prompt") && err.contains("context of 64"),
        "{err}"
    );
    for _ in 0..2 {
        collect(&e.step().unwrap(), &mut out);
    }
    for p in &ps[3..] {
        ids.push(e.submit(request(p, STEPS)).unwrap());
    }
    collect(&e.run_all().unwrap(), &mut out);
    for (i, id) in ids.iter().enumerate() {
        let o = &out[id];
        assert_eq!(o.tokens, want[i], "{model} {devices} {mode}: request {i}");
        assert_eq!(o.reason, Some(FinishReason::Length));
    }
    assert_eq!(e.batch().free_slots(), 3, "every slot is free again");
    assert!(e.stats.steps > 0 && e.stats.generated_tokens == (STEPS * ps.len()) as u64);
}

fn every_split(arch: &'static Arch) {
    let path = model_file(arch);
    let model = path.to_str().unwrap();
    let (set, m) = open(model, "cpu:1x1", SplitMode::Tensor);
    let want: Vec<Vec<u32>> = prompts()
        .iter()
        .map(|p| greedy(&m, &set, p, STEPS).unwrap().1)
        .collect();
    for (devices, mode) in [
        ("cpu:1x1", SplitMode::Tensor),
        ("cpu:2x1", SplitMode::Tensor),
        ("cpu:3x1", SplitMode::Tensor),
        ("cpu:2x1", SplitMode::Layer),
    ] {
        batched_equals_alone(model, devices, mode, &want);
    }
}

#[test]
fn llama_batched_gives_each_sequences_tokens_on_every_split() {
    every_split(&LLAMA);
}

#[test]
fn gemma2_batched_gives_each_sequences_tokens_on_every_split() {
    every_split(&GEMMA2);
}

/// The numpy reference's logits of the last prompt position (`None` when its packages are
/// missing and METASHARD_SKIP_PYREF=1 allows it).
fn reference_last_logits(path: &Path, prompt: &[u32], nv: usize) -> Option<Vec<f32>> {
    let out = path.with_extension("ref.f32");
    let (_, v) = decoders::reference(path, prompt, &[], "--prompt-logits-out", &out)?;
    Some(v[v.len() - nv..].to_vec())
}

/// Two sequences in one step, then a decode step of both, on cpu and cpu:2x1: each one's
/// logits equal its own run's (NMSE < 1e-6) and the numpy reference's; a step naming a free
/// slot, or tokens past a slot's room, is an error naming it.
#[test]
fn batched_logits_match_one_sequence_and_the_reference() {
    let path = model_file(&GEMMA2);
    let model = path.to_str().unwrap();
    let ps = prompts();
    let (a, b) = (&ps[1], &ps[4]);
    for devices in ["cpu:1x1", "cpu:2x1"] {
        let (set, m) = open(model, devices, SplitMode::Tensor);
        let nv = m.cfg.n_vocab;
        let alone = |p: &[u32], next: u32| -> Result<(Vec<f32>, Vec<f32>)> {
            let mut s = Session::new(&m, set.backend.clone(), set.buffer_type.as_ref(), 64)?;
            Ok((s.eval(p, false)?, s.eval(&[next], false)?))
        };
        let mut bs =
            BatchSession::new(&m, set.backend.clone(), set.buffer_type.as_ref(), 2, 64).unwrap();
        // Slot 0 is taken and freed first, so slot 1 holds a sequence above the free slot.
        let s0 = bs.acquire().unwrap();
        let s1 = bs.acquire().unwrap();
        let seqs = [
            SeqInput {
                slot: s1,
                tokens: a,
                logits: true,
            },
            SeqInput {
                slot: s0,
                tokens: b,
                logits: true,
            },
        ];
        let first = bs.step(&seqs).unwrap();
        let next = [7u32, 9];
        let second = bs
            .step(&[
                SeqInput {
                    slot: s1,
                    tokens: &next[..1],
                    logits: true,
                },
                SeqInput {
                    slot: s0,
                    tokens: &next[1..],
                    logits: true,
                },
            ])
            .unwrap();
        for (k, p) in [a, b].iter().enumerate() {
            let (l0, l1) = alone(p, next[k]).unwrap();
            for (got, want) in [(&first[k], &l0), (&second[k], &l1)] {
                let e = nmse(got.as_ref().unwrap(), want);
                assert!(e < 1e-6, "{devices} sequence {k}: NMSE {e:.3e}");
            }
            if devices == "cpu:1x1"
                && let Some(r) = reference_last_logits(&path, p, nv)
            {
                let e = nmse(first[k].as_ref().unwrap(), &r);
                assert!(e < 1e-5, "sequence {k} against numpy: NMSE {e:.3e}");
            }
        }
        bs.release(s0).unwrap();
        let err = bs
            .step(&[SeqInput {
                slot: s0,
                tokens: &next[..1],
                logits: true,
            }])
            .unwrap_err()
            .to_string();
        assert!(err.contains("slot"), "{err}");
        let room = vec![3u32; 64 - a.len()];
        let err = bs
            .step(&[SeqInput {
                slot: s1,
                tokens: &room,
                logits: true,
            }])
            .unwrap_err()
            .to_string();
        assert!(err.contains("tokens") && err.contains("slot 1"), "{err}");
    }
}

fn smollm2_prompt(m: &DecoderModel, text: &str) -> Vec<u32> {
    let opts = PromptOptions {
        raw: true,
        ..PromptOptions::default()
    };
    prompt_tokens(m, text, &opts).unwrap()
}

/// SmolLM2, four prompts on two slots with cancelling and a stop string: the uncancelled
/// requests give their greedy tokens alone; the cancelled one frees its slot for the queue;
/// the stop string cuts the text where it first appears and ends that request.
#[test]
fn smollm2_cancel_and_stop_strings() {
    let (set, m) = open("smollm2", "cpu", SplitMode::Tensor);
    let texts = [
        "The capital of France is",
        "Once upon a time, in a small village near the mountains,",
        "1, 2, 3, 4,",
        "def fibonacci(n):",
    ];
    let ps: Vec<Vec<u32>> = texts.iter().map(|t| smollm2_prompt(&m, t)).collect();
    let n = 12;
    let want: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| greedy(&m, &set, p, n).unwrap().1)
        .collect();
    let want_text: Vec<String> = want
        .iter()
        .map(|t| String::from_utf8_lossy(&m.tokenizer.decode_bytes(t).unwrap()).to_string())
        .collect();
    // A stop string from the middle of request 2's text.
    let t2 = &want_text[2];
    let cut = t2.char_indices().nth(t2.chars().count() / 2).unwrap().0;
    let stop: String = t2[cut..].chars().take(3).collect();
    let batch =
        BatchSession::new(&m, set.backend.clone(), set.buffer_type.as_ref(), 2, 64).unwrap();
    let mut e = Engine::new(batch, 16);
    let mut out = HashMap::new();
    let mut ids = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        let mut r = request(p, n);
        if i == 1 {
            r.max_tokens = 1000;
        }
        if i == 2 {
            r.stop = vec![stop.clone()];
        }
        ids.push(e.submit(r).unwrap());
    }
    for _ in 0..4 {
        collect(&e.step().unwrap(), &mut out);
    }
    assert_eq!((e.running(), e.queued()), (2, 2));
    assert!(e.cancel(ids[1]).unwrap());
    assert!(!e.cancel(ids[1]).unwrap(), "cancelled twice");
    collect(&e.run_all().unwrap(), &mut out);
    assert_eq!(out[&ids[1]].reason, Some(FinishReason::Cancelled));
    for i in [0, 3] {
        assert_eq!(out[&ids[i]].tokens, want[i], "request {i}");
        assert_eq!(out[&ids[i]].text, want_text[i], "request {i}");
    }
    let o = &out[&ids[2]];
    assert_eq!(
        o.reason,
        Some(FinishReason::Stop),
        "stop {stop:?} in {t2:?}"
    );
    let first = t2.find(&stop).unwrap();
    assert_eq!(o.text, t2[..first], "stop {stop:?}");
    assert_eq!(e.batch().free_slots(), 2);
}

/// A decoding step reuses the last step's graph (`Session::set_graph_reuse`,
/// `BatchSession::set_graph_reuse`, on by default): 40 steps after a prompt, and 36 steps of
/// two sequences together, across a cache-size boundary (a new graph shape), give the same
/// logits bit for bit as building every step's graph anew, for a llama and a Gemma 2 file
/// (its sliding-window mask refilled too) on one device, a meta device and a layer split; on
/// the layer split also with the two sequences in two micro-batches (a graph kept for each).
#[test]
fn reused_step_graphs_give_the_bits_of_new_ones() {
    for arch in [&LLAMA, &GEMMA2] {
        let path = model_file(arch);
        let model = path.to_str().unwrap();
        for (devices, mode) in [
            ("cpu:1x1", SplitMode::Tensor),
            ("cpu:2x1", SplitMode::Tensor),
            ("cpu:2x1", SplitMode::Layer),
        ] {
            let (set, m) = open(model, devices, mode);
            let run = |reuse: bool| -> Vec<Vec<f32>> {
                let mut s =
                    Session::new(&m, set.backend.clone(), set.buffer_type.as_ref(), 64).unwrap();
                s.set_graph_reuse(reuse);
                let mut out = vec![s.eval(&prompts()[0], false).unwrap()];
                for i in 0..40u32 {
                    out.push(s.eval(&[(i * 13 + 5) % 250], false).unwrap());
                }
                out
            };
            let (fresh, reused) = (run(false), run(true));
            // Two sequences decoding together, one of them starting late.
            let run_batch = |reuse: bool, micro: usize| -> Vec<Vec<f32>> {
                let bt = set.buffer_type.as_ref();
                let mut bs = BatchSession::new(&m, set.backend.clone(), bt, 2, 64).unwrap();
                bs.set_graph_reuse(reuse);
                bs.micro_batches = micro;
                let (a, b) = (bs.acquire().unwrap(), bs.acquire().unwrap());
                let ps = prompts();
                let mut out = Vec::new();
                fn seq(slot: usize, tokens: &[u32]) -> SeqInput<'_> {
                    SeqInput {
                        slot,
                        tokens,
                        logits: true,
                    }
                }
                out.extend(bs.step(&[seq(a, &ps[2])]).unwrap().into_iter().flatten());
                out.extend(bs.step(&[seq(b, &ps[3])]).unwrap().into_iter().flatten());
                for i in 0..36u32 {
                    let (x, y) = ([(i * 7 + 1) % 250], [(i * 11 + 3) % 250]);
                    let r = bs.step(&[seq(a, &x), seq(b, &y)]).unwrap();
                    out.extend(r.into_iter().flatten());
                }
                out
            };
            let (fresh_b, reused_b) = (run_batch(false, 1), run_batch(true, 1));
            let (fresh_m, reused_m) = match mode {
                SplitMode::Layer => (run_batch(false, 2), run_batch(true, 2)),
                _ => (Vec::new(), Vec::new()),
            };
            let pairs = fresh
                .iter()
                .zip(&reused)
                .chain(fresh_b.iter().zip(&reused_b))
                .chain(fresh_m.iter().zip(&reused_m));
            assert_eq!(fresh_b.len(), 2 + 2 * 36);
            assert_eq!(reused_m.len(), fresh_m.len());
            for (i, (a, b)) in pairs.enumerate() {
                let same =
                    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "{} on {devices} ({mode:?}): logits {i} differ",
                    arch.name
                );
            }
        }
    }
}
