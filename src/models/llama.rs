//! Llama-family decoders from GGUF files: hyper-parameters from the metadata
//! (`{arch}.block_count`, `{arch}.embedding_length`, ... per GGUF's llama conventions), each
//! count checked against the tensors present before anything is sized by it (errors name the
//! file and the key), weights checked against them and placed in any buffer type (a meta
//! buffer scatters them to the devices as they are placed), the byte-level BPE tokenizer and
//! chat template, a `Session` that evaluates tokens into a KV cache in batches, and sampling
//! (settings out of range are refused) with a generation loop bounded by the context.
//!
//! When the output projection is tied to the token embedding (no `output.weight`), the
//! embedding's bytes are placed a second time as `output.weight`, so the embedding can stay
//! mirrored for the row lookup while the output projection is vocabulary-split.

use super::decoder::{DecoderConfig, DecoderWeights, KvCache, StepInput, build_step};
use super::synthetic::{alloc_kv_cache, decoder_weights, place};
use crate::backend::Backend;
use crate::buffer::{Buffer, BufferType, BufferUsage};
use crate::io::gguf::GgufFile;
use crate::op::RopeMode;
use crate::tensor::Layout;
use crate::tokenizer::Tokenizer;
use crate::tokenizer::bpe::BpeTokenizer;
use crate::tokenizer::chat::ChatTemplate;
use crate::{DType, Error, Result};
use std::path::Path;
use std::sync::Arc;

/// Architectures whose GGUF tensors and metadata match the Llama layout used here.
const ARCHS: &[&str] = &["llama", "mistral"];

/// A loaded decoder.
pub struct LlamaModel {
    pub name: String,
    pub cfg: DecoderConfig,
    pub weights: DecoderWeights,
    pub weight_buffer: Arc<dyn Buffer>,
    pub tokenizer: BpeTokenizer,
    pub chat: Option<ChatTemplate>,
    pub context_length: usize,
    /// Bytes of all weights as stored (the tied output counted once).
    pub weight_bytes: usize,
    /// Bytes of the memory-mapped file's tensor data this process touched while placing the
    /// weights (resident file pages before and after, Linux only): with ranks as processes,
    /// about the rank's own slices plus the mirrored tensors.
    pub file_bytes_read: Option<u64>,
}

fn model_err(g: &GgufFile, reason: String) -> Error {
    Error::Model {
        model: g.path().display().to_string(),
        reason,
    }
}

/// An error naming the file and the metadata key.
fn key_err(g: &GgufFile, key: &str, reason: String) -> Error {
    Error::format(g.path(), format!("metadata key '{key}'"), reason)
}

