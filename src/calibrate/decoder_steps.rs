//! The per-node cost of a real decoding step: a synthetic decoder of a small model's width
//! (24 layers of 512, Q4_1 weights) decoded through the path a run takes
//! (`runtime::open_decoder`, a `Session`), the mean step timed, against the cost model's
//! prediction for the same step on the cluster measured so far. The chains of tiny nodes
//! (`overheads.rs`) and the rates timed graph by graph leave out what a decoder's step does
//! besides computing each node: the model code building the step graph, hashing it against
//! the plan cache, uploading positions and the mask, running each device's plan node by node,
//! the devices meeting at every collective, gathering the logits. The difference per node on
//! the step's critical path is added to the profile's `node_overhead_s` (never taken off it:
//! a slower prediction is the kernels', not the nodes').
//!
//! The decoder was 64 wide until 2026-11-28, so that its kernels cost almost nothing and the
//! difference was the nodes' alone (on cpu:2x1 of the Zen 2 host: 380 us measured against 374
//! predicted once steps reused their graphs). At that width the devices of a step meet every
//! few microseconds and never lose their cores; at a real width they compute for tens of
//! microseconds between collectives, and three one-thread devices on two cores lose about a
//! quarter of a decoding step to taking turns (SmolLM2 on cpu:3x1 of the AVX-512 Xeon: 9.5-11.3
//! ms a step for 16 ms of work on two cores). The 512-wide decoder sees it: 6.7-6.9 ms measured
//! against 5.6-5.8 predicted on cpu:3x1 (+2.1-2.3 us per node), 4.3-4.5 against 4.2-4.5 on
//! cpu:2x1 (0-0.7 us). Charged per node, it is about right for steps of this width and too
//! little for wider ones or batched steps, where the turns cost more compute.

use crate::models::hparams::DecoderConfig;
use crate::models::session::Session;
use crate::models::synthetic::gguf_bytes;
use crate::planner::evaluate::Workload;
use crate::planner::report::evaluate_split;
use crate::planner::{Cluster, ModelShape, Strategy};
use crate::runtime::{OpenOptions, open_decoder};
use crate::{DType, Error, Result};
use std::time::Instant;

/// Layers of the decoder timed: as many as a small model has, so a step has hundreds of nodes.
const LAYERS: usize = 24;
/// Decoding steps per timed span (after two untimed): two `KV_PAD`s of cache rows, so the steps whose
/// attention span grows (a structure the plan caches have not seen: prepared again) are among
/// them as often as in a run.
const STEPS: usize = 2 * crate::models::session::KV_PAD;
/// Spans of [`STEPS`] steps timed, one generation going on through them.
const REPS: usize = 3;

/// Calibrations of this process so far: each writes its decoder file under a name of its own.
static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// What [`measure_decoder_steps`] found, in seconds.
pub(super) struct DecoderSteps {
    /// Mean seconds of one decoding step as run (the fastest span's).
    pub measured_s: f64,
    /// The cost model's seconds for that step on the cluster before the correction.
    pub predicted_s: f64,
    /// Nodes on the step's critical path (the slowest device's at each stage), as the cost
    /// model counts them for `node_overhead_s`.
    pub nodes: f64,
    /// Seconds added to `node_overhead_s`: `(measured - predicted) / nodes`, at least 0.
    pub extra_node_s: f64,
}

/// Decode [`REPS`] spans of [`STEPS`] steps of a synthetic llama of [`LAYERS`] layers of width
/// 512 on `spec` (its default tensor split, `opts` as a run's) and compare the fastest span's
/// mean step with `cluster`'s prediction for a step of that generation.
pub(super) fn measure_decoder_steps(
    spec: &str,
    opts: &OpenOptions,
    cluster: &Cluster,
) -> Result<DecoderSteps> {
    let cfg = DecoderConfig::llama(LAYERS, 512, 1536, 8, 2, 300);
    let bytes = gguf_bytes(&cfg, DType::Q4_1, true, 256, 11)?;
    let path = std::env::temp_dir().join(format!(
        "metashard-calibrate-decoder-{}-{}.gguf",
        std::process::id(),
        FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::write(&path, &bytes).map_err(|e| Error::io(&path, e))?;
    let opened = (|| {
        let shape = ModelShape::from_gguf(&path)?;
        let (set, model) = open_decoder(&path.to_string_lossy(), spec, opts, &|_, _| {})?;
        Ok::<_, Error>((shape, set, model))
    })();
    std::fs::remove_file(&path).ok();
    let (shape, set, model) = opened?;
    let ctx = 2 + REPS * STEPS;
    let mut s = Session::new(&model, set.backend.clone(), set.buffer_type.as_ref(), ctx)?;
    s.eval(&[1], false)?;
    s.eval(&[2], false)?;
    // The mean step, as a generation pays it (the steps that prepare a structure not seen
    // before included: one generation goes on through [`REPS`] spans of [`STEPS`] steps, each
    // reaching new cache sizes); the fastest span's, as the chains' slope is taken between the
    // fastest chains: what every step costs, not another process's interference.
    let mut means = Vec::with_capacity(REPS);
    for r in 0..REPS {
        let t = Instant::now();
        for i in 0..STEPS {
            s.eval(&[3 + ((r * STEPS + i) % 200) as u32], false)?;
        }
        means.push(t.elapsed().as_secs_f64() / STEPS as f64);
    }
    let measured_s = means.iter().copied().fold(f64::INFINITY, f64::min);
    // The prediction, and the nodes it charges `node_overhead_s` for: the same step on a copy
    // of the cluster whose only cost is 1 second per node.
    let split = Strategy::Megatron
        .split(shape.n_layer(), shape.tied)
        .ok_or_else(|| Error::invalid_op("calibrate", "no tensor split for the decoder"))?;
    // The generation timed: its middle step is the one the cost model prices.
    let workload = Workload::parse(&format!("pp=1,tg={},ctx={ctx}", REPS * STEPS))?;
    let step = |c: &Cluster| -> Result<f64> {
        let e = evaluate_split(&shape, &split, c, &workload)?;
        Ok(e.decode.map_or(0.0, |d| d.seconds))
    };
    let predicted_s = step(cluster)?;
    let mut counting = cluster.clone();
    for d in &mut counting.devices {
        d.node_overhead_s = 1.0;
        d.step_overhead_s = 0.0;
    }
    let counted = step(&counting)?;
    // Kernel and collective time is negligible next to a second per node.
    let nodes = counted.round().max(1.0);
    let extra_node_s = ((measured_s - predicted_s) / nodes).max(0.0);
    Ok(DecoderSteps {
        measured_s,
        predicted_s,
        nodes,
        extra_node_s,
    })
}
