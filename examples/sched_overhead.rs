//! The scheduler's overhead on one backend: SmolLM2 decode steps on plain `cpu:1x2`, on the
//! scheduler over that same backend and weights, and on the layer split of `cpu:1x2` (the
//! scheduler with the weights placed through its buffer type), interleaved in short blocks
//! so a noisy machine hits all three alike. Two measures:
//!
//! - the paired ratio: the median over blocks of each one's tokens/s over plain's in the same
//!   block (exposed to the machine's noise);
//! - the scheduler's own share: the time `Sched::graph_compute` takes beyond the time its
//!   backend's `graph_compute` takes inside it, over the former (both timed by wrappers, so
//!   contention slows both alike; the median over blocks).
//!
//! `cargo run --release --example sched_overhead [-- BLOCKS STEPS]` (default 41 blocks of 16
//! decode steps after an 8-token prompt).

use metashard::backend::{Backend, Device};
use metashard::graph::Graph;
use metashard::models::layer_split::placement;
use metashard::models::loader::DecoderModel;
use metashard::models::paths::{ModelPath, resolve};
use metashard::models::sampler::argmax;
use metashard::models::session::Session;
use metashard::sched::Sched;
use metashard::{Error, Result, parse_devices};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A backend that adds up the time its `graph_compute` takes.
struct Timed {
    inner: Arc<dyn Backend>,
    nanos: AtomicU64,
}

impl Timed {
    fn new(inner: Arc<dyn Backend>) -> Arc<Timed> {
        Arc::new(Timed {
            inner,
            nanos: AtomicU64::new(0),
        })
    }
    fn take_secs(&self) -> f64 {
        self.nanos.swap(0, Ordering::Relaxed) as f64 * 1e-9
    }
}

impl Backend for Timed {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn device(&self) -> Arc<dyn Device> {
        self.inner.device()
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    fn graph_compute(&self, g: &mut Graph) -> Result<()> {
        let t = Instant::now();
        let r = self.inner.graph_compute(g);
        self.nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }
}

/// One configuration's result.
pub struct Row {
    pub name: &'static str,
    /// Median tokens/s.
    pub tps: f64,
    /// Median over blocks of its tokens/s over plain's in the same block.
    pub paired: f64,
    /// Median over blocks of the scheduler's own share of its compute time (0 for plain).
    pub sched_share: f64,
}

/// `blocks` interleaved blocks of `steps` decode steps on each configuration (after one
/// warm-up block).
pub fn run(blocks: usize, steps: usize) -> Result<Vec<Row>> {
    let ModelPath::Gguf(path) = resolve("smollm2")? else {
        return Err(Error::msg("SmolLM2 is a GGUF model"));
    };
    let dev = parse_devices("cpu:1x2")?.remove(0);
    let none = &|_: usize, _: usize| {};
    // Plain: the device's backend, timed.
    let plain = Timed::new(dev.init_backend()?);
    let m = DecoderModel::load(&path, dev.buffer_type().as_ref(), none)?;
    // The scheduler over a backend of the same device, with the same weights.
    let inner_b = Timed::new(dev.init_backend()?);
    let outer_b = Timed::new(Sched::new(vec![inner_b.clone()])?);
    // The layer split of one device: weights placed through the scheduler's buffer type.
    let inner_c = Timed::new(dev.init_backend()?);
    let sched_c = Sched::new(vec![inner_c.clone()])?;
    // Every layer on the one backend.
    let layers = 0..m.cfg.n_layer;
    let bt_c = sched_c.buffer_type(placement(std::slice::from_ref(&layers)));
    let outer_c = Timed::new(sched_c);
    let mc = DecoderModel::load(&path, bt_c.as_ref(), none)?;
    let ctx = 8 + steps + 2;
    let bt = dev.buffer_type();
    type Config<'a> = (&'static str, Session<'a>, Arc<Timed>, Option<Arc<Timed>>);
    let mut configs: [Config; 3] = [
        (
            "plain cpu:1x2",
            Session::new(&m, plain.clone(), bt.as_ref(), ctx)?,
            plain.clone(),
            None,
        ),
        (
            "sched over it",
            Session::new(&m, outer_b.clone(), bt.as_ref(), ctx)?,
            outer_b.clone(),
            Some(inner_b),
        ),
        (
            "layer split",
            Session::new(&mc, outer_c.clone(), bt_c.as_ref(), ctx)?,
            outer_c.clone(),
            Some(inner_c),
        ),
    ];
    let prompt: Vec<u32> = (0..8).map(|i| 100 + i * 7).collect();
    let mut tps = vec![Vec::new(); configs.len()];
    let mut share = vec![Vec::new(); configs.len()];
    for b in 0..blocks.max(1) + 1 {
        for (i, (_, s, outer, inner)) in configs.iter_mut().enumerate() {
            s.reset();
            let mut logits = s.eval(&prompt, false)?;
            outer.take_secs();
            if let Some(t) = inner {
                t.take_secs();
            }
            let t0 = Instant::now();
            for _ in 0..steps.max(1) {
                logits = s.eval(&[argmax(&logits)], false)?;
            }
            let wall = t0.elapsed().as_secs_f64();
            let (o, n) = (
                outer.take_secs(),
                inner.as_ref().map_or(0.0, |t| t.take_secs()),
            );
            // The first block warms up (plans, caches).
            if b > 0 {
                tps[i].push(steps.max(1) as f64 / wall);
                share[i].push(if inner.is_some() { (o - n) / o } else { 0.0 });
            }
        }
    }
    Ok(configs
        .iter()
        .enumerate()
        .map(|(i, c)| Row {
            name: c.0,
            tps: median(tps[i].clone()),
            paired: median(tps[i].iter().zip(&tps[0]).map(|(x, p)| x / p).collect()),
            sched_share: median(share[i].clone()),
        })
        .collect())
}

fn main() -> Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (blocks, steps) = (
        args.first().copied().unwrap_or(41),
        args.get(1).copied().unwrap_or(16),
    );
    let rows = run(blocks, steps)?;
    println!("{blocks} blocks of {steps} decode steps, interleaved");
    for r in rows {
        println!(
            "{:<14} median {:>7.1} t/s, paired ratio to plain {:.3}x, scheduler's own share \
             of its compute {:.2}%",
            r.name,
            r.tps,
            r.paired,
            100.0 * r.sched_share
        );
    }
    Ok(())
}
