//! Errors of the meta device, each naming what is at fault: invalid split states from the
//! callback (extents that do not add up, quantized axis-0 slices that are not whole blocks, a
//! wrong device count, segments that do not add up, partial non-float tensors), communication
//! refused in explicit mode (while a Megatron MLP, which only reduces partial sums, runs), a
//! destination state no rule admits, and a device failing in the middle of a program while its
//! peers wait in a collective: the compute returns the cause promptly (no hang) and the same
//! backend then runs a good graph.

mod support;

use metashard::backend::alloc_tensors;
use metashard::meta::{MetaBackend, MetaDevice, MetaOptions, TensorInfo};
use metashard::split_state::{Granularity, SplitState, split_even};
use metashard::{Backend, DType, Device, Error, Graph, Layout, Storage, TensorId, parse_devices};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use support::compare::{max_diff, scale_of};
use support::target::{compute_and_read, run_single};
use support::{CPU, Input, Place, Rng, quantized_weight_types};

/// Bind a tensor named `name` of `layout` into a meta buffer of `n` devices whose callback
/// answers `state`, and return the error.
fn bind_error(n: usize, name: &str, layout: Layout, state: SplitState) -> Error {
    let mut states = HashMap::new();
    states.insert(name.to_string(), state);
    let dev = CPU
        .meta_device(n, 1, states, MetaOptions::default())
        .unwrap();
    let (buf, offs) = alloc_tensors(dev.buffer_type().as_ref(), &[layout]).unwrap();
    let mut g = Graph::new();
    let id = g.weight(name, layout.dtype, layout.ne).unwrap();
    let e = g.bind(id, Storage::new(buf.clone(), offs[0])).unwrap_err();
    // init_tensor directly says the same.
    let e2 = buf.init_tensor(name, &layout, offs[0]).unwrap_err();
    assert_eq!(e.to_string(), e2.to_string());
    assert!(
        g.node(id).storage.is_none(),
        "a refused tensor stays unbound"
    );
    e
}

fn assert_invalid(e: Error, tensor: &str, says: &str) {
    match &e {
        Error::InvalidSplit { tensor: t, reason } => {
            assert_eq!(t, tensor, "{e}");
            assert!(reason.contains(says), "`{says}` not in: {e}");
        }
        other => panic!("expected InvalidSplit for `{tensor}`, got {other}"),
    }
    assert!(e.to_string().contains(&format!("`{tensor}`")), "{e}");
}

#[test]
fn extents_that_do_not_add_up() {
    let l = Layout::contiguous(DType::F32, [8, 6, 1, 1]);
    let e = bind_error(3, "blk.0.ffn_up.weight", l, SplitState::axis(1, &[2, 2, 1]));
    assert_invalid(e, "blk.0.ffn_up.weight", "sum to 5");
    let e = bind_error(2, "w", l, SplitState::axis(0, &[8, 1]));
    assert_invalid(e, "w", "sum to 9");
    let e = bind_error(2, "w", l, SplitState::axis(4, &[1, 0]));
    assert_invalid(e, "w", "axis 4");
}

#[test]
fn quantized_axis0_extents_must_be_whole_blocks() {
    for dt in quantized_weight_types() {
        // Three blocks, cut in halves of 1.5 blocks.
        let b = dt.block_size();
        let l = Layout::contiguous(dt, [3 * b, 4, 1, 1]);
        let e = bind_error(
            2,
            "blk.3.ffn_down.weight",
            l,
            SplitState::axis(0, &[3 * b / 2, 3 * b / 2]),
        );
        assert_invalid(e, "blk.3.ffn_down.weight", &format!("whole blocks of {b}"));
        // Whole blocks, unevenly and with a zero, are fine.
        let mut states = HashMap::new();
        states.insert("w".to_string(), SplitState::axis(0, &[2 * b, 0, b]));
        let dev = CPU
            .meta_device(3, 1, states, MetaOptions::default())
            .unwrap();
        let (buf, offs) = alloc_tensors(dev.buffer_type().as_ref(), &[l]).unwrap();
        buf.init_tensor("w", &l, offs[0]).unwrap();
    }
}

