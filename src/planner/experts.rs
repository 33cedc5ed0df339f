//! Mixtures of experts in the planner: the expert keys of a Hugging Face `config.json` (into
//! the [`Moe`] part of the decoder's configuration, nothing kept twice), what one device's
//! `mul_mat_id` streams and computes in a step under a routing skew, and the experts each
//! device holds once a model is placed.
//!
//! **Which experts a step touches.** A token picks `k` of the `E` experts; under uniform
//! routing each expert is picked by a token with probability `k / E`, independently for the
//! `T` tokens of a step, so an expert is left untouched with probability `(1 - k/E)^T` and a
//! device holding `E_d` of them (the local weight's `ne[2]`: all `E` where the experts are
//! mirrored, fewer under expert parallelism) reads `E_d * (1 - (1 - k/E)^T)` experts' matrices
//! in expectation: `k E_d / E` for one decode token, all `E_d` for a long prompt. The
//! (slot, token) pairs it computes are `T k E_d / E`, each `2 N K` flops. Where the experts are
//! spread over `m = E / E_d` devices, the step waits for the hottest of them, so a device is
//! priced at the expected maximum over the `m` of those binomial counts ([`expert_load`]): one
//! Mixtral decode token over 8 devices of one expert each costs 0.9 of an expert's bytes, not
//! the mean's 0.25; where every device holds every expert it is the mean.
//!
//! **Load imbalance.** Beyond the chance spread above, routing is not uniform: one device's
//! experts are preferred, so it gets `skew` times its uniform share of the pairs in
//! expectation (capped at all `T k`), and each of its experts is picked with probability
//! `skew k / E` (so more of them are read); the hottest device is then taken over it and the
//! `m - 1` others. The skew is a figure of the
//! workload and the router, not of the model files: [`DEFAULT_ROUTING_SKEW`] is 1 (uniform),
//! an assumption (see there); `plan --routing-skew` sets it, and `plan --routing` counts it
//! (`skew_from_counts`), kept for every number of expert holders ([`skews_by_holders`]) so
//! each placement takes the skew of its own spread. With every expert on every device
//! (`E_d = E`) the skew changes nothing: a device cannot get more than all the pairs.

use super::cluster::DeviceProfile;
use super::evaluate::Placed;
use crate::graph::{Graph, Node};
use crate::io::config::JsonConfig;
use crate::meta::{MetaBuffer, MetaTensor};
use crate::models::arch::{Arch, Mlp, MoeSpec, Tensor};
use crate::models::hparams::{MAX_EXPERTS, Moe};
use crate::models::limits::Count;
use crate::op::RowWindow;
use crate::split_state::SplitState;
use crate::{Error, Result};
use serde::Serialize;
use std::sync::Arc;

/// The routing skew assumed when none is given: 1.0, uniform routing. An assumption, not a
/// measurement: both presets' routers were trained with a load-balancing loss
/// (`router_aux_loss_coef` 0.02 in Mixtral's config.json, 0.001 in Qwen3-30B-A3B's; the loss of
/// Fedus et al., "Switch Transformers", arXiv:2101.03961, section 2.2) that pushes each
/// expert's share of the tokens towards `k / E`, and no per-device figure for inference on
/// these models was found to cite. Set a measured one with `plan --routing-skew`.
pub const DEFAULT_ROUTING_SKEW: f64 = 1.0;

/// The largest routing skew accepted (a device can never get more than all the pairs; this
/// only bounds nonsense).
pub const MAX_ROUTING_SKEW: f64 = 4096.0;

/// `skew` if it is a routing skew (finite, in `1..=`[`MAX_ROUTING_SKEW`]: the hottest device
/// gets at least its uniform share), else an error naming `what` (a flag or a field).
pub fn check_skew(what: &str, skew: f64) -> Result<f64> {
    if skew.is_finite() && (1.0..=MAX_ROUTING_SKEW).contains(&skew) {
        return Ok(skew);
    }
    Err(Error::invalid_argument(
        what,
        skew,
        format!(
            "a routing skew must be finite and in 1..={MAX_ROUTING_SKEW} (1: uniform; the \
             hottest device gets skew times its uniform share of the routed tokens)"
        ),
    ))
}

