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