#[test]
fn wrong_device_count() {
    let l = Layout::contiguous(DType::F16, [4, 6, 1, 1]);
    let e = bind_error(3, "output.weight", l, SplitState::axis(1, &[3, 3]));
    assert_invalid(
        e,
        "output.weight",
        "for 2 devices but the meta device has 3",
    );
    let e = bind_error(
        2,
        "norm",
        Layout::contiguous(DType::F32, [4, 1, 1, 1]),
        SplitState::mirrored(4),
    );
    assert_invalid(e, "norm", "for 4 devices");
}

#[test]
fn segments_that_do_not_add_up() {
    let l = Layout::contiguous(DType::F32, [4, 12, 1, 1]);
    // Q, K, V segments over 2 devices summing to 13 rows, not 12.
    let s = SplitState::segmented(1, &[vec![4, 2], vec![2, 1], vec![2, 2]]);
    let e = bind_error(2, "blk.0.attn_qkv.weight", l, s);
    assert_invalid(e, "blk.0.attn_qkv.weight", "sum to 13");
    // A segment with a missing device: 5 extents are not whole segments of 2 devices.
    let s = SplitState::segmented(1, &[vec![4, 2], vec![6]]);
    let e = bind_error(2, "blk.0.attn_qkv.weight", l, s);
    assert_invalid(e, "blk.0.attn_qkv.weight", "whole segments");
}

/// A partial sum of integers or quantized blocks cannot be gathered (reads sum in float), so
/// the state is refused when the tensor is placed, not on the first read.
#[test]
fn partial_state_of_a_non_float_tensor() {
    for dt in DType::ALL.into_iter().filter(|d| !d.is_float()) {
        let l = Layout::contiguous(dt, [dt.block_size(), 2, 1, 1]);
        let e = bind_error(2, "ids", l, SplitState::partial(2));
        assert_invalid(e, "ids", "Partial");
    }
    let l = Layout::contiguous(DType::BF16, [3, 2, 1, 1]);
    let mut states = HashMap::new();
    states.insert("p".to_string(), SplitState::partial(2));
    let dev = CPU
        .meta_device(2, 1, states, MetaOptions::default())
        .unwrap();
    let (buf, offs) = alloc_tensors(dev.buffer_type().as_ref(), &[l]).unwrap();
    buf.init_tensor("p", &l, offs[0]).unwrap();
}

/// The callback's own error comes back from bind unchanged.
#[test]
fn callback_errors_pass_through() {
    let dev = MetaDevice::new(
        parse_devices("cpu:2x1").unwrap(),
        Arc::new(|t: &TensorInfo| Err(Error::msg(format!("no split for `{}`", t.name)))),
    )
    .unwrap();
    let l = Layout::contiguous(DType::F32, [2, 2, 1, 1]);
    let (buf, offs) = alloc_tensors(dev.buffer_type().as_ref(), &[l]).unwrap();
    let mut g = Graph::new();
    let id = g.weight("tok_embd", DType::F32, l.ne).unwrap();
    let e = g.bind(id, Storage::new(buf, offs[0])).unwrap_err();
    assert!(e.to_string().contains("no split for `tok_embd`"), "{e}");
}

// ---- explicit mode ----------------------------------------------------------------------------

/// Weights `w1` (column-parallel, Axis1) and `w2` (row-parallel, Axis0) on `n` devices, and an
/// activation `x [d, t]` inline.
fn megatron_setup(
    n: usize,
    explicit: bool,
    (d, f, t): (usize, usize, usize),
    w2_rotation: usize,
) -> (
    Vec<Input>,
    Vec<Place>,
    Arc<MetaBackend>,
    Graph,
    Vec<TensorId>,
) {
    let mut rng = Rng::new(11);
    let leaves = vec![
        Input::random(&mut rng, "w1", DType::F32, [d, f, 1, 1]),
        Input::random(&mut rng, "w2", DType::F32, [f, d, 1, 1]),
        Input::random(&mut rng, "x", DType::F32, [d, t, 1, 1]),
    ];
    let places = vec![
        Place::State(SplitState::axis(
            1,
            &split_even(f, n, Granularity(1), 0).unwrap(),
        )),
        Place::State(SplitState::axis(
            0,
            &split_even(f, n, Granularity(1), w2_rotation).unwrap(),
        )),
        Place::Inline,
    ];
    let s = CPU
        .meta_setup(&leaves, &places, (n, 1), MetaOptions::explicit(explicit))
        .unwrap();
    (leaves, places, s.backend, s.graph, s.inputs)
}