/// The routing skew that counted routing gives on `n` devices holding whole experts:
/// `per_layer[l][e]` is the (token, expert) pairs routed to expert `e` of layer `l` (`bench
/// model --json`'s `routing.per_layer`). The experts are cut into `n` contiguous even shares
/// (the remainder on the first devices, as `bench model` assumes for mirrored experts); per
/// layer, the busiest device's pairs over the mean device's; averaged over the layers (a step
/// pays each layer's hottest device, and the cost model prices every layer with one skew).
/// Layers with no pair count as 1; the result is at least 1. Over many counted tokens the
/// chance spread in it is small, so little of the binomial spread [`expert_load`] adds is
/// counted twice.
pub fn skew_from_counts(per_layer: &[Vec<u64>], n: usize) -> f64 {
    let n = n.max(1);
    let ratios: Vec<f64> = per_layer
        .iter()
        .map(|row| {
            // Summed as f64: counts come from a file and may be as large as u64 allows.
            let sum = |r: &[u64]| r.iter().map(|&c| c as f64).sum::<f64>();
            let e = row.len();
            let total = sum(row);
            if total == 0.0 || e == 0 {
                return 1.0;
            }
            let (base, extra) = (e / n, e % n);
            let mut start = 0;
            let mut hottest = 0f64;
            for d in 0..n {
                let len = base + usize::from(d < extra);
                hottest = hottest.max(sum(&row[start..start + len]));
                start += len;
            }
            // The mean over the devices that hold experts (all n when e >= n).
            let holders = n.min(e) as f64;
            hottest / (total / holders)
        })
        .collect();
    if ratios.is_empty() {
        return 1.0;
    }
    (ratios.iter().sum::<f64>() / ratios.len() as f64).max(1.0)
}

/// The routing of a model's experts as the cost model needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// Experts of a layer in the model (`E`; a device may hold fewer).
    pub n_expert: usize,
    /// The hottest device's share of the routed pairs over its uniform share (>= 1): an
    /// assumption, or counted for the cluster's device count.
    pub skew: f64,
    /// From counted routing ([`skews_by_holders`]): the skew when the experts are spread over
    /// `m` holders (devices, or groups of devices), at index `m`. A placement on a subset of
    /// the devices, or over groups, is priced with its own holders' skew, not the one counted
    /// for every device of the cluster.
    pub counted: Option<Arc<[f64]>>,
}

impl Routing {
    /// Routing with one assumed skew for any spread of the experts.
    pub fn assumed(n_expert: usize, skew: f64) -> Routing {
        Routing {
            n_expert,
            skew,
            counted: None,
        }
    }

    /// The skew of experts spread over `holders` (rounded; an uneven split's fraction).
    pub fn skew_for(&self, holders: f64) -> f64 {
        match &self.counted {
            Some(t) if t.len() > 1 => {
                let m = (holders.round().max(1.0) as usize).min(t.len() - 1);
                t[m]
            }
            _ => self.skew,
        }
    }
}

/// [`skew_from_counts`] for every holder count `0..=n_expert` (index 0 repeats 1 holder's):
/// what [`Routing::counted`] holds.
pub fn skews_by_holders(per_layer: &[Vec<u64>], n_expert: usize) -> Vec<f64> {
    (0..=n_expert.max(1))
        .map(|m| skew_from_counts(per_layer, m.max(1)))
        .collect()
}

/// What one device's expert product does in a step: expected experts read and (slot, token)
/// pairs computed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertLoad {
    pub experts: f64,
    pub pairs: f64,
}

/// Experts a device holding `local` of `n_expert` experts is expected to read in a step of
/// `tokens` tokens each routed to `used` experts, under uniform routing:
/// `E_d (1 - (1 - k/E)^T)` (`k E_d / E` for one token).
pub fn expected_experts(local: usize, used: usize, tokens: usize, n_expert: usize) -> f64 {
    let e = n_expert.max(local).max(1) as f64;
    local as f64 * (1.0 - untouched((used as f64 / e).min(1.0), tokens))
}

/// `(1 - p)^T` as `exp(T ln(1 - p))`: exact to rounding for any `T`, 0 for `p = 1`.
fn untouched(p: f64, tokens: usize) -> f64 {
    if p >= 1.0 {
        0.0
    } else {
        (tokens as f64 * (-p).ln_1p()).exp()
    }
}

