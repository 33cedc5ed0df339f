//! One worker thread per device of a meta device, with a bounded wait: [`DeviceWorkers::run`]
//! hands each worker a job (its device's program for one step) and returns when every job has
//! returned, or as soon as one device has spent longer than the timeout inside one stage of
//! its program. The caller never runs a device's program itself, so a device that never
//! returns cannot hang it.
//!
//! A stalled worker cannot be interrupted (a kernel or a driver call does not take signals),
//! so it is abandoned: its thread keeps the job's data alive (jobs own what they use, they are
//! `'static`) and exits when the job returns; a new thread takes its place. A job learns that
//! it was abandoned through [`Progress::cancelled`] and stops at its next stage boundary.
//!
//! Not a CPU concept: devices of any kind (CPU, GPU streams, ranks) are driven this way. Waiting
//! workers spin briefly, then yield, then park, like the CPU pool's barrier, so a host with
//! more threads than cores does not burn time slices; the caller sleeps. Workers are pinned to
//! distinct CPUs when there are enough (see [`DeviceWorkers::new`]). A round trip with empty
//! jobs costs 4 us back to back and 45 us after a 1 ms idle gap on the 2-core test machine
//! (`examples/workers_latency.rs`).

use crate::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Spin iterations before a waiting worker starts yielding (about 20 us).
const SPIN_LIMIT: u32 = 1 << 10;
/// Yields before it parks.
const YIELD_LIMIT: u32 = 16;
/// Spin iterations of the caller waiting for the last device (about 100 us).
const LAST_SPIN_LIMIT: u32 = 1 << 12;

/// A device's job for one step. It reports each stage it starts through the [`Progress`].
pub type Job = Box<dyn FnOnce(&Progress) + Send + 'static>;

/// What a job sees of its worker: stage starts (the stall clock) and cancellation.
pub struct Progress {
    slot: Arc<Slot>,
    epoch: Instant,
}

impl Progress {
    /// Stage `index` of the job starts now: the stall clock restarts. A stall reports the
    /// index of the stage it happened in. `waits_for_peers` marks a stage that waits for other
    /// devices (a collective): a device late in one is blamed only when no device is late in
    /// work of its own, since it is most likely waiting for that one.
    pub fn stage(&self, index: usize, waits_for_peers: bool) {
        self.slot.stage.store(index, Ordering::Relaxed);
        self.slot
            .waits_for_peers
            .store(waits_for_peers, Ordering::Relaxed);
        self.slot
            .heartbeat
            .store(nanos_since(self.epoch), Ordering::Release);
    }

    /// True once the caller gave up on this job: stop at the next stage boundary.
    pub fn cancelled(&self) -> bool {
        self.slot.abandoned.load(Ordering::Acquire)
    }
}

/// How a bounded run ended.
#[derive(Debug)]
pub enum Outcome {
    /// Every job returned.
    Done,
    /// These devices stayed inside one stage longer than the timeout; their workers were
    /// replaced. `stages` holds the stage index each was in (`usize::MAX`: before its first).
    Stalled {
        devices: Vec<usize>,
        stages: Vec<usize>,
        waited: Duration,
    },
}

/// One worker's mailbox and clocks.
struct Slot {
    job: Mutex<Option<Job>>,
    has_job: AtomicBool,
    parked: AtomicBool,
    wake: Condvar,
    /// Set when the caller gave up on the running job; the thread exits after it.
    abandoned: AtomicBool,
    shutdown: AtomicBool,
    /// When the current stage started (ns since the pool's epoch).
    heartbeat: AtomicU64,
    /// The current stage's index.
    stage: AtomicUsize,
    /// Whether the current stage waits for other devices.
    waits_for_peers: AtomicBool,
    /// The batch the running job belongs to.
    batch: Mutex<Option<Arc<Batch>>>,
}

/// Completion of one `run`.
struct Batch {
    /// Devices not settled yet; the caller waits for 0.
    left: AtomicUsize,
    lock: Mutex<()>,
    done: Condvar,
    /// Set once per device, by whoever settles it first: its worker finishing, or the caller
    /// declaring it stalled. The one that sets it decrements `left`.
    settled: Vec<AtomicBool>,
    panic: Mutex<Option<(usize, String)>>,
}

fn nanos_since(epoch: Instant) -> u64 {
    epoch.elapsed().as_nanos().min(u64::MAX as u128) as u64
}

/// `n` worker threads, one per device.
pub struct DeviceWorkers {
    name: String,
    epoch: Instant,
    slots: Vec<Arc<Slot>>,
    /// The CPU worker d is pinned to, when pinned (see [`DeviceWorkers::new`]).
    cpus: Option<Vec<usize>>,
}

