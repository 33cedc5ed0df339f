//! The meta device end to end on a Megatron-split MLP: column-parallel W1, row-parallel W2
//! over 1..=3 CPU devices equals one device, weights read back through the meta buffer are the
//! originals, and the plan prints.

mod support;

use metashard::backend::alloc_tensors;
use metashard::meta::{MetaDevice, SplitFn, TensorInfo};
use metashard::split_state::{Granularity, SplitState, split_even};
use metashard::{Backend, DType, Device, Graph, Layout, Storage, parse_devices};
use std::sync::Arc;
use support::Rng;

/// `n` values uniform in [-0.5, 0.5), the same for the same seed.
fn rnd(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.uniform(-0.5, 0.5)).collect()
}

fn megatron() -> SplitFn {
    Arc::new(|t: &TensorInfo| {
        let n = t.n_devices;
        Ok(if t.name.starts_with("w1") {
            SplitState::axis(1, &split_even(t.layout.ne[1], n, Granularity(1), 0)?)
        } else if t.name.starts_with("w2") {
            SplitState::axis(0, &split_even(t.layout.ne[0], n, Granularity(1), 0)?)
        } else {
            SplitState::mirrored(n)
        })
    })
}

/// x -> W1 (column) -> silu -> W2 (row) -> + x, `layers` times.
fn mlp(
    g: &mut Graph,
    w: &[(metashard::TensorId, metashard::TensorId)],
    x: metashard::TensorId,
) -> metashard::TensorId {
    let mut h = x;
    for &(w1, w2) in w {
        let a = g.mul_mat(w1, h).unwrap();
        let a = g.silu(a).unwrap();
        let b = g.mul_mat(w2, a).unwrap();
        h = g.add(b, h).unwrap();
    }
    h
}

fn run(devs: &str, meta: bool, layers: usize, t: usize) -> Vec<f32> {
    let (d, f) = (64, 96);
    let devices = parse_devices(devs).unwrap();
    let (backend, bt): (Arc<dyn Backend>, _) = if meta {
        let m = MetaDevice::new(devices, megatron()).unwrap();
        (m.init_backend().unwrap(), m.buffer_type())
    } else {
        (devices[0].init_backend().unwrap(), devices[0].buffer_type())
    };
    let mut layouts = Vec::new();
    for _ in 0..layers {
        layouts.push(Layout::contiguous(DType::F32, [d, f, 1, 1]));
        layouts.push(Layout::contiguous(DType::F32, [f, d, 1, 1]));
    }
    let (buf, offs) = alloc_tensors(bt.as_ref(), &layouts).unwrap();
    let mut g = Graph::new();
    let mut w = Vec::new();
    for l in 0..layers {
        let w1 = g
            .weight(&format!("w1.{l}"), DType::F32, [d, f, 1, 1])
            .unwrap();
        let w2 = g
            .weight(&format!("w2.{l}"), DType::F32, [f, d, 1, 1])
            .unwrap();
        g.bind(w1, Storage::new(buf.clone(), offs[2 * l])).unwrap();
        g.bind(w2, Storage::new(buf.clone(), offs[2 * l + 1]))
            .unwrap();
        let s1 = g.storage(w1).unwrap();
        s1.set(
            g.layout(w1),
            metashard::dtype::as_bytes(&rnd(d * f, 10 + l as u64)),
        )
        .unwrap();
        let s2 = g.storage(w2).unwrap();
        s2.set(
            g.layout(w2),
            metashard::dtype::as_bytes(&rnd(d * f, 100 + l as u64)),
        )
        .unwrap();
        w.push((w1, w2));
    }
    let x = g.input_f32("x", [d, t, 1, 1], &rnd(d * t, 7)).unwrap();
    let y = mlp(&mut g, &w, x);
    g.set_output(y);
    backend.graph_compute(&mut g).unwrap();
    // Weights read back through the meta buffer are the originals.
    let w1 = g.read_f32(w[0].0).unwrap();
    assert_eq!(w1, rnd(d * f, 10));
    g.read_f32(y).unwrap()
}

#[test]
fn megatron_mlp_matches_single_device() {
    let want = run("cpu:1x1", false, 3, 5);
    for devs in ["cpu:1x1", "cpu:2x1", "cpu:3x1"] {
        let got = run(devs, true, 3, 5);
        let err: f32 = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err < 1e-4, "{devs}: max abs diff {err}");
    }
}

#[test]
fn print_plan() {
    let devices = parse_devices("cpu:2x1").unwrap();
    let m = MetaDevice::new(devices, megatron()).unwrap();
    let be = m.meta_backend().unwrap();
    let bt = m.buffer_type();
    let (d, f) = (64, 96);
    let layouts = vec![
        Layout::contiguous(DType::F32, [d, f, 1, 1]),
        Layout::contiguous(DType::F32, [f, d, 1, 1]),
    ];
    let (buf, offs) = alloc_tensors(bt.as_ref(), &layouts).unwrap();
    let mut g = Graph::new();
    let w1 = g.weight("w1.0", DType::F32, [d, f, 1, 1]).unwrap();
    let w2 = g.weight("w2.0", DType::F32, [f, d, 1, 1]).unwrap();
    g.bind(w1, Storage::new(buf.clone(), offs[0])).unwrap();
    g.bind(w2, Storage::new(buf.clone(), offs[1])).unwrap();
    let x = g.input_f32("x", [d, 3, 1, 1], &rnd(d * 3, 7)).unwrap();
    let y = mlp(&mut g, &[(w1, w2)], x);
    g.set_output(y);
    let p = be.sharding(&g).unwrap();
    println!("{}", p.describe(&g));
}
