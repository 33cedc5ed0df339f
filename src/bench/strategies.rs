//! `metashard bench strategies`: every strategy's prediction held against a measurement. For
//! each device set, the devices are calibrated (or a profile is read), every named strategy
//! and the search's choice are costed by the planner for the benchmark's workload, then each
//! is loaded and run (prompt of `pp` tokens, `tg` decode steps, repetitions interleaved over
//! the strategies, medians). The report puts predicted and measured side by side, with the
//! Spearman rank correlation of the strategies' speeds, the median relative error for prefill
//! and decode, and how auto's measured speed compares with the best measured. `--strategies`
//! keeps only the named strategies (two strategies timed side by side in a short quiet run);
//! each row also has the spread of its decode repetitions and the bytes a decode step moves
//! between devices, counted from the meta backend's sharding of that step (weights among them:
//! expert parallelism moves none).

use crate::cli::run::load;
use crate::cli::{JsonArgs, SplitArgs, parse_positive, parse_reps};
use metashard::Result;
use metashard::calibrate::{CalibrateOptions, calibrate};
use metashard::cpu::Precision;
use metashard::models::session::Session;
use metashard::models::split::DecoderSplit;
use metashard::planner::evaluate::{Evaluation, Workload};
use metashard::planner::report::evaluate_split;
use metashard::planner::{Cluster, ModelShape, Strategy, auto};
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
    /// Only these strategies (comma-separated names, e.g. `megatron,expert-parallel`); all
    /// that apply to the model by default.
    #[arg(long, value_delimiter = ',')]
    pub strategies: Vec<String>,
    /// A full calibration of each device set instead of a quick one.
    #[arg(long)]
    pub full_calibration: bool,
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
        strategies: a.strategies.clone(),
        full_calibration: a.full_calibration,
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
    /// Only these strategies (by name); empty: every one that applies to the model.
    pub strategies: Vec<String>,
    /// A full calibration instead of a quick one.
    pub full_calibration: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct StrategyRow {
    pub devices: String,
    pub strategy: String,
    pub assignment: String,
    pub predicted_pp_tps: f64,
    pub measured_pp_tps: f64,
    pub predicted_tg_tps: f64,
    pub measured_tg_tps: f64,
    /// The slowest and fastest decode repetition (tokens/s): the median's noise.
    pub measured_tg_range: (f64, f64),
    /// Bytes one decode step moves between devices (every communicating conversion of the
    /// meta backend's sharding of that step), and those of them that are weights.
    pub step_comm_bytes: usize,
    pub step_weight_bytes_moved: usize,
    /// Largest device's weights, predicted and measured (bytes).
    pub predicted_weight_bytes: usize,
    pub measured_weight_bytes: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct DeviceSetSummary {
    pub devices: String,
    /// Spearman rank correlation of predicted and measured tokens/s over the strategies.
    pub spearman_tg: f64,
    pub spearman_pp: f64,
    /// Median |predicted - measured| / measured.
    pub median_error_tg: f64,
    pub median_error_pp: f64,
    /// auto's measured decode speed over the best measured strategy's.
    pub auto_vs_best_tg: f64,
    pub auto_vs_best_pp: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct StrategiesReport {
    pub model: String,
    pub workload: Workload,
    pub rows: Vec<StrategyRow>,
    pub summaries: Vec<DeviceSetSummary>,
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

struct Candidate {
    strategy: String,
    split: DecoderSplit,
    predicted: Evaluation,
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
    let workload = Workload {
        prefill: opts.pp,
        decode: opts.tg,
        batch: 1,
        context,
    };
    workload.validate()?;
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
    let mut rows = Vec::new();
    let mut summaries = Vec::new();
    for (si, spec) in opts.devices.iter().enumerate() {
        let cluster: Cluster = match profiles.get(si) {
            Some(c) => c.clone(),
            None => {
                progress(&format!("calibrating {spec}"));
                let co = if opts.full_calibration {
                    CalibrateOptions::default()
                } else {
                    CalibrateOptions::quick()
                };
                calibrate(spec, &co, &|what, _| progress(&format!("  {what}")))?
            }
        };
        check_profile(&cluster, spec)?;
        let mut cands = Vec::new();
        let all = Strategy::for_model(shape.cfg.moe.is_some());
        let mut chosen = Vec::new();
        for name in &opts.strategies {
            let st = Strategy::parse(name)?;
            if !all.contains(&st) {
                return Err(metashard::Error::invalid_argument(
                    "--strategies",
                    name,
                    "a strategy of this model (expert-parallel needs a mixture of experts)",
                ));
            }
            chosen.push(st);
        }
        let keep = if chosen.is_empty() { all } else { chosen };
        for st in keep {
            let split = match st.split(shape.n_layer(), shape.tied) {
                Some(s) => s,
                None => auto(&shape, &cluster, &workload, None)?.split,
            };
            let predicted = evaluate_split(&shape, &split, &cluster, &workload)?;
            cands.push(Candidate {
                strategy: st.name().to_string(),
                split,
                predicted,
            });
        }
        // Load every strategy, then interleave the repetitions.
        let mut loaded = Vec::new();
        for c in &cands {
            progress(&format!(
                "loading {} on {spec} ({})",
                opts.model, c.strategy
            ));
            let (set, m) = load_with(&opts.model, spec, c.split.clone())?;
            let weights = set
                .bytes_per_device(&[&m.weight_buffer])
                .into_iter()
                .max()
                .unwrap_or(0);
            loaded.push((set, m, weights));
        }
        let mut runs = Vec::new();
        let mut traffic = Vec::new();
        for (set, m, _) in &loaded {
            let n_vocab = m.cfg.n_vocab as u32;
            let prompt: Vec<u32> = (0..opts.pp as u32)
                .map(|i| (i * 131 + 17) % n_vocab)
                .collect();
            let mut s = Session::new(
                m,
                set.backend.clone(),
                set.buffer_type.as_ref(),
                workload.context,
            )?;
            // Warm up: plans for both shapes.
            s.eval(&prompt, false)?;
            s.eval(&[1], false)?;
            traffic.push(decode_traffic(m, set, &s)?);
            runs.push((s, prompt, n_vocab, Vec::new(), Vec::new()));
        }
        for r in 0..opts.reps.max(1) {
            for (ci, (s, prompt, n_vocab, pps, tgs)) in runs.iter_mut().enumerate() {
                s.reset();
                let t0 = Instant::now();
                s.eval(prompt, false)?;
                pps.push(opts.pp as f64 / t0.elapsed().as_secs_f64());
                let t0 = Instant::now();
                let mut tok = 1u32;
                for i in 0..opts.tg {
                    let l = s.eval(&[tok], false)?;
                    tok = (metashard::models::sampler::argmax(&l) + i as u32) % *n_vocab;
                }
                tgs.push(opts.tg as f64 / t0.elapsed().as_secs_f64());
                progress(&format!(
                    "{spec} {}: rep {} pp {:.1} t/s, tg {:.1} t/s",
                    cands[ci].strategy,
                    r + 1,
                    pps[r],
                    tgs[r]
                ));
            }
        }
        let measured: Vec<(Vec<f64>, Vec<f64>)> =
            runs.into_iter().map(|(_, _, _, p, t)| (p, t)).collect();
        let mut set_rows = Vec::new();
        for (((c, (pps, tgs)), (_, _, weights)), (comm, moved)) in
            cands.iter().zip(measured).zip(&loaded).zip(&traffic)
        {
            let weights = *weights;
            let lo = tgs.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = tgs.iter().copied().fold(0.0, f64::max);
            set_rows.push(StrategyRow {
                devices: spec.clone(),
                strategy: c.strategy.clone(),
                assignment: metashard::planner::strategy::describe(&c.split),
                predicted_pp_tps: c.predicted.prefill_tps(),
                measured_pp_tps: median(pps),
                predicted_tg_tps: c.predicted.decode_tps(),
                measured_tg_tps: median(tgs),
                measured_tg_range: (lo, hi),
                step_comm_bytes: *comm,
                step_weight_bytes_moved: *moved,
                predicted_weight_bytes: c
                    .predicted
                    .memory
                    .iter()
                    .map(|m| m.weights)
                    .max()
                    .unwrap_or(0),
                measured_weight_bytes: weights,
            });
        }
        summaries.push(summarize(spec, &set_rows));
        rows.extend(set_rows);
    }
    Ok(StrategiesReport {
        model: shape.name.clone(),
        workload,
        rows,
        summaries,
    })
}

/// Bytes one decode step (a token after the warm-up's) moves between devices on a meta device,
/// from the meta backend's sharding of that step's graph: every communicating conversion, and
/// those whose tensor is a weight (a leaf named `*.weight`, or a view of one). (0, 0) on one
/// device.
fn decode_traffic(
    m: &metashard::models::loader::DecoderModel,
    set: &metashard::DeviceSet,
    s: &Session,
) -> Result<(usize, usize)> {
    use metashard::models::decoder::{SequenceStep, build_step};
    let Some(meta) = &set.meta else {
        return Ok((0, 0));
    };
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

/// Open the model on `spec` with an explicit per-layer assignment.
fn load_with(
    model: &str,
    spec: &str,
    split: DecoderSplit,
) -> Result<(
    metashard::DeviceSet,
    metashard::models::loader::DecoderModel,
)> {
    if metashard::parse_devices(spec)?.len() == 1 {
        return load(model, spec, Precision::Exact, &SplitArgs::default(), true);
    }
    let opts = metashard::runtime::OpenOptions {
        split: Some(split),
        ..Default::default()
    };
    metashard::runtime::open_decoder(model, spec, &opts, &|_, _| {})
}

fn summarize(spec: &str, rows: &[StrategyRow]) -> DeviceSetSummary {
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
    let auto = rows.iter().find(|r| r.strategy == "auto");
    let best_tg = mtg.iter().copied().fold(0.0, f64::max);
    let best_pp = mpp.iter().copied().fold(0.0, f64::max);
    DeviceSetSummary {
        devices: spec.to_string(),
        spearman_tg: spearman(&ptg, &mtg),
        spearman_pp: spearman(&ppp, &mpp),
        median_error_tg: err(&ptg, &mtg),
        median_error_pp: err(&ppp, &mpp),
        auto_vs_best_tg: auto.map_or(0.0, |a| a.measured_tg_tps / best_tg.max(1e-12)),
        auto_vs_best_pp: auto.map_or(0.0, |a| a.measured_pp_tps / best_pp.max(1e-12)),
    }
}

pub fn print_table(r: &StrategiesReport) {
    println!(
        "{} — workload {} (predicted by the planner, measured here; medians)",
        r.model, r.workload
    );
    println!(
        "{:<9} {:<17} {:>10} {:>10} {:>7} {:>10} {:>10} {:>7} {:>15} {:>10} {:>10} {:>10} {:>10}",
        "devices",
        "strategy",
        "pp pred",
        "pp meas",
        "err",
        "tg pred",
        "tg meas",
        "err",
        "tg reps range",
        "MiB pred",
        "MiB meas",
        "step comm",
        "w moved"
    );
    for x in &r.rows {
        let e = |p: f64, m: f64| (p - m) / m.max(1e-12) * 100.0;
        println!(
            "{:<9} {:<17} {:>10.1} {:>10.1} {:>6.1}% {:>10.1} {:>10.1} {:>6.1}% {:>15} {:>10.1} {:>10.1} {:>10} {:>10}",
            x.devices,
            x.strategy,
            x.predicted_pp_tps,
            x.measured_pp_tps,
            e(x.predicted_pp_tps, x.measured_pp_tps),
            x.predicted_tg_tps,
            x.measured_tg_tps,
            e(x.predicted_tg_tps, x.measured_tg_tps),
            format!("{:.1}-{:.1}", x.measured_tg_range.0, x.measured_tg_range.1),
            x.predicted_weight_bytes as f64 / 1048576.0,
            x.measured_weight_bytes as f64 / 1048576.0,
            x.step_comm_bytes,
            x.step_weight_bytes_moved
        );
    }
    let has_auto = r.rows.iter().any(|x| x.strategy == "auto");
    for s in &r.summaries {
        if !has_auto {
            println!(
                "{}: Spearman tg {:.2}, pp {:.2}; median |error| tg {:.1}%, pp {:.1}% (auto not run)",
                s.devices,
                s.spearman_tg,
                s.spearman_pp,
                s.median_error_tg * 100.0,
                s.median_error_pp * 100.0
            );
            continue;
        }
        println!(
            "{}: Spearman tg {:.2}, pp {:.2}; median |error| tg {:.1}%, pp {:.1}%; auto vs best \
             measured: tg {:.3}x, pp {:.3}x",
            s.devices,
            s.spearman_tg,
            s.spearman_pp,
            s.median_error_tg * 100.0,
            s.median_error_pp * 100.0,
            s.auto_vs_best_tg,
            s.auto_vs_best_pp
        );
    }
}

/// An SVG scatter of predicted against measured tokens/s (decode and prefill, log scales), with
/// the diagonal.
pub fn svg(r: &StrategiesReport) -> String {
    let pts: Vec<(f64, f64, &str, &str, &str)> = r
        .rows
        .iter()
        .flat_map(|x| {
            [
                (
                    x.measured_tg_tps,
                    x.predicted_tg_tps,
                    "tg",
                    x.strategy.as_str(),
                    x.devices.as_str(),
                ),
                (
                    x.measured_pp_tps,
                    x.predicted_pp_tps,
                    "pp",
                    x.strategy.as_str(),
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
        r.workload
    );
    for (meas, pred, kind, strat, dev) in pts {
        let color = if kind == "tg" { "#1f77b4" } else { "#d62728" };
        s += &format!(
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"{color}\"><title>{dev} {strat} {kind}: measured {meas:.1}, predicted {pred:.1}</title></circle>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" fill=\"{color}\">{strat} ({dev})</text>\n",
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
    fn spearman_of_known_orders() {
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0], &[10.0, 20.0, 30.0, 40.0]) - 1.0).abs() < 1e-12);
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0], &[4.0, 3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
        // One swap in five: 1 - 6 * 2 / (5 * 24) = 0.9.
        let s = spearman(&[1.0, 2.0, 3.0, 4.0, 5.0], &[1.0, 3.0, 2.0, 4.0, 5.0]);
        assert!((s - 0.9).abs() < 1e-12, "{s}");
        assert_eq!(ranks(&[5.0, 1.0, 5.0]), vec![2.5, 1.0, 2.5]);
    }
}
