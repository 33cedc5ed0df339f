//! Sampling ([`SamplerConfig`], [`Sampler`]: presence and frequency penalties and a logit
//! bias, then temperature, top-k, top-p, a seeded random state; settings out of range are
//! refused), tokens' log-probabilities
//! ([`token_logprobs`]) and the generation loop ([`generate`]), bounded
//! by the session's context, with its timings and why it stopped.

use super::session::Session;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

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
    /// In [-2, 2]: subtracted from the logit of every token this sampler has drawn before
    /// (the OpenAI API's `presence_penalty`; 0 is none).
    pub presence_penalty: f32,
    /// In [-2, 2]: subtracted from a token's logit once per earlier draw of it (the OpenAI
    /// API's `frequency_penalty`; 0 is none).
    pub frequency_penalty: f32,
}

impl SamplerConfig {
    /// An [`Error::InvalidArgument`] naming the first setting out of range: a NaN or infinite
    /// or negative temperature, `top_k` 0, `top_p` outside (0, 1] or NaN, a penalty outside
    /// [-2, 2] or NaN.
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
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(Error::invalid_argument(
                    name,
                    v,
                    "must be in [-2, 2] (0 is none)",
                ));
            }
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
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

/// The most a [`Sampler::with_logit_bias`] value may add or take away (the OpenAI API's
/// `logit_bias` range: -100 bans a token in practice, 100 forces it).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// An error naming `logit_bias` for a value outside [-[`MAX_LOGIT_BIAS`], [`MAX_LOGIT_BIAS`]]
/// or not finite.
pub fn check_logit_bias(bias: &[(u32, f32)]) -> Result<()> {
    match bias
        .iter()
        .find(|(_, b)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(b))
    {
        Some(&(t, b)) => Err(Error::invalid_argument(
            "logit_bias",
            format!("{b} for token {t}"),
            format!("must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"),
        )),
        None => Ok(()),
    }
}

/// A token sampler with its own random state (splitmix64), the counts of the tokens it drew
/// (for the penalties) and a fixed logit bias.
pub struct Sampler {
    cfg: SamplerConfig,
    state: u64,
    drawn: std::collections::HashMap<u32, u32>,
    bias: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler with `cfg`; an error naming the setting when [`SamplerConfig::validate`]
    /// refuses it.
    pub fn new(cfg: SamplerConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Sampler {
            cfg,
            state: cfg.seed ^ 0x5DEE_CE66_D1CE_4E5B,
            drawn: Default::default(),
            bias: Vec::new(),
        })
    }

    /// Add `bias` to the logits of these tokens before every draw (the OpenAI API's
    /// `logit_bias`); the error of [`check_logit_bias`] for a value out of range. Ids past
    /// the vocabulary are the caller's to refuse ([`crate::models::engine::Engine::submit`]
    /// does).
    pub fn with_logit_bias(mut self, bias: Vec<(u32, f32)>) -> Result<Self> {
        check_logit_bias(&bias)?;
        self.bias = bias;
        Ok(self)
    }

    /// The next token from `logits` after the penalties and the bias, on a copy (none when
    /// all are 0): `l - count * frequency_penalty - [count > 0] * presence_penalty + bias`,
    /// the OpenAI API's formula (its guide's "frequency and presence penalties"), then
    /// [`Sampler::draw`].
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let (pp, fp) = (self.cfg.presence_penalty, self.cfg.frequency_penalty);
        let penalize = (pp != 0.0 || fp != 0.0) && !self.drawn.is_empty();
        let t = if penalize || !self.bias.is_empty() {
            let mut l = logits.to_vec();
            if penalize {
                for (&t, &c) in &self.drawn {
                    if let Some(x) = l.get_mut(t as usize) {
                        *x -= c as f32 * fp + pp;
                    }
                }
            }
            for &(t, b) in &self.bias {
                if let Some(x) = l.get_mut(t as usize) {
                    *x += b;
                }
            }
            self.draw(&l)
        } else {
            self.draw(logits)
        };
        if pp != 0.0 || fp != 0.0 {
            *self.drawn.entry(t).or_default() += 1;
        }
        t
    }

    fn next_f64(&mut self) -> f64 {
        // splitmix64 (Steele, Lea, Flood 2014).
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next token from `logits` as they are: greedy at temperature 0; otherwise the
    /// candidates are the `top_k` first in the order "larger logit first, then lower id" (a
    /// total order: [`by_rank`]), with probabilities `exp((l - max) / temperature)` normalized over them; the nucleus is
    /// the shortest prefix of that order whose probabilities add up to `top_p` (Holtzman et
    /// al. 2020, "The curious case of neural text degeneration"; every candidate when
    /// `top_p` is 1), and the draw walks the nucleus in token id order. Linear in the
    /// vocabulary (expected): `top_k` and the nucleus by selections ([`nucleus_end`]), no
    /// sort of the whole order. Sorting the whole vocabulary (262,144 logits for Gemma 3)
    /// for every token cost as much as a decoding step.
    pub fn draw(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 || logits.len() <= 1 {
            return argmax(logits);
        }
        let before = by_rank(logits);
        // The candidates in id order.
        let n = logits.len();
        let mut ids: Vec<u32> = (0..n as u32).collect();
        let k = self.cfg.top_k.clamp(1, n);
        if k < n {
            ids.select_nth_unstable_by(k - 1, &before);
            ids.truncate(k);
            ids.sort_unstable();
        }
        let top = *ids.iter().min_by(|a, b| before(a, b)).expect("k >= 1");
        let t = self.cfg.temperature as f64;
        let m = logits[top as usize] as f64;
        let ws: Vec<f64> = ids
            .iter()
            .map(|&i| ((logits[i as usize] as f64 - m) / t).exp())
            .collect();
        let sum: f64 = ws.iter().sum();
        // The nucleus: the candidates ranked at or before `last`, of probability `total`.
        let (last, total) = if self.cfg.top_p >= 1.0 {
            // (The running sum may round to just under 1 before the end.)
            (None, 1.0)
        } else {
            let cands = ids
                .iter()
                .zip(&ws)
                .map(|(&i, &x)| (logits[i as usize], i, x / sum))
                .collect();
            nucleus_end(cands, self.cfg.top_p as f64)
        };
        let mut r = self.next_f64() * total;
        let mut seen = top;
        for (&i, &x) in ids.iter().zip(&ws) {
            if last.is_some_and(|l| before(&i, &l).is_gt()) {
                continue;
            }
            seen = i;
            r -= x / sum;
            if r <= 0.0 {
                return i;
            }
        }
        seen
    }
}

