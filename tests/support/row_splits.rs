//! Splits by rows, case by case: `get_rows` from a table split along its rows (a
//! vocabulary-split embedding: each device looks up the ids it holds, a Partial lookup) and
//! `set_rows` into a destination split along its rows (a KV cache split by slots: each device
//! writes the rows whose slot it holds), over even, uneven, zero and segmented extents and
//! every table dtype, against one device. Each run also checks the plan: the split operand is
//! used where it lies (never gathered), in explicit mode too.

use super::case::{Case, Input, quantized_weight_types};
use super::compare::{Out, max_diff, rel_tol, scale_of};
use super::meta::Place;
use super::rng::Rng;
use super::target::{MetaSetup, Target, run_single};
use metashard::meta::{MetaOptions, Sharding};
use metashard::split_state::SplitState;
use metashard::{DType, Error};

/// The placed case on the target (explicit mode or not) against one device: every output
/// within the dtype's tolerance (`exact`: outputs listed there bit for bit), and the plan.
fn run_checked(
    t: &Target,
    case: &Case,
    explicit: bool,
    exact: &[usize],
) -> (Vec<Out>, Sharding, MetaSetup) {
    let p = case.placement.as_ref().expect("placed");
    let desc = format!(
        "{} n={} [{}] explicit={explicit} on {}",
        case.op,
        p.n,
        p.places
            .iter()
            .map(|pl| pl.describe())
            .collect::<Vec<_>>()
            .join("; "),
        t.name
    );
    let want = run_single(&case.inputs, &*case.build).expect("one device");
    let (got, setup) = t
        .run_meta(case, 1, MetaOptions::explicit(explicit))
        .unwrap_or_else(|e| panic!("meta failed: {e} ({desc})"));
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        let d = max_diff(w, g).unwrap_or_else(|e| panic!("output {i}: {e} ({desc})"));
        let tol = if exact.contains(&i) {
            0.0
        } else {
            rel_tol(w.dtype, p.n) * scale_of(w)
        };
        assert!(
            d <= tol,
            "output {i}: max diff {d} > {tol} ({desc})\nwant {:?}\ngot  {:?}",
            w.values,
            g.values
        );
    }
    let plan = setup.backend.last_sharding().expect("computed");
    (want, plan, setup)
}

/// The state and the conversions of the node named `name`, as planned.
fn planned<'a>(
    setup: &MetaSetup,
    plan: &'a Sharding,
    name: &str,
) -> (SplitState, Vec<&'a metashard::meta::Conversion>) {
    let id = setup.graph.find(name).expect("named node");
    let convs = plan
        .conversions
        .iter()
        .filter(|c| c.consumer == id)
        .collect();
    (plan.states[id.index()].clone(), convs)
}

/// Splits of 10 rows: even, uneven, with zero extents, segmented; (devices, state).
fn row_splits() -> Vec<(usize, SplitState)> {
    vec![
        (2, SplitState::axis(1, &[5, 5])),
        (3, SplitState::axis(1, &[1, 7, 2])),
        (3, SplitState::axis(1, &[0, 10, 0])),
        (4, SplitState::axis(1, &[4, 0, 3, 3])),
        (
            2,
            SplitState::segmented(1, &[vec![2, 1], vec![0, 4], vec![3, 0]]),
        ),
        (3, SplitState::segmented(1, &[vec![0, 3, 2], vec![1, 0, 4]])),
    ]
}

/// A table `[ne0, 10, e2, 1]` split by rows, looked up with mirrored ids (every row, some
/// twice): the lookup is Partial where the table lies (no gather of the table), its sum is
/// the lookup exactly; a linear consumer keeps it Partial, a norm reduces it.
pub fn table_split_by_rows_gives_a_partial_lookup(t: &Target) {
    let mut rng = Rng::new(11);
    let mut dtypes = vec![DType::F32, DType::F16, DType::BF16];
    dtypes.extend(quantized_weight_types());
    for dt in dtypes {
        let ne0 = if dt.is_quantized() {
            2 * dt.block_size()
        } else {
            6
        };
        for (i, (n, state)) in row_splits().into_iter().enumerate() {
            let e2 = 1 + i % 2;
            let table = Input::random(&mut rng, "table", dt, [ne0, 10, e2, 1]);
            // Every row; with one batch, some twice.
            let mut ids: Vec<i32> = (0..10).collect();
            if e2 == 1 {
                ids.extend([3, 9, 0]);
            }
            let ids = Input::from_i32("ids", [ids.len() / e2, e2, 1, 1], &ids);
            let case = Case::new("get_rows", vec![table, ids], |g, l| {
                let e = g.get_rows(l[0], l[1])?;
                g.set_name(e, "lookup");
                let s = g.scale(e, 2.0)?;
                let r = g.rms_norm(e, 1e-5)?;
                Ok(vec![s, r])
            })
            .placed(n, vec![Place::State(state.clone()), Place::Inline]);
            for explicit in [false, true] {
                let (_, plan, setup) = run_checked(t, &case, explicit, &[0]);
                let (st, convs) = planned(&setup, &plan, "lookup");
                let what = format!("{dt} {state} n={n} explicit={explicit}");
                assert_eq!(st, SplitState::partial(n), "{what}: the lookup's state");
                assert!(
                    convs.is_empty(),
                    "{what}: the table is converted: {convs:?}"
                );
                assert!(
                    plan.conversions.iter().all(|c| c.kind.planned()),
                    "{what}: only the partial sum is reduced: {:?}",
                    plan.conversions
                );
            }
        }
    }
}

