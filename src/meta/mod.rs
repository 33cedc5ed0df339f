//! The meta device: N devices seen as one. Weight (static) tensors get their split state from a
//! user callback when they are placed in a meta buffer; computed nodes take the cheapest state
//! their op's rule admits, or the state an optional hint callback asks for ([`SplitPolicy`]);
//! the meta backend rewrites each graph into one program per device joined by collectives and
//! runs the devices at the same time.
//!
//! - `buffer.rs`: `MetaBufferType`, `MetaBuffer` (each device allocates only its slice;
//!   set/get scatter and gather through the split, summing partials).
//! - `sharding.rs`: derive every node's state and the conversions its sources need (pure).
//! - `rewrite.rs`: build the per-device programs (local shapes, conversions, collectives).
//! - `backend.rs`: `MetaBackend` (plan cache, per-device allocation, concurrent execution).
//! - `profile.rs`: `METASHARD_STEP_PROFILE`, a step's time stage by stage on every device.

pub mod backend;
pub mod buffer;
mod profile;
pub(crate) mod rewrite;
pub mod sharding;

pub use backend::{MemoryReport, MetaBackend};
pub use buffer::{MetaBuffer, MetaBufferType, MetaTensor};
pub use sharding::{Conversion, ConversionKind, Sharding};

/// Whether `METASHARD_STEP_PROFILE` is on (the meta device's step profile and the scheduler's,
/// `sched/profile.rs`).
pub(crate) fn step_profile_enabled() -> bool {
    profile::enabled()
}

use crate::backend::{Backend, Device, DeviceCaps, DeviceKind, MemoryInfo};
use crate::buffer::BufferType;
use crate::graph::{Graph, TensorId};
use crate::split_state::SplitState;
use crate::tensor::Layout;
use crate::{Error, Result};
use std::any::Any;
use std::sync::Arc;

/// What the split callback is told about a tensor.
#[derive(Clone, Copy, Debug)]
pub struct TensorInfo<'a> {
    pub name: &'a str,
    pub layout: &'a Layout,
    pub n_devices: usize,
}

/// The user's split-state callback: called once for every tensor placed in a meta buffer.
pub type SplitFn = Arc<dyn Fn(&TensorInfo) -> Result<SplitState> + Send + Sync>;

/// What a state hint is told about a computed node: the node in its graph (its name, layout,
/// op and sources) and the device count.
#[derive(Clone, Copy)]
pub struct NodeInfo<'a> {
    pub graph: &'a Graph,
    pub id: TensorId,
    pub n_devices: usize,
}

impl<'a> NodeInfo<'a> {
    pub fn name(&self) -> &'a str {
        self.graph.name(self.id)
    }

    pub fn layout(&self) -> &'a Layout {
        self.graph.layout(self.id)
    }

    pub fn op(&self) -> &'a crate::op::Op {
        &self.graph.node(self.id).op
    }

    /// The names of the node's sources, in order.
    pub fn source_names(&self) -> impl Iterator<Item = &'a str> + 'a {
        let g = self.graph;
        g.node(self.id).src.iter().map(move |&s| g.name(s))
    }
}

/// State hints for computed nodes: called for every node of each new graph; `Some(state)`
/// makes the sharding take a pattern giving that state where one is admissible (see
/// `sharding.rs`). A meta device's hints are fixed for its life, so its backend's plan cache
/// (keyed by graph structure) stays valid.
pub type HintFn = Arc<dyn Fn(&NodeInfo) -> Option<SplitState> + Send + Sync>;

/// The state `hints` give node `id` of `g` on `n` devices (None without hints).
pub fn hint_for(hints: Option<&HintFn>, g: &Graph, id: TensorId, n: usize) -> Option<SplitState> {
    hints?(&NodeInfo {
        graph: g,
        id,
        n_devices: n,
    })
}

/// What decides the split states on a meta device: the split callback for placed tensors and
/// optional state hints for computed nodes. A bare [`SplitFn`] converts into a policy without
/// hints.
#[derive(Clone)]
pub struct SplitPolicy {
    pub split: SplitFn,
    pub hints: Option<HintFn>,
}

impl From<SplitFn> for SplitPolicy {
    fn from(split: SplitFn) -> Self {
        SplitPolicy { split, hints: None }
    }
}

impl std::fmt::Debug for SplitPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SplitPolicy")
            .field("hints", &self.hints.is_some())
            .finish_non_exhaustive()
    }
}

