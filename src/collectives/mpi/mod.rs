//! `MpiCommunicator`: ranks as processes (feature `mpi`). One process is one rank of an MPI
//! job (`mpirun -np N`); [`world`] initializes MPI once per process, and
//! [`MpiCommunicatorFactory`] makes the communicator a distributed meta device uses
//! (`crate::dist`). Only non-blocking point-to-point calls are used (`MPI_Isend`,
//! `MPI_Irecv`, polled with `MPI_Test`), so that every wait has a deadline.
//!
//! # Algorithms (per rank, buffer of B bytes, N ranks)
//!
//! - **all-reduce**: reduce-scatter then all-gather, each a direct exchange (every rank sends
//!   one message to every peer): rank r receives chunk r of every peer's buffer, sums the N
//!   chunks *in rank order*, and sends its summed chunk to every peer. It sends (N-1)/N·B twice:
//!   the bandwidth-optimal 2(N-1)/N·B of a ring (Patarasuk and Yuan, "Bandwidth optimal
//!   all-reduce algorithms for clusters of workstations", JPDC 2009) in 2 rounds of messages
//!   instead of 2(N-1); for the few ranks of one model (N <= 16) the latency of N-1 messages
//!   in flight at once is lower than that of 2(N-1) dependent ring steps. A ring would add
//!   partial sums in a rotated order per chunk (`((x_{r+1} + x_{r+2}) + ...)`), which is not
//!   the in-process communicator's order: the direct exchange keeps it.
//! - **all-gather**: every rank sends its slice to every peer, Σ_{q≠r} local_bytes(q) received.
//! - **reduce-scatter**: rank r sends each peer q the packed slice q of its full tensor and sums
//!   the N slices it receives for itself in rank order.
//! - **broadcast**: the root sends B bytes to every peer.
//!
//! # Determinism
//!
//! The sums are the in-process [`CpuCommunicator`](super::CpuCommunicator)'s: every element is
//! `x_0 + x_1 + ... + x_{N-1}` in rank order through the same kernel (`reduce::sum_into`: f32
//! adds, half types widened and rounded once), computed by one rank and sent to the others,
//! so every rank ends with the same bits, equal to the in-process communicator's for the same
//! inputs (`metashard selftest comm`, `tests/mpi.rs`).
//!
//! # Failure model
//!
//! As in process: any error fails the whole group, and every rank's pending and later calls
//! return an error naming the rank at fault ([`Error::RankFailed`]), never hang:
//! - a rank whose call fails locally (bad arguments, mismatched calls) or whose meta backend
//!   aborts sends an abort message to every peer (a receive for it is always posted, and every
//!   wait polls it), so peers return at once;
//! - a peer process that exits or is killed is seen within about 1 ms when it runs on the same
//!   host (its pid, exchanged at start-up, is polled in `/proc`);
//! - a peer that sends nothing for the timeout (stalled, or on another host and gone) makes
//!   the waiting rank give up then, naming it;
//! - a peer that finished its work normally (the ranks were given different work) says so on
//!   the control channel at the end of its `main` ([`finalize`]): a rank still waiting on it
//!   names it as finished within 200 ms, not as stalled after the timeout (a wait whose part
//!   with that peer is done goes on: the notice can overtake a message's completion);
//! - a process that never starts MPI (one rank given `--help`) is named at start-up, within a
//!   second or a deadline (`startup.rs`), instead of leaving the others in `MPI_Init_thread`.
//!
//! Messages carry a header (sequence number, collective, dtype, sizes, layout fingerprint)
//! that the receiver compares with its own call, so calls that do not match across ranks are
//! an error naming both, not garbage. Data goes through staging buffers owned by the
//! communicator: after a failure, requests still in flight (a peer may deliver late) target
//! memory that is kept forever rather than the caller's buffers. A failed group stays failed
//! and cannot be made again (a process cannot rejoin an MPI job): restart the job.
//!
//! # Threads
//!
//! MPI is initialized with `MPI_THREAD_SERIALIZED`: calls come from the meta backend's worker
//! thread and the main thread, one at a time, all under one lock ([`MpiWorld`]'s state).

