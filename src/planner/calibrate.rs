//! `metashard calibrate`: measure this machine as the cost model sees it, and write it down as
//! a [`Cluster`].
//!
//! The cost model (see `cluster.rs`) prices a matrix product with weights at
//! `weight bytes / gemv_bw[dtype]` when the activations have M <= 8 rows and at
//! `2 M N K / gemm_flops[dtype]` above; any other op at `bytes moved / mem_bw`; every node of a
//! device's program at `node_overhead_s` more, every graph computation at `step_overhead_s`;
//! and collectives by the links' alpha-beta fits. [`calibrate`] measures exactly these
//! quantities, on the devices of a device list opened the way a run opens them (same backend,
//! same precision default, `DeviceSet::open`):
//!
//! - **Device rates** run on all devices of the list at once, each device's graph computed
//!   through its own backend's plan by a [`DeviceWorkers`] worker (pinned as the meta device
//!   pins its workers), so devices that share memory bandwidth are measured sharing it, as in a
//!   tensor-parallel step. Each figure is a median over repeated runs of the time from the
//!   first device starting to the last one finishing (what a step waits for), the same for
//!   every device of the list (they are identical):
//!   - GEMV: M = 1 products over weights shaped like a small decoder's projections
//!     (K = 576, 1536, 2048, 4096; see [`SHAPES`]), repeated until they far exceed the last-level
//!     cache so weights stream from memory as in a decode step; `gemv_bw` = weight bytes per
//!     second of kernel time;
//!   - GEMM: M = 128 products over the same shapes, `gemm_flops` = `2 M N K` per second;
//!   - memory: element-wise adds of large F32 tensors; `mem_bw` = bytes read and written per
//!     second (two sources and the result: the cost model's "bytes moved");
//!   - the per-node cost of a device's program (a chain of tiny nodes), subtracted from the
//!     three above so they are kernel rates.
//! - **Overheads** through the backend a run uses: the device's own for one device, the meta
//!   device's over the whole list for several. A step is timed as a program runs it (graph
//!   built, then `graph_compute`). Chains of 1 and of many tiny nodes run back to back: the
//!   slope is `node_overhead_s` (building, hashing for the plan cache, dispatching and running
//!   one more node). A one-node step after an idle gap ([`STEP_GAP`], as the sampling between
//!   two decode steps leaves the workers parked) gives `step_overhead_s` (the meta dispatch to
//!   every device's worker and back included).
//! - **Links**: for each group size N = 2..=n, [`CpuCommunicator`] ranks on N workers pinned
//!   like the meta device's, timing all-reduce, all-gather and reduce-scatter of F32 tensors of
//!   4 KiB .. 16 MiB (median per size), fitted to `alpha(N) + factor(N) B / bus_bw` by weighted
//!   least squares (relative errors, so the latency-bound small sizes count as much as the
//!   bandwidth-bound large ones; one bus bandwidth for every N, one alpha per N, alphas
//!   constrained to be >= 0). The fit quality (RMS and largest relative residual) is reported.
//!   `factor(N)` is nccl-tests' bus-bandwidth factor (NVIDIA/nccl-tests `doc/PERFORMANCE.md`):
//!   2(N-1)/N for all-reduce, (N-1)/N for gathers and scatters of the full tensor.
//! - **Memory budget**: the host's available memory divided by the device count (what each
//!   CPU device reports as free).
//!
//! Only CPU device lists are calibrated: the links are measured with the host communicator,
//! which is what CPU devices use.

use super::cluster::{Cluster, Collective, CollectiveFit, DeviceProfile, LinkLevel, Links};
use crate::backend::{Device, DeviceKind, GraphPlan, alloc_tensors};
use crate::buffer::{BufferType, Storage};
use crate::collectives::{CpuCommunicator, SliceLayout};
use crate::cpu::{CpuOptions, Precision};
use crate::devices::{DeviceSet, parse_devices_with};
use crate::graph::Graph;
use crate::meta::{MetaOptions, SplitFn};
use crate::split_state::SplitState;
use crate::tensor::Layout;
use crate::workers::{DeviceWorkers, Job, Outcome, Progress};
use crate::{Backend, DType, Error, Result};
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Weight shapes `(K, N)` of the GEMV and GEMM measurements: SmolLM2-135M's FFN projections
/// (576 -> 1536 and back) and a 2048- and a 4096-wide projection cut to N = 1024 rows, a
/// device's share of a split matrix.
pub const SHAPES: [(usize, usize); 4] = [(576, 1536), (1536, 576), (2048, 1024), (4096, 1024)];
/// Activation rows of the GEMV (matrix-vector) measurement.
pub const GEMV_M: usize = 1;
/// Activation rows of the GEMM measurement (a prompt batch; above the cost model's M <= 8).
pub const GEMM_M: usize = 128;
/// Nodes of the short chain the per-node costs are measured against.
const SHORT_CHAIN: usize = 1;
/// F32 elements per tensor of the memory measurement (4 MiB).
const STREAM_ELEMS: usize = 1 << 20;
/// The collectives whose links are measured (broadcast falls back to all-gather's fit).
const LINK_COLLECTIVES: [Collective; 3] = [
    Collective::AllReduce,
    Collective::AllGather,
    Collective::ReduceScatter,
];
/// Idle time before each timed step of the overhead measurement: longer than the workers'
/// spinning (about 20 us, `workers.rs`), as the sampling between two decode steps is, so
/// waking parked workers is part of the step overhead, as in a generation loop.
pub const STEP_GAP: Duration = Duration::from_millis(1);
/// How long a worker may stay inside one measurement before the calibration fails.
const STALL_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a rank waits for its peers in a collective.
const COMM_TIMEOUT: Duration = Duration::from_secs(60);

/// What to measure and how long.
#[derive(Clone, Debug)]
pub struct CalibrateOptions {
    /// Fewer repetitions, smaller sizes and fewer shapes: a few seconds (tests), instead of a
    /// few tens of seconds.
    pub quick: bool,
    /// Precision of products with quantized weights on CPU devices (default: the runs'
    /// default, [`Precision::Exact`]).
    pub precision: Precision,
    /// Weight types whose GEMV and GEMM rates are measured (default: every weight type).
    pub weight_types: Vec<DType>,
}

