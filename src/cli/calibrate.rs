//! `metashard calibrate`: measure a device list's rates, overheads and links (the library's
//! `calibrate`), show a progress bar on stderr, print the figures as a table and write
//! the profile as JSON (`-o FILE`, or stdout with `--json`) for `Cluster::load`.

use metashard::calibrate::{CalibrateOptions, Calibration, calibrate, calibrate_report};
use metashard::cpu::Precision;
use metashard::planner::{Collective, LinkFitReport, LinkLevel, LinkSample, fit_level};
use metashard::{DType, Error, Result};
use std::fmt::Write as _;
use std::path::PathBuf;

#[derive(Clone, Debug, clap::Args)]
#[command(mut_arg("json", |a| a.help(
    "Print the profile as JSON on stdout (the table then goes to stderr)"
)))]
pub struct CalibrateArgs {
    /// The device list to measure: `cpu`, `cpu:N`, `cpu:NxT` (devices of one list run at once,
    /// as a tensor-parallel step runs them).
    #[arg(long)]
    pub devices: String,
    /// Write the profile (JSON, read back by the planner) to this file.
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
    /// Under a minute instead of a few: fewer repetitions, sizes and shapes.
    #[arg(long)]
    pub quick: bool,
    #[command(flatten)]
    pub out: super::JsonArgs,
    /// Precision of products with quantized weights, as the runs to be planned will use it.
    #[arg(long, value_parser = super::parse_precision, default_value = "exact")]
    pub precision: Precision,
    /// Weight types whose matrix-vector and matrix-matrix rates are measured, by ggml name,
    /// comma-separated (`--types q4_k,q6_k,q8_0` for a Q4_K_M file). F32 is always measured
    /// as well: the planner prices unfused attention and types without figures from it.
    /// Default: f32, f16, bf16, q8_0, q4_0, q4_1.
    #[arg(long, value_delimiter = ',', value_parser = parse_weight_type)]
    pub types: Vec<DType>,
    /// Measure F32 and the weight types this model's matrices are stored in (a model name as
    /// `plan --model` takes it, a `.gguf` file or a `config.json`) instead of --types.
    #[arg(long, conflicts_with = "types")]
    pub model: Option<String>,
    /// Hosts of this device list each: the profile then has HOSTS copies of the measured
    /// devices, joined between hosts by the links fitted from --inter (two levels).
    #[arg(long, default_value_t = 1, value_parser = super::parse_positive)]
    pub hosts: usize,
    /// Collectives timed between hosts: the JSON of `metashard bench comm --dist mpi --json`
    /// run with one rank per host (e.g. `scripts/two_hosts.sh run ...`); fitted per collective
    /// into the inter-host level. Needs --hosts 2 or more.
    #[arg(long)]
    pub inter: Option<PathBuf>,
    /// What the links between hosts are, in words (the profile's `kind` of that level).
    #[arg(long)]
    pub inter_kind: Option<String>,
}

/// Samples of `bench comm --json` rows: `[{"collective": "all_reduce", "ranks": 2, "bytes":
/// 65536, "median_us": 31.0, ...}, ...]` (src/bench/comm.rs, `CommRow`).
pub fn comm_samples(path: &std::path::Path) -> Result<Vec<(Collective, LinkSample)>> {
    let bad = |reason: String| Error::Format {
        path: path.to_path_buf(),
        field: "bench comm rows".into(),
        reason,
    };
    let text = metashard::io::read_json_text(path)?;
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&text).map_err(|e| bad(format!("not a JSON array: {e}")))?;
    let mut out = Vec::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        let c = match r["collective"].as_str() {
            Some("all_reduce") => Collective::AllReduce,
            Some("all_gather") => Collective::AllGather,
            Some("reduce_scatter") => Collective::ReduceScatter,
            other => return Err(bad(format!("row {i}: unknown collective {other:?}"))),
        };
        // Each figure in a range hardware reaches: a group of ranks a cluster can have, a
        // buffer up to 1 PiB, a median call of at most 10 s.
        let field = |k: &str, lo: f64, hi: f64, whole: bool| {
            r[k].as_f64()
                .filter(|v| (lo..=hi).contains(v) && (!whole || v.fract() == 0.0))
                .ok_or_else(|| {
                    bad(format!(
                        "row {i}: `{k}` must be a {}number in {lo}..={hi}, found {}",
                        if whole { "whole " } else { "" },
                        r[k]
                    ))
                })
        };
        let max_ranks = metashard::planner::MAX_DEVICES as f64;
        out.push((
            c,
            LinkSample {
                n: field("ranks", 2.0, max_ranks, true)? as usize,
                bytes: field("bytes", 1.0, (1u64 << 50) as f64, true)? as usize,
                seconds: field("median_us", 1e-3, 1e7, false)? * 1e-6,
                reps: 1,
            },
        ));
    }
    Ok(out)
}

