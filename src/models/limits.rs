//! Bounds on every count a model's configuration declares, in one table ([`LIMITS`]) every
//! loader goes through before anything is sized by a count: a GGUF header
//! (`hparams::config_from_gguf`), a Hugging Face `config.json` (the planner's
//! `ModelShape::from_config_json`, `BertConfig::from_model_dir`), the presets, and any
//! [`DecoderConfig`] or [`BertConfig`] a caller builds (their `validate` checks it too).
//!
//! Each count (layers, width, heads, KV heads, head size, feed-forward width, vocabulary,
//! context, experts, sliding window) must lie in `1..=max`, the maxima far above every
//! published model's (the largest decoders have about 130 layers, a width of 16k to 25k, 128
//! heads, heads of 256, a vocabulary of 256k) so that a corrupt or hostile number is refused by
//! name instead of sizing a list of layers or a tensor. Then the counts are checked against
//! each other: the heads divide the width where no head size is declared ([`head_dim_of`]),
//! the KV heads divide the heads, every tensor's elements (the product of its dimensions in
//! the architecture table) fit the address space at 4 bytes each, and the
//! whole model's parameters are at most [`MAX_PARAMETERS`], which also bounds what the planner
//! builds and costs. Errors name the file and the key (`num_hidden_layers` of a `config.json`,
//! `llama.block_count` of a GGUF header).

use super::arch::{Arch, Dim};
use super::bert::BertConfig;
use super::hparams::{DecoderConfig, MAX_CONTEXT};
use crate::{Error, Result};
use std::path::Path;

/// A count a model's configuration declares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Count {
    Layers,
    /// The model width (`n_embd`).
    Width,
    /// The feed-forward width (`n_ff`).
    Ffn,
    Heads,
    KvHeads,
    /// Features per head (`n_embd / n_head`, or an explicit key).
    HeadDim,
    Vocab,
    /// The context a decoder was trained for (positions are 32-bit).
    Context,
    /// BERT's position table (`max_position_embeddings`).
    Positions,
    /// BERT's token-type table (`type_vocab_size`).
    TokenTypes,
    /// Experts of a mixture-of-experts layer.
    Experts,
    /// Experts each token is routed to.
    ExpertsUsed,
    /// Positions a sliding-window layer sees (Gemma 2 and 3): within the 32-bit positions.
    Window,
}

/// One row of the table: a count's bound and its keys.
#[derive(Clone, Copy, Debug)]
pub struct Limit {
    pub count: Count,
    /// The largest value accepted (the smallest is 1).
    pub max: usize,
    /// What the count counts, for messages ("layers").
    pub unit: &'static str,
    /// Its key in a Hugging Face `config.json`.
    pub hf: &'static str,
    /// Its key in a GGUF header, after `{arch}.` (llama.cpp's `LLM_KV_*` names).
    pub gguf: &'static str,
}

/// The bounds, one row per [`Count`].
pub const LIMITS: [Limit; 13] = [
    row(
        Count::Layers,
        1024,
        "layers",
        "num_hidden_layers",
        "block_count",
    ),
    row(
        Count::Width,
        1 << 18,
        "features",
        "hidden_size",
        "embedding_length",
    ),
    row(
        Count::Ffn,
        1 << 20,
        "features",
        "intermediate_size",
        "feed_forward_length",
    ),
    row(
        Count::Heads,
        1024,
        "heads",
        "num_attention_heads",
        "attention.head_count",
    ),
    row(
        Count::KvHeads,
        1024,
        "KV heads",
        "num_key_value_heads",
        "attention.head_count_kv",
    ),
    row(
        Count::HeadDim,
        1024,
        "features per head",
        "head_dim",
        "attention.key_length",
    ),
    row(Count::Vocab, 1 << 22, "tokens", "vocab_size", "vocab_size"),
    row(
        Count::Context,
        MAX_CONTEXT,
        "tokens",
        "max_position_embeddings",
        "context_length",
    ),
    row(
        Count::Positions,
        1 << 20,
        "positions",
        "max_position_embeddings",
        "context_length",
    ),
    row(
        Count::TokenTypes,
        1 << 16,
        "token types",
        "type_vocab_size",
        "token_type_count",
    ),
    row(
        Count::Experts,
        1024,
        "experts",
        "num_local_experts",
        "expert_count",
    ),
    row(
        Count::ExpertsUsed,
        1024,
        "experts",
        "num_experts_per_tok",
        "expert_used_count",
    ),
    row(
        Count::Window,
        MAX_CONTEXT,
        "positions",
        "sliding_window",
        "attention.sliding_window",
    ),
];

const fn row(
    count: Count,
    max: usize,
    unit: &'static str,
    hf: &'static str,
    gguf: &'static str,
) -> Limit {
    Limit {
        count,
        max,
        unit,
        hf,
        gguf,
    }
}

/// The most parameters a model may have (every tensor of its architecture counted): 2^48,
/// about 140 times the largest published model, and 1 PiB at 4 bytes each. What the planner
/// places on virtual devices and costs stays within it.
pub const MAX_PARAMETERS: u64 = 1 << 48;

