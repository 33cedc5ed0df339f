//! Layer split in the cost model (llama.cpp's `-sm layer`; `--split-mode layer` on the
//! scheduler): whole layers on each device, in proportion to the shares (`layer_ranges`, the
//! same assignment a run uses). A stage's time for one micro-batch is the sum of its segments,
//! each on the device holding it (the embedding on the first device, the output on the last),
//! plus the copy of the residual stream (`n_embd` x tokens, f32) to the next stage, costed by
//! the link's alpha and bus bandwidth at two devices, plus the stage's per-step overhead.
//!
//! A step's rows (a prompt chunk's tokens, or a batched decode step's sequences) may be cut
//! into `m` micro-batches that flow through the stages as a pipeline (GPipe's schedule,
//! Huang et al. 2019, arXiv:1811.06965: stage k runs micro-batch j while stage k + 1 runs
//! micro-batch j - 1): the step costs the fill and drain, the sum of the stages' times for one
//! micro-batch, plus `m - 1` times the slowest stage (with its copy), the steady state. With
//! one micro-batch this is the stages strictly one after another. Each micro-batch is costed
//! by the same per-node model at its own size, so it streams its stage's weights again: the
//! memory floor holds at any `m`, and a memory-bound step is best left whole.
//! [`MicroBatches::Best`] takes the fastest count of 1, 2, 4, ... up to
//! [`MAX_MICRO_BATCHES`] and the step's rows, and the report says which it took.
//!
//! The segment times come from a whole-model evaluation on each distinct device profile alone
//! (the same per-node cost model as every other strategy); memory is the resident bytes of the
//! device's segments plus that evaluation's activation peak. Profiles are measured with every
//! device busy; where the cluster says a device alone runs faster (`Cluster::alone_speedup`,
//! devices sharing cores), the fill and drain (one stage at a time) and the steady state
//! (min(m, stages) at once) are scaled by [`Cluster::concurrency_factor`]. A stage's step of
//! a micro-batch's rows is costed like any step (`evaluate::step_at`), so the cluster's step
//! factor at those rows (`Cluster::step_factor_at`) is in it too.
//!
//! A pipelined decoding step (m > 1) is multiplied by the cluster's measured
//! [`Cluster::pipeline_factor`] (a calibration's small decoder, 8 sequences in 2
//! micro-batches, against this model): each micro-batch's stage runs on a thread started for
//! it, on a device idle since its last one, slower than the same rows outside a pipeline on
//! the hosts measured; prompts' micro-batches are left as modelled.
//!
//! A search costs the hybrid split in groups of s on several counts of devices; each count's
//! stage is the cluster's first s devices, so a [`StageCache`] evaluates it and its
//! micro-batches' steps once for all of them (the same numbers: evaluations are deterministic).

use super::cluster::{Cluster, DeviceProfile};
use super::evaluate::{Evaluation, Placed, StepCost, Workload, evaluate_placed, step_at};
use super::shape::ModelShape;
use super::strategy::Strategy;
use crate::models::layer_split::layer_ranges;
use crate::models::split::by_layer;
use crate::{Error, Result};
use parking_lot::Mutex;
use serde::Serialize;
use std::sync::Arc;

/// Memory of one device under a layer split.
#[derive(Clone, Debug, Serialize)]
pub struct LayerDeviceMemory {
    pub device: String,
    /// Its layers, `[first, end)`.
    pub layers: (usize, usize),
    /// Weights and KV cache of its segments.
    pub resident: usize,
    pub activations: usize,
    pub total: usize,
    pub budget: u64,
}

