//! `olmoe` (OLMoE), after llama.cpp's `LLM_ARCH_OLMOE` tensors and graph (`src/llama-arch.cpp`,
//! `src/models/olmoe.cpp`) and Hugging Face's `OlmoeAttention` / `OlmoeSparseMoeBlock`:
//! llama's attention without biases, with Q and K each RMS-normalized over the whole
//! projection (`attn_q_norm` is `[n_head * head_dim]`, `attn_k_norm` `[n_head_kv * head_dim]`,
//! applied before the reshape to heads, unlike Qwen3's per-head norms), NeoX RoPE
//! (`llama_model_rope_type`), then a mixture of SwiGLU experts with softmax gating whose
//! selected weights are not renormalised (`build_moe_ffn(..., norm_w = false, ...)`, HF's
//! `norm_topk_prob = False`); the experts are `feed_forward_length` wide, as llama.cpp loads
//! them with `n_ff`.

use super::groups::{ATTENTION, DECODER_ENDS, MOE_MLP, QK_NORM_FULL};
use super::{Arch, Naming};
use crate::op::RopeMode;

pub const OLMOE: Arch = Arch {
    name: "olmoe",
    aliases: &[],
    naming: Naming::Gguf,
    tensors: &[DECODER_ENDS, ATTENTION, QK_NORM_FULL, MOE_MLP],
    // Softmax gating, the weights not renormalised, no shared expert.
    kind: super::moe::spec(RopeMode::NeoX, false, false),
};
