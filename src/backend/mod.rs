//! The compute rungs of the backend ladder: `Registry` (a family of devices), `Device` (one
//! piece of hardware, or one logical CPU device), `Backend` (a stream on a device that computes
//! graphs) and `Event` (a marker in a stream), and the communicator rung (`comm.rs`: the
//! `Communicator` and `CommunicatorFactory` traits; `layout.rs`: `SliceLayout`, which bytes of
//! a full tensor each rank holds). This module names no backend and no communicator
//! implementation: the built-in registries and the device-string parser live in `devices.rs`,
//! above every backend; the communicators in `collectives/`.
//!
//! Shaped after ggml-backend's `ggml_backend_reg_i`, `ggml_backend_device_i`,
//! `ggml_backend_i` (ggml-org/ggml `src/ggml-backend-impl.h`); optional entries are default
//! methods. All traits are object safe so a meta device can hold `Arc<dyn Device>`.

pub mod comm;
pub mod layout;

pub use comm::{Communicator, CommunicatorFactory};
pub use layout::{Run, Runs, SliceLayout};

use crate::buffer::{Buffer, BufferType, Storage};
use crate::graph::{Graph, TensorId};
use crate::tensor::Layout;
use crate::{Error, Result};
use std::any::Any;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Gpu,
    /// A device made of other devices (the meta device).
    Meta,
}

/// What a device can do beyond the required minimum.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceCaps {
    /// set/get/copy can overlap with compute.
    pub async_io: bool,
    /// Has a pinned host buffer type.
    pub host_buffer: bool,
    /// Supports events.
    pub events: bool,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct MemoryInfo {
    pub free: usize,
    pub total: usize,
}

/// A family of devices (the CPU, CUDA, ...).
pub trait Registry: Send + Sync {
    fn name(&self) -> &str;
    fn devices(&self) -> Vec<Arc<dyn Device>>;
}

/// One device.
pub trait Device: Send + Sync + Any {
    fn name(&self) -> String;
    fn description(&self) -> String;
    fn memory(&self) -> MemoryInfo;
    fn kind(&self) -> DeviceKind;
    fn caps(&self) -> DeviceCaps {
        DeviceCaps::default()
    }
    /// The buffer type backends of this device compute in.
    fn buffer_type(&self) -> Arc<dyn BufferType>;
    /// (optional) Pinned host memory for fast transfers.
    fn host_buffer_type(&self) -> Option<Arc<dyn BufferType>> {
        None
    }
    /// A stream on this device.
    fn init_backend(&self) -> Result<Arc<dyn Backend>>;
    /// Whether this device computes node `id` of `graph` (op, dtypes, layouts); `Err` says why not.
    fn supports_op(&self, graph: &Graph, id: TensorId) -> std::result::Result<(), String>;
    /// Whether kernels of this device can use tensors in buffers of type `bt`.
    fn supports_buffer_type(&self, bt: &dyn BufferType) -> bool;
    /// (optional) An event for synchronizing streams of this device.
    fn event_new(&self) -> Result<Arc<dyn Event>> {
        Err(Error::Device {
            device: self.name(),
            reason: "events are not supported".into(),
        })
    }
    /// (optional) The communicators this device can join, best first (NCCL, peer kernels for
    /// logical devices on one GPU, MPI across processes). The meta device uses the first kind
    /// all its devices offer; with none, it falls back to the in-process host communicator.
    fn communicators(&self) -> Vec<Arc<dyn CommunicatorFactory>> {
        Vec::new()
    }
    /// (optional) True for a stand-in of a device another process owns (a rank of a
    /// distributed meta device, `crate::dist`): its buffers hold no data here and the meta
    /// backend runs no program for it. Defaults to false.
    fn is_remote(&self) -> bool {
        false
    }
    fn as_any(&self) -> &dyn Any;
}

