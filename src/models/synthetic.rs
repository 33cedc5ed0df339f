//! Decoders with random weights (for benchmarks and tests of the meta backend and of new
//! architectures): any architecture of the table, its tensors as the table declares them.

use super::arch::{Group, Tensor};
use super::hparams::DecoderConfig;
use super::weights::{ModelWeights, TensorDecl, decoder_layouts, place_decoder};
use crate::buffer::{Buffer, BufferType};
use crate::{DType, Result};
use std::sync::Arc;

pub use super::weights::alloc_kv_cache;

/// The tensors of a synthetic decoder: the architecture's required ones (no optional biases),
/// the token embedding in F32, every other matrix in `wdtype`.
pub fn weight_decls(cfg: &DecoderConfig, wdtype: DType) -> Result<Vec<TensorDecl>> {
    decoder_layouts(
        cfg,
        &|t, _| {
            if t == Tensor::TokenEmbd {
                DType::F32
            } else {
                wdtype
            }
        },
        &|_, _| false,
    )
}

/// A deterministic stream of values in [-0.5, 0.5).
pub fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed ^ 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// A small grouped-query decoder for tests: width 64, 4 heads over 2 KV heads of 16, FFN 128,
/// vocabulary 32, `n_layer` layers.
pub fn small_config(n_layer: usize) -> DecoderConfig {
    DecoderConfig::llama(n_layer, 64, 128, 4, 2, 32)
}

/// The values of tensor number `i` (of role `tensor`, `n` elements) of a random decoder:
/// norms near 1, everything else scaled by 1/sqrt(K).
pub fn random_values(tensor: Tensor, ne0: usize, n: usize, seed: u64) -> Vec<f32> {
    let mut v = random_f32(n, seed);
    if matches!(
        tensor,
        Tensor::RopeFreqs | Tensor::RopeFactorsLong | Tensor::RopeFactorsShort
    ) {
        // Frequency factors in 1..8, as Llama 3's.
        v.iter_mut().for_each(|x| *x = 4.5 + 7.0 * *x);
        return v;
    }
    let is_norm = matches!(tensor.group(), Group::Norms | Group::OutputNorm);
    let s = if is_norm {
        0.2
    } else {
        2.0 / (ne0 as f32).sqrt()
    };
    v.iter_mut()
        .for_each(|x| *x = *x * s + if is_norm { 1.0 } else { 0.0 });
    v
}

/// A decoder with random weights placed in `bt`: norms near 1, matrices scaled by 1/sqrt(K).
pub fn random_decoder(
    cfg: &DecoderConfig,
    wdtype: DType,
    bt: &dyn BufferType,
    seed: u64,
) -> Result<(Arc<dyn Buffer>, ModelWeights)> {
    let decls = weight_decls(cfg, wdtype)?;
    let (buf, refs, weights) = place_decoder(cfg, &decls, bt)?;
    for (i, (d, r)) in decls.iter().zip(&refs).enumerate() {
        let n = r.layout.nelements();
        let v = random_values(d.tensor, r.layout.ne[0], n, seed + i as u64);
        let bytes = crate::dtype::f32_to_bytes(r.layout.dtype, &v)?;
        r.storage.set(&r.layout, &bytes)?;
    }
    Ok((buf, weights))
}

/// A GGUF file of a decoder with random weights in `cfg`'s architecture (the values of
/// [`random_decoder`] with the same seed), as llama.cpp's converter would write it: the
/// architecture's metadata keys (the head size, sliding window and soft-capping where `cfg`
/// has them; the local layers' pattern and RoPE base are the family's; the expert counts of a
/// mixture of experts), every tensor its table requires (the output projection
/// omitted when `tied`), vectors as 1-D tensors, the experts as 3-D ones, and a byte-level BPE vocabulary of
/// `cfg.n_vocab` tokens (the 256 byte tokens, then `<|extra_N|>` control tokens, the last one
/// the end of sequence), so the loader, the tokenizer and outside readers (gguf-py) take it
/// as they take a downloaded file. `cfg.n_vocab` must be at least 257.
pub fn gguf_bytes(
    cfg: &DecoderConfig,
    wdtype: DType,
    tied: bool,
    context_length: usize,
    seed: u64,
) -> Result<Vec<u8>> {
    gguf_bytes_with(cfg, wdtype, tied, context_length, seed, &[])
}

