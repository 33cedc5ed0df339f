//! The planner's hardware figures: the built-in cluster presets (valid, in sane ranges, their
//! ring formulas give the published collective times, JSON round trips) and `calibrate`, which
//! measures this machine (a valid profile with positive finite rates for every weight type and
//! fitted links; a second run agrees with the first within a factor of a few; bad device lists
//! are errors naming them; the binary writes a profile `Cluster::load` reads back).
//!
//! Calibrations here are the quick mode's (about a second each on the 2-core test machine).
//! They run one at a time (a lock), so they do not halve each other's bandwidth.

use metashard::DType;
use metashard::calibrate::{CalibrateOptions, calibrate, calibrate_report};
use metashard::planner::{Cluster, Collective, PRESET_NAMES};
use parking_lot::Mutex;
use std::process::Command;

/// Serializes the tests that measure this machine.
static MEASURING: Mutex<()> = Mutex::new(());

const GIB: f64 = (1u64 << 30) as f64;

fn no_progress(_: &str, _: f64) {}

#[test]
fn presets_validate_and_their_figures_are_in_sane_ranges() {
    assert_eq!(Cluster::preset_names(), PRESET_NAMES);
    assert!(PRESET_NAMES.len() >= 3);
    for name in PRESET_NAMES {
        let c = Cluster::preset(name).unwrap_or_else(|| panic!("{name}"));
        c.validate().unwrap();
        assert!(!c.sources.is_empty(), "{name} cites no source");
        if c.sources[0].starts_with("measured on this project's test machine") {
            measured_preset_is_sane(&c);
            continue;
        }
        assert!(
            c.sources.iter().any(|s| s.contains("https://")),
            "{name}: sources without links"
        );
        for d in &c.devices {
            // 16 to 200 GB of device memory, with headroom below the datasheet's.
            assert!(
                (16e9..200e9).contains(&(d.memory_bytes as f64)),
                "{name} {d:?}"
            );
            // HBM or GDDR: 0.5 to 10 TB/s.
            assert!((0.5e12..10e12).contains(&d.mem_bw), "{name} {}", d.mem_bw);
            for t in DType::WEIGHT_TYPES {
                let g = d.gemv(*t);
                // Reading weights is at most as fast as copying memory, and not much slower.
                assert!(g <= d.mem_bw && g >= 0.5 * d.mem_bw, "{name} {t}: {g}");
                assert!(d.gemv_bw.contains_key(t.name()), "{name}: no gemv {t}");
                let f = d.gemm(*t);
                assert!((1e13..2e15).contains(&f), "{name} {t}: {f}");
            }
            assert!(d.gemm(DType::BF16) > d.gemm(DType::F32), "{name}");
            assert!((1e-7..1e-3).contains(&d.node_overhead_s), "{name}");
            assert!((1e-7..1e-3).contains(&d.step_overhead_s), "{name}");
        }
        // Every level's all-reduce moves bytes at 10 GB/s .. 1 TB/s, latencies 1 us .. 1 ms.
        for l in std::iter::once(&c.links.intra).chain(c.links.inter.as_ref()) {
            for coll in [
                Collective::AllReduce,
                Collective::AllGather,
                Collective::ReduceScatter,
            ] {
                let f = l.fit(coll);
                assert!((10e9..1e12).contains(&f.bus_bw), "{name} {}", l.kind);
                for &(n, a) in &f.alpha_s {
                    assert!(n >= 2 && (1e-6..1e-3).contains(&a), "{name} {n} {a}");
                }
            }
        }
    }
}