impl Default for CalibrateOptions {
    fn default() -> Self {
        CalibrateOptions {
            quick: false,
            precision: Precision::default(),
            weight_types: DType::WEIGHT_TYPES.to_vec(),
        }
    }
}

impl CalibrateOptions {
    pub fn quick() -> Self {
        CalibrateOptions {
            quick: true,
            ..Default::default()
        }
    }
}

/// One timed collective: `n` ranks, `bytes` of the full tensor, median seconds per call.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct LinkSample {
    pub n: usize,
    pub bytes: usize,
    pub seconds: f64,
    /// Calls timed (the median is over them).
    pub reps: usize,
}

/// The fit of one collective, with its samples and quality.
#[derive(Clone, Debug, Serialize)]
pub struct LinkFitReport {
    pub collective: Collective,
    pub fit: CollectiveFit,
    pub samples: Vec<LinkSample>,
    /// Root mean square of `(measured - fitted) / measured` over the samples.
    pub rel_rms: f64,
    /// Largest `|measured - fitted| / measured`.
    pub max_rel: f64,
}

/// Everything a calibration measured: the profile and how it was obtained.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    pub spec: String,
    pub quick: bool,
    pub cluster: Cluster,
    /// Seconds per node of a device's own program (its plan run by its worker: no graph
    /// building, no dispatch), the part subtracted from the kernel timings.
    pub kernel_node_s: f64,
    /// Step overhead when steps follow each other without a gap (workers still spinning);
    /// the profile's `step_overhead_s` is measured after an idle gap of [`STEP_GAP`], as in
    /// a generation loop that samples between steps.
    pub step_back_to_back_s: f64,
    /// Weight bytes and nodes of each GEMV graph (per device), by weight type.
    pub gemv_weight_bytes: BTreeMap<String, usize>,
    pub gemv_nodes: BTreeMap<String, usize>,
    /// Long-chain length of the overhead measurements.
    pub chain_nodes: usize,
    pub links: Vec<LinkFitReport>,
    pub seconds: f64,
}

/// Sizes and repetition counts of one mode.
struct Budget {
    /// Bytes of weights streamed per GEMV graph, over all devices.
    gemv_total: usize,
    /// Shapes in the GEMM graph (a prefix of SHAPES).
    gemm_shapes: usize,
    /// Bytes moved per memory graph, over all devices.
    stream_total: usize,
    warmup: usize,
    reps: usize,
    chain: usize,
    step_reps: usize,
    link_sizes: Vec<usize>,
    /// Timed seconds per (N, collective, size), at least `link_min_reps` calls.
    link_time: f64,
    link_min_reps: usize,
}

impl Budget {
    fn new(quick: bool) -> Budget {
        let llc = last_level_cache().unwrap_or(32 << 20);
        if quick {
            Budget {
                gemv_total: (2 * llc).max(32 << 20),
                gemm_shapes: 2,
                stream_total: (2 * llc).max(32 << 20),
                warmup: 1,
                reps: 3,
                chain: 257,
                step_reps: 31,
                link_sizes: vec![4 << 10, 64 << 10, 1 << 20, 4 << 20],
                link_time: 0.01,
                link_min_reps: 5,
            }
        } else {
            Budget {
                gemv_total: (8 * llc).max(128 << 20),
                gemm_shapes: SHAPES.len(),
                stream_total: (8 * llc).max(128 << 20),
                warmup: 2,
                reps: 11,
                chain: 257,
                step_reps: 61,
                link_sizes: vec![
                    4 << 10,
                    16 << 10,
                    64 << 10,
                    256 << 10,
                    1 << 20,
                    4 << 20,
                    16 << 20,
                ],
                link_time: 0.06,
                link_min_reps: 10,
            }
        }
    }
}

/// Bytes of this host's last-level cache (Linux sysfs), if known.
fn last_level_cache() -> Option<usize> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut best = None;
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let Ok(text) = std::fs::read_to_string(e.path().join("size")) else {
            continue;
        };
        let t = text.trim();
        let bytes = if let Some(k) = t.strip_suffix('K') {
            k.parse::<usize>().ok().map(|v| v << 10)
        } else if let Some(m) = t.strip_suffix('M') {
            m.parse::<usize>().ok().map(|v| v << 20)
        } else {
            t.parse::<usize>().ok()
        };
        best = best.max(bytes);
    }
    best
}

/// The host CPU's model name (Linux `/proc/cpuinfo`).
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// Measure the devices of `spec` (`cpu:2x1`, `cpu:1x2`, ...) and their links; see the module
/// doc. `progress(what, fraction done)` is told each step.
pub fn calibrate(
    spec: &str,
    opts: &CalibrateOptions,
    progress: &dyn Fn(&str, f64),
) -> Result<Cluster> {
    Ok(calibrate_report(spec, opts, progress)?.cluster)
}

