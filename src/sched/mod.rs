//! The multi-backend scheduler: one graph over several backends in priority order (a meta
//! device's backend is one backend among others). Every computed node gets a backend, the graph
//! is cut into splits (runs of nodes on one backend), each split runs on its backend in order
//! with its inputs copied from the splits before it, and an optional eval callback observes
//! nodes as they complete.
//!
//! The algorithm is ggml-backend's scheduler (`ggml_backend_sched_split_graph` in
//! ggml-org/ggml `src/ggml-backend.cpp`), whose comments name its passes: assign backends to
//! ops with pre-allocated inputs; expand GPU backends (every backend but the lowest-priority
//! one) down and up, then all backends down and up; upgrade nodes to higher-priority backends
//! with compatible buffer types; assign the remaining nodes; then split the graph and create
//! input copies. Here the passes are one function each, run by [`Sched::plan`]:
//!
//! - (a) `passes::pin_to_buffers`: a node whose bytes, or whose sources' bytes, are bound in a
//!   backend's buffers runs there (weights first);
//! - (b) `passes::expand_to_neighbours`: unassigned nodes take the backend of their neighbours
//!   in graph order;
//! - (c) `passes::upgrade_to_priority`: a node moves to a higher-priority backend that computes
//!   in the same buffer type (by identity, as ggml compares pointers), supports it and can read
//!   its bound sources;
//! - (d) `passes::assign_by_support`: the rest go to the highest-priority backend whose
//!   `supports_op` accepts them; a node nobody supports is [`Error::NoBackendFor`];
//! - (e) `split::build_splits`: maximal runs of computed nodes on one backend (also cut after
//!   each node the eval callback asked for, except on a meta device), each with its own graph,
//!   inputs and copies.
//!
//! Differences from ggml, each for a reason of this crate: views compute nothing and belong to
//! no split (each split re-creates the views it reads); each split is computed through the
//! public `Backend::graph_compute`, so every backend (the CPU, a meta device, a plug-in) runs
//! splits with its own graph allocator and compute buffer, and a value a later split reads is
//! read out after its split runs (so backends may reuse their compute buffer from one split to
//! the next); logical CPU devices share host memory, so tensors are tied to a backend through
//! the scheduler's buffer type ([`SchedBufferType`], `buffer.rs`) rather than by buffer type
//! alone. Copies are synchronous (no backend here has asynchronous copies or events yet), and
//! splits run one after another on the caller's thread.
//!
//! The eval callback (ggml's `ggml_backend_sched_eval_callback`): before a compute, the
//! callback is asked about every computed node; a split on any backend but a meta device is
//! cut after each wanted node, so the callback sees it before the next node runs; a meta
//! device's split is one sharded program (cutting it would change its sharding), so its wanted
//! nodes are kept as outputs and shown in order after the split. Returning false stops the
//! compute with [`Error::EvalStopped`]; nothing is left half-done for the next compute.
//!
//! The plan (assignment and splits) is cached by graph structure and the set of nodes the eval
//! callback asks for, so a decode loop plans once per shape.
//!
//! `METASHARD_STEP_PROFILE=1` times every split run (in, compute, out) per backend and every
//! pipeline tick, printed when the scheduler is dropped (`profile.rs`).

mod buffer;
pub mod compare;
mod passes;
mod profile;
mod split;

pub use buffer::{PlaceFn, Placed, SchedBuffer, SchedBufferType};
pub use compare::{GraphComparison, NodeDiff, compare_graph_backend, compare_graph_sched};
pub use passes::{Assignment, Cause};
pub use split::{CopyFrom, CopyIn, Split, Splits};

use crate::backend::{Backend, Device, DeviceKind};
use crate::buffer::{Buffer, BufferType, HostBufferType, Storage};
use crate::graph::{Graph, Signature, TensorId};
use crate::{Error, Result};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

/// One task of a pipeline tick: split `k` of a graph under its plan, with the graph and the
/// values its earlier splits captured.
type Task<'a> = (
    usize,
    &'a SchedPlan,
    &'a mut Graph,
    &'a mut Vec<Option<Arc<[u8]>>>,
);

/// Plans kept per scheduler (a decode loop alternates few shapes).
const CACHE_SIZE: usize = 8;

/// Most backends in one scheduler (ggml's `GGML_SCHED_MAX_BACKENDS`).
pub const MAX_BACKENDS: usize = 16;

