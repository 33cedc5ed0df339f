//! `phi3` (Phi-3, Phi-3.5 and Phi-4-mini text models), after llama.cpp's `LLM_ARCH_PHI3`
//! (`src/llama-arch.cpp`: tensor names; `src/llama-model.cpp`: hyper-parameters, tensors
//! `attn_qkv` `{n_embd, n_embd + 2 * n_embd_gqa}` and `ffn_up` `{n_embd, 2 * n_ff}`, graph)
//! and Hugging Face's `Phi3` modelling: llama's layer with Q | K | V in one matrix
//! (`attn_qkv`, rows Q then K then V) and gate | up in one matrix stored under the name of the
//! up projection (`ffn_up`, 2 * n_ff rows: `silu(gate) * up`, gate first), NeoX RoPE over the
//! file's `phi3.rope.dimension_count` dimensions of each head (Phi-4-mini rotates 3/4 of them),
//! 1 / sqrt(head_dim) attention scale, the output projection tied to the embedding when absent.
//!
//! The sliding window (`phi3.attention.sliding_window`, Hugging Face's `sliding_window`)
//! applies to every layer when the file sets it (llama.cpp's pattern 0); current llama.cpp
//! turns it off with a warning (its PR 13676), Hugging Face's mask keeps it.
//!
//! LongRoPE (the 128k-context models: `rope_factors_long` / `rope_factors_short`,
//! `phi3.rope.scaling.attn_factor`, `phi3.rope.scaling.original_context_length`), as
//! llama.cpp's `get_rope_factors` and `ggml_rope_ext` apply it: pair i's angle divided by
//! factor i, the long factors when the session's context exceeds the original one, the short
//! ones otherwise; the rotated dimensions of Q and K multiplied by the attention factor
//! (Hugging Face's `attention_scaling` on cos and sin).
//!
//! Some Phi-3 files hold Q, K and V as three tensors (`attn_q`, `attn_k`, `attn_v`, llama's
//! names and shapes) instead of `attn_qkv`: llama.cpp's `llama-model.cpp` loads `attn_qkv` as
//! not required for `LLM_ARCH_PHI3` and the three tensors when it is absent, and its graph
//! takes whichever the file has. [`PHI3_SEPARATE_QKV`] is that layout, a variant of the same
//! GGUF name (`Arch::for_file` picks it by the tensors present).

use super::groups::{ATTENTION, DECODER_ENDS, FUSED_ATTENTION, FUSED_GATED_MLP, LONG_ROPE};
use super::{Arch, AttnScale, DecoderSpec, Kind, Mlp, Naming, SwaSpec};
use crate::op::{RopeMode, UnaryOp};

pub const PHI3: Arch = Arch {
    name: "phi3",
    aliases: &[],
    naming: Naming::Gguf,
    tensors: &[DECODER_ENDS, LONG_ROPE, FUSED_ATTENTION, FUSED_GATED_MLP],
    kind: Kind::Decoder(DecoderSpec {
        rope_mode: RopeMode::NeoX,
        mlp: Mlp::Gated(UnaryOp::Silu),
        scale_embeddings: false,
        attn_scale: AttnScale::HeadDim,
        swa: Some(SwaSpec {
            pattern: 0,
            rope_base: None,
            default_window: None,
            optional: true,
        }),
        softcap: false,
    }),
};

/// Phi-3 with Q, K and V as three tensors (see the module doc): everything else as [`PHI3`].
pub const PHI3_SEPARATE_QKV: Arch = Arch {
    tensors: &[DECODER_ENDS, LONG_ROPE, ATTENTION, FUSED_GATED_MLP],
    ..PHI3
};
