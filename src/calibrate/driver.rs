//! The calibration driver: opens the device list, runs the measurements in turn (device rates,
//! overheads, links) with progress, and assembles the profile through the planner's
//! `measured_cluster`, with sources saying how each figure was obtained.

use super::decoder_steps::{
    DecoderSteps, PipelineStep, RowsStep, SmallDecoder, StageStep, measure_decoder_steps,
    measure_stage_steps,
};
use super::device_rates::measure_devices;
use super::host::cpu_model;
use super::links::measure_links;
use super::options::{
    ATTN_HEADS, ATTN_KV_ROWS, ATTN_SHAPES, Budget, CalibrateOptions, GEMM_M, GEMV_M, SHAPES,
    SHORT_CHAIN, STEP_GAP,
};
use super::overheads::{Overheads, measure_overheads};
use super::rig::Rig;
use crate::backend::{Device, DeviceKind};
use crate::cpu::CpuOptions;
use crate::devices::parse_devices_with;
use crate::planner::fit::{LinkFitReport, MeasuredRates, measured_cluster};
use crate::planner::{CALIBRATED_M, Cluster};
use crate::{Error, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

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
    /// A small decoder's decoding step as run (median seconds), as the profile predicted it
    /// before the correction, and the nodes on its critical path: the difference per node is
    /// in `node_overhead_s` (`decoder_steps.rs`).
    pub decoder_step_s: f64,
    pub decoder_step_predicted_s: f64,
    pub decoder_step_nodes: f64,
    /// The small decoder's steps of more rows (a batched decoding step, a prompt chunk, a
    /// batch's prompt chunks in one step), as run and as predicted after the per-node
    /// correction: the profile's `step_factor_by_m`.
    pub decoder_rows_steps: Vec<RowsStep>,
    /// The prompt steps again with the decoder mirrored on every device: the profile's
    /// `step_factor_apart_by_m` (empty on one device).
    pub decoder_apart_steps: Vec<RowsStep>,
    /// The decoder's decoding steps as a layer split (stages one after another), as run and
    /// as predicted: the profile's `alone_speedup_by_m` (empty on one device).
    pub decoder_stage_steps: Vec<StageStep>,
    /// The layer split's batched decoding step in micro-batches (pipelined), as run and as
    /// predicted: the profile's `pipeline_factor` (absent on one device).
    pub decoder_pipeline_step: Option<PipelineStep>,
    pub links: Vec<LinkFitReport>,
    pub seconds: f64,
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
    let devices = cpu_devices(spec, opts)?;
    let n = devices.len();
    let budget = Budget::new(opts.quick);
    let link_units = (n - 1) * 3 * budget.link_sizes.len();
    // Per type: a GEMV per row length of the shapes, the small-M products, the GEMM.
    let per_type = SHAPES.len() + CALIBRATED_M.len() + 1;
    let units = 1 + per_type * opts.weight_types.len() + 5 + link_units;
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
    let (level, links) = measure_links(n, &budget, &step, rates.mem_bw)?;

    let names: Vec<(String, u64)> = devices
        .iter()
        .map(|d| {
            let m = d.memory();
            let memory = if m.free > 0 { m.free } else { m.total };
            (d.name(), memory as u64)
        })
        .collect();
    let measured = MeasuredRates {
        gemv_bw: rates.gemv.clone(),
        gemm_flops: rates.gemm.clone(),
        gemm_flops_by_m: rates.gemm_by_m.clone(),
        gemv_bw_by_k: rates.gemv_by_k.clone(),
        attn_flops: Some(rates.attn_flops),
        mem_bw: rates.mem_bw,
        step_overhead_s: over.step_s,
        node_overhead_s: over.node_s,
        // From the layer split's steps below, once the profile prices a step.
        alone_speedup: None,
        alone_speedup_by_m: Vec::new(),
    };
    let mut cluster = measured_cluster(
        format!("calibrated {spec}"),
        format!(
            "{n} logical CPU device{} of `{spec}` on {}, measured by metashard calibrate",
            if n == 1 { "" } else { "s" },
            cpu_model()
        ),
        &names,
        &measured,
        level,
        Vec::new(),
    )?;
    // A real decoding step against the profile's prediction: what a step costs per node
    // beyond the chains (`decoder_steps.rs`).
    step("decoding steps of a small decoder");
    let open = crate::runtime::OpenOptions {
        precision: opts.precision,
        ..Default::default()
    };
    let decoder = SmallDecoder::new()?;
    let dec = measure_decoder_steps(&decoder, spec, &open, &cluster)?;
    for d in &mut cluster.devices {
        d.node_overhead_s += dec.extra_node_s;
    }
    // The one-token step is where the per-node correction was fitted: factor 1 there.
    cluster.step_factor_by_m = std::iter::once((1, 1.0))
        .chain(dec.rows.iter().map(|r| (r.rows, r.factor)))
        .collect();
    // Steps apart: the prompt steps timed mirrored; below their rows the tensor split's
    // points (the decoding steps are not timed mirrored: on cpu:3x1 three runs priced a
    // mirrored decoding step within 2-16% with them, the prompts 30-40% off before).
    if let Some(first) = dec.apart.first() {
        cluster.step_factor_apart_by_m = cluster
            .step_factor_by_m
            .iter()
            .copied()
            .filter(|&(m, _)| m < first.rows)
            .chain(dec.apart.iter().map(|r| (r.rows, r.factor)))
            .collect();
    }
    // The layer split's steps, stages one after another: how much faster a device computes
    // alone than the rates measured with all of them busy (`decoder_steps.rs`).
    step("a layer split's stages, one at a time");
    let (stages, piped) = measure_stage_steps(&decoder, spec, &open, &cluster)?;
    cluster.alone_speedup_by_m = stages.iter().map(|s| (s.rows, s.speedup)).collect();
    cluster.alone_speedup = cluster.alone_speedup_by_m.last().map(|&(_, s)| s);
    cluster.pipeline_factor = piped.as_ref().map(|p| p.factor);
    progress("done", 1.0);
    let seconds = start.elapsed().as_secs_f64();
    cluster.sources = sources(
        spec,
        opts,
        &budget,
        n,
        (&over, &dec, &stages, piped.as_ref()),
        &links,
        seconds,
    );
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
        decoder_step_s: dec.measured_s,
        decoder_step_predicted_s: dec.predicted_s,
        decoder_step_nodes: dec.nodes,
        decoder_rows_steps: dec.rows.clone(),
        decoder_apart_steps: dec.apart.clone(),
        decoder_stage_steps: stages,
        decoder_pipeline_step: piped,
        links,
        seconds,
    })
}

