//! `metashard bench batch`: aggregate generation tokens/s of S sequences decoded together
//! (`models::engine` over one KV cache of S slots) for each S of `--parallel`, in one run on
//! one device set: S requests of the same prompt length (each its own prompt), `--tg` tokens
//! each past the end-of-sequence token; the prompts are evaluated first (not timed), then the
//! decode steps, where every step evaluates one token of each sequence.

use crate::cli::run::load;
use crate::cli::{JsonArgs, ModelArgs, SplitArgs, parse_positive};
use metashard::Result;
use metashard::cpu::Precision;
use metashard::models::batch::BatchSession;
use metashard::models::engine::{Engine, GenRequest};
use metashard::models::sampler::SamplerConfig;
use std::time::Instant;

#[derive(Clone, Debug, clap::Args)]
pub struct BenchBatchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Devices: `cpu`, `cpu:N`, `cpu:NxT`.
    #[arg(long, default_value = "cpu")]
    pub devices: String,
    /// Sequences decoded together, a list (e.g. `1,4,8`).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 4, 8],
          value_parser = parse_positive)]
    pub parallel: Vec<usize>,
    /// Prompt tokens of each sequence.
    #[arg(long, default_value_t = 16, value_parser = parse_positive)]
    pub pp: usize,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 32, value_parser = parse_positive)]
    pub tg: usize,
    /// Quantized weights times 8-bit activations.
    #[arg(long)]
    pub q8: bool,
    /// Micro-batches each step's sequences are cut into (`BatchSession::micro_batches`): a
    /// layer split pipelines them through its devices.
    #[arg(long, default_value_t = 1, value_parser = parse_positive)]
    pub micro_batches: usize,
    #[command(flatten)]
    pub split: SplitArgs,
    #[command(flatten)]
    pub out: JsonArgs,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct BatchRow {
    pub parallel: usize,
    pub generated_tokens: u64,
    pub decode_steps: u64,
    pub decode_secs: f64,
    /// Generated tokens of all sequences per second of decoding.
    pub tokens_per_s: f64,
    /// Relative to the first row's.
    pub vs_first: f64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct BatchReport {
    pub model: String,
    pub devices: String,
    pub pp: usize,
    pub tg: usize,
    pub rows: Vec<BatchRow>,
}

pub fn run(a: &BenchBatchArgs) -> Result<()> {
    a.split.check(&a.devices)?;
    let (set, m) = load(
        &a.model.name,
        &a.devices,
        Precision::from_q8_flag(a.q8),
        &a.split,
        a.out.json,
    )?;
    let ctx = a.pp + a.tg + 1;
    let mut rows: Vec<BatchRow> = Vec::new();
    for &s in &a.parallel {
        let mut batch =
            BatchSession::new(&m, set.backend.clone(), set.buffer_type.as_ref(), s, ctx)?;
        batch.micro_batches = a.micro_batches;
        let mut e = Engine::new(batch, s * a.pp);
        for i in 0..s {
            let prompt = (0..a.pp)
                .map(|j| ((i * 131 + j * 17 + 1000) % m.cfg.n_vocab) as u32)
                .collect();
            e.submit(GenRequest {
                prompt,
                max_tokens: a.tg,
                sampling: SamplerConfig {
                    temperature: 0.0,
                    ..SamplerConfig::default()
                },
                stop: Vec::new(),
                ignore_eos: true,
                logprobs: None,
                logit_bias: Vec::new(),
            })?;
        }
        // The first step evaluates every prompt (the budget holds them) and samples a token.
        e.step()?;
        let (steps0, gen0) = (e.stats.steps, e.stats.generated_tokens);
        let t0 = Instant::now();
        e.run_all()?;
        let secs = t0.elapsed().as_secs_f64();
        let generated = e.stats.generated_tokens - gen0;
        let tps = generated as f64 / secs.max(1e-9);
        let first = rows.first().map_or(tps, |r| r.tokens_per_s);
        rows.push(BatchRow {
            parallel: s,
            generated_tokens: generated,
            decode_steps: e.stats.steps - steps0,
            decode_secs: secs,
            tokens_per_s: tps,
            vs_first: tps / first,
        });
    }
    let report = BatchReport {
        model: m.name.clone(),
        devices: set.spec.clone(),
        pp: a.pp,
        tg: a.tg,
        rows,
    };
    a.out.print("command output", &report, |r| {
        println!(
            "{} on {}: {} prompt tokens, {} generated per sequence",
            r.model, r.devices, r.pp, r.tg
        );
        println!(
            "{:>8} {:>10} {:>8} {:>10} {:>10}",
            "parallel", "generated", "steps", "tokens/s", "vs first"
        );
        for row in &r.rows {
            println!(
                "{:>8} {:>10} {:>8} {:>10.1} {:>9.2}x",
                row.parallel,
                row.generated_tokens,
                row.decode_steps,
                row.tokens_per_s,
                row.vs_first
            );
        }
    })
}
