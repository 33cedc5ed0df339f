//! Targets: a [`Target`] names a backend and makes its devices; the harness runs cases on one
//! of them ([`Target::backend`], [`Target::run_cases`]) and on a meta device over several
//! ([`Target::meta_device`], [`Target::meta_setup`], [`Target::run_meta`]), with each input in
//! the place the case's placement gives. [`run_single`], the graph on one plain CPU device with
//! every input as inline data, is the reference of the meta runs.

use super::case::{BuildFn, Case, Input};
use super::compare::{Out, read_outputs};
use super::meta::Place;
use super::run::{CaseReport, RunOptions, Summary, run_case};
use metashard::backend::alloc_tensors;
use metashard::buffer::Buffer;
use metashard::meta::{MetaBackend, MetaBuffer, MetaDevice, MetaOptions, SplitFn, TensorInfo};
use metashard::split_state::{SplitAxis, SplitState};
use metashard::{Backend, Device, Graph, Result, Storage, TensorId, parse_devices};
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex};

/// `n` devices of a backend, each with `threads` worker threads where the backend has such a
/// notion (others ignore it).
pub type DevicesFn = fn(n: usize, threads: usize) -> Result<Vec<Arc<dyn Device>>>;

/// A meta device over devices of a target, with a split callback and options.
pub type MetaFn = fn(Vec<Arc<dyn Device>>, SplitFn, MetaOptions) -> Result<Arc<MetaDevice>>;

/// A backend the whole harness runs on (see the `support` module doc).
#[derive(Clone, Copy)]
pub struct Target {
    /// Names the target in reports.
    pub name: &'static str,
    pub devices: DevicesFn,
    /// `MetaDevice::with_options` unless the backend brings its own way of joining devices.
    pub meta: MetaFn,
    /// Why the target cannot run here (no GPU), or `None`: every harness test of an absent
    /// target passes without running, after one printed line saying why.
    pub absent_because: fn() -> Option<String>,
}

/// A meta backend of one device count for many op cases, and the split table its callback
/// answers from (set before each case from the case's places).
struct MetaRig {
    backend: Arc<dyn Backend>,
    table: Arc<Mutex<HashMap<String, SplitState>>>,
}

fn cpu_devices(n: usize, threads: usize) -> Result<Vec<Arc<dyn Device>>> {
    parse_devices(&format!("cpu:{n}x{threads}"))
}

/// The CPU backend: `cpu:NxT`.
pub const CPU: Target = Target::new("cpu", cpu_devices);

/// N logical devices on GPU 0 (`cuda:0xN`); threads do not apply.
#[cfg(feature = "cuda")]
fn cuda_devices(n: usize, _threads: usize) -> Result<Vec<Arc<dyn Device>>> {
    parse_devices(&format!("cuda:0x{n}"))
}

