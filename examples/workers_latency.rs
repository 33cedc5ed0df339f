//! Round-trip time of `DeviceWorkers::run` with empty jobs: what the meta backend pays per step
//! to hand each device its program and learn that all returned, after an idle gap like the one
//! a decode loop leaves between steps (sampling, building the next graph).
//!
//! `cargo run --release --example workers_latency [N]`

use metashard::workers::{DeviceWorkers, Job, Progress};
use std::time::{Duration, Instant};

fn main() -> metashard::Result<()> {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let mut w = DeviceWorkers::new(n, "latency")?;
    for gap_us in [0u64, 50, 200, 1000] {
        let mut v = Vec::new();
        for _ in 0..300 {
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_micros(gap_us) {
                std::hint::spin_loop();
            }
            let t = Instant::now();
            let jobs: Vec<Job> = (0..n).map(|_| Box::new(|_: &Progress| {}) as Job).collect();
            w.run(jobs, Duration::from_secs(10), &|_| {})?;
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
        v.sort_by(f64::total_cmp);
        println!(
            "{n} workers, idle gap {gap_us:>5} us: round trip median {:.1} us, p90 {:.1} us",
            v[v.len() / 2],
            v[v.len() * 9 / 10]
        );
    }
    Ok(())
}
