//! Bad input gets a clear error, never a panic: mismatched shapes name the op and both shapes,
//! unsupported dtypes and layouts are refused (by the builder, or by `graph_compute` before
//! anything runs), buffers that are too small and allocations that cannot be had are errors,
//! a leaf without storage is named, and an out-of-range id at run time is an error returned by
//! the node's kernel (not a panic) naming the node, the id and the range, after which the
//! backend still works.

use metashard::backend::alloc_tensors;
use metashard::buffer::{BufferType, Storage};
use metashard::cpu::CpuBufferType;
use metashard::op::{RopeMode, RopeParams};
use metashard::{Backend, DType, Error, Graph, Layout, Shape, TensorId, parse_devices};
use std::sync::Arc;

fn backend(spec: &str) -> Arc<dyn Backend> {
    parse_devices(spec).unwrap()[0].init_backend().unwrap()
}

fn f32_in(g: &mut Graph, name: &str, ne: [usize; 4]) -> TensorId {
    g.input(name, DType::F32, ne).unwrap()
}

fn rope_params(n_dims: usize) -> RopeParams {
    RopeParams {
        mode: RopeMode::Normal,
        n_dims,
        freq_base: 10000.0,
        freq_scale: 1.0,
    }
}

/// `op(a, b)` must fail with a shape mismatch naming `op` and both shapes.
fn expect_shape_error(
    op: &str,
    a: [usize; 4],
    b: [usize; 4],
    f: impl FnOnce(&mut Graph, TensorId, TensorId) -> metashard::Result<TensorId>,
) {
    let mut g = Graph::new();
    let ta = f32_in(&mut g, "a", a);
    let tb = f32_in(&mut g, "b", b);
    let e = f(&mut g, ta, tb).expect_err(op);
    let msg = e.to_string();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{op}: {e:?}");
    for want in [op.to_string(), Shape(a).to_string(), Shape(b).to_string()] {
        assert!(msg.contains(&want), "{op}: `{msg}` does not name {want}");
    }
}

#[test]
fn mismatched_shapes_name_the_op_and_both_shapes() {
    expect_shape_error("mul_mat", [4, 3, 1, 1], [5, 2, 1, 1], |g, a, b| {
        g.mul_mat(a, b)
    });
    expect_shape_error("mul_mat", [4, 3, 2, 1], [4, 2, 3, 1], |g, a, b| {
        g.mul_mat(a, b)
    });
    expect_shape_error("mul_mat", [4, 3, 1, 2], [4, 2, 1, 3], |g, a, b| {
        g.mul_mat(a, b)
    });
    for (op, f) in [
        ("add", Graph::add as fn(&mut Graph, TensorId, TensorId) -> _),
        ("sub", Graph::sub),
        ("mul", Graph::mul),
        ("div", Graph::div),
    ] {
        expect_shape_error(op, [4, 3, 1, 1], [3, 3, 1, 1], f);
        expect_shape_error(op, [4, 3, 2, 1], [4, 3, 4, 1], f);
        expect_shape_error(op, [4, 0, 1, 1], [4, 1, 1, 1], |g, a, b| f(g, b, a));
    }
    expect_shape_error("swiglu", [4, 3, 1, 1], [4, 2, 1, 1], |g, a, b| {
        g.swiglu(a, b)
    });
    // soft_max: mask row length, too few mask rows, mask dims 2/3 not dividing the input's.
    for m in [[5, 3, 1, 1], [4, 2, 1, 1], [4, 3, 2, 1], [4, 3, 1, 2]] {
        expect_shape_error("soft_max", [4, 3, 3, 3], m, |g, a, b| {
            g.soft_max(a, Some(b), 1.0)
        });
    }
    expect_shape_error("cpy", [4, 3, 1, 1], [5, 2, 1, 1], |g, a, b| g.cpy(a, b));
    expect_shape_error("concat", [4, 3, 1, 1], [4, 2, 2, 1], |g, a, b| {
        g.concat(a, b, 1)
    });
    expect_shape_error("set_rows", [4, 10, 1, 1], [5, 2, 1, 1], |g, a, b| {
        let ids = g.input("ids", DType::I32, [2, 1, 1, 1])?;
        g.set_rows(a, b, ids)
    });
    expect_shape_error("reshape", [4, 3, 1, 1], [5, 1, 1, 1], |g, a, b| {
        let ne = g.layout(b).ne;
        g.reshape(a, ne)
    });
    // Flash attention: q/k head size, k/v lengths, head groups, mask shape.
    expect_shape_error("flash_attn", [8, 2, 4, 1], [6, 5, 2, 1], |g, q, k| {
        let v = g.input("v", DType::F32, [8, 5, 2, 1])?;
        g.flash_attn(q, k, v, None, 1.0)
    });
    expect_shape_error("flash_attn", [8, 5, 2, 1], [8, 6, 2, 1], |g, k, v| {
        let q = g.input("q", DType::F32, [8, 2, 4, 1])?;
        g.flash_attn(q, k, v, None, 1.0)
    });
    expect_shape_error("flash_attn", [8, 2, 3, 1], [8, 5, 2, 1], |g, q, k| {
        let v = g.input("v", DType::F32, [8, 5, 2, 1])?;
        g.flash_attn(q, k, v, None, 1.0)
    });
    expect_shape_error("flash_attn", [8, 2, 4, 1], [5, 1, 1, 1], |g, q, m| {
        let k = g.input("k", DType::F32, [8, 5, 2, 1])?;
        let v = g.input("v", DType::F32, [8, 5, 2, 1])?;
        g.flash_attn(q, k, v, Some(m), 1.0)
    });

    // Builders whose second operand is I32: build it by hand.
    let mut g = Graph::new();
    let x = f32_in(&mut g, "x", [64, 3, 5, 1]);
    let pos = g.input("pos", DType::I32, [4, 1, 1, 1]).unwrap();
    let e = g.rope(x, pos, rope_params(64)).unwrap_err().to_string();
    assert!(
        e.contains("rope") && e.contains("[64, 3, 5, 1]") && e.contains("[4, 1, 1, 1]"),
        "{e}"
    );
    let table = f32_in(&mut g, "table", [8, 10, 2, 1]);
    let ids = g.input("ids", DType::I32, [3, 1, 1, 1]).unwrap();
    let e = g.get_rows(table, ids).unwrap_err().to_string();
    assert!(
        e.contains("get_rows") && e.contains("[8, 10, 2, 1]") && e.contains("[3, 1, 1, 1]"),
        "{e}"
    );
}

