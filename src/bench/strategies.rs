//! `metashard bench strategies`: every strategy's prediction held against a measurement. For
//! each device set, the devices are calibrated (or a profile is read), every named strategy
//! and the search's choice are costed by the planner for the benchmark's workload, then each
//! is loaded and run (prompt of `pp` tokens, `tg` decode steps, repetitions interleaved over
//! the strategies, medians). Without a profile the device set is calibrated `--calibrations`
//! times (3 by default): once before anything is loaded (auto is searched, and a layer
//! split's micro-batches chosen, with that one), the others spread between the repetitions;
//! each row's prediction is the median of its predictions under each profile, so that the
//! predictions sample the same stretch of a shared host's time as the measurements (a quick
//! calibration's step factors moved 0.71 -> 1.12 within twenty minutes on a 2-vCPU guest,
//! docs/planner.md). The report puts predicted and measured side by side, with the
//! Spearman rank correlation of the strategies' speeds, the median relative error for prefill
//! and decode, and how auto's measured speed compares with the best measured; and that error
//! split in two: the predictions' level (the median of predicted / measured, which moves with
//! the host between the calibration and the measurements) and the median error once the
//! level is divided out (the cost model's shape: how the strategies compare).
//!
//! With `--batch 1,8` each batch size S is a workload of its own: S sequences' prompts, then
//! decode steps of one token of each of the S sequences together (`BatchSession`, the engine's
//! batched step), priced by the planner at `batch = S` (auto searched per batch: the tensor
//! search's split, or the layer split where the planner predicts it faster). Beside the
//! tensor strategies a `layer` row runs whole layers per device as `run --split-mode layer`
//! does, pipelined in the micro-batches the planner takes for it (`planner/layer.rs`): a
//! prompt's chunk cut by `Session::ubatch`, a batched step's sequences by
//! `BatchSession::micro_batches`. On device sets of 4 or more (an even count) a `hybrid` row
//! runs two groups, each a meta device under the Megatron split, with whole layers per group
//! as `run --split-mode hybrid` does, pipelined the same way and priced by the planner's
//! hybrid split. The summaries are per device set and batch size; the report also keeps the
//! figures of each device set's profile that its calibration measured on real steps (per-node
//! overhead, step factors, alone speedups), which move with the host's load from run to run.
//!
//! `--strategies` keeps only the named strategies (`layer` names the layer split, `hybrid`
//! the hybrid split), for two
//! strategies timed side by side in a short quiet run; each row also has the spread of its
//! decode repetitions and the bytes a one-sequence decode step moves between devices, counted
//! from the meta backend's sharding of that step (weights among them: expert parallelism moves
//! none).

use crate::cli::run::load;
use crate::cli::{JsonArgs, SplitArgs, parse_positive, parse_reps};
use metashard::Result;
use metashard::calibrate::{CalibrateOptions, calibrate};
use metashard::cpu::Precision;
use metashard::models::batch::{BatchSession, MAX_SLOTS, SeqInput};
use metashard::models::layer_split::SplitMode;
use metashard::models::session::Session;
use metashard::models::split::DecoderSplit;
use metashard::planner::evaluate::{Evaluation, Workload};
use metashard::planner::layouts::SAME_TIME;
use metashard::planner::report::evaluate_split;
use metashard::planner::{
    Cluster, LayerSplitCost, MicroBatches, ModelShape, Strategy, auto, evaluate_hybrid_split_with,
    evaluate_layer_split_with,
};
use serde::Serialize;
use std::time::Instant;

#[derive(Clone, Debug, clap::Args)]
pub struct BenchStrategiesArgs {
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Device sets (repeat the flag); each is calibrated first unless --profile is given.
    #[arg(long, default_values_t = vec!["cpu:2x1".to_string(), "cpu:3x1".to_string()])]
    pub devices: Vec<String>,
    /// Calibrated profiles (`metashard calibrate -o FILE`), one per --devices, in order.
    #[arg(long)]
    pub profile: Vec<std::path::PathBuf>,
    /// Prompt tokens.
    #[arg(long, default_value_t = 128, value_parser = parse_positive)]
    pub pp: usize,
    /// Generated tokens.
    #[arg(long, default_value_t = 64, value_parser = parse_positive)]
    pub tg: usize,
    /// Repetitions (interleaved over the strategies; medians reported).
    #[arg(long, default_value_t = 3, value_parser = parse_reps)]
    pub reps: usize,
    /// Sequences decoded together, a list (e.g. `1,8`): each is measured and predicted as a
    /// workload of its own.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize],
          value_parser = parse_positive)]
    pub batch: Vec<usize>,
    /// Only these strategies (comma-separated names, e.g. `megatron,expert-parallel`; `layer`
    /// for the layer split, `hybrid` for two groups with layers across them, on 4 or more
    /// devices); all that apply to the model by default.
    #[arg(long, value_delimiter = ',')]
    pub strategies: Vec<String>,
    /// A full calibration of each device set instead of a quick one.
    #[arg(long)]
    pub full_calibration: bool,
    /// Calibrations of each device set without a --profile: the first before anything is
    /// loaded (auto is searched with it), the others spread over the repetitions; every
    /// prediction is the median of its predictions under each (the host's speed moves
    /// between a calibration and the measurements minutes later).
    #[arg(long, default_value_t = 3, value_parser = parse_calibrations)]
    pub calibrations: usize,
    /// Write an SVG plot of predicted against measured tokens/s with the diagonal.
    #[arg(long)]
    pub svg: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub out: JsonArgs,
}

/// `bench strategies`: check the device lists, predict and measure every strategy (progress on
/// stderr), write the SVG plot if asked, print the report.
pub fn run(a: &BenchStrategiesArgs) -> Result<()> {
    for d in &a.devices {
        metashard::parse_devices(d)?;
    }
    let opts = StrategiesBenchOptions {
        model: a.model.clone(),
        devices: a.devices.clone(),
        profiles: a.profile.clone(),
        pp: a.pp,
        tg: a.tg,
        reps: a.reps,
        batch: a.batch.clone(),
        strategies: a.strategies.clone(),
        full_calibration: a.full_calibration,
        calibrations: a.calibrations,
    };
    let report = measure(&opts, &|line| eprintln!("{line}"))?;
    if let Some(p) = &a.svg {
        std::fs::write(p, svg(&report)).map_err(|e| metashard::Error::io(p, e))?;
    }
    a.out.print("bench strategies report", &report, print_table)
}

#[derive(Clone, Debug)]
pub struct StrategiesBenchOptions {
    pub model: String,
    pub devices: Vec<String>,
    /// Profiles for the device sets, in order (calibrated when absent).
    pub profiles: Vec<std::path::PathBuf>,
    pub pp: usize,
    pub tg: usize,
    pub reps: usize,
    /// Batch sizes (sequences decoded together), each a workload.
    pub batch: Vec<usize>,
    /// Only these strategies (by name, `layer` for the layer split, `hybrid` for the hybrid
    /// split); empty: every one that applies to the model.
    pub strategies: Vec<String>,
    /// A full calibration instead of a quick one.
    pub full_calibration: bool,
    /// Calibrations of each device set without a profile (1..=[`MAX_CALIBRATIONS`]): the
    /// predictions are the median of their predictions under each.
    pub calibrations: usize,
}

/// The most calibrations `--calibrations` takes (a quick one takes most of a minute).
pub const MAX_CALIBRATIONS: usize = 16;

