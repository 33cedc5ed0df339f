//! A readable plan: per tensor group its split state, bytes per device and why; per layer the
//! predicted compute and communication time; totals per token for prefill and decode; memory
//! per device against its budget; the search's runner-up. As a table, as JSON (a plan file:
//! `run --plan FILE` executes exactly its `split`), and as DOT of one layer's per-device
//! programs with their collectives.

use super::cluster::Cluster;
use super::evaluate::{Evaluation, Placed, StepCost, Workload};
pub use super::experts::PlacedExperts;
use super::experts::{experts_how, meta_tensor};
use super::layouts::{Considered, LayoutKind, LayoutSearch, layouts_table};
use super::search::{Candidate, DeviceCount, RunAlternatives, SearchResult};
pub use super::shape::HeadSplit;
use super::shape::ModelShape;
use super::strategy::describe;
use crate::meta::rewrite::Stage;
use crate::meta::{MetaBuffer, SplitPolicy};
use crate::models::arch::{Group, Part, Tensor};
use crate::models::split::{DecoderSplit, policy};
use crate::op::Op;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::Path;

/// One group of tensors that share a split.
#[derive(Clone, Debug, Serialize)]
pub struct GroupRow {
    pub group: String,
    pub state: String,
    /// Bytes each device holds of the whole group.
    pub bytes: Vec<usize>,
    pub why: String,
}

/// A plan: what `metashard plan` prints, and what `--plan FILE` runs.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub model: String,
    pub cluster: String,
    pub devices: Vec<String>,
    pub workload: Workload,
    pub strategy: String,
    /// The assignment; a plan file is read back for this field.
    pub split: DecoderSplit,
    pub summary: String,
    pub groups: Vec<GroupRow>,
    /// How attention's heads lie over the devices.
    pub heads: HeadSplit,
    /// A mixture of experts' counts and each device's experts (absent for a dense model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<PlacedExperts>,
    pub evaluation: Evaluation,
    /// The search's best assignment per choice of ends, best first.
    pub candidates: Vec<Candidate>,
    /// Per run of equal layers, what the other patterns would cost (search only).
    pub alternatives: Vec<RunAlternatives>,
    pub solve_ms: Option<f64>,
    /// Each count of the cluster's devices the search tried (`auto_devices`), most first; empty
    /// when only the devices of the plan were considered.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub device_counts: Vec<DeviceCount>,
    /// Every layout the search weighed (`search_layouts`: tensor splits on device counts,
    /// hybrid and layer splits, replicas), the chosen first, each with its predicted cost and
    /// verdict; empty for a fixed strategy.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub layouts: Vec<Considered>,
}

/// The part of a plan file `--plan` reads.
#[derive(Deserialize)]
struct PlanFile {
    model: String,
    devices: Vec<String>,
    split: DecoderSplit,
}

/// Read a plan file's assignment (a regular file of at most [`crate::io::MAX_JSON_BYTES`]),
/// checking it against the model's layer count and the number of devices it will run on.
pub fn load_plan(path: &Path, n_layer: usize, n_devices: usize) -> Result<DecoderSplit> {
    parse_plan(path, &crate::io::read_json_text(path)?, n_layer, n_devices)
}

