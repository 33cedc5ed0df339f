//! Command implementations of the `metashard` binary (not part of the library, so a user of
//! the crate does not pull clap and indicatif): one file per subcommand, each with its clap
//! arguments and its `run` (`devices`, `run`, `verify`, `embed`, `plan`, `calibrate`,
//! `quantize`, `selftest`; the `bench` family is in `src/bench/`), and here the flag groups they share
//! (model, split, prompt, precision, `--dist`, `--json`) with the parsers that refuse bad
//! values naming the flag, progress bars and memory summaries; with ranks as processes, what
//! the ranks must agree on (`agree`) and rank 0's request (`share_request`); and the quiet end
//! on a closed stdout (`stdout_closed`). What they compute lives in the library (`devices`,
//! `runtime`, `verify`, `planner`).

pub mod calibrate;
pub mod devices;
pub mod dump;
pub mod embed;
pub mod plan;
pub mod quantize;
pub mod run;
pub mod selftest;
pub mod serve;
pub mod verify;

use metashard::dist::{Dist, Setting};
use metashard::models::prompt::PromptOptions;
use metashard::models::sampler::SamplerConfig;
use metashard::{Error, Result};

/// End the process as a closed stdout does to Unix tools: by SIGPIPE, quietly (status 141 in
/// a shell). For a write to stdout that failed with a broken pipe while SIGPIPE is ignored
/// (ranks as processes ignore it for MPI's sockets).
pub fn stdout_closed() -> ! {
    // SAFETY: restoring a signal's default action and raising it touch no memory of ours.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    // Not reached: the default action of SIGPIPE ends the process.
    std::process::exit(128 + libc::SIGPIPE)
}

/// `e` is a write to a closed pipe.
pub fn is_closed_pipe(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::BrokenPipe
}

/// Make `println!` to a closed stdout end the process quietly through [`stdout_closed`]
/// instead of panicking (it panics only while SIGPIPE is ignored: with ranks as processes).
/// Std's message is "failed printing to stdout: " and the I/O error.
pub fn end_quietly_on_closed_stdout() {
    let closed = std::io::Error::from_raw_os_error(libc::EPIPE).to_string();
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let p = info.payload();
        let msg = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.ends_with(&closed) {
            stdout_closed();
        }
        default(info)
    }));
}

/// A setting the ranks of a job must agree on (`dist::agree`): its name and its value.
pub fn setting(name: &str, value: impl std::fmt::Display) -> Setting {
    (name.to_string(), value.to_string())
}

/// What the ranks of a job must agree on before they open `model` (see `dist::agree`): the
/// command, the model file's identity (not its path; an unreadable file gives its error as
/// the value, which the ranks then compare), and `more` (the command's flags that change the
/// math or the shapes). Without ranks as processes, nothing.
pub fn agree(dist: Dist, command: &str, model: &str, more: Vec<Setting>) -> Result<()> {
    if dist == Dist::Local {
        return Ok(());
    }
    let identity = metashard::runtime::model_identity(model)
        .unwrap_or_else(|e| format!("(cannot be read: {e})"));
    let mut settings = vec![setting("command", command), setting("model file", identity)];
    settings.extend(more);
    metashard::dist::agree(dist, &settings)
}

/// With ranks as processes, rank 0's `request` on every rank (each rank passes its own; rank
/// 0 owns the request: the prompt and its tokens, sampling settings, step counts). A rank
/// whose own request differs says so on stderr, naming the fields (the JSON keys of `T`,
/// named after the flags; keys in `derived`, such as tokens only rank 0 computes, are not
/// compared). Without ranks as processes, `request` itself.
pub fn share_request<T>(dist: Dist, request: T, derived: &[&str]) -> Result<T>
where
    T: serde::Serialize + serde::de::DeserializeOwned,
{
    if dist == Dist::Local {
        return Ok(request);
    }
    let json = |e: serde_json::Error| Error::Json {
        what: "the request of rank 0",
        source: e,
    };
    let mine = serde_json::to_value(&request).map_err(json)?;
    let bytes = serde_json::to_vec(&mine).map_err(json)?;
    let got = metashard::dist::share_from_leader(dist, bytes, metashard::dist::REQUEST_TIMEOUT)?;
    let theirs: serde_json::Value = serde_json::from_slice(&got).map_err(json)?;
    let rank = metashard::dist::rank_and_size(dist)?.0;
    if rank != 0 {
        let differ: Vec<&str> = mine
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, v)| !derived.contains(&k.as_str()) && theirs.get(k.as_str()) != Some(v))
            .map(|(k, _)| k.as_str())
            .collect();
        if !differ.is_empty() {
            eprint_line(format!(
                "rank {rank}: note: rank 0 owns the request; this rank's own {} differ from \
                 rank 0's and are ignored",
                differ.join(", ")
            ));
        }
    }
    serde_json::from_value(theirs).map_err(json)
}

