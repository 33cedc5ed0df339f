//! How many devices a model uses and how they are grouped: the layouts `plan`'s search weighs
//! against one another, each costed by the same cost model for the same workload.
//!
//! - the tensor split (`auto`, `search.rs`) on the first k devices, for k = all of them, every
//!   whole number of nodes, every power of two and one ([`device_counts`]);
//! - hybrid splits (`layer.rs`, what `run --split-mode hybrid --groups G` runs): groups of s
//!   devices under the Megatron split, the layers across the groups, on each of those counts,
//!   for every s that divides a node's devices (a group never straddles two nodes: tensor
//!   split inside a node, layers across the nodes), and the layer split (groups of one);
//! - for a batch, replicas (data parallelism): c copies of the model, each searched on n / c
//!   devices with its share of the sequences, one server per copy.
//!
//! The objective is the workload's predicted time (`total_s`): for one sequence the latency
//! of its request (the prompt, then one step per generated token), for a batch the time to
//! serve all of its sequences, the inverse of their aggregate throughput. The fastest layout
//! that fits wins; among those within [`SAME_TIME`] of it, the one on the fewest devices, then
//! the simplest (a tensor split, replicas, a hybrid split, the layer split). Every other is
//! kept with its predicted cost and why it lost ([`Considered`]), for the plan.
//!
//! The tensor searches, the hybrid and layer splits and the replicas are independent and run
//! at once; the hybrid splits of one group size share their stage (`layer::StageCache`).

use super::cluster::Cluster;
use super::evaluate::Workload;
use super::layer::{LayerSplitCost, MicroBatches, StageCache, evaluate_hybrid_split_cached};
use super::search::{SearchResult, auto};
use super::shape::ModelShape;
use crate::error::human_bytes;
use crate::{Error, Result};
use serde::Serialize;
use std::time::Instant;

/// How much slower than the fastest layout a layout on fewer devices (or a simpler one) may be
/// and still be chosen: 2%, well inside the cost model's error, so a small model is not spread
/// over eight GPUs for half a percent (SmolLM2 on `h100x8-nvswitch`).
pub const SAME_TIME: f64 = 0.02;

/// One count of devices the tensor-split search tried ([`auto_devices`]).
#[derive(Clone, Debug, Serialize)]
pub struct DeviceCount {
    /// The first `devices` of the cluster.
    pub devices: usize,
    /// Predicted seconds of the whole workload with the best assignment on them; `None` when
    /// the model does not fit.
    pub time_s: Option<f64>,
}

/// The counts of devices [`auto_devices`] tries on `cluster`, most first: all of them, whole
/// nodes, powers of two, and one.
pub fn device_counts(cluster: &Cluster) -> Vec<usize> {
    let n = cluster.devices.len();
    let per_node = cluster.links.devices_per_node.clamp(1, n.max(1));
    let mut counts: Vec<usize> = (1..=n)
        .filter(|&k| k == n || k == 1 || k.is_power_of_two() || k % per_node == 0)
        .collect();
    counts.reverse();
    counts
}

