//! The `metashard` command line: list devices, run and verify models across devices,
//! calibrate the planner's cost model, and benchmark kernels, the meta backend and models.
//! This file only dispatches: each subcommand's arguments and `run` are in its own file under
//! `src/cli/` (`src/bench/` for `bench`). A subcommand's error is printed here, with exit
//! code 1; clap's own (a bad flag or value) exit with 2.
//!
//! A closed stdout (`metashard plan | head -1`) ends the program quietly, as Unix tools do:
//! the process is ended by SIGPIPE, with no message (a shell shows status 141, 128 + 13; a
//! parent process sees "killed by signal 13"). SIGPIPE gets its default action back at
//! start-up (Rust programs ignore it), so every print of every command ends there; with ranks
//! as processes MPI's sockets need it ignored again, and a print to a closed stdout then ends
//! the process the same way ([`cli::stdout_closed`], through the panic hook below for
//! `println!`).

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
    /// Quantize a GGUF file of F32/F16/BF16 weights (llama.cpp's types and mixes).
    Quantize(cli::quantize::QuantizeArgs),
    /// Serve a GGUF decoder over HTTP with the OpenAI API's shapes (completions, chat
    /// completions, streamed or whole), many requests decoded together.
    Serve(cli::serve::ServeArgs),
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
        Cmd::Quantize(a) => cli::quantize::run(&a),
        Cmd::Serve(a) => cli::serve::run(&a),
        Cmd::Bench { what } => bench::run(&what),
        Cmd::Selftest { what } => cli::selftest::run(&what),
    }
}

fn main() {
    // SAFETY: restoring a signal's default action touches no memory of ours; no other thread
    // runs yet.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    cli::end_quietly_on_closed_stdout();
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
    // With ranks as processes, end the job cleanly: every rank says it finished.
    if let Err(e) = run(cli.cmd).and_then(|()| metashard::dist::finalize()) {
        // The other ranks learn at once that this one failed, and why.
        metashard::dist::abort(&e.to_string());
        // Under mpirun, say which process failed. One write of the whole line: stderr is
        // unbuffered, and mpirun interleaves the ranks' output between writes.
        let rank = metashard::dist::current_rank().or_else(metashard::dist::launcher_rank);
        cli::eprint_line(match rank {
            Some(r) => format!("error (rank {r}): {e}"),
            None => format!("error: {e}"),
        });
        std::process::exit(1);
    }
}
