//! Shared helpers of the meta-device tests: a deterministic generator, test leaves with data,
//! random split states (uneven and zero extents, segments, whole blocks or heads), placing leaves
//! on a meta device in a chosen state (partial tensors get random per-device pieces written into
//! each device's slice directly), running one graph on a single CPU device and on a meta device,
//! and comparing the results.
#![allow(dead_code)]

pub mod cases;
pub mod check;

use metashard::backend::alloc_tensors;
use metashard::buffer::Buffer;
use metashard::dtype::{bytes_to_f32, f32_to_bytes};
use metashard::meta::{MetaBackend, MetaBuffer, MetaDevice, MetaOptions, SplitFn, TensorInfo};
use metashard::split_state::{SplitAxis, SplitState};
use metashard::{Backend, DType, Graph, Layout, Result, Storage, TensorId, parse_devices};
use std::collections::HashMap;
use std::sync::Arc;

/// SplitMix64: a small deterministic generator for test data and choices.
#[derive(Clone, Debug)]
pub struct TestRng(pub u64);

impl TestRng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }

    pub fn pick<T: Clone>(&mut self, v: &[T]) -> T {
        v[self.below(v.len())].clone()
    }

    /// A multiple of 1/64 in [-2, 2]: exact in f32, f16 and bf16, and sums of a few of them
    /// are exact in f32, so sums in any order agree.
    pub fn grid(&mut self) -> f32 {
        (self.below(257) as i32 - 128) as f32 / 64.0
    }

    /// A random permutation of `0..n`.
    pub fn perm(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            v.swap(i, self.below(i + 1));
        }
        v
    }
}

/// A leaf of a test graph and its value (the bytes the single-device run gets).
#[derive(Clone, Debug)]
pub struct Leaf {
    pub name: String,
    pub dtype: DType,
    pub ne: [usize; 4],
    pub bytes: Vec<u8>,
}

impl Leaf {
    pub fn layout(&self) -> Layout {
        Layout::contiguous(self.dtype, self.ne)
    }

    pub fn nelements(&self) -> usize {
        self.ne.iter().product()
    }

    /// The value as f32 in logical order.
    pub fn values(&self) -> Vec<f32> {
        bytes_to_f32(self.dtype, &self.bytes, self.nelements()).expect("leaf bytes")
    }

    pub fn from_f32(name: &str, dtype: DType, ne: [usize; 4], v: &[f32]) -> Leaf {
        assert_eq!(v.len(), ne.iter().product::<usize>(), "{name}");
        Leaf {
            name: name.to_string(),
            dtype,
            ne,
            bytes: f32_to_bytes(dtype, v).expect("encodable leaf"),
        }
    }

    pub fn from_i32(name: &str, ne: [usize; 4], v: &[i32]) -> Leaf {
        assert_eq!(v.len(), ne.iter().product::<usize>(), "{name}");
        Leaf {
            name: name.to_string(),
            dtype: DType::I32,
            ne,
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// Random grid values (quantized types: the quantization of uniform values in [-1, 1]).
    pub fn random(rng: &mut TestRng, name: &str, dtype: DType, ne: [usize; 4]) -> Leaf {
        let n: usize = ne.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.grid()).collect();
        Leaf::from_f32(name, dtype, ne, &v)
    }

    /// Random values bounded away from zero: sign * [0.5, 2] on the grid (divisors).
    pub fn random_nonzero(rng: &mut TestRng, name: &str, dtype: DType, ne: [usize; 4]) -> Leaf {
        let n: usize = ne.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                let m = (32 + rng.below(97)) as f32 / 64.0;
                if rng.chance(1, 2) { m } else { -m }
            })
            .collect();
        Leaf::from_f32(name, dtype, ne, &v)
    }
}

