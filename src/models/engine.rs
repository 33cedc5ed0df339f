//! The request scheduler ([`Engine`]) over a [`BatchSession`]: requests wait in a queue until a
//! slot is free; each step decodes one token of every running sequence and fills the rest of
//! a token budget with prompt chunks of the sequences still reading their prompts (chunked
//! prefill, so a long prompt does not stall the running ones: vLLM's scheduling policy with
//! decodes first); each request samples with its own settings and seed, stops at its token
//! count, the end-of-sequence token, a stop string or a full slot, and may be cancelled. A
//! prompt that does not fit a slot is refused for that request only. Events say what each step
//! produced, text streamed in whole UTF-8 characters with any text that could still become a
//! stop string held back. How long each request waited for its slot is counted in a
//! histogram ([`WaitHistogram`], in [`EngineStats`]); [`Engine::waiting`] is what a server bounds.
//! A request may ask for each generated token's log-probability and the most likely
//! alternatives ([`GenRequest::logprobs`]), from the logits its token was sampled from.

use super::batch::{BatchSession, SeqInput};
pub use super::sampler::TokenLogprob;
use super::sampler::{Sampler, SamplerConfig, check_logit_bias, token_logprobs};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use std::collections::VecDeque;
use std::time::Instant;

/// One generation request.
#[derive(Clone, Debug)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least 1).
    pub max_tokens: usize,
    pub sampling: SamplerConfig,
    /// Generation ends where the text contains one of these (not included in the text).
    pub stop: Vec<String>,
    /// Keep generating past the end-of-sequence token.
    pub ignore_eos: bool,
    /// Report each generated token's log-probability and those of this many most likely
    /// tokens (at most [`MAX_TOP_LOGPROBS`]) in its [`Event::Token`].
    pub logprobs: Option<usize>,
    /// Added to these tokens' logits before each draw ([`Sampler::with_logit_bias`]).
    pub logit_bias: Vec<(u32, f32)>,
}

/// The most alternatives [`GenRequest::logprobs`] may ask for (the OpenAI API's limit for
/// `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A request's number, from [`Engine::submit`].
pub type RequestId = u64;

/// Why a request finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_tokens` generated.
    Length,
    /// The end-of-sequence token.
    Eos,
    /// A stop string.
    Stop,
    /// The slot's context is full.
    Context,
    /// [`Engine::cancel`].
    Cancelled,
}

/// What a step produced for a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A generated token (not the end-of-sequence token) and the text it releases.
    Token {
        id: RequestId,
        token: u32,
        text: String,
        /// When the request asked for them ([`GenRequest::logprobs`]).
        logprob: Option<TokenLogprob>,
    },
    /// The request is done: the last text it releases and the counts.
    Finished {
        id: RequestId,
        reason: FinishReason,
        text: String,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
}

/// A request holding a slot.
struct Running {
    id: RequestId,
    slot: usize,
    req: GenRequest,
    sampler: Sampler,
    /// Prompt tokens evaluated so far.
    fed: usize,
    /// The last sampled token, to evaluate next.
    next: Option<u32>,
    generated: usize,
    /// Bytes of an incomplete UTF-8 character.
    pending: Vec<u8>,
    /// Text decoded so far, and how much of it was released.
    text: String,
    released: usize,
}

/// Counters since the engine started.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct EngineStats {
    /// Requests accepted by [`Engine::submit`].
    pub requests: u64,
    pub steps: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Seconds from submission to a slot, of every admitted request.
    pub queue_wait: WaitHistogram,
}

/// Upper bounds (seconds) of [`WaitHistogram`]'s buckets; the last bucket is unbounded.
pub const WAIT_BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0,
];

/// A histogram of durations in seconds with the fixed bounds [`WAIT_BUCKETS`], cumulative as
/// Prometheus' histograms are (prometheus.io/docs/concepts/metric_types/#histogram): `le[i]`
/// counts the observations at most `WAIT_BUCKETS[i]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct WaitHistogram {
    pub le: [u64; WAIT_BUCKETS.len()],
    pub count: u64,
    pub sum: f64,
}

