//! The experts of a mixture of experts split over devices, every way (`ExpertSplit`): column
//! then row inside every expert, whole experts per device (expert parallelism), and both
//! (whole experts per group of devices, column then row inside a group; its own tests at the
//! end: cpu:4x1 and cpu:3x1 in two groups, bad `--expert-groups`). Every MoE
//! family of the architecture table (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral,
//! OLMoE) on a
//! synthetic file of 8 experts gives one device's greedy tokens and logits on cpu:2x1, cpu:3x1
//! (8 experts: 3 + 3 + 2) and cpu:4x1 under each; the sharding of an expert-parallel step
//! moves no expert weight and no expert product between devices (the rows each device's
//! experts computed stay Routed until the one all-reduce per MoE block).

#[path = "support/decoders.rs"]
mod decoders;

use decoders::config;
use metashard::DType;
use metashard::cpu::Precision;
use metashard::meta::{ConversionKind, MetaDevice, Sharding};
use metashard::models::arch::{Arch, MIXTRAL, OLMOE, QWEN2MOE, QWEN3MOE};
use metashard::models::decoder::{SequenceStep, build_step};
use metashard::models::hparams::DecoderConfig;
use metashard::models::split::{ExpertSplit, SplitOptions, megatron};
use metashard::models::synthetic::{alloc_kv_cache, gguf_bytes_with, random_decoder};
use metashard::runtime::{OpenOptions, open_decoder};
use metashard::split_state::SplitState;
use metashard::verify::{greedy, nmse};
use metashard::{Device, parse_devices};
use std::path::{Path, PathBuf};

const PROMPT: &[u32] = &[72, 101, 108, 108, 111, 44, 32, 81, 119, 101, 110, 51, 33];
const STEPS: usize = 6;
const FAMILIES: [&Arch; 4] = [&QWEN3MOE, &QWEN2MOE, &MIXTRAL, &OLMOE];

/// The family's test configuration with 8 experts (2 per token).
fn moe_config(arch: &'static Arch) -> DecoderConfig {
    let mut c = config(arch);
    let moe = c.moe.as_mut().expect("a family with experts");
    moe.n_expert = 8;
    c
}

fn model_file(arch: &'static Arch) -> PathBuf {
    let bytes = gguf_bytes_with(&moe_config(arch), DType::F32, false, 512, 17, &[]).unwrap();
    decoders::write("experts", &format!("{}-8x.gguf", arch.name), &bytes)
}

/// Prompt logits and greedy tokens on `devices`, and the most weight bytes a device holds.
/// Weight `wt`'s product (the node whose first source it is) has the state `want(ids)` (ids:
/// the product's expert ids), and neither the weight nor the product is converted.
fn assert_product_stays(
    g: &metashard::Graph,
    plan: &Sharding,
    wt: metashard::graph::TensorId,
    want: impl Fn(usize) -> SplitState,
    what: &str,
) {
    let text = plan.describe(g);
    let product = g
        .ids()
        .find(|&id| g.node(id).src.first() == Some(&wt))
        .unwrap();
    let ids = g.node(product).src[2];
    assert_eq!(
        plan.states[product.index()],
        want(ids.index()),
        "{what}'s product\n{text}"
    );
    assert!(
        plan.conversions
            .iter()
            .all(|cv| cv.source != wt && cv.source != product),
        "{what} or its product converted\n{text}"
    );
}

/// The plan's all-reduces.
fn all_reduces(plan: &Sharding) -> usize {
    plan.conversions
        .iter()
        .filter(|cv| cv.kind == ConversionKind::AllReduce)
        .count()
}

fn run(path: &Path, devices: &str, experts: ExpertSplit) -> (Vec<f32>, Vec<u32>, usize) {
    let opts = OpenOptions {
        precision: Precision::Exact,
        experts: Some(experts),
        ..OpenOptions::default()
    };
    let (set, m) = open_decoder(path.to_str().unwrap(), devices, &opts, &|_, _| {}).unwrap();
    let held = set.bytes_per_device(&[&m.weight_buffer]);
    let (logits, tokens) = greedy(&m, &set, PROMPT, STEPS).unwrap();
    (logits, tokens, held.into_iter().max().unwrap())
}

