//! Measures `CpuCommunicator`: all-reduce GB/s (algorithm bytes = buffer size) next to a
//! single-thread memcpy of the same size, all-gather and reduce-scatter, and small-message
//! latency. Times are per call of rank 0; the tables quote the 10th percentile (calls that
//! ran undisturbed) and the median, so other processes sharing the cores disturb them less
//! than averages would.
//!
//! `cargo run --release --example collectives_bench [max_world] [all|bw|lat]`
//!
//! With at most as many ranks as cores, rank r's thread is pinned to core r (with `taskset`,
//! when present): on a loaded host the scheduler otherwise sometimes stacks both ranks on one
//! core, and every call then costs a time slice (~100 us) instead of microseconds.
//!
//! "touched" columns time a loop closer to real use: each rank writes its whole buffer (the
//! producing op), all-reduces it, then reads it (the consuming op); the cost shown is that
//! loop minus the same write and read without the all-reduce.

use metashard::DType;
use metashard::collectives::{CpuCommunicator, SliceLayout};
use std::hint::black_box;
use std::time::{Duration, Instant};

fn pct(v: &[f64], p: usize) -> f64 {
    v[(v.len() - 1) * p / 100]
}

fn calls_for(bytes: usize) -> usize {
    ((256 << 20) / bytes.max(1)).clamp(30, 20_000)
}

/// One rank's buffers: `a` of the size asked for, `b` of the second size.
type Op<'a> = dyn Fn(usize, &mut [u8], &mut [u8]) + Sync + 'a;

/// Run `op(rank, a, b)` `calls` times on each of `n` ranks after a warm-up; rank 0's sorted
/// per-call seconds.
fn per_call(
    n: usize,
    sizes: &(dyn Fn(usize) -> (usize, usize) + Sync),
    calls: usize,
    op: &Op,
) -> Vec<f64> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                s.spawn(move || {
                    if n <= cores() {
                        pin(r);
                    }
                    let (sa, sb) = sizes(r);
                    // Written buffers: a never-written `vec![0; n]` maps the shared zero page,
                    // and reads from it would hit the cache however large the buffer.
                    let (mut a, mut b) = (vec![1u8; sa], vec![1u8; sb]);
                    for _ in 0..calls.min(100) {
                        op(r, &mut a, &mut b);
                    }
                    let mut t = Vec::with_capacity(calls);
                    for _ in 0..calls {
                        let t0 = Instant::now();
                        op(r, &mut a, &mut b);
                        t.push(t0.elapsed().as_secs_f64());
                    }
                    t.sort_by(|x, y| x.partial_cmp(y).unwrap());
                    t
                })
            })
            .collect();
        let mut all: Vec<Vec<f64>> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        all.swap_remove(0)
    })
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Pin the calling thread to core `core` with `taskset` (best effort: nothing if it fails).
fn pin(core: usize) {
    // "/proc/thread-self" links to "<pid>/task/<tid>".
    let Ok(link) = std::fs::read_link("/proc/thread-self") else {
        return;
    };
    let Some(tid) = link.file_name().and_then(|t| t.to_str()).map(str::to_owned) else {
        return;
    };
    let _ = std::process::Command::new("taskset")
        .args(["-p", "-c", &core.to_string(), &tid])
        .stdout(std::process::Stdio::null())
        .status();
}

/// Write every byte, as a producing op would.
fn produce(buf: &mut [u8], i: u8) {
    buf.fill(black_box(i));
}

/// Read every byte, as a consuming op would.
fn consume(buf: &[u8]) -> u64 {
    buf.chunks_exact(8).fold(0u64, |a, c| {
        a.wrapping_add(u64::from_ne_bytes(c.try_into().unwrap()))
    })
}

fn main() {
    let mut args = std::env::args().skip(1);
    let max_world: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(4);
    let what = args.next().unwrap_or_else(|| "all".into());
    println!("cores: {}\n", cores());
    if what != "lat" {
        all_reduce_bandwidth(max_world);
        gather_scatter(max_world);
    }
    if what != "bw" {
        latency(max_world);
    }
}

