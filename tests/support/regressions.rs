//! Regressions: cases the meta properties found, fixed in `src/`, each with the places that
//! failed, run on meta devices of a target by `harness_tests!`.

use super::case::{Case, Input, quantized_weight_types};
use super::check::{check_placed, check_refused};
use super::compare::{max_diff, scale_of};
use super::meta::{Place, partial_pieces, random_extents, random_split};
use super::random::random_mul_mat;
use super::rng::Rng;
use super::target::{Target, compute_and_read, run_single};
use metashard::meta::MetaOptions;
use metashard::split_state::SplitState;
use metashard::{DType, Graph, Result, TensorId};
use std::sync::Arc;

fn regress(t: &Target, case: Case, places: Vec<Place>, n: usize) {
    if let Err(e) = check_placed(t, &case.placed(n, places), 1) {
        panic!("{e}");
    }
}

fn state(s: SplitState) -> Place {
    Place::State(s)
}

/// A quantized weight must not follow an activation's K split that cuts its blocks (the rule
/// offered the pattern; the device's view of 21 elements of a Q8_0 row failed).
pub fn quantized_weight_follows_k_split_in_whole_blocks_only(t: &Target) {
    let mut rng = Rng::new(1);
    for dt in quantized_weight_types() {
        let bs = dt.block_size();
        let case = random_mul_mat(&mut rng, dt, [1, 2, 1, 1, 1, 1, 1]);
        let b = state(SplitState::axis(0, &[bs - 11, 11]));
        regress(t, case, vec![Place::Inline, b], 2);
        let case = random_mul_mat(&mut rng, dt, [4, 2, 3, 1, 1, 1, 2]);
        let (h, hh) = (bs, bs / 2);
        let b = state(SplitState::segmented(0, &[vec![h, 0, 0], vec![0, hh, hh]]));
        regress(t, case, vec![Place::Inline, b], 3);
    }
}

/// A cast to a quantized type must not keep an axis-0 split that cuts blocks (the rule passed
/// any state through; the device's cast of a 3-element row to Q8_0 failed).
pub fn cast_to_quantized_keeps_axis0_split_only_in_whole_blocks(t: &Target) {
    let mut rng = Rng::new(2);
    for to in quantized_weight_types() {
        let bs = to.block_size();
        let a = Input::random(&mut rng, "a", DType::F32, [2 * bs, 3, 1, 1]);
        let case = Case::new("cont", vec![a], move |g, l| Ok(vec![g.cast(l[0], to)?]));
        regress(
            t,
            case,
            vec![state(SplitState::axis(0, &[3, 2 * bs - 3]))],
            2,
        );
        let a = Input::random(&mut rng, "a", DType::F32, [2 * bs, 3, 1, 1]);
        let case = Case::new("cont", vec![a], move |g, l| Ok(vec![g.cast(l[0], to)?]));
        let s = SplitState::segmented(0, &[vec![0, bs, 0], vec![bs / 2, 0, bs / 2]]);
        regress(t, case, vec![state(s)], 3);
        // Whole blocks stay split.
        let a = Input::random(&mut rng, "a", DType::F32, [2 * bs, 3, 1, 1]);
        let case = Case::new("cont", vec![a], move |g, l| Ok(vec![g.cast(l[0], to)?]));
        regress(t, case, vec![state(SplitState::axis(0, &[bs, 0, bs]))], 3);
    }
}

/// Slicing a mirrored quantized tensor into a segmented split (a table following segmented
/// ids, a weight following a segmented K split) joined the pieces with `concat`, which takes
/// no quantized type.
pub fn segmented_slice_of_quantized_tensor(t: &Target) {
    let mut rng = Rng::new(3);
    for dt in quantized_weight_types() {
        let bs = dt.block_size();
        let table = Input::random(&mut rng, "table", dt, [bs, 3, 2, 1]);
        let ids = Input::from_i32("ids", [2, 2, 1, 1], &[2, 0, 1, 1]);
        let case = Case::new("get_rows", vec![table, ids], |g, l| {
            Ok(vec![g.get_rows(l[0], l[1])?])
        });
        let s = SplitState::segmented(1, &[vec![1, 0], vec![0, 1]]);
        regress(t, case, vec![Place::Inline, state(s)], 2);
        let case = random_mul_mat(&mut rng, dt, [6, 3, 2, 1, 1, 1, 1]);
        let s = SplitState::segmented(0, &[vec![bs, 0], vec![0, bs]]);
        regress(t, case, vec![Place::Inline, state(s)], 2);
    }
}

