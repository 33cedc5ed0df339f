//! The planner's model of hardware: a [`Cluster`] of devices ([`DeviceProfile`]: memory
//! budget, matrix-product throughput per weight type and regime, memory bandwidth, fixed
//! overheads) joined by links ([`Links`]: per collective, a latency alpha as a function of the
//! group size and a bus bandwidth beta; a topology, one level or two). Profiles are JSON a user
//! can read and edit; `metashard calibrate` measures one, presets describe clusters nobody can
//! run here.
//!
//! Collective times follow the alpha-beta model of ring algorithms, with the bus-bandwidth
//! convention of nccl-tests (NVIDIA/nccl-tests `doc/PERFORMANCE.md`): an all-reduce of B bytes
//! over N ranks moves 2(N-1)/N B per rank, an all-gather or reduce-scatter (N-1)/N B of the
//! full tensor, a broadcast B, so `t = alpha(N) + factor(N) * B / bus_bw`. Across nodes the
//! two-level (hierarchical) forms apply: reduce-scatter inside each node, the collective
//! between nodes on 1/n_local of the data, all-gather inside the node.

use crate::{DType, Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::path::Path;

/// What one device can do, as the cost model sees it. Rates are per second.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DeviceProfile {
    pub name: String,
    /// Bytes the planner may place on the device (weights, KV cache, activations, buffers).
    pub memory_bytes: u64,
    /// Streaming read bandwidth, bytes/s: element-wise ops, norms, attention over the cache.
    pub mem_bw: f64,
    /// Matrix-vector regime (M <= 8 rows of activations): weight bytes read per second, by
    /// weight type name (`f32`, `f16`, `bf16`, `q8_0`, `q4_0`, `q4_1`).
    pub gemv_bw: BTreeMap<String, f64>,
    /// Matrix-matrix regime (the largest M): floating-point operations per second, by weight
    /// type.
    pub gemm_flops: BTreeMap<String, f64>,
    /// Between the two regimes: `[M, flop/s]` points by weight type, M strictly increasing
    /// from 2 (a calibration measures M = 2, 8 and 32, where a CPU's small-M kernels run far
    /// below its GEMM rate: [`CALIBRATED_M`]). A product of M rows is priced by interpolating
    /// its time linearly in M between the points, M = 1 costing the weights' bytes at
    /// `gemv_bw` ([`DeviceProfile::product_seconds`]). Absent (presets, older profiles): the
    /// `gemm_flops` rate from M = 2 on.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gemm_flops_by_m: BTreeMap<String, Vec<(usize, f64)>>,
    /// The matrix-vector rate by row length: `[K, bytes/s]` points by weight type, K strictly
    /// increasing (a calibration measures each row length of its shapes on its own: short rows
    /// stream slower on a CPU, each row a separate burst; on the Zen 2 host of this project
    /// F16 and BF16 rows of 576 read at 9-10 GB/s per device of cpu:2x1, rows of 4096 at
    /// 16.5, Q4_1 at 7.2 and 7.7). A product with rows of K elements reads its weights at
    /// [`DeviceProfile::gemv_at`]. Absent (presets, older profiles, types not measured):
    /// `gemv_bw` at every K.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gemv_bw_by_k: BTreeMap<String, Vec<(usize, f64)>>,
    /// Fused attention (`flash_attn`): floating-point operations per second, counting 4 D per
    /// query row, query head and cache row it attends to (head size D: a score and a value
    /// row), as calibrated at a decoding step's shape (one query row, grouped heads, f16
    /// cache). A CPU kernel visits the cache row by row, far below its GEMM rate (on the Zen 2
    /// host of this project about 10 Gflop/s against 50-100 for F32 GEMM). Absent (presets,
    /// older profiles): the F32 `gemm_flops` rate, as a GPU's tiled kernel approaches it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_flops: Option<f64>,
    /// Fixed cost of one graph computation (launch, synchronization), seconds.
    pub step_overhead_s: f64,
    /// Fixed cost per node of a program (a kernel launch, a barrier between threads), seconds.
    pub node_overhead_s: f64,
}

impl DeviceProfile {
    /// Weight bytes per second in the matrix-vector regime for `dtype` (the F32 figure when
    /// the type is not listed, scaled by its bytes per element; `mem_bw` if nothing is).
    pub fn gemv(&self, dtype: DType) -> f64 {
        rate(&self.gemv_bw, dtype).unwrap_or(self.mem_bw)
    }

    /// Weight bytes per second of a matrix-vector product of `dtype` with rows of `k`
    /// elements: the type's [`gemv_bw_by_k`](DeviceProfile::gemv_bw_by_k) points interpolated
    /// linearly in ln K, the end points' rates beyond them; [`DeviceProfile::gemv`] where the
    /// profile has none for the type.
    pub fn gemv_at(&self, dtype: DType, k: usize) -> f64 {
        let Some(points) = self
            .gemv_bw_by_k
            .get(dtype.name())
            .filter(|p| !p.is_empty())
        else {
            return self.gemv(dtype);
        };
        let x = (k.max(1) as f64).ln();
        let mut prev: Option<(f64, f64)> = None;
        for &(pk, rate) in points {
            let px = (pk.max(1) as f64).ln();
            if x <= px {
                return match prev {
                    Some((qx, qr)) => {
                        let f = ((x - qx) / (px - qx).max(1e-12)).clamp(0.0, 1.0);
                        qr + f * (rate - qr)
                    }
                    None => rate,
                };
            }
            prev = Some((px, rate));
        }
        prev.map_or_else(|| self.gemv(dtype), |(_, r)| r)
    }

    /// Floating-point operations per second of fused attention: [`attn_flops`] where
    /// calibrated, else the F32 GEMM rate.
    ///
    /// [`attn_flops`]: DeviceProfile::attn_flops
    pub fn attention(&self) -> f64 {
        self.attn_flops.unwrap_or_else(|| self.gemm(DType::F32))
    }

    /// Floating-point operations per second in the matrix-matrix regime for `dtype`.
    pub fn gemm(&self, dtype: DType) -> f64 {
        rate(&self.gemm_flops, dtype)
            .or_else(|| self.gemm_flops.values().copied().reduce(f64::min))
            .unwrap_or(1e9)
    }

