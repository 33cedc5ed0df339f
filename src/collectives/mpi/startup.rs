//! Start-up of this process's MPI world, bounded in time. `MPI_Init_thread` waits until every
//! process of the job has called it, and a process that never does (one rank given `--help`,
//! `devices`, a bad flag, or a command without `--dist mpi`, which exits with status 0 before
//! MPI starts) leaves the others inside it for good: mpirun does not count a process that
//! never joined as failed. MPI cannot be asked to give up, so:
//!
//! - `MPI_Init_thread` runs on a thread of its own, named [`INIT_THREAD`]; the calling thread
//!   waits for it with a deadline ([`startup_timeout`]: 60 s, or `METASHARD_STARTUP_TIMEOUT`
//!   seconds) and returns an error naming the rank that did not arrive. The thread stays
//!   blocked; the process exits with the error (status 1), and mpirun then ends the job.
//! - While it waits it looks at the other ranks on this host: the processes started by the
//!   same launcher process (mpirun or its daemon), each with its rank in its environment
//!   (`OMPI_COMM_WORLD_RANK`, `PMI_RANK`, `SLURM_PROCID`). One that exits before MPI started,
//!   or is missing after a second when every rank runs on this host, is named at once; at the
//!   deadline, one that runs without an [`INIT_THREAD`] thread is named as "running but never
//!   started MPI". Ranks on other hosts are named at the deadline.
//! - The first exchange (every rank's host and pid, `hello`) has the same deadline.
//!
//! SIGPIPE: `main` restores its default action (a closed stdout ends the program quietly), but
//! MPI's own sockets must see a closed connection as an error, not a signal: it is ignored
//! again before MPI starts, as Rust programs do by default.

use super::world::{
    CTRL_BYTES, Fault, HDR, Kind, MpiWorld, Peer, State, TAG_CTRL, bytes_type, check, comm_world,
    exited, hostname, null_request,
};
use crate::Error;
use mpi::ffi;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::mpsc::{RecvTimeoutError, channel};
use std::time::{Duration, Instant};

/// The name of the thread that runs `MPI_Init_thread`: its presence marks a process as one
/// that arrived at MPI's start-up, for the other ranks on its host.
pub const INIT_THREAD: &str = "ms-mpi-init";
/// The environment variable that sets the start-up deadline, in seconds.
pub const STARTUP_TIMEOUT_VAR: &str = "METASHARD_STARTUP_TIMEOUT";
const DEFAULT_STARTUP: Duration = Duration::from_secs(60);
/// How often the waiting thread looks at its siblings.
const POLL: Duration = Duration::from_millis(50);
/// How long a rank that every other rank runs on this host may be missing before it is taken
/// for one that exited before MPI started (mpirun starts a host's ranks at the same time).
const MISSING_GRACE: Duration = Duration::from_secs(1);

/// The start-up deadline: `METASHARD_STARTUP_TIMEOUT` seconds (a positive number), else 60 s.
pub fn startup_timeout() -> Result<Duration, String> {
    match std::env::var(STARTUP_TIMEOUT_VAR) {
        Err(_) => Ok(DEFAULT_STARTUP),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s > 0.0 && s.is_finite() && s <= 86_400.0 => Ok(Duration::from_secs_f64(s)),
            _ => Err(format!(
                "{STARTUP_TIMEOUT_VAR}={v:?} is not a number of seconds in (0, 86400]"
            )),
        },
    }
}

/// Why start-up failed.
#[derive(Clone, Debug)]
pub(super) enum StartError {
    /// MPI refused, or the deadline passed without saying who was missing.
    Mpi(String),
    /// Rank `rank` did not arrive or answer.
    Rank {
        rank: usize,
        world: usize,
        reason: String,
    },
}

impl StartError {
    pub(super) fn into_error(self) -> Error {
        match self {
            StartError::Mpi(reason) => Error::Device {
                device: "mpi".into(),
                reason,
            },
            StartError::Rank {
                rank,
                world,
                reason,
            } => Error::RankFailed {
                rank,
                world,
                collective: "start-up",
                reason,
            },
        }
    }
}

/// This process's place in the job as its launcher's environment says.
struct Launch {
    rank_var: &'static str,
    rank: usize,
    size: usize,
    /// Ranks on this host, when the launcher says.
    local_size: Option<usize>,
}

fn env_usize(var: &str) -> Option<usize> {
    std::env::var(var).ok()?.trim().parse().ok()
}

