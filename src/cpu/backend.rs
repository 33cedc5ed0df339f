//! The CPU stream: `CpuBackend::graph_compute` checks every node against the kernels, allocates
//! unallocated roots in its compute buffer, uploads inline inputs, and runs the nodes in order
//! on the device's thread pool, all threads working on each node and meeting at a barrier
//! between nodes (ggml's CPU execution model). `graph_plan` prepares an allocated graph once
//! and computes node ranges of it on demand (used by the meta backend between collectives). A
//! kernel that reports an error (a row id out of range) stops every thread at the next barrier
//! and the error names the node; a kernel that panics is caught by the pool.

use super::device::CpuDevice;
use super::matmul::{self, Isa};
use super::ops;
use super::pool::ThreadPool;
use super::view::{ComputeParams, Precision, TensorView};
use crate::alloc::GraphAllocator;
use crate::backend::{Backend, Device, GraphPlan, check_supported};
use crate::buffer::{Buffer, Storage};
use crate::graph::{Graph, Signature, TensorId};
use crate::op::Op;
use crate::{Error, Result};
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

/// One node ready to run.
struct ExecNode {
    id: TensorId,
    name: String,
    op: Op,
    dst: TensorView,
    src: SmallVec<[TensorView; 4]>,
    /// Threads must meet after this node: the next one reads what it wrote, writes what it
    /// read, or shares scratch with it (see `plan_barriers`).
    barrier_after: bool,
    /// The precision its kernels run at: the device's, but [`Precision::Exact`] for products
    /// whose rows make 8-bit activations slower ([`matmul::node_precision`]).
    precision: Precision,
}

/// The scratch pointer handed to every pool thread.
#[derive(Clone, Copy)]
struct WorkPtr(*mut u8);
// SAFETY: the scratch memory outlives the pool job (owned by the plan, which `compute` borrows
// mutably for the whole job), and kernels partition it by thread or order accesses by barriers.
unsafe impl Sync for WorkPtr {}

impl WorkPtr {
    fn get(self) -> *mut u8 {
        self.0
    }
}

struct Inner {
    device: CpuDevice,
    pool: ThreadPool,
    /// Scratch memory handed from one plan to the next (no fresh zeroed pages per step).
    spare_work: Mutex<Vec<[u64; 8]>>,
}

pub struct CpuBackend {
    inner: Arc<Inner>,
    alloc: Mutex<GraphAllocator>,
    /// The last graph's allocation and plan (locked after `alloc`).
    last: Mutex<Option<Reuse>>,
    /// Graphs allocated and planned by `graph_compute` (not reused).
    graphs_planned: AtomicUsize,
}

/// What `graph_compute` keeps of the last graph it ran: its structure, the offsets the
/// allocator gave its roots, and its plan, holding its buffers only weakly (a kept plan does
/// not keep a dropped model's weights alive; a buffer gone makes it unusable).
struct Reuse {
    key: Signature,
    offsets: Vec<(TensorId, usize)>,
    compute: Weak<dyn Buffer>,
    buffers: Vec<Weak<dyn Buffer>>,
    plan: CpuPlan,
}

impl Reuse {
    /// Keep `plan` (made for `g` after allocation at `offsets` in `compute`) for later graphs.
    fn keep(
        key: Signature,
        offsets: Vec<(TensorId, usize)>,
        compute: &Arc<dyn Buffer>,
        mut plan: CpuPlan,
    ) -> Reuse {
        let buffers = plan
            ._buffers
            .drain(..)
            .map(|b| Arc::downgrade(&b))
            .collect();
        Reuse {
            key,
            offsets,
            compute: Arc::downgrade(compute),
            buffers,
            plan,
        }
    }

    /// The kept plan, if `g` has the kept structure, node names and live buffers, with `g`'s
    /// roots bound where the kept graph's were (in `compute`, the allocator's buffer now).
    /// A `Weak` keeps its allocation, so a live buffer at a kept address is the kept buffer.
    fn revive(
        mut self,
        key: &Signature,
        g: &mut Graph,
        compute: Option<&Arc<dyn Buffer>>,
    ) -> Option<(CpuPlan, Vec<(TensorId, usize)>)> {
        let compute = compute?;
        let same = self.key == *key
            && std::ptr::addr_eq(self.compute.as_ptr(), Arc::as_ptr(compute))
            && self.plan.exec.iter().all(|e| e.name == g.node(e.id).name);
        if !same {
            return None;
        }
        let buffers = self
            .buffers
            .iter()
            .map(Weak::upgrade)
            .collect::<Option<Vec<_>>>()?;
        for &(id, off) in &self.offsets {
            g.node_mut(id).storage = Some(Storage::new(compute.clone(), off));
        }
        self.plan._buffers = buffers;
        Some((self.plan, self.offsets))
    }
}

