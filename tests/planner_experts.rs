//! The planner on mixtures of experts: the Mixtral-8x7B and Qwen3-30B-A3B presets (their
//! published `config.json`) weigh what their published checkpoints weigh, on the 8 x H100
//! preset too; a decode step streams about the parameters their authors publish as active per
//! token (not every expert); a plan reports each device's experts from the placed slices; a
//! GGUF header and the equivalent `config.json` give the same experts; a layout the table
//! cannot describe is an error naming its key.

use metashard::io::config::JsonConfig;
use metashard::meta::MetaBuffer;
use metashard::models::hparams::Moe;
use metashard::models::synthetic;
use metashard::planner::evaluate::Placed;
use metashard::planner::model_presets::{CONFIG_PRESETS, MIXTRAL_8X7B, QWEN3_30B_A3B};
use metashard::planner::report::{Plan, evaluate_split, split_fn};
use metashard::planner::{
    Cluster, CollectiveFit, DeviceProfile, LinkLevel, Links, ModelShape, Strategy, Workload,
};
use metashard::{DType, Result};
use std::collections::BTreeMap;

/// `a` within `tol` (a fraction) of `b`.
fn near(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b
}

/// The plan of `strategy` for `shape` on 8 x H100.
fn plan_on_h100s(shape: &ModelShape, strategy: Strategy, w: &Workload) -> Result<Plan> {
    let c = Cluster::preset("h100x8-nvswitch").unwrap();
    let split = strategy.split(shape.n_layer(), shape.tied).unwrap();
    let e = evaluate_split(shape, &split, &c, w)?;
    Plan::fixed(shape, &c, w, strategy.name(), split, e)
}

#[test]
fn presets_weigh_what_their_checkpoints_weigh_on_every_h100() -> Result<()> {
    // The checkpoints' `metadata.total_size` (model.safetensors.index.json), bf16:
    // mistralai/Mixtral-8x7B-v0.1 93,405,585,408 bytes; Qwen/Qwen3-30B-A3B 61,064,245,248
    // bytes (`model_presets.rs` names the sources).
    assert_eq!(MIXTRAL_8X7B.checkpoint_bytes, 93_405_585_408);
    assert_eq!(QWEN3_30B_A3B.checkpoint_bytes, 61_064_245_248);
    let experts = |p: &str| ModelShape::preset(p).unwrap().cfg.moe.unwrap();
    let m = experts("mixtral-8x7b");
    assert_eq!((m.n_expert, m.n_expert_used, m.n_ff_exp), (8, 2, 14336));
    let q = experts("qwen3-30b-a3b");
    assert_eq!((q.n_expert, q.n_expert_used, q.n_ff_exp), (128, 8, 768));
    assert!(q.norm_weights && q.n_ff_shexp == 0);
    let w = Workload::parse("pp=64,tg=16,ctx=512")?;
    for p in CONFIG_PRESETS {
        let shape = ModelShape::preset(p.name).unwrap();
        let real = p.checkpoint_bytes as f64;
        let bytes = shape.weight_bytes() as f64;
        assert!(
            near(bytes, real, 0.01),
            "{}: {bytes} against {real}",
            p.name
        );
        // Every device of a mirrored plan holds the whole checkpoint (Mixtral's is over an
        // H100's budget: the plan is still predicted); summed, eight of them.
        let plan = plan_on_h100s(&shape, Strategy::Mirrored, &w)?;
        let per_device: Vec<usize> = plan.evaluation.memory.iter().map(|m| m.weights).collect();
        for &b in &per_device {
            assert!(near(b as f64, real, 0.01), "{}: {b} against {real}", p.name);
        }
        let sum: usize = per_device.iter().sum();
        assert!(near(sum as f64, 8.0 * real, 0.01));
        // Each device holds every expert, and the experts' bytes of every layer.
        let x = plan.experts.as_ref().unwrap();
        let moe = shape.cfg.moe.unwrap();
        assert_eq!(x.experts, vec![moe.n_expert; 8]);
        assert_eq!(x.experts_max, x.experts);
        let expert_bytes = 3 * moe.n_expert * shape.cfg.n_embd * moe.n_ff_exp * 2;
        assert_eq!(x.expert_bytes, vec![shape.n_layer() * expert_bytes; 8]);
        assert!(plan.table().contains(&format!(
            "experts: {} per layer of width {}, {} per token",
            moe.n_expert, moe.n_ff_exp, moe.n_expert_used
        )));
    }
    Ok(())
}