/// Observes nodes as they are computed (ggml's `ggml_backend_sched_eval_callback`).
pub trait EvalCallback: Send {
    /// Whether the callback wants node `id` of `graph` (asked once per compute, for every
    /// computed node in order: not leaves, not views).
    fn ask(&mut self, graph: &Graph, id: TensorId) -> bool;
    /// Node `id` has run on `backend`; `values` are its elements as f32 in logical order.
    /// Returning false stops the compute with [`Error::EvalStopped`].
    fn eval(&mut self, graph: &Graph, id: TensorId, backend: &str, values: &[f32]) -> bool;
}

/// One backend of the scheduler.
pub(crate) struct Slot {
    pub backend: Arc<dyn Backend>,
    pub device: Arc<dyn Device>,
    /// The buffer type it computes in (compared by identity in pass (c)).
    pub bt: Arc<dyn BufferType>,
    pub name: String,
}

/// The assignment and splits of one graph structure, with a readable description.
#[derive(Clone, Debug)]
pub struct SchedPlan {
    pub assignment: Assignment,
    pub splits: Splits,
    key: (Signature, Vec<bool>),
    /// The buffers the graph was bound to when planned (a hit needs them alive; see the meta
    /// backend's `Prepared::bound`).
    bound: Vec<Weak<dyn Buffer>>,
    description: String,
}

impl SchedPlan {
    /// One line per computed node and view (backend, pass), one per split (inputs, copies),
    /// and the totals.
    pub fn describe(&self) -> &str {
        &self.description
    }

    pub fn n_splits(&self) -> usize {
        self.splits.splits.len()
    }

    pub fn n_copies(&self) -> usize {
        self.splits.n_copies()
    }
}

struct State {
    cache: Vec<Arc<SchedPlan>>,
    last: Option<Arc<SchedPlan>>,
    eval: Option<Box<dyn EvalCallback>>,
    /// Buffers this scheduler bound the user's outputs to in the last compute.
    results: Vec<Weak<dyn Buffer>>,
}

/// One graph over several backends (see the module doc).
pub struct Sched {
    id: u64,
    slots: Vec<Slot>,
    state: Mutex<State>,
    plans_made: AtomicUsize,
    /// `METASHARD_STEP_PROFILE`'s sums (`profile.rs`).
    profile: Mutex<profile::SchedProfile>,
}