#[test]
fn every_expert_split_gives_one_devices_tokens() {
    for arch in FAMILIES {
        let path = model_file(arch);
        let (want_logits, want, whole) = run(&path, "cpu:1x1", ExpertSplit::Tensor);
        for (devices, n) in [("cpu:2x1", 2), ("cpu:3x1", 3), ("cpu:4x1", 4)] {
            for experts in ExpertSplit::ALL {
                let (logits, toks, held) = run(&path, devices, experts);
                let what = format!("{} {devices} experts {}", arch.name, experts.name());
                // The experts (most of the weights) are split, not mirrored: a device holds
                // well under one device's whole model.
                assert!(held * n < whole * 2, "{what}: {held} of {whole} bytes");
                assert_eq!(toks, want, "{what}: greedy tokens");
                let e = nmse(&logits, &want_logits);
                // Partial sums added in another order: f32 rounding only.
                assert!(e < 1e-7, "{what}: logits NMSE {e:.3e}");
            }
        }
    }
}

/// Expert parallelism in the sharding of a decode step and of a prompt: the experts' tensors
/// are split whole (uneven: 8 over 3 devices), no conversion reads an expert weight or the
/// rows of an expert product, every expert product is Routed by its layer's ids, and each
/// layer has two all-reduces (attention, the MoE block with its shared expert).
#[test]
fn expert_parallel_moves_no_expert_weight() {
    for arch in FAMILIES {
        let c = moe_config(arch);
        for n in [2, 3] {
            let opts = SplitOptions {
                experts: ExpertSplit::Expert,
                ..SplitOptions::default()
            };
            let m = MetaDevice::new(
                parse_devices(&format!("cpu:{n}x1")).unwrap(),
                megatron(&c, opts),
            )
            .unwrap();
            let mb = m.meta_backend().unwrap();
            let bt = m.buffer_type();
            let (_wb, w) = random_decoder(&c, DType::F32, bt.as_ref(), 5).unwrap();
            let (_cb, cache) = alloc_kv_cache(&c, 32, bt.as_ref()).unwrap();
            let prompt: Vec<i32> = PROMPT.iter().map(|&t| t as i32).collect();
            let p = prompt.len();
            // A prompt (logits of its last row), then a decode step after it.
            let steps = [
                SequenceStep::new(&prompt, 0, 32),
                SequenceStep::new(&[7], p, 32),
            ];
            for step in &steps {
                let t = step.tokens.len();
                let sg = build_step(&c, &w, &cache, &step.input(t - 1..t)).unwrap();
                let g = &sg.graph;
                let plan = mb.sharding(g).unwrap();
                let text = plan.describe(g);
                let what = format!("{} on {n} devices, {t} tokens", arch.name);
                for l in 0..c.n_layer {
                    for t in ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] {
                        let wt = g.find(&format!("blk.{l}.{t}.weight")).unwrap();
                        let st = &plan.states[wt.index()];
                        assert_eq!(st.split_dim(), Some(2), "{what}: {t} is {st}");
                        let mut e: Vec<usize> = st.extents().to_vec();
                        e.sort();
                        let want = if n == 2 { vec![4, 4] } else { vec![2, 3, 3] };
                        assert_eq!(e, want, "{what}: {t}");
                        let product_state = |ids: usize| SplitState::routed(ids, st.extents());
                        assert_product_stays(g, &plan, wt, product_state, &format!("{what}: {t}"));
                    }
                }
                let reduces = all_reduces(&plan);
                // Two per layer (attention, the MoE block), and OLMoE's sums of squares of Q
                // and K (its norms over the whole projections); none of them is more than a
                // row of activations per token.
                let per_layer = if arch.name == "olmoe" { 4 } else { 2 };
                assert_eq!(reduces, per_layer * c.n_layer, "{what}:\n{text}");
                let most = t * c.n_embd.max(c.n_vocab) * 4;
                assert!(
                    plan.conversions
                        .iter()
                        .filter(|cv| cv.kind.communicates())
                        .all(|cv| cv.bytes <= most),
                    "{what}:\n{text}"
                );
            }
        }
    }
}

