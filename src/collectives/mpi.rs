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
//!   the waiting rank give up then, naming it.
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

use super::reduce::{reducible, sum_into};
use super::{Communicator, CommunicatorFactory, SliceLayout};
use crate::backend::Device;
use crate::buffer::BufferRange;
use crate::{DType, Error, Result};
use mpi::ffi;
use parking_lot::Mutex;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

const TAG_DATA: c_int = 0x6d73;
const TAG_CTRL: c_int = 0x6d74;
/// Bytes of the header in front of every data message.
const HDR: usize = 32;
/// Bytes of an abort message (culprit rank, then the reason in UTF-8).
const CTRL_BYTES: usize = 1024;
/// How long start-up waits for every process to say who it is.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);
/// How often a waiting rank checks that its peers on the same host are alive.
const LIVENESS_EVERY: Duration = Duration::from_millis(1);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    AllReduceScatter = 1,
    AllReduceGather = 2,
    AllGather = 3,
    ReduceScatter = 4,
    Broadcast = 5,
    Hello = 6,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllReduceScatter | Kind::AllReduceGather => "all_reduce",
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Broadcast => "broadcast",
            Kind::Hello => "start-up",
        }
    }
}

/// What a call must agree on across ranks (sent in every message's header).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Sig {
    seq: u64,
    kind: Kind,
    dtype: Option<DType>,
    root: usize,
    /// Buffer bytes (all_reduce, broadcast) or full-tensor bytes (all_gather, reduce_scatter).
    len: usize,
    /// Layout fingerprint, 0 without a layout.
    layout: u64,
}

impl Sig {
    fn encode(&self) -> [u8; HDR] {
        let dt = self
            .dtype
            .and_then(|d| DType::ALL.iter().position(|x| *x == d))
            .map_or(0, |i| i + 1) as u32;
        let mut h = [0u8; HDR];
        h[0..8].copy_from_slice(&self.seq.to_le_bytes());
        h[8..12].copy_from_slice(&(self.kind as u32 | dt << 8).to_le_bytes());
        h[12..16].copy_from_slice(&(self.root as u32).to_le_bytes());
        h[16..24].copy_from_slice(&(self.len as u64).to_le_bytes());
        h[24..32].copy_from_slice(&self.layout.to_le_bytes());
        h
    }

    fn describe(&self) -> String {
        let mut d = format!("call #{} {} of {} B", self.seq, self.kind.name(), self.len);
        if let Some(t) = self.dtype {
            d += &format!(" {t}");
        }
        if self.kind == Kind::Broadcast {
            d += &format!(" from root {}", self.root);
        }
        if self.layout != 0 {
            d += &format!(" layout {:016x}", self.layout);
        }
        d
    }
}

/// Decode a header for an error message.
fn describe_header(h: &[u8]) -> String {
    let u64at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
    let u32at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
    let code = u32at(8);
    let kind = [
        Kind::AllReduceScatter,
        Kind::AllReduceGather,
        Kind::AllGather,
        Kind::ReduceScatter,
        Kind::Broadcast,
        Kind::Hello,
    ]
    .into_iter()
    .find(|k| *k as u32 == code & 0xff);
    let Some(kind) = kind else {
        return format!("an unknown message (code {code:#x})");
    };
    let dtype = match (code >> 8) as usize {
        0 => None,
        i => DType::ALL.get(i - 1).copied(),
    };
    Sig {
        seq: u64at(0),
        kind,
        dtype,
        root: u32at(12) as usize,
        len: u64at(16) as usize,
        layout: u64at(24),
    }
    .describe()
}

/// Who a rank is, exchanged at start-up: its host and pid, to tell a dead peer from a slow one.
#[derive(Clone, Debug)]
pub struct Peer {
    pub host: String,
    pub pid: u32,
}

/// A failure and the rank at fault.
#[derive(Clone, Debug)]
struct Fault {
    culprit: usize,
    reason: String,
}

/// A posted request and the peer it talks to.
struct Req {
    req: ffi::MPI_Request,
    peer: usize,
}

/// Everything that touches MPI, behind one lock.
struct State {
    seq: u64,
    /// Outgoing messages of the current exchange, back to back.
    send: Vec<u8>,
    /// Per peer: the incoming message of the current exchange.
    recv: Vec<Vec<u8>>,
    /// Per peer: the buffer and the posted receive of its abort message.
    ctrl: Vec<(Box<[u8; CTRL_BYTES]>, ffi::MPI_Request)>,
    /// Abort messages already sent.
    notified: bool,
}