/// The number of decoder blocks the file holds tensors for: one more than the largest `N` of a
/// `blk.N.*` tensor name (0 when there are none).
fn blocks_present(g: &GgufFile) -> usize {
    g.tensors()
        .iter()
        .filter_map(|t| {
            t.name
                .strip_prefix("blk.")?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .map(|i| i.saturating_add(1))
        .max()
        .unwrap_or(0)
}

/// Positions are i32 in the step graph: the most a context may hold.
pub const MAX_CONTEXT: usize = i32::MAX as usize;

/// The decoder configuration from GGUF metadata. Every count that sizes an allocation is
/// checked against the tensors the file holds first (the block count against the `blk.N`
/// tensors, the widths, head counts and vocabulary against the shapes of `token_embd`,
/// `blk.0.attn_k` and `blk.0.ffn_gate`), so a corrupt count is an error naming its key, not a
/// huge allocation.
pub fn config_from_gguf(g: &GgufFile) -> Result<DecoderConfig> {
    let arch = g.architecture()?;
    if !ARCHS.contains(&arch) {
        return Err(model_err(
            g,
            format!("architecture `{arch}` is not supported (supported: {ARCHS:?})"),
        ));
    }
    let k = |s: &str| format!("{arch}.{s}");
    let n_layer = g.get_usize(&k("block_count"))?;
    let n_blocks = blocks_present(g);
    if n_layer != n_blocks || n_layer == 0 {
        return Err(key_err(
            g,
            &k("block_count"),
            match n_blocks {
                0 => format!("{n_layer} blocks, but the file holds no blk.N tensors"),
                n => format!(
                    "{n_layer} blocks, but the file holds tensors for {n} (blk.0 to blk.{})",
                    n - 1
                ),
            },
        ));
    }
    let shape_of = |name: &str| {
        g.tensor(name)
            .map(|t| t.ne)
            .ok_or_else(|| model_err(g, format!("tensor `{name}` is missing")))
    };
    let embd = shape_of("token_embd.weight")?;
    let n_embd = g.get_usize(&k("embedding_length"))?;
    if n_embd != embd[0] {
        return Err(key_err(
            g,
            &k("embedding_length"),
            format!(
                "{n_embd}, but token_embd.weight is {} (width {})",
                crate::Shape(embd),
                embd[0]
            ),
        ));
    }
    let (vocab_key, n_vocab) = match g.opt_u64(&k("vocab_size"))? {
        Some(v) => (k("vocab_size"), usize::try_from(v).unwrap_or(usize::MAX)),
        None => (
            "tokenizer.ggml.tokens".to_string(),
            g.get_str_array("tokenizer.ggml.tokens")?.len(),
        ),
    };
    if n_vocab != embd[1] {
        return Err(key_err(
            g,
            &vocab_key,
            format!(
                "{n_vocab} tokens, but token_embd.weight is {} ({} rows)",
                crate::Shape(embd),
                embd[1]
            ),
        ));
    }
    let n_ff = g.get_usize(&k("feed_forward_length"))?;
    let gate = shape_of("blk.0.ffn_gate.weight")?;
    if n_ff != gate[1] {
        return Err(key_err(
            g,
            &k("feed_forward_length"),
            format!(
                "{n_ff}, but blk.0.ffn_gate.weight is {}",
                crate::Shape(gate)
            ),
        ));
    }
    let n_head = g.get_usize(&k("attention.head_count"))?;
    if n_head == 0 || !n_embd.is_multiple_of(n_head) {
        return Err(key_err(
            g,
            &k("attention.head_count"),
            format!("{n_head} heads do not divide the width {n_embd}"),
        ));
    }
    let head_dim = n_embd / n_head;
    let n_head_kv = match g.opt_u64(&k("attention.head_count_kv"))? {
        Some(v) => usize::try_from(v).unwrap_or(usize::MAX),
        None => n_head,
    };
    if n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
        return Err(key_err(
            g,
            &k("attention.head_count_kv"),
            format!("{n_head_kv} KV heads do not divide the {n_head} heads"),
        ));
    }
    let wk = shape_of("blk.0.attn_k.weight")?;
    if n_head_kv.checked_mul(head_dim) != Some(wk[1]) {
        return Err(Error::format(
            g.path(),
            format!(
                "metadata keys '{}' and '{}'",
                k("attention.head_count"),
                k("attention.head_count_kv")
            ),
            format!(
                "{n_head_kv} KV heads of size {head_dim} (width {n_embd} / {n_head} heads) \
                 make {} rows, but blk.0.attn_k.weight has {}",
                n_head_kv * head_dim,
                wk[1]
            ),
        ));
    }
    let rope_dims = match g.opt_u64(&k("rope.dimension_count"))? {
        Some(v) => usize::try_from(v).unwrap_or(usize::MAX),
        None => head_dim,
    };
    if rope_dims == 0 || rope_dims > head_dim || !rope_dims.is_multiple_of(2) {
        return Err(key_err(
            g,
            &k("rope.dimension_count"),
            format!("{rope_dims}: must be even and in 2..={head_dim} (the head size)"),
        ));
    }
    let rms_eps = g
        .opt_f32(&k("attention.layer_norm_rms_epsilon"))?
        .unwrap_or(1e-5);
    if !(rms_eps.is_finite() && rms_eps >= 0.0) {
        return Err(key_err(
            g,
            &k("attention.layer_norm_rms_epsilon"),
            format!("{rms_eps}: must be finite and >= 0"),
        ));
    }
    let rope_base = g.opt_f32(&k("rope.freq_base"))?.unwrap_or(10000.0);
    if !(rope_base.is_finite() && rope_base > 0.0) {
        return Err(key_err(
            g,
            &k("rope.freq_base"),
            format!("{rope_base}: must be finite and > 0"),
        ));
    }
    let cfg = DecoderConfig {
        n_layer,
        n_embd,
        n_ff,
        n_head,
        n_head_kv,
        n_vocab,
        rms_eps,
        rope_base,
        // GGUF llama conversions permute Q and K so that the normal (adjacent-pair) mode applies.
        rope_mode: RopeMode::Normal,
        rope_dims,
        fused_attn: true,
    };
    cfg.validate().map_err(|e| match e {
        Error::Model { reason, .. } => model_err(g, reason),
        e => e,
    })?;
    if let Some(s) = g.opt_f32(&k("rope.scaling.factor"))?
        && s != 1.0
    {
        return Err(model_err(
            g,
            format!("rope scaling factor {s} is not supported"),
        ));
    }
    context_length_from_gguf(g)?;
    Ok(cfg)
}

/// `{arch}.context_length` (2048 when absent): an error naming the key unless it is in
/// 1..=[`MAX_CONTEXT`].
pub fn context_length_from_gguf(g: &GgufFile) -> Result<usize> {
    let key = format!("{}.context_length", g.architecture()?);
    match g.opt_u64(&key)? {
        None => Ok(2048),
        Some(v) if v >= 1 && v <= MAX_CONTEXT as u64 => Ok(v as usize),
        Some(v) => Err(key_err(
            g,
            &key,
            format!("{v}: must be in 1..={MAX_CONTEXT} (positions are 32-bit)"),
        )),
    }
}

/// Expected layouts (ggml order) of every weight, by name, for `cfg`.
fn expected(cfg: &DecoderConfig) -> Vec<(String, [usize; 2])> {
    super::synthetic::weight_layouts(cfg, DType::F32)
        .into_iter()
        .map(|(n, l)| (n, [l.ne[0], l.ne[1]]))
        .collect()
}

impl LlamaModel {
    /// Load a GGUF decoder, placing its weights in `bt`; `progress(done_bytes, total_bytes)` is
    /// called as tensors are placed.
    pub fn load(
        path: &Path,
        bt: &dyn BufferType,
        progress: &dyn Fn(usize, usize),
    ) -> Result<LlamaModel> {
        let g = GgufFile::open(path)?;
        let mut cfg = config_from_gguf(&g)?;
        let tied = g.tensor("output.weight").is_none();
        // Collect (name, layout, source tensor name) for every weight in the decoder's order.
        let mut tensors = Vec::new();
        let mut sources = Vec::new();
        for (name, ne) in expected(&cfg) {
            let src = if name == "output.weight" && tied {
                "token_embd.weight"
            } else {
                name.as_str()
            };
            let t = g
                .tensor(src)
                .ok_or_else(|| model_err(&g, format!("tensor `{src}` is missing")))?;
            let dtype = t.dtype.ok_or_else(|| {
                model_err(
                    &g,
                    format!(
                        "tensor `{src}` has ggml type {} which metashard cannot run",
                        t.ggml_type
                    ),
                )
            })?;
            let want = [ne[0], ne[1], 1, 1];
            // Norms are 1-D in GGUF: [n], stored as [n, 1, 1, 1].
            if t.ne != want {
                return Err(model_err(
                    &g,
                    format!(
                        "tensor `{src}` has shape {} but the metadata implies {}",
                        crate::Shape(t.ne),
                        crate::Shape(want)
                    ),
                ));
            }
            if name.contains("norm") && dtype != DType::F32 {
                return Err(model_err(
                    &g,
                    format!("norm `{src}` is {dtype}, expected f32"),
                ));
            }
            tensors.push((name.clone(), Layout::contiguous(dtype, want)));
            sources.push(src.to_string());
        }
        for t in g.tensors() {
            if t.name.ends_with(".bias") {
                return Err(model_err(
                    &g,
                    format!(
                        "tensor `{}`: biases are not supported in this decoder",
                        t.name
                    ),
                ));
            }
        }
        let total: usize = tensors.iter().map(|t| t.1.nbytes()).sum();
        let (buf, refs) = place(bt, &tensors, BufferUsage::Weights)?;
        let rss_before = crate::dist::rss_file_bytes();
        let mut done = 0;
        for (r, src) in refs.iter().zip(&sources) {
            let t = g.tensor(src).expect("checked above");
            r.storage.set(&r.layout, g.tensor_data(t)?)?;
            done += r.layout.nbytes();
            progress(done, total);
        }
        let file_bytes_read = crate::dist::rss_file_bytes()
            .zip(rss_before)
            .map(|(a, b)| a.saturating_sub(b));
        let weights = decoder_weights(&cfg, &refs);
        let tokenizer = BpeTokenizer::from_gguf(&g)?;
        if tokenizer.vocab_size() != cfg.n_vocab {
            return Err(model_err(
                &g,
                format!(
                    "tokenizer has {} tokens, the output {}",
                    tokenizer.vocab_size(),
                    cfg.n_vocab
                ),
            ));
        }
        let chat = ChatTemplate::from_gguf(&g).ok();
        let context_length = context_length_from_gguf(&g)?;
        let weight_bytes = total
            - if tied {
                weights.output.layout.nbytes()
            } else {
                0
            };
        cfg.fused_attn = true;
        Ok(LlamaModel {
            name: g.opt_str("general.name")?.unwrap_or("llama").to_string(),
            cfg,
            weights,
            weight_buffer: buf,
            tokenizer,
            chat,
            context_length,
            weight_bytes,
            file_bytes_read,
        })
    }

    /// Bytes read from weights per generated token (every matrix once; the embedding lookup
    /// reads one row).
    pub fn bytes_per_token(&self) -> usize {
        let w = &self.weights;
        let mut b = w.output.layout.nbytes() + w.output_norm.layout.nbytes();
        for l in &w.layers {
            for r in [
                &l.attn_norm,
                &l.wq,
                &l.wk,
                &l.wv,
                &l.wo,
                &l.ffn_norm,
                &l.w_gate,
                &l.w_up,
                &l.w_down,
            ] {
                b += r.layout.nbytes();
            }
        }
        b + w.token_embd.layout.row_size()
    }
}

/// Cache rows attended to are padded to a multiple of this, so consecutive decode steps share a
/// graph structure (and the meta backend's plan); padded rows are masked.
pub const KV_PAD: usize = 32;

/// A running sequence: the model, a backend, and a KV cache.
pub struct Session<'m> {
    pub model: &'m LlamaModel,
    backend: Arc<dyn Backend>,
    cache: KvCache,
    _cache_buffer: Arc<dyn Buffer>,
    n_past: usize,
    /// Tokens per graph when evaluating many tokens.
    pub ubatch: usize,
}

