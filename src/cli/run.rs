//! `metashard run`: load a GGUF decoder on a device set (the built-in split callback, or
//! `--tensor-split` ratios), show a memory summary, generate text from a prompt (through the
//! model's chat template unless `--raw`; the user's text stays text unless `--special`), and
//! report prompt and generation tokens/s and why generation stopped; `--dump` prints
//! statistics of matching nodes through the scheduler's eval callback (`dump.rs`). Bad sampling flags and
//! `--ctx` values are errors naming the flag; `-n` is bounded by the context. With ranks as
//! processes the ranks agree on the model, split, precision and context before loading
//! (`cli::agree`), and every rank takes rank 0's prompt tokens and sampling (`RunRequest`).

use super::{JsonArgs, ModelArgs, PromptArgs, SplitArgs, bytes_bar, memory_table, setting};
use metashard::cpu::Precision;
use metashard::devices::DeviceSet;
use metashard::dist::{Dist, Setting};
use metashard::models::loader::DecoderModel;
use metashard::models::prompt::prompt_tokens;
use metashard::models::sampler::{Sampler, SamplerConfig, StopReason, generate};
use metashard::models::session::Session;
use metashard::runtime::{OpenOptions, open_decoder};
use metashard::tokenizer::Tokenizer;
use metashard::{Error, Result};
use std::io::Write;

#[derive(Clone, Debug, clap::Args)]
#[command(mut_arg("json", |a| a.help(
    "Print one JSON object (text, tokens, timings, memory, `stop_reason`) instead of streaming \
     text"
)))]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Devices: `cpu`, `cpu:N`, `cpu:NxT`.
    #[arg(long, default_value = "cpu")]
    pub devices: String,
    #[command(flatten)]
    pub prompt: PromptArgs,
    /// Tokens to generate at most; generation also stops at the end-of-sequence token and
    /// when the context is full (and says so).
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    pub n_predict: usize,
    /// System message for the chat template (the template's default when absent).
    #[arg(long)]
    pub system: Option<String>,
    /// Sampling temperature, finite and >= 0; 0 is greedy.
    #[arg(long, default_value_t = 0.0, value_parser = super::parse_temp)]
    pub temp: f32,
    /// Sample among this many most likely tokens (at least 1).
    #[arg(long, default_value_t = 40, value_parser = super::parse_top_k)]
    pub top_k: usize,
    /// Then among the fewest tokens whose probabilities add up to this, in (0, 1].
    #[arg(long, default_value_t = 0.95, value_parser = super::parse_top_p)]
    pub top_p: f32,
    /// Seed of the sampler's random numbers.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Subtracted from the logit of every token already generated, in [-2, 2] (the OpenAI
    /// API's `presence_penalty`).
    #[arg(long, default_value_t = 0.0, value_parser = super::parse_presence_penalty)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated, in [-2, 2] (the
    /// OpenAI API's `frequency_penalty`).
    #[arg(long, default_value_t = 0.0, value_parser = super::parse_frequency_penalty)]
    pub frequency_penalty: f32,
    /// Quantized weights times 8-bit activations (ggml's CPU behaviour; faster decoding on
    /// some CPUs, less accurate; on AVX2 without VNNI products of more than 4-16 rows, e.g.
    /// prompts, stay in f32, which is faster there). Default: f32 activations.
    #[arg(long)]
    pub q8: bool,
    #[command(flatten)]
    pub split: SplitArgs,
    #[command(flatten)]
    pub dist: super::DistArgs,
    /// Attention through mul_mat + soft_max instead of the fused kernel.
    #[arg(long)]
    pub no_flash: bool,
    /// Context size in tokens, at most the model's trained context (default: prompt + n,
    /// within that).
    #[arg(long, value_parser = super::parse_positive)]
    pub ctx: Option<usize>,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Micro-batches a prompt step is cut into for a layer or hybrid split (`--split-mode
    /// layer|hybrid`), pipelined through its stages: the session's `ubatch` becomes the
    /// prompt's chunk (at most 512 tokens, the planner's) over N, as `plan --micro-batches N`
    /// prices it. Default: the session's chunks of 128 tokens.
    #[arg(long, value_parser = super::parse_positive)]
    pub micro_batches: Option<usize>,
    #[command(flatten)]
    pub out: JsonArgs,
    /// Print min, max, mean and NaN count of every node whose name matches NODE_PATTERN (a
    /// glob with `*`; without `*`, names containing it) as it is computed, to stderr (the
    /// scheduler's eval callback); an I32 node's ids too, such as a mixture of experts'
    /// choices (`--dump router`: `l{i}.moe.chosen_by_router`, each token's experts).
    #[arg(long, value_name = "NODE_PATTERN")]
    pub dump: Option<String>,
}