/// [`gguf_bytes`] with the architecture's optional tensors of the roles in `optional` too
/// (Llama 3's `rope_freqs`, llama's biases).
pub fn gguf_bytes_with(
    cfg: &DecoderConfig,
    wdtype: DType,
    tied: bool,
    context_length: usize,
    seed: u64,
    optional: &[Tensor],
) -> Result<Vec<u8>> {
    use crate::io::{GgufArray, GgufValue, GgufWriter};
    cfg.validate()?;
    if cfg.n_vocab <= 256 {
        return Err(crate::Error::invalid_argument(
            "synthetic GGUF: n_vocab",
            cfg.n_vocab,
            "must be at least 257 (the byte tokens and an end-of-sequence token)",
        ));
    }
    let arch = cfg.arch.name;
    let mut w = GgufWriter::new();
    let u32v = |v: usize| GgufValue::U32(v as u32);
    w.add("general.architecture", GgufValue::String(arch.into()));
    w.add(
        "general.name",
        GgufValue::String(format!("synthetic {arch}")),
    );
    for (k, v) in [
        ("block_count", cfg.n_layer),
        ("context_length", context_length),
        ("embedding_length", cfg.n_embd),
        ("feed_forward_length", cfg.n_ff),
        ("attention.head_count", cfg.n_head),
        ("attention.head_count_kv", cfg.n_head_kv),
        ("rope.dimension_count", cfg.rope_dims),
    ] {
        w.add(format!("{arch}.{k}"), u32v(v));
    }
    if let Some(m) = cfg.moe {
        for (k, v) in [
            ("expert_count", m.n_expert),
            ("expert_used_count", m.n_expert_used),
        ] {
            w.add(format!("{arch}.{k}"), u32v(v));
        }
        // Converters of families whose experts are `feed_forward_length` wide (OLMoE,
        // Mixtral) write no key of their own.
        if m.n_ff_exp != cfg.n_ff {
            w.add(
                format!("{arch}.expert_feed_forward_length"),
                u32v(m.n_ff_exp),
            );
        }
        if m.n_ff_shexp > 0 {
            w.add(
                format!("{arch}.expert_shared_feed_forward_length"),
                u32v(m.n_ff_shexp),
            );
        }
    }
    if cfg.n_head * cfg.head_dim != cfg.n_embd {
        w.add(format!("{arch}.attention.key_length"), u32v(cfg.head_dim));
        w.add(format!("{arch}.attention.value_length"), u32v(cfg.head_dim));
    }
    if let Some(sw) = cfg.swa {
        w.add(format!("{arch}.attention.sliding_window"), u32v(sw.window));
    }
    for (k, v) in [
        ("attn_logit_softcapping", cfg.attn_softcap),
        ("final_logit_softcapping", cfg.final_softcap),
    ] {
        if let Some(v) = v {
            w.add(format!("{arch}.{k}"), GgufValue::F32(v));
        }
    }
    if let Some(lr) = cfg.long_rope {
        w.add(
            format!("{arch}.rope.scaling.attn_factor"),
            GgufValue::F32(lr.attn_factor),
        );
        w.add(
            format!("{arch}.rope.scaling.original_context_length"),
            u32v(lr.original_context),
        );
    }
    w.add(
        format!("{arch}.rope.freq_base"),
        GgufValue::F32(cfg.rope_base),
    );
    w.add(
        format!("{arch}.attention.layer_norm_rms_epsilon"),
        GgufValue::F32(cfg.rms_eps),
    );
    let table = crate::tokenizer::pretok::byte_to_char_table();
    let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    tokens.extend((256..cfg.n_vocab).map(|i| format!("<|extra_{i}|>")));
    let types: Vec<i32> = (0..cfg.n_vocab)
        .map(|i| if i < 256 { 1 } else { 3 })
        .collect();
    w.add("tokenizer.ggml.model", GgufValue::String("gpt2".into()));
    // "gpt-2", the name llama.cpp's converter writes and its loader knows (`llama-vocab.cpp`
    // refuses "gpt2"), so llama.cpp can run these files as an outside reference.
    w.add("tokenizer.ggml.pre", GgufValue::String("gpt-2".into()));
    w.add(
        "tokenizer.ggml.tokens",
        GgufValue::Array(GgufArray::String(tokens)),
    );
    w.add(
        "tokenizer.ggml.token_type",
        GgufValue::Array(GgufArray::I32(types)),
    );
    w.add(
        "tokenizer.ggml.merges",
        GgufValue::Array(GgufArray::String(Vec::new())),
    );
    w.add("tokenizer.ggml.eos_token_id", u32v(cfg.n_vocab - 1));
    let decls = decoder_layouts(
        cfg,
        &|t, _| {
            if t == Tensor::TokenEmbd {
                DType::F32
            } else {
                wdtype
            }
        },
        &|t, _| optional.contains(&t),
    )?;
    for (i, d) in decls.iter().enumerate() {
        if tied && d.tensor == Tensor::Output {
            continue;
        }
        let ne = d.layout.ne;
        let v = random_values(d.tensor, ne[0], d.layout.nelements(), seed + i as u64);
        let dims = &ne[..d.tensor.n_dims()];
        let bytes = crate::dtype::f32_to_bytes(d.layout.dtype, &v)?;
        w.add_tensor(d.name.clone(), d.layout.dtype, dims, bytes)?;
    }
    Ok(w.to_bytes())
}

