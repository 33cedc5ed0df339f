//! The `metashard embed` command: sentence embeddings with a BERT encoder (all-MiniLM-L6-v2)
//! on any device list, printed as JSON (one object per sentence) or as a short summary with a
//! table of pairwise cosine similarities. `--strategy` picks a named split for several devices.
//! A sentence longer than the model takes (256 tokens) is cut to its first 256, as
//! sentence-transformers does, and said so: a line on stderr with its full length, and
//! `"truncated": true` in its JSON object. With ranks as processes, rank 0 owns the request
//! (the sentences' token ids, the batch size, the repetitions) and the ranks agree on the rest
//! (the model's files, the strategy) before loading.

use metashard::dist::Dist;
use metashard::models::bert::{BertConfig, BertEncoder, cosine};
use metashard::models::paths::{ModelPath, resolve};
use metashard::models::split::DecoderSplit;
use metashard::planner::Strategy;
use metashard::runtime::open_encoder;
use metashard::tokenizer::{BatchEncoding, Tokenizer, WordPieceTokenizer};
use metashard::{Error, Result, parse_devices};
use std::time::Instant;

/// What `metashard embed` was asked (its command-line arguments).
#[derive(Clone, Debug, clap::Args)]
#[command(mut_arg("json", |a| a.help(
    "Print JSON: an array with one object per sentence (text, tokens, truncated, embedding)"
)))]
pub struct EmbedArgs {
    /// `minilm` or a folder with model.safetensors, config.json and tokenizer.json.
    #[arg(long, default_value = "minilm")]
    pub model: String,
    /// A device list: `cpu`, `cpu:N`, `cpu:NxT` (several devices: tensor parallelism).
    #[arg(long, default_value = "cpu")]
    pub devices: String,
    /// A named split for several devices instead of the built-in one: megatron (the built-in
    /// split's assignment), mlp-only, attn-only, mirrored, vocab-split (the word embedding by
    /// vocabulary), memory (everything split); `auto` is for decoders only.
    #[arg(long)]
    pub strategy: Option<String>,
    /// With `--dist mpi`, `--devices` is this process's one device (one rank per process of
    /// the MPI job); rank 0 prints.
    #[command(flatten)]
    pub dist: super::DistArgs,
    #[command(flatten)]
    pub out: super::JsonArgs,
    /// Sentences per batch (each batch is padded to its longest sentence), as
    /// sentence-transformers' default; at least 1.
    #[arg(long, default_value_t = 32, value_parser = super::parse_positive)]
    pub batch_size: usize,
    /// Run the batches this many times (at least 1); the median time goes to stderr.
    #[arg(long, default_value_t = 1, value_parser = super::parse_positive)]
    pub repeat: usize,
    /// The sentences, embedded in padded batches. One longer than the model takes (256
    /// tokens with [CLS] and [SEP]) is cut to its first 256, as sentence-transformers does;
    /// each one cut is named on stderr with its full length (and `"truncated": true` with
    /// --json).
    #[arg(required = true)]
    pub sentences: Vec<String>,
}

/// One sentence's result, as printed with `--json`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct EmbeddingRecord {
    pub text: String,
    /// Tokens including [CLS] and [SEP], after truncation.
    pub tokens: usize,
    /// Whether the sentence was longer than the model takes, and cut.
    #[serde(default)]
    pub truncated: bool,
    pub embedding: Vec<f32>,
}

/// A padded batch of token ids as rank 0 shares it: `BatchEncoding`'s fields, for serde.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(remote = "BatchEncoding")]
struct BatchDef {
    batch: usize,
    seq_len: usize,
    ids: Vec<u32>,
    attention_mask: Vec<u32>,
    type_ids: Vec<u32>,
    lengths: Vec<usize>,
}

/// One batch of [`EmbedRequest`].
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct SharedBatch(#[serde(with = "BatchDef")] BatchEncoding);

/// What `embed` takes from rank 0 with ranks as processes (see `share_request`): the
/// sentences, their token ids in batches and which were cut (rank 0 alone computes them),
/// and the repetitions. JSON keys are the flags.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct EmbedRequest {
    #[serde(rename = "the sentences")]
    sentences: Vec<String>,
    #[serde(rename = "--batch-size")]
    batch_size: usize,
    #[serde(rename = "--repeat")]
    repeat: usize,
    batches: Vec<SharedBatch>,
    /// Per sentence: its full length when it was cut.
    cut: Vec<Option<usize>>,
}

