//! `MetaBackend::graph_compute`. A graph structure seen for the first time goes through the
//! passes of [`MetaBackend::prepare`], one function each:
//!
//! 1. [`derive_sharding`]: every node's split state and the conversions (`sharding.rs`),
//!    following the meta device's state hints where it has them;
//! 2. [`rewrite`]: one program per device, conversions as local nodes or collectives
//!    (`rewrite.rs`);
//! 3. [`allocate`]: each device's compute buffer, sized from its local shapes;
//! 4. [`compile`]: each device backend's `GraphPlan` of its program;
//! 5. [`register_outputs`]: the user's outputs in a meta buffer that gathers them on read.
//!
//! The result is cached by graph structure, so a decode loop prepares once. Every step then uploads the inputs, runs all devices at the same
//! time (one worker each) with collectives between their stages, and binds the outputs to a
//! meta buffer so `Graph::read_f32` gathers them (summing partials).
//!
//! The devices' programs run on their own workers (`crate::workers`), never on the caller, and
//! the communicator comes from the devices themselves: when the backend is created it asks
//! every device which communicators it can join (`Device::communicators`) and uses the first
//! kind all offer, else the in-process host communicator (logged with `tracing`).
//!
//! Failures: a device that fails aborts the communicator, so its peers return promptly; the
//! error that caused it is the one reported, and the next step starts with a new communicator.
//! A device that stays inside one stage (a node range or a collective) for longer than the
//! timeout (`MetaOptions::timeout`) is declared stalled: `graph_compute` returns
//! [`Error::DeviceStalled`] naming it, its worker and backend are replaced, cached programs
//! are dropped, and the next compute starts afresh while the stalled thread is left to finish.

use super::MetaShared;
use super::buffer::{MetaBuffer, MetaTensor};
use super::rewrite::{DeviceProgram, Stage, Upload, rewrite};
use super::sharding::{Sharding, derive_sharding};
use crate::alloc::GraphAllocator;
use crate::backend::{Backend, Device, GraphPlan};
use crate::buffer::{Buffer, BufferRange, Storage};
use crate::collectives::{
    AbortOnPanic, Communicator, CommunicatorFactory, HostCommunicatorFactory,
};
use crate::graph::{Flags, Graph, Signature, TensorId};
use crate::op::CollectiveKind;
use crate::tensor::Layout;
use crate::workers::{DeviceWorkers, Job, Outcome, Progress};
use crate::{Error, Result};
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Plans kept per backend (a decode loop alternates few shapes).
const CACHE_SIZE: usize = 8;

/// Bytes per device: weights (from the given meta buffers) and compute buffers (last graph).
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
    key: Signature,
    /// The buffers the graph's storage was bound to when prepared. The key holds buffer
    /// addresses; a buffer freed and another allocated at its address would hit a stale entry,
    /// so a hit counts only while all of these are still alive.
    bound: Vec<std::sync::Weak<dyn Buffer>>,
    sharding: Sharding,
    runs: Vec<Mutex<DeviceRun>>,
    /// Per device, a description of each stage (for stall errors, when the run is locked).
    stage_names: Vec<Vec<String>>,
    /// The user leaves whose inline data the programs upload.
    inputs: Vec<TensorId>,
    compute_bytes: Vec<usize>,
    /// User roots to bind after each run, at offsets of `outputs`.
    out_roots: Vec<(TensorId, usize)>,
    outputs: Arc<MetaBuffer>,
}

/// The communicator in use and the factory that makes a new one after a failure.
struct Comm {
    factory: Arc<dyn CommunicatorFactory>,
    current: Arc<dyn Communicator>,
}

pub struct MetaBackend {
    shared: Arc<MetaShared>,
    /// Per device; replaced when the device stalls.
    backends: Mutex<Vec<Arc<dyn Backend>>>,
    workers: Mutex<DeviceWorkers>,
    comm: Mutex<Comm>,
    cache: Mutex<Vec<Arc<Prepared>>>,
    last: Mutex<Option<Arc<Prepared>>>,
    graphs_prepared: AtomicUsize,
    /// `METASHARD_STEP_PROFILE`'s sums (`profile.rs`).
    profile: Mutex<super::profile::StepProfile>,
}

