//! The op-by-op harness core (after the idea of ggml's `tests/test-backend-ops.cpp`): a
//! [`Case`] declares its inputs (dtype, shape, layout, how to fill them) and builds a tiny
//! graph; [`run_case`] fills the inputs with seeded random data, binds every root (inputs and
//! the output root) into its own buffer with guard bytes before and after (where the buffer is
//! byte-addressable: not the meta device's, which only knows its tensors), poisons the output,
//! runs the graph on the backend under test, checks the guards and the inputs, and compares
//! the output root with the float64 reference interpreter (`reference.rs`) by normalized mean
//! squared error `sum((a - b)^2) / sum(b^2)`.
//!
//! Pluggable: `run_case` takes any `&dyn Backend`; buffers come from the backend's device
//! buffer type unless [`RunOptions::buffer_type`] names another one.

use super::reference;
use metashard::buffer::{Buffer, BufferType, Storage};
use metashard::cpu::CpuDevice;
use metashard::dtype::{bytes_to_f32, f32_to_bytes};
use metashard::{Backend, DType, Graph, Layout, TensorId};
use std::sync::Arc;

// ---- seeded random numbers ------------------------------------------------------------------

/// SplitMix64 (Steele, Lea, Flood, "Fast splittable pseudorandom number generators", 2014).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        (lo as f64 + (hi as f64 - lo as f64) * self.unit()) as f32
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// FNV-1a of a string, to seed each case from its description (independent of case order).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

// ---- inputs ---------------------------------------------------------------------------------

/// How an input root is filled. Values are generated as f32 in the root's memory order and
/// stored in its dtype with the crate's reference conversions; the reference reads the stored
/// values back, so quantized and half inputs are exact on both sides.
#[derive(Clone, Debug)]
pub enum Fill {
    /// Uniform in `[lo, hi)`.
    Uniform(f32, f32),
    /// Random sign, magnitude uniform in `[lo, hi)`: safe denominators.
    AwayFromZero(f32, f32),
    /// Integers uniform in `[lo, hi)` (ids with repeats, positions in any order).
    Ints(i32, i32),
    /// Along dim 0, distinct integers from `0..hi` (set_rows ids: no two rows hit one slot).
    DistinctIds(usize),
    /// An attention mask `[n_kv, rows, ..]`: row `i` sees keys `j <= (n_kv - rows) + i` with a
    /// random bias in `[-1, 0.5)`, the rest is `-inf`; rows listed in `dead` are all `-inf`.
    CausalMask { dead: Vec<usize> },
}

impl Fill {
    fn generate(&self, ne: [usize; 4], rng: &mut Rng) -> Vec<f32> {
        let n: usize = ne.iter().product();
        match self {
            Fill::Uniform(lo, hi) => (0..n).map(|_| rng.uniform(*lo, *hi)).collect(),
            Fill::AwayFromZero(lo, hi) => (0..n)
                .map(|_| {
                    let m = rng.uniform(*lo, *hi);
                    if rng.next_u64() & 1 == 0 { m } else { -m }
                })
                .collect(),
            Fill::Ints(lo, hi) => (0..n)
                .map(|_| (*lo + rng.below((*hi - *lo) as usize) as i32) as f32)
                .collect(),
            Fill::DistinctIds(hi) => {
                let mut out = Vec::with_capacity(n);
                for _ in 0..n / ne[0].max(1) {
                    // Partial Fisher-Yates: the first ne0 of a shuffled 0..hi.
                    let mut pool: Vec<usize> = (0..*hi).collect();
                    for i in 0..ne[0].min(*hi) {
                        let j = i + rng.below(*hi - i);
                        pool.swap(i, j);
                        out.push(pool[i] as f32);
                    }
                }
                out
            }
            Fill::CausalMask { dead } => {
                let past = ne[0].saturating_sub(ne[1]);
                let mut out = Vec::with_capacity(n);
                for _ in 0..ne[2] * ne[3] {
                    for i in 0..ne[1] {
                        for j in 0..ne[0] {
                            let visible = j <= past + i && !dead.contains(&i);
                            out.push(if visible {
                                rng.uniform(-1.0, 0.5)
                            } else {
                                f32::NEG_INFINITY
                            });
                        }
                    }
                }
                out
            }
        }
    }
}

/// How an operand is made from its packed root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lay {
    /// The root itself.
    Packed,
    /// `permute(root, axes)`; `[1, 0, 2, 3]` is a transpose.
    Permuted([usize; 4]),
    /// A view of a root with `pad` more elements per row, starting `off` elements in (both
    /// whole blocks for quantized types): rows are packed, row strides are not.
    Padded { pad: usize, off: usize },
}