mod startup;
mod world;

pub use startup::{INIT_THREAD, STARTUP_TIMEOUT_VAR, startup_timeout};
pub use world::{MpiWorld, Peer, abort, finalize, started_rank, world};

use super::reduce::{check_reducible, sum_into};
use super::{Communicator, CommunicatorFactory, SliceLayout};
use crate::backend::Device;
use crate::buffer::BufferRange;
use crate::{DType, Error, Result};
use std::sync::Arc;
use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::time::Duration;
use world::{Fault, HDR, Kind, State};

/// The chunk of all-reduce rank `r` (elements): equal shares rounded up to whole 64-byte
/// lines, as the in-process communicator cuts them (the result does not depend on it).
fn chunk(world: usize, n: usize, esz: usize, r: usize) -> (usize, usize) {
    let line = (64 / esz).max(1);
    let per = n.div_ceil(world).div_ceil(line) * line;
    let lo = per.saturating_mul(r).min(n);
    (lo, per.saturating_add(lo).min(n))
}

/// A communicator over the process's [`MpiWorld`]: rank r of the group is MPI rank r, and only
/// this process's rank may call it. See the module doc.
pub struct MpiCommunicator {
    world: Arc<MpiWorld>,
    timeout: Duration,
}

/// What a collective body returns: a local error (this rank's arguments) or a fault.
enum Failure {
    Local(String),
    Fault(Fault),
}

impl From<Fault> for Failure {
    fn from(f: Fault) -> Self {
        Failure::Fault(f)
    }
}

impl From<String> for Failure {
    fn from(s: String) -> Self {
        Failure::Local(s)
    }
}

type Body<'a> = dyn FnOnce(&MpiWorld, &mut State) -> std::result::Result<(), Failure> + 'a;

impl MpiCommunicator {
    /// A communicator over `world` whose waits give up after `timeout`.
    pub fn new(world: Arc<MpiWorld>, timeout: Duration) -> Self {
        MpiCommunicator { world, timeout }
    }

    pub fn world(&self) -> &Arc<MpiWorld> {
        &self.world
    }

    fn run(&self, name: &'static str, rank: usize, body: Box<Body<'_>>) -> Result<()> {
        let w = &*self.world;
        if rank != w.rank {
            return Err(Error::Collective {
                collective: name,
                rank,
                world: w.size,
                reason: format!(
                    "this process is rank {}; rank {rank} lives in another process",
                    w.rank
                ),
            });
        }
        let mut st = w.state.lock();
        if w.failed.load(Acquire) || w.finalized.load(Acquire) {
            // An abort from another thread that could not take the lock has not told the
            // peers yet: tell them now (once).
            w.notify(&mut st);
            return Err(w.failed_error(name));
        }
        match body(w, &mut st) {
            Ok(()) => Ok(()),
            Err(Failure::Local(reason)) => {
                let fault = Fault {
                    culprit: w.rank,
                    reason: format!("rank {} in {name}: {reason}", w.rank),
                };
                w.fail(fault, Some(&mut st), true);
                Err(Error::Collective {
                    collective: name,
                    rank,
                    world: w.size,
                    reason,
                })
            }
            Err(Failure::Fault(f)) => {
                w.fail(f, Some(&mut st), true);
                Err(w.failed_error(name))
            }
        }
    }