/// Whether `name` matches `pattern`: a glob with `*` (any run of characters), or without `*`
/// a substring.
pub fn name_matches(pattern: &str, name: &str) -> bool {
    if !pattern.contains('*') {
        return name.contains(pattern);
    }
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p) {
            Some(i) => rest = &rest[i + p.len()..],
            None => return false,
        }
    }
    true
}

/// Open the devices and load the model with the split the flags ask for (the built-in one,
/// ratios, a strategy or a plan file), with a progress bar on stderr unless `quiet`.
pub fn load(
    model: &str,
    devices: &str,
    precision: Precision,
    split: &SplitArgs,
    quiet: bool,
) -> Result<(DeviceSet, DecoderModel)> {
    load_dist(model, devices, Dist::Local, precision, split, quiet)
}

/// As [`load`], with the devices spread over processes as `dist` says. With `Dist::Mpi`,
/// only rank 0 shows progress, and every rank reports on stderr the weight bytes it holds and
/// the bytes it read from the memory-mapped model file.
pub fn load_dist(
    model: &str,
    devices: &str,
    dist: Dist,
    precision: Precision,
    split: &SplitArgs,
    quiet: bool,
) -> Result<(DeviceSet, DecoderModel)> {
    // (A process that started MPI is a rank, and opens a local set on purpose: `verify`'s
    // single device.)
    if dist == Dist::Local
        && metashard::dist::launched_by_mpirun()
        && metashard::dist::current_rank().is_none()
    {
        eprintln!(
            "warning: started by mpirun without --dist mpi: this process runs the whole model on \
             its own devices (add --dist mpi for one rank per process)"
        );
    }
    let mut ranks = None;
    if dist == Dist::Mpi {
        let n = metashard::parse_devices(devices)?.len();
        metashard::dist::one_device_per_process(devices, n)?;
        let world = metashard::dist::rank_and_size(dist)?.1;
        split.check_dist(devices, world)?;
        ranks = Some(world);
    }
    let opts = OpenOptions {
        precision,
        ratios: split.tensor_split.clone(),
        mirror_attention: split.mirror_attention,
        experts: split.expert_split()?,
        split: split.decoder_split(model, devices, ranks)?,
        split_mode: split.mode()?,
        groups: split.groups,
        dist,
        ..OpenOptions::default()
    };
    let (rank, _) = metashard::dist::rank_and_size(dist)?;
    let bar = bytes_bar(0, "loading weights");
    if quiet || rank != 0 {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let r = open_decoder(model, devices, &opts, &|done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    if let (Ok((set, m)), Some(r)) = (&r, set_rank(&r)) {
        let held = set.bytes_per_device(&[&m.weight_buffer]);
        super::eprint_line(format!(
            "rank {r}: holds {:.1} MiB of weights, read {} of the model file's {:.1} MiB",
            held.get(r).copied().unwrap_or(0) as f64 / 1048576.0,
            m.file_bytes_read.map_or("?".to_string(), |b| format!(
                "{:.1} MiB",
                b as f64 / 1048576.0
            )),
            m.weight_bytes as f64 / 1048576.0
        ));
    }
    r
}

fn set_rank(r: &Result<(DeviceSet, DecoderModel)>) -> Option<usize> {
    r.as_ref().ok().and_then(|(set, _)| set.rank)
}

/// What `run` takes from rank 0 with ranks as processes (see `share_request`): the prompt
/// (and its tokens, which rank 0 alone computes), sampling and stopping. JSON keys are the
/// flags, so a rank given another value can name them.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct RunRequest {
    #[serde(rename = "--prompt")]
    prompt: String,
    #[serde(rename = "--system")]
    system: Option<String>,
    #[serde(rename = "--raw")]
    raw: bool,
    #[serde(rename = "--special")]
    special: bool,
    #[serde(rename = "-n")]
    n_predict: usize,
    #[serde(rename = "--temp")]
    temp: f32,
    #[serde(rename = "--top-k")]
    top_k: usize,
    #[serde(rename = "--top-p")]
    top_p: f32,
    #[serde(rename = "--seed")]
    seed: u64,
    #[serde(rename = "--presence-penalty")]
    presence_penalty: f32,
    #[serde(rename = "--frequency-penalty")]
    frequency_penalty: f32,
    #[serde(rename = "--ignore-eos")]
    ignore_eos: bool,
    tokens: Vec<u32>,
}

impl RunRequest {
    fn sampler(&self) -> Result<Sampler> {
        Sampler::new(SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
        })
        .map_err(super::sampling_flag)
    }
}