/// An id outside the table split by rows is an error naming the node and the whole table's
/// rows (as on one device), not a row of zeros.
pub fn out_of_range_ids_of_a_table_split_by_rows_are_errors(t: &Target) {
    let mut rng = Rng::new(12);
    for bad in [10, -1] {
        let table = Input::random(&mut rng, "table", DType::F32, [4, 10, 1, 1]);
        let ids = Input::from_i32("ids", [3, 1, 1, 1], &[1, bad, 7]);
        let case = Case::new("get_rows", vec![table, ids], |g, l| {
            let e = g.get_rows(l[0], l[1])?;
            g.set_name(e, "lookup");
            Ok(vec![g.rms_norm(e, 1e-5)?])
        })
        .placed(
            3,
            vec![Place::State(SplitState::axis(1, &[3, 0, 7])), Place::Inline],
        );
        match t.run_meta(&case, 1, MetaOptions::default()) {
            Err(Error::RowIdOutOfRange { node, id, rows, .. }) => {
                assert_eq!((node.as_str(), id, rows), ("lookup", bad as i64, 10));
            }
            Err(e) => panic!("id {bad}: expected RowIdOutOfRange, got {e}"),
            Ok(_) => panic!("id {bad}: the lookup ran"),
        }
    }
}

/// A destination `[5, 8, 2, 1]` split by rows (slots), written with mirrored rows and ids:
/// it keeps its state (no conversion of the destination), each device writes the rows whose
/// slot it holds; read back whole, through a consumer of the split, through a view of a slot
/// range (gathered), and from the meta buffer itself.
pub fn destination_split_by_rows_takes_its_window(t: &Target) {
    let mut rng = Rng::new(13);
    let splits = vec![
        (2, SplitState::axis(1, &[4, 4])),
        (3, SplitState::axis(1, &[1, 6, 1])),
        (3, SplitState::axis(1, &[0, 8, 0])),
        (3, SplitState::axis(1, &[3, 0, 5])),
        (2, SplitState::segmented(1, &[vec![2, 1], vec![3, 2]])),
        (
            4,
            SplitState::segmented(1, &[vec![0, 2, 0, 1], vec![3, 0, 2, 0]]),
        ),
    ];
    for dt in [DType::F32, DType::F16, DType::BF16] {
        for (n, state) in &splits {
            let dst = Input::random(&mut rng, "dst", dt, [5, 8, 2, 1]);
            let rows = Input::random(&mut rng, "rows", DType::F32, [5, 3, 2, 1]);
            let slots = rng.perm(8);
            let ids: Vec<i32> = slots[..3].iter().map(|&s| s as i32).collect();
            let ids = Input::from_i32("ids", [3, 1, 1, 1], &ids);
            let ts = dt.type_size();
            let inputs = vec![dst, rows, ids];
            let places = vec![Place::State(state.clone()), Place::Inline, Place::Inline];
            // In explicit mode, no view of a slot range (it would need a gather).
            for explicit in [false, true] {
                let case = Case {
                    written: vec![0],
                    ..Case::new("set_rows", inputs.clone(), move |g, l| {
                        let w = g.set_rows(l[0], l[1], l[2])?;
                        g.set_name(w, "write");
                        let norm = g.rms_norm(w, 1e-5)?;
                        if explicit {
                            return Ok(vec![w, norm]);
                        }
                        // Slots 1..5 of both heads: a range of the split axis, gathered first.
                        let v = g.view_3d(w, [5, 4, 2], 5 * ts, 40 * ts, 5 * ts)?;
                        let v = g.cont(v)?;
                        Ok(vec![w, norm, v])
                    })
                }
                .placed(*n, places.clone());
                let (want, plan, setup) = run_checked(t, &case, explicit, &[0, 2]);
                let what = format!("{dt} {state} n={n} explicit={explicit}");
                let (st, convs) = planned(&setup, &plan, "write");
                assert_eq!(&st, state, "{what}: the destination's state");
                assert!(convs.is_empty(), "{what}: conversions {convs:?}");
                // The meta buffer holds what one device wrote.
                let held = setup
                    .placed_values(&case.inputs, 0)
                    .expect("read back")
                    .expect("placed");
                assert_eq!(held, want[0].values, "{what}: the destination as stored");
            }
        }
    }
}