/// Options of a meta device.
#[derive(Clone, Copy, Debug)]
pub struct MetaOptions {
    /// Refuse communication the plan did not ask for: any conversion that moves data between
    /// devices other than reducing partial sums (all-gathers, all-to-alls) is an error naming
    /// the node and the states.
    pub explicit: bool,
    /// How long a device may stay inside one stage of its program (a node range, or a
    /// collective waiting for its peers) before the compute fails naming it.
    pub timeout: std::time::Duration,
}

impl Default for MetaOptions {
    fn default() -> Self {
        MetaOptions {
            explicit: false,
            timeout: crate::collectives::cpu::DEFAULT_TIMEOUT,
        }
    }
}

impl MetaOptions {
    /// Default options with `explicit` set as given.
    pub fn explicit(explicit: bool) -> Self {
        MetaOptions {
            explicit,
            ..MetaOptions::default()
        }
    }
}

/// What the meta device's buffers and backends share.
pub struct MetaShared {
    pub devices: Vec<Arc<dyn Device>>,
    pub split_fn: SplitFn,
    /// State hints for computed nodes (see [`HintFn`]).
    pub hints: Option<HintFn>,
    pub options: MetaOptions,
}

/// N devices seen as one.
pub struct MetaDevice {
    shared: Arc<MetaShared>,
}

impl MetaDevice {
    /// A meta device over `devices` (1..=16) with the split callback `split_fn`.
    pub fn new(devices: Vec<Arc<dyn Device>>, split_fn: SplitFn) -> Result<Arc<MetaDevice>> {
        Self::with_options(devices, split_fn, MetaOptions::default())
    }

    pub fn with_options(
        devices: Vec<Arc<dyn Device>>,
        split_fn: SplitFn,
        options: MetaOptions,
    ) -> Result<Arc<MetaDevice>> {
        Self::with_policy(devices, split_fn.into(), options)
    }

    /// A meta device whose split states follow `policy`: its split callback, and its state
    /// hints for computed nodes.
    pub fn with_policy(
        devices: Vec<Arc<dyn Device>>,
        policy: SplitPolicy,
        options: MetaOptions,
    ) -> Result<Arc<MetaDevice>> {
        if devices.is_empty() || devices.len() > 16 {
            return Err(Error::Device {
                device: "meta".into(),
                reason: format!("a meta device needs 1..=16 devices, got {}", devices.len()),
            });
        }
        Ok(Arc::new(MetaDevice {
            shared: Arc::new(MetaShared {
                devices,
                split_fn: policy.split,
                hints: policy.hints,
                options,
            }),
        }))
    }

    pub fn n_devices(&self) -> usize {
        self.shared.devices.len()
    }

    pub fn devices(&self) -> &[Arc<dyn Device>] {
        &self.shared.devices
    }

    pub fn options(&self) -> MetaOptions {
        self.shared.options
    }

    /// The meta backend, typed (for its reports).
    pub fn meta_backend(&self) -> Result<Arc<MetaBackend>> {
        Ok(Arc::new(MetaBackend::new(self.shared.clone())?))
    }
}

impl Device for MetaDevice {
    fn name(&self) -> String {
        let names: Vec<String> = self.shared.devices.iter().map(|d| d.name()).collect();
        format!("meta[{}]", names.join(","))
    }

    fn description(&self) -> String {
        format!("tensor parallelism over {} devices", self.n_devices())
    }

    fn memory(&self) -> MemoryInfo {
        self.shared
            .devices
            .iter()
            .fold(MemoryInfo::default(), |acc, d| {
                let m = d.memory();
                MemoryInfo {
                    free: acc.free + m.free,
                    total: acc.total + m.total,
                }
            })
    }

    fn kind(&self) -> DeviceKind {
        DeviceKind::Meta
    }

    fn caps(&self) -> DeviceCaps {
        DeviceCaps::default()
    }

    fn buffer_type(&self) -> Arc<dyn BufferType> {
        Arc::new(MetaBufferType::new(self.shared.clone()))
    }

    fn init_backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(self.meta_backend()?)
    }

    /// An op is supported if every device supports it with all sources mirrored (the
    /// fallback every rule admits); the split-specific checks happen when a graph is planned.
    fn supports_op(&self, graph: &Graph, id: TensorId) -> std::result::Result<(), String> {
        for d in &self.shared.devices {
            d.supports_op(graph, id)?;
        }
        Ok(())
    }

    /// Its own meta buffers (not another meta device's: their slices lie on other devices),
    /// or a buffer type every device can use.
    fn supports_buffer_type(&self, bt: &dyn BufferType) -> bool {
        bt.as_any()
            .downcast_ref::<MetaBufferType>()
            .is_some_and(|m| m.belongs_to(&self.shared))
            || self
                .shared
                .devices
                .iter()
                .all(|d| d.supports_buffer_type(bt))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
