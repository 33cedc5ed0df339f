//! Tensor roles shared by every architecture (llama.cpp's `llm_tensor`), written once with
//! everything that depends on the role alone: its GGUF name, its name in a Hugging Face BERT
//! checkpoint, its shape in hyper-parameter units, the group the plan report shows it in, and
//! how a tensor-parallel split cuts it.
//!
//! GGUF names follow llama.cpp's `LLM_TENSOR_NAMES` (`src/llama-arch.cpp`): a per-layer tensor
//! is `blk.{N}.<base>.weight` (or `.bias`), a whole-model one `<base>.weight`. The Hugging Face
//! names are those of BERT checkpoints as `transformers` saves them (`BertModel`'s
//! `state_dict`, optionally prefixed `bert.`). KV caches are not in any file; they are named
//! `cache_k_l{N}` / `cache_v_l{N}` wherever they are placed.

/// What a tensor is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tensor {
    // The whole model.
    TokenEmbd,
    TokenTypes,
    PosEmbd,
    TokenEmbdNorm,
    TokenEmbdNormBias,
    OutputNorm,
    Output,
    RopeFreqs,
    RopeFactorsLong,
    RopeFactorsShort,
    // Each layer.
    AttnNorm,
    AttnQ,
    AttnQBias,
    AttnK,
    AttnKBias,
    AttnV,
    AttnVBias,
    AttnQkv,
    AttnOut,
    AttnOutBias,
    AttnOutNorm,
    AttnOutNormBias,
    AttnQNorm,
    AttnKNorm,
    AttnQNormFull,
    AttnKNormFull,
    AttnPostNorm,
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnGateUp,
    FfnUpBias,
    FfnDown,
    FfnDownBias,
    LayerOutNorm,
    LayerOutNormBias,
    FfnPostNorm,
    // A mixture of experts: the router, the experts (3-D: one matrix per expert along ne[2]),
    // and the shared expert with its sigmoid gate (Qwen2-MoE).
    FfnGateInp,
    FfnGateExps,
    FfnUpExps,
    FfnDownExps,
    FfnGateInpShexp,
    FfnGateShexp,
    FfnUpShexp,
    FfnDownShexp,
    // Each layer's KV cache (made at run time, never in a file).
    CacheK,
    CacheV,
}

/// Where a tensor lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// One per model.
    Model,
    /// One per layer, in the file.
    Layer,
    /// One per layer, made at run time.
    Cache,
}

/// A dimension in hyper-parameter units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dim {
    One,
    /// The model width (`n_embd`).
    Embd,
    /// The feed-forward width (`n_ff`).
    Ff,
    /// The vocabulary.
    Vocab,
    /// All query heads: `n_head * head_dim`.
    Q,
    /// All key (or value) heads: `n_head_kv * head_dim`.
    Kv,
    /// Q, K and V fused: `(n_head + 2 * n_head_kv) * head_dim`.
    Qkv,
    /// Gate and up fused: `2 * n_ff`.
    Ff2,
    /// One head: `head_dim`.
    HeadDim,
    /// Half the rotated dimensions of a head: `rope_dims / 2`.
    RopeHalf,
    /// The position table (BERT's `max_position_embeddings`).
    Pos,
    /// The token-type table (BERT's `type_vocab_size`).
    Types,
    /// KV cache rows (the session's context).
    Ctx,
    /// Experts of a mixture-of-experts layer (`{arch}.expert_count`).
    Expert,
    /// One expert's feed-forward width (`{arch}.expert_feed_forward_length`).
    FfExp,
    /// The shared expert's feed-forward width (`{arch}.expert_shared_feed_forward_length`).
    FfShexp,
}

/// How the plan report groups tensors (one row per group and run of layers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Group {
    Embedding,
    AttnQkv,
    AttnOut,
    Cache,
    FfnIn,
    FfnOut,
    Norms,
    OutputNorm,
    Output,
}

/// The part of a model a split switches on or off ([`crate::models::split::DecoderSplit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// A layer's attention: Q, K, V, output and the KV cache, by whole KV-head groups.
    Attention,
    /// A layer's MLP: column- then row-parallel.
    Mlp,
    /// The output projection, by vocabulary.
    Output,
    /// The token embedding, by vocabulary rows.
    Embedding,
}

