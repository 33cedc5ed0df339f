//! The built-in device families, listed in one place above every backend: [`registries`],
//! the device-string parser [`parse_devices`] (`cpu`, `cpu:N`, `cpu:NxT`, `cuda:0,1`), and
//! [`DeviceSet`], what a program runs on: one device, a meta device over several, or the
//! scheduler (`crate::runtime` makes the layer and hybrid splits of a model).
//!
//! A new backend plugs in here (its registry and its device-string prefix) and nowhere else
//! above its own module: `backend/`, `meta/` and `sched/` name no backend (`tests/tidy.rs`).

use crate::backend::{Backend, Device, Registry};
use crate::buffer::{Buffer, BufferType};
use crate::cpu::{CpuOptions, Precision};
use crate::dist::Dist;
use crate::meta::{MetaBuffer, MetaDevice, MetaOptions, SplitPolicy};
use crate::sched::{Sched, SchedBuffer};
use crate::{Error, Result};
use std::sync::Arc;

/// Registries built into this binary.
pub fn registries() -> Vec<Arc<dyn Registry>> {
    let mut v: Vec<Arc<dyn Registry>> = vec![Arc::new(crate::cpu::CpuRegistry)];
    if let Some(r) = crate::cuda::registry() {
        v.push(r);
    }
    v
}

/// Parse a device list: `cpu` (one device, all cores), `cpu:N` (N devices splitting the cores),
/// `cpu:NxT` (N devices of T threads), or `cuda`, `cuda:0,1`.
pub fn parse_devices(spec: &str) -> Result<Vec<Arc<dyn Device>>> {
    parse_devices_with(spec, CpuOptions::default())
}

/// As [`parse_devices`], with the options CPU devices are opened with.
pub fn parse_devices_with(spec: &str, cpu: CpuOptions) -> Result<Vec<Arc<dyn Device>>> {
    let spec = spec.trim();
    if spec == "cpu" || spec.starts_with("cpu:") {
        return crate::cpu::parse_cpu_spec_with(spec, cpu);
    }
    if spec.starts_with("cuda") {
        return crate::cuda::parse_cuda_spec(spec, cpu.precision);
    }
    Err(Error::Device {
        device: spec.to_string(),
        reason: "unknown device list; use `cpu`, `cpu:N`, `cpu:NxT` or `cuda:0,1`".into(),
    })
}

/// The devices a program runs on: one device with its backend, or a meta device over several.
pub struct DeviceSet {
    pub spec: String,
    pub devices: Vec<Arc<dyn Device>>,
    pub backend: Arc<dyn Backend>,
    pub buffer_type: Arc<dyn BufferType>,
    /// Set when running on several devices with tensor parallelism.
    pub meta: Option<Arc<MetaDevice>>,
    /// Set when the scheduler runs the graph (layer or hybrid split): it and the device
    /// indices each of its backends covers.
    pub sched: Option<(Arc<Sched>, Vec<std::ops::Range<usize>>)>,
    /// With ranks as processes (`Dist::Mpi`): this process's rank (its device's index in
    /// `devices`; the others are `dist::RemoteDevice`s).
    pub rank: Option<usize>,
}

impl DeviceSet {
    /// Open `spec` with `precision` for products of quantized weights on CPU devices; several
    /// devices run as one meta device with `split` (called only then, with the device count):
    /// a split callback, or a [`SplitPolicy`] that adds state hints.
    pub fn open<P: Into<SplitPolicy>>(
        spec: &str,
        precision: Precision,
        options: MetaOptions,
        split: impl FnOnce(usize) -> P,
    ) -> Result<DeviceSet> {
        Self::open_dist(spec, Dist::Local, precision, options, split)
    }

    /// As [`DeviceSet::open`], with the devices spread over processes as `dist` says: with
    /// `Dist::Mpi`, `spec` is this process's one device and the meta device has one rank per
    /// process of the MPI job (see `crate::dist`).
    pub fn open_dist<P: Into<SplitPolicy>>(
        spec: &str,
        dist: Dist,
        precision: Precision,
        options: MetaOptions,
        split: impl FnOnce(usize) -> P,
    ) -> Result<DeviceSet> {
        let local = parse_devices_with(spec, CpuOptions { precision })?;
        let devices = crate::dist::distributed_devices(spec, local, dist)?;
        let rank = match dist {
            Dist::Local => None,
            Dist::Mpi => Some(crate::dist::rank_and_size(dist)?.0),
        };
        if devices.len() == 1 {
            let d = devices[0].clone();
            return Ok(DeviceSet {
                spec: spec.to_string(),
                backend: d.init_backend()?,
                buffer_type: d.buffer_type(),
                devices,
                meta: None,
                sched: None,
                rank,
            });
        }
        let m = MetaDevice::with_policy(devices.clone(), split(devices.len()).into(), options)?;
        Ok(DeviceSet {
            spec: spec.to_string(),
            backend: m.init_backend()?,
            buffer_type: m.buffer_type(),
            devices,
            meta: Some(m),
            sched: None,
            rank,
        })
    }

    /// Whether this process prints: rank 0 of a distributed set, or any local set.
    pub fn is_leader(&self) -> bool {
        self.rank.is_none_or(|r| r == 0)
    }

    pub fn names(&self) -> Vec<String> {
        self.devices.iter().map(|d| d.name()).collect()
    }

    /// Bytes per device held by `buffers` (split buffers count each device's slices; a
    /// scheduler's buffer counts each tensor on the devices of its backend).
    pub fn bytes_per_device(&self, buffers: &[&Arc<dyn Buffer>]) -> Vec<usize> {
        let mut v = vec![0; self.devices.len()];
        let mut add = |b: &dyn Buffer, first: usize| match b.as_any().downcast_ref::<MetaBuffer>() {
            Some(mb) => mb
                .device_bytes()
                .iter()
                .enumerate()
                .for_each(|(d, x)| v[first + d] += x),
            None => v[first] += b.size(),
        };
        for b in buffers {
            match (b.as_any().downcast_ref::<SchedBuffer>(), &self.sched) {
                (Some(sb), Some((_, groups))) => {
                    for p in sb.placed() {
                        let first = groups.get(p.backend).map_or(0, |g| g.start);
                        add(p.storage.buffer.as_ref(), first);
                    }
                }
                _ => add(b.as_ref(), 0),
            }
        }
        v
    }
}
