//! The CPU stream: `CpuBackend::graph_compute` checks every node against the kernels, allocates
//! unallocated roots in its compute buffer, uploads inline inputs, and runs the nodes in order
//! on the device's thread pool, all threads working on each node and meeting at a barrier
//! between nodes (ggml's CPU execution model).

use super::device::CpuDevice;
use super::ops;
use super::pool::ThreadPool;
use super::view::{ComputeParams, TensorView};
use crate::alloc::GraphAllocator;
use crate::backend::{Backend, Device};
use crate::buffer::BufferType;
use crate::graph::{Graph, TensorId};
use crate::op::Op;
use crate::{Error, Result};
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One node ready to run.
struct ExecNode {
    id: TensorId,
    op: Op,
    dst: TensorView,
    src: SmallVec<[TensorView; 4]>,
}

/// The scratch pointer handed to every pool thread.
#[derive(Clone, Copy)]
struct WorkPtr(*mut u8);
// SAFETY: the scratch memory outlives the pool job (held under the state lock for the whole
// compute), and kernels partition it by thread or order their accesses with barriers.
unsafe impl Sync for WorkPtr {}

impl WorkPtr {
    fn get(self) -> *mut u8 {
        self.0
    }
}

struct State {
    alloc: GraphAllocator,
    /// Scratch shared by the threads of one node (64-byte aligned via u64x8 chunks).
    work: Vec<[u64; 8]>,
}

pub struct CpuBackend {
    device: Arc<CpuDevice>,
    pool: ThreadPool,
    state: Mutex<State>,
}

impl CpuBackend {
    pub fn new(device: CpuDevice) -> Self {
        let pool = ThreadPool::new(device.threads, &format!("cpu{}", device.index));
        CpuBackend {
            device: Arc::new(device),
            pool,
            state: Mutex::new(State {
                alloc: GraphAllocator::new(Arc::new(super::buffer::CpuBufferType)),
                work: Vec::new(),
            }),
        }
    }

    pub fn threads(&self) -> usize {
        self.pool.nth()
    }

    /// Bytes of the compute buffer after the last graph.
    pub fn compute_buffer_size(&self) -> usize {
        self.state.lock().alloc.buffer_size()
    }
}

/// A node's view in host memory, or an error if its bytes are not in a host buffer.
fn host_view(g: &Graph, id: TensorId, backend: &str) -> Result<TensorView> {
    let n = g.node(id);
    let st = g.storage(id).ok_or_else(|| Error::NoStorage {
        tensor: n.name.clone(),
        reason: "not allocated".into(),
    })?;
    let data = st.host_ptr().ok_or_else(|| Error::IncompatibleBuffer {
        backend: backend.to_string(),
        tensor: n.name.clone(),
        buffer_type: st.buffer.buffer_type().name(),
    })?;
    Ok(TensorView {
        data,
        dtype: n.layout.dtype,
        ne: n.layout.ne,
        nb: n.layout.nb,
    })
}

/// A view with no data, for support and work-size queries.
fn shape_view(g: &Graph, id: TensorId) -> TensorView {
    let l = g.layout(id);
    TensorView {
        data: std::ptr::null_mut(),
        dtype: l.dtype,
        ne: l.ne,
        nb: l.nb,
    }
}

/// Whether the CPU kernels compute node `id`.
pub fn supports_node(g: &Graph, id: TensorId) -> std::result::Result<(), String> {
    let n = g.node(id);
    if n.op.is_noop() {
        return Ok(());
    }
    let src: SmallVec<[TensorView; 4]> = n.src.iter().map(|&s| shape_view(g, s)).collect();
    ops::supports(&n.op, &shape_view(g, id), &src)
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        self.device.name()
    }

    fn device(&self) -> Arc<dyn Device> {
        self.device.clone()
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn graph_compute(&self, g: &mut Graph) -> Result<()> {
        let name = self.name();
        // Pass 1: every node must have a kernel, before anything runs.
        for id in g.ids() {
            if let Err(detail) = supports_node(g, id) {
                let n = g.node(id);
                return Err(Error::UnsupportedOp {
                    backend: name,
                    op: n.op.name().to_string(),
                    node: n.name.clone(),
                    detail,
                });
            }
        }
        let mut state = self.state.lock();
        // Pass 2: allocate roots without storage in the compute buffer.
        state.alloc.alloc_graph(g)?;
        // Pass 3: upload inline inputs.
        for n in g.nodes() {
            if let (Some(data), Some(st)) = (&n.data, &n.storage) {
                st.set(&n.layout, data)?;
            }
        }
        // Pass 4: resolve views and size the scratch memory.
        let nth = self.pool.nth();
        let exact = self.device.options.exact;
        let mut exec = Vec::new();
        let mut wsize = 0usize;
        for id in g.ids() {
            let n = g.node(id);
            let dst = host_view(g, id, &name)?;
            if n.op.is_noop() || dst.nelements() == 0 {
                continue;
            }
            let src = n
                .src
                .iter()
                .map(|&s| host_view(g, s, &name))
                .collect::<Result<SmallVec<_>>>()?;
            wsize = wsize.max(ops::work_size(&n.op, &dst, &src, nth, exact));
            exec.push(ExecNode {
                id,
                op: n.op,
                dst,
                src,
            });
        }
        let words = wsize.div_ceil(64);
        if state.work.len() < words {
            state.work = vec![[0u64; 8]; words];
        }
        let wdata = WorkPtr(state.work.as_mut_ptr().cast::<u8>());
        // Pass 5: run, all threads on each node, a barrier between nodes.
        let current = AtomicUsize::new(0);
        let run = self.pool.run(&|ith, barrier| {
            let p = ComputeParams {
                ith,
                nth,
                wdata: wdata.get(),
                wsize: words * 64,
                barrier,
                exact,
            };
            for (i, e) in exec.iter().enumerate() {
                if ith == 0 {
                    current.store(i, Ordering::Relaxed);
                }
                ops::forward(&p, &e.op, &e.dst, &e.src);
                barrier.wait();
            }
        });
        run.map_err(|msg| {
            let node = exec
                .get(current.load(Ordering::Relaxed))
                .map_or("?".to_string(), |e| g.name(e.id).to_string());
            Error::Device {
                device: name.clone(),
                reason: format!("a kernel panicked at node `{node}`: {msg}"),
            }
        })
    }
}

impl CpuBackend {
    /// The buffer type this backend computes in.
    pub fn buffer_type(&self) -> Arc<dyn BufferType> {
        self.device.buffer_type()
    }
}
