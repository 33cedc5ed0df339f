//! A backend from outside the crate plugs into the meta device without any change in `meta/`:
//! `support::plugin::Wrapped` wraps a CPU device and brings its own communicator
//! (`CountingComm`, which counts its calls and reduces through the host addresses of the
//! buffer handles). The meta backend
//! asks the devices for their communicators and uses it; devices with nothing in common fall
//! back to the host communicator; a device that stalls fails the compute within the timeout,
//! naming it, and the next compute works.

mod support;

use metashard::backend::{Backend, Device};
use metashard::buffer::BufferType;
use metashard::meta::{MetaDevice, MetaOptions};
use metashard::models::decoder::{StepInput, build_step};
use metashard::models::hparams::DecoderConfig;
use metashard::models::split::{SplitOptions, megatron};
use metashard::models::synthetic::{alloc_kv_cache, random_decoder};
use metashard::{DType, Error, Result, parse_devices};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use support::plugin::{Stats, wrapped};

// ---- a two-layer decoder to run on it -----------------------------------------------------

fn cfg() -> DecoderConfig {
    DecoderConfig {
        fused_attn: false,
        ..DecoderConfig::llama(2, 128, 256, 8, 4, 96)
    }
}

/// A model on one backend: weights, cache, and a step function giving the last logits.
struct Model {
    backend: Arc<dyn Backend>,
    _bufs: Vec<Arc<dyn metashard::Buffer>>,
    w: metashard::models::weights::ModelWeights,
    cache: metashard::models::weights::KvCache,
}

impl Model {
    fn new(backend: Arc<dyn Backend>, bt: Arc<dyn BufferType>) -> Model {
        let c = cfg();
        let (wb, w) = random_decoder(&c, DType::F32, bt.as_ref(), 7).unwrap();
        let (cb, cache) = alloc_kv_cache(&c, 16, bt.as_ref()).unwrap();
        Model {
            backend,
            _bufs: vec![wb, cb],
            w,
            cache,
        }
    }

    fn step(&self, tokens: &[i32], start: i32) -> Result<Vec<f32>> {
        let positions: Vec<i32> = (start..start + tokens.len() as i32).collect();
        let n_kv = (start as usize) + tokens.len();
        let kvp: Vec<i32> = (0..n_kv as i32).collect();
        let inp = StepInput {
            tokens,
            positions: &positions,
            slots: &positions,
            n_kv,
            kv_positions: &kvp,
            logits_rows: tokens.len() - 1..tokens.len(),
        };
        let mut sg = build_step(&cfg(), &self.w, &self.cache, &inp)?;
        self.backend.graph_compute(&mut sg.graph)?;
        sg.graph.read_f32(sg.logits)
    }
}

fn plain() -> Model {
    let d = parse_devices("cpu:1x1").unwrap().remove(0);
    Model::new(d.init_backend().unwrap(), d.buffer_type())
}

