//! `metashard bench serve`: an HTTP client that measures an OpenAI-compatible server under
//! load, for each concurrency of `--concurrency`: `--requests` streamed completions sent by
//! that many clients at once (each client sends its next request when its last one ends), and
//! from them the aggregate generated tokens/s (all tokens over the wall time of the level),
//! time to first token and inter-token latency (medians and 95th percentiles over requests,
//! and over every gap between two streamed tokens). Without `--url` it starts `metashard serve`
//! itself on a loopback port (`cli::serve::start`) with `serve`'s model and engine flags; with `--url` it
//! measures any server speaking the OpenAI completions API (llama.cpp's `llama-server`
//! included; its `/health` is awaited). Each request asks for `--max-tokens` tokens past the
//! end-of-sequence token (`ignore_eos`, llama-server's extension, which `metashard serve` also
//! takes) at `--temperature` (0, greedy, by default) and no prompt cache (`cache_prompt:
//! false`), so both servers do the same work; the prompts cycle through a fixed list, and the
//! report gives each prompt's distinct texts (greedy: one each when nothing is lost) and, from
//! `/metrics` where the server has it, the requests still holding a slot afterwards.

mod http;

use crate::cli::serve::{EngineArgs, ServeArgs, start};
use crate::cli::{JsonArgs, parse_concurrency, parse_positive};
use metashard::{Error, Result};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone, Debug, clap::Args)]
pub struct BenchServeArgs {
    /// A running server to measure (`http://HOST:PORT`); without it, `metashard serve` is
    /// started on a loopback port with the flags below.
    #[arg(long)]
    pub url: Option<String>,
    /// Clients sending requests at once, a list (e.g. `1,4,8,16`).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 4, 8, 16],
          value_parser = parse_concurrency)]
    pub concurrency: Vec<usize>,
    /// Requests per concurrency.
    #[arg(long, default_value_t = 32, value_parser = parse_positive)]
    pub requests: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32, value_parser = parse_positive)]
    pub max_tokens: usize,
    /// Sampling temperature every request sends: 0 (the default) is greedy; the OpenAI API's
    /// default, which clients that do not set one get, is 1 (then every token is drawn over
    /// the whole vocabulary, `top_p` 1).
    #[arg(long, default_value_t = 0.0, value_parser = crate::cli::parse_temp)]
    pub temperature: f32,
    /// `Authorization: Bearer KEY` for a server that asks for one (with --url).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Seconds a request may take before it counts as failed.
    #[arg(long, default_value_t = 300, value_parser = parse_positive)]
    pub timeout: usize,
    /// The server started without --url.
    #[command(flatten)]
    pub server: EngineArgs,
    #[command(flatten)]
    pub out: JsonArgs,
}

/// The prompts requests cycle through: different openings, so no two requests in a row share
/// a prefix a server could reuse.
pub const PROMPTS: [&str; 8] = [
    "The history of the printing press",
    "In a small village by the sea,",
    "The main ingredients of bread are",
    "Photosynthesis is the process",
    "The capital of France is",
    "Once upon a time, a robot",
    "The three laws of motion",
    "A good way to learn programming is",
];

/// One concurrency's measurement.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ServeRow {
    pub concurrency: usize,
    pub requests: usize,
    pub failed: usize,
    pub generated_tokens: usize,
    pub secs: f64,
    /// Generated tokens of all requests per second of the level's wall time.
    pub tokens_per_s: f64,
    /// Relative to the first row's.
    pub vs_first: f64,
    pub ttft_median_ms: f64,
    pub ttft_p95_ms: f64,
    pub itl_median_ms: f64,
    pub itl_p95_ms: f64,
}

/// The texts one prompt got, with how many requests got each.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PromptTexts {
    pub prompt: String,
    pub texts: BTreeMap<String, usize>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ServeReport {
    pub url: String,
    pub model: String,
    pub max_tokens: usize,
    pub rows: Vec<ServeRow>,
    pub outputs: Vec<PromptTexts>,
    /// The first errors, one line each.
    pub errors: Vec<String>,
    /// Requests running or queued on the server after the last level (`/metrics` of
    /// `metashard serve`; `None` where the server has no such metrics).
    pub held_after: Option<f64>,
}

/// One request's outcome.
struct Outcome {
    prompt: usize,
    result: std::result::Result<http::Stream, String>,
}