    /// Seconds of a product of `m` activation rows with a weight of `dtype`, `weight_bytes`
    /// bytes, rows of `k` elements and `nk` (N x K) elements: never below streaming the
    /// weights once ([`DeviceProfile::gemv_at`] its row length) and
    /// never below its `2 M N K` flops at the `gemm_flops` rate; between, where the profile has
    /// [`gemm_flops_by_m`](DeviceProfile::gemm_flops_by_m) points for the type, the time is
    /// interpolated linearly in M from M = 1 (the bytes at `gemv_bw`) through the points (each
    /// point's time at least the one before: a larger M never costs less). Non-decreasing in
    /// `m`, as a batch's step must be.
    pub fn product_seconds(
        &self,
        dtype: DType,
        weight_bytes: f64,
        k: usize,
        nk: f64,
        m: f64,
    ) -> f64 {
        let floor = weight_bytes / self.gemv_at(dtype, k).max(1.0);
        let flops = |m: f64| 2.0 * nk * m;
        let gemm = flops(m) / self.gemm(dtype).max(1.0);
        let Some(points) = self.gemm_flops_by_m.get(dtype.name()) else {
            return floor.max(gemm);
        };
        let mut prev = (1.0, floor);
        for &(pm, rate) in points {
            let pm = pm as f64;
            let t = (flops(pm) / rate.max(1.0)).max(prev.1);
            if m <= pm {
                let f = ((m - prev.0) / (pm - prev.0).max(1e-9)).clamp(0.0, 1.0);
                return (prev.1 + f * (t - prev.1)).max(floor);
            }
            prev = (pm, t);
        }
        gemm.max(prev.1).max(floor)
    }
}

/// The activation rows a calibration measures between the GEMV (M = 1) and the GEMM regimes
/// ([`DeviceProfile::gemm_flops_by_m`]): 2 (just past the memory floor), 8 (a batched decoding
/// step; on the CPU every weight type's fused small-M kernels) and 32 (a short prompt or a
/// micro-batch: the dequantizing tiles, or on AVX-512 Q4_1's fused kernels).
pub const CALIBRATED_M: [usize; 3] = [2, 8, 32];

/// The most devices a cluster may have (hosts times devices per host included).
pub const MAX_DEVICES: usize = 1024;
/// Memory of one device, bytes: up to 1 PiB.
pub const MEMORY_BYTES: RangeInclusive<u64> = 1..=1 << 50;
/// Bandwidths (memory, weights read, a link's bus), bytes/s: 1 kB/s to 10 PB/s.
pub const BANDWIDTH: RangeInclusive<f64> = 1e3..=1e16;
/// Floating-point operations per second of one device: 1e3 to 1e19 (ten exaflops).
pub const FLOPS: RangeInclusive<f64> = 1e3..=1e19;
/// Overheads and latencies, seconds: none to 10 s.
pub const SECONDS: RangeInclusive<f64> = 0.0..=10.0;

/// `v` in `range` (NaN never is), else (field, value, reason).
fn in_range<T: PartialOrd + std::fmt::Display>(
    field: &str,
    v: T,
    range: &RangeInclusive<T>,
    unit: &str,
) -> std::result::Result<(), (String, String, String)> {
    if range.contains(&v) {
        return Ok(());
    }
    Err((
        field.to_string(),
        v.to_string(),
        format!("must be in {}..={} {unit}", range.start(), range.end()),
    ))
}

impl DeviceProfile {
    /// Every figure in its physical range: (field, value, reason) of the first that is not.
    fn check(&self) -> std::result::Result<(), (String, String, String)> {
        in_range("memory_bytes", self.memory_bytes, &MEMORY_BYTES, "bytes")?;
        in_range("mem_bw", self.mem_bw, &BANDWIDTH, "bytes/s")?;
        in_range("step_overhead_s", self.step_overhead_s, &SECONDS, "s")?;
        in_range("node_overhead_s", self.node_overhead_s, &SECONDS, "s")?;
        if let Some(a) = self.attn_flops {
            in_range("attn_flops", a, &FLOPS, "flop/s")?;
        }
        for (map, field, range, unit) in [
            (&self.gemv_bw, "gemv_bw", &BANDWIDTH, "bytes/s"),
            (&self.gemm_flops, "gemm_flops", &FLOPS, "flop/s"),
        ] {
            for (k, &v) in map {
                if DType::from_name(k).is_none() {
                    return Err((
                        field.to_string(),
                        format!("`{k}`"),
                        "not an element type name (f32, f16, bf16, q8_0, ...)".into(),
                    ));
                }
                in_range(&format!("{field}.{k}"), v, range, unit)?;
            }
        }
        check_points(
            "gemv_bw_by_k",
            &self.gemv_bw_by_k,
            ("K", 1..=1 << 24, "row lengths"),
            (&BANDWIDTH, "bytes/s"),
        )?;
        check_points(
            "gemm_flops_by_m",
            &self.gemm_flops_by_m,
            ("M", 2..=1 << 20, "rows"),
            (&FLOPS, "flop/s"),
        )?;
        Ok(())
    }
}

/// Points `[x, rate]` by weight type name (`gemv_bw_by_k`, `gemm_flops_by_m`): known type
/// names, `x` (named `var`, what it counts `what`) strictly increasing within `xs`, rates in
/// `range`; else (field, value, reason) of the first that is not.
fn check_points(
    field: &str,
    map: &BTreeMap<String, Vec<(usize, f64)>>,
    (var, xs, what): (&str, RangeInclusive<usize>, &str),
    (range, unit): (&RangeInclusive<f64>, &str),
) -> std::result::Result<(), (String, String, String)> {
    for (k, points) in map {
        if DType::from_name(k).is_none() {
            return Err((
                field.into(),
                format!("`{k}`"),
                "not an element type name (f32, f16, bf16, q8_0, ...)".into(),
            ));
        }
        let mut prev = 0;
        for &(x, v) in points {
            if x <= prev || !xs.contains(&x) {
                return Err((
                    format!("{field}.{k}"),
                    format!("{var} = {x}"),
                    format!("{what} must increase, from {} to {}", xs.start(), xs.end()),
                ));
            }
            in_range(&format!("{field}.{k} at {var} = {x}"), v, range, unit)?;
            prev = x;
        }
    }
    Ok(())
}

