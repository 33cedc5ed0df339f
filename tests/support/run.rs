//! The op-by-op harness (after the idea of ggml's `tests/test-backend-ops.cpp`): [`run_case`]
//! fills a [`Case`]'s inputs with seeded random data, binds every root (inputs and the output
//! root) into its own buffer with guard bytes before and after (where the buffer is
//! byte-addressable: not the meta device's, which only knows its tensors), poisons the output,
//! runs the graph on the backend under test, checks the guards and the inputs, and compares
//! the output root with the float64 reference interpreter (`reference.rs`) by normalized mean
//! squared error `sum((a - b)^2) / sum(b^2)`.
//!
//! Pluggable: `run_case` takes any `&dyn Backend` and compares a case's one output; buffers
//! come from the backend's device buffer type unless [`RunOptions::buffer_type`] names another
//! one. `Target::run_cases` makes the backend each case's placement asks for.

use super::case::Case;
use super::compare::nmse;
use super::reference;
use metashard::buffer::{Buffer, BufferType, Storage};
use metashard::cpu::CpuDevice;
use metashard::dtype::bytes_to_f32;
use metashard::{Backend, DType, Graph, Layout, TensorId};
use std::sync::Arc;

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
/// building, computing, a guard, an input that changed, a non-finite or wrong output. Where
/// the inputs live is the backend's business (`Target::run_cases` makes the backend a case's
/// placement asks for).
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
    let (mut g, roots, outs) = case.graph().map_err(fail)?;
    let &[out] = outs.as_slice() else {
        return Err(fail(format!(
            "the harness compares one output, the case has {}",
            outs.len()
        )));
    };
    let mut rng = case.rng(opts.seed);

    // Inputs: seeded values, stored in the dtype, each root in its own guarded buffer.
    let mut images = Vec::new();
    let mut bufs = Vec::new();
    for (inp, &id) in case.inputs.iter().zip(&roots) {
        let bytes = inp
            .materialize(&mut rng)
            .map_err(|e| fail(format!("{e}")))?;
        let stored =
            bytes_to_f32(inp.dtype, &bytes, inp.nelements()).map_err(|e| fail(format!("{e}")))?;
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
