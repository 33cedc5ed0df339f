//! Benchmarks behind `metashard bench`: each subcommand's arguments and `run` in its own file
//! (the per-op kernel benchmark [`ops`], the cost of tensor parallelism on one host [`meta`], a
//! real model's prompt and generation throughput per device set [`model`], every split
//! strategy's prediction against a measurement [`strategies`], one op at a time on any device
//! through the backend API [`backend`], the collectives' bandwidth [`comm`], sequences decoded
//! together [`batch`], an OpenAI-compatible server under load [`serve`]), and here the
//! dispatch and timing helpers that report medians.

pub mod backend;
pub mod batch;
pub mod comm;
pub mod meta;
pub mod model;
pub mod ops;
pub mod routing;
pub mod serve;
pub mod strategies;

use metashard::Result;
use std::time::{Duration, Instant};

#[derive(clap::Subcommand)]
pub enum BenchCmd {
    /// Matrix-product kernels on a fixed set of shapes (table, or JSON with --json).
    Ops(ops::BenchOpsArgs),
    /// A real model's prompt (pp) and generation (tg) tokens/s on each device set.
    Model(model::BenchModelArgs),
    /// Every split strategy's predicted speed and memory against a measurement, per device set.
    Strategies(strategies::BenchStrategiesArgs),
    /// One op at a time on any device through the backend API: a 256 MiB copy, GEMM 4096^3
    /// (F16, BF16, F32 weights), decode GEMV 14336x4096 (Q4_0, Q8_0, F16); medians.
    Backend(backend::BenchBackendArgs),
    /// Collective latency and bus bandwidth (all-reduce, all-gather, reduce-scatter of f32): in
    /// process over --world threads, or over the job's processes with --dist mpi under mpirun.
    Comm(comm::BenchCommArgs),
    /// Tensor parallelism on one host: plain cpu:1x2 vs meta over cpu:2x1 vs meta over cpu:1x2.
    Meta(meta::BenchMetaArgs),
    /// Aggregate generation tokens/s of S sequences decoded together in one KV cache, for
    /// each S of --parallel.
    Batch(batch::BenchBatchArgs),
    /// An OpenAI-compatible server under load (`metashard serve`, started on a loopback port,
    /// or any server at --url): aggregate tokens/s, time to first token and inter-token
    /// latency for each concurrency of --concurrency.
    Serve(serve::BenchServeArgs),
}

/// Run the benchmark `what` names.
pub fn run(what: &BenchCmd) -> Result<()> {
    match what {
        BenchCmd::Ops(a) => ops::run(a),
        BenchCmd::Model(a) => model::run(a),
        BenchCmd::Strategies(a) => strategies::run(a),
        BenchCmd::Backend(a) => backend::run(a),
        BenchCmd::Comm(a) => comm::run(a),
        BenchCmd::Meta(a) => meta::run(a),
        BenchCmd::Batch(a) => batch::run(a),
        BenchCmd::Serve(a) => serve::run(a),
    }
}

/// How long and how often to repeat a measurement.
#[derive(Clone, Copy, Debug)]
pub struct Repeat {
    /// Untimed runs first (page faults, caches, CPU clocks).
    pub warmup: usize,
    /// At least this many timed runs ...
    pub min_reps: usize,
    /// ... and at least this much timed time, unless `max_reps` is reached first.
    pub min_time: Duration,
    pub max_reps: usize,
}

impl Default for Repeat {
    fn default() -> Self {
        Repeat {
            warmup: 2,
            min_reps: 10,
            min_time: Duration::from_millis(1000),
            max_reps: 500,
        }
    }
}

/// Timings of one measurement, in microseconds.
#[derive(Clone, Debug)]
pub struct Timing {
    pub median_us: f64,
    pub min_us: f64,
    pub reps: usize,
}

/// Run `f` per `rep` and return the median and minimum wall time. `f(i)` gets the repetition
/// index (warm-up runs included), so a benchmark can rotate between input copies.
pub fn time_it(rep: &Repeat, mut f: impl FnMut(usize)) -> Timing {
    let mut i = 0;
    for _ in 0..rep.warmup {
        f(i);
        i += 1;
    }
    let mut times = Vec::with_capacity(rep.min_reps);
    let start = Instant::now();
    while times.len() < rep.max_reps.max(1)
        && (times.len() < rep.min_reps || start.elapsed() < rep.min_time)
    {
        let t = Instant::now();
        f(i);
        times.push(t.elapsed().as_secs_f64() * 1e6);
        i += 1;
    }
    times.sort_by(f64::total_cmp);
    Timing {
        median_us: median(&times),
        min_us: times[0],
        reps: times.len(),
    }
}

/// Median of sorted values (mean of the middle two for an even count).
fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_repetition_counts() {
        assert_eq!(median(&[1.0, 2.0, 10.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 4.0, 10.0]), 3.0);
        let rep = Repeat {
            warmup: 3,
            min_reps: 5,
            min_time: Duration::ZERO,
            max_reps: 7,
        };
        let mut seen = Vec::new();
        let t = time_it(&rep, |i| seen.push(i));
        assert_eq!(t.reps, 5);
        assert_eq!(seen, (0..8).collect::<Vec<_>>());
        assert!(t.min_us <= t.median_us);
    }
}