impl CollectiveFit {
    /// Latencies in [`SECONDS`] (at least one where the level is used: `needs_latency`) by
    /// strictly increasing group sizes in 1..=[`MAX_DEVICES`], a bus bandwidth in
    /// [`BANDWIDTH`].
    fn check(&self, needs_latency: bool) -> std::result::Result<(), (String, String, String)> {
        in_range("bus_bw", self.bus_bw, &BANDWIDTH, "bytes/s")?;
        if needs_latency && self.alpha_s.is_empty() {
            // No latency would price every collective at bandwidth alone (zero latency).
            return Err((
                "alpha_s".into(),
                "[]".into(),
                "needs at least one [group size, seconds] latency point".into(),
            ));
        }
        let mut prev = 0;
        for &(n, a) in &self.alpha_s {
            if n <= prev || n > MAX_DEVICES {
                return Err((
                    "alpha_s".into(),
                    format!("group size {n}"),
                    format!("group sizes must increase, in 1..={MAX_DEVICES}"),
                ));
            }
            in_range(&format!("alpha_s at {n} ranks"), a, &SECONDS, "s")?;
            prev = n;
        }
        Ok(())
    }
}

fn rate(map: &BTreeMap<String, f64>, dtype: DType) -> Option<f64> {
    map.get(dtype.name()).or_else(|| map.get("f32")).copied()
}

/// Latency and bandwidth of one collective: `t = alpha(N) + factor(N) * bytes / bus_bw`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CollectiveFit {
    /// Latency in seconds by group size, `[N, alpha]` pairs; interpolated linearly in N,
    /// extrapolated from the last two points.
    pub alpha_s: Vec<(usize, f64)>,
    /// Bus bandwidth, bytes/s.
    pub bus_bw: f64,
}

impl CollectiveFit {
    pub fn alpha(&self, n: usize) -> f64 {
        let pts = &self.alpha_s;
        match pts.len() {
            0 => 0.0,
            1 => pts[0].1,
            _ => {
                let i = pts
                    .windows(2)
                    .position(|w| n <= w[1].0)
                    .unwrap_or(pts.len() - 2);
                let ((n0, a0), (n1, a1)) = (pts[i], pts[i + 1]);
                if n1 == n0 {
                    return a0;
                }
                let t = (n as f64 - n0 as f64) / (n1 as f64 - n0 as f64);
                (a0 + t * (a1 - a0)).max(0.0)
            }
        }
    }
}

/// Which collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Collective {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
}

impl Collective {
    /// Bytes each rank moves per byte of the (full) tensor, for a ring over `n` ranks.
    pub fn factor(self, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let f = (n - 1) as f64 / n as f64;
        match self {
            Collective::AllReduce => 2.0 * f,
            Collective::AllGather | Collective::ReduceScatter => f,
            Collective::Broadcast => 1.0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all-reduce",
            Collective::AllGather => "all-gather",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::Broadcast => "broadcast",
        }
    }
}

/// The fits of every collective on one level of links.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LinkLevel {
    /// What the links are, in words (`NVSwitch (NVLink 4)`, `PCIe 4.0 x16`, `host memory`).
    pub kind: String,
    pub all_reduce: CollectiveFit,
    pub all_gather: CollectiveFit,
    pub reduce_scatter: CollectiveFit,
    #[serde(default)]
    pub broadcast: Option<CollectiveFit>,
}

impl LinkLevel {
    /// Every fit of the level (a broadcast's too, when given) in its range: (field, value,
    /// reason) of the first that is not. A level nothing communicates over (one device's) may
    /// leave out latencies (`needs_latency` false).
    fn check(&self, needs_latency: bool) -> std::result::Result<(), (String, String, String)> {
        let fits = [
            ("all_reduce", Some(&self.all_reduce)),
            ("all_gather", Some(&self.all_gather)),
            ("reduce_scatter", Some(&self.reduce_scatter)),
            ("broadcast", self.broadcast.as_ref()),
        ];
        for (name, f) in fits {
            if let Some(f) = f {
                f.check(needs_latency)
                    .map_err(|(field, v, r)| (format!("{name}.{field}"), v, r))?;
            }
        }
        Ok(())
    }

    /// [`LinkLevel::check`] as an error naming `what` (the level's origin, e.g. a file of
    /// collectives timed between hosts).
    pub fn validate(&self, what: &str) -> Result<()> {
        self.check(true).map_err(|(field, value, reason)| {
            Error::invalid_argument(
                format!("{what}: links `{}` {field}", self.kind),
                value,
                reason,
            )
        })
    }

    pub fn fit(&self, c: Collective) -> &CollectiveFit {
        match c {
            Collective::AllReduce => &self.all_reduce,
            Collective::AllGather => &self.all_gather,
            Collective::ReduceScatter => &self.reduce_scatter,
            Collective::Broadcast => self.broadcast.as_ref().unwrap_or(&self.all_gather),
        }
    }

    /// Seconds for collective `c` of a `bytes`-byte (full) tensor over `n` ranks.
    pub fn time(&self, c: Collective, n: usize, bytes: f64) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let fit = self.fit(c);
        fit.alpha(n) + c.factor(n) * bytes / fit.bus_bw.max(1.0)
    }
}

/// How the devices are joined.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Links {
    /// Devices per node (all of them for one level).
    pub devices_per_node: usize,
    /// Links inside a node.
    pub intra: LinkLevel,
    /// Links between nodes, when there are several.
    #[serde(default)]
    pub inter: Option<LinkLevel>,
}