fn all_reduce_bandwidth(max_world: usize) {
    println!(
        "| size | N | dtype | all_reduce GB/s p10 / p50 | memcpy GB/s p10 / p50 | ratio p10 | \
         us/call p10 / p50 | touched: extra us/call p10 / p50 |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for bytes in [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20] {
        let calls = calls_for(bytes);
        let sizes = |_| (bytes, bytes);
        let mc = per_call(1, &sizes, calls, &|_, dst, src| {
            dst.copy_from_slice(black_box(src))
        });
        let base = per_call(1, &sizes, calls, &|_, a, _| {
            produce(a, 1);
            black_box(consume(a));
        });
        let sizes = |_| (bytes, 0);
        for n in 2..=max_world {
            for dtype in [DType::F32, DType::BF16] {
                if dtype != DType::F32 && bytes != 4 << 20 {
                    continue;
                }
                let comm = CpuCommunicator::with_timeout(n, Duration::from_secs(60)).unwrap();
                let t = per_call(n, &sizes, calls, &|r, a, _| {
                    comm.all_reduce(r, a, dtype).unwrap()
                });
                let touched = per_call(n, &sizes, calls, &|r, a, _| {
                    produce(a, r as u8);
                    comm.all_reduce(r, a, dtype).unwrap();
                    black_box(consume(a));
                });
                let gbs = |v: &[f64], p| bytes as f64 / pct(v, p) / 1e9;
                let us = |v: &[f64], p| pct(v, p) * 1e6;
                println!(
                    "| {} KiB | {n} | {dtype} | {:.1} / {:.1} | {:.1} / {:.1} | {:.2} | {:.1} / {:.1} \
                     | {:.1} / {:.1} |",
                    bytes >> 10,
                    gbs(&t, 10),
                    gbs(&t, 50),
                    gbs(&mc, 10),
                    gbs(&mc, 50),
                    gbs(&t, 10) / gbs(&mc, 10),
                    us(&t, 10),
                    us(&t, 50),
                    us(&touched, 10) - us(&base, 10),
                    us(&touched, 50) - us(&base, 50),
                );
            }
        }
    }
    println!();
}

fn gather_scatter(max_world: usize) {
    let bytes = 4 << 20;
    for n in 2..=max_world {
        let comm = CpuCommunicator::with_timeout(n, Duration::from_secs(60)).unwrap();
        let per = bytes / 4 / n;
        let mut ext = vec![per; n];
        ext[n - 1] = bytes / 4 - per * (n - 1);
        let layout = SliceLayout::single(1, 4, &ext).unwrap();
        let calls = calls_for(bytes);
        let sizes = |r| (bytes, layout.local_bytes(r));
        let ag = per_call(n, &sizes, calls, &|r, full, local| {
            comm.all_gather(r, local, full, &layout).unwrap()
        });
        let rs = per_call(n, &sizes, calls, &|r, full, local| {
            comm.reduce_scatter(r, full, local, &layout, DType::F32)
                .unwrap()
        });
        println!(
            "4 MiB full tensor, N={n}: all_gather {:.1} / {:.1} GB/s, reduce_scatter {:.1} / {:.1} \
             GB/s (p10 / p50)",
            bytes as f64 / pct(&ag, 10) / 1e9,
            bytes as f64 / pct(&ag, 50) / 1e9,
            bytes as f64 / pct(&rs, 10) / 1e9,
            bytes as f64 / pct(&rs, 50) / 1e9,
        );
    }
    println!();
}

fn latency(max_world: usize) {
    for elems in [512, 576] {
        for n in 2..=max_world {
            let comm = CpuCommunicator::new(n).unwrap();
            let sizes = |_| (elems * 4, 0);
            let t = per_call(n, &sizes, 20_000, &|r, a, _| {
                comm.all_reduce(r, a, DType::F32).unwrap()
            });
            println!(
                "{} B f32 all_reduce, N={n}: p10 {:.2} us, p50 {:.2} us, p90 {:.2} us",
                elems * 4,
                pct(&t, 10) * 1e6,
                pct(&t, 50) * 1e6,
                pct(&t, 90) * 1e6
            );
        }
    }
}