// SAFETY: MPI handles (requests) are plain values that MPI lets any thread pass in once it
// runs at MPI_THREAD_SERIALIZED or above (checked in `init`); the state is only used under
// the world's lock, so no two threads call MPI at the same time.
unsafe impl Send for State {}

/// This process's place in the MPI job: its rank, the job size, who the peers are, and the
/// state of the one group every communicator of the process shares.
pub struct MpiWorld {
    rank: usize,
    size: usize,
    peers: Vec<Peer>,
    state: Mutex<State>,
    failed: AtomicBool,
    fault: Mutex<Option<Fault>>,
    bytes_moved: AtomicU64,
    finalized: AtomicBool,
}

static WORLD: OnceLock<std::result::Result<Arc<MpiWorld>, String>> = OnceLock::new();

/// Whether this process was started by an MPI launcher (`mpirun`, `srun`): OpenMPI, PMIx and
/// Slurm set these variables.
pub fn launched_by_mpirun() -> bool {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMIX_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
}

/// This process's MPI world, initializing MPI on the first call.
pub fn world() -> Result<Arc<MpiWorld>> {
    WORLD
        .get_or_init(|| MpiWorld::init().map(Arc::new))
        .clone()
        .map_err(|reason| Error::Device {
            device: "mpi".into(),
            reason,
        })
}

/// This process's rank if MPI was started (by [`world`]), without starting it.
pub fn started_rank() -> Option<usize> {
    match WORLD.get() {
        Some(Ok(w)) => Some(w.rank),
        _ => None,
    }
}

/// Finalize MPI if it was initialized and the group did not fail (`MPI_Finalize` waits for
/// every process, so after a failure it is skipped: the process exits with its error). Call
/// once, at the end of `main`.
pub fn finalize() {
    if let Some(Ok(w)) = WORLD.get() {
        w.finalize();
    }
}

fn mpi_err(rc: c_int) -> String {
    let mut buf = vec![0 as std::os::raw::c_char; 512];
    let mut len: c_int = 0;
    // SAFETY: MPI_Error_string writes at most MPI_MAX_ERROR_STRING (256 in OpenMPI) chars and
    // their count into the buffers we own.
    let ok = unsafe { ffi::MPI_Error_string(rc, buf.as_mut_ptr(), &mut len) };
    if ok != 0 || len <= 0 {
        return format!("MPI error {rc}");
    }
    let bytes: Vec<u8> = buf[..len as usize].iter().map(|&c| c as u8).collect();
    format!("MPI error {rc}: {}", String::from_utf8_lossy(&bytes))
}

fn check(rc: c_int, what: &str) -> std::result::Result<(), String> {
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("{what}: {}", mpi_err(rc)))
    }
}