/// How a leaf reaches the meta device.
#[derive(Clone, Debug)]
pub enum Place {
    /// Inline input data (mirrored, uploaded every run).
    Inline,
    /// Placed in the meta buffer in this state. Partial leaves hold the given per-device pieces.
    State(SplitState),
    /// Placed in the meta buffer as Partial with these per-device pieces (bytes of the dtype).
    Partial(Vec<Vec<u8>>),
}

impl Place {
    pub fn state(&self, n: usize) -> SplitState {
        match self {
            Place::Inline => SplitState::mirrored(n),
            Place::State(s) => s.clone(),
            Place::Partial(_) => SplitState::partial(n),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Place::Inline => "Inline".into(),
            Place::State(s) => s.to_string(),
            Place::Partial(_) => "Partial".into(),
        }
    }
}

/// Random extents of `total` (a multiple of `gran`) over `n` devices, in whole `gran` units:
/// even, all on one device, or random cuts (zeros included).
pub fn random_extents(rng: &mut TestRng, total: usize, gran: usize, n: usize) -> Vec<usize> {
    let g = gran.max(1);
    assert_eq!(total % g, 0, "total {total} in units of {g}");
    let units = total / g;
    let mut e = vec![0usize; n];
    match rng.below(4) {
        0 => {
            for (d, x) in e.iter_mut().enumerate() {
                *x = units / n + usize::from(d < units % n);
            }
        }
        1 => e[rng.below(n)] = units,
        _ => {
            for _ in 0..units {
                e[rng.below(n)] += 1;
            }
        }
    }
    e.into_iter().map(|x| x * g).collect()
}

/// A random split of dimension `axis` of `ne`, maybe in segments (each a whole number of
/// `gran` units).
pub fn random_split(
    rng: &mut TestRng,
    axis: usize,
    ne: [usize; 4],
    gran: usize,
    n: usize,
    segments: bool,
) -> SplitState {
    let g = gran.max(1);
    let units = ne[axis] / g;
    if segments && units >= 2 && rng.chance(1, 3) {
        let nseg = 2 + rng.below(2.min(units - 1));
        // Cut points inside 1..units, distinct and sorted: segments of at least one unit.
        let mut cuts: Vec<usize> = rng.perm(units - 1).into_iter().map(|c| c + 1).collect();
        cuts.truncate(nseg - 1);
        cuts.sort_unstable();
        let mut segs = Vec::new();
        let mut prev = 0;
        for c in cuts.into_iter().chain([units]) {
            segs.push(random_extents(rng, (c - prev) * g, g, n));
            prev = c;
        }
        return SplitState::segmented(axis, &segs);
    }
    SplitState::axis(axis, &random_extents(rng, ne[axis], g, n))
}

/// The states a leaf may take in a test.
#[derive(Clone, Debug)]
pub struct Space {
    pub inline: bool,
    pub mirrored: bool,
    pub partial: bool,
    /// Axes that may be split.
    pub axes: Vec<usize>,
    /// Granularity of extents per axis.
    pub gran: [usize; 4],
    pub segments: bool,
    /// Extra states to choose among (e.g. whole-head or fused-segment splits), taken half the
    /// time when present.
    pub extra: Vec<SplitState>,
}

impl Space {
    /// Everything the leaf's dtype allows: partial for float types, every axis, quantized
    /// axis-0 extents in whole blocks, segments.
    pub fn any(leaf: &Leaf) -> Space {
        Space {
            inline: true,
            mirrored: true,
            partial: leaf.dtype.is_float(),
            axes: vec![0, 1, 2, 3],
            gran: [leaf.dtype.block_size(), 1, 1, 1],
            segments: true,
            extra: Vec::new(),
        }
    }

    pub fn no_partial(mut self) -> Space {
        self.partial = false;
        self
    }

    pub fn axes(mut self, axes: &[usize]) -> Space {
        self.axes = axes.to_vec();
        self
    }

    pub fn gran(mut self, axis: usize, g: usize) -> Space {
        self.gran[axis] = g;
        self
    }

