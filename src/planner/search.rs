//! `auto`: the cheapest assignment for a workload under every device's memory budget.
//!
//! Layers of a decoder are identical, so their costs are measured once ("tied"): for every
//! ordered pair of layer patterns (p then q) a two-layer model is costed by the cost model
//! (`evaluate.rs`), which gives the cost of a layer with pattern q after one with pattern p
//! (the conversion between them included: a partial residual left by p is reduced in q's
//! first node), of the first layer after the embedding, and of the output after the last
//! layer; a one-layer model per pattern and per choice of ends (output projection and token
//! embedding split by vocabulary or mirrored) gives the ends. Resident bytes per layer and
//! pattern come from the same placements.
//!
//! The search is a dynamic program over layers whose state is the last layer's pattern and
//! whose values are Pareto fronts of (time, bytes): exact for this additive model, and checked
//! against brute force on small instances (tests). Memory is the sum over segments of the
//! largest device's bytes (an upper bound of every device's), plus the largest activation
//! peak. The chosen assignment is then costed whole; that evaluation is what the plan reports.

use super::cluster::Cluster;
use super::evaluate::{Evaluation, Placed, StepCost, Workload, evaluate_placed};
use super::shape::ModelShape;
use super::strategy::describe;
use crate::models::limits::Count;
use crate::models::split::{
    DecoderSplit, ExpertSplit, LayerSplit, by_layer, sequence_parallel_hints,
};
use crate::{Error, Result};
use serde::Serialize;
use std::time::{Duration, Instant};

/// The patterns a layer may take.
pub const PATTERNS: [LayerSplit; 4] = [
    LayerSplit {
        attention: true,
        mlp: true,
    },
    LayerSplit {
        attention: false,
        mlp: true,
    },
    LayerSplit {
        attention: true,
        mlp: false,
    },
    LayerSplit {
        attention: false,
        mlp: false,
    },
];

/// Costs of one choice of ends, for the dynamic program. Times are seconds of the whole
/// workload (all prefill chunks plus every decode step).
#[derive(Clone, Debug)]
pub struct Tables {
    pub output: bool,
    pub embedding: bool,
    /// `pair[p][q]`: a layer with pattern q after one with pattern p.
    pub pair: Vec<Vec<f64>>,
    /// `first[p]`: the first layer with pattern p (after the embedding).
    pub first: Vec<f64>,
    /// `last[q]`: the output after a last layer with pattern q.
    pub last: Vec<f64>,
    /// The embedding and the per-step overheads.
    pub fixed: f64,
    /// Resident bytes of a layer with pattern p (mean over devices: remainders of uneven
    /// splits rotate with the layer index, so over many layers every device holds about the
    /// mean).
    pub mem: Vec<usize>,
    /// Resident bytes of the ends (largest device), plus one layer's largest deviation from
    /// the mean (what rotation leaves uneven).
    pub fixed_mem: usize,
    /// Peak of the compute buffer when layers have pattern p (largest device): the memory of
    /// an assignment adds the largest of its patterns' peaks.
    pub act: Vec<usize>,
}

/// Seconds of segment `s` over the workload.
fn seg_time(e: &Evaluation, s: usize) -> f64 {
    let t = |c: &Option<StepCost>| {
        c.as_ref()
            .and_then(|c| c.segments.get(s))
            .map_or(0.0, |x| x.compute_s + x.comm_s)
    };
    t(&e.prefill) * e.prefill_chunks as f64 + t(&e.decode) * e.workload.decode as f64
}

/// Per-step overheads over the workload.
fn overhead_time(e: &Evaluation, cluster: &Cluster) -> f64 {
    let step = cluster
        .devices
        .iter()
        .map(|d| d.step_overhead_s)
        .fold(0.0, f64::max);
    let steps = e.prefill.as_ref().map_or(0, |_| e.prefill_chunks)
        + e.decode.as_ref().map_or(0, |_| e.workload.decode);
    step * steps as f64
}