    /// All-reduce over a host slice (see [`Communicator::all_reduce`]).
    pub fn all_reduce_host(&self, rank: usize, buf: &mut [u8], dtype: DType) -> Result<()> {
        let timeout = self.timeout;
        self.run(
            "all_reduce",
            rank,
            Box::new(move |w, st| {
                let len = buf.len();
                let esz = check_reducible(dtype, "buffer", len)?;
                let n = w.size;
                if n == 1 {
                    return Ok(());
                }
                let me = w.rank;
                let ch = |r: usize| {
                    let (lo, hi) = chunk(n, len / esz, esz, r);
                    (lo * esz, hi * esz)
                };
                let peers: Vec<usize> = (0..n).filter(|&q| q != me).collect();
                let (lo, hi) = ch(me);
                // Reduce-scatter: chunk q of this buffer to rank q; chunk `me` of every peer's.
                let sig = w.next_sig(st, Kind::AllReduceScatter, Some(dtype), 0, len, 0);
                let sends: Vec<(usize, usize)> = peers
                    .iter()
                    .map(|&q| {
                        let (a, b) = ch(q);
                        (q, b - a)
                    })
                    .collect();
                let recvs: Vec<(usize, usize)> = peers.iter().map(|&q| (q, hi - lo)).collect();
                let src: &[u8] = buf;
                w.exchange(
                    st,
                    &sig,
                    &sends,
                    &recvs,
                    &mut |q, out| {
                        let (a, b) = ch(q);
                        out.copy_from_slice(&src[a..b]);
                        Ok(())
                    },
                    timeout,
                )?;
                // Sum chunk `me` of every rank in rank order, into this buffer's chunk.
                let dst = buf[lo..hi].as_mut_ptr();
                let srcs: Vec<*const u8> = (0..n)
                    .map(|q| {
                        if q == me {
                            dst.cast_const()
                        } else {
                            st.recv[q][HDR..].as_ptr()
                        }
                    })
                    .collect();
                // SAFETY: every source holds hi - lo bytes (received messages were checked to
                // be whole: their headers matched and MPI refuses longer ones; shorter ones
                // leave the zero-filled tail, caught by the header check of a matching size).
                // The destination is this rank's own chunk, equal to source `me`, which
                // `sum_into` allows; nothing else touches these buffers now.
                unsafe { sum_into(dtype, &[dst], &srcs, (hi - lo) / esz) };
                // All-gather: this chunk to every peer; chunk q from rank q.
                let sig = w.next_sig(st, Kind::AllReduceGather, Some(dtype), 0, len, 0);
                let sends: Vec<(usize, usize)> = peers.iter().map(|&q| (q, hi - lo)).collect();
                let recvs: Vec<(usize, usize)> = peers
                    .iter()
                    .map(|&q| {
                        let (a, b) = ch(q);
                        (q, b - a)
                    })
                    .collect();
                let mine: &[u8] = &buf[lo..hi];
                w.exchange(
                    st,
                    &sig,
                    &sends,
                    &recvs,
                    &mut |_, out| {
                        out.copy_from_slice(mine);
                        Ok(())
                    },
                    timeout,
                )?;
                for &q in &peers {
                    let (a, b) = ch(q);
                    buf[a..b].copy_from_slice(&st.recv[q][HDR..]);
                }
                Ok(())
            }),
        )
    }

    /// All-gather over host slices (see [`Communicator::all_gather`]).
    pub fn all_gather_host(
        &self,
        rank: usize,
        local: &[u8],
        full: &mut [u8],
        layout: &SliceLayout,
    ) -> Result<()> {
        let timeout = self.timeout;
        self.run(
            "all_gather",
            rank,
            Box::new(move |w, st| {
                if layout.world() != w.size {
                    return Err(format!(
                        "layout has {} ranks, the communicator {}",
                        layout.world(),
                        w.size
                    )
                    .into());
                }
                layout
                    .gather_into(local, w.rank, full)
                    .map_err(|e| e.to_string())?;
                if w.size == 1 {
                    return Ok(());
                }
                let sig = w.next_sig(
                    st,
                    Kind::AllGather,
                    None,
                    0,
                    full.len(),
                    layout.fingerprint(),
                );
                let peers: Vec<usize> = (0..w.size).filter(|&q| q != w.rank).collect();
                let sends: Vec<(usize, usize)> = peers.iter().map(|&q| (q, local.len())).collect();
                let recvs: Vec<(usize, usize)> =
                    peers.iter().map(|&q| (q, layout.local_bytes(q))).collect();
                w.exchange(
                    st,
                    &sig,
                    &sends,
                    &recvs,
                    &mut |_, out| {
                        out.copy_from_slice(local);
                        Ok(())
                    },
                    timeout,
                )?;
                for &q in &peers {
                    layout
                        .gather_into(&st.recv[q][HDR..], q, full)
                        .map_err(|e| e.to_string())?;
                }
                Ok(())
            }),
        )
    }