/// A `--calibrations` count: 1..=[`MAX_CALIBRATIONS`].
fn parse_calibrations(s: &str) -> std::result::Result<usize, String> {
    match parse_positive(s)? {
        n if n <= MAX_CALIBRATIONS => Ok(n),
        n => Err(format!("{n} calibrations: at most {MAX_CALIBRATIONS}")),
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct StrategyRow {
    pub devices: String,
    pub strategy: String,
    pub assignment: String,
    /// Sequences decoded together.
    pub batch: usize,
    /// Micro-batches a prompt step and a decode step are cut into (the layer split's
    /// pipeline; 1 for the tensor strategies).
    pub pp_micro_batches: usize,
    pub tg_micro_batches: usize,
    /// Prompt tokens/s of all the batch's sequences.
    pub predicted_pp_tps: f64,
    pub measured_pp_tps: f64,
    /// Generated tokens/s per sequence (the planner's `decode_tps`).
    pub predicted_tg_tps: f64,
    pub measured_tg_tps: f64,
    /// Generated tokens/s of all the batch's sequences (`decode_tps_total`).
    pub predicted_tg_total_tps: f64,
    pub measured_tg_total_tps: f64,
    /// The slowest and fastest decode repetition (tokens/s per sequence): the median's noise.
    pub measured_tg_range: (f64, f64),
    /// The lowest and highest prediction of the device set's calibrations (tokens/s; prompt,
    /// decode per sequence): the calibrations' noise. The predicted figures are their medians.
    pub predicted_pp_range: (f64, f64),
    pub predicted_tg_range: (f64, f64),
    /// The prediction under each calibration, in the order they were taken (prompt tokens/s,
    /// decode tokens/s per sequence).
    pub predicted_by_calibration: Vec<(f64, f64)>,
    /// Bytes one one-sequence decode step moves between devices (every communicating
    /// conversion of the meta backend's sharding of that step), and those of them that are
    /// weights; 0 for the layer and hybrid splits (not counted: the layer split's copies are the
    /// residual stream between stages).
    pub step_comm_bytes: usize,
    pub step_weight_bytes_moved: usize,
    /// Largest device's weights, predicted and measured (bytes); the planner's layer split
    /// reports resident bytes with the KV cache, so its row has no weights prediction.
    pub predicted_weight_bytes: Option<usize>,
    pub measured_weight_bytes: usize,
    /// The strategy listed earlier whose program this row's is (same assignment, batch and
    /// micro-batches): measured once, its figures shared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub same_program_as: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct DeviceSetSummary {
    pub devices: String,
    pub batch: usize,
    /// Spearman rank correlation of predicted and measured tokens/s over the strategies.
    pub spearman_tg: f64,
    pub spearman_pp: f64,
    /// Median |predicted - measured| / measured.
    pub median_error_tg: f64,
    pub median_error_pp: f64,
    /// The level of the predictions: the median of predicted / measured over the strategies
    /// (above 1: the cost model's figures faster than this run's; a calibration and the
    /// measurements minutes later see a shared host differently).
    pub level_tg: f64,
    pub level_pp: f64,
    /// Median |predicted / level - measured| / measured: the error with the level taken out,
    /// what is left of the model's shape (how the strategies compare), not the check's figure.
    pub shape_error_tg: f64,
    pub shape_error_pp: f64,
    /// The median |error| had each calibration predicted alone (in the order they were
    /// taken; the first is what one calibration before the measurements gives).
    pub median_error_by_calibration_tg: Vec<f64>,
    pub median_error_by_calibration_pp: Vec<f64>,
    /// auto's measured decode speed over the best measured strategy's.
    pub auto_vs_best_tg: f64,
    pub auto_vs_best_pp: f64,
    /// auto's measured decode and prompt speeds are each within 5% of the best measured.
    pub auto_within_5pct: bool,
    /// The best measured strategy's time for the whole workload (every prompt, then the
    /// decode steps) over auto's: what auto's one program for both phases is chosen by, where
    /// a strategy faster in one phase (a layer split's prompts) can be slower overall.
    pub auto_vs_best_workload: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct StrategiesReport {
    pub model: String,
    /// One workload per batch size.
    pub workloads: Vec<Workload>,
    pub rows: Vec<StrategyRow>,
    pub summaries: Vec<DeviceSetSummary>,
    /// The profiles each device set was predicted with, in the order they were calibrated:
    /// the figures a calibration measures on real steps, which move from run to run on a
    /// shared host.
    pub profiles: Vec<ProfileFigures>,
}

/// Figures of a profile a device set was predicted with.
#[derive(Clone, Debug, Serialize)]
pub struct ProfileFigures {
    pub devices: String,
    /// Which of the device set's calibrations (1: the one before anything was loaded, which
    /// auto was searched with; a `--profile` is 1).
    pub calibration: usize,
    /// The first device's per-node overhead (seconds).
    pub node_overhead_s: f64,
    /// `Cluster::alone_speedup_by_m`, `Cluster::step_factor_by_m` and
    /// `Cluster::step_factor_apart_by_m`.
    pub alone_speedup_by_m: Vec<(usize, f64)>,
    pub step_factor_by_m: Vec<(usize, f64)>,
    pub step_factor_apart_by_m: Vec<(usize, f64)>,
    /// `Cluster::pipeline_factor` (absent on one device).
    pub pipeline_factor: Option<f64>,
    /// The first device's GEMV weight bandwidth by type (bytes/s): what a one-sequence
    /// decoding step's prediction is made of, almost alone.
    pub gemv_bw: std::collections::BTreeMap<String, f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Ranks (1-based, ties averaged).
fn ranks(v: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[a].total_cmp(&v[b]));
    let mut r = vec![0.0; v.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && v[idx[j + 1]] == v[idx[i]] {
            j += 1;
        }
        let avg = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            r[k] = avg;
        }
        i = j + 1;
    }
    r
}

/// Spearman's rank correlation: Pearson's correlation of the ranks.
pub fn spearman(a: &[f64], b: &[f64]) -> f64 {
    let (ra, rb) = (ranks(a), ranks(b));
    let n = ra.len() as f64;
    if n < 2.0 {
        return 1.0;
    }
    let (ma, mb) = (ra.iter().sum::<f64>() / n, rb.iter().sum::<f64>() / n);
    let cov: f64 = ra.iter().zip(&rb).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = ra.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = rb.iter().map(|y| (y - mb).powi(2)).sum();
    if va == 0.0 || vb == 0.0 {
        return 0.0;
    }
    cov / (va * vb).sqrt()
}

/// A model loaded on a device set: a tensor split's assignment, or the layer split.
struct Loaded {
    key: String,
    set: metashard::DeviceSet,
    m: metashard::models::loader::DecoderModel,
    weights: usize,
    /// `decode_traffic`'s (bytes moved, weight bytes moved) of a decode step.
    traffic: (usize, usize),
}

/// The planner's figures for one strategy at one batch size.
#[derive(Clone, Copy, Debug)]
struct Predicted {
    pp_tps: f64,
    tg_tps: f64,
    tg_total_tps: f64,
    pp_micro: usize,
    tg_micro: usize,
    weights: Option<usize>,
}

/// One row to measure: a strategy at a batch size on a loaded model.
struct Candidate {
    strategy: String,
    assignment: String,
    batch: usize,
    loaded: usize,
    /// What it runs and for which workload, to predict it again under a later calibration.
    layout: Layout,
    workload: Workload,
    /// The prediction under the first calibration: its micro-batch counts are the program
    /// run.
    predicted: Predicted,
    /// Its predictions under every calibration of the device set, the first included.
    predictions: Vec<Predicted>,
}

/// The prompt step the planner prices (`Workload::prefill_step`): a chunk of at most this
/// many tokens of each of the batch's sequences.
const PLANNER_CHUNK: usize = Workload::CHUNK;

/// The tensor split `split`'s prediction for `w`.
fn predict_tensor(
    shape: &ModelShape,
    split: &DecoderSplit,
    cluster: &Cluster,
    w: &Workload,
) -> Result<Predicted> {
    let e: Evaluation = evaluate_split(shape, split, cluster, w)?;
    Ok(Predicted {
        pp_tps: e.prefill_tps(),
        tg_tps: e.decode_tps(),
        tg_total_tps: e.decode_tps_total(),
        pp_micro: 1,
        tg_micro: 1,
        weights: e.memory.iter().map(|m| m.weights).max(),
    })
}

/// The layer split's prediction for `w` (`planner/layer.rs`), or the hybrid split's in
/// `groups` groups, with the micro-batch counts the planner takes; a batched prompt step is
/// cut into at most its sequences (as `BatchSession::micro_batches` cuts it), so where the
/// planner's best count is more, the prompt is priced at one micro-batch per sequence.
/// With `fixed` (micro-batches of a prompt step, of a decode step) those counts are priced
/// instead: the program a first prediction chose, predicted again under another calibration.
fn predict_staged(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    groups: Option<usize>,
    fixed: Option<(usize, usize)>,
) -> Result<Predicted> {
    let cost = |micro: MicroBatches| -> Result<LayerSplitCost> {
        match groups {
            None => evaluate_layer_split_with(shape, cluster, w, None, micro),
            Some(g) => evaluate_hybrid_split_with(shape, cluster, w, g, None, micro),
        }
    };
    let (pp_cost, tg_cost) = match fixed {
        Some((pp, tg)) => (
            cost(MicroBatches::Fixed(pp))?,
            cost(MicroBatches::Fixed(tg))?,
        ),
        None => {
            let best = cost(MicroBatches::Best)?;
            let pp_cost = if w.batch > 1 && best.prefill_micro_batches > w.batch {
                cost(MicroBatches::Fixed(w.batch))?
            } else {
                best.clone()
            };
            (pp_cost, best)
        }
    };
    let rows = (w.prefill.min(PLANNER_CHUNK) * w.batch).min(w.context);
    Ok(Predicted {
        pp_tps: rows as f64 / pp_cost.prefill_s.max(1e-12),
        tg_tps: 1.0 / tg_cost.decode_s.max(1e-12),
        tg_total_tps: w.batch as f64 / tg_cost.decode_s.max(1e-12),
        pp_micro: pp_cost.prefill_micro_batches,
        tg_micro: tg_cost.decode_micro_batches,
        weights: None,
    })
}

/// `c`'s prediction under `cluster` (a later calibration of its device set), for the
/// program measured: a staged split keeps the micro-batch counts of its first prediction.
fn predict_again(shape: &ModelShape, cluster: &Cluster, c: &Candidate) -> Result<Predicted> {
    let w = &c.workload;
    let fixed = Some((c.predicted.pp_micro, c.predicted.tg_micro));
    match &c.layout {
        Layout::Tensor(s) => predict_tensor(shape, s, cluster, w),
        Layout::Layer => predict_staged(shape, cluster, w, None, fixed),
        Layout::Hybrid(g) => predict_staged(shape, cluster, w, Some(*g), fixed),
    }
}

/// The repetitions (0-based) after which a device set is calibrated again: `extra`
/// calibrations spread evenly over `reps` repetitions, the last after the last one (several
/// after one repetition where there are more calibrations than repetitions).
fn calibrate_after(reps: usize, extra: usize) -> Vec<usize> {
    (1..=extra)
        .map(|i| (i * reps.max(1)).div_ceil(extra) - 1)
        .collect()
}

/// The workload's predicted seconds at these speeds: every sequence's prompt, then the
/// decode steps.
fn workload_s(p: &Predicted, w: &Workload) -> f64 {
    (w.prefill * w.batch) as f64 / p.pp_tps.max(1e-12) + w.decode as f64 / p.tg_tps.max(1e-12)
}

/// What `auto` runs on the device set: the search's tensor split, or the layer split or (on
/// 4 or more devices, an even count) the hybrid split in [`HYBRID_GROUPS`] groups, whichever
/// the planner predicts fastest for the workload, the tensor split kept unless another is
/// faster by more than [`SAME_TIME`] (as the search over layouts weighs it;
/// `planner/layouts.rs`).
fn auto_layout(
    shape: &ModelShape,
    cluster: &Cluster,
    w: &Workload,
    n_devices: usize,
) -> Result<Layout> {
    let tensor = auto(shape, cluster, w, None)?.split;
    if n_devices < 2 {
        return Ok(Layout::Tensor(tensor));
    }
    let t = workload_s(&predict_tensor(shape, &tensor, cluster, w)?, w);
    let mut best = (
        Layout::Layer,
        workload_s(&predict_staged(shape, cluster, w, None, None)?, w),
    );
    if hybrid_applies(n_devices) {
        let h = workload_s(
            &predict_staged(shape, cluster, w, Some(HYBRID_GROUPS), None)?,
            w,
        );
        if h < best.1 {
            best = (Layout::Hybrid(HYBRID_GROUPS), h);
        }
    }
    Ok(if best.1 * (1.0 + SAME_TIME) >= t {
        Layout::Tensor(tensor)
    } else {
        best.0
    })
}

/// Whether a device set of `n` gets a hybrid row: at least two devices in each of the
/// [`HYBRID_GROUPS`] groups, the groups of equal size.
fn hybrid_applies(n: usize) -> bool {
    n >= 2 * HYBRID_GROUPS && n.is_multiple_of(HYBRID_GROUPS)
}

/// One measurement of `c` on `l`: prompt tokens/s (all sequences' prompt tokens over the
/// prompt's seconds) and decode tokens/s per sequence. One sequence's prompt goes through a
/// `Session` whose `ubatch` cuts a chunk into the planner's micro-batches (as `run` does);
/// a batch's prompts go through a `BatchSession` in steps of a chunk of each sequence, its
/// sequences cut into the micro-batches. Decoding is `tg` batched steps of one token of each
/// sequence (`BatchSession::step`, as the engine steps), cut into the decode micro-batches.
fn measure_one(l: &Loaded, c: &Candidate, pp: usize, tg: usize) -> Result<(f64, f64)> {
    let (m, set) = (&l.m, &l.set);
    let n_vocab = m.cfg.n_vocab as u32;
    let s_n = c.batch;
    let ctx = pp + tg + 2;
    let prompts: Vec<Vec<u32>> = (0..s_n as u32)
        .map(|s| {
            (0..pp as u32)
                .map(|i| (i * 131 + s * 7919 + 17) % n_vocab)
                .collect()
        })
        .collect();
    let mut pp_secs = None;
    if s_n == 1 {
        let mut s = Session::new(m, set.backend.clone(), set.buffer_type.as_ref(), ctx)?;
        if c.predicted.pp_micro > 1 {
            s.ubatch = pp.min(PLANNER_CHUNK).div_ceil(c.predicted.pp_micro);
        }
        let t0 = Instant::now();
        s.eval(&prompts[0], false)?;
        pp_secs = Some(t0.elapsed().as_secs_f64());
    }
    let mut b = BatchSession::new(m, set.backend.clone(), set.buffer_type.as_ref(), s_n, ctx)?;
    let slots: Vec<usize> = (0..s_n)
        .map(|_| {
            b.acquire()
                .expect("a fresh session has a free slot per sequence")
        })
        .collect();
    b.micro_batches = c.predicted.pp_micro.min(s_n);
    let t0 = Instant::now();
    let mut logits = Vec::new();
    for start in (0..pp).step_by(PLANNER_CHUNK) {
        let end = (start + PLANNER_CHUNK).min(pp);
        let seqs: Vec<SeqInput> = slots
            .iter()
            .zip(&prompts)
            .map(|(&slot, p)| SeqInput {
                slot,
                tokens: &p[start..end],
                logits: end == pp,
            })
            .collect();
        logits = b.step(&seqs)?;
    }
    let pp_secs = pp_secs.unwrap_or_else(|| t0.elapsed().as_secs_f64());
    b.micro_batches = c.predicted.tg_micro.min(s_n);
    let mut next: Vec<[u32; 1]> = logits
        .iter()
        .map(|l| [l.as_deref().map_or(1, metashard::models::sampler::argmax)])
        .collect();
    let t0 = Instant::now();
    for i in 0..tg {
        let seqs: Vec<SeqInput> = slots
            .iter()
            .zip(&next)
            .map(|(&slot, t)| SeqInput {
                slot,
                tokens: t,
                logits: true,
            })
            .collect();
        let out = b.step(&seqs)?;
        for (t, l) in next.iter_mut().zip(&out) {
            let a = l.as_deref().map_or(1, metashard::models::sampler::argmax);
            t[0] = (a + i as u32) % n_vocab;
        }
    }
    let tg_secs = t0.elapsed().as_secs_f64();
    Ok((
        (pp * s_n) as f64 / pp_secs.max(1e-12),
        tg as f64 / tg_secs.max(1e-12),
    ))
}

pub fn measure(opts: &StrategiesBenchOptions, progress: &dyn Fn(&str)) -> Result<StrategiesReport> {
    let shape = ModelShape::resolve(&opts.model)?;
    // The prompt, the steps and the warm-up token must fit the model's context, checked
    // without overflow before anything is calibrated or loaded.
    let context = opts
        .pp
        .checked_add(opts.tg)
        .and_then(|n| n.checked_add(2))
        .filter(|&n| opts.pp > 0 && n <= shape.context_length)
        .ok_or_else(|| {
            metashard::Error::invalid_argument(
                "--pp + --tg",
                format!("{} + {}", opts.pp, opts.tg),
                format!(
                    "the prompt (at least 1 token), the steps and 2 more must fit the model's \
                     context of {} tokens",
                    shape.context_length
                ),
            )
        })?;
    if !(1..=MAX_CALIBRATIONS).contains(&opts.calibrations) {
        return Err(metashard::Error::invalid_argument(
            "--calibrations",
            opts.calibrations,
            format!("calibrations of each device set, 1..={MAX_CALIBRATIONS}"),
        ));
    }
    if opts.batch.is_empty() || opts.batch.iter().any(|&b| b == 0 || b > MAX_SLOTS) {
        return Err(metashard::Error::invalid_argument(
            "--batch",
            format!("{:?}", opts.batch),
            format!("sequences decoded together, each in 1..={MAX_SLOTS}"),
        ));
    }
    // The planner caps a prompt step at the context (`Workload::prefill_step`); the run's
    // `BatchSession` steps hold a chunk of every sequence at once, so the workload's context
    // holds them: the predicted step is the measured one (same rows per product).
    let workloads: Vec<Workload> = opts
        .batch
        .iter()
        .map(|&batch| Workload {
            prefill: opts.pp,
            decode: opts.tg,
            batch,
            context: context.max(opts.pp.min(PLANNER_CHUNK).saturating_mul(batch)),
        })
        .collect();
    for w in &workloads {
        w.validate()?;
    }
    // Every profile is read and checked against its device set before anything is measured.
    if opts.profiles.len() > opts.devices.len() {
        return Err(metashard::Error::invalid_argument(
            "--profile",
            opts.profiles.len(),
            format!("profiles for {} device sets", opts.devices.len()),
        ));
    }
    let mut profiles = Vec::with_capacity(opts.profiles.len());
    for (p, spec) in opts.profiles.iter().zip(&opts.devices) {
        let cluster = Cluster::load(p)?;
        check_profile(&cluster, spec)?;
        profiles.push(cluster);
    }
    // Checked before any device set is calibrated: a bad name fails at once.
    let (keep, keep_layer, keep_hybrid) = chosen_strategies(&shape, &opts.strategies)?;
    let mut rows = Vec::new();
    let mut summaries = Vec::new();
    let mut figures = Vec::new();
    let co = CalibrateOptions {
        weight_types: metashard::calibrate::types_of(&shape)?,
        ..if opts.full_calibration {
            CalibrateOptions::default()
        } else {
            CalibrateOptions::quick()
        }
    };
    let calibrate_set = |spec: &str, k: usize, figures: &mut Vec<ProfileFigures>| {
        progress(&format!(
            "calibrating {spec} ({k} of {})",
            opts.calibrations
        ));
        let c = calibrate(spec, &co, &|what, _| progress(&format!("  {what}")))?;
        check_profile(&c, spec)?;
        figures.push(profile_figures(spec, k, &c));
        Ok::<Cluster, metashard::Error>(c)
    };
    for (si, spec) in opts.devices.iter().enumerate() {
        // A profile given is the device set's only one; else the first of its calibrations.
        let (cluster, extra) = match profiles.get(si) {
            Some(c) => {
                check_profile(c, spec)?;
                figures.push(profile_figures(spec, 1, c));
                (c.clone(), 0)
            }
            None => (calibrate_set(spec, 1, &mut figures)?, opts.calibrations - 1),
        };
        let n_devices = metashard::parse_devices(spec)?.len();
        // Every strategy at every batch size: auto is searched per batch; the layer split
        // where there are devices to split over. Models are loaded once per assignment.
        let mut loaded: Vec<Loaded> = Vec::new();
        let mut cands = Vec::new();
        for w in &workloads {
            let mut named: Vec<(String, Layout)> = Vec::new();
            for &st in &keep {
                let layout = match st.split(shape.n_layer(), shape.tied) {
                    Some(s) => Layout::Tensor(s),
                    None => auto_layout(&shape, &cluster, w, n_devices)?,
                };
                named.push((st.name().to_string(), layout));
            }
            if n_devices > 1 && keep_layer {
                named.push(("layer".to_string(), Layout::Layer));
            }
            if hybrid_applies(n_devices) && keep_hybrid {
                named.push(("hybrid".to_string(), Layout::Hybrid(HYBRID_GROUPS)));
            }
            for (strategy, layout) in named {
                let (key, assignment, predicted) = match &layout {
                    Layout::Tensor(s) => {
                        let d = metashard::planner::strategy::describe(s);
                        (d.clone(), d, predict_tensor(&shape, s, &cluster, w)?)
                    }
                    Layout::Layer => (
                        "layer".to_string(),
                        match strategy.as_str() {
                            "auto" => "whole layers per device (--split-mode layer): predicted \
                                       faster than the tensor split"
                                .to_string(),
                            _ => "whole layers per device (--split-mode layer)".to_string(),
                        },
                        predict_staged(&shape, &cluster, w, None, None)?,
                    ),
                    Layout::Hybrid(g) => (
                        format!("hybrid {g}"),
                        format!(
                            "{g} groups of {} devices, megatron inside, whole layers per group \
                             (--split-mode hybrid --groups {g}){}",
                            n_devices / g,
                            match strategy.as_str() {
                                "auto" => ": predicted faster than the tensor split",
                                _ => "",
                            }
                        ),
                        predict_staged(&shape, &cluster, w, Some(*g), None)?,
                    ),
                };
                let li = match loaded.iter().position(|l| l.key == key) {
                    Some(i) => i,
                    None => {
                        progress(&format!("loading {} on {spec} ({strategy})", opts.model));
                        let tensor = matches!(layout, Layout::Tensor(_));
                        let (set, m) = load_with(&opts.model, spec, layout.clone())?;
                        let weights = set
                            .bytes_per_device(&[&m.weight_buffer])
                            .into_iter()
                            .max()
                            .unwrap_or(0);
                        let traffic = if tensor {
                            decode_traffic(&m, &set, context)?
                        } else {
                            (0, 0)
                        };
                        loaded.push(Loaded {
                            key,
                            set,
                            m,
                            weights,
                            traffic,
                        });
                        loaded.len() - 1
                    }
                };
                cands.push(Candidate {
                    strategy,
                    assignment,
                    batch: w.batch,
                    loaded: li,
                    layout,
                    workload: *w,
                    predicted,
                    predictions: vec![predicted],
                });
            }
        }
        // Candidates that run one program (one loaded assignment, batch and micro-batch
        // counts: `memory` where it assigns as `megatron` does, auto and the strategy it
        // picked) are measured once per repetition and share the figures; measured apart,
        // identical runs differed by up to 20% on a shared host and decided which "won".
        let program: Vec<usize> = cands
            .iter()
            .enumerate()
            .map(|(i, c)| {
                cands[..i]
                    .iter()
                    .position(|o| {
                        (
                            o.loaded,
                            o.batch,
                            o.predicted.pp_micro,
                            o.predicted.tg_micro,
                        ) == (
                            c.loaded,
                            c.batch,
                            c.predicted.pp_micro,
                            c.predicted.tg_micro,
                        )
                    })
                    .unwrap_or(i)
            })
            .collect();
        // Warm up (plans for every shape), then interleave the repetitions.
        for (i, c) in cands.iter().enumerate() {
            if program[i] == i {
                measure_one(&loaded[c.loaded], c, opts.pp, 2)?;
            }
        }
        let mut measured: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); cands.len()];
        let again = calibrate_after(opts.reps, extra);
        let mut k = 1;
        for r in 0..opts.reps.max(1) {
            for (i, c) in cands.iter().enumerate() {
                let (pp, tg) = if program[i] == i {
                    measure_one(&loaded[c.loaded], c, opts.pp, opts.tg)?
                } else {
                    let (pps, tgs) = &measured[program[i]];
                    (pps[r], tgs[r])
                };
                measured[i].0.push(pp);
                measured[i].1.push(tg);
                let same = match program[i] {
                    j if j == i => String::new(),
                    j => format!(" (the run of {})", cands[j].strategy),
                };
                progress(&format!(
                    "{spec} batch {} {}: rep {} pp {pp:.1} t/s, tg {tg:.1} t/s per sequence \
                     ({:.1} in all){same}",
                    c.batch,
                    c.strategy,
                    r + 1,
                    tg * c.batch as f64
                ));
            }
            // The later calibrations, between the repetitions, so that the predictions and
            // the measurements sample the same stretch of the host's time.
            for _ in again.iter().filter(|&&a| a == r) {
                k += 1;
                let later = calibrate_set(spec, k, &mut figures)?;
                for c in cands.iter_mut() {
                    let p = predict_again(&shape, &later, c)?;
                    c.predictions.push(p);
                }
            }
        }
        for w in &workloads {
            let mut set_rows = Vec::new();
            for (i, (c, (pps, tgs))) in cands.iter().zip(&measured).enumerate() {
                if c.batch != w.batch {
                    continue;
                }
                // The median prediction over the calibrations (each a whole profile's).
                let over = |f: fn(&Predicted) -> f64| {
                    let v: Vec<f64> = c.predictions.iter().map(f).collect();
                    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
                    let hi = v.iter().copied().fold(0.0, f64::max);
                    (median(v), (lo, hi))
                };
                let (pp_pred, pp_range) = over(|p| p.pp_tps);
                let (tg_pred, tg_range) = over(|p| p.tg_tps);
                let (tg_total_pred, _) = over(|p| p.tg_total_tps);
                let p = c.predicted;
                let tg = median(tgs.clone());
                let lo = tgs.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = tgs.iter().copied().fold(0.0, f64::max);
                let (comm, moved) = loaded[c.loaded].traffic;
                set_rows.push(StrategyRow {
                    devices: spec.clone(),
                    strategy: c.strategy.clone(),
                    assignment: c.assignment.clone(),
                    batch: c.batch,
                    pp_micro_batches: p.pp_micro,
                    tg_micro_batches: p.tg_micro,
                    predicted_pp_tps: pp_pred,
                    measured_pp_tps: median(pps.clone()),
                    predicted_tg_tps: tg_pred,
                    measured_tg_tps: tg,
                    predicted_tg_total_tps: tg_total_pred,
                    measured_tg_total_tps: tg * c.batch as f64,
                    measured_tg_range: (lo, hi),
                    predicted_pp_range: pp_range,
                    predicted_tg_range: tg_range,
                    predicted_by_calibration: c
                        .predictions
                        .iter()
                        .map(|p| (p.pp_tps, p.tg_tps))
                        .collect(),
                    step_comm_bytes: comm,
                    step_weight_bytes_moved: moved,
                    predicted_weight_bytes: p.weights,
                    measured_weight_bytes: loaded[c.loaded].weights,
                    same_program_as: (program[i] != i).then(|| cands[program[i]].strategy.clone()),
                });
            }
            summaries.push(summarize(spec, w, &set_rows));
            rows.extend(set_rows);
        }
    }
    Ok(StrategiesReport {
        model: shape.name.clone(),
        workloads,
        rows,
        summaries,
        profiles: figures,
    })
}