/// Print `line` and a newline to stderr in one write: stderr is unbuffered, and under mpirun
/// the ranks' output is interleaved between writes.
pub fn eprint_line(line: String) {
    let line = line + "\n";
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
}

/// The `--model` flag of `run`, `verify` and `bench model`: a GGUF decoder.
#[derive(Clone, Debug, clap::Args)]
pub struct ModelArgs {
    /// Model name (`smollm2`) or path to a `.gguf` file.
    #[arg(
        id = "model",
        long = "model",
        value_name = "MODEL",
        default_value = "smollm2"
    )]
    pub name: String,
}

/// The `--json` flag: print what the command reports as JSON instead of its text. Commands
/// whose JSON is not "the report" give the flag their own help line with
/// `#[command(mut_arg("json", ...))]` on their arguments.
#[derive(Clone, Copy, Debug, Default, clap::Args)]
pub struct JsonArgs {
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl JsonArgs {
    /// With `--json`, `value` as pretty JSON on stdout (`what` names it in a serialization
    /// error); without, `table(value)`.
    pub fn print<T: serde::Serialize>(
        &self,
        what: &'static str,
        value: &T,
        table: impl FnOnce(&T),
    ) -> Result<()> {
        if self.json {
            println!("{}", to_json(what, value)?);
        } else {
            table(value);
        }
        Ok(())
    }
}

/// `v` as pretty JSON; `what` names it in the error.
pub fn to_json<T: serde::Serialize>(what: &'static str, v: &T) -> Result<String> {
    serde_json::to_string_pretty(v).map_err(|source| Error::Json { what, source })
}

/// Precisions of products with quantized weights, a list to compare: the flags of `bench ops`
/// and `bench model` (`bench ops` words the help of `--precision` its own way).
#[derive(Clone, Debug, clap::Args)]
pub struct PrecisionsArgs {
    /// Precisions of products with quantized weights, e.g. `exact,q8` (every device
    /// set runs at each; repetitions interleave).
    #[arg(long, value_delimiter = ',', value_parser = parse_precision, default_value = "exact")]
    pub precision: Vec<metashard::cpu::Precision>,
    /// Shorthand for `--precision q8`.
    #[arg(long, conflicts_with = "precision")]
    pub q8: bool,
}

impl PrecisionsArgs {
    /// `--precision` values, or the one given by `--q8`.
    pub fn list(&self) -> Vec<metashard::cpu::Precision> {
        if self.q8 {
            vec![metashard::cpu::Precision::Q8]
        } else {
            self.precision.clone()
        }
    }
}

/// A `--precision` value: `exact` or `q8`.
pub fn parse_precision(s: &str) -> std::result::Result<metashard::cpu::Precision, String> {
    metashard::cpu::Precision::from_name(s).ok_or_else(|| format!("`{s}` is not one of exact, q8"))
}

/// How the devices are spread over processes: the `--dist` flag.
#[derive(Clone, Copy, Debug, Default, clap::Args)]
pub struct DistArgs {
    /// `local` (every device in this process) or `mpi` (one rank per process of an MPI job:
    /// `mpirun -np N metashard ... --dist mpi --devices cpu:1xT`; needs a build with
    /// `--features mpi`).
    #[arg(long, default_value = "local", value_parser = parse_dist)]
    pub dist: metashard::dist::Dist,
}

fn parse_dist(s: &str) -> std::result::Result<metashard::dist::Dist, String> {
    metashard::dist::Dist::from_name(s).ok_or_else(|| format!("`{s}` is not one of local, mpi"))
}

/// How a decoder is split over several devices: the flags `run`, `verify` and `bench model`
/// share.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct SplitArgs {
    /// Per-device shares of the split, e.g. `3,1` (in whole heads and blocks): one finite,
    /// non-negative share per device, not all zero. Default: even shares.
    #[arg(long, value_delimiter = ',', value_parser = parse_share)]
    pub tensor_split: Option<Vec<f64>>,
    /// Keep attention mirrored on every device instead of head-split.
    #[arg(long)]
    pub mirror_attention: bool,
    /// A named split strategy instead of the built-in one: megatron (the default), mlp-only,
    /// attn-only, mirrored, vocab-split, memory, sequence-parallel, auto, and for a mixture
    /// of experts expert-parallel and expert-groups (see `metashard plan`).
    #[arg(long, conflicts_with_all = ["plan", "mirror_attention"])]
    pub strategy: Option<String>,
    /// Run exactly the assignment of a plan file written by `metashard plan -o FILE`.
    #[arg(long, conflicts_with = "mirror_attention")]
    pub plan: Option<std::path::PathBuf>,
    /// How a mixture of experts splits its experts: tensor (column then row inside every
    /// expert, the default), expert (whole experts per device: expert parallelism) or both
    /// (whole experts per group of devices, column then row inside a group; with
    /// --expert-groups). Overrides the strategy's or the plan's choice.
    #[arg(long, value_parser = parse_experts)]
    pub experts: Option<metashard::models::split::ExpertSplit>,
    /// Groups of devices of --experts both (1 to the device count; uneven groups allowed).
    #[arg(long)]
    pub expert_groups: Option<usize>,
    /// tensor (every layer on every device, the default), layer (whole layers per device in
    /// proportion to --tensor-split, on the scheduler) or hybrid (groups of devices, each a
    /// meta device, with whole layers per group). `bench model` takes a list, e.g.
    /// `tensor,layer`.
    #[arg(long, value_delimiter = ',', value_parser = parse_split_mode)]
    pub split_mode: Vec<metashard::models::layer_split::SplitMode>,
    /// Device groups of --split-mode hybrid (each a meta device); default 2.
    #[arg(long, value_parser = parse_positive)]
    pub groups: Option<usize>,
}

