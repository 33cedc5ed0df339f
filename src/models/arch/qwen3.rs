//! `qwen3` (Qwen3 dense): llama's layer without biases, with Q and K normalized per head
//! (RMS norm over each head's features, `attn_q_norm` / `attn_k_norm`) before RoPE on the
//! halves of each head (NeoX), and a head size the file gives (`qwen3.attention.key_length`,
//! not n_embd / n_head), after llama.cpp's `LLM_ARCH_QWEN3` graph and Hugging Face's
//! `Qwen3Attention` (`q_norm`, `k_norm`).

use super::groups::{ATTENTION, DECODER_ENDS, GATED_MLP, QK_NORM};
use super::{Arch, AttnScale, DecoderSpec, Kind, Mlp, Naming};
use crate::op::{RopeMode, UnaryOp};

pub const QWEN3: Arch = Arch {
    name: "qwen3",
    aliases: &[],
    naming: Naming::Gguf,
    tensors: &[DECODER_ENDS, ATTENTION, QK_NORM, GATED_MLP],
    kind: Kind::Decoder(DecoderSpec {
        rope_mode: RopeMode::NeoX,
        mlp: Mlp::Gated(UnaryOp::Silu),
        scale_embeddings: false,
        attn_scale: AttnScale::HeadDim,
        swa: None,
        softcap: false,
    }),
};
