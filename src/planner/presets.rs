//! Built-in clusters, from public figures (machines nobody can run here) or measured on the
//! test machine (`cpu2x2-netns`): [`Cluster::preset`] and [`PRESET_NAMES`].
//!
//! Every figure below names its source. Three kinds of figure appear, and the comments say
//! which each one is:
//!
//! - a **datasheet** peak (memory size and bandwidth, tensor-core FLOP/s);
//! - a **measurement** someone published (nccl-tests bus bandwidth, a matmul FLOP/s sweep);
//! - a **derived** figure: a stated fraction of a datasheet or measured one, where nobody
//!   published the quantity the cost model needs (GEMV weight bandwidth per quantized type,
//!   FP32 GEMM on the tensor-core GPUs), or one the planner's issue gave without a public
//!   measurement behind it (marked "the figure").
//!
//! Conventions shared by all presets:
//!
//! - Memory budget: 95% of the datasheet capacity (GB = 10^9 bytes), leaving room for the
//!   runtime's context, the allocator's fragmentation and the communicator's buffers. This is
//!   our choice, not a published figure.
//! - GEMV weight bandwidth (the matrix-vector regime is bound by reading the weights once):
//!   90% of the measured copy bandwidth for f32/f16/bf16 weights, 75% for the block-quantized
//!   types (their kernels also load per-block scales and unpack nibbles). Both fractions are
//!   assumptions, stated here and in each preset's `sources`.
//! - Collective latencies of the GPU links inside a node: NCCL's own cost model (NVIDIA/nccl
//!   `src/graph/tuning.cc`, `ncclTopoTuneModel`: a ring LL base latency plus a hardware latency
//!   per step, 2(N-1) steps for an all-reduce, N-1 for an all-gather or reduce-scatter) plus one
//!   kernel launch, as measured here (collectives pay no node overhead in the planner). Where
//!   only an all-reduce latency is known (InfiniBand between nodes), all-gather and
//!   reduce-scatter get half of it, the same ratio of ring steps.
//! - GPU runtime overheads model a runtime without CUDA graphs (a launch per node); the
//!   with-graphs figures are in `SRC_LAUNCH` and docs/planner.md, not in the presets.
//! - Bus bandwidths follow nccl-tests' convention (NVIDIA/nccl-tests `doc/PERFORMANCE.md`),
//!   the same one [`crate::planner::cluster`] uses, so a `busbw` column of `all_reduce_perf`
//!   can be copied in as is.

use super::cluster::{Cluster, CollectiveFit, DeviceProfile, LinkLevel, Links};
use crate::DType;
use std::collections::BTreeMap;

/// Names [`Cluster::preset`] knows, in the order `metashard` lists them.
pub const PRESET_NAMES: &[&str] = &[
    "h100x8-nvswitch",
    "h100x16-ib",
    "rtx4090x4-pcie",
    "cpu2x2-netns",
];

/// Share of the datasheet memory the planner may fill (see the module doc).
const MEMORY_HEADROOM: f64 = 0.95;
/// GEMV weight bandwidth as a share of copy bandwidth: float weights, quantized weights.
const GEMV_FLOAT_SHARE: f64 = 0.90;
const GEMV_QUANT_SHARE: f64 = 0.75;

// ---- sources -----------------------------------------------------------------------------

const SRC_H100_DATASHEET: &str = "NVIDIA H100 Tensor Core GPU datasheet / product page \
    (https://www.nvidia.com/en-us/data-center/h100/): H100 SXM 80 GB HBM3, 3.35 TB/s, \
    BF16/FP16 tensor 1,979 TFLOP/s with sparsity (989 dense), FP32 67 TFLOP/s, NVLink 900 GB/s";
const SRC_H100_MAMF: &str = "stas00/ml-engineering compute/accelerator/README.md, Maximum \
    Achievable Matmul FLOPS table (https://github.com/stas00/ml-engineering/tree/master/\
    compute/accelerator): H100 SXM BF16 794.5 TFLOP/s measured (80.3% of 989)";
