//! `gemma2` (Gemma 2), after llama.cpp's `LLM_ARCH_GEMMA2` (`llama-model.cpp`: hyper-parameters,
//! `src/models/gemma2*.cpp`: graph) and Hugging Face's `Gemma2` modelling: token embeddings
//! scaled by sqrt(n_embd); every block's output normalized before its residual add
//! (`post_attention_norm`, `post_ffw_norm`); a GELU-gated MLP (tanh GELU); RoPE on the halves
//! of each head; sliding-window attention (4096 unless the file says) on every other layer
//! starting with the first; attention scores soft-capped `c * tanh(s / c)` with
//! `attn_logit_softcapping` and the logits with `final_logit_softcapping`. GGUF stores the RMS
//! norms' weights with Gemma's `1 + w` already added, so they multiply as any other.

use super::groups::{ATTENTION, DECODER_ENDS, GATED_MLP, POST_NORMS};
use super::{Arch, AttnScale, DecoderSpec, Kind, Mlp, Naming, SwaSpec};
use crate::op::{RopeMode, UnaryOp};

pub const GEMMA2: Arch = Arch {
    name: "gemma2",
    aliases: &[],
    naming: Naming::Gguf,
    tensors: &[DECODER_ENDS, ATTENTION, POST_NORMS, GATED_MLP],
    kind: Kind::Decoder(DecoderSpec {
        rope_mode: RopeMode::NeoX,
        mlp: Mlp::Gated(UnaryOp::Gelu),
        scale_embeddings: true,
        // Gemma 2 27B has 46 layers.
        attn_scale: AttnScale::Gemma {
            large_layers: &[46],
        },
        swa: Some(SwaSpec {
            pattern: 2,
            rope_base: None,
            default_window: Some(4096),
            optional: false,
        }),
        softcap: true,
    }),
};