/// The search on the first k devices for each of `counts`: its result, or the refusal
/// (`DoesNotFit`) of a count the model does not fit; any other error is returned.
fn tensor_searches(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    ratios: &Option<Vec<f64>>,
    counts: &[usize],
) -> Result<Vec<(usize, std::result::Result<SearchResult, Error>)>> {
    let mut out = Vec::with_capacity(counts.len());
    for &k in counts {
        match auto(shape, &cluster.take(k), w, ratios.clone()) {
            Ok(r) => out.push((k, Ok(r))),
            Err(e @ Error::DoesNotFit { .. }) => out.push((k, Err(e))),
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// The fewest devices within [`SAME_TIME`] of the fastest among `searches` (counts most first).
fn fewest_fast(searches: &[(usize, std::result::Result<SearchResult, Error>)]) -> Option<usize> {
    let fastest = searches
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok().map(|r| r.evaluation.total_s))
        .reduce(f64::min)?;
    searches.iter().rposition(|(_, r)| {
        r.as_ref()
            .is_ok_and(|r| r.evaluation.total_s <= fastest * (1.0 + SAME_TIME))
    })
}

fn counts_of(searches: &[(usize, std::result::Result<SearchResult, Error>)]) -> Vec<DeviceCount> {
    searches
        .iter()
        .map(|(k, r)| DeviceCount {
            devices: *k,
            time_s: r.as_ref().ok().map(|r| r.evaluation.total_s),
        })
        .collect()
}

/// [`auto`] over subsets of `cluster`: its first k devices for each of [`device_counts`]
/// (all of them, whole nodes, powers of two, one), keeping the fewest devices that fit and are
/// within [`SAME_TIME`] of the fastest. More devices are not always faster: each split layer's
/// collectives cost a latency that grows with the devices, and across nodes the slower links
/// carry them (Llama-3-70B decodes faster on 8 of the 16 H100s of `h100x16-ib` than on all 16).
/// The subset chosen, and the search's result on it, with every count's predicted time.
/// Device shares are per device, so with `ratios` only the whole cluster is searched.
pub fn auto_devices(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    ratios: Option<Vec<f64>>,
) -> Result<(SearchResult, Cluster, Vec<DeviceCount>)> {
    // At least one device (its error names the field), so some count is tried.
    cluster.validate()?;
    let counts = match ratios {
        Some(_) => vec![cluster.devices.len()],
        None => device_counts(cluster),
    };
    let start = Instant::now();
    let mut searches = tensor_searches(shape, cluster, w, &ratios, &counts)?;
    let tried = counts_of(&searches);
    let Some(i) = fewest_fast(&searches) else {
        // The whole cluster's refusal names the device and the bytes.
        return Err(searches.swap_remove(0).1.expect_err("a refusal"));
    };
    let (k, r) = searches.swap_remove(i);
    let mut r = r.expect("a count that fits");
    // The search's time is that of every count tried.
    r.solve_time = start.elapsed();
    Ok((r, cluster.take(k), tried))
}

/// Copies of a model serving a batch's sequences apart (data parallelism): `copies` copies on
/// `devices` devices each, each with `batch` of the sequences.
#[derive(Clone, Debug, Serialize)]
pub struct Replicas {
    pub copies: usize,
    pub devices: usize,
    pub batch: usize,
    /// Predicted seconds of the whole workload (the copies run at once: one copy's time).
    pub time_s: f64,
}

/// [`replicas`] with each count's search result and its copy's workload.
fn replica_searches(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
) -> Result<Vec<(Replicas, SearchResult, Workload)>> {
    let n = cluster.devices.len();
    let mut out = Vec::new();
    for copies in 2..=n.min(w.batch) {
        let devices = n / copies;
        // Only counts that leave no device idle (and are not the same split as a smaller one).
        if devices * copies != n {
            continue;
        }
        let share = Workload {
            batch: w.batch.div_ceil(copies),
            ..*w
        };
        match auto(shape, &cluster.take(devices), &share, None) {
            Ok(r) => out.push((
                Replicas {
                    copies,
                    devices,
                    batch: share.batch,
                    time_s: r.evaluation.total_s,
                },
                r,
                share,
            )),
            Err(Error::DoesNotFit { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// For a batch of several sequences: the best way to serve it with copies of the model, each
/// on its own `cluster.devices.len() / copies` devices (the first such group of the cluster
/// stands for all: contiguous groups of one profile) with its share of the sequences, for
/// every number of copies from 2 that gives each copy a sequence and a device; the search on
/// one copy's devices for its share of the batch. Counts that do not fit are left out; empty
/// for a batch of one.
pub fn replicas(shape: &ModelShape, cluster: &Cluster, w: &Workload) -> Result<Vec<Replicas>> {
    Ok(replica_searches(shape, cluster, w)?
        .into_iter()
        .map(|(r, _, _)| r)
        .collect())
}

/// The kinds of layout, simplest first (the order that breaks ties).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LayoutKind {
    /// The used devices under one tensor split (a plan file, `run --plan`).
    Tensor,
    /// Copies of a tensor split, each on its own devices with its share of the batch.
    Replicas,
    /// Groups of devices under the Megatron split, the layers across the groups.
    Hybrid,
    /// Whole layers per device.
    Layer,
}

/// A device over its budget, and by how many bytes.
#[derive(Clone, Debug, Serialize)]
pub struct Over {
    pub device: String,
    pub bytes: u64,
}

/// One layout the search weighed, with its predicted cost and the verdict.
#[derive(Clone, Debug, Serialize)]
pub struct Considered {
    pub kind: LayoutKind,
    /// Devices it uses: the cluster's first ones.
    pub devices: usize,
    /// Devices under one tensor split: all of `devices` for the tensor split, a group's for
    /// the hybrid split, 1 for the layer split, a copy's for replicas.
    pub group: usize,
    /// Copies of the model (1 but for replicas), each with `batch` of the sequences.
    pub copies: usize,
    pub batch: usize,
    pub description: String,
    /// How it is run.
    pub run: String,
    /// Predicted seconds of the whole workload (the copies run at once); `None` when no
    /// assignment fits.
    pub time_s: Option<f64>,
    /// Seconds of one decode step (of one copy).
    pub decode_s: Option<f64>,
    /// Generated tokens per second over all the workload's sequences.
    pub decode_tps: Option<f64>,
    /// The first device over its budget (none: it fits).
    pub over: Option<Over>,
    pub chosen: bool,
    /// Why it was chosen, or why not.
    pub verdict: String,
}

impl Considered {
    fn fits(&self) -> bool {
        self.over.is_none() && self.time_s.is_some()
    }
}

/// What the search over layouts found.
pub struct LayoutSearch {
    /// The tensor plan to print and write: the chosen layout's when it is a tensor split (on
    /// its devices) or replicas (one copy's plan), else the fastest tensor split's (the fewest
    /// devices within [`SAME_TIME`]).
    pub result: SearchResult,
    /// That plan's devices: the cluster's first ones.
    pub subset: Cluster,
    /// That plan's workload: the whole workload, or one copy's share of it.
    pub workload: Workload,
    /// Every count of devices the tensor split was searched on, most first; empty when the
    /// plan is one copy of replicas.
    pub counts: Vec<DeviceCount>,
    /// Every layout weighed: the chosen first, then those that fit by predicted time, then
    /// those that do not fit.
    pub layouts: Vec<Considered>,
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// The layout of a tensor search on `k` devices.
fn tensor_layout(
    k: usize,
    r: &std::result::Result<SearchResult, Error>,
    w: &Workload,
) -> Considered {
    let (time_s, decode_s, decode_tps, over) = match r {
        Ok(r) => {
            let e = &r.evaluation;
            let d = e.decode.as_ref().map(|d| d.seconds);
            (Some(e.total_s), d, d.map(|_| e.decode_tps_total()), None)
        }
        Err(Error::DoesNotFit { device, over, .. }) => (
            None,
            None,
            None,
            Some(Over {
                device: device.clone(),
                bytes: *over,
            }),
        ),
        Err(_) => (None, None, None, None),
    };
    Considered {
        kind: LayoutKind::Tensor,
        devices: k,
        group: k,
        copies: 1,
        batch: w.batch,
        description: format!("tensor split on {k} device{}", plural(k)),
        run: "run --plan FILE".into(),
        time_s,
        decode_s,
        decode_tps,
        over,
        chosen: false,
        verdict: String::new(),
    }
}

/// The layout of a hybrid (or layer, `group` 1) split's cost on `k` devices.
fn staged_layout(k: usize, group: usize, cost: &LayerSplitCost, cluster: &Cluster) -> Considered {
    let groups = k / group.max(1);
    let per_node = cluster.links.devices_per_node.max(1);
    let (kind, description, run) = if group == 1 {
        (
            LayoutKind::Layer,
            format!("layer split on {k} devices"),
            "run --split-mode layer".to_string(),
        )
    } else {
        let nodes = if group == per_node && cluster.links.inter.is_some() {
            ", one per node"
        } else {
            ""
        };
        (
            LayoutKind::Hybrid,
            format!("hybrid split: {groups} groups of {group}{nodes}"),
            format!("run --split-mode hybrid --groups {groups}"),
        )
    };
    let tokens = cost.workload.batch as f64;
    Considered {
        kind,
        devices: k,
        group,
        copies: 1,
        batch: cost.workload.batch,
        description,
        run,
        time_s: Some(cost.total_s),
        decode_s: (cost.workload.decode > 0).then_some(cost.decode_s),
        decode_tps: (cost.workload.decode > 0).then(|| tokens / cost.decode_s.max(1e-12)),
        over: cost.over_budget().map(|(m, over)| Over {
            device: m.device.clone(),
            bytes: over,
        }),
        chosen: false,
        verdict: String::new(),
    }
}

/// The layout of `r.copies` replicas, each searched as `s`.
fn replica_layout(r: &Replicas, s: &SearchResult) -> Considered {
    let e = &s.evaluation;
    let d = e.decode.as_ref().map(|d| d.seconds);
    Considered {
        kind: LayoutKind::Replicas,
        devices: r.copies * r.devices,
        group: r.devices,
        copies: r.copies,
        batch: r.batch,
        description: format!(
            "replicas: {} x {} device{}, {} sequence{} each",
            r.copies,
            r.devices,
            plural(r.devices),
            r.batch,
            plural(r.batch)
        ),
        run: "serve --plan FILE per copy".into(),
        time_s: Some(r.time_s),
        decode_s: d,
        decode_tps: d.map(|_| e.decode_tps_total() * r.copies as f64),
        over: None,
        chosen: false,
        verdict: String::new(),
    }
}

/// The counts of devices (of the tensor split's `counts`) on which the hybrid and layer splits
/// are costed: all of them, and whole nodes. Below a node they would run the layers of groups
/// smaller than the node one after another, where the tensor split over the node's devices
/// holds less per device and its collectives stay inside the node.
pub fn staged_counts(cluster: &Cluster, counts: &[usize]) -> Vec<usize> {
    let n = cluster.devices.len();
    let per_node = cluster.links.devices_per_node.clamp(1, n.max(1));
    counts
        .iter()
        .copied()
        .filter(|&k| k > 1 && (k == n || k.is_multiple_of(per_node)))
        .collect()
}

/// The hybrid and layer splits worth costing on the first `k` devices: groups of every size
/// that divides both k and a node's devices, below k (one group is the tensor split).
pub fn group_sizes(cluster: &Cluster, k: usize) -> Vec<usize> {
    let per_node = cluster.links.devices_per_node.max(1);
    (1..k)
        .filter(|&s| k.is_multiple_of(s) && per_node.is_multiple_of(s))
        .collect()
}

/// Choose among `c` (see the module's doc), write every verdict, and order them: the chosen
/// first, then those that fit by time, then the rest. None when nothing fits.
fn choose(c: &mut [Considered]) -> Option<()> {
    let fastest = c
        .iter()
        .filter(|x| x.fits())
        .filter_map(|x| x.time_s)
        .reduce(f64::min)?;
    let near =
        |x: &Considered| x.fits() && x.time_s.is_some_and(|t| t <= fastest * (1.0 + SAME_TIME));
    let best = (0..c.len()).filter(|&i| near(&c[i])).min_by(|&a, &b| {
        (c[a].devices, c[a].kind)
            .cmp(&(c[b].devices, c[b].kind))
            .then(
                c[a].time_s
                    .unwrap_or(0.0)
                    .total_cmp(&c[b].time_s.unwrap_or(0.0)),
            )
    })?;
    let this = c[best].time_s.unwrap_or(fastest).max(1e-12);
    let chosen = (c[best].devices, c[best].kind);
    for (i, x) in c.iter_mut().enumerate() {
        x.chosen = i == best;
        let pct = |t: f64| (t / this - 1.0) * 100.0;
        x.verdict = match (x.chosen, x.time_s, &x.over) {
            (true, Some(t), _) if t <= fastest => "chosen: the fastest that fits".into(),
            (true, ..) => format!(
                "chosen: the fewest devices within {:.0}% of the fastest",
                SAME_TIME * 100.0
            ),
            (false, _, Some(o)) => format!(
                "does not fit: {} over its budget by {}",
                o.device,
                human_bytes(o.bytes)
            ),
            (false, None, None) => "does not fit".into(),
            (false, Some(t), None) if near(x) && (x.devices, x.kind) > chosen => format!(
                "{:+.1}% time: within {:.0}%, on {}",
                pct(t),
                SAME_TIME * 100.0,
                if x.devices > chosen.0 {
                    "more devices"
                } else {
                    "the same devices, less simple"
                }
            ),
            (false, Some(t), None) if this > fastest => format!(
                "{:+.1}% time ({:+.1}% against the fastest)",
                pct(t),
                (t / fastest.max(1e-12) - 1.0) * 100.0
            ),
            (false, Some(t), None) => format!("{:+.1}% time", pct(t)),
        };
    }
    c.sort_by(|a, b| {
        (!a.chosen, !a.fits()).cmp(&(!b.chosen, !b.fits())).then(
            a.time_s
                .unwrap_or(f64::INFINITY)
                .total_cmp(&b.time_s.unwrap_or(f64::INFINITY)),
        )
    });
    Some(())
}

/// The hybrid and layer splits `staged` ((devices, group size) pairs) of `shape` on the first
/// devices of `cluster`, in that order. Groups of one size on different counts of devices
/// evaluate the same stage (the first devices of the cluster): each is evaluated once, in a
/// first wave of the first count with that group size, and taken from the cache by the others.
fn staged_costs(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    ratios: Option<&[f64]>,
    staged: &[(usize, usize)],
) -> Result<Vec<LayerSplitCost>> {
    use rayon::prelude::*;
    let cache = StageCache::default();
    let first: Vec<bool> = (0..staged.len())
        .map(|i| !staged[..i].iter().any(|p| p.1 == staged[i].1))
        .collect();
    let mut costs: Vec<Option<Result<LayerSplitCost>>> = (0..staged.len()).map(|_| None).collect();
    for wave in [true, false] {
        let done: Vec<(usize, Result<LayerSplitCost>)> = (0..staged.len())
            .into_par_iter()
            .filter(|&i| first[i] == wave)
            .map(|i| {
                let (k, s) = staged[i];
                let cost = evaluate_hybrid_split_cached(
                    shape,
                    &cluster.take(k),
                    w,
                    k / s,
                    ratios,
                    MicroBatches::Best,
                    Some(&cache),
                );
                (i, cost)
            })
            .collect();
        for (i, cost) in done {
            costs[i] = Some(cost);
        }
    }
    costs
        .into_iter()
        .map(|c| c.expect("every layout costed"))
        .collect()
}

/// The search over layouts (see the module's doc): the tensor split on each count of
/// devices, the hybrid and layer splits the cluster's nodes suggest, and replicas for a batch;
/// the chosen layout's plan and every layout's predicted cost. With device shares (`ratios`,
/// one per device) only the whole cluster is searched, and no replicas.
pub fn search_layouts(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    ratios: Option<Vec<f64>>,
) -> Result<LayoutSearch> {
    cluster.validate()?;
    let start = Instant::now();
    let n = cluster.devices.len();
    let counts = match ratios {
        Some(_) => vec![n],
        None => device_counts(cluster),
    };
    // The stages' whole-model evaluations are independent: cost them in parallel.
    let staged: Vec<(usize, usize)> = staged_counts(cluster, &counts)
        .into_iter()
        .flat_map(|k| group_sizes(cluster, k).into_iter().map(move |s| (k, s)))
        .collect();
    // The tensor searches, the hybrid and layer splits and the replicas are independent: run
    // them at once (each search leaves a core idle while it costs its chosen assignment's
    // prompt again under sequence parallelism), then take their answers in this order.
    let (searches, (costs, reps)) = rayon::join(
        || tensor_searches(shape, cluster, w, &ratios, &counts),
        || {
            rayon::join(
                || staged_costs(shape, cluster, w, ratios.as_deref(), &staged),
                || match ratios {
                    Some(_) => Ok(Vec::new()),
                    None => replica_searches(shape, cluster, w),
                },
            )
        },
    );
    let mut searches = searches?;
    let Some(best_tensor) = fewest_fast(&searches) else {
        // Nothing fits under any tensor split, the least memory a device can hold: the whole
        // cluster's refusal names the device and the bytes.
        return Err(searches.swap_remove(0).1.expect_err("a refusal"));
    };
    let mut layouts: Vec<Considered> = searches
        .iter()
        .map(|(k, r)| tensor_layout(*k, r, w))
        .collect();
    let costs = costs?;
    for (&(k, s), cost) in staged.iter().zip(&costs) {
        layouts.push(staged_layout(k, s, cost, cluster));
    }
    let mut reps = reps?;
    layouts.extend(reps.iter().map(|(r, s, _)| replica_layout(r, s)));
    choose(&mut layouts).expect("a tensor split fits");
    let chosen = &layouts[0];
    let replica = reps
        .iter()
        .position(|(r, _, _)| chosen.kind == LayoutKind::Replicas && r.copies == chosen.copies);
    let (mut result, subset, workload, counts) = match replica {
        Some(i) => {
            let (r, s, share) = reps.swap_remove(i);
            (s, cluster.take(r.devices), share, Vec::new())
        }
        None => {
            let tensor_k = match chosen.kind {
                LayoutKind::Tensor => chosen.devices,
                _ => searches[best_tensor].0,
            };
            let tried = counts_of(&searches);
            let i = searches
                .iter()
                .position(|(k, _)| *k == tensor_k)
                .expect("a searched count");
            let r = searches.swap_remove(i).1.expect("a count that fits");
            (r, cluster.take(tensor_k), *w, tried)
        }
    };
    // The search's time is that of every layout weighed.
    result.solve_time = start.elapsed();
    Ok(LayoutSearch {
        result,
        subset,
        workload,
        counts,
        layouts,
    })
}

/// The layouts as a table for the plan, under the whole workload `w`.
pub fn layouts_table(layouts: &[Considered], w: &Workload) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "layouts considered (workload {w}; the fastest that fits, the fewest devices within {:.0}%):",
        SAME_TIME * 100.0
    );
    let _ = writeln!(
        s,
        "  {:<42} {:>7} {:>11} {:>10} {:>11}  {:<35} verdict",
        "layout", "devices", "workload s", "decode ms", "decode t/s", "run"
    );
    let opt = |v: Option<f64>, scale: f64, prec: usize| {
        v.map_or("-".to_string(), |x| format!("{:.*}", prec, x * scale))
    };
    for c in layouts {
        let _ = writeln!(
            s,
            "  {:<42} {:>7} {:>11} {:>10} {:>11}  {:<35} {}",
            c.description,
            c.devices,
            opt(c.time_s, 1.0, 3),
            opt(c.decode_s, 1e3, 3),
            opt(c.decode_tps, 1.0, 1),
            c.run,
            c.verdict
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(kind: LayoutKind, devices: usize, time_s: Option<f64>, over: bool) -> Considered {
        Considered {
            kind,
            devices,
            group: devices,
            copies: 1,
            batch: 1,
            description: format!("{kind:?} on {devices}"),
            run: String::new(),
            time_s,
            decode_s: None,
            decode_tps: None,
            over: over.then(|| Over {
                device: "dev-3".into(),
                bytes: 3 << 30,
            }),
            chosen: false,
            verdict: String::new(),
        }
    }

    #[test]
    fn the_fastest_that_fits_wins_and_every_other_says_why() {
        use LayoutKind::*;
        let mut c = vec![
            layout(Tensor, 16, Some(2.30), false),
            layout(Tensor, 8, Some(2.00), false),
            layout(Tensor, 1, None, true),
            layout(Hybrid, 16, Some(1.50), true),
            layout(Hybrid, 16, Some(1.80), false),
            layout(Layer, 16, Some(7.0), false),
        ];
        choose(&mut c).unwrap();
        // The hybrid split that fits is fastest (a faster one is over its budget).
        assert!(c[0].chosen && c[0].kind == Hybrid && c[0].time_s == Some(1.80));
        assert_eq!(c[0].verdict, "chosen: the fastest that fits");
        assert_eq!(c.iter().filter(|x| x.chosen).count(), 1);
        // Then those that fit by time, then those that do not.
        let times: Vec<Option<f64>> = c.iter().map(|x| x.time_s).collect();
        assert_eq!(
            times,
            [
                Some(1.80),
                Some(2.00),
                Some(2.30),
                Some(7.0),
                Some(1.50),
                None
            ]
        );
        assert_eq!(c[1].verdict, "+11.1% time");
        assert!(
            c[4].verdict
                .starts_with("does not fit: dev-3 over its budget by 3.00 GiB")
        );
        assert!(c[5].verdict.starts_with("does not fit"));
    }

    #[test]
    fn within_two_percent_the_fewest_devices_then_the_simplest_layout_win() {
        use LayoutKind::*;
        let mut c = vec![
            layout(Replicas, 8, Some(1.000), false),
            layout(Tensor, 8, Some(1.015), false),
            layout(Hybrid, 4, Some(1.019), false),
            layout(Tensor, 4, Some(1.019), false),
            layout(Tensor, 2, Some(1.03), false),
        ];
        choose(&mut c).unwrap();
        assert_eq!((c[0].kind, c[0].devices), (Tensor, 4));
        assert_eq!(
            c[0].verdict,
            "chosen: the fewest devices within 2% of the fastest"
        );
        let v = |k: LayoutKind, d: usize| {
            c.iter()
                .find(|x| (x.kind, x.devices) == (k, d))
                .unwrap()
                .verdict
                .clone()
        };
        assert!(v(Hybrid, 4).ends_with("within 2%, on the same devices, less simple"));
        assert!(v(Replicas, 8).ends_with("within 2%, on more devices"));
        assert!(v(Replicas, 8).starts_with("-1.9% time"));
        // Two devices are over 2% slower than the fastest.
        assert_eq!(v(Tensor, 2), "+1.1% time (+3.0% against the fastest)");
        // Nothing fits: no choice.
        let mut none = vec![layout(Tensor, 2, None, true)];
        assert!(choose(&mut none).is_none());
    }

    /// A hybrid split whose stage another device count already evaluated (the first 4 devices
    /// of 16 and of 8) costs, from the cache, exactly what it costs alone: every number of
    /// its plan to the last bit.
    #[test]
    fn a_stage_from_the_cache_costs_what_a_new_one_costs() {
        let shape = ModelShape::preset("llama3-8b").unwrap();
        let c = Cluster::preset("h100x16-ib").unwrap();
        let w = Workload::parse("pp=512,tg=128,batch=4,ctx=4096").unwrap();
        let json = |cost: &LayerSplitCost| serde_json::to_string(cost).unwrap();
        let cache = StageCache::default();
        let on16 =
            evaluate_hybrid_split_cached(&shape, &c, &w, 4, None, MicroBatches::Best, Some(&cache))
                .unwrap();
        let on8 = evaluate_hybrid_split_cached(
            &shape,
            &c.take(8),
            &w,
            2,
            None,
            MicroBatches::Best,
            Some(&cache),
        )
        .unwrap();
        let alone16 =
            evaluate_hybrid_split_cached(&shape, &c, &w, 4, None, MicroBatches::Best, None)
                .unwrap();
        let alone8 =
            evaluate_hybrid_split_cached(&shape, &c.take(8), &w, 2, None, MicroBatches::Best, None)
                .unwrap();
        assert_eq!(json(&on16), json(&alone16));
        assert_eq!(json(&on8), json(&alone8));
        // The two counts differ (the copy between the nodes), and the cache held one stage.
        assert_ne!(on16.total_s, on8.total_s);
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn groups_stay_inside_a_node() {
        let c = Cluster::preset("h100x16-ib").unwrap();
        assert_eq!(group_sizes(&c, 16), [1, 2, 4, 8]);
        assert_eq!(group_sizes(&c, 8), [1, 2, 4]);
        assert_eq!(group_sizes(&c, 2), [1]);
        assert!(group_sizes(&c, 1).is_empty());
    }
}