pub const TRANSPOSED: Lay = Lay::Permuted([1, 0, 2, 3]);

impl Lay {
    /// The root shape whose operand has logical shape `ne`.
    pub fn root_ne(self, ne: [usize; 4]) -> [usize; 4] {
        match self {
            Lay::Packed => ne,
            Lay::Permuted(axes) => [ne[axes[0]], ne[axes[1]], ne[axes[2]], ne[axes[3]]],
            Lay::Padded { pad, .. } => [ne[0] + pad, ne[1], ne[2], ne[3]],
        }
    }

    fn apply(self, g: &mut Graph, root: TensorId, ne: [usize; 4]) -> metashard::Result<TensorId> {
        match self {
            Lay::Packed => Ok(root),
            Lay::Permuted(axes) => g.permute(root, axes),
            Lay::Padded { off, .. } => {
                let l = *g.layout(root);
                let dt = l.dtype;
                let offset = off / dt.block_size() * dt.type_size();
                g.view(
                    root,
                    ne,
                    [dt.type_size(), l.nb[1], l.nb[2], l.nb[3]],
                    offset,
                )
            }
        }
    }

    fn describe(self) -> String {
        match self {
            Lay::Packed => String::new(),
            Lay::Permuted([1, 0, 2, 3]) => " transposed".into(),
            Lay::Permuted(a) => format!(" permuted{a:?}"),
            Lay::Padded { pad, off } => format!(" view(row pad {pad}, offset {off})"),
        }
    }
}

/// One input root of a case.
#[derive(Clone, Debug)]
pub struct Input {
    pub name: String,
    pub dtype: DType,
    /// The root's (packed) shape.
    pub ne: [usize; 4],
    pub fill: Fill,
}

// ---- cases ----------------------------------------------------------------------------------

/// Builds the case's graph from its operands (the inputs after their `Lay`), returning the
/// output node.
pub type BuildFn = dyn Fn(&mut Graph, &[TensorId]) -> metashard::Result<TensorId> + Send + Sync;
/// An extra assertion on the backend's output root (memory order, as f64).
pub type CheckFn = dyn Fn(&[f64]) -> Result<(), String> + Send + Sync;

/// One harness case.
#[derive(Clone)]
pub struct Case {
    /// The op under test (as `Op::name`).
    pub op: &'static str,
    /// Parameters and operands, for reports.
    pub params: String,
    pub inputs: Vec<Input>,
    /// Gets the input roots, in `inputs` order.
    pub build: Arc<BuildFn>,
    /// Largest NMSE accepted (default mode), and in exact mode.
    pub tol: f64,
    pub tol_exact: f64,
    pub check: Option<Arc<CheckFn>>,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.op, self.params)
    }
}

impl Case {
    /// Build the case's graph without storage: the input roots and the output node.
    pub fn graph(&self) -> Result<(Graph, Vec<TensorId>, TensorId), String> {
        let mut g = Graph::new();
        let mut roots = Vec::new();
        for inp in &self.inputs {
            let id = g
                .input(&inp.name, inp.dtype, inp.ne)
                .map_err(|e| format!("input `{}`: {e}", inp.name))?;
            roots.push(id);
        }
        let out = (self.build)(&mut g, &roots).map_err(|e| format!("building the graph: {e}"))?;
        g.set_output(out);
        Ok((g, roots, out))
    }
}

/// NMSE bound for a case whose operands and outputs are stored in these dtypes. With the
/// reference modelling the storage rounding of every output, what is left is f32 arithmetic
/// (relative error ~1e-7 per element, NMSE ~1e-13) plus, for half types, the rounding a backend
/// may apply to intermediate values (mul_mat activations, attention): f16 keeps 11 bits, a
/// relative error uniform in +-2^-11, NMSE ~(2^-11)^2/3 = 8e-8; bf16 keeps 8 bits, ~5e-6.
pub fn dtype_tol(dt: DType) -> f64 {
    match dt {
        DType::F32 | DType::I32 => 1e-10,
        DType::F16 => 1e-6,
        DType::BF16 => 1e-4,
        // Quantized tensors as inputs are exact values; as outputs the reference quantizes like
        // the format's definition, so a backend may differ only by an occasional level flip.
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => 1e-6,
    }
}

/// A case under construction.
pub struct CaseBuilder {
    op: &'static str,
    params: String,
    inputs: Vec<Input>,
    lays: Vec<(Lay, [usize; 4])>,
    dtypes: Vec<DType>,
    tol: Option<f64>,
    tol_exact: Option<f64>,
    check: Option<Arc<CheckFn>>,
}