/// Bytes per element the address-space check assumes: F32, the widest weight type.
const WIDEST: u64 = 4;

impl Count {
    /// This count's row of [`LIMITS`].
    pub fn limit(self) -> &'static Limit {
        &LIMITS[self as usize]
    }

    pub fn max(self) -> usize {
        self.limit().max
    }
}

/// Where counts come from, for errors naming the file and the key.
#[derive(Clone, Copy, Debug)]
pub enum Source<'a> {
    /// A Hugging Face `config.json`: keys such as `num_hidden_layers`.
    ConfigJson(&'a Path),
    /// A GGUF header: keys such as `llama.block_count`.
    Gguf { path: &'a Path, arch: &'a str },
    /// A configuration built in code (a preset, a synthetic model), named so.
    Named(&'a str),
}

impl Source<'_> {
    /// The key of `count` in this source.
    pub fn key(&self, count: Count) -> String {
        let l = count.limit();
        match self {
            Source::Gguf { arch, .. } => format!("{arch}.{}", l.gguf),
            Source::ConfigJson(_) | Source::Named(_) => l.hf.to_string(),
        }
    }

    /// An error about the keys of `counts`.
    pub fn err(&self, counts: &[Count], reason: String) -> Error {
        let keys: Vec<String> = counts
            .iter()
            .map(|&c| format!("'{}'", self.key(c)))
            .collect();
        let field = format!(
            "{} {}",
            if keys.len() == 1 { "key" } else { "keys" },
            keys.join(" and ")
        );
        match self {
            Source::ConfigJson(path) => Error::format(*path, field, reason),
            Source::Gguf { path, .. } => Error::format(*path, format!("metadata {field}"), reason),
            Source::Named(name) => Error::Model {
                model: name.to_string(),
                reason: format!("{field}: {reason}"),
            },
        }
    }
}

/// `v` if it is in `1..=max` of `count`, else an error naming its key.
pub fn check(count: Count, v: usize, src: Source) -> Result<usize> {
    let l = count.limit();
    if (1..=l.max).contains(&v) {
        return Ok(v);
    }
    Err(src.err(
        &[count],
        format!(
            "{v} {}: must be in 1..={} (metashard's bound, far above any published model)",
            l.unit, l.max
        ),
    ))
}

/// The parameters of a model of `arch` with `n_layer` layers and the extents `dim` gives,
/// counting every tensor the architecture may hold; an error naming `blame` when one tensor
/// would not fit the address space or the whole exceeds [`MAX_PARAMETERS`].
fn check_parameters(
    arch: &Arch,
    n_layer: usize,
    dim: &dyn Fn(Dim) -> Option<usize>,
    blame: &[Count],
    src: Source,
) -> Result<u64> {
    let elements = |tensors: &mut dyn Iterator<Item = super::arch::Tensor>| -> Result<u64> {
        let mut sum = 0u64;
        for t in tensors {
            let [a, b] = t.info().shape.map(|d| dim(d).unwrap_or(1) as u64);
            // The experts' third dimension counts in with the second.
            let b = b.saturating_mul(dim(t.info().ne2).unwrap_or(1) as u64);
            let n = a
                .checked_mul(b)
                .filter(|n| {
                    n.checked_mul(WIDEST)
                        .is_some_and(|b| b <= isize::MAX as u64)
                })
                .ok_or_else(|| {
                    src.err(
                        blame,
                        format!(
                            "tensor `{}` would have {a} x {b} elements, more than memory can \
                             address",
                            t.info().gguf
                        ),
                    )
                })?;
            sum = sum.saturating_add(n);
        }
        Ok(sum)
    };
    let model = elements(&mut arch.model_tensors().map(|(t, _)| t))?;
    let layer = elements(&mut arch.layer_tensors().map(|(t, _)| t))?;
    let total = layer
        .checked_mul(n_layer as u64)
        .and_then(|l| l.checked_add(model))
        .filter(|&p| p <= MAX_PARAMETERS);
    total.ok_or_else(|| {
        src.err(
            blame,
            format!(
                "{n_layer} layers of {layer} parameters and {model} more make over \
                 {MAX_PARAMETERS} parameters (2^48, metashard's bound)"
            ),
        )
    })
}

/// Every count of a decoder in its bounds (the head size, which families such as Qwen3 and
/// Gemma declare apart from the width, and the sliding window included), the KV heads dividing
/// the heads, and the tensors and the whole model within the address space and
/// [`MAX_PARAMETERS`]. Nothing is sized before this passes.
pub fn check_decoder(cfg: &DecoderConfig, src: Source) -> Result<()> {
    check(Count::Layers, cfg.n_layer, src)?;
    check(Count::Width, cfg.n_embd, src)?;
    check(Count::Ffn, cfg.n_ff, src)?;
    check(Count::Heads, cfg.n_head, src)?;
    check(Count::KvHeads, cfg.n_head_kv, src)?;
    check(Count::HeadDim, cfg.head_dim, src)?;
    check(Count::Vocab, cfg.n_vocab, src)?;
    if let Some(w) = cfg.swa {
        check(Count::Window, w.window, src)?;
    }
    check_kv_heads(cfg.n_head, cfg.n_head_kv, src)?;
    check_parameters(
        cfg.arch,
        cfg.n_layer,
        &|d| cfg.dim(d),
        &[Count::Layers, Count::Width, Count::Ffn, Count::Vocab],
        src,
    )?;
    Ok(())
}