/// One device that reads a byte per picosecond (memory and weights alike) and computes nearly
/// for free (10^19 flop/s), with no overheads: a step's predicted seconds times 10^12 are the
/// bytes it streams.
fn byte_counter() -> Cluster {
    let rates = |x: f64| -> BTreeMap<String, f64> {
        ["f32", "f16", "bf16"]
            .iter()
            .map(|d| (d.to_string(), x))
            .collect()
    };
    let dev = DeviceProfile {
        name: "dev".into(),
        memory_bytes: 1 << 40,
        mem_bw: 1e12,
        gemv_bw: rates(1e12),
        gemm_flops: rates(1e19),
        gemm_flops_by_m: BTreeMap::new(),
        gemv_bw_by_k: BTreeMap::new(),
        attn_flops: None,
        step_overhead_s: 0.0,
        node_overhead_s: 0.0,
    };
    let fit = CollectiveFit {
        alpha_s: vec![(2, 1e-6)],
        bus_bw: 1e12,
    };
    let links = Links {
        devices_per_node: 1,
        intra: LinkLevel {
            kind: "none".into(),
            all_reduce: fit.clone(),
            all_gather: fit.clone(),
            reduce_scatter: fit,
            broadcast: None,
        },
        inter: None,
    };
    Cluster::homogeneous("bytes", 1, &dev, links)
}

#[test]
fn a_decode_token_streams_the_published_active_parameters() -> Result<()> {
    // Parameters active per token as their authors publish them: Mixtral 12.9e9 (Mistral AI,
    // "Mixtral of experts", mistral.ai/news/mixtral-of-experts: "12.9B active parameters per
    // token"); Qwen3-30B-A3B 3.3e9 (the Qwen/Qwen3-30B-A3B model card: "Number of Activated
    // Parameters: 3.3B"). Both count the token embedding, of which a decode step reads one
    // row: it is taken off. The rest (attention, router, the used experts, output) is what a
    // decode step streams, in bf16, plus its KV cache and activations (under 1%).
    let c = byte_counter();
    let w = Workload::parse("pp=64,tg=64,ctx=256")?;
    for (name, active) in [("mixtral-8x7b", 12.9e9), ("qwen3-30b-a3b", 3.3e9)] {
        let shape = ModelShape::preset(name).unwrap();
        let split = Strategy::Mirrored
            .split(shape.n_layer(), shape.tied)
            .unwrap();
        let e = evaluate_split(&shape, &split, &c, &w)?;
        let streamed = e.decode.as_ref().unwrap().seconds * 1e12 / 2.0;
        let embedding = (shape.cfg.n_vocab * shape.cfg.n_embd) as f64;
        assert!(
            near(streamed, active - embedding, 0.03),
            "{name}: {streamed:.4e} parameters streamed per token against {:.4e}",
            active - embedding
        );
        // Far below every weight once (what the dense pricing of `mul_mat_id` gave).
        assert!(streamed < 0.3 * shape.weight_bytes() as f64 / 2.0);
    }
    Ok(())
}

/// A small `config.json` of a mixture-of-experts family (`model_type`) with `extra` keys: 6
/// experts of 64 features, 2 per token (Qwen2-MoE: a shared expert of 96).
fn small_config_json(model_type: &str, extra: &str) -> String {
    let family = match model_type {
        "mixtral" => r#""intermediate_size": 64, "num_local_experts": 6"#,
        // OLMoE's experts are `intermediate_size` wide (it has no dense MLP), not normalised.
        "olmoe" => r#""intermediate_size": 64, "num_experts": 6, "norm_topk_prob": false"#,
        "qwen2_moe" => {
            r#""intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 6,
            "shared_expert_intermediate_size": 96, "norm_topk_prob": false"#
        }
        _ => {
            r#""intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 6,
            "head_dim": 32"#
        }
    };
    format!(
        r#"{{"model_type": "{model_type}", "hidden_size": 128, {family},
        "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_attention_heads": 8,
        "num_key_value_heads": 2, "vocab_size": 300, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "torch_dtype": "float32", "tie_word_embeddings": false{extra}}}"#
    )
}

