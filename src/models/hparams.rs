//! A decoder's hyper-parameters ([`DecoderConfig`]) and how they are read from GGUF metadata:
//! the keys every llama-style family shares (`{arch}.block_count`, `{arch}.embedding_length`,
//! ... as llama.cpp's `LLM_KV_*` in `src/llama-arch.cpp` name them), each count checked against
//! the tensors the file holds and against the bounds of `limits.rs` before anything is sized by
//! it (errors name the file and the key), and the keys that would change the math without
//! metashard computing it refused by name rather than ignored.

use super::arch::{Arch, AttnScale, DecoderSpec, LLAMA, MIXTRAL, Mlp, Tensor};
use crate::io::gguf::GgufFile;
use crate::op::RopeMode;
use crate::{Error, Result};

mod moe;
pub use moe::{MAX_EXPERTS, Moe};

/// Hyper-parameters of a decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderConfig {
    /// The architecture: its tensors and its layer.
    pub arch: &'static Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    /// KV heads as the graph and the cache see them: the file's count times `kv_repeat`.
    pub n_head_kv: usize,
    /// Copies of each of the file's KV heads (1 unless [`DecoderConfig::with_kv_repeat`]):
    /// virtual KV heads that let fewer KV heads than devices spread attention over them.
    pub kv_repeat: usize,
    pub n_vocab: usize,
    /// Features per attention head (`{arch}.attention.key_length`; n_embd / n_head when the
    /// file does not say).
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub rope_mode: RopeMode,
    /// Rotated dimensions per head (usually the head size).
    pub rope_dims: usize,
    /// Use the fused attention kernel instead of mul_mat + soft_max + mul_mat (soft-capped
    /// attention always runs unfused).
    pub fused_attn: bool,
    /// The attention scores' scale (1 / sqrt(head_dim) unless the family says otherwise).
    pub attn_scale: f32,
    /// Token embeddings are multiplied by this (Gemma: sqrt(n_embd); 1 for most families).
    pub embd_scale: f32,
    /// Sliding-window attention on some layers (Gemma 2 and 3).
    pub swa: Option<SlidingWindow>,
    /// Attention scores soft-capped `c * tanh(s / c)` before the softmax (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// Logits soft-capped the same way (Gemma 2).
    pub final_softcap: Option<f32>,
    /// LongRoPE (Phi-3's 128k-context models), when the file has its factors.
    pub long_rope: Option<LongRope>,
    /// The experts of a mixture-of-experts family (`Mlp::Moe`), `None` for dense ones.
    pub moe: Option<Moe>,
}

/// LongRoPE as llama.cpp runs it (`llama_model::get_rope_factors`, `ggml_rope_ext`'s
/// `attn_factor`): pair i's angle divided by factor i of `rope_factors_long` when the
/// session's context exceeds `original_context`, of `rope_factors_short` otherwise, and the
/// rotated dimensions of Q and K multiplied by `attn_factor`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LongRope {
    /// `{arch}.rope.scaling.attn_factor` (1 when absent).
    pub attn_factor: f32,
    /// `{arch}.rope.scaling.original_context_length` (the trained context when absent).
    pub original_context: usize,
}

/// Sliding-window attention: a local layer's token at position p sees the cache rows holding
/// positions in `p - window + 1 ..= p` (llama.cpp's `LLAMA_SWA_TYPE_STANDARD`); layer `l` is
/// local when `l % pattern < pattern - 1`, every layer with pattern 0 (llama.cpp's
/// `set_swa_pattern`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlidingWindow {
    pub window: usize,
    pub pattern: usize,
    /// Local layers' RoPE base.
    pub rope_base: f32,
}

impl SlidingWindow {
    /// Whether layer `l` attends through the window (every layer with pattern 0).
    pub fn is_local(&self, l: usize) -> bool {
        self.pattern == 0 || l % self.pattern < self.pattern - 1
    }
}