fn max_dev(v: &[usize]) -> usize {
    v.iter().copied().max().unwrap_or(0)
}

fn costed(
    shape: &ModelShape,
    split: &DecoderSplit,
    cluster: &Cluster,
    w: &Workload,
) -> Result<(Evaluation, Vec<Vec<usize>>)> {
    let shape = &shape.for_split(cluster.devices.len(), split);
    let placed = Placed::new(
        shape,
        cluster,
        by_layer(shape.split_dims(), split.clone()),
        w.cache_rows(),
    )?;
    let e = evaluate_placed(&placed, cluster, w)?;
    Ok((e, placed.bytes_by_segment()))
}

/// The costs of a layer after another, tied over layers: `pair[p][q]`, resident bytes per
/// pattern and the largest activation peak. Independent of the ends (a layer after the first).
pub struct LayerTables {
    pub pair: Vec<Vec<f64>>,
    /// Mean resident bytes per device of a layer with each pattern.
    pub mem: Vec<usize>,
    /// The largest device's excess over that mean, over the patterns.
    pub slack: usize,
    /// Activation peak per pattern (of the two-layer model with that pattern twice).
    pub act: Vec<usize>,
}

/// [`LayerTables`] from a two-layer model per ordered pair of patterns.
pub fn layer_tables(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    ratios: &Option<Vec<f64>>,
) -> Result<LayerTables> {
    use rayon::prelude::*;
    let np = PATTERNS.len();
    let two = shape.with_layers(2);
    let mut pair = vec![vec![0.0; np]; np];
    let mut mem = vec![0usize; np];
    let mut slack = 0usize;
    let mut act = vec![0usize; np];
    // The pairs are independent: cost them in parallel.
    let results: Vec<(usize, usize, Evaluation, Vec<Vec<usize>>)> = (0..np * np)
        .into_par_iter()
        .map(|i| {
            let (p, q) = (i / np, i % np);
            let split = DecoderSplit {
                layers: vec![PATTERNS[p], PATTERNS[q]],
                output: true,
                embedding: false,
                ratios: ratios.clone(),
                sequence_parallel: false,
                experts: ExpertSplit::Tensor,
            };
            costed(&two, &split, cluster, w).map(|(e, b)| (p, q, e, b))
        })
        .collect::<Result<_>>()?;
    for (p, q, e, bytes) in results {
        pair[p][q] = seg_time(&e, 2);
        if p == q {
            let b = &bytes[2];
            mem[q] = b.iter().sum::<usize>().div_ceil(b.len().max(1));
            slack = slack.max(max_dev(b) - mem[q].min(max_dev(b)));
            act[q] = e.memory.iter().map(|m| m.activations).max().unwrap_or(0);
        }
    }
    Ok(LayerTables {
        pair,
        mem,
        slack,
        act,
    })
}

/// Cost tables for one choice of ends, from the layer tables and a one-layer model per
/// pattern.
pub fn tables(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    ratios: &Option<Vec<f64>>,
    layers: &LayerTables,
    output: bool,
    embedding: bool,
) -> Result<Tables> {
    use rayon::prelude::*;
    let np = PATTERNS.len();
    let one = shape.with_layers(1);
    let mut first = vec![0.0; np];
    let mut last = vec![0.0; np];
    let mut fixed = 0.0;
    let mut ends_mem = 0usize;
    let mut act = layers.act.clone();
    let results: Vec<(Evaluation, Vec<Vec<usize>>)> = PATTERNS
        .par_iter()
        .map(|&lp| {
            let split = DecoderSplit {
                layers: vec![lp],
                output,
                embedding,
                ratios: ratios.clone(),
                sequence_parallel: false,
                experts: ExpertSplit::Tensor,
            };
            costed(&one, &split, cluster, w)
        })
        .collect::<Result<_>>()?;
    for (p, (e, bytes)) in results.into_iter().enumerate() {
        first[p] = seg_time(&e, 1);
        last[p] = seg_time(&e, 2);
        fixed = seg_time(&e, 0) + overhead_time(&e, cluster);
        ends_mem = max_dev(&bytes[0]) + max_dev(&bytes[2]);
        // The one-layer model's peak covers the ends' activations (the logits).
        act[p] = act[p].max(e.memory.iter().map(|m| m.activations).max().unwrap_or(0));
    }
    Ok(Tables {
        output,
        embedding,
        pair: layers.pair.clone(),
        first,
        last,
        fixed,
        mem: layers.mem.clone(),
        fixed_mem: ends_mem + layers.slack,
        act,
    })
}