/// The figures of `cluster`, the `k`-th profile of device set `spec`, the report keeps.
fn profile_figures(spec: &str, k: usize, cluster: &Cluster) -> ProfileFigures {
    ProfileFigures {
        devices: spec.to_string(),
        calibration: k,
        node_overhead_s: cluster.devices.first().map_or(0.0, |d| d.node_overhead_s),
        alone_speedup_by_m: cluster.alone_speedup_by_m.clone(),
        step_factor_by_m: cluster.step_factor_by_m.clone(),
        step_factor_apart_by_m: cluster.step_factor_apart_by_m.clone(),
        pipeline_factor: cluster.pipeline_factor,
        gemv_bw: cluster
            .devices
            .first()
            .map(|d| d.gemv_bw.clone())
            .unwrap_or_default(),
    }
}

/// Bytes one decode step (a token after the warm-up's) moves between devices on a meta device,
/// from the meta backend's sharding of that step's graph: every communicating conversion, and
/// those whose tensor is a weight (a leaf named `*.weight`, or a view of one). (0, 0) on one
/// device.
fn decode_traffic(
    m: &metashard::models::loader::DecoderModel,
    set: &metashard::DeviceSet,
    context: usize,
) -> Result<(usize, usize)> {
    use metashard::models::decoder::{SequenceStep, build_step};
    let Some(meta) = &set.meta else {
        return Ok((0, 0));
    };
    let s = Session::new(m, set.backend.clone(), set.buffer_type.as_ref(), context)?;
    let step = SequenceStep::new(&[1], 1, s.capacity());
    let sg = build_step(&m.cfg, &m.weights, &s.cache(), &step.input(0..1))?;
    let g = &sg.graph;
    let sharding = meta.meta_backend()?.sharding(g)?;
    let moved = |c: &metashard::meta::sharding::Conversion| {
        let root = g.node(c.source).view_src.unwrap_or(c.source);
        let n = g.node(root);
        n.is_leaf() && n.name.ends_with(".weight")
    };
    let comm: Vec<_> = sharding
        .conversions
        .iter()
        .filter(|c| c.kind.communicates())
        .collect();
    Ok((
        comm.iter().map(|c| c.bytes).sum(),
        comm.iter().filter(|c| moved(c)).map(|c| c.bytes).sum(),
    ))
}

