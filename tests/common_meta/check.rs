//! The op-test harness: a `Case` (leaves, the states each leaf may take, the graph), random
//! places, the single-device reference and the meta run compared within the dtype's
//! tolerance, the check that a compute leaves its inputs unchanged, the check that a state no
//! rule admits fails with `NoSplitRule`, and multi-step runs on one backend.

use super::*;
use metashard::meta::MetaOptions;
use metashard::{DType, Error, Graph, Result, TensorId};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::rc::Rc;

pub type BuildFn = Rc<dyn Fn(&mut Graph, &[TensorId]) -> Result<Vec<TensorId>>>;

/// One op test: leaves, the states each may take, the graph, and the tolerance.
#[derive(Clone)]
pub struct Case {
    pub leaves: Vec<Leaf>,
    pub spaces: Vec<Space>,
    pub build: BuildFn,
    /// Extra absolute tolerance for quantized `mul_mat(a, b)`: leaf indices of a and b.
    pub quant_mm: Option<(usize, usize)>,
    /// Leaves the graph writes (set_rows and cpy destinations).
    pub written: Vec<usize>,
    /// Relative tolerance of f32 outputs computed through half-precision intermediates (a
    /// value rounded to f16 may land one ulp apart when its f32 sum was formed in another
    /// order); 0 to use the output dtype's.
    pub rel: f32,
}

impl Case {
    pub fn new(leaves: Vec<Leaf>, build: BuildFn) -> Case {
        let spaces = leaves.iter().map(Space::any).collect();
        Case {
            leaves,
            spaces,
            build,
            quant_mm: None,
            written: Vec::new(),
            rel: 0.0,
        }
    }

    pub fn space(mut self, i: usize, s: Space) -> Case {
        self.spaces[i] = s;
        self
    }
}

pub fn cfg(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Relative tolerance (against max(1, |reference|)) of an output dtype: f32 sums in another
/// order; half types may round partial pieces on each of the n devices before they are summed.
pub fn rel_tol(dtype: DType, n: usize) -> f32 {
    match dtype {
        DType::F16 => 1e-3 * (n + 1) as f32,
        DType::BF16 => 8e-3 * (n + 1) as f32,
        _ => 1e-4,
    }
}

/// Honest bound for a quantized `mul_mat` whose kernel quantizes activations to 8 bits per
/// block of 32 (ggml's vec_dot_type): each quantization of an activation block errs by at most
/// amax/254 per element, so a dot errs by at most sum|w| * amax / 254; the reference quantizes
/// once, the sharded run once per partial piece.
pub fn quant_mm_tol(case: &Case, leaves: &[Leaf], places: &[Place], n: usize) -> f32 {
    let Some((ia, ib)) = case.quant_mm else {
        return 0.0;
    };
    let a = &leaves[ia];
    let k = a.ne[0];
    let av = a.values();
    let max_row: f32 = av
        .chunks(k)
        .map(|r| r.iter().map(|x| x.abs()).sum::<f32>())
        .fold(0.0, f32::max);
    let mut amax = leaves[ib].values().iter().fold(0f32, |m, x| m.max(x.abs()));
    if let Place::Partial(pieces) = &places[ib] {
        for p in pieces {
            let v = metashard::dtype::bytes_to_f32(DType::F32, p, leaves[ib].nelements()).unwrap();
            amax = v.iter().fold(amax, |m, x| m.max(x.abs()));
        }
    }
    (n + 1) as f32 * max_row * amax / 254.0
}

/// Run the case with random places on `n` devices and compare with the single device.
pub fn check(case: Case, n: usize, seed: u64) -> std::result::Result<(), TestCaseError> {
    let mut rng = TestRng(seed);
    let mut leaves = case.leaves.clone();
    let places: Vec<Place> = leaves
        .iter_mut()
        .zip(&case.spaces)
        .map(|(l, s)| random_place(&mut rng, l, s, n))
        .collect();
    check_places(&case, leaves, places, n, seed)
}

pub fn describe(leaves: &[Leaf], places: &[Place], n: usize) -> String {
    let v: Vec<String> = leaves
        .iter()
        .zip(places)
        .map(|(l, p)| format!("{} {} {:?}: {}", l.name, l.dtype, l.ne, p.describe()))
        .collect();
    format!("n={n} [{}]", v.join("; "))
}

/// Run the case with the given places on `n` devices and compare with the single device.
/// `seed` also picks 2 threads per device in some runs on few devices, and one run in four is in explicit mode: it
/// either matches with only planned conversions, or fails with `UnrequestedCommunication`.
pub fn check_places(
    case: &Case,
    leaves: Vec<Leaf>,
    places: Vec<Place>,
    n: usize,
    seed: u64,
) -> std::result::Result<(), TestCaseError> {
    // Two threads per device on small device counts only: workers spin at barriers, and
    // the test machine has few cores.
    let threads = if n <= 3 && (seed >> 7).is_multiple_of(4) {
        2
    } else {
        1
    };
    let explicit = (seed >> 9).is_multiple_of(4);
    let desc = format!("{} threads={threads}", describe(&leaves, &places, n));
    let want = run_single(&leaves, &*case.build)
        .map_err(|e| TestCaseError::fail(format!("reference failed: {e} ({desc})")))?;
    let (got, setup) = match run_meta_keep(
        &leaves,
        &places,
        (n, threads),
        MetaOptions::explicit(explicit),
        &*case.build,
    ) {
        Ok(r) => r,
        Err(Error::UnrequestedCommunication { .. }) if explicit => return Ok(()),
        Err(e) => {
            let mode = if explicit { "explicit " } else { "" };
            return Err(TestCaseError::fail(format!(
                "{mode}meta failed: {e} ({desc})"
            )));
        }
    };
    if explicit {
        let plan = setup.backend.last_sharding().expect("computed");
        prop_assert!(
            plan.conversions.iter().all(|c| c.kind.planned()),
            "explicit mode ran unplanned communication ({desc})"
        );
    }
    // A compute leaves its inputs as they were (but the destinations it writes).
    for (i, l) in leaves.iter().enumerate() {
        if case.written.contains(&i) {
            continue;
        }
        let now = placed_values(&setup, &leaves, i)
            .map_err(|e| TestCaseError::fail(format!("reading {}: {e}", l.name)))?;
        if let Some(now) = now {
            prop_assert!(
                now == l.values(),
                "the compute changed input `{}` ({desc})",
                l.name
            );
        }
    }
    let extra = quant_mm_tol(case, &leaves, &places, n);
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        let d =
            max_diff(w, g).map_err(|e| TestCaseError::fail(format!("output {i}: {e} ({desc})")))?;
        let tol = if w.dtype == DType::I32 {
            0.0
        } else {
            rel_tol(w.dtype, n).max(case.rel) * scale_of(w) + extra
        };
        prop_assert!(
            d <= tol,
            "output {i}: max diff {d} > {tol} ({desc})\nwant {:?}\ngot  {:?}",
            w.values,
            g.values
        );
    }
    Ok(())
}

