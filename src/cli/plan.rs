//! `metashard plan`: which split is fastest for a model on a cluster, whether it fits, and what
//! it costs in communication, predicted without running it. A table by default, the plan file
//! with `--json` or `-o`, DOT or SVG of one layer's per-device programs with `--dot`/`--svg`.
//! `--quantize TYPE` plans the model as `metashard quantize` would write it (each weight in
//! the type llama.cpp's mix rules give it).

use metashard::Result;
use metashard::models::split::ExpertSplit;
use metashard::planner::evaluate::Workload;
use metashard::planner::report::{Plan, dot, evaluate_split};
use metashard::planner::{
    Cluster, ModelShape, Shares, Strategy, evaluate_hybrid_split, search_layouts,
};
use std::path::PathBuf;

#[derive(Clone, Debug, clap::Args)]
#[command(mut_arg("json", |a| a.help(
    "Print the plan as JSON (a plan file: `run --plan FILE` executes it)"
)))]
pub struct PlanArgs {
    /// A model: a preset (smollm2-135m, llama3-8b, llama3-70b, mixtral-8x7b, qwen3-30b-a3b),
    /// `smollm2`, a `.gguf` file (only its header is read) or a Hugging Face `config.json` (or
    /// its folder).
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Plan the model as `metashard quantize --type TYPE` would write it (q8_0, q4_k_m,
    /// q5_k_m, q6_k, ...: llama.cpp's per-tensor mix rules), e.g. a config.json's bf16 model
    /// as the Q4_K_M file people download.
    #[arg(long, value_name = "TYPE")]
    pub quantize: Option<String>,
    /// The cluster: a preset name or a profile JSON (`metashard calibrate -o FILE`).
    #[arg(long, conflicts_with = "devices")]
    pub cluster: Option<String>,
    /// Plan for these devices of this machine, measured first (`cpu:2x1`; a quick calibration).
    #[arg(long)]
    pub devices: Option<String>,
    /// The workload: `pp=512,tg=128,batch=1,ctx=4096` (any subset).
    #[arg(long, default_value = "pp=512,tg=128,batch=1,ctx=4096")]
    pub workload: String,
    /// megatron, mlp-only, attn-only, mirrored, vocab-split, memory, sequence-parallel,
    /// expert-parallel (a mixture of experts: whole experts per device), expert-groups (whole
    /// experts per group of devices, `--expert-groups` groups (2), columns and rows inside a
    /// group), auto (the search), layer (whole layers per device, as `--split-mode layer` runs them), or hybrid (groups
    /// of devices under the Megatron split, layers across the groups, as `--split-mode hybrid`
    /// runs them).
    #[arg(long, default_value = "auto")]
    pub strategy: String,
    /// Groups of the hybrid split (default: the cluster's nodes, or 2 on one node).
    #[arg(long)]
    pub groups: Option<usize>,
    /// Groups of devices of `--strategy expert-groups` (default 2; 1 to the device count).
    #[arg(long)]
    pub expert_groups: Option<usize>,
    /// Micro-batches of the layer split's steps (1: its devices one after another; default:
    /// the fastest the cost model finds).
    #[arg(long, value_parser = super::parse_positive)]
    pub micro_batches: Option<usize>,
    /// A mixture of experts' load imbalance: the hottest device gets this many times its
    /// uniform share of the routed tokens (1: uniform routing, an assumption; at least 1).
    #[arg(long, default_value_t = metashard::planner::experts::DEFAULT_ROUTING_SKEW)]
    pub routing_skew: f64,
    /// A measured routing instead of --routing-skew: the JSON of `bench model --json` (its
    /// `routing.per_layer`, tokens routed per layer and expert); the skew is the busiest
    /// device's share over the mean under whole experts split evenly over the cluster's
    /// devices, averaged over the layers.
    #[arg(long, conflicts_with = "routing_skew")]
    pub routing: Option<PathBuf>,
    /// Device shares of split tensors: even, throughput (by each device's measured speed), or
    /// ratios like 3,1.
    #[arg(long, default_value = "even")]
    pub shares: String,
    #[command(flatten)]
    pub out: super::JsonArgs,
    /// Also write the plan file here.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Write DOT of layer 0's per-device programs (one decode step) with their collectives.
    #[arg(long)]
    pub dot: Option<PathBuf>,
    /// Write that graph as SVG (through graphviz's `dot`; DOT is written instead, next to it,
    /// when graphviz is missing).
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

/// The routing skews of a `bench model --json` report (`--routing`): on `n` devices, and by
/// the number of expert holders (`experts::skews_by_holders`, for placements on fewer devices
/// or over groups); its `routing.per_layer` counts checked against the model's layers and
/// experts.
fn measured_skew(
    p: &std::path::Path,
    shape: &ModelShape,
    n: usize,
) -> Result<(f64, std::sync::Arc<[f64]>)> {
    let bad = |why: String| metashard::Error::invalid_argument("--routing", p.display(), why);
    let text = metashard::io::file::read_json_text(p)?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let rows = v
        .get("routing")
        .unwrap_or(&v)
        .get("per_layer")
        .and_then(|r| r.as_array())
        .ok_or_else(|| {
            bad(
                "no `routing.per_layer` (the JSON of `bench model --json` on a mixture of experts)"
                    .into(),
            )
        })?;
    let per_layer: Vec<Vec<u64>> = rows
        .iter()
        .map(|r| {
            r.as_array()
                .and_then(|a| a.iter().map(|x| x.as_u64()).collect::<Option<Vec<u64>>>())
                .ok_or_else(|| bad("`per_layer` must be arrays of token counts".into()))
        })
        .collect::<Result<_>>()?;
    let Some(moe) = shape.cfg.moe.as_ref() else {
        return Err(bad(format!("{} has no experts", shape.name)));
    };
    if per_layer.len() != shape.n_layer() || per_layer.iter().any(|r| r.len() != moe.n_expert) {
        return Err(bad(format!(
            "counts for {} layers of {} experts (the model's)",
            shape.n_layer(),
            moe.n_expert
        )));
    }
    let skew = metashard::planner::experts::skew_from_counts(&per_layer, n);
    let by_holders = metashard::planner::experts::skews_by_holders(&per_layer, moe.n_expert);
    Ok((
        metashard::planner::experts::check_skew("--routing", skew)?,
        by_holders.into(),
    ))
}

/// `shape` with every weight in the type `metashard quantize --type qtype` gives it
/// (`quantize::tensor_type`: llama.cpp's mix rules; norms and routers keep theirs), the types
/// of layer 0's roles following, and the name saying so. A tied output takes the embedding's
/// type (one table).
fn quantized(shape: &ModelShape, qtype: &str) -> Result<ModelShape> {
    use super::quantize::{MixContext, file_type_of, is_quantized_tensor, tensor_type};
    use metashard::models::arch::Tensor;
    let f = file_type_of("--quantize", qtype)?;
    let cfg = &shape.cfg;
    let ctx = MixContext {
        n_layer: cfg.n_layer,
        n_gqa: cfg.n_head / cfg.n_head_kv.max(1),
        has_output: !shape.tied,
        n_expert: cfg.moe.as_ref().map_or(1, |m| m.n_expert.max(1)),
    };
    let mut decls = shape.weight_decls()?;
    for d in decls.iter_mut().filter(|d| {
        (d.tensor != Tensor::Output || !shape.tied)
            && is_quantized_tensor(&d.name, d.tensor.n_dims())
    }) {
        let t = tensor_type(f, ctx, &d.name, d.layout.ne[0])?;
        d.layout = metashard::Layout::contiguous(t, d.layout.ne);
    }
    let of = |decls: &[metashard::models::weights::TensorDecl], t: Tensor| {
        decls.iter().find(|d| d.tensor == t).map(|d| d.layout.dtype)
    };
    if let Some(e) = of(&decls, Tensor::TokenEmbd)
        && shape.tied
    {
        for d in decls.iter_mut().filter(|d| d.tensor == Tensor::Output) {
            d.layout = metashard::Layout::contiguous(e, d.layout.ne);
        }
    }
    let mut out = shape.clone();
    let first = |ts: &[Tensor], was: metashard::DType| {
        ts.iter().find_map(|&t| of(&decls, t)).unwrap_or(was)
    };
    let w = &mut out.types;
    w.embedding = first(&[Tensor::TokenEmbd], w.embedding);
    w.output = first(&[Tensor::Output, Tensor::TokenEmbd], w.output);
    w.attention = first(&[Tensor::AttnQ, Tensor::AttnQkv], w.attention);
    w.ffn_gate_up = first(
        &[Tensor::FfnUp, Tensor::FfnGateUp, Tensor::FfnUpExps],
        w.ffn_gate_up,
    );
    w.ffn_down = first(&[Tensor::FfnDown, Tensor::FfnDownExps], w.ffn_down);
    out.file_tensors = Some(decls);
    out.name = format!("{} as {}", shape.name, f.name);
    Ok(out)
}

/// The cluster of `--cluster` (preset or file) or `--devices` (measured now).
pub fn cluster_of(cluster: Option<&str>, devices: Option<&str>) -> Result<Cluster> {
    super::calibrate::resolve_cluster(cluster, devices)
}

pub fn run(a: &PlanArgs) -> Result<()> {
    let mut shape = ModelShape::resolve(&a.model)?;
    if let Some(t) = &a.quantize {
        shape = quantized(&shape, t)?;
    }
    shape.routing_skew = metashard::planner::experts::check_skew("--routing-skew", a.routing_skew)?;
    let cluster = cluster_of(a.cluster.as_deref(), a.devices.as_deref())?;
    if let Some(p) = &a.routing {
        let (skew, by_holders) = measured_skew(p, &shape, cluster.n_devices())?;
        shape.routing_skew = skew;
        shape.routing_counted = Some(by_holders);
    }
    let workload = Workload::parse(&a.workload)?;
    if workload.context > shape.context_length {
        return Err(metashard::Error::invalid_argument(
            "--workload ctx",
            workload.context,
            format!(
                "more than the model's trained context of {}",
                shape.context_length
            ),
        ));
    }
    let ratios = Shares::parse(&a.shares)?.ratios(&shape, &cluster)?;
    if let Some(g) = a.expert_groups
        && !a.strategy.trim().eq_ignore_ascii_case("expert-groups")
    {
        return Err(metashard::Error::invalid_argument(
            "--expert-groups",
            g,
            "is for `--strategy expert-groups`",
        ));
    }
    let staged = ["layer", "hybrid"]
        .into_iter()
        .find(|s| a.strategy.trim().eq_ignore_ascii_case(s));
    if a.groups.is_some() && staged != Some("hybrid") {
        return Err(metashard::Error::invalid_argument(
            "--groups",
            a.groups.unwrap_or(0),
            "groups are for `--strategy hybrid`",
        ));
    }
    if let Some(mode) = staged {
        // Whole layers per device or group (`run --split-mode layer|hybrid`): not a tensor
        // split, so no plan file or DOT of per-device programs.
        if a.output.is_some() || a.dot.is_some() || a.svg.is_some() {
            return Err(metashard::Error::invalid_argument(
                "--strategy",
                mode,
                format!(
                    "a {mode} split is run with `--split-mode {mode} [--tensor-split ...]`, not \
                     from a plan file; -o, --dot and --svg describe tensor splits"
                ),
            ));
        }
        let cost = match mode {
            "layer" => metashard::planner::evaluate_layer_split_with(
                &shape,
                &cluster,
                &workload,
                ratios.as_deref(),
                a.micro_batches
                    .map_or(metashard::planner::MicroBatches::Best, |m| {
                        metashard::planner::MicroBatches::Fixed(m)
                    }),
            )?,
            _ => evaluate_hybrid_split(
                &shape,
                &cluster,
                &workload,
                a.groups.unwrap_or_else(|| default_groups(&cluster)),
                ratios.as_deref(),
            )?,
        };
        a.out.print("layer split prediction", &cost, |cost| {
            println!(
                "plan: {} on {} ({} devices), workload {}, strategy {mode}",
                shape.name,
                cluster.name,
                cluster.devices.len(),
                workload
            );
            print!("{}", cost.table());
        })?;
        // The prediction is printed; a split that does not fit is still an error.
        return match cost.over_budget() {
            Some((m, over)) => Err(does_not_fit(
                &shape, &cluster, mode, &m.device, over, m.budget,
            )),
            None => Ok(()),
        };
    }
    let strategy = Strategy::parse(&a.strategy)?;
    let plan = match strategy.split(shape.n_layer(), shape.tied) {
        Some(mut split) => {
            split.ratios = ratios.clone();
            if let Some(groups) = a.expert_groups {
                split.experts = ExpertSplit::Both { groups };
                split.experts.check_groups(cluster.devices.len())?;
            }
            let e = evaluate_split(&shape, &split, &cluster, &workload)?;
            Plan::fixed(&shape, &cluster, &workload, strategy.name(), split, e)?
        }
        None => {
            // The search weighs layouts: the tensor split on fewer of the devices (the first
            // k), hybrid and layer splits, replicas for a batch; the plan lists them all.
            Plan::searched_layouts(
                &shape,
                search_layouts(&shape, &cluster, &workload, ratios.clone())?,
            )?
        }
    };
    if let Some(p) = &a.output {
        std::fs::write(p, plan.to_json()).map_err(|e| metashard::Error::io(p, e))?;
    }
    if a.dot.is_some() || a.svg.is_some() {
        // The devices the plan uses (the search may have chosen the first k).
        let text = dot(&shape, &cluster.take(plan.devices.len()), &plan.split)?;
        if let Some(p) = &a.dot {
            std::fs::write(p, &text).map_err(|e| metashard::Error::io(p, e))?;
        }
        if let Some(p) = &a.svg {
            write_svg(p, &text)?;
        }
    }
    if a.out.json {
        println!("{}", plan.to_json());
    } else {
        print!("{}", plan.table());
    }
    // The plan is printed (and written, with -o); a fixed strategy that does not fit is still
    // an error (the search only returns plans that fit).
    match plan.evaluation.over_budget() {
        Some((m, over)) => Err(does_not_fit(
            &shape,
            &cluster,
            strategy.name(),
            &m.device,
            over,
            m.budget,
        )),
        None => Ok(()),
    }
}

/// The hybrid split's groups when not given: the cluster's nodes, or 2 on one node.
fn default_groups(cluster: &Cluster) -> usize {
    let nodes = cluster
        .devices
        .len()
        .div_ceil(cluster.links.devices_per_node.max(1));
    if nodes > 1 { nodes } else { 2 }
}

fn does_not_fit(
    shape: &ModelShape,
    cluster: &Cluster,
    strategy: &str,
    device: &str,
    over: u64,
    budget: u64,
) -> metashard::Error {
    metashard::Error::DoesNotFit {
        model: shape.name.clone(),
        cluster: cluster.name.clone(),
        how: format!("with strategy {strategy}"),
        device: device.to_string(),
        over,
        budget,
    }
}

/// SVG through graphviz's `dot`, or the DOT next to the requested file when `dot` is missing.
fn write_svg(path: &std::path::Path, dot_text: &str) -> Result<()> {
    use std::io::Write;
    let child = std::process::Command::new("dot")
        .arg("-Tsvg")
        .arg("-o")
        .arg(path)
        .stdin(std::process::Stdio::piped())
        .spawn();
    match child {
        Ok(mut c) => {
            if let Some(mut stdin) = c.stdin.take() {
                stdin
                    .write_all(dot_text.as_bytes())
                    .map_err(|e| metashard::Error::io(path, e))?;
            }
            let status = c.wait().map_err(|e| metashard::Error::io(path, e))?;
            if !status.success() {
                return Err(metashard::Error::ProgramFailed {
                    program: "dot".into(),
                    status: status.to_string(),
                    stderr: String::new(),
                });
            }
            Ok(())
        }
        Err(_) => {
            let alt = path.with_extension("dot");
            std::fs::write(&alt, dot_text).map_err(|e| metashard::Error::io(&alt, e))?;
            eprintln!(
                "graphviz's `dot` is not installed: wrote {} instead of {}",
                alt.display(),
                path.display()
            );
            Ok(())
        }
    }
}