impl Links {
    /// Seconds for collective `c` of a `bytes`-byte tensor over the first `n` devices: one
    /// level inside a node; across nodes the two-level form (reduce-scatter inside the node,
    /// the collective between nodes on a 1/n_local share, all-gather inside the node; gathers
    /// and scatters likewise split into their inner and outer parts).
    pub fn time(&self, c: Collective, n: usize, bytes: f64) -> f64 {
        let local = self.devices_per_node.max(1).min(n.max(1));
        let nodes = n.div_ceil(local);
        let Some(inter) = self.inter.as_ref().filter(|_| nodes > 1) else {
            return self.intra.time(c, n, bytes);
        };
        let share = bytes / local as f64;
        match c {
            Collective::AllReduce => {
                self.intra.time(Collective::ReduceScatter, local, bytes)
                    + inter.time(Collective::AllReduce, nodes, share)
                    + self.intra.time(Collective::AllGather, local, bytes)
            }
            Collective::AllGather => {
                inter.time(
                    Collective::AllGather,
                    nodes,
                    bytes / local as f64 * nodes as f64,
                ) + self.intra.time(Collective::AllGather, local, bytes)
            }
            Collective::ReduceScatter => {
                self.intra.time(Collective::ReduceScatter, local, bytes)
                    + inter.time(Collective::ReduceScatter, nodes, share)
            }
            Collective::Broadcast => {
                inter.time(Collective::Broadcast, nodes, bytes)
                    + self.intra.time(Collective::Broadcast, local, bytes)
            }
        }
    }
}

/// Devices and links: what a plan is made for.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Cluster {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub devices: Vec<DeviceProfile>,
    pub links: Links,
    /// Where the figures come from (a measurement, or public sources).
    #[serde(default)]
    pub sources: Vec<String>,
    /// How much faster one device computes when it is the only one of the cluster computing
    /// than when all of them compute at once, as the devices' rates were measured: devices
    /// sharing cores (3 one-thread CPU devices on 2 cores) or a memory bus. A calibration
    /// measures it; absent: 1 (independent devices). A layer split's stages, which run one
    /// at a time or a few at once, are priced with it ([`Cluster::concurrency_factor`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alone_speedup: Option<f64>,
    /// The same by the rows of the products (`[M, speedup]`, rising M): a calibration measures
    /// it at M = 1 (a decoding step of one sequence, weights streamed) and M = 8 (batched and
    /// prompt steps), since devices sharing a core's vector units can slow each other down more
    /// in compute-bound products than in streaming ones. Between the points the speedup is
    /// interpolated in log M, outside them the nearest point holds; absent or empty:
    /// [`alone_speedup`](Cluster::alone_speedup) at every M.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alone_speedup_by_m: Vec<(usize, f64)>,
    /// How much longer the kernels of a real step of M rows take than the devices' rates say
    /// (`[M, factor]`, rising M): a calibration times a small decoder's batched decoding
    /// step, prompt chunk and batch of prompt chunks as run, and the factor is measured over
    /// predicted for their compute (the step's overheads and collectives kept as predicted;
    /// below 1 where the rates were slower than the step's kernels). In a step the
    /// products are short and meet at a collective after each, where the rates time each
    /// kernel in long runs: devices that share cores take turns at every meeting point, and
    /// a step waits at each for the slowest device. Interpolated in log M, the nearest point
    /// outside them; absent or empty: 1 (the rates as measured).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub step_factor_by_m: Vec<(usize, f64)>,
    /// The same for steps whose devices do not meet inside the layers (fewer collectives
    /// than layers: a mirrored or vocab-split program, or a layer split's stage, each device
    /// running whole layers through): a calibration times the small decoder mirrored on every
    /// device at its prompt chunk and its batch of prompt chunks, where the devices'
    /// products are whole matrices and nobody waits for the slowest at every half layer (on
    /// the shared AVX-512 Xeon such programs' prompts measured 30-40% faster, against the
    /// others, than the factors timed on a tensor split said; `docs/planner.md`,
    /// "twenty-first session"). Below those rows a calibration copies the tensor split's
    /// points. Absent or empty:
    /// [`step_factor_by_m`](Cluster::step_factor_by_m).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub step_factor_apart_by_m: Vec<(usize, f64)>,
    /// How much longer a layer split's batched decoding step takes cut into micro-batches
    /// (pipelined, `planner/layer.rs`) than the cost model's pipeline says: a calibration
    /// times the small decoder's decoding step of 8 sequences in 2 micro-batches against its
    /// prediction (with the alone speedups). A pipelined stage runs each micro-batch as a split
    /// of its own, on a thread started for it, on a device idle since its last one: on the
    /// Zen 3 host's cpu:2x1 a stage's micro-batch of 4 rows took 1.2-1.5x the same rows run
    /// outside the pipeline, even alone (`docs/sched.md`, the scheduler's profile). Applied
    /// to pipelined decoding steps only: prompts' micro-batches (tens of rows, compute-bound)
    /// were predicted within their bounds without it. Absent: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline_factor: Option<f64>,
}

/// `points` (`[M, value]`, rising M) at `rows`, interpolated in log M, the nearest point
/// outside them; `None` when there are none.
fn at_rows(points: &[(usize, f64)], rows: usize) -> Option<f64> {
    let (first, last) = (points.first()?, points.last()?);
    let m = rows.max(1);
    if m <= first.0 {
        return Some(first.1);
    }
    if m >= last.0 {
        return Some(last.1);
    }
    let i = points
        .iter()
        .position(|&(pm, _)| pm >= m)
        .unwrap_or(points.len() - 1);
    let ((m0, s0), (m1, s1)) = (points[i - 1], points[i]);
    let t = ((m as f64).ln() - (m0 as f64).ln()) / ((m1 as f64).ln() - (m0 as f64).ln());
    Some(s0 + t * (s1 - s0))
}

/// Smallest and largest step factor a profile may hold
/// ([`Cluster::step_factor_by_m`]).
pub const STEP_FACTOR: std::ops::RangeInclusive<f64> = 0.25..=4.0;

/// The range of [`Cluster::pipeline_factor`].
pub const PIPELINE_FACTOR: std::ops::RangeInclusive<f64> = 0.25..=4.0;

impl Cluster {
    pub fn n_devices(&self) -> usize {
        self.devices.len()
    }

    /// The factor on the devices' calibrated compute times when only `active` of the
    /// cluster's devices compute at once, in a step of `rows` rows (at most 1). With an alone
    /// speedup s over n devices ([`Cluster::alone_speedup_at`]), the devices behave as if they
    /// shared n / s cores: each of k active devices runs at min(1, cores / k) of a device
    /// alone, against min(1, cores / n) when measured.
    pub fn concurrency_factor(&self, active: usize, rows: usize) -> f64 {
        let n = self.devices.len().max(1) as f64;
        let s = self.alone_speedup_at(rows).clamp(1.0, n);
        let cores = n / s;
        let share = |k: f64| (cores / k.max(1.0)).min(1.0);
        (share(n) / share(active.clamp(1, self.devices.len().max(1)) as f64)).min(1.0)
    }

