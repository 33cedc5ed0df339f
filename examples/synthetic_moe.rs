//! Write a synthetic Qwen3-MoE or OLMoE GGUF (random weights, the project's writer and
//! quantizer) of a chosen size, for timing the expert splits (`bench strategies`) where no
//! real MoE file is at hand: `cargo run --release --example synthetic_moe -- OUT [n_embd
//! n_layer n_expert n_used n_ff_exp dtype n_vocab arch]` (default 1024 4 32 8 512 q8_0 32000
//! qwen3moe; `olmoe`: as many KV heads as query heads, Q and K normed over whole
//! projections, experts' weights not renormalised).

use metashard::DType;
use metashard::models::arch::{OLMOE, QWEN3MOE};
use metashard::models::hparams::{DecoderConfig, Moe};
use metashard::models::synthetic::gguf_bytes_with;

fn main() -> metashard::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let out = args.first().cloned().unwrap_or_else(|| "moe.gguf".into());
    let num = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (n_embd, n_layer, n_expert) = (num(1, 1024), num(2, 4), num(3, 32));
    let (n_used, n_ff_exp) = (num(4, 8), num(5, 512));
    let dtype = match args.get(6) {
        Some(s) => DType::from_name(s).ok_or_else(|| {
            metashard::Error::invalid_argument("dtype", s, "a weight type such as q8_0")
        })?,
        None => DType::Q8_0,
    };
    let n_vocab = num(7, 32000);
    let olmoe = match args.get(8).map(String::as_str) {
        None | Some("qwen3moe") => false,
        Some("olmoe") => true,
        Some(s) => {
            return Err(metashard::Error::invalid_argument(
                "arch",
                s,
                "qwen3moe or olmoe",
            ));
        }
    };
    let head_dim = 64;
    let n_head = n_embd / head_dim;
    let (arch, n_head_kv) = if olmoe {
        (&OLMOE, n_head)
    } else {
        (&QWEN3MOE, n_head / 4)
    };
    let mut cfg = DecoderConfig {
        arch,
        rope_mode: arch.decoder()?.rope_mode,
        ..DecoderConfig::llama(n_layer, n_embd, n_ff_exp, n_head, n_head_kv, n_vocab)
    };
    cfg.head_dim = head_dim;
    cfg.rope_dims = head_dim;
    cfg.moe = Some(Moe {
        n_expert,
        n_expert_used: n_used,
        n_ff_exp,
        n_ff_shexp: 0,
        norm_weights: !olmoe,
    });
    let bytes = gguf_bytes_with(&cfg, dtype, false, 4096, 7, &[])?;
    std::fs::write(&out, &bytes).map_err(|e| metashard::Error::io(&out, e))?;
    eprintln!("{out}: {} MB", bytes.len() >> 20);
    Ok(())
}