/// [`calibrate`], with the measurements behind the profile (fit samples and quality, kernel
/// node costs).
pub fn calibrate_report(
    spec: &str,
    opts: &CalibrateOptions,
    progress: &dyn Fn(&str, f64),
) -> Result<Calibration> {
    let start = Instant::now();
    let devices = parse_devices_with(spec, CpuOptions::with_precision(opts.precision))?;
    if let Some(d) = devices.iter().find(|d| d.kind() != DeviceKind::Cpu) {
        return Err(Error::Device {
            device: d.name(),
            reason: format!(
                "calibrate measures CPU device lists only (its links are timed with the host \
                 communicator); `{spec}` has a {:?} device",
                d.kind()
            ),
        });
    }
    if opts.weight_types.is_empty() {
        return Err(Error::invalid_argument(
            "weight types",
            "[]",
            "give at least one weight type to measure",
        ));
    }
    if let Some(t) = opts
        .weight_types
        .iter()
        .find(|t| !DType::WEIGHT_TYPES.contains(t))
    {
        return Err(Error::invalid_argument(
            "weight types",
            t,
            "not a weight type (f32, f16, bf16, q8_0, q4_0, q4_1)",
        ));
    }
    let n = devices.len();
    let budget = Budget::new(opts.quick);
    let link_units = (n - 1) * 3 * budget.link_sizes.len();
    let units = 1 + 2 * opts.weight_types.len() + 1 + 1 + link_units;
    let done = std::cell::Cell::new(0usize);
    let step = |what: &str| {
        progress(what, done.get() as f64 / units as f64);
        done.set(done.get() + 1);
    };

    // Device rates, all devices at once.
    let rates = {
        let mut rig = Rig::new(&devices)?;
        measure_devices(&mut rig, opts, &budget, &step)?
    };
    // Overheads through the backend a run uses.
    step("step and node overheads");
    let over = measure_overheads(spec, opts.precision, &budget)?;
    // Links.
    let mut links = Vec::new();
    let level = if n >= 2 {
        let mut samples: Vec<(Collective, Vec<LinkSample>)> =
            LINK_COLLECTIVES.iter().map(|&c| (c, Vec::new())).collect();
        for world in 2..=n {
            measure_links(world, &budget, &step, &mut samples)?;
        }
        for (c, s) in samples {
            links.push(fit_collective(c, s)?);
        }
        let get = |c: Collective| {
            links
                .iter()
                .find(|l| l.collective == c)
                .map(|l| l.fit.clone())
                .expect("every collective was measured")
        };
        LinkLevel {
            kind: "host memory (in-process CpuCommunicator)".into(),
            all_reduce: get(Collective::AllReduce),
            all_gather: get(Collective::AllGather),
            reduce_scatter: get(Collective::ReduceScatter),
            broadcast: None,
        }
    } else {
        // One device never communicates; the level only keeps the profile valid.
        let fit = CollectiveFit {
            alpha_s: Vec::new(),
            bus_bw: rates.mem_bw,
        };
        LinkLevel {
            kind: "none (one device)".into(),
            all_reduce: fit.clone(),
            all_gather: fit.clone(),
            reduce_scatter: fit,
            broadcast: None,
        }
    };
    progress("done", 1.0);

    let profiles: Vec<DeviceProfile> = devices
        .iter()
        .map(|d| {
            let m = d.memory();
            let memory = if m.free > 0 { m.free } else { m.total };
            DeviceProfile {
                name: d.name(),
                memory_bytes: memory as u64,
                mem_bw: rates.mem_bw,
                gemv_bw: rates.gemv.clone(),
                gemm_flops: rates.gemm.clone(),
                step_overhead_s: over.step_s,
                node_overhead_s: over.node_s,
            }
        })
        .collect();
    let seconds = start.elapsed().as_secs_f64();
    let mode = if opts.quick { "quick" } else { "full" };
    let mut sources = vec![
        format!(
            "measured by `metashard calibrate --devices {spec}` ({mode} mode, {seconds:.1} s) \
             on {} ({} logical CPUs), unix time {}",
            cpu_model(),
            crate::cpu::host_threads(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        ),
        format!(
            "device rates: medians of {} runs of every device computing at once (first start \
             to last finish; the devices of one list are identical and get the same figures); \
             GEMV at M = {GEMV_M}, GEMM at M = {GEMM_M} over (K, N) shapes {:?}; mem_bw from \
             F32 adds (bytes read + written); precision {}",
            budget.reps,
            &SHAPES[..],
            opts.precision
        ),
        format!(
            "overheads: steps built and computed through {}; node_overhead_s is the slope \
             between chains of {SHORT_CHAIN} and {} tiny nodes run back to back, \
             step_overhead_s the cost of a one-node step after {STEP_GAP:?} idle less its \
             node ({:.1} us back to back)",
            if n > 1 {
                "the meta device's backend"
            } else {
                "the device's backend"
            },
            budget.chain,
            over.back_to_back_s * 1e6
        ),
    ];
    for l in &links {
        sources.push(format!(
            "{} fitted to alpha(N) + factor(N) B / bus_bw over {} samples: relative RMS \
             residual {:.1}%, largest {:.1}%",
            l.collective.name(),
            l.samples.len(),
            100.0 * l.rel_rms,
            100.0 * l.max_rel
        ));
    }
    sources.push(
        "ring alpha-beta model and bus-bandwidth factors: NVIDIA/nccl-tests doc/PERFORMANCE.md"
            .into(),
    );
    let cluster = Cluster {
        name: format!("calibrated {spec}"),
        description: format!(
            "{n} logical CPU device{} of `{spec}` on {}, measured by metashard calibrate",
            if n == 1 { "" } else { "s" },
            cpu_model()
        ),
        devices: profiles,
        links: Links {
            devices_per_node: n,
            intra: level,
            inter: None,
        },
        sources,
    };
    cluster.validate()?;
    Ok(Calibration {
        spec: spec.to_string(),
        quick: opts.quick,
        cluster,
        kernel_node_s: rates.kernel_node_s,
        step_back_to_back_s: over.back_to_back_s,
        gemv_weight_bytes: rates.gemv_bytes,
        gemv_nodes: rates.gemv_nodes,
        chain_nodes: budget.chain,
        links,
        seconds,
    })
}

// ---- device rates ------------------------------------------------------------------------

/// Each device's backend and a worker per device (pinned as the meta device pins them).
struct Rig {
    devices: Vec<Arc<dyn Device>>,
    backends: Vec<Arc<dyn Backend>>,
    workers: DeviceWorkers,
}

/// What [`Rig::time`] measured, in seconds per timed run.
struct Timings {
    /// From the first device starting to the last one finishing.
    spans: Vec<f64>,
    /// Each device's own time, every device and run.
    device: Vec<f64>,
}

/// One graph per device, computed once (allocation, uploads, pages touched) and planned.
struct Prepared {
    plans: Vec<Arc<Mutex<Box<dyn GraphPlan>>>>,
    lens: Vec<usize>,
    /// The graphs own the bindings the plans compute over.
    _graphs: Vec<Graph>,
}

impl Rig {
    fn new(devices: &[Arc<dyn Device>]) -> Result<Rig> {
        Ok(Rig {
            backends: devices
                .iter()
                .map(|d| d.init_backend())
                .collect::<Result<_>>()?,
            workers: DeviceWorkers::new(devices.len(), "calibrate")?,
            devices: devices.to_vec(),
        })
    }

    /// `build(device index, its buffer type)` on every device, computed once and planned.
    fn prepare(&self, build: &dyn Fn(usize, &dyn BufferType) -> Result<Graph>) -> Result<Prepared> {
        let (mut plans, mut lens, mut graphs) = (Vec::new(), Vec::new(), Vec::new());
        for (d, (dev, be)) in self.devices.iter().zip(&self.backends).enumerate() {
            let mut g = build(d, dev.buffer_type().as_ref())?;
            be.graph_compute(&mut g)?;
            plans.push(Arc::new(Mutex::new(be.graph_plan(&g)?)));
            lens.push(g.len());
            graphs.push(g);
        }
        Ok(Prepared {
            plans,
            lens,
            _graphs: graphs,
        })
    }

    /// Run every device's plan at the same time, `warmup + reps` times; the seconds of each
    /// timed run, from the first device starting to the last one finishing (what a step
    /// waits for; devices sharing cores or memory slow each other down in it).
    fn time(&mut self, p: &Prepared, warmup: usize, reps: usize) -> Result<Timings> {
        let n = self.devices.len();
        let mut times = Timings {
            spans: Vec::with_capacity(reps),
            device: Vec::with_capacity(n * reps),
        };
        type Span = Option<Result<(Instant, Instant)>>;
        for rep in 0..warmup + reps {
            let slots: Vec<Arc<Mutex<Span>>> = (0..n).map(|_| Arc::new(Mutex::new(None))).collect();
            let jobs: Vec<Job> = (0..n)
                .map(|d| {
                    let (plan, len, slot) = (p.plans[d].clone(), p.lens[d], slots[d].clone());
                    Box::new(move |prog: &Progress| {
                        prog.stage(0, false);
                        let mut plan = plan.lock();
                        let t = Instant::now();
                        let r = plan.compute(0..len).map(|()| (t, Instant::now()));
                        *slot.lock() = Some(r);
                    }) as Job
                })
                .collect();
            match self.workers.run(jobs, STALL_TIMEOUT, &|_| {})? {
                Outcome::Done => {}
                Outcome::Stalled { devices, .. } => {
                    return Err(Error::Device {
                        device: self.devices[devices[0]].name(),
                        reason: format!(
                            "a calibration graph ran longer than {STALL_TIMEOUT:?}; abandoned"
                        ),
                    });
                }
            }
            let mut spans = Vec::with_capacity(n);
            for (d, slot) in slots.iter().enumerate() {
                spans.push(slot.lock().take().unwrap_or_else(|| {
                    Err(Error::Device {
                        device: self.devices[d].name(),
                        reason: "a calibration job returned no timing".into(),
                    })
                })?);
            }
            let first = spans
                .iter()
                .map(|s| s.0)
                .min()
                .expect("at least one device");
            let last = spans
                .iter()
                .map(|s| s.1)
                .max()
                .expect("at least one device");
            if rep >= warmup {
                times.spans.push((last - first).as_secs_f64());
                times
                    .device
                    .extend(spans.iter().map(|s| (s.1 - s.0).as_secs_f64()));
            }
        }
        Ok(times)
    }
}

/// What [`measure_devices`] found (the same for every device of the list).
struct Rates {
    gemv: BTreeMap<String, f64>,
    gemm: BTreeMap<String, f64>,
    mem_bw: f64,
    kernel_node_s: f64,
    gemv_bytes: BTreeMap<String, usize>,
    gemv_nodes: BTreeMap<String, usize>,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// A deterministic value in [-1, 1) (xorshift64*).
fn rand(state: &mut u64) -> f32 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    let v = state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
    v as f32 / (1u64 << 23) as f32 - 1.0
}

fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n).map(|_| rand(&mut s)).collect()
}

