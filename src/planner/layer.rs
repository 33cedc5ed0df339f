//! Layer split in the cost model (llama.cpp's `-sm layer`; `--split-mode layer` on the
//! scheduler): whole layers on each device, in proportion to the shares (`layer_ranges`, the
//! same assignment a run uses), run one device after another. A step costs the sum of its
//! segments, each on the device holding it (the embedding on the first device, the output on
//! the last), plus one copy of the residual stream (`n_embd` x tokens, f32) wherever the next
//! layer lives on another device, costed by the link's alpha and bus bandwidth at two devices,
//! plus the per-step overhead of each device that runs a part. The segment times come from a whole-model
//! evaluation on each distinct device profile alone (the same per-node cost model as every
//! other strategy); memory is the resident bytes of the device's segments plus that
//! evaluation's activation peak.

use super::cluster::{Cluster, DeviceProfile};
use super::evaluate::{Evaluation, Placed, StepCost, Workload, evaluate_placed};
use super::shape::ModelShape;
use super::strategy::Strategy;
use crate::models::layer_split::layer_ranges;
use crate::models::split::by_layer;
use crate::{Error, Result};
use serde::Serialize;

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
    /// Copies of the residual stream per step.
    pub copies: usize,
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
        let _ = match self.group {
            1 => writeln!(
                s,
                "layer split: layers run one device after another, {} copies of the residual \
                 stream per step",
                self.copies
            ),
            g => writeln!(
                s,
                "hybrid split: groups of {g} devices (Megatron inside a group), layers run one \
                 group after another, {} copies of the residual stream per step",
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

/// One stage's whole-model evaluation (a device alone, or a group of devices under the
/// Megatron split) and each of its devices' resident bytes per segment.
struct Stage {
    /// The stage's device profiles, names aside (stages of equal profiles share this).
    profiles: Vec<DeviceProfile>,
    eval: Evaluation,
    /// Bytes per segment, per device of the stage.
    bytes: Vec<Vec<usize>>,
}

/// The layer split of `shape` over `cluster`'s devices with `shares` (even when absent) for
/// workload `w`.
pub fn evaluate_layer_split(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    shares: Option<&[f64]>,
) -> Result<LayerSplitCost> {
    evaluate_stages(shape, cluster, w, shares, 1)
}

/// The hybrid split (`run --split-mode hybrid --groups G`): G contiguous groups of the
/// devices, each a meta device under the Megatron split, the layers split across the groups by
/// the groups' total `shares` (per device; even when absent) and run one group after another.
/// An error naming `--groups` unless G divides the devices.
pub fn evaluate_hybrid_split(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    groups: usize,
    shares: Option<&[f64]>,
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
    evaluate_stages(shape, cluster, w, group_shares.as_deref(), per)
}

/// Stages of `per` devices each (1: the layer split; more: the hybrid split), the layers split
/// across the stages by `shares` (one per stage) and run one stage after another.
fn evaluate_stages(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    shares: Option<&[f64]>,
    per: usize,
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
    let mut evals: Vec<Stage> = Vec::new();
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
                let placed = Placed::new(
                    stage_shape,
                    &group,
                    by_layer(stage_shape.split_dims(), split.clone()),
                    w.cache_rows(),
                )?;
                let eval = evaluate_placed(&placed, &group, w)?;
                evals.push(Stage {
                    profiles,
                    eval,
                    bytes: placed.bytes_by_segment(),
                });
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
    let used = ranges.iter().filter(|r| !r.is_empty()).count().max(1);
    // The residual stream goes from the last device of one stage to the first of the next.
    let link = |a: usize, b: usize| {
        let node = cluster.links.devices_per_node.max(1);
        match &cluster.links.inter {
            Some(inter) if (a * per + per - 1) / node != (b * per) / node => &inter.all_gather,
            _ => &cluster.links.intra.all_gather,
        }
    };
    let step = |get: &dyn Fn(&Evaluation) -> Option<&StepCost>, tokens: usize| -> f64 {
        let mut t = 0.0;
        for (s, &st) in owners.iter().enumerate() {
            if let Some(sc) = get(&evals[which[st]].eval) {
                t += sc.segments.get(s).map_or(0.0, |x| x.compute_s + x.comm_s);
            }
        }
        let bytes = (shape.cfg.n_embd * tokens * 4) as f64;
        for p in owners.windows(2).filter(|p| p[0] != p[1]) {
            let fit = link(p[0], p[1]);
            t += fit.alpha(2) + bytes / fit.bus_bw.max(1.0);
        }
        // Each stage that runs a part pays its per-step overhead (the segments leave it out).
        let overhead = cluster
            .devices
            .iter()
            .map(|d| d.step_overhead_s)
            .fold(0.0, f64::max);
        t + used as f64 * overhead
    };
    let e0 = &evals[which[first]].eval;
    let prefill_s = e0
        .prefill
        .as_ref()
        .map_or(0.0, |p| step(&|e| e.prefill.as_ref(), p.tokens));
    let decode_s = e0
        .decode
        .as_ref()
        .map_or(0.0, |d| step(&|e| e.decode.as_ref(), d.tokens));
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
        memory,
    })
}
