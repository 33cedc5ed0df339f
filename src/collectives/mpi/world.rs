//! `MpiWorld`: this process's place in the MPI job (MPI initialized once, by `startup.rs`,
//! every rank's host and pid) and the one exchange primitive the collectives are built on: a
//! round of non-blocking sends and receives with a header per message, waited for with a
//! deadline while polling control messages (a peer's abort, or its normal finish) and the
//! peers' liveness (see the parent module's failure model); and the end of the job
//! ([`finalize`]: every rank says it finished and waits for the others' word before
//! `MPI_Finalize`, so a rank still waiting in a collective learns that its peer finished).

use super::startup::StartError;
use crate::{DType, Error, Result};
use mpi::ffi;
use parking_lot::Mutex;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

const TAG_DATA: c_int = 0x6d73;
pub(super) const TAG_CTRL: c_int = 0x6d74;
/// Bytes of the header in front of every data message.
pub(super) const HDR: usize = 32;
/// Bytes of a control message: a word (the culprit rank of an abort, or [`FINISHED`] with the
/// sender's rank), then the reason in UTF-8.
pub(super) const CTRL_BYTES: usize = 1024;
/// The flag of the first word of a control message that says "I finished normally".
const FINISHED: u32 = 1 << 31;
/// How long a waiting rank yields between polls before it starts sleeping between them.
const YIELD_FOR: Duration = Duration::from_millis(20);
/// How long a rank that saw a peer exit still polls for that peer's abort message.
const EXIT_GRACE: Duration = Duration::from_millis(50);
/// How long a wait may still need a peer that said it finished normally before that is an
/// error: the notice can overtake the completion of this rank's last message to or from that
/// peer (the peer received it and finished; this rank's `MPI_Test` has not seen it yet), as
/// CI saw under load (a root's broadcast "failed" after every peer had its data).
const FINISHED_GRACE: Duration = Duration::from_millis(200);

/// How long a waiting rank sleeps 50 us between polls; after that it sleeps a fiftieth of the
/// time it waited so far (so it sees a message at most 2% later), up to [`DOZE_MAX`]: a wait
/// this long is mostly a rank waiting for work (`serve --dist mpi`'s ranks between requests,
/// `runtime::lockstep`), where 20000 polls a second cost a quarter of a core.
const DOZE_AFTER: Duration = Duration::from_millis(100);
const DOZE_MAX: Duration = Duration::from_millis(5);

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

/// A control message from a peer: its finish word (the text says after which call), or an
/// abort.
enum Ctrl {
    Finished(String),
    Abort(Fault),
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
    /// Per peer: its "finished normally" notice (the text, and when it was seen), kept until a
    /// wait still needs that peer after `FINISHED_GRACE`.
    pub(super) finished: Vec<Option<(String, Instant)>>,
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

static WORLD: OnceLock<std::result::Result<Arc<MpiWorld>, StartError>> = OnceLock::new();

/// This process's MPI world, initializing MPI on the first call (bounded: see `startup.rs`).
pub fn world() -> Result<Arc<MpiWorld>> {
    WORLD
        .get_or_init(|| MpiWorld::init().map(Arc::new))
        .clone()
        .map_err(StartError::into_error)
}

/// This process's rank if MPI was started (by [`world`]), without starting it.
pub fn started_rank() -> Option<usize> {
    match WORLD.get() {
        Some(Ok(w)) => Some(w.rank),
        _ => None,
    }
}

/// End the job on this rank, if MPI was started and the group did not fail: tell every peer
/// this rank finished, wait for each peer's word, then `MPI_Finalize`. A peer that aborted or
/// exited instead makes this an error naming it (`MPI_Finalize` is then skipped: it would
/// wait for the dead process; the process exits with the error). Call once, at the end of
/// `main`, after a success.
pub fn finalize() -> Result<()> {
    match WORLD.get() {
        Some(Ok(w)) => w.finalize(),
        _ => Ok(()),
    }
}

/// This rank fails with `reason` (an error outside any collective, e.g. a bad prompt on
/// rank 0): the group is marked failed and every peer is told at once, so a peer waiting for
/// this rank reports the reason instead of waiting for a timeout. A no-op if MPI was not
/// started.
pub fn abort(reason: &str) {
    if let Some(Ok(w)) = WORLD.get() {
        w.fail(
            Fault {
                culprit: w.rank,
                reason: reason.to_string(),
            },
            None,
            true,
        );
    }
}

pub(super) fn mpi_err(rc: c_int) -> String {
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

pub(super) fn check(rc: c_int, what: &str) -> std::result::Result<(), String> {
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("{what}: {}", mpi_err(rc)))
    }
}