/// A chain of `k` tiny nodes (scales of 16 floats) on one input.
fn chain_graph(k: usize) -> Result<Graph> {
    let mut g = Graph::new();
    let mut x = g.input_f32("x", [16, 1, 1, 1], &[0.5; 16])?;
    for _ in 0..k {
        x = g.scale(x, 1.0)?;
    }
    g.set_output(x);
    Ok(g)
}

/// Weights of `dtype` shaped `(K, N)` for each of `shapes`, in one buffer of `bt`, each row a
/// copy of one quantized random row (the values do not change the timing; real-valued rows
/// keep subnormals and NaNs out).
fn weights(
    dtype: DType,
    shapes: &[(usize, usize)],
    tensors: &BTreeMap<(usize, usize), Vec<u8>>,
    bt: &dyn BufferType,
) -> Result<Vec<(Layout, Storage)>> {
    let layouts: Vec<Layout> = shapes
        .iter()
        .map(|&(k, n)| Layout::contiguous(dtype, [k, n, 1, 1]))
        .collect();
    let (buf, offs) = alloc_tensors(bt, &layouts)?;
    let mut out = Vec::with_capacity(shapes.len());
    for ((l, off), shape) in layouts.into_iter().zip(offs).zip(shapes) {
        let st = Storage::new(buf.clone(), off);
        st.set(&l, &tensors[shape])?;
        out.push((l, st));
    }
    Ok(out)
}

/// The bytes of one `(K, N)` weight of `dtype`: a random row repeated N times.
fn tensor_bytes(dtype: DType, k: usize, n: usize) -> Result<Vec<u8>> {
    let mut row = vec![0u8; dtype.row_size(k)];
    crate::dtype::row_from_f32(dtype, &random_f32(k, k as u64), &mut row)?;
    Ok(row.repeat(n))
}