impl<'m> Session<'m> {
    /// A session with a cache of `ctx` positions placed in `bt` (the backend's buffer type):
    /// at most the model's context length, rounded up to a multiple of [`KV_PAD`] (see
    /// [`Session::capacity`]). A context of 0 is an error.
    pub fn new(
        model: &'m LlamaModel,
        backend: Arc<dyn Backend>,
        bt: &dyn BufferType,
        ctx: usize,
    ) -> Result<Self> {
        let ctx = ctx
            .min(model.context_length)
            .checked_next_multiple_of(KV_PAD)
            .filter(|&c| c > 0)
            .ok_or_else(|| {
                Error::invalid_argument(
                    "context",
                    ctx,
                    format!(
                        "must be in 1..={} (the model's context length)",
                        model.context_length
                    ),
                )
            })?;
        let (buf, cache) = alloc_kv_cache(&model.cfg, ctx, bt)?;
        Ok(Session {
            model,
            backend,
            cache,
            _cache_buffer: buf,
            n_past: 0,
            ubatch: 128,
        })
    }

    /// The KV cache tensors.
    pub fn cache(&self) -> KvCache {
        self.cache.clone()
    }

    /// The buffer holding the KV cache.
    pub fn cache_buffer(&self) -> Arc<dyn Buffer> {
        self._cache_buffer.clone()
    }

