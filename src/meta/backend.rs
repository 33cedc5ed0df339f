//! `MetaBackend::graph_compute`: plan the graph (states and conversions, `plan.rs`), rewrite it
//! into per-device programs (`rewrite.rs`), allocate each device's compute buffer from its
//! local shapes, prepare each device's backend plan, and cache all of it by graph structure so
//! a decode loop plans once. Every step then uploads the inputs, runs all devices at the same
//! time (one worker each) with collectives between their stages, and binds the outputs to a
//! meta buffer so `Graph::read_f32` gathers them (summing partials).
//!
//! A device that fails aborts the communicator, so its peers return promptly; the error that
//! caused it is the one reported, and the next step starts with a new communicator.

use super::MetaShared;
use super::buffer::{MetaBuffer, MetaTensor};
use super::plan::{MetaPlan, plan};
use super::rewrite::{DeviceProgram, Stage, Upload, rewrite};
use crate::alloc::GraphAllocator;
use crate::backend::{Backend, Device, GraphPlan};
use crate::buffer::{Buffer, Storage};
use crate::collectives::{AbortOnPanic, Communicator, CpuCommunicator};
use crate::cpu::ThreadPool;
use crate::graph::{Flags, Graph, TensorId};
use crate::op::CollectiveKind;
use crate::tensor::Layout;
use crate::{Error, Result};
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Plans kept per backend (a decode loop alternates few shapes).
const CACHE_SIZE: usize = 8;

/// Bytes per device: weights (from the given meta buffers) and compute buffers (last plan).
#[derive(Clone, Debug, serde::Serialize)]
pub struct MemoryReport {
    pub devices: Vec<String>,
    pub weights: Vec<usize>,
    pub compute: Vec<usize>,
}

impl std::fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:<10} {:>14} {:>14}",
            "device", "weights MiB", "compute MiB"
        )?;
        for (i, d) in self.devices.iter().enumerate() {
            writeln!(
                f,
                "{:<10} {:>14.2} {:>14.2}",
                d,
                self.weights[i] as f64 / 1048576.0,
                self.compute[i] as f64 / 1048576.0
            )?;
        }
        Ok(())
    }
}

struct DeviceRun {
    program: DeviceProgram,
    plan: Box<dyn GraphPlan>,
}

/// Everything prepared for one graph structure.
struct Prepared {
    key: u64,
    /// The buffers the graph's storage was bound to when planned. The key hashes buffer
    /// addresses; a buffer freed and another allocated at its address would hit a stale plan,
    /// so a hit counts only while all of these are still alive.
    bound: Vec<std::sync::Weak<dyn Buffer>>,
    plan: MetaPlan,
    runs: Vec<Mutex<DeviceRun>>,
    compute_bytes: Vec<usize>,
    /// User roots to bind after each run, at offsets of `outputs`.
    out_roots: Vec<(TensorId, usize)>,
    outputs: Arc<MetaBuffer>,
}

pub struct MetaBackend {
    shared: Arc<MetaShared>,
    backends: Vec<Arc<dyn Backend>>,
    pool: ThreadPool,
    comm: Mutex<Arc<CpuCommunicator>>,
    cache: Mutex<Vec<Arc<Prepared>>>,
    last: Mutex<Option<Arc<Prepared>>>,
    plans_built: AtomicUsize,
}

impl MetaBackend {
    pub fn new(shared: Arc<MetaShared>) -> Result<Self> {
        let n = shared.devices.len();
        let backends = shared
            .devices
            .iter()
            .map(|d| d.init_backend())
            .collect::<Result<Vec<_>>>()?;
        Ok(MetaBackend {
            backends,
            pool: ThreadPool::new(n, "meta")?,
            comm: Mutex::new(Arc::new(CpuCommunicator::new(n)?)),
            cache: Mutex::new(Vec::new()),
            last: Mutex::new(None),
            plans_built: AtomicUsize::new(0),
            shared,
        })
    }

    pub fn n_devices(&self) -> usize {
        self.shared.devices.len()
    }

