//! Device rates: GEMV weight bandwidth and GEMM throughput per weight type, memory bandwidth,
//! fused attention at a decoding step's shape, and the per-node cost of a device's own
//! program, measured on every device of the list at once through the timing rig (`rig.rs`).

use super::options::{
    ATTN_HEADS, ATTN_KV_ROWS, ATTN_SHAPES, Budget, CalibrateOptions, GEMM_M, GEMV_M, SHAPES,
    SHORT_CHAIN, STREAM_ELEMS,
};
use super::rig::{Rig, median};
use crate::backend::alloc_tensors;
use crate::buffer::{BufferType, Storage};
use crate::graph::Graph;
use crate::planner::CALIBRATED_M;
use crate::tensor::Layout;
use crate::{DType, Result};
use std::collections::BTreeMap;

/// What [`measure_devices`] found (the same for every device of the list).
pub(super) struct Rates {
    pub gemv: BTreeMap<String, f64>,
    /// GEMV bytes/s by row length K, by type.
    pub gemv_by_k: BTreeMap<String, Vec<(usize, f64)>>,
    pub gemm: BTreeMap<String, f64>,
    /// Flop/s at the rows of [`CALIBRATED_M`], by type.
    pub gemm_by_m: BTreeMap<String, Vec<(usize, f64)>>,
    pub mem_bw: f64,
    /// Fused attention flop/s at a decoding step's shape ([`attention_rate`]).
    pub attn_flops: f64,
    pub kernel_node_s: f64,
    pub gemv_bytes: BTreeMap<String, usize>,
    pub gemv_nodes: BTreeMap<String, usize>,
}

/// A deterministic value in [-1, 1) (xorshift64*).
fn rand(state: &mut u64) -> f32 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    let v = state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
    v as f32 / (1u64 << 23) as f32 - 1.0
}

fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n).map(|_| rand(&mut s)).collect()
}

/// A chain of `k` tiny nodes (scales of 16 floats) on one input.
pub(super) fn chain_graph(k: usize) -> Result<Graph> {
    let mut g = Graph::new();
    let mut x = g.input_f32("x", [16, 1, 1, 1], &[0.5; 16])?;
    for _ in 0..k {
        x = g.scale(x, 1.0)?;
    }
    g.set_output(x);
    Ok(g)
}

/// Weights of `dtype` shaped `(K, N)` for each of `shapes`, in one buffer of `bt`, each row a
/// copy of one quantized random row (the values do not change the timing; real-valued rows
/// keep subnormals and NaNs out).
fn weights(
    dtype: DType,
    shapes: &[(usize, usize)],
    tensors: &BTreeMap<(usize, usize), Vec<u8>>,
    bt: &dyn BufferType,
) -> Result<Vec<(Layout, Storage)>> {
    let layouts: Vec<Layout> = shapes
        .iter()
        .map(|&(k, n)| Layout::contiguous(dtype, [k, n, 1, 1]))
        .collect();
    let (buf, offs) = alloc_tensors(bt, &layouts)?;
    let mut out = Vec::with_capacity(shapes.len());
    for ((l, off), shape) in layouts.into_iter().zip(offs).zip(shapes) {
        let st = Storage::new(buf.clone(), off);
        st.set(&l, &tensors[shape])?;
        out.push((l, st));
    }
    Ok(out)
}

/// The bytes of one `(K, N)` weight of `dtype`: a random row repeated N times.
fn tensor_bytes(dtype: DType, k: usize, n: usize) -> Result<Vec<u8>> {
    let mut row = vec![0u8; dtype.row_size(k)];
    crate::dtype::row_from_f32(dtype, &random_f32(k, k as u64), &mut row)?;
    Ok(row.repeat(n))
}

/// A graph of one `mul_mat` per weight, activations of `m` rows per K.
fn matmul_graph(dtype: DType, w: &[(Layout, Storage)], m: usize) -> Result<Graph> {
    let mut g = Graph::new();
    let mut xs: BTreeMap<usize, crate::TensorId> = BTreeMap::new();
    for (i, (l, st)) in w.iter().enumerate() {
        let k = l.ne[0];
        let x = match xs.get(&k) {
            Some(&x) => x,
            None => {
                let x = g.input_f32(&format!("x{k}"), [k, m, 1, 1], &random_f32(k * m, 7))?;
                xs.insert(k, x);
                x
            }
        };
        let wid = g.weight(&format!("w{i}"), dtype, l.ne)?;
        g.bind(wid, st.clone())?;
        g.mul_mat(wid, x)?;
    }
    Ok(g)
}