pub fn case(op: &'static str, params: impl Into<String>) -> CaseBuilder {
    CaseBuilder {
        op,
        params: params.into(),
        inputs: Vec::new(),
        lays: Vec::new(),
        dtypes: Vec::new(),
        tol: None,
        tol_exact: None,
        check: None,
    }
}

impl CaseBuilder {
    /// An operand of logical shape `ne`, made from a packed root by `lay`.
    pub fn input(mut self, name: &str, dtype: DType, ne: [usize; 4], lay: Lay, fill: Fill) -> Self {
        let sep = if self.params.is_empty() { "" } else { " " };
        self.params += &format!(
            "{sep}{name}:{}{}{}",
            dtype,
            metashard::Shape(ne),
            lay.describe()
        );
        self.inputs.push(Input {
            name: name.to_string(),
            dtype,
            ne: lay.root_ne(ne),
            fill,
        });
        self.lays.push((lay, ne));
        self.dtypes.push(dtype);
        self
    }

    /// A packed operand.
    pub fn packed(self, name: &str, dtype: DType, ne: [usize; 4], fill: Fill) -> Self {
        self.input(name, dtype, ne, Lay::Packed, fill)
    }

    /// Count `dt` (e.g. an output dtype) in the default tolerance.
    pub fn involves(mut self, dt: DType) -> Self {
        self.dtypes.push(dt);
        self
    }

    pub fn tol(mut self, t: f64) -> Self {
        self.tol = Some(t);
        self
    }

    pub fn tol_exact(mut self, t: f64) -> Self {
        self.tol_exact = Some(t);
        self
    }

    pub fn check(
        mut self,
        f: impl Fn(&[f64]) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.check = Some(Arc::new(f));
        self
    }

    pub fn build(
        self,
        f: impl Fn(&mut Graph, &[TensorId]) -> metashard::Result<TensorId> + Send + Sync + 'static,
    ) -> Case {
        let tol = self.tol.unwrap_or_else(|| {
            self.dtypes
                .iter()
                .map(|&d| dtype_tol(d))
                .fold(0.0, f64::max)
                .max(dtype_tol(DType::F32))
        });
        let lays = self.lays;
        Case {
            op: self.op,
            params: self.params,
            inputs: self.inputs,
            build: Arc::new(move |g: &mut Graph, roots: &[TensorId]| {
                let mut ops = Vec::with_capacity(roots.len());
                for (&r, &(lay, ne)) in roots.iter().zip(&lays) {
                    ops.push(lay.apply(g, r, ne)?);
                }
                f(g, &ops)
            }),
            tol,
            tol_exact: self.tol_exact.unwrap_or(tol),
            check: self.check,
        }
    }
}

// ---- guarded buffers ------------------------------------------------------------------------

/// Guard bytes on each side of a tensor; a multiple of 64 keeps the tensor 64-byte aligned.
pub const GUARD: usize = 192;

fn guard_byte(i: usize) -> u8 {
    0xA5u8.wrapping_add((i % 251) as u8)
}

/// A flat byte layout over `n` bytes (`n` a multiple of 4), to write and read a whole buffer.
fn flat(n: usize) -> Layout {
    Layout::contiguous(DType::F32, [n / 4, 1, 1, 1])
}

/// One root alone in a buffer, between two guard regions. The guards are written and checked
/// where the buffer is plain bytes (a flat write over the whole buffer works: host or device
/// memory); a buffer that only knows its tensors (the meta device's) gets no guards. The
/// tensor itself is always written and read through its layout, after `bind`.
pub struct Guarded {
    pub name: String,
    pub buf: Arc<dyn Buffer>,
    pub layout: Layout,
    pub content: Vec<u8>,
    /// The guards were written (the buffer is byte-addressable).
    pub guarded: bool,
}

impl Guarded {
    /// Allocate a buffer for root `id`, write the guards, bind `id` between them and write
    /// `content` into it; `name` labels errors.
    pub fn bind(
        g: &mut Graph,
        id: TensorId,
        bt: &dyn BufferType,
        name: &str,
        content: Vec<u8>,
    ) -> Result<Self, String> {
        let layout = *g.layout(id);
        let span = content.len();
        let total = (GUARD + span + GUARD).next_multiple_of(64);
        let buf = bt
            .alloc_buffer(total)
            .map_err(|e| format!("allocating {total} bytes for `{name}`: {e}"))?;
        let mut img: Vec<u8> = (0..total).map(guard_byte).collect();
        img[GUARD..GUARD + span].copy_from_slice(&content);
        let guarded = buf.set_tensor(&flat(total), 0, &img, 0).is_ok();
        let st = Storage::new(buf.clone(), GUARD);
        g.bind(id, st.clone())
            .map_err(|e| format!("binding `{name}`: {e}"))?;
        st.set(&layout, &content)
            .map_err(|e| format!("writing `{name}`: {e}"))?;
        Ok(Guarded {
            name: name.to_string(),
            buf,
            layout,
            content,
            guarded,
        })
    }