    /// How many times a graph was planned (not found in the cache).
    pub fn plans_built(&self) -> usize {
        self.plans_built.load(Ordering::Relaxed)
    }

    /// Plans in the cache (each for one graph structure with live buffers).
    pub fn cached_plans(&self) -> usize {
        self.cache.lock().len()
    }

    /// The plan of the last computed graph.
    pub fn last_plan(&self) -> Option<MetaPlan> {
        self.last.lock().as_ref().map(|p| p.plan.clone())
    }

    /// Plan a graph without running it (for reports).
    pub fn plan_graph(&self, g: &Graph) -> Result<MetaPlan> {
        plan(g, self.n_devices(), self.shared.options.explicit, &|id| {
            leaf_state(g, id)
        })
    }

    /// The local program of device `d` for the last graph (for inspection and tests).
    pub fn last_program_len(&self, d: usize) -> Option<usize> {
        self.last
            .lock()
            .as_ref()
            .map(|p| p.runs[d].lock().program.graph.len())
    }

    /// Weights held by each device in `weights`, and the last graph's compute buffers.
    pub fn memory_report(&self, weights: &[&MetaBuffer]) -> MemoryReport {
        let n = self.n_devices();
        let mut w = vec![0; n];
        for b in weights {
            for (d, x) in b.device_bytes().into_iter().enumerate() {
                w[d] += x;
            }
        }
        let compute = self
            .last
            .lock()
            .as_ref()
            .map_or(vec![0; n], |p| p.compute_bytes.clone());
        MemoryReport {
            devices: self.shared.devices.iter().map(|d| d.name()).collect(),
            weights: w,
            compute,
        }
    }

