//! The load balance of a mixture of experts for `bench model`: the tokens routed to each
//! expert, counted from the router's choices (`l{i}.moe.chosen_by_router`, read through the
//! scheduler's eval callback as `run --dump` reads them) over one prompt and its generation
//! steps, and the tokens each device computes: the experts a device holds from the expert
//! weights' split state (`FfnGateExps` split on axis 2: whole experts per device, per layer;
//! split on another axis: every device computes a share of every routed token), or, where
//! the experts are mirrored, from an even split of them over the devices (the remainder on
//! the first devices) as expert parallelism would cut; with a layer or hybrid split, a layer's
//! experts are on the devices of the group holding it. The report says which.

use crate::cli::dump::Views;
use metashard::buffer::Storage;
use metashard::devices::DeviceSet;
use metashard::meta::MetaBuffer;
use metashard::models::arch::Tensor;
use metashard::models::loader::DecoderModel;
use metashard::models::moe::parse_chosen_name;
use metashard::models::session::Session;
use metashard::sched::SchedBuffer;
use metashard::split_state::SplitState;
use metashard::{Graph, Result, TensorId};
use parking_lot::Mutex;
use std::ops::Range;
use std::sync::Arc;

/// Tokens routed per expert, over the counted steps.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RoutingReport {
    /// The device set the routing was counted on (the first configuration).
    pub counted_on: String,
    /// Tokens counted: the prompt and the generation steps of one repetition.
    pub tokens: usize,
    pub n_layer: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Per expert, summed over the layers: each token counts once in each of the
    /// `n_expert_used` experts it is routed to in each layer.
    pub per_expert: Vec<u64>,
    /// Per layer, per expert.
    pub per_layer: Vec<Vec<u64>>,
    /// The busiest expert's count over the mean (1: balanced).
    pub expert_imbalance: f64,
    /// Per device set of the benchmark: the tokens its devices compute.
    pub devices: Vec<DeviceRouting>,
}

/// The routed tokens each device of one device set computes.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceRouting {
    pub devices: String,
    pub split_mode: String,
    /// How the experts of a device were found (the kinds met, joined by `; `): `split state`
    /// (the expert weights split on axis 2), `even split (experts mirrored)` (the experts
    /// mirrored now: an even split assumed, as expert parallelism would cut), `every device
    /// (experts split inside)` (split on another axis: each device computes a share of every
    /// routed token), `one device`, `layer split (whole layers per device)`.
    pub experts_from: String,
    /// Per device: the experts it holds in the first layer, as ranges (a layer split: the
    /// devices without that layer hold none of it).
    pub experts: Vec<Vec<Range<usize>>>,
    /// Per device: routed tokens (summed over layers) its experts compute.
    pub per_device: Vec<u64>,
    /// The busiest device's count over the mean (1: balanced).
    pub imbalance: f64,
}

/// Counts the ids of every `l{i}.moe.chosen_by_router` view, by layer and expert.
struct Counter {
    views: Views,
    counts: Arc<Mutex<Vec<Vec<u64>>>>,
}

/// The pattern naming the router's choices (`models::moe::chosen_name`).
const CHOSEN: &str = ".moe.chosen_by_router";

impl metashard::sched::EvalCallback for Counter {
    fn ask(&mut self, g: &Graph, id: TensorId) -> bool {
        self.views.ask(CHOSEN, g, id)
    }

    fn eval(&mut self, g: &Graph, id: TensorId, _: &str, values: &[f32]) -> bool {
        let mut counts = self.counts.lock();
        for (v, ids) in self.views.values(g, id, values) {
            let Some(row) = parse_chosen_name(g.name(v)).and_then(|l| counts.get_mut(l)) else {
                continue;
            };
            for &e in &ids {
                if let Some(c) = row.get_mut(e as usize) {
                    *c += 1;
                }
            }
        }
        true
    }
}

/// Tokens routed per layer and expert while `m` on `set` evaluates `prompt` and then `tg`
/// steps (the benchmark's tokens); `None` for a model without experts.
pub fn count(
    set: &DeviceSet,
    m: &DecoderModel,
    prompt: &[u32],
    tg: usize,
    next: &dyn Fn(&[f32], usize) -> u32,
) -> Result<Option<Vec<Vec<u64>>>> {
    let Some(moe) = m.cfg.moe else {
        return Ok(None);
    };
    let counts = Arc::new(Mutex::new(vec![vec![0u64; moe.n_expert]; m.cfg.n_layer]));
    let sched = match &set.sched {
        Some((s, _)) => s.clone(),
        None => metashard::sched::Sched::new(vec![set.backend.clone()])?,
    };
    let old = sched.take_eval_callback();
    sched.set_eval_callback(Some(Box::new(Counter {
        views: Views::default(),
        counts: counts.clone(),
    })));
    let run = || -> Result<()> {
        let mut s = Session::new(
            m,
            sched.clone(),
            set.buffer_type.as_ref(),
            prompt.len() + tg + 2,
        )?;
        s.eval(prompt, false)?;
        let mut tok = 1u32;
        for i in 0..tg {
            let l = s.eval(&[tok], false)?;
            tok = next(&l, i);
        }
        Ok(())
    };
    let done = run();
    sched.set_eval_callback(old);
    done?;
    let counts = counts.lock().clone();
    Ok(Some(counts))
}

