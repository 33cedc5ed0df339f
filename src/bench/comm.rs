//! `metashard selftest comm` and `metashard bench comm`: a job communicator (ranks as
//! processes, `--dist mpi` under `mpirun`) checked bit for bit against the in-process
//! `CpuCommunicator` on the same inputs, with optional fault injection, and the collectives'
//! bus bandwidth over it or in process.
//!
//! The check: every rank generates every rank's inputs from fixed seeds, runs the in-process
//! communicator over N threads on all of them (the reference), runs the job communicator on its
//! own, and compares its result with the reference's for its rank, byte for byte. The
//! reference gives every rank the same bits, so equality on every rank also proves the ranks
//! agree.

use crate::cli::{DistArgs, JsonArgs, parse_positive};
use metashard::buffer::{BufferRange, Storage};
use metashard::collectives::{Communicator, CpuCommunicator, SliceLayout};
use metashard::dist::Dist;
use metashard::{DType, Error, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Debug, clap::Args)]
#[command(mut_arg("json", |a| a.help("Print the rows as JSON instead of a table")))]
pub struct BenchCommArgs {
    #[command(flatten)]
    pub dist: DistArgs,
    /// Ranks of the in-process communicator (without --dist mpi).
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// Buffer sizes in bytes.
    #[arg(long, value_delimiter = ',', default_values_t = vec![65536usize, 1 << 20, 16 << 20])]
    pub bytes: Vec<usize>,
    /// Timed calls per size (median reported; at least 1).
    #[arg(long, default_value_t = 20, value_parser = parse_positive)]
    pub reps: usize,
    #[command(flatten)]
    pub out: JsonArgs,
}

/// `bench comm`: time the collectives (every rank of a job takes part); rank 0 prints.
pub fn run(a: &BenchCommArgs) -> Result<()> {
    let rows = bench(a.dist.dist, a.world, &a.bytes, a.reps)?;
    if metashard::dist::rank_and_size(a.dist.dist)?.0 == 0 {
        a.out.print("command output", &rows, |r| print_table(r))?;
    }
    Ok(())
}

/// What an injected fault does when rank `rank` reaches its collective number `at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultHow {
    /// SIGKILL itself.
    Kill,
    /// Exit with status 3 at once.
    Exit,
    /// Sleep for an hour inside the job (a stalled rank).
    Stall,
    /// Abort the group with an error.
    Error,
    /// Stop before that call and end normally, as a rank given less work would.
    Finish,
}

#[derive(Clone, Copy, Debug)]
pub struct Fault {
    pub how: FaultHow,
    pub rank: usize,
    pub at: usize,
}

/// `HOW@RANK:CALL`, e.g. `kill@1:5`.
pub fn parse_fault(s: &str) -> std::result::Result<Fault, String> {
    let bad =
        || format!("`{s}` is not HOW@RANK:CALL with HOW one of kill, exit, stall, error, finish");
    let (how, rest) = s.split_once('@').ok_or_else(bad)?;
    let (rank, at) = rest.split_once(':').ok_or_else(bad)?;
    let how = match how {
        "kill" => FaultHow::Kill,
        "exit" => FaultHow::Exit,
        "stall" => FaultHow::Stall,
        "error" => FaultHow::Error,
        "finish" => FaultHow::Finish,
        _ => return Err(bad()),
    };
    Ok(Fault {
        how,
        rank: rank.parse().map_err(|_| bad())?,
        at: at.parse().map_err(|_| bad())?,
    })
}

/// A host buffer of `len` bytes holding `data` (or zeros), as a collective takes it.
fn host_range(len: usize, data: Option<&[u8]>) -> Result<BufferRange> {
    let buf = metashard::BufferType::alloc_buffer(&metashard::cpu::CpuBufferType, len.max(1))?;
    let p = buf.host_ptr().ok_or_else(|| Error::Device {
        device: "cpu".into(),
        reason: "host buffer without a host pointer".into(),
    })?;
    // SAFETY: a fresh host allocation of at least `len` bytes, not shared yet.
    let s = unsafe { std::slice::from_raw_parts_mut(p, len) };
    match data {
        Some(d) => s.copy_from_slice(d),
        None => s.fill(0),
    }
    Ok(BufferRange::new(Storage::new(buf, 0), len))
}