pub fn run(a: &CalibrateArgs) -> Result<()> {
    // Every flag is checked before anything is measured: an unknown device list, more hosts
    // than a cluster may have, a bad file of timings.
    let per_host = metashard::parse_devices(&a.devices)?.len();
    metashard::planner::Cluster::check_hosts(a.hosts, per_host)?;
    if let Some(p) = &a.output
        && p.is_dir()
    {
        return Err(Error::invalid_argument(
            "--output",
            p.display(),
            "is a directory; give a file name for the profile",
        ));
    }
    if (a.hosts > 1) != a.inter.is_some() {
        return Err(Error::invalid_argument(
            "--hosts",
            a.hosts,
            "--hosts 2 or more and --inter FILE go together (the links between hosts are \
             fitted from the collectives in FILE)",
        ));
    }
    // The inter-host fit first: a bad file is reported before anything is measured.
    let inter = match &a.inter {
        Some(p) => {
            let kind = a
                .inter_kind
                .clone()
                .unwrap_or_else(|| format!("between hosts, fitted from {}", p.display()));
            let (level, fits) = fit_level(&kind, &comm_samples(p)?)?;
            level.validate(&format!("--inter {}", p.display()))?;
            Some((p, (level, fits)))
        }
        None => None,
    };
    let mut opts = CalibrateOptions {
        quick: a.quick,
        precision: a.precision,
        ..Default::default()
    };
    if let Some(m) = &a.model {
        opts.weight_types =
            metashard::calibrate::types_of(&metashard::planner::ModelShape::resolve(m)?)?;
    } else if !a.types.is_empty() {
        opts.weight_types = metashard::calibrate::with_f32(a.types.iter().copied());
    }
    let pb = indicatif::ProgressBar::new(1000);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg:<34} [{bar:40}] {percent:>3}% {elapsed}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    let report = calibrate_report(&a.devices, &opts, &|what, done| {
        pb.set_message(what.to_string());
        pb.set_position((done.clamp(0.0, 1.0) * 1000.0) as u64);
    });
    pb.finish_and_clear();
    let mut report = report?;
    let mut inter_text = String::new();
    if let Some((path, (level, fits))) = inter {
        let rms = fits.iter().map(|f| f.rel_rms).fold(0.0, f64::max);
        let mut c = report.cluster.with_hosts(a.hosts, level)?;
        c.sources.push(format!(
            "links between hosts: fitted from the bench comm rows in {} (largest RMS relative \
             residual {:.1}%)",
            path.display(),
            100.0 * rms
        ));
        inter_text = links_table(c.links.inter.as_ref().expect("just set"), &fits);
        report.cluster = c;
    }
    let json = report.cluster.to_json();
    if let Some(p) = &a.output {
        std::fs::write(p, format!("{json}\n")).map_err(|e| Error::io(p, e))?;
    }
    let mut text = table(&report);
    if !inter_text.is_empty() {
        text.push_str("\nbetween hosts\n");
        text.push_str(&inter_text);
    }
    if let Some(p) = &a.output {
        let _ = writeln!(text, "\nprofile written to {}", p.display());
    }
    if a.out.json {
        eprint!("{text}");
        println!("{json}");
    } else {
        print!("{text}");
    }
    Ok(())
}

/// A `--types` entry: a weight type by its ggml name (`q4_k`), case-insensitive.
fn parse_weight_type(s: &str) -> std::result::Result<DType, String> {
    DType::from_name(s.trim())
        .filter(|d| DType::WEIGHT_TYPES.contains(d))
        .ok_or_else(|| {
            let names: Vec<&str> = DType::WEIGHT_TYPES.iter().map(|d| d.name()).collect();
            format!("`{s}` is not a weight type ({})", names.join(", "))
        })
}