    pub fn extra(mut self, s: SplitState) -> Space {
        self.extra.push(s);
        self
    }
}

/// Per-device pieces of a partial leaf: random grid values on devices 1.., and device 0 holds
/// the rest. The leaf's value becomes the sum of the pieces (as rounded to its dtype), which
/// is exact for the grid values used.
pub fn partial_pieces(rng: &mut TestRng, leaf: &mut Leaf, n: usize) -> Vec<Vec<u8>> {
    let v = leaf.values();
    let mut pieces: Vec<Vec<f32>> = vec![vec![0.0; v.len()]; n];
    for p in pieces.iter_mut().skip(1) {
        p.iter_mut().for_each(|x| *x = rng.grid());
    }
    for (i, &x) in v.iter().enumerate() {
        let rest: f32 = pieces[1..].iter().map(|p| p[i]).sum();
        pieces[0][i] = x - rest;
    }
    let bytes: Vec<Vec<u8>> = pieces
        .iter()
        .map(|p| f32_to_bytes(leaf.dtype, p).expect("float piece"))
        .collect();
    // The value is what the pieces sum to after rounding to the dtype.
    let rounded: Vec<Vec<f32>> = bytes
        .iter()
        .map(|b| bytes_to_f32(leaf.dtype, b, v.len()).expect("piece"))
        .collect();
    let sum: Vec<f32> = (0..v.len())
        .map(|i| rounded.iter().map(|p| p[i]).sum())
        .collect();
    leaf.bytes = f32_to_bytes(leaf.dtype, &sum).expect("float leaf");
    pieces_check(&rounded, &sum);
    bytes
}

fn pieces_check(rounded: &[Vec<f32>], sum: &[f32]) {
    for (i, &s) in sum.iter().enumerate() {
        let again: f32 = rounded.iter().rev().map(|p| p[i]).sum();
        assert_eq!(again, s, "partial pieces must sum exactly in any order");
    }
}

/// A random place in `space` (partial places rewrite the leaf's value to their sum).
pub fn random_place(rng: &mut TestRng, leaf: &mut Leaf, space: &Space, n: usize) -> Place {
    let mut opts: Vec<u8> = Vec::new();
    if space.inline {
        opts.push(0);
    }
    if space.mirrored {
        opts.push(1);
    }
    if space.partial {
        opts.push(2);
    }
    let axes: Vec<usize> = space
        .axes
        .iter()
        .copied()
        .filter(|&k| leaf.ne[k].is_multiple_of(space.gran[k].max(1)))
        .collect();
    // Splits are the interesting case: weight them up.
    if !axes.is_empty() {
        opts.extend([3, 3, 3]);
    }
    if !space.extra.is_empty() && (opts.is_empty() || rng.chance(1, 2)) {
        return Place::State(rng.pick(&space.extra));
    }
    match rng.pick(&opts) {
        0 => Place::Inline,
        1 => Place::State(SplitState::mirrored(n)),
        2 => Place::Partial(partial_pieces(rng, leaf, n)),
        _ => {
            let k = rng.pick(&axes);
            Place::State(random_split(
                rng,
                k,
                leaf.ne,
                space.gran[k],
                n,
                space.segments,
            ))
        }
    }
}

/// Builds the graph under test from its leaves; returns the tensors to compare.
pub type Build<'a> = dyn Fn(&mut Graph, &[TensorId]) -> Result<Vec<TensorId>> + 'a;

/// One output read back.
#[derive(Clone, Debug)]
pub struct Out {
    pub dtype: DType,
    pub ne: [usize; 4],
    pub values: Vec<f32>,
}

fn read_outputs(g: &Graph, outs: &[TensorId]) -> Result<Vec<Out>> {
    outs.iter()
        .map(|&id| {
            Ok(Out {
                dtype: g.layout(id).dtype,
                ne: g.layout(id).ne,
                values: g.read_f32(id)?,
            })
        })
        .collect()
}

