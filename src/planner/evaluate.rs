//! The cost model: predicted time and memory of one assignment of split states (any split
//! callback: a strategy, a search result, a user's own, with its state hints if it has them:
//! a [`SplitPolicy`]) for a workload on a cluster, without running it.
//!
//! The model is placed on [`VirtualDevice`]s through a real meta device, so every weight and
//! cache slice has the size a run would give it. A prefill step and a decode step are built
//! with the real decoder builder, sharded by the meta backend's own pass
//! ([`derive_sharding`], with the same state hints a run's meta device follows) and rewritten
//! into the per-device programs a run would execute (`meta::rewrite`). Each program node is then costed on its device's profile:
//!
//! - a product with a weight: the larger of weight bytes / GEMV bandwidth of its type (the
//!   weights stream once: the memory floor) and 2·M·N·K / GEMM flop rate of its type; where
//!   the profile has small-M rates for the type (a CPU's calibration at M = 2, 8, 32), the
//!   time between M = 1 and the GEMM regime is interpolated through them
//!   (`DeviceProfile::product_seconds`);
//! - an expert product (`mul_mat_id`): the larger of the bytes of the experts the step's
//!   tokens are expected to be routed to / GEMV bandwidth and the routed pairs' flops / GEMM
//!   rate, under a routing skew (`planner::experts`);
//! - a product of two activations (attention without the fused kernel) and fused attention:
//!   the larger of bytes moved / memory bandwidth and flops / the F32 GEMM rate;
//! - everything else: bytes read and written / memory bandwidth;
//! - every executed node: the device's per-node overhead; every step: its per-step overhead;
//! - the kernels' times of a step of M rows (not the overheads) times the cluster's step
//!   factor at M (`Cluster::step_factor_at`: what a calibration measured a real batched
//!   step or prompt chunk to take over its prediction; 1 where there is none), or, in a step
//!   whose devices meet fewer times than there are layers (mirrored, vocab split, a layer
//!   split's stage), the factor timed that way (`Cluster::step_factor_apart_at`).
//!
//! The devices run their programs at the same time and meet at each collective, so a step
//! takes the sum over stages of the slowest device's compute, plus each collective's
//! alpha-beta time on the cluster's links. Memory per device: its weight and cache slices
//! (exact) and the peak of its compute buffer (the graph allocator's measure pass).
//!
//! The prefill and decode steps are costed at once (`rayon::join`), their per-device programs
//! built without node names (`meta::rewrite::rewrite_unnamed`): the same numbers, in about
//! half the time on two cores.

use super::cluster::{Cluster, Collective};
use super::experts::{Routing, mul_mat_id_seconds};
use super::shape::ModelShape;
use super::virtual_device::{VirtualBufferType, VirtualDevice};
use crate::backend::Device;
use crate::buffer::{Buffer, BufferUsage};
use crate::graph::{Graph, TensorId};
use crate::meta::rewrite::{Rewritten, Stage, rewrite, rewrite_unnamed};
use crate::meta::sharding::{Sharding, derive_sharding};
use crate::meta::{HintFn, MetaBuffer, MetaDevice, MetaOptions, SplitPolicy, hint_for};
use crate::models::arch::{Naming, Tensor};
use crate::models::decoder::{SequenceStep, build_step_shapes};
use crate::models::limits::Count;
use crate::models::weights::{
    KvCache, ModelWeights, WeightRef, place_decoder_shared, place_kv_cache, tied_output_pair,
};
use crate::op::{CollectiveKind, Op};
use crate::{DType, Error, Result};
use serde::Serialize;
use std::sync::Arc;

/// What the model is asked to do: a prompt of `prefill` tokens, then `decode` generated tokens,
/// for `batch` sequences, in a context of `context` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Workload {
    pub prefill: usize,
    pub decode: usize,
    pub batch: usize,
    pub context: usize,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            prefill: 512,
            decode: 128,
            batch: 1,
            context: 4096,
        }
    }
}

