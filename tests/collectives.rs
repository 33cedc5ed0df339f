//! Tests of the collectives: `SliceLayout` against its definition, every `CpuCommunicator`
//! collective against straightforward references for 1..=8 and 16 ranks, byte counts, and the
//! failure model (abort, timeout, panic, mismatched calls).

mod support;

use half::{bf16, f16};
use metashard::collectives::{AbortOnPanic, Communicator, CpuCommunicator, SliceLayout};
use metashard::{DType, Error};
use proptest::prelude::*;
use std::time::{Duration, Instant};
use support::Rng;

const WORLDS: [usize; 9] = [1, 2, 3, 4, 5, 6, 7, 8, 16];
const REDUCIBLE: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Run `f(rank)` on one scoped thread per rank and collect the results in rank order.
fn on_ranks<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = (0..n).map(|r| s.spawn(move || f(r))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for &x in v {
        match dtype {
            DType::F32 => out.extend_from_slice(&x.to_ne_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f32(x).to_bits().to_ne_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f32(x).to_bits().to_ne_bytes()),
            _ => unreachable!(),
        }
    }
    out
}

fn decode(dtype: DType, b: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f32())
            .collect(),
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f32())
            .collect(),
        _ => unreachable!(),
    }
}

/// The documented result: an f32 sum in rank order, rounded to the dtype once.
fn documented_sum(dtype: DType, inputs: &[Vec<u8>]) -> Vec<u8> {
    let vals: Vec<Vec<f32>> = inputs.iter().map(|b| decode(dtype, b)).collect();
    let sums: Vec<f32> = (0..vals[0].len())
        .map(|i| vals.iter().skip(1).fold(vals[0][i], |a, v| a + v[i]))
        .collect();
    encode(dtype, &sums)
}

/// Unit roundoff of the dtype.
fn roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 2f64.powi(-24),
        DType::F16 => 2f64.powi(-11),
        _ => 2f64.powi(-8),
    }
}

/// Check `got` against the exact f64 sum of the inputs: n f32 adds plus one final rounding.
fn assert_close_to_f64_sum(dtype: DType, inputs: &[Vec<u8>], got: &[u8], what: &str) {
    let vals: Vec<Vec<f32>> = inputs.iter().map(|b| decode(dtype, b)).collect();
    let got = decode(dtype, got);
    for (i, &g) in got.iter().enumerate() {
        let exact: f64 = vals.iter().map(|v| f64::from(v[i])).sum();
        let mag: f64 = vals.iter().map(|v| f64::from(v[i]).abs()).sum();
        let tol = vals.len() as f64 * 2f64.powi(-24) * mag + roundoff(dtype) * exact.abs() + 1e-7;
        assert!(
            (f64::from(g) - exact).abs() <= tol,
            "{what}: element {i}: got {g}, exact {exact}, tolerance {tol}"
        );
    }
}

#[test]
fn all_reduce_is_the_rank_order_sum_on_every_rank() {
    for n in WORLDS {
        let comm = CpuCommunicator::new(n).unwrap();
        for dtype in REDUCIBLE {
            for elems in [0, 1, 7, 33, 576, 4099] {
                let mut rng = Rng::new((n * 1000 + elems) as u64);
                let inputs: Vec<Vec<u8>> = (0..n)
                    .map(|_| {
                        encode(
                            dtype,
                            &(0..elems).map(|_| rng.signed_unit()).collect::<Vec<_>>(),
                        )
                    })
                    .collect();
                let outs = on_ranks(n, |r| {
                    let mut buf = inputs[r].clone();
                    comm.all_reduce(r, &mut buf, dtype).unwrap();
                    buf
                });
                let what = format!("N={n} {dtype} {elems} elements");
                let want = documented_sum(dtype, &inputs);
                for (r, out) in outs.iter().enumerate() {
                    assert_eq!(out, &outs[0], "{what}: rank {r} differs from rank 0");
                }
                assert_eq!(outs[0], want, "{what}: not the rank-order f32 sum");
                assert_close_to_f64_sum(dtype, &inputs, &outs[0], &what);
            }
        }
    }
}