/// Builders reject dtypes and parameters their op does not take, naming the op and the operand.
#[test]
fn bad_dtypes_and_parameters_are_builder_errors() {
    let mut g = Graph::new();
    let x = f32_in(&mut g, "x", [64, 3, 5, 1]);
    let xb = g.input("x_bf16", DType::BF16, [64, 3, 5, 1]).unwrap();
    let xh = g.input("x_f16", DType::F16, [64, 3, 1, 1]).unwrap();
    let pos = g.input("pos", DType::I32, [5, 1, 1, 1]).unwrap();
    let q8 = g.input("w_q8", DType::Q8_0, [64, 4, 1, 1]).unwrap();
    let i32s = g.input("ids", DType::I32, [64, 3, 1, 1]).unwrap();
    let odd = f32_in(&mut g, "odd", [3, 2, 1, 1]);
    let n = g.len();
    let cases: Vec<(&str, &str, metashard::Result<TensorId>)> = vec![
        ("rope", "x_bf16", g.rope(xb, pos, rope_params(64))),
        ("rope", "x", g.rope(x, x, rope_params(64))),
        ("rope", "n_dims 7", g.rope(x, pos, rope_params(7))),
        ("rope", "n_dims 66", g.rope(x, pos, rope_params(66))),
        (
            "rope",
            "freq_base -1",
            g.rope(
                x,
                pos,
                RopeParams {
                    freq_base: -1.0,
                    ..rope_params(64)
                },
            ),
        ),
        ("mul_mat", "x_f16", g.mul_mat(q8, xh)),
        ("mul_mat", "ids", g.mul_mat(i32s, x)),
        ("add", "ids", g.add(x, i32s)),
        ("relu", "w_q8", g.relu(q8)),
        ("clamp", "min 1 must not exceed max 0", g.clamp(x, 1.0, 0.0)),
        ("swiglu", "even", g.swiglu_fused(odd)),
        ("argmax", "x_f16", g.argmax(xh)),
        ("argmax", "2-D", g.argmax(x)),
        ("get_rows", "x_f16", g.get_rows(x, xh)),
        ("set_rows", "w_q8", g.set_rows(q8, x, pos)),
        ("concat", "dim 4", g.concat(x, x, 4)),
        ("concat", "x_f16", g.concat(x, xh, 0)),
        ("permute", "not a permutation", g.permute(x, [0, 0, 1, 2])),
        ("cont", "cannot convert f16", g.cast(xh, DType::Q4_0)),
        ("cont", "cannot convert i32", g.cast(i32s, DType::F32)),
        ("soft_max", "pos", g.soft_max(x, Some(pos), 1.0)),
    ];
    for (op, what, r) in cases {
        let e = r.expect_err(op).to_string();
        assert!(
            e.starts_with(op) && e.contains(what),
            "{op}: `{e}` should name {what}"
        );
    }
    // Partial quantization blocks, in a leaf and in a view.
    let e = g
        .input("w_q4", DType::Q4_0, [48, 2, 1, 1])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("w_q4") && e.contains("48") && e.contains("block size 32"),
        "{e}"
    );
    let e = g
        .view(q8, [16, 4, 1, 1], [34, 68, 272, 272], 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("view") && e.contains("16"), "{e}");
    // A reshape of a non-contiguous view.
    let t = g.transpose(x).unwrap();
    let n2 = g.len();
    let e = g.reshape(t, [192, 5, 1, 1]).unwrap_err().to_string();
    assert!(e.contains("reshape") && e.contains("not contiguous"), "{e}");
    assert_eq!(
        (n, n2),
        (g.len() - 1, g.len()),
        "failed builders added nodes"
    );
}