fn launch() -> Option<Launch> {
    // OpenMPI, MPICH's Hydra, Slurm.
    const VARS: [(&str, &str, &str); 3] = [
        (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"),
    ];
    VARS.iter().find_map(|&(r, s, l)| {
        Some(Launch {
            rank_var: r,
            rank: env_usize(r)?,
            size: env_usize(s)?,
            local_size: env_usize(l),
        })
    })
}

/// Another process started by this process's parent (the launcher), and its rank.
struct Sibling {
    pid: u32,
    rank: usize,
    /// It runs an [`INIT_THREAD`]: it is inside MPI's start-up.
    arrived: bool,
}

/// The children of process `parent`: `/proc/P/task/*/children` (Linux 3.5 and later), else
/// every process whose parent it is (`/proc/N/stat`).
fn children(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{parent}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
            }
        }
    }
    if !out.is_empty() {
        return out;
    }
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The parent is the second field after the parenthesized command name.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(parent) {
            out.push(pid);
        }
    }
    out
}

/// Whether process `pid` has a thread named `name`.
fn has_thread(pid: u32, name: &str) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == name))
}

/// The live processes this process's launcher started besides this one, with their ranks.
fn siblings(rank_var: &str) -> Vec<Sibling> {
    let me = std::process::id();
    // SAFETY: getppid has no arguments and cannot fail.
    let parent = unsafe { libc::getppid() } as u32;
    let key = format!("{rank_var}=");
    children(parent)
        .into_iter()
        .filter(|&pid| pid != me && !exited(pid))
        .filter_map(|pid| {
            let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
            let rank = env.split(|&b| b == 0).find_map(|kv| {
                let v = kv.strip_prefix(key.as_bytes())?;
                std::str::from_utf8(v).ok()?.parse::<usize>().ok()
            })?;
            Some(Sibling {
                pid,
                rank,
                arrived: has_thread(pid, INIT_THREAD),
            })
        })
        .collect()
}

/// `MPI_Init_thread` at `MPI_THREAD_SERIALIZED` unless MPI is initialized already (run on
/// [`INIT_THREAD`]).
fn init_thread() -> Result<(), String> {
    let mut flag: c_int = 0;
    // SAFETY: MPI_Initialized may be called at any time, even before MPI_Init.
    check(
        unsafe { ffi::MPI_Initialized(&mut flag) },
        "MPI_Initialized",
    )?;
    if flag != 0 {
        return Ok(());
    }
    // SAFETY: setting a signal's action to "ignore" touches no memory of ours.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    // SAFETY: a constant exported by the library.
    let serialized = unsafe { ffi::RSMPI_THREAD_SERIALIZED };
    let mut provided: c_int = 0;
    // SAFETY: null argc/argv are allowed (MPI-2); called once (guarded by `WORLD`). Any thread
    // may initialize MPI; at MPI_THREAD_SERIALIZED any thread may then call it, one at a time.
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
    Ok(())
}

