//! The bodies of the tests `harness_tests!` emits for a target: the op-by-op list against the
//! float64 reference on one device at 1, 2 and 3 threads and on meta devices with mirrored
//! inputs, and the meta properties (each op's randomized case on N = 1..=8 devices of the
//! target against one device). The strategies live in the macro; each property here takes
//! what they drew.

use super::cases::all_cases;
use super::check::{check, check_refused, check_steps};
use super::meta::{Place, random_split};
use super::random::*;
use super::rng::Rng;
use super::run::{RunOptions, Summary, run_cases};
use super::target::Target;
use metashard::DType;
use metashard::op::BinaryOp;
use metashard::split_state::SplitState;
use proptest::test_runner::TestCaseError;
use std::time::Instant;

type Prop = std::result::Result<(), TestCaseError>;

/// Failures of a summary, and runs that did not check their guards where `guarded` says the
/// buffers are plain bytes.
fn failures_of(label: &str, s: &Summary, guarded: bool) -> Vec<String> {
    let mut f: Vec<String> = s
        .failures()
        .into_iter()
        .map(|e| format!("{label}: {e}"))
        .collect();
    if guarded {
        f.extend(
            s.results
                .iter()
                .flatten()
                .filter(|r| !r.guarded)
                .map(|r| format!("{label}: {r}: guards were not checked")),
        );
    }
    f
}

