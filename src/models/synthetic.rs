//! Decoders with random weights (for benchmarks and tests of the meta backend), and the
//! allocation of weights and KV caches in any buffer type.

use super::decoder::{
    DecoderConfig, DecoderWeights, KvCache, LayerWeights, WeightRef, kv_cache_layouts,
};
use crate::backend::alloc_tensors;
use crate::buffer::{Buffer, BufferType, BufferUsage, Storage};
use crate::tensor::Layout;
use crate::{DType, Result};
use std::sync::Arc;

/// Place named tensors in one buffer of `bt` (calling the meta split callback where `bt` is a
/// meta buffer type) and return references to them.
pub fn place(
    bt: &dyn BufferType,
    tensors: &[(String, Layout)],
    usage: BufferUsage,
) -> Result<(Arc<dyn Buffer>, Vec<WeightRef>)> {
    let layouts: Vec<Layout> = tensors.iter().map(|t| t.1).collect();
    let (buf, offs) = alloc_tensors(bt, &layouts)?;
    buf.set_usage(usage);
    let mut refs = Vec::with_capacity(tensors.len());
    for ((name, layout), off) in tensors.iter().zip(offs) {
        buf.init_tensor(name, layout, off)?;
        refs.push(WeightRef {
            name: name.clone(),
            layout: *layout,
            storage: Storage::new(buf.clone(), off),
        });
    }
    Ok((buf, refs))
}

/// Names and layouts of a decoder's weights (GGUF llama names; `wdtype` for the matrices).
pub fn weight_layouts(cfg: &DecoderConfig, wdtype: DType) -> Vec<(String, Layout)> {
    let (e, f, ekv, v) = (cfg.n_embd, cfg.n_ff, cfg.n_embd_kv(), cfg.n_vocab);
    let l = |dt, ne0, ne1| Layout::contiguous(dt, [ne0, ne1, 1, 1]);
    let mut t = vec![
        ("token_embd.weight".to_string(), l(DType::F32, e, v)),
        ("output_norm.weight".to_string(), l(DType::F32, e, 1)),
        ("output.weight".to_string(), l(wdtype, e, v)),
    ];
    for i in 0..cfg.n_layer {
        let b = |k: &str| format!("blk.{i}.{k}.weight");
        t.push((b("attn_norm"), l(DType::F32, e, 1)));
        t.push((b("attn_q"), l(wdtype, e, e)));
        t.push((b("attn_k"), l(wdtype, e, ekv)));
        t.push((b("attn_v"), l(wdtype, e, ekv)));
        t.push((b("attn_output"), l(wdtype, e, e)));
        t.push((b("ffn_norm"), l(DType::F32, e, 1)));
        t.push((b("ffn_gate"), l(wdtype, e, f)));
        t.push((b("ffn_up"), l(wdtype, e, f)));
        t.push((b("ffn_down"), l(wdtype, f, e)));
    }
    t
}

/// Assemble `DecoderWeights` from references in `weight_layouts` order.
pub fn decoder_weights(cfg: &DecoderConfig, refs: &[WeightRef]) -> DecoderWeights {
    let find = |name: &str| {
        refs.iter()
            .find(|r| r.name == name)
            .cloned()
            .expect("weight in list")
    };
    let layers = (0..cfg.n_layer)
        .map(|i| {
            let b = |k: &str| find(&format!("blk.{i}.{k}.weight"));
            LayerWeights {
                attn_norm: b("attn_norm"),
                wq: b("attn_q"),
                wk: b("attn_k"),
                wv: b("attn_v"),
                wo: b("attn_output"),
                ffn_norm: b("ffn_norm"),
                w_gate: b("ffn_gate"),
                w_up: b("ffn_up"),
                w_down: b("ffn_down"),
            }
        })
        .collect();
    DecoderWeights {
        token_embd: find("token_embd.weight"),
        output_norm: find("output_norm.weight"),
        output: find("output.weight"),
        layers,
    }
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
    DecoderConfig {
        n_layer,
        n_embd: 64,
        n_ff: 128,
        n_head: 4,
        n_head_kv: 2,
        n_vocab: 32,
        rms_eps: 1e-5,
        rope_base: 10000.0,
        rope_mode: crate::op::RopeMode::Normal,
        rope_dims: 16,
        fused_attn: false,
    }
}

/// A decoder with random weights placed in `bt`: norms near 1, matrices scaled by 1/sqrt(K).
pub fn random_decoder(
    cfg: &DecoderConfig,
    wdtype: DType,
    bt: &dyn BufferType,
    seed: u64,
) -> Result<(Arc<dyn Buffer>, DecoderWeights)> {
    let tensors = weight_layouts(cfg, wdtype);
    let (buf, refs) = place(bt, &tensors, BufferUsage::Weights)?;
    for (i, r) in refs.iter().enumerate() {
        let n = r.layout.nelements();
        let mut v = random_f32(n, seed + i as u64);
        let is_norm = r.name.contains("norm");
        let s = if is_norm {
            0.2
        } else {
            2.0 / (r.layout.ne[0] as f32).sqrt()
        };
        v.iter_mut()
            .for_each(|x| *x = *x * s + if is_norm { 1.0 } else { 0.0 });
        let bytes = crate::dtype::f32_to_bytes(r.layout.dtype, &v)?;
        r.storage.set(&r.layout, &bytes)?;
    }
    Ok((buf, decoder_weights(cfg, &refs)))
}

/// A zeroed KV cache of `size` rows per layer placed in `bt`.
pub fn alloc_kv_cache(
    cfg: &DecoderConfig,
    size: usize,
    bt: &dyn BufferType,
) -> Result<(Arc<dyn Buffer>, KvCache)> {
    let (buf, refs) = place(bt, &kv_cache_layouts(cfg, size), BufferUsage::Compute)?;
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for r in refs {
        r.storage
            .buffer
            .memset_tensor(&r.layout, r.storage.offset, 0, 0, r.layout.nbytes())?;
        if r.name.starts_with("cache_k") {
            k.push(r)
        } else {
            v.push(r)
        }
    }
    Ok((buf, KvCache { k, v, size }))
}