/// The load of the hottest device holding `local` of `routing.n_expert` experts in a step of
/// `tokens` tokens each routed to `used` experts (see the module doc): the step waits for it.
/// Where every device holds every expert (`E_d = E`) that is the mean, [`expected_experts`]
/// and `T k` pairs. Where the experts are spread over `m = E / E_d` devices, the expected
/// maximum over them: each local expert is read with probability `q = 1 - (1 - p)^T` (`p =
/// k / E`; `skew k / E` on the skewed device) and each pair lands on the device with
/// probability `E_d / E` (`skew E_d / E`), so its experts read and pairs computed are binomial,
/// and the hottest of `m` devices (one skewed, `m - 1` not, taken as independent) reads
/// `E[max]` of them: one Mixtral decode token over 8 devices of one expert each reads 0.9 of an
/// expert on the hottest device, not the mean's 0.25. Never more experts than pairs, never more
/// pairs than the step has.
pub fn expert_load(local: usize, used: usize, tokens: usize, routing: &Routing) -> ExpertLoad {
    if local == 0 || tokens == 0 || used == 0 {
        return ExpertLoad {
            experts: 0.0,
            pairs: 0.0,
        };
    }
    let e = routing.n_expert.max(local) as f64;
    let ed = local as f64;
    let k = used.min(routing.n_expert.max(local));
    let peers = e / ed;
    // The skew this device can have: its share of the pairs is at most all of them.
    let skew = routing.skew_for(peers).max(1.0).min(peers);
    let p = k as f64 / e;
    let p_hot = (skew * p).min(1.0);
    let (q, q_hot) = (1.0 - untouched(p, tokens), 1.0 - untouched(p_hot, tokens));
    let pairs_n = tokens.saturating_mul(k);
    let share = ed / e;
    let pairs = expected_max(pairs_n, (skew * share).min(1.0), share, peers);
    let experts = expected_max(local, q_hot, q, peers);
    ExpertLoad {
        experts: experts.min(pairs).min(ed),
        pairs: pairs.min(pairs_n as f64),
    }
}

/// `E[max]` of `peers` independent counts, one Binomial(`n`, `p_hot`) and `peers - 1`
/// Binomial(`n`, `p`) (`peers` may be fractional: an uneven split; at most 1: the one count's
/// mean): `sum over x < n of 1 - F_hot(x) F(x)^(peers - 1)`, summed exactly over the 12 standard
/// deviations around the means (below them the product is 0 to rounding, above them 1).
fn expected_max(n: usize, p_hot: f64, p: f64, peers: f64) -> f64 {
    let nf = n as f64;
    if peers <= 1.0 || n == 0 {
        return nf * p_hot;
    }
    let sd = (nf * p_hot.max(p) * (1.0 - p_hot.min(p))).sqrt();
    let lo = (nf * p.min(p_hot) - 12.0 * sd - 1.0).floor().max(0.0) as usize;
    let hi = ((nf * p_hot.max(p) + 12.0 * sd + 2.0).ceil() as usize).min(n);
    let (mut hot, mut cold) = (Pmf::at(n, p_hot, lo), Pmf::at(n, p, lo));
    let (mut f_hot, mut f) = (0.0, 0.0);
    let mut sum = lo as f64;
    for _ in lo..hi {
        f_hot = (f_hot + hot.next()).min(1.0);
        f = (f + cold.next()).min(1.0);
        sum += 1.0 - f_hot * f.powf(peers - 1.0);
    }
    sum
}

/// A binomial distribution's probabilities from `x` on, one per [`Pmf::next`]: the first from
/// `ln_gamma`, each next by the ratio `(n - x) / (x + 1) * p / (1 - p)`.
struct Pmf {
    n: usize,
    p: f64,
    x: usize,
    v: f64,
}

impl Pmf {
    fn at(n: usize, p: f64, x: usize) -> Pmf {
        let v = if p <= 0.0 {
            f64::from(x == 0)
        } else if p >= 1.0 {
            f64::from(x == n)
        } else {
            let (nf, xf) = (n as f64, x as f64);
            (ln_gamma(nf + 1.0) - ln_gamma(xf + 1.0) - ln_gamma(nf - xf + 1.0)
                + xf * p.ln()
                + (nf - xf) * (-p).ln_1p())
            .exp()
        };
        Pmf { n, p, x, v }
    }

    /// P(X = x), then step to x + 1.
    fn next(&mut self) -> f64 {
        let v = self.v;
        self.v = if self.x >= self.n || self.p <= 0.0 {
            0.0
        } else if self.p >= 1.0 {
            f64::from(self.x + 1 == self.n)
        } else {
            v * (self.n - self.x) as f64 / (self.x + 1) as f64 * self.p / (1.0 - self.p)
        };
        self.x += 1;
        v
    }
}

