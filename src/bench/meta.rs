//! `metashard bench meta`: the cost of tensor parallelism on one host. A transformer block
//! (hidden 1024, FFN 4096, 8 heads, F32) or a stack of 4 MLP layers (x -> W1 1024x4096
//! column-split -> silu -> W2 4096x1024 row-split -> all-reduce -> + x, the stack ggml's meta
//! backend was measured on) runs at T=1 and T=128 tokens on one device with 2 threads
//! (`cpu:1x2`), on the meta device over `cpu:2x1`, and on the meta device over the single
//! `cpu:1x2` device; steps are timed as a user runs them (graph built, planned from the
//! cache, computed), medians reported with the ratios, next to all-reduce and memcpy GB/s.

use crate::cli::{JsonArgs, parse_positive};
use metashard::backend::{Backend, Device, alloc_tensors};
use metashard::buffer::{BufferType, BufferUsage, Storage};
use metashard::collectives::CpuCommunicator;
use metashard::devices::parse_devices;
use metashard::graph::{Graph, TensorId};
use metashard::meta::{MetaBuffer, MetaDevice, SplitFn, TensorInfo};
use metashard::models::decoder::{StepInput, build_step};
use metashard::models::hparams::DecoderConfig;
use metashard::models::split::{FFN_UNIT, SplitOptions, megatron};
use metashard::models::synthetic::{alloc_kv_cache, random_decoder, random_f32};
use metashard::split_state::{Granularity, SplitState, split_even};
use metashard::tensor::Layout;
use metashard::{DType, Result};
use std::sync::Arc;
use std::time::Instant;

/// Which graph to time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum BenchGraph {
    /// One transformer block: attention (8 heads) and SwiGLU MLP.
    Block,
    /// 4 MLP layers, ggml's meta-backend comparison stack.
    Mlp,
}

#[derive(Clone, Debug, clap::Args)]
pub struct BenchMetaArgs {
    /// The graph: a transformer block or ggml's 4-layer MLP stack.
    #[arg(long, value_enum, default_value = "block")]
    pub graph: BenchGraph,
    /// Token counts per step (each in 1..=4096).
    #[arg(long, value_delimiter = ',', default_value = "1,128")]
    pub tokens: Vec<usize>,
    /// Timed steps per configuration (median reported; at least 1).
    #[arg(long, default_value_t = 20, value_parser = parse_positive)]
    pub reps: usize,
    /// Use the fused attention kernel in the block.
    #[arg(long)]
    pub fused_attn: bool,
    #[command(flatten)]
    pub out: JsonArgs,
}

/// `bench meta`: check the token counts, time every configuration (progress on stderr), print
/// the report.
pub fn run(a: &BenchMetaArgs) -> Result<()> {
    if let Some(&t) = a.tokens.iter().find(|&&t| t == 0 || t > 4096) {
        return Err(metashard::Error::invalid_argument(
            "--tokens",
            t,
            "token counts must be in 1..=4096",
        ));
    }
    let opts = MetaBenchOptions {
        graph: a.graph,
        tokens: a.tokens.clone(),
        reps: a.reps,
        fused_attn: a.fused_attn,
    };
    let report = measure(&opts, &|line| eprintln!("{line}"))?;
    a.out.print("bench meta report", &report, print_table)
}

#[derive(Clone, Debug)]
pub struct MetaBenchOptions {
    pub graph: BenchGraph,
    pub tokens: Vec<usize>,
    pub reps: usize,
    /// Use the fused attention kernel in the block.
    pub fused_attn: bool,
}

/// One timed configuration.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MetaBenchRow {
    pub graph: BenchGraph,
    pub config: String,
    pub tokens: usize,
    pub median_ms: f64,
    pub tokens_per_s: f64,
    /// Throughput relative to the plain `cpu:1x2` device on the same graph and tokens.
    pub vs_plain: f64,
    pub graphs_prepared: usize,
}