    pub fn n_past(&self) -> usize {
        self.n_past
    }

    pub fn capacity(&self) -> usize {
        self.cache.size
    }

    /// Forget the sequence (the cache is overwritten as new tokens come).
    pub fn reset(&mut self) {
        self.n_past = 0;
    }

    /// Evaluate `tokens` after the current sequence; returns the logits of the last token, or
    /// of every token (`n_vocab` each, in order) with `all_logits`.
    pub fn eval(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::invalid_input(
                "eval",
                "tokens",
                "at least one",
                "none",
            ));
        }
        if self.n_past + tokens.len() > self.cache.size {
            return Err(Error::invalid_input(
                "eval",
                "tokens",
                format!(
                    "at most {} after {} in a context of {}",
                    self.cache.size - self.n_past,
                    self.n_past,
                    self.cache.size
                ),
                tokens.len(),
            ));
        }
        let nv = self.model.cfg.n_vocab;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= nv) {
            return Err(Error::invalid_input(
                "eval",
                "token id",
                format!("below the vocabulary size {nv}"),
                bad,
            ));
        }
        let mut out = Vec::new();
        let n_chunks = tokens.len().div_ceil(self.ubatch.max(1));
        for (ci, chunk) in tokens.chunks(self.ubatch.max(1)).enumerate() {
            let t = chunk.len();
            let ids: Vec<i32> = chunk.iter().map(|&x| x as i32).collect();
            let pos: Vec<i32> = (self.n_past..self.n_past + t).map(|p| p as i32).collect();
            let filled = self.n_past + t;
            let n_kv = filled.next_multiple_of(KV_PAD).min(self.cache.size);
            let kvp: Vec<i32> = (0..n_kv)
                .map(|j| if j < filled { j as i32 } else { -1 })
                .collect();
            let last_chunk = ci + 1 == n_chunks;
            let rows = if all_logits { 0..t } else { t - 1..t };
            let inp = StepInput {
                tokens: &ids,
                positions: &pos,
                slots: &pos,
                n_kv,
                kv_positions: &kvp,
                logits_rows: rows,
            };
            let mut sg = build_step(&self.model.cfg, &self.model.weights, &self.cache, &inp)?;
            self.backend.graph_compute(&mut sg.graph)?;
            self.n_past += t;
            if all_logits || last_chunk {
                out.extend(sg.graph.read_f32(sg.logits)?);
            }
            debug_assert_eq!(out.len() % nv, 0);
        }
        Ok(out)
    }
}