/// [`load_plan`] of the JSON `text` of `path` (named in errors). Shares whose sum overflows are
/// scaled so the largest is 1 ([`super::strategy::normalized`]).
pub fn parse_plan(
    path: &Path,
    text: &str,
    n_layer: usize,
    n_devices: usize,
) -> Result<DecoderSplit> {
    let mut p: PlanFile = crate::io::parse_json(path, "plan", text)?;
    let bad = |field: &str, reason: String| Error::Format {
        path: path.to_path_buf(),
        field: field.into(),
        reason,
    };
    if p.split.layers.len() != n_layer {
        return Err(bad(
            "split.layers",
            format!(
                "the plan (for `{}`) has {} layers, the model {n_layer}",
                p.model,
                p.split.layers.len()
            ),
        ));
    }
    if p.devices.len() != n_devices {
        return Err(bad(
            "devices",
            format!(
                "the plan is for {} device{} ({}), the run has {n_devices}: run it on {} \
                 device{} (`plan` keeps the fewest devices within 2% of the fastest; a fixed \
                 `--strategy` plans for all of them)",
                p.devices.len(),
                if p.devices.len() == 1 { "" } else { "s" },
                p.devices.join(","),
                p.devices.len(),
                if p.devices.len() == 1 { "" } else { "s" },
            ),
        ));
    }
    if let Some(r) = &p.split.ratios {
        if r.len() != n_devices {
            return Err(bad(
                "split.ratios",
                format!("{} shares for {n_devices} devices", r.len()),
            ));
        }
        let n = super::strategy::normalized(r).ok_or_else(|| {
            bad(
                "split.ratios",
                format!("{r:?}: shares must be finite, non-negative and not all zero"),
            )
        })?;
        p.split.ratios = Some(n);
    }
    Ok(p.split)
}

/// The split callback of an assignment for `shape`, with its state hints (sequence
/// parallelism). `shape` as the assignment places it: [`ModelShape::for_split`] where its
/// KV heads may be repeated ([`evaluate_split`] does both).
pub fn split_fn(shape: &ModelShape, split: &DecoderSplit) -> SplitPolicy {
    policy(shape.split_dims(), split.clone())
}

/// [`evaluate`](super::evaluate::evaluate) of an assignment as a run places it: the model's
/// KV heads repeated where the run repeats them ([`ModelShape::for_split`]), with its state
/// hints.
pub fn evaluate_split(
    shape: &ModelShape,
    split: &DecoderSplit,
    cluster: &Cluster,
    workload: &Workload,
) -> Result<Evaluation> {
    let shape = shape.for_split(cluster.devices.len(), split);
    super::evaluate::evaluate(&shape, split_fn(&shape, split), cluster, workload)
}

impl Plan {
    /// The plan of a fixed strategy's `split`, evaluated as `evaluation`.
    pub fn fixed(
        shape: &ModelShape,
        cluster: &Cluster,
        workload: &Workload,
        strategy: &str,
        split: DecoderSplit,
        evaluation: Evaluation,
    ) -> Result<Plan> {
        Self::new(
            shape,
            cluster,
            workload,
            strategy,
            split,
            evaluation,
            Vec::new(),
            Vec::new(),
            None,
        )
    }