/// The figures of a calibration as text tables.
pub fn table(r: &Calibration) -> String {
    let c = &r.cluster;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} ({} mode, {:.1} s)\n{}",
        c.name,
        if r.quick { "quick" } else { "full" },
        r.seconds,
        c.description
    );
    let _ = writeln!(
        s,
        "\n{:<8} {:>11} {:>10} {:>11} {:>9} {:>9}",
        "device", "memory GiB", "mem GB/s", "attn GF/s", "step us", "node us"
    );
    for d in &c.devices {
        let _ = writeln!(
            s,
            "{:<8} {:>11.2} {:>10.2} {:>11.2} {:>9.1} {:>9.2}",
            d.name,
            d.memory_bytes as f64 / (1u64 << 30) as f64,
            d.mem_bw / 1e9,
            d.attention() / 1e9,
            d.step_overhead_s * 1e6,
            d.node_overhead_s * 1e6,
        );
    }
    let _ = writeln!(
        s,
        "(step: after {:?} idle; {:.1} us back to back. node: graph building to kernel; \
         {:.2} us of it in the device's own program)",
        metashard::calibrate::STEP_GAP,
        r.step_back_to_back_s * 1e6,
        r.kernel_node_s * 1e6
    );
    let _ = writeln!(
        s,
        "(node us includes {:.2} us from a small decoder's decoding step: {:.1} us as run, {:.1} \
         us predicted from the chains, {:.0} nodes on its critical path)",
        ((r.decoder_step_s - r.decoder_step_predicted_s) / r.decoder_step_nodes).max(0.0) * 1e6,
        r.decoder_step_s * 1e6,
        r.decoder_step_predicted_s * 1e6,
        r.decoder_step_nodes
    );
    let apart = r.decoder_apart_steps.iter().map(|st| (st, " mirrored"));
    for (st, how) in r.decoder_rows_steps.iter().map(|st| (st, "")).chain(apart) {
        let _ = writeln!(
            s,
            "(steps of {} rows{how}: kernels x{:.3}, from the small decoder's {}: {:.1} us as \
             run, {:.1} us predicted, {:.1} us of it kernels)",
            st.rows,
            st.factor,
            match st.rows {
                metashard::calibrate::BATCH_ROWS => "batched decoding step",
                metashard::calibrate::PROMPT_ROWS => "prompt chunk",
                _ => "prompt chunks of a batch in one step",
            },
            st.measured_s * 1e6,
            st.predicted_s * 1e6,
            st.predicted_kernels_s * 1e6
        );
    }
    for st in &r.decoder_stage_steps {
        let _ = writeln!(
            s,
            "(a device alone at {} row{}: x{:.3}, from the small decoder's layer split, stages \
             one after another: {:.1} us as run, {:.1} us predicted with all devices' rates, \
             {:.1} us of it the stages')",
            st.rows,
            if st.rows == 1 { "" } else { "s" },
            st.speedup,
            st.measured_s * 1e6,
            st.predicted_s * 1e6,
            st.scaled_s * 1e6
        );
    }
    if let Some(p) = &r.decoder_pipeline_step {
        let _ = writeln!(
            s,
            "(a pipelined decoding step: x{:.3}, the small decoder's layer split, {} rows in {} \
             micro-batches: {:.1} us as run, {:.1} us predicted with the alone speedups)",
            p.factor,
            p.rows,
            p.micro_batches,
            p.measured_s * 1e6,
            p.predicted_s * 1e6
        );
    }
    let types: Vec<&str> = DType::WEIGHT_TYPES
        .iter()
        .map(|t| t.name())
        .filter(|t| c.devices.iter().any(|d| d.gemv_bw.contains_key(*t)))
        .collect();
    type Get<'a> = Box<dyn Fn(&metashard::planner::DeviceProfile, &str) -> Option<f64> + 'a>;
    let mut tables: Vec<(String, f64, Get)> = vec![(
        "GEMV (M = 1), weight GB/s".into(),
        1e9,
        Box::new(|d, t| d.gemv_bw.get(t).copied()),
    )];
    // By row length: the K each type was measured at (the K-quants' 576 is 768, whole blocks).
    let mut ks: Vec<usize> = c
        .devices
        .iter()
        .flat_map(|d| d.gemv_bw_by_k.values().flatten().map(|p| p.0))
        .collect();
    ks.sort_unstable();
    ks.dedup();
    for k in ks {
        tables.push((
            format!("GEMV (M = 1) with rows of K = {k}, weight GB/s"),
            1e9,
            Box::new(move |d, t| {
                d.gemv_bw_by_k
                    .get(t)
                    .and_then(|p| p.iter().find(|x| x.0 == k))
                    .map(|x| x.1)
            }),
        ));
    }
    for m in metashard::planner::CALIBRATED_M {
        tables.push((
            format!("products at M = {m}, GFLOP/s"),
            1e9,
            Box::new(move |d, t| {
                d.gemm_flops_by_m
                    .get(t)
                    .and_then(|p| p.iter().find(|x| x.0 == m))
                    .map(|x| x.1)
            }),
        ));
    }
    tables.push((
        "GEMM (M = 128), GFLOP/s".into(),
        1e9,
        Box::new(|d, t| d.gemm_flops.get(t).copied()),
    ));
    for (title, unit, get) in tables {
        if !c
            .devices
            .iter()
            .any(|d| types.iter().any(|t| get(d, t).is_some()))
        {
            continue;
        }
        let _ = write!(s, "\n{title}\n{:<8}", "device");
        for t in &types {
            let _ = write!(s, " {t:>8}");
        }
        s.push('\n');
        for d in &c.devices {
            let _ = write!(s, "{:<8}", d.name);
            for t in &types {
                match get(d, t) {
                    Some(v) => {
                        let _ = write!(s, " {:>8.2}", v / unit);
                    }
                    None => {
                        let _ = write!(s, " {:>8}", "-");
                    }
                }
            }
            s.push('\n');
        }
    }
    let l = &c.links.intra;
    if r.links.is_empty() {
        let _ = writeln!(s, "\nlinks: {}", l.kind);
        return s;
    }
    s.push_str(&links_table(l, &r.links));
    s
}

