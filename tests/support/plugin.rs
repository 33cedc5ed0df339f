//! A backend from outside the crate: `Wrapped` wraps a CPU device and brings its own
//! communicator (`CountingComm`, which counts its calls and reduces through the host addresses
//! of the buffer handles), and its backend can be told to stall. `tests/meta_plugin.rs` shows
//! the meta backend using it with no change in `meta/`; `tests/targets.rs` runs the whole
//! harness on it ([`PLUGIN`]).

use super::target::Target;
use metashard::backend::{Backend, Device, DeviceKind, GraphPlan, MemoryInfo};
use metashard::buffer::{BufferRange, BufferType};
use metashard::collectives::{Communicator, CommunicatorFactory, CpuCommunicator, SliceLayout};
use metashard::graph::{Graph, TensorId};
use metashard::{DType, Result, parse_devices};
use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// What the plug-in records.
#[derive(Default)]
pub struct Stats {
    pub all_reduces: AtomicUsize,
    pub gathers: AtomicUsize,
    pub scatters: AtomicUsize,
    pub groups_made: AtomicUsize,
    /// When set, the next plan compute of a device with `stalls` sleeps this long first.
    pub stall_ms: AtomicUsize,
}

pub struct Wrapped {
    inner: Arc<dyn Device>,
    stats: Arc<Stats>,
    /// Whether this device is the one that stalls when `stats.stall_ms` is set.
    stalls: bool,
}

pub struct CountingFactory {
    stats: Arc<Stats>,
}

/// A communicator of its own: counts calls, then works on the host addresses of the handles.
pub struct CountingComm {
    host: CpuCommunicator,
    stats: Arc<Stats>,
}

/// # Safety
/// The slice must not outlive the call that got the handle; the meta backend leaves the tensor
/// alone during a collective (the `Communicator` contract).
unsafe fn host<'a>(b: &BufferRange) -> Result<&'a mut [u8]> {
    let p = b.host_ptr()?;
    // SAFETY: `host_ptr` checked that the range lies in the buffer's host memory; exclusivity
    // is the caller's contract above.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, b.len) })
}

impl Communicator for CountingComm {
    fn name(&self) -> String {
        format!("counting({})", self.host.world_size())
    }
    fn world_size(&self) -> usize {
        self.host.world_size()
    }
    fn all_reduce(&self, rank: usize, buf: &BufferRange, dtype: DType) -> Result<()> {
        self.stats.all_reduces.fetch_add(1, Ordering::Relaxed);
        // SAFETY: within this call (the Communicator contract).
        self.host.all_reduce(rank, unsafe { host(buf)? }, dtype)
    }
    fn all_gather(
        &self,
        rank: usize,
        local: &BufferRange,
        full: &BufferRange,
        layout: &SliceLayout,
    ) -> Result<()> {
        self.stats.gathers.fetch_add(1, Ordering::Relaxed);
        // SAFETY: within this call; `local` and `full` are distinct tensors.
        let (l, f) = unsafe { (host(local)?, host(full)?) };
        self.host.all_gather(rank, l, f, layout)
    }
    fn reduce_scatter(
        &self,
        rank: usize,
        full: &BufferRange,
        local: &BufferRange,
        layout: &SliceLayout,
        dtype: DType,
    ) -> Result<()> {
        self.stats.scatters.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as in all_gather.
        let (f, l) = unsafe { (host(full)?, host(local)?) };
        self.host.reduce_scatter(rank, f, l, layout, dtype)
    }
    fn broadcast(&self, rank: usize, root: usize, buf: &BufferRange) -> Result<()> {
        // SAFETY: within this call.
        self.host.broadcast(rank, root, unsafe { host(buf)? })
    }
    fn abort(&self, rank: usize, reason: &str) {
        Communicator::abort(&self.host, rank, reason)
    }
    fn failure(&self) -> Option<String> {
        self.host.failure()
    }
}

impl CommunicatorFactory for CountingFactory {
    fn name(&self) -> String {
        "counting".into()
    }
    fn create(
        &self,
        devices: &[Arc<dyn Device>],
        timeout: Duration,
    ) -> Result<Arc<dyn Communicator>> {
        self.stats.groups_made.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(CountingComm {
            host: CpuCommunicator::with_timeout(devices.len(), timeout)?,
            stats: self.stats.clone(),
        }))
    }
}

impl Device for Wrapped {
    fn name(&self) -> String {
        format!("wrapped-{}", self.inner.name())
    }
    fn description(&self) -> String {
        format!("a test plug-in over {}", self.inner.description())
    }
    fn memory(&self) -> MemoryInfo {
        self.inner.memory()
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        self.inner.buffer_type()
    }
    fn init_backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(WrappedBackend {
            inner: self.inner.init_backend()?,
            stats: self.stats.clone(),
            stalls: self.stalls,
        }))
    }
    fn supports_op(&self, graph: &Graph, id: TensorId) -> std::result::Result<(), String> {
        self.inner.supports_op(graph, id)
    }
    fn supports_buffer_type(&self, bt: &dyn BufferType) -> bool {
        self.inner.supports_buffer_type(bt)
    }
    fn communicators(&self) -> Vec<Arc<dyn CommunicatorFactory>> {
        vec![Arc::new(CountingFactory {
            stats: self.stats.clone(),
        })]
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

pub struct WrappedBackend {
    inner: Arc<dyn Backend>,
    stats: Arc<Stats>,
    stalls: bool,
}

pub struct WrappedPlan {
    inner: Box<dyn GraphPlan>,
    stats: Arc<Stats>,
    stalls: bool,
}

impl GraphPlan for WrappedPlan {
    fn compute(&mut self, range: std::ops::Range<usize>) -> Result<()> {
        if self.stalls {
            let ms = self.stats.stall_ms.swap(0, Ordering::AcqRel);
            if ms > 0 {
                std::thread::sleep(Duration::from_millis(ms as u64));
            }
        }
        self.inner.compute(range)
    }
}

impl Backend for WrappedBackend {
    fn name(&self) -> String {
        format!("wrapped-{}", self.inner.name())
    }
    fn device(&self) -> Arc<dyn Device> {
        self.inner.device()
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    fn graph_compute(&self, graph: &mut Graph) -> Result<()> {
        self.inner.graph_compute(graph)
    }
    fn graph_plan(&self, graph: &Graph) -> Result<Box<dyn GraphPlan>> {
        Ok(Box::new(WrappedPlan {
            inner: self.inner.graph_plan(graph)?,
            stats: self.stats.clone(),
            stalls: self.stalls,
        }))
    }
}

/// `n` wrapped CPU devices of one thread; device `stalling` (if any) is the one that stalls.
pub fn wrapped(n: usize, stats: &Arc<Stats>, stalling: Option<usize>) -> Vec<Arc<dyn Device>> {
    parse_devices(&format!("cpu:{n}x1"))
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(d, inner)| {
            Arc::new(Wrapped {
                inner,
                stats: stats.clone(),
                stalls: stalling == Some(d),
            }) as Arc<dyn Device>
        })
        .collect()
}

fn plugin_devices(n: usize, threads: usize) -> Result<Vec<Arc<dyn Device>>> {
    let stats = Arc::new(Stats::default());
    Ok(parse_devices(&format!("cpu:{n}x{threads}"))?
        .into_iter()
        .map(|inner| {
            Arc::new(Wrapped {
                inner,
                stats: stats.clone(),
                stalls: false,
            }) as Arc<dyn Device>
        })
        .collect())
}

/// The plug-in as a harness target.
pub const PLUGIN: Target = Target::new("plugin", plugin_devices);
