//! Benchmarks behind `metashard bench`: timing helpers that report medians, the per-op
//! kernel benchmark ([`ops`]), the cost of tensor parallelism on one host ([`meta`]) and a real
//! model's prompt and generation throughput per device set ([`model`]), and one op at a time
//! on any device through the backend API ([`backend`]).

pub mod backend;
pub mod comm;
pub mod meta;
pub mod model;
pub mod ops;
pub mod strategies;

use std::time::{Duration, Instant};

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