impl CpuBackend {
    /// The backend of `device` with its thread pool; an error when the system refuses a thread.
    pub fn new(device: CpuDevice) -> Result<Self> {
        let pool = ThreadPool::new(device.threads, &format!("cpu{}", device.index))?;
        Ok(CpuBackend {
            inner: Arc::new(Inner {
                device,
                pool,
                spare_work: Mutex::new(Vec::new()),
            }),
            alloc: Mutex::new(GraphAllocator::new(Arc::new(super::buffer::CpuBufferType))),
            last: Mutex::new(None),
            graphs_planned: AtomicUsize::new(0),
        })
    }

    /// How many graphs `graph_compute` allocated and planned; a graph run with the last one's
    /// plan does not count.
    pub fn graphs_planned(&self) -> usize {
        self.graphs_planned.load(Ordering::Relaxed)
    }

    pub fn threads(&self) -> usize {
        self.inner.pool.nth()
    }

    /// Bytes of the compute buffer after the last graph.
    pub fn compute_buffer_size(&self) -> usize {
        self.alloc.lock().buffer_size()
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

/// A prepared graph: resolved host views of every computed node, and scratch memory laid out
/// as one shared region (as large as any node's shared need) followed by one private slot per
/// thread (as large as any node's per-thread need).
struct CpuPlan {
    inner: Arc<Inner>,
    exec: Vec<ExecNode>,
    work: Vec<[u64; 8]>,
    shared: usize,
    slot: usize,
    /// Each node's work-item counter (see `ComputeParams::items`), set to 0 before its range
    /// runs: made once with the plan, not per range.
    items: Vec<AtomicUsize>,
    /// Keeps every buffer the views point into alive while the plan exists.
    _buffers: Vec<Arc<dyn Buffer>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if super::profile::enabled()
            && let Some(r) = super::profile::take_report()
        {
            eprintln!(
                "CPU profile (METASHARD_CPU_PROFILE), up to device {}:\n{r}",
                self.device.name()
            );
        }
    }
}

impl Drop for CpuPlan {
    fn drop(&mut self) {
        let mut spare = self.inner.spare_work.lock();
        if self.work.len() > spare.len() {
            *spare = std::mem::take(&mut self.work);
        }
    }
}

/// One access to a tensor since the last barrier: its bytes, the view's identity (address,
/// type, shape, strides), and the node's [`ops::Split`] when each thread touches only its own
/// share of the view.
struct Access {
    span: (usize, usize),
    view: (usize, crate::DType, [usize; 4], [usize; 4]),
    split: Option<ops::Split>,
}

impl Access {
    fn of(t: &TensorView, split: Option<ops::Split>) -> Access {
        let start = t.data as usize;
        Access {
            span: (start, start + t.layout().nbytes()),
            view: (start, t.dtype, t.ne, t.nb),
            split,
        }
    }