    fn prepare(&self, g: &Graph, key: u64) -> Result<Arc<Prepared>> {
        let n = self.n_devices();
        // Passes 1-2: states and conversions.
        let mp = self.plan_graph(g)?;
        // Pass 3: per-device programs.
        let rw = rewrite(g, &mp, &self.shared.devices)?;
        let local = rw.local;
        let mut runs = Vec::with_capacity(n);
        let mut compute_bytes = Vec::with_capacity(n);
        for (d, mut program) in rw.programs.into_iter().enumerate() {
            // Pass 4: allocate the device's compute buffer from its local shapes.
            let mut alloc = GraphAllocator::new(self.shared.devices[d].buffer_type());
            alloc.alloc_graph(&mut program.graph)?;
            compute_bytes.push(alloc.buffer_size());
            // Pass 5: the device backend's plan of its program.
            let plan = self.backends[d].graph_plan(&program.graph)?;
            runs.push(Mutex::new(DeviceRun { program, plan }));
        }
        // Outputs computed here are registered in a meta buffer the user reads through.
        let outputs = Arc::new(MetaBuffer::for_results(self.shared.clone(), usize::MAX / 2));
        let mut out_roots = Vec::new();
        let mut offset = 0usize;
        for id in g.ids() {
            let node = g.node(id);
            if !node.flags.contains(Flags::OUTPUT) {
                continue;
            }
            let r = g.root(id);
            // Leaves the user placed are read through their own storage; everything else the
            // user reads (computed roots, and inline inputs written or returned) is registered.
            let placed_leaf = g.node(r).is_leaf() && g.node(r).storage.is_some();
            if placed_leaf || out_roots.iter().any(|&(x, _)| x == r) {
                continue;
            }
            let rl = *g.layout(r);
            let mut locals = Vec::with_capacity(n);
            for (d, run) in runs.iter().enumerate() {
                let run = run.lock();
                let lid = local[d][r.index()];
                let st = run
                    .program
                    .graph
                    .storage(lid)
                    .ok_or_else(|| Error::NoStorage {
                        tensor: node.name.clone(),
                        reason: format!("output has no storage on device {d}"),
                    })?;
                locals.push((st, *run.program.graph.layout(lid)));
            }
            outputs.register(
                offset,
                MetaTensor {
                    name: g.name(r).to_string(),
                    layout: Layout::contiguous(rl.dtype, rl.ne),
                    state: mp.states[r.index()].clone(),
                    local: locals,
                },
            )?;
            out_roots.push((r, offset));
            offset += rl.nbytes().next_multiple_of(64).max(64);
        }
        let mut bound: Vec<std::sync::Weak<dyn Buffer>> = Vec::new();
        for n in g.nodes() {
            if let Some(st) = &n.storage
                && !bound
                    .iter()
                    .any(|w| std::ptr::addr_eq(w.as_ptr(), Arc::as_ptr(&st.buffer)))
            {
                bound.push(Arc::downgrade(&st.buffer));
            }
        }
        self.plans_built.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(Prepared {
            key,
            bound,
            plan: mp,
            runs,
            compute_bytes,
            out_roots,
            outputs,
        }))
    }

    fn prepared(&self, g: &Graph) -> Result<Arc<Prepared>> {
        let key = g.structure_hash();
        {
            let mut cache = self.cache.lock();
            // Plans whose buffers are gone can never be valid again.
            cache.retain(|p| p.bound.iter().all(|w| w.strong_count() > 0));
            if let Some(i) = cache.iter().position(|p| p.key == key) {
                let p = cache.remove(i);
                cache.push(p.clone());
                return Ok(p);
            }
        }
        let p = self.prepare(g, key)?;
        let mut cache = self.cache.lock();
        if cache.len() >= CACHE_SIZE {
            cache.remove(0);
        }
        cache.push(p.clone());
        Ok(p)
    }

    /// Run device `d`'s program: stages in order, collectives with the peers.
    fn run_device(
        &self,
        d: usize,
        run: &mut DeviceRun,
        g: &Graph,
        comm: &dyn Communicator,
    ) -> Result<()> {
        let _guard = AbortOnPanic::new(comm, d);
        // Inputs of this step.
        for (lid, up) in &run.program.uploads {
            let lg = &run.program.graph;
            let st = lg
                .storage(*lid)
                .ok_or_else(|| Error::msg("upload target without storage"))?;
            match up {
                Upload::User(u) => {
                    let data = g.node(*u).data.as_ref().ok_or_else(|| Error::NoStorage {
                        tensor: g.name(*u).to_string(),
                        reason: "inline data expected (the graph structure changed?)".into(),
                    })?;
                    st.set(lg.layout(*lid), data)?;
                }
                Upload::Zeros => {
                    let l = lg.layout(*lid);
                    st.buffer.memset_tensor(l, st.offset, 0, 0, l.nbytes())?;
                }
            }
        }
        for stage in &run.program.stages {
            match stage {
                Stage::Compute(r) => run.plan.compute(r.clone())?,
                Stage::Collective {
                    kind,
                    src,
                    dst,
                    layout,
                    dtype,
                } => {
                    let lg = &run.program.graph;
                    let bytes = |id: TensorId| -> Result<(*mut u8, usize)> {
                        let st = lg
                            .storage(id)
                            .ok_or_else(|| Error::msg("collective tensor without storage"))?;
                        let p = st.host_ptr().ok_or_else(|| Error::Device {
                            device: self.shared.devices[d].name(),
                            reason: "collectives need host memory on this build".into(),
                        })?;
                        Ok((p, lg.layout(id).nbytes()))
                    };
                    let (sp, sn) = bytes(*src)?;
                    let (dp, dn) = bytes(*dst)?;
                    // SAFETY: both tensors lie inside this device's buffers (bound and checked
                    // by the allocator); during the collective no kernel of this device runs,
                    // and peers touch them only inside the collective's barriers.
                    unsafe {
                        match kind {
                            CollectiveKind::AllReduce => {
                                comm.all_reduce(d, std::slice::from_raw_parts_mut(dp, dn), *dtype)?
                            }
                            CollectiveKind::AllGather { .. } => comm.all_gather(
                                d,
                                std::slice::from_raw_parts(sp, sn),
                                std::slice::from_raw_parts_mut(dp, dn),
                                layout.as_ref().expect("gathers have layouts"),
                            )?,
                            CollectiveKind::ReduceScatter { .. } => comm.reduce_scatter(
                                d,
                                std::slice::from_raw_parts(sp, sn),
                                std::slice::from_raw_parts_mut(dp, dn),
                                layout.as_ref().expect("scatters have layouts"),
                                *dtype,
                            )?,
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Drop the bindings an earlier compute of this graph made to its results: they are computed
/// again, and a graph computed again must plan (and hit the plan cache) as it did the first
/// time, with its inline inputs uploaded again rather than read from old results.
fn unbind_results(g: &mut Graph) {
    for id in g.ids() {
        let bound = g.node(id).storage.as_ref().is_some_and(|st| {
            st.buffer
                .as_any()
                .downcast_ref::<MetaBuffer>()
                .is_some_and(MetaBuffer::holds_results)
        });
        if bound {
            g.node_mut(id).storage = None;
        }
    }
}

/// The state of a leaf placed in a meta buffer.
fn leaf_state(g: &Graph, id: TensorId) -> Option<crate::split_state::SplitState> {
    let st = g.node(id).storage.as_ref()?;
    let mb = st.buffer.as_any().downcast_ref::<MetaBuffer>()?;
    mb.tensor_at(st.offset).map(|t| t.state.clone())
}

impl Backend for MetaBackend {
    fn name(&self) -> String {
        format!("meta({})", self.n_devices())
    }

    fn device(&self) -> Arc<dyn Device> {
        Arc::new(super::MetaDevice {
            shared: self.shared.clone(),
        })
    }

    fn synchronize(&self) -> Result<()> {
        self.backends.iter().try_for_each(|b| b.synchronize())
    }

    fn compute_buffer_bytes(&self) -> Vec<usize> {
        self.last
            .lock()
            .as_ref()
            .map_or(vec![0; self.n_devices()], |p| p.compute_bytes.clone())
    }

    fn graph_compute(&self, g: &mut Graph) -> Result<()> {
        unbind_results(g);
        let prep = self.prepared(g)?;
        let comm = {
            let mut c = self.comm.lock();
            if c.failure().is_some() {
                *c = Arc::new(CpuCommunicator::new(self.n_devices())?);
            }
            c.clone()
        };
        let errors: Vec<Mutex<Option<Error>>> =
            (0..self.n_devices()).map(|_| Mutex::new(None)).collect();
        let graph: &Graph = g;
        let ran = self.pool.run(&|d, _| {
            let mut run = prep.runs[d].lock();
            if let Err(e) = self.run_device(d, &mut run, graph, comm.as_ref()) {
                comm.abort(d, &e.to_string());
                *errors[d].lock() = Some(e);
            }
        });
        if let Err(msg) = ran {
            return Err(Error::Device {
                device: self.name(),
                reason: format!("a device worker panicked: {msg}"),
            });
        }
        // Report the cause: a failure other than a released collective, if any.
        let errs: Vec<Error> = errors.into_iter().filter_map(|e| e.into_inner()).collect();
        if let Some(first) = errs
            .iter()
            .position(|e| !matches!(e, Error::Collective { .. }))
            .or((!errs.is_empty()).then_some(0))
        {
            return Err(errs.into_iter().nth(first).expect("index from position"));
        }
        for &(r, off) in &prep.out_roots {
            match g.node(r).storage.clone() {
                // The user placed this output: gather into it.
                Some(st)
                    if !Arc::ptr_eq(&st.buffer, &(prep.outputs.clone() as Arc<dyn Buffer>)) =>
                {
                    let l = *g.layout(r);
                    let mut bytes = vec![0u8; l.nbytes()];
                    prep.outputs.get_tensor(&l, off, &mut bytes, 0)?;
                    st.set(&l, &bytes)?;
                }
                _ => g.bind(r, Storage::new(prep.outputs.clone(), off))?,
            }
        }
        *self.last.lock() = Some(prep);
        Ok(())
    }
}