fn parse_experts(s: &str) -> std::result::Result<metashard::models::split::ExpertSplit, String> {
    metashard::models::split::ExpertSplit::parse(s, "--experts").map_err(|e| e.to_string())
}

fn parse_split_mode(
    s: &str,
) -> std::result::Result<metashard::models::layer_split::SplitMode, String> {
    metashard::models::layer_split::SplitMode::parse(s).map_err(|e| e.to_string())
}

impl SplitArgs {
    /// The one split mode of `run` and `verify` (tensor when not given); several are an error
    /// naming the flag.
    pub fn mode(&self) -> Result<metashard::models::layer_split::SplitMode> {
        match self.split_mode.as_slice() {
            [] => Ok(Default::default()),
            [m] => Ok(*m),
            many => Err(Error::invalid_argument(
                "--split-mode",
                many.iter().map(|m| m.name()).collect::<Vec<_>>().join(","),
                "takes one mode here (a list only for `bench model`)",
            )),
        }
    }

    /// The per-layer assignment `--strategy` or `--plan` asks for on `devices`, with the
    /// `--tensor-split` shares; `None` for the built-in split. `ranks`: with ranks as
    /// processes, the job's size, which is the meta device's device count (one device per
    /// process), not the length of this process's list.
    pub fn decoder_split(
        &self,
        model: &str,
        devices: &str,
        ranks: Option<usize>,
    ) -> Result<Option<metashard::models::split::DecoderSplit>> {
        if self.strategy.is_none() && self.plan.is_none() {
            return Ok(None);
        }
        let shape = metashard::planner::ModelShape::resolve(model)?;
        let n_layer = shape.n_layer();
        let n_devices = match ranks {
            Some(n) => n,
            None => metashard::parse_devices(devices)?.len(),
        };
        let mut split = match (&self.strategy, &self.plan) {
            (_, Some(path)) => metashard::planner::load_plan(path, n_layer, n_devices)?,
            (Some(name), None) => {
                let s = metashard::planner::Strategy::parse(name)?;
                match s.split(n_layer, shape.tied) {
                    Some(split) => split,
                    None => {
                        // auto: measure these devices (quickly) and search for a default
                        // workload; `metashard plan` gives the full report and a plan file.
                        let cluster = calibrate::resolve_cluster(None, Some(devices))?;
                        let w = metashard::planner::Workload::parse("pp=128,tg=128,ctx=512")?;
                        let r = metashard::planner::auto(&shape, &cluster, &w, None)?;
                        eprintln!(
                            "auto ({} on {devices}, {w}): {}",
                            shape.name,
                            metashard::planner::strategy::describe(&r.split)
                        );
                        r.split
                    }
                }
            }
            (None, None) => return Ok(None),
        };
        if let Some(r) = &self.tensor_split {
            split.ratios = Some(r.clone());
        }
        Ok(Some(split))
    }