/// The prediction for a layer split.
#[derive(Clone, Debug, Serialize)]
pub struct LayerSplitCost {
    pub workload: Workload,
    /// Devices per stage: 1 for the layer split, the group's devices for the hybrid split.
    pub group: usize,
    /// Seconds of one prefill chunk, and the chunks.
    pub prefill_s: f64,
    pub prefill_chunks: usize,
    /// Seconds of one decode step.
    pub decode_s: f64,
    pub total_s: f64,
    /// Copies of the residual stream per micro-batch.
    pub copies: usize,
    /// Micro-batches each prompt step and each decode step was cut into (1: the stages one
    /// after another, as without a pipeline).
    pub prefill_micro_batches: usize,
    pub decode_micro_batches: usize,
    pub memory: Vec<LayerDeviceMemory>,
}

impl LayerSplitCost {
    /// The first device over its budget, and by how many bytes.
    pub fn over_budget(&self) -> Option<(&LayerDeviceMemory, u64)> {
        self.memory
            .iter()
            .find(|m| m.total as u64 > m.budget)
            .map(|m| (m, m.total as u64 - m.budget))
    }

    pub fn table(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let pipeline = format!(
            "micro-batches through the stages: {} per prompt step, {} per decode step (1: one \
             stage after another)",
            self.prefill_micro_batches, self.decode_micro_batches
        );
        let _ = match self.group {
            1 => writeln!(
                s,
                "layer split: whole layers per device, {} copies of the residual stream per \
                 micro-batch; {pipeline}",
                self.copies
            ),
            g => writeln!(
                s,
                "hybrid split: groups of {g} devices (Megatron inside a group), whole layers \
                 per group, {} copies of the residual stream per micro-batch; {pipeline}",
                self.copies
            ),
        };
        let _ = writeln!(
            s,
            "prefill: {:.3} ms per chunk ({} chunk{}); decode: {:.3} ms per token, {:.1} \
             tokens/s; workload total: {:.3} s",
            self.prefill_s * 1e3,
            self.prefill_chunks,
            if self.prefill_chunks == 1 { "" } else { "s" },
            self.decode_s * 1e3,
            if self.decode_s > 0.0 {
                1.0 / self.decode_s
            } else {
                0.0
            },
            self.total_s
        );
        let _ = writeln!(
            s,
            "{:<12} {:>10} {:>14} {:>12} {:>12} {:>12}",
            "device", "layers", "resident MiB", "act MiB", "total MiB", "budget MiB"
        );
        let mib = |b: usize| b as f64 / 1048576.0;
        for m in &self.memory {
            let _ = writeln!(
                s,
                "{:<12} {:>10} {:>14.1} {:>12.1} {:>12.1} {:>12.1}{}",
                m.device,
                if m.layers.1 > m.layers.0 {
                    format!("{}-{}", m.layers.0, m.layers.1 - 1)
                } else {
                    "none".to_string()
                },
                mib(m.resident),
                mib(m.activations),
                mib(m.total),
                m.budget as f64 / 1048576.0,
                if m.total as u64 > m.budget {
                    "  OVER"
                } else {
                    ""
                }
            );
        }
        s
    }
}

/// How a layer or hybrid split's steps are cut into micro-batches through its stages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub enum MicroBatches {
    /// The fastest of 1, 2, 4, ... up to [`MAX_MICRO_BATCHES`] and the step's rows.
    #[default]
    Best,
    /// This many, at most the step's rows (1: the stages strictly one after another).
    Fixed(usize),
}

/// The most micro-batches [`MicroBatches::Best`] tries.
pub const MAX_MICRO_BATCHES: usize = 16;

impl MicroBatches {
    /// The counts to cost for a step of `rows` rows (tokens of a prompt step, sequences of a
    /// decode step).
    fn candidates(self, rows: usize) -> Vec<usize> {
        let rows = rows.max(1);
        match self {
            MicroBatches::Fixed(m) => vec![m.clamp(1, rows)],
            MicroBatches::Best => std::iter::successors(Some(1usize), |m| Some(m * 2))
                .take_while(|&m| m <= rows.min(MAX_MICRO_BATCHES))
                .collect(),
        }
    }
}

