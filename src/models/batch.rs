//! Many sequences in one KV cache ([`BatchSession`]): the cache holds `slots` sequences of
//! `ctx` positions each (slot s owns cache rows `s * ctx .. (s + 1) * ctx`), each slot with its
//! own length; one step ([`BatchSession::step`]) evaluates tokens of several slots at once,
//! prompt chunks and single decode tokens mixed, through the decoder's step graph with a mask
//! that lets each token see only its own slot's rows at or before its position (and within
//! the sliding window): llama.cpp's unified KV cache and vLLM's continuous batching do the
//! same. The graph is the one-sequence graph with more rows, so it runs on one device, a meta
//! device (any split state) and the scheduler's layer split alike. A step hook
//! ([`BatchSession::set_step_hook`]) sees each step's inputs before it computes, and
//! [`BatchSession::set_lens`] takes another session's slot lengths: with both, the ranks of a
//! job step alike (`runtime::lockstep`). With [`BatchSession::micro_batches`] above 1 a step's
//! sequences are cut into that many graphs, given to the backend together
//! (`Backend::graph_compute_many`): a layer split pipelines them through its devices. Each
//! micro-batch's graph is kept and refilled by the next step whose micro-batch of that index
//! has its shape (`decoder::KeptStep`).

use super::decoder::{KeptStep, StepInput, StepSeqs, build_step_seqs};
use super::loader::DecoderModel;
use super::session::{KV_PAD, padded_context};
use super::weights::{KvCache, alloc_kv_cache};
use crate::backend::Backend;
use crate::buffer::{Buffer, BufferType};
use crate::graph::{Graph, TensorId};
use crate::{Error, Result};
use std::sync::Arc;

/// Most slots a batch session holds.
pub const MAX_SLOTS: usize = 256;

/// Tokens of one slot in a step: evaluated after the slot's current sequence; with
/// `logits`, the step returns the logits of the last one.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    pub slot: usize,
    pub tokens: &'a [u32],
    pub logits: bool,
}

/// Called by [`BatchSession::step`] with a step's checked inputs before it computes: every
/// slot's length before the step, and the sequences. With ranks as processes rank 0 sends
/// them to the other ranks, which take the same step (`runtime::lockstep`); an error ends the
/// step before anything changed.
pub type StepHook<'m> = Box<dyn FnMut(&[Option<usize>], &[SeqInput]) -> Result<()> + Send + 'm>;

/// A KV cache of several slots, a model and a backend.
pub struct BatchSession<'m> {
    pub model: &'m DecoderModel,
    backend: Arc<dyn Backend>,
    cache: KvCache,
    buffer: Arc<dyn Buffer>,
    /// Positions per slot (a multiple of [`KV_PAD`]).
    ctx: usize,
    /// Each slot's length, `None` when free.
    lens: Vec<Option<usize>>,
    hook: Option<StepHook<'m>>,
    /// Micro-batches each step's sequences are cut into (1, the default: one graph). With
    /// several, their graphs go to the backend together (`Backend::graph_compute_many`),
    /// which the scheduler of a layer split pipelines through its stages.
    pub micro_batches: usize,
    /// The last step's graph of each micro-batch (by index), for the next step whose
    /// micro-batch of that index has its shape (`decoder::KeptStep`: a step of S sequences
    /// decoding one token each repeats its structure for up to `KV_PAD` steps).
    kept: Vec<Option<KeptStep>>,
    /// Whether steps reuse `kept` ([`BatchSession::set_graph_reuse`]).
    reuse: bool,
}

impl<'m> BatchSession<'m> {
    /// A session of `slots` slots of `ctx` positions each (at most the model's context,
    /// rounded up to a multiple of [`KV_PAD`]) in `bt`. 0 slots, more than [`MAX_SLOTS`] or a
    /// context of 0 are errors naming the value.
    pub fn new(
        model: &'m DecoderModel,
        backend: Arc<dyn Backend>,
        bt: &dyn BufferType,
        slots: usize,
        ctx: usize,
    ) -> Result<Self> {
        if slots == 0 || slots > MAX_SLOTS {
            return Err(Error::invalid_argument(
                "parallel",
                slots,
                format!("must be in 1..={MAX_SLOTS} (sequences decoded together)"),
            ));
        }
        let ctx = padded_context(model, ctx)?;
        let (buffer, cache) = alloc_kv_cache(&model.cfg, slots * ctx, bt)?;
        Ok(BatchSession {
            model,
            backend,
            cache,
            buffer,
            ctx,
            lens: vec![None; slots],
            hook: None,
            micro_batches: 1,
            kept: Vec::new(),
            reuse: true,
        })
    }