    /// The split flags with ranks as processes: `--tensor-split` and `--plan` take one share
    /// or device per rank of the job (`world`); `--strategy auto` is not taken yet (every rank
    /// would calibrate and search on its own, and ranks measuring different figures could
    /// choose different splits).
    pub fn check_dist(&self, devices: &str, world: usize) -> Result<()> {
        self.check_n(&format!("{devices} x {world} ranks"), world)?;
        let refuse = |flag: &str| {
            Err(Error::invalid_argument(
                flag,
                "with --dist mpi",
                "is not supported with ranks as processes yet (use the built-in split, a named \
                 strategy, or `metashard plan -o FILE` and --plan FILE)",
            ))
        };
        if self.strategy.as_deref() == Some("auto") {
            return refuse("--strategy auto");
        }
        Ok(())
    }

    /// The split flags as settings the ranks of a job must agree on (`dist::agree`): the
    /// shares, mirrored attention, the strategy, the plan file's content (not its path), the
    /// split mode and the groups. The plan is read as `load_plan` reads it (a regular file of at
    /// most [`metashard::io::MAX_JSON_BYTES`]): a FIFO named as the plan must not block here.
    pub fn settings(&self) -> Vec<Setting> {
        let plan = match &self.plan {
            None => "(none)".to_string(),
            Some(p) => match metashard::io::read_limited(p, metashard::io::MAX_JSON_BYTES) {
                Ok(b) => format!(
                    "{} B, content {:016x}",
                    b.len(),
                    metashard::runtime::identity::content_hash(&b)
                ),
                Err(e) => format!("(cannot be read: {e})"),
            },
        };
        let list = |v: &[metashard::models::layer_split::SplitMode]| {
            v.iter().map(|m| m.name()).collect::<Vec<_>>().join(",")
        };
        vec![
            setting("--tensor-split", format!("{:?}", self.tensor_split)),
            setting("--mirror-attention", self.mirror_attention),
            setting("--experts", format!("{:?}", self.experts)),
            setting("--expert-groups", format!("{:?}", self.expert_groups)),
            setting("--strategy", format!("{:?}", self.strategy)),
            setting("--plan", plan),
            setting("--split-mode", list(&self.split_mode)),
            setting("--groups", format!("{:?}", self.groups)),
        ]
    }

    /// `--experts` with its `--expert-groups` (errors name `--expert-groups`).
    pub fn expert_split(&self) -> Result<Option<metashard::models::split::ExpertSplit>> {
        metashard::models::split::ExpertSplit::with_groups(self.experts, self.expert_groups)
    }

    /// `--tensor-split` against the device list `devices`: one share per device, not all 0.
    pub fn check(&self, devices: &str) -> Result<()> {
        if self.tensor_split.is_none() {
            return Ok(());
        }
        self.check_n(devices, metashard::parse_devices(devices)?.len())
    }

    /// `--tensor-split` against `n` devices (`devices` names them in errors).
    pub fn check_n(&self, devices: &str, n: usize) -> Result<()> {
        let Some(shares) = &self.tensor_split else {
            return Ok(());
        };
        let given = shares
            .iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",");
        if shares.len() != n {
            return Err(Error::invalid_argument(
                "--tensor-split",
                given,
                format!(
                    "{} share{} for the {n} device{} of `{devices}`: give one per device",
                    shares.len(),
                    if shares.len() == 1 { "" } else { "s" },
                    if n == 1 { "" } else { "s" },
                ),
            ));
        }
        if shares.iter().all(|&x| x == 0.0) || !shares.iter().sum::<f64>().is_finite() {
            return Err(Error::invalid_argument(
                "--tensor-split",
                given,
                "the shares must not all be 0, and their sum must be finite",
            ));
        }
        Ok(())
    }
}

/// The prompt and how it is tokenized: the flags `run` and `verify` share.
#[derive(Clone, Debug, clap::Args)]
pub struct PromptArgs {
    /// The prompt: the user's message in the model's chat template, or the whole text with
    /// --raw.
    #[arg(long, short = 'p', default_value = "What is the capital of France?")]
    pub prompt: String,
    /// Feed the prompt as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Read control tokens such as `<|im_start|>` written in the prompt (and the system
    /// message) as control tokens. Default: off, the user's text is plain text and cannot
    /// open or close chat turns; the chat template's own markup gives control tokens either
    /// way. Use with --raw to write a chat template by hand.
    #[arg(long)]
    pub special: bool,
    /// The chat format: `llama3`, `gemma`, `phi3`, `chatml` (metashard's own, for an
    /// instruction model whose file has no `tokenizer.chat_template` or a wrong one; the
    /// model's vocabulary must have the format's turn tokens), or a file holding a Jinja
    /// template. Default: the file's template; none (a base model's file): the raw prompt.
    #[arg(long, value_name = "NAME|FILE")]
    pub chat_template: Option<String>,
}

