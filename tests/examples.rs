//! The examples are part of the docs: each is compiled into this test and run.

#[path = "../examples/custom_split.rs"]
#[allow(dead_code)]
mod custom_split;

#[test]
fn custom_split_example_runs_and_reduces_once_per_layer() {
    let (answer, reduces) =
        custom_split::run("cpu:2x1", "What is the capital of France?", 12).unwrap();
    assert!(answer.contains("Paris"), "{answer}");
    // SmolLM2 has 30 layers; only the MLP is split, so one all-reduce per layer.
    assert_eq!(reduces, 30);
}