impl Drop for Sched {
    fn drop(&mut self) {
        if let Some(r) = self.profile.lock().report(&self.backend_names()) {
            eprintln!("{r}");
        }
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Sched {
    /// A scheduler over `backends`, highest priority first, each computing in its device's
    /// buffer type.
    pub fn new(backends: Vec<Arc<dyn Backend>>) -> Result<Arc<Sched>> {
        let bts = backends.iter().map(|b| b.device().buffer_type()).collect();
        Self::with_buffer_types(backends, bts)
    }

    /// As [`Sched::new`] with the buffer type of each backend given (ggml's `bufts`): backends
    /// given the same `Arc` share memory, and pass (c) may move nodes between them.
    pub fn with_buffer_types(
        backends: Vec<Arc<dyn Backend>>,
        bts: Vec<Arc<dyn BufferType>>,
    ) -> Result<Arc<Sched>> {
        if backends.is_empty() || backends.len() > MAX_BACKENDS || bts.len() != backends.len() {
            return Err(Error::invalid_argument(
                "scheduler backends",
                format!("{} backends, {} buffer types", backends.len(), bts.len()),
                format!("needs 1..={MAX_BACKENDS} backends and one buffer type each"),
            ));
        }
        let slots = backends
            .into_iter()
            .zip(bts)
            .map(|(backend, bt)| Slot {
                device: backend.device(),
                name: backend.name(),
                backend,
                bt,
            })
            .collect();
        Ok(Arc::new(Sched {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            slots,
            state: Mutex::new(State {
                cache: Vec::new(),
                last: None,
                eval: None,
                results: Vec::new(),
            }),
            plans_made: AtomicUsize::new(0),
            profile: Mutex::new(Default::default()),
        }))
    }

    pub fn n_backends(&self) -> usize {
        self.slots.len()
    }

    /// The backends' names, in priority order.
    pub fn backend_names(&self) -> Vec<String> {
        self.slots.iter().map(|s| s.name.clone()).collect()
    }

    pub fn backend(&self, i: usize) -> Option<Arc<dyn Backend>> {
        self.slots.get(i).map(|s| s.backend.clone())
    }

    /// A buffer type whose tensors are each placed on the backend `place` names (by the
    /// tensor's name): load a model's weights and caches with it to put its layers on
    /// different backends.
    pub fn buffer_type(&self, place: PlaceFn) -> Arc<dyn BufferType> {
        Arc::new(SchedBufferType {
            placement: Arc::new(buffer::Placement {
                sched_id: self.id,
                bts: self.slots.iter().map(|s| s.bt.clone()).collect(),
                names: self.backend_names(),
                place,
            }),
        })
    }

    /// Set (or clear) the eval callback.
    pub fn set_eval_callback(&self, cb: Option<Box<dyn EvalCallback>>) {
        self.state.lock().eval = cb;
    }

    /// Take the eval callback back (to read what it gathered).
    pub fn take_eval_callback(&self) -> Option<Box<dyn EvalCallback>> {
        self.state.lock().eval.take()
    }

    /// How many plans were made (graphs not found in the cache).
    pub fn plans_made(&self) -> usize {
        self.plans_made.load(Ordering::Relaxed)
    }

    /// The plan of the last computed graph.
    pub fn last_plan(&self) -> Option<Arc<SchedPlan>> {
        self.state.lock().last.clone()
    }

    /// The plan of `g` without running it (no nodes asked for).
    pub fn plan(&self, g: &Graph) -> Result<SchedPlan> {
        let asked = vec![false; g.len()];
        self.make_plan(g, &asked, (g.signature(), asked.clone()))
    }

    fn make_plan(
        &self,
        g: &Graph,
        asked: &[bool],
        key: (Signature, Vec<bool>),
    ) -> Result<SchedPlan> {
        let ctx = passes::Ctx::new(g, &self.slots, self.id);
        let assignment = passes::assign(&ctx)?;
        let cut: Vec<bool> = self
            .slots
            .iter()
            .map(|s| s.device.kind() != DeviceKind::Meta)
            .collect();
        let splits = split::build_splits(&ctx, &assignment, asked, &cut)?;
        let description = split::describe(g, &self.backend_names(), &assignment, &splits);
        Ok(SchedPlan {
            assignment,
            splits,
            key,
            bound: g.bound_buffers(),
            description,
        })
    }

    fn cached_plan(&self, st: &mut State, g: &Graph, asked: &[bool]) -> Result<Arc<SchedPlan>> {
        let key = (g.signature(), asked.to_vec());
        st.cache
            .retain(|p| p.bound.iter().all(|w| w.strong_count() > 0));
        if let Some(i) = st.cache.iter().position(|p| p.key == key) {
            let p = st.cache.remove(i);
            st.cache.push(p.clone());
            return Ok(p);
        }
        let p = Arc::new(self.make_plan(g, asked, key)?);
        self.plans_made.fetch_add(1, Ordering::Relaxed);
        if st.cache.len() >= CACHE_SIZE {
            st.cache.remove(0);
        }
        st.cache.push(p.clone());
        Ok(p)
    }

    /// Run the splits of `plan` in order (see the module doc).
    fn run(&self, st: &mut State, g: &mut Graph, plan: &SchedPlan) -> Result<()> {
        let splits = &plan.splits.splits;
        let mut values: Vec<Option<Arc<[u8]>>> = vec![None; g.len()];
        let start = profile::now();
        let mut times = Vec::new();
        for (si, sp) in splits.iter().enumerate() {
            let slot = &self.slots[sp.backend];
            // Outputs stay where they were computed unless this backend runs again in this
            // compute (it may reuse its compute buffer): then they are copied out first.
            let runs_again = splits[si + 1..].iter().any(|s| s.backend == sp.backend);
            let (lg, t) = self.run_split(g, plan, si, &mut values, runs_again, &mut st.results)?;
            if start.is_some() {
                times.push(t);
            }
            if let Some(cb) = st.eval.as_mut() {
                for &(u, l) in &sp.asked {
                    let v = lg.read_f32(l)?;
                    if !cb.eval(g, u, &slot.name, &v) {
                        return Err(Error::EvalStopped {
                            node: g.name(u).to_string(),
                            backend: slot.name.clone(),
                        });
                    }
                }
            }
        }
        if start.is_some() {
            let mut p = self.profile.lock();
            p.splits(&times);
            p.compute(1, profile::since(start));
        }
        Ok(())
    }

    /// Run split `si` of `plan` for `g`: its inputs and copies in (`values`: what earlier
    /// splits captured), its compute, its captures out, its outputs bound into `g` (copied to
    /// host memory with `copy_out`, their buffers noted in `results`). Returns the split's
    /// computed graph and, where the step profile is on, its times (zeros where it is off).
    fn run_split(
        &self,
        g: &mut Graph,
        plan: &SchedPlan,
        si: usize,
        values: &mut [Option<Arc<[u8]>>],
        copy_out: bool,
        results: &mut Vec<Weak<dyn Buffer>>,
    ) -> Result<(Graph, profile::SplitTimes)> {
        let sp = &plan.splits.splits[si];
        let slot = &self.slots[sp.backend];
        let mut times = profile::SplitTimes {
            backend: sp.backend,
            ..Default::default()
        };
        let mut clock = profile::now();
        let mut lap = |into: &mut u64| {
            if let Some(t) = clock {
                *into = t.elapsed().as_nanos() as u64;
                clock = Some(std::time::Instant::now());
            }
        };
        let mut lg = sp.graph.clone();
        for &(u, l) in &sp.inputs {
            lg.node_mut(l).data = Some(g.node(u).data.clone().ok_or_else(|| Error::NoStorage {
                tensor: g.name(u).to_string(),
                reason: "inline data expected (the graph structure changed?)".into(),
            })?);
        }
        for c in &sp.copies {
            let bytes: Arc<[u8]> = match c.from {
                CopyFrom::Split(_) => {
                    values[c.src.index()]
                        .clone()
                        .ok_or_else(|| Error::Internal {
                            component: "sched",
                            reason: format!("copy of `{}` before it was read", g.name(c.src)),
                        })?
                }
                CopyFrom::Leaf => g.read_bytes(c.src)?.into(),
            };
            lg.node_mut(c.local).data = Some(bytes);
        }
        lap(&mut times.input);
        slot.backend.graph_compute(&mut lg)?;
        lap(&mut times.compute);
        for &(u, l) in &sp.captures {
            values[u.index()] = Some(lg.read_bytes(l)?.into());
        }
        for &(u, l) in &sp.outputs {
            let local = lg.storage(l).ok_or_else(|| Error::NoStorage {
                tensor: g.name(u).to_string(),
                reason: format!("{} returned the split without it", slot.name),
            })?;
            let storage = if copy_out {
                let layout = *lg.layout(l);
                let mut bytes = vec![0u8; layout.nbytes()];
                local.get(&layout, &mut bytes)?;
                // Host memory holds any backend's output (a meta device's buffers hold
                // only tensors placed through its split callback).
                let buf = HostBufferType.alloc_buffer(bytes.len())?;
                let dst = Storage::new(buf, 0);
                dst.set(&layout, &bytes)?;
                dst
            } else {
                local
            };
            results.push(Arc::downgrade(&storage.buffer));
            g.node_mut(u).storage = Some(storage);
        }
        lap(&mut times.output);
        Ok((lg, times))
    }

    /// Forget the storage this scheduler bound `g`'s nodes to in the last compute (so they
    /// are computed again).
    fn unbind_results(old: &[Weak<dyn Buffer>], g: &mut Graph) {
        for id in g.ids() {
            // A live weak pointer to the same allocation (a dead one's address may have been
            // reused by a buffer the user bound).
            let ours = g.node(id).storage.as_ref().is_some_and(|s| {
                old.iter().any(|w| {
                    w.strong_count() > 0 && std::ptr::addr_eq(w.as_ptr(), Arc::as_ptr(&s.buffer))
                })
            });
            if ours {
                g.node_mut(id).storage = None;
            }
        }
    }

    /// The pipeline over the splits (`graph_compute_many`): at tick `t`, split `k` of graph
    /// `t - k` for every `k` at once, one thread per backend (a backend's tasks of one tick
    /// one after another), so each backend works on the next graph while the later backends
    /// work on the earlier ones (GPipe's schedule, Huang et al. 2019, arXiv:1811.06965).
    /// Split `k` of graph `j` runs after splits `0..k` of graph `j` (its inputs) and after
    /// split `k` of graph `j - 1` (what that wrote in the bound buffers of its backend, a KV
    /// cache's rows); every output is copied to host memory, since each backend runs again.
    fn run_pipelined(
        &self,
        st: &mut State,
        graphs: &mut [Graph],
        plans: &[Arc<SchedPlan>],
        done: &mut dyn FnMut(usize, &Graph) -> Result<()>,
    ) -> Result<()> {
        let n_splits = plans[0].splits.splits.len();
        let backend_of = |k: usize| plans[0].splits.splits[k].backend;
        let mut values: Vec<Vec<Option<Arc<[u8]>>>> =
            graphs.iter().map(|g| vec![None; g.len()]).collect();
        let m = graphs.len();
        let start = profile::now();
        for t in 0..m + n_splits - 1 {
            let tick = profile::now();
            // The tick's tasks (split, graph, its values), grouped by backend.
            let mut by_backend: Vec<Vec<Task>> =
                (0..self.slots.len()).map(|_| Vec::new()).collect();
            for (j, (g, v)) in graphs.iter_mut().zip(values.iter_mut()).enumerate() {
                if let Some(k) = t.checked_sub(j).filter(|&k| k < n_splits) {
                    by_backend[backend_of(k)].push((k, &plans[j], g, v));
                }
            }
            type Done = (Vec<Weak<dyn Buffer>>, Vec<profile::SplitTimes>);
            let outcomes: Vec<Result<Done>> = std::thread::scope(|sc| {
                let handles: Vec<_> = by_backend
                    .into_iter()
                    .filter(|tasks| !tasks.is_empty())
                    .map(|tasks| {
                        sc.spawn(move || -> Result<Done> {
                            let (mut results, mut times) = (Vec::new(), Vec::new());
                            for (k, plan, g, v) in tasks {
                                times.push(self.run_split(g, plan, k, v, true, &mut results)?.1);
                            }
                            Ok((results, times))
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(Error::Internal {
                                component: "sched",
                                reason: "a pipeline stage's thread panicked".into(),
                            })
                        })
                    })
                    .collect()
            });
            let mut times = Vec::new();
            for o in outcomes {
                let (results, t) = o?;
                st.results.extend(results);
                times.extend(t);
            }
            if tick.is_some() {
                self.profile.lock().tick(t, profile::since(tick), &times);
            }
            if let Some(j) = (t + 1).checked_sub(n_splits).filter(|&j| j < m) {
                done(j, &graphs[j])?;
            }
        }
        if start.is_some() {
            self.profile.lock().compute(m, profile::since(start));
        }
        Ok(())
    }
}

impl Backend for Sched {
    fn name(&self) -> String {
        format!("sched({})", self.backend_names().join(","))
    }

    /// The highest-priority backend's device.
    fn device(&self) -> Arc<dyn Device> {
        self.slots[0].device.clone()
    }

    fn synchronize(&self) -> Result<()> {
        self.slots.iter().try_for_each(|s| s.backend.synchronize())
    }

    fn compute_buffer_bytes(&self) -> Vec<usize> {
        self.slots
            .iter()
            .flat_map(|s| s.backend.compute_buffer_bytes())
            .collect()
    }

    fn graph_compute(&self, g: &mut Graph) -> Result<()> {
        let mut st = self.state.lock();
        // Results of the last compute bound into this graph are computed again.
        let old = std::mem::take(&mut st.results);
        Self::unbind_results(&old, g);
        let asked: Vec<bool> = match st.eval.as_mut() {
            Some(cb) => g
                .ids()
                .map(|id| {
                    let n = g.node(id);
                    !n.is_leaf() && !n.op.is_view() && cb.ask(g, id)
                })
                .collect(),
            None => Vec::new(),
        };
        let plan = self.cached_plan(&mut st, g, &asked)?;
        st.last = Some(plan.clone());
        self.run(&mut st, g, &plan)
    }

    /// The graphs pipelined through the splits (`run_pipelined`) when there are several,
    /// no eval callback is set and every graph's splits run on the same backends in the same
    /// order (a model's micro-batches); else one after another.
    fn graph_compute_many(
        &self,
        graphs: &mut [Graph],
        done: &mut dyn FnMut(usize, &Graph) -> Result<()>,
    ) -> Result<()> {
        let one_by_one =
            |graphs: &mut [Graph], done: &mut dyn FnMut(usize, &Graph) -> Result<()>| {
                graphs.iter_mut().enumerate().try_for_each(|(j, g)| {
                    self.graph_compute(g)?;
                    done(j, g)
                })
            };
        let mut st = self.state.lock();
        if graphs.len() < 2 || st.eval.is_some() {
            drop(st);
            return one_by_one(graphs, done);
        }
        let old = std::mem::take(&mut st.results);
        let mut plans = Vec::with_capacity(graphs.len());
        for g in graphs.iter_mut() {
            Self::unbind_results(&old, g);
            let plan = self.cached_plan(&mut st, g, &[])?;
            plans.push(plan);
        }
        let backends =
            |p: &SchedPlan| -> Vec<usize> { p.splits.splits.iter().map(|s| s.backend).collect() };
        if plans.iter().any(|p| backends(p) != backends(&plans[0])) {
            drop(st);
            return one_by_one(graphs, done);
        }
        st.last = plans.last().cloned();
        self.run_pipelined(&mut st, graphs, &plans, done)
    }
}
