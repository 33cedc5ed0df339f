//! The sharding of a Megatron-split transformer block, pinned as a snapshot: every node's
//! split state and every conversion (collective or local) the meta backend inserts. The printed
//! sharding is part of the interface (`METASHARD_LOG=debug` shows it for each new graph); a
//! change of rules, costs or naming shows up here as a diff against
//! `tests/snapshots/megatron_block_sharding.txt`. Update with `UPDATE_EXPECT=1`.

use expect_test::expect_file;
use metashard::meta::MetaDevice;
use metashard::models::decoder::{DecoderConfig, StepInput, build_step};
use metashard::models::split::{SplitOptions, megatron};
use metashard::models::synthetic::{alloc_kv_cache, random_decoder};
use metashard::op::RopeMode;
use metashard::{DType, Device, parse_devices};

#[test]
fn megatron_block_sharding_on_two_devices() {
    let cfg = DecoderConfig {
        n_layer: 1,
        n_embd: 64,
        n_ff: 128,
        n_head: 4,
        n_head_kv: 2,
        n_vocab: 32,
        rms_eps: 1e-5,
        rope_base: 10000.0,
        rope_mode: RopeMode::Normal,
        rope_dims: 16,
        fused_attn: false,
    };
    let m = MetaDevice::new(
        parse_devices("cpu:2x1").unwrap(),
        megatron(&cfg, SplitOptions::default()),
    )
    .unwrap();
    let bt = m.buffer_type();
    let (_wb, w) = random_decoder(&cfg, DType::F32, bt.as_ref(), 1).unwrap();
    let (_cb, cache) = alloc_kv_cache(&cfg, 8, bt.as_ref()).unwrap();
    let pos = [0, 1, 2];
    let kvp = [0, 1, 2];
    let inp = StepInput {
        tokens: &[5, 6, 7],
        positions: &pos,
        slots: &pos,
        n_kv: 3,
        kv_positions: &kvp,
        logits_rows: 2..3,
    };
    let sg = build_step(&cfg, &w, &cache, &inp).unwrap();
    let sharding = m.meta_backend().unwrap().sharding(&sg.graph).unwrap();
    expect_file!["snapshots/megatron_block_sharding.txt"].assert_eq(&sharding.describe(&sg.graph));
}