/// The layout's definition, written out directly: per outer repetition, per segment, per rank.
fn reference_gather(outer: usize, unit: usize, segs: &[Vec<usize>], locals: &[Vec<u8>]) -> Vec<u8> {
    let mut cursor = vec![0; locals.len()];
    let mut full = Vec::new();
    for _ in 0..outer {
        for seg in segs {
            for (r, &e) in seg.iter().enumerate() {
                full.extend_from_slice(&locals[r][cursor[r]..cursor[r] + e * unit]);
                cursor[r] += e * unit;
            }
        }
    }
    full
}

/// The inverse of `reference_gather`: each rank's slice of `full`.
fn reference_scatter(outer: usize, unit: usize, segs: &[Vec<usize>], full: &[u8]) -> Vec<Vec<u8>> {
    let mut locals = vec![Vec::new(); segs[0].len()];
    let mut at = 0;
    for _ in 0..outer {
        for seg in segs {
            for (r, &e) in seg.iter().enumerate() {
                locals[r].extend_from_slice(&full[at..at + e * unit]);
                at += e * unit;
            }
        }
    }
    assert_eq!(at, full.len());
    locals
}

/// Random uneven extents, zeros included: `n_seg` segments of `n` ranks.
fn random_segments(rng: &mut Rng, n: usize, n_seg: usize) -> Vec<Vec<usize>> {
    (0..n_seg)
        .map(|_| {
            (0..n)
                .map(|_| if rng.below(4) == 0 { 0 } else { rng.below(6) })
                .collect()
        })
        .collect()
}

#[test]
fn all_gather_matches_the_layout_definition() {
    for n in WORLDS {
        let comm = CpuCommunicator::new(n).unwrap();
        let mut rng = Rng::new(n as u64);
        for case in 0..6 {
            let n_seg = 1 + case % 3;
            let outer = 1 + rng.below(4);
            // Plain element sizes and a Q8_0 block (34 bytes).
            let unit = [1, 2, 4, 12, 34][rng.below(5)];
            let segs = random_segments(&mut rng, n, n_seg);
            let layout = SliceLayout::new(outer, unit, &segs).unwrap();
            let locals: Vec<Vec<u8>> = (0..n).map(|r| rng.bytes(layout.local_bytes(r))).collect();
            let want = reference_gather(outer, unit, &segs, &locals);
            let outs = on_ranks(n, |r| {
                let mut full = vec![0xAA; layout.full_bytes()];
                comm.all_gather(r, &locals[r], &mut full, &layout).unwrap();
                full
            });
            for (r, out) in outs.iter().enumerate() {
                assert_eq!(
                    out,
                    &want,
                    "N={n} case {case} rank {r}: {}",
                    layout.describe()
                );
            }
        }
    }
}

#[test]
fn reduce_scatter_matches_the_reference_and_composes_to_all_reduce() {
    for n in WORLDS {
        let comm = CpuCommunicator::new(n).unwrap();
        let mut rng = Rng::new(100 + n as u64);
        for (case, dtype) in REDUCIBLE.into_iter().cycle().take(6).enumerate() {
            let esz = dtype.type_size();
            let outer = 1 + rng.below(3);
            let unit = esz * (1 + rng.below(3));
            let segs = random_segments(&mut rng, n, 1 + case % 3);
            let layout = SliceLayout::new(outer, unit, &segs).unwrap();
            let elems = layout.full_bytes() / esz;
            let fulls: Vec<Vec<u8>> = (0..n)
                .map(|_| {
                    encode(
                        dtype,
                        &(0..elems).map(|_| rng.signed_unit()).collect::<Vec<_>>(),
                    )
                })
                .collect();
            let summed = documented_sum(dtype, &fulls);
            let want = reference_scatter(outer, unit, &segs, &summed);
            let outs = on_ranks(n, |r| {
                let mut local = vec![0x55; layout.local_bytes(r)];
                comm.reduce_scatter(r, &fulls[r], &mut local, &layout, dtype)
                    .unwrap();
                let mut full = vec![0; layout.full_bytes()];
                comm.all_gather(r, &local, &mut full, &layout).unwrap();
                let mut reduced = fulls[r].clone();
                comm.all_reduce(r, &mut reduced, dtype).unwrap();
                (local, full, reduced)
            });
            let what = format!("N={n} {dtype} case {case}: {}", layout.describe());
            for (r, (local, full, reduced)) in outs.iter().enumerate() {
                assert_eq!(local, &want[r], "{what}: rank {r}'s slice");
                assert_eq!(
                    full, reduced,
                    "{what}: rank {r}: reduce_scatter + all_gather"
                );
            }
            assert_close_to_f64_sum(dtype, &fulls, &outs[0].1, &what);
        }
    }
}