/// The tensor strategies `names` keeps (all that apply to the model when empty), and whether
/// it keeps the layer split (`layer`) and the hybrid split (`hybrid`, on device sets of 4 or
/// more); a name that is none of these is an error naming `--strategies`.
fn chosen_strategies(shape: &ModelShape, names: &[String]) -> Result<(Vec<Strategy>, bool, bool)> {
    let all = Strategy::for_model(shape.cfg.moe.is_some());
    if names.is_empty() {
        return Ok((all, true, true));
    }
    let (mut keep, mut layer, mut hybrid) = (Vec::new(), false, false);
    for name in names {
        match name.as_str() {
            "layer" => layer = true,
            "hybrid" => hybrid = true,
            _ => {
                let st = Strategy::parse(name)?;
                if !all.contains(&st) {
                    return Err(metashard::Error::invalid_argument(
                        "--strategies",
                        name,
                        "a strategy of this model (expert-parallel needs a mixture of experts)",
                    ));
                }
                keep.push(st);
            }
        }
    }
    Ok((keep, layer, hybrid))
}

/// A profile of as many devices as `spec` has, else an error naming `--profile`.
fn check_profile(cluster: &Cluster, spec: &str) -> Result<()> {
    if cluster.n_devices() != metashard::parse_devices(spec)?.len() {
        return Err(metashard::Error::invalid_argument(
            "--profile",
            &cluster.name,
            format!("a profile of {} devices for `{spec}`", cluster.n_devices()),
        ));
    }
    Ok(())
}