/// A split tensor consumed as Partial (copied into a partial destination, added to a partial
/// tensor) had no conversion: Axis -> Partial was "impossible", so `cpy` into a Partial
/// destination failed with NoSplitRule. Each device now pads its slice with zeros, locally.
pub fn split_to_partial_pads_with_zeros(t: &Target) {
    let mut rng = Rng::new(4);
    for n in [1, 2, 3, 5] {
        let a = Input::random(&mut rng, "src", DType::F32, [4, 5, 2, 2]);
        let mut dst = Input::random(&mut rng, "dst", DType::F16, [4, 5, 2, 2]);
        let pieces = partial_pieces(&mut rng, &mut dst, n);
        let case = Case {
            written: vec![1],
            ..Case::new("cpy", vec![a, dst], |g, l| Ok(vec![g.cpy(l[0], l[1])?]))
        };
        for s in [
            SplitState::axis(1, &random_extents(&mut rng, 5, 1, n)),
            random_split(&mut rng, 3, [4, 5, 2, 2], 1, n, true),
            SplitState::segmented(
                0,
                &[
                    random_extents(&mut rng, 1, 1, n),
                    random_extents(&mut rng, 3, 1, n),
                ],
            ),
        ] {
            let places = vec![state(s), Place::Partial(pieces.clone())];
            regress(t, case.clone(), places, n);
        }
    }
}

/// A device whose slice is empty built the op on empty shapes, which a builder may refuse:
/// soft_max's mask check took a zero extent for a bad broadcast ('[1, 1, 0, 2] and
/// [1, 1, 0, 1]'). Devices with an empty output now hold an empty placeholder.
pub fn empty_slices_skip_the_op(t: &Target) {
    let mut rng = Rng::new(5);
    let a = Input::random(&mut rng, "a", DType::F32, [3, 2, 3, 2]);
    let m = Input::random(&mut rng, "mask", DType::F32, [3, 2, 3, 1]);
    let case = Case::new("soft_max", vec![a, m], |g, l| {
        Ok(vec![g.soft_max(l[0], Some(l[1]), 0.5)?])
    });
    for s in [
        SplitState::axis(2, &[3, 0]),
        SplitState::segmented(2, &[vec![1, 0, 0], vec![1, 0, 0], vec![0, 0, 1]]),
        SplitState::axis(1, &[0, 2, 0]),
    ] {
        let n = s.n_devices();
        regress(t, case.clone(), vec![state(s), Place::Inline], n);
    }
}

/// The all-reduce of a Partial leaf ran in place, in the leaf's own storage: the meta buffer
/// then held the sum on every device (N times the value), so the next step computed with a
/// corrupted weight. Leaves are now reduced into a copy.
pub fn all_reduce_of_a_partial_leaf_leaves_it_unchanged(t: &Target) {
    let mut rng = Rng::new(6);
    for n in [2, 3, 4] {
        let mut y = Input::random(&mut rng, "y", DType::F32, [5, 3, 1, 1]);
        let pieces = partial_pieces(&mut rng, &mut y, n);
        let case = Case::new("rms_norm", vec![y], |g, l| {
            Ok(vec![g.rms_norm(l[0], 1e-5)?])
        });
        // check_placed also asserts that the leaf reads back unchanged.
        regress(t, case.clone(), vec![Place::Partial(pieces.clone())], n);
        // The same through a view of the leaf (reduced in the root's bytes before).
        let mut view = case.clone();
        view.build = Arc::new(|g: &mut Graph, l: &[TensorId]| {
            let t = g.transpose(l[0])?;
            Ok(vec![g.rms_norm(t, 1e-5)?])
        });
        regress(t, view, vec![Place::Partial(pieces.clone())], n);
        // Two steps on one backend.
        let leaves = case.inputs.clone();
        let places = [Place::Partial(pieces)];
        let setup = t
            .meta_setup(&leaves, &places, (n, 1), MetaOptions::default())
            .unwrap();
        let want = run_single(&leaves, &*case.build).unwrap();
        for step in 0..2 {
            let (mut g, ids) = setup.fresh_graph(&leaves).unwrap();
            let outs = (case.build)(&mut g, &ids).unwrap();
            let got = compute_and_read(setup.backend.as_ref(), &mut g, &outs).unwrap();
            let d = max_diff(&want[0], &got[0]).unwrap();
            assert!(d < 1e-5, "n={n} step {step}: differs by {d}");
        }
    }
}