/// The units a split cuts in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// One KV-head group's query features: `head_dim * n_head / n_head_kv`.
    QGroup,
    /// One KV head's features: `head_dim`.
    KvHead,
    /// Feed-forward features, in whole blocks of the weights' type (at least 32).
    Ffn,
    /// Vocabulary rows.
    Vocab,
    /// Whole experts (`ne[2]` of the experts' tensors).
    Expert,
    /// A fused tensor: consecutive segments along the cut axis, each of the given extent and
    /// cut in its own unit, so every device gets its share of each (the split state's
    /// segments; Phi-3's `attn_qkv` is Q | K | V, its `ffn_up` gate | up).
    Segments(&'static [(Dim, Unit)]),
}

/// How a tensor-parallel split cuts a tensor when its part is split: along `axis`, in `unit`s.
/// Tensors without a cut are mirrored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    pub part: Part,
    pub axis: usize,
    pub unit: Unit,
}

/// Everything that depends on the role alone.
#[derive(Debug)]
pub struct RoleInfo {
    pub tensor: Tensor,
    pub scope: Scope,
    /// The GGUF name after `blk.{N}.` (per layer) or the whole name (per model).
    pub gguf: &'static str,
    /// The name in a Hugging Face BERT checkpoint after `encoder.layer.{N}.` (per layer) or
    /// the whole name; `None` where BERT has no such tensor.
    pub hf_bert: Option<&'static str>,
    /// `ne[0]`, `ne[1]` in hyper-parameter units (vectors are `[n, 1]`).
    pub shape: [Dim; 2],
    /// `ne[2]`: `Dim::Expert` for the experts' 3-D tensors, `Dim::One` for every other.
    pub ne2: Dim,
    pub group: Group,
    pub cut: Option<Cut>,
}

const fn cut(part: Part, axis: usize, unit: Unit) -> Option<Cut> {
    Some(Cut { part, axis, unit })
}

macro_rules! roles {
    (@ne2) => { Dim::One };
    (@ne2 $d2:ident) => { Dim::$d2 };
    ($( $t:ident, $scope:ident, $gguf:literal, $hf:expr, [$d0:ident, $d1:ident $(, $d2:ident)?], $group:ident, $cut:expr; )*) => {
        /// One row per role: the only place a tensor name, shape or split rule is written.
        pub const ROLES: &[RoleInfo] = &[$(RoleInfo {
            tensor: Tensor::$t,
            scope: Scope::$scope,
            gguf: $gguf,
            hf_bert: $hf,
            shape: [Dim::$d0, Dim::$d1],
            ne2: roles!(@ne2 $($d2)?),
            group: Group::$group,
            cut: $cut,
        },)*];
    };
}

use Part::{Attention, Embedding, Mlp};
use Unit::{Ffn, KvHead, QGroup, Vocab};

/// Q | K | V of a fused projection: query groups, then KV heads twice.
const QKV_SEGMENTS: Unit =
    Unit::Segments(&[(Dim::Q, QGroup), (Dim::Kv, KvHead), (Dim::Kv, KvHead)]);
/// gate | up of a fused projection: feed-forward features twice.
const GATE_UP_SEGMENTS: Unit = Unit::Segments(&[(Dim::Ff, Ffn), (Dim::Ff, Ffn)]);