impl WaitHistogram {
    pub fn observe(&mut self, secs: f64) {
        for (n, &b) in self.le.iter_mut().zip(&WAIT_BUCKETS) {
            *n += (secs <= b) as u64;
        }
        self.count += 1;
        self.sum += secs;
    }
}

/// Requests scheduled onto a batch session.
pub struct Engine<'m> {
    batch: BatchSession<'m>,
    /// Waiting requests and when each was submitted.
    queue: VecDeque<(RequestId, GenRequest, Instant)>,
    running: Vec<Running>,
    /// Events of requests finished outside a step (cancelled while queued).
    finished: Vec<Event>,
    next_id: RequestId,
    /// Tokens evaluated per step at most (decode tokens first, then prompt chunks).
    pub token_budget: usize,
    pub stats: EngineStats,
}

impl<'m> Engine<'m> {
    /// An engine over `batch` evaluating at most `token_budget` tokens per step (at least the
    /// number of slots, so every running sequence decodes each step).
    pub fn new(batch: BatchSession<'m>, token_budget: usize) -> Engine<'m> {
        let token_budget = token_budget.max(batch.n_slots());
        Engine {
            batch,
            queue: VecDeque::new(),
            running: Vec::new(),
            finished: Vec::new(),
            next_id: 0,
            token_budget,
            stats: EngineStats::default(),
        }
    }

    pub fn batch(&self) -> &BatchSession<'m> {
        &self.batch
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Queued requests that the next step's admission leaves waiting (those beyond the free
    /// slots): what a server bounds.
    pub fn waiting(&self) -> usize {
        self.queue.len().saturating_sub(self.batch.free_slots())
    }

    /// Requests holding a slot.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Nothing queued, running or left to report.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.running.is_empty() && self.finished.is_empty()
    }

    /// Queue a request; an error naming the field when it can never run: no prompt, a prompt
    /// that leaves no room in a slot for a generated token, a token outside the vocabulary
    /// (in the prompt or `logit_bias`), `max_tokens` 0, sampling settings out of range, more
    /// than [`MAX_TOP_LOGPROBS`] alternatives. Other requests are not affected.
    pub fn submit(&mut self, req: GenRequest) -> Result<RequestId> {
        self.submit_since(req, Instant::now())
    }

