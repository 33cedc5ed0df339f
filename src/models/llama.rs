//! Llama-family decoders from GGUF files: hyper-parameters from the metadata
//! (`{arch}.block_count`, `{arch}.embedding_length`, ... per GGUF's llama conventions), weights
//! checked against them and placed in any buffer type (a meta buffer scatters them to the
//! devices as they are placed), the byte-level BPE tokenizer and chat template, and a `Session`
//! that evaluates tokens into a KV cache in batches.
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
}

fn model_err(g: &GgufFile, reason: String) -> Error {
    Error::Model {
        model: g.path().display().to_string(),
        reason,
    }
}

/// The decoder configuration from GGUF metadata.
pub fn config_from_gguf(g: &GgufFile) -> Result<DecoderConfig> {
    let arch = g.architecture()?;
    if !ARCHS.contains(&arch) {
        return Err(model_err(
            g,
            format!("architecture `{arch}` is not supported (supported: {ARCHS:?})"),
        ));
    }
    let k = |s: &str| format!("{arch}.{s}");
    let n_embd = g.get_usize(&k("embedding_length"))?;
    let n_head = g.get_usize(&k("attention.head_count"))?;
    let n_head_kv = g
        .opt_u64(&k("attention.head_count_kv"))?
        .map_or(n_head, |v| v as usize);
    let n_vocab = match g.opt_u64(&k("vocab_size"))? {
        Some(v) => v as usize,
        None => g.get_str_array("tokenizer.ggml.tokens")?.len(),
    };
    let head_dim = n_embd.checked_div(n_head).unwrap_or(0);
    let cfg = DecoderConfig {
        n_layer: g.get_usize(&k("block_count"))?,
        n_embd,
        n_ff: g.get_usize(&k("feed_forward_length"))?,
        n_head,
        n_head_kv,
        n_vocab,
        rms_eps: g
            .opt_f32(&k("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5),
        rope_base: g.opt_f32(&k("rope.freq_base"))?.unwrap_or(10000.0),
        // GGUF llama conversions permute Q and K so that the normal (adjacent-pair) mode applies.
        rope_mode: RopeMode::Normal,
        rope_dims: g
            .opt_u64(&k("rope.dimension_count"))?
            .map_or(head_dim, |v| v as usize),
        fused_attn: true,
    };
    cfg.validate().map_err(|e| model_err(g, e.to_string()))?;
    if let Some(s) = g.opt_f32(&k("rope.scaling.factor"))?
        && s != 1.0
    {
        return Err(model_err(
            g,
            format!("rope scaling factor {s} is not supported"),
        ));
    }
    Ok(cfg)
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
        let mut done = 0;
        for (r, src) in refs.iter().zip(&sources) {
            let t = g.tensor(src).expect("checked above");
            r.storage.set(&r.layout, g.tensor_data(t)?)?;
            done += r.layout.nbytes();
            progress(done, total);
        }
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
        let arch = g.architecture()?.to_string();
        let context_length = g
            .opt_u64(&format!("{arch}.context_length"))?
            .map_or(2048, |v| v as usize);
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
    /// A session with a cache of `ctx` positions placed in `bt` (the backend's buffer type).
    pub fn new(
        model: &'m LlamaModel,
        backend: Arc<dyn Backend>,
        bt: &dyn BufferType,
        ctx: usize,
    ) -> Result<Self> {
        let ctx = ctx
            .next_multiple_of(KV_PAD)
            .min(model.context_length.next_multiple_of(KV_PAD));
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

/// Sampling settings: temperature 0 is greedy.
#[derive(Clone, Copy, Debug)]
pub struct SamplerConfig {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: u64,
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
    pub fn new(cfg: SamplerConfig) -> Self {
        Sampler {
            cfg,
            state: cfg.seed ^ 0x5DEE_CE66_D1CE_4E5B,
        }
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
        if self.cfg.top_k > 0 {
            idx.truncate(self.cfg.top_k);
        }
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

/// Timings of one generation.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub prompt_secs: f64,
    pub generated: usize,
    /// Decode steps run (each evaluates one token); the first token comes from the prompt.
    pub gen_evals: usize,
    pub gen_secs: f64,
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
/// generation by returning false. Stops at the end-of-sequence token unless `ignore_eos`.
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
    let mut out = Vec::with_capacity(n);
    let t0 = std::time::Instant::now();
    for i in 0..n {
        let t = sampler.sample(&logits);
        out.push(t);
        let go_on = on_token(t);
        if (!ignore_eos && Some(t) == eos) || !go_on || i + 1 == n || s.n_past() >= s.capacity() {
            break;
        }
        logits = s.eval(&[t], false)?;
        stats.gen_evals += 1;
    }
    stats.generated = out.len();
    stats.gen_secs = t0.elapsed().as_secs_f64();
    Ok((out, stats))
}
