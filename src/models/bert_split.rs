//! The built-in split callback for BERT encoders (Megatron-style tensor parallelism, the
//! assignments llama.cpp's meta-device callback makes for a dense model, applied to BERT's
//! safetensors names; see `shared/reference/upstream-meta-facts.md`):
//!
//! | tensor | state |
//! |---|---|
//! | `attention.self.{query,key,value}.weight` `[in, out]` | Axis1, whole heads |
//! | `attention.self.{query,key,value}.bias` | Axis0, the same extents |
//! | `attention.output.dense.weight` `[in, out]` | Axis0 (row-parallel: partial sums) |
//! | `intermediate.dense.weight` / `.bias` | Axis1 / Axis0 |
//! | `output.dense.weight` | Axis0 (row-parallel) |
//! | the biases after a reduction, embeddings, LayerNorms | Mirrored |
//!
//! Heads are split in whole units (12 heads on 5 devices: 3, 3, 2, 2, 2), the intermediate
//! width in whole units of 32 where it divides; the rounding remainder rotates with the layer
//! index, so no device always carries the extra head. More devices than heads leave some
//! devices without heads (zero extents).

use super::bert::BertConfig;
use crate::meta::{SplitFn, TensorInfo};
use crate::split_state::{Granularity, SplitState, split_even};
use crate::{Error, Result};
use std::sync::Arc;

/// What a BERT tensor name refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BertRole {
    /// Query, key or value weight (column-parallel).
    QkvWeight,
    /// Query, key or value bias (split like the weight's output features).
    QkvBias,
    /// Attention output dense weight (row-parallel).
    AttnOut,
    /// Intermediate dense weight (column-parallel).
    Inter,
    InterBias,
    /// Output dense weight (row-parallel).
    Out,
    /// Everything else: mirrored.
    Other,
}

/// Parse `[bert.]encoder.layer.N.<kind>` into (role, layer).
pub fn bert_role(name: &str) -> (BertRole, usize) {
    let name = name.strip_prefix("bert.").unwrap_or(name);
    let Some(rest) = name.strip_prefix("encoder.layer.") else {
        return (BertRole::Other, 0);
    };
    let Some((layer, kind)) = rest.split_once('.') else {
        return (BertRole::Other, 0);
    };
    let Ok(layer) = layer.parse() else {
        return (BertRole::Other, 0);
    };
    let role = match kind {
        "attention.self.query.weight"
        | "attention.self.key.weight"
        | "attention.self.value.weight" => BertRole::QkvWeight,
        "attention.self.query.bias" | "attention.self.key.bias" | "attention.self.value.bias" => {
            BertRole::QkvBias
        }
        "attention.output.dense.weight" => BertRole::AttnOut,
        "intermediate.dense.weight" => BertRole::Inter,
        "intermediate.dense.bias" => BertRole::InterBias,
        "output.dense.weight" => BertRole::Out,
        _ => BertRole::Other,
    };
    (role, layer)
}

/// Extents of the attention features (whole heads) of `layer` over `n` devices.
pub fn head_extents(cfg: &BertConfig, n: usize, layer: usize) -> Result<Vec<usize>> {
    let hd = cfg.head_dim();
    Ok(split_even(cfg.n_head, n, Granularity(1), layer)?
        .into_iter()
        .map(|h| h * hd)
        .collect())
}

/// Extents of the intermediate features of `layer` over `n` devices (whole 32s where possible).
pub fn ffn_extents(cfg: &BertConfig, n: usize, layer: usize) -> Result<Vec<usize>> {
    let unit = if cfg.n_ff.is_multiple_of(32) { 32 } else { 1 };
    Ok(split_even(cfg.n_ff / unit, n, Granularity(1), layer)?
        .into_iter()
        .map(|u| u * unit)
        .collect())
}

/// The built-in callback for an encoder with this configuration.
pub fn bert_split(cfg: &BertConfig) -> SplitFn {
    let cfg = cfg.clone();
    Arc::new(move |t: &TensorInfo| -> Result<SplitState> {
        let n = t.n_devices;
        let (role, layer) = bert_role(t.name);
        let ne = t.layout.ne;
        // The dimension the split cuts must be the one the config says.
        let expect = |dim: usize, want: usize| -> Result<()> {
            if ne[dim] == want {
                Ok(())
            } else {
                Err(Error::InvalidSplit {
                    tensor: t.name.to_string(),
                    reason: format!(
                        "bert split: dimension {dim} of {} is {}, config.json implies {want}",
                        t.layout.shape(),
                        ne[dim]
                    ),
                })
            }
        };
        if role != BertRole::Other && layer >= cfg.n_layer {
            return Err(Error::InvalidSplit {
                tensor: t.name.to_string(),
                reason: format!(
                    "bert split: layer {layer} but num_hidden_layers is {}",
                    cfg.n_layer
                ),
            });
        }
        Ok(match role {
            BertRole::QkvWeight => {
                expect(1, cfg.n_embd)?;
                SplitState::axis(1, &head_extents(&cfg, n, layer)?)
            }
            BertRole::QkvBias => {
                expect(0, cfg.n_embd)?;
                SplitState::axis(0, &head_extents(&cfg, n, layer)?)
            }
            BertRole::AttnOut => {
                expect(0, cfg.n_embd)?;
                SplitState::axis(0, &head_extents(&cfg, n, layer)?)
            }
            BertRole::Inter => {
                expect(1, cfg.n_ff)?;
                SplitState::axis(1, &ffn_extents(&cfg, n, layer)?)
            }
            BertRole::InterBias => {
                expect(0, cfg.n_ff)?;
                SplitState::axis(0, &ffn_extents(&cfg, n, layer)?)
            }
            BertRole::Out => {
                expect(0, cfg.n_ff)?;
                SplitState::axis(0, &ffn_extents(&cfg, n, layer)?)
            }
            BertRole::Other => SplitState::mirrored(n),
        })
    })
}