/// What a row runs: a tensor split's per-layer assignment, the layer split, or the hybrid
/// split in so many groups.
#[derive(Clone)]
enum Layout {
    Tensor(DecoderSplit),
    Layer,
    Hybrid(usize),
}

/// Groups of the hybrid row (`run --split-mode hybrid`'s default), measured on device sets of
/// at least two devices per group.
const HYBRID_GROUPS: usize = 2;

/// Open the model on `spec` with `layout`: an explicit per-layer assignment (`--split-mode
/// tensor`), or even shares of whole layers per device or per group (`run --split-mode layer`
/// or `hybrid`).
fn load_with(
    model: &str,
    spec: &str,
    layout: Layout,
) -> Result<(
    metashard::DeviceSet,
    metashard::models::loader::DecoderModel,
)> {
    if metashard::parse_devices(spec)?.len() == 1 {
        return load(model, spec, Precision::Exact, &SplitArgs::default(), true);
    }
    let (split, split_mode, groups) = match layout {
        Layout::Tensor(s) => (Some(s), SplitMode::Tensor, None),
        Layout::Layer => (None, SplitMode::Layer, None),
        Layout::Hybrid(g) => (None, SplitMode::Hybrid, Some(g)),
    };
    let opts = metashard::runtime::OpenOptions {
        split,
        split_mode,
        groups,
        ..Default::default()
    };
    metashard::runtime::open_decoder(model, spec, &opts, &|_, _| {})
}

