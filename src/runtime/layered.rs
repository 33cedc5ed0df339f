//! Layer and hybrid splits of a decoder on the scheduler (`crate::sched`): one backend per
//! device (layer split) or per group of devices (hybrid: each group a meta device with the
//! built-in Megatron split inside), whole layers per backend in proportion to the shares, the
//! tensors placed by `models::layer_split::placement`.

use crate::backend::{Backend, Device};
use crate::cpu::{CpuOptions, Precision};
use crate::devices::{DeviceSet, parse_devices_with};
use crate::meta::{MetaDevice, MetaOptions};
use crate::models::layer_split::{SplitMode, device_groups, layer_ranges, placement};
use crate::models::split::{SplitDims, SplitOptions, megatron};
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
}

/// The scheduler for `mode` (layer or hybrid) over `devices` for a decoder of `dims`: one
/// backend per device (layer), or one per group of `groups` (hybrid; a group of one device is
/// that device, a larger one a meta device with the Megatron split and the group's shares).
pub fn open(
    dims: &SplitDims,
    devices: &[Arc<dyn Device>],
    mode: SplitMode,
    shares: Option<&[f64]>,
    groups: usize,
    meta: MetaOptions,
) -> Result<Layered> {
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
    let mut backends: Vec<Arc<dyn Backend>> = Vec::with_capacity(groups.len());
    let mut group_shares = Vec::with_capacity(groups.len());
    for g in &groups {
        let s = &shares[g.clone()];
        group_shares.push(s.iter().sum::<f64>());
        if g.len() == 1 {
            backends.push(devices[g.start].init_backend()?);
        } else {
            let split = megatron(
                dims.clone(),
                SplitOptions {
                    ratios: Some(s.to_vec()),
                    mirror_attention: false,
                },
            );
            let m = MetaDevice::with_options(devices[g.clone()].to_vec(), split, meta)?;
            backends.push(m.init_backend()?);
        }
    }
    let layers = layer_ranges(dims.n_layer, &group_shares)?;
    let sched = Sched::new(backends)?;
    let buffer_type = sched.buffer_type(placement(&layers));
    Ok(Layered {
        sched,
        buffer_type,
        groups,
        layers,
    })
}

/// The scheduler over the devices of `spec` for a layer or hybrid split of a decoder of `dims`,
/// with `precision` for products of quantized weights, as a device set.
pub fn open_layered(
    spec: &str,
    precision: Precision,
    options: MetaOptions,
    dims: &SplitDims,
    mode: SplitMode,
    shares: Option<&[f64]>,
    groups: usize,
) -> Result<DeviceSet> {
    let devices = parse_devices_with(spec, CpuOptions { precision })?;
    let l = open(dims, &devices, mode, shares, groups, options)?;
    Ok(DeviceSet {
        spec: spec.to_string(),
        backend: l.sched.clone(),
        buffer_type: l.buffer_type,
        devices,
        meta: None,
        sched: Some((l.sched, l.groups)),
        rank: None,
    })
}
