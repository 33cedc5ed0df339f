//! A transformer block graph (embedding lookup, RMSNorm, attention with and without the fused
//! kernel, SwiGLU MLP, residuals; random weights) with the Megatron-style callback on
//! N = 1..=4: equal to one device, with exactly two all-reduces per layer.

use metashard::meta::{ConversionKind, MetaDevice};
use metashard::models::decoder::{StepInput, build_step};
use metashard::models::hparams::DecoderConfig;
use metashard::models::split::{SplitOptions, megatron};
use metashard::models::synthetic::{alloc_kv_cache, random_decoder};
use metashard::{Backend, DType, Device, parse_devices};
use std::sync::Arc;

fn cfg(fused: bool, n_head_kv: usize) -> DecoderConfig {
    DecoderConfig {
        fused_attn: fused,
        ..DecoderConfig::llama(2, 128, 256, 8, n_head_kv, 96)
    }
}

/// Logits of a 5-token prompt, then of one decoded token, and the meta plans (if any).
fn run(
    cfg: &DecoderConfig,
    devs: Option<&str>,
) -> (Vec<f32>, Vec<f32>, Vec<metashard::meta::Sharding>) {
    let (backend, bt): (Arc<dyn Backend>, _) = match devs {
        None => {
            let d = parse_devices("cpu:1x1").unwrap().remove(0);
            (d.init_backend().unwrap(), d.buffer_type())
        }
        Some(spec) => {
            let m = MetaDevice::new(
                parse_devices(spec).unwrap(),
                megatron(cfg, SplitOptions::default()),
            )
            .unwrap();
            (m.init_backend().unwrap(), m.buffer_type())
        }
    };
    let (_wb, w) = random_decoder(cfg, DType::F32, bt.as_ref(), 42).unwrap();
    let (_cb, cache) = alloc_kv_cache(cfg, 16, bt.as_ref()).unwrap();
    let mut plans = Vec::new();
    let prompt = [3, 17, 42, 5, 60];
    let pos: Vec<i32> = (0..5).collect();
    let step = |tokens: &[i32], positions: &[i32], n_kv: usize| {
        let kvp: Vec<i32> = (0..n_kv as i32).collect();
        let inp = StepInput {
            tokens,
            positions,
            slots: positions,
            n_kv,
            kv_positions: &kvp,
            logits_rows: tokens.len() - 1..tokens.len(),
        };
        let mut sg = build_step(cfg, &w, &cache, &inp).unwrap();
        backend.graph_compute(&mut sg.graph).unwrap();
        sg.graph.read_f32(sg.logits).unwrap()
    };
    let a = step(&prompt, &pos, 5);
    let b = step(&[9], &[5], 6);
    if let Some(spec) = devs {
        let m = MetaDevice::new(
            parse_devices(spec).unwrap(),
            megatron(cfg, SplitOptions::default()),
        )
        .unwrap();
        let mb = m.meta_backend().unwrap();
        let (_wb, w) = random_decoder(cfg, DType::F32, m.buffer_type().as_ref(), 42).unwrap();
        let (_cb, cache) = alloc_kv_cache(cfg, 16, m.buffer_type().as_ref()).unwrap();
        let kvp: Vec<i32> = (0..5).collect();
        let inp = StepInput {
            tokens: &prompt,
            positions: &pos,
            slots: &pos,
            n_kv: 5,
            kv_positions: &kvp,
            logits_rows: 4..5,
        };
        let sg = build_step(cfg, &w, &cache, &inp).unwrap();
        plans.push(mb.sharding(&sg.graph).unwrap());
    }
    (a, b, plans)
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

#[test]
fn transformer_block_matches_one_device_with_two_all_reduces_per_layer() {
    for fused in [false, true] {
        for kv in [8, 2] {
            let c = cfg(fused, kv);
            let (want_a, want_b, _) = run(&c, None);
            for n in 1..=4 {
                let spec = format!("cpu:{n}x1");
                let (a, b, plans) = run(&c, Some(&spec));
                let (ea, eb) = (max_rel(&a, &want_a), max_rel(&b, &want_b));
                assert!(
                    ea < 1e-4 && eb < 1e-4,
                    "fused={fused} kv={kv} N={n}: prompt {ea}, decode {eb}"
                );
                let p = &plans[0];
                assert_eq!(
                    p.count(ConversionKind::AllReduce),
                    2 * c.n_layer,
                    "fused={fused} kv={kv} N={n}: conversions {:?}",
                    p.conversions.iter().map(|c| c.kind).collect::<Vec<_>>()
                );
                assert_eq!(p.count(ConversionKind::AllGather), 0, "N={n}");
            }
        }
    }
}

#[test]
fn plan_is_readable() {
    let c = cfg(true, 2);
    let (_, _, plans) = run(&c, Some("cpu:3x1"));
    let m = MetaDevice::new(
        parse_devices("cpu:3x1").unwrap(),
        megatron(&c, SplitOptions::default()),
    )
    .unwrap();
    let (_wb, w) = random_decoder(&c, DType::F32, m.buffer_type().as_ref(), 42).unwrap();
    let (_cb, cache) = alloc_kv_cache(&c, 16, m.buffer_type().as_ref()).unwrap();
    let kvp: Vec<i32> = (0..5).collect();
    let pos: Vec<i32> = (0..5).collect();
    let inp = StepInput {
        tokens: &[1, 2, 3, 4, 5],
        positions: &pos,
        slots: &pos,
        n_kv: 5,
        kv_positions: &kvp,
        logits_rows: 4..5,
    };
    let sg = build_step(&c, &w, &cache, &inp).unwrap();
    let text = plans[0].describe(&sg.graph);
    // Every layer's attention output is reduced before the MLP norm, and the KV cache stays
    // head-split.
    assert!(text.contains("l0.attn_out"), "{text}");
    println!("{text}");
}

/// A plan is cached per graph structure, which includes the addresses of bound buffers. A KV
/// cache dropped and a new one allocated at the same address must not hit the old plan (which
/// still points at the old cache's device slices): plans whose buffers died leave the cache.
/// (Seen with SmolLM2: three sessions in a row, the third decoded from the first's KV slices.)
#[test]
fn plans_of_dropped_buffers_leave_the_cache() {
    let c = cfg(true, 2);
    let m = MetaDevice::new(
        parse_devices("cpu:2x1").unwrap(),
        megatron(&c, SplitOptions::default()),
    )
    .unwrap();
    let be = m.meta_backend().unwrap();
    let bt = m.buffer_type();
    let (_wb, w) = random_decoder(&c, DType::F32, bt.as_ref(), 42).unwrap();
    let step = |cache: &metashard::models::weights::KvCache| {
        let kvp: Vec<i32> = (0..16).map(|j| if j == 0 { 0 } else { -1 }).collect();
        let inp = StepInput {
            tokens: &[7],
            positions: &[0],
            slots: &[0],
            n_kv: 16,
            kv_positions: &kvp,
            logits_rows: 0..1,
        };
        let mut sg = build_step(&c, &w, cache, &inp).unwrap();
        be.graph_compute(&mut sg.graph).unwrap();
        sg.graph.read_f32(sg.logits).unwrap()
    };
    let (cb1, cache1) = alloc_kv_cache(&c, 16, bt.as_ref()).unwrap();
    let first = step(&cache1);
    assert_eq!(be.cached_graphs(), 1);
    drop((cb1, cache1));
    let (_cb2, cache2) = alloc_kv_cache(&c, 16, bt.as_ref()).unwrap();
    let second = step(&cache2);
    assert_eq!(
        be.cached_graphs(),
        1,
        "the plan of the dropped cache must be gone"
    );
    assert_eq!(first, second);
}