#[test]
fn a_gguf_header_and_its_config_json_give_the_same_experts() -> Result<()> {
    for (model_type, gguf_arch, shared, norm) in [
        ("qwen3_moe", "qwen3moe", 0, true),
        ("qwen2_moe", "qwen2moe", 96, false),
        ("mixtral", "llama", 0, true),
        ("olmoe", "olmoe", 0, false),
    ] {
        let text = small_config_json(model_type, "");
        let from_json = ModelShape::from_config(&JsonConfig::parse("small/config.json", &text)?)?;
        assert_eq!(from_json.cfg.arch.name, gguf_arch);
        let moe = from_json.cfg.moe.unwrap();
        let want = Moe {
            n_expert: 6,
            n_expert_used: 2,
            n_ff_exp: 64,
            n_ff_shexp: shared,
            norm_weights: norm,
        };
        assert_eq!(moe, want, "{model_type}");
        // The same model as a GGUF file, as llama.cpp's converter writes one (F32 matrices).
        let bytes = synthetic::gguf_bytes(&from_json.cfg, DType::F32, false, 4096, 7)?;
        let path = std::env::temp_dir().join(format!(
            "metashard-plan-{model_type}-{}.gguf",
            std::process::id()
        ));
        std::fs::write(&path, bytes).unwrap();
        let from_gguf = ModelShape::from_gguf(&path);
        std::fs::remove_file(&path).ok();
        let from_gguf = from_gguf?;
        assert_eq!(from_gguf.cfg.arch, from_json.cfg.arch, "{model_type}");
        assert_eq!(from_gguf.cfg.moe, Some(moe), "{model_type}");
        assert_eq!(from_gguf.types.ffn_gate_up, DType::F32);
        // The synthetic file's embedding is F32 as well: every tensor weighs the same.
        assert_eq!(
            from_gguf.weight_bytes(),
            from_json.weight_bytes(),
            "{model_type}"
        );
    }
    Ok(())
}