    /// Check both guards; return the tensor's bytes.
    pub fn check(&self) -> Result<Vec<u8>, String> {
        let span = self.content.len();
        if self.guarded {
            let total = self.buf.size();
            let mut img = vec![0u8; total];
            self.buf
                .get_tensor(&flat(total), 0, &mut img, 0)
                .map_err(|e| format!("reading back `{}`: {e}", self.name))?;
            let end = GUARD + span;
            if let Some(i) = (0..GUARD).find(|&i| img[i] != guard_byte(i)) {
                return Err(format!(
                    "guard before `{}` overwritten at byte {} before its start",
                    self.name,
                    GUARD - i
                ));
            }
            if let Some(i) = (end..total).find(|&i| img[i] != guard_byte(i)) {
                return Err(format!(
                    "guard after `{}` overwritten at byte {} past its end ({span} bytes)",
                    self.name,
                    i - end,
                ));
            }
        }
        let mut out = vec![0u8; span];
        Storage::new(self.buf.clone(), GUARD)
            .get(&self.layout, &mut out)
            .map_err(|e| format!("reading `{}`: {e}", self.name))?;
        Ok(out)
    }
}

// ---- running --------------------------------------------------------------------------------

/// How to run cases.
#[derive(Clone, Default)]
pub struct RunOptions {
    /// Exact mode tolerances; `None`: the CPU device's option, else default mode.
    pub exact: Option<bool>,
    /// Mixed into every case's seed.
    pub seed: u64,
    /// Where the harness allocates roots; `None`: the backend's device buffer type.
    pub buffer_type: Option<Arc<dyn BufferType>>,
    /// Leave a computed output root to the backend's allocator (no guards, no poison) and read
    /// it with `Graph::read_bytes`, for backends that cannot write into a bound output.
    pub backend_allocates_output: bool,
}

/// What one case did on one backend.
#[derive(Clone, Debug)]
pub struct CaseReport {
    pub op: &'static str,
    pub params: String,
    pub backend: String,
    pub nmse: f64,
    pub tol: f64,
    pub max_abs_err: f64,
    /// Elements compared.
    pub n: usize,
    /// The output root's bytes, for comparisons between backends or thread counts.
    pub output: Vec<u8>,
    /// Guard bytes were checked (the buffers are byte-addressable).
    pub guarded: bool,
}

impl std::fmt::Display for CaseReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:<10} {:<8} nmse {:9.2e} <= tol {:7.0e}  max|err| {:8.2e}  n {:<6} {}{}",
            self.op,
            self.backend,
            self.nmse,
            self.tol,
            self.max_abs_err,
            self.n,
            self.params,
            if self.guarded { "" } else { " (no guards)" }
        )
    }
}

/// `sum((a - b)^2) / sum(b^2)` over finite reference values (the sum itself when the
/// reference is all zeros), and the largest absolute difference.
pub fn nmse(got: &[f64], want: &[f64]) -> (f64, f64) {
    let (mut num, mut den, mut max) = (0f64, 0f64, 0f64);
    for (a, b) in got.iter().zip(want) {
        if !b.is_finite() {
            continue;
        }
        let d = a - b;
        num += d * d;
        den += b * b;
        max = max.max(d.abs());
    }
    (if den == 0.0 { num } else { num / den }, max)
}

fn exact_mode(backend: &dyn Backend, opts: &RunOptions) -> bool {
    opts.exact.unwrap_or_else(|| {
        backend
            .device()
            .as_any()
            .downcast_ref::<CpuDevice>()
            .is_some_and(|d| d.options.precision == metashard::cpu::Precision::Exact)
    })
}

