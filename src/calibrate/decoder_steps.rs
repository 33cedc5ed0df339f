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
//!
//! So, with the per-node correction in the cluster, the same decoder then takes steps of more
//! rows: a batched decoding step of [`BATCH_ROWS`] sequences, a prompt chunk of
//! [`PROMPT_ROWS`] tokens, and [`BATCH_ROWS`] such chunks in one step (a batch's prompts).
//! Each one's measured over predicted time, as a factor on the prediction's kernel time (the
//! overheads and collectives kept), is the cluster's `step_factor_by_m` at its rows: what
//! the kernels of a real step take beyond the rates timed in long runs (turns taken at every
//! collective, the wait for the slowest device at each, the kernels' speed at these shapes).
//!
//! Those are a tensor split's steps: its devices meet at every half layer and each computes
//! its share of every matrix. On several devices the decoder is opened again mirrored on
//! every device (whole layers through, whole matrices, no collective inside the layers) and
//! its two prompt steps are timed the same way: the cluster's `step_factor_apart_by_m`, for
//! steps whose devices do not meet at every layer (mirrored, vocab split, a layer split's
//! stage). On cpu:3x1 of the AVX-512 Xeon they came out 7-18% below the tensor split's.
//!
//! Last ([`measure_stage_steps`], on the profile with those factors), on several devices the
//! decoder is opened as a layer split (whole layers per device, on the scheduler) and its
//! decoding step of one sequence and its batched step of [`BATCH_ROWS`] are timed: stages
//! that run one after another, each device alone while the others wait. The cost model
//! divides such a step's time by the cluster's alone speedup at its rows; the speedup that
//! makes each prediction its measurement is the profile's `alone_speedup_by_m` at
//! [`ALONE_M`]. Until 2026-11-29 those points came from products timed on the first device
//! alone against all at once; on the Zen 3 host (cpu:2x1) that gave 1.38-1.89 at one row,
//! where SmolLM2's layer split decoded at one device's speed (cpu:1x1 and the layer split both
//! about 50 tokens/s against a prediction of 62-89 with those figures). The same batched step
//! is then timed cut into [`PIPELINE_MICRO_BATCHES`] micro-batches (pipelined through the
//! stages, as `BatchSession::micro_batches` runs them), and its measurement over the cost
//! model's pipelined prediction with those speedups is the profile's `pipeline_factor`: on
//! the Zen 3 host a stage's micro-batch ran 1.2-1.5x slower than the same rows outside the
//! pipeline (`docs/sched.md`), where the model priced two micro-batches 9% faster than one.

use crate::models::batch::{BatchSession, SeqInput};
use crate::models::hparams::DecoderConfig;
use crate::models::layer_split::SplitMode;
use crate::models::loader::DecoderModel;
use crate::models::session::Session;
use crate::models::split::DecoderSplit;
use crate::models::synthetic::gguf_bytes;
use crate::planner::evaluate::{StepCost, Workload};
use crate::planner::report::evaluate_split;
use crate::planner::{Cluster, MicroBatches, ModelShape, Strategy, evaluate_layer_split_with};
use crate::planner::{PIPELINE_FACTOR, STEP_FACTOR};
use crate::runtime::{OpenOptions, open_decoder};
use crate::{DType, DeviceSet, Error, Result};
use std::time::Instant;

/// Layers of the decoder timed: as many as a small model has, so a step has hundreds of nodes.
const LAYERS: usize = 24;
/// Decoding steps per timed span (after two untimed): two `KV_PAD`s of cache rows, so the steps whose
/// attention span grows (a structure the plan caches have not seen: prepared again) are among
/// them as often as in a run.
const STEPS: usize = 2 * crate::models::session::KV_PAD;
/// Spans of [`STEPS`] steps timed, one generation going on through them; the median span's
/// mean step is the figure.
const SPANS: usize = 5;
/// The synthetic decoder's context: the generation of [`SPANS`] spans and its two untimed
/// steps.
const CONTEXT: usize = 2 + SPANS * STEPS;