/// A preset measured here (`cpu2x2-netns`): CPU-range figures, two levels, and the link
/// between hosts slower than host memory.
fn measured_preset_is_sane(c: &Cluster) {
    let name = &c.name;
    for d in &c.devices {
        assert!(
            (1e9..1e13).contains(&(d.memory_bytes as f64)),
            "{name} {d:?}"
        );
        assert!((1e8..1e12).contains(&d.mem_bw), "{name} {}", d.mem_bw);
        for t in DType::WEIGHT_TYPES {
            assert!((1e8..1e12).contains(&d.gemv(*t)), "{name} {t}");
            assert!((1e9..1e13).contains(&d.gemm(*t)), "{name} {t}");
        }
    }
    let inter = c.links.inter.as_ref().expect("two levels");
    assert!(c.links.devices_per_node < c.n_devices(), "{name}");
    for coll in [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
    ] {
        let (i, o) = (c.links.intra.fit(coll), inter.fit(coll));
        assert!(
            o.bus_bw < i.bus_bw && o.alpha(2) > i.alpha(2),
            "{name} {coll:?}"
        );
        assert!((1e8..1e12).contains(&o.bus_bw) && (1e-8..1e-3).contains(&o.alpha(2)));
    }
}

#[test]
fn preset_collective_times_follow_the_ring_formulas() {
    // 8 H100s on NVSwitch: an all-reduce of 1 GiB moves 2 (7/8) GiB per rank at 365 GB/s, plus
    // the latency at 8 GPUs: NCCL's ring LL model (6.6 us base + 14 steps of 0.6 us, NVIDIA/nccl
    // src/graph/tuning.cc) plus a 4 us launch = 19 us.
    let c = Cluster::preset("h100x8-nvswitch").unwrap();
    assert_eq!(c.n_devices(), 8);
    let t = c.links.time(Collective::AllReduce, 8, GIB);
    let want = 2.0 * 7.0 / 8.0 * GIB / 365e9 + 19e-6;
    assert!((t / want - 1.0).abs() < 1e-9, "{t} vs {want}");
    // About 5.2 ms.
    assert!((5.0e-3..5.4e-3).contains(&t), "{t}");
    // At 2 and 4 GPUs: 6.6 + 2 (N-1) 0.6 + 4 us = 11.8 and 14.2 us.
    let l = &c.links.intra;
    assert!((l.time(Collective::AllReduce, 2, 0.0) - 11.8e-6).abs() < 1e-12);
    assert!((l.time(Collective::AllReduce, 4, 0.0) - 14.2e-6).abs() < 1e-12);
    // Without its launch, the 2-GPU latency (NCCL's model, 7.8 us) is at most 1.5x the one
    // NVIDIA/nccl#1259 measured with CUDA graphs on 2 H100s (5.56 us at 128 B with NVLS).
    let model = l.time(Collective::AllReduce, 2, 0.0) - 4e-6;
    assert!((1.0..1.5).contains(&(model / 5.56e-6)), "{model}");
    // An all-gather of the same bytes moves half as much, (7/8) GiB, in N-1 = 7 ring steps:
    // 6.6 + 7 x 0.6 + 4 = 14.8 us.
    let g = l.time(Collective::AllGather, 8, GIB);
    assert!(
        (g - (7.0 / 8.0 * GIB / 365e9 + 14.8e-6)).abs() < 1e-12,
        "{g}"
    );

    // 4 RTX 4090s on PCIe: 2 (3/4) GiB at 25 GB/s plus 6.6 + 6 x 1.0 + 4 = 16.6 us.
    let c = Cluster::preset("rtx4090x4-pcie").unwrap();
    let t = c.links.time(Collective::AllReduce, 4, GIB);
    let want = 1.5 * GIB / 25e9 + 16.6e-6;
    assert!((t / want - 1.0).abs() < 1e-9, "{t} vs {want}");

    // Two H100 nodes: 8 per node, InfiniBand between them; 16 GPUs cost more than 8 (the
    // inter-node share runs at 47 GB/s), but less than a flat 16-GPU ring at 47 GB/s.
    let c = Cluster::preset("h100x16-ib").unwrap();
    assert_eq!((c.n_devices(), c.links.devices_per_node), (16, 8));
    let inter = c.links.inter.as_ref().expect("two levels");
    assert!((inter.all_reduce.bus_bw - 47e9).abs() < 1.0);
    let (t8, t16) = (
        c.links.time(Collective::AllReduce, 8, GIB),
        c.links.time(Collective::AllReduce, 16, GIB),
    );
    let flat = 2.0 * 15.0 / 16.0 * GIB / 47e9;
    assert!(t16 > t8 && t16 < flat, "{t8} {t16} {flat}");
    // A small all-reduce over the 16 GPUs costs what NVIDIA/nccl#1244 measured on 2 nodes of 8
    // Hopper GPUs on InfiniBand NDR (46.25-47.76 us from 4 B to 512 B).
    let small = c.links.time(Collective::AllReduce, 16, 256.0);
    assert!((46.0e-6..48.0e-6).contains(&small), "{small}");
    // Within one node, the two-node preset is the one-node preset.
    let one = Cluster::preset("h100x8-nvswitch").unwrap();
    assert_eq!(t8, one.links.time(Collective::AllReduce, 8, GIB));
}