/// Every case of the op-by-op list against the float64 reference on one device of the target
/// at 1, 2 and 3 threads; the three agree bit for bit (kernels split work by output rows, so
/// the thread count must not change a single bit), and every case checked its guards (the
/// buffers are plain bytes).
pub fn op_cases_at_1_2_3_threads(target: &Target) {
    let cases = all_cases();
    let opts = RunOptions::default();
    let mut failures = Vec::new();
    let mut outputs: Vec<Vec<Option<Vec<u8>>>> = Vec::new();
    for threads in 1..=3 {
        let label = format!("{} 1x{threads}", target.name);
        let be = target.backend(threads).expect("the target's backend");
        let t = Instant::now();
        let summary = run_cases(be.as_ref(), &cases, &opts);
        println!("---- {label}: {} cases in {:.2?}", cases.len(), t.elapsed());
        if threads == 2 {
            summary.print();
        }
        failures.extend(failures_of(&label, &summary, true));
        outputs.push(
            summary
                .results
                .iter()
                .map(|r| r.as_ref().ok().map(|rep| rep.output.clone()))
                .collect(),
        );
    }
    for (i, c) in cases.iter().enumerate() {
        if let (Some(a), Some(b), Some(d)) = (&outputs[0][i], &outputs[1][i], &outputs[2][i])
            && (a != b || a != d)
        {
            failures.push(format!("{c:?}: outputs differ between 1, 2 and 3 threads"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} failing case runs (of {} cases x 3 thread counts):\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// The same list on meta devices over 1, 2 and 3 devices of the target, every input mirrored
/// (each device computes the whole graph; split inputs are the meta properties' business). The
/// output root is bound by the harness (with guards and poison): the meta backend gathers the
/// computed output into it.
pub fn op_cases_on_meta_devices_mirrored(target: &Target) {
    let cases = all_cases();
    let opts = RunOptions::default();
    let mut failures = Vec::new();
    for n in 1..=3 {
        let placed: Vec<_> = cases.iter().map(|c| c.mirrored(n)).collect();
        let t = Instant::now();
        let summary = target.run_cases(&placed, &opts);
        let label = format!("meta {}:{n}x1", target.name);
        println!(
            "---- {label}: {} cases in {:.2?}",
            placed.len(),
            t.elapsed()
        );
        failures.extend(failures_of(&label, &summary, false));
    }
    assert!(
        failures.is_empty(),
        "{} failing case runs on the meta device:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

// ---- the meta properties --------------------------------------------------------------------

/// The case generator's seed: the property's seed, apart from the seed of the places.
fn rng(seed: u64) -> Rng {
    Rng::new(seed ^ 0x5eed)
}

pub fn mul_mat_f32(t: &Target, n: usize, seed: u64, p: [usize; 7]) -> Prop {
    check(t, random_mul_mat(&mut rng(seed), DType::F32, p), n, seed)
}

pub fn mul_mat_quantized(t: &Target, n: usize, seed: u64, dt: DType, p: [usize; 7]) -> Prop {
    check(t, random_mul_mat(&mut rng(seed), dt, p), n, seed)
}

pub fn binary_broadcast(t: &Target, n: usize, seed: u64, op: BinaryOp, ne: [usize; 4]) -> Prop {
    check(t, random_binary(&mut rng(seed), op, ne), n, seed)
}

pub fn unary_scale_clamp(t: &Target, n: usize, seed: u64, which: usize, ne: [usize; 4]) -> Prop {
    check(t, random_unary(&mut rng(seed), ne, which), n, seed)
}

pub fn swiglu(t: &Target, n: usize, seed: u64, fused: bool, ne: [usize; 4]) -> Prop {
    check(t, random_swiglu(&mut rng(seed), n, ne, fused), n, seed)
}

pub fn rowwise(t: &Target, n: usize, seed: u64, which: usize, ne: [usize; 4]) -> Prop {
    check(t, random_rowwise(&mut rng(seed), ne, which), n, seed)
}

pub fn soft_max(t: &Target, n: usize, seed: u64, mask: bool, ne: [usize; 4]) -> Prop {
    check(t, random_soft_max(&mut rng(seed), ne, mask), n, seed)
}

pub fn rope(t: &Target, n: usize, seed: u64, [hd, nh, tk]: [usize; 3], neox: bool) -> Prop {
    check(t, random_rope(&mut rng(seed), hd, nh, tk, neox), n, seed)
}

pub fn argmax(t: &Target, n: usize, seed: u64, ne0: usize, ne1: usize) -> Prop {
    check(t, random_argmax(&mut rng(seed), ne0, ne1), n, seed)
}

pub fn mul_mat_id(t: &Target, n: usize, seed: u64, p: [usize; 6]) -> Prop {
    check(t, random_mul_mat_id(&mut rng(seed), p), n, seed)
}

pub fn argsort(t: &Target, n: usize, seed: u64, ne: [usize; 4], descending: bool) -> Prop {
    check(t, random_argsort(&mut rng(seed), ne, descending), n, seed)
}

pub fn get_rows(t: &Target, n: usize, seed: u64, [ne0, rows, nid, e2, e3]: [usize; 5]) -> Prop {
    check(
        t,
        random_get_rows(&mut rng(seed), ne0, rows, nid, e2, e3),
        n,
        seed,
    )
}

/// One run in five places the destination in a state the rule does not admit (Partial, or a
/// split on an axis not in the admitted ones): it must be refused naming the node.
pub fn set_rows(t: &Target, n: usize, seed: u64, p: [usize; 5], refuse: usize) -> Prop {
    let mut rng = rng(seed);
    let (case, axes) = random_set_rows(&mut rng, p);
    if refuse != 0 {
        return check(t, case, n, seed);
    }
    let mut placed = case.placed_randomly(&mut rng, n);
    let bad: Vec<usize> = (1..4).filter(|k| !axes.contains(k)).collect();
    let ne = placed.inputs[0].ne;
    // Every axis admitted: only Partial is refused, drawn on several devices (as before).
    if bad.is_empty() && n == 1 {
        return check(t, case, n, seed);
    }
    placed.placement.as_mut().unwrap().places[0] = if bad.is_empty() || (n > 1 && rng.chance(1, 3))
    {
        Place::State(SplitState::partial(n))
    } else {
        let k = rng.pick(&bad);
        Place::State(random_split(&mut rng, k, ne, 1, n, true))
    };
    check_refused(t, &placed, "set_rows_out")
}

/// Not admitted, one run in five where it applies: a destination of another shape split on
/// an axis, or a partial destination of a quantized source.
pub fn cpy(t: &Target, n: usize, seed: u64, ne: [usize; 4], refuse: usize) -> Prop {
    let mut rng = rng(seed);
    let (case, same) = random_cpy(&mut rng, ne);
    let quant = case.inputs[0].dtype.is_quantized();
    if !(refuse == 0 && (!same || quant)) {
        return check(t, case, n, seed);
    }
    let mut placed = case.placed_randomly(&mut rng, n);
    let k = rng.below(4);
    let ne = placed.inputs[1].ne;
    placed.placement.as_mut().unwrap().places[1] = if quant {
        Place::State(SplitState::partial(n))
    } else {
        Place::State(random_split(&mut rng, k, ne, 1, n, true))
    };
    check_refused(t, &placed, "cpy_out")
}

pub fn cont_cast(t: &Target, n: usize, seed: u64, ne: [usize; 4]) -> Prop {
    check(t, random_cast(&mut rng(seed), ne), n, seed)
}

pub fn concat(t: &Target, n: usize, seed: u64, ne: [usize; 4], dim: usize, extra: usize) -> Prop {
    check(t, random_concat(&mut rng(seed), ne, dim, extra), n, seed)
}

pub fn flash_attn(t: &Target, n: usize, seed: u64, p: [usize; 8]) -> Prop {
    check(t, random_flash_attn(&mut rng(seed), p), n, seed)
}

pub fn reshape(t: &Target, n: usize, seed: u64, ne: [usize; 4]) -> Prop {
    check(t, random_reshape(&mut rng(seed), ne), n, seed)
}

pub fn permute_transpose(t: &Target, n: usize, seed: u64, ne: [usize; 4], consumer: usize) -> Prop {
    check(t, random_permute(&mut rng(seed), ne, consumer), n, seed)
}

pub fn kv_cache_views(t: &Target, n: usize, seed: u64, p: [usize; 7]) -> Prop {
    check(t, random_kv_cache(&mut rng(seed), n, p), n, seed)
}

pub fn expert_groups(t: &Target, n: usize, seed: u64, p: [usize; 5]) -> Prop {
    check(t, random_expert_groups(&mut rng(seed), n, p), n, seed)
}

pub fn segment_views(t: &Target, n: usize, seed: u64, p: [usize; 5]) -> Prop {
    check(t, random_segment_views(&mut rng(seed), n, p), n, seed)
}

pub fn sub_views(t: &Target, n: usize, seed: u64, ne0: usize, ne1: usize) -> Prop {
    check(t, random_sub_views(&mut rng(seed), ne0, ne1), n, seed)
}

pub fn chains(t: &Target, n: usize, seed: u64, d: [usize; 3], steps: usize) -> Prop {
    check_steps(t, &random_chain(&mut rng(seed), d, steps), n, seed)
}

pub fn attention_block(t: &Target, n: usize, seed: u64, z: AttnSizes, megatron: bool) -> Prop {
    check(
        t,
        random_attention_block(&mut rng(seed), n, z, megatron),
        n,
        seed,
    )
}