    /// How much faster one device computes alone than all at once in products of `rows` rows:
    /// [`alone_speedup_by_m`](Cluster::alone_speedup_by_m) interpolated in log M (the nearest
    /// point outside them), else [`alone_speedup`](Cluster::alone_speedup), else 1.
    pub fn alone_speedup_at(&self, rows: usize) -> f64 {
        at_rows(&self.alone_speedup_by_m, rows).unwrap_or(self.alone_speedup.unwrap_or(1.0))
    }

    /// The factor on the kernels' times in a step of `rows` rows:
    /// [`step_factor_by_m`](Cluster::step_factor_by_m) interpolated in log M (the nearest
    /// point outside them), else 1.
    pub fn step_factor_at(&self, rows: usize) -> f64 {
        at_rows(&self.step_factor_by_m, rows).unwrap_or(1.0)
    }

    /// The factor on the kernels' times in a step of `rows` rows whose devices do not meet
    /// inside the layers: [`step_factor_apart_by_m`](Cluster::step_factor_apart_by_m) as
    /// [`step_factor_at`](Cluster::step_factor_at) interpolates, else that.
    pub fn step_factor_apart_at(&self, rows: usize) -> f64 {
        at_rows(&self.step_factor_apart_by_m, rows).unwrap_or_else(|| self.step_factor_at(rows))
    }

    /// Check the figures against their physical ranges ([`MAX_DEVICES`], [`MEMORY_BYTES`],
    /// [`BANDWIDTH`], [`FLOPS`], [`SECONDS`]): at least one device, rates and bandwidths
    /// positive, finite and within reach of hardware, overheads and latencies non-negative and
    /// below seconds, latencies by increasing group size, a sane topology. Errors name the
    /// device and the field.
    pub fn validate(&self) -> Result<()> {
        self.check().map_err(|(field, value, reason)| {
            Error::invalid_argument(format!("cluster `{}`: {field}", self.name), value, reason)
        })
    }

    /// The first figure out of its range: (field, value, reason).
    fn check(&self) -> std::result::Result<(), (String, String, String)> {
        let n = self.devices.len();
        if let Some(s) = self.alone_speedup
            && !(1.0..=MAX_DEVICES as f64).contains(&s)
        {
            return Err((
                "alone_speedup".into(),
                s.to_string(),
                format!("must be in 1..={MAX_DEVICES}"),
            ));
        }
        for (i, &(m, s)) in self.alone_speedup_by_m.iter().enumerate() {
            let rising = i == 0 || self.alone_speedup_by_m[i - 1].0 < m;
            if m == 0 || !rising || !(1.0..=MAX_DEVICES as f64).contains(&s) {
                return Err((
                    format!("alone_speedup_by_m[{i}]"),
                    format!("[{m}, {s}]"),
                    format!("rows must rise from 1 and speedups be in 1..={MAX_DEVICES}"),
                ));
            }
        }
        if let Some(f) = self.pipeline_factor
            && !PIPELINE_FACTOR.contains(&f)
        {
            return Err((
                "pipeline_factor".into(),
                f.to_string(),
                format!(
                    "must be in {}..={}",
                    PIPELINE_FACTOR.start(),
                    PIPELINE_FACTOR.end()
                ),
            ));
        }
        for (field, points) in [
            ("step_factor_by_m", &self.step_factor_by_m),
            ("step_factor_apart_by_m", &self.step_factor_apart_by_m),
        ] {
            for (i, &(m, f)) in points.iter().enumerate() {
                let rising = i == 0 || points[i - 1].0 < m;
                if m == 0 || !rising || !STEP_FACTOR.contains(&f) {
                    return Err((
                        format!("{field}[{i}]"),
                        format!("[{m}, {f}]"),
                        format!(
                            "rows must rise from 1 and factors be in {}..={}",
                            STEP_FACTOR.start(),
                            STEP_FACTOR.end()
                        ),
                    ));
                }
            }
        }
        if !(1..=MAX_DEVICES).contains(&n) {
            return Err((
                "devices".into(),
                format!("{n} devices"),
                format!("a cluster has 1..={MAX_DEVICES} devices"),
            ));
        }
        for (i, d) in self.devices.iter().enumerate() {
            d.check()
                .map_err(|(f, v, r)| (format!("devices[{i}] (`{}`) {f}", d.name), v, r))?;
        }
        let per_node = self.links.devices_per_node;
        if !(1..=MAX_DEVICES).contains(&per_node) {
            return Err((
                "links.devices_per_node".into(),
                per_node.to_string(),
                format!("must be in 1..={MAX_DEVICES}"),
            ));
        }
        let levels = [
            ("links.intra", Some(&self.links.intra)),
            ("links.inter", self.links.inter.as_ref()),
        ];
        for (name, l) in levels {
            if let Some(l) = l {
                // One device never communicates: its level needs no latencies.
                l.check(n > 1)
                    .map_err(|(f, v, r)| (format!("{name} (`{}`) {f}", l.kind), v, r))?;
            }
        }
        Ok(())
    }

    /// A cluster from a JSON file (a calibrated profile or one a user wrote): a regular file of
    /// at most [`crate::io::MAX_JSON_BYTES`], every figure in its range (errors name the file
    /// and the field).
    pub fn load(path: &Path) -> Result<Cluster> {
        let text = crate::io::read_json_text(path)?;
        Cluster::from_json(path, &text)
    }

    /// A cluster from the JSON `text` of `path` (named in errors), validated.
    pub fn from_json(path: &Path, text: &str) -> Result<Cluster> {
        let c: Cluster = crate::io::parse_json(path, "cluster profile", text)?;
        c.check().map_err(|(field, value, reason)| {
            Error::format(path, field, format!("{value}: {reason}"))
        })?;
        Ok(c)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a cluster serializes")
    }

