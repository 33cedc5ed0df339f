//! The `metashard` command line: list devices, run and verify models across devices,
//! calibrate the planner's cost model, and benchmark kernels, the meta backend and models.

mod bench;
mod cli;

use clap::{Parser, Subcommand};
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
        what: bench::BenchCmd,
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
        Cmd::Bench { what } => bench::run(&what),
    }
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
