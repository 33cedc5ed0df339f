//! Where a layer or hybrid split's computes go (`METASHARD_STEP_PROFILE=1`, the switch of the
//! meta device's step profile): each backend's time per split run in its inputs and copies
//! in, its compute, and its captures and outputs out; for the pipelined computes
//! (`graph_compute_many`, micro-batches), each tick's wall time against its busiest backend's
//! time (the difference: threads started and joined, the host's work between ticks). The sums
//! per compute are printed to stderr when the scheduler is dropped. Comparing a backend's
//! compute per micro-batch with the same rows computed alone tells how much running the
//! stages at once slows each (devices sharing cores); that is what the cost model's steady
//! state of a pipeline must price (`planner/layer.rs`). Off, it costs one read of a set flag
//! per split.

use std::time::Instant;

/// Whether the profile is on (`METASHARD_STEP_PROFILE`, as for the meta device).
pub(super) fn enabled() -> bool {
    crate::meta::step_profile_enabled()
}

/// A clock read where the profile is on.
pub(super) fn now() -> Option<Instant> {
    enabled().then(Instant::now)
}

/// Nanoseconds since `t` (0 where the profile is off).
pub(super) fn since(t: Option<Instant>) -> u64 {
    t.map_or(0, |t| t.elapsed().as_nanos() as u64)
}

/// One split run's times, nanoseconds: inputs and copies in, compute, captures and outputs
/// out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct SplitTimes {
    pub backend: usize,
    pub input: u64,
    pub compute: u64,
    pub output: u64,
}

impl SplitTimes {
    fn total(&self) -> u64 {
        self.input + self.compute + self.output
    }
}

/// Sums over the computes profiled, nanoseconds.
#[derive(Default)]
pub(super) struct SchedProfile {
    computes: u64,
    graphs: u64,
    wall: u64,
    /// Per backend: split runs, in, compute, out.
    per_backend: Vec<[u64; 4]>,
    /// Pipelined computes: ticks, their wall time, their busiest backend's time.
    ticks: u64,
    tick_wall: u64,
    tick_busiest: u64,
    /// Wall time by the tick's position in its compute (fill, steady state, drain).
    by_position: Vec<u64>,
}

impl SchedProfile {
    /// One compute of `graphs` graphs taking `wall` in all.
    pub fn compute(&mut self, graphs: usize, wall: u64) {
        self.computes += 1;
        self.graphs += graphs as u64;
        self.wall += wall;
    }

    /// Split runs of one compute (or of one tick).
    pub fn splits(&mut self, runs: &[SplitTimes]) {
        for r in runs {
            if self.per_backend.len() <= r.backend {
                self.per_backend.resize(r.backend + 1, [0; 4]);
            }
            let b = &mut self.per_backend[r.backend];
            b[0] += 1;
            b[1] += r.input;
            b[2] += r.compute;
            b[3] += r.output;
        }
    }

    /// Tick `position` of a pipelined compute: its wall time and its runs (a backend's runs of
    /// one tick one after another).
    pub fn tick(&mut self, position: usize, wall: u64, runs: &[SplitTimes]) {
        self.ticks += 1;
        self.tick_wall += wall;
        if self.by_position.len() <= position {
            self.by_position.resize(position + 1, 0);
        }
        self.by_position[position] += wall;
        let mut busy: Vec<u64> = Vec::new();
        for r in runs {
            if busy.len() <= r.backend {
                busy.resize(r.backend + 1, 0);
            }
            busy[r.backend] += r.total();
        }
        self.tick_busiest += busy.into_iter().max().unwrap_or(0);
        self.splits(runs);
    }

    /// The report, per compute in microseconds; None before any compute.
    pub fn report(&self, names: &[String]) -> Option<String> {
        use std::fmt::Write;
        if self.computes == 0 {
            return None;
        }
        let per = |x: u64| x as f64 / self.computes as f64;
        let us = |ns: u64| per(ns) / 1e3;
        let mut s = format!(
            "scheduler profile (METASHARD_STEP_PROFILE), mean of {} computes ({:.2} graphs \
             each), us:\n  wall {:.1}\n",
            self.computes,
            per(self.graphs),
            us(self.wall),
        );
        if self.ticks > 0 {
            let _ = writeln!(
                s,
                "  pipelined: {:.2} ticks, wall {:.1}, busiest backend {:.1} (the rest: threads \
                 started and joined)",
                per(self.ticks),
                us(self.tick_wall),
                us(self.tick_busiest)
            );
            let walls: Vec<String> = self
                .by_position
                .iter()
                .map(|&ns| format!("{:.1}", us(ns)))
                .collect();
            let _ = writeln!(
                s,
                "  ticks in order (fill, steady state, drain): {}",
                walls.join(" / ")
            );
        }
        let _ = writeln!(
            s,
            "  {:<24} {:>6} {:>9} {:>10} {:>9}",
            "backend", "runs", "in", "compute", "out"
        );
        for (b, t) in self.per_backend.iter().enumerate() {
            let name = names.get(b).map_or("?", String::as_str);
            let _ = writeln!(
                s,
                "  {name:<24} {:>6.2} {:>9.1} {:>10.1} {:>9.1}",
                per(t[0]),
                us(t[1]),
                us(t[2]),
                us(t[3])
            );
        }
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tick counts its busiest backend's runs together (one after another on its thread);
    /// the report gives means per compute.
    #[test]
    fn a_tick_takes_its_busiest_backend_and_the_report_is_per_compute() {
        let mut p = SchedProfile::default();
        assert!(p.report(&[]).is_none());
        let t = |backend, compute| SplitTimes {
            backend,
            input: 1000,
            compute,
            output: 1000,
        };
        p.tick(0, 50_000, &[t(0, 10_000), t(1, 30_000)]);
        p.tick(1, 60_000, &[t(1, 20_000), t(1, 20_000)]);
        p.compute(2, 110_000);
        assert_eq!(p.ticks, 2);
        assert_eq!(p.tick_wall, 110_000);
        assert_eq!(p.tick_busiest, 32_000 + 44_000);
        assert_eq!(
            p.per_backend,
            vec![[1, 1000, 10_000, 1000], [3, 3000, 70_000, 3000]]
        );
        let r = p.report(&["a".into(), "b".into()]).unwrap();
        assert!(
            r.contains("2.00 graphs") && r.contains("busiest backend 76.0"),
            "{r}"
        );
        // Backend b's line: 3 runs, 3 us in, 70 us of compute, 3 us out, in one compute.
        let b = r
            .lines()
            .find(|l| l.trim_start().starts_with("b "))
            .unwrap();
        let cols: Vec<&str> = b.split_whitespace().collect();
        assert_eq!(cols, ["b", "3.00", "3.0", "70.0", "3.0"], "{r}");
        assert!(r.contains("drain): 50.0 / 60.0"), "{r}");
    }
}
