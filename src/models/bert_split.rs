//! Split callbacks for BERT encoders (Megatron-style tensor parallelism, the assignments
//! llama.cpp's meta-device callback makes for a dense model, applied to BERT's safetensors
//! names; see `shared/reference/upstream-meta-facts.md`). [`bert_by_layer`] is the general
//! form, taking the decoder's [`DecoderSplit`] (so the named strategies of
//! `planner::Strategy` apply to encoders too); [`bert_split`] is its every-layer case:
//!
//! | tensor | state when its part is split | `bert_split` |
//! |---|---|---|
//! | `attention.self.{query,key,value}.weight` `[in, out]` | Axis1, whole heads | split |
//! | `attention.self.{query,key,value}.bias` | Axis0, the same extents | split |
//! | `attention.output.dense.weight` `[in, out]` | Axis0 (row-parallel: partial sums) | split |
//! | `intermediate.dense.weight` / `.bias` | Axis1 / Axis0 | split |
//! | `output.dense.weight` | Axis0 (row-parallel) | split |
//! | `embeddings.word_embeddings.weight` `[n_embd, vocab]` | Axis1 (by vocabulary rows: the lookup is Partial) | mirrored |
//! | the biases after a reduction, position and type embeddings, LayerNorms | Mirrored | mirrored |
//!
//! Heads are split in whole units (12 heads on 5 devices: 3, 3, 2, 2, 2), the intermediate
//! width in whole units of 32 where it divides; the rounding remainder rotates with the layer
//! index, so no device always carries the extra head. More devices than heads leave some
//! devices without heads (zero extents). Ratios (`DecoderSplit::ratios`) share heads, 32s and
//! vocabulary rows in proportion.

use super::bert::BertConfig;
use super::split::extents;
use super::split::{DecoderSplit, LayerSplit};
use crate::meta::{SplitFn, TensorInfo};
use crate::split_state::SplitState;
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
    /// The word-embedding table (split by vocabulary rows, or mirrored).
    WordEmbedding,
    /// Everything else: mirrored.
    Other,
}

/// Parse `[bert.]encoder.layer.N.<kind>` into (role, layer).
pub fn bert_role(name: &str) -> (BertRole, usize) {
    let name = name.strip_prefix("bert.").unwrap_or(name);
    if name == "embeddings.word_embeddings.weight" {
        return (BertRole::WordEmbedding, 0);
    }
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

fn heads(cfg: &BertConfig, n: usize, ratios: Option<&[f64]>, layer: usize) -> Result<Vec<usize>> {
    extents(cfg.n_head, cfg.head_dim(), n, ratios, layer)
}

fn ffn(cfg: &BertConfig, n: usize, ratios: Option<&[f64]>, layer: usize) -> Result<Vec<usize>> {
    let unit = if cfg.n_ff.is_multiple_of(32) { 32 } else { 1 };
    extents(cfg.n_ff / unit, unit, n, ratios, layer)
}

/// Extents of the attention features (whole heads) of `layer` over `n` devices.
pub fn head_extents(cfg: &BertConfig, n: usize, layer: usize) -> Result<Vec<usize>> {
    heads(cfg, n, None, layer)
}

/// Extents of the intermediate features of `layer` over `n` devices (whole 32s where possible).
pub fn ffn_extents(cfg: &BertConfig, n: usize, layer: usize) -> Result<Vec<usize>> {
    ffn(cfg, n, None, layer)
}

/// The built-in callback for an encoder with this configuration: attention and the MLP split
/// in every layer, the embeddings mirrored (`bert_by_layer` with every layer
/// `{ attention: true, mlp: true }` and `embedding: false`).
pub fn bert_split(cfg: &BertConfig) -> SplitFn {
    let layer = LayerSplit {
        attention: true,
        mlp: true,
    };
    bert_by_layer(cfg, DecoderSplit::uniform(cfg.n_layer, layer, false, false))
}

/// The callback for a per-layer choice of splits, in the decoder's terms:
///
/// - `split.layers[i].attention`: Q/K/V of layer i by whole heads (with their biases), the
///   attention output dense by rows; otherwise all mirrored.
/// - `split.layers[i].mlp`: the intermediate dense by columns (with its bias), the output dense
///   by rows; otherwise mirrored.
/// - `split.embedding`: the word-embedding table by vocabulary rows (each device looks up the
///   ids it holds: a Partial lookup, summed before the embedding LayerNorm); otherwise
///   mirrored. Position and type embeddings are always mirrored.
/// - `split.output`: ignored (an encoder has no output projection: its output is the pooled
///   hidden state).
/// - `split.ratios`: per-device shares of heads, 32s and vocabulary rows (one per device; even
///   when absent).
///
/// Layers past `split.layers` are mirrored. A split tensor whose cut dimension disagrees with
/// `config.json`, a layer beyond `num_hidden_layers` or ratios not one per device are errors
/// naming the tensor.
pub fn bert_by_layer(cfg: &BertConfig, split: DecoderSplit) -> SplitFn {
    let cfg = cfg.clone();
    Arc::new(move |t: &TensorInfo| -> Result<SplitState> {
        let n = t.n_devices;
        let (role, layer) = bert_role(t.name);
        let ne = t.layout.ne;
        let ratios = split.ratios.as_deref();
        let named = |e: Error| -> Error {
            match e {
                Error::InvalidSplit { .. } => e,
                e => Error::InvalidSplit {
                    tensor: t.name.to_string(),
                    reason: format!("bert split: {e}"),
                },
            }
        };
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
        if !matches!(role, BertRole::Other | BertRole::WordEmbedding) && layer >= cfg.n_layer {
            return Err(Error::InvalidSplit {
                tensor: t.name.to_string(),
                reason: format!(
                    "bert split: layer {layer} but num_hidden_layers is {}",
                    cfg.n_layer
                ),
            });
        }
        let l = split.layers.get(layer).copied().unwrap_or(LayerSplit {
            attention: false,
            mlp: false,
        });
        let (attn, mlp) = (l.attention, l.mlp);
        let state = match role {
            BertRole::QkvWeight if attn => {
                expect(1, cfg.n_embd)?;
                SplitState::axis(1, &heads(&cfg, n, ratios, layer).map_err(named)?)
            }
            BertRole::QkvBias if attn => {
                expect(0, cfg.n_embd)?;
                SplitState::axis(0, &heads(&cfg, n, ratios, layer).map_err(named)?)
            }
            BertRole::AttnOut if attn => {
                expect(0, cfg.n_embd)?;
                SplitState::axis(0, &heads(&cfg, n, ratios, layer).map_err(named)?)
            }
            BertRole::Inter if mlp => {
                expect(1, cfg.n_ff)?;
                SplitState::axis(1, &ffn(&cfg, n, ratios, layer).map_err(named)?)
            }
            BertRole::InterBias if mlp => {
                expect(0, cfg.n_ff)?;
                SplitState::axis(0, &ffn(&cfg, n, ratios, layer).map_err(named)?)
            }
            BertRole::Out if mlp => {
                expect(0, cfg.n_ff)?;
                SplitState::axis(0, &ffn(&cfg, n, ratios, layer).map_err(named)?)
            }
            BertRole::WordEmbedding if split.embedding => {
                expect(0, cfg.n_embd)?;
                expect(1, cfg.n_vocab)?;
                SplitState::axis(1, &extents(cfg.n_vocab, 1, n, ratios, 0).map_err(named)?)
            }
            _ => SplitState::mirrored(n),
        };
        Ok(state)
    })
}