/// The reference: the graph on one CPU device (`cpu:1x1`) with every leaf as inline data.
pub fn run_single(leaves: &[Leaf], build: &Build) -> Result<Vec<Out>> {
    let dev = parse_devices("cpu:1x1")?;
    let backend = dev[0].init_backend()?;
    let mut g = Graph::new();
    let mut ids = Vec::new();
    for l in leaves {
        let id = g.input(&l.name, l.dtype, l.ne)?;
        g.set_data(id, l.bytes.clone())?;
        ids.push(id);
    }
    let outs = build(&mut g, &ids)?;
    for &o in &outs {
        g.set_output(o);
    }
    backend.graph_compute(&mut g)?;
    read_outputs(&g, &outs)
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

/// A meta device over `cpu:Nx1` with a split table.
pub fn meta_device(
    n: usize,
    states: HashMap<String, SplitState>,
    options: MetaOptions,
) -> Result<Arc<MetaDevice>> {
    meta_device_threads(n, 1, states, options)
}

/// As `meta_device`, over `cpu:NxT` (T worker threads per device).
pub fn meta_device_threads(
    n: usize,
    threads: usize,
    states: HashMap<String, SplitState>,
    options: MetaOptions,
) -> Result<Arc<MetaDevice>> {
    MetaDevice::with_options(
        parse_devices(&format!("cpu:{n}x{threads}"))?,
        table_split(states),
        options,
    )
}

/// A graph whose leaves are placed on a meta device of `n` devices as `places` say, with their
/// data written (partial leaves: each device's piece into its own slice).
pub struct MetaSetup {
    pub device: Arc<MetaDevice>,
    pub backend: Arc<MetaBackend>,
    pub graph: Graph,
    pub leaves: Vec<TensorId>,
    /// The meta buffer holding the placed leaves, and each placed leaf's offset.
    pub buffer: Option<Arc<dyn Buffer>>,
    pub offsets: Vec<Option<usize>>,
}

pub fn meta_setup(
    leaves: &[Leaf],
    places: &[Place],
    n: usize,
    options: MetaOptions,
) -> Result<MetaSetup> {
    meta_setup_threads(leaves, places, n, 1, options)
}

/// As `meta_setup`, with `threads` worker threads per device.
pub fn meta_setup_threads(
    leaves: &[Leaf],
    places: &[Place],
    n: usize,
    threads: usize,
    options: MetaOptions,
) -> Result<MetaSetup> {
    let mut states = HashMap::new();
    let mut layouts = Vec::new();
    for (l, p) in leaves.iter().zip(places) {
        if !matches!(p, Place::Inline) {
            states.insert(l.name.clone(), p.state(n));
            layouts.push(l.layout());
        }
    }
    let device = meta_device_threads(n, threads, states, options)?;
    let backend = device.meta_backend()?;
    let buffer = if layouts.is_empty() {
        None
    } else {
        let bt = metashard::Device::buffer_type(device.as_ref());
        Some(alloc_tensors(bt.as_ref(), &layouts)?)
    };
    let mut g = Graph::new();
    let mut ids = Vec::new();
    let mut offsets = Vec::new();
    let mut next = 0;
    for (l, p) in leaves.iter().zip(places) {
        if let Place::Inline = p {
            let id = g.input(&l.name, l.dtype, l.ne)?;
            g.set_data(id, l.bytes.clone())?;
            ids.push(id);
            offsets.push(None);
            continue;
        }
        let (buf, offs) = buffer.as_ref().expect("placed leaves have a buffer");
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
            _ => g.storage(id).expect("bound").set(&l.layout(), &l.bytes)?,
        }
        ids.push(id);
        offsets.push(Some(off));
    }
    Ok(MetaSetup {
        device,
        backend,
        graph: g,
        leaves: ids,
        buffer: buffer.map(|b| b.0),
        offsets,
    })
}