/// The median of `predicted / measured` over the rows (the predictions' level) and the median
/// |error| of the predictions divided by it (their shape); (1, 0) without rows.
fn level_and_shape(predicted: &[f64], measured: &[f64]) -> (f64, f64) {
    if predicted.is_empty() {
        return (1.0, 0.0);
    }
    let ratio: Vec<f64> = predicted
        .iter()
        .zip(measured)
        .map(|(p, m)| p / m.max(1e-12))
        .collect();
    let level = median(ratio.clone());
    let shape = median(
        ratio
            .iter()
            .map(|r| (r / level.max(1e-12) - 1.0).abs())
            .collect(),
    );
    (level, shape)
}

fn summarize(spec: &str, w: &Workload, rows: &[StrategyRow]) -> DeviceSetSummary {
    let batch = w.batch;
    let col = |f: &dyn Fn(&StrategyRow) -> f64| rows.iter().map(f).collect::<Vec<f64>>();
    let (ptg, mtg) = (col(&|r| r.predicted_tg_tps), col(&|r| r.measured_tg_tps));
    let (ppp, mpp) = (col(&|r| r.predicted_pp_tps), col(&|r| r.measured_pp_tps));
    let err = |p: &[f64], m: &[f64]| {
        median(
            p.iter()
                .zip(m)
                .map(|(p, m)| (p - m).abs() / m.max(1e-12))
                .collect(),
        )
    };
    // The calibrations every row was predicted under (all of them, as `measure` predicts).
    let k = rows
        .iter()
        .map(|r| r.predicted_by_calibration.len())
        .min()
        .unwrap_or(0);
    let by_calibration = |f: fn(&(f64, f64)) -> f64, m: &[f64]| -> Vec<f64> {
        (0..k)
            .map(|i| {
                let p: Vec<f64> = rows
                    .iter()
                    .map(|r| f(&r.predicted_by_calibration[i]))
                    .collect();
                err(&p, m)
            })
            .collect()
    };
    let median_error_by_calibration_tg = by_calibration(|p| p.1, &mtg);
    let median_error_by_calibration_pp = by_calibration(|p| p.0, &mpp);
    let (level_tg, shape_error_tg) = level_and_shape(&ptg, &mtg);
    let (level_pp, shape_error_pp) = level_and_shape(&ppp, &mpp);
    let auto = rows.iter().find(|r| r.strategy == "auto");
    let best_tg = mtg.iter().copied().fold(0.0, f64::max);
    let best_pp = mpp.iter().copied().fold(0.0, f64::max);
    let auto_vs_best_tg = auto.map_or(0.0, |a| a.measured_tg_tps / best_tg.max(1e-12));
    let auto_vs_best_pp = auto.map_or(0.0, |a| a.measured_pp_tps / best_pp.max(1e-12));
    // The workload's measured seconds: every sequence's prompt, then the decode steps (what
    // auto minimizes with one program for both).
    let secs = |r: &StrategyRow| {
        (w.prefill * w.batch) as f64 / r.measured_pp_tps.max(1e-12)
            + w.decode as f64 / r.measured_tg_tps.max(1e-12)
    };
    let best_s = rows.iter().map(secs).fold(f64::INFINITY, f64::min);
    let auto_vs_best_workload = auto.map_or(0.0, |a| best_s / secs(a).max(1e-12));
    DeviceSetSummary {
        devices: spec.to_string(),
        batch,
        spearman_tg: spearman(&ptg, &mtg),
        spearman_pp: spearman(&ppp, &mpp),
        median_error_tg: err(&ptg, &mtg),
        median_error_pp: err(&ppp, &mpp),
        level_tg,
        level_pp,
        shape_error_tg,
        shape_error_pp,
        median_error_by_calibration_tg,
        median_error_by_calibration_pp,
        auto_vs_best_tg,
        auto_vs_best_pp,
        auto_within_5pct: auto_vs_best_tg >= 0.95 && auto_vs_best_pp >= 0.95,
        auto_vs_best_workload,
    }
}