impl Drop for MetaBackend {
    fn drop(&mut self) {
        let names: Vec<String> = self.shared.devices.iter().map(|d| d.name()).collect();
        if let Some(r) = self.profile.lock().report(&names) {
            eprintln!("{r}");
        }
    }
}

/// The first communicator kind every device offers, else the host fallback.
fn choose_communicator(
    devices: &[Arc<dyn Device>],
    timeout: Duration,
) -> Result<(Arc<dyn CommunicatorFactory>, Arc<dyn Communicator>)> {
    let offers: Vec<Vec<Arc<dyn CommunicatorFactory>>> =
        devices.iter().map(|d| d.communicators()).collect();
    let names = || {
        devices
            .iter()
            .map(|d| d.name())
            .collect::<Vec<_>>()
            .join(",")
    };
    for f in offers.first().into_iter().flatten() {
        let name = f.name();
        if !offers[1..]
            .iter()
            .all(|o| o.iter().any(|g| g.name() == name))
        {
            continue;
        }
        match f.create(devices, timeout) {
            Ok(c) => {
                tracing::info!(devices = %names(), communicator = %c.name(), "meta backend communicator");
                return Ok((f.clone(), c));
            }
            Err(e) => {
                tracing::warn!(devices = %names(), communicator = %name, error = %e, "communicator offered by every device failed; trying the next")
            }
        }
    }
    let f: Arc<dyn CommunicatorFactory> = Arc::new(HostCommunicatorFactory);
    let c = f.create(devices, timeout)?;
    tracing::info!(devices = %names(), communicator = %c.name(), "meta backend communicator: the devices offer none in common, using the in-process host communicator");
    Ok((f, c))
}

impl MetaBackend {
    pub fn new(shared: Arc<MetaShared>) -> Result<Self> {
        let n = shared.devices.len();
        let backends = shared
            .devices
            .iter()
            .map(|d| d.init_backend())
            .collect::<Result<Vec<_>>>()?;
        let (factory, current) = choose_communicator(&shared.devices, shared.options.timeout)?;
        Ok(MetaBackend {
            backends: Mutex::new(backends),
            workers: Mutex::new(DeviceWorkers::new(n, "meta")?),
            comm: Mutex::new(Comm { factory, current }),
            cache: Mutex::new(Vec::new()),
            last: Mutex::new(None),
            graphs_prepared: AtomicUsize::new(0),
            profile: Mutex::new(Default::default()),
            shared,
        })
    }

    pub fn n_devices(&self) -> usize {
        self.shared.devices.len()
    }

    /// The communicator the devices use (`host(2)`, or one a device brought).
    pub fn communicator(&self) -> Arc<dyn Communicator> {
        self.comm.lock().current.clone()
    }

    /// How many times a graph was prepared (not found in the cache).
    pub fn graphs_prepared(&self) -> usize {
        self.graphs_prepared.load(Ordering::Relaxed)
    }

    /// Plans in the cache (each for one graph structure with live buffers).
    pub fn cached_graphs(&self) -> usize {
        self.cache.lock().len()
    }

    /// The sharding of the last computed graph.
    pub fn last_sharding(&self) -> Option<Sharding> {
        self.last.lock().as_ref().map(|p| p.sharding.clone())
    }

    /// The sharding of a graph (pass 1), without running it (for reports): placed leaves in
    /// their states, computed nodes by their rules and the device's state hints.
    pub fn sharding(&self, g: &Graph) -> Result<Sharding> {
        let n = self.n_devices();
        derive_sharding(
            g,
            n,
            self.shared.options.explicit,
            &|id| leaf_state(g, id),
            &|id| super::hint_for(self.shared.hints.as_ref(), g, id, n),
        )
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

    /// The passes, in order (see the module doc).
    fn prepare(&self, g: &Graph, key: Signature) -> Result<Arc<Prepared>> {
        let devices = &self.shared.devices;
        let sharding = self.sharding(g)?;
        log_sharding(g, &sharding);
        let mut rw = rewrite(g, &sharding, devices)?;
        let mut programs = std::mem::take(&mut rw.programs);
        let compute_bytes = allocate(&mut programs, devices)?;
        let backends = self.backends.lock().clone();
        let (runs, stage_names, inputs) = compile(programs, &backends)?;
        let (outputs, out_roots) = register_outputs(&self.shared, g, &sharding, &runs, &rw)?;
        self.graphs_prepared.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(Prepared {
            key,
            bound: g.bound_buffers(),
            sharding,
            runs,
            stage_names,
            inputs,
            compute_bytes,
            out_roots,
            outputs,
        }))
    }