/// `ln Γ(x)` for `x >= 1`: Lanczos' approximation (C. Lanczos, "A precision approximation of
/// the gamma function", SIAM J. Numer. Anal. B 1, 1964) with `g = 7` and the 9 coefficients P.
/// Godfrey computed for it (the set the Wikipedia article "Lanczos approximation" lists),
/// relative error about 1e-15.
fn ln_gamma(x: f64) -> f64 {
    const G: f64 = 7.0;
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    let x = x - 1.0;
    let t = x + G + 0.5;
    let a = C[1..]
        .iter()
        .enumerate()
        .fold(C[0], |a, (i, c)| a + c / (x + i as f64 + 1.0));
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// Seconds of a `mul_mat_id` node (expert weights `[K, N, E_d, 1]`, activations, ids
/// `[k, T]`; with a `window`, the meta backend's share of whole experts: only the window's
/// experts of the weight are used) of one device's program: the larger of the experts read
/// over the GEMV weight bandwidth of their type and the pairs' flops over its GEMM rate, plus
/// the activations, ids and output over the memory bandwidth. Without `routing` (a graph built
/// by hand) every expert it holds counts as read.
pub fn mul_mat_id_seconds(
    g: &Graph,
    node: &Node,
    window: Option<RowWindow>,
    prof: &DeviceProfile,
    routing: Option<&Routing>,
) -> f64 {
    let a = g.layout(node.src[0]);
    let ids = g.layout(node.src[2]);
    let (k_dim, n_dim) = (a.ne[0] as f64, a.ne[1] as f64);
    let local = window.map_or(a.ne[2], |w| w.len().min(a.ne[2]));
    let (used, tokens) = (ids.ne[0], ids.ne[1]);
    let uniform = Routing::assumed(local, 1.0);
    let load = expert_load(local, used, tokens, routing.unwrap_or(&uniform));
    let per_expert = a.nbytes() as f64 / a.ne[2].max(1) as f64;
    let read = load.experts * per_expert / prof.gemv_at(a.dtype, a.ne[0]).max(1.0);
    let flops = 2.0 * k_dim * n_dim * load.pairs / prof.gemm(a.dtype).max(1.0);
    let rest = [node.src[1], node.src[2]]
        .iter()
        .map(|&s| g.layout(s).nbytes() as f64)
        .sum::<f64>()
        + node.layout.nbytes() as f64;
    read.max(flops) + rest / prof.mem_bw.max(1.0)
}

/// A mixture of experts as a plan places it: the model's counts and, per device, the experts
/// it holds and their bytes, read from the placed expert weights' slices (so any split of the
/// experts, mirrored, by whole experts or inside every expert, reports what it placed).
#[derive(Clone, Debug, Serialize)]
pub struct PlacedExperts {
    /// Experts of a layer.
    pub n_expert: usize,
    /// Experts each token is routed to.
    pub n_expert_used: usize,
    /// One expert's feed-forward width.
    pub n_ff_exp: usize,
    /// The shared expert's width (0: none).
    pub n_ff_shexp: usize,
    /// The routing skew the plan was priced with: the assumed one, or with counted routing
    /// the skew of this placement's holders (the experts over the devices or groups that
    /// hold different ones).
    pub routing_skew: f64,
    /// Per device, the experts of a layer it holds any part of (the fewest over the layers).
    pub experts: Vec<usize>,
    /// Per device, the most experts it holds in any layer (equal to `experts` unless the
    /// layers differ).
    pub experts_max: Vec<usize>,
    /// Per device, bytes of the routed experts' gate, up and down matrices over all layers.
    pub expert_bytes: Vec<usize>,
}

impl PlacedExperts {
    /// The experts of `placed` (None for a dense model).
    pub fn of(placed: &Placed) -> Option<PlacedExperts> {
        let cfg = &placed.shape.cfg;
        let m = cfg.moe?;
        let n = placed.devices.len();
        let tensors = placed.tensors();
        let (mut lo, mut hi) = (vec![usize::MAX; n], vec![0; n]);
        let mut bytes = vec![0; n];
        for l in 0..cfg.n_layer {
            let mut held = vec![0; n];
            for role in [Tensor::FfnGateExps, Tensor::FfnUpExps, Tensor::FfnDownExps] {
                let Some(t) = tensors.get(&cfg.arch.name(role, l)).and_then(meta_tensor) else {
                    continue;
                };
                for d in 0..n {
                    let (_, layout) = &t.local[d];
                    bytes[d] += layout.nbytes();
                    if layout.nbytes() > 0 {
                        held[d] = held[d].max(layout.ne[2]);
                    }
                }
            }
            for d in 0..n {
                lo[d] = lo[d].min(held[d]);
                hi[d] = hi[d].max(held[d]);
            }
        }
        // Holders: the model's experts over the most any device holds (1: mirrored or split
        // inside every expert; the device count under whole experts; the groups under both).
        let held = hi
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .clamp(1, m.n_expert.max(1));
        let holders = m.n_expert as f64 / held as f64;
        let routing_skew = placed
            .routing()
            .map_or(placed.shape.routing_skew, |r| r.skew_for(holders));
        Some(PlacedExperts {
            n_expert: m.n_expert,
            n_expert_used: m.n_expert_used,
            n_ff_exp: m.n_ff_exp,
            n_ff_shexp: m.n_ff_shexp,
            routing_skew,
            experts: lo.into_iter().map(|x| x.min(m.n_expert)).collect(),
            experts_max: hi,
            expert_bytes: bytes,
        })
    }

    /// One line for the plan's table.
    pub fn line(&self) -> String {
        let list = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join("/");
        let mib = |b: usize| format!("{:.1}", b as f64 / 1048576.0);
        let per_device = if self.experts == self.experts_max {
            list(&self.experts)
        } else {
            let v: Vec<String> = self
                .experts
                .iter()
                .zip(&self.experts_max)
                .map(|(a, b)| {
                    if a == b {
                        a.to_string()
                    } else {
                        format!("{a}-{b}")
                    }
                })
                .collect();
            v.join("/")
        };
        let bytes = match self.expert_bytes.iter().all(|b| *b == self.expert_bytes[0]) {
            true => format!("{} MiB each", mib(self.expert_bytes[0])),
            false => {
                let v: Vec<String> = self.expert_bytes.iter().map(|b| mib(*b)).collect();
                format!("{} MiB", v.join("/"))
            }
        };
        let shared = match self.n_ff_shexp {
            0 => String::new(),
            w => format!(", a shared expert of width {w}"),
        };
        format!(
            "experts: {} per layer of width {}, {} per token{shared}, routing skew {}; per device \
             {per_device} experts, expert weights {bytes}",
            self.n_expert, self.n_ff_exp, self.n_expert_used, self.routing_skew
        )
    }
}

/// How a placed expert weight's `state` lies, for the plan's table (None: mirrored).
pub(super) fn experts_how(state: &SplitState) -> Option<&'static str> {
    match state.split_dim() {
        _ if state.is_mirrored() => None,
        None if state.is_grouped() => Some("whole experts per group, columns or rows inside it"),
        Some(2) => Some("whole experts per device"),
        Some(1) => Some("columns inside every expert"),
        Some(0) => Some("rows inside every expert"),
        _ => Some("experts split"),
    }
}