impl PromptArgs {
    pub fn options<'a>(&self, system: Option<&'a str>) -> PromptOptions<'a> {
        PromptOptions {
            system,
            raw: self.raw,
            special: self.special,
        }
    }
}

/// One `--tensor-split` share: finite and >= 0.
fn parse_share(s: &str) -> std::result::Result<f64, String> {
    let x: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number"))?;
    if x.is_finite() && x >= 0.0 {
        Ok(x)
    } else {
        Err(format!("share `{s}` must be finite and >= 0"))
    }
}

/// An integer of at least 1.
pub fn parse_positive(s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(e) => Err(format!("`{s}` is not a count: {e}")),
    }
}

/// The most repetitions a `--reps` flag takes: far more than a median needs, and few enough
/// that counting them (warm-up rounds added) cannot overflow.
pub const MAX_REPS: usize = 100_000;

/// A `--reps` count: 1..=[`MAX_REPS`].
pub fn parse_reps(s: &str) -> std::result::Result<usize, String> {
    match parse_positive(s)? {
        n if n <= MAX_REPS => Ok(n),
        n => Err(format!("{n} repetitions: at most {MAX_REPS}")),
    }
}

/// The most clients `bench serve` runs at once: each is a thread of this process.
pub const MAX_CONCURRENCY: usize = 1024;

/// A `--concurrency` entry: 1..=[`MAX_CONCURRENCY`] (more would only exhaust the threads a
/// process may start, failing midway instead of here).
pub fn parse_concurrency(s: &str) -> std::result::Result<usize, String> {
    match parse_positive(s)? {
        n if n <= MAX_CONCURRENCY => Ok(n),
        n => Err(format!(
            "{n} clients: at most {MAX_CONCURRENCY} (each is a thread of this process)"
        )),
    }
}

/// A sampling setting checked by the library's [`SamplerConfig::validate`].
fn sampling<T>(s: &str, set: impl FnOnce(&mut SamplerConfig, T)) -> std::result::Result<T, String>
where
    T: Copy + std::str::FromStr,
    T::Err: std::fmt::Display,
{
    let v: T = s
        .trim()
        .parse()
        .map_err(|e| format!("`{s}` is not a number: {e}"))?;
    let mut cfg = SamplerConfig::default();
    set(&mut cfg, v);
    match cfg.validate() {
        Ok(()) => Ok(v),
        Err(Error::InvalidArgument { reason, .. }) => Err(reason),
        Err(e) => Err(e.to_string()),
    }
}

pub fn parse_temp(s: &str) -> std::result::Result<f32, String> {
    sampling(s, |c, v| c.temperature = v)
}

pub fn parse_top_k(s: &str) -> std::result::Result<usize, String> {
    sampling(s, |c, v| c.top_k = v)
}

pub fn parse_top_p(s: &str) -> std::result::Result<f32, String> {
    sampling(s, |c, v| c.top_p = v)
}

pub fn parse_presence_penalty(s: &str) -> std::result::Result<f32, String> {
    sampling(s, |c, v| c.presence_penalty = v)
}

pub fn parse_frequency_penalty(s: &str) -> std::result::Result<f32, String> {
    sampling(s, |c, v| c.frequency_penalty = v)
}

/// A library error about a sampling setting, renamed after the flag that gave it.
pub fn sampling_flag(e: Error) -> Error {
    match e {
        Error::InvalidArgument {
            name,
            value,
            reason,
        } => {
            let flag = match name.as_str() {
                "temperature" => "--temp",
                "top_k" => "--top-k",
                "top_p" => "--top-p",
                "presence_penalty" => "--presence-penalty",
                "frequency_penalty" => "--frequency-penalty",
                _ => name.as_str(),
            };
            Error::InvalidArgument {
                name: flag.to_string(),
                value,
                reason,
            }
        }
        e => e,
    }
}

/// A progress bar on stderr for `total` bytes (hidden when stderr is not a terminal).
pub fn bytes_bar(total: usize, msg: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(total as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:<22} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec})",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

/// A per-device memory table.
pub fn memory_table(names: &[String], rows: &[(&str, Vec<usize>)]) -> String {
    let mut s = format!("{:<10}", "device");
    for (label, _) in rows {
        s += &format!(" {label:>12}");
    }
    s += &format!(" {:>12}\n", "total MiB");
    for (d, name) in names.iter().enumerate() {
        s += &format!("{name:<10}");
        let mut total = 0;
        for (_, v) in rows {
            let x = v.get(d).copied().unwrap_or(0);
            total += x;
            s += &format!(" {:>12.2}", x as f64 / 1048576.0);
        }
        s += &format!(" {:>12.2}\n", total as f64 / 1048576.0);
    }
    s
}