    /// The plan the search found.
    pub fn searched(
        shape: &ModelShape,
        cluster: &Cluster,
        workload: &Workload,
        r: SearchResult,
    ) -> Result<Plan> {
        let alternatives = r.alternatives();
        Self::new(
            shape,
            cluster,
            workload,
            "auto",
            r.split,
            r.evaluation,
            r.candidates,
            alternatives,
            Some(r.solve_time.as_secs_f64() * 1e3),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn new(
        shape: &ModelShape,
        cluster: &Cluster,
        workload: &Workload,
        strategy: &str,
        split: DecoderSplit,
        evaluation: Evaluation,
        candidates: Vec<Candidate>,
        alternatives: Vec<RunAlternatives>,
        solve_ms: Option<f64>,
    ) -> Result<Plan> {
        let shape = &shape.for_split(cluster.devices.len(), &split);
        let placed = Placed::new(
            shape,
            cluster,
            split_fn(shape, &split),
            workload.cache_rows(),
        )?;
        let heads = HeadSplit::of(shape, cluster.devices.len(), &split)?;
        let experts = PlacedExperts::of(&placed);
        let groups = groups(
            &placed,
            &split,
            strategy,
            &candidates,
            &alternatives,
            evaluation.total_s,
        )?;
        Ok(Plan {
            model: shape.name.clone(),
            cluster: cluster.name.clone(),
            devices: cluster.devices.iter().map(|d| d.name.clone()).collect(),
            workload: *workload,
            strategy: strategy.to_string(),
            summary: describe(&split),
            split,
            groups,
            heads,
            experts,
            evaluation,
            candidates,
            alternatives,
            solve_ms,
            device_counts: Vec::new(),
            layouts: Vec::new(),
        })
    }

    /// The plan of `search_layouts`: the chosen layout's tensor plan (one copy's for replicas,
    /// the fastest tensor split's for a hybrid or layer split), with every layout weighed.
    pub fn searched_layouts(shape: &ModelShape, ls: LayoutSearch) -> Result<Plan> {
        let mut p = Plan::searched_devices(shape, &ls.subset, &ls.workload, ls.result, ls.counts)?;
        p.layouts = ls.layouts;
        Ok(p)
    }

    /// The line naming the chosen layout, when the search weighed layouts.
    pub fn layout_line(&self) -> Option<String> {
        let c = self.layouts.first().filter(|c| c.chosen)?;
        let plan = match c.kind {
            LayoutKind::Tensor => "with this plan".to_string(),
            LayoutKind::Replicas => format!(
                "this plan is one copy's, on its {} device{}",
                c.group,
                if c.group == 1 { "" } else { "s" }
            ),
            LayoutKind::Hybrid | LayoutKind::Layer => {
                let best = self
                    .layouts
                    .iter()
                    .find(|x| x.kind == LayoutKind::Tensor && x.devices == self.devices.len());
                let by = match best.and_then(|b| b.time_s.zip(c.time_s)) {
                    Some((b, t)) => format!(" ({:+.1}%)", (b / t.max(1e-12) - 1.0) * 100.0),
                    None => String::new(),
                };
                format!("not a plan file: the plan below is the fastest tensor split{by}")
            }
        };
        Some(format!(
            "layout: {} ({}); {}; {plan}",
            c.description, c.verdict, c.run
        ))
    }

    /// The plan of `auto_devices`: the search's result on the first `subset` devices of a
    /// cluster, with the predicted time of every count of its devices tried.
    pub fn searched_devices(
        shape: &ModelShape,
        subset: &Cluster,
        workload: &Workload,
        r: SearchResult,
        counts: Vec<DeviceCount>,
    ) -> Result<Plan> {
        let mut p = Plan::searched(shape, subset, workload, r)?;
        p.device_counts = counts;
        Ok(p)
    }

    /// The line saying how many devices the plan uses and what the other counts would take.
    pub fn devices_line(&self) -> Option<String> {
        if self.device_counts.len() < 2 {
            return None;
        }
        let all = self.device_counts.iter().map(|c| c.devices).max()?;
        let this = self.evaluation.total_s.max(1e-12);
        let others: Vec<String> = self
            .device_counts
            .iter()
            .filter(|c| c.devices != self.devices.len())
            .map(|c| match c.time_s {
                Some(t) => format!("{}: {:+.1}%", c.devices, (t / this - 1.0) * 100.0),
                None => format!("{}: does not fit", c.devices),
            })
            .collect();
        Some(format!(
            "devices: {} of {all} (the fewest within 2% of the fastest that fit); the workload on {}",
            self.devices.len(),
            others.join(", ")
        ))
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a plan serializes")
    }

    /// The plan as text tables.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let mib = |b: usize| b as f64 / 1048576.0;
        let _ = writeln!(
            s,
            "plan: {} on {} ({} device{}), workload {}, strategy {}",
            self.model,
            self.cluster,
            self.devices.len(),
            if self.devices.len() == 1 { "" } else { "s" },
            self.workload,
            self.strategy
        );
        let _ = writeln!(s, "assignment: {}", self.summary);
        let _ = writeln!(s, "{}", self.heads.line());
        if let Some(x) = &self.experts {
            let _ = writeln!(s, "{}", x.line());
        }
        if let Some(ms) = self.solve_ms {
            let _ = writeln!(s, "search: {ms:.1} ms");
        }
        if let Some(line) = self.layout_line() {
            let _ = writeln!(s, "{line}");
        }
        if let Some(line) = self.devices_line() {
            let _ = writeln!(s, "{line}");
        }
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "{:<34} {:<28} {:>14}  why",
            "tensor group", "state", "MiB/device"
        );
        for g in &self.groups {
            let max = g.bytes.iter().copied().max().unwrap_or(0);
            let min = g.bytes.iter().copied().min().unwrap_or(0);
            let bytes = if max == min {
                format!("{:.2}", mib(max))
            } else {
                format!("{:.2}-{:.2}", mib(min), mib(max))
            };
            let _ = writeln!(
                s,
                "{:<34} {:<28} {:>14}  {}",
                g.group, g.state, bytes, g.why
            );
        }
        let _ = writeln!(s);
        let e = &self.evaluation;
        let _ = writeln!(
            s,
            "{:<14} {:>14} {:>14} {:>14} {:>14}",
            "segment", "prefill ms", "prefill comm", "decode us", "decode comm"
        );
        for row in segment_rows(e) {
            let _ = writeln!(s, "{row}");
        }
        let _ = writeln!(s);
        if let Some(p) = &e.prefill {
            let _ = writeln!(
                s,
                "prefill: {:.2} ms per chunk of {} tokens ({} chunk{}), {:.1} tokens/s; compute \
                 {:.2} ms, communication {:.2} ms{}",
                p.seconds * 1e3,
                p.tokens,
                e.prefill_chunks,
                if e.prefill_chunks == 1 { "" } else { "s" },
                e.prefill_tps(),
                p.compute_s * 1e3,
                p.comm_s * 1e3,
                collectives(p)
            );
        }
        if let Some(d) = &e.decode {
            let per = if d.tokens > 1 {
                format!(
                    "step of {} sequences, {:.1} tokens/s per sequence, {:.1} in all",
                    d.tokens,
                    e.decode_tps(),
                    e.decode_tps_total()
                )
            } else {
                format!("token, {:.1} tokens/s", e.decode_tps())
            };
            let _ = writeln!(
                s,
                "decode:  {:.3} ms per {per}; compute {:.3} ms, communication {:.3} ms{}",
                d.seconds * 1e3,
                d.compute_s * 1e3,
                d.comm_s * 1e3,
                collectives(d)
            );
        }
        let _ = writeln!(s, "workload total: {:.3} s", e.total_s);
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "{:<12} {:>12} {:>12} {:>12} {:>12} {:>12}",
            "device", "weights MiB", "kv MiB", "act MiB", "total MiB", "budget MiB"
        );
        for m in &e.memory {
            let _ = writeln!(
                s,
                "{:<12} {:>12.1} {:>12.1} {:>12.1} {:>12.1} {:>12.1}{}",
                m.device,
                mib(m.weights),
                mib(m.kv_cache),
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
        if self.candidates.len() > 1 {
            let _ = writeln!(s);
            let best = self.candidates[0].time_s;
            let _ = writeln!(s, "search candidates (whole workload):");
            for c in &self.candidates {
                let _ = writeln!(
                    s,
                    "  {:>10.3} s ({:+.1}%) {:>10.1} MiB  {}",
                    c.time_s,
                    (c.time_s / best - 1.0) * 100.0,
                    mib(c.bytes),
                    c.description
                );
            }
        }
        if !self.layouts.is_empty() {
            // The whole workload (a copy's plan has its share; the other layouts the whole
            // batch).
            let batch = self
                .layouts
                .iter()
                .find(|c| c.copies == 1)
                .map_or(self.workload.batch, |c| c.batch);
            let whole = Workload {
                batch,
                ..self.workload
            };
            let _ = writeln!(s);
            s.push_str(&layouts_table(&self.layouts, &whole));
        }
        s
    }
}

/// A state with equal extents written once: `Axis1[1024 x8]`.
fn compact(state: &str) -> String {
    let (Some(a), Some(b)) = (state.find('['), state.rfind(']')) else {
        return state.to_string();
    };
    let inner = &state[a + 1..b];
    if inner.contains('[') {
        return state.to_string();
    }
    let v: Vec<&str> = inner.split(',').map(str::trim).collect();
    if v.len() > 2 && v.iter().all(|x| *x == v[0]) {
        format!("{}[{} x{}]{}", &state[..a], v[0], v.len(), &state[b + 1..])
    } else {
        state.to_string()
    }
}

fn collectives(c: &StepCost) -> String {
    if c.collectives.is_empty() {
        return String::new();
    }
    let v: Vec<String> = c
        .collectives
        .iter()
        .map(|x| {
            format!(
                "{} {} ({:.1} KiB)",
                x.count,
                x.kind,
                x.bytes as f64 / 1024.0
            )
        })
        .collect();
    format!(" [{}]", v.join(", "))
}

/// Per segment rows, consecutive layers with equal costs folded.
fn segment_rows(e: &Evaluation) -> Vec<String> {
    let seg = |c: &Option<StepCost>, i: usize| {
        c.as_ref()
            .and_then(|c| c.segments.get(i))
            .map_or((0.0, 0.0), |x| (x.compute_s, x.comm_s))
    };
    let n = e
        .prefill
        .as_ref()
        .or(e.decode.as_ref())
        .map_or(0, |c| c.segments.len());
    let names: Vec<String> = e
        .prefill
        .as_ref()
        .or(e.decode.as_ref())
        .map_or(Vec::new(), |c| {
            c.segments.iter().map(|x| x.name.clone()).collect()
        });
    let vals: Vec<[f64; 4]> = (0..n)
        .map(|i| {
            let (pc, pm) = seg(&e.prefill, i);
            let (dc, dm) = seg(&e.decode, i);
            [(pc + pm) * 1e3, pm * 1e3, (dc + dm) * 1e6, dm * 1e6]
        })
        .collect();
    let close = |a: &[f64; 4], b: &[f64; 4]| {
        a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 0.005 * x.abs().max(y.abs()).max(1e-9))
    };
    let mut rows = Vec::new();
    let mut i = 0;
    while i < n {
        let mut j = i;
        let is_layer = names[i].starts_with("layer");
        while is_layer
            && j + 1 < n
            && names[j + 1].starts_with("layer")
            && close(&vals[i], &vals[j + 1])
        {
            j += 1;
        }
        let name = if j > i {
            format!(
                "layers {}-{}",
                names[i].trim_start_matches("layer "),
                names[j].trim_start_matches("layer ")
            )
        } else {
            names[i].clone()
        };
        let v = vals[i];
        rows.push(format!(
            "{:<14} {:>14.3} {:>14.3} {:>14.1} {:>14.1}{}",
            name,
            v[0],
            v[1],
            v[2],
            v[3],
            if j > i { "  (each)" } else { "" }
        ));
        i = j + 1;
    }
    rows
}

