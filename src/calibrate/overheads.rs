//! Step and node overheads through the backend a run uses (`DeviceSet::open`: the device's own
//! for one device, the meta device's for several), each step timed as a program runs it.

use super::device_rates::chain_graph;
use super::options::{Budget, SHORT_CHAIN, STEP_GAP};
use super::rig::median;
use crate::Result;
use crate::cpu::Precision;
use crate::devices::DeviceSet;
use crate::meta::{MetaOptions, SplitFn};
use crate::split_state::SplitState;
use std::sync::Arc;
use std::time::Instant;

/// Every tensor mirrored: the chains have no weights, so this is never asked; a run's split
/// would be.
fn mirrored() -> SplitFn {
    Arc::new(|t| Ok(SplitState::mirrored(t.n_devices)))
}

/// What [`measure_overheads`] found, in seconds.
pub(super) struct Overheads {
    pub step_s: f64,
    pub node_s: f64,
    pub back_to_back_s: f64,
}

/// Step and node overheads through the backend `DeviceSet::open` gives for `spec` (each step
/// timed as a program runs it: graph built, then computed, on a structure the backend has
/// prepared already, as most decode steps are). The per-node cost is the slope
/// between the fastest chains of [`SHORT_CHAIN`] and `b.chain` nodes run back to back; the
/// step overhead is that of a one-node step after an idle gap of [`STEP_GAP`] (workers
/// parked, as between two decode steps), less its node.
pub(super) fn measure_overheads(spec: &str, precision: Precision, b: &Budget) -> Result<Overheads> {
    let set = DeviceSet::open(spec, precision, MetaOptions::default(), |_| mirrored())?;
    let (mut gap, mut short, mut long) = (Vec::new(), Vec::new(), Vec::new());
    let timed = |k: usize| -> Result<f64> {
        let t = Instant::now();
        let mut g = chain_graph(k)?;
        set.backend.graph_compute(&mut g)?;
        Ok(t.elapsed().as_secs_f64())
    };
    // The series interleave, so a drift in machine speed hits all of them alike.
    for rep in 0..b.step_reps + 3 {
        std::thread::sleep(STEP_GAP);
        let g = timed(SHORT_CHAIN)?;
        let s = timed(SHORT_CHAIN)?;
        // The long chain twice, the second timed: a backend that keeps only its last plan (the
        // CPU backend) reuses it then, as a decode step reuses the step before's (the cache
        // rows attended to grow in steps of `KV_PAD`, so most steps repeat the structure). The
        // short chains repeat the gap step's structure already.
        timed(b.chain)?;
        let l = timed(b.chain)?;
        if rep >= 3 {
            gap.push(g);
            short.push(s);
            long.push(l);
        }
    }
    // The per-node cost is work done every time; interference (a worker that shares its core
    // with the caller, another process) is not, so the slope is taken between the fastest
    // steps of each length. The overheads are medians: interference is part of a step.
    let fastest = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let node_s = ((fastest(&long) - fastest(&short)) / (b.chain - SHORT_CHAIN) as f64).max(0.0);
    let own = SHORT_CHAIN as f64 * node_s;
    Ok(Overheads {
        step_s: (median(&gap) - own).max(0.0),
        node_s,
        back_to_back_s: (median(&short) - own).max(0.0),
    })
}