/// One level's fits and their samples, measured against fitted.
fn links_table(l: &LinkLevel, fits: &[LinkFitReport]) -> String {
    let mut s = String::new();
    let ns: Vec<usize> = fits[0].fit.alpha_s.iter().map(|&(n, _)| n).collect();
    let _ = writeln!(
        s,
        "\nlinks: {}\nt = alpha(N) + factor(N) * bytes / bus_bw (factor: 2(N-1)/N all-reduce, \
         (N-1)/N gather, scatter)",
        l.kind
    );
    let _ = write!(s, "{:<15} {:>9}", "collective", "bus GB/s");
    for n in &ns {
        let _ = write!(s, " {:>9}", format!("a({n}) us"));
    }
    let _ = writeln!(s, " {:>9} {:>9}", "fit rms", "fit max");
    for f in fits {
        let _ = write!(s, "{:<15} {:>9.2}", f.collective.name(), f.fit.bus_bw / 1e9);
        for &(_, a) in &f.fit.alpha_s {
            let _ = write!(s, " {:>9.2}", a * 1e6);
        }
        let _ = writeln!(
            s,
            " {:>8.1}% {:>8.1}%",
            100.0 * f.rel_rms,
            100.0 * f.max_rel
        );
    }
    let _ = writeln!(s, "\nmeasured (median per call):");
    let _ = writeln!(
        s,
        "{:<15} {:>3} {:>10} {:>11} {:>11} {:>9}",
        "collective", "N", "bytes", "measured us", "fitted us", "bus GB/s"
    );
    for f in fits {
        for smp in &f.samples {
            let fitted = l.time(f.collective, smp.n, smp.bytes as f64);
            let _ = writeln!(
                s,
                "{:<15} {:>3} {:>10} {:>11.2} {:>11.2} {:>9.2}",
                f.collective.name(),
                smp.n,
                smp.bytes,
                smp.seconds * 1e6,
                fitted * 1e6,
                f.collective.factor(smp.n) * smp.bytes as f64 / smp.seconds / 1e9
            );
        }
    }
    s
}

/// A cluster for the planner: a preset name or a profile file (`--cluster`), or the devices of
/// this machine measured now with a quick calibration (`--devices`), with a progress bar.
pub fn resolve_cluster(
    cluster: Option<&str>,
    devices: Option<&str>,
) -> Result<metashard::planner::Cluster> {
    use metashard::planner::Cluster;
    match (cluster, devices) {
        (Some(c), _) => {
            if let Some(p) = Cluster::preset(c) {
                return Ok(p);
            }
            let path = std::path::Path::new(c);
            if path.exists() {
                return Cluster::load(path);
            }
            Err(Error::invalid_argument(
                "--cluster",
                c,
                format!(
                    "neither a preset ({}) nor a profile file",
                    Cluster::preset_names().join(", ")
                ),
            ))
        }
        (None, Some(d)) => {
            metashard::parse_devices(d)?;
            let pb = indicatif::ProgressBar::new(1000);
            pb.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg:<34} [{bar:40}] {percent:>3}% {elapsed}",
                )
                .expect("a valid template")
                .progress_chars("=> "),
            );
            pb.set_message(format!("calibrating {d}"));
            let r = calibrate(d, &CalibrateOptions::quick(), &|what, done| {
                pb.set_message(what.to_string());
                pb.set_position((done.clamp(0.0, 1.0) * 1000.0) as u64);
            });
            pb.finish_and_clear();
            r
        }
        (None, None) => Err(Error::invalid_argument(
            "--cluster",
            "(none)",
            "give a cluster (a preset or a profile file) or --devices to measure this machine's",
        )),
    }
}