impl DecoderConfig {
    /// A llama-architecture configuration with these dimensions, RoPE over whole heads (base
    /// 10000), epsilon 1e-5 and the unfused attention: a starting point for synthetic models.
    pub fn llama(
        n_layer: usize,
        n_embd: usize,
        n_ff: usize,
        n_head: usize,
        n_head_kv: usize,
        n_vocab: usize,
    ) -> DecoderConfig {
        let head_dim = n_embd / n_head.max(1);
        DecoderConfig {
            arch: &LLAMA,
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            kv_repeat: 1,
            n_vocab,
            head_dim,
            rms_eps: 1e-5,
            rope_base: 10000.0,
            rope_mode: RopeMode::Normal,
            rope_dims: head_dim,
            fused_attn: false,
            attn_scale: 1.0 / (head_dim.max(1) as f32).sqrt(),
            embd_scale: 1.0,
            swa: None,
            attn_softcap: None,
            final_softcap: None,
            long_rope: None,
            moe: None,
        }
    }

    /// Features of all query heads.
    pub fn n_embd_q(&self) -> usize {
        self.head_dim * self.n_head
    }
    pub fn n_embd_kv(&self) -> usize {
        self.head_dim * self.n_head_kv
    }

    /// The RoPE base of layer `l` (local layers of a sliding-window model have their own).
    pub fn rope_base_of(&self, l: usize) -> f32 {
        match self.swa {
            Some(w) if w.is_local(l) => w.rope_base,
            _ => self.rope_base,
        }
    }
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_head / self.n_head_kv
    }

    /// The KV heads the file holds (`n_head_kv` without the repetition).
    pub fn file_kv_heads(&self) -> usize {
        self.n_head_kv / self.kv_repeat.max(1)
    }

    /// This model with each KV head repeated `r` times (`r` dividing the query heads per
    /// KV head): `n_head_kv * r` KV heads, each read by `group() / r` query heads. Query head
    /// `i` reads KV head `i / group()`, which becomes virtual head `i / (group() / r)`, a copy
    /// of the same head when the copies of head `h` are heads `h * r .. h * r + r` (what
    /// `weights::repeat_kv_rows` places), so the math is unchanged; K and V (and the cache) are
    /// `r` times larger. An error naming the counts when `r` does not divide the group.
    pub fn with_kv_repeat(&self, r: usize) -> Result<DecoderConfig> {
        if r == 0 || !self.group().is_multiple_of(r) {
            return Err(Error::Model {
                model: self.arch.name.into(),
                reason: format!(
                    "cannot repeat each of {} KV heads {r} times: the repetition must divide \
                     the {} query heads per KV head",
                    self.n_head_kv,
                    self.group()
                ),
            });
        }
        let mut c = self.clone();
        c.n_head_kv *= r;
        c.kv_repeat *= r;
        Ok(c)
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |r: String| {
            Err(Error::Model {
                model: "decoder".into(),
                reason: r,
            })
        };
        self.arch.decoder()?;
        if self.n_layer == 0 || self.n_embd == 0 || self.n_ff == 0 || self.n_vocab == 0 {
            return bad(format!(
                "n_layer {}, n_embd {}, n_ff {} and n_vocab {} must all be at least 1",
                self.n_layer, self.n_embd, self.n_ff, self.n_vocab
            ));
        }
        if self.n_head == 0 || self.head_dim == 0 {
            return bad(format!(
                "n_head {} and head_dim {} must be at least 1",
                self.n_head, self.head_dim
            ));
        }
        if self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(format!(
                "n_head {} is not a multiple of n_head_kv {}",
                self.n_head, self.n_head_kv
            ));
        }
        if self.kv_repeat == 0 || !self.n_head_kv.is_multiple_of(self.kv_repeat) {
            return bad(format!(
                "n_head_kv {} is not a multiple of its repetition {}",
                self.n_head_kv, self.kv_repeat
            ));
        }
        if self.rope_dims == 0
            || self.rope_dims > self.head_dim
            || !self.rope_dims.is_multiple_of(2)
        {
            return bad(format!(
                "rope dims {} do not fit head size {}",
                self.rope_dims, self.head_dim
            ));
        }
        let finite = |v: f32| v.is_finite() && v > 0.0;
        if !finite(self.attn_scale) || !finite(self.embd_scale) {
            return bad(format!(
                "attention scale {} and embedding scale {} must be finite and > 0",
                self.attn_scale, self.embd_scale
            ));
        }
        if let Some(w) = self.swa
            && (w.window == 0 || !finite(w.rope_base))
        {
            return bad(format!(
                "sliding window {w:?}: the window must be at least 1 and the RoPE base finite"
            ));
        }
        for c in [self.attn_softcap, self.final_softcap]
            .into_iter()
            .flatten()
        {
            if !finite(c) {
                return bad(format!("soft-capping {c} must be finite and > 0"));
            }
        }
        super::limits::check_decoder(self, super::limits::Source::Named(self.arch.name))
    }
}