    fn prepared(&self, g: &Graph) -> Result<Arc<Prepared>> {
        let key = g.signature();
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

    /// The communicator for this step: a new one if the last failed.
    fn step_communicator(&self) -> Result<Arc<dyn Communicator>> {
        let mut c = self.comm.lock();
        if c.current.failure().is_some() {
            c.current = c
                .factory
                .create(&self.shared.devices, self.shared.options.timeout)?;
        }
        Ok(c.current.clone())
    }

    /// After a stall: fresh backends for the stalled devices (the old ones may still be busy)
    /// and no cached programs (they hold the old backends' plans, and a stalled thread holds
    /// its device's program).
    fn recover_from_stall(&self, stalled: &[usize]) -> Result<()> {
        self.cache.lock().clear();
        *self.last.lock() = None;
        let mut backends = self.backends.lock();
        for &d in stalled {
            backends[d] = self.shared.devices[d].init_backend()?;
        }
        Ok(())
    }
}

/// The sharding at debug level, once per new graph structure.
fn log_sharding(g: &Graph, sharding: &Sharding) {
    if tracing::enabled!(tracing::Level::DEBUG) {
        let collectives = sharding
            .conversions
            .iter()
            .filter(|c| c.kind.communicates())
            .count();
        tracing::debug!(
            "sharding of a new graph over {} devices: {} nodes, {} collectives, {} bytes \
             communicated\n{}",
            sharding.n,
            g.len(),
            collectives,
            sharding.communicated_bytes(),
            sharding.describe(g)
        );
    }
}

/// Pass 3: each device's compute buffer, from the local shapes of its program.
fn allocate(programs: &mut [DeviceProgram], devices: &[Arc<dyn Device>]) -> Result<Vec<usize>> {
    programs
        .iter_mut()
        .zip(devices)
        .map(|(program, device)| {
            let mut alloc = GraphAllocator::new(device.buffer_type());
            alloc.alloc_graph(&mut program.graph)?;
            Ok(alloc.buffer_size())
        })
        .collect()
}

/// What [`compile`] returns: each device's run, its stages in words, and the user leaves the
/// programs upload.
type Compiled = (Vec<Mutex<DeviceRun>>, Vec<Vec<String>>, Vec<TensorId>);

/// Pass 4: each device backend's plan of its program.
fn compile(programs: Vec<DeviceProgram>, backends: &[Arc<dyn Backend>]) -> Result<Compiled> {
    let mut runs = Vec::with_capacity(programs.len());
    let mut stage_names = Vec::with_capacity(programs.len());
    let mut inputs = Vec::new();
    for (program, backend) in programs.into_iter().zip(backends) {
        let plan = backend.graph_plan(&program.graph)?;
        stage_names.push(
            program
                .stages
                .iter()
                .map(|st| describe_stage(&program.graph, st))
                .collect(),
        );
        for (_, up) in &program.uploads {
            if let Upload::User(u) = up
                && !inputs.contains(u)
            {
                inputs.push(*u);
            }
        }
        runs.push(Mutex::new(DeviceRun { program, plan }));
    }
    Ok((runs, stage_names, inputs))
}

/// User roots bound after each run, with their offsets in the outputs buffer.
type OutRoots = Vec<(TensorId, usize)>;

/// Pass 5: the user's outputs computed on the devices, registered in a meta buffer the user
/// reads through (it gathers slices and sums partials); returns it and each root's offset.
fn register_outputs(
    shared: &Arc<MetaShared>,
    g: &Graph,
    sharding: &Sharding,
    runs: &[Mutex<DeviceRun>],
    rw: &super::rewrite::Rewritten,
) -> Result<(Arc<MetaBuffer>, OutRoots)> {
    let local = &rw.local;
    let outputs = Arc::new(MetaBuffer::for_results(shared.clone(), usize::MAX / 2));
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
        let mut locals = Vec::with_capacity(runs.len());
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
                state: if rw.mirrored_outputs.contains(&r) {
                    crate::split_state::SplitState::mirrored(runs.len())
                } else {
                    sharding.states[r.index()].clone()
                },
                local: locals,
            },
        )?;
        out_roots.push((r, offset));
        offset += rl.nbytes().next_multiple_of(64).max(64);
    }
    Ok((outputs, out_roots))
}