/// The meta run must fail with `NoSplitRule` naming `node` (a destination state its rule does
/// not admit).
pub fn check_refused(
    case: &Case,
    leaves: Vec<Leaf>,
    places: Vec<Place>,
    n: usize,
    node: &str,
) -> std::result::Result<(), TestCaseError> {
    let desc = describe(&leaves, &places, n);
    match run_meta(&leaves, &places, n, MetaOptions::default(), &*case.build) {
        Err(Error::NoSplitRule { node: nd, .. }) => {
            prop_assert!(
                nd.starts_with(node),
                "refused at `{nd}`, expected `{node}` ({desc})"
            );
            Ok(())
        }
        Err(e) => Err(TestCaseError::fail(format!(
            "expected NoSplitRule, got {e} ({desc})"
        ))),
        Ok(_) => Err(TestCaseError::fail(format!(
            "expected NoSplitRule, ran ({desc})"
        ))),
    }
}

/// The chain on the meta device, then twice more on the same backend: a new graph of the same
/// structure with new inline data (a decode step: the cached plan must be reused), and the same
/// graph object computed again with other inline data.
pub fn check_chain_steps(
    case: &Case,
    n: usize,
    seed: u64,
) -> std::result::Result<(), TestCaseError> {
    let mut rng = TestRng(seed);
    let mut leaves = case.leaves.clone();
    let places: Vec<Place> = leaves
        .iter_mut()
        .zip(&case.spaces)
        .map(|(l, s)| random_place(&mut rng, l, s, n))
        .collect();
    check_places(case, leaves.clone(), places.clone(), n, seed)?;
    let desc = describe(&leaves, &places, n);
    let fail = |what: &str, e: Error| TestCaseError::fail(format!("{what}: {e} ({desc})"));
    let setup =
        meta_setup(&leaves, &places, n, MetaOptions::default()).map_err(|e| fail("setup", e))?;
    let step = |leaves: &[Leaf], g: &mut Graph, outs: &[TensorId], what: &str| {
        let want = run_single(leaves, &*case.build).map_err(|e| fail("reference", e))?;
        let got = compute_and_read(setup.backend.as_ref(), g, outs).map_err(|e| fail(what, e))?;
        for (i, (w, o)) in want.iter().zip(&got).enumerate() {
            let d = max_diff(w, o).map_err(|e| TestCaseError::fail(format!("{what} {i}: {e}")))?;
            let tol = rel_tol(w.dtype, n) * scale_of(w);
            prop_assert!(d <= tol, "{what}: output {i} differs by {d} ({desc})");
        }
        Ok(())
    };
    let renew = |leaves: &mut Vec<Leaf>, rng: &mut TestRng| {
        for (l, p) in leaves.iter_mut().zip(&places) {
            if matches!(p, Place::Inline) {
                *l = Leaf::random(rng, &l.name, l.dtype, l.ne);
            }
        }
    };
    let (mut g, ids) = setup.fresh_graph(&leaves).map_err(|e| fail("graph", e))?;
    let outs = (case.build)(&mut g, &ids).map_err(|e| fail("build", e))?;
    step(&leaves, &mut g, &outs, "first step")?;
    renew(&mut leaves, &mut rng);
    let (mut g2, ids2) = setup.fresh_graph(&leaves).map_err(|e| fail("graph", e))?;
    let outs2 = (case.build)(&mut g2, &ids2).map_err(|e| fail("build", e))?;
    step(&leaves, &mut g2, &outs2, "second step")?;
    prop_assert_eq!(
        setup.backend.graphs_prepared(),
        1,
        "the second step must reuse the plan"
    );
    renew(&mut leaves, &mut rng);
    for ((l, &id), p) in leaves.iter().zip(&ids2).zip(&places) {
        if matches!(p, Place::Inline) {
            g2.set_data(id, l.bytes.clone())
                .map_err(|e| fail("set_data", e))?;
        }
    }
    step(&leaves, &mut g2, &outs2, "same graph again")?;
    Ok(())
}
