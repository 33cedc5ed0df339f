//! Meta buffers: scatter (`set_tensor`) then gather (`get_tensor`) is the identity for every
//! dtype, every axis, random segment layouts and extents (zero extents and empty segments
//! included), 1..=8 devices, whole tensors and byte ranges inside them, mirrored tensors and
//! partial ones (a write gives device 0 the data and the others zeros; a read sums). Each
//! device allocates exactly its slice: the local layouts and `device_bytes` are checked against
//! byte counts computed here from the extents.

mod support;

use metashard::Device;
use metashard::backend::alloc_tensors;
use metashard::buffer::Buffer;
use metashard::meta::{MetaBuffer, MetaOptions};
use metashard::split_state::{Granularity, SplitState, split_even};
use metashard::{DType, Layout};
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use support::check::cfg;
use support::meta::random_extents;
use support::{CPU, Rng};

/// Random extents in segments along `axis`: 1..=4 segments of random sizes (empty segments
/// included), each spread over the devices with zeros.
fn random_segments(rng: &mut Rng, ne: [usize; 4], axis: usize, g: usize, n: usize) -> SplitState {
    let units = ne[axis] / g;
    let nseg = 1 + rng.below(4);
    let mut sizes = vec![0usize; nseg];
    for _ in 0..units {
        sizes[rng.below(nseg)] += 1;
    }
    let segs: Vec<Vec<usize>> = sizes
        .iter()
        .map(|&u| random_extents(rng, u * g, g, n))
        .collect();
    SplitState::segmented(axis, &segs)
}

/// Bytes device `d` must hold for a tensor of layout `l` in state `s`, from the extents alone.
fn expected_bytes(l: &Layout, s: &SplitState, d: usize) -> usize {
    let full = l.nbytes();
    match s.split_dim() {
        None => full,
        Some(k) => full * s.local_extent(d) / l.ne[k],
    }
}

/// Values that survive a sum with zeros bit for bit (no -0, no NaN): grid values.
fn summable_bytes(rng: &mut Rng, dt: DType, count: usize) -> Vec<u8> {
    let v: Vec<f32> = (0..count).map(|_| rng.grid()).collect();
    metashard::dtype::f32_to_bytes(dt, &v).unwrap()
}

#[derive(Clone, Debug)]
enum Kind {
    Axis(usize),
    Mirrored,
    Partial,
}

/// One tensor of a test buffer: its layout, state and the bytes the buffer should hold.
struct Placed {
    layout: Layout,
    state: SplitState,
    offset: usize,
    model: Vec<u8>,
}