impl DeviceWorkers {
    /// `n` workers named `{name}-d{index}`. Fails (does not abort) if a thread cannot be
    /// spawned.
    ///
    /// When there are several workers and the process may run on at least `n` CPUs, worker d
    /// is pinned to the d-th of them (`METASHARD_NO_PIN=1` turns this off). Unpinned, the scheduler often queues a second
    /// woken worker behind the first on one core while another core idles, and that worker
    /// starts only when the first yields in a collective: on the 2-core test machine, 10-15% of
    /// decode steps started device 1 about 1 ms late (p90 of its start 1.06 ms unpinned, 51 us
    /// pinned; `bench meta --graph block --tokens 1`: 0.90x -> 0.96x of the plain device).
    pub fn new(n: usize, name: &str) -> Result<Self> {
        let allowed = allowed_cpus();
        // One worker is not pinned: it has no sibling to collide with, and pinned it ran the
        // MLP decode step of `bench meta` 3-5% slower (its device's own pool threads float).
        let pin = n > 1 && allowed.len() >= n && std::env::var_os("METASHARD_NO_PIN").is_none();
        let mut w = DeviceWorkers {
            name: name.to_string(),
            epoch: Instant::now(),
            slots: Vec::with_capacity(n),
            cpus: pin.then(|| allowed[..n].to_vec()),
        };
        for d in 0..n {
            let slot = w.spawn(d)?;
            w.slots.push(slot);
        }
        Ok(w)
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    fn spawn(&self, d: usize) -> Result<Arc<Slot>> {
        let slot = Arc::new(Slot {
            job: Mutex::new(None),
            has_job: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            wake: Condvar::new(),
            abandoned: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            heartbeat: AtomicU64::new(0),
            stage: AtomicUsize::new(usize::MAX),
            waits_for_peers: AtomicBool::new(false),
            batch: Mutex::new(None),
        });
        let s = slot.clone();
        let epoch = self.epoch;
        let cpu = self.cpus.as_ref().map(|c| c[d]);
        std::thread::Builder::new()
            .name(format!("{}-d{d}", self.name))
            .spawn(move || worker_loop(d, s, epoch, cpu))
            .map_err(|e| Error::Device {
                device: format!("{} worker {d}", self.name),
                reason: format!("cannot spawn a thread: {e}"),
            })?;
        Ok(slot)
    }

    /// Run `jobs[d]` on worker d, all at once, and wait until all returned (`Done`) or some
    /// device has been inside one stage for longer than `timeout` (`Stalled`). On a stall,
    /// `on_stall(d)` is called for each stalled device (abort its communicator there, so the
    /// peers waiting for it return), the others are waited for under the same rule, and the
    /// stalled workers are replaced. A job that panicked is an error with its message.
    pub fn run(
        &mut self,
        jobs: Vec<Job>,
        timeout: Duration,
        on_stall: &dyn Fn(usize),
    ) -> Result<Outcome> {
        let n = self.slots.len();
        assert_eq!(jobs.len(), n, "one job per worker");
        // A worker abandoned by an earlier run whose replacement could not be spawned.
        for d in 0..n {
            if self.slots[d].abandoned.load(Ordering::Acquire) {
                self.slots[d] = self.spawn(d)?;
            }
        }
        let batch = Arc::new(Batch {
            left: AtomicUsize::new(n),
            lock: Mutex::new(()),
            done: Condvar::new(),
            settled: (0..n).map(|_| AtomicBool::new(false)).collect(),
            panic: Mutex::new(None),
        });
        let start = nanos_since(self.epoch);
        for (slot, job) in self.slots.iter().zip(jobs) {
            slot.heartbeat.store(start, Ordering::Release);
            slot.stage.store(usize::MAX, Ordering::Relaxed);
            slot.waits_for_peers.store(false, Ordering::Relaxed);
            *slot.batch.lock() = Some(batch.clone());
            // Under the mailbox lock: a worker checks `has_job` and parks under it too, so
            // either it sees the job or it is parked (and flagged) when we look.
            let mut mailbox = slot.job.lock();
            *mailbox = Some(job);
            slot.has_job.store(true, Ordering::Release);
        }
        for slot in &self.slots {
            let _mailbox = slot.job.lock();
            if slot.parked.load(Ordering::Acquire) {
                slot.wake.notify_one();
            }
        }
        let timeout_ns = timeout.as_nanos().min(u64::MAX as u128) as u64;
        let mut stalled: Vec<usize> = Vec::new();
        let mut stages = Vec::new();
        // After a stall the others' clocks restart: the peers of a stalled device wait for it
        // in a collective and are released by `on_stall`; they are not stalled themselves.
        let mut floor = 0u64;
        // The caller sleeps until notified or until the next device could be due: spinning
        // or yielding here takes the core a worker needs (measured: yielding made a decode
        // step of the block 1.6x slower on 2 cores).
        let mut guard = batch.lock.lock();
        while batch.left.load(Ordering::Acquire) > 0 {
            if n > 1 && batch.left.load(Ordering::Acquire) == 1 {
                // One device left: the others' cores are free, so wait for it awake a little
                // (the devices of a step usually finish within microseconds of each other,
                // and a sleeping caller takes tens of microseconds to wake).
                drop(guard);
                let mut spins = 0u32;
                while batch.left.load(Ordering::Acquire) == 1 && spins < LAST_SPIN_LIMIT {
                    std::hint::spin_loop();
                    spins += 1;
                }
                guard = batch.lock.lock();
                if batch.left.load(Ordering::Acquire) == 0 {
                    break;
                }
            }
            let now = nanos_since(self.epoch);
            // The late device to blame (in work of its own first, then the one late
            // longest), and when the next is due.
            let mut blame: Option<(bool, u64, usize)> = None;
            let mut own_work_running = false;
            let mut next = u64::MAX;
            for (d, slot) in self.slots.iter().enumerate() {
                if batch.settled[d].load(Ordering::Acquire) {
                    continue;
                }
                let waits = slot.waits_for_peers.load(Ordering::Relaxed);
                own_work_running |= !waits;
                let since = slot.heartbeat.load(Ordering::Acquire).max(floor);
                let due = since.saturating_add(timeout_ns);
                if now >= due {
                    let key = (waits, since, d);
                    if blame.is_none_or(|b| key < b) {
                        blame = Some(key);
                    }
                } else {
                    next = next.min(due);
                }
            }
            // A device late in a collective waits for a peer still at work: wait for that
            // peer's own deadline instead.
            let oldest = blame
                .filter(|&(waits, _, _)| !waits || !own_work_running)
                .map(|(_, since, d)| (d, since));
            if let Some((d, _)) = oldest {
                // Unless its worker settled it in the meantime (it just finished).
                if !batch.settled[d].swap(true, Ordering::AcqRel) {
                    self.slots[d].abandoned.store(true, Ordering::Release);
                    stalled.push(d);
                    stages.push(self.slots[d].stage.load(Ordering::Relaxed));
                    batch.left.fetch_sub(1, Ordering::AcqRel);
                    floor = now;
                    on_stall(d);
                }
                continue;
            }
            let wait = Duration::from_nanos(next.saturating_sub(now))
                .clamp(Duration::from_millis(1), Duration::from_millis(100));
            batch.done.wait_for(&mut guard, wait);
        }
        drop(guard);
        if let Some((d, msg)) = batch.panic.lock().take() {
            return Err(Error::Device {
                device: format!("{} worker {d}", self.name),
                reason: format!("a device worker panicked: {msg}"),
            });
        }
        if stalled.is_empty() {
            return Ok(Outcome::Done);
        }
        for &d in &stalled {
            self.slots[d] = self.spawn(d)?;
        }
        let waited = Duration::from_nanos(nanos_since(self.epoch).saturating_sub(start));
        Ok(Outcome::Stalled {
            devices: stalled,
            stages,
            waited,
        })
    }
}

impl Drop for DeviceWorkers {
    fn drop(&mut self) {
        // Workers exit at their next check; an abandoned one exits when its job returns. No
        // join: a stalled thread must not hang the drop.
        for s in &self.slots {
            let _mailbox = s.job.lock();
            s.shutdown.store(true, Ordering::Release);
            s.wake.notify_one();
        }
    }
}

/// The CPUs this process may run on (its affinity mask), in order; empty if unknown.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: `cpu_set_t` is a plain bit array for which all zeros is valid; the size passed
    // is its own, so the kernel writes inside it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Restrict the calling thread to `cpu` (best effort: a refusal leaves it unpinned).
fn pin_current_thread(cpu: usize) {
    // SAFETY: as in `allowed_cpus`; `cpu` comes from the affinity mask, below CPU_SETSIZE.
    unsafe {
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut one);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one);
    }
}