#[test]
fn explicit_mode_refuses_an_all_gather_and_names_it() {
    for n in [2, 3, 5] {
        let (_, _, backend, mut g, l) = megatron_setup(n, true, (8, 12, 3), 0);
        let h = g.mul_mat(l[0], l[2]).unwrap(); // [f, t], split on axis 0 like w1's rows
        g.set_name(h, "ffn_up_out");
        let y = g.rms_norm(h, 1e-5).unwrap(); // reduces axis 0: needs the whole row
        g.set_name(y, "ffn_norm");
        g.set_output(y);
        let e = backend.graph_compute(&mut g).unwrap_err();
        match &e {
            Error::UnrequestedCommunication {
                node,
                op,
                source_name,
                from,
                to,
                conversion,
            } => {
                assert_eq!(node, "ffn_norm");
                assert_eq!(op, "rms_norm");
                assert_eq!(source_name, "ffn_up_out");
                assert!(from.starts_with("Axis0"), "{e}");
                assert_eq!(to, "Mirrored");
                assert_eq!(conversion, "all-gather");
            }
            other => panic!("expected UnrequestedCommunication, got {other}"),
        }
        let text = e.to_string();
        assert!(
            text.contains("ffn_norm") && text.contains("ffn_up_out") && text.contains("Axis0"),
            "{text}"
        );
        // The plan alone says the same.
        assert!(matches!(
            backend.sharding(&g),
            Err(Error::UnrequestedCommunication { .. })
        ));
    }
}

#[test]
fn explicit_mode_runs_a_megatron_mlp() {
    let (d, f, t) = (16, 24, 5);
    let build = |g: &mut Graph, l: &[TensorId]| -> metashard::Result<Vec<TensorId>> {
        let h = g.mul_mat(l[0], l[2])?;
        let h = g.silu(h)?;
        let o = g.mul_mat(l[1], h)?;
        Ok(vec![g.add(o, l[2])?])
    };
    for n in 1..=8 {
        let (leaves, places, backend, mut g, l) = megatron_setup(n, true, (d, f, t), 0);
        let outs = build(&mut g, &l).unwrap();
        let got = compute_and_read(backend.as_ref(), &mut g, &outs).unwrap();
        let want = run_single(&leaves, &build).unwrap();
        let diff = max_diff(&want[0], &got[0]).unwrap();
        assert!(
            diff <= 1e-4 * scale_of(&want[0]),
            "n={n}: differs by {diff}"
        );
        // Only local work and reductions of partial sums.
        let plan = backend.last_sharding().unwrap();
        assert!(
            plan.conversions.iter().all(|c| c.kind.planned()),
            "{}",
            plan.describe(&g)
        );
        // The same graph in the default mode plans the same conversions.
        let lax = CPU
            .meta_setup(&leaves, &places, (n, 1), MetaOptions::default())
            .unwrap();
        let mut g2 = lax.graph;
        build(&mut g2, &lax.inputs).unwrap();
        let p2 = lax.backend.sharding(&g2).unwrap();
        let kinds = |p: &metashard::meta::Sharding| {
            p.conversions.iter().map(|c| c.kind).collect::<Vec<_>>()
        };
        assert_eq!(kinds(&plan), kinds(&p2));
        // With w2's rows split unlike w1's columns, the hidden activation would have to move
        // between devices: refused.
        if f % n != 0 {
            let (_, _, backend, mut g, l) = megatron_setup(n, true, (d, f, t), 1);
            build(&mut g, &l).unwrap();
            match backend.sharding(&g) {
                Err(Error::UnrequestedCommunication { conversion, .. }) => {
                    assert_eq!(conversion, "all-to-all")
                }
                other => panic!("n={n}: expected an all-to-all refused, got {other:?}"),
            }
        }
    }
}

// ---- destinations no rule admits ---------------------------------------------------------------

