//! Layer and hybrid splits of a decoder on the scheduler (`crate::sched`): one backend per
//! device (layer split) or per group of devices (hybrid: each group a meta device with the
//! built-in Megatron split inside, its experts split as `--experts` says), whole layers per
//! backend in proportion to the shares, the tensors placed by
//! `models::layer_split::placement`. A group with more devices than the KV-head groups of its
//! layers repeats each KV head as the tensor split does (one repetition for the model,
//! `models::split::kv_repeat_groups`).

use crate::backend::{Backend, Device};
use crate::cpu::{CpuOptions, Precision};
use crate::devices::{DeviceSet, parse_devices_with};
use crate::meta::{MetaDevice, MetaOptions};
use crate::models::layer_split::{SplitMode, device_groups, layer_ranges, placement};
use crate::models::split::{
    DecoderSplit, ExpertSplit, SplitDims, SplitOptions, by_layer, kv_repeat_groups, megatron_plan,
};
use crate::sched::Sched;
use crate::{Error, Result};
use std::ops::Range;
use std::sync::Arc;

/// What [`open`] builds: the scheduler, its buffer type, and the devices each backend covers.
pub struct Layered {
    pub sched: Arc<Sched>,
    pub buffer_type: Arc<dyn crate::buffer::BufferType>,
    /// Device indices per backend of the scheduler.
    pub groups: Vec<Range<usize>>,
    /// Layers per backend.
    pub layers: Vec<Range<usize>>,
    /// Copies of each KV head the groups' tensor splits need (`DecoderConfig::with_kv_repeat`;
    /// load the model with `LoadOptions::kv_repeat` this); 1: none.
    pub kv_repeat: usize,
}

/// How a layer or hybrid split cuts the devices: `--split-mode`, `--tensor-split` (one share
/// per device), `--groups` (hybrid) and `--experts` (inside a hybrid group).
#[derive(Clone, Copy, Debug)]
pub struct Staging<'a> {
    pub mode: SplitMode,
    pub shares: Option<&'a [f64]>,
    pub groups: usize,
    pub experts: ExpertSplit,
}

/// The scheduler for `mode` (layer or hybrid) over `devices` for a decoder of `dims`: one
/// backend per device (layer), or one per group of `groups` (hybrid; a group of one device is
/// that device, a larger one a meta device with the Megatron split, the group's shares and
/// its experts split as `experts`).
pub fn open(
    dims: &SplitDims,
    devices: &[Arc<dyn Device>],
    how: &Staging,
    meta: MetaOptions,
) -> Result<Layered> {
    let Staging {
        mode,
        shares,
        groups,
        experts,
    } = *how;
    let n = devices.len();
    let shares: Vec<f64> = match shares {
        Some(s) if s.len() == n => s.to_vec(),
        Some(s) => {
            return Err(Error::invalid_argument(
                "--tensor-split",
                format!("{s:?}"),
                format!("give one share per device ({n})"),
            ));
        }
        None => vec![1.0; n],
    };
    let groups = match mode {
        SplitMode::Layer => device_groups(n, n)?,
        SplitMode::Hybrid => device_groups(n, groups)?,
        SplitMode::Tensor => {
            return Err(Error::invalid_argument(
                "--split-mode",
                "tensor",
                "runs on the meta device, not the scheduler",
            ));
        }
    };
    let group_shares: Vec<f64> = groups
        .iter()
        .map(|g| shares[g.clone()].iter().sum::<f64>())
        .collect();
    let layers = layer_ranges(dims.n_layer, &group_shares)?;
    // Each group's Megatron split (its own shares) cuts only its own layers; one repetition of
    // the KV heads for the whole model, the smallest that gives every device of every group
    // query heads (virtual KV heads, as the tensor split picks it).
    let plan = |g: &Range<usize>| {
        megatron_plan(
            dims.n_layer,
            SplitOptions {
                ratios: Some(shares[g.clone()].to_vec()),
                mirror_attention: false,
                experts,
            },
        )
    };
    let plans: Vec<(usize, DecoderSplit)> = groups
        .iter()
        .zip(&layers)
        .map(|(g, own)| {
            let mut p = plan(g);
            for (l, ls) in p.layers.iter_mut().enumerate() {
                ls.attention &= own.contains(&l);
            }
            (g.len(), p)
        })
        .collect();
    let kv_repeat = kv_repeat_groups(dims, &plans);
    let dims = dims.with_kv_repeat(kv_repeat);
    let mut backends: Vec<Arc<dyn Backend>> = Vec::with_capacity(groups.len());
    for g in &groups {
        if g.len() == 1 {
            backends.push(devices[g.start].init_backend()?);
        } else {
            let split = by_layer(dims.clone(), plan(g));
            let m = MetaDevice::with_options(devices[g.clone()].to_vec(), split, meta)?;
            backends.push(m.init_backend()?);
        }
    }
    let sched = Sched::new(backends)?;
    let buffer_type = sched.buffer_type(placement(&layers));
    Ok(Layered {
        sched,
        buffer_type,
        groups,
        layers,
        kv_repeat,
    })
}

/// The scheduler over the devices of `spec` for a layer or hybrid split of a decoder of `dims`,
/// with `precision` for products of quantized weights, as a device set, and the copies of each
/// KV head the model must be loaded with ([`Layered::kv_repeat`]).
pub fn open_layered(
    spec: &str,
    precision: Precision,
    options: MetaOptions,
    dims: &SplitDims,
    how: &Staging,
) -> Result<(DeviceSet, usize)> {
    let devices = parse_devices_with(spec, CpuOptions { precision })?;
    let l = open(dims, &devices, how, options)?;
    let set = DeviceSet {
        spec: spec.to_string(),
        backend: l.sched.clone(),
        buffer_type: l.buffer_type,
        devices,
        meta: None,
        sched: Some((l.sched, l.groups)),
        rank: None,
    };
    Ok((set, l.kv_repeat))
}
