//! A decoder (random weights, two layers) whose token embedding is split by vocabulary and
//! whose KV cache is split by slots (both along axis 1, on top of the built-in Megatron
//! split): a 5-token prompt and two decode steps on `cpu:2x1` and `cpu:3x1` give the logits of
//! one device, the embedding lookup is a Partial sum where the table lies (never gathered),
//! the cache writes keep the cache split, and each device holds only its share of the
//! embedding and of the cache.

use metashard::meta::{ConversionKind, MetaBuffer, MetaDevice, SplitFn, TensorInfo};
use metashard::models::arch::Tensor;
use metashard::models::decoder::{StepInput, build_step};
use metashard::models::hparams::DecoderConfig;
use metashard::models::split::{SplitOptions, megatron};
use metashard::models::synthetic::{alloc_kv_cache, random_decoder};
use metashard::models::weights::{KvCache, ModelWeights};
use metashard::split_state::{Granularity, SplitState, split_even};
use metashard::{Backend, Buffer, DType, Device, parse_devices};
use std::sync::Arc;

const KV_SIZE: usize = 16;

fn cfg(fused: bool, n_head_kv: usize) -> DecoderConfig {
    DecoderConfig {
        fused_attn: fused,
        ..DecoderConfig::llama(2, 64, 128, 4, n_head_kv, 96)
    }
}

/// Extents of `total` rows over `n` devices: uneven on purpose (the remainder on the last
/// device, rotated by `rot`).
fn extents(total: usize, n: usize, rot: usize) -> Vec<usize> {
    split_even(total, n, Granularity(1), rot).unwrap()
}

/// The built-in split, with the token embedding split by vocabulary and the caches by slots.
fn row_split(cfg: &DecoderConfig) -> SplitFn {
    let base = megatron(cfg, SplitOptions::default());
    Arc::new(move |t: &TensorInfo| {
        let n = t.n_devices;
        if t.name == "token_embd.weight" {
            return Ok(SplitState::axis(1, &extents(t.layout.ne[1], n, 0)));
        }
        if t.name.starts_with("cache_k_l") || t.name.starts_with("cache_v_l") {
            return Ok(SplitState::axis(1, &extents(t.layout.ne[1], n, 1)));
        }
        base(t)
    })
}

/// Where tokens are written: slots = positions (attending to `0..n_kv`), or slots scattered
/// over the whole cache (attending to all of it, empty slots masked).
#[derive(Clone, Copy, Debug)]
enum Slots {
    InOrder,
    Scattered,
}

const SCATTERED: [i32; 7] = [15, 2, 9, 4, 11, 0, 7];

struct Run {
    /// Logits of the prompt's last token, then of each decoded token.
    logits: Vec<Vec<f32>>,
    /// Per device: bytes of weights and of the cache.
    weight_bytes: Vec<usize>,
    cache_bytes: Vec<usize>,
}

fn device_bytes(buf: &Arc<dyn Buffer>) -> Vec<usize> {
    buf.as_any()
        .downcast_ref::<MetaBuffer>()
        .map_or_else(Vec::new, |mb| mb.device_bytes())
}

/// The prompt and two decode steps on `devs` (one plain device when `None`), split by `split`.
fn run(cfg: &DecoderConfig, devs: Option<&str>, split: SplitFn, tied: bool, slots: Slots) -> Run {
    let (backend, bt): (Arc<dyn Backend>, _) = match devs {
        None => {
            let d = parse_devices("cpu:1x1").unwrap().remove(0);
            (d.init_backend().unwrap(), d.buffer_type())
        }
        Some(spec) => {
            let m = MetaDevice::new(parse_devices(spec).unwrap(), split).unwrap();
            (m.init_backend().unwrap(), m.buffer_type())
        }
    };
    let (wb, mut w) = random_decoder(cfg, DType::F32, bt.as_ref(), 42).unwrap();
    if tied {
        let embd = w.model.get(Tensor::TokenEmbd).unwrap().clone();
        w.model.insert(Tensor::Output, embd);
    }
    let (cb, cache) = alloc_kv_cache(cfg, KV_SIZE, bt.as_ref()).unwrap();
    let prompt = [3, 17, 42, 5, 60];
    let mut logits = Vec::new();
    let mut kv_positions = [-1i32; KV_SIZE];
    let mut past = 0;
    for tokens in [&prompt[..], &[9], &[77]] {
        let t = tokens.len();
        let positions: Vec<i32> = (past..past + t).map(|p| p as i32).collect();
        let (slot_ids, n_kv): (Vec<i32>, usize) = match slots {
            Slots::InOrder => (positions.clone(), past + t),
            Slots::Scattered => (SCATTERED[past..past + t].to_vec(), KV_SIZE),
        };
        for (&s, &p) in slot_ids.iter().zip(&positions) {
            kv_positions[s as usize] = p;
        }
        let inp = StepInput {
            tokens,
            positions: &positions,
            slots: &slot_ids,
            n_kv,
            kv_positions: &kv_positions[..n_kv],
            logits_rows: t - 1..t,
        };
        logits.push(step(cfg, &w, &cache, &inp, backend.as_ref()));
        past += t;
    }
    Run {
        logits,
        weight_bytes: device_bytes(&wb),
        cache_bytes: device_bytes(&cb),
    }
}

