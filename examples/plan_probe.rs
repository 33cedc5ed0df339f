use metashard::planner::*;
use std::collections::BTreeMap;
fn main() -> metashard::Result<()> {
    let fit = CollectiveFit {
        alpha_s: vec![(2, 10e-6), (8, 20e-6)],
        bus_bw: 10e9,
    };
    let links = Links {
        devices_per_node: 16,
        intra: LinkLevel {
            kind: "host".into(),
            all_reduce: fit.clone(),
            all_gather: fit.clone(),
            reduce_scatter: fit,
            broadcast: None,
        },
        inter: None,
    };
    let mut gemv = BTreeMap::new();
    for d in ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"] {
        gemv.insert(d.to_string(), 10e9);
    }
    let mut gemm = BTreeMap::new();
    for d in ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"] {
        gemm.insert(d.to_string(), 50e9);
    }
    let mem: u64 = std::env::args()
        .nth(3)
        .and_then(|s| s.parse().ok())
        .unwrap_or(8 << 30);
    let dev = DeviceProfile {
        name: "cpu".into(),
        memory_bytes: mem,
        mem_bw: 10e9,
        gemv_bw: gemv,
        gemm_flops: gemm,
        gemm_flops_by_m: BTreeMap::new(),
        gemv_bw_by_k: BTreeMap::new(),
        attn_flops: None,
        step_overhead_s: 50e-6,
        node_overhead_s: 1e-6,
    };
    let spec = std::env::args().nth(1).unwrap_or("smollm2-135m".into());
    let n: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let shape = ModelShape::resolve(&spec)?;
    let cluster = Cluster::homogeneous("test", n, &dev, links);
    let w = Workload::parse("pp=128,tg=64,ctx=512")?;
    let r = auto(&shape, &cluster, &w, None)?;
    println!("solve {:?}: {}", r.solve_time, strategy::describe(&r.split));
    println!(
        "pred total {:.3} s; prefill {:.1} t/s decode {:.1} t/s mem {:?}",
        r.evaluation.total_s,
        r.evaluation.prefill_tps(),
        r.evaluation.decode_tps(),
        r.evaluation
            .memory
            .iter()
            .map(|m| m.total >> 20)
            .collect::<Vec<_>>()
    );
    for c in &r.candidates {
        println!(
            "  cand {:.3} s {} MiB: {}",
            c.time_s,
            c.bytes >> 20,
            c.description
        );
    }
    Ok(())
}