/// The meta tensor a placed storage holds (None for a storage outside a meta buffer).
pub(super) fn meta_tensor(st: &crate::buffer::Storage) -> Option<std::sync::Arc<MetaTensor>> {
    st.buffer
        .as_any()
        .downcast_ref::<MetaBuffer>()?
        .tensor_at(st.offset)
}

/// The first of `keys` `c` has, with its value.
fn first_usize<'a>(c: &JsonConfig, keys: &[&'a str]) -> Result<Option<(&'a str, usize)>> {
    for &k in keys {
        if let Some(v) = c.opt_usize(k)? {
            return Ok(Some((k, v)));
        }
    }
    Ok(None)
}

/// The experts of a `config.json` of a mixture-of-experts family (`None` for a dense one), as
/// Hugging Face's Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE configurations name them:
/// `num_local_experts` (Mixtral) or `num_experts`, `num_experts_per_tok`,
/// `moe_intermediate_size` (Qwen; Mixtral's and OLMoE's experts are `intermediate_size` wide),
/// `shared_expert_intermediate_size` (Qwen2-MoE), `norm_topk_prob` (the family's choice when
/// absent). A layout the table cannot describe is an error naming its key: dense layers among
/// the expert layers (`decoder_sparse_step` other than 1, a non-empty `mlp_only_layers`).
pub fn moe_from_config(c: &JsonConfig, arch: &Arch) -> Result<Option<Moe>> {
    let Mlp::Moe(MoeSpec {
        norm_weights,
        shared_expert,
    }) = arch.decoder()?.mlp
    else {
        return Ok(None);
    };
    let bad = |key: &str, reason: String| Error::format(c.path(), format!("key '{key}'"), reason);
    let (e_key, n_expert) = first_usize(c, &["num_local_experts", "num_experts"])?
        .ok_or_else(|| bad("num_experts", "missing (or num_local_experts)".into()))?;
    if !(1..=MAX_EXPERTS).contains(&n_expert) {
        return Err(bad(
            e_key,
            format!("{n_expert}: must be in 1..={MAX_EXPERTS}"),
        ));
    }
    let used_key = "num_experts_per_tok";
    let n_expert_used = c.get_usize(used_key)?;
    if !(1..=n_expert).contains(&n_expert_used) {
        return Err(bad(
            used_key,
            format!("{n_expert_used}: must be in 1..={n_expert} (the experts)"),
        ));
    }
    let width = |key: &str, v: usize| -> Result<usize> {
        let max = Count::Ffn.max();
        match (1..=max).contains(&v) {
            true => Ok(v),
            false => Err(bad(key, format!("{v} features: must be in 1..={max}"))),
        }
    };
    let (ff_key, n_ff_exp) = first_usize(c, &["moe_intermediate_size", "intermediate_size"])?
        .ok_or_else(|| {
            bad(
                "moe_intermediate_size",
                "missing (or intermediate_size)".into(),
            )
        })?;
    let n_ff_exp = width(ff_key, n_ff_exp)?;
    let n_ff_shexp = match shared_expert {
        true => {
            let key = "shared_expert_intermediate_size";
            width(key, c.get_usize(key)?)?
        }
        false => 0,
    };
    if let Some(step) = c.opt_usize("decoder_sparse_step")?
        && step != 1
    {
        return Err(bad(
            "decoder_sparse_step",
            format!("{step}: only every layer having experts (1) is supported"),
        ));
    }
    if let Some(v) = c.get("mlp_only_layers")
        && v.as_array().is_none_or(|a| !a.is_empty())
    {
        return Err(bad(
            "mlp_only_layers",
            format!("{v}: dense layers among the expert layers are not supported"),
        ));
    }
    Ok(Some(Moe {
        n_expert,
        n_expert_used,
        n_ff_exp,
        n_ff_shexp,
        norm_weights: c.opt_bool("norm_topk_prob")?.unwrap_or(norm_weights),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skew_from_counted_routing() {
        // Even routing: 1 on any device count.
        assert_eq!(skew_from_counts(&[vec![5; 8], vec![3; 8]], 2), 1.0);
        // Layer 0: experts 0..4 get 30 pairs, 4..8 get 10: the first device 120 of 160 (mean
        // 80): 1.5; layer 1 even: 1; mean 1.25.
        let l0 = vec![30, 30, 30, 30, 10, 10, 10, 10];
        let s = skew_from_counts(&[l0.clone(), vec![1; 8]], 2);
        assert!((s - 1.25).abs() < 1e-12, "{s}");
        // On one device nothing is uneven; 8 experts over 3 devices: 3 + 3 + 2 experts, the
        // first device 90 of 160 pairs over a mean of 53.3.
        assert_eq!(skew_from_counts(std::slice::from_ref(&l0), 1), 1.0);
        let s = skew_from_counts(&[l0], 3);
        assert!((s - 90.0 / (160.0 / 3.0)).abs() < 1e-12, "{s}");
        // No counted pair, no layer: uniform.
        assert_eq!(skew_from_counts(&[vec![0; 4]], 2), 1.0);
        assert_eq!(skew_from_counts(&[], 2), 1.0);
    }

    fn uniform(e: usize) -> Routing {
        Routing::assumed(e, 1.0)
    }

    #[test]
    fn one_token_reads_k_of_e_experts_and_a_prompt_reads_all() {
        // The expected experts per device, E_d (1 - (1 - k/E)^T): k E_d / E for one token.
        // Mixtral (2 of 8) on a device holding all 8, and 1 of them (expert parallel over 8).
        assert!((expected_experts(8, 2, 1, 8) - 2.0).abs() < 1e-12);
        assert!((expected_experts(1, 2, 1, 8) - 0.25).abs() < 1e-12);
        assert!((expected_experts(4, 2, 1, 8) - 1.0).abs() < 1e-12);
        // Two tokens: 8 (1 - (3/4)^2) = 3.5.
        assert!((expected_experts(8, 2, 2, 8) - 3.5).abs() < 1e-12);
        // With every expert on the device, the load is that mean and every pair.
        let one = expert_load(8, 2, 1, &uniform(8));
        assert!(
            (one.experts - 2.0).abs() < 1e-12 && one.pairs == 2.0,
            "{one:?}"
        );
        assert!((expert_load(8, 2, 2, &uniform(8)).experts - 3.5).abs() < 1e-12);
        // Qwen3-30B-A3B, 8 of 128: a 512-token prompt reads all 128 (to rounding).
        let prompt = expert_load(128, 8, 512, &uniform(128));
        assert!((prompt.experts - 128.0).abs() < 1e-9, "{prompt:?}");
        assert_eq!(prompt.pairs, 512.0 * 8.0);
        // Spread over 8 devices of one expert, the step waits for the hottest: it reads its
        // expert unless no token picked it, 1 - (3/4)^8 (the two picked experts taken as
        // independent draws); the mean is 0.25.
        let ep = expert_load(1, 2, 1, &uniform(8));
        assert!(
            (ep.experts - (1.0 - 0.75f64.powi(8))).abs() < 1e-9,
            "{ep:?}"
        );
        // A long prompt: every device reads all its experts, and the hottest computes a little
        // more than the mean's 512 * 8 / 8 pairs.
        let ep = expert_load(16, 8, 512, &uniform(128));
        assert!((ep.experts - 16.0).abs() < 1e-6, "{ep:?}");
        assert!(ep.pairs > 512.0 && ep.pairs < 512.0 * 1.2, "{ep:?}");
    }

    #[test]
    fn expected_max_matches_a_direct_sum() {
        // max of 4 Binomial(2, 1/4): P(max <= 0) = (9/16)^4, P(max <= 1) = (15/16)^4.
        let direct = (1.0 - (9.0f64 / 16.0).powi(4)) + (1.0 - (15.0f64 / 16.0).powi(4));
        assert!((expected_max(2, 0.25, 0.25, 4.0) - direct).abs() < 1e-12);
        // One device: the mean. Many trials: the maximum of 8 Binomial(4096, 1/8) is about
        // mean + 1.42 standard deviations (the expected maximum of 8 standard normals).
        assert_eq!(expected_max(10, 0.3, 0.3, 1.0), 3.0);
        let (mean, sd) = (512.0, (4096.0f64 * 0.125 * 0.875).sqrt());
        let m = expected_max(4096, 0.125, 0.125, 8.0);
        assert!((m - (mean + 1.4236 * sd)).abs() < 0.3, "{m}");
        assert!((ln_gamma(11.0) - 3_628_800f64.ln()).abs() < 1e-12);
    }

    /// Seconds of one `mul_mat_id` over 8 bf16 experts `[256, 64]`, 2 per token, for `tokens`
    /// tokens on a device holding `local` of them, where a byte takes 1 ps and flops are free.
    fn expert_product(tokens: usize, local: usize) -> f64 {
        expert_product_in(tokens, local, None)
    }

    /// [`expert_product`] of the experts in `window` only.
    fn expert_product_in(tokens: usize, local: usize, window: Option<RowWindow>) -> f64 {
        use crate::DType;
        let rate = |x: f64| [("bf16".to_string(), x)].into_iter().collect();
        let prof = DeviceProfile {
            name: "test".into(),
            memory_bytes: 1 << 40,
            mem_bw: 1e12,
            gemv_bw: rate(1e12),
            gemm_flops: rate(1e30),
            gemm_flops_by_m: Default::default(),
            gemv_bw_by_k: Default::default(),
            attn_flops: None,
            step_overhead_s: 0.0,
            node_overhead_s: 0.0,
        };
        let mut g = Graph::new();
        let w = g
            .input("experts", DType::BF16, [256, 64, local, 1])
            .unwrap();
        let x = g.input("x", DType::F32, [256, 1, tokens, 1]).unwrap();
        let ids = g.input("ids", DType::I32, [2, tokens, 1, 1]).unwrap();
        let y = match window {
            Some(win) => g.mul_mat_id_windowed(w, x, ids, win).unwrap(),
            None => g.mul_mat_id(w, x, ids).unwrap(),
        };
        mul_mat_id_seconds(&g, g.node(y), window, &prof, Some(&uniform(8)))
    }

    #[test]
    fn a_decode_step_streams_the_routed_experts_and_a_prompt_all() {
        let expert = 256.0 * 64.0 * 2.0;
        // Activations, ids and output of `t` tokens.
        let rest = |t: f64| t * (256.0 * 4.0 + 2.0 * 4.0 + 64.0 * 2.0 * 4.0);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b;
        // One token: 2 of the 8 experts (not all 8, as a dense product would read).
        let one = expert_product(1, 8) * 1e12;
        assert!(close(one, 2.0 * expert + rest(1.0)), "{one}");
        // On devices holding 2 of them (expert parallel over 4): the hottest of the 4 reads
        // E[max] of 4 Binomial(2, 1/4) experts (the mean is 0.5).
        let hottest = (1.0 - (9.0f64 / 16.0).powi(4)) + (1.0 - (15.0f64 / 16.0).powi(4));
        let ep = expert_product(1, 2) * 1e12;
        assert!(close(ep, hottest * expert + rest(1.0)), "{ep}");
        // A window of 2 of the 4 experts a device holds (one segment of its share): the same.
        let win = RowWindow {
            rows: 8,
            lo: 4,
            hi: 6,
            at: 2,
        };
        let windowed = expert_product_in(1, 4, Some(win)) * 1e12;
        assert!(close(windowed, hottest * expert + rest(1.0)), "{windowed}");
        // A prompt of 512 tokens reads every expert once.
        let prompt = expert_product(512, 8) * 1e12;
        assert!(close(prompt, 8.0 * expert + rest(512.0)), "{prompt}");
    }

    /// Counted routing prices each spread of the experts with its own skew: the same counts
    /// are skewed 2x over four holders of two experts and even over two holders of four.
    #[test]
    fn counted_routing_takes_the_skew_of_the_placements_holders() {
        let counts = vec![vec![40, 0, 0, 0, 10, 10, 10, 10]];
        let t = skews_by_holders(&counts, 8);
        assert_eq!((t[2], t[4]), (1.0, 2.0));
        let counted = Routing {
            n_expert: 8,
            skew: t[4],
            counted: Some(t.into()),
        };
        // Four holders (two experts each): the counted 2x; two holders: none.
        let four = expert_load(2, 2, 16, &counted);
        assert_eq!(four, expert_load(2, 2, 16, &Routing::assumed(8, 2.0)));
        let two = expert_load(4, 2, 16, &counted);
        assert_eq!(two, expert_load(4, 2, 16, &uniform(8)));
        assert!(four.pairs > two.pairs / 2.0, "{four:?} {two:?}");
        // The assumed skew alone would have priced the two holders at 2x.
        assert!(expert_load(4, 2, 16, &Routing::assumed(8, 2.0)).pairs > two.pairs);
    }

    #[test]
    fn skew_loads_the_hottest_device_up_to_all_pairs() {
        let skewed = Routing::assumed(8, 1.5);
        let l = expert_load(2, 2, 16, &skewed);
        // Uniform share 16 * 2 * 2/8 = 8 pairs; the skewed device's mean 1.5 times that, and
        // the hottest of the four at least that.
        let even = expert_load(2, 2, 16, &uniform(8));
        assert!(
            l.pairs >= 12.0 && l.pairs > even.pairs && l.pairs < 32.0,
            "{l:?}"
        );
        assert!(l.experts > even.experts);
        // Capped at every pair of the step; with all experts local, no effect at all.
        let huge = Routing::assumed(8, 100.0);
        assert_eq!(expert_load(1, 2, 16, &huge).pairs, 32.0);
        assert_eq!(
            expert_load(8, 2, 3, &huge),
            expert_load(8, 2, 3, &uniform(8))
        );
        // Nothing held, nothing done.
        assert_eq!(expert_load(0, 2, 16, &huge).pairs, 0.0);
        assert!(check_skew("--routing-skew", 0.5).is_err());
        assert!(check_skew("--routing-skew", f64::NAN).is_err());
        assert_eq!(check_skew("--routing-skew", 1.25).unwrap(), 1.25);
    }
}
