//! Every strategy runs SmolLM2 exactly like one device: on cpu:2x1 and cpu:3x1, each named
//! strategy and the search's own choice give the single device's greedy tokens, with logits
//! within NMSE 1e-5 of it.

use metashard::cpu::Precision;
use metashard::models::prompt::{PromptOptions, prompt_tokens};
use metashard::models::split::DecoderSplit;
use metashard::planner::evaluate::Workload;
use metashard::planner::{
    Cluster, CollectiveFit, DeviceProfile, LinkLevel, Links, ModelShape, Strategy, auto,
};
use metashard::runtime::{OpenOptions, open_decoder};
use metashard::verify::{greedy, nmse};
use std::collections::BTreeMap;

const STEPS: usize = 8;

fn run(devices: &str, split: Option<DecoderSplit>) -> (Vec<f32>, Vec<u32>) {
    let opts = OpenOptions {
        precision: Precision::Exact,
        split,
        ..OpenOptions::default()
    };
    let (set, m) = open_decoder("smollm2", devices, &opts, &|_, _| {}).unwrap();
    let prompt = prompt_tokens(&m, "Name three colors.", &PromptOptions::default()).unwrap();
    greedy(&m, &set, &prompt, STEPS).unwrap()
}

/// A cluster like this machine's CPU devices, for the search (figures of the right order).
fn cpu_like(n: usize) -> Cluster {
    let fit = CollectiveFit {
        alpha_s: vec![(2, 5e-6), (8, 15e-6)],
        bus_bw: 5e9,
    };
    let rates = |x: f64| -> BTreeMap<String, f64> {
        ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"]
            .iter()
            .map(|d| (d.to_string(), x))
            .collect()
    };
    let dev = DeviceProfile {
        name: "cpu".into(),
        memory_bytes: 4 << 30,
        mem_bw: 10e9,
        gemv_bw: rates(8e9),
        gemm_flops: rates(40e9),
        gemm_flops_by_m: BTreeMap::new(),
        gemv_bw_by_k: BTreeMap::new(),
        attn_flops: None,
        step_overhead_s: 100e-6,
        node_overhead_s: 2e-6,
    };
    Cluster::homogeneous(
        "cpu-like",
        n,
        &dev,
        Links {
            devices_per_node: 16,
            intra: LinkLevel {
                kind: "host memory".into(),
                all_reduce: fit.clone(),
                all_gather: fit.clone(),
                reduce_scatter: fit,
                broadcast: None,
            },
            inter: None,
        },
    )
}

#[test]
fn every_strategy_equals_one_device() {
    let (want_logits, want_tokens) = run("cpu:1x1", None);
    let shape = ModelShape::resolve("smollm2").unwrap();
    let w = Workload::parse("pp=16,tg=8,ctx=256").unwrap();
    for (devices, n) in [("cpu:2x1", 2), ("cpu:3x1", 3)] {
        let mut splits: Vec<(String, DecoderSplit)> = Strategy::ALL
            .iter()
            .filter_map(|s| {
                s.split(shape.n_layer(), shape.tied)
                    .map(|sp| (s.name().to_string(), sp))
            })
            .collect();
        let found = auto(&shape, &cpu_like(n), &w, None).unwrap();
        splits.push(("auto".into(), found.split));
        for (name, split) in splits {
            let (logits, tokens) = run(devices, Some(split));
            let e = nmse(&logits, &want_logits);
            assert!(e < 1e-5, "{name} on {devices}: logits NMSE {e:.2e}");
            assert_eq!(tokens, want_tokens, "{name} on {devices}: greedy tokens");
        }
    }
}