fn bytes_of(r: &BufferRange) -> Result<Vec<u8>> {
    let p = r.host_ptr()?;
    // SAFETY: the range lies in the buffer's host allocation (checked by host_ptr) and no
    // collective is running on it.
    Ok(unsafe { std::slice::from_raw_parts(p, r.len) }.to_vec())
}

/// Deterministic values of `dtype` with magnitudes over six decades and both signs, so that
/// a different summation order would change the rounding.
fn values(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(n * dtype.type_size());
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let m = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        let v = m * 10f32.powi((x % 7) as i32 - 3);
        match dtype {
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_bits().to_ne_bytes()),
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_ne_bytes()),
            _ => out.extend_from_slice(&v.to_ne_bytes()),
        }
    }
    out
}

/// One collective call with every rank's inputs.
enum Case {
    AllReduce { dtype: DType, n: usize },
    AllGather { layout: SliceLayout },
    ReduceScatter { dtype: DType, layout: SliceLayout },
    Broadcast { root: usize, len: usize },
}

impl Case {
    fn describe(&self) -> String {
        match self {
            Case::AllReduce { dtype, n } => format!("all_reduce {n} x {dtype}"),
            Case::AllGather { layout } => format!("all_gather of {} B", layout.full_bytes()),
            Case::ReduceScatter { dtype, layout } => {
                format!("reduce_scatter of {} B {dtype}", layout.full_bytes())
            }
            Case::Broadcast { root, len } => format!("broadcast of {len} B from {root}"),
        }
    }
}

fn cases(world: usize) -> Result<Vec<Case>> {
    let mut v = Vec::new();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for n in [1, 33, 1000, 70_001] {
            v.push(Case::AllReduce { dtype, n });
        }
    }
    // Uneven extents with zeros, and a segmented layout (a fused QKV-like tensor).
    let uneven: Vec<usize> = (0..world).map(|q| (q * 5 + 3) % 7).collect();
    let even: Vec<usize> = vec![4; world];
    for (outer, unit, segs) in [
        (3, 8, vec![uneven.clone()]),
        (1, 4, vec![even.clone()]),
        (2, 16, vec![uneven.clone(), even.clone()]),
    ] {
        v.push(Case::AllGather {
            layout: SliceLayout::new(outer, unit, &segs)?,
        });
        for dtype in [DType::F32, DType::F16] {
            v.push(Case::ReduceScatter {
                dtype,
                layout: SliceLayout::new(outer, unit, &segs)?,
            });
        }
    }
    for root in 0..world {
        v.push(Case::Broadcast { root, len: 1000 });
    }
    Ok(v)
}

/// Inputs of `rank` for case `i`.
fn inputs(case: &Case, i: usize, rank: usize) -> Vec<u8> {
    let seed = (i as u64) << 8 | rank as u64;
    match case {
        Case::AllReduce { dtype, n } => values(*dtype, *n, seed),
        Case::AllGather { layout } => values(DType::F32, layout.local_bytes(rank) / 4, seed),
        Case::ReduceScatter { dtype, layout } => {
            values(*dtype, layout.full_bytes() / dtype.type_size(), seed)
        }
        Case::Broadcast { len, .. } => values(DType::F32, len / 4, seed),
    }
}