#[test]
fn broadcast_from_every_root() {
    for n in WORLDS {
        let comm = CpuCommunicator::new(n).unwrap();
        for root in 0..n {
            let mut rng = Rng::new((n * 100 + root) as u64);
            let bufs: Vec<Vec<u8>> = (0..n).map(|_| rng.bytes(1000 + root)).collect();
            let outs = on_ranks(n, |r| {
                let mut b = bufs[r].clone();
                comm.broadcast(r, root, &mut b).unwrap();
                b
            });
            for (r, out) in outs.iter().enumerate() {
                assert_eq!(out, &bufs[root], "N={n} root {root} rank {r}");
            }
        }
    }
}

#[test]
fn all_reduce_moves_two_n_minus_one_over_n_of_the_buffer() {
    let bytes = 1 << 20;
    for n in [2, 3, 4, 5, 7, 8, 16] {
        let comm = CpuCommunicator::new(n).unwrap();
        on_ranks(n, |r| {
            let mut buf = encode(DType::F32, &vec![r as f32; bytes / 4]);
            comm.all_reduce(r, &mut buf, DType::F32).unwrap();
        });
        let ideal = 2.0 * (n - 1) as f64 / n as f64 * bytes as f64;
        for r in 0..n {
            let moved = comm.bytes_moved(r) as f64;
            assert!(
                (moved - ideal).abs() <= 0.01 * ideal,
                "N={n} rank {r}: moved {moved} B, ideal {ideal} B"
            );
        }
        // The other collectives' counts, from their definitions.
        let layout = SliceLayout::single(1, 64, &(0..n).collect::<Vec<_>>()).unwrap();
        let before: Vec<u64> = (0..n).map(|r| comm.bytes_moved(r)).collect();
        on_ranks(n, |r| {
            let local = vec![0u8; layout.local_bytes(r)];
            let mut full = vec![0u8; layout.full_bytes()];
            comm.all_gather(r, &local, &mut full, &layout).unwrap();
        });
        for (r, before) in before.into_iter().enumerate() {
            let want = (layout.full_bytes() - layout.local_bytes(r)) as u64;
            assert_eq!(
                comm.bytes_moved(r) - before,
                want,
                "all_gather N={n} rank {r}"
            );
        }
    }
}

#[test]
fn many_small_all_reduces_complete() {
    for (n, rounds) in [(2, 1000), (3, 1000), (4, 1000), (16, 200)] {
        let comm = CpuCommunicator::new(n).unwrap();
        let outs = on_ranks(n, |r| {
            // 576 floats, as in one decode step's hidden state.
            let mut acc = vec![0f32; 576];
            for i in 0..rounds {
                let mut buf = encode(DType::F32, &vec![(r + i) as f32; 576]);
                comm.all_reduce(r, &mut buf, DType::F32).unwrap();
                for (a, v) in acc.iter_mut().zip(decode(DType::F32, &buf)) {
                    *a += v;
                }
            }
            acc
        });
        // Σ_i Σ_r (r + i), exactly representable.
        let want: f32 = (0..rounds)
            .map(|i| (0..n).map(|r| (r + i) as f32).sum::<f32>())
            .sum();
        for out in outs {
            assert!(
                out.iter().all(|&a| a == want),
                "N={n}: {} != {want}",
                out[0]
            );
        }
    }
}

fn reason(e: &Error) -> String {
    match e {
        Error::Collective { reason, .. } => reason.clone(),
        other => panic!("expected a collective error, got {other}"),
    }
}

#[test]
fn a_rank_that_never_arrives_times_out_every_waiting_rank() {
    let n = 3;
    let comm = CpuCommunicator::with_timeout(n, Duration::from_millis(200)).unwrap();
    let t = Instant::now();
    let errs = on_ranks(2, |r| {
        let mut buf = vec![0u8; 4096];
        comm.all_reduce(r, &mut buf, DType::F32).unwrap_err()
    });
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(200),
        "returned before the timeout: {took:?}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");
    let stored = comm.failure().unwrap();
    assert!(
        stored.contains("timed out") && stored.contains("[2]"),
        "{stored}"
    );
    for e in &errs {
        assert!(reason(e).contains("timed out"), "{e}");
    }
    // The communicator stays failed, for the late rank too.
    let mut buf = vec![0u8; 4096];
    assert!(comm.all_reduce(2, &mut buf, DType::F32).is_err());
    assert!(comm.broadcast(0, 0, &mut buf).is_err());
}