impl Tables {
    /// Time and bytes of a path of layer patterns (as `solve` counts them).
    pub fn path(&self, pats: &[usize]) -> (f64, usize) {
        let Some((&first, rest)) = pats.split_first() else {
            return (self.fixed, self.fixed_mem);
        };
        let mut time = self.fixed + self.first[first] + self.last[*pats.last().unwrap_or(&first)];
        let mut mem = self.fixed_mem + self.mem[first];
        let mut prev = first;
        for &q in rest {
            time += self.pair[prev][q];
            mem += self.mem[q];
            prev = q;
        }
        (
            time,
            mem + pats.iter().map(|&p| self.act[p]).max().unwrap_or(0),
        )
    }
}

/// For a run of layers with one pattern, what each other pattern would cost instead.
#[derive(Clone, Debug, Serialize)]
pub struct RunAlternatives {
    pub first: usize,
    pub last: usize,
    /// (pattern, seconds added over the workload, bytes added on the largest device).
    pub alternatives: Vec<(LayerSplit, f64, i64)>,
}

/// A point of a Pareto front: time, bytes, and how it was reached.
#[derive(Clone, Copy, Debug)]
struct Point {
    time: f64,
    mem: usize,
    /// Index in the previous layer's front of `prev` (usize::MAX for the first layer).
    back: usize,
    prev: usize,
}

/// Keep the points no other point beats in both time and bytes.
fn prune(mut v: Vec<Point>) -> Vec<Point> {
    v.sort_by(|a, b| a.mem.cmp(&b.mem).then(a.time.total_cmp(&b.time)));
    let mut out: Vec<Point> = Vec::with_capacity(v.len());
    for p in v {
        if out.last().is_none_or(|l| p.time < l.time) {
            out.push(p);
        }
    }
    out
}

/// The cheapest per-layer patterns for `n_layer` layers with total bytes at most `budget`:
/// (time, bytes, pattern indices), or None if nothing fits. Bytes are the resident bytes plus
/// the largest activation peak of the patterns used: for each possible largest peak, the
/// patterns under it are searched with that peak set aside, and the best answer wins.
pub fn solve(t: &Tables, n_layer: usize, budget: usize) -> Option<(f64, usize, Vec<usize>)> {
    let mut caps = t.act.clone();
    caps.sort_unstable();
    caps.dedup();
    caps.into_iter()
        .filter_map(|cap| {
            let allowed: Vec<bool> = t.act.iter().map(|&a| a <= cap).collect();
            let r = solve_resident(t, n_layer, budget.checked_sub(cap)?, &allowed)?;
            let peak = r.2.iter().map(|&p| t.act[p]).max().unwrap_or(0);
            Some((r.0, r.1 + peak, r.2))
        })
        .min_by(|a, b| a.0.total_cmp(&b.0))
}

