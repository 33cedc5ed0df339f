//! The keys of a mixture of experts, as llama.cpp's `load_hparams` reads them
//! (`LLM_KV_EXPERT_COUNT`, `LLM_KV_EXPERT_USED_COUNT`, `LLM_KV_EXPERT_FEED_FORWARD_LENGTH`,
//! `LLM_KV_EXPERT_SHARED_FEED_FORWARD_LENGTH`, `LLM_KV_EXPERT_WEIGHTS_NORM`), each count
//! checked against the first layer's expert tensors before anything is sized by it.

use super::{Keys, model_err, shape_of};
use crate::Result;
use crate::io::gguf::GgufFile;
use crate::models::arch::{Arch, Mlp, MoeSpec, Tensor};

/// The most experts a layer may have (the largest released models have 384).
pub const MAX_EXPERTS: usize = 4096;

/// A mixture-of-experts layer's counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moe {
    pub n_expert: usize,
    /// Experts each token uses (`k` of the top-k).
    pub n_expert_used: usize,
    /// One expert's feed-forward width.
    pub n_ff_exp: usize,
    /// The shared expert's feed-forward width (0: none).
    pub n_ff_shexp: usize,
    /// The selected experts' weights divided by their sum.
    pub norm_weights: bool,
}

/// The family's experts as the file gives them (`None` for a family without experts).
pub(super) fn read_moe(
    g: &GgufFile,
    arch: &Arch,
    keys: &Keys,
    n_ff: Option<usize>,
) -> Result<Option<Moe>> {
    let Mlp::Moe(spec) = arch.decoder()?.mlp else {
        return Ok(None);
    };
    let MoeSpec {
        norm_weights,
        shared_expert,
    } = spec;
    let n_expert = keys.usize("expert_count")?;
    let gate = shape_of(g, arch, Tensor::FfnGateExps)?;
    if n_expert == 0 || n_expert > MAX_EXPERTS || gate[2] != n_expert {
        return Err(keys.err(
            &keys.key("expert_count"),
            format!(
                "{n_expert}, but {} is {} (and at most {MAX_EXPERTS} experts are taken)",
                arch.name(Tensor::FfnGateExps, 0),
                crate::Shape(gate)
            ),
        ));
    }
    let n_expert_used = keys.usize("expert_used_count")?;
    if n_expert_used == 0 || n_expert_used > n_expert {
        return Err(keys.err(
            &keys.key("expert_used_count"),
            format!("{n_expert_used}: must be in 1..={n_expert} (the experts)"),
        ));
    }
    // Mixtral's experts are `feed_forward_length` wide (llama.cpp loads them with n_ff).
    let ff_key = "expert_feed_forward_length";
    let n_ff_exp = match (keys.opt_usize(ff_key)?, n_ff) {
        (Some(v), _) | (None, Some(v)) => v,
        (None, None) => keys.usize(ff_key)?,
    };
    if n_ff_exp != gate[1] {
        return Err(keys.err(
            &keys.key(ff_key),
            format!(
                "{n_ff_exp}, but {} is {}",
                arch.name(Tensor::FfnGateExps, 0),
                crate::Shape(gate)
            ),
        ));
    }
    let n_ff_shexp = if shared_expert {
        let key = "expert_shared_feed_forward_length";
        let v = keys.usize(key)?;
        let up = shape_of(g, arch, Tensor::FfnUpShexp)?;
        if v != up[1] {
            return Err(keys.err(
                &keys.key(key),
                format!(
                    "{v}, but {} is {}",
                    arch.name(Tensor::FfnUpShexp, 0),
                    crate::Shape(up)
                ),
            ));
        }
        v
    } else {
        0
    };
    let norm_weights = g
        .opt_bool(&keys.key("expert_weights_norm"))
        .map_err(|e| model_err(g, e.to_string()))?
        .unwrap_or(norm_weights);
    Ok(Some(Moe {
        n_expert,
        n_expert_used,
        n_ff_exp,
        n_ff_shexp,
        norm_weights,
    }))
}
