//! Criterion benchmark of the planner's search: `auto` for Llama-3-70B shapes on the 8 x H100
//! preset (80 layers, 8 devices, workload pp=512 tg=128 ctx=4096), Llama-3-8B on 4 x RTX 4090
//! and SmolLM2-135M on the 8 x H100 preset; `auto_devices` (the search over 16, 8, 4, 2 and 1 of the devices,
//! the tensor split alone) and `search_layouts` (what `plan` runs: those subsets, the hybrid
//! and layer splits of groups inside a node, replicas for a batch) for Llama-3-70B on the
//! 16-device preset, at batch 1 and 64. The timed region is the whole search (cost tables of
//! tied layers, the dynamic program, the whole-model evaluation of the answer, each hybrid's
//! stage evaluation). The targets: under 100 ms for the first, under 1 s for the
//! 16-device preset with subsets and hybrids.

use criterion::{Criterion, criterion_group, criterion_main};
use metashard::planner::evaluate::Workload;
use metashard::planner::{Cluster, ModelShape, auto, auto_devices, search_layouts};

fn search(c: &mut Criterion) {
    let mut g = c.benchmark_group("planner");
    g.sample_size(10);
    let cases = [
        ("llama3-70b", "h100x8-nvswitch", "pp=512,tg=128,ctx=4096"),
        ("llama3-8b", "rtx4090x4-pcie", "pp=512,tg=128,ctx=4096"),
        ("smollm2-135m", "h100x8-nvswitch", "pp=128,tg=64,ctx=512"),
    ];
    for (model, cluster, workload) in cases {
        let shape = ModelShape::preset(model).unwrap();
        let cl = Cluster::preset(cluster).unwrap();
        let w = Workload::parse(workload).unwrap();
        g.bench_function(format!("auto {model} on {cluster}"), |b| {
            b.iter(|| auto(&shape, &cl, &w, None).unwrap())
        });
    }
    let shape = ModelShape::preset("llama3-70b").unwrap();
    let cl = Cluster::preset("h100x16-ib").unwrap();
    for workload in ["pp=512,tg=128,ctx=4096", "pp=512,tg=128,batch=64,ctx=4096"] {
        let w = Workload::parse(workload).unwrap();
        g.bench_function(
            format!("auto_devices llama3-70b on h100x16-ib {workload}"),
            |b| b.iter(|| auto_devices(&shape, &cl, &w, None).unwrap()),
        );
        g.bench_function(
            format!("search_layouts llama3-70b on h100x16-ib {workload}"),
            |b| b.iter(|| search_layouts(&shape, &cl, &w, None).unwrap()),
        );
    }
    g.finish();
}

criterion_group!(benches, search);
criterion_main!(benches);