#[test]
fn abort_releases_waiting_ranks_promptly() {
    let n = 4;
    // A long timeout: only the abort can release the others quickly.
    let comm = CpuCommunicator::with_timeout(n, Duration::from_secs(60)).unwrap();
    let t = Instant::now();
    let results = on_ranks(n, |r| {
        if r == 3 {
            std::thread::sleep(Duration::from_millis(50));
            comm.abort(3, "out of memory");
            return Ok(());
        }
        let mut buf = vec![0u8; 1 << 16];
        comm.all_reduce(r, &mut buf, DType::F32)
    });
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    for e in results.iter().take(3) {
        let e = e.as_ref().unwrap_err();
        assert!(reason(e).contains("rank 3 aborted: out of memory"), "{e}");
    }
    // Every later call on every rank fails.
    for r in 0..n {
        let mut buf = vec![0u8; 16];
        assert!(comm.all_reduce(r, &mut buf, DType::F32).is_err());
    }
}

#[test]
fn a_panicking_rank_holding_abort_on_panic_releases_the_others() {
    let n = 3;
    let comm = CpuCommunicator::with_timeout(n, Duration::from_secs(60)).unwrap();
    let t = Instant::now();
    let results: Vec<std::thread::Result<bool>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let comm = &comm;
                s.spawn(move || {
                    let _guard = AbortOnPanic::new(comm, r);
                    if r == 1 {
                        panic!("rank 1 fails between collectives");
                    }
                    let mut buf = vec![0u8; 1024];
                    comm.all_reduce(r, &mut buf, DType::F32).is_err()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect()
    });
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    assert!(results[1].is_err(), "rank 1 should have panicked");
    assert!(matches!(results[0], Ok(true)) && matches!(results[2], Ok(true)));
    assert!(comm.failure().unwrap().contains("rank 1 aborted"));
}

#[test]
fn a_bad_argument_on_one_rank_is_an_error_on_all() {
    let n = 3;
    let comm = CpuCommunicator::with_timeout(n, Duration::from_secs(60)).unwrap();
    let t = Instant::now();
    let results = on_ranks(n, |r| {
        let mut buf = vec![0u8; 64];
        // Rank 2 asks for a dtype that cannot be summed.
        let dtype = if r == 2 { DType::Q8_0 } else { DType::F32 };
        comm.all_reduce(r, &mut buf, dtype)
    });
    assert!(t.elapsed() < Duration::from_secs(10));
    assert!(reason(results[2].as_ref().unwrap_err()).contains("cannot be summed"));
    for res in &results[..2] {
        let e = res.as_ref().unwrap_err();
        assert!(reason(e).contains("q8_0 cannot be summed"), "{e}");
    }
}

#[test]
fn two_threads_calling_as_one_rank_is_an_error() {
    let comm = CpuCommunicator::with_timeout(2, Duration::from_secs(60)).unwrap();
    let t = Instant::now();
    // Both threads claim rank 0; rank 1 never calls. The second to enter is refused at once,
    // which fails the communicator and releases the first.
    let results = on_ranks(2, |_| comm.all_reduce(0, &mut [0u8; 64], DType::F32));
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    assert!(results.iter().all(|r| r.is_err()));
    let why = comm.failure().unwrap();
    assert!(why.contains("already inside a collective"), "{why}");
}

/// Run one mismatched pair of calls on two ranks; both must fail quickly and say why.
fn assert_mismatch(
    what: &str,
    call: impl Fn(&CpuCommunicator, usize) -> metashard::Result<()> + Sync,
) {
    let comm = CpuCommunicator::with_timeout(2, Duration::from_secs(60)).unwrap();
    let t = Instant::now();
    let results = on_ranks(2, |r| call(&comm, r));
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "{what}: took {:?}",
        t.elapsed()
    );
    for (r, res) in results.iter().enumerate() {
        let e = res.as_ref().expect_err(what);
        assert!(reason(e).contains("mismatched"), "{what}: rank {r}: {e}");
    }
}

