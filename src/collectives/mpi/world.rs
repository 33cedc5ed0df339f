//! `MpiWorld`: this process's place in the MPI job (MPI initialized once, every rank's host
//! and pid) and the one exchange primitive the collectives are built on: a round of
//! non-blocking sends and receives with a header per message, waited for with a deadline while
//! polling abort messages and the peers' liveness (see the parent module's failure model).

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
pub(super) const HDR: usize = 32;
/// Bytes of an abort message (culprit rank, then the reason in UTF-8).
const CTRL_BYTES: usize = 1024;
/// How long start-up waits for every process to say who it is.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a waiting rank yields between polls before it starts sleeping between them.
const YIELD_FOR: Duration = Duration::from_millis(20);
/// How long a rank that saw a peer exit still polls for that peer's abort message.
const EXIT_GRACE: Duration = Duration::from_millis(50);

/// How often a waiting rank checks that its peers on the same host are alive.
const LIVENESS_EVERY: Duration = Duration::from_millis(1);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Kind {
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
pub(super) struct Sig {
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

/// Writes the payload of the message to a peer: `fill(peer, out)`.
pub(super) type Fill<'a> = dyn FnMut(usize, &mut [u8]) -> std::result::Result<(), String> + 'a;

/// Who a rank is, exchanged at start-up: its host and pid, to tell a dead peer from a slow one.
#[derive(Clone, Debug)]
pub struct Peer {
    pub host: String,
    pub pid: u32,
}

/// A failure and the rank at fault.
#[derive(Clone, Debug)]
pub(super) struct Fault {
    pub(super) culprit: usize,
    pub(super) reason: String,
}

/// A posted request and the peer it talks to.
struct Req {
    req: ffi::MPI_Request,
    peer: usize,
}

/// Everything that touches MPI, behind one lock.
pub(super) struct State {
    pub(super) seq: u64,
    /// Outgoing messages of the current exchange, back to back.
    pub(super) send: Vec<u8>,
    /// Per peer: the incoming message of the current exchange.
    pub(super) recv: Vec<Vec<u8>>,
    /// Per peer: the buffer and the posted receive of its abort message.
    pub(super) ctrl: Vec<(Box<[u8; CTRL_BYTES]>, ffi::MPI_Request)>,
    /// Abort messages already sent.
    pub(super) notified: bool,
}

// SAFETY: MPI handles (requests) are plain values that MPI lets any thread pass in once it
// runs at MPI_THREAD_SERIALIZED or above (checked in `init`); the state is only used under
// the world's lock, so no two threads call MPI at the same time.
unsafe impl Send for State {}

/// This process's place in the MPI job: its rank, the job size, who the peers are, and the
/// state of the one group every communicator of the process shares.
pub struct MpiWorld {
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) peers: Vec<Peer>,
    pub(super) state: Mutex<State>,
    pub(super) failed: AtomicBool,
    pub(super) fault: Mutex<Option<Fault>>,
    pub(super) bytes_moved: AtomicU64,
    pub(super) finalized: AtomicBool,
}

static WORLD: OnceLock<std::result::Result<Arc<MpiWorld>, String>> = OnceLock::new();

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

    pub(super) fn next_sig(
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
    pub(super) fn fail(&self, fault: Fault, st: Option<&mut State>, tell: bool) {
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
    pub(super) fn notify(&self, st: &mut State) {
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
    pub(super) fn failed_error(&self, collective: &'static str) -> Error {
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
    pub(super) fn exchange(
        &self,
        st: &mut State,
        sig: &Sig,
        sends: &[(usize, usize)],
        recvs: &[(usize, usize)],
        fill: &mut Fill<'_>,
        timeout: Duration,
    ) -> std::result::Result<(), Fault> {
        let local = |reason: String| Fault {
            culprit: self.rank,
            reason,
        };
        // Every size is checked before anything is posted, so an error here leaves no request
        // in flight.
        if let Some(&(_, b)) = sends
            .iter()
            .chain(recvs)
            .find(|&&(_, b)| c_int::try_from(HDR + b).is_err())
        {
            return Err(local(format!(
                "a message of {b} B is more than MPI's count of {} B",
                c_int::MAX
            )));
        }
        let count = |b: usize| (HDR + b) as c_int;
        let hdr = sig.encode();
        let total: usize = sends.iter().map(|&(_, b)| HDR + b).sum();
        // Resized, not refilled: every byte is written below or by MPI.
        st.send.resize(total, 0);
        let mut at = 0;
        for &(q, b) in sends {
            let msg = &mut st.send[at..at + HDR + b];
            msg[..HDR].copy_from_slice(&hdr);
            fill(q, &mut msg[HDR..]).map_err(local)?;
            at += HDR + b;
        }
        for &(q, b) in recvs {
            st.recv[q].resize(HDR + b, 0);
        }
        let mut reqs: Vec<Req> = Vec::with_capacity(sends.len() + recvs.len());
        // Receives first, so peers' sends find them posted.
        for &(q, b) in recvs {
            let n = count(b);
            let mut req = null_request();
            let buf = st.recv[q].as_mut_ptr();
            // SAFETY: the receive buffer holds HDR + b bytes and stays alive and unmoved until
            // the request completes: it is only resized in the next exchange, after this one
            // completed, and leaked with the state when the group fails with requests pending.
            let rc = unsafe {
                ffi::MPI_Irecv(
                    buf.cast::<c_void>(),
                    n,
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
            let n = count(b);
            let mut req = null_request();
            // SAFETY: as for the receives: the send buffer is not touched until the request
            // completes, or is leaked.
            let rc = unsafe {
                ffi::MPI_Isend(
                    st.send.as_ptr().add(at).cast::<c_void>(),
                    n,
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
                        // A rank that aborts sends its reason, then exits: the message may
                        // still be on its way when the exit is seen. Give it a moment, so the
                        // others report the reason rather than only the exit.
                        let seen = Instant::now();
                        while seen.elapsed() < EXIT_GRACE {
                            if let Some(f) = self.poll_ctrl(st) {
                                return Err(f);
                            }
                            std::thread::sleep(Duration::from_millis(1));
                        }
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
            // Spin briefly, then yield (a peer on the same core needs it), and sleep only
            // after YIELD_FOR: MPI moves large messages only inside our MPI_Test calls
            // (shared-memory fragments are copied by the polling side), so sleeping early
            // slows a 16 MiB transfer by tens of milliseconds.
            round = round.saturating_add(1);
            if round < 256 {
                std::hint::spin_loop();
            } else if now - start < YIELD_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
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
