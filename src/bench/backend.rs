//! `bench backend`: one op at a time on any device, through the backend API (a one-node graph,
//! its plan computed again and again, medians): the figures the CUDA issue holds against the
//! hardware and PyTorch. A device-to-device copy (`cont` of 256 MiB f32: bytes read and
//! written per second, the bandwidth the other rows are held against), a chain of 64 `scale`
//! nodes on 256 values (microseconds per node: what launching one costs), GEMM 4096^3 with F16,
//! BF16 and F32 weights (TFLOP/s), and decode GEMV 14336 x 4096 at M = 1 with Q4_0, Q8_0,
//! Q4_K, Q6_K, Q5_0 and F16 weights (weight bytes read per second), and a decoding step's
//! `mul_mat_id` (8 of 128 experts of 768 x 2048, Q4_K and Q8_0: the selected experts' bytes
//! per second; and over a prompt of 512 tokens, 32 pairs per expert: TFLOP/s); the quantized GEMV and `mul_mat_id` cases again on the device opened with 8-bit
//! activations (`Precision::Q8`, labels ending `q8`: the activations' quantization included,
//! once per product). A GEMV-like case's graph holds four products, each over its own copy of the
//! weights, and its time is a quarter of the graph's: one product per synchronization measured
//! the launch and the synchronization as much as the kernel. The same cases run on a CPU
//! device, so the command is tested without a GPU (`--small` shrinks every shape).

use crate::bench::{Repeat, time_it};
use crate::cli::JsonArgs;
use metashard::backend::{Device, alloc_tensors};
use metashard::buffer::Storage;
use metashard::cpu::{CpuOptions, Precision};
use metashard::devices::parse_devices_with;
use metashard::dtype::f32_to_bytes;
use metashard::{DType, Error, Graph, Result, parse_devices};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// Products per timed graph in the GEMV-like cases (see `run_case`).
const COPIES: usize = 4;

#[derive(Clone, Debug, clap::Args)]
#[command(mut_arg("json", |a| a.help("Print the results as JSON instead of a table")))]
pub struct BenchBackendArgs {
    /// Devices to time, one device each (repeat the flag), e.g. `cuda` or `cpu`.
    #[arg(long, default_values_t = vec!["cpu".to_string()])]
    pub devices: Vec<String>,
    /// Shrink every shape (a quick check, not a measurement).
    #[arg(long)]
    pub small: bool,
    /// Only cases whose label contains this text, e.g. "gemv".
    #[arg(long)]
    pub filter: Option<String>,
    /// Seconds of timed repetitions per case (at least 5 repetitions).
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    #[command(flatten)]
    pub out: JsonArgs,
}

/// `bench backend`: check `--seconds`, time every case (progress on stderr), print the table or
/// JSON.
pub fn run(a: &BenchBackendArgs) -> Result<()> {
    if !(a.seconds.is_finite() && a.seconds >= 0.0) {
        return Err(Error::invalid_argument(
            "--seconds",
            a.seconds,
            "a finite, non-negative number of seconds",
        ));
    }
    let opts = BackendBenchOptions {
        devices: a.devices.clone(),
        small: a.small,
        filter: a.filter.clone(),
        min_time: Duration::from_secs_f64(a.seconds),
    };
    let results = measure(&opts, &|line| eprintln!("{line}"))?;
    a.out
        .print("bench backend results", &results, |r| print_table(r))
}

/// What one case measures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    /// `cont` of `n` f32 elements.
    Copy { n: usize },
    /// `mul_mat` of weights `[k, n]` of `dtype` by f32 activations `[k, m]`.
    MulMat {
        dtype: DType,
        k: usize,
        n: usize,
        m: usize,
    },
    /// A chain of `nodes` `scale` ops on `n` f32 values: one tiny kernel each, so the time per
    /// node is what launching a node costs (a decoding step of a small model is hundreds).
    Launches { nodes: usize, n: usize },
    /// `mul_mat_id` of `tokens` tokens by `used` of `experts` expert matrices `[k, n]` of
    /// `dtype` (one token: a decoding step of a mixture of experts, ids `1, 3, 5, ...`; more:
    /// a prompt, token t's ids shifted by 3 t, so every expert gets about as many pairs).
    MulMatId {
        dtype: DType,
        k: usize,
        n: usize,
        experts: usize,
        used: usize,
        tokens: usize,
    },
}

#[derive(Clone, Debug)]
pub struct Case {
    pub label: String,
    pub kind: Kind,
    /// On a device opened with 8-bit activations for quantized weights (`Precision::Q8`, the
    /// CPU's `--q8`; the GPU's integer-dot-product GEMV), labelled `... q8`.
    pub q8: bool,
}

