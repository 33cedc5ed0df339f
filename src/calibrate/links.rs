//! Link timing: collectives of the in-process host communicator on N workers pinned like the
//! meta device's, timed per size (the median per call of the slowest rank) and fitted per
//! collective by the planner (`planner::fit`).

use super::options::{Budget, COMM_TIMEOUT, STALL_TIMEOUT};
use super::rig::median;
use crate::collectives::{CpuCommunicator, SliceLayout};
use crate::planner::Collective;
use crate::planner::LinkLevel;
use crate::planner::fit::{
    LEVEL_COLLECTIVES, LinkFitReport, LinkSample, fit_collective, level_from_fits,
    single_device_level,
};
use crate::workers::{DeviceWorkers, Job, Outcome, Progress};
use crate::{DType, Error, Result};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Instant;

/// The links of `n` devices: for each group size 2..=n, every collective of
/// [`LEVEL_COLLECTIVES`] timed at each size of the budget, then fitted per collective. One
/// device never communicates: its level only keeps the profile valid (`mem_bw` as bandwidth).
pub(super) fn measure_links(
    n: usize,
    b: &Budget,
    step: &dyn Fn(&str),
    mem_bw: f64,
) -> Result<(LinkLevel, Vec<LinkFitReport>)> {
    if n < 2 {
        return Ok((single_device_level(mem_bw), Vec::new()));
    }
    let mut samples: Vec<(Collective, Vec<LinkSample>)> =
        LEVEL_COLLECTIVES.iter().map(|&c| (c, Vec::new())).collect();
    for world in 2..=n {
        measure_world(world, b, step, &mut samples)?;
    }
    let mut links = Vec::new();
    for (c, s) in samples {
        links.push(fit_collective(c, s)?);
    }
    let level = level_from_fits("host memory (in-process CpuCommunicator)", &links);
    Ok((level, links))
}

/// A 64-byte aligned, 64-byte granular line of host memory.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// A buffer of whole lines, viewed as bytes.
struct Lines(Vec<Line>);

impl Lines {
    fn filled(bytes: usize, v: f32) -> Lines {
        Lines(vec![Line([v; 16]); bytes.div_ceil(64)])
    }
    fn bytes(&mut self) -> &mut [u8] {
        let len = self.0.len() * 64;
        // SAFETY: the vector owns `len` initialized bytes (Line is 64 bytes of f32, no
        // padding), borrowed exclusively here; any byte pattern is a valid f32.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u8>(), len) }
    }
}

/// A rank's buffers: all-reduce's buffer; all-gather's local and full; reduce-scatter's full
/// and local.
struct RankBufs {
    a: Lines,
    b: Lines,
}

/// Time one collective of `bytes` (full tensor) on `world` ranks, `reps` calls after
/// `warmup`; per call, the slowest rank's seconds.
fn time_collective(
    workers: &mut DeviceWorkers,
    comm: &Arc<CpuCommunicator>,
    c: Collective,
    bufs: &Arc<Vec<Mutex<RankBufs>>>,
    layout: &Arc<SliceLayout>,
    calls: usize,
) -> Result<Vec<f64>> {
    let world = bufs.len();
    let results: Vec<Arc<Mutex<Result<Vec<f64>>>>> = (0..world)
        .map(|_| Arc::new(Mutex::new(Ok(Vec::new()))))
        .collect();
    let jobs: Vec<Job> = (0..world)
        .map(|r| {
            let (comm, bufs, layout, out) = (
                comm.clone(),
                bufs.clone(),
                layout.clone(),
                results[r].clone(),
            );
            Box::new(move |prog: &Progress| {
                prog.stage(0, true);
                let mut guard = bufs[r].lock();
                let RankBufs { a, b } = &mut *guard;
                let mut times = Vec::with_capacity(calls);
                for _ in 0..calls {
                    let t = Instant::now();
                    let res = match c {
                        Collective::AllReduce => comm.all_reduce(r, a.bytes(), DType::F32),
                        Collective::AllGather => {
                            let local = &a.bytes()[..layout.local_bytes(r)];
                            comm.all_gather(
                                r,
                                local,
                                &mut b.bytes()[..layout.full_bytes()],
                                &layout,
                            )
                        }
                        Collective::ReduceScatter => comm.reduce_scatter(
                            r,
                            &a.bytes()[..layout.full_bytes()],
                            &mut b.bytes()[..layout.local_bytes(r)],
                            &layout,
                            DType::F32,
                        ),
                        Collective::Broadcast => comm.broadcast(r, 0, a.bytes()),
                    };
                    if let Err(e) = res {
                        *out.lock() = Err(e);
                        return;
                    }
                    times.push(t.elapsed().as_secs_f64());
                }
                *out.lock() = Ok(times);
            }) as Job
        })
        .collect();
    match workers.run(jobs, STALL_TIMEOUT, &|_| {})? {
        Outcome::Done => {}
        Outcome::Stalled { devices, .. } => {
            return Err(Error::Collective {
                collective: "calibrate",
                rank: devices[0],
                world,
                reason: format!("a timed {} stalled", c.name()),
            });
        }
    }
    let mut per_rank = Vec::with_capacity(world);
    for r in results {
        per_rank.push(std::mem::replace(&mut *r.lock(), Ok(Vec::new()))?);
    }
    Ok((0..calls)
        .map(|i| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect())
}

fn measure_world(
    world: usize,
    b: &Budget,
    step: &dyn Fn(&str),
    samples: &mut [(Collective, Vec<LinkSample>)],
) -> Result<()> {
    let comm = Arc::new(CpuCommunicator::with_timeout(world, COMM_TIMEOUT)?);
    let mut workers = DeviceWorkers::new(world, "calibrate-link")?;
    for (c, out) in samples.iter_mut() {
        let c = *c;
        for &size in &b.link_sizes {
            step(&format!("{} N={world} {}", c.name(), human_bytes(size)));
            // Whole 64-byte lines per rank, so every rank's slice is whole F32 elements.
            let bytes = size.next_multiple_of(64 * world);
            let per_rank = bytes / world;
            let layout = Arc::new(SliceLayout::single(1, 4, &vec![per_rank / 4; world])?);
            // Fill with -0.0: pages really allocated (no shared zero page), and sums of -0.0
            // stay -0.0 however many all-reduces run in place.
            let bufs: Arc<Vec<Mutex<RankBufs>>> = Arc::new(
                (0..world)
                    .map(|_| {
                        let (a, b) = match c {
                            Collective::AllGather => (per_rank, bytes),
                            Collective::ReduceScatter => (bytes, per_rank),
                            _ => (bytes, 0),
                        };
                        Mutex::new(RankBufs {
                            a: Lines::filled(a, -0.0),
                            b: Lines::filled(b, -0.0),
                        })
                    })
                    .collect(),
            );
            let warm = time_collective(&mut workers, &comm, c, &bufs, &layout, 3)?;
            let est = median(&warm).max(1e-7);
            let reps = ((b.link_time / est) as usize).clamp(b.link_min_reps, 2000);
            let t = time_collective(&mut workers, &comm, c, &bufs, &layout, reps)?;
            out.push(LinkSample {
                n: world,
                bytes,
                seconds: median(&t),
                reps,
            });
        }
    }
    Ok(())
}

fn human_bytes(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else {
        format!("{} KiB", b >> 10)
    }
}