fn check_buffer(
    n: usize,
    seed: u64,
    tensors: &[(DType, [usize; 4], Kind)],
) -> Result<(), TestCaseError> {
    let mut rng = Rng::new(seed);
    let mut states = HashMap::new();
    let mut placed = Vec::new();
    for (i, (dt, ne, kind)) in tensors.iter().enumerate() {
        let mut ne = *ne;
        ne[0] *= dt.block_size();
        let layout = Layout::contiguous(*dt, ne);
        let state = match kind {
            Kind::Mirrored => SplitState::mirrored(n),
            Kind::Partial => SplitState::partial(n),
            Kind::Axis(k) => random_segments(
                &mut rng,
                ne,
                *k,
                if *k == 0 { dt.block_size() } else { 1 },
                n,
            ),
        };
        states.insert(format!("t{i}"), state.clone());
        placed.push(Placed {
            layout,
            state,
            offset: 0,
            model: Vec::new(),
        });
    }
    let dev = CPU
        .meta_device(n, 1, states, MetaOptions::default())
        .unwrap();
    let layouts: Vec<Layout> = placed.iter().map(|p| p.layout).collect();
    let (buf, offs) = alloc_tensors(dev.buffer_type().as_ref(), &layouts).unwrap();
    let mb = buf
        .as_any()
        .downcast_ref::<MetaBuffer>()
        .expect("a meta buffer");
    let desc = |p: &Placed| format!("{} {:?} {} on {n}", p.layout.dtype, p.layout.ne, p.state);
    for (i, (p, &off)) in placed.iter_mut().zip(&offs).enumerate() {
        p.offset = off;
        buf.init_tensor(&format!("t{i}"), &p.layout, off).unwrap();
        let t = mb.tensor_at(off).expect("placed");
        prop_assert_eq!(&t.state, &p.state);
        // Each device holds exactly its slice, packed.
        for d in 0..n {
            let ll = t.local[d].1;
            prop_assert_eq!(
                ll,
                Layout::contiguous(p.layout.dtype, p.state.local_ne(p.layout.ne, d))
            );
            prop_assert_eq!(
                t.local_bytes(d),
                expected_bytes(&p.layout, &p.state, d),
                "{}",
                desc(p)
            );
            prop_assert!(t.local[d].0.buffer.size() >= ll.nbytes());
        }
        if p.state.split_dim().is_some() {
            let total: usize = (0..n).map(|d| t.local_bytes(d)).sum();
            prop_assert_eq!(
                total,
                p.layout.nbytes(),
                "slices add up to the tensor: {}",
                desc(p)
            );
        }
    }
    let per_device = mb.device_bytes();
    for (d, &b) in per_device.iter().enumerate() {
        let want: usize = placed
            .iter()
            .map(|p| expected_bytes(&p.layout, &p.state, d))
            .sum();
        prop_assert_eq!(b, want, "device {} bytes", d);
    }
    // Whole writes, then whole reads.
    for p in placed.iter_mut() {
        let len = p.layout.nbytes();
        p.model = if p.state.is_partial() {
            summable_bytes(&mut rng, p.layout.dtype, p.layout.nelements())
        } else {
            (0..len).map(|_| rng.next_u64() as u8).collect()
        };
        buf.set_tensor(&p.layout, p.offset, &p.model, 0).unwrap();
    }
    for p in &placed {
        let mut out = vec![0u8; p.layout.nbytes()];
        buf.get_tensor(&p.layout, p.offset, &mut out, 0).unwrap();
        prop_assert!(out == p.model, "whole read differs: {}", desc(p));
    }
    // Ranges: writes and reads inside each tensor (element-aligned for partial tensors, whose
    // reads sum elements; any bytes otherwise).
    for _ in 0..4 {
        for p in placed.iter_mut() {
            let len = p.layout.nbytes();
            let unit = if p.state.is_partial() {
                p.layout.dtype.type_size()
            } else {
                1
            };
            let units = len / unit;
            let a = rng.below(units + 1);
            let b = a + rng.below(units - a + 1);
            let (a, b) = (a * unit, b * unit);
            let data = if p.state.is_partial() {
                summable_bytes(&mut rng, p.layout.dtype, (b - a) / unit)
            } else {
                (a..b).map(|_| rng.next_u64() as u8).collect()
            };
            buf.set_tensor(&p.layout, p.offset, &data, a).unwrap();
            p.model[a..b].copy_from_slice(&data);
            let c = rng.below(units + 1);
            let e = c + rng.below(units - c + 1);
            let (c, e) = (c * unit, e * unit);
            let mut out = vec![0u8; e - c];
            buf.get_tensor(&p.layout, p.offset, &mut out, c).unwrap();
            prop_assert!(
                out[..] == p.model[c..e],
                "range {}..{} differs: {}",
                c,
                e,
                desc(p)
            );
        }
    }
    // Partial tensors: the pieces really are device 0's data and zeros elsewhere.
    for p in &placed {
        if !p.state.is_partial() {
            continue;
        }
        let t = mb.tensor_at(p.offset).unwrap();
        for (d, (st, ll)) in t.local.iter().enumerate() {
            let mut piece = vec![0u8; ll.nbytes()];
            st.get(ll, &mut piece).unwrap();
            if d == 0 {
                prop_assert!(piece == p.model);
            } else {
                let v = metashard::dtype::bytes_to_f32(ll.dtype, &piece, ll.nelements()).unwrap();
                prop_assert!(
                    v.iter().all(|&x| x == 0.0),
                    "device {} holds a non-zero piece",
                    d
                );
            }
        }
    }
    Ok(())
}

fn kind(dt: DType) -> impl Strategy<Value = Kind> {
    let partial = dt.is_float();
    (0usize..6).prop_map(move |k| match k {
        0..4 => Kind::Axis(k),
        4 => Kind::Mirrored,
        _ if partial => Kind::Partial,
        _ => Kind::Axis(0),
    })
}

fn tensor() -> impl Strategy<Value = (DType, [usize; 4], Kind)> {
    (
        prop::sample::select(DType::ALL.to_vec()),
        [1usize..=7, 1usize..=5, 1usize..=4, 1usize..=3],
    )
        .prop_flat_map(|(dt, ne)| (Just(dt), Just(ne), kind(dt)))
}

proptest! {
    #![proptest_config(cfg(1000))]

    /// One to three tensors of any dtype and state in one meta buffer.
    #[test]
    fn scatter_then_gather_is_the_identity(n in 1usize..=8, seed: u64, ts in prop::collection::vec(tensor(), 1..=3)) {
        check_buffer(n, seed, &ts)?;
    }
}

/// Every dtype on every axis and as mirrored and partial, for every device count, once.
#[test]
fn every_dtype_axis_and_device_count() {
    for n in 1..=8 {
        for dt in DType::ALL {
            let mut kinds = vec![
                Kind::Axis(0),
                Kind::Axis(1),
                Kind::Axis(2),
                Kind::Axis(3),
                Kind::Mirrored,
            ];
            if dt.is_float() {
                kinds.push(Kind::Partial);
            }
            for k in kinds {
                check_buffer(n, (n * 100 + dt as usize) as u64, &[(dt, [5, 7, 3, 2], k)]).unwrap();
            }
        }
    }
}