/// Kernel seconds of a graph of `nodes` nodes that ran in `t` seconds, on a device whose
/// program costs `node_s` per node (the cost is removed unless it would leave less than half).
fn kernel_time(t: f64, nodes: usize, node_s: f64) -> f64 {
    let k = t - nodes as f64 * node_s;
    if k > 0.5 * t { k } else { t }
}

/// Each device's share of the streamed weights' bytes (`gemv_total` over `n` devices, at least
/// 8 MiB): enough that they come from memory, as a decoding step's do.
fn per_device_bytes(b: &Budget, n: usize) -> usize {
    (b.gemv_total / n).max(8 << 20)
}

/// [`SHAPES`] with rows in whole blocks of `dt` (576 -> 768 for the K-quants' blocks of 256).
fn block_shapes(dt: DType) -> Vec<(usize, usize)> {
    SHAPES
        .iter()
        .map(|&(k, n)| (k.next_multiple_of(dt.block_size()), n))
        .collect()
}

/// The shapes of `base` in turn until they hold a device's share of the streamed bytes
/// ([`per_device_bytes`] over `n` devices).
fn streamed_shapes(
    dt: DType,
    base: &[(usize, usize)],
    n: usize,
    b: &Budget,
) -> Vec<(usize, usize)> {
    let cycle: usize = base.iter().map(|&(k, n)| dt.row_size(k) * n).sum();
    let cycles = per_device_bytes(b, n).div_ceil(cycle).max(1);
    (0..cycles).flat_map(|_| base.iter().copied()).collect()
}

/// GEMV, GEMM and memory rates of every device of the rig at once, and the per-node cost of a
/// device's program subtracted from them (see the module doc).
pub(super) fn measure_devices(
    rig: &mut Rig,
    opts: &CalibrateOptions,
    b: &Budget,
    step: &dyn Fn(&str),
) -> Result<Rates> {
    // Per-node cost of a device's program: the slope between a short and a long chain.
    step("per-node cost of a device program");
    let kernel_node_s = node_cost(rig, b)?;
    let mut r = Rates {
        gemv: BTreeMap::new(),
        gemv_by_k: BTreeMap::new(),
        gemm: BTreeMap::new(),
        gemm_by_m: BTreeMap::new(),
        mem_bw: 0.0,
        attn_flops: 0.0,
        kernel_node_s,
        gemv_bytes: BTreeMap::new(),
        gemv_nodes: BTreeMap::new(),
    };
    for &dt in &opts.weight_types {
        matmul_rates(rig, dt, b, step, &mut r)?;
    }
    // Memory: F32 adds of distinct 4 MiB tensors, results kept (outputs), so every byte comes
    // from and goes to memory.
    step("memory bandwidth (F32 adds)");
    r.mem_bw = memory_bandwidth(rig, b, kernel_node_s)?;
    step("attention (a decoding step's shape)");
    r.attn_flops = attention_rate(rig, b, kernel_node_s)?;
    Ok(r)
}

