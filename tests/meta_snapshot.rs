//! The sharding of a transformer block, pinned as snapshots: every node's split state and every
//! conversion (collective or local) the meta backend inserts. The printed sharding is part of
//! the interface (`METASHARD_LOG=debug` shows it for each new graph); a change of rules, costs,
//! hints or naming shows up here as a diff against `tests/snapshots/*.txt`. Update with
//! `UPDATE_EXPECT=1`.
//!
//! - `megatron_block_sharding.txt`: the Megatron split, two all-reduces per layer;
//! - `sequence_parallel_block_sharding.txt`: the same weights with the sequence-parallel state
//!   hints, a reduce-scatter and an all-gather in place of each all-reduce.

use expect_test::expect_file;
use metashard::meta::{ConversionKind, MetaDevice, MetaOptions, SplitPolicy};
use metashard::models::decoder::{StepInput, build_step};
use metashard::models::hparams::DecoderConfig;
use metashard::models::split::{SplitOptions, megatron, policy};
use metashard::models::synthetic::{alloc_kv_cache, random_decoder, small_config};
use metashard::planner::Strategy;
use metashard::{DType, Device, Graph, parse_devices};

fn cfg(n_layer: usize) -> DecoderConfig {
    small_config(n_layer)
}

/// The sharding of a step of `tokens` tokens (logits for the last) of `cfg` on cpu:2x1.
fn sharding(
    cfg: &DecoderConfig,
    policy: SplitPolicy,
    tokens: usize,
) -> (Graph, metashard::meta::Sharding) {
    let m = MetaDevice::with_policy(
        parse_devices("cpu:2x1").unwrap(),
        policy,
        MetaOptions::default(),
    )
    .unwrap();
    let bt = m.buffer_type();
    let (_wb, w) = random_decoder(cfg, DType::F32, bt.as_ref(), 1).unwrap();
    let (_cb, cache) = alloc_kv_cache(cfg, tokens.max(8), bt.as_ref()).unwrap();
    let pos: Vec<i32> = (0..tokens as i32).collect();
    let toks: Vec<i32> = (0..tokens as i32).map(|i| 5 + i).collect();
    let inp = StepInput {
        tokens: &toks,
        positions: &pos,
        slots: &pos,
        n_kv: tokens,
        kv_positions: &pos,
        logits_rows: tokens - 1..tokens,
    };
    let sg = build_step(cfg, &w, &cache, &inp).unwrap();
    let sharding = m.meta_backend().unwrap().sharding(&sg.graph).unwrap();
    (sg.graph, sharding)
}

#[test]
fn megatron_block_sharding_on_two_devices() {
    let cfg = cfg(1);
    let (g, s) = sharding(&cfg, megatron_policy(&cfg), 3);
    expect_file!["snapshots/megatron_block_sharding.txt"].assert_eq(&s.describe(&g));
}

#[test]
fn sequence_parallel_block_sharding_on_two_devices() {
    let cfg = cfg(1);
    let split = Strategy::SequenceParallel.split(1, false).unwrap();
    let (g, s) = sharding(&cfg, policy(&cfg, split), 4);
    expect_file!["snapshots/sequence_parallel_block_sharding.txt"].assert_eq(&s.describe(&g));
    // The all-reduce between attention and the MLP is a reduce-scatter into the token split and
    // an all-gather of the normed activation; the last layer's output stays Partial and only the
    // row that gets logits is all-reduced, as with Megatron.
    let d = s.describe(&g);
    assert_eq!(s.count(ConversionKind::ReduceScatter), 1, "{d}");
    assert_eq!(s.count(ConversionKind::AllGather), 1, "{d}");
    assert_eq!(s.count(ConversionKind::AllReduce), 1, "{d}");
}

#[test]
fn sequence_parallel_replaces_every_full_all_reduce_between_layers() {
    let cfg = cfg(3);
    let split = Strategy::SequenceParallel.split(3, false).unwrap();
    let (g, s) = sharding(&cfg, policy(&cfg, split.clone()), 4);
    let d = s.describe(&g);
    // Megatron: 2 all-reduces per layer (6, the last of one row). Sequence parallel: 5
    // reduce-scatters and 5 all-gathers of the stream, and the one-row all-reduce.
    assert_eq!(s.count(ConversionKind::ReduceScatter), 5, "{d}");
    assert_eq!(s.count(ConversionKind::AllGather), 5, "{d}");
    assert_eq!(s.count(ConversionKind::AllReduce), 1, "{d}");
    let stream = 64 * 4 * 4; // [n_embd, T] in f32
    for c in s.conversions.iter().filter(|c| c.kind.communicates()) {
        let want = if c.kind == ConversionKind::AllReduce {
            stream / 4
        } else {
            stream
        };
        assert_eq!(c.bytes, want, "{} of `{}`", c.kind.name(), g.name(c.source));
    }
    // The residual adds of the first layers are token-split, the norms after them too.
    for name in [
        "l0.attn_out",
        "l0.out",
        "l1.attn_out",
        "l1.out",
        "l2.attn_out",
    ] {
        let id = g.ids().find(|&id| g.name(id) == name).unwrap();
        let norm = g
            .ids()
            .find(|&n| g.node(n).op.name() == "rms_norm" && g.node(n).src[0] == id)
            .unwrap();
        for x in [id, norm] {
            let st = s.states[x.index()].to_string();
            assert_eq!(st, "Axis1[2, 2]", "`{}`\n{d}", g.name(x));
        }
    }
    let (_, m) = sharding(&cfg, megatron_policy(&cfg), 4);
    assert_eq!(m.count(ConversionKind::AllReduce), 6);
    assert_eq!(m.count(ConversionKind::ReduceScatter), 0);
    // A long prompt (its stream larger than a weight): still the activations gathered, never
    // a weight, and no all-to-all.
    let (g, s) = sharding(&cfg, policy(&cfg, split.clone()), 256);
    let d = s.describe(&g);
    assert_eq!(s.count(ConversionKind::ReduceScatter), 5, "{d}");
    assert_eq!(s.count(ConversionKind::AllGather), 5, "{d}");
    assert_eq!(s.count(ConversionKind::AllToAll), 0, "{d}");
    for c in s.conversions.iter().filter(|c| c.kind.communicates()) {
        let leaf = g.node(c.source).is_leaf();
        assert!(!leaf, "{} of `{}`\n{d}", c.kind.name(), g.name(c.source));
    }
    // A decode step (fewer tokens than devices) is not hinted: exactly Megatron's.
    let (g1, one) = sharding(&cfg, policy(&cfg, split), 1);
    let (_, mega1) = sharding(&cfg, megatron_policy(&cfg), 1);
    assert_eq!(one.describe(&g1), mega1.describe(&g1));
}

fn megatron_policy(cfg: &DecoderConfig) -> SplitPolicy {
    megatron(cfg, SplitOptions::default()).into()
}