/// A stream on one device: queues transfers and graph computations.
pub trait Backend: Send + Sync {
    fn name(&self) -> String;
    fn device(&self) -> Arc<dyn Device>;
    /// (optional) Write tensor bytes, possibly asynchronously; defaults to a synchronous write.
    fn set_tensor_async(
        &self,
        dst: &Storage,
        layout: &Layout,
        data: &[u8],
        offset: usize,
    ) -> Result<()> {
        dst.buffer.set_tensor(layout, dst.offset, data, offset)
    }
    /// (optional) Read tensor bytes, possibly asynchronously (complete after `synchronize`).
    fn get_tensor_async(
        &self,
        src: &Storage,
        layout: &Layout,
        out: &mut [u8],
        offset: usize,
    ) -> Result<()> {
        src.buffer.get_tensor(layout, src.offset, out, offset)
    }
    /// (optional) Copy between buffers on this stream; `Ok(false)` when the caller must stage.
    fn cpy_tensor_async(
        &self,
        _src: &Storage,
        _src_layout: &Layout,
        _dst: &Storage,
        _dst_layout: &Layout,
    ) -> Result<bool> {
        Ok(false)
    }
    /// Wait for everything queued on this stream.
    fn synchronize(&self) -> Result<()>;
    /// Compute every node of `graph` in order. Roots without storage are allocated in this
    /// backend's compute buffer (and stay valid until the next compute); leaves with inline data
    /// are uploaded first. Unsupported ops are an error naming the node, before anything runs.
    fn graph_compute(&self, graph: &mut Graph) -> Result<()>;
    /// (optional) Compute `graphs` as if one after another (a later graph may read what an
    /// earlier one wrote into bound buffers, such as a KV cache), calling `done(j, graph)`
    /// once graph `j`'s outputs are ready (they may not outlive the call). Defaults to one
    /// [`Backend::graph_compute`] each; the scheduler overlaps them as a pipeline through its
    /// backends (`sched`).
    fn graph_compute_many(
        &self,
        graphs: &mut [Graph],
        done: &mut dyn FnMut(usize, &Graph) -> Result<()>,
    ) -> Result<()> {
        for (j, g) in graphs.iter_mut().enumerate() {
            self.graph_compute(g)?;
            done(j, g)?;
        }
        Ok(())
    }
    /// (optional) Prepare `graph`, whose roots must all have storage, so node ranges can be
    /// computed repeatedly (ggml's `graph_plan_create`); the meta backend runs a device's
    /// program this way, between collectives. Inline data is not uploaded by plans.
    fn graph_plan(&self, _graph: &Graph) -> Result<Box<dyn GraphPlan>> {
        Err(Error::Device {
            device: self.name(),
            reason: "graph plans are not supported".into(),
        })
    }
    /// (optional) Bytes of the compute buffers this backend holds, per device it drives.
    fn compute_buffer_bytes(&self) -> Vec<usize> {
        Vec::new()
    }
    /// (optional) Record `event` at the current point of the stream.
    fn event_record(&self, _event: &dyn Event) -> Result<()> {
        Ok(())
    }
    /// (optional) Make this stream wait for `event`.
    fn event_wait(&self, event: &dyn Event) -> Result<()> {
        event.synchronize()
    }
}

/// A graph prepared by [`Backend::graph_plan`].
pub trait GraphPlan: Send {
    /// Compute the nodes whose indices are in `range`, in order.
    fn compute(&mut self, range: std::ops::Range<usize>) -> Result<()>;
}

/// A marker in a stream.
pub trait Event: Send + Sync {
    /// Block until the event has completed.
    fn synchronize(&self) -> Result<()>;
}

/// Allocate a buffer of `bt` and place `layouts` in it one after another (aligned); returns the
/// buffer and each tensor's offset. For weights and caches, which live across graphs.
pub fn alloc_tensors(
    bt: &dyn BufferType,
    layouts: &[Layout],
) -> Result<(Arc<dyn Buffer>, Vec<usize>)> {
    let align = bt.alignment().max(1);
    let mut offsets = Vec::with_capacity(layouts.len());
    let mut size = 0usize;
    for l in layouts {
        size = size.next_multiple_of(align);
        offsets.push(size);
        size = size
            .checked_add(bt.alloc_size(l))
            .ok_or_else(|| Error::AllocFailed {
                buffer_type: bt.name(),
                size: usize::MAX,
                reason: "total size overflows".into(),
            })?;
    }
    let buf = bt.alloc_buffer(size.max(1))?;
    Ok((buf, offsets))
}

/// Every node of `g` that a backend must compute is one it supports (`supports` says why not):
/// checked before anything runs, the error naming the node, its op and the backend. Plans of
/// the meta backend's per-device programs may hold collectives (`allow_collectives`), which
/// their caller runs between node ranges.
pub fn check_supported(
    g: &Graph,
    backend: &str,
    allow_collectives: bool,
    supports: impl Fn(&Graph, TensorId) -> std::result::Result<(), String>,
) -> Result<()> {
    for id in g.ids() {
        let n = g.node(id);
        if allow_collectives && matches!(n.op, crate::op::Op::Collective(_)) {
            continue;
        }
        if let Err(detail) = supports(g, id) {
            return Err(Error::UnsupportedOp {
                backend: backend.to_string(),
                op: n.op.name().to_string(),
                node: n.name.clone(),
                detail,
            });
        }
    }
    Ok(())
}