/// Positions are i32 in the step graph: the most a context may hold.
pub const MAX_CONTEXT: usize = i32::MAX as usize;

/// The value of a metadata key that leaves the math as metashard computes it.
#[derive(Clone, Copy, Debug)]
enum Neutral {
    /// This number (a factor of 1, no experts).
    Number(f64),
    /// This string (`rope.scaling.type` "none").
    Text(&'static str),
    /// The head size `n_embd / n_head` (an explicit key or value length equal to it).
    HeadDim,
    /// Absent: any value changes the math.
    Absent,
}

/// Metadata keys that change a decoder's math (llama.cpp's `LLM_KV_*` names), with the value
/// that leaves it unchanged. A file that sets one otherwise is refused naming the key: running
/// it as if the key were absent would give wrong results silently.
const MATH_KEYS: &[(&str, Neutral)] = &[
    ("rope.scaling.type", Neutral::Text("none")),
    ("rope.scaling.factor", Neutral::Number(1.0)),
    ("rope.scale_linear", Neutral::Number(1.0)),
    ("rope.scaling.attn_factor", Neutral::Number(1.0)),
    ("attention.key_length", Neutral::HeadDim),
    ("attention.value_length", Neutral::HeadDim),
    ("attention.sliding_window", Neutral::Absent),
    ("attn_logit_softcapping", Neutral::Absent),
    ("final_logit_softcapping", Neutral::Absent),
    ("expert_count", Neutral::Number(0.0)),
    // The routing of DeepSeek-style mixtures, which no family here has (llama.cpp reads these
    // for deepseek2 and its kin, never for qwen2moe, qwen3moe, olmoe or Mixtral): the selected
    // experts' weights scaled (`LLM_KV_EXPERT_WEIGHTS_SCALE`), a gating function other than
    // softmax (`LLM_KV_EXPERT_GATING_FUNC`: 1 is softmax), dense layers before the first MoE
    // layer (`LLM_KV_LEADING_DENSE_BLOCK_COUNT`), experts routed within groups
    // (`LLM_KV_EXPERT_GROUP_COUNT`).
    ("expert_weights_scale", Neutral::Number(1.0)),
    ("expert_gating_func", Neutral::Number(1.0)),
    ("leading_dense_block_count", Neutral::Number(0.0)),
    ("expert_group_count", Neutral::Number(1.0)),
];

/// The keys of one file, prefixed with its architecture name, with errors naming the file and
/// the key.
struct Keys<'g> {
    g: &'g GgufFile,
    prefix: String,
}