/// A graph of one `mul_mat` per weight, activations of `m` rows per K.
fn matmul_graph(dtype: DType, w: &[(Layout, Storage)], m: usize) -> Result<Graph> {
    let mut g = Graph::new();
    let mut xs: BTreeMap<usize, crate::TensorId> = BTreeMap::new();
    for (i, (l, st)) in w.iter().enumerate() {
        let k = l.ne[0];
        let x = match xs.get(&k) {
            Some(&x) => x,
            None => {
                let x = g.input_f32(&format!("x{k}"), [k, m, 1, 1], &random_f32(k * m, 7))?;
                xs.insert(k, x);
                x
            }
        };
        let wid = g.weight(&format!("w{i}"), dtype, l.ne)?;
        g.bind(wid, st.clone())?;
        g.mul_mat(wid, x)?;
    }
    Ok(g)
}

/// Kernel seconds of a graph of `nodes` nodes that ran in `t` seconds, on a device whose
/// program costs `node_s` per node (the cost is removed unless it would leave less than half).
fn kernel_time(t: f64, nodes: usize, node_s: f64) -> f64 {
    let k = t - nodes as f64 * node_s;
    if k > 0.5 * t { k } else { t }
}

fn measure_devices(
    rig: &mut Rig,
    opts: &CalibrateOptions,
    b: &Budget,
    step: &dyn Fn(&str),
) -> Result<Rates> {
    let n = rig.devices.len();
    // Per-node cost of a device's program: the slope between a short and a long chain.
    step("per-node cost of a device program");
    let short = rig.prepare(&|_, _| chain_graph(SHORT_CHAIN))?;
    let long = rig.prepare(&|_, _| chain_graph(b.chain))?;
    let (ts, tl) = (
        rig.time(&short, b.warmup, b.reps * 3)?,
        rig.time(&long, b.warmup, b.reps * 3)?,
    );
    // Each device's own time: the dispatch skew between devices is not a cost of its nodes.
    let kernel_node_s =
        ((median(&tl.device) - median(&ts.device)) / (b.chain - SHORT_CHAIN) as f64).max(0.0);
    drop((short, long));
    let mut r = Rates {
        gemv: BTreeMap::new(),
        gemm: BTreeMap::new(),
        mem_bw: 0.0,
        kernel_node_s,
        gemv_bytes: BTreeMap::new(),
        gemv_nodes: BTreeMap::new(),
    };
    let per_device_gemv = (b.gemv_total / n).max(8 << 20);
    for &dt in &opts.weight_types {
        // GEMV: the shapes in turn until the device's weights reach its share of the total.
        step(&format!("GEMV {dt} (M = {GEMV_M})"));
        let cycle: usize = SHAPES.iter().map(|&(k, m)| dt.row_size(k) * m).sum();
        let cycles = per_device_gemv.div_ceil(cycle).max(1);
        let shapes: Vec<(usize, usize)> = (0..cycles).flat_map(|_| SHAPES).collect();
        let mut tensors = BTreeMap::new();
        for &(k, m) in &SHAPES {
            tensors.insert((k, m), tensor_bytes(dt, k, m)?);
        }
        let p = rig.prepare(&|_, bt| {
            let w = weights(dt, &shapes, &tensors, bt)?;
            matmul_graph(dt, &w, GEMV_M)
        })?;
        let t = rig.time(&p, b.warmup, b.reps)?;
        drop(p);
        let bytes = cycles * cycle;
        let k = kernel_time(median(&t.spans), shapes.len(), kernel_node_s);
        r.gemv.insert(dt.name().into(), bytes as f64 / k);
        r.gemv_bytes.insert(dt.name().into(), bytes);
        r.gemv_nodes.insert(dt.name().into(), shapes.len());
        // GEMM: one copy of the first shapes (compute-bound, the weights may stay cached).
        step(&format!("GEMM {dt} (M = {GEMM_M})"));
        let shapes = &SHAPES[..b.gemm_shapes];
        let flops: f64 = shapes
            .iter()
            .map(|&(k, m)| 2.0 * (GEMM_M * k * m) as f64)
            .sum();
        let p = rig.prepare(&|_, bt| {
            let w = weights(dt, shapes, &tensors, bt)?;
            matmul_graph(dt, &w, GEMM_M)
        })?;
        let t = rig.time(&p, b.warmup, b.reps)?;
        drop(p);
        let k = kernel_time(median(&t.spans), shapes.len(), kernel_node_s);
        r.gemm.insert(dt.name().into(), flops / k);
    }
    // Memory: F32 adds of distinct 4 MiB tensors, results kept (outputs), so every byte comes
    // from and goes to memory.
    step("memory bandwidth (F32 adds)");
    let moved_per_add = 3 * 4 * STREAM_ELEMS;
    let adds = ((b.stream_total / n).max(8 << 20)).div_ceil(moved_per_add);
    let p = rig.prepare(&|_, bt| {
        let l = Layout::contiguous(DType::F32, [STREAM_ELEMS, 1, 1, 1]);
        let (buf, offs) = alloc_tensors(bt, &vec![l; 2 * adds])?;
        let ones = crate::dtype::as_bytes(&vec![1.0f32; STREAM_ELEMS]).to_vec();
        let mut g = Graph::new();
        for i in 0..adds {
            let mut ids = Vec::with_capacity(2);
            for j in 0..2 {
                let st = Storage::new(buf.clone(), offs[2 * i + j]);
                st.set(&l, &ones)?;
                let id = g.new_tensor(&format!("s{i}.{j}"), DType::F32, l.ne)?;
                g.bind(id, st)?;
                ids.push(id);
            }
            let c = g.add(ids[0], ids[1])?;
            g.set_output(c);
        }
        Ok(g)
    })?;
    let t = rig.time(&p, b.warmup, b.reps)?;
    let k = kernel_time(median(&t.spans), adds, kernel_node_s);
    r.mem_bw = (adds * moved_per_add) as f64 / k;
    Ok(r)
}

// ---- overheads ---------------------------------------------------------------------------

/// Every tensor mirrored: the chains have no weights, so this is never asked; a run's split
/// would be.
fn mirrored() -> SplitFn {
    Arc::new(|t| Ok(SplitState::mirrored(t.n_devices)))
}

struct Overheads {
    step_s: f64,
    node_s: f64,
    back_to_back_s: f64,
}