/// A Partial destination (a sum of caches) cannot take a write: refused naming the node, the
/// cache untouched. A destination split by its rows (slots) is admitted: each device writes
/// the rows whose slot it holds, even where one holds none.
#[test]
fn set_rows_is_refused_into_a_partial_destination_and_written_into_an_axis1_one() {
    let n = 3;
    let mut rng = Rng::new(12);
    let cache = Input::random(&mut rng, "cache_k", DType::F16, [6, 8, 1, 1]);
    let rows = Input::random(&mut rng, "k_cur", DType::F32, [6, 2, 1, 1]);
    let ids = Input::from_i32("pos", [2, 1, 1, 1], &[5, 1]);
    let leaves = vec![cache, rows, ids];
    for dst in [SplitState::partial(n), SplitState::axis(1, &[3, 0, 5])] {
        let places = vec![Place::State(dst.clone()), Place::Inline, Place::Inline];
        let mut s = CPU
            .meta_setup(&leaves, &places, (n, 1), MetaOptions::default())
            .unwrap();
        let l = s.inputs.clone();
        let w = s.graph.set_rows(l[0], l[1], l[2]).unwrap();
        s.graph.set_name(w, "kv_write");
        s.graph.set_output(w);
        let r = s.backend.graph_compute(&mut s.graph);
        let now = s.placed_values(&leaves, 0).unwrap().unwrap();
        if !dst.is_partial() {
            r.unwrap();
            // Slots 5 and 1 hold the new rows (as f16), the others are unchanged.
            let mut want = leaves[0].values();
            let new = leaves[1].values();
            for (i, slot) in [5, 1].into_iter().enumerate() {
                let row: Vec<f32> = new[i * 6..(i + 1) * 6]
                    .iter()
                    .map(|&x| half::f16::from_f32(x).to_f32())
                    .collect();
                want[slot * 6..(slot + 1) * 6].copy_from_slice(&row);
            }
            assert_eq!(now, want);
            continue;
        }
        let e = r.unwrap_err();
        match &e {
            Error::NoSplitRule {
                op, node, states, ..
            } => {
                assert_eq!(op, "set_rows");
                assert_eq!(node, "kv_write");
                assert!(states.contains(&dst.to_string()), "{e}");
            }
            other => panic!("expected NoSplitRule, got {other}"),
        }
        // The cache is untouched.
        assert_eq!(now, leaves[0].values());
    }
}

/// Tensors placed where the meta device cannot use them: two layouts at one offset of a meta
/// buffer, and a node writing into a plain host buffer every device would write at once.
#[test]
fn misplaced_tensors_are_named() {
    let dev = CPU
        .meta_device(2, 1, HashMap::new(), MetaOptions::default())
        .unwrap();
    let l = Layout::contiguous(DType::F32, [8, 4, 1, 1]);
    let (buf, offs) = alloc_tensors(dev.buffer_type().as_ref(), &[l]).unwrap();
    buf.init_tensor("first", &l, offs[0]).unwrap();
    let other = Layout::contiguous(DType::F32, [4, 4, 1, 1]);
    match buf.init_tensor("second", &other, offs[0]).unwrap_err() {
        Error::MetaPlacement { tensor, reason } => {
            assert_eq!(tensor, "second");
            assert!(reason.contains("`first`"), "{reason}");
        }
        e => panic!("expected MetaPlacement, got {e}"),
    }
    // A cache in a plain CPU buffer, written by set_rows on a meta backend of 2 devices.
    let plain = parse_devices("cpu:1x1").unwrap().remove(0);
    let cl = Layout::contiguous(DType::F32, [6, 8, 1, 1]);
    let (cbuf, coffs) = alloc_tensors(plain.buffer_type().as_ref(), &[cl]).unwrap();
    let mut g = Graph::new();
    let cache = g.new_tensor("plain_cache", DType::F32, cl.ne).unwrap();
    g.bind(cache, Storage::new(cbuf, coffs[0])).unwrap();
    let rows = g.input("rows", DType::F32, [6, 1, 1, 1]).unwrap();
    g.set_data(rows, vec![0u8; 24]).unwrap();
    let ids = g.input("ids", DType::I32, [1, 1, 1, 1]).unwrap();
    g.set_data(ids, 3i32.to_le_bytes().to_vec()).unwrap();
    let w = g.set_rows(cache, rows, ids).unwrap();
    g.set_name(w, "kv_write");
    g.set_output(w);
    let e = dev
        .init_backend()
        .unwrap()
        .graph_compute(&mut g)
        .unwrap_err();
    match &e {
        Error::MetaPlacement { tensor, reason } => {
            assert_eq!(tensor, "plain_cache");
            assert!(reason.contains("`kv_write` writes into it"), "{e}");
        }
        other => panic!("expected MetaPlacement, got {other}"),
    }
}

