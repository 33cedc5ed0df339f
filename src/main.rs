//! The `metashard` command line: list devices, run and verify models across devices,
//! calibrate the planner's cost model, and benchmark kernels, the meta backend and models.

mod bench;
mod cli;

use clap::{Parser, Subcommand};
use metashard::cpu::Precision;
use metashard::{Result, parse_devices};

#[derive(Parser)]
#[command(
    name = "metashard",
    version,
    about = "Tensor parallelism: one graph across N devices"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// List devices (all built-in registries, or those of a device list).
    Devices {
        /// A device list: `cpu`, `cpu:N`, `cpu:NxT`.
        #[arg(long)]
        devices: Option<String>,
        /// Print a JSON array (name, kind, description, memory) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Generate text with a GGUF decoder on a device set.
    Run(cli::run::RunArgs),
    /// Check a sharded run against one device (and the numpy reference with --reference).
    Verify(cli::verify::VerifyArgs),
    /// Sentence embeddings with a BERT encoder (all-MiniLM-L6-v2) on any device list.
    Embed(cli::embed::EmbedOptions),
    /// Plan the split of a model on a cluster: predicted time, memory and communication.
    Plan(cli::plan::PlanArgs),
    /// Measure a device list (rates per weight type, overheads, collective links) into a
    /// cluster profile (JSON) for the planner.
    Calibrate(cli::calibrate::CalibrateArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
    /// Self-checks of this build on this machine.
    Selftest {
        #[command(subcommand)]
        what: SelftestCmd,
    },
}

#[derive(Subcommand)]
enum SelftestCmd {
    /// The job's communicator (ranks as processes: `mpirun -np N metashard selftest comm
    /// --dist mpi`) against the in-process one, bit for bit, on every collective.
    Comm {
        #[command(flatten)]
        dist: cli::DistArgs,
        /// How long a rank waits for a peer before naming it, in milliseconds.
        #[arg(long, default_value_t = 10_000)]
        timeout_ms: u64,
        /// Inject a fault: `HOW@RANK:CALL` with HOW one of kill, exit, stall, error (rank
        /// RANK does it before its collective number CALL).
        #[arg(long, value_parser = bench::comm::parse_fault)]
        fault: Option<bench::comm::Fault>,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Matrix-product kernels on a fixed set of shapes (table, or JSON with --json).
    Ops {
        /// Thread counts (each case runs at each).
        #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 2])]
        threads: Vec<usize>,
        /// Only cases whose label contains this text, e.g. "q4_0" or "m=1 ".
        #[arg(long)]
        filter: Option<String>,
        /// Precisions of products with quantized weights, e.g. `exact,q8` (each quantized
        /// case runs at each, side by side).
        #[arg(long, value_delimiter = ',', value_parser = parse_precision, default_value = "exact")]
        precision: Vec<Precision>,
        /// Shorthand for `--precision q8`.
        #[arg(long, conflicts_with = "precision")]
        q8: bool,
        /// M values of the K = N = 4096 cases (default 1,32).
        #[arg(long, value_delimiter = ',')]
        m: Option<Vec<usize>>,
        /// Also time numpy (scripts/bench_numpy.py) in this run and print the ratios.
        #[arg(long)]
        numpy: bool,
        /// Keep one copy of the weights (may stay in cache, as ggml's perf mode does).
        #[arg(long)]
        no_rotate: bool,
        /// Print the results as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// A real model's prompt (pp) and generation (tg) tokens/s on each device set.
    Model {
        /// Model name (`smollm2`) or path to a `.gguf` file.
        #[arg(long, default_value = "smollm2")]
        model: String,
        /// Device sets to compare (repeat the flag); the first is the baseline of the ratios.
        #[arg(long, default_values_t = vec!["cpu:1x2".to_string(), "cpu:2x1".to_string()])]
        devices: Vec<String>,
        /// Prompt tokens evaluated in one batch (at least 1; with --tg, within the model's
        /// context).
        #[arg(long, default_value_t = 128, value_parser = cli::parse_positive)]
        pp: usize,
        /// Generation steps timed after the prompt.
        #[arg(long, default_value_t = 64)]
        tg: usize,
        /// Repetitions of each configuration (median reported; at least 1).
        #[arg(long, default_value_t = 3, value_parser = cli::parse_positive)]
        reps: usize,
        /// Precisions of products with quantized weights, e.g. `exact,q8` (every device
        /// set runs at each; repetitions interleave).
        #[arg(long, value_delimiter = ',', value_parser = parse_precision, default_value = "exact")]
        precision: Vec<Precision>,
        /// Shorthand for `--precision q8`.
        #[arg(long, conflicts_with = "precision")]
        q8: bool,
        // The split flags apply to the device sets of several devices.
        #[command(flatten)]
        split: cli::SplitArgs,
        /// With `--dist mpi`, each --devices is this process's one device (one rank per
        /// process of the MPI job); rank 0 prints the report.
        #[command(flatten)]
        dist: cli::DistArgs,
        /// Print the report as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Every split strategy's predicted speed and memory against a measurement, per device set.
    Strategies {
        #[arg(long, default_value = "smollm2")]
        model: String,
        /// Device sets (repeat the flag); each is calibrated first unless --profile is given.
        #[arg(long, default_values_t = vec!["cpu:2x1".to_string(), "cpu:3x1".to_string()])]
        devices: Vec<String>,
        /// Calibrated profiles (`metashard calibrate -o FILE`), one per --devices, in order.
        #[arg(long)]
        profile: Vec<std::path::PathBuf>,
        /// Prompt tokens.
        #[arg(long, default_value_t = 128, value_parser = cli::parse_positive)]
        pp: usize,
        /// Generated tokens.
        #[arg(long, default_value_t = 64, value_parser = cli::parse_positive)]
        tg: usize,
        /// Repetitions (interleaved over the strategies; medians reported).
        #[arg(long, default_value_t = 3, value_parser = cli::parse_positive)]
        reps: usize,
        /// A full calibration of each device set instead of a quick one.
        #[arg(long)]
        full_calibration: bool,
        /// Write an SVG plot of predicted against measured tokens/s with the diagonal.
        #[arg(long)]
        svg: Option<std::path::PathBuf>,
        /// Print the report as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One op at a time on any device through the backend API: a 256 MiB copy, GEMM 4096^3
    /// (F16, BF16, F32 weights), decode GEMV 14336x4096 (Q4_0, Q8_0, F16); medians.
    Backend {
        /// Devices to time, one device each (repeat the flag), e.g. `cuda` or `cpu`.
        #[arg(long, default_values_t = vec!["cpu".to_string()])]
        devices: Vec<String>,
        /// Shrink every shape (a quick check, not a measurement).
        #[arg(long)]
        small: bool,
        /// Only cases whose label contains this text, e.g. "gemv".
        #[arg(long)]
        filter: Option<String>,
        /// Seconds of timed repetitions per case (at least 5 repetitions).
        #[arg(long, default_value_t = 1.0)]
        seconds: f64,
        /// Print the results as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Collective latency and bus bandwidth (all-reduce, all-gather, reduce-scatter of f32): in
    /// process over --world threads, or over the job's processes with --dist mpi under mpirun.
    Comm {
        #[command(flatten)]
        dist: cli::DistArgs,
        /// Ranks of the in-process communicator (without --dist mpi).
        #[arg(long, default_value_t = 2)]
        world: usize,
        /// Buffer sizes in bytes.
        #[arg(long, value_delimiter = ',', default_values_t = vec![65536usize, 1 << 20, 16 << 20])]
        bytes: Vec<usize>,
        /// Timed calls per size (median reported; at least 1).
        #[arg(long, default_value_t = 20, value_parser = cli::parse_positive)]
        reps: usize,
        /// Print the rows as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Tensor parallelism on one host: plain cpu:1x2 vs meta over cpu:2x1 vs meta over cpu:1x2.
    Meta {
        /// The graph: a transformer block or ggml's 4-layer MLP stack.
        #[arg(long, value_enum, default_value = "block")]
        graph: bench::meta::BenchGraph,
        /// Token counts per step (each in 1..=4096).
        #[arg(long, value_delimiter = ',', default_value = "1,128")]
        tokens: Vec<usize>,
        /// Timed steps per configuration (median reported; at least 1).
        #[arg(long, default_value_t = 20, value_parser = cli::parse_positive)]
        reps: usize,
        /// Use the fused attention kernel in the block.
        #[arg(long)]
        fused_attn: bool,
        /// Print the report as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn main() {
    // Library events (the communicator chosen, the sharding of each new graph at debug) go to
    // stderr, filtered by METASHARD_LOG (e.g. `info`, `metashard::meta=debug`); warnings only
    // by default.
    let filter = tracing_subscriber::EnvFilter::try_from_env("METASHARD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        // Under mpirun, say which process failed. One write of the whole line: stderr is
        // unbuffered, and mpirun interleaves the ranks' output between writes.
        cli::eprint_line(match metashard::dist::current_rank() {
            Some(r) => format!("error (rank {r}): {e}"),
            None => format!("error: {e}"),
        });
        std::process::exit(1);
    }
    // With ranks as processes, leave the MPI job cleanly.
    metashard::dist::finalize();
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Devices { devices, json } => devices_cmd(devices.as_deref(), json),
        Cmd::Run(a) => cli::run::run(&a),
        Cmd::Verify(a) => cli::verify::run(&a),
        Cmd::Embed(opts) => cli::embed::run(&opts, &mut std::io::stdout().lock()),
        Cmd::Plan(a) => cli::plan::run(&a),
        Cmd::Calibrate(a) => cli::calibrate::run(&a),
        Cmd::Selftest { what } => match what {
            SelftestCmd::Comm {
                dist,
                timeout_ms,
                fault,
            } => {
                let t = std::time::Instant::now();
                let n = bench::comm::selftest(
                    dist.dist,
                    std::time::Duration::from_millis(timeout_ms),
                    fault,
                )?;
                let (rank, world) = metashard::dist::rank_and_size(dist.dist)?;
                println!(
                    "rank {rank} of {world}: {n} collectives bit-identical to the in-process \
                     communicator ({:.2} s)",
                    t.elapsed().as_secs_f64()
                );
                Ok(())
            }
        },
        Cmd::Bench { what } => match what {
            BenchCmd::Backend {
                devices,
                small,
                filter,
                seconds,
                json,
            } => {
                if !(seconds.is_finite() && seconds >= 0.0) {
                    return Err(metashard::Error::invalid_argument(
                        "--seconds",
                        seconds,
                        "a finite, non-negative number of seconds",
                    ));
                }
                let opts = bench::backend::BackendBenchOptions {
                    devices,
                    small,
                    filter,
                    min_time: std::time::Duration::from_secs_f64(seconds),
                };
                let results = bench::backend::run(&opts, &|line| eprintln!("{line}"))?;
                if json {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&results).map_err(|source| {
                            metashard::Error::Json {
                                what: "bench backend results",
                                source,
                            }
                        })?
                    );
                } else {
                    bench::backend::print_table(&results);
                }
                Ok(())
            }
            BenchCmd::Comm {
                dist,
                world,
                bytes,
                reps,
                json,
            } => {
                let rows = bench::comm::bench(dist.dist, world, &bytes, reps)?;
                if metashard::dist::rank_and_size(dist.dist)?.0 == 0 {
                    if json {
                        println!("{}", to_json(&rows)?);
                    } else {
                        bench::comm::print_table(&rows);
                    }
                }
                Ok(())
            }
            BenchCmd::Ops {
                threads,
                filter,
                precision,
                q8,
                m,
                numpy,
                no_rotate,
                json,
            } => {
                let opts = bench::ops::OpsBenchOptions {
                    threads,
                    precisions: precisions(precision, q8),
                    ms: m,
                    filter,
                    rotate: !no_rotate,
                    ..Default::default()
                };
                bench_ops(opts, numpy, json)
            }
            BenchCmd::Model {
                model,
                devices,
                pp,
                tg,
                reps,
                precision,
                q8,
                split,
                dist,
                json,
            } => {
                // The split flags apply to the device sets of several devices.
                for d in &devices {
                    if parse_devices(d)?.len() > 1 && dist.dist == metashard::dist::Dist::Local {
                        split.check(d)?;
                    }
                }
                let leader = metashard::dist::rank_and_size(dist.dist)?.0 == 0;
                let opts = bench::model::ModelBenchOptions {
                    model,
                    devices,
                    pp,
                    tg,
                    reps,
                    precisions: precisions(precision, q8),
                    split,
                    dist: dist.dist,
                };
                let report = bench::model::run(&opts, &|line| {
                    if leader {
                        eprintln!("{line}")
                    }
                })?;
                if !leader {
                    return Ok(());
                }
                if json {
                    println!("{}", to_json(&report)?);
                } else {
                    bench::model::print_table(&report);
                }
                Ok(())
            }
            BenchCmd::Strategies {
                model,
                devices,
                profile,
                pp,
                tg,
                reps,
                full_calibration,
                svg,
                json,
            } => {
                for d in &devices {
                    metashard::parse_devices(d)?;
                }
                let opts = bench::strategies::StrategiesBenchOptions {
                    model,
                    devices,
                    profiles: profile,
                    pp,
                    tg,
                    reps,
                    full_calibration,
                };
                let report = bench::strategies::run(&opts, &|line| eprintln!("{line}"))?;
                if let Some(p) = &svg {
                    std::fs::write(p, bench::strategies::svg(&report))
                        .map_err(|e| metashard::Error::io(p, e))?;
                }
                if json {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&report).map_err(|source| {
                            metashard::Error::Json {
                                what: "bench strategies report",
                                source,
                            }
                        })?
                    );
                } else {
                    bench::strategies::print_table(&report);
                }
                Ok(())
            }
            BenchCmd::Meta {
                graph,
                tokens,
                reps,
                fused_attn,
                json,
            } => {
                if let Some(&t) = tokens.iter().find(|&&t| t == 0 || t > 4096) {
                    return Err(metashard::Error::invalid_argument(
                        "--tokens",
                        t,
                        "token counts must be in 1..=4096",
                    ));
                }
                let opts = bench::meta::MetaBenchOptions {
                    graph,
                    tokens,
                    reps,
                    fused_attn,
                };
                let report = bench::meta::run(&opts, &|line| eprintln!("{line}"))?;
                if json {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&report).map_err(|source| {
                            metashard::Error::Json {
                                what: "bench meta report",
                                source,
                            }
                        })?
                    );
                } else {
                    bench::meta::print_table(&report);
                }
                Ok(())
            }
        },
    }
}

/// `--precision` values, or the one given by `--q8`.
fn precisions(list: Vec<Precision>, q8: bool) -> Vec<Precision> {
    if q8 { vec![Precision::Q8] } else { list }
}

fn parse_precision(s: &str) -> std::result::Result<Precision, String> {
    Precision::from_name(s).ok_or_else(|| format!("`{s}` is not one of exact, q8"))
}

fn bench_ops(opts: bench::ops::OpsBenchOptions, numpy: bool, json: bool) -> Result<()> {
    let (threads, filter) = (opts.threads.clone(), opts.filter.clone());
    let results = bench::ops::run(&opts)?;
    let refs = if numpy {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/bench_numpy.py");
        let t: Vec<String> = threads.iter().map(|t| t.to_string()).collect();
        let mut cmd = std::process::Command::new("python3");
        cmd.arg(&script)
            .arg("--threads")
            .arg(t.join(","))
            .arg("--json");
        if let Some(f) = &filter {
            cmd.arg("--filter").arg(f);
        }
        eprintln!("timing numpy ...");
        let out = cmd.output().map_err(|e| metashard::Error::io(&script, e))?;
        if !out.status.success() {
            return Err(metashard::Error::ProgramFailed {
                program: script,
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        bench::ops::parse_refs(
            &String::from_utf8_lossy(&out.stdout),
            "bench_numpy.py output",
        )?
    } else {
        Vec::new()
    };
    if json {
        println!("{}", bench::ops::to_json(&results));
    } else {
        print!("{}", bench::ops::print_table(&results, &refs));
    }
    Ok(())
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string_pretty(v).map_err(|source| metashard::Error::Json {
        what: "command output",
        source,
    })
}

fn devices_cmd(spec: Option<&str>, json: bool) -> Result<()> {
    let devices = match spec {
        Some(s) => parse_devices(s)?,
        None => metashard::devices::registries()
            .iter()
            .flat_map(|r| r.devices())
            .collect(),
    };
    let rows: Vec<serde_json::Value> = devices
        .iter()
        .map(|d| {
            let m = d.memory();
            serde_json::json!({
                "name": d.name(),
                "kind": format!("{:?}", d.kind()),
                "description": d.description(),
                "memory_total": m.total,
                "memory_free": m.free,
            })
        })
        .collect();
    if json {
        println!("{}", serde_json::Value::Array(rows));
    } else {
        println!(
            "{:<8} {:<6} {:>12} {:>12}  description",
            "name", "kind", "total MiB", "free MiB"
        );
        for r in rows {
            println!(
                "{:<8} {:<6} {:>12} {:>12}  {}",
                r["name"].as_str().unwrap_or(""),
                r["kind"].as_str().unwrap_or(""),
                r["memory_total"].as_u64().unwrap_or(0) / 1048576,
                r["memory_free"].as_u64().unwrap_or(0) / 1048576,
                r["description"].as_str().unwrap_or("")
            );
        }
    }
    Ok(())
}