impl Keys<'_> {
    fn key(&self, s: &str) -> String {
        format!("{}.{s}", self.prefix)
    }

    fn err(&self, key: &str, reason: String) -> Error {
        Error::format(self.g.path(), format!("metadata key '{key}'"), reason)
    }

    fn usize(&self, s: &str) -> Result<usize> {
        self.g.get_usize(&self.key(s))
    }

    fn opt_usize(&self, s: &str) -> Result<Option<usize>> {
        Ok(self
            .g
            .opt_u64(&self.key(s))?
            .map(|v| usize::try_from(v).unwrap_or(usize::MAX)))
    }

    /// An f32 key in `ok` (default `default`), an error naming it otherwise.
    fn f32_in(&self, s: &str, default: f32, ok: fn(f32) -> bool, rule: &str) -> Result<f32> {
        let v = self.g.opt_f32(&self.key(s))?.unwrap_or(default);
        if ok(v) {
            Ok(v)
        } else {
            Err(self.err(&self.key(s), format!("{v}: {rule}")))
        }
    }

    /// An optional f32 key in `ok`, an error naming it otherwise.
    fn opt_f32_in(&self, s: &str, ok: fn(f32) -> bool, rule: &str) -> Result<Option<f32>> {
        match self.g.opt_f32(&self.key(s))? {
            Some(v) if !ok(v) => Err(self.err(&self.key(s), format!("{v}: {rule}"))),
            v => Ok(v),
        }
    }

    /// Refuse every [`MATH_KEYS`] entry set to a value that changes the math of a model with
    /// heads of `head_dim`, unless the family computes it (`spec`).
    fn refuse_math_keys(&self, head_dim: usize, spec: &DecoderSpec, long_rope: bool) -> Result<()> {
        for &(s, neutral) in MATH_KEYS {
            let computed = match s {
                "rope.scaling.attn_factor" => long_rope,
                "attention.sliding_window" => spec.swa.is_some(),
                "attn_logit_softcapping" | "final_logit_softcapping" => spec.softcap,
                "expert_count" => matches!(spec.mlp, Mlp::Moe(_)),
                _ => false,
            };
            if computed {
                continue;
            }
            let key = self.key(s);
            let Some(v) = self.g.get(&key) else { continue };
            let number = v.as_float().or_else(|| v.as_integer().map(|i| i as f64));
            let unchanged = match neutral {
                Neutral::Number(n) => number == Some(n),
                Neutral::Text(t) => v.as_str() == Some(t),
                Neutral::HeadDim => number == Some(head_dim as f64),
                Neutral::Absent => false,
            };
            if !unchanged {
                return Err(self.err(
                    &key,
                    format!(
                        "{}: metashard does not compute this for `{}` models",
                        v.describe(),
                        self.prefix
                    ),
                ));
            }
        }
        Ok(())
    }
}

fn model_err(g: &GgufFile, reason: String) -> Error {
    Error::Model {
        model: g.path().display().to_string(),
        reason,
    }
}

/// The architecture a GGUF file declares, or an error naming it.
pub fn arch_of(g: &GgufFile) -> Result<&'static Arch> {
    let name = g.architecture()?;
    let has = |t: &str| g.tensor(t).is_some();
    let mut arch =
        Arch::for_file(name, &has).ok_or_else(|| model_err(g, Arch::unsupported(name)))?;
    // Mixtral is a `llama` file with experts (llama.cpp: LLM_ARCH_LLAMA with n_expert > 0).
    if *arch == LLAMA && g.opt_u64(&format!("{name}.expert_count"))?.unwrap_or(0) > 0 {
        arch = &MIXTRAL;
    }
    arch.decoder().map_err(|_| {
        model_err(
            g,
            format!("architecture `{name}` is an encoder; this command needs a decoder"),
        )
    })?;
    Ok(arch)
}

/// The number of decoder blocks the file holds tensors for: one more than the largest `N` of a
/// `blk.N.*` tensor name (0 when there are none).
fn blocks_present(g: &GgufFile) -> usize {
    g.tensors()
        .iter()
        .filter_map(|t| blk_number(&t.name))
        .map(|i| i.saturating_add(1))
        .max()
        .unwrap_or(0)
}

/// `N` of any `blk.N.*` name, known role or not.
fn blk_number(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The shape of the first layer's (or the model's) `tensor`, or an error naming it.
fn shape_of(g: &GgufFile, arch: &Arch, tensor: Tensor) -> Result<[usize; 4]> {
    let name = arch.name(tensor, 0);
    g.tensor(&name)
        .map(|t| t.ne)
        .ok_or_else(|| model_err(g, format!("tensor `{name}` is missing")))
}