/// Step and node overheads through the backend `DeviceSet::open` gives for `spec` (each step
/// timed as a program runs it: graph built, then computed). The per-node cost is the slope
/// between the fastest chains of [`SHORT_CHAIN`] and `b.chain` nodes run back to back; the
/// step overhead
/// is that of a one-node step after an idle gap of [`STEP_GAP`] (workers parked, as between
/// two decode steps), less its node.
fn measure_overheads(spec: &str, precision: Precision, b: &Budget) -> Result<Overheads> {
    let set = DeviceSet::open(spec, precision, MetaOptions::default(), |_| mirrored())?;
    let (mut gap, mut short, mut long) = (Vec::new(), Vec::new(), Vec::new());
    let timed = |k: usize| -> Result<f64> {
        let t = Instant::now();
        let mut g = chain_graph(k)?;
        set.backend.graph_compute(&mut g)?;
        Ok(t.elapsed().as_secs_f64())
    };
    // The series interleave, so a drift in machine speed hits all of them alike.
    for rep in 0..b.step_reps + 3 {
        std::thread::sleep(STEP_GAP);
        let g = timed(SHORT_CHAIN)?;
        let s = timed(SHORT_CHAIN)?;
        let l = timed(b.chain)?;
        if rep >= 3 {
            gap.push(g);
            short.push(s);
            long.push(l);
        }
    }
    // The per-node cost is work done every time; interference (a worker that shares its core
    // with the caller, another process) is not, so the slope is taken between the fastest
    // steps of each length. The overheads are medians: interference is part of a step.
    let fastest = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let node_s = ((fastest(&long) - fastest(&short)) / (b.chain - SHORT_CHAIN) as f64).max(0.0);
    let own = SHORT_CHAIN as f64 * node_s;
    Ok(Overheads {
        step_s: (median(&gap) - own).max(0.0),
        node_s,
        back_to_back_s: (median(&short) - own).max(0.0),
    })
}

// ---- links -------------------------------------------------------------------------------

/// A 64-byte aligned, 64-byte granular line of host memory.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// A buffer of whole lines, viewed as bytes.
struct Lines(Vec<Line>);

impl Lines {
    fn filled(bytes: usize, v: f32) -> Lines {
        Lines(vec![Line([v; 16]); bytes.div_ceil(64)])
    }
    fn bytes(&mut self) -> &mut [u8] {
        let len = self.0.len() * 64;
        // SAFETY: the vector owns `len` initialized bytes (Line is 64 bytes of f32, no
        // padding), borrowed exclusively here; any byte pattern is a valid f32.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u8>(), len) }
    }
}

/// A rank's buffers: all-reduce's buffer; all-gather's local and full; reduce-scatter's full
/// and local.
struct RankBufs {
    a: Lines,
    b: Lines,
}