/// Start MPI on [`INIT_THREAD`] and wait for it until `deadline`, naming a rank of this host
/// that exits before it arrives as soon as that is seen (see the module doc).
fn init_bounded(deadline: Duration) -> Result<(), StartError> {
    let (tx, rx) = channel();
    std::thread::Builder::new()
        .name(INIT_THREAD.into())
        .spawn(move || {
            let _ = tx.send(init_thread());
        })
        .map_err(|e| StartError::Mpi(format!("starting the MPI start-up thread: {e}")))?;
    let launch = launch();
    let start = Instant::now();
    // Every sibling rank seen alive, with its pid.
    let mut seen: BTreeMap<usize, u32> = BTreeMap::new();
    loop {
        match rx.recv_timeout(POLL) {
            Ok(r) => return r.map_err(StartError::Mpi),
            Err(RecvTimeoutError::Disconnected) => {
                return Err(StartError::Mpi(
                    "the MPI start-up thread ended without an answer".into(),
                ));
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
        let waited = start.elapsed();
        let Some(l) = &launch else {
            if waited >= deadline {
                return Err(StartError::Mpi(format!(
                    "MPI_Init_thread did not return within {deadline:?} ({STARTUP_TIMEOUT_VAR} \
                     sets this deadline)"
                )));
            }
            continue;
        };
        let sib = siblings(l.rank_var);
        let never = |q: usize, what: String| StartError::Rank {
            rank: q,
            world: l.size,
            reason: format!(
                "{what} before it joined the job, so MPI cannot start (this rank waited {:.1} s): \
                 it failed before MPI started (its own error says why), or it ran a command \
                 without --dist mpi (`--help`, `devices`); every rank must run the same command \
                 with --dist mpi",
                waited.as_secs_f64()
            ),
        };
        if let Some((&q, &pid)) = seen
            .iter()
            .find(|&(_, &pid)| !sib.iter().any(|s| s.pid == pid))
        {
            return Err(never(q, format!("rank {q} (pid {pid}) exited")));
        }
        for s in &sib {
            seen.insert(s.rank, s.pid);
        }
        let all_here = l.local_size == Some(l.size);
        if all_here
            && waited >= MISSING_GRACE
            && let Some(q) = (0..l.size).find(|&q| q != l.rank && !seen.contains_key(&q))
        {
            return Err(never(q, format!("rank {q} is not running: it exited")));
        }
        if waited >= deadline {
            return Err(missing(l, &sib, all_here, deadline));
        }
    }
}

/// The error at the deadline: every rank that did not arrive, the first named as at fault.
fn missing(l: &Launch, sib: &[Sibling], all_here: bool, deadline: Duration) -> StartError {
    let mut late = Vec::new();
    for q in (0..l.size).filter(|&q| q != l.rank) {
        match sib.iter().find(|s| s.rank == q) {
            Some(s) if s.arrived => {}
            Some(s) => late.push((
                q,
                format!(
                    "rank {q} (pid {}) is running but never started MPI (a command without \
                     --dist mpi, or another program?)",
                    s.pid
                ),
            )),
            None if all_here => late.push((q, format!("rank {q} is not running"))),
            None => late.push((q, format!("rank {q} is on another host, or not running"))),
        }
    }
    let rank = late.first().map_or(l.rank, |(q, _)| *q);
    let list: Vec<String> = late.into_iter().map(|(_, s)| s).collect();
    StartError::Rank {
        rank,
        world: l.size,
        reason: format!(
            "MPI did not start within {deadline:?}: {} ({STARTUP_TIMEOUT_VAR} sets this \
             deadline; every rank must run a metashard command with --dist mpi)",
            if list.is_empty() {
                "every rank of this host arrived".to_string()
            } else {
                list.join("; ")
            }
        ),
    }
}

impl MpiWorld {
    /// Start MPI (bounded, see the module doc), post the control receives, and exchange every
    /// rank's host and pid.
    pub(super) fn init() -> Result<MpiWorld, StartError> {
        let deadline = startup_timeout().map_err(StartError::Mpi)?;
        init_bounded(deadline)?;
        let mpi = |e: String| StartError::Mpi(e);
        let world = comm_world();
        // Errors come back as return codes, never as an abort of the job.
        // SAFETY: MPI is initialized; COMM_WORLD and ERRORS_RETURN are valid handles.
        check(
            unsafe { ffi::MPI_Comm_set_errhandler(world, ffi::RSMPI_ERRORS_RETURN) },
            "MPI_Comm_set_errhandler",
        )
        .map_err(mpi)?;
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: MPI is initialized; the outputs are ours.
        unsafe {
            check(ffi::MPI_Comm_rank(world, &mut rank), "MPI_Comm_rank").map_err(mpi)?;
            check(ffi::MPI_Comm_size(world, &mut size), "MPI_Comm_size").map_err(mpi)?;
        }
        let (rank, size) = (rank as usize, size as usize);
        let mut ctrl = Vec::with_capacity(size);
        for q in 0..size {
            let mut buf = Box::new([0u8; CTRL_BYTES]);
            let mut req = null_request();
            if q != rank {
                // SAFETY: the boxed buffer lives in the state until the request completes
                // (the peer's one control message: its abort or its finish word), or forever
                // (leaked with the state) otherwise.
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
                check(rc, "MPI_Irecv (control messages)").map_err(mpi)?;
            }
            ctrl.push((buf, req));
        }
        let me = Peer {
            host: hostname(),
            pid: std::process::id(),
        };
        let mut w = MpiWorld {
            rank,
            size,
            peers: vec![me.clone(); size],
            state: Mutex::new(State {
                seq: 0,
                send: Vec::new(),
                recv: vec![Vec::new(); size],
                ctrl,
                notified: false,
                finished: vec![None; size],
            }),
            failed: AtomicBool::new(false),
            fault: Mutex::new(None),
            bytes_moved: AtomicU64::new(0),
            finalized: AtomicBool::new(false),
        };
        // Who is who: 4 bytes of pid, then the host name.
        let mut hello = (me.pid).to_le_bytes().to_vec();
        hello.extend_from_slice(me.host.as_bytes());
        // `w` is not shared yet: fill in the peers.
        w.peers = w.hello(&hello, deadline).map_err(|f| StartError::Rank {
            rank: f.culprit,
            world: size,
            reason: format!("it did not answer at start-up: {}", f.reason),
        })?;
        Ok(w)
    }

    /// Exchange start-up records with every peer, within `deadline`.
    fn hello(&self, mine: &[u8], deadline: Duration) -> Result<Vec<Peer>, Fault> {
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
            deadline,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_children_of_a_process_are_found_and_a_thread_by_its_name() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .expect("sleep starts");
        let mine = children(std::process::id());
        let _ = child.kill();
        let _ = child.wait();
        assert!(mine.contains(&child.id()), "{mine:?}");
        let name = "ms-test-thread";
        let (tx, rx) = channel::<()>();
        let (up_tx, up) = channel::<()>();
        let t = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                // The name is set when the thread starts, before this.
                let _ = up_tx.send(());
                let _ = rx.recv();
            })
            .expect("a thread");
        up.recv().expect("the thread runs");
        assert!(has_thread(std::process::id(), name));
        drop(tx);
        t.join().expect("joined");
        assert!(!has_thread(std::process::id(), name));
    }
}