/// The decoder configuration from GGUF metadata. Every count that sizes an allocation is
/// checked against the tensors the file holds first (the block count against the `blk.N`
/// tensors, the widths, head counts and vocabulary against the shapes of the embedding and
/// of the first layer's K and gate), so a corrupt count is an error naming its key, not a
/// huge allocation.
pub fn config_from_gguf(g: &GgufFile) -> Result<DecoderConfig> {
    let arch = arch_of(g)?;
    let keys = Keys {
        g,
        prefix: g.architecture()?.to_string(),
    };
    let n_layer = read_block_count(g, &keys)?;
    let (n_embd, n_vocab) = read_embedding(g, arch, &keys)?;
    let n_ff = if matches!(arch.decoder()?.mlp, Mlp::Moe(_)) {
        keys.opt_usize("feed_forward_length")?
    } else {
        Some(keys.usize("feed_forward_length")?)
    };
    let moe = moe::read_moe(g, arch, &keys, n_ff)?;
    let n_ff = match (n_ff, moe) {
        (Some(v), _) => v,
        (None, Some(m)) => m.n_ff_exp,
        (None, None) => keys.usize("feed_forward_length")?,
    };
    // The gate's rows, or twice them where gate | up are one matrix (Phi-3).
    let (gate_t, per_ff) = if arch.has(Tensor::FfnGateUp) {
        (Tensor::FfnGateUp, 2)
    } else {
        (Tensor::FfnGate, 1)
    };
    // (A mixture of experts has none: its widths are checked against the experts.)
    let gate = match arch.has(gate_t) {
        true => Some(shape_of(g, arch, gate_t)?),
        false => None,
    };
    if let Some(gate) = gate
        && n_ff.checked_mul(per_ff) != Some(gate[1])
    {
        return Err(keys.err(
            &keys.key("feed_forward_length"),
            format!(
                "{n_ff}, but {} is {}",
                arch.name(gate_t, 0),
                crate::Shape(gate)
            ),
        ));
    }
    let (n_head, n_head_kv, head_dim) = read_heads(g, arch, &keys, n_embd)?;
    let rope_dims = keys.opt_usize("rope.dimension_count")?.unwrap_or(head_dim);
    if rope_dims == 0 || rope_dims > head_dim || !rope_dims.is_multiple_of(2) {
        return Err(keys.err(
            &keys.key("rope.dimension_count"),
            format!("{rope_dims}: must be even and in 2..={head_dim} (the head size)"),
        ));
    }
    let rms_eps = keys.f32_in(
        "attention.layer_norm_rms_epsilon",
        1e-5,
        |v| v.is_finite() && v >= 0.0,
        "must be finite and >= 0",
    )?;
    let rope_base = keys.f32_in(
        "rope.freq_base",
        10000.0,
        |v| v.is_finite() && v > 0.0,
        "must be finite and > 0",
    )?;
    let spec = arch.decoder()?;
    let mut cfg = DecoderConfig {
        arch,
        n_layer,
        n_embd,
        n_ff,
        n_head,
        n_head_kv,
        kv_repeat: 1,
        n_vocab,
        head_dim,
        rms_eps,
        rope_base,
        rope_mode: spec.rope_mode,
        rope_dims,
        fused_attn: true,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        embd_scale: 1.0,
        swa: None,
        attn_softcap: None,
        final_softcap: None,
        long_rope: read_long_rope(g, arch, &keys)?,
        moe,
    };
    read_family_keys(&keys, spec, &mut cfg)?;
    let src = super::limits::Source::Gguf {
        path: g.path(),
        arch: &keys.prefix,
    };
    super::limits::check_decoder(&cfg, src)?;
    cfg.validate().map_err(|e| match e {
        Error::Model { reason, .. } => model_err(g, reason),
        e => e,
    })?;
    keys.refuse_math_keys(head_dim, spec, cfg.long_rope.is_some())?;
    context_length_from_gguf(g)?;
    Ok(cfg)
}

