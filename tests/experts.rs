//! The mixture-of-experts ops refuse bad operands by name: `mul_mat_id` with experts and
//! activations of different row lengths, ids of another token count or an `n_used` the
//! activations do not divide, ids that are not I32, `top_k` of more values than a row has; an
//! expert id outside the experts at run time is an error naming the node, the id and the
//! range, on any thread count, and the backend works after it.

use metashard::{Backend, DType, Error, Graph, Shape, parse_devices};

#[test]
fn bad_operands_are_builder_errors_naming_the_op() {
    let mut g = Graph::new();
    let experts = g.input("experts", DType::Q8_0, [64, 8, 4, 1]).unwrap();
    let x = g.input("x", DType::F32, [64, 1, 3, 1]).unwrap();
    let x2 = g.input("x2", DType::F32, [64, 2, 3, 1]).unwrap();
    let short = g.input("short", DType::F32, [32, 1, 3, 1]).unwrap();
    let ids = g.input("ids", DType::I32, [3, 3, 1, 1]).unwrap();
    let ids_2t = g.input("ids_2t", DType::I32, [2, 2, 1, 1]).unwrap();
    let ids_f = g.input("ids_f", DType::F32, [2, 3, 1, 1]).unwrap();
    let shape = |e: Error, a: [usize; 4], b: [usize; 4]| {
        let msg = e.to_string();
        assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
        for want in [
            "mul_mat_id".to_string(),
            Shape(a).to_string(),
            Shape(b).to_string(),
        ] {
            assert!(msg.contains(&want), "`{msg}` does not name {want}");
        }
    };
    shape(
        g.mul_mat_id(experts, short, ids).unwrap_err(),
        [64, 8, 4, 1],
        [32, 1, 3, 1],
    );
    shape(
        g.mul_mat_id(experts, x, ids_2t).unwrap_err(),
        [64, 1, 3, 1],
        [2, 2, 1, 1],
    );
    // Three experts per token cannot share two activation rows.
    shape(
        g.mul_mat_id(experts, x2, ids).unwrap_err(),
        [64, 2, 3, 1],
        [3, 3, 1, 1],
    );
    let e = g.mul_mat_id(experts, x, ids_f).unwrap_err();
    assert!(
        matches!(e, Error::DTypeMismatch { .. }) && e.to_string().contains("ids_f"),
        "{e}"
    );
    let e = g.mul_mat_id(ids, x, ids).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let probs = g.input("probs", DType::F32, [4, 3, 1, 1]).unwrap();
    let e = g.top_k(probs, 5).unwrap_err().to_string();
    assert!(e.contains("top_k") && e.contains("k = 5"), "{e}");
    let e = g.argsort(ids, true).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    assert!(g.mul_mat_id(experts, x2, ids_2t).is_err());
    let ok = g.mul_mat_id(experts, x, ids).unwrap();
    assert_eq!(g.layout(ok).ne, [8, 3, 3, 1]);
}

/// One small graph that must run after an error.
fn runs(be: &dyn Backend) {
    let mut g = Graph::new();
    let experts = g
        .input_f32("experts", [2, 1, 2, 1], &[1.0, 2.0, 3.0, 4.0])
        .unwrap();
    let x = g.input_f32("x", [2, 1, 1, 1], &[1.0, 1.0]).unwrap();
    let ids = g.input_i32("ids", [2, 1, 1, 1], &[1, 0]).unwrap();
    let y = g.mul_mat_id(experts, x, ids).unwrap();
    g.set_output(y);
    be.graph_compute(&mut g).unwrap();
    assert_eq!(g.read_f32(y).unwrap(), vec![7.0, 3.0]);
}

#[test]
fn an_expert_id_outside_the_experts_is_a_node_error() {
    for spec in ["cpu:1x1", "cpu:1x2", "cpu:1x3"] {
        let be = parse_devices(spec).unwrap()[0].init_backend().unwrap();
        runs(be.as_ref());
        for bad in [4, -1] {
            let mut g = Graph::new();
            let experts = g.input_f32("experts", [8, 3, 4, 1], &[0.5; 96]).unwrap();
            let x = g.input_f32("x", [8, 1, 2, 1], &[1.0; 16]).unwrap();
            let ids = g.input_i32("ids", [2, 2, 1, 1], &[0, 3, 2, bad]).unwrap();
            let y = g.mul_mat_id(experts, x, ids).unwrap();
            g.set_name(y, "ffn_up_exps_out");
            g.set_output(y);
            let e = be.graph_compute(&mut g).expect_err("bad expert id");
            match &e {
                Error::RowIdOutOfRange {
                    node,
                    op,
                    id,
                    index,
                    rows,
                    ..
                } => assert_eq!(
                    (node.as_str(), *op, *id, *index, *rows),
                    ("ffn_up_exps_out", "mul_mat_id", bad as i64, [1, 1, 0], 4),
                    "{spec}: {e}"
                ),
                other => panic!("{spec}: expected RowIdOutOfRange, got {other:?}"),
            }
            runs(be.as_ref());
        }
    }
}