    /// Reduce-scatter over host slices (see [`Communicator::reduce_scatter`]).
    pub fn reduce_scatter_host(
        &self,
        rank: usize,
        full: &[u8],
        local: &mut [u8],
        layout: &SliceLayout,
        dtype: DType,
    ) -> Result<()> {
        let timeout = self.timeout;
        self.run(
            "reduce_scatter",
            rank,
            Box::new(move |w, st| {
                if layout.world() != w.size {
                    return Err(format!(
                        "layout has {} ranks, the communicator {}",
                        layout.world(),
                        w.size
                    )
                    .into());
                }
                layout
                    .check_sizes("reduce_scatter", full.len(), w.rank, local.len())
                    .map_err(|e| e.to_string())?;
                let esz = check_reducible(dtype, "layout unit", layout.unit_bytes())?;
                // This rank's own term first: its slice of its full tensor.
                layout
                    .scatter(full, w.rank, local)
                    .map_err(|e| e.to_string())?;
                if w.size == 1 {
                    return Ok(());
                }
                let sig = w.next_sig(
                    st,
                    Kind::ReduceScatter,
                    Some(dtype),
                    0,
                    full.len(),
                    layout.fingerprint(),
                );
                let peers: Vec<usize> = (0..w.size).filter(|&q| q != w.rank).collect();
                let sends: Vec<(usize, usize)> =
                    peers.iter().map(|&q| (q, layout.local_bytes(q))).collect();
                let recvs: Vec<(usize, usize)> = peers.iter().map(|&q| (q, local.len())).collect();
                w.exchange(
                    st,
                    &sig,
                    &sends,
                    &recvs,
                    &mut |q, out| layout.scatter(full, q, out).map_err(|e| e.to_string()),
                    timeout,
                )?;
                let dst = local.as_mut_ptr();
                let srcs: Vec<*const u8> = (0..w.size)
                    .map(|q| {
                        if q == w.rank {
                            dst.cast_const()
                        } else {
                            st.recv[q][HDR..].as_ptr()
                        }
                    })
                    .collect();
                // SAFETY: every source holds local.len() bytes (as in all_reduce); the
                // destination is `local`, exclusively ours and equal to source `rank`.
                unsafe { sum_into(dtype, &[dst], &srcs, local.len() / esz) };
                Ok(())
            }),
        )
    }

    /// Broadcast over a host slice (see [`Communicator::broadcast`]).
    pub fn broadcast_host(&self, rank: usize, root: usize, buf: &mut [u8]) -> Result<()> {
        let timeout = self.timeout;
        self.run(
            "broadcast",
            rank,
            Box::new(move |w, st| {
                if root >= w.size {
                    return Err(format!("root {root} is out of range").into());
                }
                if w.size == 1 {
                    return Ok(());
                }
                let sig = w.next_sig(st, Kind::Broadcast, None, root, buf.len(), 0);
                let me = w.rank;
                let len = buf.len();
                let peers: Vec<(usize, usize)> =
                    (0..w.size).filter(|&q| q != me).map(|q| (q, len)).collect();
                let (sends, recvs) = if me == root {
                    (peers, vec![])
                } else {
                    (vec![], vec![(root, len)])
                };
                let src: &[u8] = buf;
                w.exchange(
                    st,
                    &sig,
                    &sends,
                    &recvs,
                    &mut |_, out| {
                        out.copy_from_slice(src);
                        Ok(())
                    },
                    timeout,
                )?;
                if me != root {
                    buf.copy_from_slice(&st.recv[root][HDR..]);
                }
                Ok(())
            }),
        )
    }
}

