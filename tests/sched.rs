//! The multi-backend scheduler (`src/sched/`): a decoder's layers on two CPU devices equal one
//! device bit for bit, with the assignment and splits pinned as a snapshot; a backend that
//! refuses some ops runs everything else while the CPU takes those nodes (the splits and copies
//! the passes predict, results equal one device); pass (c) moves nodes only between backends
//! given one buffer type; a meta device is one backend among others; the eval callback sees
//! every computed node once, in order, and stopping it is an error that says so, after which
//! the next compute works; `compare_graph_backend` names the first divergent node.
//! Update the snapshots with `UPDATE_EXPECT=1`.

use expect_test::expect_file;
use metashard::backend::{Backend, Device, DeviceKind, GraphPlan, MemoryInfo};
use metashard::buffer::{Buffer, BufferType};
use metashard::graph::{Graph, TensorId};
use metashard::meta::MetaDevice;
use metashard::models::arch::Tensor;
use metashard::models::decoder::{StepInput, build_step};
use metashard::models::hparams::DecoderConfig;
use metashard::models::split::{SplitOptions, megatron};
use metashard::models::synthetic::{alloc_kv_cache, random_decoder, small_config};
use metashard::models::weights::{KvCache, ModelWeights};
use metashard::sched::{Cause, CopyFrom, EvalCallback, PlaceFn, Sched, compare_graph_backend};
use metashard::{DType, Error, Result, parse_devices};
use std::any::Any;
use std::sync::{Arc, Mutex};

fn cfg(n_layer: usize) -> DecoderConfig {
    small_config(n_layer)
}

/// A CPU device that refuses the ops named in `refuses` (and says so when asked to run them).
struct Picky {
    inner: Arc<dyn Device>,
    refuses: &'static [&'static str],
}

struct PickyBackend {
    device: Arc<Picky>,
    inner: Arc<dyn Backend>,
}

impl Picky {
    fn open(inner: Arc<dyn Device>, refuses: &'static [&'static str]) -> Arc<Picky> {
        Arc::new(Picky { inner, refuses })
    }
    fn refused(&self, g: &Graph, id: TensorId) -> Option<&'static str> {
        let op = g.node(id).op.name();
        self.refuses.iter().copied().find(|&r| r == op)
    }
    fn backend(self: &Arc<Self>) -> Arc<dyn Backend> {
        Arc::new(PickyBackend {
            device: self.clone(),
            inner: self.inner.init_backend().unwrap(),
        })
    }
}