/// The devices of `spec`, opened with the options' precision: CPU devices only (the links are
/// timed with the host communicator), and the options' weight types checked.
fn cpu_devices(spec: &str, opts: &CalibrateOptions) -> Result<Vec<Arc<dyn Device>>> {
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
    opts.check()?;
    Ok(devices)
}

/// Where each figure of the profile comes from, in words.
fn sources(
    spec: &str,
    opts: &CalibrateOptions,
    budget: &Budget,
    n: usize,
    (over, dec, stages, piped): (
        &Overheads,
        &DecoderSteps,
        &[StageStep],
        Option<&PipelineStep>,
    ),
    links: &[LinkFitReport],
    seconds: f64,
) -> Vec<String> {
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
             F32 adds (bytes read + written); attn_flops from flash_attn of one query row of \
             {ATTN_HEADS} heads over {ATTN_KV_ROWS} f16 cache rows of 2 KV heads, head sizes \
             {:?}; precision {}",
            budget.reps,
            &SHAPES[..],
            &ATTN_SHAPES[..],
            opts.precision
        ),
        format!(
            "overheads: steps built and computed through {}; node_overhead_s is the slope \
             between chains of {SHORT_CHAIN} and {} tiny nodes run back to back, \
             step_overhead_s the cost of a one-node step after {STEP_GAP:?} idle less its \
             node ({:.1} us back to back); plus {:.2} us per node from a small decoder's \
             decoding step as run ({:.1} us measured, {:.1} us predicted before, {:.0} nodes \
             on its critical path)",
            if n > 1 {
                "the meta device's backend"
            } else {
                "the device's backend"
            },
            budget.chain,
            over.back_to_back_s * 1e6,
            dec.extra_node_s * 1e6,
            dec.measured_s * 1e6,
            dec.predicted_s * 1e6,
            dec.nodes
        ),
    ];
    let steps = |rows: &[RowsStep]| {
        rows.iter()
            .map(|r| {
                format!(
                    "step of {} rows ({:.1} us measured, {:.1} us predicted, {:.1} us of it \
                     kernels: x{:.3})",
                    r.rows,
                    r.measured_s * 1e6,
                    r.predicted_s * 1e6,
                    r.predicted_kernels_s * 1e6,
                    r.factor
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    sources.push(format!(
        "step_factor_by_m: the small decoder's {}, each as run against its prediction after \
         the per-node correction; the factor on the kernels' time that makes them agree",
        steps(&dec.rows)
    ));
    if !dec.apart.is_empty() {
        sources.push(format!(
            "step_factor_apart_by_m: step_factor_by_m's points below the first here, then \
             the small decoder mirrored on every device: its {}",
            steps(&dec.apart)
        ));
    }
    if !stages.is_empty() {
        let points = stages
            .iter()
            .map(|s| {
                format!(
                    "step of {} rows ({:.1} us measured, {:.1} us predicted at 1, {:.1} us of \
                     it divided by the speedup: {:.3})",
                    s.rows,
                    s.measured_s * 1e6,
                    s.predicted_s * 1e6,
                    s.scaled_s * 1e6,
                    s.speedup
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        sources.push(format!(
            "alone_speedup_by_m: the small decoder as a layer split (stages one after another), \
             its {points}; the speedup that makes each prediction its measurement"
        ));
    }
    if let Some(p) = piped {
        sources.push(format!(
            "pipeline_factor: the small decoder's layer split, its batched decoding step of {} \
             rows in {} micro-batches ({:.1} us measured, {:.1} us predicted with the alone \
             speedups): {:.3}",
            p.rows,
            p.micro_batches,
            p.measured_s * 1e6,
            p.predicted_s * 1e6,
            p.factor
        ));
    }
    for l in links {
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
    sources
}