    /// Positions each slot holds.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    pub fn n_slots(&self) -> usize {
        self.lens.len()
    }

    pub fn free_slots(&self) -> usize {
        self.lens.iter().filter(|l| l.is_none()).count()
    }

    /// The buffer holding the KV cache.
    pub fn cache_buffer(&self) -> Arc<dyn Buffer> {
        self.buffer.clone()
    }

    /// Slot `slot`'s length, `None` when it is free (or out of range).
    pub fn len(&self, slot: usize) -> Option<usize> {
        self.lens.get(slot).copied().flatten()
    }

    /// Every slot's length (`None`: free).
    pub fn lens(&self) -> &[Option<usize>] {
        &self.lens
    }

    /// Make every slot's length `lens` (another session's, whose step this one takes next);
    /// an error naming the value when there are not [`BatchSession::n_slots`] of them or one
    /// is past the context.
    pub fn set_lens(&mut self, lens: &[Option<usize>]) -> Result<()> {
        if lens.len() != self.lens.len() {
            return Err(Error::invalid_input(
                "batch step",
                "slots",
                self.lens.len().to_string(),
                lens.len().to_string(),
            ));
        }
        if let Some(l) = lens.iter().flatten().find(|&&l| l > self.ctx) {
            return Err(Error::invalid_input(
                "batch step",
                "slot length",
                format!("at most the context of {}", self.ctx),
                l.to_string(),
            ));
        }
        self.lens.copy_from_slice(lens);
        Ok(())
    }

    /// Call `hook` with the inputs of every later step, before it computes (see [`StepHook`]).
    pub fn set_step_hook(&mut self, hook: Option<StepHook<'m>>) {
        self.hook = hook;
    }

    /// Take the lowest free slot (an empty sequence), if any. The lowest keeps the cache rows
    /// attended to few.
    pub fn acquire(&mut self) -> Option<usize> {
        let s = self.lens.iter().position(|l| l.is_none())?;
        self.lens[s] = Some(0);
        Some(s)
    }

    /// Free `slot` (its rows are overwritten by the next sequence that takes it); an error
    /// naming the slot when it is not held.
    pub fn release(&mut self, slot: usize) -> Result<()> {
        self.held(slot)?;
        self.lens[slot] = None;
        Ok(())
    }

    fn held(&self, slot: usize) -> Result<usize> {
        self.len(slot).ok_or_else(|| {
            Error::invalid_input(
                "batch step",
                "slot",
                format!("a held slot of 0..{}", self.lens.len()),
                slot,
            )
        })
    }

    /// Check the step's inputs: held, distinct slots, tokens that fit each slot and the
    /// vocabulary.
    fn check(&self, seqs: &[SeqInput]) -> Result<()> {
        let bad = |what: &str, expected: String, got: String| {
            Err(Error::invalid_input("batch step", what, expected, got))
        };
        if seqs.is_empty() {
            return bad("sequences", "at least one".into(), "none".into());
        }
        let nv = self.model.cfg.n_vocab;
        let mut seen = vec![false; self.lens.len()];
        for s in seqs {
            let len = self.held(s.slot)?;
            if std::mem::replace(&mut seen[s.slot], true) {
                return bad("slot", "each slot once".into(), s.slot.to_string());
            }
            if s.tokens.is_empty() || len + s.tokens.len() > self.ctx {
                return bad(
                    "tokens",
                    format!(
                        "1..={} for slot {} (holding {len} of {})",
                        self.ctx - len,
                        s.slot,
                        self.ctx
                    ),
                    s.tokens.len().to_string(),
                );
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= nv) {
                return bad(
                    "token id",
                    format!("below the vocabulary size {nv}"),
                    t.to_string(),
                );
            }
        }
        Ok(())
    }

    /// Whether a step's graphs (one per micro-batch) reuse the last step's of the same
    /// micro-batch where it has the same shape (on by default); off, every step's graphs are
    /// built anew (both give the same bits).
    pub fn set_graph_reuse(&mut self, on: bool) {
        self.reuse = on;
        if !on {
            self.kept.clear();
        }
    }

    /// Evaluate each sequence's tokens after its slot's sequence, all in one graph; returns,
    /// per sequence in order, the logits (`n_vocab`) of its last token where it asked for
    /// them. Tokens needing logits are laid out last, so the logits are one contiguous range.
    /// A failed step leaves every slot's length as it was.
    pub fn step(&mut self, seqs: &[SeqInput]) -> Result<Vec<Option<Vec<f32>>>> {
        self.check(seqs)?;
        if let Some(hook) = &mut self.hook {
            hook(&self.lens, seqs)?;
        }
        let before = self.lens.clone();
        for s in seqs {
            let len = self.lens[s.slot].unwrap_or(0);
            self.lens[s.slot] = Some(len + s.tokens.len());
        }
        let per = seqs
            .len()
            .div_ceil(self.micro_batches.clamp(1, seqs.len().max(1)));
        let result = self.compute_groups(seqs.chunks(per.max(1)), &before);
        if result.is_err() {
            // A failed step leaves every slot as it was (its rows are written again).
            self.lens = before;
        }
        let logits = result?;
        let nv = self.model.cfg.n_vocab;
        let mut next = 0;
        Ok(seqs
            .iter()
            .map(|s| {
                s.logits.then(|| {
                    let l = logits[next * nv..(next + 1) * nv].to_vec();
                    next += 1;
                    l
                })
            })
            .collect())
    }

    /// The graphs of `groups` of sequences (slot lengths `before` the step, `self.lens`
    /// after), computed together; the logits of every sequence that asked, in order.
    fn compute_groups<'s>(
        &mut self,
        groups: impl Iterator<Item = &'s [SeqInput<'s>]>,
        before: &[Option<usize>],
    ) -> Result<Vec<f32>> {
        let groups: Vec<&[SeqInput]> = groups.collect();
        let mut graphs = Vec::new();
        let mut outs = Vec::new();
        // Each micro-batch's graph is kept for the next step (out of `self.kept` while it
        // computes; a failed step drops them and the next builds anew).
        let mut kept = Vec::with_capacity(groups.len());
        for (i, g) in groups.iter().enumerate() {
            let last = self
                .reuse
                .then(|| self.kept.get_mut(i).and_then(Option::take));
            let (graph, logits, n_logits, k) = self.build(g, before, last)?;
            graphs.push(graph);
            outs.push((logits, n_logits));
            kept.push(k);
        }
        let mut all = Vec::new();
        self.backend.graph_compute_many(&mut graphs, &mut |j, g| {
            let (logits, n_logits) = outs[j];
            if n_logits > 0 {
                all.extend(g.read_f32(logits)?);
            }
            Ok(())
        })?;
        // Only this step's micro-batches stay kept (a kept graph holds its inputs' data, the
        // mask among them: rows x cache rows).
        self.kept = kept
            .into_iter()
            .zip(graphs)
            .map(|(k, g)| {
                k.map(|mut k| {
                    k.put_back(g);
                    k
                })
            })
            .collect();
        Ok(all)
    }

    /// The step graph of `seqs` (each slot's length `before` the step), its logits node and
    /// how many sequences asked for logits; with `last` (the kept step, if any), the graph is
    /// the kept one's where the shape is the same, and comes with the `KeptStep` to put it
    /// back in.
    fn build(
        &self,
        seqs: &[SeqInput],
        before: &[Option<usize>],
        last: Option<Option<KeptStep>>,
    ) -> Result<(Graph, TensorId, usize, Option<KeptStep>)> {
        // (token, position, cache row, slot) per row: rows without logits first.
        let mut front = Vec::new();
        let mut back = Vec::new();
        let mut n_kv = 0;
        for s in seqs {
            let start = before[s.slot].unwrap_or(0);
            let base = s.slot * self.ctx;
            for (i, &t) in s.tokens.iter().enumerate() {
                let p = start + i;
                let row = (t as i32, p as i32, (base + p) as i32, s.slot as i32);
                if s.logits && i + 1 == s.tokens.len() {
                    back.push(row);
                } else {
                    front.push(row);
                }
            }
            n_kv = n_kv.max(base + start + s.tokens.len());
        }
        let n_logits = back.len();
        let n_front = front.len();
        front.extend(back);
        let rows = front;
        let n_kv = n_kv.next_multiple_of(KV_PAD).min(self.cache.size);
        let kv_rows: Vec<i32> = (0..n_kv).map(|j| (j / self.ctx) as i32).collect();
        let kv_positions: Vec<i32> = (0..n_kv)
            .map(|j| {
                let p = j % self.ctx;
                match self.lens[j / self.ctx] {
                    Some(len) if p < len => p as i32,
                    _ => -1,
                }
            })
            .collect();
        let col = |f: fn(&(i32, i32, i32, i32)) -> i32| rows.iter().map(f).collect::<Vec<i32>>();
        let (tokens, positions, slots, seq) =
            (col(|r| r.0), col(|r| r.1), col(|r| r.2), col(|r| r.3));
        // A step with no logits still computes one row's (the graph needs an output).
        let logits_rows = if n_logits == 0 {
            rows.len() - 1..rows.len()
        } else {
            n_front..rows.len()
        };
        let inp = StepInput {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            n_kv,
            kv_positions: &kv_positions,
            logits_rows,
        };
        let ids = StepSeqs {
            tokens: &seq,
            kv_rows: &kv_rows,
        };
        let m = self.model;
        match last {
            Some(last) => {
                let model = (&m.cfg, &m.weights, &self.cache);
                let mut k = KeptStep::for_step(last, model, &inp, Some(&ids))?;
                Ok((k.take_graph(), k.logits(), n_logits, Some(k)))
            }
            None => {
                let sg = build_step_seqs(&m.cfg, &m.weights, &self.cache, &inp, Some(&ids))?;
                Ok((sg.graph, sg.logits, n_logits, None))
            }
        }
    }
}