/// Calibrations of this process so far: each writes its decoder file under a name of its own.
static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Sequences of the batched decoding step timed for [`Cluster::step_factor_by_m`].
pub const BATCH_ROWS: usize = 8;
/// Tokens of the prompt chunk timed for [`Cluster::step_factor_by_m`].
pub const PROMPT_ROWS: usize = 64;
/// Prompts of [`PROMPT_ROWS`] tokens per timed span (after one untimed); the batch of
/// [`BATCH_ROWS`] such prompts in one step is timed once per span.
const PROMPTS: usize = 2;

/// What [`measure_decoder_steps`] found, in seconds.
pub(super) struct DecoderSteps {
    /// Mean seconds of one decoding step as run (the median span's).
    pub measured_s: f64,
    /// The cost model's seconds for that step on the cluster before the correction.
    pub predicted_s: f64,
    /// Nodes on the step's critical path (the slowest device's at each stage), as the cost
    /// model counts them for `node_overhead_s`.
    pub nodes: f64,
    /// Seconds added to `node_overhead_s`: `(measured - predicted) / nodes`, at least 0.
    pub extra_node_s: f64,
    /// The steps of more rows: a batched decoding step of [`BATCH_ROWS`] sequences, a
    /// prompt chunk of [`PROMPT_ROWS`] tokens and [`BATCH_ROWS`] such chunks in one step,
    /// each as run and as predicted after the per-node correction.
    pub rows: Vec<RowsStep>,
    /// The prompt chunk and the batch of prompt chunks again with the decoder mirrored on
    /// every device (as run and as predicted after the per-node correction): the profile's
    /// `step_factor_apart_by_m`. Empty on one device.
    pub apart: Vec<RowsStep>,
}

/// A step of `rows` rows of the small decoder, timed and predicted.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RowsStep {
    pub rows: usize,
    /// Mean seconds of the step as run (the median span's).
    pub measured_s: f64,
    /// The cost model's seconds for it, and the part of them the kernels are (the rest is
    /// the overheads and the collectives).
    pub predicted_s: f64,
    pub predicted_kernels_s: f64,
    /// `1 + (measured - predicted) / predicted kernels`, in [`STEP_FACTOR`]: the factor on
    /// the kernels that makes the prediction the measurement.
    pub factor: f64,
}

/// Rows of the layer split's steps timed for the cluster's `alone_speedup_by_m`: a decoding
/// step of one sequence and a batched decoding step of [`BATCH_ROWS`] sequences.
pub const ALONE_M: [usize; 2] = [1, BATCH_ROWS];

/// Micro-batches of the layer split's pipelined batched step timed for the cluster's
/// `pipeline_factor`.
pub const PIPELINE_MICRO_BATCHES: usize = 2;

/// The small decoder's batched decoding step of [`BATCH_ROWS`] sequences under a layer split
/// cut into [`PIPELINE_MICRO_BATCHES`] micro-batches (pipelined through the stages), timed,
/// and the factor on the cost model's pipelined step that makes its prediction agree.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PipelineStep {
    pub rows: usize,
    pub micro_batches: usize,
    /// Mean seconds of the step as run (the median span's).
    pub measured_s: f64,
    /// The cost model's seconds for it with the alone speedups measured, no pipeline factor.
    pub predicted_s: f64,
    /// `measured / predicted`, in [`PIPELINE_FACTOR`]: the cluster's `pipeline_factor`.
    pub factor: f64,
}

/// A step of `rows` rows of the small decoder under a layer split (stages one after another),
/// timed, and the alone speedup that makes the cost model's prediction agree with it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StageStep {
    pub rows: usize,
    /// Mean seconds of the step as run (the median span's).
    pub measured_s: f64,
    /// The cost model's seconds for it with no alone speedup (every stage at the rates
    /// measured with all devices busy), and the part of them the speedup divides.
    pub predicted_s: f64,
    pub scaled_s: f64,
    /// `scaled / (measured - (predicted - scaled))`, in 1 ..= the device count: the
    /// cluster's `alone_speedup_by_m` at `rows`.
    pub speedup: f64,
}