pub fn print_table(r: &StrategiesReport) {
    let loads: Vec<String> = r.workloads.iter().map(|w| w.to_string()).collect();
    println!(
        "{} — workloads {} (predicted by the planner, measured here; medians; tg per sequence, \
         tg all: every sequence's tokens; m: micro-batches of a prompt step / a decode step)",
        r.model,
        loads.join("; ")
    );
    println!(
        "{:<9} {:>3} {:<17} {:>5} {:>9} {:>9} {:>7} {:>8} {:>8} {:>7} {:>13} {:>8} {:>8} {:>8} \
         {:>8} {:>10} {:>8}",
        "devices",
        "S",
        "strategy",
        "m",
        "pp pred",
        "pp meas",
        "err",
        "tg pred",
        "tg meas",
        "err",
        "tg reps range",
        "all pred",
        "all meas",
        "MiB pred",
        "MiB meas",
        "step comm",
        "w moved"
    );
    for x in &r.rows {
        let e = |p: f64, m: f64| (p - m) / m.max(1e-12) * 100.0;
        let mib = |b: usize| format!("{:.1}", b as f64 / 1048576.0);
        println!(
            "{:<9} {:>3} {:<17} {:>5} {:>9.1} {:>9.1} {:>6.1}% {:>8.1} {:>8.1} {:>6.1}% {:>13} \
             {:>8.1} {:>8.1} {:>8} {:>8} {:>10} {:>8}",
            x.devices,
            x.batch,
            x.strategy,
            format!("{}/{}", x.pp_micro_batches, x.tg_micro_batches),
            x.predicted_pp_tps,
            x.measured_pp_tps,
            e(x.predicted_pp_tps, x.measured_pp_tps),
            x.predicted_tg_tps,
            x.measured_tg_tps,
            e(x.predicted_tg_tps, x.measured_tg_tps),
            format!("{:.1}-{:.1}", x.measured_tg_range.0, x.measured_tg_range.1),
            x.predicted_tg_total_tps,
            x.measured_tg_total_tps,
            x.predicted_weight_bytes.map_or("-".to_string(), mib),
            mib(x.measured_weight_bytes),
            x.step_comm_bytes,
            x.step_weight_bytes_moved
        );
    }
    let shared: Vec<String> = r
        .rows
        .iter()
        .filter_map(|x| {
            let of = x.same_program_as.as_ref()?;
            Some(format!("{} S={} {} = {of}", x.devices, x.batch, x.strategy))
        })
        .collect();
    if !shared.is_empty() {
        println!("one program, measured once: {}", shared.join("; "));
    }
    let points = |p: &[(usize, f64)]| match p {
        [] => "none".to_string(),
        _ => p
            .iter()
            .map(|(m, x)| format!("M={m} {x:.2}"))
            .collect::<Vec<_>>()
            .join(", "),
    };
    for f in &r.profiles {
        println!(
            "{} profile {}: node overhead {:.2} us; step factor {}; apart {}; alone speedup {}",
            f.devices,
            f.calibration,
            f.node_overhead_s * 1e6,
            points(&f.step_factor_by_m),
            points(&f.step_factor_apart_by_m),
            points(&f.alone_speedup_by_m)
        );
    }
    let has_auto = r.rows.iter().any(|x| x.strategy == "auto");
    for s in &r.summaries {
        let k = r.profiles.iter().filter(|f| f.devices == s.devices).count();
        if k > 1 {
            // How far apart the calibrations' predictions of one row were, at most.
            let spread = |range: fn(&StrategyRow) -> (f64, f64)| {
                r.rows
                    .iter()
                    .filter(|x| x.devices == s.devices && x.batch == s.batch)
                    .map(|x| range(x).1 / range(x).0.max(1e-12) - 1.0)
                    .fold(0.0, f64::max)
                    * 100.0
            };
            let pct = |v: &[f64]| {
                v.iter()
                    .map(|e| format!("{:.1}%", e * 100.0))
                    .collect::<Vec<_>>()
                    .join(" / ")
            };
            println!(
                "{} batch {}: predictions are the median of {k} calibrations' (each row's \
                 highest up to {:.1}% / {:.1}% above its lowest, tg / pp); each calibration \
                 alone: median |error| tg {}, pp {}",
                s.devices,
                s.batch,
                spread(|x| x.predicted_tg_range),
                spread(|x| x.predicted_pp_range),
                pct(&s.median_error_by_calibration_tg),
                pct(&s.median_error_by_calibration_pp)
            );
        }
        println!(
            "{} batch {}: predictions at {:.2}x / {:.2}x of the measurements (tg / pp, median); \
             with that level taken out, median |error| tg {:.1}%, pp {:.1}%",
            s.devices,
            s.batch,
            s.level_tg,
            s.level_pp,
            s.shape_error_tg * 100.0,
            s.shape_error_pp * 100.0
        );
        if !has_auto {
            println!(
                "{} batch {}: Spearman tg {:.2}, pp {:.2}; median |error| tg {:.1}%, pp {:.1}% \
                 (auto not run)",
                s.devices,
                s.batch,
                s.spearman_tg,
                s.spearman_pp,
                s.median_error_tg * 100.0,
                s.median_error_pp * 100.0
            );
            continue;
        }
        println!(
            "{} batch {}: Spearman tg {:.2}, pp {:.2}; median |error| tg {:.1}%, pp {:.1}%; \
             auto vs best measured: tg {:.3}x, pp {:.3}x ({}), the whole workload {:.3}x",
            s.devices,
            s.batch,
            s.spearman_tg,
            s.spearman_pp,
            s.median_error_tg * 100.0,
            s.median_error_pp * 100.0,
            s.auto_vs_best_tg,
            s.auto_vs_best_pp,
            if s.auto_within_5pct {
                "within 5%"
            } else {
                "not within 5%"
            },
            s.auto_vs_best_workload
        );
    }
}

