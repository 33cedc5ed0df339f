//! Sharded equals single-device, op by op: for every op of the op set, random small shapes
//! (odd sizes and 1s), N in 1..=8 devices, and each input leaf in a random state its dtype
//! allows (inline, mirrored, partial with random per-device pieces, or split on any axis with
//! random uneven extents, zeros and segments included), the meta device's result equals the
//! graph's result on one CPU device within the dtype's tolerance, and the inputs are left
//! unchanged. Chains of ops cover derived states, and steps on one backend the plan cache.
//!
//! Data lie on a grid of 1/64 in [-2, 2], so partial pieces sum exactly in any order and the
//! remaining differences come from the order of longer sums and from transcendental functions.
//! Destinations of `set_rows` and `cpy`, which cannot be converted, take only the states their
//! rule admits; any other state must fail with `Error::NoSplitRule` naming the node. The cases
//! live in `common_meta/cases.rs`, the harness in `common_meta/check.rs`.

mod common_meta;

use common_meta::cases::*;
use common_meta::check::*;
use common_meta::*;
use metashard::meta::MetaOptions;
use metashard::op::BinaryOp;
use metashard::split_state::SplitState;
use metashard::{DType, Graph, Result, TensorId};
use proptest::prelude::*;
use std::rc::Rc;

// ---- the properties -------------------------------------------------------------------------

fn shape4() -> impl Strategy<Value = [usize; 4]> {
    [1usize..=7, 1usize..=5, 1usize..=3, 1usize..=2]
}