/// The small decoder timed by a calibration: a synthetic llama of [`LAYERS`] layers of width
/// 512 with Q4_1 weights, as GGUF bytes, opened as often as the measurements need.
pub(super) struct SmallDecoder {
    bytes: Vec<u8>,
}

impl SmallDecoder {
    pub(super) fn new() -> Result<SmallDecoder> {
        let cfg = DecoderConfig::llama(LAYERS, 512, 1536, 8, 2, 300);
        Ok(SmallDecoder {
            bytes: gguf_bytes(&cfg, DType::Q4_1, true, CONTEXT, 11)?,
        })
    }

    /// The decoder opened on `spec` with `opts` (its file written for the open and removed
    /// after).
    fn open(
        &self,
        spec: &str,
        opts: &OpenOptions,
    ) -> Result<(ModelShape, DeviceSet, DecoderModel)> {
        let path = std::env::temp_dir().join(format!(
            "metashard-calibrate-decoder-{}-{}.gguf",
            std::process::id(),
            FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::write(&path, &self.bytes).map_err(|e| Error::io(&path, e))?;
        let opened = (|| {
            let shape = ModelShape::from_gguf(&path)?;
            let (set, model) = open_decoder(&path.to_string_lossy(), spec, opts, &|_, _| {})?;
            Ok::<_, Error>((shape, set, model))
        })();
        std::fs::remove_file(&path).ok();
        opened
    }
}

/// Decode [`SPANS`] spans of [`STEPS`] steps of a synthetic llama of [`LAYERS`] layers of width
/// 512 on `spec` (its default tensor split, `opts` as a run's) and compare the median span's
/// mean step with `cluster`'s prediction for a step of that generation; then, with the
/// per-node difference added to the cluster's `node_overhead_s`, the same for a batched step
/// of [`BATCH_ROWS`] sequences, a prompt chunk of [`PROMPT_ROWS`] tokens, and a step of
/// [`BATCH_ROWS`] such chunks; and on several devices the two prompt steps again with the
/// decoder mirrored on every device (steps whose devices do not meet inside the layers).
pub(super) fn measure_decoder_steps(
    decoder: &SmallDecoder,
    spec: &str,
    opts: &OpenOptions,
    cluster: &Cluster,
) -> Result<DecoderSteps> {
    let (shape, set, model) = decoder.open(spec, opts)?;
    let ctx = CONTEXT;
    let measured_s = time_decode(&model, &set)?;
    // The prediction, and the nodes it charges `node_overhead_s` for: the same step on a copy
    // of the cluster whose only cost is 1 second per node.
    let split_of = |st: Strategy| {
        st.split(shape.n_layer(), shape.tied).ok_or_else(|| {
            Error::invalid_op("calibrate", format!("no {st:?} split for the decoder"))
        })
    };
    let split = split_of(Strategy::Megatron)?;
    let predict = |c: &Cluster, split: &DecoderSplit, w: &str| -> Result<StepCost> {
        let e = evaluate_split(&shape, split, c, &Workload::parse(w)?)?;
        Ok(e.decode.or(e.prefill).unwrap_or_default())
    };
    // The generation timed: its middle step is the one the cost model prices.
    let generation = format!("pp=1,tg={},ctx={ctx}", SPANS * STEPS);
    let predicted_s = predict(cluster, &split, &generation)?.seconds;
    let mut counting = cluster.clone();
    for d in &mut counting.devices {
        d.node_overhead_s = 1.0;
        d.step_overhead_s = 0.0;
    }
    let counted = predict(&counting, &split, &generation)?.seconds;
    // Kernel and collective time is negligible next to a second per node.
    let nodes = counted.round().max(1.0);
    let extra_node_s = ((measured_s - predicted_s) / nodes).max(0.0);

    // Steps of more rows, priced with the per-node correction.
    let mut corrected = cluster.clone();
    for d in &mut corrected.devices {
        d.node_overhead_s += extra_node_s;
    }
    let rows_step = |split: &DecoderSplit, rows: usize, measured_s: f64, w: &str| {
        let p = predict(&corrected, split, w)?;
        let kernels = (p.compute_s - p.overhead_s).max(1e-12);
        let factor = (1.0 + (measured_s - p.seconds) / kernels)
            .clamp(*STEP_FACTOR.start(), *STEP_FACTOR.end());
        Ok::<_, Error>(RowsStep {
            rows,
            measured_s,
            predicted_s: p.seconds,
            predicted_kernels_s: kernels,
            factor,
        })
    };
    let batch_s = time_batched(&model, &set, STEPS, 1)?;
    let batch = rows_step(
        &split,
        BATCH_ROWS,
        batch_s,
        &format!("pp=1,tg={},batch={BATCH_ROWS},ctx={ctx}", SPANS * STEPS),
    )?;
    // The prompt steps: a chunk of PROMPT_ROWS tokens, and BATCH_ROWS such chunks in one step.
    let prompts = |split: &DecoderSplit, model: &DecoderModel, set: &DeviceSet| {
        let (chunk_s, chunks_s) = time_prompts(model, set)?;
        let rows = BATCH_ROWS * PROMPT_ROWS;
        Ok::<_, Error>([
            rows_step(
                split,
                PROMPT_ROWS,
                chunk_s,
                &format!("pp={PROMPT_ROWS},tg=0,ctx={ctx}"),
            )?,
            rows_step(
                split,
                rows,
                chunks_s,
                &format!("pp={PROMPT_ROWS},tg=0,batch={BATCH_ROWS},ctx={rows}"),
            )?,
        ])
    };
    let [chunk, chunks] = prompts(&split, &model, &set)?;
    drop((set, model));
    // The same prompt steps with every device holding the whole decoder: no collective
    // inside the layers, whole matrices per device. One device has no other way to run.
    let apart = match cluster.n_devices() {
        1 => Vec::new(),
        _ => {
            let mirrored = split_of(Strategy::Mirrored)?;
            let (_, set, model) = decoder.open(
                spec,
                &OpenOptions {
                    split: Some(mirrored.clone()),
                    ..opts.clone()
                },
            )?;
            prompts(&mirrored, &model, &set)?.to_vec()
        }
    };
    Ok(DecoderSteps {
        measured_s,
        predicted_s,
        nodes,
        extra_node_s,
        rows: vec![batch, chunk, chunks],
        apart,
    })
}

/// On several devices, the decoder opened as a layer split on `spec` (even shares, each step
/// whole: the stages one after another) and its decoding steps of [`ALONE_M`] rows timed
/// and predicted on `cluster` (the profile with its per-node correction and step factors):
/// the alone speedup at each row count that makes the prediction the measurement. The layer
/// split's cost with one micro-batch is `scaled / s + rest` for an alone speedup `s` (stages
/// one at a time: [`Cluster::concurrency_factor`] of one device), so the prediction at
/// `s = 1` and at `s = 2` give both parts. Then the batched step again in
/// [`PIPELINE_MICRO_BATCHES`] micro-batches, pipelined, against its prediction with those
/// speedups: the [`PipelineStep`] whose factor is the profile's `pipeline_factor`. Empty and
/// none on one device.
pub(super) fn measure_stage_steps(
    decoder: &SmallDecoder,
    spec: &str,
    opts: &OpenOptions,
    cluster: &Cluster,
) -> Result<(Vec<StageStep>, Option<PipelineStep>)> {
    let n = cluster.n_devices();
    if n < 2 {
        return Ok((Vec::new(), None));
    }
    let (shape, set, model) = decoder.open(
        spec,
        &OpenOptions {
            split_mode: SplitMode::Layer,
            ..opts.clone()
        },
    )?;
    // The batched spans shorter: the stages one after another take a batch of 8 through
    // about 50 ms on the Zen 3 host's cpu:2x1.
    let batch_steps = STEPS / 4;
    let measured = [
        (time_decode(&model, &set)?, STEPS),
        (time_batched(&model, &set, batch_steps, 1)?, batch_steps),
    ];
    let piped_s = time_batched(&model, &set, batch_steps, PIPELINE_MICRO_BATCHES)?;
    drop((set, model));
    let workload = |rows: usize, steps: usize| {
        Workload::parse(&format!(
            "pp=1,tg={},batch={rows},ctx={CONTEXT}",
            SPANS * steps
        ))
    };
    let predict = |rows: usize, steps: usize, speedup: f64| -> Result<f64> {
        let mut c = cluster.clone();
        c.alone_speedup = Some(speedup);
        c.alone_speedup_by_m = Vec::new();
        let w = workload(rows, steps)?;
        Ok(evaluate_layer_split_with(&shape, &c, &w, None, MicroBatches::Fixed(1))?.decode_s)
    };
    let stages = ALONE_M
        .iter()
        .zip(measured)
        .map(|(&rows, (measured_s, steps))| {
            let (one, two) = (predict(rows, steps, 1.0)?, predict(rows, steps, 2.0)?);
            let scaled_s = (2.0 * (one - two)).max(0.0);
            let rest = one - scaled_s;
            let speedup = match measured_s - rest {
                left if left > 0.0 => (scaled_s / left).clamp(1.0, n as f64),
                _ => n as f64,
            };
            Ok(StageStep {
                rows,
                measured_s,
                predicted_s: one,
                scaled_s,
                speedup,
            })
        })
        .collect::<Result<Vec<StageStep>>>()?;
    // The pipelined step against the model's pipeline with those speedups.
    let mut c = cluster.clone();
    c.alone_speedup_by_m = stages.iter().map(|s| (s.rows, s.speedup)).collect();
    c.alone_speedup = c.alone_speedup_by_m.last().map(|&(_, s)| s);
    c.pipeline_factor = None;
    let w = workload(BATCH_ROWS, batch_steps)?;
    let micro = MicroBatches::Fixed(PIPELINE_MICRO_BATCHES);
    let predicted_s = evaluate_layer_split_with(&shape, &c, &w, None, micro)?.decode_s;
    let factor = match predicted_s > 0.0 {
        true => (piped_s / predicted_s).clamp(*PIPELINE_FACTOR.start(), *PIPELINE_FACTOR.end()),
        false => 1.0,
    };
    let piped = PipelineStep {
        rows: BATCH_ROWS,
        micro_batches: PIPELINE_MICRO_BATCHES,
        measured_s: piped_s,
        predicted_s,
        factor,
    };
    Ok((stages, Some(piped)))
}

/// A session of the decoder on `set` over [`CONTEXT`] positions.
fn session<'a>(model: &'a DecoderModel, set: &DeviceSet) -> Result<Session<'a>> {
    Session::new(
        model,
        set.backend.clone(),
        set.buffer_type.as_ref(),
        CONTEXT,
    )
}