const SRC_H100_COPY: &str = "H100 SXM copy bandwidth ~3.0 TB/s: the issue's figure (~90% of \
    the 3.35 TB/s peak). Measured by this project on an H100 80GB HBM3 (docs/cuda.md, \
    2026-11-26, scripts/gpu_check.sh): torch's device-to-device copy of 256 MiB moved \
    2.80-2.89 TB/s counting bytes read and written, 4-7% under the preset; consistent with \
    pytorch/FBGEMM#3993 (https://github.com/pytorch/FBGEMM/pull/3993): gather/scatter kernels \
    at 2.54-2.77 TB/s on H100 SXM5";
const SRC_NVLINK_RING: &str = "NVIDIA/nccl-tests#212 (https://github.com/NVIDIA/nccl-tests/\
    issues/212), NCCL maintainer: 'NCCL can get an effective NVLink bandwidth of 370GB/s, \
    which you can observe as BusBw when running non-allreduce operations, or when running with \
    NCCL_ALGO=RING' (H100 SXM, NVLink 4 / NVSwitch); the preset uses 365 GB/s";
const SRC_NVLINK_ALPHA: &str = "all-reduce latency 11.8 / 14.2 / 19.0 us at 2 / 4 / 8 H100s on \
    NVSwitch, all-gather and reduce-scatter 11.2 / 12.4 / 14.8 us: derived, NCCL's own cost \
    model plus one kernel launch. NVIDIA/nccl src/graph/tuning.cc (NCCL 2.30.7, \
    ncclTunerConstantsDefaults): ring LL base latency 6.6 us, NVLink ring LL hardware latency \
    0.6 us per step, 2(N-1) steps for an all-reduce and N-1 for an all-gather or \
    reduce-scatter (7.8 / 10.2 / 15.0 us all-reduce at N = 2 / 4 / 8; ring LL128 and simple, \
    tree and NVLS cost more for small messages in that model), plus the 4 us launch of \
    SRC_LAUNCH, as the planner charges collectives no node overhead. Measured with CUDA graphs \
    (no launch per collective): NVIDIA/nccl#1259, 2 H100 80GB HBM3 in an HGX node, \
    all_reduce_perf -G 10, NCCL_ALGO=NVLS: 5.56 us at 128 B, about 6 us with NVLSTree; the \
    earlier 10 / 15 / 31 us were the issue's figures, without a public measurement";
const SRC_IB: &str = "NVIDIA/nccl-tests#290 (https://github.com/NVIDIA/nccl-tests/issues/290), \
    NCCL maintainer: 'For NDR @ 400Gbps you should see 46-48GB/s per NIC' (two H100 nodes, \
    NCCL_ALGO=RING); the preset uses 47 GB/s per GPU's NIC";
const SRC_IB_ALPHA: &str = "inter-node all-reduce latency 17.4 us (all-gather and \
    reduce-scatter 8.7 us, half: ring steps): derived so that a small all-reduce over the 16 \
    GPUs costs the measured 47 us in the two-level form (reduce-scatter 14.8 us inside the \
    node + 17.4 us between nodes + all-gather 14.8 us inside the node, SRC_NVLINK_ALPHA at \
    N = 8). Measurement: NVIDIA/nccl#1244, 2 nodes of 8 H20 (Hopper, NVSwitch) with 16 \
    ConnectX-7 NICs on InfiniBand NDR, NCCL 2.21.5, all_reduce_perf with \
    NCCL_ALGO=NVLSTree: 46.25-47.76 us from 4 B to 512 B (the issue's ~47 us, which the \
    preset used to charge between the nodes alone, 78 us in all)";
const SRC_4090_DATASHEET: &str = "NVIDIA Ada GPU architecture whitepaper, appendix A \
    (https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf) \
    and the RTX 4090 product page (https://www.nvidia.com/en-us/geforce/graphics-cards/\
    40-series/rtx-4090/): 24 GB GDDR6X, 1008 GB/s, FP16/BF16 tensor with FP32 accumulate \
    165.2 TFLOP/s dense, FP32 82.6 TFLOP/s";
