//! The harness itself, on the CPU backend: every case of `support::all_cases()` against the
//! float64 reference in exact mode (a CPU option); a check that the case list covers every op
//! and the dtypes and shapes that matter; self-tests showing the op harness catches
//! out-of-bounds writes, unwritten outputs, wrong values and clobbered inputs, and the meta
//! check catches a meta run that differs from one device. The list on every target (threads,
//! meta devices) and the meta properties run in `targets.rs`.

mod support;

use metashard::backend::Device;
use metashard::cpu::{CpuOptions, parse_cpu_spec_with};
use metashard::graph::Flags;
use metashard::{Backend, DType, Graph, Layout};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use support::check::{check_placed, check_refused};
use support::meta::partial_pieces;
use support::{
    CPU, Case, Fill, Input, Place, Rng, RunOptions, all_cases, case, run_case, run_cases,
};

fn cpu(spec: &str, exact: bool) -> Arc<dyn Backend> {
    let options = if exact {
        CpuOptions::exact()
    } else {
        CpuOptions::default()
    };
    let devs = parse_cpu_spec_with(spec, options).expect("cpu spec");
    devs[0].init_backend().expect("cpu backend")
}

#[test]
fn every_case_matches_the_reference_in_exact_mode() {
    let cases = all_cases();
    let be = cpu("cpu:1x2", true);
    let summary = run_cases(be.as_ref(), &cases, &RunOptions::default());
    let failures = summary.failures();
    assert!(
        failures.is_empty(),
        "{} failing cases in exact mode:\n{}",
        failures.len(),
        failures
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    // Exact-mode tolerances were applied (quantized mul_mat is held to 1e-10 here).
    let q = summary
        .results
        .iter()
        .flatten()
        .find(|r| r.op == "mul_mat" && r.params.contains("a:q4_0"))
        .expect("a q4_0 mul_mat case");
    assert_eq!(q.tol, 1e-10, "{q}");
}

/// Every op of `Op` appears in some case graph, with the dtypes and shapes the brief asks for;
/// case descriptions are unique (they seed the inputs and name failures).
#[test]
fn the_case_list_covers_every_op_dtype_and_shape_family() {
    let cases = all_cases();
    let mut ops: BTreeSet<&'static str> = BTreeSet::new();
    let mut src0: BTreeMap<&'static str, BTreeSet<DType>> = BTreeMap::new();
    let mut mm_m = BTreeSet::new();
    let mut seen = BTreeSet::new();
    for c in &cases {
        assert!(seen.insert(format!("{c:?}")), "duplicate case {c:?}");
        let (g, _, outs) = c.graph().unwrap_or_else(|e| panic!("{c:?}: {e}"));
        assert_eq!(outs.len(), 1, "{c:?}: the op list compares one output");
        let out = outs[0];
        for n in g.nodes() {
            ops.insert(n.op.name());
            if let Some(&s) = n.src.first() {
                src0.entry(n.op.name())
                    .or_default()
                    .insert(g.layout(s).dtype);
            }
            if n.op.name() == "mul_mat" {
                mm_m.insert(n.layout.ne[1]);
            }
        }
        if g.node(out).op.name() == "cont" {
            src0.entry("cont->")
                .or_default()
                .insert(g.layout(out).dtype);
        }
        if g.node(out).op.name() == "set_rows" {
            src0.entry("set_rows dst")
                .or_default()
                .insert(g.layout(out).dtype);
        }
    }
    let all_ops = [
        "leaf",
        "reshape",
        "view",
        "permute",
        "cont",
        "cpy",
        "concat",
        "get_rows",
        "set_rows",
        "mul_mat",
        "add",
        "sub",
        "mul",
        "div",
        "scale",
        "clamp",
        "silu",
        "gelu",
        "gelu_erf",
        "relu",
        "tanh",
        "swiglu",
        "rms_norm",
        "norm",
        "soft_max",
        "rope",
        "sum_rows",
        "sum_sqr_rows",
        "rms_norm_sums",
        "mean",
        "argmax",
        "flash_attn",
        "sigmoid",
        "argsort",
        "mul_mat_id",
    ];
    for op in all_ops {
        assert!(ops.contains(op), "no case uses {op}");
    }
    assert_eq!(
        ops.len(),
        all_ops.len(),
        "an op is missing from the list above: {ops:?}"
    );
    use DType::*;
    let want = |k: &str, d: &[DType]| {
        let got = &src0[k];
        for x in d {
            assert!(got.contains(x), "{k}: no case with {x} (have {got:?})");
        }
    };
    want("mul_mat", DType::WEIGHT_TYPES);
    want("get_rows", DType::WEIGHT_TYPES);
    want("get_rows", &[I32]);
    want("cont", DType::WEIGHT_TYPES);
    want("cont->", DType::WEIGHT_TYPES);
    want("set_rows dst", &[F32, F16, BF16]);
    want("rope", &[F32, F16]);
    want("flash_attn", &[F32]);
    for m in [0, 1, 2, 7, 32, 33] {
        assert!(mm_m.contains(&m), "no mul_mat with M = {m}");
    }
    assert!(cases.len() > 400, "only {} cases", cases.len());
}

// ---- the harness catches what it claims to catch ------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Sabotage {
    WriteAfterOutput,
    WriteBeforeOutput,
    SkipCompute,
    PerturbOutput,
    ClobberInput,
}

/// A backend that runs the CPU backend, then does one wrong thing.
struct Saboteur {
    inner: Arc<dyn Backend>,
    kind: Sabotage,
}

