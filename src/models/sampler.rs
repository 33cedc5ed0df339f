//! Sampling ([`SamplerConfig`], [`Sampler`]: temperature, top-k, top-p, a seeded random
//! state; settings out of range are refused) and the generation loop ([`generate`]), bounded
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
    use super::argmax;

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