#[test]
fn mismatched_calls_are_errors_on_every_rank() {
    assert_mismatch("sizes", |c, r| {
        let mut buf = vec![0u8; if r == 0 { 100 } else { 200 }];
        c.all_reduce(r, &mut buf, DType::F32)
    });
    assert_mismatch("dtypes", |c, r| {
        let mut buf = vec![0u8; 64];
        c.all_reduce(r, &mut buf, if r == 0 { DType::F32 } else { DType::F16 })
    });
    assert_mismatch("collectives", |c, r| {
        let mut buf = vec![0u8; 64];
        if r == 0 {
            c.all_reduce(r, &mut buf, DType::F32)
        } else {
            c.broadcast(r, 0, &mut buf)
        }
    });
    assert_mismatch("roots", |c, r| c.broadcast(r, r, &mut [0u8; 8]));
    assert_mismatch("layouts", |c, r| {
        // Same full size, different split.
        let layout = SliceLayout::single(1, 4, if r == 0 { &[1, 3] } else { &[2, 2] }).unwrap();
        let local = vec![0u8; layout.local_bytes(r)];
        c.all_gather(r, &local, &mut [0u8; 16], &layout)
    });
}

#[test]
fn bad_arguments_are_errors() {
    assert!(CpuCommunicator::new(0).is_err());
    assert!(CpuCommunicator::new(17).is_err());
    let single = CpuCommunicator::new(1).unwrap();
    assert!(
        single.all_reduce(0, &mut [0u8; 6], DType::F32).is_err(),
        "not whole elements"
    );
    let comm = CpuCommunicator::new(1).unwrap();
    assert!(
        comm.all_reduce(1, &mut [0u8; 8], DType::F32).is_err(),
        "rank out of range"
    );
    let comm = CpuCommunicator::new(1).unwrap();
    let two = SliceLayout::single(1, 4, &[1, 1]).unwrap();
    assert!(
        comm.all_gather(0, &[0; 4], &mut [0; 8], &two).is_err(),
        "layout world"
    );
    let comm = CpuCommunicator::new(1).unwrap();
    let one = SliceLayout::single(1, 4, &[2]).unwrap();
    assert!(
        comm.all_gather(0, &[0; 4], &mut [0; 8], &one).is_err(),
        "local size"
    );
    let comm = CpuCommunicator::new(1).unwrap();
    let odd = SliceLayout::single(1, 3, &[2]).unwrap();
    assert!(
        comm.reduce_scatter(0, &[0; 6], &mut [0; 6], &odd, DType::F16)
            .is_err(),
        "unit not whole elements"
    );
    let comm = CpuCommunicator::new(1).unwrap();
    assert!(
        comm.broadcast(0, 1, &mut [0; 4]).is_err(),
        "root out of range"
    );
}

fn layout_strategy() -> impl Strategy<Value = (usize, usize, Vec<Vec<usize>>)> {
    (1usize..=8, 1usize..=3, 0usize..=3, 1usize..=9).prop_flat_map(|(n, n_seg, outer, unit)| {
        (
            Just(outer),
            Just(unit),
            prop::collection::vec(prop::collection::vec(0usize..5, n), n_seg),
        )
    })
}

proptest! {
    #[test]
    fn scatter_then_gather_is_the_identity((outer, unit, segs) in layout_strategy(), seed in any::<u64>()) {
        let layout = SliceLayout::new(outer, unit, &segs).unwrap();
        let full = Rng::new(seed).bytes(layout.full_bytes());
        let want = reference_scatter(outer, unit, &segs, &full);
        let mut rebuilt = vec![0u8; full.len()];
        let mut covered = vec![0u8; full.len()];
        prop_assert_eq!(want.len(), layout.world());
        for (r, want) in want.iter().enumerate() {
            let mut local = vec![0u8; layout.local_bytes(r)];
            layout.scatter(&full, r, &mut local).unwrap();
            prop_assert_eq!(&local, want);
            layout.gather_into(&local, r, &mut rebuilt).unwrap();
            for run in layout.runs(r) {
                covered[run.full..run.full + run.len].iter_mut().for_each(|c| *c += 1);
            }
        }
        prop_assert_eq!(rebuilt, full);
        // Every byte belongs to exactly one rank.
        prop_assert!(covered.iter().all(|&c| c == 1));
    }
}