/// What the group rows are built from: the placed model, the assignment and the search.
struct GroupCtx<'a> {
    placed: &'a Placed,
    tensors: std::collections::HashMap<String, crate::buffer::Storage>,
    split: &'a DecoderSplit,
    strategy: &'a str,
    candidates: &'a [Candidate],
    alternatives: &'a [RunAlternatives],
    total_s: f64,
    rows: Vec<GroupRow>,
}

impl GroupCtx<'_> {
    /// The compact state and per-device bytes of a placed tensor.
    fn state_of(&self, name: &str) -> Option<(String, Vec<usize>)> {
        let n = self.placed.devices.len();
        let st = self.tensors.get(name)?;
        let mb = st.buffer.as_any().downcast_ref::<MetaBuffer>()?;
        let t = mb.tensor_at(st.offset)?;
        Some((
            compact(&t.state.to_string()),
            (0..n).map(|d| t.local_bytes(d)).collect(),
        ))
    }

    /// A row for `names` (summed bytes) with the state of `rep`, when `rep` is placed.
    fn push(&mut self, group: String, rep: &str, names: &[String], why: String) {
        let Some((state, _)) = self.state_of(rep) else {
            return;
        };
        let mut bytes = vec![0; self.placed.devices.len()];
        for nm in names {
            if let Some((_, b)) = self.state_of(nm) {
                bytes.iter_mut().zip(b).for_each(|(a, x)| *a += x);
            }
        }
        self.rows.push(GroupRow {
            group,
            state,
            bytes,
            why,
        });
    }

    /// Why an end is split as it is: the best candidate with the other choice of this end.
    fn ends_why(&self, what: &str, alt: &str, differs: &dyn Fn(&DecoderSplit) -> bool) -> String {
        if self.strategy != "auto" {
            return format!("strategy {}: {what} ({alt} otherwise)", self.strategy);
        }
        let cands = self.candidates;
        let best = cands.first().map_or(0.0, |c| c.time_s);
        match cands.iter().skip(1).find(|c| differs(&c.split)) {
            Some(r) => format!(
                "search: {what}; {alt}: {:+.1}% time, {:+.1} MiB",
                (r.time_s / best.max(1e-12) - 1.0) * 100.0,
                (r.bytes as f64 - cands[0].bytes as f64) / 1048576.0
            ),
            None => format!("search: {what}"),
        }
    }

    /// Why a run of layers splits `part` as it does: what the best other pattern changing this
    /// part would cost.
    fn layer_why(&self, first: usize, what: &str, alt: &str, part: Part) -> String {
        if self.strategy != "auto" {
            return format!("strategy {}: {what} ({alt} otherwise)", self.strategy);
        }
        let Some(run) = self.alternatives.iter().find(|r| r.first == first) else {
            return format!("search: {what}");
        };
        let cur = self.split.layers[first];
        let flipped = run.alternatives.iter().find(|(p, _, _)| match part {
            Part::Attention => p.attention != cur.attention && p.mlp == cur.mlp,
            _ => p.mlp != cur.mlp && p.attention == cur.attention,
        });
        match flipped {
            Some((_, dt, dm)) => format!(
                "search: {what}; {alt}: {:+.1}% time, {:+.1} MiB",
                dt / self.total_s.max(1e-12) * 100.0,
                *dm as f64 / 1048576.0
            ),
            None => format!("search: {what}"),
        }
    }

    /// The rows of a whole-model tensor.
    fn end_row(&mut self, tensor: Tensor) {
        let arch = self.placed.shape.cfg.arch;
        let name = arch.name(tensor, 0);
        let why = match tensor {
            Tensor::TokenEmbd if self.split.embedding => self.ends_why(
                "rows split by vocabulary, looked up where they live",
                "mirrored",
                &|c| !c.embedding,
            ),
            Tensor::TokenEmbd => self.ends_why(
                "mirrored: every device looks up its tokens",
                "vocab split",
                &|c| c.embedding,
            ),
            Tensor::Output if self.split.output => self.ends_why(
                "columns by vocabulary, logits gathered on read",
                "mirrored",
                &|c| !c.output,
            ),
            Tensor::Output => self.ends_why("mirrored", "vocab split", &|c| c.output),
            _ => "mirrored: row-wise over the whole width".into(),
        };
        self.push(name.clone(), &name, std::slice::from_ref(&name), why);
    }

    /// The rows of layers `i..=j` (one pattern), one per tensor group.
    fn layer_rows(&mut self, i: usize, j: usize) {
        let arch = self.placed.shape.cfg.arch;
        let l = self.split.layers[i];
        let sp = self.split.sequence_parallel;
        let range = if i == j {
            format!("blk.{i}")
        } else {
            format!("blk.{i}-{j}")
        };
        for group in LAYER_GROUPS {
            let roles: Vec<Tensor> = match group {
                Group::Cache => vec![Tensor::CacheK, Tensor::CacheV],
                g => arch
                    .layer_tensors()
                    .map(|(t, _)| t)
                    .filter(|t| t.group() == *g)
                    .collect(),
            };
            let Some(&first) = roles.first() else {
                continue;
            };
            // A mixture of experts' MLP groups are shown by their experts' state.
            let exps = match group {
                Group::FfnIn => Some(Tensor::FfnUpExps),
                Group::FfnOut => Some(Tensor::FfnDownExps),
                _ => None,
            };
            let exps = exps.filter(|t| arch.has(*t));
            let rep = exps.unwrap_or(first);
            let names: Vec<String> = (i..=j)
                .flat_map(|b| roles.iter().map(move |&t| arch.name(t, b)))
                .collect();
            let (label, why) = match group {
                Group::AttnQkv if l.attention => (
                    label(&roles),
                    self.layer_why(
                        i,
                        "columns by whole KV-head groups",
                        "mirrored",
                        Part::Attention,
                    ),
                ),
                Group::AttnQkv => (
                    label(&roles),
                    self.layer_why(i, "attention mirrored", "head split", Part::Attention),
                ),
                Group::AttnOut => (label(&roles), reduced(l.attention, sp, "rows by heads: ")),
                Group::Cache => (
                    " kv cache".to_string(),
                    if l.attention {
                        "by KV heads, with the attention".into()
                    } else {
                        "mirrored with the attention".into()
                    },
                ),
                Group::FfnIn if l.mlp => (
                    label(&roles),
                    self.layer_why(i, "columns in whole blocks", "mirrored", Part::Mlp),
                ),
                Group::FfnIn => (
                    label(&roles),
                    self.layer_why(i, "MLP mirrored", "column/row split", Part::Mlp),
                ),
                Group::FfnOut => (label(&roles), reduced(l.mlp, sp, "rows: ")),
                _ => (
                    " norms".to_string(),
                    if sp && (l.attention || l.mlp) {
                        "mirrored: row-wise, on each device's tokens (prompts)".into()
                    } else {
                        "mirrored: row-wise over the whole width".into()
                    },
                ),
            };
            let how = exps.and_then(|t| self.tensors.get(&arch.name(t, i)).and_then(meta_tensor));
            let why = match (how.map(|t| experts_how(&t.state)), group) {
                (None, _) => why,
                (Some(None), Group::FfnOut) => "mirrored with its inputs".into(),
                (Some(Some(h)), Group::FfnOut) => reduced(true, sp, &format!("{h}: ")),
                (Some(h), _) => {
                    let alt = if l.mlp { "mirrored" } else { "split" };
                    self.layer_why(i, h.unwrap_or("experts mirrored"), alt, Part::Mlp)
                }
            };
            self.push(format!("{range}{label}"), &arch.name(rep, i), &names, why);
        }
    }
}