/// LongRoPE's parameters where the architecture has its factors (llama.cpp's
/// `LLM_TENSOR_ROPE_FACTORS_LONG/SHORT`) and the file holds them: both factors or neither (an
/// error naming the missing one), the attention factor and the original context from the
/// keys.
fn read_long_rope(g: &GgufFile, arch: &Arch, keys: &Keys) -> Result<Option<LongRope>> {
    if !arch.has(Tensor::RopeFactorsLong) {
        return Ok(None);
    }
    let [long, short] =
        [Tensor::RopeFactorsLong, Tensor::RopeFactorsShort].map(|t| arch.name(t, 0));
    match (g.tensor(&long).is_some(), g.tensor(&short).is_some()) {
        (false, false) => return Ok(None),
        (true, false) => {
            return Err(model_err(
                g,
                format!("tensor `{short}` is missing (`{long}` is there)"),
            ));
        }
        (false, true) => {
            return Err(model_err(
                g,
                format!("tensor `{long}` is missing (`{short}` is there)"),
            ));
        }
        (true, true) => {}
    }
    let attn_factor = keys.f32_in(
        "rope.scaling.attn_factor",
        1.0,
        |v| v.is_finite() && v > 0.0,
        "must be finite and > 0",
    )?;
    let original_context = match keys.opt_usize("rope.scaling.original_context_length")? {
        Some(v) => v,
        None => context_length_from_gguf(g)?,
    };
    Ok(Some(LongRope {
        attn_factor,
        original_context,
    }))
}

/// The keys of the family's own layer: the attention scale, the embedding scale, the sliding
/// window and the soft-capping, as llama.cpp's `load_hparams` reads them for the family.
fn read_family_keys(keys: &Keys, spec: &DecoderSpec, cfg: &mut DecoderConfig) -> Result<()> {
    if let AttnScale::Gemma { large_layers } = spec.attn_scale
        && large_layers.contains(&cfg.n_layer)
    {
        cfg.attn_scale = 1.0 / ((cfg.n_embd / cfg.n_head) as f32).sqrt();
    }
    if spec.scale_embeddings {
        cfg.embd_scale = (cfg.n_embd as f32).sqrt();
    }
    if let Some(w) = spec.swa {
        let key = "attention.sliding_window";
        let window = match (keys.opt_usize(key)?, w.default_window) {
            (Some(v), _) => Some(v),
            (None, Some(d)) => Some(d),
            (None, None) if w.optional => None,
            (None, None) => Some(keys.usize(key)?),
        };
        if window == Some(0) {
            return Err(keys.err(
                &keys.key(key),
                "0: a window holds at least one position".into(),
            ));
        }
        cfg.swa = window.map(|window| SlidingWindow {
            window,
            pattern: w.pattern,
            rope_base: w.rope_base.unwrap_or(cfg.rope_base),
        });
    }
    if spec.softcap {
        let cap =
            |s: &str| keys.opt_f32_in(s, |v| v.is_finite() && v > 0.0, "must be finite and > 0");
        cfg.attn_softcap = cap("attn_logit_softcapping")?;
        cfg.final_softcap = cap("final_logit_softcapping")?;
    }
    Ok(())
}

/// `{arch}.block_count`, checked against the `blk.N` tensors present.
fn read_block_count(g: &GgufFile, keys: &Keys) -> Result<usize> {
    let n_layer = keys.usize("block_count")?;
    let n_blocks = blocks_present(g);
    if n_layer != n_blocks || n_layer == 0 {
        return Err(keys.err(
            &keys.key("block_count"),
            match n_blocks {
                0 => format!("{n_layer} blocks, but the file holds no blk.N tensors"),
                n => format!(
                    "{n_layer} blocks, but the file holds tensors for {n} (blk.0 to blk.{})",
                    n - 1
                ),
            },
        ));
    }
    Ok(n_layer)
}

/// The width and the vocabulary, checked against the token embedding's shape.
fn read_embedding(g: &GgufFile, arch: &Arch, keys: &Keys) -> Result<(usize, usize)> {
    let embd = shape_of(g, arch, Tensor::TokenEmbd)?;
    let embd_name = arch.name(Tensor::TokenEmbd, 0);
    let n_embd = keys.usize("embedding_length")?;
    if n_embd != embd[0] {
        return Err(keys.err(
            &keys.key("embedding_length"),
            format!(
                "{n_embd}, but {embd_name} is {} (width {})",
                crate::Shape(embd),
                embd[0]
            ),
        ));
    }
    let (vocab_key, n_vocab) = match keys.opt_usize("vocab_size")? {
        Some(v) => (keys.key("vocab_size"), v),
        None => (
            "tokenizer.ggml.tokens".to_string(),
            g.get_str_array("tokenizer.ggml.tokens")?.len(),
        ),
    };
    if n_vocab != embd[1] {
        return Err(keys.err(
            &vocab_key,
            format!(
                "{n_vocab} tokens, but {embd_name} is {} ({} rows)",
                crate::Shape(embd),
                embd[1]
            ),
        ));
    }
    Ok((n_embd, n_vocab))
}