/// One stage's whole-model evaluation (a device alone, or a group of devices under the
/// Megatron split) and each of its devices' resident bytes per segment.
struct Stage {
    /// The stage's device profiles, names aside (stages of equal profiles share this).
    profiles: Vec<DeviceProfile>,
    eval: Evaluation,
    /// Bytes per segment, per device of the stage.
    bytes: Vec<Vec<usize>>,
    /// The model placed on the stage's devices, and those devices as a cluster: for the
    /// micro-batches' steps.
    placed: Placed,
    group: Cluster,
    /// The micro-batches' steps costed so far.
    steps: Mutex<Vec<(StepKey, StepCost)>>,
}

/// A step of a stage: (rows, start, sequences).
type StepKey = (usize, usize, usize);

impl Stage {
    /// The cost of a step of `rows` rows at `start` holding `seqs` sequences on this stage
    /// (`step_at`), costed once.
    fn step(&self, rows: usize, start: usize, seqs: usize) -> Result<StepCost> {
        let key = (rows, start, seqs);
        let done = |steps: &[(StepKey, StepCost)]| {
            steps
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, c)| c.clone())
        };
        if let Some(c) = done(&self.steps.lock()) {
            return Ok(c);
        }
        // Costed without the lock held (another thread may cost it too: the same answer).
        let mut scratch = vec![0usize; self.group.devices.len()];
        let c = step_at(&self.placed, &self.group, rows, start, seqs, &mut scratch)?;
        let mut steps = self.steps.lock();
        if done(&steps).is_none() {
            steps.push((key, c.clone()));
        }
        Ok(c)
    }
}

/// What a stage's evaluation depends on besides the model and the split strategy (fixed for
/// one [`StageCache`]): its devices and links, the workload, and whether a tied output shares
/// the embedding's bytes.
#[derive(PartialEq)]
struct StageKey {
    group: Cluster,
    workload: Workload,
    share_tied: bool,
}

/// Stage evaluations shared by the layer and hybrid splits of one model that one search costs
/// (`search_layouts`): the hybrid split in groups of s on 16 devices and on 8 evaluates the same
/// stage (the first s devices, the same links) and the same micro-batches' steps. Evaluations
/// are deterministic, so a stage taken from here costs exactly what a new one would. Use one
/// cache per model and workload only.
#[derive(Default)]
pub struct StageCache {
    stages: Mutex<Vec<(StageKey, Arc<Stage>)>>,
}