/// Collective and copy bandwidth, for the report.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BandwidthRow {
    pub bytes: usize,
    pub all_reduce_gbps: f64,
    pub memcpy_gbps: f64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct MemoryCheck {
    pub per_device_weight_bytes: Vec<usize>,
    pub bound_bytes: usize,
    pub within_bound: bool,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct MetaBenchReport {
    pub rows: Vec<MetaBenchRow>,
    pub bandwidth: Vec<BandwidthRow>,
    pub memory: Option<MemoryCheck>,
}

fn block_config(fused: bool) -> DecoderConfig {
    DecoderConfig {
        fused_attn: fused,
        ..DecoderConfig::llama(1, 1024, 4096, 8, 8, 256)
    }
}

const MLP_LAYERS: usize = 4;
const MLP_D: usize = 1024;
const MLP_F: usize = 4096;

fn mlp_split() -> SplitFn {
    Arc::new(|t: &TensorInfo| {
        let n = t.n_devices;
        Ok(if t.name.starts_with("w1") {
            SplitState::axis(1, &split_even(t.layout.ne[1], n, Granularity(FFN_UNIT), 0)?)
        } else if t.name.starts_with("w2") {
            SplitState::axis(0, &split_even(t.layout.ne[0], n, Granularity(FFN_UNIT), 0)?)
        } else {
            SplitState::mirrored(n)
        })
    })
}

/// A runnable benchmark subject: builds the step graph for `t` tokens.
trait Subject {
    fn step(&self, t: usize) -> Result<(Graph, TensorId)>;
}

struct Mlp {
    weights: Vec<(String, Layout, Storage)>,
}

impl Mlp {
    fn new(bt: &dyn BufferType) -> Result<Mlp> {
        let mut layouts = Vec::new();
        let mut names = Vec::new();
        for l in 0..MLP_LAYERS {
            names.push(format!("w1.{l}"));
            layouts.push(Layout::contiguous(DType::F32, [MLP_D, MLP_F, 1, 1]));
            names.push(format!("w2.{l}"));
            layouts.push(Layout::contiguous(DType::F32, [MLP_F, MLP_D, 1, 1]));
        }
        let (buf, offs) = alloc_tensors(bt, &layouts)?;
        buf.set_usage(BufferUsage::Weights);
        let mut weights = Vec::new();
        for (i, ((name, l), off)) in names.into_iter().zip(layouts).zip(offs).enumerate() {
            buf.init_tensor(&name, &l, off)?;
            let st = Storage::new(buf.clone(), off);
            let s = 1.0 / (l.ne[0] as f32).sqrt();
            let v: Vec<f32> = random_f32(l.nelements(), i as u64)
                .into_iter()
                .map(|x| x * s)
                .collect();
            st.set(&l, metashard::dtype::as_bytes(&v))?;
            weights.push((name, l, st));
        }
        Ok(Mlp { weights })
    }
}

impl Subject for Mlp {
    fn step(&self, t: usize) -> Result<(Graph, TensorId)> {
        let mut g = Graph::new();
        let mut x = g.input_f32("x", [MLP_D, t, 1, 1], &random_f32(MLP_D * t, 99))?;
        for pair in self.weights.chunks(2) {
            let ids: Vec<TensorId> = pair
                .iter()
                .map(|(name, l, st)| {
                    let id = g.weight(name, l.dtype, l.ne)?;
                    g.bind(id, st.clone())?;
                    Ok(id)
                })
                .collect::<Result<_>>()?;
            let h = g.mul_mat(ids[0], x)?;
            let h = g.silu(h)?;
            let o = g.mul_mat(ids[1], h)?;
            x = g.add(o, x)?;
        }
        g.set_output(x);
        Ok((g, x))
    }
}

struct Block {
    cfg: DecoderConfig,
    weights: metashard::models::weights::ModelWeights,
    cache: metashard::models::weights::KvCache,
}

/// Cache rows already filled before a decode step (T = 1).
const PAST: usize = 128;

impl Subject for Block {
    fn step(&self, t: usize) -> Result<(Graph, TensorId)> {
        let past = if t == 1 { PAST } else { 0 };
        let tokens: Vec<i32> = (0..t as i32)
            .map(|i| (i * 7) % self.cfg.n_vocab as i32)
            .collect();
        let pos: Vec<i32> = (past as i32..(past + t) as i32).collect();
        let n_kv = past + t;
        let kvp: Vec<i32> = (0..n_kv as i32).collect();
        let inp = StepInput {
            tokens: &tokens,
            positions: &pos,
            slots: &pos,
            n_kv,
            kv_positions: &kvp,
            logits_rows: t - 1..t,
        };
        let sg = build_step(&self.cfg, &self.weights, &self.cache, &inp)?;
        Ok((sg.graph, sg.logits))
    }
}

fn subject(graph: BenchGraph, fused: bool, bt: &dyn BufferType) -> Result<Box<dyn Subject>> {
    Ok(match graph {
        BenchGraph::Mlp => Box::new(Mlp::new(bt)?),
        BenchGraph::Block => {
            let cfg = block_config(fused);
            let (_wb, weights) = random_decoder(&cfg, DType::F32, bt, 7)?;
            let (_cb, cache) = alloc_kv_cache(&cfg, PAST + 128, bt)?;
            Box::new(Block {
                cfg,
                weights,
                cache,
            })
        }
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One timed step: graph built, computed, output read; milliseconds.
fn time_step(backend: &dyn Backend, s: &dyn Subject, t: usize) -> Result<f64> {
    let start = Instant::now();
    let (mut g, out) = s.step(t)?;
    backend.graph_compute(&mut g)?;
    let _ = g.read_bytes(out)?;
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

/// A configuration under test: its backend and its own copy of the weights.
struct Config {
    label: &'static str,
    backend: Arc<dyn Backend>,
    meta: Option<Arc<metashard::meta::MetaBackend>>,
    subject: Box<dyn Subject>,
    times: Vec<f64>,
}

fn bandwidth() -> Result<Vec<BandwidthRow>> {
    let mut rows = Vec::new();
    for bytes in [64 << 10, 1 << 20, 16 << 20] {
        let comm = CpuCommunicator::new(2)?;
        let reps = (64 << 20) / bytes;
        let bufs: Vec<parking_lot::Mutex<Vec<u8>>> = (0..2)
            .map(|r| {
                parking_lot::Mutex::new(
                    metashard::dtype::as_bytes(&random_f32(bytes / 4, r)).to_vec(),
                )
            })
            .collect();
        let pool = metashard::cpu::ThreadPool::new(2, "bench-ar")?;
        let start = Instant::now();
        pool.run(&|r, _| {
            let mut b = bufs[r].lock();
            for _ in 0..reps {
                comm.all_reduce(r, &mut b, DType::F32).expect("all-reduce");
            }
        })
        .map_err(|msg| metashard::Error::Device {
            device: "bench-ar pool".into(),
            reason: format!("a thread panicked: {msg}"),
        })?;
        let ar = (bytes * reps) as f64 / start.elapsed().as_secs_f64() / 1e9;
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        let start = Instant::now();
        for _ in 0..reps {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        }
        let mc = (bytes * reps) as f64 / start.elapsed().as_secs_f64() / 1e9;
        rows.push(BandwidthRow {
            bytes,
            all_reduce_gbps: ar,
            memcpy_gbps: mc,
        });
    }
    Ok(rows)
}

/// Run the benchmark; `progress` is told each finished configuration.
pub fn measure(opts: &MetaBenchOptions, progress: &dyn Fn(&str)) -> Result<MetaBenchReport> {
    let mut rows = Vec::new();
    let mut memory = None;
    let plain_dev = parse_devices("cpu:1x2")?.remove(0);
    let split = || -> SplitFn {
        match opts.graph {
            BenchGraph::Mlp => mlp_split(),
            BenchGraph::Block => megatron(&block_config(opts.fused_attn), SplitOptions::default()),
        }
    };
    for &t in &opts.tokens {
        // Every configuration is set up first, then the steps interleave (plain, meta 2x1,
        // meta 1x2, plain, ...) so that a drift in machine speed hits all of them alike.
        let mut configs = Vec::new();
        let be = plain_dev.init_backend()?;
        let s = subject(
            opts.graph,
            opts.fused_attn,
            plain_dev.buffer_type().as_ref(),
        )?;
        configs.push(Config {
            label: "cpu:1x2",
            backend: be,
            meta: None,
            subject: s,
            times: Vec::new(),
        });
        for (label, spec) in [("meta cpu:2x1", "cpu:2x1"), ("meta [cpu:1x2]", "cpu:1x2")] {
            let m = MetaDevice::new(parse_devices(spec)?, split())?;
            let be = m.meta_backend()?;
            let s = subject(opts.graph, opts.fused_attn, m.buffer_type().as_ref())?;
            configs.push(Config {
                label,
                backend: be.clone(),
                meta: Some(be),
                subject: s,
                times: Vec::new(),
            });
        }
        for rep in 0..opts.reps + 2 {
            for c in &mut configs {
                let ms = time_step(c.backend.as_ref(), c.subject.as_ref(), t)?;
                // Two warm-up rounds (plans built, pages touched) are not timed.
                if rep >= 2 {
                    c.times.push(ms);
                }
            }
        }
        let plain = median(configs[0].times.clone());
        for c in &configs {
            let ms = median(c.times.clone());
            progress(&format!("{} T={t}: {ms:.2} ms", c.label));
            let plans = c.meta.as_ref().map_or(0, |m| m.graphs_prepared());
            rows.push(MetaBenchRow {
                graph: opts.graph,
                config: c.label.to_string(),
                tokens: t,
                median_ms: ms,
                tokens_per_s: t as f64 / ms * 1e3,
                vs_plain: plain / ms,
                graphs_prepared: plans,
            });
            if memory.is_none()
                && let Some(m) = &c.meta
                && m.n_devices() == 2
            {
                memory = Some(memory_check(m, c.subject.as_ref(), t, 2)?);
            }
        }
    }
    let bandwidth = bandwidth()?;
    Ok(MetaBenchReport {
        rows,
        bandwidth,
        memory,
    })
}

/// Per-device weight bytes against (split bytes / N + mirrored bytes) + 1%.
fn memory_check(
    be: &Arc<metashard::meta::MetaBackend>,
    s: &dyn Subject,
    t: usize,
    n: usize,
) -> Result<MemoryCheck> {
    let (g, _) = s.step(t)?;
    let mut seen: Vec<usize> = Vec::new();
    let mut buffers: Vec<Arc<dyn metashard::buffer::Buffer>> = Vec::new();
    for node in g.nodes() {
        if let Some(st) = &node.storage
            && st.buffer.as_any().is::<MetaBuffer>()
            && node.flags.contains(metashard::graph::Flags::WEIGHT)
        {
            let id = st.buffer_id();
            if !seen.contains(&id) {
                seen.push(id);
                buffers.push(st.buffer.clone());
            }
        }
    }
    let metas: Vec<&MetaBuffer> = buffers
        .iter()
        .filter_map(|b| b.as_any().downcast_ref::<MetaBuffer>())
        .collect();
    let report = be.memory_report(&metas);
    let (mut split_bytes, mut mirrored) = (0usize, 0usize);
    for mb in &metas {
        for (_, t) in mb.tensors() {
            if t.state.split_dim().is_some() {
                split_bytes += t.layout.nbytes();
            } else {
                mirrored += t.layout.nbytes();
            }
        }
    }
    let bound = ((split_bytes / n + mirrored) as f64 * 1.01) as usize;
    let within = report.weights.iter().all(|&w| w <= bound);
    Ok(MemoryCheck {
        per_device_weight_bytes: report.weights,
        bound_bytes: bound,
        within_bound: within,
    })
}

/// The report as a table.
pub fn print_table(r: &MetaBenchReport) {
    println!(
        "{:<6} {:<16} {:>6} {:>12} {:>12} {:>10} {:>6}",
        "graph", "config", "tokens", "median ms", "tokens/s", "vs 1x2", "plans"
    );
    for row in &r.rows {
        println!(
            "{:<6} {:<16} {:>6} {:>12.3} {:>12.1} {:>9.3}x {:>6}",
            format!("{:?}", row.graph).to_lowercase(),
            row.config,
            row.tokens,
            row.median_ms,
            row.tokens_per_s,
            row.vs_plain,
            row.graphs_prepared
        );
    }
    println!();
    println!(
        "{:>10} {:>16} {:>12}",
        "bytes", "all-reduce GB/s", "memcpy GB/s"
    );
    for b in &r.bandwidth {
        println!(
            "{:>10} {:>16.2} {:>12.2}",
            b.bytes, b.all_reduce_gbps, b.memcpy_gbps
        );
    }
    if let Some(m) = &r.memory {
        println!();
        println!(
            "weights per device (meta cpu:2x1): {:?} bytes; bound (split/N + mirrored + 1%): {} -> {}",
            m.per_device_weight_bytes,
            m.bound_bytes,
            if m.within_bound { "ok" } else { "EXCEEDED" }
        );
    }
}