proptest! {
    #![proptest_config(cfg(400))]

    #[test]
    fn mul_mat_f32(n in 1usize..=8, seed: u64, p in [1usize..=9, 1usize..=6, 1usize..=5, 1usize..=3, 1usize..=3, 1usize..=2, 1usize..=2]) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(mul_mat_case(&mut rng, DType::F32, p), n, seed)?;
    }

    #[test]
    fn mul_mat_quantized(n in 1usize..=8, seed: u64, dt in prop::sample::select(vec![DType::Q8_0, DType::Q4_0, DType::Q4_1]), p in [1usize..=9, 1usize..=5, 1usize..=4, 1usize..=3, 1usize..=2, 1usize..=2, 1usize..=2]) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(mul_mat_case(&mut rng, dt, p), n, seed)?;
    }

    #[test]
    fn binary_broadcast(n in 1usize..=8, seed: u64, op in prop::sample::select(vec![BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div]), ne in shape4()) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(binary_case(&mut rng, op, ne), n, seed)?;
    }

    #[test]
    fn unary_scale_clamp(n in 1usize..=8, seed: u64, which in 0usize..7, ne in shape4()) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(unary_case(&mut rng, ne, which), n, seed)?;
    }

    #[test]
    fn swiglu(n in 1usize..=8, seed: u64, fused: bool, ne in shape4()) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(swiglu_case(&mut rng, n, ne, fused), n, seed)?;
    }

    #[test]
    fn rowwise(n in 1usize..=8, seed: u64, which in 0usize..4, ne in shape4()) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(rowwise_case(&mut rng, ne, which), n, seed)?;
    }

    #[test]
    fn soft_max(n in 1usize..=8, seed: u64, mask: bool, ne in shape4()) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(soft_max_case(&mut rng, ne, mask), n, seed)?;
    }

    #[test]
    fn rope(n in 1usize..=8, seed: u64, hd in 1usize..=4, nh in 1usize..=5, t in 1usize..=4, neox: bool) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(rope_case(&mut rng, hd, nh, t, neox), n, seed)?;
    }

    #[test]
    fn argmax(n in 1usize..=8, seed: u64, ne0 in 1usize..=9, ne1 in 1usize..=6) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(argmax_case(&mut rng, ne0, ne1), n, seed)?;
    }

    #[test]
    fn get_rows(n in 1usize..=8, seed: u64, ne0 in 1usize..=6, rows in 1usize..=7, nid in 1usize..=5, e2 in 1usize..=3, e3 in 1usize..=2) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(get_rows_case(&mut rng, ne0, rows, nid, e2, e3), n, seed)?;
    }

    #[test]
    fn set_rows(n in 1usize..=8, seed: u64, p in [1usize..=5, 1usize..=6, 1usize..=4, 1usize..=2, 1usize..=4], refuse in 0usize..5) {
        let mut rng = TestRng(seed ^ 0x5eed);
        let (case, axes) = set_rows_case(&mut rng, p);
        if refuse == 0 {
            // A destination state the rule does not admit: Partial, or a split on an axis
            // not in `axes`.
            let mut leaves = case.leaves.clone();
            let mut places: Vec<Place> = leaves.iter_mut().zip(&case.spaces)
                .map(|(l, s)| random_place(&mut rng, l, s, n)).collect();
            let bad: Vec<usize> = (1..4).filter(|k| !axes.contains(k)).collect();
            let k = rng.pick(&bad);
            places[0] = if n > 1 && rng.chance(1, 3) {
                Place::State(SplitState::partial(n))
            } else {
                Place::State(random_split(&mut rng, k, leaves[0].ne, 1, n, true))
            };
            check_refused(&case, leaves, places, n, "set_rows_out")?;
        } else {
            check(case, n, seed)?;
        }
    }

    #[test]
    fn cpy(n in 1usize..=8, seed: u64, ne in shape4(), refuse in 0usize..5) {
        let mut rng = TestRng(seed ^ 0x5eed);
        let (case, same) = cpy_case(&mut rng, ne);
        let quant = case.leaves[0].dtype.is_quantized();
        if refuse == 0 && (!same || quant) {
            // Not admitted: a destination of another shape split on an axis, or a partial
            // destination of a quantized source.
            let mut leaves = case.leaves.clone();
            let mut places: Vec<Place> = leaves.iter_mut().zip(&case.spaces)
                .map(|(l, s)| random_place(&mut rng, l, s, n)).collect();
            let k = rng.below(4);
            places[1] = if quant {
                Place::State(SplitState::partial(n))
            } else {
                Place::State(random_split(&mut rng, k, leaves[1].ne, 1, n, true))
            };
            check_refused(&case, leaves, places, n, "cpy_out")?;
        } else {
            check(case, n, seed)?;
        }
    }

    #[test]
    fn cont_cast(n in 1usize..=8, seed: u64, ne in shape4()) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(cast_case(&mut rng, ne), n, seed)?;
    }

    #[test]
    fn concat(n in 1usize..=8, seed: u64, ne in shape4(), dim in 0usize..4, extra in 1usize..=4) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(concat_case(&mut rng, ne, dim, extra), n, seed)?;
    }

    #[test]
    fn flash_attn(n in 1usize..=8, seed: u64, p in [1usize..=6, 1usize..=5, 1usize..=4, 1usize..=5, 1usize..=3, 1usize..=3, 1usize..=2, 0usize..=2]) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(flash_attn_case(&mut rng, p), n, seed)?;
    }

    #[test]
    fn reshape(n in 1usize..=8, seed: u64, ne in shape4()) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(reshape_case(&mut rng, ne), n, seed)?;
    }

    #[test]
    fn permute_transpose(n in 1usize..=8, seed: u64, ne in shape4(), consumer in 0usize..3) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(permute_case(&mut rng, ne, consumer), n, seed)?;
    }

    #[test]
    fn kv_cache_views(n in 1usize..=8, seed: u64, p in [1usize..=4, 1usize..=3, 1usize..=3, 1usize..=6, 1usize..=3, 0usize..=2, 0usize..=1]) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(kv_cache_case(&mut rng, n, p), n, seed)?;
    }

    #[test]
    fn segment_views(n in 1usize..=8, seed: u64, p in [1usize..=6, 1usize..=4, 1usize..=4, 1usize..=3, 0usize..=1]) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(segment_view_case(&mut rng, n, p), n, seed)?;
    }

    #[test]
    fn sub_views(n in 1usize..=8, seed: u64, ne0 in 1usize..=6, ne1 in 1usize..=6) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check(sub_view_case(&mut rng, ne0, ne1), n, seed)?;
    }

    #[test]
    fn chains(n in 1usize..=8, seed: u64, d in [1usize..=6, 1usize..=4, 1usize..=3], steps in 1usize..=6) {
        let mut rng = TestRng(seed ^ 0x5eed);
        check_chain_steps(&chain_case(&mut rng, d, steps), n, seed)?;
    }

    #[test]
    fn attention_block(n in 1usize..=8, seed: u64, hd in 1usize..=3, hk in 1usize..=3, group in 1usize..=3, t in 1usize..=3, past in 0usize..=3, f16_cache: bool, megatron: bool) {
        let mut rng = TestRng(seed ^ 0x5eed);
        let z = AttnSizes { hd: 2 * hd, hk, group, t, past, f16_cache };
        check(attention_case(&mut rng, n, z, megatron), n, seed)?;
    }
}

// ---- regressions: cases the properties found, fixed in src/ ---------------------------------

fn regress(case: Case, places: Vec<Place>, n: usize) {
    let leaves = case.leaves.clone();
    if let Err(e) = check_places(&case, leaves, places, n, 1) {
        panic!("{e}");
    }
}

fn state(s: SplitState) -> Place {
    Place::State(s)
}