/// The host slice of a buffer handle (see `cpu.rs`'s function of the same name).
///
/// # Safety
/// The slice must not outlive the buffer, and nothing else may access the range while it is
/// used (the trait's contract: the caller leaves its buffers alone during a collective).
unsafe fn host_slice<'a>(b: &BufferRange) -> Result<&'a mut [u8]> {
    let p = b.host_ptr()?;
    // SAFETY: `host_ptr` checked that `len` bytes from `p` lie inside the buffer's host
    // allocation; exclusivity is the caller's contract above.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, b.len) })
}

impl Communicator for MpiCommunicator {
    fn name(&self) -> String {
        format!("mpi({})", self.world.size)
    }

    fn world_size(&self) -> usize {
        self.world.size
    }

    fn all_reduce(&self, rank: usize, buf: &BufferRange, dtype: DType) -> Result<()> {
        // SAFETY: the handle keeps the buffer alive through the call; the caller leaves it
        // alone until the call returns (the trait's contract).
        let b = unsafe { host_slice(buf)? };
        self.all_reduce_host(rank, b, dtype)
    }

    fn all_gather(
        &self,
        rank: usize,
        local: &BufferRange,
        full: &BufferRange,
        layout: &SliceLayout,
    ) -> Result<()> {
        // SAFETY: as in all_reduce; `local` and `full` are distinct tensors of one program.
        let (l, f) = unsafe { (host_slice(local)?, host_slice(full)?) };
        self.all_gather_host(rank, l, f, layout)
    }

    fn reduce_scatter(
        &self,
        rank: usize,
        full: &BufferRange,
        local: &BufferRange,
        layout: &SliceLayout,
        dtype: DType,
    ) -> Result<()> {
        // SAFETY: as in all_gather.
        let (f, l) = unsafe { (host_slice(full)?, host_slice(local)?) };
        self.reduce_scatter_host(rank, f, l, layout, dtype)
    }

    fn broadcast(&self, rank: usize, root: usize, buf: &BufferRange) -> Result<()> {
        // SAFETY: as in all_reduce.
        let b = unsafe { host_slice(buf)? };
        self.broadcast_host(rank, root, b)
    }

    fn abort(&self, rank: usize, reason: &str) {
        self.world.fail(
            Fault {
                culprit: rank,
                reason: format!("rank {rank} aborted: {reason}"),
            },
            None,
            true,
        );
    }

    fn failure(&self) -> Option<String> {
        self.world
            .fault()
            .map(|(r, why)| format!("rank {r} failed: {why}"))
    }

    fn bytes_moved(&self, rank: usize) -> u64 {
        if rank == self.world.rank {
            self.world.bytes_moved.load(Relaxed)
        } else {
            0
        }
    }
}

/// Makes [`MpiCommunicator`]s over this process's world: the communicator every device of a
/// distributed meta device offers (`crate::dist`). Its waits give up after 3/4 of the meta
/// device's timeout, so that a peer that stalls is named by the communicator before the meta
/// backend's stall watchdog would blame the rank waiting for it.
pub struct MpiCommunicatorFactory {
    pub world: Arc<MpiWorld>,
}

impl CommunicatorFactory for MpiCommunicatorFactory {
    fn name(&self) -> String {
        "mpi".into()
    }

    fn create(
        &self,
        devices: &[Arc<dyn Device>],
        timeout: Duration,
    ) -> Result<Arc<dyn Communicator>> {
        let w = &self.world;
        if devices.len() != w.size {
            return Err(Error::Device {
                device: "mpi".into(),
                reason: format!(
                    "{} devices but {} MPI processes: each process is one rank",
                    devices.len(),
                    w.size
                ),
            });
        }
        if w.failed.load(Acquire) {
            return Err(w.failed_error("create"));
        }
        Ok(Arc::new(MpiCommunicator::new(
            w.clone(),
            timeout.mul_f64(0.75),
        )))
    }
}