#[test]
fn a_layout_the_table_cannot_describe_names_its_key() {
    let err = |extra: &str| {
        let text = small_config_json("qwen3_moe", extra);
        let c = JsonConfig::parse("bad/config.json", &text).unwrap();
        ModelShape::from_config(&c).unwrap_err().to_string()
    };
    for (extra, key) in [
        (r#", "decoder_sparse_step": 2"#, "decoder_sparse_step"),
        (r#", "mlp_only_layers": [0]"#, "mlp_only_layers"),
        (r#", "num_experts_per_tok": 7"#, "num_experts_per_tok"),
        (r#", "num_experts": 0"#, "num_experts"),
        (r#", "moe_intermediate_size": 0"#, "moe_intermediate_size"),
    ] {
        let e = err(extra);
        assert!(
            e.contains(key) && e.contains("bad/config.json"),
            "{extra}: {e}"
        );
    }
}

#[test]
fn expert_parallel_spreads_the_checkpoint_over_the_h100s() -> Result<()> {
    // Whole experts per device: Mixtral's 8 one per H100, Qwen3-30B-A3B's 128 sixteen per H100.
    // The devices hold the checkpoint once between them (each mirrored tensor counted once:
    // the embedding, norms and routers), within 1% of its `total_size`, and fit.
    let w = Workload::parse("pp=64,tg=16,ctx=512")?;
    for (p, per_device) in [(&MIXTRAL_8X7B, 1), (&QWEN3_30B_A3B, 16)] {
        let shape = ModelShape::preset(p.name).unwrap();
        let plan = plan_on_h100s(&shape, Strategy::ExpertParallel, &w)?;
        assert!(plan.evaluation.over_budget().is_none(), "{}", p.name);
        let x = plan.experts.as_ref().unwrap();
        assert_eq!(x.experts, vec![per_device; 8], "{}", p.name);
        let moe = shape.cfg.moe.unwrap();
        let all = shape.n_layer() * 3 * moe.n_expert * shape.cfg.n_embd * moe.n_ff_exp * 2;
        assert_eq!(x.expert_bytes, vec![all / 8; 8], "{}", p.name);
        // Placed as the plan places it: every weight's slices, a mirrored one counted once.
        let c = Cluster::preset("h100x8-nvswitch").unwrap();
        let placed_shape = shape.for_split(8, &plan.split);
        let placed = Placed::new(&placed_shape, &c, split_fn(&placed_shape, &plan.split), 512)?;
        let tensors = placed.tensors();
        let mut once = 0usize;
        for (name, _) in shape.weight_layouts() {
            let st = &tensors[&name];
            let mb = st.buffer.as_any().downcast_ref::<MetaBuffer>().unwrap();
            let t = mb.tensor_at(st.offset).unwrap();
            once += match t.state.is_mirrored() {
                true => t.local_bytes(0),
                false => (0..8).map(|d| t.local_bytes(d)).sum(),
            };
        }
        let real = p.checkpoint_bytes as f64;
        assert!(
            near(once as f64, real, 0.01),
            "{}: {once} against {real}",
            p.name
        );
    }
    Ok(())
}

#[test]
fn expert_groups_hold_the_groups_experts_in_slices() -> Result<()> {
    // `expert-groups` on 8 H100s: two groups of four, each with half the experts (Mixtral 4,
    // Qwen3-30B-A3B 64), every device a quarter of each of its group's experts: the experts
    // a device holds any part of are its group's, their bytes an eighth of all, as the other
    // splits. Its decode step is priced from those slices: each device reads its quarter of
    // the experts routed to its group (the hotter group), so between megatron (an eighth of
    // every routed expert) and whole experts per device (the hottest of eight devices).
    let w = Workload::parse("pp=64,tg=16,ctx=512")?;
    for (p, per_device) in [(&MIXTRAL_8X7B, 4), (&QWEN3_30B_A3B, 64)] {
        let shape = ModelShape::preset(p.name).unwrap();
        let plan = plan_on_h100s(&shape, Strategy::ExpertGroups, &w)?;
        assert!(plan.evaluation.over_budget().is_none(), "{}", p.name);
        let x = plan.experts.as_ref().unwrap();
        assert_eq!(x.experts, vec![per_device; 8], "{}", p.name);
        let moe = shape.cfg.moe.unwrap();
        let all = shape.n_layer() * 3 * moe.n_expert * shape.cfg.n_embd * moe.n_ff_exp * 2;
        assert_eq!(x.expert_bytes, vec![all / 8; 8], "{}", p.name);
        let table = plan.table();
        assert!(
            table.contains(&format!("per device {per_device}/{per_device}/"))
                && table.contains("whole experts over 2 groups of devices"),
            "{table}"
        );
        // Decode tokens per second: higher is faster.
        let decode = |s: Strategy| -> Result<f64> {
            Ok(plan_on_h100s(&shape, s, &w)?.evaluation.decode_tps())
        };
        let (tp, ep, both) = (
            decode(Strategy::Megatron)?,
            decode(Strategy::ExpertParallel)?,
            plan.evaluation.decode_tps(),
        );
        assert!(tp >= both && both >= ep, "{}: {tp} {both} {ep}", p.name);
    }
    Ok(())
}

#[test]
fn auto_is_never_slower_than_the_expert_splits_it_tries() -> Result<()> {
    // The search costs its chosen assignment with whole experts per device and with experts
    // over 2 and 4 groups of the 8 H100s, and keeps the fastest: so its total is at most
    // each of those fixed strategies' (which share its assignment of everything else only
    // when it is megatron's, hence `<=` and not equality).
    let c = Cluster::preset("h100x8-nvswitch").unwrap();
    let w = Workload::parse("pp=64,tg=16,ctx=512")?;
    for p in [&MIXTRAL_8X7B, &QWEN3_30B_A3B] {
        let shape = ModelShape::preset(p.name).unwrap();
        let r = metashard::planner::search::auto(&shape, &c, &w, None)?;
        let best = r.evaluation.total_s;
        for s in [
            Strategy::ExpertGroups,
            Strategy::ExpertParallel,
            Strategy::Megatron,
        ] {
            let fixed = plan_on_h100s(&shape, s, &w)?.evaluation.total_s;
            assert!(
                best <= fixed * (1.0 + 1e-9),
                "{}: auto {best} > {} {fixed}",
                p.name,
                s.name()
            );
        }
    }
    Ok(())
}