pub(super) fn null_request() -> ffi::MPI_Request {
    // SAFETY: a constant the MPI library exports; reading it has no side effect.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

pub(super) fn comm_world() -> ffi::MPI_Comm {
    // SAFETY: as null_request.
    unsafe { ffi::RSMPI_COMM_WORLD }
}

pub(super) fn bytes_type() -> ffi::MPI_Datatype {
    // SAFETY: as null_request.
    unsafe { ffi::RSMPI_UINT8_T }
}

/// Whether process `pid` on this host has exited (gone, or a zombie not yet reaped).
pub(super) fn exited(pid: u32) -> bool {
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

pub(super) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

impl MpiWorld {
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

    /// Send an abort message to every peer, once (no message after this rank's finish word:
    /// a peer posts one control receive per rank).
    pub(super) fn notify(&self, st: &mut State) {
        if st.notified || self.finalized.load(Acquire) {
            return;
        }
        st.notified = true;
        let Some(f) = self.fault.lock().clone() else {
            return;
        };
        self.send_ctrl(f.culprit as u32, &f.reason);
    }

    /// Send a control message (`word`, then `text`) to every peer. Fire and forget: the
    /// request is freed and the message buffer leaked, as a dead peer never completes it.
    fn send_ctrl(&self, word: u32, text: &str) {
        let mut msg = vec![0u8; CTRL_BYTES];
        msg[..4].copy_from_slice(&word.to_le_bytes());
        let text = text.as_bytes();
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

    /// The control message of peer `q`, if it arrived: `Ok(Some(None))` for its finish word,
    /// `Ok(Some(Some(fault)))` for an abort.
    fn test_ctrl(&self, st: &mut State, q: usize) -> std::result::Result<Option<Ctrl>, Fault> {
        let (buf, req) = &mut st.ctrl[q];
        if *req == null_request() {
            return Ok(None);
        }
        let mut flag: c_int = 0;
        // SAFETY: `status` is ours; the request is a posted receive of this state.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        let rc = unsafe { ffi::MPI_Test(req, &mut flag, &mut status) };
        if rc != 0 {
            return Err(Fault {
                culprit: q,
                reason: format!("its connection failed: {}", mpi_err(rc)),
            });
        }
        if flag == 0 {
            return Ok(None);
        }
        let word = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes"));
        let text = String::from_utf8_lossy(&buf[4..])
            .trim_end_matches('\0')
            .to_string();
        if word & FINISHED != 0 {
            return Ok(Some(Ctrl::Finished(text)));
        }
        let culprit = word as usize;
        let reason = if culprit == q {
            format!("it aborted: {text}")
        } else {
            format!("{text} (reported by rank {q})")
        };
        Ok(Some(Ctrl::Abort(Fault {
            culprit: culprit.min(self.size.saturating_sub(1)),
            reason,
        })))
    }

    /// A control message from a peer while this rank waits in the call `during` for the
    /// requests `reqs`: an abort, or a peer that finished its work normally (the ranks did
    /// different work) while a request with it is still pending `FINISHED_GRACE` after its
    /// notice (a finished peer whose part of the call is done is no error).
    fn poll_ctrl(&self, st: &mut State, during: &Sig, reqs: &[Req]) -> Option<Fault> {
        for q in (0..self.size).filter(|&q| q != self.rank) {
            match self.test_ctrl(st, q) {
                Ok(None) => {}
                Ok(Some(Ctrl::Abort(f))) | Err(f) => return Some(f),
                Ok(Some(Ctrl::Finished(after))) => st.finished[q] = Some((after, Instant::now())),
            }
        }
        for r in reqs.iter().filter(|r| r.req != null_request()) {
            let q = r.peer;
            if let Some((after, seen)) = &st.finished[q]
                && seen.elapsed() >= FINISHED_GRACE
            {
                return Some(Fault {
                    culprit: q,
                    reason: format!(
                        "rank {q} finished normally {after}, while rank {} waits in {}: the \
                         ranks were given different work",
                        self.rank,
                        during.describe()
                    ),
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
            if let Some(f) = self.poll_ctrl(st, sig, reqs) {
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
                            if let Some(f) = self.poll_ctrl(st, sig, reqs) {
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
            } else if now - start < DOZE_AFTER {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::sleep((now - start).div_f64(50.0).min(DOZE_MAX));
            }
        }
    }

    /// End the job on this rank (see [`finalize`]).
    fn finalize(&self) -> Result<()> {
        if self.failed.load(Acquire) || self.finalized.load(Acquire) {
            return Ok(());
        }
        let mut st = self.state.lock();
        if let Err(f) = self.finish(&mut st) {
            // Every peer holds this rank's finish word already: nothing more to send.
            self.fail(f, Some(&mut st), false);
            return Err(self.failed_error("finish"));
        }
        self.finalized.store(true, Release);
        // SAFETY: every request of ours is complete (the control receives by `finish`, the
        // data requests by their exchanges); called once (the `finalized` flag).
        unsafe { ffi::MPI_Finalize() };
        Ok(())
    }

    /// Say "finished" to every peer, then wait for every peer's word: its own finish, or an
    /// abort (a peer still waiting in a collective learns from this rank's word that the
    /// ranks did different work, and aborts). A peer on this host that exits instead is
    /// seen through its pid; there is no deadline otherwise (a peer may still be busy with
    /// work of its own, such as rank 0 printing; `MPI_Finalize` waits for it as well).
    fn finish(&self, st: &mut State) -> std::result::Result<(), Fault> {
        if self.size == 1 {
            return Ok(());
        }
        if !st.notified {
            st.notified = true;
            self.send_ctrl(
                FINISHED | self.rank as u32,
                &format!("after call #{}", st.seq),
            );
        }
        let me = &self.peers[self.rank];
        let mut last_check = Instant::now();
        loop {
            let mut pending = Vec::new();
            for q in (0..self.size).filter(|&q| q != self.rank) {
                match self.test_ctrl(st, q)? {
                    Some(Ctrl::Abort(f)) => return Err(f),
                    Some(Ctrl::Finished(_)) => {}
                    None if st.ctrl[q].1 != null_request() => pending.push(q),
                    None => {}
                }
            }
            if pending.is_empty() {
                return Ok(());
            }
            if last_check.elapsed() >= Duration::from_millis(10) {
                last_check = Instant::now();
                for &q in &pending {
                    let p = &self.peers[q];
                    if p.host == me.host && exited(p.pid) {
                        // Its last word may still be on its way.
                        std::thread::sleep(EXIT_GRACE);
                        if let Some(Ctrl::Abort(f)) = self.test_ctrl(st, q)? {
                            return Err(f);
                        }
                        if st.ctrl[q].1 != null_request() {
                            return Err(Fault {
                                culprit: q,
                                reason: format!(
                                    "{} exited before it finished its work",
                                    self.describe_peer(q)
                                ),
                            });
                        }
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