/// Time one collective of `bytes` (full tensor) on `world` ranks, `reps` calls after
/// `warmup`; per call, the slowest rank's seconds.
fn time_collective(
    workers: &mut DeviceWorkers,
    comm: &Arc<CpuCommunicator>,
    c: Collective,
    bufs: &Arc<Vec<Mutex<RankBufs>>>,
    layout: &Arc<SliceLayout>,
    calls: usize,
) -> Result<Vec<f64>> {
    let world = bufs.len();
    let results: Vec<Arc<Mutex<Result<Vec<f64>>>>> = (0..world)
        .map(|_| Arc::new(Mutex::new(Ok(Vec::new()))))
        .collect();
    let jobs: Vec<Job> = (0..world)
        .map(|r| {
            let (comm, bufs, layout, out) = (
                comm.clone(),
                bufs.clone(),
                layout.clone(),
                results[r].clone(),
            );
            Box::new(move |prog: &Progress| {
                prog.stage(0, true);
                let mut guard = bufs[r].lock();
                let RankBufs { a, b } = &mut *guard;
                let mut times = Vec::with_capacity(calls);
                for _ in 0..calls {
                    let t = Instant::now();
                    let res = match c {
                        Collective::AllReduce => comm.all_reduce(r, a.bytes(), DType::F32),
                        Collective::AllGather => {
                            let local = &a.bytes()[..layout.local_bytes(r)];
                            comm.all_gather(
                                r,
                                local,
                                &mut b.bytes()[..layout.full_bytes()],
                                &layout,
                            )
                        }
                        Collective::ReduceScatter => comm.reduce_scatter(
                            r,
                            &a.bytes()[..layout.full_bytes()],
                            &mut b.bytes()[..layout.local_bytes(r)],
                            &layout,
                            DType::F32,
                        ),
                        Collective::Broadcast => comm.broadcast(r, 0, a.bytes()),
                    };
                    if let Err(e) = res {
                        *out.lock() = Err(e);
                        return;
                    }
                    times.push(t.elapsed().as_secs_f64());
                }
                *out.lock() = Ok(times);
            }) as Job
        })
        .collect();
    match workers.run(jobs, STALL_TIMEOUT, &|_| {})? {
        Outcome::Done => {}
        Outcome::Stalled { devices, .. } => {
            return Err(Error::Collective {
                collective: "calibrate",
                rank: devices[0],
                world,
                reason: format!("a timed {} stalled", c.name()),
            });
        }
    }
    let mut per_rank = Vec::with_capacity(world);
    for r in results {
        per_rank.push(std::mem::replace(&mut *r.lock(), Ok(Vec::new()))?);
    }
    Ok((0..calls)
        .map(|i| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect())
}

fn measure_links(
    world: usize,
    b: &Budget,
    step: &dyn Fn(&str),
    samples: &mut [(Collective, Vec<LinkSample>)],
) -> Result<()> {
    let comm = Arc::new(CpuCommunicator::with_timeout(world, COMM_TIMEOUT)?);
    let mut workers = DeviceWorkers::new(world, "calibrate-link")?;
    for (c, out) in samples.iter_mut() {
        let c = *c;
        for &size in &b.link_sizes {
            step(&format!("{} N={world} {}", c.name(), human_bytes(size)));
            // Whole 64-byte lines per rank, so every rank's slice is whole F32 elements.
            let bytes = size.next_multiple_of(64 * world);
            let per_rank = bytes / world;
            let layout = Arc::new(SliceLayout::single(1, 4, &vec![per_rank / 4; world])?);
            // Fill with -0.0: pages really allocated (no shared zero page), and sums of -0.0
            // stay -0.0 however many all-reduces run in place.
            let bufs: Arc<Vec<Mutex<RankBufs>>> = Arc::new(
                (0..world)
                    .map(|_| {
                        let (a, b) = match c {
                            Collective::AllGather => (per_rank, bytes),
                            Collective::ReduceScatter => (bytes, per_rank),
                            _ => (bytes, 0),
                        };
                        Mutex::new(RankBufs {
                            a: Lines::filled(a, -0.0),
                            b: Lines::filled(b, -0.0),
                        })
                    })
                    .collect(),
            );
            let warm = time_collective(&mut workers, &comm, c, &bufs, &layout, 3)?;
            let est = median(&warm).max(1e-7);
            let reps = ((b.link_time / est) as usize).clamp(b.link_min_reps, 2000);
            let t = time_collective(&mut workers, &comm, c, &bufs, &layout, reps)?;
            out.push(LinkSample {
                n: world,
                bytes,
                seconds: median(&t),
                reps,
            });
        }
    }
    Ok(())
}

fn human_bytes(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else {
        format!("{} KiB", b >> 10)
    }
}

/// Solve `a x = y` (square, small, columns scaled to unit norm) by Gaussian elimination with
/// partial pivoting; `None` when singular (a pivot below 1e-10).
fn solve(mut a: Vec<Vec<f64>>, mut y: Vec<f64>) -> Option<Vec<f64>> {
    let n = y.len();
    for col in 0..n {
        let piv = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[piv][col].abs() < 1e-10 {
            return None;
        }
        a.swap(col, piv);
        y.swap(col, piv);
        let (top, rest) = a.split_at_mut(col + 1);
        let pivot = &top[col];
        for (r, row) in rest.iter_mut().enumerate() {
            let f = row[col] / pivot[col];
            for (x, p) in row[col..].iter_mut().zip(&pivot[col..]) {
                *x -= f * p;
            }
            y[col + 1 + r] -= f * y[col];
        }
    }
    let mut x = vec![0.0; n];
    for row in (0..n).rev() {
        let s: f64 = (row + 1..n).map(|k| a[row][k] * x[k]).sum();
        x[row] = (y[row] - s) / a[row][row];
    }
    Some(x)
}

/// Fit `t = alpha(N) + factor(N) B / bus_bw` to `samples` (one alpha per N, one bus bandwidth)
/// by least squares on relative errors (each sample's equation divided by its time), with the
/// alphas constrained to be >= 0 (a negative one is pinned to 0 and the rest refitted).
pub fn fit_collective(c: Collective, samples: Vec<LinkSample>) -> Result<LinkFitReport> {
    let bad = |reason: String| Error::Collective {
        collective: "calibrate fit",
        rank: 0,
        world: samples.iter().map(|s| s.n).max().unwrap_or(0),
        reason: format!("{}: {reason}", c.name()),
    };
    if samples.is_empty() {
        return Err(bad("no samples".into()));
    }
    if samples
        .iter()
        .any(|s| !(s.seconds.is_finite() && s.seconds > 0.0) || s.n < 2)
    {
        return Err(bad(
            "every sample needs a positive time and at least 2 ranks".into(),
        ));
    }
    let mut ns: Vec<usize> = samples.iter().map(|s| s.n).collect();
    ns.sort_unstable();
    ns.dedup();
    // Columns: alpha of each N (free unless pinned to 0), then beta = 1 / bus_bw.
    let mut pinned = vec![false; ns.len()];
    let (alphas, beta) = loop {
        let free: Vec<usize> = (0..ns.len()).filter(|&i| !pinned[i]).collect();
        let cols = free.len() + 1;
        let mut ata = vec![vec![0.0; cols]; cols];
        let mut aty = vec![0.0; cols];
        for s in &samples {
            let w = 1.0 / s.seconds;
            let mut row = vec![0.0; cols];
            if let Some(j) = free.iter().position(|&i| ns[i] == s.n) {
                row[j] = w;
            }
            row[cols - 1] = c.factor(s.n) * s.bytes as f64 * w;
            for i in 0..cols {
                aty[i] += row[i] * s.seconds * w;
                for j in 0..cols {
                    ata[i][j] += row[i] * row[j];
                }
            }
        }
        // Scale the columns to unit norm (the alpha and bandwidth columns differ by orders of
        // magnitude), so a near-singular system is recognized as such.
        let scale: Vec<f64> = (0..cols).map(|i| ata[i][i].sqrt().max(1e-300)).collect();
        for i in 0..cols {
            aty[i] /= scale[i];
            for j in 0..cols {
                ata[i][j] /= scale[i] * scale[j];
            }
        }
        let x = solve(ata, aty).ok_or_else(|| {
            bad("the samples do not determine the fit (give at least two sizes per N)".into())
        })?;
        let x: Vec<f64> = x.iter().zip(&scale).map(|(v, s)| v / s).collect();
        let mut alphas = vec![0.0; ns.len()];
        for (j, &i) in free.iter().enumerate() {
            alphas[i] = x[j];
        }
        match free
            .iter()
            .copied()
            .filter(|&i| alphas[i] < 0.0)
            .min_by(|&i, &j| alphas[i].total_cmp(&alphas[j]))
        {
            Some(i) => pinned[i] = true,
            None => break (alphas, x[cols - 1]),
        }
    };
    let bus_bw = if beta > 0.0 {
        1.0 / beta
    } else {
        // No bandwidth term (all sizes latency-bound): the best rate any sample reached.
        samples
            .iter()
            .map(|s| c.factor(s.n) * s.bytes as f64 / s.seconds)
            .fold(0.0, f64::max)
    };
    let fit = CollectiveFit {
        alpha_s: ns.iter().copied().zip(alphas).collect(),
        bus_bw,
    };
    let rel: Vec<f64> = samples
        .iter()
        .map(|s| {
            let pred = fit.alpha(s.n) + c.factor(s.n) * s.bytes as f64 / fit.bus_bw;
            (s.seconds - pred) / s.seconds
        })
        .collect();
    let rel_rms = (rel.iter().map(|r| r * r).sum::<f64>() / rel.len() as f64).sqrt();
    let max_rel = rel.iter().map(|r| r.abs()).fold(0.0, f64::max);
    Ok(LinkFitReport {
        collective: c,
        fit,
        samples,
        rel_rms,
        max_rel,
    })
}

/// One level of links from collectives timed elsewhere, e.g. `metashard bench comm --json`
/// between two hosts: all-reduce, all-gather and reduce-scatter each fitted by
/// [`fit_collective`] (a broadcast is left to the all-gather's fit, as [`LinkLevel::fit`]
/// does). Every one of the three needs samples of at least two sizes; an error names the one
/// that has none.
pub fn fit_level(
    kind: &str,
    samples: &[(Collective, LinkSample)],
) -> Result<(LinkLevel, Vec<LinkFitReport>)> {
    let mut reports = Vec::with_capacity(3);
    for c in [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
    ] {
        let mine: Vec<LinkSample> = samples
            .iter()
            .filter(|(k, _)| *k == c)
            .map(|&(_, s)| s)
            .collect();
        reports.push(fit_collective(c, mine)?);
    }
    let level = LinkLevel {
        kind: kind.to_string(),
        all_reduce: reports[0].fit.clone(),
        all_gather: reports[1].fit.clone(),
        reduce_scatter: reports[2].fit.clone(),
        broadcast: None,
    };
    Ok((level, reports))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(alpha: &[(usize, f64)], bw: f64, c: Collective, noise: f64) -> Vec<LinkSample> {
        let mut v = Vec::new();
        let mut seed = 3u64;
        for &(n, a) in alpha {
            for bytes in [4096usize, 65536, 1 << 20, 16 << 20] {
                let t = a + c.factor(n) * bytes as f64 / bw;
                v.push(LinkSample {
                    n,
                    bytes,
                    seconds: t * (1.0 + noise * rand(&mut seed) as f64),
                    reps: 1,
                });
            }
        }
        v
    }

    #[test]
    fn exact_samples_give_back_the_model() {
        let alpha = [(2, 5e-6), (3, 9e-6), (4, 12e-6)];
        let r = fit_collective(
            Collective::AllReduce,
            samples(&alpha, 8e9, Collective::AllReduce, 0.0),
        )
        .unwrap();
        assert!((r.fit.bus_bw / 8e9 - 1.0).abs() < 1e-6, "{}", r.fit.bus_bw);
        for ((n, a), (m, b)) in alpha.iter().zip(&r.fit.alpha_s) {
            assert_eq!(n, m);
            assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        }
        assert!(r.rel_rms < 1e-9 && r.max_rel < 1e-9);
    }

    #[test]
    fn noisy_samples_fit_within_the_noise_and_alphas_stay_non_negative() {
        let r = fit_collective(
            Collective::AllGather,
            samples(&[(2, 2e-6)], 5e9, Collective::AllGather, 0.05),
        )
        .unwrap();
        assert!((r.fit.bus_bw / 5e9 - 1.0).abs() < 0.2, "{}", r.fit.bus_bw);
        assert!(r.max_rel < 0.15, "{}", r.max_rel);
        // Pure bandwidth (alpha 0) with noise: a negative alpha would be pinned to 0.
        let r = fit_collective(
            Collective::AllGather,
            samples(&[(2, 0.0)], 5e9, Collective::AllGather, 0.05),
        )
        .unwrap();
        assert!(r.fit.alpha_s[0].1 >= 0.0);
    }

    #[test]
    fn too_few_samples_are_an_error_naming_the_collective() {
        let e = fit_collective(Collective::ReduceScatter, Vec::new()).unwrap_err();
        assert!(e.to_string().contains("reduce-scatter"), "{e}");
        // One size only: alpha and bandwidth cannot be told apart.
        let one = vec![LinkSample {
            n: 2,
            bytes: 4096,
            seconds: 1e-5,
            reps: 1,
        }];
        let e = fit_collective(Collective::AllReduce, one).unwrap_err();
        assert!(e.to_string().contains("all-reduce"), "{e}");
    }

    #[test]
    fn a_level_fits_each_collective_and_names_a_missing_one() {
        let mut all = Vec::new();
        for (c, a, bw) in [
            (Collective::AllReduce, 40e-6, 1e9),
            (Collective::AllGather, 20e-6, 2e9),
            (Collective::ReduceScatter, 25e-6, 1.5e9),
        ] {
            all.extend(samples(&[(2, a)], bw, c, 0.0).into_iter().map(|s| (c, s)));
        }
        let (level, reports) = fit_level("veth", &all).unwrap();
        assert_eq!(reports.len(), 3);
        assert!((level.all_reduce.alpha(2) - 40e-6).abs() < 1e-12);
        assert!((level.all_gather.bus_bw / 2e9 - 1.0).abs() < 1e-6);
        assert!((level.reduce_scatter.bus_bw / 1.5e9 - 1.0).abs() < 1e-6);
        assert_eq!(level.kind, "veth");
        let no_rs: Vec<_> = all
            .into_iter()
            .filter(|(c, _)| *c != Collective::ReduceScatter)
            .collect();
        let e = fit_level("veth", &no_rs).unwrap_err();
        assert!(e.to_string().contains("reduce-scatter"), "{e}");
    }

    #[test]
    fn solve_small_systems() {
        let x = solve(vec![vec![2.0, 1.0], vec![1.0, 3.0]], vec![3.0, 5.0]).unwrap();
        assert!((x[0] - 0.8).abs() < 1e-12 && (x[1] - 1.4).abs() < 1e-12);
        assert!(solve(vec![vec![1.0, 2.0], vec![2.0, 4.0]], vec![1.0, 2.0]).is_none());
    }
}