/// Why the CUDA backend cannot run here, if it cannot.
#[cfg(feature = "cuda")]
pub fn no_gpu() -> Option<String> {
    match metashard::cuda::device::gpu_count() {
        Ok(0) => Some("the CUDA driver sees no GPU".into()),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// The CUDA backend: `cuda:0xN`, absent without a GPU.
#[cfg(feature = "cuda")]
pub const CUDA: Target = Target::new("cuda", cuda_devices).unless(no_gpu);

impl Target {
    /// A target joined into meta devices by `MetaDevice::with_options`.
    pub const fn new(name: &'static str, devices: DevicesFn) -> Target {
        Target {
            name,
            devices,
            meta: MetaDevice::with_options,
            absent_because: || None,
        }
    }

    /// The same target, absent when `why` says so.
    pub const fn unless(self, why: fn() -> Option<String>) -> Target {
        Target {
            absent_because: why,
            ..self
        }
    }

    /// Whether this target cannot run here; the first call per process prints why.
    pub fn absent(&self) -> bool {
        static SAID: std::sync::Once = std::sync::Once::new();
        match (self.absent_because)() {
            None => false,
            Some(why) => {
                SAID.call_once(|| println!("skipped: the {} target: {why}", self.name));
                true
            }
        }
    }

    /// A backend on one device with `threads` threads.
    pub fn backend(&self, threads: usize) -> Result<Arc<dyn Backend>> {
        (self.devices)(1, threads)?[0].init_backend()
    }

    /// A meta device over `n` devices of `threads` threads, splitting tensors as `states`
    /// says by name (mirrored when absent).
    pub fn meta_device(
        &self,
        n: usize,
        threads: usize,
        states: HashMap<String, SplitState>,
        options: MetaOptions,
    ) -> Result<Arc<MetaDevice>> {
        (self.meta)((self.devices)(n, threads)?, table_split(states), options)
    }

    /// A graph whose inputs are placed on a meta device of `n` devices as `places` say, with
    /// their data written (partial inputs: each device's piece into its own slice).
    pub fn meta_setup(
        &self,
        inputs: &[Input],
        places: &[Place],
        (n, threads): (usize, usize),
        options: MetaOptions,
    ) -> Result<MetaSetup> {
        let mut states = HashMap::new();
        let mut layouts = Vec::new();
        for (l, p) in inputs.iter().zip(places) {
            if !matches!(p, Place::Inline) {
                states.insert(l.name.clone(), p.state(n));
                layouts.push(l.layout());
            }
        }
        let device = self.meta_device(n, threads, states, options)?;
        let backend = device.meta_backend()?;
        let buffer = if layouts.is_empty() {
            None
        } else {
            Some(alloc_tensors(device.buffer_type().as_ref(), &layouts)?)
        };
        let mut g = Graph::new();
        let mut ids = Vec::new();
        let mut offsets = Vec::new();
        let mut next = 0;
        for (l, p) in inputs.iter().zip(places) {
            if let Place::Inline = p {
                let id = g.input(&l.name, l.dtype, l.ne)?;
                g.set_data(id, l.bytes().to_vec())?;
                ids.push(id);
                offsets.push(None);
                continue;
            }
            let (buf, offs) = buffer.as_ref().expect("placed inputs have a buffer");
            let off = offs[next];
            next += 1;
            let id = g.new_tensor(&l.name, l.dtype, l.ne)?;
            g.bind(id, Storage::new(buf.clone(), off))?;
            match p {
                Place::Partial(pieces) => {
                    let mb = buf
                        .as_any()
                        .downcast_ref::<MetaBuffer>()
                        .expect("a meta buffer");
                    let t = mb.tensor_at(off).expect("placed tensor");
                    assert_eq!(t.state.axis, SplitAxis::Partial);
                    for (d, (st, ll)) in t.local.iter().enumerate() {
                        st.set(ll, &pieces[d])?;
                    }
                }
                _ => g.storage(id).expect("bound").set(&l.layout(), l.bytes())?,
            }
            ids.push(id);
            offsets.push(Some(off));
        }
        Ok(MetaSetup {
            device,
            backend,
            graph: g,
            inputs: ids,
            buffer: buffer.map(|b| b.0),
            offsets,
        })
    }

    /// The case's graph on a meta device with its inputs placed as its placement says,
    /// `threads` per device; also returns the setup (to inspect the placed inputs and the plan
    /// afterwards).
    pub fn run_meta(
        &self,
        case: &Case,
        threads: usize,
        options: MetaOptions,
    ) -> Result<(Vec<Out>, MetaSetup)> {
        let p = case
            .placement
            .as_ref()
            .expect("a case placed on a meta device");
        let mut s = self.meta_setup(&case.inputs, &p.places, (p.n, threads), options)?;
        let outs = (case.build)(&mut s.graph, &s.inputs)?;
        let got = compute_and_read(s.backend.as_ref(), &mut s.graph, &outs)?;
        Ok((got, s))
    }

    /// Run every case with the op harness (never stopping at the first failure): cases without
    /// a placement on one device, placed ones on a meta device of their `n` devices whose split
    /// table follows the case's places (each input in a `Place::State`). One backend per
    /// device count runs all its cases, as a model's steps would.
    pub fn run_cases(&self, cases: &[Case], opts: &RunOptions) -> Summary {
        let mut single: Option<Arc<dyn Backend>> = None;
        let mut rigs: HashMap<usize, MetaRig> = HashMap::new();
        let mut one = |c: &Case| -> std::result::Result<CaseReport, String> {
            let fail = |e: String| format!("{c:?} [{}]: {e}", self.name);
            let Some(p) = &c.placement else {
                if single.is_none() {
                    single = Some(self.backend(1).map_err(|e| fail(e.to_string()))?);
                }
                return run_case(single.as_deref().unwrap(), c, opts);
            };
            if let Entry::Vacant(v) = rigs.entry(p.n) {
                v.insert(self.meta_rig(p.n).map_err(|e| fail(e.to_string()))?);
            }
            let rig = &rigs[&p.n];
            let mut states = HashMap::new();
            for (inp, place) in c.inputs.iter().zip(&p.places) {
                let Place::State(s) = place else {
                    return Err(fail(format!(
                        "the op harness binds every input: `{}` must be in a state, not {}",
                        inp.name,
                        place.describe()
                    )));
                };
                states.insert(inp.name.clone(), s.clone());
            }
            *rig.table.lock().unwrap() = states;
            run_case(rig.backend.as_ref(), c, opts)
        };
        Summary {
            results: cases.iter().map(&mut one).collect(),
        }
    }

    /// A meta backend over `n` devices of one thread whose split table can change.
    fn meta_rig(&self, n: usize) -> Result<MetaRig> {
        let table = Arc::new(Mutex::new(HashMap::new()));
        let t = table.clone();
        let split: SplitFn = Arc::new(move |info: &TensorInfo| {
            Ok(t.lock()
                .unwrap()
                .get(info.name)
                .cloned()
                .unwrap_or_else(|| SplitState::mirrored(info.n_devices)))
        });
        let device = (self.meta)((self.devices)(n, 1)?, split, MetaOptions::default())?;
        Ok(MetaRig {
            backend: device.init_backend()?,
            table,
        })
    }
}

/// A split callback answering from a table of tensor names (mirrored when absent).
pub fn table_split(states: HashMap<String, SplitState>) -> SplitFn {
    Arc::new(move |t: &TensorInfo| {
        Ok(states
            .get(t.name)
            .cloned()
            .unwrap_or_else(|| SplitState::mirrored(t.n_devices)))
    })
}

/// A graph whose inputs are placed on a meta device (see [`Target::meta_setup`]).
pub struct MetaSetup {
    pub device: Arc<MetaDevice>,
    pub backend: Arc<MetaBackend>,
    pub graph: Graph,
    pub inputs: Vec<TensorId>,
    /// The meta buffer holding the placed inputs, and each placed input's offset.
    pub buffer: Option<Arc<dyn Buffer>>,
    pub offsets: Vec<Option<usize>>,
}

impl MetaSetup {
    /// A new graph over the same placed inputs (bound to the same meta-buffer tensors, whose
    /// data stay), with inline inputs taking the bytes of `inputs` (a later step of a loop).
    pub fn fresh_graph(&self, inputs: &[Input]) -> Result<(Graph, Vec<TensorId>)> {
        let mut g = Graph::new();
        let mut ids = Vec::new();
        for (l, off) in inputs.iter().zip(&self.offsets) {
            let id = match off {
                None => {
                    let id = g.input(&l.name, l.dtype, l.ne)?;
                    g.set_data(id, l.bytes().to_vec())?;
                    id
                }
                Some(off) => {
                    let id = g.new_tensor(&l.name, l.dtype, l.ne)?;
                    let buf = self.buffer.clone().expect("placed inputs have a buffer");
                    g.bind(id, Storage::new(buf, *off))?;
                    id
                }
            };
            ids.push(id);
        }
        Ok((g, ids))
    }

    /// The values of input `i` as its meta buffer holds them now (None if inline).
    pub fn placed_values(&self, inputs: &[Input], i: usize) -> Result<Option<Vec<f32>>> {
        let Some(off) = self.offsets[i] else {
            return Ok(None);
        };
        let buf = self.buffer.as_ref().expect("placed inputs have a buffer");
        let l = &inputs[i];
        let mut bytes = vec![0u8; l.layout().nbytes()];
        buf.get_tensor(&l.layout(), off, &mut bytes, 0)?;
        Ok(Some(metashard::dtype::bytes_to_f32(
            l.dtype,
            &bytes,
            l.nelements(),
        )?))
    }
}

/// The reference of the meta runs: the graph on one plain CPU device (`cpu:1x1`) with every
/// input as inline data.
pub fn run_single(inputs: &[Input], build: &BuildFn) -> Result<Vec<Out>> {
    let backend = CPU.backend(1)?;
    let mut g = Graph::new();
    let mut ids = Vec::new();
    for l in inputs {
        let id = g.input(&l.name, l.dtype, l.ne)?;
        g.set_data(id, l.bytes().to_vec())?;
        ids.push(id);
    }
    let outs = build(&mut g, &ids)?;
    compute_and_read(backend.as_ref(), &mut g, &outs)
}

/// Compute `outs` of `g` on the backend and read them.
pub fn compute_and_read(
    backend: &dyn Backend,
    g: &mut Graph,
    outs: &[TensorId],
) -> Result<Vec<Out>> {
    for &o in outs {
        g.set_output(o);
    }
    backend.graph_compute(g)?;
    read_outputs(g, outs)
}