/// The dynamic program over resident bytes only, with patterns restricted to `allowed`.
fn solve_resident(
    t: &Tables,
    n_layer: usize,
    budget: usize,
    allowed: &[bool],
) -> Option<(f64, usize, Vec<usize>)> {
    let np = PATTERNS.len();
    // The fronts are sized by the layer count: a count beyond the bound of every model's
    // (`ModelShape::check`, which `auto` calls first) finds nothing rather than allocating.
    if n_layer == 0 || n_layer > Count::Layers.max() {
        return None;
    }
    let cap = budget.saturating_sub(t.fixed_mem);
    if t.fixed_mem > budget {
        return None;
    }
    // fronts[i][p]: layer i ends with pattern p.
    let mut fronts: Vec<Vec<Vec<Point>>> = Vec::with_capacity(n_layer);
    fronts.push(
        (0..np)
            .map(|p| {
                let pt = Point {
                    time: t.first[p],
                    mem: t.mem[p],
                    back: usize::MAX,
                    prev: usize::MAX,
                };
                if pt.mem <= cap && allowed[p] {
                    vec![pt]
                } else {
                    vec![]
                }
            })
            .collect(),
    );
    for i in 1..n_layer {
        let prev = &fronts[i - 1];
        let mut next = Vec::with_capacity(np);
        for (q, &ok) in allowed.iter().enumerate().take(np) {
            let mut cand = Vec::new();
            if !ok {
                next.push(cand);
                continue;
            }
            for (p, front) in prev.iter().enumerate() {
                for (k, pt) in front.iter().enumerate() {
                    let mem = pt.mem + t.mem[q];
                    if mem <= cap {
                        cand.push(Point {
                            time: pt.time + t.pair[p][q],
                            mem,
                            back: k,
                            prev: p,
                        });
                    }
                }
            }
            next.push(prune(cand));
        }
        fronts.push(next);
    }
    let lastf = &fronts[n_layer - 1];
    let (q, k, time) = lastf
        .iter()
        .enumerate()
        .flat_map(|(q, f)| f.iter().enumerate().map(move |(k, p)| (q, k, p.time)))
        .map(|(q, k, time)| (q, k, time + t.last[q] + t.fixed))
        .min_by(|a, b| a.2.total_cmp(&b.2))?;
    let mem = lastf[q][k].mem + t.fixed_mem;
    let mut pats = vec![0; n_layer];
    let (mut p, mut idx) = (q, k);
    for i in (0..n_layer).rev() {
        pats[i] = p;
        let pt = fronts[i][p][idx];
        (p, idx) = (pt.prev, pt.back);
    }
    Some((time, mem, pats))
}

/// The same answer by trying every assignment (tests; `PATTERNS.len()^n_layer` of them).
pub fn brute_force(t: &Tables, n_layer: usize, budget: usize) -> Option<(f64, usize, Vec<usize>)> {
    let np = PATTERNS.len();
    let total = np.checked_pow(n_layer as u32)?;
    let mut best: Option<(f64, usize, Vec<usize>)> = None;
    for code in 0..total {
        let pats: Vec<usize> = (0..n_layer).map(|i| code / np.pow(i as u32) % np).collect();
        let mut time = t.first[pats[0]] + t.fixed + t.last[pats[n_layer - 1]];
        let mut mem = t.fixed_mem + t.mem[pats[0]];
        for i in 1..n_layer {
            time += t.pair[pats[i - 1]][pats[i]];
            mem += t.mem[pats[i]];
        }
        mem += pats.iter().map(|&p| t.act[p]).max().unwrap_or(0);
        if mem <= budget && best.as_ref().is_none_or(|b| time < b.0) {
            best = Some((time, mem, pats));
        }
    }
    best
}

/// One assignment the search considered, for the report.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    pub description: String,
    /// The assignment itself (the description is for people).
    #[serde(skip)]
    pub split: DecoderSplit,
    /// Predicted seconds of the whole workload.
    pub time_s: f64,
    /// Largest device's bytes.
    pub bytes: usize,
}

/// What `auto` found.
#[derive(Clone, Debug)]
pub struct SearchResult {
    pub split: DecoderSplit,
    /// The chosen assignment costed whole.
    pub evaluation: Evaluation,
    /// The best assignment of each choice of ends, best first (the runner-up is second).
    pub candidates: Vec<Candidate>,
    /// Time to build the tables and solve.
    pub solve_time: Duration,
    /// The tables of the chosen ends and the chosen pattern per layer.
    pub tables: Tables,
    pub patterns: Vec<usize>,
}

