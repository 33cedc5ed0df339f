//! `metashard selftest`: self-checks of this build on this machine. `selftest comm` runs the
//! job's communicator against the in-process one, bit for bit (the check itself, with its
//! fault injection, is in `src/bench/comm.rs`, beside `bench comm`).

use crate::bench::comm::{Fault, parse_fault, selftest};
use metashard::Result;
use std::time::{Duration, Instant};

#[derive(clap::Subcommand)]
pub enum SelftestCmd {
    /// The job's communicator (ranks as processes: `mpirun -np N metashard selftest comm
    /// --dist mpi`) against the in-process one, bit for bit, on every collective.
    Comm(SelftestCommArgs),
}

/// Run the self-check `what` names.
pub fn run(what: &SelftestCmd) -> Result<()> {
    match what {
        SelftestCmd::Comm(a) => comm(a),
    }
}

#[derive(Clone, Debug, clap::Args)]
pub struct SelftestCommArgs {
    #[command(flatten)]
    pub dist: super::DistArgs,
    /// How long a rank waits for a peer before naming it, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// Inject a fault: `HOW@RANK:CALL` with HOW one of kill, exit, stall, error, finish
    /// (rank RANK does it before its collective number CALL; finish: it stops there and ends
    /// normally, as a rank given less work would).
    #[arg(long, value_parser = parse_fault)]
    pub fault: Option<Fault>,
}

/// `selftest comm`: every collective on the job's communicator, compared with the in-process
/// one; one line per rank.
pub fn comm(a: &SelftestCommArgs) -> Result<()> {
    let t = Instant::now();
    let n = selftest(a.dist.dist, Duration::from_millis(a.timeout_ms), a.fault)?;
    let (rank, world) = metashard::dist::rank_and_size(a.dist.dist)?;
    println!(
        "rank {rank} of {world}: {n} collectives bit-identical to the in-process \
         communicator ({:.2} s)",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
