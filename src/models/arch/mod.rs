//! Model architectures as data, after llama.cpp's `llm_arch` / `LLM_TENSOR_NAMES` and its
//! per-architecture tensor lists (`src/llama-arch.cpp`, `src/llama-model.cpp`): an [`Arch`]
//! says which names a family's files use, which tensors it has (required or optional, shapes
//! from the hyper-parameters), and what its layers compute as a choice among shared blocks
//! (`models::blocks`). The loader, the weight layouts, the split rules, the planner's model
//! shapes, the layer placement and the plan report all read it; nothing else names a tensor.
//!
//! Adding a family is one file here (its `Arch` constant) and one line in [`ARCHS`].

mod bert;
mod gemma2;
mod gemma3;
mod llama;
mod moe;
mod olmoe;
mod phi3;
mod qwen2;
mod qwen3;
pub mod tensor;

pub use bert::BERT;
pub use gemma2::GEMMA2;
pub use gemma3::GEMMA3;
pub use llama::LLAMA;
pub use moe::{MIXTRAL, QWEN2MOE, QWEN3MOE};
pub use olmoe::OLMOE;
pub use phi3::{PHI3, PHI3_SEPARATE_QKV};
pub use qwen2::QWEN2;
pub use qwen3::QWEN3;
pub use tensor::{Cut, Dim, Group, Naming, Part, ROLES, RoleInfo, Scope, Tensor, Unit, layer_of};

use crate::op::{RopeMode, UnaryOp};
use crate::{Error, Result};

/// Whether a file must hold a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    Required,
    /// Used when present (llama's optional biases).
    Optional,
    /// When absent, the bytes of the given tensor are used (a tied output projection: the
    /// token embedding), placed a second time under this tensor's name.
    TiedTo(Tensor),
}

/// The feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mlp {
    /// `down(act(gate(x)) * up(x))`; SiLU runs as the fused `swiglu` op.
    Gated(UnaryOp),
    /// `down(act(up(x)))` (BERT).
    Plain(UnaryOp),
    /// A mixture of SwiGLU experts (llama.cpp's `build_moe_ffn` with softmax gating):
    /// the router's softmax over the experts, the `expert_used_count` largest per token, their
    /// probabilities as weights of the experts' outputs.
    Moe(MoeSpec),
}

/// The family's mixture of experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeSpec {
    /// The selected experts' weights divided by their sum, unless the file's
    /// `{arch}.expert_weights_norm` says otherwise (llama.cpp's `norm_w` for the family).
    pub norm_weights: bool,
    /// A shared expert every token uses, scaled by the sigmoid of its gate (Qwen2-MoE's
    /// `ffn_*_shexp`, `ffn_gate_inp_shexp`).
    pub shared_expert: bool,
}

/// What a decoder layer computes: pre-norm attention with a KV cache, then a pre-norm MLP,
/// each added to the residual stream. Optional parts follow the tensors the model has: biases
/// are added, Q and K are normalized per head (`attn_q_norm`, `attn_k_norm`; over the whole
/// projection for OLMoE's `AttnQNormFull`, `AttnKNormFull`) and a block's
/// output is normalized before the residual add (`post_attention_norm`, `post_ffw_norm`)
/// wherever the model has those tensors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecoderSpec {
    /// How RoPE pairs dimensions in this family's GGUF files (llama.cpp's
    /// `llama_model_rope_type`: the llama converter permutes Q and K for adjacent pairs,
    /// Qwen2 keeps Hugging Face's halves, NeoX).
    pub rope_mode: RopeMode,
    pub mlp: Mlp,
    /// Token embeddings multiplied by sqrt(n_embd) (Gemma).
    pub scale_embeddings: bool,
    /// The attention scores' scale.
    pub attn_scale: AttnScale,
    /// Sliding-window attention on some layers (Gemma 2 and 3).
    pub swa: Option<SwaSpec>,
    /// Reads `{arch}.attn_logit_softcapping` and `{arch}.final_logit_softcapping` (Gemma 2).
    pub softcap: bool,
}

