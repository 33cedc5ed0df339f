//! End-to-end smoke test of the graph API on the CPU backend.
use metashard::{DType, Graph, parse_devices};

#[test]
fn small_mlp_matches_hand_computation() {
    let dev = &parse_devices("cpu:1x2").unwrap()[0];
    let be = dev.init_backend().unwrap();
    let mut g = Graph::new();
    // x [K=3, M=2], W [K=3, N=2]
    let x = g
        .input_f32("x", [3, 2, 1, 1], &[1., 2., 3., 4., 5., 6.])
        .unwrap();
    let w = g
        .input_f32("w", [3, 2, 1, 1], &[1., 0., -1., 0.5, 0.5, 0.5])
        .unwrap();
    let y = g.mul_mat(w, x).unwrap(); // [2, 2]
    let b = g.input_f32("b", [2, 1, 1, 1], &[10., 20.]).unwrap();
    let z = g.add(y, b).unwrap();
    let z = g.relu(z).unwrap();
    let s = g.sum_rows(z).unwrap();
    g.set_output(z);
    g.set_output(s);
    be.graph_compute(&mut g).unwrap();
    let zv = g.read_f32(z).unwrap();
    // row m=0: x=[1,2,3]: w0·x = 1-3 = -2 -> +10 = 8 ; w1·x = 3 -> 23
    // row m=1: x=[4,5,6]: w0·x = -2 -> 8 ; w1·x = 7.5 -> 27.5
    assert_eq!(zv, vec![8., 23., 8., 27.5]);
    assert_eq!(g.read_f32(s).unwrap(), vec![31., 35.5]);
    let _ = DType::F32;
}