#[test]
fn presets_round_trip_through_json_files() {
    let dir = std::env::temp_dir().join(format!("metashard-presets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in PRESET_NAMES {
        let c = Cluster::preset(name).unwrap();
        let path = dir.join(format!("{name}.json"));
        std::fs::write(&path, c.to_json()).unwrap();
        let back = Cluster::load(&path).unwrap();
        assert_eq!(back, c, "{name}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A calibrated profile of `n` devices with sane figures, rates measured for exactly `types`.
fn assert_valid_calibration(c: &Cluster, n: usize, types: &[DType]) {
    c.validate().unwrap();
    assert_eq!(c.n_devices(), n);
    assert_eq!(c.links.devices_per_node, n);
    for d in &c.devices {
        assert!(d.memory_bytes > 0, "{d:?}");
        let pos = |v: f64| v.is_finite() && v > 0.0;
        assert!(pos(d.mem_bw) && pos(d.step_overhead_s) && pos(d.node_overhead_s));
        // A CPU reads memory at 0.1 GB/s .. 1 TB/s.
        assert!((1e8..1e12).contains(&d.mem_bw), "{}", d.mem_bw);
        let mut names: Vec<&str> = d.gemv_bw.keys().map(String::as_str).collect();
        names.sort_unstable();
        let mut want: Vec<&str> = types.iter().map(|t| t.name()).collect();
        want.sort_unstable();
        assert_eq!(names, want, "{d:?}");
        for t in types {
            let g = d.gemv_bw[t.name()];
            let f = d.gemm_flops[t.name()];
            assert!(pos(g) && (1e8..1e12).contains(&g), "gemv {t}: {g}");
            assert!(pos(f) && (1e8..1e13).contains(&f), "gemm {t}: {f}");
        }
        // Overheads of microseconds, not seconds.
        assert!(d.step_overhead_s < 0.1 && d.node_overhead_s < 1e-3, "{d:?}");
        // Attention measured, and far below the F32 GEMM rate on a CPU (a kernel visiting
        // the cache row by row; about a fifth of it on the Zen 2 host).
        let a = d.attn_flops.expect("attention measured");
        assert!(pos(a) && (1e7..1e13).contains(&a), "attention: {a}");
        assert!(
            a < d.gemm_flops["f32"],
            "attention {a} vs {:?}",
            d.gemm_flops
        );
        assert_eq!(d.attention(), a);
    }
}

/// A step factor is what makes the step's prediction its measurement (unless clamped to the
/// range a profile may hold).
fn factor_explains_the_step(st: &metashard::calibrate::RowsStep) {
    let f = st.factor;
    let explained = st.predicted_s + (f - 1.0) * st.predicted_kernels_s;
    let clamped = f == *metashard::planner::STEP_FACTOR.start()
        || f == *metashard::planner::STEP_FACTOR.end();
    assert!(
        clamped || (explained / st.measured_s - 1.0).abs() < 1e-9,
        "{st:?}"
    );
}

fn within(a: f64, b: f64, factor: f64) -> bool {
    a / b <= factor && b / a <= factor
}

#[test]
fn calibrate_quick_gives_a_valid_profile_and_a_second_run_agrees() {
    let _g = MEASURING.lock();
    let opts = CalibrateOptions::quick();
    let seen = Mutex::new(Vec::new());
    let r = calibrate_report("cpu:2x1", &opts, &|what, f| {
        seen.lock().push((what.to_string(), f))
    })
    .unwrap();
    let c = &r.cluster;
    assert_valid_calibration(c, 2, metashard::calibrate::MEASURED_TYPES);
    // Progress went from 0 to 1, in order.
    let seen = seen.into_inner();
    assert!(seen.len() > 5);
    assert!(seen.windows(2).all(|w| w[0].1 <= w[1].1), "{seen:?}");
    assert_eq!(seen.last().unwrap().1, 1.0);
    // Links: all three collectives fitted at N = 2, from every size measured.
    for coll in [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
    ] {
        let f = c.links.intra.fit(coll);
        assert_eq!(f.alpha_s.len(), 1, "{coll:?}");
        assert_eq!(f.alpha_s[0].0, 2);
        assert!(f.alpha_s[0].1 >= 0.0 && f.alpha_s[0].1 < 1e-3, "{f:?}");
        assert!((1e8..1e12).contains(&f.bus_bw), "{coll:?} {}", f.bus_bw);
        let rep = r.links.iter().find(|l| l.collective == coll).unwrap();
        assert!(rep.samples.len() >= 3 && rep.rel_rms.is_finite());
    }
    // The profile says where it comes from.
    assert!(c.sources.iter().any(|s| s.contains("cpu:2x1")));
    // A device alone against both: the small decoder as a layer split, decoding one sequence
    // and a batch, each speedup in 1..=2 devices' worth and what makes the step's prediction
    // its measurement unless clamped; the single figure is the batch's.
    let by_m = &c.alone_speedup_by_m;
    let rows: Vec<usize> = by_m.iter().map(|p| p.0).collect();
    assert_eq!(rows, metashard::calibrate::ALONE_M, "{by_m:?}");
    assert!(by_m.iter().all(|p| (1.0..=2.0).contains(&p.1)), "{by_m:?}");
    assert_eq!(c.alone_speedup, Some(by_m[1].1));
    assert_eq!(r.decoder_stage_steps.len(), by_m.len());
    for (st, &(m, sp)) in r.decoder_stage_steps.iter().zip(by_m) {
        assert_eq!((st.rows, st.speedup), (m, sp));
        assert!(
            st.measured_s > 0.0 && st.scaled_s > 0.0 && st.scaled_s <= st.predicted_s,
            "{st:?}"
        );
        let explained = st.predicted_s - st.scaled_s + st.scaled_s / sp;
        assert!(
            sp == 1.0 || sp == 2.0 || (explained / st.measured_s - 1.0).abs() < 1e-9,
            "{st:?}"
        );
        // A batch of 8 costs more than one sequence's step.
        assert!(m == 1 || st.predicted_s > r.decoder_stage_steps[0].predicted_s);
    }
    // The pipelined batched step: its factor is its measurement over its prediction (unless
    // clamped), and the profile's pipeline factor.
    let p = r
        .decoder_pipeline_step
        .as_ref()
        .expect("a pipelined step on two devices");
    assert_eq!(
        (p.rows, p.micro_batches),
        (
            metashard::calibrate::BATCH_ROWS,
            metashard::calibrate::PIPELINE_MICRO_BATCHES
        )
    );
    assert_eq!(c.pipeline_factor, Some(p.factor));
    assert!(p.measured_s > 0.0 && p.predicted_s > 0.0, "{p:?}");
    let range = metashard::planner::PIPELINE_FACTOR;
    assert!(
        p.factor == *range.start()
            || p.factor == *range.end()
            || (p.factor * p.predicted_s / p.measured_s - 1.0).abs() < 1e-9,
        "{p:?}"
    );
    // Step factors at the one-token step (1: where the per-node correction was fitted), a
    // batched decoding step, a prompt chunk and a batch's prompt chunks in one step, each
    // what makes its prediction its measurement (unless clamped to the range a profile may
    // hold).
    let steps = &c.step_factor_by_m;
    let rows: Vec<usize> = steps.iter().map(|p| p.0).collect();
    let (batch, prompt) = (
        metashard::calibrate::BATCH_ROWS,
        metashard::calibrate::PROMPT_ROWS,
    );
    assert_eq!(rows, [1, batch, prompt, batch * prompt], "{steps:?}");
    assert_eq!(steps[0].1, 1.0);
    assert_eq!(r.decoder_rows_steps.len(), 3);
    for (st, &(m, f)) in r.decoder_rows_steps.iter().zip(&steps[1..]) {
        assert_eq!((st.rows, st.factor), (m, f));
        assert!(metashard::planner::STEP_FACTOR.contains(&f), "{st:?}");
        assert!(
            st.measured_s > 0.0 && st.predicted_kernels_s < st.predicted_s,
            "{st:?}"
        );
        factor_explains_the_step(st);
    }
    // Steps apart: the prompt chunk and the batch of prompt chunks timed with the decoder
    // mirrored, after the tensor split's points below them; each factor what makes its
    // prediction its measurement.
    let apart = &c.step_factor_apart_by_m;
    let rows: Vec<usize> = apart.iter().map(|p| p.0).collect();
    assert_eq!(rows, [1, batch, prompt, batch * prompt], "{apart:?}");
    assert_eq!(apart[..2], steps[..2]);
    assert_eq!(r.decoder_apart_steps.len(), 2);
    for (st, &(m, f)) in r.decoder_apart_steps.iter().zip(&apart[2..]) {
        assert_eq!((st.rows, st.factor), (m, f));
        // Mirrored, every device computes the whole decoder: more kernel time than the
        // tensor split's step of the same rows.
        let tensor = r.decoder_rows_steps.iter().find(|t| t.rows == m).unwrap();
        assert!(
            st.predicted_kernels_s > tensor.predicted_kernels_s,
            "{st:?} {tensor:?}"
        );
        factor_explains_the_step(st);
    }
    // Each row length of the GEMV shapes measured on its own, in increasing K, and the one
    // rate over all of them between the slowest and the fastest.
    for t in metashard::calibrate::MEASURED_TYPES {
        let by_k = &c.devices[0].gemv_bw_by_k[t.name()];
        assert_eq!(
            by_k.len(),
            metashard::calibrate::SHAPES.len(),
            "{t}: {by_k:?}"
        );
        assert!(by_k.windows(2).all(|w| w[0].0 < w[1].0), "{by_k:?}");
        let (lo, hi) = by_k
            .iter()
            .fold((f64::MAX, 0f64), |(l, h), p| (l.min(p.1), h.max(p.1)));
        let all = c.devices[0].gemv_bw[t.name()];
        assert!(
            lo * 0.999 <= all && all <= hi * 1.001,
            "{t}: {all} outside {by_k:?}"
        );
    }
    // A small decoder's decoding steps were run (hundreds of nodes on the critical path), and
    // what they cost beyond the chains' prediction is in node_overhead_s: with the correction
    // the profile prices the step at no less than was measured, to rounding.
    assert!(
        r.decoder_step_s > 0.0 && r.decoder_step_predicted_s > 0.0,
        "{r:?}"
    );
    assert!(r.decoder_step_nodes > 100.0, "{}", r.decoder_step_nodes);
    let extra = (r.decoder_step_s - r.decoder_step_predicted_s).max(0.0) / r.decoder_step_nodes;
    assert!(c.devices[0].node_overhead_s >= extra, "{:?}", c.devices[0]);
    assert!(
        c.sources
            .iter()
            .any(|s| s.contains("small decoder's decoding step"))
    );

    // A second run: device rates and the all-reduce bandwidth within a factor of 5 (two of
    // the types again: the other four would only lengthen the test).
    let two = [DType::F32, DType::Q4_1];
    let opts2 = CalibrateOptions {
        weight_types: two.to_vec(),
        ..CalibrateOptions::quick()
    };
    let r2 = calibrate_report("cpu:2x1", &opts2, &no_progress).unwrap();
    let c2 = &r2.cluster;
    // Bigger collectives take longer, in at least one of the two runs: on a shared 2-core
    // machine a preempted worker can hold the smallest size's median at a scheduler tick
    // (11 ms for 4 KiB was seen in CI) for a whole run, rarely for two.
    for coll in [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
    ] {
        let times = |r: &metashard::calibrate::Calibration| -> Vec<f64> {
            let rep = r.links.iter().find(|l| l.collective == coll).unwrap();
            rep.samples.iter().map(|s| s.seconds).collect()
        };
        let (t1, t2) = (times(&r), times(&r2));
        assert!(
            t1.last() > t1.first() || t2.last() > t2.first(),
            "{coll:?} {t1:?} {t2:?}"
        );
    }
    let (a, b) = (&c.devices[0], &c2.devices[0]);
    for t in two {
        let k = t.name();
        assert!(
            within(a.gemv_bw[k], b.gemv_bw[k], 5.0),
            "gemv {k}: {a:?} {b:?}"
        );
        assert!(within(a.gemm_flops[k], b.gemm_flops[k], 5.0), "gemm {k}");
    }
    assert!(within(a.mem_bw, b.mem_bw, 5.0), "{} {}", a.mem_bw, b.mem_bw);
    let (p, q) = (a.attn_flops.unwrap(), b.attn_flops.unwrap());
    assert!(within(p, q, 5.0), "attention {p} {q}");
    let (x, y) = (
        c.links.intra.all_reduce.bus_bw,
        c2.links.intra.all_reduce.bus_bw,
    );
    assert!(within(x, y, 5.0), "{x} {y}");
}

#[test]
fn calibrate_one_device_has_no_links_to_fit() {
    let _g = MEASURING.lock();
    let opts = CalibrateOptions {
        weight_types: vec![DType::F32, DType::Q4_0],
        ..CalibrateOptions::quick()
    };
    let r = calibrate_report("cpu:1x2", &opts, &no_progress).unwrap();
    let c = &r.cluster;
    c.validate().unwrap();
    assert_eq!(c.n_devices(), 1);
    assert!(r.links.is_empty());
    // One device has no other way to run than whole layers: no steps apart of their own.
    assert!(r.decoder_apart_steps.is_empty() && c.step_factor_apart_by_m.is_empty());
    assert!(c.links.intra.all_reduce.alpha_s.is_empty());
    let d = &c.devices[0];
    assert_eq!(d.gemv_bw.len(), 2);
    assert!(d.gemv_bw["q4_0"] > 0.0 && d.gemm_flops["f32"] > 0.0);
    // Unmeasured types fall back to the F32 figure (`DeviceProfile::gemv`).
    assert_eq!(d.gemv(DType::BF16), d.gemv_bw["f32"]);
}

#[test]
fn bad_device_lists_and_options_are_errors_naming_them() {
    let opts = CalibrateOptions::quick();
    for spec in ["gpu:7", "cpu:0", "cpu:2xq", "", "cpu:99"] {
        let e = calibrate(spec, &opts, &no_progress)
            .unwrap_err()
            .to_string();
        assert!(e.contains(spec.trim()) || spec.is_empty(), "`{spec}`: {e}");
    }
    let bad = CalibrateOptions {
        weight_types: vec![DType::I32],
        ..CalibrateOptions::quick()
    };
    let e = calibrate("cpu:2x1", &bad, &no_progress)
        .unwrap_err()
        .to_string();
    assert!(e.contains("i32") && e.contains("weight type"), "{e}");
    let none = CalibrateOptions {
        weight_types: vec![],
        ..CalibrateOptions::quick()
    };
    assert!(calibrate("cpu:2x1", &none, &no_progress).is_err());
}

fn metashard(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_metashard"))
        .args(args)
        .env_remove("METASHARD_MAX_THREADS")
        .output()
        .unwrap()
}

#[test]
fn the_binary_writes_a_profile_cluster_load_accepts() {
    let _g = MEASURING.lock();
    let dir = std::env::temp_dir().join(format!("metashard-calibrate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("profile.json");
    let p = path.to_str().unwrap();
    // --types: the named types (any case, repeated) and F32, nothing else.
    let o = metashard(&[
        "calibrate",
        "--devices",
        "cpu:2x1",
        "--quick",
        "--types",
        "Q4_K,q8_0,q4_k",
        "-o",
        p,
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{stderr}");
    let c = Cluster::load(&path).unwrap();
    assert_valid_calibration(&c, 2, &[DType::F32, DType::Q4_K, DType::Q8_0]);
    // The table names the weight types measured, the collectives and the file.
    for want in [
        "q4_k",
        "q8_0",
        "all-reduce",
        "reduce-scatter",
        "bus GB/s",
        p,
    ] {
        assert!(stdout.contains(want), "no `{want}` in\n{stdout}");
    }
    assert!(!stdout.contains("q4_1"), "{stdout}");
    std::fs::remove_dir_all(&dir).ok();

    // --json: the profile on stdout, parseable; the table on stderr. --model: F32 and the
    // types of the real Gemma 3 Q4_K_M file's matrices (Q4_K and Q6_K among them), no other.
    let gemma = metashard::models::paths::models_dir().join("gemma3/gemma-3-270m-q4_k_m.gguf");
    let o = metashard(&[
        "calibrate",
        "--devices",
        "cpu:1x1",
        "--quick",
        "--model",
        gemma.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let c: Cluster = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(c.n_devices(), 1);
    let measured = &c.devices[0].gemv_bw;
    for t in ["f32", "q4_k", "q6_k"] {
        assert!(measured.contains_key(t), "{t}: {measured:?}");
    }
    for t in ["bf16", "q4_0", "q4_1"] {
        assert!(!measured.contains_key(t), "{t}: {measured:?}");
    }
    assert!(String::from_utf8_lossy(&o.stderr).contains("GEMV"));
}

#[test]
fn the_binary_refuses_a_bad_device_list_naming_it() {
    let o = metashard(&["calibrate", "--devices", "tpu:3", "--quick"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("tpu:3") && !err.contains("panicked"), "{err}");
    // A directory is not a profile file.
    let dir = std::env::temp_dir();
    let o = metashard(&[
        "calibrate",
        "--devices",
        "cpu:2x1",
        "--quick",
        "-o",
        dir.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--output") && err.contains("directory"),
        "{err}"
    );
    // A name that is no type, or a type no weight is stored in, is refused naming it.
    for bad in ["q9_9", "i32"] {
        let o = metashard(&["calibrate", "--devices", "cpu:2x1", "--types", bad]);
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains(bad) && err.contains("--types") && err.contains("q4_k"),
            "{err}"
        );
    }
    // --types and --model both say which types to measure: not together.
    let o = metashard(&[
        "calibrate",
        "--devices",
        "cpu:2x1",
        "--types",
        "q8_0",
        "--model",
        "smollm2",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--types") && err.contains("--model"),
        "{err}"
    );
    // A model that is none is named before anything is measured.
    let o = metashard(&[
        "calibrate",
        "--devices",
        "cpu:2x1",
        "--model",
        "no-such-model",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("no-such-model") && !err.contains("panicked"),
        "{err}"
    );
    // --json has a help line.
    let o = metashard(&["calibrate", "--help"]);
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(help.contains("--json") && help.contains("Print the profile as JSON"));
}

/// `bench comm --json` rows (src/bench/comm.rs) of an exact alpha-beta link: 2 ranks, all
/// three collectives, four sizes.
fn comm_rows(alpha: f64, bus_bw: f64) -> String {
    let mut rows = Vec::new();
    for (name, coll) in [
        ("all_reduce", Collective::AllReduce),
        ("all_gather", Collective::AllGather),
        ("reduce_scatter", Collective::ReduceScatter),
    ] {
        for bytes in [4096usize, 65536, 1 << 20, 16 << 20] {
            let t = alpha + coll.factor(2) * bytes as f64 / bus_bw;
            rows.push(serde_json::json!({
                "communicator": "mpi(2)", "ranks": 2, "collective": name, "bytes": bytes,
                "median_us": t * 1e6, "busbw_gbs": coll.factor(2) * bytes as f64 / t / 1e9,
            }));
        }
    }
    serde_json::to_string(&rows).unwrap()
}

#[test]
fn calibrate_with_hosts_fits_the_link_between_hosts_from_bench_comm_rows() {
    let dir = std::env::temp_dir().join(format!("metashard-hosts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rows = dir.join("veth.json");
    std::fs::write(&rows, comm_rows(12e-6, 2.5e9)).unwrap();
    let out = dir.join("two-hosts.json");
    let (r, o) = (rows.to_str().unwrap(), out.to_str().unwrap());
    // Wrong combinations and bad files are refused before anything is measured.
    let e = metashard(&["calibrate", "--devices", "cpu:2x1", "--hosts", "2"]);
    let err = String::from_utf8_lossy(&e.stderr);
    assert!(!e.status.success() && err.contains("--inter"), "{err}");
    let missing = dir.join("missing.json");
    let e = metashard(&[
        "calibrate",
        "--devices",
        "cpu:2x1",
        "--hosts",
        "2",
        "--inter",
        missing.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&e.stderr);
    assert!(!e.status.success() && err.contains("missing.json"), "{err}");
    std::fs::write(dir.join("bad.json"), r#"[{"collective": "gather"}]"#).unwrap();
    let bad = dir.join("bad.json");
    let e = metashard(&[
        "calibrate",
        "--devices",
        "cpu:2x1",
        "--hosts",
        "2",
        "--inter",
        bad.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&e.stderr);
    assert!(!e.status.success() && err.contains("gather"), "{err}");

    let _g = MEASURING.lock();
    let args = [
        "calibrate",
        "--devices",
        "cpu:2x1",
        "--quick",
        "--types",
        "f32",
    ];
    let o = metashard(&[&args[..], &["--hosts", "2", "--inter", r, "-o", o]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("between hosts"));
    let c = Cluster::load(&out).unwrap();
    assert_eq!((c.n_devices(), c.links.devices_per_node), (4, 2));
    assert_eq!(c.devices[3].name, "h1.cpu1");
    let inter = c.links.inter.as_ref().expect("a level between hosts");
    for coll in [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
    ] {
        let f = inter.fit(coll);
        assert!((f.bus_bw / 2.5e9 - 1.0).abs() < 1e-6, "{coll:?} {f:?}");
        assert!((f.alpha(2) - 12e-6).abs() < 1e-11, "{coll:?} {f:?}");
    }
    assert!(c.sources.iter().any(|s| s.contains("veth.json")));
    std::fs::remove_dir_all(&dir).ok();
}