/// Token ids in the sampler's order: the larger logit first (by `total_cmp`), then the lower
/// id, a total order, so what a selection or a sort picks does not depend on how it works.
fn by_rank(logits: &[f32]) -> impl Fn(&u32, &u32) -> std::cmp::Ordering + '_ {
    |a, b| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    }
}

/// The last candidate of the shortest prefix of the order [`by_rank`] whose probabilities add up
/// to `top_p`, and that sum, by a weighted quickselect (Hoare's selection with each side's
/// probability summed: linear expected time); `None` and the sum of all when they do not
/// reach it (a `top_p` just under 1 and rounding). `cands`: each candidate's logit, id and
/// probability, in any order (the order is [`by_rank`]'s, on the logits held here).
fn nucleus_end(mut cands: Vec<(f32, u32, f64)>, top_p: f64) -> (Option<u32>, f64) {
    let before = |a: &(f32, u32, f64), b: &(f32, u32, f64)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    // `cands[..lo]` are the `lo` first candidates, of probability `acc` (< top_p); the end is
    // in `cands[lo..hi]`, and `cands[hi..]` come after all of those.
    let (mut lo, mut hi, mut acc) = (0, cands.len(), 0.0);
    while lo < hi {
        let s = &mut cands[lo..hi];
        let mid = s.len() / 2;
        s.select_nth_unstable_by(mid, before);
        let left: f64 = s[..mid].iter().map(|x| x.2).sum();
        if acc + left >= top_p {
            hi = lo + mid;
            continue;
        }
        let with = acc + left + s[mid].2;
        if with >= top_p {
            return (Some(s[mid].1), with);
        }
        acc = with;
        lo += mid + 1;
    }
    (None, acc)
}

/// A sampled token's log-probability and the most likely tokens' at its position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// `ln p` of the sampled token.
    pub logprob: f32,
    /// The most likely tokens and their `ln p`, most likely first (then lower id).
    pub top: Vec<(u32, f32)>,
}

/// Log-probabilities under the softmax of `logits`, the model's own distribution (before the
/// temperature and the top-k / top-p cuts, as the OpenAI API and llama.cpp's server report
/// them): token `t`'s and the `n` most likely tokens'. Log-sum-exp in f64 from the largest
/// logit.
pub fn token_logprobs(logits: &[f32], t: u32, n: usize) -> TokenLogprob {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = m + logits
        .iter()
        .map(|&l| (l as f64 - m).exp())
        .sum::<f64>()
        .ln();
    let lp = |i: u32| (logits[i as usize] as f64 - lse) as f32;
    let before = by_rank(logits);
    let n = n.min(logits.len());
    if n == 0 {
        return TokenLogprob {
            logprob: lp(t),
            top: Vec::new(),
        };
    }
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    if n < ids.len() {
        ids.select_nth_unstable_by(n - 1, &before);
    }
    ids.truncate(n);
    ids.sort_unstable_by(&before);
    TokenLogprob {
        logprob: lp(t),
        top: ids.into_iter().map(|i| (i, lp(i))).collect(),
    }
}

