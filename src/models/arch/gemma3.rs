//! `gemma3` (Gemma 3 text), after llama.cpp's `LLM_ARCH_GEMMA3` (`llama-model.cpp`:
//! hyper-parameters, `src/models/gemma3*.cpp`: graph) and Hugging Face's `Gemma3` text
//! modelling: Gemma 2's layer (scaled embeddings, post-block norms, GELU-gated MLP, NeoX RoPE)
//! with Q and K normalized per head before RoPE, no soft-capping, a head size the file gives
//! (`gemma3.attention.key_length`), and five sliding-window layers (the file's
//! `gemma3.attention.sliding_window`, RoPE base 10000) to every global one (RoPE base from
//! `gemma3.rope.freq_base`).

use super::groups::{ATTENTION, DECODER_ENDS, GATED_MLP, POST_NORMS, QK_NORM};
use super::{Arch, AttnScale, DecoderSpec, Kind, Mlp, Naming, SwaSpec};
use crate::op::{RopeMode, UnaryOp};

pub const GEMMA3: Arch = Arch {
    name: "gemma3",
    aliases: &[],
    naming: Naming::Gguf,
    tensors: &[DECODER_ENDS, ATTENTION, QK_NORM, POST_NORMS, GATED_MLP],
    kind: Kind::Decoder(DecoderSpec {
        rope_mode: RopeMode::NeoX,
        mlp: Mlp::Gated(UnaryOp::Gelu),
        scale_embeddings: true,
        // Gemma 3 27B has 62 layers.
        attn_scale: AttnScale::Gemma {
            large_layers: &[62],
        },
        swa: Some(SwaSpec {
            pattern: 6,
            rope_base: Some(10000.0),
            default_window: None,
            optional: false,
        }),
        softcap: false,
    }),
};
