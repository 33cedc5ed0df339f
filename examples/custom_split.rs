//! Writing your own split-state callback.
//!
//! The callback is called once for every tensor placed on the meta device (weights and KV
//! cache), with its name, layout and the number of devices, and returns how that tensor is
//! spread. Everything else (activations, conversions, collectives) follows from the per-op
//! rules. Here: only the MLP is tensor-parallel (gate/up split by output rows, down by input
//! rows, 2:1 in favour of device 0), attention and the output projection stay mirrored.
//!
//! Run: `cargo run --release --example custom_split -- [devices] [prompt]`

use metashard::cpu::Precision;
use metashard::devices::DeviceSet;
use metashard::meta::MetaOptions;
use metashard::meta::{ConversionKind, SplitFn, TensorInfo};
use metashard::models::decoder::{StepInput, build_step};
use metashard::models::loader::DecoderModel;
use metashard::models::paths::{ModelPath, resolve};
use metashard::models::sampler::{Sampler, SamplerConfig, generate};
use metashard::models::session::Session;
use metashard::split_state::{Granularity, SplitState, split_ratios};
use metashard::tokenizer::{ChatMessage, Tokenizer};
use std::sync::Arc;

/// MLP-only tensor parallelism, 2:1 towards device 0.
pub fn mlp_only() -> SplitFn {
    Arc::new(|t: &TensorInfo| {
        let n = t.n_devices;
        let ratios: Vec<f64> = (0..n).map(|d| if d == 0 { 2.0 } else { 1.0 }).collect();
        // Whole quantization blocks along K for the down projection, and the same extents for
        // gate and up so the SwiGLU halves line up on each device.
        let split = |len: usize| split_ratios(len, &ratios, Granularity(32), 0);
        Ok(
            if t.name.ends_with("ffn_gate.weight") || t.name.ends_with("ffn_up.weight") {
                SplitState::axis(1, &split(t.layout.ne[1])?)
            } else if t.name.ends_with("ffn_down.weight") {
                SplitState::axis(0, &split(t.layout.ne[0])?)
            } else {
                SplitState::mirrored(n)
            },
        )
    })
}

/// Load SmolLM2 on `devices` with the callback and generate up to `n` tokens; returns the
/// answer and the number of all-reduces in the plan of a decode step.
pub fn run(devices: &str, prompt: &str, n: usize) -> metashard::Result<(String, usize)> {
    let ModelPath::Gguf(path) = resolve("smollm2")? else {
        unreachable!("smollm2 is a GGUF model")
    };
    let set = DeviceSet::open(devices, Precision::Exact, MetaOptions::default(), |_| {
        mlp_only()
    })?;
    let model = DecoderModel::load(&path, set.buffer_type.as_ref(), &|_, _| {})?;
    let chat = model.chat.as_ref().expect("SmolLM2 has a chat template");
    let text = chat.render(&[ChatMessage::new("user", prompt)], true)?;
    let tokens = model.tokenizer.encode(&text, true)?;
    let mut session = Session::new(
        &model,
        set.backend.clone(),
        set.buffer_type.as_ref(),
        tokens.len() + n + 1,
    )?;
    let mut sampler = Sampler::new(SamplerConfig::default())?;
    let (out, stats) = generate(&mut session, &tokens, n, &mut sampler, false, |_| true)?;
    let eos = model.tokenizer.eos();
    let out: Vec<u32> = out.into_iter().filter(|&t| Some(t) != eos).collect();
    let answer = String::from_utf8_lossy(&model.tokenizer.decode_bytes(&out)?).to_string();
    eprintln!("{:.1} tokens/s on {devices}", stats.gen_tps());
    // What the plan does with this split: one all-reduce per layer (after the MLP).
    let reduces = match &set.meta {
        Some(m) => {
            let at = session.n_past() as i32;
            let n_kv = session.capacity();
            let kvp: Vec<i32> = (0..n_kv as i32)
                .map(|j| if j <= at { j } else { -1 })
                .collect();
            let step = StepInput {
                tokens: &[1],
                positions: &[at],
                slots: &[at],
                n_kv,
                kv_positions: &kvp,
                logits_rows: 0..1,
            };
            let g = build_step(&model.cfg, &model.weights, &session.cache(), &step)?;
            m.meta_backend()?
                .sharding(&g.graph)?
                .count(ConversionKind::AllReduce)
        }
        None => 0,
    };
    Ok((answer, reduces))
}

fn main() -> metashard::Result<()> {
    let devices = std::env::args().nth(1).unwrap_or_else(|| "cpu:2x1".into());
    let prompt = std::env::args()
        .nth(2)
        .unwrap_or_else(|| "What is the capital of France?".into());
    let (answer, reduces) = run(&devices, &prompt, 24)?;
    println!("{answer}");
    println!("all-reduces per decode step with the MLP-only split: {reduces}");
    Ok(())
}