/// How the attention scores are scaled before the softmax.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnScale {
    /// 1 / sqrt(head_dim).
    HeadDim,
    /// Gemma's `query_pre_attn_scalar`, as llama.cpp sets it (`llama-model.cpp`, after
    /// gemma_pytorch's config): 1 / sqrt(n_embd / n_head) for the 27B models (the layer count
    /// names them: `large_layers`), 1 / sqrt(head_dim) otherwise.
    Gemma { large_layers: &'static [usize] },
}

/// Which layers attend through a sliding window, after llama.cpp's `set_swa_pattern`: layer
/// `l` is local when `l % pattern < pattern - 1` (every `pattern`-th layer attends to the
/// whole context); pattern 0: every layer is local (Phi-3).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SwaSpec {
    pub pattern: usize,
    /// The RoPE base of local layers (`None`: the file's `rope.freq_base`, as global layers).
    pub rope_base: Option<f32>,
    /// The window when the file has no `{arch}.attention.sliding_window` (`None`: required,
    /// unless `optional`).
    pub default_window: Option<usize>,
    /// A file without the window key has no sliding window (Phi-3).
    pub optional: bool,
}

/// What an encoder layer computes: post-norm attention without a cache (LayerNorm with bias),
/// then a post-norm MLP (BERT).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncoderSpec {
    pub mlp: Mlp,
}

/// Which graph builder runs the family.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Decoder(DecoderSpec),
    Encoder(EncoderSpec),
}

/// One model architecture.
#[derive(Debug, PartialEq)]
pub struct Arch {
    /// The family's name: GGUF's `general.architecture` for GGUF families.
    pub name: &'static str,
    /// Other `general.architecture` values with exactly this layout (`mistral` for `llama`).
    pub aliases: &'static [&'static str],
    pub naming: Naming,
    /// The tensors, in groups shared between families; whole-model tensors first, then one
    /// layer's, in the order they are placed.
    pub tensors: &'static [&'static [(Tensor, Need)]],
    pub kind: Kind,
}

/// Every architecture metashard runs.
pub const ARCHS: &[&Arch] = &[
    &llama::LLAMA,
    &qwen2::QWEN2,
    &qwen3::QWEN3,
    &moe::QWEN3MOE,
    &moe::QWEN2MOE,
    &moe::MIXTRAL,
    &gemma2::GEMMA2,
    &gemma3::GEMMA3,
    &phi3::PHI3,
    &bert::BERT,
    // Last, so the families before it keep their place (tests seed files by it).
    &olmoe::OLMOE,
];

/// Other tensor layouts of a GGUF architecture name, told apart by the tensors a file has
/// ([`Arch::for_file`]).
pub const VARIANTS: &[&Arch] = &[&phi3::PHI3_SEPARATE_QKV];