/// Index of the largest value (the first of equals; NaNs are never larger, and a NaN first
/// value stays the answer): the result of scanning with `if v[i] > v[best] { best = i }`.
/// Two vectorizable passes over a decoder's logits (262144 of them for Gemma 3) instead of
/// one dependent chain: the maximum in 16 lanes, then the first chunk holding it.
pub fn argmax(v: &[f32]) -> u32 {
    const LANES: usize = 16;
    let Some(&first) = v.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    // `if x > m { x } else { m }` skips NaNs as the scan does (and compiles to `maxps`).
    let pick = |m: f32, x: f32| if x > m { x } else { m };
    let mut acc = [first; LANES];
    let chunks = v.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = pick(*a, x);
        }
    }
    let max = tail.iter().chain(&acc).fold(first, |m, &x| pick(m, x));
    // The scan stops moving at the first value equal to the maximum (`==` also joins -0 and
    // +0, which `>` does not tell apart either).
    let at = v
        .chunks(256)
        .enumerate()
        .find(|(_, c)| c.iter().fold(false, |hit, &x| hit | (x == max)))
        .and_then(|(ci, c)| Some(ci * 256 + c.iter().position(|&x| x == max)?));
    at.unwrap_or(0) as u32
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

#[cfg(test)]
mod tests {
    use super::{Sampler, SamplerConfig, argmax};