pub fn run(a: &BenchServeArgs) -> Result<()> {
    let server = match &a.url {
        Some(_) => None,
        None => Some(start(&serve_args(a), a.out.json)?),
    };
    let base = match (&a.url, &server) {
        (Some(u), _) => http::Base::parse(u)?,
        (None, Some(s)) => http::Base::local(s.addr),
        (None, None) => unreachable!("a server is started without --url"),
    };
    let client = http::Client {
        base: base.clone(),
        api_key: a.api_key.clone(),
        timeout: Duration::from_secs(a.timeout as u64),
    };
    client.wait_healthy()?;
    let model = client.model_name()?;
    // One untimed request: the server is up and its first step paid.
    client
        .complete(&body(&model, 0, a.max_tokens.min(4), a.temperature))
        .map_err(|e| Error::invalid_argument("bench serve", "the first request", e))?;
    let mut rows: Vec<ServeRow> = Vec::new();
    let mut texts: Vec<BTreeMap<String, usize>> = vec![BTreeMap::new(); PROMPTS.len()];
    let mut errors = Vec::new();
    for &c in &a.concurrency {
        let (outcomes, secs) = level(&client, &model, a, c);
        let row = summarize(c, &outcomes, secs, rows.first().map(|r| r.tokens_per_s));
        for o in outcomes {
            match o.result {
                Ok(s) => *texts[o.prompt].entry(s.text).or_default() += 1,
                Err(e) if errors.len() < 10 => errors.push(e),
                Err(_) => {}
            }
        }
        rows.push(row);
    }
    let held_after = client.held().ok();
    if let Some(s) = server {
        s.stop()?;
    }
    let report = ServeReport {
        url: base.to_string(),
        model,
        max_tokens: a.max_tokens,
        rows,
        outputs: PROMPTS
            .iter()
            .zip(texts)
            .filter(|(_, t)| !t.is_empty())
            .map(|(p, texts)| PromptTexts {
                prompt: p.to_string(),
                texts,
            })
            .collect(),
        errors,
        held_after,
    };
    a.out.print("command output", &report, table)?;
    let failed: usize = report.rows.iter().map(|r| r.failed).sum();
    if failed > 0 {
        return Err(Error::invalid_argument(
            "bench serve",
            format!("{failed} requests"),
            format!("failed; the first: {}", report.errors.join("; ")),
        ));
    }
    Ok(())
}

/// The `serve` flags of the server `bench serve` starts: loopback, any free port.
fn serve_args(a: &BenchServeArgs) -> ServeArgs {
    ServeArgs {
        engine: a.server.clone(),
        host: "127.0.0.1".into(),
        port: 0,
        api_key: a.api_key.clone(),
        dist: Default::default(),
    }
}

/// The body of request `i`: a streamed completion of `max_tokens` tokens at `temperature`.
fn body(model: &str, i: usize, max_tokens: usize, temperature: f32) -> String {
    json!({
        "model": model,
        "prompt": PROMPTS[i % PROMPTS.len()],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
        "cache_prompt": false,
    })
    .to_string()
}

/// `a.requests` requests from `c` clients at once; the outcomes and the wall time.
fn level(client: &http::Client, model: &str, a: &BenchServeArgs, c: usize) -> (Vec<Outcome>, f64) {
    let bar = indicatif::ProgressBar::new(a.requests as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:<18} [{bar:40}] {pos}/{len} requests")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_message(format!("concurrency {c}"));
    let next = AtomicUsize::new(0);
    let out = parking_lot::Mutex::new(Vec::new());
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..c.min(a.requests) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= a.requests {
                        break;
                    }
                    let result = client
                        .complete(&body(model, i, a.max_tokens, a.temperature))
                        .map_err(|e| format!("request {i}: {e}"));
                    out.lock().push(Outcome {
                        prompt: i % PROMPTS.len(),
                        result,
                    });
                    bar.inc(1);
                }
            });
        }
    });
    let secs = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    (out.into_inner(), secs)
}

/// The `q` quantile of `v` (nearest rank), 0 when empty.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn summarize(c: usize, outcomes: &[Outcome], secs: f64, first: Option<f64>) -> ServeRow {
    let ok: Vec<&http::Stream> = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().ok())
        .collect();
    let tokens: usize = ok.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = ok.iter().map(|s| s.ttft * 1e3).collect();
    let mut itl: Vec<f64> = ok
        .iter()
        .flat_map(|s| s.gaps.iter().map(|g| g * 1e3))
        .collect();
    let tps = tokens as f64 / secs.max(1e-9);
    ServeRow {
        concurrency: c,
        requests: outcomes.len(),
        failed: outcomes.len() - ok.len(),
        generated_tokens: tokens,
        secs,
        tokens_per_s: tps,
        vs_first: tps / first.unwrap_or(tps).max(1e-9),
        ttft_median_ms: quantile(&mut ttft, 0.5),
        ttft_p95_ms: quantile(&mut ttft, 0.95),
        itl_median_ms: quantile(&mut itl, 0.5),
        itl_p95_ms: quantile(&mut itl, 0.95),
    }
}

fn table(r: &ServeReport) {
    println!(
        "{} at {}: {} tokens per request",
        r.model, r.url, r.max_tokens
    );
    println!(
        "{:>11} {:>8} {:>6} {:>9} {:>9} {:>9} {:>14} {:>14}",
        "concurrency",
        "requests",
        "failed",
        "tokens/s",
        "vs first",
        "secs",
        "TTFT p50/p95",
        "ITL p50/p95"
    );
    for row in &r.rows {
        println!(
            "{:>11} {:>8} {:>6} {:>9.1} {:>8.2}x {:>9.2} {:>14} {:>14}",
            row.concurrency,
            row.requests,
            row.failed,
            row.tokens_per_s,
            row.vs_first,
            row.secs,
            format!("{:.0}/{:.0} ms", row.ttft_median_ms, row.ttft_p95_ms),
            format!("{:.1}/{:.1} ms", row.itl_median_ms, row.itl_p95_ms),
        );
    }
    for e in &r.errors {
        println!("error: {e}");
    }
    if let Some(h) = r.held_after {
        println!("requests holding a slot afterwards: {h}");
    }
}

#[cfg(test)]
mod tests {
    use super::quantile;

    #[test]
    fn quantiles_take_the_nearest_rank() {
        let mut v: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        assert_eq!(quantile(&mut v, 0.5), 10.0);
        assert_eq!(quantile(&mut v, 0.95), 19.0);
        assert_eq!(quantile(&mut v, 1.0), 20.0);
        assert_eq!(quantile(&mut [], 0.5), 0.0);
    }
}
