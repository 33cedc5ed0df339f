//! Where a meta device's decoding (or any) step goes, stage by stage
//! (`METASHARD_STEP_PROFILE=1`): each device's job times its uploads and every stage of its
//! program; a step then adds up, stage by stage, the slowest device's compute and the later
//! device's time inside each collective (the cost of the collective itself: the earlier
//! devices also wait for the later one's work there), and the host's time before the devices
//! start (the plan-cache lookup, the dispatch) and after they finish (results bound). The
//! sums per step are printed to stderr when the backend is dropped. This is how the cost
//! model's misses on a cpu:2x1 step were found (docs/planner.md, "Predictions held against
//! measurements"). Off, it costs three reads of a set flag per step.

use std::sync::OnceLock;

/// Whether `METASHARD_STEP_PROFILE` is set to anything but `0` or empty.
pub(super) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("METASHARD_STEP_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0")
    })
}

/// One device's times of one step, nanoseconds: its uploads, then each stage (whether it is
/// a collective, its time).
#[derive(Default)]
pub(super) struct DeviceTimes {
    pub uploads: u64,
    pub stages: Vec<(bool, u64)>,
}

/// Sums over the steps profiled, nanoseconds.
#[derive(Default)]
pub(super) struct StepProfile {
    steps: u64,
    before: u64,
    devices: u64,
    after: u64,
    /// Per device: uploads, compute stages, collective stages.
    per_device: Vec<[u64; 3]>,
    /// Per stage: the slowest device's compute, the later device's collective time.
    critical: [u64; 2],
}

impl StepProfile {
    /// One step: `before` the devices started, the devices' wall time, `after` they finished,
    /// and each device's times.
    pub fn add(&mut self, before: u64, devices: u64, after: u64, times: &[DeviceTimes]) {
        self.steps += 1;
        self.before += before;
        self.devices += devices;
        self.after += after;
        self.per_device
            .resize(self.per_device.len().max(times.len()), [0; 3]);
        for (sum, t) in self.per_device.iter_mut().zip(times) {
            sum[0] += t.uploads;
            for &(coll, ns) in &t.stages {
                sum[if coll { 2 } else { 1 }] += ns;
            }
        }
        let stages = times.iter().map(|t| t.stages.len()).max().unwrap_or(0);
        for i in 0..stages {
            let at = times.iter().filter_map(|t| t.stages.get(i));
            if times.iter().any(|t| t.stages.get(i).is_some_and(|s| s.0)) {
                self.critical[1] += at.map(|s| s.1).min().unwrap_or(0);
            } else {
                self.critical[0] += at.map(|s| s.1).max().unwrap_or(0);
            }
        }
    }

    /// The report, per step in microseconds; None before any step.
    pub fn report(&self, names: &[String]) -> Option<String> {
        use std::fmt::Write;
        if self.steps == 0 {
            return None;
        }
        let us = |ns: u64| ns as f64 / self.steps as f64 / 1e3;
        let mut s = format!(
            "step profile (METASHARD_STEP_PROFILE), mean of {} steps, us:\n  host before the \
             devices {:.1} (plan-cache lookup, dispatch), devices {:.1}, host after {:.1}\n  \
             critical path: compute {:.1} (the slowest device at each stage), collectives {:.1} \
             (the later device's time in each)\n",
            self.steps,
            us(self.before),
            us(self.devices),
            us(self.after),
            us(self.critical[0]),
            us(self.critical[1]),
        );
        let _ = writeln!(
            s,
            "  {:<10} {:>9} {:>9} {:>12}",
            "device", "uploads", "compute", "collectives"
        );
        for (d, sum) in self.per_device.iter().enumerate() {
            let name = names.get(d).map_or("?", String::as_str);
            let _ = writeln!(
                s,
                "  {name:<10} {:>9.1} {:>9.1} {:>12.1}",
                us(sum[0]),
                us(sum[1]),
                us(sum[2])
            );
        }
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The critical path takes the slowest device's compute and the later device's time in a
    /// collective, stage by stage.
    #[test]
    fn the_critical_path_is_the_slowest_compute_and_the_shortest_wait() {
        let mut p = StepProfile::default();
        let t = |stages: Vec<(bool, u64)>| DeviceTimes { uploads: 5, stages };
        let us = 1000;
        p.add(
            10 * us,
            400 * us,
            20 * us,
            &[
                t(vec![(false, 100 * us), (true, 50 * us), (false, 200 * us)]),
                t(vec![(false, 150 * us), (true, 8 * us), (false, 180 * us)]),
            ],
        );
        assert_eq!(p.critical, [350 * us, 8 * us]);
        assert_eq!(
            p.per_device,
            vec![[5, 300 * us, 50 * us], [5, 330 * us, 8 * us]]
        );
        let r = p.report(&["a".into(), "b".into()]).unwrap();
        assert!(
            r.contains("compute 350.0") && r.contains("collectives 8.0"),
            "{r}"
        );
        assert!(StepProfile::default().report(&[]).is_none());
    }
}