/// Run `case` as `rank` on `comm` with input bytes `input`; the result bytes.
fn run_case(comm: &dyn Communicator, rank: usize, case: &Case, input: &[u8]) -> Result<Vec<u8>> {
    match case {
        Case::AllReduce { dtype, .. } => {
            let b = host_range(input.len(), Some(input))?;
            comm.all_reduce(rank, &b, *dtype)?;
            bytes_of(&b)
        }
        Case::AllGather { layout } => {
            let l = host_range(input.len(), Some(input))?;
            let f = host_range(layout.full_bytes(), None)?;
            comm.all_gather(rank, &l, &f, layout)?;
            bytes_of(&f)
        }
        Case::ReduceScatter { dtype, layout } => {
            let f = host_range(input.len(), Some(input))?;
            let l = host_range(layout.local_bytes(rank), None)?;
            comm.reduce_scatter(rank, &f, &l, layout, *dtype)?;
            bytes_of(&l)
        }
        Case::Broadcast { root, .. } => {
            let b = host_range(input.len(), Some(input))?;
            comm.broadcast(rank, *root, &b)?;
            bytes_of(&b)
        }
    }
}

/// The in-process communicator's result for `rank` (all ranks run on threads here).
fn reference(world: usize, case: &Case, i: usize, rank: usize) -> Result<Vec<u8>> {
    let comm = CpuCommunicator::new(world)?;
    let results: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|q| {
                let comm = &comm;
                s.spawn(move || run_case(comm, q, case, &inputs(case, i, q)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Internal {
                        component: "selftest comm",
                        reason: "a reference thread panicked".into(),
                    })
                })
            })
            .collect()
    });
    results.into_iter().nth(rank).expect("one result per rank")
}

fn inject(f: &Fault, comm: &dyn Communicator, rank: usize) -> Result<()> {
    eprintln!("rank {rank}: injecting {:?} at call {}", f.how, f.at);
    match f.how {
        // SAFETY: raising a signal at ourselves has no memory effect; SIGKILL ends the process.
        FaultHow::Kill => unsafe {
            libc::raise(libc::SIGKILL);
        },
        FaultHow::Exit => std::process::exit(3),
        FaultHow::Stall => std::thread::sleep(Duration::from_secs(3600)),
        // `selftest` returns before the call.
        FaultHow::Finish => {}
        FaultHow::Error => {
            comm.abort(rank, "an injected error");
            return Err(Error::Collective {
                collective: "selftest",
                rank,
                world: comm.world_size(),
                reason: "an injected error (--fault)".into(),
            });
        }
    }
    Ok(())
}

/// Run every case on the job communicator and compare with the in-process reference; returns
/// the number of cases. An injected fault fires at its call on its rank.
pub fn selftest(dist: Dist, timeout: Duration, fault: Option<Fault>) -> Result<usize> {
    let (rank, comm) = metashard::dist::job_communicator(dist, timeout)?;
    let world = comm.world_size();
    let all = cases(world)?;
    for (i, case) in all.iter().enumerate() {
        if let Some(f) = fault.filter(|f| f.rank == rank && f.at == i) {
            inject(&f, comm.as_ref(), rank)?;
            if f.how == FaultHow::Finish {
                return Ok(i);
            }
        }
        let t = Instant::now();
        let got =
            run_case(comm.as_ref(), rank, case, &inputs(case, i, rank)).inspect_err(|_| {
                crate::cli::eprint_line(format!(
                    "rank {rank}: call {i} ({}) failed after {:.3} s",
                    case.describe(),
                    t.elapsed().as_secs_f64()
                ))
            })?;
        let want = reference(world, case, i, rank)?;
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b);
            return Err(Error::Collective {
                collective: "selftest",
                rank,
                world,
                reason: format!(
                    "{}: {} differs from the in-process communicator (first byte {at:?}, {} vs \
                     {} bytes)",
                    case.describe(),
                    comm.name(),
                    got.len(),
                    want.len()
                ),
            });
        }
    }
    Ok(all.len())
}

/// One row of `bench comm`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CommRow {
    pub communicator: String,
    /// Ranks in the group.
    pub ranks: usize,
    pub collective: &'static str,
    pub bytes: usize,
    pub median_us: f64,
    /// Bus bandwidth in GB/s: the bytes each rank must move, per second (nccl-tests' busbw,
    /// NVIDIA/nccl-tests doc/PERFORMANCE.md): all-reduce 2(N-1)/N·B, all-gather and
    /// reduce-scatter (N-1)/N·B.
    pub busbw_gbs: f64,
}

