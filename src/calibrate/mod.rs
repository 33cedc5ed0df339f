//! `metashard calibrate`: measure this machine as the cost model sees it, and write it down as
//! a [`Cluster`](crate::planner::Cluster). This is the measuring half of calibration, above the
//! planner, the devices and `verify` (it opens devices and times graphs and collectives); the
//! pure half (the least-squares fits, assembling the cluster) is the planner's
//! (`planner::fit`). One file per job: `options.rs` (what to measure and how long), `host.rs`
//! (probing the host), `driver.rs` ([`calibrate`], [`calibrate_report`]), `rig.rs` (timing
//! graphs on all devices at once), `device_rates.rs` (GEMV, GEMM, memory, per-node cost),
//! `overheads.rs` (step and node overheads through a run's backend), `decoder_steps.rs` (a
//! small decoder's decoding steps against the profile's prediction), `links.rs` (timing
//! collectives).
//!
//! The cost model (see `planner/cluster.rs`) prices a matrix product with weights at no less
//! than `weight bytes / gemv_bw[dtype]` and `2 M N K / gemm_flops[dtype]`, interpolated in
//! M through the `gemm_flops_by_m` points in between; any other op at `bytes moved / mem_bw`; every node of a
//! device's program at `node_overhead_s` more, every graph computation at `step_overhead_s`;
//! and collectives by the links' alpha-beta fits. [`calibrate`] measures exactly these
//! quantities, on the devices of a device list opened the way a run opens them (same backend,
//! same precision default, `DeviceSet::open`):
//!
//! - **Device rates** run on all devices of the list at once, each device's graph computed
//!   through its own backend's plan by a [`DeviceWorkers`](crate::workers::DeviceWorkers)
//!   worker (pinned as the meta device pins its workers), so devices that share memory
//!   bandwidth are measured sharing it, as in a tensor-parallel step. Each figure is a median
//!   over repeated runs of the time from the first device starting to the last one finishing
//!   (what a step waits for), the same for every device of the list (they are identical):
//!   - GEMV: M = 1 products over weights shaped like a small decoder's projections
//!     (K = 576, 1536, 2048, 4096; see [`SHAPES`]), each row length on its own, repeated until
//!     they far exceed the last-level cache so weights stream from memory as in a decode step;
//!     `gemv_bw_by_k` = each row length's weight bytes per second of kernel time, `gemv_bw` =
//!     all of them together;
//!   - between the two: M = 2 and 8 over the streamed weights, M = 32 over one copy
//!     (`gemm_flops_by_m`, the points the cost model interpolates through);
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
//! - **A real decoding step**: a synthetic decoder of a small model's width (24 x 512, Q4_1)
//!   decoded through the run path, its median span's mean
//!   step against the cost model's prediction on the profile so far; the difference per node
//!   of the step's critical path is added to `node_overhead_s` (`decoder_steps.rs`). Then, so
//!   corrected, a batched decoding step of 8 sequences, a prompt chunk of 64 tokens and 8
//!   such chunks in one step of the same decoder, each against its prediction: the factor
//!   on the kernels' time that makes them agree is the cluster's `step_factor_by_m` (1 at
//!   one row, where the per-node correction was fitted). On several devices the two prompt
//!   steps again with the decoder mirrored on every device (no collective inside the
//!   layers, whole matrices per device): the cluster's `step_factor_apart_by_m`, for steps
//!   whose devices do not meet at every layer. Last, on several devices, the decoder as a
//!   layer split (stages one after another): its decoding steps of 1 and 8 sequences
//!   against their predictions give the alone speedup (how much faster a device computes
//!   while the others wait than the rates measured with all busy) that makes them agree:
//!   the cluster's `alone_speedup_by_m` and `alone_speedup`; its batched step in 2
//!   micro-batches (pipelined through the stages) against its prediction with those gives
//!   the cluster's `pipeline_factor`.
//! - **Links**: for each group size N = 2..=n,
//!   [`CpuCommunicator`](crate::collectives::CpuCommunicator) ranks on N workers pinned like
//!   the meta device's, timing all-reduce, all-gather and reduce-scatter of F32 tensors of
//!   4 KiB .. 16 MiB (median per size), fitted (`planner::fit`) to
//!   `alpha(N) + factor(N) B / bus_bw` by weighted least squares (relative errors, so the
//!   latency-bound small sizes count as much as the bandwidth-bound large ones; one bus
//!   bandwidth for every N, one alpha per N, alphas constrained to be >= 0). The fit quality
//!   (RMS and largest relative residual) is reported.
//!   `factor(N)` is nccl-tests' bus-bandwidth factor (NVIDIA/nccl-tests `doc/PERFORMANCE.md`):
//!   2(N-1)/N for all-reduce, (N-1)/N for gathers and scatters of the full tensor.
//! - **Memory budget**: the host's available memory divided by the device count (what each
//!   CPU device reports as free).
//!
//! Only CPU device lists are calibrated: the links are measured with the host communicator,
//! which is what CPU devices use.

mod decoder_steps;
mod device_rates;
mod driver;
mod host;
mod links;
mod options;
mod overheads;
mod rig;

pub use crate::planner::fit::{LinkFitReport, LinkSample, fit_collective, fit_level};
pub use decoder_steps::{
    ALONE_M, BATCH_ROWS, PIPELINE_MICRO_BATCHES, PROMPT_ROWS, PipelineStep, RowsStep, StageStep,
};
pub use driver::{Calibration, calibrate, calibrate_report};
pub use options::{
    CalibrateOptions, GEMM_M, GEMV_M, MEASURED_TYPES, SHAPES, STEP_GAP, types_of, with_f32,
};