roles! {
    TokenEmbd, Model, "token_embd.weight", Some("embeddings.word_embeddings.weight"), [Embd, Vocab], Embedding, cut(Embedding, 1, Vocab);
    TokenTypes, Model, "token_types.weight", Some("embeddings.token_type_embeddings.weight"), [Embd, Types], Embedding, None;
    PosEmbd, Model, "position_embd.weight", Some("embeddings.position_embeddings.weight"), [Embd, Pos], Embedding, None;
    TokenEmbdNorm, Model, "token_embd_norm.weight", Some("embeddings.LayerNorm.weight"), [Embd, One], Embedding, None;
    TokenEmbdNormBias, Model, "token_embd_norm.bias", Some("embeddings.LayerNorm.bias"), [Embd, One], Embedding, None;
    OutputNorm, Model, "output_norm.weight", None, [Embd, One], OutputNorm, None;
    Output, Model, "output.weight", None, [Embd, Vocab], Output, cut(Part::Output, 1, Vocab);
    // Llama 3's per-pair RoPE frequency factors (its long-context scaling).
    RopeFreqs, Model, "rope_freqs.weight", None, [RopeHalf, One], Norms, None;
    // LongRoPE's per-pair factors (Phi-3's 128k-context models): the long ones past the
    // original context, the short ones within it.
    RopeFactorsLong, Model, "rope_factors_long.weight", None, [RopeHalf, One], Norms, None;
    RopeFactorsShort, Model, "rope_factors_short.weight", None, [RopeHalf, One], Norms, None;
    AttnNorm, Layer, "attn_norm.weight", None, [Embd, One], Norms, None;
    AttnQ, Layer, "attn_q.weight", Some("attention.self.query.weight"), [Embd, Q], AttnQkv, cut(Attention, 1, QGroup);
    AttnQBias, Layer, "attn_q.bias", Some("attention.self.query.bias"), [Q, One], AttnQkv, cut(Attention, 0, QGroup);
    AttnK, Layer, "attn_k.weight", Some("attention.self.key.weight"), [Embd, Kv], AttnQkv, cut(Attention, 1, KvHead);
    AttnKBias, Layer, "attn_k.bias", Some("attention.self.key.bias"), [Kv, One], AttnQkv, cut(Attention, 0, KvHead);
    AttnV, Layer, "attn_v.weight", Some("attention.self.value.weight"), [Embd, Kv], AttnQkv, cut(Attention, 1, KvHead);
    AttnVBias, Layer, "attn_v.bias", Some("attention.self.value.bias"), [Kv, One], AttnQkv, cut(Attention, 0, KvHead);
    // Q | K | V in one matrix (Phi-3); cut per segment, each device its heads' rows of each.
    AttnQkv, Layer, "attn_qkv.weight", None, [Embd, Qkv], AttnQkv, cut(Attention, 1, QKV_SEGMENTS);
    AttnOut, Layer, "attn_output.weight", Some("attention.output.dense.weight"), [Q, Embd], AttnOut, cut(Attention, 0, QGroup);
    // Added after the output's partial sums are reduced: mirrored.
    AttnOutBias, Layer, "attn_output.bias", Some("attention.output.dense.bias"), [Embd, One], AttnOut, None;
    AttnOutNorm, Layer, "attn_output_norm.weight", Some("attention.output.LayerNorm.weight"), [Embd, One], Norms, None;
    AttnOutNormBias, Layer, "attn_output_norm.bias", Some("attention.output.LayerNorm.bias"), [Embd, One], Norms, None;
    // Per-head RMS norms of Q and K (Qwen3, Gemma 3): every device normalizes its own heads.
    AttnQNorm, Layer, "attn_q_norm.weight", None, [HeadDim, One], Norms, None;
    AttnKNorm, Layer, "attn_k_norm.weight", None, [HeadDim, One], Norms, None;
    // RMS norms over the whole Q and K projections, not per head (OLMoE; llama.cpp's
    // LLM_ARCH_OLMOE applies `attn_q_norm` to Qcur before the reshape to heads; Hugging Face's
    // `OlmoeAttention.k_norm` spans the KV heads' width): the same names as the per-head
    // norms, told apart by the family (`Arch::parse`). The decoder sums the squares of each
    // device's columns and all-reduces the sums (`NormKind::RmsSums`), so the weights
    // are cut as the projections are.
    AttnQNormFull, Layer, "attn_q_norm.weight", None, [Q, One], Norms, cut(Attention, 0, QGroup);
    AttnKNormFull, Layer, "attn_k_norm.weight", None, [Kv, One], Norms, cut(Attention, 0, KvHead);
    // Norms of a block's output before the residual add (Gemma 2 and 3).
    AttnPostNorm, Layer, "post_attention_norm.weight", None, [Embd, One], Norms, None;
    FfnNorm, Layer, "ffn_norm.weight", None, [Embd, One], Norms, None;
    FfnGate, Layer, "ffn_gate.weight", None, [Embd, Ff], FfnIn, cut(Mlp, 1, Ffn);
    FfnUp, Layer, "ffn_up.weight", Some("intermediate.dense.weight"), [Embd, Ff], FfnIn, cut(Mlp, 1, Ffn);
    // gate | up in one matrix under the name of the plain up projection (Phi-3): the
    // architecture says which of the two roles `ffn_up.weight` is (`Arch::parse`).
    FfnGateUp, Layer, "ffn_up.weight", None, [Embd, Ff2], FfnIn, cut(Mlp, 1, GATE_UP_SEGMENTS);
    FfnUpBias, Layer, "ffn_up.bias", Some("intermediate.dense.bias"), [Ff, One], FfnIn, cut(Mlp, 0, Ffn);
    FfnDown, Layer, "ffn_down.weight", Some("output.dense.weight"), [Ff, Embd], FfnOut, cut(Mlp, 0, Ffn);
    FfnDownBias, Layer, "ffn_down.bias", Some("output.dense.bias"), [Embd, One], FfnOut, None;
    LayerOutNorm, Layer, "layer_output_norm.weight", Some("output.LayerNorm.weight"), [Embd, One], Norms, None;
    LayerOutNormBias, Layer, "layer_output_norm.bias", Some("output.LayerNorm.bias"), [Embd, One], Norms, None;
    FfnPostNorm, Layer, "post_ffw_norm.weight", None, [Embd, One], Norms, None;
    // A mixture of experts (llama.cpp's LLM_TENSOR_FFN_*_EXPS, *_SHEXP): the router
    // `[n_embd, n_expert]`, the experts `[n_embd, n_ff_exp, n_expert]` (down:
    // `[n_ff_exp, n_embd, n_expert]`), the shared expert and its gate `[n_embd]` (Qwen2-MoE).
    // The experts and the shared expert are cut as the dense MLP is (columns, then rows, in
    // every expert); a split of whole experts (`ExpertSplit::Expert`) cuts the experts on
    // ne[2] instead, and `ExpertSplit::Both` both (ne[2] over groups of devices, this cut
    // inside a group). The router and the shared expert's gate are mirrored.
    FfnGateInp, Layer, "ffn_gate_inp.weight", None, [Embd, Expert], FfnIn, None;
    FfnGateExps, Layer, "ffn_gate_exps.weight", None, [Embd, FfExp, Expert], FfnIn, cut(Mlp, 1, Ffn);
    FfnUpExps, Layer, "ffn_up_exps.weight", None, [Embd, FfExp, Expert], FfnIn, cut(Mlp, 1, Ffn);
    FfnDownExps, Layer, "ffn_down_exps.weight", None, [FfExp, Embd, Expert], FfnOut, cut(Mlp, 0, Ffn);
    FfnGateInpShexp, Layer, "ffn_gate_inp_shexp.weight", None, [Embd, One], FfnIn, None;
    FfnGateShexp, Layer, "ffn_gate_shexp.weight", None, [Embd, FfShexp], FfnIn, cut(Mlp, 1, Ffn);
    FfnUpShexp, Layer, "ffn_up_shexp.weight", None, [Embd, FfShexp], FfnIn, cut(Mlp, 1, Ffn);
    FfnDownShexp, Layer, "ffn_down_shexp.weight", None, [FfShexp, Embd], FfnOut, cut(Mlp, 0, Ffn);
    CacheK, Cache, "cache_k_l", None, [Kv, Ctx], Cache, cut(Attention, 0, KvHead);
    CacheV, Cache, "cache_v_l", None, [Kv, Ctx], Cache, cut(Attention, 0, KvHead);
}

