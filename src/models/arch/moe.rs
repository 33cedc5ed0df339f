//! The mixture-of-experts families, after llama.cpp's `LLM_ARCH_QWEN3MOE`, `LLM_ARCH_QWEN2MOE`
//! and `LLM_ARCH_LLAMA` with `n_expert > 0` (Mixtral) tensor lists (`src/llama-arch.cpp`,
//! `src/llama-model.cpp`) and their `build_moe_ffn` calls (softmax gating; `norm_w` true for
//! Qwen3-MoE and Mixtral, false for Qwen2-MoE, whose shared expert is added scaled by the
//! sigmoid of `ffn_gate_inp_shexp · x`):
//!
//! - `qwen3moe`: Qwen3's attention (per-head Q and K norms, NeoX RoPE, a head size the file
//!   gives) with experts instead of the MLP;
//! - `qwen2moe`: Qwen2's attention (Q, K, V biases, NeoX RoPE) with experts and a shared expert;
//! - Mixtral: a GGUF `llama` file whose `llama.expert_count` is above 0 (`hparams::arch_of`
//!   takes this table for it): llama's attention with experts.

use super::groups::{
    ATTENTION, DECODER_ENDS, MOE_MLP, OPTIONAL_ATTN_BIAS, QK_NORM, QKV_BIAS, ROPE_FACTORS,
    SHARED_EXPERT,
};
use super::{Arch, AttnScale, DecoderSpec, Kind, Mlp, MoeSpec, Naming};
use crate::op::RopeMode;

/// A decoder whose MLP is a mixture of experts (OLMoE's too).
pub(super) const fn spec(rope_mode: RopeMode, norm_weights: bool, shared_expert: bool) -> Kind {
    Kind::Decoder(DecoderSpec {
        rope_mode,
        mlp: Mlp::Moe(MoeSpec {
            norm_weights,
            shared_expert,
        }),
        scale_embeddings: false,
        attn_scale: AttnScale::HeadDim,
        swa: None,
        softcap: false,
    })
}

pub const QWEN3MOE: Arch = Arch {
    name: "qwen3moe",
    aliases: &[],
    naming: Naming::Gguf,
    tensors: &[DECODER_ENDS, ATTENTION, QK_NORM, MOE_MLP],
    kind: spec(RopeMode::NeoX, true, false),
};

pub const QWEN2MOE: Arch = Arch {
    name: "qwen2moe",
    aliases: &[],
    naming: Naming::Gguf,
    tensors: &[DECODER_ENDS, ATTENTION, QKV_BIAS, MOE_MLP, SHARED_EXPERT],
    kind: spec(RopeMode::NeoX, false, true),
};

/// Mixtral: GGUF name `llama`, found by `hparams::arch_of` when the file has experts (the name
/// lookup finds the dense `llama` first).
pub const MIXTRAL: Arch = Arch {
    name: "llama",
    aliases: &["mistral"],
    naming: Naming::Gguf,
    tensors: &[
        DECODER_ENDS,
        ROPE_FACTORS,
        ATTENTION,
        OPTIONAL_ATTN_BIAS,
        MOE_MLP,
    ],
    kind: spec(RopeMode::Normal, true, false),
};