/// A quantized weight must not follow an activation's K split that cuts its blocks (the rule
/// offered the pattern; the device's view of 21 elements of a Q8_0 row failed).
#[test]
fn regression_quantized_weight_follows_k_split_in_whole_blocks_only() {
    let mut rng = TestRng(1);
    for dt in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
        let case = mul_mat_case(&mut rng, dt, [1, 2, 1, 1, 1, 1, 1]);
        let b = state(SplitState::axis(0, &[21, 11]));
        regress(case, vec![Place::Inline, b], 2);
        let case = mul_mat_case(&mut rng, dt, [4, 2, 3, 1, 1, 1, 2]);
        let b = state(SplitState::segmented(0, &[vec![32, 0, 0], vec![0, 16, 16]]));
        regress(case, vec![Place::Inline, b], 3);
    }
}

/// A cast to a quantized type must not keep an axis-0 split that cuts blocks (the rule passed
/// any state through; the device's cast of a 3-element row to Q8_0 failed).
#[test]
fn regression_cast_to_quantized_keeps_axis0_split_only_in_whole_blocks() {
    let mut rng = TestRng(2);
    for to in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
        let a = Leaf::random(&mut rng, "a", DType::F32, [64, 3, 1, 1]);
        let case = Case::new(vec![a], Rc::new(move |g, l| Ok(vec![g.cast(l[0], to)?])));
        regress(case, vec![state(SplitState::axis(0, &[3, 61]))], 2);
        let a = Leaf::random(&mut rng, "a", DType::F32, [64, 3, 1, 1]);
        let case = Case::new(vec![a], Rc::new(move |g, l| Ok(vec![g.cast(l[0], to)?])));
        let s = SplitState::segmented(0, &[vec![0, 32, 0], vec![16, 0, 16]]);
        regress(case, vec![state(s)], 3);
        // Whole blocks stay split.
        let a = Leaf::random(&mut rng, "a", DType::F32, [64, 3, 1, 1]);
        let case = Case::new(vec![a], Rc::new(move |g, l| Ok(vec![g.cast(l[0], to)?])));
        regress(case, vec![state(SplitState::axis(0, &[32, 0, 32]))], 3);
    }
}

/// Slicing a mirrored quantized tensor into a segmented split (a table following segmented
/// ids, a weight following a segmented K split) joined the pieces with `concat`, which takes
/// no quantized type.
#[test]
fn regression_segmented_slice_of_quantized_tensor() {
    let mut rng = TestRng(3);
    for dt in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
        let table = Leaf::random(&mut rng, "table", dt, [32, 3, 2, 1]);
        let ids = Leaf::from_i32("ids", [2, 2, 1, 1], &[2, 0, 1, 1]);
        let case = Case::new(
            vec![table, ids],
            Rc::new(|g, l| Ok(vec![g.get_rows(l[0], l[1])?])),
        );
        let s = SplitState::segmented(1, &[vec![1, 0], vec![0, 1]]);
        regress(case, vec![Place::Inline, state(s)], 2);
        let case = mul_mat_case(&mut rng, dt, [6, 3, 2, 1, 1, 1, 1]);
        let s = SplitState::segmented(0, &[vec![32, 0], vec![0, 32]]);
        regress(case, vec![Place::Inline, state(s)], 2);
    }
}

/// A split tensor consumed as Partial (copied into a partial destination, added to a partial
/// tensor) had no conversion: Axis -> Partial was "impossible", so `cpy` into a Partial
/// destination failed with NoSplitRule. Each device now pads its slice with zeros, locally.
#[test]
fn regression_split_to_partial_pads_with_zeros() {
    let mut rng = TestRng(4);
    for n in [1, 2, 3, 5] {
        let a = Leaf::random(&mut rng, "src", DType::F32, [4, 5, 2, 2]);
        let mut dst = Leaf::random(&mut rng, "dst", DType::F16, [4, 5, 2, 2]);
        let pieces = partial_pieces(&mut rng, &mut dst, n);
        let case = Case {
            written: vec![1],
            ..Case::new(vec![a, dst], Rc::new(|g, l| Ok(vec![g.cpy(l[0], l[1])?])))
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
            regress(case.clone(), places, n);
        }
    }
}