/// Views must stay inside their root, whatever the arithmetic.
#[test]
fn views_outside_their_root_are_errors() {
    let mut g = Graph::new();
    let x = f32_in(&mut g, "cache", [8, 4, 1, 1]);
    let cases = [
        // One row too many.
        ([8, 5, 1, 1], [4, 32, 160, 160], 0),
        // In bounds by size, out by offset.
        ([8, 4, 1, 1], [4, 32, 128, 128], 4),
        // Offsets and strides that overflow the address arithmetic.
        ([8, 1, 1, 1], [4, 32, 32, 32], usize::MAX - 3),
        ([1, 2, 1, 1], [4, usize::MAX, 4, 4], 0),
        ([1, 1, 3, 1], [4, 4, usize::MAX / 2 + 1, 4], 0),
    ];
    for (ne, nb, off) in cases {
        let e = g.view(x, ne, nb, off).expect_err("out of bounds view");
        assert!(
            e.to_string().contains("view of `cache`"),
            "{ne:?} {nb:?} {off}: {e}"
        );
    }
    // The last column of the matrix: strided elements ending exactly at the root's end.
    g.view(x, [4, 1, 1, 1], [32, 128, 128, 128], 28)
        .expect("last column");
    // Element addresses must be whole elements: a 4-byte float at byte 2 is not one.
    let e = g
        .view_2d(x, 4, 2, 32, 2)
        .expect_err("misaligned view")
        .to_string();
    assert!(e.contains("view") && e.contains("cache"), "{e}");
    let e = g
        .view(x, [4, 2, 1, 1], [4, 6, 12, 12], 0)
        .expect_err("misaligned")
        .to_string();
    assert!(e.contains("view") && e.contains("cache"), "{e}");
}

/// Shapes whose byte size does not fit the address space are refused when declared, not
/// wrapped into a small allocation that kernels would then overrun.
#[test]
fn shapes_too_large_for_memory_are_errors() {
    let mut g = Graph::new();
    let e = g
        .input("huge", DType::F32, [1 << 62, 1, 1, 1])
        .unwrap_err()
        .to_string();
    assert!(e.contains("huge"), "{e}");
    let e = g
        .input("huge2", DType::F16, [1 << 32, 1 << 32, 1, 1])
        .unwrap_err()
        .to_string();
    assert!(e.contains("huge2"), "{e}");
    // A zero-element tensor with huge extents is fine; a product of two such is not.
    let a = f32_in(&mut g, "a", [0, 1 << 40, 1, 1]);
    let b = f32_in(&mut g, "b", [0, 1 << 40, 1, 1]);
    let e = g.mul_mat(a, b).unwrap_err().to_string();
    assert!(e.contains("mul_mat"), "{e}");
    // A reshape whose extents multiply to a wrapped-around element count.
    let z = f32_in(&mut g, "z", [0, 1, 1, 1]);
    let e = g
        .reshape(z, [1 << 32, 1 << 32, 1, 1])
        .unwrap_err()
        .to_string();
    assert!(e.contains("reshape"), "{e}");
}