/// Megatron-split weights of a small transformer block: per-device bytes are the split bytes
/// over N (up to one unit of rounding per split tensor) plus the mirrored bytes.
#[test]
fn megatron_weights_allocate_one_nth_plus_mirrored() {
    for &dt in DType::WEIGHT_TYPES {
        // Widths in whole blocks: 192, 320, heads of 32 for blocks of 32 (and plain types);
        // eight times that for the K-quants' blocks of 256.
        let b = dt.block_size().max(32);
        let (d, f, heads, hd) = (6 * b, 10 * b, 6, b);
        for n in 1..=8 {
            let weights: Vec<(&str, Layout)> = vec![
                ("attn_q", Layout::contiguous(dt, [d, heads * hd, 1, 1])),
                ("attn_output", Layout::contiguous(dt, [heads * hd, d, 1, 1])),
                ("ffn_up", Layout::contiguous(dt, [d, f, 1, 1])),
                ("ffn_down", Layout::contiguous(dt, [f, d, 1, 1])),
                ("attn_norm", Layout::contiguous(DType::F32, [d, 1, 1, 1])),
                ("ffn_norm", Layout::contiguous(DType::F32, [d, 1, 1, 1])),
            ];
            let g_head = Granularity(hd);
            let g_rows = Granularity(dt.block_size());
            let mut states = HashMap::new();
            // (split bytes, the bytes of one rounding unit) per split tensor.
            let mut split = Vec::new();
            let mut mirrored = 0;
            for (l, (name, lay)) in weights.iter().enumerate() {
                let (axis, g) = match *name {
                    "attn_q" => (1, g_head),
                    "ffn_up" => (1, Granularity(1)),
                    "attn_output" => (0, g_head.and(g_rows)),
                    "ffn_down" => (0, g_rows),
                    _ => {
                        mirrored += lay.nbytes();
                        states.insert(name.to_string(), SplitState::mirrored(n));
                        continue;
                    }
                };
                let s = SplitState::axis(axis, &split_even(lay.ne[axis], n, g, l).unwrap());
                // A device's share is even up to one unit of the granularity.
                split.push((lay.nbytes(), lay.nbytes() * g.0 / lay.ne[axis]));
                states.insert(name.to_string(), s);
            }
            let dev = CPU
                .meta_device(n, 1, states, MetaOptions::default())
                .unwrap();
            let layouts: Vec<Layout> = weights.iter().map(|w| w.1).collect();
            let (buf, offs) = alloc_tensors(dev.buffer_type().as_ref(), &layouts).unwrap();
            for ((name, lay), &off) in weights.iter().zip(&offs) {
                buf.init_tensor(name, lay, off).unwrap();
            }
            let mb = buf.as_any().downcast_ref::<MetaBuffer>().unwrap();
            let bytes = mb.device_bytes();
            let total_split: usize = split.iter().map(|s| s.0).sum();
            let slack: usize = split.iter().map(|s| s.1).sum();
            for (dv, &b) in bytes.iter().enumerate() {
                let even = total_split / n + mirrored;
                assert!(
                    b + slack >= even && b <= even + slack,
                    "{dt} n={n} device {dv}: {b} bytes, expected {even} +- {slack}"
                );
            }
            assert_eq!(
                bytes.iter().sum::<usize>(),
                total_split + n * mirrored,
                "{dt} n={n}"
            );
        }
    }
}

/// A tensor placed twice at the same offset is one tensor; a different one there is refused.
#[test]
fn placing_again_is_idempotent() {
    let mut states = HashMap::new();
    states.insert("w".to_string(), SplitState::axis(1, &[2, 0, 3]));
    let dev = CPU
        .meta_device(3, 1, states, MetaOptions::default())
        .unwrap();
    let l = Layout::contiguous(DType::F32, [4, 5, 1, 1]);
    let (buf, offs) = alloc_tensors(dev.buffer_type().as_ref(), &[l]).unwrap();
    buf.init_tensor("w", &l, offs[0]).unwrap();
    buf.init_tensor("w", &l, offs[0]).unwrap();
    let mb: &MetaBuffer = buf.as_any().downcast_ref().unwrap();
    assert_eq!(mb.tensors().len(), 1);
    assert_eq!(mb.device_bytes(), vec![2 * 16, 0, 3 * 16]);
    let other = Layout::contiguous(DType::F32, [5, 4, 1, 1]);
    let e = buf
        .init_tensor("v", &other, offs[0])
        .unwrap_err()
        .to_string();
    assert!(e.contains("`v`") && e.contains("`w`"), "{e}");
    let _: Arc<dyn Buffer> = buf;
}