/// The cases, full size or shrunk for tests.
pub fn cases(small: bool) -> Vec<Case> {
    let (copy, g, (gn, gk)) = if small {
        (1 << 16, 64, (128, 256))
    } else {
        (64 << 20, 4096, (14336, 4096))
    };
    let mut v = vec![Case {
        label: if copy * 4 >= 1 << 20 {
            format!("copy f32 {} MiB", (copy * 4) >> 20)
        } else {
            format!("copy f32 {} KiB", (copy * 4) >> 10)
        },
        kind: Kind::Copy { n: copy },
        q8: false,
    }];
    v.push(Case {
        label: "launch: 64 scale nodes of 256 f32".into(),
        kind: Kind::Launches { nodes: 64, n: 256 },
        q8: false,
    });
    for dt in [DType::F16, DType::BF16, DType::F32] {
        v.push(Case {
            label: format!("gemm {dt} {g}^3"),
            kind: Kind::MulMat {
                dtype: dt,
                k: g,
                n: g,
                m: g,
            },
            q8: false,
        });
    }
    let gemv = [
        DType::Q4_0,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q6_K,
        DType::Q5_0,
        DType::F16,
    ];
    for (dt, q8) in gemv
        .iter()
        .map(|&d| (d, false))
        .chain(gemv.iter().filter(|d| d.is_quantized()).map(|&d| (d, true)))
    {
        v.push(Case {
            label: format!("gemv {dt} m=1 {gn}x{gk}{}", if q8 { " q8" } else { "" }),
            kind: Kind::MulMat {
                dtype: dt,
                k: gk,
                n: gn,
                m: 1,
            },
            q8,
        });
    }
    // Qwen3-30B-A3B's expert shape (2048 x 768 at full size), 8 of 128 experts.
    let (ek, en, experts) = if small {
        (256, 64, 16)
    } else {
        (2048, 768, 128)
    };
    // One token (with 8-bit activations too), and a prompt of 512 tokens (32 pairs per
    // expert: products grouped by expert, or each expert read once per pair).
    let prompt = if small { 16 } else { 512 };
    for (tokens, q8) in [(1, false), (1, true), (prompt, false)] {
        for dt in [DType::Q4_K, DType::Q8_0] {
            let what = match (tokens, q8) {
                (1, false) => String::new(),
                (1, true) => " q8".into(),
                _ => format!(" {tokens} tokens"),
            };
            v.push(Case {
                label: format!("mul_mat_id {dt} 8 of {experts} {en}x{ek}{what}"),
                kind: Kind::MulMatId {
                    dtype: dt,
                    k: ek,
                    n: en,
                    experts,
                    used: 8,
                    tokens,
                },
                q8,
            });
        }
    }
    v
}

pub struct BackendBenchOptions {
    pub devices: Vec<String>,
    pub small: bool,
    /// Only cases whose label contains this.
    pub filter: Option<String>,
    pub min_time: Duration,
}