/// A batch session of the decoder on `set`: [`BATCH_ROWS`] slots of [`CONTEXT`] positions.
fn batch_session<'a>(model: &'a DecoderModel, set: &DeviceSet) -> Result<BatchSession<'a>> {
    BatchSession::new(
        model,
        set.backend.clone(),
        set.buffer_type.as_ref(),
        BATCH_ROWS,
        CONTEXT,
    )
}

/// Mean seconds of a decoding step of one sequence (a `Session`), as a generation pays it:
/// the median span's (see [`median_span`]; the steps that prepare a structure not seen
/// before included: one generation goes on through [`SPANS`] spans of [`STEPS`] steps, each
/// reaching new cache sizes). The median, as `bench strategies` and `bench model` report a
/// run's median: a step as a run typically pays it, the host's other load included. (The
/// fastest of three spans until 2026-11-28; of five spans, on cpu:2x1 of the shared AVX-512
/// Xeon in three calibrations, the fastest was 8-27% faster than the median for this step,
/// 8-21% for the batched step, whose first span attends to the shortest cache, and 1-15% for
/// the prompts: every prediction was that much too fast.)
fn time_decode(model: &DecoderModel, set: &DeviceSet) -> Result<f64> {
    let mut s = session(model, set)?;
    s.eval(&[1], false)?;
    s.eval(&[2], false)?;
    median_span(STEPS, |i| s.eval(&[3 + (i % 200) as u32], false).map(drop))
}