const SRC_4090_MATMUL: &str = "mli/transformers-benchmarks#4 (https://github.com/mli/\
    transformers-benchmarks/issues/4): torch.float16 matmul 158.6 TFLOP/s at n = 8192 on an \
    RTX 4090 (BF16 runs at the FP16 rate per the Ada whitepaper)";
const SRC_4090_COPY: &str = "RTX 4090 copy bandwidth assumed 0.9 x 1008 GB/s (the H100's \
    measured/peak ratio 3.0/3.35); the device-local entries of p2pBandwidthLatencyTest on \
    RTX 4090s read 918-924 GB/s (tinygrad/open-gpu-kernel-modules#6, https://github.com/\
    tinygrad/open-gpu-kernel-modules/issues/6)";
const SRC_PCIE: &str = "tinygrad/open-gpu-kernel-modules#26 (https://github.com/tinygrad/\
    open-gpu-kernel-modules/issues/26): two RTX 4090s on PCIe 4.0/5.0 AMD hosts reach ~25 GB/s \
    in all_reduce_perf and nvbandwidth; the issue's figure is ~26 GB/s; the preset uses 25 GB/s. \
    These are measured with tinygrad's patched open kernel modules, which enable peer-to-peer \
    transfers between GeForce cards; the stock driver does not, and NCCL then stages through \
    host memory (slower, not modelled)";
const SRC_PCIE_ALPHA: &str = "all-reduce latency 16.6 us over PCIe for 4 RTX 4090s \
    (all-gather and reduce-scatter 13.6 us): derived, NCCL's own cost model plus one kernel \
    launch, as SRC_NVLINK_ALPHA: NVIDIA/nccl src/graph/tuning.cc (NCCL 2.30.7): ring LL base \
    6.6 us, PCI ring LL hardware latency 1.0 us per step, 2(N-1) = 6 steps, plus the 4 us \
    launch of SRC_LAUNCH; assumes peer-to-peer (SRC_PCIE's patched driver). No public \
    small-message measurement found; the earlier ~40 us was the issue's figure";
const SRC_LAUNCH: &str = "GPU overheads, measured by this project on an H100 80GB HBM3 \
    (driver 580.159.04, CUDA 13.0; scripts/launch_overhead.cu, 2026-11-26, medians of 7 \
    repetitions, 3 runs): 3.8-4.0 us per kernel launched back to back on a stream -> \
    node_overhead_s 4 us; 9.8-10.1 us for a launch followed by a stream synchronization -> \
    step_overhead_s 10 us (the runtime waits for each step's result). With CUDA graphs the \
    same kernels cost 0.92 us each when replayed and a one-kernel graph launch with its \
    synchronization 6.4-7.4 us: a runtime with graphs would have node_overhead_s ~1 us and \
    step_overhead_s ~7 us, and its collectives would lose the 4 us launch in SRC_NVLINK_ALPHA \
    (the presets model a runtime without graphs). Consistent with 'pegainfer (3): From Launch \
    Overhead to CUDA Graph' (https://susun-blog.com/blog/pegainfer-3-cuda-graph): about 4-6 us \
    per launch on an RTX 5070 Ti. This project's CUDA backend: SmolLM2 decodes at 162 \
    tokens/s, 6.2 ms for a step of 724 nodes (docs/cuda.md), about 8 us per node with its \
    per-range synchronizations";
const SRC_RING: &str = "alpha-beta ring model and bus-bandwidth convention: NVIDIA/nccl-tests \
    doc/PERFORMANCE.md (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md)";
const SRC_DERIVED: &str = "derived (assumptions of this preset): memory budget 95% of \
    capacity; GEMV weight bandwidth 90% (f32/f16/bf16) or 75% (q8_0/q4_0/q4_1) of the copy \
    bandwidth; quantized GEMM at the BF16 tensor-core rate (weights dequantized to 16 bits); \
    FP32 GEMM 80% of the non-tensor FP32 peak";