/// Computing the same graph object again returned the first compute's results: its outputs
/// were bound to the first compute's result buffer, which changed the graph's structure hash
/// (a new plan) and made the new plan skip them as user-bound; inline inputs read back as
/// outputs were also taken from the old results instead of their new data.
pub fn computing_a_graph_again_gives_new_results(t: &Target) {
    let mut rng = Rng::new(7);
    for n in [1, 2, 3] {
        let x = Input::random(&mut rng, "x", DType::F32, [4, 3, 1, 1]);
        let w = Input::random(&mut rng, "w", DType::F32, [4, 4, 1, 1]);
        let mut leaves = vec![x, w];
        let places = [
            Place::Inline,
            state(SplitState::axis(1, &random_extents(&mut rng, 4, 1, n))),
        ];
        let setup = t
            .meta_setup(&leaves, &places, (n, 1), MetaOptions::default())
            .unwrap();
        let build = |g: &mut Graph, l: &[TensorId]| -> Result<Vec<TensorId>> {
            let y = g.mul_mat(l[1], l[0])?;
            Ok(vec![g.silu(y)?, l[0]])
        };
        let (mut g, ids) = setup.fresh_graph(&leaves).unwrap();
        let outs = build(&mut g, &ids).unwrap();
        for step in 0..3 {
            if step > 0 {
                leaves[0] = Input::random(&mut rng, "x", DType::F32, [4, 3, 1, 1]);
                g.set_data(ids[0], leaves[0].bytes().to_vec()).unwrap();
            }
            let want = run_single(&leaves, &build).unwrap();
            let got = compute_and_read(setup.backend.as_ref(), &mut g, &outs).unwrap();
            for (w, o) in want.iter().zip(&got) {
                let d = max_diff(w, o).unwrap();
                assert!(d <= 1e-4 * scale_of(w), "n={n} step {step}: differs by {d}");
            }
        }
        // Every step after the first reused the plan.
        assert_eq!(setup.backend.graphs_prepared(), 1);
    }
}

/// Copying a quantized tensor into a destination split on axis 0 in partial blocks cannot be
/// done per device (the source would be cut inside its blocks); the rule offered it anyway and
/// the device's view failed. Nor can a quantized source be made Partial for a partial
/// destination (concat of quantized zeros failed). Both are now NoSplitRule naming the node.
pub fn cpy_of_quantized_source_into_partial_block_split(t: &Target) {
    let mut rng = Rng::new(8);
    let src = Input::random(&mut rng, "src", DType::Q8_0, [64, 2, 1, 1]);
    let dst = Input::random(&mut rng, "dst", DType::F32, [64, 2, 1, 1]);
    let case = Case {
        written: vec![1],
        ..Case::new("cpy", vec![src, dst], |g, l| {
            let c = g.cpy(l[0], l[1])?;
            g.set_name(c, "dequant");
            Ok(vec![c])
        })
    };
    let refused = vec![Place::Inline, state(SplitState::axis(0, &[3, 61]))];
    if let Err(e) = check_refused(t, &case.clone().placed(2, refused), "dequant") {
        panic!("{e}");
    }
    for src in [
        state(SplitState::axis(1, &[1, 0, 1])),
        state(SplitState::mirrored(3)),
    ] {
        let refused = vec![src, state(SplitState::partial(3))];
        if let Err(e) = check_refused(t, &case.clone().placed(3, refused), "dequant") {
            panic!("{e}");
        }
    }
    // Whole blocks are fine.
    regress(
        t,
        case,
        vec![Place::Inline, state(SplitState::axis(0, &[32, 0, 32]))],
        3,
    );
}