/// The query and KV head counts and the head size (`attention.key_length`, else the width
/// over the heads), checked against the first layer's Q and K.
fn read_heads(
    g: &GgufFile,
    arch: &Arch,
    keys: &Keys,
    n_embd: usize,
) -> Result<(usize, usize, usize)> {
    let n_head = keys.usize("attention.head_count")?;
    let head_dim = match keys.opt_usize("attention.key_length")? {
        Some(k) => {
            if k == 0 {
                return Err(keys.err(
                    &keys.key("attention.key_length"),
                    "0: a head has at least one feature".into(),
                ));
            }
            if let Some(v) = keys.opt_usize("attention.value_length")?
                && v != k
            {
                return Err(keys.err(
                    &keys.key("attention.value_length"),
                    format!(
                        "{v}: metashard computes heads whose values are as long as their keys ({k})"
                    ),
                ));
            }
            if n_head == 0 {
                return Err(keys.err(&keys.key("attention.head_count"), "0 heads".into()));
            }
            k
        }
        None => {
            if n_head == 0 || !n_embd.is_multiple_of(n_head) {
                return Err(keys.err(
                    &keys.key("attention.head_count"),
                    format!("{n_head} heads do not divide the width {n_embd}"),
                ));
            }
            n_embd / n_head
        }
    };
    let n_head_kv = keys.opt_usize("attention.head_count_kv")?.unwrap_or(n_head);
    if n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
        return Err(keys.err(
            &keys.key("attention.head_count_kv"),
            format!("{n_head_kv} KV heads do not divide the {n_head} heads"),
        ));
    }
    // Q and K, or Q | K | V in one matrix (Phi-3).
    let checks: &[(Tensor, usize, &str)] = if arch.has(Tensor::AttnQkv) {
        &[(
            Tensor::AttnQkv,
            n_head.saturating_add(n_head_kv.saturating_mul(2)),
            "query, key and value heads",
        )]
    } else {
        &[
            (Tensor::AttnK, n_head_kv, "KV heads"),
            (Tensor::AttnQ, n_head, "query heads"),
        ]
    };
    for &(t, heads, what) in checks {
        let shape = shape_of(g, arch, t)?;
        if heads.checked_mul(head_dim) != Some(shape[1]) {
            let explicit = keys.g.get(&keys.key("attention.key_length")).is_some();
            let (head_size, size_from) = if explicit {
                (
                    format!(" and '{}'", keys.key("attention.key_length")),
                    format!("{} {head_dim}", keys.key("attention.key_length")),
                )
            } else {
                (String::new(), format!("width {n_embd} / {n_head} heads"))
            };
            return Err(Error::format(
                g.path(),
                format!(
                    "metadata keys '{}', '{}'{head_size}",
                    keys.key("attention.head_count"),
                    keys.key("attention.head_count_kv")
                ),
                format!(
                    "{heads} {what} of size {head_dim} ({size_from}) make {} rows, but {} has {}",
                    heads.saturating_mul(head_dim),
                    arch.name(t, 0),
                    shape[1]
                ),
            ));
        }
    }
    Ok((n_head, n_head_kv, head_dim))
}

/// `{arch}.context_length` (2048 when absent): an error naming the key unless it is in
/// 1..=[`MAX_CONTEXT`].
pub fn context_length_from_gguf(g: &GgufFile) -> Result<usize> {
    let key = format!("{}.context_length", g.architecture()?);
    match g.opt_u64(&key)? {
        None => Ok(2048),
        Some(v) if v >= 1 && v <= MAX_CONTEXT as u64 => Ok(v as usize),
        Some(v) => Err(Error::format(
            g.path(),
            format!("metadata key '{key}'"),
            format!("{v}: must be in 1..={MAX_CONTEXT} (positions are 32-bit)"),
        )),
    }
}