impl Device for Picky {
    fn name(&self) -> String {
        format!("picky-{}", self.inner.name())
    }
    fn description(&self) -> String {
        "a CPU device that refuses some ops".into()
    }
    fn memory(&self) -> MemoryInfo {
        self.inner.memory()
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Gpu
    }
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        self.inner.buffer_type()
    }
    fn init_backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(Picky::open(self.inner.clone(), self.refuses).backend())
    }
    fn supports_op(&self, g: &Graph, id: TensorId) -> std::result::Result<(), String> {
        match self.refused(g, id) {
            Some(op) => Err(format!("{op} is refused by this test device")),
            None => self.inner.supports_op(g, id),
        }
    }
    fn supports_buffer_type(&self, bt: &dyn BufferType) -> bool {
        self.inner.supports_buffer_type(bt)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Backend for PickyBackend {
    fn name(&self) -> String {
        self.device.name()
    }
    fn device(&self) -> Arc<dyn Device> {
        self.device.clone()
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn graph_compute(&self, g: &mut Graph) -> Result<()> {
        self.refuse(g)?;
        self.inner.graph_compute(g)
    }
    fn graph_plan(&self, g: &Graph) -> Result<Box<dyn GraphPlan>> {
        self.refuse(g)?;
        self.inner.graph_plan(g)
    }
}

impl PickyBackend {
    /// An error if `g` holds an op this device refuses.
    fn refuse(&self, g: &Graph) -> Result<()> {
        for id in g.ids() {
            if let Some(op) = self.device.refused(g, id) {
                return Err(Error::UnsupportedOp {
                    backend: self.name(),
                    op: op.into(),
                    node: g.name(id).into(),
                    detail: "refused by this test device".into(),
                });
            }
        }
        Ok(())
    }
}

/// Layer `l` of a name (`blk.N.*`, `cache_k_lN`), for placements.
fn layer(name: &str) -> Option<usize> {
    if let Some(r) = name.strip_prefix("blk.") {
        return r.split('.').next()?.parse().ok();
    }
    name.rsplit_once("_l")?.1.parse().ok()
}

/// Layers below `cut` on backend 0, the rest (and the output) on backend 1.
fn two_way(cut: usize) -> PlaceFn {
    Arc::new(move |name: &str| match layer(name) {
        Some(l) => usize::from(l >= cut),
        None => usize::from(name.starts_with("output")),
    })
}

struct Model {
    _wb: Arc<dyn Buffer>,
    _cb: Arc<dyn Buffer>,
    w: ModelWeights,
    cache: KvCache,
}

fn model(cfg: &DecoderConfig, bt: &dyn BufferType) -> Model {
    let (wb, w) = random_decoder(cfg, DType::F32, bt, 7).unwrap();
    let (cb, cache) = alloc_kv_cache(cfg, 8, bt).unwrap();
    Model {
        _wb: wb,
        _cb: cb,
        w,
        cache,
    }
}

/// A step of `tokens.len()` tokens after `past` cached ones (logits of every row).
fn step(cfg: &DecoderConfig, m: &Model, past: usize, tokens: &[i32]) -> (Graph, TensorId) {
    let t = tokens.len();
    let pos: Vec<i32> = (past as i32..(past + t) as i32).collect();
    let kvp: Vec<i32> = (0..8)
        .map(|j| if j < past + t { j as i32 } else { -1 })
        .collect();
    let inp = StepInput {
        tokens,
        positions: &pos,
        slots: &pos,
        n_kv: 8,
        kv_positions: &kvp,
        logits_rows: 0..t,
    };
    let sg = build_step(cfg, &m.w, &m.cache, &inp).unwrap();
    (sg.graph, sg.logits)
}

/// Logits of a 3-token prompt then one decode step on `backend` with weights in `bt`.
/// Also layer 0's output, read by the user (on a backend that runs again later in the
/// compute, the scheduler copies it out of that backend's compute buffer first).
fn run(cfg: &DecoderConfig, backend: &dyn Backend, bt: &dyn BufferType) -> Vec<Vec<f32>> {
    let m = model(cfg, bt);
    let mut out = Vec::new();
    for (past, toks) in [(0, &[3, 9, 4][..]), (3, &[11][..])] {
        let (mut g, logits) = step(cfg, &m, past, toks);
        let l0 = g.find("l0.out").unwrap();
        g.set_output(l0);
        backend.graph_compute(&mut g).unwrap();
        out.push(g.read_f32(logits).unwrap());
        out.push(g.read_f32(l0).unwrap());
    }
    out
}

fn single(cfg: &DecoderConfig) -> Vec<Vec<f32>> {
    let d = parse_devices("cpu:1x1").unwrap().remove(0);
    run(
        cfg,
        d.init_backend().unwrap().as_ref(),
        d.buffer_type().as_ref(),
    )
}

fn cpus(n: usize) -> Vec<Arc<dyn Backend>> {
    parse_devices(&format!("cpu:{n}x1"))
        .unwrap()
        .iter()
        .map(|d| d.init_backend().unwrap())
        .collect()
}

#[test]
fn layer_split_over_two_cpu_devices_equals_one_device() {
    let cfg = cfg(2);
    let sched = Sched::new(cpus(2)).unwrap();
    let bt = sched.buffer_type(two_way(1));
    assert_eq!(run(&cfg, sched.as_ref(), bt.as_ref()), single(&cfg));
    // The decode step's plan: layer 0 on cpu0, layer 1 on cpu1.
    let plan = sched.last_plan().unwrap();
    expect_file!["snapshots/sched_layer_split.txt"].assert_eq(plan.describe());
    assert_eq!(plan.n_splits(), 2, "{}", plan.describe());
    // Layer 1's first norm follows layer 0 (pass (b) spreads cpu0 down first), so the split
    // takes its output and the residual stream.
    assert_eq!(plan.n_copies(), 2, "{}", plan.describe());
    // Prompt and decode steps: one plan each, reused when computed again.
    assert_eq!(sched.plans_made(), 2);
}

#[test]
fn ops_a_backend_refuses_fall_back_to_the_cpu() {
    let cfg = cfg(2);
    let devs = parse_devices("cpu:2x1").unwrap();
    let picky = Picky::open(devs[0].clone(), &["rope", "soft_max"]);
    let sched = Sched::new(vec![picky.backend(), devs[1].init_backend().unwrap()]).unwrap();
    // Weights in plain host memory: the first backend that can use it and runs the op.
    let bt = devs[0].buffer_type();
    assert_eq!(run(&cfg, sched.as_ref(), bt.as_ref()), single(&cfg));
    let plan = sched.last_plan().unwrap();
    let d = plan.describe();
    expect_file!["snapshots/sched_cpu_fallback.txt"].assert_eq(d);
    // Each refused node (2 ropes and a soft_max per layer) is a split of its own between
    // splits of the picky device, which begins and ends the graph.
    let refused = plan
        .splits
        .splits
        .iter()
        .filter(|s| s.backend == 1)
        .map(|s| s.nodes.len())
        .collect::<Vec<_>>();
    assert_eq!(refused, vec![1; 6], "{d}");
    assert_eq!(plan.n_splits(), 13, "{d}");
    // Every split but the first reads something an earlier one computed.
    for s in &plan.splits.splits[1..] {
        assert!(!s.copies.is_empty(), "{d}");
    }
    assert_eq!(plan.n_copies(), 18, "{d}");
    // A backend alone that refuses an op is an error naming the node and the reason.
    let alone = Sched::new(vec![picky.backend()]).unwrap();
    let m = model(&cfg, bt.as_ref());
    let (mut g, _) = step(&cfg, &m, 0, &[1, 2]);
    let e = alone.graph_compute(&mut g).unwrap_err();
    assert!(matches!(e, Error::NoBackendFor { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("rope") && msg.contains("refused by this test device"),
        "{msg}"
    );
}

#[test]
fn upgrades_happen_only_between_backends_given_one_buffer_type() {
    let cfg = cfg(1);
    let devs = parse_devices("cpu:2x1").unwrap();
    let picky = Picky::open(devs[0].clone(), &["soft_max"]);
    let all_on_1: PlaceFn = Arc::new(|_: &str| 1);
    // Distinct buffer types: the weights pin their nodes to cpu1, which keeps them.
    let s = Sched::new(vec![picky.backend(), devs[1].init_backend().unwrap()]).unwrap();
    let m = model(&cfg, s.buffer_type(all_on_1.clone()).as_ref());
    let (g, _) = step(&cfg, &m, 0, &[1, 2]);
    let plan = s.plan(&g).unwrap();
    assert_eq!(plan.n_splits(), 1, "{}", plan.describe());
    assert!(!plan.assignment.cause.contains(&Some(Cause::Upgraded)));
    // One buffer type for both: every node the picky device runs moves up to it.
    let shared = devs[0].buffer_type();
    let s = Sched::with_buffer_types(
        vec![picky.backend(), devs[1].init_backend().unwrap()],
        vec![shared.clone(), shared],
    )
    .unwrap();
    let m = model(&cfg, s.buffer_type(all_on_1).as_ref());
    let (mut g, logits) = step(&cfg, &m, 0, &[1, 2]);
    let plan = s.plan(&g).unwrap();
    let d = plan.describe();
    for id in g.ids().filter(|&id| !g.node(id).is_leaf()) {
        let (b, c) = (
            plan.assignment.backend[id.index()],
            plan.assignment.cause[id.index()],
        );
        let soft_max = g.node(id).op.name() == "soft_max";
        assert_eq!(b, Some(usize::from(soft_max)), "`{}`\n{d}", g.name(id));
        if g.node(id).op.name() == "mul_mat" && !soft_max {
            assert_eq!(c, Some(Cause::Upgraded), "`{}`\n{d}", g.name(id));
        }
    }
    assert_eq!(plan.n_splits(), 3, "{d}");
    s.graph_compute(&mut g).unwrap();
    let single_m = model(&cfg, devs[0].buffer_type().as_ref());
    let (mut g1, l1) = step(&cfg, &single_m, 0, &[1, 2]);
    devs[0]
        .init_backend()
        .unwrap()
        .graph_compute(&mut g1)
        .unwrap();
    assert_eq!(g.read_f32(logits).unwrap(), g1.read_f32(l1).unwrap());
}

#[test]
fn a_meta_device_is_one_backend_among_others() {
    let cfg = cfg(2);
    let devs = parse_devices("cpu:3x1").unwrap();
    let meta =
        MetaDevice::new(devs[..2].to_vec(), megatron(&cfg, SplitOptions::default())).unwrap();
    let sched = Sched::new(vec![
        meta.init_backend().unwrap(),
        devs[2].init_backend().unwrap(),
    ])
    .unwrap();
    let bt = sched.buffer_type(two_way(1));
    let got = run(&cfg, sched.as_ref(), bt.as_ref());
    for (a, b) in got.iter().zip(single(&cfg)) {
        let e = metashard::verify::nmse(a, &b);
        assert!(e < 1e-10, "nmse {e}");
    }
    let plan = sched.last_plan().unwrap();
    assert_eq!(plan.n_splits(), 2, "{}", plan.describe());
    assert!(
        plan.describe().contains("split 0 on meta(2)"),
        "{}",
        plan.describe()
    );
    // The eval callback on a meta device: its split stays one program, its nodes are shown
    // once each, in order, after it runs; the CPU device's split is cut at each node.
    let m = model(&cfg, bt.as_ref());
    let log = Arc::new(Mutex::new(Vec::new()));
    sched.set_eval_callback(Some(Box::new(Seen {
        log: log.clone(),
        stop_at: Some("l1.attn_out"),
    })));
    let (mut g, _) = step(&cfg, &m, 0, &[3, 9, 4]);
    let e = sched.graph_compute(&mut g).unwrap_err();
    assert!(e.to_string().contains("`l1.attn_out` on cpu2"), "{e}");
    let plan = sched.last_plan().unwrap();
    let computed: Vec<TensorId> = g
        .ids()
        .filter(|&id| !g.node(id).is_leaf() && !g.node(id).op.is_view())
        .collect();
    let meta_nodes = plan.splits.splits[0].nodes.len();
    assert_eq!(plan.splits.splits[0].backend, 0);
    assert_eq!(plan.n_splits(), 1 + computed.len() - meta_nodes);
    let seen = std::mem::take(&mut *log.lock().unwrap());
    let upto = computed
        .iter()
        .position(|&id| g.name(id) == "l1.attn_out")
        .unwrap();
    let seen_ids: Vec<TensorId> = seen.iter().map(|s| s.0).collect();
    assert_eq!(seen_ids, computed[..=upto].to_vec());
    assert_eq!(seen.iter().filter(|s| s.1 == "meta(2)").count(), meta_nodes);
    // Values seen on the meta device are whole tensors (gathered).
    for (id, _, n) in &seen {
        assert_eq!(*n, g.layout(*id).nelements(), "`{}`", g.name(*id));
    }
    sched.set_eval_callback(None);
}

#[test]
fn a_meta_device_refusing_an_op_falls_back_with_its_weights_copied() {
    // Both devices of the meta device refuse `mul` (the norms' weights): those nodes run on the
    // CPU device, which cannot read meta buffers, so the norm weights are copied (gathered).
    let cfg = cfg(2);
    let devs = parse_devices("cpu:3x1").unwrap();
    let picky: Vec<Arc<dyn Device>> = devs[..2]
        .iter()
        .map(|d| Picky::open(d.clone(), &["mul"]) as Arc<dyn Device>)
        .collect();
    let meta = MetaDevice::new(picky, megatron(&cfg, SplitOptions::default())).unwrap();
    let sched = Sched::new(vec![
        meta.init_backend().unwrap(),
        devs[2].init_backend().unwrap(),
    ])
    .unwrap();
    let bt = sched.buffer_type(Arc::new(|_: &str| 0));
    let got = run(&cfg, sched.as_ref(), bt.as_ref());
    for (a, b) in got.iter().zip(single(&cfg)) {
        let e = metashard::verify::nmse(a, &b);
        assert!(e < 1e-10, "nmse {e}");
    }
    let plan = sched.last_plan().unwrap();
    let d = plan.describe();
    let leaf_copies: Vec<usize> = plan
        .splits
        .splits
        .iter()
        .flat_map(|s| &s.copies)
        .filter(|c| c.from == CopyFrom::Leaf)
        .map(|c| c.bytes)
        .collect();
    // attn_norm and ffn_norm of 2 layers and the output norm: [64] f32 each.
    assert_eq!(leaf_copies, vec![256; 5], "{d}");
    assert!(d.contains("from its buffer"), "{d}");
    // Exactly the `mul` nodes run on the CPU device.
    let m = model(&cfg, bt.as_ref());
    let (g, _) = step(&cfg, &m, 3, &[11]);
    for id in g.ids().filter(|&id| !g.node(id).is_leaf()) {
        let on_cpu = plan.assignment.backend[id.index()] == Some(1);
        assert_eq!(
            on_cpu,
            g.node(id).op.name() == "mul",
            "`{}`\n{d}",
            g.name(id)
        );
    }
    // A write into a cache in the meta device's buffers cannot fall back to a device that
    // cannot use them: an error naming the node, the backend and the buffer.
    let picky: Vec<Arc<dyn Device>> = devs[..2]
        .iter()
        .map(|d| Picky::open(d.clone(), &["set_rows"]) as Arc<dyn Device>)
        .collect();
    let meta = MetaDevice::new(picky, megatron(&cfg, SplitOptions::default())).unwrap();
    let sched = Sched::new(vec![
        meta.init_backend().unwrap(),
        devs[2].init_backend().unwrap(),
    ])
    .unwrap();
    let m = model(&cfg, sched.buffer_type(Arc::new(|_: &str| 0)).as_ref());
    let (mut g, _) = step(&cfg, &m, 0, &[3, 9]);
    let e = sched.graph_compute(&mut g).unwrap_err();
    assert!(matches!(e, Error::SchedPlacement { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("set_rows") && msg.contains("cpu2") && msg.contains("cannot use"),
        "{msg}"
    );
}

/// Records the nodes it sees; stops after `stop_at` when set.
struct Seen {
    log: Arc<Mutex<Vec<(TensorId, String, usize)>>>,
    stop_at: Option<&'static str>,
}

impl EvalCallback for Seen {
    fn ask(&mut self, _g: &Graph, _id: TensorId) -> bool {
        true
    }
    fn eval(&mut self, g: &Graph, id: TensorId, backend: &str, values: &[f32]) -> bool {
        self.log
            .lock()
            .unwrap()
            .push((id, backend.to_string(), values.len()));
        self.stop_at != Some(g.name(id))
    }
}

#[test]
fn the_eval_callback_sees_every_node_once_in_order_and_can_stop_the_compute() {
    let cfg = cfg(2);
    let sched = Sched::new(cpus(2)).unwrap();
    let bt = sched.buffer_type(two_way(1));
    let m = model(&cfg, bt.as_ref());
    let log = Arc::new(Mutex::new(Vec::new()));
    sched.set_eval_callback(Some(Box::new(Seen {
        log: log.clone(),
        stop_at: None,
    })));
    let (mut g, logits) = step(&cfg, &m, 0, &[3, 9, 4]);
    sched.graph_compute(&mut g).unwrap();
    let computed: Vec<TensorId> = g
        .ids()
        .filter(|&id| !g.node(id).is_leaf() && !g.node(id).op.is_view())
        .collect();
    let seen = std::mem::take(&mut *log.lock().unwrap());
    assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), computed);
    for (id, backend, n) in &seen {
        assert_eq!(*n, g.layout(*id).nelements(), "`{}`", g.name(*id));
        assert!(backend == "cpu0" || backend == "cpu1", "{backend}");
    }
    // Each asked node ends a split on a CPU device, so a node is observed before the next runs;
    // the logits are still those of one device.
    let want = single(&cfg).remove(0); // the prompt's logits
    assert_eq!(g.read_f32(logits).unwrap(), want);
    // Stopping after layer 0's attention: an error naming the node, and nothing after it ran.
    sched.set_eval_callback(Some(Box::new(Seen {
        log: log.clone(),
        stop_at: Some("l0.attn_out"),
    })));
    let (mut g, _) = step(&cfg, &m, 0, &[3, 9, 4]);
    let e = sched.graph_compute(&mut g).unwrap_err();
    assert!(matches!(e, Error::EvalStopped { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("`l0.attn_out`") && msg.contains("stopped"),
        "{msg}"
    );
    let seen = std::mem::take(&mut *log.lock().unwrap());
    assert_eq!(g.name(seen.last().unwrap().0), "l0.attn_out");
    assert!(seen.len() < computed.len() / 2);
    // The next compute works, with or without the callback.
    sched.set_eval_callback(None);
    let (mut g, logits) = step(&cfg, &m, 0, &[3, 9, 4]);
    sched.graph_compute(&mut g).unwrap();
    assert_eq!(g.read_f32(logits).unwrap(), want);
}

#[test]
fn compare_graph_backend_names_the_first_divergent_node() {
    let cfg = cfg(1);
    let devs = parse_devices("cpu:2x1").unwrap();
    let (a, b) = (devs[0].clone(), devs[1].clone());
    let ma = model(&cfg, a.buffer_type().as_ref());
    let mb = model(&cfg, b.buffer_type().as_ref());
    let (mut ga, _) = step(&cfg, &ma, 0, &[3, 9]);
    let (mut gb, _) = step(&cfg, &mb, 0, &[3, 9]);
    let r = compare_graph_backend(
        a.init_backend().unwrap(),
        &mut ga,
        b.init_backend().unwrap(),
        &mut gb,
        1e-12,
    )
    .unwrap();
    assert!(r.first_over.is_none(), "{:?}", r.first_over);
    let computed = ga
        .ids()
        .filter(|&id| !ga.node(id).is_leaf() && !ga.node(id).op.is_view())
        .count();
    assert_eq!(r.nodes.len(), computed);
    // Change one weight of the second model: the first node reading it is reported.
    let wq = mb.w.layers[0].get(Tensor::AttnQ).unwrap();
    let mut bytes = vec![0u8; wq.layout.nbytes()];
    wq.storage.get(&wq.layout, &mut bytes).unwrap();
    bytes[3] ^= 0x80; // the sign of the first weight
    wq.storage.set(&wq.layout, &bytes).unwrap();
    let (mut ga, _) = step(&cfg, &ma, 0, &[3, 9]);
    let (mut gb, _) = step(&cfg, &mb, 0, &[3, 9]);
    let r = compare_graph_backend(
        a.init_backend().unwrap(),
        &mut ga,
        b.init_backend().unwrap(),
        &mut gb,
        1e-12,
    )
    .unwrap();
    let first = r.first_over.expect("a divergent node");
    let q = ga
        .ids()
        .find(|&id| ga.node(id).op.name() == "mul_mat" && ga.node(id).src[0].index() > 0)
        .unwrap();
    assert_eq!(first.index, q.index(), "{first:?}");
    assert_eq!(first.op, "mul_mat");
    // Graphs of different structure are refused.
    let (mut gc, _) = step(&cfg, &mb, 0, &[3]);
    let e = compare_graph_backend(
        a.init_backend().unwrap(),
        &mut ga,
        b.init_backend().unwrap(),
        &mut gc,
        1e-12,
    )
    .unwrap_err();
    assert!(e.to_string().contains("compare_graph_backend"), "{e}");
}