/// What the ranks of a job running a decoder must agree on besides the command and the model
/// (see `cli::agree`): the precision (`--q8`, or the list `bench model` takes), the split
/// flags, and `more`.
pub fn decoder_settings(
    precision: Setting,
    split: &SplitArgs,
    more: impl IntoIterator<Item = Setting>,
) -> Vec<Setting> {
    let mut s = vec![precision];
    s.extend(split.settings());
    s.extend(more);
    s
}

/// `--micro-batches N`: in 1..=`MAX_MICRO_BATCHES`, and above 1 only for a split that
/// pipelines (layer or hybrid); else an error naming the flag.
pub fn check_micro_batches(
    n: Option<usize>,
    mode: metashard::models::layer_split::SplitMode,
) -> Result<()> {
    use metashard::models::layer_split::SplitMode;
    use metashard::planner::layer::MAX_MICRO_BATCHES;
    match n {
        Some(n) if n == 0 || n > MAX_MICRO_BATCHES => Err(metashard::Error::invalid_argument(
            "--micro-batches",
            n,
            format!("must be in 1..={MAX_MICRO_BATCHES}"),
        )),
        Some(n) if n > 1 && mode == SplitMode::Tensor => Err(metashard::Error::invalid_argument(
            "--micro-batches",
            n,
            "micro-batches are pipelined through the stages of `--split-mode layer` or \
             `hybrid`; a tensor split runs each step whole",
        )),
        _ => Ok(()),
    }
}

/// The session's `ubatch` for a prompt of `prompt` tokens cut into `n` micro-batches: the
/// planner's prompt step (at most `Workload::CHUNK` tokens) over `n`.
pub fn prompt_ubatch(prompt: usize, n: usize) -> usize {
    use metashard::planner::evaluate::Workload;
    prompt.clamp(1, Workload::CHUNK).div_ceil(n.max(1))
}

/// The context size for `run`: `--ctx` checked against the model and the prompt, or the
/// prompt plus `-n` (and the token after), within the model's context.
fn context_size(ctx: Option<usize>, r: &RunRequest, m: &DecoderModel) -> Result<usize> {
    let (max, prompt_len) = (m.context_length, r.tokens.len());
    if prompt_len == 0 {
        return Err(Error::invalid_argument(
            "--prompt",
            format!("{:?}", r.prompt),
            "gives no tokens",
        ));
    }
    if prompt_len >= max {
        return Err(Error::invalid_argument(
            "--prompt",
            format!("of {prompt_len} tokens"),
            format!("does not fit the model's context of {max} tokens with a token to generate"),
        ));
    }
    match ctx {
        Some(c) if c > max => Err(Error::invalid_argument(
            "--ctx",
            c,
            format!("more than the model's trained context of {max} tokens"),
        )),
        Some(c) if c <= prompt_len => Err(Error::invalid_argument(
            "--ctx",
            c,
            format!(
                "the prompt has {prompt_len} tokens: the context must hold it and a generated \
                 token (at least {})",
                prompt_len + 1
            ),
        )),
        Some(c) => Ok(c),
        None => Ok(prompt_len
            .saturating_add(r.n_predict)
            .saturating_add(1)
            .min(max)),
    }
}

/// Write `s` to stdout now (streamed text). A closed stdout ends the program quietly (see
/// `stdout_closed`); other errors are ignored, as a terminal that cannot show the text does
/// not stop generation.
fn stream(stdout: &mut std::io::Stdout, s: &str) {
    if let Err(e) = write!(stdout, "{s}").and_then(|()| stdout.flush())
        && super::is_closed_pipe(&e)
    {
        super::stdout_closed();
    }
}