/// A stage in words, for errors.
fn describe_stage(lg: &Graph, st: &Stage) -> String {
    match st {
        Stage::Compute(r) => {
            let first = r.start;
            let last = r.end.saturating_sub(1);
            format!(
                "nodes {first}..={last} (`{}` .. `{}`)",
                lg.name(TensorId(first as u32)),
                lg.name(TensorId(last as u32))
            )
        }
        Stage::Collective { kind, dst, .. } => {
            let what = match kind {
                CollectiveKind::AllReduce => "all-reduce",
                CollectiveKind::AllGather { .. } => "all-gather",
                CollectiveKind::ReduceScatter { .. } => "reduce-scatter",
            };
            format!("{what} into `{}`", lg.name(*dst))
        }
    }
}

/// What a device's job needs for one step; owned, since a stalled job outlives the call.
struct StepJob {
    d: usize,
    prep: Arc<Prepared>,
    /// Inline data of `prep.inputs`, in that order.
    data: Arc<Vec<Arc<[u8]>>>,
    comm: Arc<dyn Communicator>,
    device: Arc<dyn Device>,
    error: Arc<Mutex<Option<Error>>>,
    /// Where `METASHARD_STEP_PROFILE` is on: this device's times of the step.
    times: Option<Arc<Mutex<super::profile::DeviceTimes>>>,
}

impl StepJob {
    fn run(self, progress: &Progress) {
        if let Err(e) = self.run_device(progress) {
            self.comm.abort(self.d, &e.to_string());
            *self.error.lock() = Some(e);
        }
    }

    /// Run device `d`'s program: uploads, then stages in order, collectives with the peers.
    fn run_device(&self, progress: &Progress) -> Result<()> {
        let d = self.d;
        let comm = self.comm.as_ref();
        let _guard = AbortOnPanic::new(comm, d);
        let mut run = self.prep.runs[d].lock();
        let run = &mut *run;
        let lg = &run.program.graph;
        let storage = |id: TensorId| {
            lg.storage(id).ok_or_else(|| Error::NoStorage {
                tensor: lg.name(id).to_string(),
                reason: format!(
                    "the program of device {} has no storage for it (internal)",
                    self.device.name()
                ),
            })
        };
        let start = self.times.as_ref().map(|_| Instant::now());
        // Inputs of this step.
        for (lid, up) in &run.program.uploads {
            let st = storage(*lid)?;
            let l = lg.layout(*lid);
            match up {
                Upload::User(u) => {
                    let i = self
                        .prep
                        .inputs
                        .iter()
                        .position(|x| x == u)
                        .expect("inputs list every uploaded leaf");
                    st.set(l, &self.data[i])?;
                }
                Upload::Zeros => st.buffer.memset_tensor(l, st.offset, 0, 0, l.nbytes())?,
            }
        }
        let mut times = self.times.as_ref().map(|t| t.lock());
        if let (Some(t), Some(start)) = (times.as_mut(), start) {
            t.uploads = start.elapsed().as_nanos() as u64;
            t.stages.clear();
        }
        for (i, stage) in run.program.stages.iter().enumerate() {
            let stage_start = times.as_ref().map(|_| Instant::now());
            if progress.cancelled() {
                return Err(Error::Device {
                    device: self.device.name(),
                    reason: "abandoned after a stall".into(),
                });
            }
            progress.stage(i, matches!(stage, Stage::Collective { .. }));
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
                    let range = |id: TensorId| -> Result<BufferRange> {
                        Ok(BufferRange::new(storage(id)?, lg.layout(id).nbytes()))
                    };
                    let gathered = || {
                        layout.as_ref().ok_or_else(|| Error::NoStorage {
                            tensor: lg.name(*dst).to_string(),
                            reason: "a gather or scatter without a slice layout (internal)".into(),
                        })
                    };
                    match kind {
                        CollectiveKind::AllReduce => comm.all_reduce(d, &range(*dst)?, *dtype)?,
                        CollectiveKind::AllGather { .. } => {
                            comm.all_gather(d, &range(*src)?, &range(*dst)?, gathered()?)?
                        }
                        CollectiveKind::ReduceScatter { .. } => comm.reduce_scatter(
                            d,
                            &range(*src)?,
                            &range(*dst)?,
                            gathered()?,
                            *dtype,
                        )?,
                    }
                }
            }
            if let (Some(t), Some(st)) = (times.as_mut(), stage_start) {
                let coll = matches!(stage, Stage::Collective { .. });
                t.stages.push((coll, st.elapsed().as_nanos() as u64));
            }
        }
        Ok(())
    }
}