/// The per-layer groups in the order the report lists them.
const LAYER_GROUPS: &[Group] = &[
    Group::AttnQkv,
    Group::AttnOut,
    Group::Cache,
    Group::FfnIn,
    Group::FfnOut,
    Group::Norms,
];

/// `.attn_q/k/v` for the matrices among `roles` (biases ride along with their matrices).
fn label(roles: &[Tensor]) -> String {
    let bases: Vec<&str> = roles
        .iter()
        .filter(|t| !t.is_vector())
        .map(|t| t.base_name())
        .collect();
    // The longest prefix ending in `_` every base shares (`attn_`, `ffn_`).
    let prefix = (0..=bases[0].len())
        .rev()
        .map(|k| &bases[0][..k])
        .find(|p| (p.is_empty() || p.ends_with('_')) && bases.iter().all(|b| b.starts_with(p)))
        .unwrap_or("");
    let rest: Vec<&str> = bases
        .iter()
        .map(|b| b.strip_prefix(prefix).unwrap_or(b))
        .collect();
    format!(".{prefix}{}", rest.join("/"))
}

/// Why a row-parallel projection's output is what it is.
fn reduced(split: bool, sequence_parallel: bool, what: &str) -> String {
    match (split, sequence_parallel) {
        (true, true) => format!("{what}partial sums, reduce-scattered to tokens"),
        (true, false) => format!("{what}partial sums, one all-reduce"),
        _ => "mirrored with its inputs".into(),
    }
}