fn step(
    cfg: &DecoderConfig,
    w: &ModelWeights,
    cache: &KvCache,
    inp: &StepInput,
    backend: &dyn Backend,
) -> Vec<f32> {
    let mut sg = build_step(cfg, w, cache, inp).unwrap();
    backend.graph_compute(&mut sg.graph).unwrap();
    sg.graph.read_f32(sg.logits).unwrap()
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

#[test]
fn vocab_split_embedding_and_slot_split_cache_match_one_device() {
    for (fused, kv) in [(true, 2), (false, 4)] {
        let c = cfg(fused, kv);
        for tied in [false, true] {
            for slots in [Slots::InOrder, Slots::Scattered] {
                let want = run(&c, None, row_split(&c), tied, slots);
                for n in [2, 3] {
                    let spec = format!("cpu:{n}x1");
                    let got = run(&c, Some(&spec), row_split(&c), tied, slots);
                    for (i, (g, w)) in got.logits.iter().zip(&want.logits).enumerate() {
                        let e = max_rel(g, w);
                        assert!(
                            e < 1e-4,
                            "fused={fused} kv={kv} tied={tied} {slots:?} {spec} step {i}: {e}"
                        );
                    }
                }
            }
        }
    }
}

/// Each device holds its rows of the embedding instead of all of it, and its slots of the
/// cache: the bytes per device are the built-in split's with the embedding and cache shares
/// replaced.
#[test]
fn devices_hold_their_share_of_the_embedding_and_the_cache() {
    let c = cfg(true, 2);
    let (e, v, ekv) = (c.n_embd, c.n_vocab, c.n_embd_kv());
    for n in [2, 3] {
        let spec = format!("cpu:{n}x1");
        let before = run(
            &c,
            Some(&spec),
            megatron(&c, SplitOptions::default()),
            false,
            Slots::InOrder,
        );
        let after = run(&c, Some(&spec), row_split(&c), false, Slots::InOrder);
        let vocab = extents(v, n, 0);
        let slots = extents(KV_SIZE, n, 1);
        let cache_share = |d: usize| 2 * c.n_layer * ekv * slots[d] * DType::F16.type_size();
        for (d, &rows) in vocab.iter().enumerate() {
            assert_eq!(
                after.weight_bytes[d],
                before.weight_bytes[d] - e * v * 4 + e * rows * 4,
                "{spec} device {d}: weights {:?} before, {:?} after",
                before.weight_bytes,
                after.weight_bytes
            );
            assert_eq!(after.cache_bytes[d], cache_share(d), "{spec} device {d}");
        }
        let total: usize = after.weight_bytes.iter().sum::<usize>();
        let total_before: usize = before.weight_bytes.iter().sum::<usize>();
        assert_eq!(total_before - total, (n - 1) * e * v * 4, "{spec}");
    }
}

/// The plan of the prompt step: the lookup is Partial and reduced once (the table is never
/// converted), the cache writes keep the cache split by slots, and the caches are gathered
/// for attention (a view of the first positions is no per-device view of a slot split).
#[test]
fn the_plan_looks_up_where_the_table_lies_and_writes_where_the_slots_lie() {
    let c = cfg(true, 2);
    for n in [2, 3] {
        let m =
            MetaDevice::new(parse_devices(&format!("cpu:{n}x1")).unwrap(), row_split(&c)).unwrap();
        let mb = m.meta_backend().unwrap();
        let (_wb, w) = random_decoder(&c, DType::F32, m.buffer_type().as_ref(), 42).unwrap();
        let (_cb, cache) = alloc_kv_cache(&c, KV_SIZE, m.buffer_type().as_ref()).unwrap();
        let pos: Vec<i32> = (0..5).collect();
        let inp = StepInput {
            tokens: &[3, 17, 42, 5, 60],
            positions: &pos,
            slots: &pos,
            n_kv: 5,
            kv_positions: &pos,
            logits_rows: 4..5,
        };
        let sg = build_step(&c, &w, &cache, &inp).unwrap();
        let g = &sg.graph;
        let plan = mb.sharding(g).unwrap();
        let text = plan.describe(g);
        let embd = g.find("token_embd.weight").unwrap();
        let lookup = g.find("inp_embd").unwrap();
        assert_eq!(
            plan.states[lookup.index()],
            SplitState::partial(n),
            "{text}"
        );
        assert!(
            plan.conversions.iter().all(|cv| cv.source != embd),
            "the table is converted:\n{text}"
        );
        let reduced: Vec<_> = plan
            .conversions
            .iter()
            .filter(|cv| cv.source == lookup)
            .map(|cv| cv.kind)
            .collect();
        assert_eq!(reduced, [ConversionKind::AllReduce], "{text}");
        let slots = SplitState::axis(1, &extents(KV_SIZE, n, 1));
        let caches: Vec<_> = (0..c.n_layer)
            .flat_map(|l| [format!("cache_k_l{l}"), format!("cache_v_l{l}")])
            .map(|name| g.find(&name).unwrap())
            .collect();
        let writes: Vec<_> = g
            .ids()
            .filter(|&id| g.node(id).op.name() == "set_rows")
            .collect();
        assert_eq!(writes.len(), caches.len());
        for id in writes {
            assert_eq!(plan.states[id.index()], slots, "{text}");
            // The new rows are gathered (every device sees every row); the cache is not.
            let dst = g.node(id).src[0];
            assert!(caches.contains(&dst));
            assert!(
                plan.conversions
                    .iter()
                    .all(|cv| cv.consumer != id || cv.source != dst),
                "the write of `{}` converts its destination:\n{text}",
                g.name(dst)
            );
        }
        // Attention reads positions 0..5 of 16 slots: the caches are gathered after the
        // writes, once each.
        for &cache in &caches {
            let gathers: Vec<_> = plan
                .conversions
                .iter()
                .filter(|cv| cv.source == cache)
                .map(|cv| cv.kind)
                .collect();
            assert_eq!(gathers, [ConversionKind::AllGather], "{text}");
        }
    }
}
