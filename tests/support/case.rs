//! The one test case type: a [`Case`] declares its inputs (name, dtype, shape, how they are
//! filled, the split states each may take on a meta device) and builds a small graph from them;
//! where its inputs live is an option ([`Case::placement`]: one device, or a meta device with
//! a given place per input). [`CaseBuilder`] makes operands from packed roots by a [`Lay`]
//! (transposed, permuted, padded rows) for the op-by-op list; [`Case::new`] takes inputs with
//! fixed values for the randomized meta cases.

use super::meta::{Place, Space};
use super::rng::Rng;
use metashard::dtype::{bytes_to_f32, f32_to_bytes};
use metashard::{DType, Graph, Layout, TensorId};
use std::sync::Arc;

// ---- inputs ---------------------------------------------------------------------------------

/// How an input root is filled. Values are generated as f32 in the root's memory order and
/// stored in its dtype with the crate's reference conversions; whoever compares reads the
/// stored values back, so quantized and half inputs are exact on every side.
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
    /// These bytes (in the input's dtype), whatever the seed.
    Bytes(Vec<u8>),
}

impl Fill {
    /// Values for a root of shape `ne` (not for `Bytes`, which has its bytes already).
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
            Fill::Bytes(_) => unreachable!("fixed bytes are not generated"),
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
    /// The states the input may take when a meta device places it at random.
    pub space: Space,
}

impl Input {
    pub fn new(name: &str, dtype: DType, ne: [usize; 4], fill: Fill) -> Input {
        Input {
            name: name.to_string(),
            dtype,
            ne,
            fill,
            space: Space::of(dtype),
        }
    }

    pub fn layout(&self) -> Layout {
        Layout::contiguous(self.dtype, self.ne)
    }

    pub fn nelements(&self) -> usize {
        self.ne.iter().product()
    }

    /// The stored bytes of an input with fixed values (see [`Case::materialized`]).
    pub fn bytes(&self) -> &[u8] {
        match &self.fill {
            Fill::Bytes(b) => b,
            f => panic!("input `{}` is filled at run time ({f:?})", self.name),
        }
    }

    /// The stored bytes: fixed ones, or generated from `rng`.
    pub fn materialize(&self, rng: &mut Rng) -> metashard::Result<Vec<u8>> {
        match &self.fill {
            Fill::Bytes(b) => Ok(b.clone()),
            f => f32_to_bytes(self.dtype, &f.generate(self.ne, rng)),
        }
    }

    /// The value as f32 in memory order (fixed values only).
    pub fn values(&self) -> Vec<f32> {
        bytes_to_f32(self.dtype, self.bytes(), self.nelements()).expect("input bytes")
    }

    pub fn from_f32(name: &str, dtype: DType, ne: [usize; 4], v: &[f32]) -> Input {
        assert_eq!(v.len(), ne.iter().product::<usize>(), "{name}");
        let bytes = f32_to_bytes(dtype, v).expect("encodable input");
        Input::new(name, dtype, ne, Fill::Bytes(bytes))
    }

    pub fn from_i32(name: &str, ne: [usize; 4], v: &[i32]) -> Input {
        assert_eq!(v.len(), ne.iter().product::<usize>(), "{name}");
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Input::new(name, DType::I32, ne, Fill::Bytes(bytes))
    }

    /// Random grid values (quantized types: the quantization of the grid values).
    pub fn random(rng: &mut Rng, name: &str, dtype: DType, ne: [usize; 4]) -> Input {
        let n: usize = ne.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.grid()).collect();
        Input::from_f32(name, dtype, ne, &v)
    }

    /// Random values bounded away from zero: sign * [0.5, 2] on the grid (divisors).
    pub fn random_nonzero(rng: &mut Rng, name: &str, dtype: DType, ne: [usize; 4]) -> Input {
        let n: usize = ne.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                let m = (32 + rng.below(97)) as f32 / 64.0;
                if rng.chance(1, 2) { m } else { -m }
            })
            .collect();
        Input::from_f32(name, dtype, ne, &v)
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

// ---- cases ----------------------------------------------------------------------------------

/// Builds a case's graph from its input roots (in `inputs` order), returning the outputs.
pub type BuildFn =
    dyn Fn(&mut Graph, &[TensorId]) -> metashard::Result<Vec<TensorId>> + Send + Sync;
/// An extra assertion on the backend's output root (memory order, as f64).
pub type CheckFn = dyn Fn(&[f64]) -> Result<(), String> + Send + Sync;

/// Where a case's inputs live: a meta device of `n` devices, input `i` as `places[i]` says.
#[derive(Clone, Debug)]
pub struct Placement {
    pub n: usize,
    pub places: Vec<Place>,
}