pub fn run(a: &RunArgs) -> Result<()> {
    let mut request = RunRequest {
        prompt: a.prompt.prompt.clone(),
        system: a.system.clone(),
        raw: a.prompt.raw,
        special: a.prompt.special,
        n_predict: a.n_predict,
        temp: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
        presence_penalty: a.presence_penalty,
        frequency_penalty: a.frequency_penalty,
        ignore_eos: a.ignore_eos,
        tokens: Vec::new(),
    };
    // This rank's flags are checked, even where rank 0's are used.
    request.sampler()?;
    let dist = a.dist.dist;
    if dist == Dist::Local {
        a.split.check(&a.devices)?;
    }
    check_micro_batches(a.micro_batches, a.split.mode()?)?;
    let precision = Precision::from_q8_flag(a.q8);
    let more = [
        setting("--no-flash", a.no_flash),
        setting("--ctx", format!("{:?}", a.ctx)),
        setting("--micro-batches", format!("{:?}", a.micro_batches)),
    ];
    super::agree(
        dist,
        "run",
        &a.model.name,
        decoder_settings(setting("--q8", a.q8), &a.split, more),
    )?;
    let (set, mut m) = load_dist(
        &a.model.name,
        &a.devices,
        dist,
        precision,
        &a.split,
        a.out.json,
    )?;
    // With ranks as processes every rank computes the same tokens; rank 0 prints.
    let leader = set.is_leader();
    m.cfg.fused_attn = !a.no_flash;
    if leader {
        if let Some(c) = &a.prompt.chat_template {
            m.choose_chat(c)?;
        }
        let opts = a.prompt.options(a.system.as_deref());
        request.tokens = prompt_tokens(&m, &a.prompt.prompt, &opts)?;
    }
    // Rank 0 owns the request: every rank generates from its prompt and settings.
    let r = super::share_request(dist, request, &["tokens"])?;
    let mut sampler = r.sampler()?;
    let ctx = context_size(a.ctx, &r, &m)?;
    let backend: std::sync::Arc<dyn metashard::Backend> = match &a.dump {
        None => set.backend.clone(),
        Some(pattern) => {
            // The scheduler's eval callback: the layer split's own scheduler, or one over the
            // device set's backend.
            let sched = match &set.sched {
                Some((s, _)) => s.clone(),
                None => metashard::sched::Sched::new(vec![set.backend.clone()])?,
            };
            sched.set_eval_callback(Some(Box::new(super::dump::Dump::new(pattern.clone()))));
            sched
        }
    };
    let mut session = Session::new(&m, backend, set.buffer_type.as_ref(), ctx)?;
    if let Some(n) = a.micro_batches {
        session.ubatch = prompt_ubatch(r.tokens.len(), n);
    }
    let eos = m.tokenizer.eos();
    let mut stdout = std::io::stdout();
    let mut pending = Vec::new();
    let (tokens, stats) = generate(
        &mut session,
        &r.tokens,
        r.n_predict,
        &mut sampler,
        r.ignore_eos,
        |t| {
            if leader && !a.out.json && Some(t) != eos {
                // Stream whole UTF-8 characters only.
                let _ = m.tokenizer.token_bytes(t, &mut pending);
                if let Ok(s) = std::str::from_utf8(&pending) {
                    stream(&mut stdout, s);
                    pending.clear();
                }
            }
            true
        },
    )?;
    if leader {
        report(a, &set, &m, &session, &tokens, &stats, r.n_predict)?;
    }
    Ok(())
}

/// Rank 0's report of a run: one JSON object with `--json`; else a newline after the streamed
/// text, and on stderr why generation stopped early, the memory table and the speeds.
fn report(
    a: &RunArgs,
    set: &DeviceSet,
    m: &DecoderModel,
    session: &Session,
    tokens: &[u32],
    stats: &metashard::models::sampler::GenStats,
    n_predict: usize,
) -> Result<()> {
    let eos = m.tokenizer.eos();
    let text: Vec<u32> = tokens.iter().copied().filter(|&t| Some(t) != eos).collect();
    let text = String::from_utf8_lossy(&m.tokenizer.decode_bytes(&text)?).to_string();
    let weights = set.bytes_per_device(&[&m.weight_buffer]);
    let cache = set.bytes_per_device(&[&session.cache_buffer()]);
    let compute = set.backend.compute_buffer_bytes();
    if a.out.json {
        let v = serde_json::json!({
            "model": m.name,
            "devices": set.names(),
            "prompt_tokens": stats.prompt_tokens,
            "generated_tokens": stats.generated,
            "text": text,
            "tokens": tokens,
            "prompt_tokens_per_s": stats.prompt_tps(),
            "gen_tokens_per_s": stats.gen_tps(),
            "stop_reason": stats.stop.name(),
            "context_size": session.capacity(),
            "ubatch": session.ubatch,
            "memory": { "weights": weights, "kv_cache": cache, "compute": compute },
        });
        println!("{v}");
        return Ok(());
    }
    println!();
    eprintln!();
    if stats.stop == StopReason::Context {
        eprintln!(
            "generation stopped: the context of {} tokens is full ({} of -n {} tokens \
             generated; --ctx raises it up to the model's {})",
            session.capacity(),
            stats.generated,
            n_predict,
            m.context_length
        );
    }
    eprint!(
        "{}",
        memory_table(
            &set.names(),
            &[
                ("weights", weights),
                ("kv cache", cache),
                ("compute", compute)
            ]
        )
    );
    eprintln!(
        "prompt: {} tokens, {:.1} tokens/s | generation: {} tokens, {:.1} tokens/s ({})",
        stats.prompt_tokens,
        stats.prompt_tps(),
        stats.generated,
        stats.gen_tps(),
        set.spec
    );
    Ok(())
}