/// Sampling settings: temperature 0 is greedy. [`SamplerConfig::validate`] says which values
/// are accepted; [`Sampler::new`] refuses the others.
#[derive(Clone, Copy, Debug)]
pub struct SamplerConfig {
    /// Finite and >= 0; 0 is greedy.
    pub temperature: f32,
    /// At least 1: sample among the `top_k` most likely tokens (1 is greedy; a value at or
    /// above the vocabulary size keeps every token).
    pub top_k: usize,
    /// In (0, 1]: then among the fewest tokens whose probability adds up to `top_p`.
    pub top_p: f32,
    pub seed: u64,
}

impl SamplerConfig {
    /// An [`Error::InvalidArgument`] naming the first setting out of range: a NaN or infinite
    /// or negative temperature, `top_k` 0, `top_p` outside (0, 1] or NaN.
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(Error::invalid_argument(
                "temperature",
                t,
                "must be a finite number >= 0 (0 is greedy)",
            ));
        }
        if self.top_k == 0 {
            return Err(Error::invalid_argument(
                "top_k",
                0,
                "must be at least 1 (1 is greedy; a value at or above the vocabulary size keeps \
                 every token)",
            ));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(Error::invalid_argument(
                "top_p",
                p,
                "must be in (0, 1] (1 keeps every token)",
            ));
        }
        Ok(())
    }
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 40,
            top_p: 0.95,
            seed: 0,
        }
    }
}

/// A token sampler with its own random state (splitmix64).
pub struct Sampler {
    cfg: SamplerConfig,
    state: u64,
}