impl MetaSetup {
    /// A new graph over the same placed leaves (bound to the same meta-buffer tensors, whose
    /// data stay), with inline leaves taking the bytes of `leaves` (a later step of a loop).
    pub fn fresh_graph(&self, leaves: &[Leaf]) -> Result<(Graph, Vec<TensorId>)> {
        let mut g = Graph::new();
        let mut ids = Vec::new();
        for (l, off) in leaves.iter().zip(&self.offsets) {
            let id = match off {
                None => {
                    let id = g.input(&l.name, l.dtype, l.ne)?;
                    g.set_data(id, l.bytes.clone())?;
                    id
                }
                Some(off) => {
                    let id = g.new_tensor(&l.name, l.dtype, l.ne)?;
                    let buf = self.buffer.clone().expect("placed leaves have a buffer");
                    g.bind(id, Storage::new(buf, *off))?;
                    id
                }
            };
            ids.push(id);
        }
        Ok((g, ids))
    }
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

/// The values of leaf `i` of a setup as its meta buffer holds them now (None if inline).
pub fn placed_values(s: &MetaSetup, leaves: &[Leaf], i: usize) -> Result<Option<Vec<f32>>> {
    let Some(off) = s.offsets[i] else {
        return Ok(None);
    };
    let buf = s.buffer.as_ref().expect("placed leaves have a buffer");
    let mut bytes = vec![0u8; leaves[i].layout().nbytes()];
    buf.get_tensor(&leaves[i].layout(), off, &mut bytes, 0)?;
    Ok(Some(bytes_to_f32(
        leaves[i].dtype,
        &bytes,
        leaves[i].nelements(),
    )?))
}

/// The graph on a meta device of `n` devices with its leaves placed as `places` say.
pub fn run_meta(
    leaves: &[Leaf],
    places: &[Place],
    n: usize,
    options: MetaOptions,
    build: &Build,
) -> Result<Vec<Out>> {
    Ok(run_meta_keep(leaves, places, (n, 1), options, build)?.0)
}

/// As `run_meta` with `threads` per device, also returning the setup (to inspect the placed
/// leaves and the plan afterwards).
pub fn run_meta_keep(
    leaves: &[Leaf],
    places: &[Place],
    (n, threads): (usize, usize),
    options: MetaOptions,
    build: &Build,
) -> Result<(Vec<Out>, MetaSetup)> {
    let mut s = meta_setup_threads(leaves, places, n, threads, options)?;
    let outs = build(&mut s.graph, &s.leaves)?;
    for &o in &outs {
        s.graph.set_output(o);
    }
    s.backend.graph_compute(&mut s.graph)?;
    Ok((read_outputs(&s.graph, &outs)?, s))
}

/// Largest absolute difference, or an error if shapes differ or NaNs appear on one side only.
pub fn max_diff(want: &Out, got: &Out) -> std::result::Result<f32, String> {
    if want.ne != got.ne || want.dtype != got.dtype {
        return Err(format!(
            "shape/dtype {:?} {} vs {:?} {}",
            want.ne, want.dtype, got.ne, got.dtype
        ));
    }
    let mut m = 0f32;
    for (i, (a, b)) in want.values.iter().zip(&got.values).enumerate() {
        if a.is_nan() != b.is_nan() {
            return Err(format!("element {i}: {a} vs {b}"));
        }
        if a.is_nan() {
            continue;
        }
        if a.is_infinite() || b.is_infinite() {
            if a != b {
                return Err(format!("element {i}: {a} vs {b}"));
            }
            continue;
        }
        m = m.max((a - b).abs());
    }
    Ok(m)
}

/// Largest magnitude of a tensor's values (at least 1).
pub fn scale_of(o: &Out) -> f32 {
    o.values
        .iter()
        .filter(|x| x.is_finite())
        .fold(1f32, |m, x| m.max(x.abs()))
}
