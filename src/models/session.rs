//! A running sequence ([`Session`]): a decoder, a backend and a KV cache; tokens are
//! evaluated in batches of `ubatch` into the cache, and the logits of the last (or every) token
//! come back. The chunks' graphs go to the backend together (`Backend::graph_compute_many`),
//! so a layer split pipelines them through its devices. A step of one chunk keeps its graph
//! for the next step of the same shape (every decoding step within one [`KV_PAD`] of cache
//! rows): the next step puts its tokens, positions and mask into the kept graph
//! (`StepGraph::refill`) instead of building the graph again, which cost about a third of a
//! millisecond per step for a 30-layer model (building, then freeing, some 1,200 named
//! nodes): host time that does not shrink on a faster device.

use super::decoder::{KeptStep, SequenceStep, build_step};
use super::loader::DecoderModel;
use super::weights::{KvCache, alloc_kv_cache};
use crate::backend::Backend;
use crate::buffer::{Buffer, BufferType};
use crate::{Error, Result};
use std::sync::Arc;

/// Cache rows attended to are padded to a multiple of this, so consecutive decode steps share a
/// graph structure (and the meta backend's plan); padded rows are masked.
pub const KV_PAD: usize = 32;

/// The positions a cache of `ctx` holds: at most the model's context length, rounded up to a
/// multiple of [`KV_PAD`]; 0 is an error naming the context.
pub fn padded_context(model: &DecoderModel, ctx: usize) -> Result<usize> {
    ctx.min(model.context_length)
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
        })
}

/// A running sequence: the model, a backend, and a KV cache.
pub struct Session<'m> {
    pub model: &'m DecoderModel,
    backend: Arc<dyn Backend>,
    cache: KvCache,
    _cache_buffer: Arc<dyn Buffer>,
    n_past: usize,
    /// Tokens per graph when evaluating many tokens.
    pub ubatch: usize,
    /// The last one-chunk step's graph, for the next step of its shape.
    kept: Option<KeptStep>,
    /// Whether steps reuse `kept` ([`Session::set_graph_reuse`]).
    reuse: bool,
}

impl<'m> Session<'m> {
    /// A session with a cache of `ctx` positions placed in `bt` (the backend's buffer type):
    /// at most the model's context length, rounded up to a multiple of [`KV_PAD`] (see
    /// [`Session::capacity`]). A context of 0 is an error.
    pub fn new(
        model: &'m DecoderModel,
        backend: Arc<dyn Backend>,
        bt: &dyn BufferType,
        ctx: usize,
    ) -> Result<Self> {
        let ctx = padded_context(model, ctx)?;
        let (buf, cache) = alloc_kv_cache(&model.cfg, ctx, bt)?;
        Ok(Session {
            model,
            backend,
            cache,
            _cache_buffer: buf,
            n_past: 0,
            ubatch: 128,
            kept: None,
            reuse: true,
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

    /// Whether a step of one chunk reuses the last such step's graph when it has the same
    /// shape (on by default); off, every step's graph is built anew (for comparisons: both
    /// give the same bits).
    pub fn set_graph_reuse(&mut self, on: bool) {
        self.reuse = on;
        if !on {
            self.kept = None;
        }
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
        // Every chunk's graph first, then all of them at once: a backend that pipelines its
        // stages (the scheduler of a layer split) overlaps the chunks.
        let ubatch = self.ubatch.max(1);
        let n_chunks = tokens.len().div_ceil(ubatch);
        let mut graphs = Vec::with_capacity(n_chunks);
        let mut logits_of = Vec::with_capacity(n_chunks);
        let mut n_past = self.n_past;
        // A one-chunk step's graph is kept for the next step (refilled where its shape is the
        // same); it is out of `self.kept` while it computes, so a failed step keeps nothing.
        let mut kept = None;
        for chunk in tokens.chunks(ubatch) {
            let t = chunk.len();
            let ids: Vec<i32> = chunk.iter().map(|&x| x as i32).collect();
            let n_kv = (n_past + t).next_multiple_of(KV_PAD).min(self.cache.size);
            let step = SequenceStep::new(&ids, n_past, n_kv);
            let rows = if all_logits { 0..t } else { t - 1..t };
            let inp = step.input(rows);
            if n_chunks == 1 && self.reuse {
                let m = (&self.model.cfg, &self.model.weights, &self.cache);
                let mut k = KeptStep::for_step(self.kept.take(), m, &inp, None)?;
                graphs.push(k.take_graph());
                logits_of.push((k.logits(), t));
                kept = Some(k);
            } else {
                let sg = build_step(&self.model.cfg, &self.model.weights, &self.cache, &inp)?;
                graphs.push(sg.graph);
                logits_of.push((sg.logits, t));
            }
            n_past += t;
        }
        let mut out = Vec::new();
        let this = &mut self.n_past;
        self.backend.graph_compute_many(&mut graphs, &mut |j, g| {
            let (logits, t) = logits_of[j];
            *this += t;
            if all_logits || j + 1 == n_chunks {
                let l = g.read_f32(logits)?;
                // The last chunk's logits alone (decoding): the vector read, not a copy of it.
                if out.is_empty() {
                    out = l;
                } else {
                    out.extend(l);
                }
            }
            Ok(())
        })?;
        if let (Some(mut k), Some(g)) = (kept, graphs.pop()) {
            k.put_back(g);
            self.kept = Some(k);
        }
        debug_assert_eq!(out.len() % nv, 0);
        Ok(out)
    }
}