impl SearchResult {
    /// For each run of equal layers, the cost of every other pattern in its place.
    pub fn alternatives(&self) -> Vec<RunAlternatives> {
        let (base_t, base_m) = self.tables.path(&self.patterns);
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.patterns.len() {
            let mut j = i;
            while j + 1 < self.patterns.len() && self.patterns[j + 1] == self.patterns[i] {
                j += 1;
            }
            let alternatives = (0..PATTERNS.len())
                .filter(|&q| q != self.patterns[i])
                .map(|q| {
                    let mut p = self.patterns.clone();
                    p[i..=j].iter_mut().for_each(|x| *x = q);
                    let (t, m) = self.tables.path(&p);
                    (PATTERNS[q], t - base_t, m as i64 - base_m as i64)
                })
                .collect();
            out.push(RunAlternatives {
                first: i,
                last: j,
                alternatives,
            });
            i = j + 1;
        }
        out
    }
}

/// The cheapest assignment of `shape` for `w` on `cluster` that fits every device's budget.
pub fn auto(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    ratios: Option<Vec<f64>>,
) -> Result<SearchResult> {
    shape.check()?;
    w.validate()?;
    cluster.validate()?;
    let start = Instant::now();
    let budget = cluster
        .devices
        .iter()
        .map(|d| d.memory_bytes)
        .min()
        .unwrap_or(0) as usize;
    let mut found: Vec<(f64, usize, DecoderSplit, Tables, Vec<usize>)> = Vec::new();
    let mut smallest: Option<usize> = None;
    let layers = layer_tables(shape, cluster, w, &ratios)?;
    // One device splits nothing: every assignment is the same program, so the plan says
    // mirrored rather than whichever split the tables' ties happen to pick.
    let one = cluster.devices.len() == 1;
    for (output, embedding) in [(true, false), (false, false), (true, true), (false, true)] {
        if one && (output || embedding) {
            continue;
        }
        // A choice the meta backend cannot run (a missing rule) is skipped.
        let t = match tables(shape, cluster, w, &ratios, &layers, output, embedding) {
            Ok(t) => t,
            Err(Error::NoSplitRule { .. }) => continue,
            Err(e) => return Err(e),
        };
        let least = t.fixed_mem
            + t.mem.iter().min().copied().unwrap_or(0) * shape.n_layer()
            + t.act.iter().min().copied().unwrap_or(0);
        smallest = Some(smallest.map_or(least, |s: usize| s.min(least)));
        let solved = solve(&t, shape.n_layer(), budget).map(|found| match one {
            false => found,
            true => {
                let mirrored = PATTERNS
                    .iter()
                    .position(|p| !p.attention && !p.mlp)
                    .unwrap();
                let pats = vec![mirrored; shape.n_layer()];
                let (time, mem) = t.path(&pats);
                (time, mem, pats)
            }
        });
        if let Some((time, mem, pats)) = solved {
            let split = DecoderSplit {
                layers: pats.iter().map(|&p| PATTERNS[p]).collect(),
                output,
                embedding,
                ratios: ratios.clone(),
                sequence_parallel: false,
                experts: ExpertSplit::Tensor,
            };
            found.push((time, mem, split, t, pats));
        }
    }
    found.sort_by(|a, b| a.0.total_cmp(&b.0));
    // The tables' bytes are estimates: cost the best candidate whole, and while some device is
    // over its budget, search again with the budget lowered by the excess.
    let mut chosen: Option<(usize, Evaluation)> = None;
    let mut chosen_placed: Option<Placed> = None;
    #[allow(clippy::needless_range_loop)] // `found[i]` is updated in the loop.
    'candidates: for i in 0..found.len() {
        let mut b = budget;
        for _ in 0..4 {
            let split = found[i].2.clone();
            let shape = &shape.for_split(cluster.devices.len(), &split);
            let placed = Placed::new(
                shape,
                cluster,
                by_layer(shape.split_dims(), split),
                w.cache_rows(),
            )?;
            let e = evaluate_placed(&placed, cluster, w)?;
            let Some((_, over)) = e.over_budget() else {
                chosen = Some((i, e));
                chosen_placed = Some(placed);
                break 'candidates;
            };
            b = b.saturating_sub(over as usize + (over as usize / 8).max(1 << 20));
            let t = found[i].3.clone();
            match solve(&t, shape.n_layer(), b) {
                Some((time, mem, pats)) => {
                    found[i].0 = time;
                    found[i].1 = mem;
                    found[i].2.layers = pats.iter().map(|&p| PATTERNS[p]).collect();
                    found[i].4 = pats;
                }
                None => continue 'candidates,
            }
        }
    }
    // A mixture of experts: cost the chosen assignment with its experts split whole over the
    // devices too (expert parallelism: each device streams only its experts' rows, and the
    // same one all-reduce per block), and over groups of devices whose count divides the
    // devices (columns inside a group), and keep whichever is fastest and fits.
    let n_dev = cluster.devices.len();
    let expert_splits = std::iter::once(ExpertSplit::Expert).chain(
        (2..n_dev)
            .filter(|g| n_dev.is_multiple_of(*g))
            .map(|groups| ExpertSplit::Both { groups }),
    );
    for experts in expert_splits {
        let Some((i, e)) = &mut chosen else { break };
        if shape.cfg.moe.is_none() || !found[*i].2.layers.iter().any(|l| l.mlp) {
            break;
        }
        let ep = DecoderSplit {
            experts,
            ..found[*i].2.clone()
        };
        let eshape = &shape.for_split(cluster.devices.len(), &ep);
        let placed = Placed::new(
            eshape,
            cluster,
            by_layer(eshape.split_dims(), ep.clone()),
            w.cache_rows(),
        )?;
        let with = evaluate_placed(&placed, cluster, w)?;
        if with.over_budget().is_none() && with.total_s < e.total_s {
            found[*i].2 = ep;
            *e = with;
            chosen_placed = Some(placed);
        }
    }
    // Sequence parallelism moves no weight, only a prompt's residual stream between split
    // blocks (a reduce-scatter and an all-gather in place of each all-reduce: the same bytes,
    // twice the latencies, the norms on each device's tokens): cost the chosen assignment with
    // it too and keep whichever is faster and fits.
    // Only the prompt changes (a decode step is not hinted), so the placement is reused and
    // only the prefill step is costed again.
    if let (Some((i, e)), Some(placed)) = (&mut chosen, &mut chosen_placed) {
        let split = &found[*i].2;
        if w.prefill > 0 && split.layers.iter().any(|l| l.attention || l.mlp) {
            let sp = DecoderSplit {
                sequence_parallel: true,
                ..split.clone()
            };
            placed.set_hints(sequence_parallel_hints(&sp));
            let prompt_only = Workload { decode: 0, ..*w };
            let with = e.with_prefill_of(&evaluate_placed(placed, cluster, &prompt_only)?);
            if with.over_budget().is_none() && with.total_s < e.total_s {
                found[*i].2 = sp;
                *e = with;
            }
        }
    }
    if let Some((i, _)) = &chosen {
        let best = found.remove(*i);
        found.insert(0, best);
    }
    let solve_time = start.elapsed();
    let Some((_, evaluation)) = chosen else {
        // Name the device over its budget under the least-memory assignment.
        let least = super::strategy::Strategy::Memory
            .split(shape.n_layer(), shape.tied)
            .expect("a fixed strategy");
        let least = DecoderSplit {
            ratios: ratios.clone(),
            ..least
        };
        let shape = &shape.for_split(cluster.devices.len(), &least);
        let placed = Placed::new(
            shape,
            cluster,
            by_layer(shape.split_dims(), least),
            w.cache_rows(),
        )?;
        let e = evaluate_placed(&placed, cluster, w)?;
        let (dev, over) = e
            .over_budget()
            .map(|(m, over)| (m.device.clone(), over))
            .unwrap_or_else(|| {
                let need = smallest.unwrap_or(0);
                (
                    cluster.devices[0].name.clone(),
                    need.saturating_sub(budget) as u64,
                )
            });
        return Err(Error::DoesNotFit {
            model: shape.name.clone(),
            cluster: cluster.name.clone(),
            how: "with everything split".into(),
            device: dev,
            over,
            budget: budget as u64,
        });
    };
    let (_, _, split, tables, patterns) = found[0].clone();
    let candidates = found
        .iter()
        .map(|(time, mem, s, _, _)| Candidate {
            description: describe(s),
            split: s.clone(),
            time_s: *time,
            bytes: *mem,
        })
        .collect();
    Ok(SearchResult {
        split,
        evaluation,
        candidates,
        solve_time,
        tables,
        patterns,
    })
}