impl Tensor {
    /// Its row of [`ROLES`].
    pub fn info(self) -> &'static RoleInfo {
        // The table lists the roles in declaration order (checked by a test).
        &ROLES[self as usize]
    }

    pub fn scope(self) -> Scope {
        self.info().scope
    }

    pub fn cut(self) -> Option<Cut> {
        self.info().cut
    }

    pub fn group(self) -> Group {
        self.info().group
    }

    /// A vector (`[n, 1]`: a norm weight or a bias).
    pub fn is_vector(self) -> bool {
        self.info().shape[1] == Dim::One
    }

    /// The dimensions a file stores it with: 1 (a vector), 2, or 3 (the experts).
    pub fn n_dims(self) -> usize {
        if self.info().ne2 != Dim::One {
            3
        } else if self.is_vector() {
            1
        } else {
            2
        }
    }

    /// The GGUF base name (`attn_q`, `token_embd`), as error messages and reports show a role.
    pub fn base_name(self) -> &'static str {
        let g = self.info().gguf;
        g.strip_suffix(".weight")
            .or_else(|| g.strip_suffix(".bias"))
            .unwrap_or(g)
            .trim_end_matches("_l")
    }
}

/// How a family's files name tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Naming {
    /// GGUF (llama.cpp's names).
    Gguf,
    /// A Hugging Face BERT checkpoint (safetensors), with an optional `bert.` prefix.
    HfBert,
}

/// The layer prefix of each naming.
const GGUF_LAYER: &str = "blk.";
const HF_BERT_LAYER: &str = "encoder.layer.";
const HF_BERT_PREFIX: &str = "bert.";

impl Naming {
    /// The name of `tensor` (of layer `layer` for per-layer tensors); `None` where this naming
    /// has no such tensor.
    pub fn name(self, tensor: Tensor, layer: usize) -> Option<String> {
        let info = tensor.info();
        if info.scope == Scope::Cache {
            return Some(format!("{}{layer}", info.gguf));
        }
        let (base, prefix) = match self {
            Naming::Gguf => (info.gguf, GGUF_LAYER),
            Naming::HfBert => (info.hf_bert?, HF_BERT_LAYER),
        };
        Some(match info.scope {
            Scope::Model => base.to_string(),
            _ => format!("{prefix}{layer}.{base}"),
        })
    }