/// One test case.
///
/// The op-by-op harness (`run.rs`) compares its one output with the float64 reference within
/// `tol` (or `tol_exact`) and `check`; the meta check (`check.rs`) compares every output of a
/// meta-device run with one CPU device within `rel`, `quant_mm` and the output dtype's bound.
#[derive(Clone)]
pub struct Case {
    /// The op under test (as `Op::name`; a composite's name for randomized blocks).
    pub op: &'static str,
    /// Parameters and operands, for reports; `op` and `params` together seed the inputs.
    pub params: String,
    pub inputs: Vec<Input>,
    /// Gets the input roots, in `inputs` order.
    pub build: Arc<BuildFn>,
    /// Largest NMSE against the float64 reference (default mode), and in exact mode.
    pub tol: f64,
    pub tol_exact: f64,
    pub check: Option<Arc<CheckFn>>,
    /// Inputs the graph writes (set_rows and cpy destinations).
    pub written: Vec<usize>,
    /// Relative tolerance against one device of f32 outputs computed through half-precision
    /// intermediates (a value rounded to f16 may land one ulp apart when its f32 sum was formed
    /// in another order); 0 to use the output dtype's.
    pub rel: f32,
    /// Extra absolute tolerance against one device for quantized `mul_mat(a, b)`: the input
    /// indices of a and b.
    pub quant_mm: Option<(usize, usize)>,
    /// `None`: the inputs live on the one device under test. `Some`: on a meta device.
    pub placement: Option<Placement>,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.op, self.params)
    }
}

impl Case {
    /// A case over inputs with their own values and roots as operands; tolerances from the
    /// input dtypes.
    pub fn new(
        op: &'static str,
        inputs: Vec<Input>,
        build: impl Fn(&mut Graph, &[TensorId]) -> metashard::Result<Vec<TensorId>>
        + Send
        + Sync
        + 'static,
    ) -> Case {
        let tol = default_tol(inputs.iter().map(|i| i.dtype));
        Case {
            op,
            params: String::new(),
            inputs,
            build: Arc::new(build),
            tol,
            tol_exact: tol,
            check: None,
            written: Vec::new(),
            rel: 0.0,
            quant_mm: None,
            placement: None,
        }
    }

    /// Input `i` may take the states of `s`.
    pub fn space(mut self, i: usize, s: Space) -> Case {
        self.inputs[i].space = s;
        self
    }

    /// The case with its inputs placed on a meta device of `n` devices.
    pub fn placed(mut self, n: usize, places: Vec<Place>) -> Case {
        assert_eq!(
            places.len(),
            self.inputs.len(),
            "{self:?}: one place per input"
        );
        self.placement = Some(Placement { n, places });
        self
    }

    /// The case with every input filled with fixed values, generated as the op harness does
    /// for seed `seed` (inputs with fixed values keep them).
    pub fn materialized(&self, seed: u64) -> metashard::Result<Case> {
        let mut rng = self.rng(seed);
        let mut c = self.clone();
        for inp in &mut c.inputs {
            inp.fill = Fill::Bytes(inp.materialize(&mut rng)?);
        }
        Ok(c)
    }

    /// The generator of the case's inputs for `seed`: seeded by the description, so
    /// independent of the case's position in a list.
    pub fn rng(&self, seed: u64) -> Rng {
        Rng::new(super::rng::fnv1a(&format!("{} {}", self.op, self.params)) ^ seed)
    }

    /// Build the case's graph without storage: the input roots and the outputs.
    pub fn graph(&self) -> Result<(Graph, Vec<TensorId>, Vec<TensorId>), String> {
        let mut g = Graph::new();
        let mut roots = Vec::new();
        for inp in &self.inputs {
            let id = g
                .input(&inp.name, inp.dtype, inp.ne)
                .map_err(|e| format!("input `{}`: {e}", inp.name))?;
            roots.push(id);
        }
        let outs = (self.build)(&mut g, &roots).map_err(|e| format!("building the graph: {e}"))?;
        for &o in &outs {
            g.set_output(o);
        }
        Ok((g, roots, outs))
    }
}

/// The quantized types of `DType::WEIGHT_TYPES`, in its order.
pub fn quantized_weight_types() -> Vec<DType> {
    DType::WEIGHT_TYPES
        .iter()
        .copied()
        .filter(|d| d.is_quantized())
        .collect()
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
        DType::Q8_0
        | DType::Q4_0
        | DType::Q4_1
        | DType::Q5_0
        | DType::Q5_1
        | DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::IQ4_NL
        | DType::IQ4_XS => 1e-6,
    }
}

/// The loosest [`dtype_tol`] of these dtypes (and f32's).
fn default_tol(dtypes: impl Iterator<Item = DType>) -> f64 {
    dtypes
        .map(dtype_tol)
        .fold(0.0, f64::max)
        .max(dtype_tol(DType::F32))
}

/// A case of the op-by-op list under construction: operands made from packed roots.
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
        self.inputs
            .push(Input::new(name, dtype, lay.root_ne(ne), fill));
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

    /// The case whose one output `f` builds from the operands.
    pub fn build(
        self,
        f: impl Fn(&mut Graph, &[TensorId]) -> metashard::Result<TensorId> + Send + Sync + 'static,
    ) -> Case {
        let tol = self
            .tol
            .unwrap_or_else(|| default_tol(self.dtypes.iter().copied()));
        let lays = self.lays;
        Case {
            params: self.params,
            tol,
            tol_exact: self.tol_exact.unwrap_or(tol),
            check: self.check,
            ..Case::new(self.op, self.inputs, move |g, roots| {
                let mut ops = Vec::with_capacity(roots.len());
                for (&r, &(lay, ne)) in roots.iter().zip(&lays) {
                    ops.push(lay.apply(g, r, ne)?);
                }
                Ok(vec![f(g, &ops)?])
            })
        }
    }
}