const SRC_NETNS: &str = "measured on this project's test machine (AMD EPYC, 2 logical CPUs \
    under KVM, Zen 2, Linux 6.18) on 2026-11-24 with `scripts/two_hosts.sh bench`, which writes the \
    same figures as target/two-hosts/cluster-netns.json: devices and the intra-host level by \
    `metashard calibrate --devices cpu:2x1 --quick` (in-process CpuCommunicator on pinned \
    workers), the inter-host level fitted (`calibrate --hosts 2 --inter`) to the medians of 3 \
    runs of `metashard bench comm --dist mpi` with one rank in each of two network namespaces \
    joined by an unshaped veth pair (OpenMPI 4.1.4, btl self,tcp), F32 at 4 KiB, 64 KiB, \
    1 MiB and 16 MiB, on a quiet machine (a first run under load measured half these device \
    rates)";
const SRC_NETNS_FIT: &str = "inter-host fit quality: relative RMS residual 23-26% per \
    collective (largest 42-47%): one bus bandwidth cannot follow the drop from ~2.5 GB/s at \
    1 MiB to ~1.2-1.4 GB/s at 16 MiB (three copies of each byte at DRAM speed, see \
    docs/distributed.md); intra-host fit RMS 3-23%";

// ---- figures -----------------------------------------------------------------------------

/// H100 SXM: 80 GB HBM3 (datasheet).
const H100_MEMORY: f64 = 80e9;
/// Measured copy bandwidth, bytes/s (the figure; SRC_H100_COPY).
const H100_COPY_BW: f64 = 3.0e12;
/// BF16 matmul, measured (SRC_H100_MAMF).
const H100_BF16_FLOPS: f64 = 794.5e12;
/// FP32 non-tensor peak (datasheet), of which 80% is assumed reachable (SRC_DERIVED).
const H100_F32_FLOPS: f64 = 0.8 * 66.9e12;

/// RTX 4090: 24 GB GDDR6X (datasheet).
const RTX4090_MEMORY: f64 = 24e9;
/// 0.9 x the 1008 GB/s peak (SRC_4090_COPY).
const RTX4090_COPY_BW: f64 = 0.9 * 1008e9;
/// FP16 matmul, measured (SRC_4090_MATMUL).
const RTX4090_BF16_FLOPS: f64 = 158.6e12;
/// FP32 non-tensor peak 82.6 TFLOP/s (datasheet), 80% assumed reachable (SRC_DERIVED).
const RTX4090_F32_FLOPS: f64 = 0.8 * 82.6e12;

/// Launch costs of a GPU runtime (SRC_LAUNCH).
const GPU_NODE_OVERHEAD_S: f64 = GPU_LAUNCH_NS / 1e9;
const GPU_LAUNCH_NS: f64 = 4000.0;
const GPU_STEP_OVERHEAD_S: f64 = 10e-6;

/// NCCL's cost model (NVIDIA/nccl `src/graph/tuning.cc`, NCCL 2.30.7): ring LL base latency
/// and the per-step hardware latency of a ring LL step over NVLink and over PCI, in whole
/// nanoseconds (so that a sum divided by 1e9 is the nearest f64 to its decimal and JSON files
/// round-trip it).
const NCCL_RING_LL_BASE_NS: f64 = 6600.0;
const NCCL_RING_LL_NVLINK_NS: f64 = 600.0;
const NCCL_RING_LL_PCI_NS: f64 = 1000.0;

/// One logical CPU device of `cpu:2x1` on the test machine (SRC_NETNS): GEMV bandwidth and GEMM
/// FLOP/s by weight type, as measured (a type measured later is added here).
const NETNS_RATES: [(DType, f64, f64); 6] = [
    (DType::F32, 15.40e9, 77.65e9),
    (DType::F16, 13.83e9, 44.15e9),
    (DType::BF16, 13.14e9, 71.71e9),
    (DType::Q8_0, 12.21e9, 75.03e9),
    (DType::Q4_0, 4.75e9, 70.90e9),
    (DType::Q4_1, 5.66e9, 76.60e9),
];
/// Host memory available to each of the 2 devices (`MemAvailable` / 2), bytes.
const NETNS_MEMORY: u64 = 12_242_864_128;
const NETNS_MEM_BW: f64 = 7.03e9;
const NETNS_STEP_OVERHEAD_S: f64 = 48.1e-6;
const NETNS_NODE_OVERHEAD_S: f64 = 0.44e-6;