/// A GGUF image `bytes` with F32 vectors appended under names of the caller's (`extra`: name
/// and values): a file with tensors the table may not know (Phi-3's LongRoPE factors
/// `rope_factors_long.weight`), for tests of their refusal.
pub fn with_extra_tensors(bytes: Vec<u8>, extra: &[(&str, Vec<f32>)]) -> Result<Vec<u8>> {
    rewrite(bytes, &mut |_, _, _| Ok(false), &mut |w| {
        for (name, v) in extra {
            let bytes = crate::dtype::f32_to_bytes(DType::F32, v)?;
            w.add_tensor(name.to_string(), DType::F32, &[v.len()], bytes)?;
        }
        Ok(())
    })
}

/// A GGUF image `bytes` in the layout llama.cpp wrote before the experts' 3-D tensors: each
/// `blk.N.ffn_{gate,down,up}_exps.weight` replaced by one 2-D tensor per expert,
/// `blk.N.ffn_gate.E.weight` (`legacy_experts.rs`), with expert E's bytes.
pub fn with_per_expert_tensors(bytes: Vec<u8>) -> Result<Vec<u8>> {
    use super::arch::Naming;
    let experts = [Tensor::FfnGateExps, Tensor::FfnDownExps, Tensor::FfnUpExps];
    rewrite(
        bytes,
        &mut |t, data, w| {
            let Some((role, Some(layer))) = Naming::Gguf.parse(&t.name) else {
                return Ok(false);
            };
            if !experts.contains(&role) {
                return Ok(false);
            }
            let dtype = t.dtype.unwrap_or(DType::F32);
            let per = data.len() / t.ne[2];
            for (e, part) in data.chunks_exact(per).enumerate() {
                let name = super::legacy_experts::legacy_name(role, layer, e);
                w.add_tensor(name, dtype, &t.ne[..2], part.to_vec())?;
            }
            Ok(true)
        },
        &mut |_| Ok(()),
    )
}

/// Writes one tensor of a file written again ([`rewrite`]): its info, its bytes, the writer;
/// `false` when it leaves the tensor to be copied as it is.
type EachTensor<'a> =
    dyn FnMut(&crate::io::GgufTensorInfo, &[u8], &mut crate::io::GgufWriter) -> Result<bool> + 'a;

/// A GGUF image `bytes` written again: its metadata, then each tensor as `each` writes it
/// (`false`: copied as it is), then what `end` adds.
fn rewrite(
    bytes: Vec<u8>,
    each: &mut EachTensor,
    end: &mut dyn FnMut(&mut crate::io::GgufWriter) -> Result<()>,
) -> Result<Vec<u8>> {
    use crate::io::GgufWriter;
    let g = crate::io::GgufFile::from_bytes("synthetic.gguf", bytes)?;
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.add(k.clone(), v.clone());
    }
    for t in g.tensors() {
        let data = g.tensor_data(t)?;
        if each(t, data, &mut w)? {
            continue;
        }
        let dtype = t.dtype.unwrap_or(DType::F32);
        w.add_tensor(t.name.clone(), dtype, &t.ne[..t.n_dims], data.to_vec())?;
    }
    end(&mut w)?;
    Ok(w.to_bytes())
}