    /// `n` copies of `device` (named `{name}{i}`) joined by `links`.
    pub fn homogeneous(name: &str, n: usize, device: &DeviceProfile, links: Links) -> Cluster {
        Cluster {
            name: name.to_string(),
            description: String::new(),
            devices: (0..n)
                .map(|i| DeviceProfile {
                    name: format!("{}{i}", device.name),
                    ..device.clone()
                })
                .collect(),
            links,
            sources: Vec::new(),
            alone_speedup: None,
            alone_speedup_by_m: Vec::new(),
            step_factor_by_m: Vec::new(),
            step_factor_apart_by_m: Vec::new(),
            pipeline_factor: None,
        }
    }

    /// `hosts` copies of this one-level cluster (one host), joined by `inter` between hosts:
    /// the two-level form of [`Links::time`]. Device `i` of host `h` is named `h{h}.{name}`.
    /// An error if this cluster already has an inter-host level, `hosts` is below 2 or the
    /// hosts' devices would be more than [`MAX_DEVICES`] (checked before any is made).
    pub fn with_hosts(&self, hosts: usize, inter: LinkLevel) -> Result<Cluster> {
        if hosts < 2 || self.links.inter.is_some() {
            return Err(Error::invalid_argument(
                format!("cluster `{}`: hosts", self.name),
                hosts,
                "give at least 2 hosts of a cluster with one level of links",
            ));
        }
        Cluster::check_hosts(hosts, self.devices.len())?;
        let devices = (0..hosts)
            .flat_map(|h| {
                self.devices.iter().map(move |d| DeviceProfile {
                    name: format!("h{h}.{}", d.name),
                    ..d.clone()
                })
            })
            .collect();
        let c = Cluster {
            name: format!("{}x{hosts}-hosts", self.name),
            description: format!(
                "{hosts} hosts of: {} (between hosts: {})",
                self.description, inter.kind
            ),
            devices,
            links: Links {
                devices_per_node: self.devices.len(),
                intra: self.links.intra.clone(),
                inter: Some(inter),
            },
            sources: self.sources.clone(),
            alone_speedup: self.alone_speedup,
            alone_speedup_by_m: self.alone_speedup_by_m.clone(),
            step_factor_by_m: self.step_factor_by_m.clone(),
            step_factor_apart_by_m: self.step_factor_apart_by_m.clone(),
            pipeline_factor: self.pipeline_factor,
        };
        c.validate()?;
        Ok(c)
    }

    /// `hosts` hosts of `per_host` devices each make at most [`MAX_DEVICES`] devices, else an
    /// error naming `--hosts`.
    pub fn check_hosts(hosts: usize, per_host: usize) -> Result<()> {
        match hosts.checked_mul(per_host) {
            Some(n) if n <= MAX_DEVICES => Ok(()),
            _ => Err(Error::invalid_argument(
                "--hosts",
                hosts,
                format!(
                    "{hosts} hosts of {per_host} device{} each make more than the {MAX_DEVICES} \
                     devices a cluster may have",
                    if per_host == 1 { "" } else { "s" }
                ),
            )),
        }
    }