fn worker_loop(d: usize, slot: Arc<Slot>, epoch: Instant, cpu: Option<usize>) {
    if let Some(c) = cpu {
        pin_current_thread(c);
    }
    let progress = Progress {
        slot: slot.clone(),
        epoch,
    };
    loop {
        let mut spins = 0u32;
        while !slot.has_job.load(Ordering::Acquire) {
            if slot.shutdown.load(Ordering::Acquire) {
                return;
            }
            if spins < SPIN_LIMIT {
                std::hint::spin_loop();
            } else if spins < SPIN_LIMIT + YIELD_LIMIT {
                std::thread::yield_now();
            } else {
                let mut g = slot.job.lock();
                slot.parked.store(true, Ordering::Release);
                if !slot.has_job.load(Ordering::Acquire) && !slot.shutdown.load(Ordering::Acquire) {
                    slot.wake.wait_for(&mut g, Duration::from_millis(50));
                }
                slot.parked.store(false, Ordering::Release);
            }
            spins = spins.saturating_add(1);
        }
        slot.has_job.store(false, Ordering::Release);
        let job = slot.job.lock().take();
        let batch = slot.batch.lock().take();
        if let Some(job) = job {
            let r = catch_unwind(AssertUnwindSafe(|| job(&progress)));
            if let Some(b) = &batch {
                if let Err(p) = r {
                    let msg = if let Some(s) = p.downcast_ref::<&str>() {
                        s.to_string()
                    } else if let Some(s) = p.downcast_ref::<String>() {
                        s.clone()
                    } else {
                        "a job panicked".to_string()
                    };
                    b.panic.lock().get_or_insert((d, msg));
                }
                // The caller is woken when one device is left (it then spins for the last, on
                // the core this worker leaves free) and when none is.
                if !b.settled[d].swap(true, Ordering::AcqRel)
                    && b.left.fetch_sub(1, Ordering::AcqRel) <= 2
                {
                    // Under the lock: the caller checks `left` and sleeps under it too.
                    let _g = b.lock.lock();
                    b.done.notify_one();
                }
            }
        }
        if slot.abandoned.load(Ordering::Acquire) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jobs(n: usize, f: impl Fn(usize, &Progress) + Send + Sync + 'static) -> Vec<Job> {
        let f = Arc::new(f);
        (0..n)
            .map(|d| {
                let f = f.clone();
                Box::new(move |p: &Progress| f(d, p)) as Job
            })
            .collect()
    }

    #[test]
    fn every_job_runs_once_per_run() {
        let mut w = DeviceWorkers::new(3, "t").unwrap();
        let count = Arc::new(AtomicUsize::new(0));
        for round in 1..=50 {
            let c = count.clone();
            let out = w
                .run(
                    jobs(3, move |_, _| {
                        c.fetch_add(1, Ordering::Relaxed);
                    }),
                    Duration::from_secs(10),
                    &|_| {},
                )
                .unwrap();
            assert!(matches!(out, Outcome::Done));
            assert_eq!(count.load(Ordering::Relaxed), 3 * round);
        }
    }

    #[test]
    fn a_stalled_job_is_reported_within_the_timeout_and_replaced() {
        let mut w = DeviceWorkers::new(2, "t").unwrap();
        let release = Arc::new(AtomicBool::new(false));
        let r = release.clone();
        let t = Instant::now();
        let out = w
            .run(
                jobs(2, move |d, p| {
                    p.stage(7 + d, false);
                    if d == 1 {
                        while !r.load(Ordering::Acquire) {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    }
                }),
                Duration::from_millis(200),
                &|_| {},
            )
            .unwrap();
        let took = t.elapsed();
        match out {
            Outcome::Stalled {
                devices, stages, ..
            } => {
                assert_eq!(devices, vec![1]);
                assert_eq!(stages, vec![8]);
            }
            Outcome::Done => panic!("the stall was not detected"),
        }
        assert!(took < Duration::from_secs(5), "took {took:?}");
        // The replacement worker runs the next job although the old one is still stuck.
        let ran = Arc::new(AtomicUsize::new(0));
        let r2 = ran.clone();
        let out = w
            .run(
                jobs(2, move |_, _| {
                    r2.fetch_add(1, Ordering::Relaxed);
                }),
                Duration::from_secs(10),
                &|_| {},
            )
            .unwrap();
        assert!(matches!(out, Outcome::Done));
        assert_eq!(ran.load(Ordering::Relaxed), 2);
        release.store(true, Ordering::Release);
    }

    #[test]
    fn a_panicking_job_is_an_error_and_the_workers_stay_usable() {
        let mut w = DeviceWorkers::new(2, "t").unwrap();
        let e = w
            .run(
                jobs(2, |d, _| {
                    if d == 0 {
                        panic!("boom on device 0");
                    }
                }),
                Duration::from_secs(10),
                &|_| {},
            )
            .unwrap_err();
        assert!(e.to_string().contains("boom on device 0"), "{e}");
        let out = w
            .run(jobs(2, |_, _| {}), Duration::from_secs(10), &|_| {})
            .unwrap();
        assert!(matches!(out, Outcome::Done));
    }
}
