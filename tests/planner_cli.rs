//! `metashard plan`, `run --strategy/--plan` and `bench strategies` through the binary: a plan
//! on a preset prints its table and writes a plan file that `run --plan` executes (the same
//! answer as the built-in split); DOT of layer 0 names its collectives; bad clusters,
//! strategies and plans are errors naming the flag; `bench strategies` reports every strategy
//! predicted against measured (SmolLM2, and the Gemma 3 270M file).
//!
//! One test calibrates inside `bench strategies` (the figures it reports are its
//! calibration's); the others that need a profile of this machine share one quick calibration
//! ([`cpu2_profile`]): they check the planner's and the bench's structure, not the rates, and
//! a calibration each took most of this file's time.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn metashard(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_metashard"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("metashard-planner-cli-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// A quick calibration of cpu:2x1 (F32 and SmolLM2's Q8_0 and Q4_1; other types are priced
/// at the F32 figures), made once for the tests of this file that run on it.
fn cpu2_profile() -> &'static Path {
    static PROFILE: OnceLock<PathBuf> = OnceLock::new();
    PROFILE.get_or_init(|| {
        let p = tmp("shared-cpu2.json");
        let (code, _, err) = metashard(&[
            "calibrate",
            "--devices",
            "cpu:2x1",
            "--quick",
            "--types",
            "q8_0,q4_1",
            "-o",
            p.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        p
    })
}

/// Two hosts of [`cpu2_profile`]'s devices joined by its links: a profile of four devices
/// for `cpu:4x1` without calibrating four devices on this machine's cores.
fn cpu4_profile() -> PathBuf {
    let two = metashard::planner::Cluster::load(cpu2_profile()).unwrap();
    let four = two.with_hosts(2, two.links.intra.clone()).unwrap();
    let p = tmp("shared-cpu4.json");
    std::fs::write(&p, four.to_json()).unwrap();
    p
}

#[test]
fn plan_on_a_preset_prints_tables_and_a_plan_file() {
    let (code, out, err) = metashard(&[
        "plan",
        "--model",
        "llama3-70b",
        "--cluster",
        "h100x8-nvswitch",
    ]);
    assert_eq!(code, 0, "{err}");
    for needle in [
        "strategy auto",
        "blk.0-79",
        "Axis1[1024 x8]",
        "decode:",
        "all-reduce",
        "budget MiB",
        "search candidates",
    ] {
        assert!(out.contains(needle), "lacks {needle:?}:\n{out}");
    }
    // JSON: the plan file.
    let (code, json, err) = metashard(&[
        "plan",
        "--model",
        "llama3-8b",
        "--cluster",
        "rtx4090x4-pcie",
        "--strategy",
        "megatron",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["strategy"], "megatron");
    assert_eq!(v["split"]["layers"].as_array().unwrap().len(), 32);
    assert_eq!(v["devices"].as_array().unwrap().len(), 4);
    assert!(v["evaluation"]["decode"]["seconds"].as_f64().unwrap() > 0.0);
}

#[test]
fn a_plan_file_runs_as_planned_and_dot_shows_the_collectives() {
    let plan = tmp("smol.json");
    let dot = tmp("l0.dot");
    let svg = tmp("l0.svg");
    // A profile of this machine, then a plan for it, written to a file.
    let profile = cpu2_profile();
    let (code, out, err) = metashard(&[
        "plan",
        "--cluster",
        profile.to_str().unwrap(),
        "--strategy",
        "mlp-only",
        "--workload",
        "pp=32,tg=8,ctx=128",
        "-o",
        plan.to_str().unwrap(),
        "--dot",
        dot.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("strategy mlp-only"), "{out}");
    let d = std::fs::read_to_string(&dot).unwrap();
    assert!(d.starts_with("digraph") && d.contains("all_reduce"), "{d}");
    assert!(d.contains("cluster_0") && d.contains("cluster_1"), "{d}");
    // SVG through graphviz, or the DOT beside it when graphviz is missing.
    match std::fs::read_to_string(&svg) {
        Ok(s) => assert!(s.contains("<svg") && s.contains("all_reduce"), "{s}"),
        Err(_) => assert!(svg.with_extension("dot").exists(), "neither SVG nor DOT"),
    }
    // The plan file runs and gives the built-in split's greedy tokens.
    let tokens = |extra: &[&str]| {
        let mut args = vec!["run", "--devices", "cpu:2x1", "-n", "6", "--json"];
        args.extend_from_slice(extra);
        let (code, out, err) = metashard(&args);
        assert_eq!(code, 0, "{args:?}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["tokens"].clone()
    };
    assert_eq!(tokens(&["--plan", plan.to_str().unwrap()]), tokens(&[]));
    // On three devices the same plan is refused, naming the file and the count.
    let (code, _, err) = metashard(&[
        "run",
        "--devices",
        "cpu:3x1",
        "--plan",
        plan.to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("smol.json") && err.contains("2 devices"),
        "{err}"
    );
}

#[test]
fn bad_planner_input_names_the_flag() {
    for (args, needle) in [
        (&["plan", "--cluster", "nowhere-x9"][..], "--cluster"),
        (
            &["plan", "--cluster", "h100x8-nvswitch", "--strategy", "fast"],
            "--strategy",
        ),
        (
            &["plan", "--cluster", "h100x8-nvswitch", "--workload", "pp=x"],
            "--workload",
        ),
        (
            &["plan", "--cluster", "h100x8-nvswitch", "--shares", "1,2,3"],
            "--shares",
        ),
        (&["plan"], "--cluster"),
        (&["run", "--strategy", "fastest"], "--strategy"),
        (&["run", "--plan", "/nonexistent/plan.json"], "plan.json"),
    ] {
        let (code, _, err) = metashard(args);
        assert_ne!(code, 0, "{args:?}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // Nothing fits: the error names the device and the bytes over.
    let (code, _, err) = metashard(&[
        "plan",
        "--model",
        "llama3-70b",
        "--cluster",
        "rtx4090x4-pcie",
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("does not fit") && err.contains("rtx4090"),
        "{err}"
    );
    // A fixed strategy (and the layer split) that does not fit: the plan is printed, with
    // its over-budget devices marked, and the exit status is an error naming the device and
    // the bytes over in GiB.
    for strategy in ["megatron", "layer"] {
        let (code, out, err) = metashard(&[
            "plan",
            "--model",
            "llama3-70b",
            "--cluster",
            "rtx4090x4-pcie",
            "--strategy",
            strategy,
        ]);
        assert_eq!(code, 1, "{strategy}: {out}");
        assert!(out.contains("OVER"), "{strategy}: {out}");
        assert!(
            err.contains(&format!("with strategy {strategy}"))
                && err.contains("device rtx4090-")
                && err.contains(" GiB ("),
            "{strategy}: {err}"
        );
    }
    // One that fits exits 0: `plan_on_a_preset_prints_tables_and_a_plan_file`.
}

#[test]
fn bench_strategies_holds_predictions_against_measurements() {
    let svg = tmp("strategies.svg");
    let (code, out, err) = metashard(&[
        "bench",
        "strategies",
        "--devices",
        "cpu:2x1",
        "--pp",
        "16",
        "--tg",
        "4",
        "--reps",
        "1",
        "--calibrations",
        "2",
        "--svg",
        svg.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["rows"].as_array().unwrap();
    let names: Vec<&str> = rows
        .iter()
        .map(|r| r["strategy"].as_str().unwrap())
        .collect();
    for s in [
        "megatron",
        "mlp-only",
        "attn-only",
        "mirrored",
        "vocab-split",
        "memory",
        "auto",
    ] {
        assert!(names.contains(&s), "{s} missing: {names:?}");
    }
    for r in rows {
        // Weights per device: the prediction is exact (the layer split's rows have none: the
        // `layer` row, and auto's where a loaded host's calibration makes auto pick it).
        if !r["assignment"]
            .as_str()
            .unwrap()
            .starts_with("whole layers")
        {
            assert_eq!(
                r["predicted_weight_bytes"], r["measured_weight_bytes"],
                "{r}"
            );
        }
        assert!(r["measured_tg_tps"].as_f64().unwrap() > 0.0);
        assert!(r["predicted_tg_tps"].as_f64().unwrap() > 0.0);
        // Predicted under both calibrations: the figure is their median (of two, the mean),
        // inside the range of the two.
        for (k, range) in [
            ("predicted_tg_tps", "predicted_tg_range"),
            ("predicted_pp_tps", "predicted_pp_range"),
        ] {
            let (p, lo, hi) = (
                r[k].as_f64().unwrap(),
                r[range][0].as_f64().unwrap(),
                r[range][1].as_f64().unwrap(),
            );
            assert!(lo > 0.0 && lo <= hi, "{r}");
            assert!((p - (lo + hi) / 2.0).abs() <= 1e-9 * hi, "{k}: {r}");
        }
        let each = r["predicted_by_calibration"].as_array().unwrap();
        assert_eq!(each.len(), 2, "{r}");
        let tg: Vec<f64> = each.iter().map(|x| x[1].as_f64().unwrap()).collect();
        assert_eq!(
            tg.iter().copied().fold(f64::INFINITY, f64::min),
            r["predicted_tg_range"][0],
            "{r}"
        );
    }
    // Strategies of one assignment run one program: measured once, the later rows naming the
    // first and carrying its figures (SmolLM2 fits both devices, so `memory` splits as
    // `megatron` does).
    let by_name = |n: &str| rows.iter().find(|r| r["strategy"] == n).unwrap();
    let memory = by_name("memory");
    assert_eq!(memory["assignment"], by_name("megatron")["assignment"]);
    assert_eq!(memory["same_program_as"], "megatron", "{memory}");
    for r in rows {
        if let Some(of) = r["same_program_as"].as_str() {
            let o = by_name(of);
            assert!(o.get("same_program_as").is_none(), "{o}");
            for k in ["measured_tg_tps", "measured_pp_tps"] {
                assert_eq!(r[k], o[k], "{k}: {r} against {o}");
            }
            // The same assignment; auto's says why it was chosen after it (a loaded host's
            // calibration can make auto pick the layer split: "...: predicted faster than the
            // tensor split").
            let (a, b) = (r["assignment"].as_str(), o["assignment"].as_str());
            let (a, b) = (a.unwrap_or_default(), b.unwrap_or_default());
            assert!(a.starts_with(b) || b.starts_with(a), "{r} against {o}");
        }
    }
    let s = &v["summaries"][0];
    assert!(s["spearman_tg"].as_f64().unwrap().is_finite());
    assert_eq!(
        s["median_error_by_calibration_tg"]
            .as_array()
            .unwrap()
            .len(),
        2,
        "{s}"
    );
    // The figures the device set was predicted with, as its calibration measured them on
    // real steps: the step factor at 1 row is 1 (the per-node correction's), 3 more points.
    let profiles = v["profiles"].as_array().unwrap();
    assert_eq!(profiles.len(), 2, "{profiles:?}");
    assert_eq!(profiles[1]["calibration"], 2, "{profiles:?}");
    let p = &profiles[0];
    assert_eq!(p["devices"], "cpu:2x1", "{p}");
    assert_eq!(p["calibration"], 1, "{p}");
    let steps = p["step_factor_by_m"].as_array().unwrap();
    assert_eq!(steps.len(), 4, "{p}");
    assert_eq!(steps[0], serde_json::json!([1, 1.0]), "{p}");
    // And those of steps apart (timed mirrored at the prompt steps' rows).
    let apart = p["step_factor_apart_by_m"].as_array().unwrap();
    assert_eq!(apart.len(), 4, "{p}");
    assert_eq!(apart[..2], steps[..2], "{p}");
    assert!(p["node_overhead_s"].as_f64().unwrap() > 0.0, "{p}");
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(
        plot.starts_with("<svg") && plot.contains("megatron"),
        "{plot}"
    );
}

/// On 4 devices `bench strategies` measures the hybrid split (two groups of two, megatron
/// inside, layers across: what `run --split-mode hybrid` runs) beside the layer and tensor
/// splits, priced by the planner's hybrid split; with fewer devices there is no such row,
/// and asking for it there is not an error (nothing to measure).
#[test]
fn bench_strategies_measures_the_hybrid_split_on_four_devices() {
    let rows = |devices: &str, profile: &Path| {
        let (code, out, err) = metashard(&[
            "bench",
            "strategies",
            "--devices",
            devices,
            "--profile",
            profile.to_str().unwrap(),
            "--pp",
            "8",
            "--tg",
            "3",
            "--reps",
            "1",
            "--strategies",
            "megatron,hybrid",
            "--json",
        ]);
        assert_eq!(code, 0, "{devices}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["rows"].as_array().unwrap().clone()
    };
    let four = rows("cpu:4x1", &cpu4_profile());
    let names: Vec<&str> = four
        .iter()
        .map(|r| r["strategy"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["megatron", "hybrid"], "{four:?}");
    let h = &four[1];
    assert!(
        h["assignment"]
            .as_str()
            .unwrap()
            .contains("--split-mode hybrid --groups 2"),
        "{h}"
    );
    for key in [
        "predicted_pp_tps",
        "measured_pp_tps",
        "predicted_tg_tps",
        "measured_tg_tps",
    ] {
        assert!(h[key].as_f64().unwrap() > 0.0, "{key}: {h}");
    }
    // A group's two devices hold half the layers between them, as megatron's four hold all
    // of them, but the first and last group also hold the embedding and the output split two
    // ways (megatron: four): the largest device holds more (SmolLM2: 44.7 against 25.1 MiB).
    let (hybrid_w, megatron_w) = (
        h["measured_weight_bytes"].as_u64().unwrap(),
        four[0]["measured_weight_bytes"].as_u64().unwrap(),
    );
    assert!(hybrid_w > megatron_w, "{hybrid_w} vs {megatron_w}");
    let two = rows("cpu:2x1", cpu2_profile());
    assert!(two.iter().all(|r| r["strategy"] != "hybrid"), "{two:?}");
}

/// `run --micro-batches N` reaches the session: a layer split's prompt chunk is cut into N
/// (the JSON's `ubatch` is the prompt over N, 128 without the flag);
/// 0, more than 16, or N > 1 on a tensor split are errors naming the flag.
#[test]
fn run_micro_batches_reach_the_session() {
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--devices",
            "cpu:2x1",
            "--split-mode",
            "layer",
            "-n",
            "3",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (code, out, err) = metashard(&args);
        assert_eq!(code, 0, "{args:?}: {err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let (whole, cut) = (run(&[]), run(&["--micro-batches", "4"]));
    let prompt = cut["prompt_tokens"].as_u64().unwrap();
    assert_eq!(cut["ubatch"].as_u64().unwrap(), prompt.div_ceil(4), "{cut}");
    assert_eq!(whole["ubatch"].as_u64().unwrap(), 128, "{whole}");
    for (args, needle) in [
        (&["run", "--micro-batches", "0"][..], "--micro-batches"),
        (
            &[
                "run",
                "--devices",
                "cpu:2x1",
                "--split-mode",
                "layer",
                "--micro-batches",
                "17",
            ],
            "1..=16",
        ),
        (
            &["run", "--devices", "cpu:2x1", "--micro-batches", "2"],
            "--split-mode layer",
        ),
    ] {
        let (code, _, err) = metashard(args);
        assert_ne!(code, 0, "{args:?}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// `bench strategies --batch 1,2` on cpu:2x1: every strategy at each batch size, with a
/// measured layer-split row (its micro-batch counts the planner's), finite positive predicted
/// and measured figures (aggregate decode = per sequence x batch, measured), and a summary per
/// batch size. Structure only, not speed.
#[test]
fn bench_strategies_measures_batches_and_the_layer_split() {
    let (code, out, err) = metashard(&[
        "bench",
        "strategies",
        "--devices",
        "cpu:2x1",
        "--profile",
        cpu2_profile().to_str().unwrap(),
        "--batch",
        "1,2",
        "--pp",
        "8",
        "--tg",
        "2",
        "--reps",
        "1",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["rows"].as_array().unwrap();
    for batch in [1u64, 2] {
        let of: Vec<&serde_json::Value> = rows.iter().filter(|r| r["batch"] == batch).collect();
        assert!(of.len() >= 8, "batch {batch}: {v}");
        let layer = of
            .iter()
            .find(|r| r["strategy"] == "layer")
            .unwrap_or_else(|| panic!("no layer row at batch {batch}: {v}"));
        assert!(layer["tg_micro_batches"].as_u64().unwrap() >= 1, "{layer}");
        assert!(
            layer["tg_micro_batches"].as_u64().unwrap() <= batch,
            "{layer}"
        );
        for r in &of {
            for k in [
                "predicted_pp_tps",
                "measured_pp_tps",
                "predicted_tg_tps",
                "measured_tg_tps",
                "predicted_tg_total_tps",
                "measured_tg_total_tps",
            ] {
                let x = r[k].as_f64().unwrap_or(f64::NAN);
                assert!(x.is_finite() && x > 0.0, "{k} of {r}");
            }
            let (one, all) = (
                r["measured_tg_tps"].as_f64().unwrap(),
                r["measured_tg_total_tps"].as_f64().unwrap(),
            );
            assert!((all - one * batch as f64).abs() <= 1e-9 * all, "{r}");
        }
        let s = v["summaries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["batch"] == batch)
            .unwrap_or_else(|| panic!("no summary for batch {batch}: {v}"));
        for k in [
            "spearman_tg",
            "spearman_pp",
            "median_error_tg",
            "median_error_pp",
            "shape_error_tg",
            "shape_error_pp",
        ] {
            assert!(s[k].as_f64().unwrap().is_finite(), "{k} of {s}");
        }
        // The level is a ratio of positive speeds; the error with it taken out is never more
        // than the error with it plus |level - 1| / level (the triangle inequality per row).
        for k in ["tg", "pp"] {
            let level = s[format!("level_{k}")].as_f64().unwrap();
            let (shape, raw) = (
                s[format!("shape_error_{k}")].as_f64().unwrap(),
                s[format!("median_error_{k}")].as_f64().unwrap(),
            );
            assert!(level.is_finite() && level > 0.0, "level_{k} of {s}");
            assert!(
                shape <= (raw + (level - 1.0).abs()) / level + 1e-9,
                "{k}: {shape} against {raw} at level {level}: {s}"
            );
        }
        assert!(s["auto_within_5pct"].is_boolean(), "{s}");
        // auto's whole workload takes at least the fastest strategy's time.
        let w = s["auto_vs_best_workload"].as_f64().unwrap();
        assert!(w > 0.0 && w <= 1.0, "{s}");
    }
    assert_eq!(v["workloads"].as_array().unwrap().len(), 2, "{v}");
}

/// `bench strategies` on the real Gemma 3 270M Q4_K_M file (K-quants, 4 query heads over 1
/// KV head, a tied 262144 x 640 table) with a few tokens: every strategy loads, runs and is
/// predicted, weights per device exactly, and the strategies that split the output hold the
/// tied table once, split (megatron: 119.9 MiB per device; 289.9 with the table whole on each).
#[test]
fn bench_strategies_runs_the_gemma3_file() {
    let path = metashard::models::paths::models_dir().join("gemma3/gemma-3-270m-q4_k_m.gguf");
    assert!(
        path.is_file(),
        "{} not found (set METASHARD_MODELS or run scripts/fetch_models.sh)",
        path.display()
    );
    let (code, out, err) = metashard(&[
        "bench",
        "strategies",
        "--model",
        path.to_str().unwrap(),
        "--devices",
        "cpu:2x1",
        "--profile",
        cpu2_profile().to_str().unwrap(),
        "--pp",
        "4",
        "--tg",
        "2",
        "--reps",
        "1",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["rows"].as_array().unwrap();
    let bytes = |name: &str| -> u64 {
        let r = rows
            .iter()
            .find(|r| r["strategy"] == name)
            .unwrap_or_else(|| panic!("{name} missing: {v}"));
        r["measured_weight_bytes"].as_u64().unwrap()
    };
    // Seven tensor strategies, auto and the layer split.
    assert_eq!(rows.len(), 9, "{v}");
    for r in rows {
        // The layer split has no predicted per-device weights; `auto` runs it where the
        // planner predicts it faster (on a busy machine's calibration it may).
        let layered = r["assignment"]
            .as_str()
            .is_some_and(|a| a.starts_with("whole layers per device"));
        if r["strategy"] == "layer" || layered {
            continue;
        }
        assert_eq!(
            r["predicted_weight_bytes"], r["measured_weight_bytes"],
            "{r}"
        );
        assert!(r["measured_tg_tps"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["predicted_tg_tps"].as_f64().unwrap() > 0.0, "{r}");
    }
    // The file's weights are 246.6 MB: each of two devices holds about half of them.
    let file = std::fs::metadata(&path).unwrap().len();
    assert!(bytes("megatron") < file * 11 / 20, "{v}");
    assert_eq!(bytes("megatron"), bytes("memory"), "{v}");
    assert!(bytes("mirrored") > bytes("megatron") * 3 / 2, "{v}");
}

#[test]
fn plan_counts_the_layer_split() {
    let base = [
        "plan",
        "--model",
        "smollm2-135m",
        "--cluster",
        "h100x8-nvswitch",
    ];
    let args =
        |extra: &[&'static str]| -> Vec<&str> { base.iter().chain(extra).copied().collect() };
    let (code, out, err) = metashard(&args(&["--strategy", "layer"]));
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("strategy layer") && out.contains("copies of the residual"),
        "{out}"
    );
    // Eight devices, 30 layers: every layer on exactly one device.
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("h100-")).collect();
    assert_eq!(rows.len(), 8, "{out}");
    let (code, out, err) = metashard(&args(&["--strategy", "layer", "--json"]));
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let layers: u64 = v["memory"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["layers"][1].as_u64().unwrap() - m["layers"][0].as_u64().unwrap())
        .sum();
    assert_eq!(layers, 30);
    // The search's plan lists the layer split among the layouts it weighed, with its cost and
    // how it is run.
    let (code, out, err) = metashard(&args(&[]));
    assert_eq!(code, 0, "{err}");
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with("layer split on 8 devices"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        row.contains("run --split-mode layer") && row.contains("% time"),
        "{row}"
    );
    // A layer split has no plan file.
    let (code, _, err) = metashard(&args(&["--strategy", "layer", "-o", "/tmp/x.json"]));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("--strategy") && err.contains("--split-mode layer"),
        "{err}"
    );
    // The hybrid split: 4 groups of 2, every device of a group on the group's layers.
    let (code, out, err) = metashard(&args(&["--strategy", "hybrid", "--groups", "4"]));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("hybrid split: groups of 2 devices"), "{out}");
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("h100-")).collect();
    assert_eq!(rows.len(), 8, "{out}");
    for pair in rows.chunks(2) {
        let layers = |r: &str| r.split_whitespace().nth(1).unwrap().to_string();
        assert_eq!(layers(pair[0]), layers(pair[1]), "{out}");
    }
    // Groups that do not divide the devices, or groups without the hybrid split, are refused.
    for extra in [
        &["--strategy", "hybrid", "--groups", "3"][..],
        &["--groups", "2"][..],
    ] {
        let (code, _, err) = metashard(&args(extra));
        assert_eq!(code, 1, "{extra:?}: {err}");
        assert!(err.contains("--groups"), "{err}");
    }
    // On two nodes the search also weighs the hybrid split over the nodes (tensor inside a
    // node, layers across the nodes), and says what it costs.
    let (code, out, err) = metashard(&["plan", "--model", "llama3-70b", "--cluster", "h100x16-ib"]);
    assert_eq!(code, 0, "{err}");
    let row = out
        .lines()
        .find(|l| l.contains("hybrid split: 2 groups of 8, one per node"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(row.contains("run --split-mode hybrid --groups 2"), "{row}");
    assert!(out.contains("devices: 8 of 16"), "{out}");
    assert!(
        out.contains("layout: tensor split on 8 devices (chosen: the fastest that fits)"),
        "{out}"
    );
    // A batch can be served by copies of the model: two copies of 8 serve 64 sequences
    // fastest, and the plan is one copy's (32 sequences on its 8 devices).
    let (code, out, err) = metashard(&[
        "plan",
        "--model",
        "llama3-70b",
        "--cluster",
        "h100x16-ib",
        "--workload",
        "pp=512,tg=128,batch=64,ctx=4096",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("layout: replicas: 2 x 8 devices, 32 sequences each (chosen")
            && out.contains("serve --plan FILE per copy")
            && out.contains("this plan is one copy's, on its 8 devices")
            && out.contains("(8 devices), workload pp=512,tg=128,batch=32"),
        "{out}"
    );
}

#[test]
fn plan_shows_each_devices_experts() {
    // Qwen3-30B-A3B mirrored on 8 x H100: every device holds all 128 experts of each of the 48
    // layers (3 matrices of 2048 x 768 bf16 each: 57,982,058,496 bytes).
    let args = [
        "plan",
        "--model",
        "qwen3-30b-a3b",
        "--cluster",
        "h100x8-nvswitch",
        "--strategy",
        "mirrored",
        "--routing-skew",
        "1.5",
    ];
    let (code, out, err) = metashard(&args);
    assert_eq!(code, 0, "{err}");
    for needle in [
        "experts: 128 per layer of width 768, 8 per token, routing skew 1.5",
        "per device 128/128/128/128/128/128/128/128 experts, expert weights 55296.0 MiB each",
        "ffn_gate_inp/gate_exps/up_exps",
    ] {
        assert!(out.contains(needle), "lacks {needle:?}:\n{out}");
    }
    let (code, json, err) = metashard(&[&args[..], &["--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let x = &v["experts"];
    assert_eq!(x["n_expert"], 128);
    assert_eq!(x["n_expert_used"], 8);
    assert_eq!(x["routing_skew"], 1.5);
    for d in 0..8 {
        assert_eq!(x["experts"][d], 128, "{x}");
        assert_eq!(x["expert_bytes"][d], 57_982_058_496u64, "{x}");
    }
    // A dense model has no experts; a skew below uniform names the flag.
    let (code, json, err) = metashard(&["plan", "--cluster", "h100x8-nvswitch", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(v.get("experts").is_none());
    let (code, _, err) = metashard(&[
        "plan",
        "--cluster",
        "h100x8-nvswitch",
        "--routing-skew",
        "0.5",
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("--routing-skew"), "{err}");
}

/// `bench strategies --strategies` with a name that is no strategy of the model fails before
/// anything is calibrated, naming the name; so does `plan --routing` with a file that is not
/// `bench model`'s routing, naming the flag.
#[test]
fn bad_strategy_names_and_routing_files_are_errors() {
    let (code, _, err) = metashard(&[
        "bench",
        "strategies",
        "--devices",
        "cpu:2x1",
        "--strategies",
        "megatron,expert-parallel",
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("--strategies"), "{err}");
    assert!(!err.contains("calibrating"), "{err}");
    let dir = std::env::temp_dir().join(format!("routing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("r.json");
    std::fs::write(&f, "{\"rows\": []}").unwrap();
    let (code, _, err) = metashard(&[
        "plan",
        "--model",
        "smollm2",
        "--cluster",
        "h100x8-nvswitch",
        "--routing",
        f.to_str().unwrap(),
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("--routing"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `plan --routing` prices each placement with the skew of its own holders: counts with the
/// first quarter of Qwen3-30B-A3B's 128 experts three times as busy are 2x skewed over 8
/// devices of 16 experts each (expert parallel) and 4/3 over 2 groups of 64 (expert groups).
#[test]
fn counted_routing_is_priced_per_placement() {
    let dir = std::env::temp_dir().join(format!("routing-held-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("r.json");
    let layer: Vec<u64> = (0..128).map(|e| if e < 32 { 3 } else { 1 }).collect();
    let per_layer = vec![layer; 48];
    let body = serde_json::json!({ "routing": { "per_layer": per_layer } });
    std::fs::write(&f, body.to_string()).unwrap();
    let skew = |strategy: &str| {
        let (code, json, err) = metashard(&[
            "plan",
            "--model",
            "qwen3-30b-a3b",
            "--cluster",
            "h100x8-nvswitch",
            "--strategy",
            strategy,
            "--routing",
            f.to_str().unwrap(),
            "--json",
        ]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["experts"]["routing_skew"].as_f64().unwrap()
    };
    let (ep, groups) = (skew("expert-parallel"), skew("expert-groups"));
    assert!((ep - 2.0).abs() < 1e-9, "{ep}");
    assert!((groups - 4.0 / 3.0).abs() < 1e-9, "{groups}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn plan_takes_the_expert_groups_count() {
    // Qwen3-30B-A3B's 128 experts over 4 groups of the 8 H100s: 32 experts per group, each
    // device half of each of its group's experts, so an eighth of all expert bytes (6,912
    // MiB), as under the default 2 groups; the count is checked against the devices and
    // belongs to `--strategy expert-groups` only.
    let base = [
        "plan",
        "--model",
        "qwen3-30b-a3b",
        "--cluster",
        "h100x8-nvswitch",
        "--strategy",
        "expert-groups",
    ];
    let (code, out, err) = metashard(&[&base[..], &["--expert-groups", "4"]].concat());
    assert_eq!(code, 0, "{err}");
    for needle in [
        "whole experts over 4 groups of devices",
        "per device 32/32/32/32/32/32/32/32 experts, expert weights 6912.0 MiB each",
    ] {
        assert!(out.contains(needle), "lacks {needle:?}:\n{out}");
    }
    let (code, out, _) = metashard(&base);
    assert_eq!(code, 0);
    assert!(
        out.contains("whole experts over 2 groups of devices"),
        "{out}"
    );
    for (args, want) in [
        (vec!["--expert-groups", "0"], "--expert-groups 0"),
        (vec!["--expert-groups", "9"], "between 1 and the 8 devices"),
    ] {
        let (code, _, err) = metashard(&[&base[..], &args[..]].concat());
        assert_ne!(code, 0);
        assert!(err.contains(want), "{err}");
    }
    let mut other = base.to_vec();
    other[6] = "megatron";
    let (code, _, err) = metashard(&[&other[..], &["--expert-groups", "2"]].concat());
    assert_ne!(code, 0);
    assert!(err.contains("is for `--strategy expert-groups`"), "{err}");
}

/// Qwen3-235B-A22B's shape (Hugging Face `Qwen/Qwen3-235B-A22B`, `config.json`; the model
/// card's 94 layers, 64 query and 4 KV heads, 128 experts, 8 per token; width 4096 and expert
/// width 1536 give its published 235B parameters, 22B active), the keys the planner reads.
const QWEN3_235B_A22B: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
  "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
  "moe_intermediate_size": 1536, "norm_topk_prob": true, "num_attention_heads": 64,
  "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 94,
  "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 151936
}"#;

/// The search picks experts over groups of devices where that is what cuts them evenly:
/// Qwen3-235B-A22B as the Q4_K_M file (`plan --quantize`, 132 GiB) needs 4 of the 8 H100s;
/// its experts are 1536 wide, 6 Q4_K blocks of 256, so a column/row split inside every expert
/// over 4 devices cuts them 2, 2, 1, 1 blocks (the hottest device reads a third of every
/// routed expert), two groups of two cut each group's experts 3 and 3 (half of the experts
/// routed to the hotter group, about 5 of the 8), and whole experts per device wait for the
/// hottest device's whole experts.
#[test]
fn auto_groups_experts_where_blocks_cut_them_evenly() {
    let f = tmp("qwen3-235b-a22b.json");
    std::fs::write(&f, QWEN3_235B_A22B).unwrap();
    let args = [
        "plan",
        "--model",
        f.to_str().unwrap(),
        "--quantize",
        "q4_k_m",
        "--cluster",
        "h100x8-nvswitch",
        "--workload",
        "pp=512,tg=128,batch=1,ctx=4096",
        "--json",
    ];
    let (code, json, err) = metashard(&args);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        v["devices"].as_array().map(Vec::len),
        Some(4),
        "{}",
        v["layouts"]
    );
    assert_eq!(v["split"]["experts"]["both"]["groups"], 2, "{}", v["split"]);
    assert_eq!(v["experts"]["experts"], serde_json::json!([64, 64, 64, 64]));
    let (code, out, err) = metashard(&args[..args.len() - 1]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("ExpertGroups1[64x[768 x2], 64x[768 x2]]"),
        "{out}"
    );
    // Without --quantize the bf16 checkpoint (438 GiB) takes all 8 devices.
    let (code, json, err) = metashard(&[&args[..3], &args[5..]].concat());
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["devices"].as_array().map(Vec::len), Some(8));
}
