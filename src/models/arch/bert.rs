//! `bert`: the encoder of sentence-transformers checkpoints (all-MiniLM-L6-v2), read from
//! safetensors with Hugging Face's names: embeddings of words, positions and token types with a
//! LayerNorm; per layer post-norm attention with biases and a GELU MLP with biases (the BERT
//! paper's post-LayerNorm layout; llama.cpp's `LLM_ARCH_BERT` lists the same tensors).

use super::Need::Required;
use super::Tensor::*;
use super::{Arch, EncoderSpec, Kind, Mlp, Naming};
use crate::op::UnaryOp;

pub const BERT: Arch = Arch {
    name: "bert",
    aliases: &[],
    naming: Naming::HfBert,
    tensors: &[
        &[
            (TokenEmbd, Required),
            (PosEmbd, Required),
            (TokenTypes, Required),
            (TokenEmbdNorm, Required),
            (TokenEmbdNormBias, Required),
        ],
        &[
            (AttnQ, Required),
            (AttnQBias, Required),
            (AttnK, Required),
            (AttnKBias, Required),
            (AttnV, Required),
            (AttnVBias, Required),
            (AttnOut, Required),
            (AttnOutBias, Required),
            (AttnOutNorm, Required),
            (AttnOutNormBias, Required),
            (FfnUp, Required),
            (FfnUpBias, Required),
            (FfnDown, Required),
            (FfnDownBias, Required),
            (LayerOutNorm, Required),
            (LayerOutNormBias, Required),
        ],
    ],
    // The activation is read from config.json (`hidden_act`); this is the default.
    kind: Kind::Encoder(EncoderSpec {
        mlp: Mlp::Plain(UnaryOp::GeluErf),
    }),
};