impl StageCache {
    /// Stages held.
    pub fn len(&self) -> usize {
        self.stages.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The layer split of `shape` over `cluster`'s devices with `shares` (even when absent) for
/// workload `w`, pipelined with the fastest number of micro-batches.
pub fn evaluate_layer_split(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    shares: Option<&[f64]>,
) -> Result<LayerSplitCost> {
    evaluate_stages(shape, cluster, w, shares, 1, MicroBatches::Best, None)
}

/// As [`evaluate_layer_split`] with the micro-batches given.
pub fn evaluate_layer_split_with(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    shares: Option<&[f64]>,
    micro: MicroBatches,
) -> Result<LayerSplitCost> {
    evaluate_stages(shape, cluster, w, shares, 1, micro, None)
}

/// The hybrid split (`run --split-mode hybrid --groups G`): G contiguous groups of the
/// devices, each a meta device under the Megatron split, the layers split across the groups by
/// the groups' total `shares` (per device; even when absent), pipelined through the groups as
/// the layer split is. An error naming `--groups` unless G divides the devices.
pub fn evaluate_hybrid_split(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    groups: usize,
    shares: Option<&[f64]>,
) -> Result<LayerSplitCost> {
    evaluate_hybrid_split_with(shape, cluster, w, groups, shares, MicroBatches::Best)
}

/// As [`evaluate_hybrid_split`] with the micro-batches given.
pub fn evaluate_hybrid_split_with(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    groups: usize,
    shares: Option<&[f64]>,
    micro: MicroBatches,
) -> Result<LayerSplitCost> {
    evaluate_hybrid_split_cached(shape, cluster, w, groups, shares, micro, None)
}

/// As [`evaluate_hybrid_split_with`], taking the stages' evaluations from `cache` when it has
/// them (and keeping those it makes there): `groups` groups of equal size (an error naming
/// `--groups` otherwise), the shares per device summed per group.
pub(super) fn evaluate_hybrid_split_cached(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    groups: usize,
    shares: Option<&[f64]>,
    micro: MicroBatches,
    cache: Option<&StageCache>,
) -> Result<LayerSplitCost> {
    let n = cluster.devices.len();
    if groups == 0 || !n.is_multiple_of(groups) {
        return Err(Error::invalid_argument(
            "--groups",
            groups,
            format!("the planner takes groups of equal size: a divisor of the {n} devices"),
        ));
    }
    let per = n / groups;
    let group_shares = shares.map(|s| s.chunks(per).map(|c| c.iter().sum()).collect::<Vec<f64>>());
    if let Some(s) = shares
        && s.len() != n
    {
        return Err(Error::invalid_argument(
            "--shares",
            format!("{s:?}"),
            format!("one share per device ({n})"),
        ));
    }
    evaluate_stages(
        shape,
        cluster,
        w,
        group_shares.as_deref(),
        per,
        micro,
        cache,
    )
}

/// Stages of `per` devices each (1: the layer split; more: the hybrid split), the layers split
/// across the stages by `shares` (one per stage), each step pipelined through the stages in
/// `micro` micro-batches.
fn evaluate_stages(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    shares: Option<&[f64]>,
    per: usize,
    micro: MicroBatches,
    cache: Option<&StageCache>,
) -> Result<LayerSplitCost> {
    shape.check()?;
    w.validate()?;
    cluster.validate()?;
    let n = cluster.devices.len();
    let stages = n / per.max(1);
    let n_layer = shape.n_layer();
    let even = vec![1.0; stages];
    let shares = shares.unwrap_or(&even);
    if shares.len() != stages {
        return Err(Error::invalid_argument(
            "--shares",
            format!("{shares:?}"),
            format!("one share per device ({n})"),
        ));
    }
    let ranges = layer_ranges(n_layer, shares)?;
    let split = match per {
        1 => Strategy::Mirrored,
        _ => Strategy::Megatron,
    }
    .split(n_layer, shape.tied)
    .expect("a fixed strategy has an assignment");
    let last = ranges
        .iter()
        .rposition(|r| !r.is_empty())
        .unwrap_or(stages - 1);
    let first = ranges.iter().position(|r| !r.is_empty()).unwrap_or(0);
    // A tied output on another stage than the embedding is held twice (each stage its copy).
    let mut stage_shape = shape.for_split(per, &split);
    stage_shape.share_tied &= first == last;
    let stage_shape = &stage_shape;
    let unnamed = |p: &DeviceProfile| DeviceProfile {
        name: String::new(),
        ..p.clone()
    };
    // Stages of the same profiles (names aside) share an evaluation.
    let mut evals: Vec<Arc<Stage>> = Vec::new();
    let mut which = Vec::with_capacity(stages);
    for st in 0..stages {
        let devices = &cluster.devices[st * per..(st + 1) * per];
        let profiles: Vec<DeviceProfile> = devices.iter().map(unnamed).collect();
        let i = match evals.iter().position(|e| e.profiles == profiles) {
            Some(i) => i,
            None => {
                // The stage's devices with the cluster's links: a group inside a node
                // communicates over the links inside it (`Links::time` of `per` devices).
                let group = Cluster {
                    devices: devices.to_vec(),
                    ..cluster.clone()
                };
                let key = StageKey {
                    group,
                    workload: *w,
                    share_tied: stage_shape.share_tied,
                };
                let cached = cache.and_then(|c| {
                    let stages = c.stages.lock();
                    stages
                        .iter()
                        .find(|(k, _)| *k == key)
                        .map(|(_, s)| s.clone())
                });
                let stage = match cached {
                    Some(stage) => stage,
                    None => {
                        let group = key.group.clone();
                        let placed = Placed::new(
                            stage_shape,
                            &group,
                            by_layer(stage_shape.split_dims(), split.clone()),
                            w.cache_rows(),
                        )?;
                        let eval = evaluate_placed(&placed, &group, w)?;
                        let stage = Arc::new(Stage {
                            profiles,
                            eval,
                            bytes: placed.bytes_by_segment(),
                            placed,
                            group,
                            steps: Mutex::new(Vec::new()),
                        });
                        if let Some(c) = cache {
                            c.stages.lock().push((key, stage.clone()));
                        }
                        stage
                    }
                };
                evals.push(stage);
                evals.len() - 1
            }
        };
        which.push(i);
    }
    // The stage of segment s: 0 embedding, 1..=L layers, L + 1 output.
    let stage_of = |s: usize| -> usize {
        if s == 0 {
            first
        } else if s > n_layer {
            last
        } else {
            ranges
                .iter()
                .position(|r| r.contains(&(s - 1)))
                .unwrap_or(last)
        }
    };
    let owners: Vec<usize> = (0..n_layer + 2).map(stage_of).collect();
    let copies = owners.windows(2).filter(|p| p[0] != p[1]).count();
    // Stages that run a part of the step.
    let used = (0..stages).filter(|st| owners.contains(st)).count().max(1);
    // The residual stream goes from the last device of one stage to the first of the next.
    let link = |a: usize, b: usize| {
        let node = cluster.links.devices_per_node.max(1);
        match &cluster.links.inter {
            Some(inter) if (a * per + per - 1) / node != (b * per) / node => &inter.all_gather,
            _ => &cluster.links.intra.all_gather,
        }
    };
    // Each stage that runs a part pays its per-step overhead (the segments leave it out).
    let overhead = cluster
        .devices
        .iter()
        .map(|d| d.step_overhead_s)
        .fold(0.0, f64::max);
    // Each stage's seconds for one micro-batch of `tokens` rows (`costs`: the step's cost on
    // each distinct stage evaluation): its segments, its overhead, the copy out of it.
    // Without `output`, the output segment (the last stage's logits) is left out.
    let stage_times = |costs: &[StepCost], tokens: usize, output: bool| -> Vec<f64> {
        let mut t = vec![0.0; stages];
        for (s, &st) in owners.iter().enumerate() {
            if !output && s == n_layer + 1 {
                continue;
            }
            t[st] += costs[which[st]]
                .segments
                .get(s)
                .map_or(0.0, |x| x.compute_s + x.comm_s);
        }
        let bytes = (shape.cfg.n_embd * tokens * 4) as f64;
        for p in owners.windows(2).filter(|p| p[0] != p[1]) {
            let fit = link(p[0], p[1]);
            t[p[0]] += fit.alpha(2) + bytes / fit.bus_bw.max(1.0);
        }
        for (st, x) in t.iter_mut().enumerate() {
            if owners.contains(&st) {
                *x += overhead;
            }
        }
        t
    };
    // A step of `rows` rows at `start` in the fastest (or the given) number of micro-batches:
    // fill and drain (every stage once) plus m - 1 times the slowest stage. `seqs`: the
    // sequences in the step, each with its logits (a decode step: one per row). One sequence's
    // prompt cut into micro-batches has logits in its last micro-batch only: its output
    // segment is paid once, at the end of the drain.
    // A pipelined decoding step (m > 1) takes the cluster's measured pipeline factor.
    let pipelined = |step: Option<(usize, usize)>,
                     seqs: usize,
                     factor: f64,
                     whole: &dyn Fn(&Evaluation) -> Option<&StepCost>|
     -> Result<(f64, usize)> {
        let Some((rows, start)) = step else {
            return Ok((0.0, 1));
        };
        let mut best: Option<(f64, usize)> = None;
        let candidates = micro.candidates(rows);
        // Sequences per micro-batch (a batch is cut between sequences) and rows of each.
        let cut = |m: usize| {
            let part = rows.div_ceil(m);
            (part, seqs.div_ceil(m).clamp(1, part))
        };
        // The micro-batches' steps (m > 1) are independent: cost them at once.
        let steps: Vec<Result<Vec<StepCost>>> = {
            use rayon::prelude::*;
            candidates
                .par_iter()
                .filter(|&&m| m > 1)
                .map(|&m| {
                    let (part, logits) = cut(m);
                    // The middle micro-batch's context stands for all of them (a prompt's
                    // later chunks attend to the earlier ones); a batch's micro-batches hold
                    // whole sequences, at the step's positions.
                    let at = match seqs {
                        1 => start + (rows - part) / 2,
                        _ => start,
                    };
                    evals.iter().map(|e| e.step(part, at, logits)).collect()
                })
                .collect()
        };
        let mut steps = steps.into_iter();
        for m in candidates {
            let (part, _) = cut(m);
            let costs: Vec<StepCost> = match m {
                1 => evals
                    .iter()
                    .map(|e| whole(&e.eval).cloned().unwrap_or_default())
                    .collect(),
                _ => steps.next().expect("a step per micro-batch count")?,
            };
            let once = seqs < m;
            let t = stage_times(&costs, part, !once);
            let output = match once {
                true => costs[which[last]]
                    .segments
                    .get(n_layer + 1)
                    .map_or(0.0, |x| x.compute_s + x.comm_s),
                false => 0.0,
            };
            // Fill and drain run one stage at a time, the steady state min(m, stages) at
            // once: on devices that share cores each runs faster than calibrated with all
            // of them busy (`Cluster::concurrency_factor`).
            let alone = cluster.concurrency_factor(per, part);
            let busy = cluster.concurrency_factor(m.min(used) * per, part);
            let slowest = t.iter().copied().fold(0.0, f64::max);
            let mut total =
                (t.iter().sum::<f64>() + output) * alone + (m - 1) as f64 * slowest * busy;
            if m > 1 {
                total *= factor;
            }
            if best.is_none_or(|(b, _)| total < b) {
                best = Some((total, m));
            }
        }
        Ok(best.unwrap_or((0.0, 1)))
    };
    let e0 = &evals[which[first]].eval;
    let (prefill_s, prefill_micro_batches) =
        pipelined(w.prefill_step(), w.batch, 1.0, &|e: &Evaluation| {
            e.prefill.as_ref()
        })?;
    let decode_rows = w.decode_step().map_or(1, |(rows, _)| rows);
    let (decode_s, decode_micro_batches) = pipelined(
        w.decode_step(),
        decode_rows,
        cluster.pipeline_factor.unwrap_or(1.0),
        &|e: &Evaluation| e.decode.as_ref(),
    )?;
    let total_s = prefill_s * e0.prefill_chunks as f64 + decode_s * w.decode as f64;
    let memory = (0..n)
        .map(|d| {
            let (st, local) = (d / per, d % per);
            let e = &evals[which[st]];
            let resident: usize = owners
                .iter()
                .enumerate()
                .filter(|&(_, &o)| o == st)
                .map(|(s, _)| {
                    e.bytes
                        .get(s)
                        .and_then(|b| b.get(local))
                        .copied()
                        .unwrap_or(0)
                })
                .sum();
            let activations = if ranges[st].is_empty() && st != first && st != last {
                0
            } else {
                e.eval.memory.get(local).map_or(0, |m| m.activations)
            };
            LayerDeviceMemory {
                device: cluster.devices[d].name.clone(),
                layers: (ranges[st].start, ranges[st].end),
                resident,
                activations,
                total: resident + activations,
                budget: cluster.devices[d].memory_bytes,
            }
        })
        .collect();
    Ok(LayerSplitCost {
        workload: *w,
        group: per,
        prefill_s,
        prefill_chunks: e0.prefill_chunks,
        decode_s,
        total_s,
        copies,
        prefill_micro_batches,
        decode_micro_batches,
        memory,
    })
}