/// Tensor groups: the ends, then each run of layers with one pattern, split into attention
/// (Q, K, V, output, KV cache), MLP and norms, as the architecture table groups its tensors.
fn groups(
    placed: &Placed,
    split: &DecoderSplit,
    strategy: &str,
    candidates: &[Candidate],
    alternatives: &[RunAlternatives],
    total_s: f64,
) -> Result<Vec<GroupRow>> {
    let mut ctx = GroupCtx {
        placed,
        tensors: placed.tensors(),
        split,
        strategy,
        candidates,
        alternatives,
        total_s,
        rows: Vec::new(),
    };
    ctx.end_row(Tensor::TokenEmbd);
    let mut i = 0;
    while i < split.layers.len() {
        let mut j = i;
        while j + 1 < split.layers.len() && split.layers[j + 1] == split.layers[i] {
            j += 1;
        }
        ctx.layer_rows(i, j);
        i = j + 1;
    }
    ctx.end_row(Tensor::OutputNorm);
    ctx.end_row(Tensor::Output);
    Ok(ctx.rows)
}

/// DOT of the per-device programs of layer 0 for one decode step: a cluster per device, nodes
/// with their local shapes, collectives joined across devices by dashed edges.
pub fn dot(shape: &ModelShape, cluster: &Cluster, split: &DecoderSplit) -> Result<String> {
    let mut s1 = split.clone();
    s1.layers.truncate(1);
    let one = shape.with_layers(1).for_split(cluster.devices.len(), &s1);
    let placed = Placed::new(&one, cluster, split_fn(&one, &s1), 64)?;
    let g = placed.step_graph(1, 8, 1)?;
    let (_, rw) = placed.shard(&g)?;
    let mut out = String::from("digraph plan {\n  rankdir=TB;\n  node [shape=box, fontsize=10];\n");
    let mut collectives: Vec<Vec<String>> = Vec::new();
    for (d, p) in rw.programs.iter().enumerate() {
        let _ = writeln!(
            out,
            "  subgraph cluster_{d} {{\n    label=\"{}\";",
            placed.devices[d].name()
        );
        let lg = &p.graph;
        let mut k = 0;
        for id in lg.ids() {
            let node = lg.node(id);
            if node.is_leaf() && node.storage.is_none() && node.data.is_none() {
                continue;
            }
            let ne = node.layout.ne;
            let label = format!(
                "{}\\n{}\\n[{},{},{},{}]",
                node.op.name(),
                node.name.replace('"', ""),
                ne[0],
                ne[1],
                ne[2],
                ne[3]
            );
            let style = match node.op {
                Op::Collective(_) => ", style=filled, fillcolor=\"#f4c7a1\"",
                Op::Leaf => ", style=dashed",
                _ => "",
            };
            let _ = writeln!(out, "    d{d}n{} [label=\"{label}\"{style}];", id.index());
            for &src in &node.src {
                let _ = writeln!(out, "    d{d}n{} -> d{d}n{};", src.index(), id.index());
            }
            if matches!(node.op, Op::Collective(_)) {
                if collectives.len() <= k {
                    collectives.push(Vec::new());
                }
                collectives[k].push(format!("d{d}n{}", id.index()));
                k += 1;
            }
        }
        let stages = p
            .stages
            .iter()
            .filter(|s| matches!(s, Stage::Collective { .. }))
            .count();
        let _ = writeln!(
            out,
            "    label=\"{} ({stages} collectives)\";\n  }}",
            placed.devices[d].name()
        );
    }
    for group in collectives {
        for w in group.windows(2) {
            let _ = writeln!(
                out,
                "  {} -> {} [style=dashed, dir=none, constraint=false, color=\"#c05000\"];",
                w[0], w[1]
            );
        }
    }
    out.push_str("}\n");
    Ok(out)
}