/// A device whose slice is empty built the op on empty shapes, which a builder may refuse:
/// soft_max's mask check took a zero extent for a bad broadcast ('[1, 1, 0, 2] and
/// [1, 1, 0, 1]'). Devices with an empty output now hold an empty placeholder.
#[test]
fn regression_empty_slices_skip_the_op() {
    let mut rng = TestRng(5);
    let a = Leaf::random(&mut rng, "a", DType::F32, [3, 2, 3, 2]);
    let m = Leaf::random(&mut rng, "mask", DType::F32, [3, 2, 3, 1]);
    let case = Case::new(
        vec![a, m],
        Rc::new(|g, l| Ok(vec![g.soft_max(l[0], Some(l[1]), 0.5)?])),
    );
    for s in [
        SplitState::axis(2, &[3, 0]),
        SplitState::segmented(2, &[vec![1, 0, 0], vec![1, 0, 0], vec![0, 0, 1]]),
        SplitState::axis(1, &[0, 2, 0]),
    ] {
        let n = s.n_devices();
        regress(case.clone(), vec![state(s), Place::Inline], n);
    }
}

/// The all-reduce of a Partial leaf ran in place, in the leaf's own storage: the meta buffer
/// then held the sum on every device (N times the value), so the next step computed with a
/// corrupted weight. Leaves are now reduced into a copy.
#[test]
fn regression_all_reduce_of_a_partial_leaf_leaves_it_unchanged() {
    let mut rng = TestRng(6);
    for n in [2, 3, 4] {
        let mut y = Leaf::random(&mut rng, "y", DType::F32, [5, 3, 1, 1]);
        let pieces = partial_pieces(&mut rng, &mut y, n);
        let case = Case::new(vec![y], Rc::new(|g, l| Ok(vec![g.rms_norm(l[0], 1e-5)?])));
        // check_places also asserts that the leaf reads back unchanged.
        regress(case.clone(), vec![Place::Partial(pieces.clone())], n);
        // The same through a view of the leaf (reduced in the root's bytes before).
        let mut view = case.clone();
        view.build = Rc::new(|g, l| {
            let t = g.transpose(l[0])?;
            Ok(vec![g.rms_norm(t, 1e-5)?])
        });
        regress(view, vec![Place::Partial(pieces.clone())], n);
        // Two steps on one backend.
        let leaves = case.leaves.clone();
        let places = [Place::Partial(pieces)];
        let setup = meta_setup(&leaves, &places, n, MetaOptions::default()).unwrap();
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
#[test]
fn regression_computing_a_graph_again_gives_new_results() {
    let mut rng = TestRng(7);
    for n in [1, 2, 3] {
        let x = Leaf::random(&mut rng, "x", DType::F32, [4, 3, 1, 1]);
        let w = Leaf::random(&mut rng, "w", DType::F32, [4, 4, 1, 1]);
        let mut leaves = vec![x, w];
        let places = [
            Place::Inline,
            state(SplitState::axis(1, &random_extents(&mut rng, 4, 1, n))),
        ];
        let setup = meta_setup(&leaves, &places, n, MetaOptions::default()).unwrap();
        let build = |g: &mut Graph, l: &[TensorId]| -> Result<Vec<TensorId>> {
            let y = g.mul_mat(l[1], l[0])?;
            Ok(vec![g.silu(y)?, l[0]])
        };
        let (mut g, ids) = setup.fresh_graph(&leaves).unwrap();
        let outs = build(&mut g, &ids).unwrap();
        for step in 0..3 {
            if step > 0 {
                leaves[0] = Leaf::random(&mut rng, "x", DType::F32, [4, 3, 1, 1]);
                g.set_data(ids[0], leaves[0].bytes.clone()).unwrap();
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
#[test]
fn regression_cpy_of_quantized_source_into_partial_block_split() {
    let mut rng = TestRng(8);
    let src = Leaf::random(&mut rng, "src", DType::Q8_0, [64, 2, 1, 1]);
    let dst = Leaf::random(&mut rng, "dst", DType::F32, [64, 2, 1, 1]);
    let case = Case {
        written: vec![1],
        ..Case::new(
            vec![src, dst],
            Rc::new(|g, l| {
                let c = g.cpy(l[0], l[1])?;
                g.set_name(c, "dequant");
                Ok(vec![c])
            }),
        )
    };
    let refused = vec![Place::Inline, state(SplitState::axis(0, &[3, 61]))];
    if let Err(e) = check_refused(&case, case.leaves.clone(), refused, 2, "dequant") {
        panic!("{e}");
    }
    for src in [
        state(SplitState::axis(1, &[1, 0, 1])),
        state(SplitState::mirrored(3)),
    ] {
        let refused = vec![src, state(SplitState::partial(3))];
        if let Err(e) = check_refused(&case, case.leaves.clone(), refused, 3, "dequant") {
            panic!("{e}");
        }
    }
    // Whole blocks are fine.
    regress(
        case,
        vec![Place::Inline, state(SplitState::axis(0, &[32, 0, 32]))],
        3,
    );
}