fn null_request() -> ffi::MPI_Request {
    // SAFETY: a constant the MPI library exports; reading it has no side effect.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

fn comm_world() -> ffi::MPI_Comm {
    // SAFETY: as null_request.
    unsafe { ffi::RSMPI_COMM_WORLD }
}

fn bytes_type() -> ffi::MPI_Datatype {
    // SAFETY: as null_request.
    unsafe { ffi::RSMPI_UINT8_T }
}

/// Whether process `pid` on this host has exited (gone, or a zombie not yet reaped).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => {
            // The state is the first field after the parenthesized command name.
            let state = s
                .rsplit_once(')')
                .and_then(|(_, r)| r.trim_start().chars().next());
            matches!(state, Some('Z' | 'X'))
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

impl MpiWorld {
    fn init() -> std::result::Result<MpiWorld, String> {
        let mut flag: c_int = 0;
        // SAFETY: MPI_Initialized may be called at any time, even before MPI_Init.
        check(
            unsafe { ffi::MPI_Initialized(&mut flag) },
            "MPI_Initialized",
        )?;
        // SAFETY: constants exported by the library.
        let (serialized, world) = unsafe { (ffi::RSMPI_THREAD_SERIALIZED, comm_world()) };
        if flag == 0 {
            let mut provided: c_int = 0;
            // SAFETY: null argc/argv are allowed (MPI-2); called once (guarded by `WORLD`).
            let rc = unsafe {
                ffi::MPI_Init_thread(
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    serialized,
                    &mut provided,
                )
            };
            check(rc, "MPI_Init_thread")?;
            if provided < serialized {
                return Err(format!(
                    "the MPI library gives thread level {provided}, below MPI_THREAD_SERIALIZED \
                     ({serialized}) which the meta backend's worker threads need"
                ));
            }
        }
        // Errors come back as return codes, never as an abort of the job.
        // SAFETY: MPI is initialized; COMM_WORLD and ERRORS_RETURN are valid handles.
        check(
            unsafe { ffi::MPI_Comm_set_errhandler(world, ffi::RSMPI_ERRORS_RETURN) },
            "MPI_Comm_set_errhandler",
        )?;
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: MPI is initialized; the outputs are ours.
        unsafe {
            check(ffi::MPI_Comm_rank(world, &mut rank), "MPI_Comm_rank")?;
            check(ffi::MPI_Comm_size(world, &mut size), "MPI_Comm_size")?;
        }
        let (rank, size) = (rank as usize, size as usize);
        let mut ctrl = Vec::with_capacity(size);
        for q in 0..size {
            let mut buf = Box::new([0u8; CTRL_BYTES]);
            let mut req = null_request();
            if q != rank {
                // SAFETY: the boxed buffer lives in the state until the request is cancelled
                // and completed in `finalize`, or forever (leaked with the state) otherwise.
                let rc = unsafe {
                    ffi::MPI_Irecv(
                        buf.as_mut_ptr().cast::<c_void>(),
                        CTRL_BYTES as c_int,
                        bytes_type(),
                        q as c_int,
                        TAG_CTRL,
                        world,
                        &mut req,
                    )
                };
                check(rc, "MPI_Irecv (abort messages)")?;
            }
            ctrl.push((buf, req));
        }
        let me = Peer {
            host: hostname(),
            pid: std::process::id(),
        };
        let w = MpiWorld {
            rank,
            size,
            peers: vec![me.clone(); size],
            state: Mutex::new(State {
                seq: 0,
                send: Vec::new(),
                recv: vec![Vec::new(); size],
                ctrl,
                notified: false,
            }),
            failed: AtomicBool::new(false),
            fault: Mutex::new(None),
            bytes_moved: AtomicU64::new(0),
            finalized: AtomicBool::new(false),
        };
        // Who is who: 4 bytes of pid, then the host name.
        let mut hello = (me.pid).to_le_bytes().to_vec();
        hello.extend_from_slice(me.host.as_bytes());
        let peers = w.hello(&hello).map_err(|f| {
            format!(
                "start-up: rank {} of {size} did not answer: {}",
                f.culprit, f.reason
            )
        })?;
        // `w` is not shared yet: fill in the peers.
        let mut w = w;
        w.peers = peers;
        Ok(w)
    }

    /// Exchange start-up records with every peer (deadline `STARTUP_TIMEOUT`).
    fn hello(&self, mine: &[u8]) -> std::result::Result<Vec<Peer>, Fault> {
        let mut st = self.state.lock();
        let sig = self.next_sig(&mut st, Kind::Hello, None, 0, 256, 0);
        let peers: Vec<usize> = (0..self.size).filter(|&q| q != self.rank).collect();
        let mut rec = [0u8; 256];
        rec[..mine.len().min(256)].copy_from_slice(&mine[..mine.len().min(256)]);
        let sends: Vec<(usize, usize)> = peers.iter().map(|&q| (q, 256)).collect();
        let recvs: Vec<(usize, usize)> = peers.iter().map(|&q| (q, 256)).collect();
        self.exchange(
            &mut st,
            &sig,
            &sends,
            &recvs,
            &mut |_, out| {
                out.copy_from_slice(&rec);
                Ok(())
            },
            STARTUP_TIMEOUT,
        )?;
        let mut out = Vec::with_capacity(self.size);
        for q in 0..self.size {
            let r = if q == self.rank {
                &rec[..]
            } else {
                &st.recv[q][HDR..]
            };
            let pid = u32::from_le_bytes(r[0..4].try_into().expect("4 bytes"));
            let host = String::from_utf8_lossy(&r[4..])
                .trim_end_matches('\0')
                .to_string();
            out.push(Peer { host, pid });
        }
        Ok(out)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Every rank's host and pid.
    pub fn peers(&self) -> &[Peer] {
        &self.peers
    }

    /// Why the group failed, and which rank was at fault.
    pub fn fault(&self) -> Option<(usize, String)> {
        self.fault
            .lock()
            .as_ref()
            .map(|f| (f.culprit, f.reason.clone()))
    }

    fn next_sig(
        &self,
        st: &mut State,
        kind: Kind,
        dtype: Option<DType>,
        root: usize,
        len: usize,
        layout: u64,
    ) -> Sig {
        st.seq += 1;
        Sig {
            seq: st.seq,
            kind,
            dtype,
            root,
            len,
            layout,
        }
    }

    fn describe_peer(&self, q: usize) -> String {
        match self.peers.get(q) {
            Some(p) => format!("rank {q} (pid {} on {})", p.pid, p.host),
            None => format!("rank {q}"),
        }
    }

    /// Record the group's failure (the first one wins) and tell the peers, unless the fault
    /// came from one of them through an abort message. `st` is the locked state when the
    /// caller holds it.
    fn fail(&self, fault: Fault, st: Option<&mut State>, tell: bool) {
        {
            let mut f = self.fault.lock();
            if f.is_none() {
                *f = Some(fault);
            }
        }
        self.failed.store(true, Release);
        if !tell {
            return;
        }
        match st {
            Some(st) => self.notify(st),
            // Another thread may be waiting inside a call with the lock: it notifies when it
            // sees the flag (`wait`).
            None => {
                if let Some(mut st) = self.state.try_lock() {
                    self.notify(&mut st);
                }
            }
        }
    }

    /// Send an abort message to every peer, once. Fire and forget: the request is freed and
    /// the message buffer leaked, as a dead peer never completes it.
    fn notify(&self, st: &mut State) {
        if st.notified || self.finalized.load(Acquire) {
            return;
        }
        st.notified = true;
        let Some(f) = self.fault.lock().clone() else {
            return;
        };
        let mut msg = vec![0u8; CTRL_BYTES];
        msg[..4].copy_from_slice(&(f.culprit as u32).to_le_bytes());
        let text = f.reason.as_bytes();
        let n = text.len().min(CTRL_BYTES - 4);
        msg[4..4 + n].copy_from_slice(&text[..n]);
        let msg: &'static [u8] = Vec::leak(msg);
        for q in (0..self.size).filter(|&q| q != self.rank) {
            let mut req = null_request();
            // SAFETY: `msg` is leaked, so valid for as long as MPI may read it; freeing the
            // request lets the send complete in the background.
            unsafe {
                if ffi::MPI_Isend(
                    msg.as_ptr().cast::<c_void>(),
                    CTRL_BYTES as c_int,
                    bytes_type(),
                    q as c_int,
                    TAG_CTRL,
                    comm_world(),
                    &mut req,
                ) == 0
                {
                    ffi::MPI_Request_free(&mut req);
                }
            }
        }
    }

    /// An abort message from a peer, if one arrived.
    fn poll_ctrl(&self, st: &mut State) -> Option<Fault> {
        for q in 0..self.size {
            let (buf, req) = &mut st.ctrl[q];
            if *req == null_request() {
                continue;
            }
            let mut flag: c_int = 0;
            // SAFETY: `status` is ours; the request is a posted receive of this state.
            let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            let rc = unsafe { ffi::MPI_Test(req, &mut flag, &mut status) };
            if rc != 0 {
                return Some(Fault {
                    culprit: q,
                    reason: format!("its connection failed: {}", mpi_err(rc)),
                });
            }
            if flag != 0 {
                let culprit = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
                let text = String::from_utf8_lossy(&buf[4..])
                    .trim_end_matches('\0')
                    .to_string();
                let reason = if culprit == q {
                    format!("it aborted: {text}")
                } else {
                    format!("{text} (reported by rank {q})")
                };
                return Some(Fault {
                    culprit: culprit.min(self.size.saturating_sub(1)),
                    reason,
                });
            }
        }
        None
    }

    /// The failure every call returns once the group failed.
    fn failed_error(&self, collective: &'static str) -> Error {
        let (rank, reason) = self
            .fault()
            .unwrap_or((self.rank, "the group failed".into()));
        Error::RankFailed {
            rank,
            world: self.size,
            collective,
            reason,
        }
    }

    /// One round of messages: for each `(peer, bytes)` of `sends`, a message of the header
    /// and `bytes` bytes written by `fill(peer, out)`; for each `(peer, bytes)` of `recvs`,
    /// a message into `st.recv[peer][HDR..]`. Waits for all of them until `timeout`, polling
    /// abort messages and the peers' liveness, then checks every header against `sig`.
    fn exchange(
        &self,
        st: &mut State,
        sig: &Sig,
        sends: &[(usize, usize)],
        recvs: &[(usize, usize)],
        fill: &mut dyn FnMut(usize, &mut [u8]) -> std::result::Result<(), String>,
        timeout: Duration,
    ) -> std::result::Result<(), Fault> {
        let local = |reason: String| Fault {
            culprit: self.rank,
            reason,
        };
        let hdr = sig.encode();
        let total: usize = sends.iter().map(|&(_, b)| HDR + b).sum();
        st.send.clear();
        st.send.resize(total, 0);
        let mut at = 0;
        for &(q, b) in sends {
            let msg = &mut st.send[at..at + HDR + b];
            msg[..HDR].copy_from_slice(&hdr);
            fill(q, &mut msg[HDR..]).map_err(local)?;
            at += HDR + b;
        }
        for &(q, b) in recvs {
            let r = &mut st.recv[q];
            r.clear();
            r.resize(HDR + b, 0);
        }
        let too_big = |b: usize| {
            local(format!(
                "a message of {b} B is more than MPI's count of {} B",
                c_int::MAX
            ))
        };
        let mut reqs: Vec<Req> = Vec::with_capacity(sends.len() + recvs.len());
        // Receives first, so peers' sends find them posted.
        for &(q, b) in recvs {
            let count = c_int::try_from(HDR + b).map_err(|_| too_big(b))?;
            let mut req = null_request();
            let buf = st.recv[q].as_mut_ptr();
            // SAFETY: the receive buffer holds HDR + b bytes and stays alive and unmoved until
            // the request completes: it is only resized in the next exchange, after this one
            // completed, and leaked with the state when the group fails with requests pending.
            let rc = unsafe {
                ffi::MPI_Irecv(
                    buf.cast::<c_void>(),
                    count,
                    bytes_type(),
                    q as c_int,
                    TAG_DATA,
                    comm_world(),
                    &mut req,
                )
            };
            if rc != 0 {
                return self.abandon(st, reqs, local(format!("MPI_Irecv: {}", mpi_err(rc))));
            }
            reqs.push(Req { req, peer: q });
        }
        let mut at = 0;
        for &(q, b) in sends {
            let count = c_int::try_from(HDR + b).map_err(|_| too_big(b))?;
            let mut req = null_request();
            // SAFETY: as for the receives: the send buffer is not touched until the request
            // completes, or is leaked.
            let rc = unsafe {
                ffi::MPI_Isend(
                    st.send.as_ptr().add(at).cast::<c_void>(),
                    count,
                    bytes_type(),
                    q as c_int,
                    TAG_DATA,
                    comm_world(),
                    &mut req,
                )
            };
            if rc != 0 {
                return self.abandon(st, reqs, local(format!("MPI_Isend: {}", mpi_err(rc))));
            }
            reqs.push(Req { req, peer: q });
            at += HDR + b;
        }
        if let Err(f) = self.wait(st, &mut reqs, sig, timeout) {
            return self.abandon(st, reqs, f);
        }
        let sent: usize = sends.iter().map(|&(_, b)| b).sum();
        self.bytes_moved.fetch_add(sent as u64, Relaxed);
        for &(q, _) in recvs {
            let h = &st.recv[q][..HDR];
            if h != hdr {
                return Err(Fault {
                    culprit: q,
                    reason: format!(
                        "calls do not match: this rank ({}) made {}, rank {q} made {}",
                        self.rank,
                        sig.describe(),
                        describe_header(h)
                    ),
                });
            }
        }
        Ok(())
    }

    /// Give up on the requests of a failed exchange: the staging buffers they target are
    /// leaked (a peer may still deliver into them), then the fault is returned.
    fn abandon(
        &self,
        st: &mut State,
        reqs: Vec<Req>,
        fault: Fault,
    ) -> std::result::Result<(), Fault> {
        if reqs.iter().any(|r| r.req != null_request()) {
            std::mem::forget(std::mem::take(&mut st.send));
            for r in &mut st.recv {
                std::mem::forget(std::mem::take(r));
            }
        }
        Err(fault)
    }

    /// Wait for `reqs` (see `exchange`).
    fn wait(
        &self,
        st: &mut State,
        reqs: &mut [Req],
        sig: &Sig,
        timeout: Duration,
    ) -> std::result::Result<(), Fault> {
        let start = Instant::now();
        let mut last_check = start;
        let mut round: u32 = 0;
        loop {
            let mut pending = false;
            for r in reqs.iter_mut() {
                if r.req == null_request() {
                    continue;
                }
                let mut flag: c_int = 0;
                // SAFETY: `status` is ours; the request was posted by `exchange`.
                let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
                let rc = unsafe { ffi::MPI_Test(&mut r.req, &mut flag, &mut status) };
                if rc != 0 {
                    return Err(Fault {
                        culprit: r.peer,
                        reason: format!(
                            "talking to {} failed in {}: {}",
                            self.describe_peer(r.peer),
                            sig.describe(),
                            mpi_err(rc)
                        ),
                    });
                }
                pending |= flag == 0;
            }
            if !pending {
                return Ok(());
            }
            if let Some(f) = self.poll_ctrl(st) {
                return Err(f);
            }
            if self.failed.load(Acquire) {
                // Aborted from another thread (the meta backend's stall watchdog): tell the
                // peers, which that thread could not do while this one held the lock.
                self.notify(st);
                let (culprit, reason) = self.fault().unwrap_or((self.rank, "aborted".into()));
                return Err(Fault { culprit, reason });
            }
            let now = Instant::now();
            if now - last_check >= LIVENESS_EVERY {
                last_check = now;
                let me = &self.peers[self.rank];
                for r in reqs.iter().filter(|r| r.req != null_request()) {
                    let p = &self.peers[r.peer];
                    if p.host == me.host && exited(p.pid) {
                        return Err(Fault {
                            culprit: r.peer,
                            reason: format!(
                                "{} exited during {}",
                                self.describe_peer(r.peer),
                                sig.describe()
                            ),
                        });
                    }
                }
                if now - start >= timeout {
                    let r = reqs
                        .iter()
                        .find(|r| r.req != null_request())
                        .expect("a request is pending");
                    return Err(Fault {
                        culprit: r.peer,
                        reason: format!(
                            "{} did not complete {} within {timeout:?} (stalled or unreachable)",
                            self.describe_peer(r.peer),
                            sig.describe()
                        ),
                    });
                }
            }
            // Spin briefly, then yield, then sleep: a peer on the same core needs it.
            round = round.saturating_add(1);
            if round < 256 {
                std::hint::spin_loop();
            } else if round < 512 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    fn finalize(&self) {
        if self.failed.load(Acquire) || self.finalized.swap(true, Release) {
            return;
        }
        let mut st = self.state.lock();
        for (_, req) in st.ctrl.iter_mut() {
            if *req != null_request() {
                // SAFETY: a posted receive of ours; cancelling a receive and waiting for it
                // completes at once (MPI 3.1, 3.8.4).
                unsafe {
                    ffi::MPI_Cancel(req);
                    ffi::MPI_Wait(req, ffi::RSMPI_STATUS_IGNORE);
                }
            }
        }
        // SAFETY: every request of ours is complete; called once (the `finalized` flag).
        unsafe { ffi::MPI_Finalize() };
    }
}

/// The chunk of all-reduce rank `r` (elements): equal shares rounded up to whole 64-byte
/// lines, as the in-process communicator cuts them (the result does not depend on it).
fn chunk(world: usize, n: usize, esz: usize, r: usize) -> (usize, usize) {
    let line = (64 / esz).max(1);
    let per = n.div_ceil(world).div_ceil(line) * line;
    let lo = per.saturating_mul(r).min(n);
    (lo, per.saturating_add(lo).min(n))
}

fn check_reducible(dtype: DType, what: &str, bytes: usize) -> std::result::Result<usize, String> {
    if !reducible(dtype) {
        return Err(format!("dtype {dtype} cannot be summed (F32, F16 or BF16)"));
    }
    let esz = dtype.type_size();
    if !bytes.is_multiple_of(esz) {
        return Err(format!(
            "{what} of {bytes} B is not a whole number of {dtype} elements"
        ));
    }
    Ok(esz)
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
        if w.failed.load(Acquire) || w.finalized.load(Acquire) {
            return Err(w.failed_error(name));
        }
        let mut st = w.state.lock();
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
                let (sends, recvs): (Vec<(usize, usize)>, Vec<(usize, usize)>) = if me == root {
                    (
                        (0..w.size).filter(|&q| q != me).map(|q| (q, len)).collect(),
                        vec![],
                    )
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