    /// As [`Engine::submit`], for a request that arrived at `since` (its wait for a slot is
    /// counted from there).
    pub fn submit_since(&mut self, req: GenRequest, since: Instant) -> Result<RequestId> {
        let ctx = self.batch.ctx();
        let n = req.prompt.len();
        if n == 0 {
            return Err(Error::invalid_argument(
                "prompt",
                "empty",
                "gives no tokens",
            ));
        }
        if n >= ctx {
            return Err(Error::invalid_argument(
                "prompt",
                format!("of {n} tokens"),
                format!("does not fit the context of {ctx} tokens with a token to generate"),
            ));
        }
        let nv = self.batch.model.cfg.n_vocab;
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= nv) {
            return Err(Error::invalid_argument(
                "prompt",
                format!("token {t}"),
                format!("is outside the vocabulary of {nv} tokens"),
            ));
        }
        if req.max_tokens == 0 {
            return Err(Error::invalid_argument(
                "max_tokens",
                0,
                "must be at least 1",
            ));
        }
        if let Some(&(t, _)) = req.logit_bias.iter().find(|&&(t, _)| t as usize >= nv) {
            return Err(Error::invalid_argument(
                "logit_bias",
                format!("token {t}"),
                format!("is outside the vocabulary of {nv} tokens"),
            ));
        }
        req.sampling.validate()?;
        check_logit_bias(&req.logit_bias)?;
        if let Some(n) = req.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(Error::invalid_argument(
                "logprobs",
                n,
                format!("asks for more than {MAX_TOP_LOGPROBS} most likely tokens"),
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.stats.requests += 1;
        self.queue.push_back((id, req, since));
        Ok(id)
    }

    /// Cancel request `id`: a queued one leaves the queue, a running one frees its slot; its
    /// `Finished` event (reason `Cancelled`) comes with the next step. False when it is not
    /// queued or running.
    pub fn cancel(&mut self, id: RequestId) -> Result<bool> {
        if let Some(i) = self.queue.iter().position(|(q, ..)| *q == id) {
            let (_, req, _) = self.queue.remove(i).expect("the position is in the queue");
            self.finished.push(Event::Finished {
                id,
                reason: FinishReason::Cancelled,
                text: String::new(),
                prompt_tokens: req.prompt.len(),
                completion_tokens: 0,
            });
            return Ok(true);
        }
        let Some(i) = self.running.iter().position(|r| r.id == id) else {
            return Ok(false);
        };
        let r = self.running.remove(i);
        self.batch.release(r.slot)?;
        self.finished
            .push(finish(r, FinishReason::Cancelled, String::new()));
        Ok(true)
    }

    /// Admit queued requests into free slots.
    fn admit(&mut self) -> Result<()> {
        while !self.queue.is_empty() && self.batch.free_slots() > 0 {
            let (id, mut req, since) = self.queue.pop_front().expect("the queue is not empty");
            let slot = self.batch.acquire().expect("a slot is free");
            self.stats.queue_wait.observe(since.elapsed().as_secs_f64());
            let bias = std::mem::take(&mut req.logit_bias);
            let sampler = Sampler::new(req.sampling)?.with_logit_bias(bias)?;
            self.running.push(Running {
                id,
                slot,
                req,
                sampler,
                fed: 0,
                next: None,
                generated: 0,
                pending: Vec::new(),
                text: String::new(),
                released: 0,
            });
        }
        Ok(())
    }

    /// One step: admit, evaluate one batch, sample; the events it produced (with those of
    /// requests cancelled since the last step). An idle engine returns no events.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        self.admit()?;
        let mut events = std::mem::take(&mut self.finished);
        if self.running.is_empty() {
            return Ok(events);
        }
        // Decode tokens first, then prompt chunks within the budget.
        let mut budget = self.token_budget;
        let mut plan: Vec<(usize, Vec<u32>, bool)> = Vec::new();
        for (i, r) in self.running.iter().enumerate() {
            if let Some(t) = r.next {
                plan.push((i, vec![t], true));
                budget = budget.saturating_sub(1);
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            if r.next.is_none() && budget > 0 {
                let n = (r.req.prompt.len() - r.fed).min(budget);
                let chunk = r.req.prompt[r.fed..r.fed + n].to_vec();
                plan.push((i, chunk, r.fed + n == r.req.prompt.len()));
                budget -= n;
            }
        }
        let seqs: Vec<SeqInput> = plan
            .iter()
            .map(|(i, t, logits)| SeqInput {
                slot: self.running[*i].slot,
                tokens: t,
                logits: *logits,
            })
            .collect();
        let logits = self.batch.step(&seqs)?;
        self.stats.steps += 1;
        let mut done = Vec::new();
        for ((i, tokens, _), l) in plan.iter().zip(logits) {
            let r = &mut self.running[*i];
            if r.next.is_none() {
                r.fed += tokens.len();
                self.stats.prompt_tokens += tokens.len() as u64;
            }
            let Some(l) = l else { continue };
            let t = r.sampler.sample(&l);
            let logprob = r.req.logprobs.map(|n| token_logprobs(&l, t, n));
            self.stats.generated_tokens += 1;
            r.generated += 1;
            r.next = Some(t);
            let len = self.batch.len(r.slot).unwrap_or(0);
            if let Some(reason) = advance(r, t, logprob, &self.batch, len, &mut events)? {
                done.push((*i, reason));
            }
        }
        // Finished requests free their slots (highest index first keeps the others' indices).
        done.sort_by_key(|d| std::cmp::Reverse(d.0));
        for (i, (reason, tail)) in done {
            let r = self.running.remove(i);
            self.batch.release(r.slot)?;
            events.push(finish(r, reason, tail));
        }
        Ok(events)
    }

    /// Step until every submitted request finished; all events in order.
    pub fn run_all(&mut self) -> Result<Vec<Event>> {
        let mut out = Vec::new();
        while !self.is_idle() {
            out.extend(self.step()?);
        }
        Ok(out)
    }
}

/// The `Finished` event of `r`, releasing `tail`.
fn finish(r: Running, reason: FinishReason, tail: String) -> Event {
    Event::Finished {
        id: r.id,
        reason,
        text: tail,
        prompt_tokens: r.req.prompt.len(),
        completion_tokens: r.generated,
    }
}

/// Take sampled token `t` into `r` (the slot now holding `len` positions): its text, a
/// `Token` event (with `logprob`), and why the request ends here if it does (with the text it
/// still releases).
fn advance(
    r: &mut Running,
    t: u32,
    logprob: Option<TokenLogprob>,
    batch: &BatchSession,
    len: usize,
    events: &mut Vec<Event>,
) -> Result<Option<(FinishReason, String)>> {
    let tok = &batch.model.tokenizer;
    if !r.req.ignore_eos && Some(t) == tok.eos() {
        let tail = r.text[r.released..].to_string();
        return Ok(Some((FinishReason::Eos, tail)));
    }
    tok.token_bytes(t, &mut r.pending)?;
    let valid = match std::str::from_utf8(&r.pending) {
        Ok(s) => s.len(),
        Err(e) => e.valid_up_to(),
    };
    let from = r.text.len();
    r.text
        .push_str(std::str::from_utf8(&r.pending[..valid]).expect("checked UTF-8"));
    r.pending.drain(..valid);
    // A stop string ends the text where it starts (searched from where a new one could start).
    let longest = r.req.stop.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut search = from.saturating_sub(longest);
    while !r.text.is_char_boundary(search) {
        search -= 1;
    }
    let hit = r
        .req
        .stop
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| r.text[search..].find(s.as_str()).map(|p| search + p))
        .min();
    if let Some(p) = hit {
        r.text.truncate(p);
        let tail = r.text[r.released.min(p)..].to_string();
        r.released = r.text.len();
        return Ok(Some((FinishReason::Stop, tail)));
    }
    // Release the text except an end that could begin a stop string.
    let mut keep = r.text.len();
    for s in &r.req.stop {
        for k in (1..s.len()).rev() {
            if s.is_char_boundary(k) && r.text.ends_with(&s[..k]) {
                keep = keep.min(r.text.len() - k);
                break;
            }
        }
    }
    let keep = keep.max(r.released);
    let text = r.text[r.released..keep].to_string();
    r.released = keep;
    events.push(Event::Token {
        id: r.id,
        token: t,
        text,
        logprob,
    });
    let reason = if r.generated >= r.req.max_tokens {
        Some(FinishReason::Length)
    } else if len >= batch.ctx() {
        Some(FinishReason::Context)
    } else {
        None
    };
    Ok(reason.map(|reason| {
        let tail = r.text[r.released..].to_string();
        r.released = r.text.len();
        (reason, tail)
    }))
}

#[cfg(test)]
mod tests {
    use super::{WAIT_BUCKETS, WaitHistogram};

    #[test]
    fn the_wait_histogram_is_cumulative() {
        let mut h = WaitHistogram::default();
        for s in [0.0005, 0.02, 0.02, 3.0, 1e6] {
            h.observe(s);
        }
        assert_eq!(h.count, 5);
        assert!((h.sum - (0.0405 + 3.0 + 1e6)).abs() < 1e-6);
        let at = |b: f64| h.le[WAIT_BUCKETS.iter().position(|&x| x == b).unwrap()];
        assert_eq!(
            (at(0.001), at(0.01), at(0.025), at(2.5), at(10.0)),
            (1, 1, 3, 3, 4)
        );
        assert!(h.le.windows(2).all(|w| w[0] <= w[1]));
    }
}