/// The head size of a model that does not declare one: the width over the heads, which must
/// divide it into heads of at most [`Count::HeadDim`]'s bound (an error naming both keys).
pub fn head_dim_of(width: usize, heads: usize, src: Source) -> Result<usize> {
    if heads == 0 || !width.is_multiple_of(heads) {
        return Err(src.err(
            &[Count::Width, Count::Heads],
            format!("{heads} heads do not divide the width {width}"),
        ));
    }
    let head_dim = width / heads;
    if head_dim > Count::HeadDim.max() {
        return Err(src.err(
            &[Count::Width, Count::Heads],
            format!(
                "heads of {head_dim} features (width {width} / {heads} heads): at most {}",
                Count::HeadDim.max()
            ),
        ));
    }
    Ok(head_dim)
}

/// The KV heads divide the heads.
fn check_kv_heads(heads: usize, kv_heads: usize, src: Source) -> Result<()> {
    if kv_heads == 0 || kv_heads > heads || !heads.is_multiple_of(kv_heads) {
        return Err(src.err(
            &[Count::Heads, Count::KvHeads],
            format!("{kv_heads} KV heads do not divide the {heads} heads"),
        ));
    }
    Ok(())
}

/// [`check_decoder`] for a BERT encoder: its counts, position and token-type tables.
pub fn check_encoder(cfg: &BertConfig, src: Source) -> Result<()> {
    check(Count::Layers, cfg.n_layer, src)?;
    check(Count::Width, cfg.n_embd, src)?;
    check(Count::Heads, cfg.n_head, src)?;
    check(Count::Ffn, cfg.n_ff, src)?;
    check(Count::Vocab, cfg.n_vocab, src)?;
    check(Count::Positions, cfg.n_pos, src)?;
    check(Count::TokenTypes, cfg.n_type, src)?;
    head_dim_of(cfg.n_embd, cfg.n_head, src)?;
    check_parameters(
        &super::arch::BERT,
        cfg.n_layer,
        &|d| cfg.dim(d),
        &[Count::Layers, Count::Width, Count::Ffn, Count::Vocab],
        src,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_in_count_order_and_its_bounds_admit_published_models() {
        for (i, l) in LIMITS.iter().enumerate() {
            assert_eq!(l.count as usize, i, "{:?}", l.count);
            assert!(l.max >= 1024, "{:?}", l.count);
        }
        // Llama-3-70B's counts pass; one more than a bound is refused naming the key.
        let mut cfg = DecoderConfig::llama(80, 8192, 28672, 64, 8, 128256);
        check_decoder(&cfg, Source::Named("llama3-70b")).unwrap();
        cfg.n_layer = Count::Layers.max() + 1;
        let e = check_decoder(&cfg, Source::ConfigJson(Path::new("c/config.json")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("c/config.json") && e.contains("'num_hidden_layers'"),
            "{e}"
        );
        let src = Source::Gguf {
            path: Path::new("m.gguf"),
            arch: "llama",
        };
        let e = check_decoder(&cfg, src).unwrap_err().to_string();
        assert!(
            e.contains("m.gguf") && e.contains("'llama.block_count'"),
            "{e}"
        );
    }

    #[test]
    fn counts_are_checked_against_each_other() {
        let named = Source::Named("t");
        let bad = |cfg: DecoderConfig| check_decoder(&cfg, named).unwrap_err().to_string();
        let e = head_dim_of(100, 3, named).unwrap_err().to_string();
        assert!(e.contains("'hidden_size' and 'num_attention_heads'"), "{e}");
        let e = head_dim_of(1 << 17, 2, named).unwrap_err().to_string();
        assert!(e.contains("at most 1024"), "{e}");
        let e = bad(DecoderConfig::llama(2, 96, 64, 6, 4, 10));
        assert!(e.contains("'num_key_value_heads'"), "{e}");
        // A head size declared apart from the width (Qwen3, Gemma) has its own bound, as has
        // a sliding window (Gemma 2 and 3).
        let e = bad(DecoderConfig::llama(2, 1 << 17, 64, 2, 1, 10));
        assert!(e.contains("'head_dim'") && e.contains("1..=1024"), "{e}");
        let mut cfg = DecoderConfig::llama(2, 96, 64, 6, 2, 10);
        cfg.swa = Some(super::super::hparams::SlidingWindow {
            window: usize::MAX,
            pattern: 2,
            rope_base: 10000.0,
        });
        let e = bad(cfg);
        assert!(e.contains("'sliding_window'"), "{e}");
        // Every count at its bound: over 2^48 parameters, refused naming the layers.
        let e = bad(DecoderConfig::llama(
            1024,
            1 << 18,
            1 << 20,
            1024,
            8,
            1 << 22,
        ));
        assert!(
            e.contains("'num_hidden_layers'") && e.contains("2^48"),
            "{e}"
        );
    }
}
