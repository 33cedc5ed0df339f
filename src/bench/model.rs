//! `metashard bench model`: prompt processing (pp, default 128 tokens in one batch) and
//! generation (tg, default 64 decode steps) tokens/s of a GGUF decoder on each given device
//! set at each given precision and split mode (repetitions interleaved; ratios to the first row
//! both of the medians and, steadier on a noisy machine, the median of per-repetition ratios),
//! the effective bandwidth of generation (weight bytes read per token x tokens/s), and
//! the machine's streaming read bandwidth measured in the same run for comparison. With ranks
//! as processes the ranks agree on the model, split and precisions first, and take rank 0's
//! sizes and repetitions. A mixture of experts' load balance is counted after the timings
//! (`routing.rs`: tokens routed per expert and per device, a table and `routing` in
//! `--json`; not with ranks as processes).

use crate::cli::run::{decoder_settings, load_dist};
use crate::cli::{
    DistArgs, JsonArgs, ModelArgs, PrecisionsArgs, SplitArgs, parse_positive, parse_reps, setting,
};
use metashard::Result;
use metashard::cpu::{Precision, ThreadPool};
use metashard::dist::Dist;
use metashard::models::layer_split::SplitMode;
use metashard::models::session::Session;
use std::time::Instant;

#[derive(Clone, Debug, clap::Args)]
pub struct BenchModelArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Device sets to compare (repeat the flag); the first is the baseline of the ratios.
    #[arg(long, default_values_t = vec!["cpu:1x2".to_string(), "cpu:2x1".to_string()])]
    pub devices: Vec<String>,
    /// Prompt tokens evaluated in one batch (at least 1; with --tg, within the model's
    /// context).
    #[arg(long, default_value_t = 128, value_parser = parse_positive)]
    pub pp: usize,
    /// Generation steps timed after the prompt.
    #[arg(long, default_value_t = 64)]
    pub tg: usize,
    /// Repetitions of each configuration (median reported; at least 1).
    #[arg(long, default_value_t = 3, value_parser = parse_reps)]
    pub reps: usize,
    #[command(flatten)]
    pub precision: PrecisionsArgs,
    // The split flags apply to the device sets of several devices.
    #[command(flatten)]
    pub split: SplitArgs,
    /// With `--dist mpi`, each --devices is this process's one device (one rank per
    /// process of the MPI job); rank 0 prints the report.
    #[command(flatten)]
    pub dist: DistArgs,
    #[command(flatten)]
    pub out: JsonArgs,
}

/// `bench model`: check the split flags against each device set, time every configuration
/// (every rank of a job takes part), and print the report on rank 0.
pub fn run(a: &BenchModelArgs) -> Result<()> {
    // The split flags apply to the device sets of several devices.
    for d in &a.devices {
        if metashard::parse_devices(d)?.len() > 1 && a.dist.dist == Dist::Local {
            a.split.check(d)?;
        }
    }
    let dist = a.dist.dist;
    let leader = metashard::dist::rank_and_size(dist)?.0 == 0;
    let precisions = a.precision.list();
    let names: Vec<&str> = precisions.iter().map(|p| p.name()).collect();
    // Every rank times the same configurations: as many device sets, the same precisions.
    crate::cli::agree(
        dist,
        "bench model",
        &a.model.name,
        decoder_settings(
            setting("--precision", names.join(",")),
            &a.split,
            [setting("--devices (sets)", a.devices.len())],
        ),
    )?;
    // Rank 0 owns the request: the sizes and repetitions.
    let r = crate::cli::share_request(
        dist,
        BenchRequest {
            pp: a.pp,
            tg: a.tg,
            reps: a.reps,
        },
        &[],
    )?;
    let opts = ModelBenchOptions {
        model: a.model.name.clone(),
        devices: a.devices.clone(),
        pp: r.pp,
        tg: r.tg,
        reps: r.reps,
        precisions,
        split: a.split.clone(),
        dist,
    };
    let report = measure(&opts, &|line| {
        if leader {
            crate::cli::eprint_line(line.to_string())
        }
    })?;
    if !leader {
        return Ok(());
    }
    a.out.print("command output", &report, print_table)
}

/// What `bench model` takes from rank 0 with ranks as processes; JSON keys are the flags.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct BenchRequest {
    #[serde(rename = "--pp")]
    pp: usize,
    #[serde(rename = "--tg")]
    tg: usize,
    #[serde(rename = "--reps")]
    reps: usize,
}

