//! The examples are part of the docs. `cargo test` compiles every one of them; the two that
//! show library use (`custom_split`, `sched_overhead`) are also run here. The others are
//! benchmarks and probes (`collectives_bench`, `plan_probe`, `workers_latency`), run by hand.

#[path = "../examples/custom_split.rs"]
#[allow(dead_code)]
mod custom_split;

#[path = "../examples/sched_overhead.rs"]
#[allow(dead_code)]
mod sched_overhead;

#[test]
fn sched_overhead_example_runs_all_three_configurations() {
    let rows = sched_overhead::run(1, 2).unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r.name).collect();
    assert_eq!(names, ["plain cpu:1x2", "sched over it", "layer split"]);
    assert_eq!(rows[0].paired, 1.0);
    for r in &rows {
        assert!(r.tps > 0.0 && r.paired > 0.0, "{}", r.name);
        assert!((0.0..1.0).contains(&r.sched_share), "{}", r.name);
    }
    assert_eq!(rows[0].sched_share, 0.0);
}

#[test]
fn custom_split_example_runs_and_reduces_once_per_layer() {
    let (answer, reduces) =
        custom_split::run("cpu:2x1", "What is the capital of France?", 12).unwrap();
    assert!(answer.contains("Paris"), "{answer}");
    // SmolLM2 has 30 layers; only the MLP is split, so one all-reduce per layer.
    assert_eq!(reduces, 30);
}
