//! The `metashard` command line: list devices, run and verify models across devices,
//! calibrate the planner's cost model, and benchmark kernels, the meta backend and models.
//! This file only dispatches: each subcommand's arguments and `run` are in its own file under
//! `src/cli/` (`src/bench/` for `bench`). A subcommand's error is printed here, with exit
//! code 1; clap's own (a bad flag or value) exit with 2.

mod bench;
mod cli;

use clap::{Parser, Subcommand};
use metashard::Result;

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
    Devices(cli::devices::DevicesArgs),
    /// Generate text with a GGUF decoder on a device set.
    Run(cli::run::RunArgs),
    /// Check a sharded run against one device (and the numpy reference with --reference).
    Verify(cli::verify::VerifyArgs),
    /// Sentence embeddings with a BERT encoder (all-MiniLM-L6-v2) on any device list.
    Embed(cli::embed::EmbedArgs),
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
        what: cli::selftest::SelftestCmd,
    },
}

fn run(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Devices(a) => cli::devices::run(&a),
        Cmd::Run(a) => cli::run::run(&a),
        Cmd::Verify(a) => cli::verify::run(&a),
        Cmd::Embed(a) => cli::embed::run(&a, &mut std::io::stdout().lock()),
        Cmd::Plan(a) => cli::plan::run(&a),
        Cmd::Calibrate(a) => cli::calibrate::run(&a),
        Cmd::Bench { what } => bench::run(&what),
        Cmd::Selftest { what } => cli::selftest::run(&what),
    }
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
    if let Err(e) = run(cli.cmd) {
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