fn on_meta(devices: Vec<Arc<dyn Device>>, options: MetaOptions) -> (Model, Arc<MetaDevice>) {
    let m = MetaDevice::with_options(devices, megatron(&cfg(), SplitOptions::default()), options)
        .unwrap();
    let model = Model::new(m.init_backend().unwrap(), m.buffer_type());
    (model, m)
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

const PROMPT: [i32; 5] = [3, 17, 42, 5, 60];

// ---- tests --------------------------------------------------------------------------------

#[test]
fn the_meta_backend_uses_the_communicator_its_devices_bring() {
    let one = plain();
    let want_prompt = one.step(&PROMPT, 0).unwrap();
    let want_next = one.step(&[9], 5).unwrap();
    for n in [2, 3] {
        let stats = Arc::new(Stats::default());
        let (model, m) = on_meta(wrapped(n, &stats, None), MetaOptions::default());
        let be = m.meta_backend().unwrap();
        assert_eq!(be.communicator().name(), format!("counting({n})"));
        let a = model.step(&PROMPT, 0).unwrap();
        let b = model.step(&[9], 5).unwrap();
        assert!(max_rel(&a, &want_prompt) < 1e-4, "N={n} prompt");
        assert!(max_rel(&b, &want_next) < 1e-4, "N={n} decode");
        // Megatron: two all-reduces per layer per step, on every rank.
        let calls = stats.all_reduces.load(Ordering::Relaxed);
        assert_eq!(calls, 2 * cfg().n_layer * 2 * n, "N={n}: all-reduce calls");
        assert_eq!(stats.gathers.load(Ordering::Relaxed), 0);
    }
}

#[test]
fn devices_without_a_common_communicator_fall_back_to_the_host_one() {
    let stats = Arc::new(Stats::default());
    let mut devices = wrapped(1, &stats, None);
    devices.push(parse_devices("cpu:2x1").unwrap().remove(1));
    let (model, m) = on_meta(devices, MetaOptions::default());
    assert_eq!(m.meta_backend().unwrap().communicator().name(), "host(2)");
    let want = plain().step(&PROMPT, 0).unwrap();
    let got = model.step(&PROMPT, 0).unwrap();
    assert!(max_rel(&got, &want) < 1e-4);
    assert_eq!(stats.all_reduces.load(Ordering::Relaxed), 0);
    assert_eq!(stats.groups_made.load(Ordering::Relaxed), 0);
}

#[test]
fn a_stalled_device_fails_the_compute_within_the_timeout_and_the_next_compute_works() {
    let want = plain().step(&PROMPT, 0).unwrap();
    let stats = Arc::new(Stats::default());
    let options = MetaOptions {
        timeout: Duration::from_millis(300),
        ..MetaOptions::default()
    };
    let (model, _m) = on_meta(wrapped(2, &stats, Some(1)), options);
    // A first step runs normally.
    assert!(max_rel(&model.step(&PROMPT, 0).unwrap(), &want) < 1e-4);
    // Device 1 stalls for 3 s inside its next compute.
    stats.stall_ms.store(3000, Ordering::Release);
    let t = Instant::now();
    let err = model.step(&PROMPT, 0).unwrap_err();
    let took = t.elapsed();
    println!("a 3 s stall under a 300 ms timeout was reported after {took:?}: {err}");
    match &err {
        Error::DeviceStalled { device, stage, .. } => {
            assert_eq!(device, "wrapped-cpu1", "{err}");
            assert!(stage.contains("nodes"), "{err}");
        }
        other => panic!("expected a stall error, got {other}"),
    }
    assert!(
        took < Duration::from_millis(2500),
        "the compute waited {took:?}, past the stall of 3 s minus a margin"
    );
    // The stalled thread still sleeps; the next compute runs on a fresh worker and backend.
    let again = model.step(&PROMPT, 0).unwrap();
    assert!(max_rel(&again, &want) < 1e-4);
    assert!(
        stats.groups_made.load(Ordering::Relaxed) >= 2,
        "a new group after the failure"
    );
}

#[test]
fn a_device_that_never_started_still_cannot_hang_the_compute() {
    // The stall begins in the first stage: the error names that stage, and a panic-free,
    // bounded return is all that is asked.
    let stats = Arc::new(Stats::default());
    let options = MetaOptions {
        timeout: Duration::from_millis(200),
        ..MetaOptions::default()
    };
    let (model, _m) = on_meta(wrapped(3, &stats, Some(2)), options);
    stats.stall_ms.store(1500, Ordering::Release);
    let stalled = AtomicBool::new(false);
    let t = Instant::now();
    if let Err(Error::DeviceStalled { device, .. }) = model.step(&[1, 2], 0) {
        assert_eq!(device, "wrapped-cpu2");
        stalled.store(true, Ordering::Relaxed);
    }
    assert!(stalled.load(Ordering::Relaxed), "no stall reported");
    assert!(t.elapsed() < Duration::from_millis(1300));
}
