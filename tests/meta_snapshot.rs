//! The sharding of a Megatron-split transformer block, pinned as a snapshot: every node's
//! split state and every conversion (collective or local) the meta backend inserts. The printed
//! sharding is part of the interface (`METASHARD_LOG=debug` shows it for each new graph); a
//! change of rules, costs or naming shows up here as a diff. Update with `UPDATE_EXPECT=1`.

use expect_test::expect;
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
    expect![[r#"
           0 leaf         tokens                       Mirrored
           1 leaf         positions                    Mirrored
           2 leaf         slots                        Mirrored
           3 leaf         kq_mask                      Mirrored
           4 leaf         token_embd.weight            Mirrored
           5 get_rows     inp_embd                     Mirrored
           6 leaf         blk.0.attn_norm.weight       Mirrored
           7 rms_norm     rms_norm_7                   Mirrored
           8 mul          mul_8                        Mirrored
           9 leaf         blk.0.attn_q.weight          Axis1[32, 32]
          10 leaf         blk.0.attn_k.weight          Axis1[16, 16]
          11 leaf         blk.0.attn_v.weight          Axis1[16, 16]
          12 mul_mat      mul_mat_12                   Axis0[32, 32]
          13 reshape      reshape_13                   Axis1[2, 2]
          14 rope         rope_14                      Axis1[2, 2]
          15 mul_mat      mul_mat_15                   Axis0[16, 16]
          16 reshape      reshape_16                   Axis1[1, 1]
          17 rope         rope_17                      Axis1[1, 1]
          18 reshape      reshape_18                   Axis0[16, 16]
          19 mul_mat      mul_mat_19                   Axis0[16, 16]
          20 leaf         cache_k_l0                   Axis0[16, 16]
          21 leaf         cache_v_l0                   Axis0[16, 16]
          22 set_rows     set_rows_22                  Axis0[16, 16]
          23 set_rows     set_rows_23                  Axis0[16, 16]
          24 view         view_24                      Axis2[1, 1]
          25 view         view_25                      Axis2[1, 1]
          26 permute      permute_26                   Axis2[2, 2]
          27 mul_mat      mul_mat_27                   Axis2[2, 2]
          28 soft_max     soft_max_28                  Axis2[2, 2]
          29 permute      permute_29                   Axis2[1, 1]
          30 cont         cont_30                      Axis2[1, 1]
          31 mul_mat      mul_mat_31                   Axis2[2, 2]
          32 permute      permute_32                   Axis1[2, 2]
          33 cont         cont_33                      Axis1[2, 2]
          34 reshape      reshape_34                   Axis0[32, 32]
          35 leaf         blk.0.attn_output.weight     Axis0[32, 32]
          36 mul_mat      mul_mat_36                   Partial
          37 add          l0.attn_out                  Partial
               <- to-partial `inp_embd`: Mirrored -> Partial (768 bytes)
          38 leaf         blk.0.ffn_norm.weight        Mirrored
          39 rms_norm     rms_norm_39                  Mirrored
               <- all-reduce `l0.attn_out`: Partial -> Mirrored (768 bytes)
          40 mul          mul_40                       Mirrored
          41 leaf         blk.0.ffn_gate.weight        Axis1[64, 64]
          42 leaf         blk.0.ffn_up.weight          Axis1[64, 64]
          43 leaf         blk.0.ffn_down.weight        Axis0[64, 64]
          44 mul_mat      mul_mat_44                   Axis0[64, 64]
          45 mul_mat      mul_mat_45                   Axis0[64, 64]
          46 swiglu       swiglu_46                    Axis0[64, 64]
          47 mul_mat      mul_mat_47                   Partial
          48 add          l0.out                       Partial
          49 view         view_49                      Partial
          50 leaf         output_norm.weight           Mirrored
          51 rms_norm     rms_norm_51                  Mirrored
               <- all-reduce `view_49`: Partial -> Mirrored (256 bytes)
          52 mul          mul_52                       Mirrored
          53 leaf         output.weight                Axis1[16, 16]
          54 mul_mat      logits                       Axis0[16, 16]
    "#]]
    .assert_eq(&sharding.describe(&sg.graph));
}