/// An SVG scatter of predicted against measured tokens/s (decode and prefill, log scales), with
/// the diagonal.
pub fn svg(r: &StrategiesReport) -> String {
    let pts: Vec<(f64, f64, &str, &str, usize, &str)> = r
        .rows
        .iter()
        .flat_map(|x| {
            [
                (
                    x.measured_tg_tps,
                    x.predicted_tg_tps,
                    "tg",
                    x.strategy.as_str(),
                    x.batch,
                    x.devices.as_str(),
                ),
                (
                    x.measured_pp_tps,
                    x.predicted_pp_tps,
                    "pp",
                    x.strategy.as_str(),
                    x.batch,
                    x.devices.as_str(),
                ),
            ]
        })
        .filter(|p| p.0 > 0.0 && p.1 > 0.0)
        .collect();
    let lo = pts
        .iter()
        .map(|p| p.0.min(p.1))
        .fold(f64::INFINITY, f64::min)
        / 1.5;
    let hi = pts.iter().map(|p| p.0.max(p.1)).fold(0.0, f64::max) * 1.5;
    let (w, h, m) = (640.0, 640.0, 60.0);
    let sx = |v: f64| m + (v.ln() - lo.ln()) / (hi.ln() - lo.ln()) * (w - 2.0 * m);
    let sy = |v: f64| h - m - (v.ln() - lo.ln()) / (hi.ln() - lo.ln()) * (h - 2.0 * m);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#999\" stroke-dasharray=\"4 4\"/>\n\
         <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">measured tokens/s (log)</text>\n\
         <text x=\"16\" y=\"{:.1}\" transform=\"rotate(-90 16 {:.1})\" text-anchor=\"middle\">predicted tokens/s (log)</text>\n\
         <text x=\"{:.1}\" y=\"24\" text-anchor=\"middle\" font-size=\"13\">{}: predicted vs measured ({})</text>\n",
        sx(lo),
        sy(lo),
        sx(hi),
        sy(hi),
        w / 2.0,
        h - 20.0,
        h / 2.0,
        h / 2.0,
        w / 2.0,
        r.model,
        r.workloads
            .iter()
            .map(|w| w.to_string())
            .collect::<Vec<_>>()
            .join("; ")
    );
    for (meas, pred, kind, strat, batch, dev) in pts {
        let color = if kind == "tg" { "#1f77b4" } else { "#d62728" };
        s += &format!(
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"{color}\"><title>{dev} batch {batch} {strat} {kind}: measured {meas:.1}, predicted {pred:.1}</title></circle>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" fill=\"{color}\">{strat} ({dev}, S={batch})</text>\n",
            sx(meas),
            sy(pred),
            sx(meas) + 6.0,
            sy(pred) - 4.0
        );
    }
    s += "<text x=\"80\" y=\"50\" fill=\"#1f77b4\">decode (tg)</text>\n<text x=\"80\" y=\"64\" fill=\"#d62728\">prefill (pp)</text>\n</svg>\n";
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_calibrations_spread_over_the_repetitions() {
        // Two more over five repetitions: after the third and after the last.
        assert_eq!(calibrate_after(5, 2), vec![2, 4]);
        assert_eq!(calibrate_after(5, 1), vec![4]);
        assert_eq!(calibrate_after(3, 0), Vec::<usize>::new());
        // More calibrations than repetitions: several after one, every one counted.
        assert_eq!(calibrate_after(1, 3), vec![0, 0, 0]);
        assert_eq!(calibrate_after(2, 3), vec![0, 1, 1]);
    }

    #[test]
    fn spearman_of_known_orders() {
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0], &[10.0, 20.0, 30.0, 40.0]) - 1.0).abs() < 1e-12);
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0], &[4.0, 3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
        // One swap in five: 1 - 6 * 2 / (5 * 24) = 0.9.
        let s = spearman(&[1.0, 2.0, 3.0, 4.0, 5.0], &[1.0, 3.0, 2.0, 4.0, 5.0]);
        assert!((s - 0.9).abs() < 1e-12, "{s}");
        assert_eq!(ranks(&[5.0, 1.0, 5.0]), vec![2.5, 1.0, 2.5]);
    }

    #[test]
    fn the_level_of_the_predictions_is_told_apart_from_their_shape() {
        // Every prediction 30% above its measurement: a 30% error, all of it level.
        let m = [100.0, 80.0, 50.0, 20.0];
        let p: Vec<f64> = m.iter().map(|x| x * 1.3).collect();
        let (level, shape) = level_and_shape(&p, &m);
        assert!(
            (level - 1.3).abs() < 1e-12 && shape < 1e-12,
            "{level} {shape}"
        );
        // One of four off by another 2x: both medians pass over it (level 1.3, shape 0).
        let mut p2 = p.clone();
        p2[3] *= 2.0;
        let (level2, shape2) = level_and_shape(&p2, &m);
        assert!((level2 - 1.3).abs() < 1e-12, "{level2}");
        assert!(
            shape2 < 1e-12,
            "{shape2}: the median ignores one outlier of four"
        );
        p2[2] *= 0.5;
        let (level3, shape3) = level_and_shape(&p2, &m);
        // Ratios 1.3, 1.3, 0.65, 2.6: median 1.3, |r / 1.3 - 1| = 0, 0, 0.5, 1: median 0.25.
        assert!(
            (level3 - 1.3).abs() < 1e-12 && (shape3 - 0.25).abs() < 1e-12,
            "{shape3}"
        );
        assert_eq!(level_and_shape(&[], &[]), (1.0, 0.0));
    }

    /// auto measured behind a layer split's prompts but ahead in decoding, and ahead for the
    /// whole workload: 0.8x on prompts, 1.0x on the workload; and the errors under each
    /// calibration alone.
    #[test]
    fn auto_is_held_against_the_best_workload_too() {
        let row = |strategy: &str, pp: f64, tg: f64, pred: Vec<(f64, f64)>| StrategyRow {
            devices: "cpu:3x1".into(),
            strategy: strategy.into(),
            assignment: String::new(),
            batch: 1,
            pp_micro_batches: 1,
            tg_micro_batches: 1,
            predicted_pp_tps: pp,
            measured_pp_tps: pp,
            predicted_tg_tps: tg,
            measured_tg_tps: tg,
            predicted_tg_total_tps: tg,
            measured_tg_total_tps: tg,
            measured_tg_range: (tg, tg),
            predicted_pp_range: (pp, pp),
            predicted_tg_range: (tg, tg),
            predicted_by_calibration: pred,
            step_comm_bytes: 0,
            step_weight_bytes_moved: 0,
            predicted_weight_bytes: None,
            measured_weight_bytes: 0,
            same_program_as: None,
        };
        let w = Workload {
            prefill: 100,
            decode: 100,
            batch: 1,
            context: 256,
        };
        // auto: 100 / 200 + 100 / 50 = 2.5 s; layer: 100 / 250 + 100 / 40 = 2.9 s.
        let rows = [
            row("auto", 200.0, 50.0, vec![(200.0, 50.0), (220.0, 60.0)]),
            row("layer", 250.0, 40.0, vec![(250.0, 40.0), (250.0, 48.0)]),
        ];
        let s = summarize("cpu:3x1", &w, &rows);
        assert!((s.auto_vs_best_pp - 0.8).abs() < 1e-12, "{s:?}");
        assert!(!s.auto_within_5pct);
        assert!((s.auto_vs_best_workload - 1.0).abs() < 1e-12, "{s:?}");
        // The first calibration predicted every row exactly; the second 20% fast in decoding.
        assert_eq!(s.median_error_by_calibration_tg, vec![0.0, 0.2]);
        // The layer split the faster: auto's workload 2.5 s against 100 / 250 + 100 / 60 s.
        let rows = [
            rows[0].clone(),
            row("layer", 250.0, 60.0, vec![(250.0, 60.0)]),
        ];
        let s = summarize("cpu:3x1", &w, &rows);
        // Only the calibration both rows were predicted under is scored.
        assert_eq!(s.median_error_by_calibration_tg, vec![0.0]);
        let best = 100.0 / 250.0 + 100.0 / 60.0;
        assert!(
            (s.auto_vs_best_workload - best / 2.5).abs() < 1e-12,
            "{s:?}"
        );
    }
}