/// Time all-reduce, all-gather and reduce-scatter of each size: on the job communicator (`Dist::Mpi`, every
/// rank calls this), or on the in-process communicator over `world` threads (`Dist::Local`).
pub fn bench(dist: Dist, world: usize, sizes: &[usize], reps: usize) -> Result<Vec<CommRow>> {
    match dist {
        Dist::Mpi => {
            let (rank, comm) = metashard::dist::job_communicator(dist, Duration::from_secs(60))?;
            bench_ranks(&[(rank, comm)], sizes, reps)
        }
        Dist::Local => {
            let comm: Arc<dyn Communicator> = Arc::new(CpuCommunicator::new(world)?);
            let ranks: Vec<_> = (0..world).map(|r| (r, comm.clone())).collect();
            bench_ranks(&ranks, sizes, reps)
        }
    }
}

/// Every rank in `ranks` runs on its own thread; rank 0's timings (or the first listed).
fn bench_ranks(
    ranks: &[(usize, Arc<dyn Communicator>)],
    sizes: &[usize],
    reps: usize,
) -> Result<Vec<CommRow>> {
    let world = ranks[0].1.world_size();
    let name = ranks[0].1.name();
    let results: Vec<Result<Vec<CommRow>>> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|(rank, comm)| {
                let name = name.clone();
                s.spawn(move || -> Result<Vec<CommRow>> {
                    let mut rows = Vec::new();
                    for &bytes in sizes {
                        let buf = host_range(bytes, Some(&values(DType::F32, bytes / 4, 1)))?;
                        let layout = SliceLayout::single(1, 4, &vec![bytes / 4 / world; world])?;
                        let local = host_range(layout.local_bytes(*rank), None)?;
                        let full = host_range(layout.full_bytes(), None)?;
                        for coll in ["all_reduce", "all_gather", "reduce_scatter"] {
                            let mut times = Vec::with_capacity(reps);
                            for i in 0..reps + 3 {
                                let t = Instant::now();
                                match coll {
                                    "all_reduce" => comm.all_reduce(*rank, &buf, DType::F32)?,
                                    "all_gather" => {
                                        comm.all_gather(*rank, &local, &full, &layout)?
                                    }
                                    _ => comm.reduce_scatter(
                                        *rank,
                                        &full,
                                        &local,
                                        &layout,
                                        DType::F32,
                                    )?,
                                }
                                if i >= 3 {
                                    times.push(t.elapsed().as_secs_f64());
                                }
                            }
                            times.sort_by(f64::total_cmp);
                            let med = times[times.len() / 2];
                            let frac = (world - 1) as f64 / world as f64;
                            let moved = if coll == "all_reduce" {
                                2.0 * frac * bytes as f64
                            } else {
                                frac * layout.full_bytes() as f64
                            };
                            rows.push(CommRow {
                                communicator: name.clone(),
                                ranks: world,
                                collective: coll,
                                bytes,
                                median_us: med * 1e6,
                                busbw_gbs: moved / med / 1e9,
                            });
                        }
                    }
                    Ok(rows)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Internal {
                        component: "bench comm",
                        reason: "a rank thread panicked".into(),
                    })
                })
            })
            .collect()
    });
    let mut first = None;
    for r in results {
        let rows = r?;
        first.get_or_insert(rows);
    }
    Ok(first.unwrap_or_default())
}

pub fn print_table(rows: &[CommRow]) {
    println!(
        "{:<10} {:<12} {:>10} {:>12} {:>12}",
        "comm", "collective", "bytes", "median us", "busbw GB/s"
    );
    for r in rows {
        println!(
            "{:<10} {:<12} {:>10} {:>12.1} {:>12.2}",
            r.communicator, r.collective, r.bytes, r.median_us, r.busbw_gbs
        );
    }
}
