//! `metashard run`: load a GGUF decoder on a device set (the built-in split callback, or
//! `--tensor-split` ratios), show a memory summary, generate text from a prompt (through the
//! model's chat template unless `--raw`), and report prompt and generation tokens/s.

use super::{bytes_bar, memory_table};
use metashard::Result;
use metashard::cpu::Precision;
use metashard::devices::DeviceSet;
use metashard::models::llama::{LlamaModel, Sampler, SamplerConfig, Session, generate};
use metashard::models::open::{OpenOptions, PromptOptions, open_decoder, prompt_tokens};
use metashard::tokenizer::Tokenizer;
use std::io::Write;

#[derive(Clone, Debug, clap::Args)]
pub struct RunArgs {
    /// Model name (`smollm2`) or path to a `.gguf` file.
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Devices: `cpu`, `cpu:N`, `cpu:NxT`.
    #[arg(long, default_value = "cpu")]
    pub devices: String,
    #[arg(long, short = 'p', default_value = "What is the capital of France?")]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    pub n_predict: usize,
    /// Feed the prompt as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// System message for the chat template (the template's default when absent).
    #[arg(long)]
    pub system: Option<String>,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temp: f32,
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Quantized weights times 8-bit activations (ggml's CPU behaviour; faster decoding on
    /// some CPUs, less accurate). Default: f32 activations.
    #[arg(long)]
    pub q8: bool,
    /// Per-device shares of the split, e.g. `3,1` (in whole heads and blocks).
    #[arg(long, value_delimiter = ',')]
    pub tensor_split: Option<Vec<f64>>,
    /// Keep attention mirrored on every device instead of head-split.
    #[arg(long)]
    pub mirror_attention: bool,
    /// Attention through mul_mat + soft_max instead of the fused kernel.
    #[arg(long)]
    pub no_flash: bool,
    /// Context size (default: prompt + n, rounded up).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

/// Open the devices and load the model with the built-in split (or ratios), with a progress
/// bar on stderr unless `quiet`.
pub fn load(
    model: &str,
    devices: &str,
    precision: Precision,
    ratios: Option<Vec<f64>>,
    mirror_attention: bool,
    quiet: bool,
) -> Result<(DeviceSet, LlamaModel)> {
    let bar = bytes_bar(0, "loading weights");
    if quiet {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let opts = OpenOptions {
        precision,
        ratios,
        mirror_attention,
        ..OpenOptions::default()
    };
    let r = open_decoder(model, devices, &opts, &|done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    r
}

pub fn run(a: &RunArgs) -> Result<()> {
    let (set, mut m) = load(
        &a.model,
        &a.devices,
        Precision::from_q8_flag(a.q8),
        a.tensor_split.clone(),
        a.mirror_attention,
        a.json,
    )?;
    m.cfg.fused_attn = !a.no_flash;
    let opts = PromptOptions {
        system: a.system.as_deref(),
        raw: a.raw,
        special: false,
    };
    let prompt = prompt_tokens(&m, &a.prompt, &opts)?;
    let ctx = a.ctx.unwrap_or(prompt.len() + a.n_predict + 1);
    let mut session = Session::new(&m, set.backend.clone(), set.buffer_type.as_ref(), ctx)?;
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    })?;
    let eos = m.tokenizer.eos();
    let mut stdout = std::io::stdout();
    let mut pending = Vec::new();
    let (tokens, stats) = generate(
        &mut session,
        &prompt,
        a.n_predict,
        &mut sampler,
        a.ignore_eos,
        |t| {
            if !a.json && Some(t) != eos {
                // Stream whole UTF-8 characters only.
                let _ = m.tokenizer.token_bytes(t, &mut pending);
                if let Ok(s) = std::str::from_utf8(&pending) {
                    let _ = write!(stdout, "{s}");
                    let _ = stdout.flush();
                    pending.clear();
                }
            }
            true
        },
    )?;
    let text: Vec<u32> = tokens.iter().copied().filter(|&t| Some(t) != eos).collect();
    let text = String::from_utf8_lossy(&m.tokenizer.decode_bytes(&text)?).to_string();
    let weights = set.bytes_per_device(&[&m.weight_buffer]);
    let cache = set.bytes_per_device(&[&session.cache_buffer()]);
    let compute = set.backend.compute_buffer_bytes();
    if a.json {
        let v = serde_json::json!({
            "model": m.name,
            "devices": set.names(),
            "prompt_tokens": stats.prompt_tokens,
            "generated_tokens": stats.generated,
            "text": text,
            "tokens": tokens,
            "prompt_tokens_per_s": stats.prompt_tps(),
            "gen_tokens_per_s": stats.gen_tps(),
            "memory": { "weights": weights, "kv_cache": cache, "compute": compute },
        });
        println!("{v}");
    } else {
        println!();
        eprintln!();
        eprint!(
            "{}",
            memory_table(
                &set.names(),
                &[
                    ("weights", weights),
                    ("kv cache", cache),
                    ("compute", compute)
                ]
            )
        );
        eprintln!(
            "prompt: {} tokens, {:.1} tokens/s | generation: {} tokens, {:.1} tokens/s ({})",
            stats.prompt_tokens,
            stats.prompt_tps(),
            stats.generated,
            stats.gen_tps(),
            set.spec
        );
    }
    Ok(())
}