// How many devices and how to group them: `layouts.rs` (re-exported here for the names
// callers know).
pub use super::layouts::{DeviceCount, Replicas, SAME_TIME, auto_devices, device_counts, replicas};

#[cfg(test)]
mod tests {
    use super::*;

    /// Tables with pseudo-random costs and sizes (SplitMix64).
    fn random_tables(seed: u64) -> Tables {
        let mut s = seed;
        let mut next = move || {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let np = PATTERNS.len();
        let mut f = || (next() % 1000) as f64 / 100.0;
        let pair = (0..np).map(|_| (0..np).map(|_| f()).collect()).collect();
        let first = (0..np).map(|_| f()).collect();
        let last = (0..np).map(|_| f()).collect();
        let fixed = f();
        let mem = (0..np).map(|_| (f() * 10.0) as usize).collect();
        let act = (0..np).map(|_| (f() * 3.0) as usize).collect();
        Tables {
            output: true,
            embedding: false,
            pair,
            first,
            last,
            fixed,
            mem,
            fixed_mem: 7,
            act,
        }
    }

    #[test]
    fn the_dynamic_program_equals_brute_force() {
        let mut checked = 0;
        for seed in 0..300u64 {
            let t = random_tables(seed);
            for n_layer in 1..=5 {
                for budget in [0, 20, 60, 150, 300, 10_000] {
                    let a = solve(&t, n_layer, budget);
                    let b = brute_force(&t, n_layer, budget);
                    match (&a, &b) {
                        (None, None) => {}
                        (Some(a), Some(b)) => {
                            assert!(
                                (a.0 - b.0).abs() < 1e-9,
                                "seed {seed} L={n_layer} budget {budget}: {a:?} vs {b:?}"
                            );
                            assert!(a.1 <= budget, "over budget: {a:?}");
                            checked += 1;
                        }
                        _ => panic!("seed {seed} L={n_layer} budget {budget}: {a:?} vs {b:?}"),
                    }
                }
            }
        }
        assert!(checked > 1000, "{checked} feasible instances");
    }

    #[test]
    fn the_path_found_costs_what_the_program_says() {
        let t = random_tables(7);
        let (time, mem, pats) = solve(&t, 6, 10_000).unwrap();
        let mut again = t.first[pats[0]] + t.fixed + t.last[pats[5]];
        let mut m = t.fixed_mem + t.mem[pats[0]];
        for i in 1..6 {
            again += t.pair[pats[i - 1]][pats[i]];
            m += t.mem[pats[i]];
        }
        m += pats.iter().map(|&p| t.act[p]).max().unwrap();
        assert!((again - time).abs() < 1e-9);
        assert_eq!(m, mem);
        assert_eq!(t.path(&pats), (time, mem));
    }
}