impl Arch {
    /// The architecture of a GGUF file whose `general.architecture` is `name` and which has a
    /// tensor named `n` where `has(n)`: the one [`ARCHS`] lists under the name, unless the file
    /// lacks one of its required layer-0 tensors and a variant of the same name
    /// ([`VARIANTS`]) has all of its own (Phi-3 with separate Q, K and V). A file fitting
    /// neither gets the listed one, whose loading names the missing tensor.
    pub fn for_file(name: &str, has: &dyn Fn(&str) -> bool) -> Option<&'static Arch> {
        let listed = Arch::from_gguf_name(name)?;
        let complete = |a: &Arch| {
            a.layer_tensors()
                .filter(|(_, need)| *need == Need::Required)
                .all(|(t, _)| has(&a.name(t, 0)))
        };
        if complete(listed) {
            return Some(listed);
        }
        let variant = VARIANTS
            .iter()
            .copied()
            .find(|v| v.name == listed.name && complete(v));
        Some(variant.unwrap_or(listed))
    }

    /// The architecture a GGUF file's `general.architecture` names.
    pub fn from_gguf_name(name: &str) -> Option<&'static Arch> {
        ARCHS
            .iter()
            .find(|a| a.naming == Naming::Gguf && (a.name == name || a.aliases.contains(&name)))
            .copied()
    }

    /// Why `name` is refused: it is not in [`ARCHS`] (the supported names listed).
    pub fn unsupported(name: &str) -> String {
        format!(
            "architecture `{name}` is not supported (supported: {})",
            gguf_names().join(", ")
        )
    }

    /// Every `(tensor, need)` of this family.
    pub fn tensor_list(&self) -> impl Iterator<Item = (Tensor, Need)> + '_ {
        self.tensors.iter().flat_map(|g| g.iter().copied())
    }

    /// How `tensor` is needed, `None` when this family has no such tensor.
    pub fn need(&self, tensor: Tensor) -> Option<Need> {
        self.tensor_list()
            .find(|(t, _)| *t == tensor)
            .map(|(_, n)| n)
    }

    pub fn has(&self, tensor: Tensor) -> bool {
        self.need(tensor).is_some()
    }

    /// Whole-model tensors, in placement order.
    pub fn model_tensors(&self) -> impl Iterator<Item = (Tensor, Need)> + '_ {
        self.tensor_list()
            .filter(|(t, _)| t.scope() == Scope::Model)
    }

    /// One layer's tensors, in placement order.
    pub fn layer_tensors(&self) -> impl Iterator<Item = (Tensor, Need)> + '_ {
        self.tensor_list()
            .filter(|(t, _)| t.scope() == Scope::Layer)
    }

    /// The decoder layer, or an error naming the family when it is not a decoder.
    pub fn decoder(&self) -> Result<&DecoderSpec> {
        match &self.kind {
            Kind::Decoder(d) => Ok(d),
            Kind::Encoder(_) => Err(Error::Model {
                model: self.name.to_string(),
                reason: format!(
                    "`{}` is an encoder; this command needs a decoder (use `embed`)",
                    self.name
                ),
            }),
        }
    }

    /// The role and layer of a name in this family's files (caches too); `None` for a name the
    /// family does not have.
    pub fn parse(&self, name: &str) -> Option<(Tensor, Option<usize>)> {
        self.naming
            .parse_among(name, &|t| t.scope() == Scope::Cache || self.has(t))
    }

    /// The name of `tensor` (of `layer`) in this family's files.
    pub fn name(&self, tensor: Tensor, layer: usize) -> String {
        self.naming
            .name(tensor, layer)
            .expect("every role of a family's table has a name in its naming")
    }
}

/// The GGUF architecture names metashard runs, for messages.
pub fn gguf_names() -> Vec<&'static str> {
    ARCHS
        .iter()
        .filter(|a| a.naming == Naming::Gguf)
        .flat_map(|a| std::iter::once(a.name).chain(a.aliases.iter().copied()))
        .fold(Vec::new(), |mut v, n| {
            // Mixtral shares `llama`'s names.
            if !v.contains(&n) {
                v.push(n);
            }
            v
        })
}

/// Tensor groups shared by families (llama.cpp's per-architecture lists repeat these).
pub mod groups {
    use super::Need::{Optional, Required, TiedTo};
    use super::{Need, Tensor::*};
    use crate::models::arch::Tensor;

