//! The test builds' fake quantized type (`DType::FakeQ4x16`: blocks of 16 in 10 bytes, a row
//! of the type table with reference conversions and no kernels) on the CPU backend: every op
//! that would need a kernel for it is refused with an error naming the type and the op, no
//! other type's kernel runs on its bytes, and the ops that move rows through f32 (get_rows,
//! cpy) use its own row of the table.

use crate::backend::Backend;
use crate::cpu::backend::{CpuBackend, supports_node};
use crate::cpu::device::{CpuDevice, CpuOptions};
use crate::cpu::matmul::kernels_for;
use crate::cpu::view::Precision;
use crate::dtype::{bytes_to_f32, f32_to_bytes};
use crate::{DType, Error, Graph};

const FAKE: DType = DType::FakeQ4x16;

fn backend() -> CpuBackend {
    CpuBackend::new(CpuDevice::new(0, 1, 2, CpuOptions::exact())).unwrap()
}

fn values(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 3.0)
        .collect()
}

/// A graph with a `FAKE` input of shape `ne` holding quantized `values`.
fn fake_input(g: &mut Graph, ne: [usize; 4]) -> crate::TensorId {
    let w = g.input("w", FAKE, ne).unwrap();
    let bytes = f32_to_bytes(FAKE, &values(ne.iter().product())).unwrap();
    g.set_data(w, bytes).unwrap();
    w
}

#[test]
fn every_dtype_maps_to_its_own_matmul_kernels_or_none() {
    for d in DType::ALL {
        if let Some(w) = kernels_for(d) {
            assert_eq!(w.dtype(), d, "{d} would run {:?}", w);
        }
    }
    assert_eq!(kernels_for(FAKE), None);
}

#[test]
fn mul_mat_on_a_type_without_kernels_is_refused_naming_it_and_the_op() {
    // K = 64 is whole blocks of 16 (and of 32): only the missing kernels stop the product.
    for precision in [Precision::Exact, Precision::Q8] {
        let mut g = Graph::new();
        let w = fake_input(&mut g, [64, 4, 1, 1]);
        let x = g.input_f32("x", [64, 3, 1, 1], &values(192)).unwrap();
        let y = g.mul_mat(w, x).unwrap();
        let why = supports_node(&g, y).unwrap_err();
        assert!(why.contains("fake_q4x16"), "{why}");
        let options = CpuOptions::with_precision(precision);
        let b = CpuBackend::new(CpuDevice::new(0, 1, 2, options)).unwrap();
        let e = b.graph_compute(&mut g).unwrap_err();
        assert!(
            matches!(&e, Error::UnsupportedOp { op, .. } if op.as_str() == "mul_mat"),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains("mul_mat") && text.contains("fake_q4x16"),
            "{text}"
        );
    }
}

#[test]
fn float_ops_on_it_are_refused_naming_it() {
    // The graph builder refuses them first, naming the op and the type.
    let mut g = Graph::new();
    let w = fake_input(&mut g, [32, 2, 1, 1]);
    for (op, e) in [("scale", g.scale(w, 2.0)), ("argmax", g.argmax(w))] {
        let text = e.unwrap_err().to_string();
        assert!(text.contains(op) && text.contains("fake_q4x16"), "{text}");
    }
}

#[test]
fn rows_and_copies_go_through_its_own_row_of_the_table() {
    let mut g = Graph::new();
    let table = fake_input(&mut g, [48, 5, 1, 1]);
    let ids = g.input_i32("ids", [3, 1, 1, 1], &[4, 0, 2]).unwrap();
    let rows = g.get_rows(table, ids).unwrap();
    let back = g.cast(rows, FAKE).unwrap();
    let again = g.cast(back, DType::F32).unwrap();
    g.set_output(rows);
    g.set_output(again);
    backend().graph_compute(&mut g).unwrap();
    // The reference dequantization of the table's bytes, row by row.
    let bytes = f32_to_bytes(FAKE, &values(48 * 5)).unwrap();
    let table = bytes_to_f32(FAKE, &bytes, 48 * 5).unwrap();
    let want: Vec<f32> = [4, 0, 2]
        .iter()
        .flat_map(|&r| table[r * 48..(r + 1) * 48].to_vec())
        .collect();
    assert_eq!(g.read_f32(rows).unwrap(), want);
    // Quantizing dequantized values again gives them back (the same scale per block).
    assert_eq!(g.read_f32(again).unwrap(), want);
}