/// How one layer's experts were found on the devices (the report joins the kinds it met).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum From {
    OneDevice,
    SplitState,
    Mirrored,
    SplitInside,
    WholeLayer,
}

impl From {
    fn text(self) -> &'static str {
        match self {
            From::OneDevice => "one device",
            From::SplitState => "split state",
            From::Mirrored => "even split (experts mirrored)",
            From::SplitInside => "every device (experts split inside)",
            From::WholeLayer => "layer split (whole layers per device)",
        }
    }
}

/// The devices holding layer `l`'s experts (a group of a layer or hybrid split, else all of
/// them) and the experts' split state there (`None`: not on a meta device).
fn layer_home(
    set: &DeviceSet,
    m: &DecoderModel,
    l: usize,
) -> Option<(Range<usize>, Option<SplitState>)> {
    let r = m.weights.layers.get(l)?.opt(Tensor::FfnGateExps)?;
    let state_at = |st: &Storage| {
        let mb = st.buffer.as_any().downcast_ref::<MetaBuffer>()?;
        mb.tensor_at(st.offset).map(|t| t.state.clone())
    };
    match r.storage.buffer.as_any().downcast_ref::<SchedBuffer>() {
        Some(sb) => {
            let (p, _) = sb.resolve(r.storage.offset)?;
            let devices = set.sched.as_ref()?.1.get(p.backend)?.clone();
            Some((devices, state_at(&p.storage)))
        }
        None => Some((0..set.devices.len().max(1), state_at(&r.storage))),
    }
}

/// `n` experts over the devices `devices` of `n_devices` as the state says (or evenly, the
/// remainder on the first devices), each device's ranges.
fn spread(
    n: usize,
    devices: &Range<usize>,
    state: Option<&SplitState>,
    n_devices: usize,
) -> (Vec<Vec<Range<usize>>>, From) {
    let mut held = vec![Vec::new(); n_devices];
    let group = devices.len();
    let from = match state.and_then(|s| s.split_dim().map(|k| (s, k))) {
        _ if group == 1 && n_devices == 1 => From::OneDevice,
        _ if group == 1 => From::WholeLayer,
        Some((s, 2)) => {
            for (i, d) in devices.clone().enumerate() {
                held[d] = (0..s.n_segments())
                    .map(|k| s.full_start(k, i)..s.full_start(k, i) + s.extent(k, i))
                    .filter(|r| !r.is_empty())
                    .collect();
            }
            return (held, From::SplitState);
        }
        Some(_) => From::SplitInside,
        None => {
            let (base, rem) = (n / group, n % group);
            let mut start = 0;
            for (i, d) in devices.clone().enumerate() {
                let len = base + usize::from(i < rem);
                if len > 0 {
                    held[d] = std::iter::once(start..start + len).collect();
                }
                start += len;
            }
            return (held, From::Mirrored);
        }
    };
    for d in devices.clone() {
        held[d] = std::iter::once(0..n).collect();
    }
    (held, from)
}

/// The experts each device of `set` holds in each layer of `m`, and how that was found
/// (empty when a layer's weights cannot be placed on devices).
fn experts_per_device(
    set: &DeviceSet,
    m: &DecoderModel,
    n_expert: usize,
) -> (Vec<Vec<Vec<Range<usize>>>>, String) {
    let n = set.devices.len().max(1);
    let mut layers = Vec::new();
    let mut kinds: Vec<From> = Vec::new();
    for l in 0..m.cfg.n_layer {
        let Some((devices, state)) = layer_home(set, m, l) else {
            return (Vec::new(), "unknown placement".into());
        };
        if devices.end > n {
            return (Vec::new(), "unknown placement".into());
        }
        let (held, from) = spread(n_expert, &devices, state.as_ref(), n);
        if !kinds.contains(&from) {
            kinds.push(from);
        }
        layers.push(held);
    }
    let text: Vec<&str> = kinds.iter().map(|k| k.text()).collect();
    (layers, text.join("; "))
}

/// The busiest count over the mean (1 for an empty or all-zero list).
fn imbalance(v: &[u64]) -> f64 {
    let sum: u64 = v.iter().sum();
    match (v.iter().max(), sum) {
        (Some(&max), s) if s > 0 => max as f64 * v.len() as f64 / s as f64,
        _ => 1.0,
    }
}

/// The routed tokens each device of `set` computes, from the counts per layer and expert.
pub fn per_device(
    set: &DeviceSet,
    m: &DecoderModel,
    split_mode: &str,
    counts: &[Vec<u64>],
) -> DeviceRouting {
    let n_expert = counts.first().map_or(0, Vec::len);
    let (layers, from) = experts_per_device(set, m, n_expert);
    let n = set.devices.len().max(1);
    let mut per_device = vec![0u64; if layers.is_empty() { 0 } else { n }];
    for (held, row) in layers.iter().zip(counts) {
        for (d, ranges) in held.iter().enumerate() {
            per_device[d] += ranges
                .iter()
                .flat_map(|r| row[r.clone()].iter())
                .sum::<u64>();
        }
    }
    DeviceRouting {
        devices: set.spec.clone(),
        split_mode: split_mode.to_string(),
        experts_from: from,
        experts: layers.first().cloned().unwrap_or_default(),
        imbalance: imbalance(&per_device),
        per_device,
    }
}

