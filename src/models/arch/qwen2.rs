//! `qwen2` (Qwen2, Qwen2.5): llama's layer with Q, K and V biases (required) and RoPE on the
//! two halves of each head (NeoX; llama.cpp's `LLM_ARCH_QWEN2` uses `LLAMA_ROPE_TYPE_NEOX`),
//! after Hugging Face's `Qwen2Attention` (`q_proj`/`k_proj`/`v_proj` with `bias=True`,
//! `o_proj` without) and `rotate_half`.

use super::groups::{ATTENTION, DECODER_ENDS, GATED_MLP, QKV_BIAS};
use super::{Arch, AttnScale, DecoderSpec, Kind, Mlp, Naming};
use crate::op::{RopeMode, UnaryOp};

pub const QWEN2: Arch = Arch {
    name: "qwen2",
    aliases: &[],
    naming: Naming::Gguf,
    tensors: &[DECODER_ENDS, ATTENTION, QKV_BIAS, GATED_MLP],
    kind: Kind::Decoder(DecoderSpec {
        rope_mode: RopeMode::NeoX,
        mlp: Mlp::Gated(UnaryOp::Silu),
        scale_embeddings: false,
        attn_scale: AttnScale::HeadDim,
        swa: None,
        softcap: false,
    }),
};