// ---- a device failing mid-program --------------------------------------------------------------

/// Rows of a table picked by ids split over the devices (one id each), joined with another
/// tensor along the split axis (an all-gather). Device `bad`'s id is out of range, so its
/// get_rows kernel fails while the others wait in the all-gather.
fn failing_rank(n: usize, bad: usize) {
    let mut rng = Rng::new(13 + n as u64);
    let rows = 5;
    let table = Input::random(&mut rng, "tok_embd", DType::F32, [4, rows, 1, 1]);
    let other = Input::random(&mut rng, "prev", DType::F32, [4, 2, 1, 1]);
    let good: Vec<i32> = (0..n).map(|i| (i % rows) as i32).collect();
    let mut ids = good.clone();
    ids[bad] = 99;
    let mut leaves = vec![table, Input::from_i32("tokens", [n, 1, 1, 1], &ids), other];
    let places = vec![
        Place::Inline,
        Place::State(SplitState::axis(0, &vec![1; n])),
        Place::Inline,
    ];
    let build = |g: &mut Graph, l: &[TensorId]| -> metashard::Result<Vec<TensorId>> {
        let e = g.get_rows(l[0], l[1])?;
        g.set_name(e, "embd");
        Ok(vec![g.concat(e, l[2], 1)?])
    };
    let mut s = CPU
        .meta_setup(&leaves, &places, (n, 1), MetaOptions::default())
        .unwrap();
    let outs = build(&mut s.graph, &s.inputs).unwrap();
    if n > 1 {
        // The plan has the collective the healthy devices wait in.
        let plan = s.backend.sharding(&s.graph).unwrap();
        assert_eq!(
            plan.count(metashard::meta::sharding::ConversionKind::AllGather),
            1
        );
    }
    let backend = s.backend.clone();
    let mut g = std::mem::take(&mut s.graph);
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    std::thread::spawn(move || {
        let r = compute_and_read(backend.as_ref(), &mut g, &outs).map(|_| ());
        let _ = tx.send(r);
    });
    let r = rx
        .recv_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("n={n} bad={bad}: graph_compute hung"));
    let took = start.elapsed();
    let e = r.expect_err("an out-of-range id must fail");
    let text = e.to_string();
    assert!(
        text.contains("row id 99") && text.contains("embd"),
        "n={n} bad={bad}: {text}"
    );
    // Released by the failing device, not by the collective's timeout.
    assert!(took < Duration::from_secs(5), "n={n}: took {took:?}");

    // The same backend then runs a good graph.
    leaves[1] = Input::from_i32("tokens", [n, 1, 1, 1], &good);
    let ids_storage = s.buffer.clone().unwrap();
    ids_storage
        .set_tensor(
            &leaves[1].layout(),
            s.offsets[1].unwrap(),
            leaves[1].bytes(),
            0,
        )
        .unwrap();
    let (mut g, l) = s.fresh_graph(&leaves).unwrap();
    let outs = build(&mut g, &l).unwrap();
    let got = compute_and_read(s.backend.as_ref(), &mut g, &outs).unwrap();
    let want = run_single(&leaves, &build).unwrap();
    assert_eq!(max_diff(&want[0], &got[0]).unwrap(), 0.0, "n={n} bad={bad}");
}

#[test]
fn a_failing_device_releases_its_peers_and_the_backend_recovers() {
    for (n, bad) in [(1, 0), (2, 1), (2, 0), (3, 1), (5, 4), (8, 0)] {
        failing_rank(n, bad);
    }
}