/// The report of the counts of `m` (counted on `counted_on` over `tokens` tokens).
pub fn report(
    m: &DecoderModel,
    counted_on: &str,
    tokens: usize,
    counts: Vec<Vec<u64>>,
    devices: Vec<DeviceRouting>,
) -> RoutingReport {
    let n_expert = counts.first().map_or(0, Vec::len);
    let per_expert: Vec<u64> = (0..n_expert)
        .map(|e| counts.iter().map(|r| r[e]).sum())
        .collect();
    RoutingReport {
        counted_on: counted_on.to_string(),
        tokens,
        n_layer: counts.len(),
        n_expert,
        n_expert_used: m.cfg.moe.map_or(0, |x| x.n_expert_used),
        expert_imbalance: imbalance(&per_expert),
        per_expert,
        per_layer: counts,
        devices,
    }
}

/// `a..b` lists as `0-2,5`.
fn ranges_text(v: &[Range<usize>]) -> String {
    if v.is_empty() {
        return "-".into();
    }
    v.iter()
        .map(|r| match r.len() {
            1 => r.start.to_string(),
            _ => format!("{}-{}", r.start, r.end - 1),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The report as tables: per expert, then per device of each device set.
pub fn print_table(r: &RoutingReport) {
    let total: u64 = r.per_expert.iter().sum();
    let share = |x: u64| 100.0 * x as f64 / total.max(1) as f64;
    println!(
        "routing: {} tokens on {} ({} layers, {} experts, {} per token)",
        r.tokens, r.counted_on, r.n_layer, r.n_expert, r.n_expert_used
    );
    println!("{:>8} {:>10} {:>8}", "expert", "tokens", "share");
    for (e, &c) in r.per_expert.iter().enumerate() {
        println!("{e:>8} {c:>10} {:>7.1}%", share(c));
    }
    println!("expert imbalance (max / mean): {:.2}", r.expert_imbalance);
    for d in &r.devices {
        if d.per_device.is_empty() {
            println!(
                "per device on {} ({} split): not counted ({})",
                d.devices, d.split_mode, d.experts_from
            );
            continue;
        }
        println!(
            "per device on {} ({} split; experts from {}):",
            d.devices, d.split_mode, d.experts_from
        );
        println!(
            "{:>8} {:>10} {:>10} {:>8}",
            "device", "experts l0", "tokens", "share"
        );
        for (i, &c) in d.per_device.iter().enumerate() {
            let held = d.experts.get(i).map_or(String::new(), |v| ranges_text(v));
            let s = 100.0 * c as f64 / d.per_device.iter().sum::<u64>().max(1) as f64;
            println!("{i:>8} {held:>10} {c:>10} {s:>7.1}%");
        }
        println!("device imbalance (max / mean): {:.2}", d.imbalance);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imbalance_and_ranges() {
        assert_eq!(imbalance(&[2, 2, 2]), 1.0);
        assert_eq!(imbalance(&[4, 0, 2]), 2.0);
        assert_eq!(imbalance(&[]), 1.0);
        assert_eq!(ranges_text(&[0..3, 5..6]), "0-2,5");
        assert_eq!(ranges_text(&[]), "-");
    }

    // A device's experts are a list of ranges; here each holds one.
    #[allow(clippy::single_range_in_vec_init)]
    #[test]
    fn experts_spread_as_the_state_says_or_evenly() {
        // Split on the expert axis: each device its extents (uneven, one with none).
        let s = SplitState::axis(2, &[4, 0, 3]);
        let (held, from) = spread(7, &(0..3), Some(&s), 3);
        assert_eq!(from, From::SplitState);
        assert_eq!(held, [vec![0..4], vec![], vec![4..7]]);
        // Mirrored: even shares, the remainder on the first devices.
        let m = SplitState::mirrored(3);
        let (held, from) = spread(7, &(0..3), Some(&m), 3);
        assert_eq!(from, From::Mirrored);
        assert_eq!(held, [vec![0..3], vec![3..5], vec![5..7]]);
        // Split inside the experts: every device computes every routed token.
        let c = SplitState::axis(1, &[32, 32]);
        let (held, from) = spread(4, &(0..2), Some(&c), 2);
        assert_eq!(from, From::SplitInside);
        assert_eq!(held, [vec![0..4], vec![0..4]]);
        // A layer on the second group of a hybrid split, and on one device of a layer split.
        let (held, _) = spread(5, &(2..4), None, 4);
        assert_eq!(held, [vec![], vec![], vec![0..3], vec![3..5]]);
        let (held, from) = spread(5, &(1..2), None, 2);
        assert_eq!(from, From::WholeLayer);
        assert_eq!(held, [vec![], vec![0..5]]);
    }
}