/// Flop/s of fused attention (`flash_attn`) as a decoding step runs it: one query row of
/// [`ATTN_HEADS`] heads over [`ATTN_KV_ROWS`] f16 cache rows of 2 KV heads, at each head size of
/// [`ATTN_SHAPES`], each node on its own cache (about as many bytes per device as the GEMV
/// graphs stream, so the caches come from memory as a model's layers' do). 4 D flops per query
/// head and cache row (the score and the value row), the count the cost model prices.
fn attention_rate(rig: &mut Rig, b: &Budget, kernel_node_s: f64) -> Result<f64> {
    let n = rig.devices.len();
    let kv_bytes = |d: usize| 2 * 2 * ATTN_KV_ROWS * d * 2;
    let per_shape = (per_device_bytes(b, n) / ATTN_SHAPES.len())
        .div_ceil(kv_bytes(ATTN_SHAPES[0]))
        .max(1);
    let nodes: Vec<usize> = ATTN_SHAPES
        .iter()
        .flat_map(|&d| std::iter::repeat_n(d, per_shape))
        .collect();
    let flops: f64 = nodes
        .iter()
        .map(|&d| 4.0 * (d * ATTN_KV_ROWS * ATTN_HEADS) as f64)
        .sum();
    // One cache's bytes per head size, for every node of it (the values do not change the
    // timing).
    let mut caches = BTreeMap::new();
    for &d in &ATTN_SHAPES {
        let mut bytes = vec![0u8; DType::F16.row_size(d * ATTN_KV_ROWS * 2)];
        crate::dtype::row_from_f32(
            DType::F16,
            &random_f32(d * ATTN_KV_ROWS * 2, d as u64),
            &mut bytes,
        )?;
        caches.insert(d, bytes);
    }
    let p = rig.prepare(&|_, bt| {
        let layouts: Vec<Layout> = nodes
            .iter()
            .flat_map(|&d| [Layout::contiguous(DType::F16, [d, ATTN_KV_ROWS, 2, 1]); 2])
            .collect();
        let (buf, offs) = alloc_tensors(bt, &layouts)?;
        let mut g = Graph::new();
        let mut qs: BTreeMap<usize, crate::TensorId> = BTreeMap::new();
        for (i, &d) in nodes.iter().enumerate() {
            let q = match qs.get(&d) {
                Some(&q) => q,
                None => {
                    let data = random_f32(d * ATTN_HEADS, d as u64);
                    let q = g.input_f32(&format!("q{d}"), [d, 1, ATTN_HEADS, 1], &data)?;
                    qs.insert(d, q);
                    q
                }
            };
            let mut kv = [crate::TensorId(0); 2];
            for (j, t) in kv.iter_mut().enumerate() {
                let l = &layouts[2 * i + j];
                let st = Storage::new(buf.clone(), offs[2 * i + j]);
                st.set(l, &caches[&d])?;
                *t = g.new_tensor(&format!("kv{i}.{j}"), DType::F16, l.ne)?;
                g.bind(*t, st)?;
            }
            let o = g.flash_attn(q, kv[0], kv[1], None, 1.0 / (d as f32).sqrt())?;
            g.set_output(o);
        }
        Ok(g)
    })?;
    let t = rig.time(&p, b.warmup, b.reps)?;
    let k = kernel_time(median(&t.spans), nodes.len(), kernel_node_s);
    Ok(flops / k)
}

/// Seconds per node of a device's own program: the slope between chains of [`SHORT_CHAIN`]
/// and `b.chain` nodes, on each device's own time (the dispatch skew between devices is not
/// a cost of its nodes).
fn node_cost(rig: &mut Rig, b: &Budget) -> Result<f64> {
    let short = rig.prepare(&|_, _| chain_graph(SHORT_CHAIN))?;
    let long = rig.prepare(&|_, _| chain_graph(b.chain))?;
    let (ts, tl) = (
        rig.time(&short, b.warmup, b.reps * 3)?,
        rig.time(&long, b.warmup, b.reps * 3)?,
    );
    Ok(((median(&tl.device) - median(&ts.device)) / (b.chain - SHORT_CHAIN) as f64).max(0.0))
}