/// Mean seconds of a batched decoding step, one token of each of [`BATCH_ROWS`] sequences (a
/// `BatchSession`), timed as [`time_decode`] in spans of `steps` steps.
fn time_batched(model: &DecoderModel, set: &DeviceSet, steps: usize, micro: usize) -> Result<f64> {
    let mut b = batch_session(model, set)?;
    b.micro_batches = micro;
    let slots: Vec<usize> = (0..BATCH_ROWS).filter_map(|_| b.acquire()).collect();
    let tokens: Vec<[u32; 1]> = (0..BATCH_ROWS as u32).map(|t| [t + 1]).collect();
    let mut batched = |_: usize| -> Result<()> {
        let seqs: Vec<SeqInput> = slots
            .iter()
            .zip(&tokens)
            .map(|(&slot, t)| SeqInput {
                slot,
                tokens: t,
                logits: true,
            })
            .collect();
        b.step(&seqs).map(drop)
    };
    batched(0)?;
    batched(1)?;
    median_span(steps, batched)
}

/// Median seconds of a prompt chunk of [`PROMPT_ROWS`] tokens (a `Session`, from the start of
/// a sequence each time) and of [`BATCH_ROWS`] such chunks in one step (a `BatchSession`,
/// every sequence from its start each time: the slots released and taken again).
fn time_prompts(model: &DecoderModel, set: &DeviceSet) -> Result<(f64, f64)> {
    let prompt: Vec<u32> = (0..PROMPT_ROWS as u32).map(|t| 1 + t % 200).collect();
    let mut s = session(model, set)?;
    let mut prompt_once = |_: usize| -> Result<()> {
        s.reset();
        s.eval(&prompt, false).map(drop)
    };
    prompt_once(0)?;
    let chunk_s = median_span(PROMPTS, prompt_once)?;
    drop(s);
    let mut b = batch_session(model, set)?;
    let mut prompts_once = |_: usize| -> Result<()> {
        for slot in 0..BATCH_ROWS {
            if b.len(slot).is_some() {
                b.release(slot)?;
            }
        }
        let slots: Vec<usize> = (0..BATCH_ROWS).filter_map(|_| b.acquire()).collect();
        let seqs: Vec<SeqInput> = slots
            .iter()
            .map(|&slot| SeqInput {
                slot,
                tokens: &prompt,
                logits: true,
            })
            .collect();
        b.step(&seqs).map(drop)
    };
    prompts_once(0)?;
    let chunks_s = median_span(1, prompts_once)?;
    Ok((chunk_s, chunks_s))
}

/// The median over [`SPANS`] spans of `per_span` calls of `step` of the span's mean seconds
/// per call (`step` is told how many calls came before it).
fn median_span(per_span: usize, mut step: impl FnMut(usize) -> Result<()>) -> Result<f64> {
    let mut spans = Vec::with_capacity(SPANS);
    for r in 0..SPANS {
        let t = Instant::now();
        for i in 0..per_span {
            step(r * per_span + i)?;
        }
        spans.push(t.elapsed().as_secs_f64() / per_span as f64);
    }
    Ok(super::rig::median(&spans))
}
