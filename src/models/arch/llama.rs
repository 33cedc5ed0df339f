//! `llama` (and `mistral`, the same layout): llama.cpp's `LLM_ARCH_LLAMA` tensors, with the
//! attention biases it loads when present and Llama 3's RoPE frequency factors
//! (`rope_freqs.weight`, its long-context scaling: pair i's angle divided by factor i); RoPE
//! on adjacent pairs (the llama converter permutes Q and K rows for it), SwiGLU MLP.

use super::groups::{ATTENTION, DECODER_ENDS, GATED_MLP, OPTIONAL_ATTN_BIAS, ROPE_FACTORS};
use super::{Arch, AttnScale, DecoderSpec, Kind, Mlp, Naming};
use crate::op::{RopeMode, UnaryOp};

pub const LLAMA: Arch = Arch {
    name: "llama",
    aliases: &["mistral"],
    naming: Naming::Gguf,
    tensors: &[
        DECODER_ENDS,
        ROPE_FACTORS,
        ATTENTION,
        OPTIONAL_ATTN_BIAS,
        GATED_MLP,
    ],
    kind: Kind::Decoder(DecoderSpec {
        rope_mode: RopeMode::Normal,
        mlp: Mlp::Gated(UnaryOp::Silu),
        scale_embeddings: false,
        attn_scale: AttnScale::HeadDim,
        swa: None,
        softcap: false,
    }),
};