    /// Whether this access and `b` need no barrier between them: disjoint bytes, or the same
    /// view split the same way by both nodes (each thread touches only what it touched).
    fn compatible(&self, b: &Access) -> bool {
        let (x, y) = (self.span, b.span);
        let disjoint = x.0 >= x.1 || !(x.0 < y.1 && y.0 < x.1);
        disjoint || (self.split.is_some() && self.split == b.split && self.view == b.view)
    }
}

/// Decide where threads must meet. Since the last barrier, keep the accesses read and written
/// and whether shared scratch was used; a node that reads a written range, writes a read or
/// written range, or uses shared scratch after another user of it needs a barrier before it,
/// unless both accesses are to the same view with the same split (a chain of element-wise
/// and row-wise nodes: norm, weight, residual add). Without one, a thread that finished its
/// share of a node goes straight on to the next (the Q, K and V projections of a layer).
fn plan_barriers(exec: &mut [ExecNode], shared: &[bool], nth: usize) {
    let (mut reads, mut writes) = (Vec::<Access>::new(), Vec::<Access>::new());
    let mut used_shared = false;
    for i in 0..exec.len() {
        let e = &exec[i];
        let split = ops::split(&e.op, &e.dst, &e.src, nth);
        let w = Access::of(&e.dst, split);
        let rs: SmallVec<[Access; 4]> = (e.src.iter().enumerate())
            .map(|(k, s)| {
                let aligned = ops::reads_aligned(&e.op, &e.dst, &e.src, k);
                Access::of(s, split.filter(|_| aligned))
            })
            .collect();
        let clash = |a: &Access, set: &[Access]| set.iter().any(|b| !a.compatible(b));
        let conflict = rs.iter().any(|r| clash(r, &writes))
            || clash(&w, &reads)
            || clash(&w, &writes)
            || (shared[i] && used_shared);
        if conflict && i > 0 {
            exec[i - 1].barrier_after = true;
            reads.clear();
            writes.clear();
            used_shared = false;
        }
        reads.extend(rs);
        writes.push(w);
        used_shared |= shared[i];
    }
}

fn make_plan(inner: &Arc<Inner>, g: &Graph) -> Result<CpuPlan> {
    let name = inner.device.name();
    check_supported(g, &name, true, supports_node)?;
    let (nth, precision) = (inner.pool.nth(), inner.device.options.precision);
    let mut exec = Vec::new();
    let mut uses_shared = Vec::new();
    let (mut shared, mut slot) = (0usize, 0usize);
    let mut buffers: Vec<Arc<dyn Buffer>> = Vec::new();
    for id in g.ids() {
        let n = g.node(id);
        let dst = host_view(g, id, &name)?;
        if let Some(st) = g.storage(id)
            && !buffers.iter().any(|b| Arc::ptr_eq(b, &st.buffer))
        {
            buffers.push(st.buffer);
        }
        if n.op.is_noop() || matches!(n.op, Op::Collective(_)) || dst.nelements() == 0 {
            continue;
        }
        let src = n
            .src
            .iter()
            .map(|&s| host_view(g, s, &name))
            .collect::<Result<SmallVec<_>>>()?;
        let precision = match n.op {
            Op::MulMat => matmul::node_precision(&src[0], &src[1], precision, Isa::detect()),
            _ => precision,
        };
        let sc = ops::scratch(&n.op, &dst, &src, nth, precision);
        shared = shared.max(sc.shared);
        slot = slot.max(sc.per_thread);
        uses_shared.push(sc.shared > 0);
        exec.push(ExecNode {
            id,
            name: n.name.clone(),
            op: n.op,
            dst,
            src,
            barrier_after: false,
            precision,
        });
    }
    plan_barriers(&mut exec, &uses_shared, nth);
    let (shared, slot) = (shared.next_multiple_of(64), slot.next_multiple_of(64));
    let words = (shared + nth * slot).div_ceil(64);
    let mut work = std::mem::take(&mut *inner.spare_work.lock());
    if work.len() < words {
        work = vec![[0u64; 8]; words];
    }
    Ok(CpuPlan {
        inner: inner.clone(),
        items: exec.iter().map(|_| AtomicUsize::new(0)).collect(),
        exec,
        work,
        shared,
        slot,
        _buffers: buffers,
    })
}

impl GraphPlan for CpuPlan {
    fn compute(&mut self, range: std::ops::Range<usize>) -> Result<()> {
        let lo = self.exec.partition_point(|e| e.id.index() < range.start);
        let hi = self.exec.partition_point(|e| e.id.index() < range.end);
        let nodes = &self.exec[lo..hi];
        if nodes.is_empty() {
            return Ok(());
        }
        let pool = &self.inner.pool;
        let (nth, precision) = (pool.nth(), self.inner.device.options.precision);
        let (shared, slot) = (self.shared, self.slot);
        let wdata = WorkPtr(self.work.as_mut_ptr().cast::<u8>());
        let current = AtomicUsize::new(0);
        // A kernel's error, per thread: the position in `nodes` and what it reported. The
        // lowest failing position is published in `failed_at` before the thread reaches the
        // next barrier, so every thread reads the same verdict after that barrier and all stop
        // there together (a thread stopping alone would leave the others waiting).
        let errors: Vec<Mutex<Option<(usize, ops::KernelError)>>> =
            (0..nth).map(|_| Mutex::new(None)).collect();
        let failed_at = AtomicUsize::new(usize::MAX);
        // The range's work-item counters, from 0.
        let items = &mut self.items[lo..hi];
        for c in items.iter_mut() {
            *c.get_mut() = 0;
        }
        let items = &*items;
        // Per node: compute and barrier-wait nanoseconds summed over threads (profile only).
        let prof = super::profile::enabled();
        let times: Vec<[AtomicU64; 2]> = match prof {
            true => nodes.iter().map(|_| Default::default()).collect(),
            false => Vec::new(),
        };
        let run = pool.run(&|ith, barrier| {
            let base = wdata.get();
            let p = ComputeParams {
                ith,
                nth,
                wdata: base,
                wsize: shared,
                // SAFETY: the work buffer holds shared + nth * slot bytes (make_plan).
                tdata: unsafe { base.add(shared + ith * slot) },
                tsize: slot,
                barrier,
                precision,
                items: None,
            };
            for (i, e) in nodes.iter().enumerate() {
                if ith == 0 {
                    current.store(i, Ordering::Relaxed);
                }
                let p = ComputeParams {
                    items: (nth > 1).then(|| &items[i]),
                    precision: e.precision,
                    ..p
                };
                let t0 = prof.then(Instant::now);
                if let Err(err) = ops::forward(&p, &e.op, &e.dst, &e.src) {
                    errors[ith].lock().get_or_insert((i, err));
                    failed_at.fetch_min(i, Ordering::AcqRel);
                }
                let t1 = prof.then(Instant::now);
                if e.barrier_after {
                    barrier.wait();
                }
                if let (Some(t0), Some(t1)) = (t0, t1) {
                    let ns = |d: std::time::Duration| d.as_nanos() as u64;
                    times[i][0].fetch_add(ns(t1 - t0), Ordering::Relaxed);
                    times[i][1].fetch_add(ns(t1.elapsed()), Ordering::Relaxed);
                }
                if e.barrier_after && failed_at.load(Ordering::Acquire) <= i {
                    break;
                }
            }
        });
        for (e, t) in nodes.iter().zip(&times) {
            let [c, w] = t.each_ref().map(|a| a.load(Ordering::Relaxed));
            // A product's row names its weight's type and shape, so that a model's products of
            // different types (a Q4_K_M file mixes four) are told apart.
            let weight = match (e.op.name(), e.src.first()) {
                ("mul_mat" | "mul_mat_id", Some(w)) => {
                    format!(" [{:?} {}x{}]", w.dtype, w.ne[0], w.ne[1])
                }
                _ => String::new(),
            };
            super::profile::record(&e.name, &weight, e.op.name(), c, w, e.barrier_after);
        }
        run.map_err(|msg| {
            let node = nodes
                .get(current.load(Ordering::Relaxed))
                .map_or("?", |e| e.name.as_str());
            Error::Device {
                device: self.inner.device.name(),
                reason: format!("a kernel panicked at node `{node}`: {msg}"),
            }
        })?;
        // The first failing node's error (several threads may have failed there).
        let first = errors
            .into_iter()
            .filter_map(|m| m.into_inner())
            .min_by_key(|&(i, _)| i);
        match first {
            None => Ok(()),
            Some((i, err)) => Err(kernel_error(&self.inner.device.name(), &nodes[i], err)),
        }
    }
}

/// A kernel's report as an error naming the device, the node and its op.
fn kernel_error(device: &str, e: &ExecNode, err: ops::KernelError) -> Error {
    match err {
        ops::KernelError::RowId { id, at, rows } => Error::RowIdOutOfRange {
            device: device.to_string(),
            node: e.name.clone(),
            op: e.op.name(),
            id,
            index: at,
            rows,
        },
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        self.inner.device.name()
    }

    fn device(&self) -> Arc<dyn Device> {
        let d = &self.inner.device;
        Arc::new(CpuDevice::new(d.index, d.count, d.threads, d.options))
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn graph_compute(&self, g: &mut Graph) -> Result<()> {
        let key = g.signature();
        let mut alloc = self.alloc.lock();
        let mut last = self.last.lock();
        let kept = last.take().and_then(|r| r.revive(&key, g, alloc.buffer()));
        let (mut plan, offsets) = match kept {
            Some(k) => k,
            None => {
                check_supported(g, &self.name(), false, supports_node)?;
                let a = alloc.alloc_graph(g)?;
                let offsets = g
                    .ids()
                    .filter_map(|id| Some((id, a.offsets[id.index()]?)))
                    .collect();
                self.graphs_planned.fetch_add(1, Ordering::Relaxed);
                (make_plan(&self.inner, g)?, offsets)
            }
        };
        for n in g.nodes() {
            if let (Some(data), Some(st)) = (&n.data, &n.storage) {
                st.set(&n.layout, data)?;
            }
        }
        plan.compute(0..g.len())?;
        if let Some(buf) = alloc.buffer() {
            *last = Some(Reuse::keep(key, offsets, buf, plan));
        }
        Ok(())
    }

    fn compute_buffer_bytes(&self) -> Vec<usize> {
        vec![self.compute_buffer_size()]
    }

    fn graph_plan(&self, g: &Graph) -> Result<Box<dyn GraphPlan>> {
        Ok(Box::new(make_plan(&self.inner, g)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn node(dst: usize, srcs: &[usize]) -> ExecNode {
        let v = |addr: usize| TensorView {
            data: addr as *mut u8,
            dtype: DType::F32,
            ne: [16, 1, 1, 1],
            nb: [4, 64, 64, 64],
        };
        ExecNode {
            id: TensorId(0),
            name: String::new(),
            op: Op::Cont,
            dst: v(dst),
            src: srcs.iter().map(|&a| v(a)).collect(),
            barrier_after: false,
            precision: Precision::Exact,
        }
    }

    /// A step-like graph: weights and an input row (inline data, shifted by `step`), a
    /// product, a residual add and a norm; `rows` of output, the norm named `norm`.
    fn step_graph(step: usize, rows: usize, norm: &str) -> (Graph, TensorId) {
        let v = |n: usize, k: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * 7 + k * 13) % 17) as f32 / 8.0 - 1.0)
                .collect()
        };
        let mut g = Graph::new();
        let w = g.input_f32("w", [64, 48, 1, 1], &v(64 * 48, 1)).unwrap();
        let x = g
            .input_f32("x", [64, rows, 1, 1], &v(64 * rows, step))
            .unwrap();
        let r = g
            .input_f32("r", [48, rows, 1, 1], &v(48 * rows, step + 5))
            .unwrap();
        let y = g.mul_mat(w, x).unwrap();
        let y = g.add(y, r).unwrap();
        let y = g.rms_norm(y, 1e-6).unwrap();
        g.set_name(y, norm);
        (g, y)
    }

    #[test]
    fn a_graph_of_the_last_structure_reuses_its_plan_with_the_same_results() {
        let b = CpuBackend::new(CpuDevice::new(
            0,
            1,
            2,
            super::super::device::CpuOptions::exact(),
        ))
        .unwrap();
        let run = |b: &CpuBackend, step: usize, rows: usize, norm: &str| {
            let (mut g, y) = step_graph(step, rows, norm);
            b.graph_compute(&mut g).unwrap();
            g.read_f32(y).unwrap()
        };
        for step in 0..4 {
            let fresh = CpuBackend::new(CpuDevice::new(
                0,
                1,
                2,
                super::super::device::CpuOptions::exact(),
            ))
            .unwrap();
            let want = run(&fresh, step, 1, "norm");
            let got = run(&b, step, 1, "norm");
            assert_eq!(
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "step {step}"
            );
            // Only the first step was planned; the others differ in their inputs only.
            assert_eq!(b.graphs_planned(), 1);
        }
        // Another shape is planned, and so is the first one after it (one graph is kept);
        // so is a graph that differs only in a node's name (errors name the node).
        run(&b, 0, 3, "norm");
        assert_eq!(b.graphs_planned(), 2);
        run(&b, 0, 1, "norm");
        assert_eq!(b.graphs_planned(), 3);
        run(&b, 0, 1, "other");
        assert_eq!(b.graphs_planned(), 4);
    }

    fn barriers(mut exec: Vec<ExecNode>, shared: &[bool]) -> Vec<bool> {
        plan_barriers(&mut exec, shared, 2);
        exec.iter().map(|e| e.barrier_after).collect()
    }

    #[test]
    fn barriers_only_where_nodes_depend() {
        // x at 0; q, k, v read x and write 64, 128, 192; then o reads q: only o waits.
        let exec = vec![
            node(64, &[0]),
            node(128, &[0]),
            node(192, &[0]),
            node(256, &[64]),
        ];
        assert_eq!(barriers(exec, &[false; 4]), [false, false, true, false]);
        // Write after read: the second node overwrites what the first reads.
        let exec = vec![node(64, &[0]), node(0, &[128])];
        assert_eq!(barriers(exec, &[false; 2]), [true, false]);
        // Two users of the shared scratch (two quantized matmuls) never overlap.
        let exec = vec![node(64, &[0]), node(128, &[0])];
        assert_eq!(barriers(exec, &[true, true]), [true, false]);
        // Write after write.
        let exec = vec![node(64, &[0]), node(64, &[128])];
        assert_eq!(barriers(exec, &[false; 2]), [true, false]);
    }

    /// A node `op` writing a packed f32 `[n0, rows]` at `dst` from sources `(address, n0,
    /// rows)`.
    fn shaped(
        op: Op,
        dst: usize,
        n0: usize,
        rows: usize,
        srcs: &[(usize, usize, usize)],
    ) -> ExecNode {
        let v = |addr: usize, n0: usize, rows: usize| TensorView {
            data: addr as *mut u8,
            dtype: DType::F32,
            ne: [n0, rows, 1, 1],
            nb: [4, 4 * n0, 4 * n0 * rows, 4 * n0 * rows],
        };
        ExecNode {
            op,
            dst: v(dst, n0, rows),
            src: srcs.iter().map(|&(a, n, r)| v(a, n, r)).collect(),
            ..node(0, &[])
        }
    }

    #[test]
    fn nodes_split_alike_over_the_same_view_need_no_barrier() {
        use crate::op::{BinaryOp, UnaryOp};
        let (norm, mul, add) = (
            Op::RmsNorm { eps: 1e-6 },
            Op::Binary(BinaryOp::Mul),
            Op::Binary(BinaryOp::Add),
        );
        // One decoding row of 640: norm, times a weight (broadcast, never written), plus the
        // residual, norm again, all on whole rows: no barrier until the product.
        let k = 1 << 20;
        let exec = vec![
            shaped(norm, k, 640, 1, &[(0, 640, 1)]),
            shaped(mul, 2 * k, 640, 1, &[(k, 640, 1), (9 * k, 640, 1)]),
            shaped(add, 3 * k, 640, 1, &[(2 * k, 640, 1), (0, 640, 1)]),
            shaped(norm, 4 * k, 640, 1, &[(3 * k, 640, 1)]),
            shaped(
                Op::MulMat,
                5 * k,
                64,
                1,
                &[(8 * k, 640, 64), (4 * k, 640, 1)],
            ),
        ];
        assert_eq!(
            barriers(exec, &[false; 5]),
            [false, false, false, true, false]
        );
        // A long row is split by columns: GELU then the product with `up` share the split,
        // but a norm of the result takes whole rows and must wait.
        let exec = vec![
            shaped(Op::Unary(UnaryOp::Gelu), k, 4096, 1, &[(0, 4096, 1)]),
            shaped(mul, 2 * k, 4096, 1, &[(k, 4096, 1), (3 * k, 4096, 1)]),
            shaped(norm, 4 * k, 4096, 1, &[(2 * k, 4096, 1)]),
        ];
        assert_eq!(barriers(exec, &[false; 3]), [false, true, false]);
        // The same bytes through another view (a reshape to 4 rows) are not the same split.
        let exec = vec![
            shaped(norm, k, 640, 1, &[(0, 640, 1)]),
            shaped(norm, 2 * k, 160, 4, &[(k, 160, 4)]),
        ];
        assert_eq!(barriers(exec, &[false; 2]), [true, false]);
        // A broadcast read of a written tensor is not aligned.
        let exec = vec![
            shaped(norm, k, 640, 1, &[(0, 640, 1)]),
            shaped(mul, 2 * k, 640, 2, &[(3 * k, 640, 2), (k, 640, 1)]),
        ];
        assert_eq!(barriers(exec, &[false; 2]), [true, false]);
    }

    /// `--q8` quantizes a product's activations up to `q8_max_rows` rows and runs it in f32
    /// above: the larger product equals the exact run bit for bit, the smaller one does not.
    #[test]
    fn q8_nodes_above_the_row_cutoff_run_exact() {
        use crate::cpu::device::CpuOptions;
        use crate::dtype::f32_to_bytes;
        let (k, n) = (256, 16);
        let vals = |len: usize, seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| (((i * 7919 + seed) % 1013) as f32 / 1013.0 - 0.5) * 3.0)
                .collect()
        };
        for dt in [DType::Q5_0, DType::Q4_K, DType::Q8_0, DType::Q3_K] {
            let cut = matmul::q8_max_rows(dt, Isa::detect());
            let big = if cut == usize::MAX { 64 } else { cut + 1 };
            let run = |precision: Precision| {
                let mut g = Graph::new();
                let w = g.input("w", dt, [k, n, 1, 1]).unwrap();
                g.set_data(w, f32_to_bytes(dt, &vals(k * n, 1)).unwrap())
                    .unwrap();
                let ys: Vec<_> = [1, big]
                    .iter()
                    .map(|&m| {
                        let x = g.input_f32("x", [k, m, 1, 1], &vals(k * m, m)).unwrap();
                        let y = g.mul_mat(w, x).unwrap();
                        g.set_output(y);
                        y
                    })
                    .collect();
                let dev = CpuDevice::new(0, 1, 2, CpuOptions::with_precision(precision));
                CpuBackend::new(dev).unwrap().graph_compute(&mut g).unwrap();
                ys.iter()
                    .map(|&y| g.read_f32(y).unwrap())
                    .collect::<Vec<_>>()
            };
            let (exact, q8) = (run(Precision::Exact), run(Precision::Q8));
            assert_ne!(q8[0], exact[0], "{dt}: one row is not quantized");
            match cut {
                usize::MAX => assert_ne!(q8[1], exact[1], "{dt}: {big} rows"),
                _ => assert_eq!(q8[1], exact[1], "{dt}: {big} rows above the cutoff {cut}"),
            }
        }
    }

    /// `mul_mat_id` applies the same rule per expert: an expert with more rows than the cutoff
    /// multiplies them in f32 (equal to the exact run bit for bit), one with a single row
    /// quantizes it.
    #[test]
    fn q8_experts_above_the_row_cutoff_run_exact() {
        use crate::cpu::device::CpuOptions;
        use crate::dtype::f32_to_bytes;
        let (k, n, dt) = (256, 16, DType::Q5_0);
        let cut = matmul::q8_max_rows(dt, Isa::detect());
        let many = if cut == usize::MAX { 8 } else { cut + 1 };
        let t = many + 1;
        let vals = |len: usize, seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| (((i * 7919 + seed) % 1013) as f32 / 1013.0 - 0.5) * 3.0)
                .collect()
        };
        // Tokens 0..many choose expert 0, the last one expert 1.
        let ids: Vec<i32> = (0..t).map(|i| i32::from(i == many)).collect();
        let run = |precision: Precision| {
            let mut g = Graph::new();
            let w = g.input("experts", dt, [k, n, 2, 1]).unwrap();
            g.set_data(w, f32_to_bytes(dt, &vals(k * n * 2, 1)).unwrap())
                .unwrap();
            let x = g.input_f32("x", [k, 1, t, 1], &vals(k * t, 2)).unwrap();
            let ids = g.input_i32("ids", [1, t, 1, 1], &ids).unwrap();
            let y = g.mul_mat_id(w, x, ids).unwrap();
            g.set_output(y);
            let dev = CpuDevice::new(0, 1, 2, CpuOptions::with_precision(precision));
            CpuBackend::new(dev).unwrap().graph_compute(&mut g).unwrap();
            g.read_f32(y).unwrap()
        };
        let (exact, q8) = (run(Precision::Exact), run(Precision::Q8));
        let (head, last) = (..many * n, many * n..);
        assert_ne!(
            q8[last.clone()],
            exact[last],
            "one row of expert 1 is not quantized"
        );
        match cut {
            usize::MAX => assert_ne!(q8[head], exact[head]),
            _ => assert_eq!(
                q8[head], exact[head],
                "{many} rows of expert 0, cutoff {cut}"
            ),
        }
    }
}