fn netns_cpu(name: &str) -> DeviceProfile {
    let rates = |pick: fn(&(DType, f64, f64)) -> f64| {
        NETNS_RATES
            .iter()
            .map(|r| (r.0.name().to_string(), pick(r)))
            .collect()
    };
    DeviceProfile {
        name: name.to_string(),
        memory_bytes: NETNS_MEMORY,
        mem_bw: NETNS_MEM_BW,
        gemv_bw: rates(|r| r.1),
        gemm_flops: rates(|r| r.2),
        gemm_flops_by_m: BTreeMap::new(),
        gemv_bw_by_k: BTreeMap::new(),
        attn_flops: None,
        step_overhead_s: NETNS_STEP_OVERHEAD_S,
        node_overhead_s: NETNS_NODE_OVERHEAD_S,
    }
}

/// A level with its own fit per collective: `(alpha at N = 2, bus bandwidth)` for all-reduce,
/// all-gather and reduce-scatter, as `calibrate` measures them.
fn measured_level(kind: &str, ar: (f64, f64), ag: (f64, f64), rs: (f64, f64)) -> LinkLevel {
    let fit = |(alpha, bus_bw): (f64, f64)| CollectiveFit {
        alpha_s: vec![(2, alpha)],
        bus_bw,
    };
    LinkLevel {
        kind: kind.to_string(),
        all_reduce: fit(ar),
        all_gather: fit(ag),
        reduce_scatter: fit(rs),
        broadcast: None,
    }
}

/// A GPU whose GEMV rates follow from its copy bandwidth and whose GEMM rates are the BF16
/// figure for 16-bit and quantized weights (see the module doc), for every weight type of the
/// type table.
fn gpu(name: &str, memory: f64, copy_bw: f64, bf16_flops: f64, f32_flops: f64) -> DeviceProfile {
    let mut gemv_bw = BTreeMap::new();
    let mut gemm_flops = BTreeMap::new();
    for &t in DType::WEIGHT_TYPES {
        let share = if t.is_quantized() {
            GEMV_QUANT_SHARE
        } else {
            GEMV_FLOAT_SHARE
        };
        gemv_bw.insert(t.name().to_string(), share * copy_bw);
        let flops = if t == DType::F32 {
            f32_flops
        } else {
            bf16_flops
        };
        gemm_flops.insert(t.name().to_string(), flops);
    }
    DeviceProfile {
        name: name.to_string(),
        memory_bytes: (MEMORY_HEADROOM * memory) as u64,
        mem_bw: copy_bw,
        gemv_bw,
        gemm_flops,
        gemm_flops_by_m: BTreeMap::new(),
        gemv_bw_by_k: BTreeMap::new(),
        attn_flops: None,
        step_overhead_s: GPU_STEP_OVERHEAD_S,
        node_overhead_s: GPU_NODE_OVERHEAD_S,
    }
}

/// One level of links: all-reduce latencies `ar_alpha` (`[N, seconds]`), all-gather and
/// reduce-scatter at half of them (ring steps), one bus bandwidth for all three.
fn level(kind: &str, ar_alpha: &[(usize, f64)], bus_bw: f64) -> LinkLevel {
    let half: Vec<(usize, f64)> = ar_alpha.iter().map(|&(n, a)| (n, a / 2.0)).collect();
    let fit = |alpha_s: Vec<(usize, f64)>| CollectiveFit { alpha_s, bus_bw };
    LinkLevel {
        kind: kind.to_string(),
        all_reduce: fit(ar_alpha.to_vec()),
        all_gather: fit(half.clone()),
        reduce_scatter: fit(half),
        broadcast: None,
    }
}

