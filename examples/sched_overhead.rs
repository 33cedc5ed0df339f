//! The scheduler's overhead on one backend: SmolLM2 decode steps on plain `cpu:1x2`, on the
//! scheduler over that same backend and weights, and on the layer split of `cpu:1x2` (the
//! scheduler with the weights placed through its buffer type), interleaved in short blocks
//! so a noisy machine hits all three alike; the median over blocks of each one's tokens/s over
//! plain's in the same block.
//!
//! `cargo run --release --example sched_overhead [-- BLOCKS STEPS]` (default 41 blocks of 16
//! decode steps after an 8-token prompt).

use metashard::models::layer_split::SplitMode;
use metashard::models::llama::{Session, argmax};
use metashard::models::open::{OpenOptions, open_decoder};
use metashard::sched::Sched;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One configuration's result: its name, median tokens/s, and the median over blocks of its
/// tokens/s over plain's in the same block.
pub struct Row {
    pub name: &'static str,
    pub tps: f64,
    pub paired: f64,
}

/// `blocks` interleaved blocks of `steps` decode steps on each configuration (after one
/// warm-up block).
pub fn run(blocks: usize, steps: usize) -> metashard::Result<Vec<Row>> {
    let none = &|_: usize, _: usize| {};
    let (plain, m) = open_decoder("smollm2", "cpu:1x2", &OpenOptions::default(), none)?;
    let over_plain = Sched::new(vec![plain.backend.clone()])?;
    let layer_opts = OpenOptions {
        split_mode: SplitMode::Layer,
        ..OpenOptions::default()
    };
    let (layered, ml) = open_decoder("smollm2", "cpu:1x2", &layer_opts, none)?;
    let ctx = 8 + steps + 2;
    let mut sessions = [
        (
            "plain cpu:1x2",
            Session::new(&m, plain.backend.clone(), plain.buffer_type.as_ref(), ctx)?,
        ),
        (
            "sched over it",
            Session::new(&m, over_plain.clone(), plain.buffer_type.as_ref(), ctx)?,
        ),
        (
            "layer split",
            Session::new(
                &ml,
                layered.backend.clone(),
                layered.buffer_type.as_ref(),
                ctx,
            )?,
        ),
    ];
    let prompt: Vec<u32> = (0..8).map(|i| 100 + i * 7).collect();
    let mut tps = vec![Vec::new(); sessions.len()];
    for b in 0..blocks.max(1) + 1 {
        for (i, (_, s)) in sessions.iter_mut().enumerate() {
            s.reset();
            let mut logits = s.eval(&prompt, false)?;
            let t0 = Instant::now();
            for _ in 0..steps.max(1) {
                logits = s.eval(&[argmax(&logits)], false)?;
            }
            // The first block warms up (plans, caches).
            if b > 0 {
                tps[i].push(steps.max(1) as f64 / t0.elapsed().as_secs_f64());
            }
        }
    }
    Ok(sessions
        .iter()
        .enumerate()
        .map(|(i, (name, _))| Row {
            name,
            tps: median(tps[i].clone()),
            paired: median(tps[i].iter().zip(&tps[0]).map(|(x, p)| x / p).collect()),
        })
        .collect())
}

fn main() -> metashard::Result<()> {
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
            "{:<14} median {:>7.1} t/s, paired ratio to plain {:.3}x",
            r.name, r.tps, r.paired
        );
    }
    Ok(())
}