/// The GEMV and GEMM rates of weight type `dt`, into `r`.
fn matmul_rates(
    rig: &mut Rig,
    dt: DType,
    b: &Budget,
    step: &dyn Fn(&str),
    r: &mut Rates,
) -> Result<()> {
    let n = rig.devices.len();
    let per_device_gemv = per_device_bytes(b, n);
    let base = block_shapes(dt);
    let mut tensors = BTreeMap::new();
    for &(k, m) in &base {
        tensors.insert((k, m), tensor_bytes(dt, k, m)?);
    }
    // GEMV: each row length on its own (copies of its shape until the device's weights reach
    // its share of the total, so they stream from memory), `gemv_bw` over all of them.
    let (mut bytes, mut secs, mut nodes) = (0usize, 0f64, 0usize);
    let mut by_k: Vec<(usize, f64)> = Vec::with_capacity(base.len());
    for &(k, m) in &base {
        if by_k.last().is_some_and(|&(pk, _)| pk >= k) {
            continue;
        }
        step(&format!("GEMV {dt} (M = {GEMV_M}, K = {k})"));
        let one = dt.row_size(k) * m;
        let copies = per_device_gemv.div_ceil(one).max(1);
        let shapes = vec![(k, m); copies];
        let p = rig.prepare(&|_, bt| {
            let w = weights(dt, &shapes, &tensors, bt)?;
            matmul_graph(dt, &w, GEMV_M)
        })?;
        let t = rig.time(&p, b.warmup, b.reps)?;
        drop(p);
        let s = kernel_time(median(&t.spans), copies, r.kernel_node_s);
        by_k.push((k, (copies * one) as f64 / s));
        (bytes, secs, nodes) = (bytes + copies * one, secs + s, nodes + copies);
    }
    r.gemv.insert(dt.name().into(), bytes as f64 / secs);
    r.gemv_by_k.insert(dt.name().into(), by_k);
    r.gemv_bytes.insert(dt.name().into(), bytes);
    r.gemv_nodes.insert(dt.name().into(), nodes);
    // The shapes in turn over the device's share, for the small-M products below.
    // Between the regimes: M = 2 and 8 over the streamed weights (a batched decode step reads
    // them from memory), larger M over one copy (compute-bound, as the GEMM).
    let streamed = streamed_shapes(dt, &base, n, b);
    let mut by_m = Vec::with_capacity(CALIBRATED_M.len());
    for &m in &CALIBRATED_M {
        step(&format!("{dt} products (M = {m})"));
        let shapes: &[(usize, usize)] = if m <= 8 {
            &streamed
        } else {
            &base[..b.gemm_shapes]
        };
        let flops: f64 = shapes.iter().map(|&(k, n)| 2.0 * (m * k * n) as f64).sum();
        let p = rig.prepare(&|_, bt| {
            let w = weights(dt, shapes, &tensors, bt)?;
            matmul_graph(dt, &w, m)
        })?;
        let t = rig.time(&p, b.warmup, b.reps)?;
        drop(p);
        let k = kernel_time(median(&t.spans), shapes.len(), r.kernel_node_s);
        by_m.push((m, flops / k));
    }
    r.gemm_by_m.insert(dt.name().into(), by_m);
    // GEMM: one copy of the first shapes (compute-bound, the weights may stay cached).
    step(&format!("GEMM {dt} (M = {GEMM_M})"));
    let shapes = &base[..b.gemm_shapes];
    let flops: f64 = shapes
        .iter()
        .map(|&(k, m)| 2.0 * (GEMM_M * k * m) as f64)
        .sum();
    let p = rig.prepare(&|_, bt| {
        let w = weights(dt, shapes, &tensors, bt)?;
        matmul_graph(dt, &w, GEMM_M)
    })?;
    let t = rig.time(&p, b.warmup, b.reps)?;
    drop(p);
    let k = kernel_time(median(&t.spans), shapes.len(), r.kernel_node_s);
    r.gemm.insert(dt.name().into(), flops / k);
    Ok(())
}

/// Bytes read and written per second by F32 adds of distinct [`STREAM_ELEMS`]-element tensors.
fn memory_bandwidth(rig: &mut Rig, b: &Budget, kernel_node_s: f64) -> Result<f64> {
    let n = rig.devices.len();
    let moved_per_add = 3 * 4 * STREAM_ELEMS;
    let adds = ((b.stream_total / n).max(8 << 20)).div_ceil(moved_per_add);
    let p = rig.prepare(&|_, bt| {
        let l = Layout::contiguous(DType::F32, [STREAM_ELEMS, 1, 1, 1]);
        let (buf, offs) = alloc_tensors(bt, &vec![l; 2 * adds])?;
        let ones = crate::dtype::as_bytes(&vec![1.0f32; STREAM_ELEMS]).to_vec();
        let mut g = Graph::new();
        for i in 0..adds {
            let mut ids = Vec::with_capacity(2);
            for j in 0..2 {
                let st = Storage::new(buf.clone(), offs[2 * i + j]);
                st.set(&l, &ones)?;
                let id = g.new_tensor(&format!("s{i}.{j}"), DType::F32, l.ne)?;
                g.bind(id, st)?;
                ids.push(id);
            }
            let c = g.add(ids[0], ids[1])?;
            g.set_output(c);
        }
        Ok(g)
    })?;
    let t = rig.time(&p, b.warmup, b.reps)?;
    let k = kernel_time(median(&t.spans), adds, kernel_node_s);
    Ok((adds * moved_per_add) as f64 / k)
}