impl Workload {
    /// `pp=512,tg=128,batch=1,ctx=4096` (any subset; the rest default).
    pub fn parse(spec: &str) -> Result<Workload> {
        let mut w = Workload::default();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| {
                Error::invalid_argument(
                    "--workload",
                    part,
                    "expected key=value (pp, tg, batch, ctx)",
                )
            })?;
            let n: usize = v.trim().parse().map_err(|_| {
                Error::invalid_argument(format!("--workload {k}"), v, "not a whole number")
            })?;
            match k.trim() {
                "pp" | "prefill" => w.prefill = n,
                "tg" | "decode" => w.decode = n,
                "batch" => w.batch = n,
                "ctx" | "context" => w.context = n,
                other => {
                    return Err(Error::invalid_argument(
                        "--workload",
                        other,
                        "unknown key (pp, tg, batch, ctx)",
                    ));
                }
            }
        }
        w.validate()?;
        Ok(w)
    }

    /// Sane counts, checked without overflow: a batch of 1..=4096 sequences, something to do,
    /// and a context of at most [`Count::Context`]'s bound of positions (they are 32-bit) that holds the
    /// prompt and the generated tokens. Errors name the workload's key.
    pub fn validate(&self) -> Result<()> {
        if self.batch == 0 || self.batch > 4096 {
            return Err(Error::invalid_argument(
                "workload batch",
                self.batch,
                "must be 1..=4096",
            ));
        }
        if self.prefill == 0 && self.decode == 0 {
            return Err(Error::invalid_argument(
                "workload",
                "pp=0,tg=0",
                "nothing to do",
            ));
        }
        check_context(self.context)?;
        if self.context.saturating_mul(self.batch) > Count::Context.max() {
            return Err(Error::invalid_argument(
                "workload batch",
                self.batch,
                format!(
                    "times ctx {} is past the {} KV cache rows a layer can hold",
                    self.context,
                    Count::Context.max()
                ),
            ));
        }
        let need = self.prefill.checked_add(self.decode);
        if need.is_none_or(|n| n > self.context) {
            return Err(Error::invalid_argument(
                "workload ctx",
                self.context,
                format!(
                    "must hold the prompt and the generated tokens (pp {} + tg {} = {})",
                    self.prefill,
                    self.decode,
                    self.prefill as u128 + self.decode as u128
                ),
            ));
        }
        // What costing it builds in memory: each step's mask of tokens x cache rows.
        for (what, step) in [
            ("prompt", self.prefill_step()),
            ("decode", self.decode_step()),
        ] {
            let Some((tokens, start)) = step else {
                continue;
            };
            let cells = tokens.saturating_mul(start + tokens);
            if cells > Self::MAX_STEP_CELLS {
                return Err(Error::invalid_argument(
                    "workload",
                    self,
                    format!(
                        "a {what} step of {tokens} tokens over {} cache rows has a mask of \
                         {cells} cells to build, more than the cost model's {} (lower batch, \
                         pp or ctx)",
                        start + tokens,
                        Self::MAX_STEP_CELLS
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Tokens of the prefill step the cost model builds (longer prompts are costed in chunks of
    /// this size, at the middle chunk's context).
    pub const CHUNK: usize = 512;

    /// The most cells (tokens times cache rows) of a step's attention mask, which the cost
    /// model builds in memory as a run would: 2^28 (1 GiB of f32), a prompt chunk of 512
    /// tokens at a context of 512k.
    pub const MAX_STEP_CELLS: usize = 1 << 28;

    /// Chunks of [`Workload::CHUNK`] tokens making up the prompt (a validated workload).
    fn prefill_chunks(&self) -> usize {
        self.prefill.div_ceil(self.prefill.clamp(1, Self::CHUNK))
    }

    /// Prefill steps making up the workload's prompts: each chunk of every sequence, in steps
    /// of [`Workload::prefill_step`]'s tokens. A batch's chunks fill one step up to the
    /// context, and take more steps past it (64 prompts of 512 tokens at a context of 4096
    /// are 8 steps of 4096 tokens, not one).
    fn prefill_steps(&self) -> usize {
        let Some((tokens, _)) = self.prefill_step() else {
            return 0;
        };
        let chunk = self.prefill.min(Self::CHUNK);
        self.prefill_chunks()
            * chunk
                .saturating_mul(self.batch.max(1))
                .div_ceil(tokens.max(1))
    }

    /// The prefill step the cost model builds: (tokens, start). The middle chunk's context
    /// stands for all of them; a batch is costed as one longer sequence (the same rows for
    /// every product, more attention) with logits for each sequence's last token (the
    /// output product of one row per sequence). None without a prompt.
    pub(super) fn prefill_step(&self) -> Option<(usize, usize)> {
        if self.prefill == 0 {
            return None;
        }
        let chunk = self.prefill.min(Self::CHUNK);
        let tokens = chunk.saturating_mul(self.batch.max(1)).min(self.context);
        let start = ((self.prefill_chunks() / 2) * chunk).min(self.context - tokens);
        Some((tokens, start))
    }

    /// Rows of KV cache the workload holds per layer: `context` positions for each of the
    /// batch's sequences (as `serve` gives each sequence a slot of its own).
    pub fn cache_rows(&self) -> usize {
        self.context.saturating_mul(self.batch.max(1))
    }

    /// The decode step the cost model builds, at the middle of the generation: (tokens,
    /// start). None without generation.
    pub(super) fn decode_step(&self) -> Option<(usize, usize)> {
        if self.decode == 0 {
            return None;
        }
        let tokens = self.batch.max(1).min(self.context);
        let at = (self.prefill + self.decode / 2).min(self.context - tokens);
        Some((tokens, at))
    }
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pp={},tg={},batch={},ctx={}",
            self.prefill, self.decode, self.batch, self.context
        )
    }
}

/// One collective kind's count and bytes in a step.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct CommCount {
    pub kind: &'static str,
    pub count: usize,
    /// Bytes of the full tensors.
    pub bytes: usize,
    pub seconds: f64,
}

/// Predicted time of one step (a prefill chunk or a decode step).
#[derive(Clone, Debug, Default, Serialize)]
pub struct StepCost {
    /// Tokens in the step.
    pub tokens: usize,
    pub seconds: f64,
    /// Slowest device's compute, summed over stages.
    pub compute_s: f64,
    /// Collectives.
    pub comm_s: f64,
    /// Per-step and per-node overheads (included in `compute_s`).
    pub overhead_s: f64,
    pub collectives: Vec<CommCount>,
    /// Per segment (`embedding`, `layer 0` .. `layer L-1`, `output`): compute (slowest
    /// device) and communication seconds.
    pub segments: Vec<SegmentCost>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct SegmentCost {
    pub name: String,
    pub compute_s: f64,
    pub comm_s: f64,
}

/// Bytes per device.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DeviceMemory {
    pub device: String,
    pub weights: usize,
    pub kv_cache: usize,
    /// Peak of the compute buffer over the steps.
    pub activations: usize,
    pub total: usize,
    pub budget: u64,
}

/// The prediction for one assignment.
#[derive(Clone, Debug, Serialize)]
pub struct Evaluation {
    pub workload: Workload,
    /// One prefill step of `prefill.tokens` tokens.
    pub prefill: Option<StepCost>,
    /// Chunks of that size making up the prompt.
    pub prefill_chunks: usize,
    /// One decode step, at the middle of the generation.
    pub decode: Option<StepCost>,
    pub memory: Vec<DeviceMemory>,
    /// Prompt plus generation, seconds.
    pub total_s: f64,
}

impl Evaluation {
    /// Prompt tokens per second over all the batch's sequences (the step's tokens are every
    /// sequence's chunk; 0 without a prompt).
    pub fn prefill_tps(&self) -> f64 {
        self.prefill
            .as_ref()
            .map_or(0.0, |p| p.tokens as f64 / p.seconds.max(1e-12))
    }

    /// Generated tokens per second per sequence (0 without generation).
    pub fn decode_tps(&self) -> f64 {
        self.decode
            .as_ref()
            .map_or(0.0, |d| 1.0 / d.seconds.max(1e-12))
    }

    /// Generated tokens per second over all the batch's sequences (one per sequence per step).
    pub fn decode_tps_total(&self) -> f64 {
        self.decode
            .as_ref()
            .map_or(0.0, |d| d.tokens as f64 / d.seconds.max(1e-12))
    }

    /// The first device over its budget, and by how much.
    pub fn over_budget(&self) -> Option<(&DeviceMemory, u64)> {
        self.memory
            .iter()
            .filter(|m| m.total as u64 > m.budget)
            .map(|m| (m, m.total as u64 - m.budget))
            .max_by_key(|(_, over)| *over)
    }
}

/// A model placed on a cluster's virtual devices with one split callback.
pub struct Placed {
    pub shape: ModelShape,
    pub devices: Vec<Arc<dyn Device>>,
    refs: Vec<WeightRef>,
    weights: ModelWeights,
    cache: KvCache,
    weight_buffer: Arc<dyn Buffer>,
    cache_buffer: Arc<dyn Buffer>,
    /// The state hints the sharding follows, as a run's meta device would.
    hints: Option<HintFn>,
}

/// A workload's context within the bound of [`Count::Context`] in `models::limits` (positions
/// are 32-bit), named as the workload's `ctx` key: the one check `Workload::validate` and
/// `Placed::new` share.
fn check_context(context: usize) -> Result<usize> {
    let max = Count::Context.max();
    if context == 0 || context > max {
        return Err(Error::invalid_argument(
            "workload ctx",
            context,
            format!("must be in 1..={max} (positions are 32-bit)"),
        ));
    }
    Ok(context)
}

impl Placed {
    /// Place `shape`'s weights and a cache of `context` rows per layer (a workload's
    /// [`Workload::cache_rows`]: every sequence's) on virtual devices
    /// named and budgeted like `cluster`'s, splitting every tensor with `split` (a split
    /// callback, or a [`SplitPolicy`] whose state hints the sharding then follows).
    pub fn new(
        shape: &ModelShape,
        cluster: &Cluster,
        split: impl Into<SplitPolicy>,
        context: usize,
    ) -> Result<Placed> {
        // Nothing below is sized by an unchecked count.
        shape.check()?;
        check_context(context)?;
        let devices: Vec<Arc<dyn Device>> = cluster
            .devices
            .iter()
            .map(|d| VirtualDevice::shared(d.name.clone(), d.memory_bytes))
            .collect();
        let policy: SplitPolicy = split.into();
        let hints = policy.hints.clone();
        let meta = MetaDevice::with_policy(devices.clone(), policy, MetaOptions::default())?;
        let bt = meta.buffer_type();
        let decls = shape.weight_decls()?;
        let shared = match shape.share_tied {
            true => tied_output_pair(&decls),
            false => Vec::new(),
        };
        let (weight_buffer, refs, weights) =
            place_decoder_shared(&shape.cfg, &decls, bt.as_ref(), &shared)?;
        // The cache is placed, not cleared: a virtual device has nothing to clear, and a meta
        // buffer's clear walks every slice.
        let (cache_buffer, cache) = place_kv_cache(&shape.cfg, context, bt.as_ref(), false)?;
        Ok(Placed {
            shape: shape.clone(),
            devices,
            refs,
            weights,
            cache,
            weight_buffer,
            cache_buffer,
            hints,
        })
    }

    /// The state a leaf was placed in (None: inline data, mirrored).
    fn leaf_state(g: &Graph, id: TensorId) -> Option<crate::split_state::SplitState> {
        let st = g.node(id).storage.as_ref()?;
        let mb = st.buffer.as_any().downcast_ref::<MetaBuffer>()?;
        mb.tensor_at(st.offset).map(|t| t.state.clone())
    }

    /// A step of `tokens` tokens at positions `start..`, attending to `start + tokens` rows,
    /// with logits for its last `logits` rows (1..=tokens: one per sequence of a batch, whose
    /// output product then has that many rows, as a batched step's has).
    pub fn step_graph(&self, tokens: usize, start: usize, logits: usize) -> Result<Graph> {
        let ids: Vec<i32> = (0..tokens).map(|i| (i % 7) as i32).collect();
        let step = SequenceStep::new(&ids, start, start + tokens);
        let inp = step.input(tokens - logits.clamp(1, tokens.max(1))..tokens);
        Ok(build_step_shapes(&self.shape.cfg, &self.weights, &self.cache, &inp)?.graph)
    }

    /// Follow other state hints from now on (the placement of weights does not depend on
    /// them): how the search costs an assignment with and without sequence parallelism
    /// without placing it twice.
    pub fn set_hints(&mut self, hints: Option<HintFn>) {
        self.hints = hints;
    }

    /// The sharding and the per-device programs of `g`.
    pub fn shard(&self, g: &Graph) -> Result<(Sharding, Rewritten)> {
        let n = self.devices.len();
        let hint = |id| hint_for(self.hints.as_ref(), g, id, n);
        let sharding = derive_sharding(g, n, false, &|id| Self::leaf_state(g, id), &hint)?;
        let rw = rewrite(g, &sharding, &self.devices)?;
        Ok((sharding, rw))
    }

    /// As [`Placed::shard`], the per-device programs without node names
    /// ([`rewrite_unnamed`]): what the cost model measures and costs.
    fn shard_unnamed(&self, g: &Graph) -> Result<Rewritten> {
        let n = self.devices.len();
        let hint = |id| hint_for(self.hints.as_ref(), g, id, n);
        let sharding = derive_sharding(g, n, false, &|id| Self::leaf_state(g, id), &hint)?;
        rewrite_unnamed(g, &sharding, &self.devices)
    }

    /// Every placed tensor (weights and cache) by name.
    pub fn tensors(&self) -> std::collections::HashMap<String, crate::buffer::Storage> {
        self.refs
            .iter()
            .chain(&self.cache.k)
            .chain(&self.cache.v)
            .map(|r| (r.name.clone(), r.storage.clone()))
            .collect()
    }

    /// How the model's experts are routed (None for a dense model).
    pub fn routing(&self) -> Option<Routing> {
        self.shape.cfg.moe.map(|m| Routing {
            n_expert: m.n_expert,
            skew: self.shape.routing_skew,
            counted: self.shape.routing_counted.clone(),
        })
    }

    /// Resident bytes (weights and cache) per segment (0: embedding, 1..=L: layers, L+1:
    /// output norm and projection) and device.
    pub fn bytes_by_segment(&self) -> Vec<Vec<usize>> {
        let n = self.devices.len();
        let layers = self.shape.n_layer();
        let mut out = vec![vec![0usize; n]; layers + 2];
        let caches = self.cache.k.iter().chain(&self.cache.v);
        // A tied output sharing the embedding's bytes counts once (as the embedding).
        let mut seen = std::collections::HashSet::new();
        let weights = self.refs.iter().filter(|r| seen.insert(r.storage.offset));
        for r in weights.chain(caches) {
            let seg = match self.shape.cfg.arch.parse(&r.name) {
                Some((Tensor::TokenEmbd, None)) => 0,
                Some((_, Some(l))) => l + 1,
                _ => layers + 1,
            };
            let Some(mb) = r.storage.buffer.as_any().downcast_ref::<MetaBuffer>() else {
                continue;
            };
            if let Some(t) = mb.tensor_at(r.storage.offset) {
                for (d, x) in out[seg].iter_mut().enumerate() {
                    *x += t.local_bytes(d);
                }
            }
        }
        out
    }

    /// Weight and cache bytes per device.
    pub fn resident_bytes(&self) -> (Vec<usize>, Vec<usize>) {
        let bytes = |b: &Arc<dyn Buffer>| {
            b.as_any().downcast_ref::<MetaBuffer>().map_or_else(
                || vec![b.size(); self.devices.len()],
                MetaBuffer::device_bytes,
            )
        };
        (bytes(&self.weight_buffer), bytes(&self.cache_buffer))
    }
}

/// Predict `split` (a split callback, or a [`SplitPolicy`] with state hints) for `workload` on
/// `cluster`.
pub fn evaluate(
    shape: &ModelShape,
    split: impl Into<SplitPolicy>,
    cluster: &Cluster,
    workload: &Workload,
) -> Result<Evaluation> {
    shape.check()?;
    workload.validate()?;
    cluster.validate()?;
    let placed = Placed::new(shape, cluster, split, workload.cache_rows())?;
    evaluate_placed(&placed, cluster, workload)
}

/// The cost of one step of `tokens` tokens at positions `start..` of `placed` on `cluster`,
/// the tokens of `seqs` sequences (a batch, costed as one longer sequence: each sequence's
/// last token gets logits, and each token attends to its own sequence's `start + tokens /
/// seqs` positions, not to every row of the step), raising `activations` (per device) to the
/// step's compute-buffer peaks.
pub(super) fn step_at(
    placed: &Placed,
    cluster: &Cluster,
    tokens: usize,
    start: usize,
    seqs: usize,
    activations: &mut [usize],
) -> Result<StepCost> {
    let seqs = seqs.clamp(1, tokens.max(1));
    let g = placed.step_graph(tokens, start, seqs)?;
    let rw = placed.shard_unnamed(&g)?;
    for (d, p) in rw.programs.iter().enumerate() {
        let plan = crate::alloc::measure(&p.graph, &VirtualBufferType)?;
        activations[d] = activations[d].max(plan.peak);
    }
    let span = start + tokens.div_ceil(seqs);
    Ok(step_cost(
        &g,
        &rw,
        cluster,
        tokens,
        span,
        placed.routing().as_ref(),
    ))
}

/// As [`evaluate`], for a model already placed.
pub fn evaluate_placed(
    placed: &Placed,
    cluster: &Cluster,
    workload: &Workload,
) -> Result<Evaluation> {
    let (weights, kv) = placed.resident_bytes();
    let n = placed.devices.len();
    // The two steps are independent: cost them at once, each raising its own peaks.
    let (pre, dec) = rayon::join(
        || -> Result<_> {
            let mut act = vec![0usize; n];
            let step = match workload.prefill_step() {
                Some((tokens, start)) => Some(step_at(
                    placed,
                    cluster,
                    tokens,
                    start,
                    // The sequences whose chunks make up the step.
                    (tokens / workload.prefill.clamp(1, Workload::CHUNK)).clamp(1, workload.batch),
                    &mut act,
                )?),
                None => None,
            };
            Ok((step, act))
        },
        || -> Result<_> {
            let mut act = vec![0usize; n];
            let step = match workload.decode_step() {
                // Every sequence of a batched decode step gets its logits.
                Some((tokens, at)) => Some(step_at(placed, cluster, tokens, at, tokens, &mut act)?),
                None => None,
            };
            Ok((step, act))
        },
    );
    let ((prefill, pre_act), (decode, dec_act)) = (pre?, dec?);
    let chunks = match prefill {
        Some(_) => workload.prefill_steps(),
        None => 0,
    };
    let activations: Vec<usize> = pre_act
        .iter()
        .zip(&dec_act)
        .map(|(a, b)| *a.max(b))
        .collect();
    let memory = placed
        .devices
        .iter()
        .enumerate()
        .map(|(d, dev)| DeviceMemory {
            device: dev.name(),
            weights: weights[d],
            kv_cache: kv[d],
            activations: activations[d],
            total: weights[d] + kv[d] + activations[d],
            budget: cluster.devices[d].memory_bytes,
        })
        .collect();
    let total_s = prefill.as_ref().map_or(0.0, |p| p.seconds * chunks as f64)
        + decode
            .as_ref()
            .map_or(0.0, |d| d.seconds * workload.decode as f64);
    Ok(Evaluation {
        workload: *workload,
        prefill,
        prefill_chunks: chunks,
        decode,
        memory,
        total_s,
    })
}

impl Evaluation {
    /// This evaluation with its prefill step replaced by `other`'s (an evaluation of the same
    /// placement under other state hints, with a prompt and no decode): the total and the
    /// activation peaks follow.
    pub fn with_prefill_of(&self, other: &Evaluation) -> Evaluation {
        let mut e = self.clone();
        let old = self
            .prefill
            .as_ref()
            .map_or(0.0, |p| p.seconds * self.prefill_chunks as f64);
        let new = other
            .prefill
            .as_ref()
            .map_or(0.0, |p| p.seconds * other.prefill_chunks as f64);
        e.total_s = self.total_s - old + new;
        e.prefill = other.prefill.clone();
        e.prefill_chunks = other.prefill_chunks;
        for (m, o) in e.memory.iter_mut().zip(&other.memory) {
            m.activations = m.activations.max(o.activations);
            m.total = m.weights + m.kv_cache + m.activations;
        }
        e
    }
}

/// The segment (0: before the first layer, 1..=L: layers, L+1: output) of every user node.
fn segments_of(g: &Graph) -> (Vec<usize>, Vec<String>) {
    let mut starts: Vec<(usize, usize)> = Vec::new(); // (node index, segment)
    let mut n_layer = 0;
    // A layer starts at the first weight of that layer, the output at the final norm.
    for id in g.ids() {
        if let Some((_, Some(l))) = Naming::Gguf.parse(g.name(id))
            && l + 1 > n_layer
        {
            starts.push((id.index(), l + 1));
            n_layer = l + 1;
        }
    }
    let out_start = g
        .ids()
        .find(|&id| Naming::Gguf.parse(g.name(id)) == Some((Tensor::OutputNorm, None)))
        .map_or(g.len(), |id| id.index());
    let mut seg = vec![0; g.len()];
    for (i, s) in seg.iter_mut().enumerate() {
        if i >= out_start {
            *s = n_layer + 1;
        } else if let Some((_, l)) = starts.iter().rev().find(|(st, _)| *st <= i) {
            *s = *l;
        }
    }
    let mut names = vec!["embedding".to_string()];
    names.extend((0..n_layer).map(|l| format!("layer {l}")));
    names.push("output".to_string());
    (seg, names)
}

/// Cost of the per-device programs `rw` of the user graph `g` on `cluster`.
fn step_cost(
    g: &Graph,
    rw: &Rewritten,
    cluster: &Cluster,
    tokens: usize,
    kv_span: usize,
    routing: Option<&Routing>,
) -> StepCost {
    let n = rw.programs.len();
    let (user_seg, names) = segments_of(g);
    // The segment of each local node: that of the first user node at or after it.
    let local_seg: Vec<Vec<usize>> = (0..n)
        .map(|d| {
            let lg = &rw.programs[d].graph;
            let mut seg = vec![names.len() - 1; lg.len()];
            let mut next = 0usize;
            for (u, &lid) in rw.local[d].iter().enumerate() {
                for s in seg.iter_mut().take(lid.index() + 1).skip(next) {
                    *s = user_seg[u];
                }
                next = next.max(lid.index() + 1);
            }
            seg
        })
        .collect();
    let mut seg_compute = vec![vec![0f64; names.len()]; n];
    let mut seg_comm = vec![0f64; names.len()];
    let mut compute_s = 0.0;
    let mut overhead_s = 0.0;
    let mut comm_s = 0.0;
    let mut counts: Vec<CommCount> = Vec::new();
    let stages = rw
        .programs
        .iter()
        .map(|p| p.stages.len())
        .max()
        .unwrap_or(0);
    // Kernels in a real step of this many rows, against the rates timed in long runs
    // (`Cluster::step_factor_by_m`); the overheads are figures of their own. A step whose
    // devices meet fewer times than there are layers runs whole layers through on each
    // device (mirrored, vocab split, a layer split's stage): the factor timed that way
    // (`Cluster::step_factor_apart_by_m`).
    let layers = names.iter().filter(|s| s.starts_with("layer ")).count();
    let meetings = rw.programs.first().map_or(0, |p| {
        p.stages
            .iter()
            .filter(|s| matches!(s, Stage::Collective { .. }))
            .count()
    });
    let factor = match meetings < layers.max(1) {
        true => cluster.step_factor_apart_at(tokens),
        false => cluster.step_factor_at(tokens),
    };
    for i in 0..stages {
        let mut slowest = 0f64;
        let mut slowest_overhead = 0f64;
        let mut collective: Option<(Collective, usize, usize)> = None;
        for d in 0..n {
            let p = &rw.programs[d];
            let prof = &cluster.devices[d];
            match p.stages.get(i) {
                Some(Stage::Compute(r)) => {
                    let (mut t, mut o) = (0.0, 0.0);
                    for idx in r.clone() {
                        let id = TensorId(idx as u32);
                        let (c, ov) = node_cost(&p.graph, id, prof, kv_span, routing);
                        let c = c * factor;
                        t += c + ov;
                        o += ov;
                        seg_compute[d][local_seg[d][idx]] += c + ov;
                    }
                    if t > slowest {
                        slowest = t;
                        slowest_overhead = o;
                    }
                }
                Some(Stage::Collective { kind, src, dst, .. }) => {
                    let full = match kind {
                        CollectiveKind::ReduceScatter { .. } => p.graph.layout(*src).nbytes(),
                        _ => p.graph.layout(*dst).nbytes(),
                    };
                    let c = match kind {
                        CollectiveKind::AllReduce => Collective::AllReduce,
                        CollectiveKind::AllGather { .. } => Collective::AllGather,
                        CollectiveKind::ReduceScatter { .. } => Collective::ReduceScatter,
                    };
                    if d == 0 {
                        collective = Some((c, full, local_seg[d][dst.index()]));
                    }
                }
                None => {}
            }
        }
        compute_s += slowest;
        overhead_s += slowest_overhead;

        if let Some((c, bytes, seg)) = collective {
            let t = cluster.links.time(c, n, bytes as f64);
            comm_s += t;
            seg_comm[seg] += t;
            match counts.iter_mut().find(|x| x.kind == c.name()) {
                Some(x) => {
                    x.count += 1;
                    x.bytes += bytes;
                    x.seconds += t;
                }
                None => counts.push(CommCount {
                    kind: c.name(),
                    count: 1,
                    bytes,
                    seconds: t,
                }),
            }
        }
    }
    let step_overhead = cluster
        .devices
        .iter()
        .map(|d| d.step_overhead_s)
        .fold(0.0, f64::max);
    compute_s += step_overhead;
    overhead_s += step_overhead;
    let segments = names
        .into_iter()
        .enumerate()
        .map(|(s, name)| SegmentCost {
            name,
            compute_s: (0..n).map(|d| seg_compute[d][s]).fold(0.0, f64::max),
            comm_s: seg_comm[s],
        })
        .collect();
    StepCost {
        tokens,
        seconds: compute_s + comm_s,
        compute_s,
        comm_s,
        overhead_s,
        collectives: counts,
        segments,
    }
}

/// Seconds of one local node on `prof`: (work, fixed overhead). Attention reads at most
/// `kv_span` cache rows per query (a batch's tokens attend to their own sequence's).
fn node_cost(
    g: &Graph,
    id: TensorId,
    prof: &super::cluster::DeviceProfile,
    kv_span: usize,
    routing: Option<&Routing>,
) -> (f64, f64) {
    let node = g.node(id);
    if node.op.is_noop() || matches!(node.op, Op::Collective(_)) {
        return (0.0, 0.0);
    }
    let out = node.layout.nbytes() as f64;
    if node.layout.ne.contains(&0) {
        return (0.0, 0.0);
    }
    let src_bytes = |i: usize| {
        node.src
            .get(i)
            .map_or(0.0, |&s| g.layout(s).nbytes() as f64)
    };
    let mem = |bytes: f64| bytes / prof.mem_bw.max(1.0);
    let work = match &node.op {
        Op::MulMat => {
            let a = g.layout(node.src[0]);
            let b = g.layout(node.src[1]);
            let (k, nn) = (a.ne[0] as f64, a.ne[1] as f64);
            let m = (b.ne[1] * b.ne[2] * b.ne[3]) as f64;
            let flops = 2.0 * k * nn * m;
            if is_weight(g, node.src[0]) {
                // The weights stream at least once (the GEMV rate, their memory floor) and the
                // product takes at least its flops at the GEMM rate: whichever is longer, at
                // any number of activation rows.
                // Between the two, a calibrated small-M rate (`DeviceProfile::product_seconds`).
                // The calibrated kernel times include reading the activations and writing
                // the result (a step's activations are hot in cache), so nothing is added.
                prof.product_seconds(a.dtype, a.nbytes() as f64, a.ne[0], k * nn, m)
            } else {
                // Activations times activations (attention scores and values): every row of b
                // meets the N rows of its head of a.
                mem(src_bytes(0) + src_bytes(1) + out).max(flops / prof.gemm(DType::F32).max(1.0))
            }
        }
        Op::FlashAttn { .. } => {
            let q = g.layout(node.src[0]);
            let k = g.layout(node.src[1]);
            // q: [dk, n_q, n_head, b], k: [dk, n_kv, n_head_kv, b]. A batch's query attends
            // to its own sequence's rows only (the CPU kernel skips the rows the mask hides
            // from other sequences): at most `kv_span` of the n_kv, and of K and V as much.
            let n_kv = k.ne[1].min(kv_span.max(1)) as f64;
            let part = n_kv / k.ne[1].max(1) as f64;
            let flops = 4.0 * q.ne[0] as f64 * n_kv * (q.ne[1] * q.ne[2] * q.ne[3]) as f64;
            mem(src_bytes(0) + part * (src_bytes(1) + src_bytes(2) + src_bytes(3)) + out)
                .max(flops / prof.attention().max(1.0))
        }
        // Only the experts the step's tokens are routed to (`planner::experts`).
        Op::MulMatId { window } => mul_mat_id_seconds(g, node, *window, prof, routing),
        // Rows read and written (set_rows' node is a view of the whole destination).
        Op::GetRows { .. } => mem(2.0 * out),
        Op::SetRows { .. } => mem(2.0 * src_bytes(1)),
        _ => mem(node
            .src
            .iter()
            .map(|&s| g.layout(s).nbytes() as f64)
            .sum::<f64>()
            + out),
    };
    (work, prof.node_overhead_s)
}

/// Whether `id` reads a weight (a leaf, or a view of one, in a weights buffer).
fn is_weight(g: &Graph, id: TensorId) -> bool {
    let r = g.root(id);
    g.node(r).is_leaf()
        && g.node(r)
            .storage
            .as_ref()
            .is_some_and(|st| st.buffer.usage() == BufferUsage::Weights)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::split::by_layer;
    use crate::planner::cluster::{CollectiveFit, DeviceProfile, LinkLevel, Links};
    use crate::planner::strategy::Strategy;
    use std::collections::BTreeMap;

    /// Two devices with a CPU's small-M rates (a quick calibration of cpu:2x1 on this
    /// machine, 2026-11-27, rounded): the product of 8 rows runs at 40% of the GEMM's rate.
    fn cpu_pair() -> Cluster {
        let types = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"];
        let rates = |x: f64| types.iter().map(|t| (t.to_string(), x)).collect();
        let dev = DeviceProfile {
            name: "cpu".into(),
            memory_bytes: 8 << 30,
            mem_bw: 5e9,
            gemv_bw: BTreeMap::from([
                ("q4_1".to_string(), 5.7e9),
                ("q8_0".to_string(), 12e9),
                ("f32".to_string(), 9e9),
            ]),
            gemm_flops: rates(70e9),
            gemm_flops_by_m: types
                .iter()
                .map(|t| (t.to_string(), vec![(2, 28e9), (8, 30e9), (32, 55e9)]))
                .collect(),
            gemv_bw_by_k: BTreeMap::new(),
            attn_flops: None,
            step_overhead_s: 50e-6,
            node_overhead_s: 0.3e-6,
        };
        let fit = CollectiveFit {
            alpha_s: vec![(2, 1e-6)],
            bus_bw: 40e9,
        };
        let links = Links {
            devices_per_node: 2,
            intra: LinkLevel {
                kind: "host memory".into(),
                all_reduce: fit.clone(),
                all_gather: fit.clone(),
                reduce_scatter: fit,
                broadcast: None,
            },
            inter: None,
        };
        Cluster::homogeneous("cpu", 2, &dev, links)
    }

    /// Issue 21's property, with small-M rates: for every batch, a step (prompt or decode)
    /// costs at least streaming the busiest device's weights once at its fastest GEMV rate,
    /// and a bigger batch never makes a step cheaper; also with step factors as calibrations
    /// measure them, rising or falling with the rows.
    #[test]
    fn steps_stream_the_weights_and_never_get_cheaper_with_the_batch() {
        let shape = ModelShape::preset("smollm2-135m").unwrap();
        let mut clusters = vec![cpu_pair()];
        for factors in [
            vec![(1, 1.0), (8, 1.4), (64, 0.8)],
            vec![(1, 1.0), (8, 0.9), (64, 0.8)],
        ] {
            let mut c = cpu_pair();
            c.step_factor_by_m = factors;
            clusters.push(c);
        }
        // Steps apart (the mirrored split below) with factors of their own.
        let mut c = cpu_pair();
        c.step_factor_by_m = vec![(1, 1.0), (8, 1.4), (64, 0.8)];
        c.step_factor_apart_by_m = vec![(1, 1.0), (8, 1.4), (64, 0.6), (512, 0.5)];
        clusters.push(c);
        for c in &clusters {
            steps_stream_the_weights_and_never_get_cheaper(&shape, c);
        }
    }

    fn steps_stream_the_weights_and_never_get_cheaper(shape: &ModelShape, c: &Cluster) {
        // A factor below 1 says real steps stream faster than the rates: the floor with it.
        let fastest = c.devices[0].gemv_bw.values().copied().fold(0.0, f64::max)
            / c.step_factor_by_m
                .iter()
                .chain(&c.step_factor_apart_by_m)
                .map(|p| p.1)
                .fold(1.0, f64::min);
        let factors = &c.step_factor_by_m;
        for strategy in [Strategy::Megatron, Strategy::Mirrored] {
            let split = strategy.split(shape.n_layer(), shape.tied).unwrap();
            let (mut last_pp, mut last_tg) = (0.0, 0.0);
            for batch in [1, 2, 3, 4, 7, 8, 9, 16, 32] {
                let w = Workload {
                    prefill: 32,
                    decode: 8,
                    batch,
                    context: 32 * batch + 8,
                };
                let policy = by_layer(shape.split_dims(), split.clone());
                let e = evaluate(shape, policy, c, &w).unwrap();
                let floor = e.memory.iter().map(|m| m.weights).max().unwrap() as f64 / fastest;
                let pp = e.prefill.as_ref().unwrap().seconds;
                let tg = e.decode.as_ref().unwrap().seconds;
                assert!(
                    pp >= floor && tg >= floor,
                    "{strategy:?} batch {batch} {factors:?}"
                );
                assert!(
                    pp >= last_pp,
                    "{strategy:?} batch {batch} {factors:?}: {pp} after {last_pp}"
                );
                assert!(
                    tg >= last_tg,
                    "{strategy:?} batch {batch} {factors:?}: {tg} after {last_tg}"
                );
                (last_pp, last_tg) = (pp, tg);
            }
        }
    }

    /// A calibrated step factor multiplies the kernels' time of a step of its rows and
    /// nothing else: the overheads and the collectives stay as they were.
    #[test]
    fn the_step_factor_scales_the_kernels_only() {
        let shape = ModelShape::preset("smollm2-135m").unwrap();
        let split = Strategy::Megatron
            .split(shape.n_layer(), shape.tied)
            .unwrap();
        let w = Workload {
            prefill: 64,
            decode: 4,
            batch: 8,
            context: 8 * 64 + 8,
        };
        let step = |c: &Cluster| {
            let policy = by_layer(shape.split_dims(), split.clone());
            let e = evaluate(&shape, policy, c, &w).unwrap();
            (e.prefill.unwrap(), e.decode.unwrap())
        };
        let plain = cpu_pair();
        let mut slow = cpu_pair();
        // 2x at a batched decoding step's 8 rows, 1x at the prompt step's 512.
        slow.step_factor_by_m = vec![(1, 1.0), (8, 2.0), (512, 1.0)];
        let ((p0, d0), (p1, d1)) = (step(&plain), step(&slow));
        let kernels = |s: &StepCost| s.compute_s - s.overhead_s;
        assert!(
            (kernels(&d1) / kernels(&d0) - 2.0).abs() < 1e-9,
            "{d0:?} {d1:?}"
        );
        assert_eq!(d1.overhead_s, d0.overhead_s);
        assert_eq!(d1.comm_s, d0.comm_s);
        assert_eq!(p1.tokens, 512);
        assert_eq!(p1.seconds, p0.seconds);
    }

    /// Steps whose devices do not meet inside the layers (mirrored) take the factor timed
    /// apart; a tensor split's steps, which meet at every layer, keep theirs.
    #[test]
    fn steps_apart_take_the_factor_timed_apart() {
        let shape = ModelShape::preset("smollm2-135m").unwrap();
        let w = Workload {
            prefill: 64,
            decode: 4,
            batch: 8,
            context: 8 * 64 + 8,
        };
        let step = |c: &Cluster, strategy: Strategy| {
            let split = strategy.split(shape.n_layer(), shape.tied).unwrap();
            let policy = by_layer(shape.split_dims(), split);
            let e = evaluate(&shape, policy, c, &w).unwrap();
            (e.prefill.unwrap(), e.decode.unwrap())
        };
        let kernels = |s: &StepCost| s.compute_s - s.overhead_s;
        let plain = cpu_pair();
        let mut apart = cpu_pair();
        // 3x at the prompt step's 512 rows for steps apart only.
        apart.step_factor_apart_by_m = vec![(1, 1.0), (8, 1.0), (512, 3.0)];
        apart.validate().unwrap();
        let ((mp0, md0), (mp1, md1)) = (
            step(&plain, Strategy::Megatron),
            step(&apart, Strategy::Megatron),
        );
        assert_eq!((mp1.seconds, md1.seconds), (mp0.seconds, md0.seconds));
        let ((p0, d0), (p1, d1)) = (
            step(&plain, Strategy::Mirrored),
            step(&apart, Strategy::Mirrored),
        );
        assert!(
            (kernels(&p1) / kernels(&p0) - 3.0).abs() < 1e-9,
            "{p0:?} {p1:?}"
        );
        assert_eq!(p1.overhead_s, p0.overhead_s);
        assert_eq!(d1.seconds, d0.seconds);
    }

    /// A calibrated attention rate prices `flash_attn` at its flops (4 D per query head and
    /// cache row) at that rate: a slow rate makes decoding dearer, the more so the longer the
    /// cache; absent, the F32 GEMM rate prices it.
    #[test]
    fn attention_costs_its_flops_at_the_calibrated_rate() {
        let shape = ModelShape::preset("smollm2-135m").unwrap();
        let split = Strategy::Megatron
            .split(shape.n_layer(), shape.tied)
            .unwrap();
        let decode = |attn: Option<f64>, prefill: usize| {
            let mut c = cpu_pair();
            for d in &mut c.devices {
                d.attn_flops = attn;
            }
            let w = Workload {
                prefill,
                decode: 2,
                batch: 1,
                context: prefill + 2,
            };
            let policy = by_layer(shape.split_dims(), split.clone());
            let e = evaluate(&shape, policy, &c, &w).unwrap();
            e.decode.unwrap().seconds
        };
        assert_eq!(decode(None, 1000), decode(Some(70e9), 1000));
        let short = decode(Some(1e9), 64) - decode(None, 64);
        let long = decode(Some(1e9), 1000) - decode(None, 1000);
        assert!(short > 0.0 && long > 10.0 * short, "{short} {long}");
        // 30 layers; the busier device's 6 query heads of 64 over the 1,001 rows the middle
        // step sees: about its flops at 1 Gflop/s, less what the memory-bound price was.
        let flops = 30.0 * 6.0 * 4.0 * 64.0 * 1001.0;
        assert!((0.7..1.1).contains(&(long / (flops / 1e9))), "{long}");
    }

    /// The programs the cost model measures (without names) are those a run gets, node for
    /// node: the same ops, sources, layouts, views, storage and stages; only the names are
    /// empty.
    #[test]
    fn programs_without_names_are_the_programs_a_run_gets() {
        let shape = ModelShape::preset("smollm2-135m").unwrap();
        let c = cpu_pair();
        for strategy in [Strategy::Megatron, Strategy::SequenceParallel] {
            let split = strategy.split(shape.n_layer(), shape.tied).unwrap();
            let policy = by_layer(shape.split_dims(), split.clone());
            let mut placed = Placed::new(&shape, &c, policy, 2 * 64).unwrap();
            placed.set_hints(crate::models::split::sequence_parallel_hints(&split));
            for (tokens, start, logits) in [(32, 0, 1), (2, 40, 2)] {
                let g = placed.step_graph(tokens, start, logits).unwrap();
                let (_, named) = placed.shard(&g).unwrap();
                let plain = placed.shard_unnamed(&g).unwrap();
                assert_eq!(named.local, plain.local);
                assert_eq!(named.programs.len(), plain.programs.len());
                for (a, b) in named.programs.iter().zip(&plain.programs) {
                    assert_eq!(format!("{:?}", a.stages), format!("{:?}", b.stages));
                    assert_eq!(a.graph.len(), b.graph.len());
                    let mut named_nodes = 0;
                    for (x, y) in a.graph.nodes().iter().zip(b.graph.nodes()) {
                        assert!(y.name.is_empty());
                        named_nodes += usize::from(!x.name.is_empty());
                        let node = |n: &crate::graph::Node| {
                            let st = n.storage.as_ref().map(|s| s.offset);
                            format!(
                                "{:?} {:?} {:?} {:?} {} {:?} {st:?}",
                                n.op, n.layout, n.src, n.view_src, n.view_offs, n.flags
                            )
                        };
                        assert_eq!(node(x), node(y));
                    }
                    assert_eq!(named_nodes, a.graph.len());
                }
            }
        }
    }

    /// A batched step gets logits for every sequence (the output product has a row per
    /// sequence, as a `BatchSession` step's has), and a batch's prompt tokens attend to their
    /// own sequence's rows, not to every row of the step.
    #[test]
    fn a_batched_step_has_logits_per_sequence_and_attends_within_sequences() {
        let shape = ModelShape::preset("smollm2-135m").unwrap();
        let c = cpu_pair();
        let split = Strategy::Megatron
            .split(shape.n_layer(), shape.tied)
            .unwrap();
        let policy = by_layer(shape.split_dims(), split);
        let placed = Placed::new(&shape, &c, policy, 8 * 64).unwrap();
        let mut act = vec![0; 2];
        let output = |s: &StepCost| s.segments.last().unwrap().compute_s;
        let one = step_at(&placed, &c, 8, 32, 1, &mut act).unwrap();
        let eight = step_at(&placed, &c, 8, 32, 8, &mut act).unwrap();
        assert!(output(&eight) > 3.0 * output(&one), "{eight:?} vs {one:?}");
        // 8 prompts of 32 tokens against one prompt of 256: the same products, less attention.
        let long = step_at(&placed, &c, 256, 0, 1, &mut act).unwrap();
        let batch = step_at(&placed, &c, 256, 0, 8, &mut act).unwrap();
        let layers = |s: &StepCost| {
            s.segments[1..s.segments.len() - 1]
                .iter()
                .map(|x| x.compute_s)
                .sum::<f64>()
        };
        assert!(
            layers(&batch) < layers(&long),
            "{} vs {}",
            layers(&batch),
            layers(&long)
        );
    }
}