    /// The definition [`Sampler::sample`] implements, by sorting every candidate: the order
    /// (larger logit, then lower id), the first `top_k`, probabilities normalized over them,
    /// the shortest prefix reaching `top_p`, a draw walking it in id order.
    fn sample_by_sorting(cfg: &SamplerConfig, u: f64, logits: &[f32]) -> u32 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        idx.sort_by(|a, b| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        });
        idx.truncate(cfg.top_k.max(1));
        let t = cfg.temperature as f64;
        let m = logits[idx[0] as usize] as f64;
        let w = |i: u32| ((logits[i as usize] as f64 - m) / t).exp();
        let sum: f64 = idx.iter().map(|&i| w(i)).sum();
        let mut keep = idx.len();
        let mut total = 1.0;
        if cfg.top_p < 1.0 {
            let mut acc = 0.0;
            for (j, &i) in idx.iter().enumerate() {
                acc += w(i) / sum;
                if acc >= cfg.top_p as f64 {
                    keep = j + 1;
                    break;
                }
            }
            total = acc;
        }
        let mut nucleus = idx[..keep].to_vec();
        nucleus.sort();
        let mut r = u * total;
        for &i in &nucleus {
            r -= w(i) / sum;
            if r <= 0.0 {
                return i;
            }
        }
        *nucleus.last().unwrap()
    }

    /// The penalties and the bias on greedy draws of three logits [1.0, 0.8, 0.0]: a presence
    /// penalty of 0.5 takes token 0 below 1 once drawn (0.5 < 0.8), then token 1 below 0 (0.3 <
    /// 0.5), and counts no further; a frequency penalty of 0.3 grows with each draw; a bias of
    /// -100 bans token 0 and +100 forces token 2.
    #[test]
    fn penalties_and_bias_follow_the_openai_formula() {
        let l = [1.0f32, 0.8, 0.0];
        let run = |presence_penalty, frequency_penalty, bias: Vec<(u32, f32)>| {
            let cfg = SamplerConfig {
                presence_penalty,
                frequency_penalty,
                ..SamplerConfig::default()
            };
            let mut s = Sampler::new(cfg).unwrap().with_logit_bias(bias).unwrap();
            (0..5).map(|_| s.sample(&l)).collect::<Vec<u32>>()
        };
        assert_eq!(run(0.0, 0.0, vec![]), [0, 0, 0, 0, 0]);
        assert_eq!(run(0.5, 0.0, vec![]), [0, 1, 0, 0, 0]);
        assert_eq!(run(0.0, 0.3, vec![]), [0, 1, 0, 1, 0]);
        assert_eq!(run(0.0, 0.0, vec![(0, -100.0)]), [1, 1, 1, 1, 1]);
        assert_eq!(run(0.0, 0.0, vec![(2, 100.0)]), [2, 2, 2, 2, 2]);
        let e = Sampler::new(SamplerConfig::default())
            .unwrap()
            .with_logit_bias(vec![(1, f32::NAN)]);
        assert!(e.is_err_and(|e| e.to_string().contains("logit_bias")));
    }

    /// Against a direct f64 softmax: the sampled token's and the top tokens' log-probabilities,
    /// the top in order with ties by id, `n` past the vocabulary clamped.
    #[test]
    fn token_logprobs_are_the_log_softmax() {
        let logits = [1.5f32, -2.0, 3.25, 3.25, 0.0, -40.0, 2.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let want = |i: usize| ((logits[i] as f64).exp() / z).ln() as f32;
        let r = super::token_logprobs(&logits, 5, 3);
        assert!((r.logprob - want(5)).abs() < 1e-5, "{r:?}");
        let ids: Vec<u32> = r.top.iter().map(|x| x.0).collect();
        assert_eq!(ids, [2, 3, 6]);
        for &(i, lp) in &r.top {
            assert!((lp - want(i as usize)).abs() < 1e-6, "{r:?}");
        }
        assert_eq!(super::token_logprobs(&logits, 0, 0).top, []);
        assert_eq!(
            super::token_logprobs(&logits, 0, 99).top.len(),
            logits.len()
        );
        // Large logits do not overflow: 1000 and 999 are e : 1 apart.
        let r = super::token_logprobs(&[1000.0, 999.0], 1, 1);
        let p1 = 1.0 / (1.0 + std::f64::consts::E);
        assert!((r.logprob as f64 - p1.ln()).abs() < 1e-6, "{r:?}");
        assert_eq!(r.top[0].0, 0);
    }

    /// Rows of 1 to 5,000 logits (some with many equal values), every kind of setting: the
    /// sampler picks what sorting every candidate picks, draw for draw (its own random
    /// numbers, replayed through a second sampler with the same seed).
    #[test]
    fn sampling_equals_sorting_every_candidate() {
        let mut s = 0x1234_5678_9abc_def1u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut cases = 0;
        for n in [1usize, 2, 3, 63, 64, 65, 200, 1000, 5000] {
            for spread in [0.5f32, 4.0, 30.0] {
                let coarse = next() % 2 == 0;
                let logits: Vec<f32> = (0..n)
                    .map(|_| {
                        let v = (next() % 100_000) as f32 / 100_000.0 * spread - spread / 2.0;
                        if coarse { v.round() } else { v }
                    })
                    .collect();
                for &(temperature, top_k, top_p) in &[
                    (1.0f32, usize::MAX, 1.0f32),
                    (0.7, 40, 0.95),
                    (1.5, usize::MAX, 0.9),
                    (0.3, 1, 1.0),
                    (2.0, 100, 0.5),
                    (1.0, 3, 0.999),
                ] {
                    let cfg = SamplerConfig {
                        temperature,
                        top_k,
                        top_p,
                        seed: next(),
                        ..SamplerConfig::default()
                    };
                    let mut a = Sampler::new(cfg).unwrap();
                    let mut b = Sampler::new(cfg).unwrap();
                    for _ in 0..20 {
                        let want = sample_by_sorting(&cfg, b.next_f64(), &logits);
                        assert_eq!(a.draw(&logits), want, "n {n} {cfg:?}");
                        cases += 1;
                    }
                }
            }
        }
        assert_eq!(cases, 9 * 3 * 6 * 20);
    }

    /// The definition: the first index that no later value is larger than.
    fn scan(v: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &x) in v.iter().enumerate() {
            if x > v[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_equals_the_scan_with_ties_nans_and_signed_zeros() {
        let mut cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![1.0],
            vec![f32::NAN, 5.0, 7.0],
            vec![1.0, f32::NAN, 7.0, 7.0, f32::NAN],
            vec![-0.0, 0.0, -0.0],
            vec![f32::NEG_INFINITY; 40],
            vec![f32::NAN; 33],
        ];
        // Pseudo-random rows of every length around the lane and chunk sizes, with repeats.
        let mut s = 0x2545_f491_u32;
        for n in [15, 16, 17, 255, 256, 257, 1000, 4099] {
            let row = (0..n)
                .map(|_| {
                    s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    ((s >> 20) % 97) as f32 - 48.0
                })
                .collect();
            cases.push(row);
        }
        let mut late = vec![0.0f32; 5000];
        late[4999] = 1.0;
        late[1234] = f32::NAN;
        cases.push(late);
        for v in &cases {
            assert_eq!(argmax(v), scan(v), "{v:?}");
        }
    }
}