#[derive(Clone, Debug)]
pub struct ModelBenchOptions {
    pub model: String,
    pub devices: Vec<String>,
    pub pp: usize,
    pub tg: usize,
    pub reps: usize,
    /// Precisions of products with quantized weights (each device set runs at each; empty:
    /// [`Precision::Exact`]).
    pub precisions: Vec<Precision>,
    /// `--tensor-split` and `--mirror-attention` for the device sets of several devices.
    pub split: SplitArgs,
    /// With `Dist::Mpi`, each device set is this process's one device of a meta device with
    /// one rank per process (every rank calls `measure`; rank 0's report is the one to print).
    pub dist: Dist,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ModelBenchRow {
    pub devices: String,
    /// tensor, layer or hybrid.
    pub split_mode: String,
    pub precision: String,
    pub pp_tokens: usize,
    pub pp_tokens_per_s: f64,
    pub tg_tokens: usize,
    pub tg_tokens_per_s: f64,
    /// Weight bytes read per generated token.
    pub bytes_per_token: usize,
    /// `bytes_per_token * tg_tokens_per_s`.
    pub tg_gbps: f64,
    /// Generation throughput relative to the first row (device set and precision).
    pub tg_vs_first: f64,
    pub pp_vs_first: f64,
    /// The median over repetitions of this row's throughput over the first row's in the same
    /// repetition: on a noisy machine, a steadier ratio than the ratio of the medians.
    pub tg_vs_first_paired: f64,
    pub pp_vs_first_paired: f64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ModelBenchReport {
    pub model: String,
    pub rows: Vec<ModelBenchRow>,
    /// Streaming read bandwidth of this machine (2 threads, 512 MiB), GB/s.
    pub stream_gbps: f64,
    /// A mixture of experts' tokens routed per expert and per device (absent for a dense
    /// model, and with ranks as processes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routing: Option<super::routing::RoutingReport>,
}

/// Read `bytes` once per thread share and sum, `reps` times (after one untimed read); the GB/s
/// of each.
pub fn stream_read_samples(threads: usize, bytes: usize, reps: usize) -> Result<Vec<f64>> {
    let n = bytes / 4;
    // Host memory as the CPU backend's weights get it (huge pages where offered), so the
    // `% stream` column compares like with like.
    let buf = metashard::buffer::HostBuffer::new(n * 4)?;
    let ptr = metashard::buffer::Buffer::host_ptr(&buf).expect("host memory") as *mut f32;
    // SAFETY: the buffer holds n * 4 bytes, 64-byte aligned, owned here until the end.
    let data = unsafe { std::slice::from_raw_parts_mut(ptr, n) };
    for (i, x) in data.iter_mut().enumerate() {
        *x = (i % 7) as f32;
    }
    let data = &*data;
    let pool = ThreadPool::new(threads, "stream")?;
    let sink = parking_lot::Mutex::new(0f32);
    let mut times = Vec::new();
    for _ in 0..reps + 1 {
        let start = Instant::now();
        let _ = pool.run(&|ith, _| {
            let r = metashard::cpu::split_range(n, ith, threads);
            // Eight independent sums so the loop vectorizes and is bound by memory.
            let mut acc = [0f32; 8];
            for c in data[r].chunks_exact(8) {
                for (a, x) in acc.iter_mut().zip(c) {
                    *a += x;
                }
            }
            *sink.lock() += acc.iter().sum::<f32>();
        });
        times.push(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(*sink.lock());
    times.remove(0);
    Ok(times.iter().map(|t| bytes as f64 / t / 1e9).collect())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One configuration being measured: a device set at a precision, and its model.
struct Config {
    spec: String,
    mode: SplitMode,
    precision: Precision,
    set: metashard::DeviceSet,
    m: metashard::models::loader::DecoderModel,
}

pub fn measure(opts: &ModelBenchOptions, progress: &dyn Fn(&str)) -> Result<ModelBenchReport> {
    let precisions = if opts.precisions.is_empty() {
        vec![Precision::Exact]
    } else {
        opts.precisions.clone()
    };
    progress("measuring streaming bandwidth");
    let mut stream = stream_read_samples(2, 512 << 20, 5)?;
    let mut configs = Vec::new();
    let modes = if opts.split.split_mode.is_empty() {
        vec![SplitMode::Tensor]
    } else {
        opts.split.split_mode.clone()
    };
    for spec in &opts.devices {
        for &mode in &modes {
            for &precision in &precisions {
                progress(&format!(
                    "loading {} on {spec} ({mode} split, {precision})",
                    opts.model
                ));
                // The split flags apply to device sets of several devices (or ranks); the mode
                // to all (a layer split of one device is the scheduler over its one backend).
                let mut split =
                    if metashard::parse_devices(spec)?.len() > 1 || opts.dist != Dist::Local {
                        opts.split.clone()
                    } else {
                        SplitArgs {
                            groups: opts.split.groups,
                            ..Default::default()
                        }
                    };
                split.split_mode = vec![mode];
                let (set, m) = load_dist(&opts.model, spec, opts.dist, precision, &split, true)?;
                // The prompt, the steps and the warm-up token must fit the context.
                let need = opts.pp.checked_add(opts.tg).and_then(|n| n.checked_add(2));
                if opts.pp == 0 || need.is_none_or(|n| n > m.context_length) {
                    return Err(metashard::Error::invalid_argument(
                        "--pp + --tg",
                        format!("{} + {}", opts.pp, opts.tg),
                        format!(
                            "the prompt (at least 1 token), the steps and 2 more must fit the \
                             model's context of {} tokens",
                            m.context_length
                        ),
                    ));
                }
                configs.push(Config {
                    spec: match set.rank {
                        Some(_) => format!("mpi {}x {spec}", set.devices.len()),
                        None => spec.clone(),
                    },
                    mode,
                    precision,
                    set,
                    m,
                });
            }
        }
    }
    let name = configs.first().map_or(String::new(), |c| c.m.name.clone());
    let mut sessions = Vec::new();
    for c in &configs {
        let n_vocab = c.m.cfg.n_vocab as u32;
        let prompt = bench_prompt(opts.pp, n_vocab);
        let mut s = Session::new(
            &c.m,
            c.set.backend.clone(),
            c.set.buffer_type.as_ref(),
            opts.pp + opts.tg + 2,
        )?;
        // Warm up: plans for both shapes.
        s.eval(&prompt, false)?;
        s.eval(&[1], false)?;
        sessions.push((s, prompt, n_vocab));
    }
    let (mut pps, mut tgs) = (
        vec![Vec::new(); configs.len()],
        vec![Vec::new(); configs.len()],
    );
    // Repetitions interleave the configurations, so a noisy moment hits all of them alike.
    for r in 0..opts.reps.max(1) {
        for (ci, (s, prompt, n_vocab)) in sessions.iter_mut().enumerate() {
            s.reset();
            let t0 = Instant::now();
            s.eval(prompt, false)?;
            pps[ci].push(opts.pp as f64 / t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            let mut tok = 1u32;
            for i in 0..opts.tg {
                let l = s.eval(&[tok], false)?;
                tok = next_token(&l, i, *n_vocab);
            }
            tgs[ci].push(opts.tg as f64 / t0.elapsed().as_secs_f64());
            progress(&format!(
                "{} ({} split, {}): rep {} pp {:.1} t/s, tg {:.1} t/s",
                configs[ci].spec,
                configs[ci].mode,
                configs[ci].precision,
                r + 1,
                pps[ci][r],
                tgs[ci][r]
            ));
        }
    }
    drop(sessions);
    let routing = count_routing(opts, &configs, progress)?;
    let mut rows: Vec<ModelBenchRow> = Vec::new();
    let paired = |v: &[f64], first: &[f64]| {
        median(v.iter().zip(first).map(|(x, f)| x / f).collect::<Vec<_>>())
    };
    let pp_first = pps.first().cloned().unwrap_or_default();
    let tg_first = tgs.first().cloned().unwrap_or_default();
    for ((c, pp), tg) in configs.into_iter().zip(pps).zip(tgs) {
        let (pp_paired, tg_paired) = (paired(&pp, &pp_first), paired(&tg, &tg_first));
        let (pp, tg) = (median(pp), median(tg));
        let bpt = c.m.bytes_per_token();
        let (tg0, pp0) = rows
            .first()
            .map_or((tg, pp), |r| (r.tg_tokens_per_s, r.pp_tokens_per_s));
        rows.push(ModelBenchRow {
            devices: c.spec,
            split_mode: c.mode.name().to_string(),
            precision: c.precision.name().to_string(),
            pp_tokens: opts.pp,
            pp_tokens_per_s: pp,
            tg_tokens: opts.tg,
            tg_tokens_per_s: tg,
            bytes_per_token: bpt,
            tg_gbps: bpt as f64 * tg / 1e9,
            tg_vs_first: tg / tg0,
            pp_vs_first: pp / pp0,
            tg_vs_first_paired: tg_paired,
            pp_vs_first_paired: pp_paired,
        });
    }
    // The bandwidth of a shared machine drifts: measured before and after the model runs, and
    // the median of both sets reported.
    progress("measuring streaming bandwidth");
    stream.extend(stream_read_samples(2, 512 << 20, 5)?);
    let stream_gbps = median(stream);
    Ok(ModelBenchReport {
        model: name,
        rows,
        stream_gbps,
        routing,
    })
}

/// The benchmark's prompt of `pp` tokens for a vocabulary of `n_vocab`.
fn bench_prompt(pp: usize, n_vocab: u32) -> Vec<u32> {
    (0..pp as u32).map(|i| (i * 131 + 17) % n_vocab).collect()
}

/// The generation step's next token: the argmax moved on by the step, so steps vary.
fn next_token(logits: &[f32], step: usize, n_vocab: u32) -> u32 {
    (metashard::models::sampler::argmax(logits) + step as u32) % n_vocab
}

/// A mixture of experts' routing over the benchmark's prompt and steps, counted on the first
/// configuration, with the tokens each device set's devices compute (`None`: a dense model,
/// or ranks as processes).
fn count_routing(
    opts: &ModelBenchOptions,
    configs: &[Config],
    progress: &dyn Fn(&str),
) -> Result<Option<super::routing::RoutingReport>> {
    let Some(first) = configs.first() else {
        return Ok(None);
    };
    if opts.dist != Dist::Local || first.m.cfg.moe.is_none() {
        return Ok(None);
    }
    progress(&format!("counting the experts' routing on {}", first.spec));
    let n_vocab = first.m.cfg.n_vocab as u32;
    let prompt = bench_prompt(opts.pp, n_vocab);
    let next = |l: &[f32], i: usize| next_token(l, i, n_vocab);
    let Some(counts) = super::routing::count(&first.set, &first.m, &prompt, opts.tg, &next)? else {
        return Ok(None);
    };
    let mut devices: Vec<super::routing::DeviceRouting> = Vec::new();
    for c in configs {
        let d = super::routing::per_device(&c.set, &c.m, c.mode.name(), &counts);
        if !devices
            .iter()
            .any(|x| x.devices == d.devices && x.split_mode == d.split_mode)
        {
            devices.push(d);
        }
    }
    let tokens = opts.pp + opts.tg;
    Ok(Some(super::routing::report(
        &first.m,
        &first.spec,
        tokens,
        counts,
        devices,
    )))
}

pub fn print_table(r: &ModelBenchReport) {
    println!("model: {}", r.model);
    println!(
        "{:<12} {:<7} {:<9} {:>10} {:>8} {:>8} {:>10} {:>8} {:>8} {:>12} {:>10}",
        "devices",
        "split",
        "precision",
        "pp t/s",
        "pp x",
        "paired",
        "tg t/s",
        "tg x",
        "paired",
        "tg GB/s",
        "% stream"
    );
    for row in &r.rows {
        println!(
            "{:<12} {:<7} {:<9} {:>10.1} {:>7.2}x {:>7.3}x {:>10.1} {:>7.2}x {:>7.3}x {:>12.2} {:>9.0}%",
            row.devices,
            row.split_mode,
            row.precision,
            row.pp_tokens_per_s,
            row.pp_vs_first,
            row.pp_vs_first_paired,
            row.tg_tokens_per_s,
            row.tg_vs_first,
            row.tg_vs_first_paired,
            row.tg_gbps,
            100.0 * row.tg_gbps / r.stream_gbps
        );
    }
    println!(
        "streaming read bandwidth (2 threads): {:.2} GB/s",
        r.stream_gbps
    );
    if let Some(routing) = &r.routing {
        super::routing::print_table(routing);
    }
}