#[derive(Clone, Debug, Serialize)]
pub struct BackendResult {
    pub device: String,
    pub case: String,
    pub median_us: f64,
    /// GB/s (copy: read + written; GEMV: weight bytes), TFLOP/s (GEMM) or microseconds per node
    /// (launches).
    pub rate: f64,
    pub unit: &'static str,
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Time `case` on `device`.
fn run_case(device: &Arc<dyn Device>, case: &Case, min_time: Duration) -> Result<BackendResult> {
    let backend = device.init_backend()?;
    let mut g = Graph::new();
    let inputs: Vec<(&str, DType, [usize; 4])> = match case.kind {
        Kind::Copy { n } | Kind::Launches { n, .. } => vec![("x", DType::F32, [n, 1, 1, 1])],
        Kind::MulMat { dtype, k, n, m } => {
            vec![("w", dtype, [k, n, 1, 1]), ("x", DType::F32, [k, m, 1, 1])]
        }
        Kind::MulMatId {
            dtype,
            k,
            n,
            experts,
            used,
            tokens,
        } => vec![
            ("w", dtype, [k, n, experts, 1]),
            ("x", DType::F32, [k, 1, tokens, 1]),
            ("ids", DType::I32, [used, tokens, 1, 1]),
        ],
    };
    // A GEMV moves too few bytes for one launch per synchronization to show the kernel's rate:
    // its graph holds COPIES products, each with its own copy of the weights (so none is read
    // from the L2 cache the one before filled), and the time is divided by COPIES.
    let copies = match case.kind {
        Kind::MulMat { m, .. } if m <= 8 => COPIES,
        Kind::MulMatId { tokens: 1, .. } => COPIES,
        _ => 1,
    };
    let layouts: Vec<_> = inputs
        .iter()
        .enumerate()
        .flat_map(|(i, &(_, dt, ne))| {
            let n = if i == 0 { copies } else { 1 };
            std::iter::repeat_n(metashard::tensor::Layout::contiguous(dt, ne), n)
        })
        .collect();
    let (buf, offs) = alloc_tensors(device.buffer_type().as_ref(), &layouts)?;
    // Tensor ids per input (the weights' copies first).
    let mut ids: Vec<Vec<_>> = Vec::new();
    let mut at = 0;
    for (i, &(name, dt, ne)) in inputs.iter().enumerate() {
        let bytes = if let (DType::I32, Kind::MulMatId { experts, .. }) = (dt, case.kind) {
            // Expert ids 1, 3, 5, ... (each expert once in a token, none adjacent), token t's
            // shifted by 3 t.
            let e_n = experts as i32;
            (0..ne[1] as i32)
                .flat_map(|t| (0..ne[0] as i32).map(move |e| (2 * e + 1 + 3 * t) % e_n))
                .flat_map(i32::to_le_bytes)
                .collect()
        } else {
            f32_to_bytes(dt, &values(ne.iter().product(), i as u64 + 1))?
        };
        let mut these = Vec::new();
        for c in 0..if i == 0 { copies } else { 1 } {
            let id = g.new_tensor(&format!("{name}{c}"), dt, ne)?;
            let st = Storage::new(buf.clone(), offs[at]);
            st.set(&layouts[at], &bytes)?;
            g.bind(id, st)?;
            these.push(id);
            at += 1;
        }
        ids.push(these);
    }
    if let Kind::Launches { nodes, .. } = case.kind {
        let mut t = ids[0][0];
        for _ in 0..nodes {
            t = g.scale(t, 1.0)?;
        }
        g.set_output(t);
    }
    for c in 0..copies {
        let o = match case.kind {
            Kind::Launches { .. } => break,
            Kind::Copy { .. } => g.cont(ids[0][c])?,
            Kind::MulMat { .. } => g.mul_mat(ids[0][c], ids[1][0])?,
            Kind::MulMatId { .. } => g.mul_mat_id(ids[0][c], ids[1][0], ids[2][0])?,
        };
        g.set_name(o, format!("out{c}"));
    }
    backend.graph_compute(&mut g)?;
    let mut plan = backend.graph_plan(&g)?;
    let mut failed = None;
    // Untimed runs for 200 ms first: an idle GPU runs at a fraction of its clock until busy
    // for a while (an H200 was seen at 345 MHz idle, 1980 MHz under load).
    let warm = std::time::Instant::now();
    while warm.elapsed() < Duration::from_millis(200) {
        plan.compute(0..g.len())?;
    }
    let rep = Repeat {
        warmup: 0,
        min_reps: 5,
        min_time,
        max_reps: 1000,
    };
    let t = time_it(&rep, |_| {
        if failed.is_none()
            && let Err(e) = plan.compute(0..g.len())
        {
            failed = Some(e);
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    let median_us = t.median_us / copies as f64;
    let s = median_us * 1e-6;
    let (rate, unit) = match case.kind {
        Kind::Launches { nodes, .. } => (median_us / nodes as f64, "us/node"),
        Kind::Copy { n } => ((2 * n * 4) as f64 / s / 1e9, "GB/s"),
        Kind::MulMat { dtype, k, n, m } if m <= 8 => {
            (dtype.row_size(k) as f64 * n as f64 / s / 1e9, "GB/s")
        }
        Kind::MulMat { k, n, m, .. } => (2.0 * (k * n * m) as f64 / s / 1e12, "TFLOP/s"),
        // The selected experts' bytes.
        Kind::MulMatId {
            dtype,
            k,
            n,
            used,
            tokens: 1,
            ..
        } => ((dtype.row_size(k) * n * used) as f64 / s / 1e9, "GB/s"),
        Kind::MulMatId {
            k, n, used, tokens, ..
        } => (2.0 * (k * n * used * tokens) as f64 / s / 1e12, "TFLOP/s"),
    };
    Ok(BackendResult {
        device: device.name(),
        case: case.label.clone(),
        median_us,
        rate,
        unit,
    })
}

/// Every case on every device; `progress` gets a line per case.
pub fn measure(opts: &BackendBenchOptions, progress: &dyn Fn(&str)) -> Result<Vec<BackendResult>> {
    let mut out = Vec::new();
    for spec in &opts.devices {
        let devs = parse_devices(spec)?;
        let q8 = parse_devices_with(
            spec,
            CpuOptions {
                precision: Precision::Q8,
            },
        )?;
        let ([device], [device_q8]) = (devs.as_slice(), q8.as_slice()) else {
            return Err(Error::invalid_argument(
                "--devices",
                spec,
                "bench backend times one device at a time (e.g. `cuda` or `cuda:1`, not \
                 `cuda:0x2`)",
            ));
        };
        for case in cases(opts.small) {
            if opts
                .filter
                .as_ref()
                .is_some_and(|f| !case.label.contains(f.as_str()))
            {
                continue;
            }
            progress(&format!("{}: {}", device.name(), case.label));
            let on = if case.q8 { device_q8 } else { device };
            out.push(run_case(on, &case, opts.min_time)?);
        }
    }
    Ok(out)
}

pub fn print_table(results: &[BackendResult]) {
    let w = results
        .iter()
        .map(|r| r.case.len())
        .max()
        .unwrap_or(0)
        .max(28);
    println!(
        "{:<10} {:<w$} {:>12} {:>12}",
        "device", "case", "median us", "rate"
    );
    for r in results {
        println!(
            "{:<10} {:<w$} {:>12.1} {:>8.2} {}",
            r.device, r.case, r.median_us, r.rate, r.unit
        );
    }
}