/// `--split-mode hybrid` splits the experts inside each group as `--experts` says (two groups of
/// two devices, each a meta device: whole experts per device under `expert`), giving one
/// device's tokens; `--split-mode layer` gives each device whole layers, so `--experts` is
/// refused there by name.
#[test]
fn hybrid_groups_split_their_experts_as_asked_and_the_layer_split_refuses_the_flag() {
    use metashard::models::layer_split::SplitMode;
    let arch = &QWEN3MOE;
    let path = model_file(arch);
    let (want_logits, want, _) = run(&path, "cpu:1x1", ExpertSplit::Tensor);
    let open = |mode: SplitMode, experts: Option<ExpertSplit>| {
        let opts = OpenOptions {
            precision: Precision::Exact,
            split_mode: mode,
            groups: Some(2),
            experts,
            ..OpenOptions::default()
        };
        open_decoder(path.to_str().unwrap(), "cpu:4x1", &opts, &|_, _| {})
    };
    let mut held = Vec::new();
    // Both, two expert groups inside each hybrid group of two devices.
    let both = ExpertSplit::Both { groups: 2 };
    for experts in ExpertSplit::ALL.into_iter().chain([both]) {
        let (set, m) = open(SplitMode::Hybrid, Some(experts)).unwrap();
        let (logits, toks) = greedy(&m, &set, PROMPT, STEPS).unwrap();
        assert_eq!(toks, want, "hybrid, experts {}", experts.name());
        let e = nmse(&logits, &want_logits);
        assert!(e < 1e-7, "hybrid, experts {}: NMSE {e:.3e}", experts.name());
        held.push(set.bytes_per_device(&[&m.weight_buffer]));
    }
    // Every way splits the experts inside a group: the same bytes per group in all (8 experts
    // of equal size, halved each way).
    let total = |h: &Vec<usize>| h.iter().sum::<usize>();
    assert_eq!(total(&held[0]), total(&held[1]), "{held:?}");
    assert_eq!(total(&held[0]), total(&held[2]), "{held:?}");
    // More expert groups than a hybrid group's devices is refused by name.
    let e = match open(SplitMode::Hybrid, Some(ExpertSplit::Both { groups: 3 })) {
        Ok(_) => panic!("3 expert groups in hybrid groups of 2 devices were taken"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("--expert-groups"), "{e}");
    let e = match open(SplitMode::Layer, Some(ExpertSplit::Expert)) {
        Ok(_) => panic!("the layer split took --experts"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("--experts") && e.contains("--split-mode layer"),
        "{e}"
    );
}

/// Both (`--experts both --expert-groups G`): whole experts over G groups of devices, column
/// then row inside a group. Every family gives one device's greedy tokens and logits on
/// cpu:4x1 (two groups of two), cpu:3x1 (groups of 2 + 1 devices: uneven) and, for one family,
/// cpu:4x1 in three groups (2 + 1 + 1), each device holding its group's share of the experts.
#[test]
fn experts_over_groups_give_one_devices_tokens() {
    for arch in FAMILIES {
        let path = model_file(arch);
        let (want_logits, want, whole) = run(&path, "cpu:1x1", ExpertSplit::Tensor);
        let mut cases = vec![("cpu:4x1", 4, 2), ("cpu:3x1", 3, 2)];
        if arch.name == QWEN3MOE.name {
            cases.push(("cpu:4x1", 4, 3));
        }
        for (devices, n, groups) in cases {
            let (logits, toks, held) = run(&path, devices, ExpertSplit::Both { groups });
            let what = format!("{} {devices} in {groups} expert groups", arch.name);
            assert!(held * n < whole * 2, "{what}: {held} of {whole} bytes");
            assert_eq!(toks, want, "{what}: greedy tokens");
            let e = nmse(&logits, &want_logits);
            assert!(e < 1e-7, "{what}: logits NMSE {e:.3e}");
        }
    }
}

/// The sharding of a step under both: the experts' tensors lie in expert groups (8 experts
/// 4 + 4 over two groups; inside a group the gate and up columns and the down rows alike), the
/// gate and up products are GroupRouted by the layer's ids, the down product a Partial, no
/// conversion reads an expert weight or an expert product, and each layer has two all-reduces
/// (attention, the MoE block).
#[test]
fn experts_over_groups_move_no_expert_weight() {
    use metashard::split_state::SplitAxis;
    let arch = &QWEN2MOE;
    let c = moe_config(arch);
    for n in [3, 4] {
        let opts = SplitOptions {
            experts: ExpertSplit::Both { groups: 2 },
            ..SplitOptions::default()
        };
        let m = MetaDevice::new(
            parse_devices(&format!("cpu:{n}x1")).unwrap(),
            megatron(&c, opts),
        )
        .unwrap();
        let mb = m.meta_backend().unwrap();
        let bt = m.buffer_type();
        let (_wb, w) = random_decoder(&c, DType::F32, bt.as_ref(), 5).unwrap();
        let (_cb, cache) = alloc_kv_cache(&c, 32, bt.as_ref()).unwrap();
        let prompt: Vec<i32> = PROMPT.iter().map(|&t| t as i32).collect();
        let p = prompt.len();
        for step in [
            SequenceStep::new(&prompt, 0, 32),
            SequenceStep::new(&[7], p, 32),
        ] {
            let t = step.tokens.len();
            let sg = build_step(&c, &w, &cache, &step.input(t - 1..t)).unwrap();
            let g = &sg.graph;
            let plan = mb.sharding(g).unwrap();
            let text = plan.describe(g);
            let what = format!("{} on {n} devices, {t} tokens", arch.name);
            for l in 0..c.n_layer {
                for (t, axis) in [
                    ("ffn_gate_exps", 1),
                    ("ffn_up_exps", 1),
                    ("ffn_down_exps", 0),
                ] {
                    let wt = g.find(&format!("blk.{l}.{t}.weight")).unwrap();
                    let st = &plan.states[wt.index()];
                    assert_eq!(
                        st.axis,
                        SplitAxis::ExpertGroups(axis),
                        "{what}: {t} is {st}"
                    );
                    let groups = st.groups();
                    let experts: Vec<usize> = groups.iter().map(|g| g.experts.len()).collect();
                    let sizes: Vec<usize> = groups.iter().map(|g| g.devices.len()).collect();
                    assert_eq!(experts, vec![4, 4], "{what}: {t} is {st}");
                    assert_eq!(
                        sizes,
                        if n == 3 { vec![2, 1] } else { vec![2, 2] },
                        "{what}"
                    );
                    let product_state = |ids: usize| {
                        if axis == 1 {
                            SplitState::group_routed(ids, st)
                        } else {
                            SplitState::partial(n)
                        }
                    };
                    assert_product_stays(g, &plan, wt, product_state, &format!("{what}: {t}"));
                }
            }
            assert_eq!(all_reduces(&plan), 2 * c.n_layer, "{what}:\n{text}");
        }
    }
}

/// `--expert-groups` out of range, missing, or given without `--experts both` is an error
/// naming it.
#[test]
fn bad_expert_groups_are_refused_by_name() {
    let path = model_file(&QWEN3MOE);
    for groups in [0, 5] {
        let opts = OpenOptions {
            experts: Some(ExpertSplit::Both { groups }),
            ..OpenOptions::default()
        };
        let e = match open_decoder(path.to_str().unwrap(), "cpu:4x1", &opts, &|_, _| {}) {
            Ok(_) => panic!("{groups} expert groups on 4 devices were taken"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("--expert-groups") && e.contains(&groups.to_string()),
            "{e}"
        );
    }
    let both = ExpertSplit::parse("both", "--experts").unwrap();
    let e = ExpertSplit::with_groups(Some(both), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--expert-groups"), "{e}");
    let e = ExpertSplit::with_groups(Some(ExpertSplit::Expert), Some(2))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--expert-groups") && e.contains("expert"), "{e}");
    assert_eq!(
        ExpertSplit::with_groups(Some(both), Some(3)).unwrap(),
        Some(ExpertSplit::Both { groups: 3 })
    );
}

/// `run --experts both`: without `--expert-groups`, with too many, or with the flag beside
/// another `--experts`, the command fails naming `--expert-groups`; two groups of cpu:3x1 run.
#[test]
fn run_names_expert_groups() {
    let path = model_file(&QWEN3MOE);
    let run = |extra: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_metashard"))
            .args(["run", "--model", path.to_str().unwrap(), "--devices"])
            .args(extra)
            .args(["--prompt", "hi", "-n", "2"])
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    for bad in [
        &["cpu:4x1", "--experts", "both"][..],
        &["cpu:4x1", "--experts", "both", "--expert-groups", "5"],
        &["cpu:4x1", "--experts", "expert", "--expert-groups", "2"],
    ] {
        let (ok, err) = run(bad);
        assert!(!ok && err.contains("--expert-groups"), "{bad:?}: {err}");
    }
    let (ok, err) = run(&["cpu:3x1", "--experts", "both", "--expert-groups", "2"]);
    assert!(ok, "{err}");
}
