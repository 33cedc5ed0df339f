//! The meta check: a case with its inputs placed on a meta device of a target (at random in
//! their spaces, or as given) against the same graph on one CPU device, within the output
//! dtype's tolerance; the check that a compute leaves its inputs unchanged, that a state no
//! rule admits fails with `NoSplitRule`, and that steps on one backend reuse the plan.

use super::case::{Case, Input};
use super::compare::{max_diff, rel_tol, scale_of};
use super::meta::Place;
use super::rng::Rng;
use super::target::{Target, compute_and_read, run_single};
use metashard::meta::MetaOptions;
use metashard::{DType, Error, Graph, TensorId};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// Proptest settings of the suite: `cases` cases, no persisted failures (the seeds are in the
/// strategies; a failure prints its case).
pub fn cfg(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Honest bound for a quantized `mul_mat` whose kernel quantizes activations to 8 bits per
/// block of 32 (ggml's vec_dot_type): each quantization of an activation block errs by at most
/// amax/254 per element, so a dot errs by at most sum|w| * amax / 254; the reference quantizes
/// once, the sharded run once per partial piece.
pub fn quant_mm_tol(case: &Case) -> f32 {
    let (Some((ia, ib)), Some(p)) = (case.quant_mm, &case.placement) else {
        return 0.0;
    };
    let a = &case.inputs[ia];
    let k = a.ne[0];
    let av = a.values();
    let max_row: f32 = av
        .chunks(k)
        .map(|r| r.iter().map(|x| x.abs()).sum::<f32>())
        .fold(0.0, f32::max);
    let b = &case.inputs[ib];
    let mut amax = b.values().iter().fold(0f32, |m, x| m.max(x.abs()));
    if let Place::Partial(pieces) = &p.places[ib] {
        for piece in pieces {
            let v = metashard::dtype::bytes_to_f32(DType::F32, piece, b.nelements()).unwrap();
            amax = v.iter().fold(amax, |m, x| m.max(x.abs()));
        }
    }
    (p.n + 1) as f32 * max_row * amax / 254.0
}

/// The case with fixed input values (those filled at run time generated for `seed`).
fn fixed(case: Case, seed: u64) -> std::result::Result<Case, TestCaseError> {
    case.materialized(seed)
        .map_err(|e| TestCaseError::fail(format!("{case:?}: inputs: {e}")))
}

/// Run the case with random places on `n` devices of `target` and compare with one device.
pub fn check(
    target: &Target,
    case: Case,
    n: usize,
    seed: u64,
) -> std::result::Result<(), TestCaseError> {
    let case = fixed(case, seed)?;
    let mut rng = Rng::new(seed);
    check_placed(target, &case.placed_randomly(&mut rng, n), seed)
}

/// The inputs and their places, for failure messages.
pub fn describe(case: &Case) -> String {
    let Some(p) = &case.placement else {
        return format!("{case:?} on one device");
    };
    let v: Vec<String> = case
        .inputs
        .iter()
        .zip(&p.places)
        .map(|(l, pl)| format!("{} {} {:?}: {}", l.name, l.dtype, l.ne, pl.describe()))
        .collect();
    format!("{} n={} [{}]", case.op, p.n, v.join("; "))
}

/// Run the placed case (its inputs with fixed values) on `target` and compare with one
/// device. `seed` also picks 2 threads
/// per device in some runs on few devices, and one run in four is in explicit mode: it either
/// matches with only planned conversions, or fails with `UnrequestedCommunication`.
pub fn check_placed(
    target: &Target,
    case: &Case,
    seed: u64,
) -> std::result::Result<(), TestCaseError> {
    let n = case.placement.as_ref().expect("a placed case").n;
    // Two threads per device on small device counts only: workers spin at barriers, and
    // the test machine has few cores.
    let threads = if n <= 3 && (seed >> 7).is_multiple_of(4) {
        2
    } else {
        1
    };
    let explicit = (seed >> 9).is_multiple_of(4);
    let desc = format!("{} on {} threads={threads}", describe(case), target.name);
    let want = run_single(&case.inputs, &*case.build)
        .map_err(|e| TestCaseError::fail(format!("reference failed: {e} ({desc})")))?;
    let (got, setup) = match target.run_meta(case, threads, MetaOptions::explicit(explicit)) {
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
    for (i, l) in case.inputs.iter().enumerate() {
        if case.written.contains(&i) {
            continue;
        }
        let now = setup
            .placed_values(&case.inputs, i)
            .map_err(|e| TestCaseError::fail(format!("reading {}: {e}", l.name)))?;
        if let Some(now) = now {
            prop_assert!(
                now == l.values(),
                "the compute changed input `{}` ({desc})",
                l.name
            );
        }
    }
    let extra = quant_mm_tol(case);
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

/// The meta run of the placed case must fail with `NoSplitRule` naming `node` (a destination
/// state its rule does not admit).
pub fn check_refused(
    target: &Target,
    case: &Case,
    node: &str,
) -> std::result::Result<(), TestCaseError> {
    let desc = describe(case);
    match target.run_meta(case, 1, MetaOptions::default()) {
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

/// The case on the meta device, then twice more on the same backend: a new graph of the same
/// structure with new inline data (a decode step: the cached plan must be reused), and the same
/// graph object computed again with other inline data.
pub fn check_steps(
    target: &Target,
    case: &Case,
    n: usize,
    seed: u64,
) -> std::result::Result<(), TestCaseError> {
    let case = &fixed(case.clone(), seed)?;
    let mut rng = Rng::new(seed);
    let placed = case.placed_randomly(&mut rng, n);
    check_placed(target, &placed, seed)?;
    let places = &placed.placement.as_ref().unwrap().places;
    let mut inputs = placed.inputs.clone();
    let desc = describe(&placed);
    let fail = |what: &str, e: Error| TestCaseError::fail(format!("{what}: {e} ({desc})"));
    let setup = target
        .meta_setup(&inputs, places, (n, 1), MetaOptions::default())
        .map_err(|e| fail("setup", e))?;
    let step = |inputs: &[Input], g: &mut Graph, outs: &[TensorId], what: &str| {
        let want = run_single(inputs, &*case.build).map_err(|e| fail("reference", e))?;
        let got = compute_and_read(setup.backend.as_ref(), g, outs).map_err(|e| fail(what, e))?;
        for (i, (w, o)) in want.iter().zip(&got).enumerate() {
            let d = max_diff(w, o).map_err(|e| TestCaseError::fail(format!("{what} {i}: {e}")))?;
            let tol = rel_tol(w.dtype, n) * scale_of(w);
            prop_assert!(d <= tol, "{what}: output {i} differs by {d} ({desc})");
        }
        Ok(())
    };
    let renew = |inputs: &mut Vec<Input>, rng: &mut Rng| {
        for (l, p) in inputs.iter_mut().zip(places) {
            if matches!(p, Place::Inline) {
                *l = Input::random(rng, &l.name, l.dtype, l.ne);
            }
        }
    };
    let (mut g, ids) = setup.fresh_graph(&inputs).map_err(|e| fail("graph", e))?;
    let outs = (case.build)(&mut g, &ids).map_err(|e| fail("build", e))?;
    step(&inputs, &mut g, &outs, "first step")?;
    renew(&mut inputs, &mut rng);
    let (mut g2, ids2) = setup.fresh_graph(&inputs).map_err(|e| fail("graph", e))?;
    let outs2 = (case.build)(&mut g2, &ids2).map_err(|e| fail("build", e))?;
    step(&inputs, &mut g2, &outs2, "second step")?;
    prop_assert_eq!(
        setup.backend.graphs_prepared(),
        1,
        "the second step must reuse the plan"
    );
    renew(&mut inputs, &mut rng);
    for ((l, &id), p) in inputs.iter().zip(&ids2).zip(places) {
        if matches!(p, Place::Inline) {
            g2.set_data(id, l.bytes().to_vec())
                .map_err(|e| fail("set_data", e))?;
        }
    }
    step(&inputs, &mut g2, &outs2, "same graph again")?;
    Ok(())
}