    /// The same cluster restricted to its first `n` devices.
    pub fn take(&self, n: usize) -> Cluster {
        let mut c = self.clone();
        c.devices.truncate(n);
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn level(bw: f64, alpha: f64) -> LinkLevel {
        let fit = CollectiveFit {
            alpha_s: vec![(2, alpha), (8, 2.0 * alpha)],
            bus_bw: bw,
        };
        LinkLevel {
            kind: "test".into(),
            all_reduce: fit.clone(),
            all_gather: fit.clone(),
            reduce_scatter: fit,
            broadcast: None,
        }
    }

    #[test]
    fn a_collective_without_a_latency_point_is_refused_naming_it() {
        let mut l = level(100e9, 10e-6);
        l.all_gather.alpha_s.clear();
        let e = l.validate("profile.json").unwrap_err().to_string();
        assert!(
            e.contains("all_gather") && e.contains("alpha_s") && e.contains("at least one"),
            "{e}"
        );
        // A one-device cluster's level (never used) may leave them out: see
        // tests/planner_calibrate.rs, `calibrate_one_device_has_no_links_to_fit`.
    }

    /// A CPU-like profile: q4_1 weights at 5.7 GB/s for one row, 29 GFLOP/s at M = 2 and 8,
    /// 57 at 32, 71 at the GEMM's M = 128 (a quick calibration of cpu:2x1, 2026-11-27).
    fn cpu_like() -> DeviceProfile {
        let one = |v: f64| BTreeMap::from([("q4_1".to_string(), v)]);
        DeviceProfile {
            name: "cpu".into(),
            memory_bytes: 1 << 30,
            mem_bw: 5e9,
            gemv_bw: one(5.7e9),
            gemm_flops: one(71e9),
            gemm_flops_by_m: BTreeMap::from([(
                "q4_1".to_string(),
                vec![(2, 29e9), (8, 29.8e9), (32, 57e9)],
            )]),
            gemv_bw_by_k: BTreeMap::new(),
            attn_flops: None,
            step_overhead_s: 0.0,
            node_overhead_s: 0.0,
        }
    }

    #[test]
    fn small_m_products_cost_their_calibrated_rate_and_never_less_with_more_rows() {
        let p = cpu_like();
        let (k, n) = (576.0, 1536.0);
        let bytes = DType::Q4_1.row_size(576) as f64 * n;
        let floor = bytes / 5.7e9;
        let at = |m: f64| p.product_seconds(DType::Q4_1, bytes, 576, k * n, m);
        // M = 1: the weights streamed once; at a point: its rate exactly.
        assert_eq!(at(1.0), floor);
        assert!((at(8.0) - 2.0 * k * n * 8.0 / 29.8e9).abs() < 1e-12);
        assert!((at(32.0) - 2.0 * k * n * 32.0 / 57e9).abs() < 1e-12);
        // Past the points: the GEMM rate (M = 256 at 71 GFLOP/s).
        assert!((at(256.0) - 2.0 * k * n * 256.0 / 71e9).abs() < 1e-12);
        // At M = 8 the product costs 2.4x what the GEMM rate alone says (the cost model took
        // that before: batched decoding predicted ~3x too fast on this machine).
        let gemm_only = 2.0 * k * n * 8.0 / 71e9;
        assert!(at(8.0) > 2.0 * gemm_only, "{} vs {gemm_only}", at(8.0));
        let mut last = 0.0;
        for m in 1..=600 {
            let t = at(m as f64);
            assert!(t >= floor && t >= last, "M = {m}: {t} after {last}");
            last = t;
        }
        // A type without points: the larger of the two regimes, as before.
        let f = DType::F32;
        assert_eq!(
            p.product_seconds(f, 1e6, 1000, 1e6, 8.0),
            (1e6 / p.gemv(f)).max(16e6 / p.gemm(f))
        );
        // A faster point after a slower one does not make more rows cheaper.
        let mut q = cpu_like();
        q.gemm_flops_by_m
            .insert("q4_1".into(), vec![(2, 1e9), (8, 100e9)]);
        let t2 = q.product_seconds(DType::Q4_1, bytes, 576, k * n, 2.0);
        assert!(q.product_seconds(DType::Q4_1, bytes, 576, k * n, 8.0) >= t2);
    }

    #[test]
    fn matrix_vector_rates_follow_the_row_length() {
        let mut p = cpu_like();
        let q = DType::Q4_1;
        // Without points: the one rate at every K.
        assert_eq!(p.gemv_at(q, 64), 5.7e9);
        p.gemv_bw_by_k
            .insert("q4_1".into(), vec![(576, 4e9), (2304, 8e9)]);
        // At the points, halfway in ln K between them (576 x 2 = 1152), the ends beyond them.
        assert_eq!(p.gemv_at(q, 576), 4e9);
        assert_eq!(p.gemv_at(q, 2304), 8e9);
        assert!(
            (p.gemv_at(q, 1152) - 6e9).abs() < 1.0,
            "{}",
            p.gemv_at(q, 1152)
        );
        assert_eq!(p.gemv_at(q, 64), 4e9);
        assert_eq!(p.gemv_at(q, 1 << 20), 8e9);
        // A type without points keeps its flat rate; a product's floor is its row length's.
        assert_eq!(p.gemv_at(DType::F32, 576), p.gemv(DType::F32));
        let bytes = q.row_size(576) as f64 * 1536.0;
        let t = p.product_seconds(q, bytes, 576, 576.0 * 1536.0, 1.0);
        assert_eq!(t, bytes / 4e9);
        // Row lengths must increase; rates must be bandwidths.
        p.gemv_bw_by_k
            .insert("q4_1".into(), vec![(576, 4e9), (576, 8e9)]);
        let e = p.check().unwrap_err();
        assert!(
            e.0.contains("gemv_bw_by_k.q4_1") && e.1 == "K = 576",
            "{e:?}"
        );
        p.gemv_bw_by_k.insert("q4_1".into(), vec![(576, f64::NAN)]);
        assert!(p.check().unwrap_err().0.contains("at K = 576"));
        p.gemv_bw_by_k.clear();
        p.gemv_bw_by_k.insert("q9".into(), vec![(576, 4e9)]);
        assert_eq!(p.check().unwrap_err().0, "gemv_bw_by_k");
    }

    #[test]
    fn small_m_points_are_checked() {
        let mut p = cpu_like();
        assert!(p.check().is_ok());
        p.gemm_flops_by_m
            .insert("q4_1".into(), vec![(8, 1e9), (8, 2e9)]);
        let e = p.check().unwrap_err();
        assert!(
            e.0.contains("gemm_flops_by_m.q4_1") && e.1 == "M = 8",
            "{e:?}"
        );
        p.gemm_flops_by_m.insert("q4_1".into(), vec![(1, 1e9)]);
        assert!(p.check().is_err());
        p.gemm_flops_by_m.insert("q4_1".into(), vec![(4, -1.0)]);
        assert!(p.check().unwrap_err().0.contains("at M = 4"));
        p.gemm_flops_by_m.clear();
        p.gemm_flops_by_m.insert("q9".into(), vec![(4, 1e9)]);
        assert!(p.check().unwrap_err().1.contains("q9"));
    }

    #[test]
    fn ring_formulas() {
        let l = level(100e9, 10e-6);
        // All-reduce of 1 GB over 8 ranks: 2 * 7/8 GB at 100 GB/s plus alpha(8) = 20 us.
        let t = l.time(Collective::AllReduce, 8, 1e9);
        assert!((t - (20e-6 + 1.75e9 / 100e9)).abs() < 1e-12, "{t}");
        let t = l.time(Collective::AllGather, 4, 1e9);
        // alpha(4) interpolates 10 and 20 us: 13.33 us.
        assert!((t - (10e-6 + (20e-6 - 10e-6) / 3.0 + 0.75e9 / 100e9)).abs() < 1e-12);
        assert_eq!(l.time(Collective::AllReduce, 1, 1e9), 0.0);
    }

    #[test]
    fn hosts_replicate_devices_and_use_the_inter_level_across_them() {
        let one = Cluster::homogeneous(
            "box",
            2,
            &DeviceProfile {
                name: "cpu".into(),
                memory_bytes: 1 << 30,
                mem_bw: 1e10,
                gemv_bw: BTreeMap::new(),
                gemm_flops: BTreeMap::new(),
                gemm_flops_by_m: BTreeMap::new(),
                gemv_bw_by_k: BTreeMap::new(),
                attn_flops: None,
                step_overhead_s: 0.0,
                node_overhead_s: 0.0,
            },
            Links {
                devices_per_node: 2,
                intra: level(40e9, 1e-6),
                inter: None,
            },
        );
        let two = one.with_hosts(2, level(1e9, 50e-6)).unwrap();
        assert_eq!(two.n_devices(), 4);
        assert_eq!(two.devices[2].name, "h1.cpu0");
        assert_eq!(two.links.devices_per_node, 2);
        // Inside a host: the intra level only; across: the slow level's latency at least.
        let inside = two.links.time(Collective::AllReduce, 2, 1e6);
        assert_eq!(inside, one.links.time(Collective::AllReduce, 2, 1e6));
        assert!(two.links.time(Collective::AllReduce, 4, 1e6) > 50e-6 + inside);
        assert!(two.with_hosts(2, level(1e9, 50e-6)).is_err());
        assert!(one.with_hosts(1, level(1e9, 50e-6)).is_err());
    }

    #[test]
    fn two_levels_cost_more_than_one_fast_level() {
        let links = Links {
            devices_per_node: 8,
            intra: level(365e9, 10e-6),
            inter: Some(level(48e9, 47e-6)),
        };
        let one = links.time(Collective::AllReduce, 8, 64e6);
        let two = links.time(Collective::AllReduce, 16, 64e6);
        assert!(two > one, "{two} vs {one}");
        // The inter-node part moves 1/8 of the data: well under a flat 16-rank ring at 48 GB/s.
        let flat = level(48e9, 47e-6).time(Collective::AllReduce, 16, 64e6);
        assert!(two < flat, "{two} vs {flat}");
    }

    /// Two CPU-like devices in one box.
    fn box_of_two() -> Cluster {
        Cluster::homogeneous(
            "box",
            2,
            &cpu_like(),
            Links {
                devices_per_node: 2,
                intra: level(40e9, 1e-6),
                inter: None,
            },
        )
    }

    #[test]
    fn the_alone_speedup_follows_the_rows_and_prices_a_stage_alone_by_it() {
        let mut c = box_of_two();
        // Neither figure: independent devices, at any rows.
        assert_eq!(c.alone_speedup_at(1), 1.0);
        assert_eq!(c.concurrency_factor(1, 8), 1.0);
        // One figure for every M.
        c.alone_speedup = Some(1.6);
        assert_eq!(c.alone_speedup_at(1), 1.6);
        assert_eq!(c.alone_speedup_at(512), 1.6);
        // By rows: the points, log-M interpolation between them, the nearest outside.
        c.alone_speedup_by_m = vec![(1, 1.0), (8, 2.0)];
        assert_eq!(c.alone_speedup_at(0), 1.0);
        assert_eq!(c.alone_speedup_at(1), 1.0);
        assert!((c.alone_speedup_at(2) - 4.0 / 3.0).abs() < 1e-12);
        assert_eq!(c.alone_speedup_at(8), 2.0);
        assert_eq!(c.alone_speedup_at(128), 2.0);
        // Two devices that are one core at M = 8: one alone runs at twice the measured rate,
        // so its time is halved; both busy, as measured; a streaming step alone, no faster.
        assert_eq!(c.concurrency_factor(1, 8), 0.5);
        assert_eq!(c.concurrency_factor(2, 8), 1.0);
        assert_eq!(c.concurrency_factor(1, 1), 1.0);
        c.validate().unwrap();
        // Rows must rise and speedups stay in range; the error names the entry.
        c.alone_speedup_by_m = vec![(8, 2.0), (1, 1.0)];
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("alone_speedup_by_m[1]"), "{e}");
        c.alone_speedup_by_m = vec![(1, 0.5)];
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("alone_speedup_by_m[0]"), "{e}");
        c.alone_speedup_by_m = vec![(0, 1.5)];
        assert!(c.validate().is_err());
        c.alone_speedup_by_m = Vec::new();
        // The pipeline factor is checked by the same rule, named.
        for bad in [0.0, -1.0, 5.0, f64::NAN, f64::INFINITY] {
            c.pipeline_factor = Some(bad);
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("pipeline_factor"), "{bad}: {e}");
        }
        c.pipeline_factor = Some(1.3);
        c.validate().unwrap();
    }

    #[test]
    fn the_step_factor_follows_the_rows_and_is_checked() {
        let mut c = box_of_two();
        // None measured: the rates as they are, at any rows.
        assert_eq!(c.step_factor_at(1), 1.0);
        assert_eq!(c.step_factor_at(4096), 1.0);
        // The points, log-M interpolation between them, the nearest outside.
        c.step_factor_by_m = vec![(1, 1.0), (8, 1.3), (64, 0.8)];
        assert_eq!(c.step_factor_at(0), 1.0);
        assert_eq!(c.step_factor_at(8), 1.3);
        assert!((c.step_factor_at(2) - 1.1).abs() < 1e-12);
        assert!((c.step_factor_at(16) - (1.3 - 0.5 / 3.0)).abs() < 1e-12);
        assert_eq!(c.step_factor_at(512), 0.8);
        c.validate().unwrap();
        // Rows must rise and factors stay in range; the error names the entry.
        for (bad, entry) in [
            (vec![(1, 1.0), (1, 1.2)], "step_factor_by_m[1]"),
            (vec![(1, 1.0), (8, 5.0)], "step_factor_by_m[1]"),
            (vec![(1, 0.1)], "step_factor_by_m[0]"),
            (vec![(1, f64::NAN)], "step_factor_by_m[0]"),
            (vec![(0, 1.0)], "step_factor_by_m[0]"),
        ] {
            c.step_factor_by_m = bad.clone();
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(entry), "{e}");
            // The factors of steps apart are checked the same way.
            c.step_factor_by_m = vec![(1, 1.0), (8, 1.3), (64, 0.8)];
            c.step_factor_apart_by_m = bad;
            let e = c.validate().unwrap_err().to_string();
            let apart = entry.replace("step_factor_by_m", "step_factor_apart_by_m");
            assert!(e.contains(&apart), "{e}");
            c.step_factor_apart_by_m = Vec::new();
        }
    }

    #[test]
    fn steps_apart_have_their_own_factor_else_the_tensor_splits() {
        let mut c = box_of_two();
        c.step_factor_by_m = vec![(1, 1.0), (8, 1.3), (64, 0.8)];
        // None measured apart: the tensor split's.
        for rows in [1, 8, 20, 64, 512] {
            assert_eq!(c.step_factor_apart_at(rows), c.step_factor_at(rows));
        }
        c.step_factor_apart_by_m = vec![(1, 1.0), (8, 1.3), (64, 0.6), (512, 0.5)];
        c.validate().unwrap();
        assert_eq!(c.step_factor_apart_at(8), 1.3);
        assert_eq!(c.step_factor_apart_at(64), 0.6);
        assert_eq!(c.step_factor_apart_at(4096), 0.5);
        assert_eq!(c.step_factor_at(4096), 0.8);
        // A profile written before the field reads as none measured.
        let json = serde_json::to_value(box_of_two()).unwrap();
        assert!(json.get("step_factor_apart_by_m").is_none());
        let back: Cluster = serde_json::from_value(json).unwrap();
        assert!(back.step_factor_apart_by_m.is_empty());
    }
}