/// Run one case on `backend` and compare with the float64 reference. `Err` says what failed:
/// building, computing, a guard, an input that changed, a non-finite or wrong output.
pub fn run_case(
    backend: &dyn Backend,
    case: &Case,
    opts: &RunOptions,
) -> Result<CaseReport, String> {
    let name = backend.name();
    let fail = |what: String| format!("{} [{}] {}: {what}", case.op, name, case.params);
    let bt = opts
        .buffer_type
        .clone()
        .unwrap_or_else(|| backend.device().buffer_type());
    let tol = if exact_mode(backend, opts) {
        case.tol_exact
    } else {
        case.tol
    };
    let (mut g, roots, out) = case.graph().map_err(fail)?;
    let mut rng = Rng::new(fnv1a(&format!("{} {}", case.op, case.params)) ^ opts.seed);

    // Inputs: seeded values, stored in the dtype, each root in its own guarded buffer.
    let mut images = Vec::new();
    let mut bufs = Vec::new();
    for (inp, &id) in case.inputs.iter().zip(&roots) {
        let vals = inp.fill.generate(inp.ne, &mut rng);
        let bytes = f32_to_bytes(inp.dtype, &vals).map_err(|e| fail(format!("{e}")))?;
        let stored =
            bytes_to_f32(inp.dtype, &bytes, vals.len()).map_err(|e| fail(format!("{e}")))?;
        images.push((id, stored.into_iter().map(f64::from).collect::<Vec<_>>()));
        let gb = Guarded::bind(&mut g, id, bt.as_ref(), &inp.name, bytes).map_err(fail)?;
        bufs.push((id, gb));
    }
    // The output root, poisoned (all-ones bytes: NaN in every float type, -1 as i32), unless it
    // is an input (cpy and set_rows write into one).
    let out_root = g.root(out);
    let out_bound = !roots.contains(&out_root) && !opts.backend_allocates_output;
    if out_bound {
        let span = g.layout(out_root).nbytes();
        let gb = Guarded::bind(&mut g, out_root, bt.as_ref(), "output", vec![0xFF; span])
            .map_err(fail)?;
        bufs.push((out_root, gb));
    }

    let want = reference::evaluate(&g, &images)
        .and_then(|mem| mem.root_image(out_root))
        .map_err(|e| fail(format!("reference: {e}")))?;

    backend
        .graph_compute(&mut g)
        .and_then(|()| backend.synchronize())
        .map_err(|e| fail(format!("graph_compute: {e}")))?;

    let mut output = Vec::new();
    if !out_bound && !roots.contains(&out_root) {
        output = g
            .read_bytes(out_root)
            .map_err(|e| fail(format!("reading the output: {e}")))?;
    }
    for (id, gb) in &bufs {
        let bytes = gb.check().map_err(fail)?;
        if *id == out_root {
            output = bytes;
        } else if bytes != gb.content {
            let at = bytes.iter().zip(&gb.content).position(|(a, b)| a != b);
            return Err(fail(format!(
                "input `{}` was modified (first changed byte {at:?})",
                gb.name
            )));
        }
    }
    let layout = *g.layout(out_root);
    let got: Vec<f64> = bytes_to_f32(layout.dtype, &output, layout.nelements())
        .map_err(|e| fail(format!("{e}")))?
        .into_iter()
        .map(f64::from)
        .collect();
    if let Some(i) = (0..got.len()).find(|&i| {
        !got[i].is_finite() && (want[i].is_finite() || got[i].to_bits() != want[i].to_bits())
    }) {
        return Err(fail(format!(
            "output element {i} is {} where the reference has {} (unwritten or overflowed)",
            got[i], want[i]
        )));
    }
    let (err, max_abs_err) = nmse(&got, &want);
    let report = CaseReport {
        op: case.op,
        params: case.params.clone(),
        backend: name.clone(),
        nmse: err,
        tol,
        max_abs_err,
        n: got.len(),
        output,
        guarded: bufs.iter().all(|(_, gb)| gb.guarded),
    };
    // NaN compares false: a NaN error fails too.
    if err.is_nan() || err > tol {
        return Err(fail(format!(
            "NMSE {err:.3e} exceeds {tol:.0e} (max |err| {max_abs_err:.3e} over {} elements)",
            got.len()
        )));
    }
    if let Some(check) = &case.check {
        check(&got).map_err(fail)?;
    }
    Ok(report)
}

/// The results of a list of cases on one backend.
pub struct Summary {
    pub results: Vec<Result<CaseReport, String>>,
}

impl Summary {
    pub fn failures(&self) -> Vec<&String> {
        self.results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .collect()
    }

    /// Print every report (visible with `--nocapture` or on failure).
    pub fn print(&self) {
        for r in &self.results {
            match r {
                Ok(rep) => println!("ok   {rep}"),
                Err(e) => println!("FAIL {e}"),
            }
        }
    }
}

/// Run every case (never stopping at the first failure).
pub fn run_cases(backend: &dyn Backend, cases: &[Case], opts: &RunOptions) -> Summary {
    Summary {
        results: cases.iter().map(|c| run_case(backend, c, opts)).collect(),
    }
}