/// One level of links whose latencies follow NCCL's ring LL model (SRC_NVLINK_ALPHA): at each
/// N in `ns`, the base latency plus `step_s` per ring step (2(N-1) for an all-reduce, N-1 for
/// an all-gather or reduce-scatter), plus one kernel launch (collectives pay no node overhead).
fn nccl_ring_level(kind: &str, ns: &[usize], step_ns: f64, bus_bw: f64) -> LinkLevel {
    let alpha = |steps: fn(usize) -> usize| -> Vec<(usize, f64)> {
        ns.iter()
            .map(|&n| {
                let t_ns = NCCL_RING_LL_BASE_NS + steps(n) as f64 * step_ns + GPU_LAUNCH_NS;
                (n, t_ns / 1e9)
            })
            .collect()
    };
    let fit = |alpha_s: Vec<(usize, f64)>| CollectiveFit { alpha_s, bus_bw };
    LinkLevel {
        kind: kind.to_string(),
        all_reduce: fit(alpha(|n| 2 * (n - 1))),
        all_gather: fit(alpha(|n| n - 1)),
        reduce_scatter: fit(alpha(|n| n - 1)),
        broadcast: None,
    }
}

/// NVSwitch inside an HGX H100 node: 365 GB/s ring bus bandwidth (SRC_NVLINK_RING), all-reduce
/// latency 11.8 / 14.2 / 19.0 us at 2 / 4 / 8 GPUs (NCCL's model plus a launch,
/// SRC_NVLINK_ALPHA).
fn nvswitch() -> LinkLevel {
    nccl_ring_level(
        "NVSwitch (NVLink 4, 18 links x 25 GB/s per direction)",
        &[2, 4, 8],
        NCCL_RING_LL_NVLINK_NS,
        365e9,
    )
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn h100s(n: usize) -> Vec<DeviceProfile> {
    (0..n)
        .map(|i| {
            gpu(
                &format!("h100-{i}"),
                H100_MEMORY,
                H100_COPY_BW,
                H100_BF16_FLOPS,
                H100_F32_FLOPS,
            )
        })
        .collect()
}

impl Cluster {
    /// A built-in cluster by name (see [`PRESET_NAMES`]); `None` for an unknown name.
    pub fn preset(name: &str) -> Option<Cluster> {
        match name.trim().to_ascii_lowercase().as_str() {
            "h100x8-nvswitch" => Some(Cluster {
                name: "h100x8-nvswitch".into(),
                description: "8 x NVIDIA H100 SXM 80 GB in one HGX node, NVSwitch (NVLink 4)"
                    .into(),
                devices: h100s(8),
                links: Links {
                    devices_per_node: 8,
                    intra: nvswitch(),
                    inter: None,
                },
                sources: strings(&[
                    SRC_H100_DATASHEET,
                    SRC_H100_MAMF,
                    SRC_H100_COPY,
                    SRC_NVLINK_RING,
                    SRC_NVLINK_ALPHA,
                    SRC_LAUNCH,
                    SRC_RING,
                    SRC_DERIVED,
                ]),
                alone_speedup: None,
                alone_speedup_by_m: Vec::new(),
                step_factor_by_m: Vec::new(),
                step_factor_apart_by_m: Vec::new(),
                pipeline_factor: None,
            }),
            "h100x16-ib" => Some(Cluster {
                name: "h100x16-ib".into(),
                description: "2 HGX nodes of 8 x NVIDIA H100 SXM 80 GB: NVSwitch inside a \
                              node, InfiniBand NDR 400 Gb/s (one NIC per GPU) between nodes"
                    .into(),
                devices: h100s(16),
                links: Links {
                    devices_per_node: 8,
                    intra: nvswitch(),
                    // 47 GB/s per NIC (SRC_IB); 17.4 us all-reduce latency between the nodes,
                    // so that a small 16-GPU all-reduce costs the measured 47 us (SRC_IB_ALPHA).
                    inter: Some(level(
                        "InfiniBand NDR 400 Gb/s (ConnectX-7), one NIC per GPU",
                        &[(2, 17.4e-6)],
                        47e9,
                    )),
                },
                sources: strings(&[
                    SRC_H100_DATASHEET,
                    SRC_H100_MAMF,
                    SRC_H100_COPY,
                    SRC_NVLINK_RING,
                    SRC_NVLINK_ALPHA,
                    SRC_IB,
                    SRC_IB_ALPHA,
                    SRC_LAUNCH,
                    SRC_RING,
                    SRC_DERIVED,
                ]),
                alone_speedup: None,
                alone_speedup_by_m: Vec::new(),
                step_factor_by_m: Vec::new(),
                step_factor_apart_by_m: Vec::new(),
                pipeline_factor: None,
            }),
            "rtx4090x4-pcie" => Some(Cluster {
                name: "rtx4090x4-pcie".into(),
                description: "4 x NVIDIA GeForce RTX 4090 24 GB on PCIe 4.0 x16 (no NVLink)".into(),
                devices: (0..4)
                    .map(|i| {
                        gpu(
                            &format!("rtx4090-{i}"),
                            RTX4090_MEMORY,
                            RTX4090_COPY_BW,
                            RTX4090_BF16_FLOPS,
                            RTX4090_F32_FLOPS,
                        )
                    })
                    .collect(),
                links: Links {
                    devices_per_node: 4,
                    // 25 GB/s (SRC_PCIE), 16.6 us all-reduce latency (NCCL's model plus a
                    // launch, SRC_PCIE_ALPHA).
                    intra: nccl_ring_level("PCIe 4.0 x16", &[4], NCCL_RING_LL_PCI_NS, 25e9),
                    inter: None,
                },
                sources: strings(&[
                    SRC_4090_DATASHEET,
                    SRC_4090_MATMUL,
                    SRC_4090_COPY,
                    SRC_PCIE,
                    SRC_PCIE_ALPHA,
                    SRC_LAUNCH,
                    SRC_RING,
                    SRC_DERIVED,
                ]),
                alone_speedup: None,
                alone_speedup_by_m: Vec::new(),
                step_factor_by_m: Vec::new(),
                step_factor_apart_by_m: Vec::new(),
                pipeline_factor: None,
            }),
            "cpu2x2-netns" => Some(Cluster {
                name: "cpu2x2-netns".into(),
                description: "2 simulated hosts (network namespaces on the test machine) of 2 \
                              logical CPU devices each: host memory inside a host, TCP over a \
                              veth pair between hosts (scripts/two_hosts.sh)"
                    .into(),
                devices: (0..4)
                    .map(|i| netns_cpu(&format!("h{}.cpu{}", i / 2, i % 2)))
                    .collect(),
                links: Links {
                    devices_per_node: 2,
                    // calibrate's fits of the in-process communicator (SRC_NETNS).
                    intra: measured_level(
                        "host memory (in-process CpuCommunicator)",
                        (0.225e-6, 47.81e9),
                        (0.272e-6, 19.44e9),
                        (0.245e-6, 26.70e9),
                    ),
                    // bench comm over the veth, fitted (SRC_NETNS, SRC_NETNS_FIT).
                    inter: Some(measured_level(
                        "veth between two network namespaces, TCP (MPI btl tcp), unshaped",
                        (12.42e-6, 2.482e9),
                        (6.05e-6, 2.239e9),
                        (6.18e-6, 2.257e9),
                    )),
                },
                sources: strings(&[SRC_NETNS, SRC_NETNS_FIT, SRC_RING]),
                alone_speedup: None,
                alone_speedup_by_m: Vec::new(),
                step_factor_by_m: Vec::new(),
                step_factor_apart_by_m: Vec::new(),
                pipeline_factor: None,
            }),
            _ => None,
        }
    }

    /// The names [`Cluster::preset`] knows.
    pub fn preset_names() -> &'static [&'static str] {
        PRESET_NAMES
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::Collective;

    #[test]
    fn every_name_resolves_and_unknown_names_do_not() {
        for n in PRESET_NAMES {
            let c = Cluster::preset(n).unwrap();
            assert_eq!(c.name, *n);
            c.validate().unwrap();
        }
        assert!(Cluster::preset("h100x9").is_none());
        assert_eq!(
            Cluster::preset(" H100x8-NVSwitch ").unwrap().name,
            "h100x8-nvswitch"
        );
    }

    #[test]
    fn cpu2x2_netns_prices_collectives_across_hosts_on_the_inter_level() {
        use crate::planner::report::split_fn;
        use crate::planner::{ModelShape, Strategy, Workload, evaluate};
        let c = Cluster::preset("cpu2x2-netns").unwrap();
        assert_eq!((c.n_devices(), c.links.devices_per_node), (4, 2));
        let inter = c.links.inter.clone().expect("two levels");
        let mut flat = c.clone();
        flat.links.inter = None;
        let shape = ModelShape::preset("smollm2-135m").unwrap();
        let split = Strategy::Megatron
            .split(shape.n_layer(), shape.tied)
            .unwrap();
        let w = Workload::parse("pp=16,tg=8,ctx=128").unwrap();
        let decode = |c: &Cluster| {
            let e = evaluate(&shape, split_fn(&shape, &split), c, &w).unwrap();
            e.decode.expect("a decode step")
        };
        // On 4 devices every all-reduce crosses the veth: each pays at least its latency
        // there on top of what one level of host memory would cost.
        let (two, one) = (decode(&c), decode(&flat));
        let n = two
            .collectives
            .iter()
            .find(|x| x.kind == "all-reduce")
            .map_or(0, |x| x.count);
        assert!(n >= 2 * shape.n_layer(), "{:?}", two.collectives);
        let floor = one.comm_s + n as f64 * inter.all_reduce.alpha(2);
        assert!(two.comm_s >= floor, "{} < {floor}", two.comm_s);
        // On the 2 devices of one host nothing crosses: the same as host memory alone.
        let (host, host_flat) = (decode(&c.take(2)), decode(&flat.take(2)));
        assert_eq!(host.comm_s, host_flat.comm_s);
        assert!(
            host.comm_s < two.comm_s / 10.0,
            "{} vs {}",
            host.comm_s,
            two.comm_s
        );
    }

    #[test]
    fn gpu_presets_price_every_weight_type_of_the_table() {
        // Derived from the type table: the test builds' fake type is priced too.
        let d = &Cluster::preset("h100x8-nvswitch").unwrap().devices[0];
        for &t in DType::WEIGHT_TYPES {
            assert!(d.gemv_bw.contains_key(t.name()) && d.gemm_flops.contains_key(t.name()));
        }
        let fake = DType::FakeQ4x16;
        assert_eq!(d.gemv(fake), d.gemv(DType::Q4_0));
        assert_eq!(
            d.gemm(DType::F32) < d.gemm(fake),
            d.gemm(DType::F32) < d.gemm(DType::BF16)
        );
    }

    #[test]
    fn quantized_gemv_is_a_stated_share_of_copy_bandwidth() {
        let c = Cluster::preset("rtx4090x4-pcie").unwrap();
        let d = &c.devices[0];
        assert!((d.gemv(DType::Q4_0) - GEMV_QUANT_SHARE * d.mem_bw).abs() < 1.0);
        assert!((d.gemv(DType::BF16) - GEMV_FLOAT_SHARE * d.mem_bw).abs() < 1.0);
        // Inside a node, NCCL's ring model: all-reduce 2(N-1) steps, all-gather N-1, the same
        // base and launch; between nodes, where only the all-reduce's is known, half of it.
        let l = &c.links.intra;
        let (ar, ag) = (
            l.fit(Collective::AllReduce).alpha(4),
            l.fit(Collective::AllGather).alpha(4),
        );
        assert!(
            (ar - ag - 3.0 * NCCL_RING_LL_PCI_NS / 1e9).abs() < 1e-12,
            "{ar} {ag}"
        );
        let ib = Cluster::preset("h100x16-ib").unwrap().links.inter.unwrap();
        assert_eq!(
            ib.fit(Collective::AllGather).alpha(2) * 2.0,
            ib.fit(Collective::AllReduce).alpha(2)
        );
    }
}