impl Sampler {
    /// A sampler with `cfg`; an error naming the setting when [`SamplerConfig::validate`]
    /// refuses it.
    pub fn new(cfg: SamplerConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Sampler {
            cfg,
            state: cfg.seed ^ 0x5DEE_CE66_D1CE_4E5B,
        })
    }

    fn next_f64(&mut self) -> f64 {
        // splitmix64 (Steele, Lea, Flood 2014).
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        idx.truncate(self.cfg.top_k.max(1));
        let t = self.cfg.temperature as f64;
        let m = logits[idx[0]] as f64;
        let mut p: Vec<f64> = idx
            .iter()
            .map(|&i| ((logits[i] as f64 - m) / t).exp())
            .collect();
        let sum: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= sum);
        // Smallest prefix with mass >= top_p.
        let mut acc = 0.0;
        let mut keep = p.len();
        for (i, &x) in p.iter().enumerate() {
            acc += x;
            if acc >= self.cfg.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        let total: f64 = p[..keep].iter().sum();
        let mut r = self.next_f64() * total;
        for i in 0..keep {
            r -= p[i];
            if r <= 0.0 {
                return idx[i] as u32;
            }
        }
        idx[keep - 1] as u32
    }
}

/// Index of the largest value (the first of equals).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The requested number of tokens was generated.
    #[default]
    Count,
    /// The end-of-sequence token was generated.
    Eos,
    /// The `on_token` callback asked to stop.
    Callback,
    /// The context (the session's KV cache) is full: no further token can be evaluated.
    Context,
}

impl StopReason {
    pub fn name(self) -> &'static str {
        match self {
            StopReason::Count => "count",
            StopReason::Eos => "eos",
            StopReason::Callback => "callback",
            StopReason::Context => "context",
        }
    }
}

/// Timings of one generation, and why it stopped.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub prompt_secs: f64,
    pub generated: usize,
    /// Decode steps run (each evaluates one token); the first token comes from the prompt.
    pub gen_evals: usize,
    pub gen_secs: f64,
    pub stop: StopReason,
}

impl GenStats {
    pub fn prompt_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_secs.max(1e-9)
    }
    /// Decode steps per second.
    pub fn gen_tps(&self) -> f64 {
        self.gen_evals as f64 / self.gen_secs.max(1e-9)
    }
}

/// Evaluate `prompt`, then generate up to `n` tokens; `on_token` sees each and may stop the
/// generation by returning false. Stops at the end-of-sequence token unless `ignore_eos`, and
/// when the session's context is full ([`GenStats::stop`] says which), so any `n` is safe:
/// nothing is sized by `n` beyond what the context can hold.
pub fn generate(
    s: &mut Session,
    prompt: &[u32],
    n: usize,
    sampler: &mut Sampler,
    ignore_eos: bool,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<(Vec<u32>, GenStats)> {
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let t0 = std::time::Instant::now();
    let mut logits = s.eval(prompt, false)?;
    stats.prompt_secs = t0.elapsed().as_secs_f64();
    let eos = s.model.tokenizer.eos();
    // Each token but the last is evaluated, so at most `capacity - n_past + 1` come out.
    let room = s.capacity().saturating_sub(s.n_past()).saturating_add(1);
    let mut out = Vec::with_capacity(n.min(room));
    let t0 = std::time::Instant::now();
    for i in 0..n {
        let t = sampler.sample(&logits);
        out.push(t);
        let go_on = on_token(t);
        let stop = if !ignore_eos && Some(t) == eos {
            Some(StopReason::Eos)
        } else if !go_on {
            Some(StopReason::Callback)
        } else if i + 1 == n {
            Some(StopReason::Count)
        } else if s.n_past() >= s.capacity() {
            Some(StopReason::Context)
        } else {
            None
        };
        if let Some(r) = stop {
            stats.stop = r;
            break;
        }
        logits = s.eval(&[t], false)?;
        stats.gen_evals += 1;
    }
    stats.generated = out.len();
    stats.gen_secs = t0.elapsed().as_secs_f64();
    Ok((out, stats))
}