/// Run the command; the text it prints goes to `out`, progress and timings to stderr.
pub fn run(opts: &EmbedArgs, out: &mut dyn std::io::Write) -> Result<()> {
    if opts.sentences.is_empty() {
        return Err(Error::msg("embed: give at least one sentence"));
    }
    let dir = match resolve(&opts.model)? {
        ModelPath::Safetensors(d) => d,
        ModelPath::Gguf(p) => {
            return Err(Error::Model {
                model: opts.model.clone(),
                reason: format!(
                    "{} is a GGUF decoder; `embed` needs a BERT folder with model.safetensors",
                    p.display()
                ),
            });
        }
    };
    let local = parse_devices(&opts.devices)?;
    let dist = opts.dist.dist;
    if dist == Dist::Mpi {
        metashard::dist::one_device_per_process(&opts.devices, local.len())?;
    }
    let strategy = super::setting("--strategy", format!("{:?}", opts.strategy));
    super::agree(dist, "embed", &opts.model, vec![strategy])?;
    let devices = metashard::dist::distributed_devices(&opts.devices, local, dist)?;
    let leader = metashard::dist::rank_and_size(dist)?.0 == 0;
    let split = match &opts.strategy {
        Some(name) => {
            let cfg = BertConfig::from_model_dir(&dir)?;
            Some(encoder_split(name, cfg.n_layer)?)
        }
        None => None,
    };
    let t0 = Instant::now();
    let enc = open_encoder(&dir, devices, split)?;
    let load_s = t0.elapsed().as_secs_f64();
    let mut request = EmbedRequest {
        sentences: opts.sentences.clone(),
        batch_size: opts.batch_size,
        repeat: opts.repeat,
        batches: Vec::new(),
        cut: Vec::new(),
    };
    if leader {
        let texts: Vec<&str> = opts.sentences.iter().map(String::as_str).collect();
        let batches = texts
            .chunks(opts.batch_size.max(1))
            .map(|c| enc.encode(c))
            .collect::<Result<Vec<_>>>()?;
        let lengths: Vec<usize> = batches.iter().flat_map(|b| b.lengths.clone()).collect();
        request.cut = cut_lengths(&enc, &texts, &lengths)?;
        request.batches = batches.into_iter().map(SharedBatch).collect();
    }
    // Rank 0 owns the request: every rank embeds its token ids.
    let r = super::share_request(dist, request, &["batches", "cut"])?;
    let batches: Vec<BatchEncoding> = r.batches.into_iter().map(|b| b.0).collect();
    let mut times = Vec::new();
    let mut vectors = Vec::new();
    for _ in 0..r.repeat.max(1) {
        let t = Instant::now();
        vectors.clear();
        for b in &batches {
            vectors.extend(enc.embed_batch(b)?);
        }
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let shapes: Vec<String> = batches
        .iter()
        .map(|b| format!("{}x{}", b.batch, b.seq_len))
        .collect();
    if !leader {
        // Every rank computed the same embeddings; rank 0 prints them.
        return Ok(());
    }
    eprintln!(
        "embed: {} on {}{}: load {:.2} s, batches (sentences x tokens) {}: median {:.1} ms \
         over {} run(s)",
        dir.display(),
        enc.device().name(),
        opts.strategy
            .as_ref()
            .map_or(String::new(), |s| format!(" (strategy {s})")),
        load_s,
        shapes.join(" "),
        median * 1e3,
        times.len()
    );
    let lengths = batches.iter().flat_map(|b| b.lengths.iter().copied());
    let records: Vec<EmbeddingRecord> = r
        .sentences
        .iter()
        .zip(lengths)
        .zip(vectors)
        .zip(&r.cut)
        .map(|(((t, n), v), cut)| EmbeddingRecord {
            text: t.clone(),
            tokens: n,
            truncated: cut.is_some(),
            embedding: v,
        })
        .collect();
    for (i, (rec, cut)) in records.iter().zip(&r.cut).enumerate() {
        if let Some(full) = cut {
            super::eprint_line(format!(
                "embed: sentence [{i}] {:?} has {full} tokens, more than the model's {}: its \
                 embedding covers its first {} (cut as sentence-transformers does)",
                short(&rec.text, 40),
                rec.tokens,
                rec.tokens
            ));
        }
    }
    let w = |e: std::io::Error| {
        if super::is_closed_pipe(&e) {
            super::stdout_closed();
        }
        Error::msg(format!("embed: writing the output: {e}"))
    };
    if opts.out.json {
        let s = serde_json::to_string(&records).map_err(|e| Error::msg(e.to_string()))?;
        writeln!(out, "{s}").map_err(w)?;
    } else {
        write_summary(&records, out).map_err(w)?;
    }
    Ok(())
}

/// Per sentence, its full length in tokens ([CLS] and [SEP] included) when it is longer than
/// `enc` takes, and was cut to `lengths[i]` tokens; `None` for the others. Only sentences
/// that reached the maximum are tokenized again, without the limit.
fn cut_lengths(enc: &BertEncoder, texts: &[&str], lengths: &[usize]) -> Result<Vec<Option<usize>>> {
    let max = enc.tokenizer().max_len().unwrap_or(enc.config().n_pos);
    let mut out = vec![None; texts.len()];
    if lengths.iter().all(|&n| n < max) {
        return Ok(out);
    }
    let mut full = WordPieceTokenizer::from_model_dir(enc.dir())?;
    full.set_max_len(None);
    for ((t, &n), o) in texts.iter().zip(lengths).zip(&mut out) {
        if n >= max {
            let all = full.encode(t, true)?.len();
            *o = (all > n).then_some(all);
        }
    }
    Ok(out)
}

/// The strategies that apply to an encoder (every named one but `auto` and
/// `sequence-parallel`, whose hints name a decoder's residual adds).
pub const ENCODER_STRATEGIES: [Strategy; 6] = [
    Strategy::Megatron,
    Strategy::MlpOnly,
    Strategy::AttnOnly,
    Strategy::Mirrored,
    Strategy::VocabSplit,
    Strategy::Memory,
];

/// The assignment `--strategy NAME` asks for on an encoder of `n_layer` layers (the output
/// projection's entry is unused by an encoder); `auto` and unknown names are errors naming
/// `--strategy`.
pub fn encoder_split(name: &str, n_layer: usize) -> Result<DecoderSplit> {
    let names: Vec<&str> = ENCODER_STRATEGIES.iter().map(|s| s.name()).collect();
    let names = names.join(", ");
    let s = Strategy::parse(name)
        .map_err(|_| Error::invalid_argument("--strategy", name, format!("one of {names}")))?;
    if s == Strategy::SequenceParallel {
        return Err(Error::invalid_argument(
            "--strategy",
            name,
            format!(
                "sequence parallelism is built for decoders; for an encoder name one of {names}"
            ),
        ));
    }
    // An encoder has no output projection: nothing is tied.
    s.split(n_layer, false).ok_or_else(|| {
        Error::invalid_argument(
            "--strategy",
            name,
            format!(
                "the planner's search covers decoders only; for an encoder name one of {names}"
            ),
        )
    })
}

/// A readable summary: per sentence its token count, norm and first values; with several
/// sentences, the matrix of pairwise cosine similarities.
pub fn write_summary(
    records: &[EmbeddingRecord],
    out: &mut dyn std::io::Write,
) -> std::io::Result<()> {
    for (i, r) in records.iter().enumerate() {
        let norm = r.embedding.iter().map(|x| x * x).sum::<f32>().sqrt();
        let head: Vec<String> = r
            .embedding
            .iter()
            .take(6)
            .map(|x| format!("{x:+.4}"))
            .collect();
        writeln!(out, "[{i}] {:?}", short(&r.text, 60))?;
        writeln!(
            out,
            "    {} tokens{}, dim {}, norm {:.6}, [{}, ...]",
            r.tokens,
            if r.truncated { " (truncated)" } else { "" },
            r.embedding.len(),
            norm,
            head.join(", ")
        )?;
    }
    if records.len() > 1 {
        writeln!(out, "\ncosine similarity")?;
        write!(out, "{:>5}", "")?;
        for j in 0..records.len() {
            write!(out, "{:>8}", format!("[{j}]"))?;
        }
        writeln!(out)?;
        for (i, a) in records.iter().enumerate() {
            write!(out, "{:>5}", format!("[{i}]"))?;
            for b in records {
                write!(out, "{:>8.4}", cosine(&a.embedding, &b.embedding))?;
            }
            writeln!(out)?;
        }
    }
    Ok(())
}

fn short(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        format!("{}...", s.chars().take(max).collect::<String>())
    }
}