    /// A decoder's ends: embedding, final norm, output (tied to the embedding when absent).
    pub const DECODER_ENDS: &[(Tensor, Need)] = &[
        (TokenEmbd, Required),
        (OutputNorm, Required),
        (Output, TiedTo(TokenEmbd)),
    ];
    /// A pre-norm attention block.
    pub const ATTENTION: &[(Tensor, Need)] = &[
        (AttnNorm, Required),
        (AttnQ, Required),
        (AttnK, Required),
        (AttnV, Required),
        (AttnOut, Required),
    ];
    /// Q, K and V biases that a family must have (Qwen2).
    pub const QKV_BIAS: &[(Tensor, Need)] = &[
        (AttnQBias, Required),
        (AttnKBias, Required),
        (AttnVBias, Required),
    ];
    /// Per-head Q and K norms (Qwen3, Gemma 3).
    pub const QK_NORM: &[(Tensor, Need)] = &[(AttnQNorm, Required), (AttnKNorm, Required)];
    /// Q and K norms over the whole projections (OLMoE).
    pub const QK_NORM_FULL: &[(Tensor, Need)] =
        &[(AttnQNormFull, Required), (AttnKNormFull, Required)];
    /// Norms of each block's output before its residual add (Gemma 2 and 3).
    pub const POST_NORMS: &[(Tensor, Need)] = &[(AttnPostNorm, Required), (FfnPostNorm, Required)];
    /// Llama 3's RoPE frequency factors, when the file has them (`rope_freqs.weight`).
    pub const ROPE_FACTORS: &[(Tensor, Need)] = &[(RopeFreqs, Optional)];
    /// LongRoPE's factors, when the file has them (Phi-3's 128k-context models).
    pub const LONG_ROPE: &[(Tensor, Need)] =
        &[(RopeFactorsLong, Optional), (RopeFactorsShort, Optional)];
    /// Attention biases a family may have (llama.cpp loads them optionally for llama).
    pub const OPTIONAL_ATTN_BIAS: &[(Tensor, Need)] = &[
        (AttnQBias, Optional),
        (AttnKBias, Optional),
        (AttnVBias, Optional),
        (AttnOutBias, Optional),
    ];
    /// A pre-norm attention block with Q | K | V in one matrix (Phi-3).
    pub const FUSED_ATTENTION: &[(Tensor, Need)] = &[
        (AttnNorm, Required),
        (AttnQkv, Required),
        (AttnOut, Required),
    ];
    /// A pre-norm gated MLP with gate | up in one matrix (Phi-3's `ffn_up`).
    pub const FUSED_GATED_MLP: &[(Tensor, Need)] = &[
        (FfnNorm, Required),
        (FfnGateUp, Required),
        (FfnDown, Required),
    ];
    /// A pre-norm mixture of experts: the router and the experts' 3-D tensors.
    pub const MOE_MLP: &[(Tensor, Need)] = &[
        (FfnNorm, Required),
        (FfnGateInp, Required),
        (FfnGateExps, Required),
        (FfnUpExps, Required),
        (FfnDownExps, Required),
    ];
    /// A shared expert with its sigmoid gate (Qwen2-MoE).
    pub const SHARED_EXPERT: &[(Tensor, Need)] = &[
        (FfnGateInpShexp, Required),
        (FfnGateShexp, Required),
        (FfnUpShexp, Required),
        (FfnDownShexp, Required),
    ];
    /// A pre-norm gated MLP.
    pub const GATED_MLP: &[(Tensor, Need)] = &[
        (FfnNorm, Required),
        (FfnGate, Required),
        (FfnUp, Required),
        (FfnDown, Required),
    ];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archs_are_found_by_gguf_name_and_unknown_ones_named() {
        assert_eq!(Arch::from_gguf_name("mistral").unwrap().name, "llama");
        assert_eq!(Arch::from_gguf_name("qwen2").unwrap().name, "qwen2");
        assert_eq!(Arch::from_gguf_name("phi3").unwrap().name, "phi3");
        assert!(Arch::from_gguf_name("falcon").is_none());
        let e = Arch::unsupported("falcon");
        assert!(e.contains("`falcon`") && e.contains("gemma3"), "{e}");
        // BERT is read from safetensors, not looked up by a GGUF name.
        assert!(Arch::from_gguf_name("bert").is_none());
    }

    #[test]
    fn every_role_of_a_family_has_a_name_in_its_naming() {
        for a in ARCHS {
            for (t, _) in a.tensor_list() {
                let name = a
                    .naming
                    .name(t, 0)
                    .unwrap_or_else(|| panic!("{}: {t:?}", a.name));
                assert_eq!(a.parse(&name).map(|p| p.0), Some(t), "{name}");
            }
        }
        assert_eq!(
            Arch::from_gguf_name("llama")
                .unwrap()
                .parse("blk.0.attn_q.bias")
                .map(|p| p.0),
            Some(Tensor::AttnQBias)
        );
        // `ffn_up.weight` is gate | up in Phi-3 files, the plain up projection elsewhere.
        let up = |a: &str| {
            Arch::from_gguf_name(a)
                .unwrap()
                .parse("blk.1.ffn_up.weight")
        };
        assert_eq!(up("phi3"), Some((Tensor::FfnGateUp, Some(1))));
        assert_eq!(up("llama"), Some((Tensor::FfnUp, Some(1))));
        assert_eq!(up("gemma3"), Some((Tensor::FfnUp, Some(1))));
    }
}