/// Ids from another graph are errors in the methods that return `Result`.
#[test]
fn foreign_tensor_ids_are_errors() {
    let mut g = Graph::new();
    let _x = f32_in(&mut g, "x", [4, 1, 1, 1]);
    let bad = TensorId(17);
    assert!(matches!(
        g.relu(bad),
        Err(Error::UnknownTensor { id: 17, len: 1 })
    ));
    assert!(matches!(g.read_f32(bad), Err(Error::UnknownTensor { .. })));
    assert!(matches!(g.read_i32(bad), Err(Error::UnknownTensor { .. })));
    assert!(matches!(
        g.set_f32(bad, &[1.0]),
        Err(Error::UnknownTensor { .. })
    ));
    assert!(matches!(
        g.set_data(bad, vec![0u8; 4]),
        Err(Error::UnknownTensor { .. })
    ));
    let buf = CpuBufferType.alloc_buffer(64).unwrap();
    assert!(matches!(
        g.bind(bad, Storage::new(buf, 0)),
        Err(Error::UnknownTensor { .. })
    ));
}

/// Binding storage and inline data: a view, a misaligned offset, a computed node and a tensor
/// too large to address are typed errors naming the tensor and what was expected.
#[test]
fn binding_and_data_errors_name_the_tensor() {
    let mut g = Graph::new();
    let w = g
        .weight("blk.0.attn_q.weight", DType::F32, [8, 4, 1, 1])
        .unwrap();
    let t = g.transpose(w).unwrap();
    g.set_name(t, "wt");
    let buf = CpuBufferType.alloc_buffer(256).unwrap();
    match g.bind(t, Storage::new(buf.clone(), 0)).unwrap_err() {
        Error::BindToView { tensor, root } => {
            assert_eq!(
                (tensor.as_str(), root.as_str()),
                ("wt", "blk.0.attn_q.weight")
            )
        }
        other => panic!("{other:?}"),
    }
    match g.bind(w, Storage::new(buf.clone(), 6)).unwrap_err() {
        Error::MisalignedBinding {
            tensor,
            offset,
            dtype,
            align,
        } => assert_eq!(
            (tensor.as_str(), offset, dtype, align),
            ("blk.0.attn_q.weight", 6, "f32", 4)
        ),
        other => panic!("{other:?}"),
    }
    let r = g.relu(w).unwrap();
    g.set_name(r, "act");
    let e = g.set_data(r, vec![0u8; 128]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::NotALeaf {
                action: "set_data",
                op: "relu",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("`act`"), "{e}");
    match g
        .input("huge", DType::F16, [1 << 32, 1 << 32, 1, 1])
        .unwrap_err()
    {
        Error::TensorTooLarge {
            tensor,
            shape,
            dtype,
        } => assert_eq!(
            (tensor.as_str(), shape, dtype),
            ("huge", Shape([1 << 32, 1 << 32, 1, 1]), "f16")
        ),
        other => panic!("{other:?}"),
    }
    match g.input("w_q4", DType::Q4_0, [48, 2, 1, 1]).unwrap_err() {
        Error::PartialBlock {
            what,
            ne0,
            dtype,
            block,
        } => assert_eq!((what.as_str(), ne0, dtype, block), ("w_q4", 48, "q4_0", 32)),
        other => panic!("{other:?}"),
    }
}

/// An op the kernels refuse is an `UnsupportedOp` naming the op and the node, and no node
/// ran: an earlier node's bound output keeps its poison and no input was allocated.
#[test]
fn unsupported_layouts_fail_before_anything_runs() {
    let be = backend("cpu:1x2");
    let mut g = Graph::new();
    let x = g.input_f32("x", [64, 3, 1, 1], &[0.5; 192]).unwrap();
    let y = g.relu(x).unwrap();
    g.set_output(y);
    let ybuf = CpuBufferType.alloc_buffer(768).unwrap();
    ybuf.clear(0xFF);
    g.bind(y, Storage::new(ybuf.clone(), 0)).unwrap();
    // A q8_0 matrix seen with every other block skipped: rows are not packed.
    let w = g.weight("w", DType::Q8_0, [128, 2, 1, 1]).unwrap();
    let (wbuf, _) = alloc_tensors(&CpuBufferType, &[*g.layout(w)]).unwrap();
    g.bind(w, Storage::new(wbuf, 0)).unwrap();
    let wv = g.view(w, [64, 2, 1, 1], [68, 136, 272, 272], 0).unwrap();
    let mm = g.mul_mat(wv, x).unwrap();
    g.set_name(mm, "attn_out");
    g.set_output(mm);
    let detail = be
        .device()
        .supports_op(&g, mm)
        .expect_err("strided q8_0 rows");
    let e = be.graph_compute(&mut g).expect_err("unsupported");
    let msg = e.to_string();
    assert!(matches!(e, Error::UnsupportedOp { .. }), "{e:?}");
    assert!(
        msg.contains("mul_mat") && msg.contains("attn_out") && msg.contains(&detail),
        "{msg}"
    );
    let mut out = vec![0u8; 768];
    Storage::new(ybuf, 0).get(g.layout(y), &mut out).unwrap();
    assert!(out.iter().all(|&b| b == 0xFF), "relu ran before the error");
    assert!(
        g.node(x).storage.is_none(),
        "inputs were allocated before the error"
    );
}

#[test]
fn buffers_too_small_and_writes_past_the_end_are_errors() {
    let mut g = Graph::new();
    let w = g
        .weight("blk.0.ffn_up.weight", DType::F32, [16, 4, 1, 1])
        .unwrap();
    let buf = CpuBufferType.alloc_buffer(100).unwrap();
    for off in [0, 64, usize::MAX - 15] {
        let e = g.bind(w, Storage::new(buf.clone(), off)).unwrap_err();
        assert!(matches!(e, Error::BufferTooSmall { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("blk.0.ffn_up.weight") && msg.contains("too small"),
            "{msg}"
        );
    }
    // Misaligned binding: f32 kernels read whole aligned floats.
    let big = CpuBufferType.alloc_buffer(512).unwrap();
    let e = g
        .bind(w, Storage::new(big.clone(), 2))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.0.ffn_up.weight") && e.contains("align"),
        "{e}"
    );
    g.bind(w, Storage::new(big.clone(), 64)).unwrap();
    let st = g.storage(w).unwrap();
    let l = *g.layout(w);
    // Past the tensor's span (the buffer would have room), and past the buffer.
    assert!(matches!(
        st.set(&l, &[0u8; 260]),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(big.set_tensor(&l, 64, &[0u8; 8], 252).is_err());
    assert!(big.set_tensor(&l, 400, &[0u8; 4], 0).is_err());
    let mut out = [0u8; 8];
    assert!(big.get_tensor(&l, 64, &mut out, 250).is_err());
    assert!(big.memset_tensor(&l, 64, 0, 200, 100).is_err());
    // Inline data of the wrong length names the leaf.
    let x = g.input("tokens", DType::I32, [5, 1, 1, 1]).unwrap();
    let e = g.set_i32(x, &[1, 2, 3]).unwrap_err().to_string();
    assert!(
        e.contains("tokens") && e.contains("20") && e.contains("12"),
        "{e}"
    );
    let e = g.set_f32(x, &[1.0; 5]).unwrap_err().to_string();
    assert!(e.contains("tokens") && e.contains("i32"), "{e}");
}

#[test]
fn impossible_allocations_are_errors_not_aborts() {
    for size in [usize::MAX, usize::MAX / 2, isize::MAX as usize, 1 << 60] {
        let e = CpuBufferType.alloc_buffer(size).err().expect("must fail");
        assert!(matches!(e, Error::AllocFailed { .. }), "{e:?}");
        assert!(e.to_string().contains("CPU"), "{e}");
    }
    let l = Layout::contiguous(DType::F32, [1 << 60, 1, 1, 1]);
    assert!(alloc_tensors(&CpuBufferType, &[l, l, l, l, l]).is_err());
    // A compute buffer that cannot be had: a broadcast view (stride 0) made packed needs
    // 2^52 bytes, more than the address space.
    let be = backend("cpu:1x1");
    let mut g = Graph::new();
    let x = g.input_f32("x", [4, 1, 1, 1], &[1.0; 4]).unwrap();
    let v = g.view(x, [4, 1 << 48, 1, 1], [4, 0, 0, 0], 0).unwrap();
    let c = g.cont(v).unwrap();
    g.set_output(c);
    let e = be.graph_compute(&mut g).expect_err("4 PiB");
    assert!(matches!(e, Error::AllocFailed { .. }), "{e:?}");
    assert_small_graph_runs(be.as_ref());
}

#[test]
fn a_leaf_without_storage_or_data_is_named() {
    let be = backend("cpu:1x2");
    let mut g = Graph::new();
    let w = g
        .weight("blk.3.attn_k.weight", DType::Q4_0, [64, 8, 1, 1])
        .unwrap();
    let x = g.input_f32("x", [64, 2, 1, 1], &[0.25; 128]).unwrap();
    let y = g.mul_mat(w, x).unwrap();
    g.set_output(y);
    let e = be.graph_compute(&mut g).expect_err("no storage");
    assert!(matches!(e, Error::NoStorage { .. }), "{e:?}");
    assert!(e.to_string().contains("blk.3.attn_k.weight"), "{e}");
    assert_small_graph_runs(be.as_ref());
}

/// A small graph computes the right values (the backend is usable).
fn assert_small_graph_runs(be: &dyn Backend) {
    let mut g = Graph::new();
    let t = g
        .input_f32(
            "t",
            [3, 4, 1, 1],
            &(0..12).map(|i| i as f32).collect::<Vec<_>>(),
        )
        .unwrap();
    let ids = g.input_i32("ids", [2, 1, 1, 1], &[3, 1]).unwrap();
    let r = g.get_rows(t, ids).unwrap();
    let s = g.scale(r, 2.0).unwrap();
    g.set_output(s);
    be.graph_compute(&mut g).unwrap();
    assert_eq!(g.read_f32(s).unwrap(), vec![18., 20., 22., 6., 8., 10.]);
}

/// The error of a graph whose node `node` (op `op`) reads the row id `id` at `index` of its ids,
/// outside `0..rows`.
#[track_caller]
fn assert_row_id_error(
    spec: &str,
    e: &Error,
    node: &str,
    op: &str,
    id: i64,
    index: [usize; 3],
    rows: usize,
) {
    match e {
        Error::RowIdOutOfRange {
            node: n,
            op: o,
            id: i,
            index: at,
            rows: r,
            ..
        } => assert_eq!(
            (n.as_str(), *o, *i, *at, *r),
            (node, op, id, index, rows),
            "{spec}: {e}"
        ),
        other => panic!("{spec}: expected RowIdOutOfRange, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("`{node}`"))
            && msg.contains(&format!("row id {id} is outside 0..{rows}"))
            && !msg.contains("panicked"),
        "{spec}: {msg}"
    );
}

/// A kernel that meets an out-of-range id returns an error from its node; `graph_compute`
/// returns it naming the node, the id and the range, on any thread count, and the backend
/// recovers.
#[test]
fn out_of_range_ids_are_node_errors_and_the_backend_recovers() {
    for spec in ["cpu:1x1", "cpu:1x2", "cpu:1x3"] {
        let be = backend(spec);
        for bad in [10, -1, i32::MAX] {
            let mut g = Graph::new();
            let table = g.input_f32("table", [4, 10, 1, 1], &[1.0; 40]).unwrap();
            let ids = g
                .input_i32("ids", [5, 1, 1, 1], &[0, 9, bad, 2, 3])
                .unwrap();
            let r = g.get_rows(table, ids).unwrap();
            g.set_name(r, "tok_embd_lookup");
            let s = g.scale(r, 2.0).unwrap();
            g.set_output(s);
            let e = be.graph_compute(&mut g).expect_err("bad id");
            assert_row_id_error(
                spec,
                &e,
                "tok_embd_lookup",
                "get_rows",
                bad as i64,
                [2, 0, 0],
                10,
            );
            assert_small_graph_runs(be.as_ref());
        }
        // set_rows into a cache, one id past its end.
        let mut g = Graph::new();
        let cache = g.input_f32("k_cache", [4, 6, 1, 1], &[0.0; 24]).unwrap();
        let rows = g.input_f32("k_new", [4, 2, 1, 1], &[1.0; 8]).unwrap();
        let ids = g.input_i32("slots", [2, 1, 1, 1], &[5, 6]).unwrap();
        let w = g.set_rows(cache, rows, ids).unwrap();
        g.set_name(w, "k_cache_write");
        g.set_output(w);
        let e = be.graph_compute(&mut g).expect_err("bad slot");
        assert_row_id_error(spec, &e, "k_cache_write", "set_rows", 6, [1, 0, 0], 6);
        assert_small_graph_runs(be.as_ref());
    }
}

/// A device list that would start an absurd number of threads is refused before any starts
/// (`cpu:16x1024` used to spawn 16384 threads and abort on a stack guard after 25 s), and the
/// error says how to raise the limit.
#[test]
fn absurd_thread_totals_are_refused_before_any_thread_starts() {
    if std::env::var_os(metashard::cpu::MAX_THREADS_ENV).is_some() {
        eprintln!(
            "NOTE: {} is set: the default limit is not tested",
            metashard::cpu::MAX_THREADS_ENV
        );
        return;
    }
    let limit = metashard::cpu::default_max_threads();
    assert!(limit >= 64);
    let t = std::time::Instant::now();
    for (spec, total) in [
        ("cpu:16x1024".to_string(), (16 * 1024).to_string()),
        (format!("cpu:1x{}", limit + 1), (limit + 1).to_string()),
        (
            format!("cpu:2x{}", usize::MAX),
            "more than usize::MAX".to_string(),
        ),
    ] {
        let e = parse_devices(&spec)
            .err()
            .unwrap_or_else(|| panic!("{spec} must fail"));
        let msg = e.to_string();
        assert!(matches!(e, Error::Device { .. }), "{spec}: {e:?}");
        for want in [
            spec.as_str(),
            &format!("{total} threads"),
            &format!("limit of {limit}"),
            metashard::cpu::MAX_THREADS_ENV,
        ] {
            assert!(msg.contains(want), "{spec}: `{msg}` lacks {want:?}");
        }
    }
    assert!(t.elapsed().as_secs() < 2, "took {:?}", t.elapsed());
    // At the limit, the devices are made (threads start only with a backend).
    assert_eq!(parse_devices(&format!("cpu:1x{limit}")).unwrap().len(), 1);
    assert_eq!(parse_devices("cpu:16x4").unwrap().len(), 16);
    // A pool starts its threads and reports them.
    let pool = metashard::cpu::ThreadPool::new(3, "t").unwrap();
    assert_eq!(pool.nth(), 3);
}

/// Split axes are checked, never wrapped (`axis(256, ..)` used to become axis 0), and extents
/// are summed with checked arithmetic (`[usize::MAX, 97]` used to wrap and pass validation).
#[test]
fn split_state_axes_are_checked_and_extent_sums_cannot_wrap() {
    use metashard::split_state::SplitState;
    let l = Layout::contiguous(DType::F32, [8, 96, 1, 1]);
    for axis in [4, 255, 256, usize::MAX] {
        let s = SplitState::axis(axis, &[4, 4]);
        assert_ne!(s.split_dim(), Some(0), "axis {axis} wrapped to 0");
        let e = s.validate("w", &l, 2).unwrap_err().to_string();
        assert!(
            e.contains("`w`") && e.contains("not in 0..=3"),
            "{axis}: {e}"
        );
        let e = SplitState::try_axis(axis, &[4, 4]).unwrap_err().to_string();
        assert!(e.contains(&format!("split axis {axis}")), "{axis}: {e}");
        assert!(SplitState::axis(0, &[4, 4]).rescaled(axis, 1, 1).is_none());
    }
    let wraps = [usize::MAX, 97];
    let e = SplitState::axis(1, &wraps)
        .validate("w", &l, 2)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`w`") && e.contains("sum past usize::MAX"),
        "{e}"
    );
    let e = SplitState::try_axis(1, &wraps).unwrap_err().to_string();
    assert!(e.contains("sum past usize::MAX"), "{e}");
    let e = SplitState::segmented(1, &[vec![usize::MAX, 1], vec![0, 96]])
        .validate("w", &l, 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("sum past usize::MAX"), "{e}");
    let e = SplitState::try_segmented(1, &[vec![48, 48], vec![0]])
        .unwrap_err()
        .to_string();
    assert!(e.contains("segment 1 has 1 extents"), "{e}");
    assert!(
        SplitState::axis(1, &[usize::MAX, 0])
            .rescaled(1, 2, 1)
            .is_none()
    );
    // Valid states still are.
    let s = SplitState::try_axis(1, &[40, 56]).unwrap();
    s.validate("w", &l, 2).unwrap();
    assert_eq!(s, SplitState::axis(1, &[40, 56]));
}

/// Sampling settings out of range are refused by the library, naming the setting
/// (`--temp NaN` used to generate garbage; `inf`, top-p 0, 2 or NaN and top-k 0 were taken).
#[test]
fn sampling_settings_out_of_range_are_refused() {
    use metashard::models::sampler::{Sampler, SamplerConfig};
    let d = SamplerConfig::default();
    let cases = [
        (
            SamplerConfig {
                temperature: f32::NAN,
                ..d
            },
            "temperature",
            "NaN",
        ),
        (
            SamplerConfig {
                temperature: f32::INFINITY,
                ..d
            },
            "temperature",
            "inf",
        ),
        (
            SamplerConfig {
                temperature: -1.0,
                ..d
            },
            "temperature",
            "-1",
        ),
        (SamplerConfig { top_k: 0, ..d }, "top_k", "0"),
        (SamplerConfig { top_p: 0.0, ..d }, "top_p", "0"),
        (SamplerConfig { top_p: 2.0, ..d }, "top_p", "2"),
        (
            SamplerConfig {
                top_p: f32::NAN,
                ..d
            },
            "top_p",
            "NaN",
        ),
        (
            SamplerConfig {
                presence_penalty: 2.5,
                ..d
            },
            "presence_penalty",
            "2.5",
        ),
        (
            SamplerConfig {
                frequency_penalty: f32::NAN,
                ..d
            },
            "frequency_penalty",
            "NaN",
        ),
    ];
    for (cfg, name, value) in cases {
        let e = Sampler::new(cfg)
            .err()
            .unwrap_or_else(|| panic!("{cfg:?} must fail"));
        match &e {
            Error::InvalidArgument {
                name: n, value: v, ..
            } => {
                assert_eq!((n.as_str(), v.as_str()), (name, value), "{e}");
            }
            other => panic!("{cfg:?}: {other:?}"),
        }
    }
    // Edges that are fine: greedy, top-p 1, top-k 1, a huge finite temperature.
    for cfg in [
        d,
        SamplerConfig {
            top_p: 1.0,
            top_k: 1,
            ..d
        },
        SamplerConfig {
            temperature: 1e30,
            ..d
        },
    ] {
        let mut s = Sampler::new(cfg).unwrap();
        let t = s.sample(&[0.0, 3.0, 1.0]);
        assert!(t < 3, "{t}");
    }
}

/// A failing node in the middle of a longer graph: threads that met no bad id and threads
/// that did stop together (no hang), the first failing node is the one named, and the same
/// backend then computes the graph with good ids exactly.
#[test]
fn a_node_error_mid_graph_stops_every_thread_and_the_next_graph_is_right() {
    // table [8, 6]: row r is r, r+1, ..., r+7; w is the identity scaled by 2.
    let table: Vec<f32> = (0..6)
        .flat_map(|r| (0..8).map(move |c| (r + c) as f32))
        .collect();
    let w: Vec<f32> = (0..64)
        .map(|i| if i % 9 == 0 { 2.0 } else { 0.0 })
        .collect();
    let build = |ids: &[i32], slots: &[i32]| {
        let mut g = Graph::new();
        let t = g.input_f32("tok_embd", [8, 6, 1, 1], &table).unwrap();
        let w = g.input_f32("w", [8, 8, 1, 1], &w).unwrap();
        let cache = g.input_f32("cache", [8, 4, 1, 1], &[0.0; 32]).unwrap();
        let ids = g.input_i32("tokens", [6, 1, 1, 1], ids).unwrap();
        let slots = g.input_i32("slots", [2, 1, 1, 1], slots).unwrap();
        let e = g.get_rows(t, ids).unwrap();
        g.set_name(e, "embd");
        let y = g.mul_mat(w, e).unwrap();
        let n = g.rms_norm(y, 1e-6).unwrap();
        let y2 = g.scale(y, 0.5).unwrap();
        let first = g.view_2d(y2, 8, 2, 8 * 4, 0).unwrap();
        let first = g.cont(first).unwrap();
        let kv = g.set_rows(cache, first, slots).unwrap();
        g.set_name(kv, "cache_write");
        let out = g.add(n, n).unwrap();
        g.set_output(out);
        g.set_output(kv);
        (g, y2, kv)
    };
    for spec in ["cpu:1x1", "cpu:1x2", "cpu:1x3", "cpu:1x4"] {
        let be = backend(spec);
        for _ in 0..20 {
            // A bad token (only the thread holding row 4 of the lookup meets it), then a bad
            // slot further on: the lookup is the node named.
            let (mut g, _, _) = build(&[0, 1, 2, 3, 60, 5], &[0, 9]);
            let e = be.graph_compute(&mut g).expect_err("bad token");
            assert_row_id_error(spec, &e, "embd", "get_rows", 60, [4, 0, 0], 6);
            // Good tokens, bad slot.
            let (mut g, _, _) = build(&[0, 1, 2, 3, 4, 5], &[0, 4]);
            let e = be.graph_compute(&mut g).expect_err("bad slot");
            assert_row_id_error(spec, &e, "cache_write", "set_rows", 4, [1, 0, 0], 4);
            // All good: y2 = rows 0..6 of the table; the cache holds rows 0 and 1 at slots 3, 1.
            let (mut g, y2, kv) = build(&[0, 1, 2, 3, 4, 5], &[3, 1]);
            be.graph_compute(&mut g).unwrap();
            assert_eq!(g.read_f32(y2).unwrap(), table);
            let mut want = vec![0.0; 32];
            want[24..32].copy_from_slice(&table[0..8]);
            want[8..16].copy_from_slice(&table[8..16]);
            assert_eq!(g.read_f32(kv).unwrap(), want, "{spec}");
        }
    }
}