/// Drop the bindings an earlier compute of this graph made to its results: they are computed
/// again, and a graph computed again must prepare (and hit the cache) as it did the first
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
        let backends = self.backends.lock().clone();
        backends.iter().try_for_each(|b| b.synchronize())
    }

    fn compute_buffer_bytes(&self) -> Vec<usize> {
        self.last
            .lock()
            .as_ref()
            .map_or(vec![0; self.n_devices()], |p| p.compute_bytes.clone())
    }

    fn graph_compute(&self, g: &mut Graph) -> Result<()> {
        // `METASHARD_STEP_PROFILE`: nothing is timed or allocated for it when it is off.
        let clock = || super::profile::enabled().then(Instant::now);
        let entered = clock();
        unbind_results(g);
        let prep = self.prepared(g)?;
        let n = self.n_devices();
        let data = prep
            .inputs
            .iter()
            .map(|&u| {
                g.node(u).data.clone().ok_or_else(|| Error::NoStorage {
                    tensor: g.name(u).to_string(),
                    reason: "inline data expected (the graph structure changed?)".into(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let data = Arc::new(data);
        let comm = self.step_communicator()?;
        let errors: Vec<Arc<Mutex<Option<Error>>>> =
            (0..n).map(|_| Arc::new(Mutex::new(None))).collect();
        let times: Vec<Arc<Mutex<super::profile::DeviceTimes>>> = match entered {
            Some(_) => (0..n).map(|_| Default::default()).collect(),
            None => Vec::new(),
        };
        let jobs: Vec<Job> = (0..n)
            .map(|d| {
                // Another process runs this rank's program.
                if self.shared.devices[d].is_remote() {
                    return Box::new(|_: &Progress| {}) as Job;
                }
                let job = StepJob {
                    d,
                    prep: prep.clone(),
                    data: data.clone(),
                    comm: comm.clone(),
                    device: self.shared.devices[d].clone(),
                    error: errors[d].clone(),
                    times: times.get(d).cloned(),
                };
                Box::new(move |p: &Progress| job.run(p)) as Job
            })
            .collect();
        let timeout = self.shared.options.timeout;
        let dispatched = clock();
        let outcome = self.workers.lock().run(jobs, timeout, &|d| {
            comm.abort(d, "it stalled (no progress within the timeout)")
        })?;
        let finished = clock();
        if let Outcome::Stalled {
            devices,
            stages,
            waited,
        } = outcome
        {
            self.recover_from_stall(&devices)?;
            let d = devices[0];
            return Err(Error::DeviceStalled {
                device: self.shared.devices[d].name(),
                stage: prep.stage_names[d]
                    .get(stages[0])
                    .cloned()
                    .unwrap_or_else(|| "its uploads, before the first stage".into()),
                waited,
                timeout,
            });
        }
        // Report the cause: a failure other than a released collective, if any.
        let errs: Vec<Error> = errors.iter().filter_map(|e| e.lock().take()).collect();
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
        if let (Some(entered), Some(dispatched), Some(finished)) = (entered, dispatched, finished) {
            let ns = |a: Instant, b: Instant| b.duration_since(a).as_nanos() as u64;
            let times: Vec<_> = times
                .iter()
                .map(|t| std::mem::take(&mut *t.lock()))
                .collect();
            let (before, devices) = (ns(entered, dispatched), ns(dispatched, finished));
            let after = ns(finished, Instant::now());
            self.profile.lock().add(before, devices, after, &times);
        }
        Ok(())
    }
}