impl Backend for Saboteur {
    fn name(&self) -> String {
        format!("{:?}", self.kind)
    }
    fn device(&self) -> Arc<dyn Device> {
        self.inner.device()
    }
    fn synchronize(&self) -> metashard::Result<()> {
        self.inner.synchronize()
    }
    fn graph_compute(&self, g: &mut Graph) -> metashard::Result<()> {
        if self.kind != Sabotage::SkipCompute {
            self.inner.graph_compute(g)?;
        }
        let flagged = |f: Flags| {
            let id = g
                .ids()
                .find(|&i| g.node(i).flags.contains(f))
                .expect("flagged node");
            let root = g.root(id);
            (
                g.node(root).storage.clone().expect("bound"),
                g.layout(root).nbytes(),
            )
        };
        let (st, span) = match self.kind {
            Sabotage::ClobberInput => flagged(Flags::INPUT),
            _ => flagged(Flags::OUTPUT),
        };
        let flat = Layout::contiguous(DType::F32, [st.buffer.size() / 4, 1, 1, 1]);
        let poke = |at: usize| {
            let mut b = [0u8];
            st.buffer.get_tensor(&flat, 0, &mut b, at)?;
            st.buffer.set_tensor(&flat, 0, &[b[0] ^ 0x5A], at)
        };
        match self.kind {
            Sabotage::WriteAfterOutput => poke(st.offset + span + 3),
            Sabotage::WriteBeforeOutput => poke(st.offset - 1),
            Sabotage::SkipCompute => Ok(()),
            Sabotage::PerturbOutput | Sabotage::ClobberInput => poke(st.offset + 2),
        }
    }
}

fn probe_case() -> Case {
    case("add", "harness self-test")
        .packed("a", DType::F32, [33, 5, 1, 1], Fill::Uniform(-1.0, 1.0))
        .packed("b", DType::F32, [33, 1, 1, 1], Fill::Uniform(-1.0, 1.0))
        .build(|g, s| g.add(s[0], s[1]))
}

#[test]
fn the_harness_catches_broken_backends() {
    let c = probe_case();
    let opts = RunOptions::default();
    let good = cpu("cpu:1x2", false);
    let rep = run_case(good.as_ref(), &c, &opts).expect("the honest backend passes");
    assert!(rep.nmse <= 1e-14, "{rep}");
    for (kind, expect) in [
        (
            Sabotage::WriteAfterOutput,
            "guard after `output` overwritten at byte 3",
        ),
        (
            Sabotage::WriteBeforeOutput,
            "guard before `output` overwritten at byte 1",
        ),
        (Sabotage::SkipCompute, "unwritten"),
        (Sabotage::PerturbOutput, "NMSE"),
        (Sabotage::ClobberInput, "input `a` was modified"),
    ] {
        let bad = Saboteur {
            inner: good.clone(),
            kind,
        };
        let err = run_case(&bad, &c, &opts).expect_err("sabotage must be caught");
        assert!(err.contains(expect), "{kind:?}: {err}");
        assert!(
            err.contains("add") && err.contains("harness self-test"),
            "{err}"
        );
    }
    // A case whose extra check fails is reported, even with a perfect NMSE.
    let strict = Case {
        check: Some(Arc::new(|_: &[f64]| Err("extra check refused".into()))),
        ..probe_case()
    };
    let err = run_case(good.as_ref(), &strict, &opts).unwrap_err();
    assert!(err.contains("extra check refused"), "{err}");
}

/// Seeds change the inputs; the same seed gives the same output bytes.
#[test]
fn inputs_are_seeded_and_reproducible() {
    let c = probe_case();
    let be = cpu("cpu:1x1", false);
    let run = |seed| {
        run_case(
            be.as_ref(),
            &c,
            &RunOptions {
                seed,
                ..Default::default()
            },
        )
        .unwrap()
        .output
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
}

/// The meta check fails when the meta device holds something other than the case's inputs
/// (here a partial input whose pieces sum to another tensor than its value), and
/// `check_refused` fails when the run is not refused.
#[test]
fn the_meta_check_catches_wrong_results() {
    let mut rng = Rng::new(9);
    let a = Input::random(&mut rng, "a", DType::F32, [7, 3, 1, 1]);
    let b = Input::random(&mut rng, "b", DType::F32, [7, 3, 1, 1]);
    let case = Case::new("add", vec![a, b], |g, l| Ok(vec![g.add(l[0], l[1])?]));
    // Not explicit mode (which may end a run early), two threads per device.
    let seed = 1 << 9;
    for n in [2, 3] {
        let mut honest = case.clone();
        let pieces = partial_pieces(&mut rng, &mut honest.inputs[0], n);
        let honest = honest.placed(n, vec![Place::Partial(pieces), Place::Inline]);
        check_placed(&CPU, &honest, seed).expect("honest pieces pass");
        let err = check_refused(&CPU, &honest, "add").expect_err("the run is not refused");
        assert!(
            err.to_string().contains("expected NoSplitRule, ran"),
            "{err}"
        );

        let mut other = Input::random(&mut rng, "a", DType::F32, [7, 3, 1, 1]);
        let wrong = partial_pieces(&mut rng, &mut other, n);
        let wrong = case
            .clone()
            .placed(n, vec![Place::Partial(wrong), Place::Inline]);
        let err = check_placed(&CPU, &wrong, seed).expect_err("wrong pieces must be caught");
        // The placed input reads back as the pieces' sum: caught before the outputs are.
        assert!(err.to_string().contains("changed input `a`"), "{err}");
        // Not compared as an input (as if the graph wrote it): the outputs differ.
        let unchecked = Case {
            written: vec![0],
            ..wrong
        };
        let err = check_placed(&CPU, &unchecked, seed).expect_err("a wrong output is caught");
        assert!(err.to_string().contains("output 0: max diff"), "{err}");
    }
}