    /// The role and layer (`None` for whole-model tensors) a name refers to; `None` for a name
    /// this naming does not know.
    pub fn parse(self, name: &str) -> Option<(Tensor, Option<usize>)> {
        self.parse_among(name, &|_| true)
    }

    /// [`Naming::parse`] among the roles `keep` accepts (a family's own: two roles may share
    /// a name, as Phi-3's fused gate/up and the plain up projection do).
    pub fn parse_among(
        self,
        name: &str,
        keep: &dyn Fn(Tensor) -> bool,
    ) -> Option<(Tensor, Option<usize>)> {
        for p in ["cache_k_l", "cache_v_l"] {
            if let Some(l) = name.strip_prefix(p) {
                let t = if p == "cache_k_l" {
                    Tensor::CacheK
                } else {
                    Tensor::CacheV
                };
                return Some((t, Some(l.parse().ok()?)));
            }
        }
        let (name, prefix) = match self {
            Naming::Gguf => (name, GGUF_LAYER),
            Naming::HfBert => (
                name.strip_prefix(HF_BERT_PREFIX).unwrap_or(name),
                HF_BERT_LAYER,
            ),
        };
        let base = |r: &RoleInfo| match self {
            Naming::Gguf => Some(r.gguf),
            Naming::HfBert => r.hf_bert,
        };
        if let Some(rest) = name.strip_prefix(prefix) {
            let (layer, kind) = rest.split_once('.')?;
            // Layer numbers are plain decimals ("blk.01" is not layer 1).
            if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let layer = layer.parse().ok()?;
            return ROLES
                .iter()
                .find(|r| r.scope == Scope::Layer && base(r) == Some(kind) && keep(r.tensor))
                .map(|r| (r.tensor, Some(layer)));
        }
        ROLES
            .iter()
            .find(|r| r.scope == Scope::Model && base(r) == Some(name) && keep(r.tensor))
            .map(|r| (r.tensor, None))
    }
}

/// The layer a tensor of either naming belongs to (`blk.N.*`, `encoder.layer.N.*`,
/// `cache_k_lN`), `None` for whole-model tensors and unknown names.
pub fn layer_of(name: &str) -> Option<usize> {
    [Naming::Gguf, Naming::HfBert]
        .into_iter()
        .find_map(|n| n.parse(name))
        .and_then(|(_, l)| l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_are_listed_in_declaration_order() {
        for (i, r) in ROLES.iter().enumerate() {
            assert_eq!(r.tensor as usize, i, "{:?}", r.tensor);
        }
    }

    #[test]
    fn names_round_trip() {
        for r in ROLES {
            for naming in [Naming::Gguf, Naming::HfBert] {
                let Some(name) = naming.name(r.tensor, 7) else {
                    continue;
                };
                let layer = (r.scope != Scope::Model).then_some(7);
                let only = |t: Tensor| t == r.tensor;
                assert_eq!(
                    naming.parse_among(&name, &only),
                    Some((r.tensor, layer)),
                    "{name}"
                );
            }
        }
        assert_eq!(
            Naming::Gguf.parse("blk.12.attn_q.bias"),
            Some((Tensor::AttnQBias, Some(12)))
        );
        assert_eq!(
            Naming::HfBert.parse("bert.encoder.layer.1.output.dense.weight"),
            Some((Tensor::FfnDown, Some(1)))
        );
        // A shared name is the first role's unless the caller narrows the roles.
        assert_eq!(
            Naming::Gguf.parse("blk.2.ffn_up.weight"),
            Some((Tensor::FfnUp, Some(2)))
        );
        let fused = |t: Tensor| t != Tensor::FfnUp;
        assert_eq!(
            Naming::Gguf.parse_among("blk.2.ffn_up.weight", &fused),
            Some((Tensor::FfnGateUp, Some(2)))
        );
        assert_eq!(Naming::Gguf.parse("blk.x.attn_q.weight"), None);
        assert_eq!(Naming::Gguf.parse("blk.1.attn_qq.weight"), None);
        assert_eq!(
            Naming::Gguf.parse("rope_freqs.weight"),
            Some((Tensor::RopeFreqs, None))
        );
        assert_eq!(Naming::Gguf.parse("rope_freqz.weight"), None);
        assert_eq!(layer_of("cache_v_l3"), Some(3));
        assert_eq!(layer_of("output.weight"), None);
        assert_eq!(Tensor::CacheK.base_name(), "cache_k");
        assert_eq!(Tensor::AttnQBias.base_name(), "attn_q");
    }
}
