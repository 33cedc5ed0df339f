//! A ggml-style worker pool: `T - 1` persistent threads plus the caller run one job with
//! `(ith, nth)` and meet at a spin barrier between graph nodes. This costs well under a
//! microsecond per node, where a fork-join per node (rayon) costs several: decode steps run
//! hundreds of small nodes, so the difference is visible in tokens per second.
//!
//! Waiting spins briefly, then yields, then parks (workers between jobs), so an
//! oversubscribed host (tests running in parallel) still makes progress.
//! A panic inside a job poisons the barrier: every thread unwinds at its next barrier and
//! [`ThreadPool::run`] returns the panic message as an error instead of hanging. A thread the
//! system refuses to start is an error from [`ThreadPool::new`], not a panic.

use crate::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;

/// Spin iterations (of `spin_loop`, about 20 ns each on Zen 4) before a waiter starts yielding.
const SPIN_LIMIT: u32 = 1 << 10;
/// Yields before a barrier waiter parks (an oversubscribed host: the peer is not running).
const YIELD_LIMIT: u32 = 16;

/// A job run on every thread of a pool: `job(ith, barrier)`.
pub type Job<'a> = dyn Fn(usize, &Barrier) + Sync + 'a;

/// A reusable barrier for the `nth` threads of one pool job. Waiters spin briefly (the common
/// case: the peers are a few hundred nanoseconds behind), then yield, then park; the last
/// thread to arrive unparks the sleepers, so a host with more threads than cores does not
/// spend whole time slices spinning.
pub struct Barrier {
    nth: usize,
    count: AtomicUsize,
    phase: AtomicUsize,
    poisoned: AtomicBool,
    /// Threads parked (or about to park) on this barrier.
    sleepers: AtomicUsize,
    parked: Mutex<Vec<std::thread::Thread>>,
}

/// Raised (as a panic payload) in threads released from a poisoned barrier.
struct Poisoned;

impl Barrier {
    pub fn new(nth: usize) -> Self {
        Barrier {
            nth,
            count: AtomicUsize::new(0),
            phase: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            parked: Mutex::new(Vec::new()),
        }
    }

    pub fn nth(&self) -> usize {
        self.nth
    }

    /// Block until all `nth` threads have called `wait`. Unwinds if another thread panicked.
    pub fn wait(&self) {
        if self.nth == 1 {
            return;
        }
        let phase = self.phase.load(Ordering::Acquire);
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == self.nth {
            self.count.store(0, Ordering::Relaxed);
            self.phase.fetch_add(1, Ordering::AcqRel);
            self.wake_sleepers();
            return;
        }
        let mut spins = 0u32;
        while self.phase.load(Ordering::Acquire) == phase {
            if self.poisoned.load(Ordering::Acquire) {
                std::panic::resume_unwind(Box::new(Poisoned));
            }
            if spins < SPIN_LIMIT {
                std::hint::spin_loop();
            } else if spins < SPIN_LIMIT + YIELD_LIMIT {
                std::thread::yield_now();
            } else {
                self.park_until_changed(phase);
            }
            spins = spins.saturating_add(1);
        }
    }

    /// Park until the phase moves on (or the barrier is poisoned). The registration happens
    /// under the lock and the phase is checked after it, so a wake-up cannot be lost.
    fn park_until_changed(&self, phase: usize) {
        self.sleepers.fetch_add(1, Ordering::AcqRel);
        {
            let mut p = self.parked.lock();
            if self.phase.load(Ordering::Acquire) != phase || self.poisoned.load(Ordering::Acquire)
            {
                self.sleepers.fetch_sub(1, Ordering::AcqRel);
                return;
            }
            p.push(std::thread::current());
        }
        while self.phase.load(Ordering::Acquire) == phase && !self.poisoned.load(Ordering::Acquire)
        {
            std::thread::park_timeout(std::time::Duration::from_millis(10));
        }
        self.sleepers.fetch_sub(1, Ordering::AcqRel);
    }

    fn wake_sleepers(&self) {
        if self.sleepers.load(Ordering::Acquire) > 0 {
            for t in self.parked.lock().drain(..) {
                t.unpark();
            }
        }
    }

    fn poison(&self) {
        self.poisoned.store(true, Ordering::Release);
        self.wake_sleepers();
    }
}

struct Shared {
    /// Incremented once per job; workers run each generation once.
    generation: AtomicU64,
    /// The current job, lifetime-erased (see the SAFETY note in `run`).
    job: Mutex<Option<JobPtr>>,
    barrier: Mutex<Arc<Barrier>>,
    /// Workers that finished the current generation.
    done: AtomicUsize,
    panic_msg: Mutex<Option<String>>,
    wake: Condvar,
    wake_lock: Mutex<()>,
    shutdown: AtomicBool,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job<'static>);
// SAFETY: the pointee is `Sync` (Job requires it), so sharing the pointer between threads and
// calling it concurrently is sound; `run` keeps the pointee alive while any worker can use it.
unsafe impl Send for JobPtr {}

/// A pool of `nth` threads: the caller of [`ThreadPool::run`] is thread 0.
pub struct ThreadPool {
    nth: usize,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One job at a time.
    running: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `nth >= 1` threads (`nth - 1` are spawned, named `{name}-w{ith}`). A thread
    /// the system refuses to start (thread or memory limits) is an [`Error::Device`] naming
    /// the pool and how many threads had started; those are stopped and joined first.
    pub fn new(nth: usize, name: &str) -> Result<Self> {
        let nth = nth.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: Mutex::new(None),
            barrier: Mutex::new(Arc::new(Barrier::new(nth))),
            done: AtomicUsize::new(0),
            panic_msg: Mutex::new(None),
            wake: Condvar::new(),
            wake_lock: Mutex::new(()),
            shutdown: AtomicBool::new(false),
        });
        let mut pool = ThreadPool {
            nth,
            shared,
            workers: Vec::new(),
            running: Mutex::new(()),
        };
        for ith in 1..nth {
            let shared = pool.shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-w{ith}"))
                .spawn(move || worker_loop(ith, &shared));
            match spawned {
                Ok(h) => pool.workers.push(h),
                Err(e) => {
                    // Dropping the pool stops and joins the workers already started.
                    drop(pool);
                    return Err(Error::Device {
                        device: name.to_string(),
                        reason: format!(
                            "cannot start thread {ith} of a pool of {nth} threads: {e} (the \
                             system's limit on threads or memory; use fewer threads)"
                        ),
                    });
                }
            }
        }
        Ok(pool)
    }

    pub fn nth(&self) -> usize {
        self.nth
    }

    /// Run `job(ith, barrier)` on every thread and wait for all. A panic in any thread is
    /// returned as `Err(message)` after every thread has stopped.
    pub fn run(&self, job: &Job<'_>) -> Result<(), String> {
        let _guard = self.running.lock();
        let barrier = Arc::new(Barrier::new(self.nth));
        if self.nth == 1 {
            return catch_unwind(AssertUnwindSafe(|| job(0, &barrier))).map_err(panic_message);
        }
        // SAFETY: we erase the job's lifetime to hand it to the workers. Every worker finishes
        // calling it before incrementing `done`, and this function does not return before
        // `done == nth - 1`, so the borrow outlives every use.
        let ptr: *const Job<'static> =
            unsafe { std::mem::transmute::<*const Job<'_>, *const Job<'static>>(job) };
        *self.shared.job.lock() = Some(JobPtr(ptr));
        *self.shared.barrier.lock() = barrier.clone();
        *self.shared.panic_msg.lock() = None;
        self.shared.done.store(0, Ordering::Release);
        {
            let _l = self.shared.wake_lock.lock();
            self.shared.generation.fetch_add(1, Ordering::AcqRel);
            self.shared.wake.notify_all();
        }
        let main = catch_unwind(AssertUnwindSafe(|| job(0, &barrier)));
        if let Err(p) = &main {
            barrier.poison();
            if !p.is::<Poisoned>() {
                *self.shared.panic_msg.lock() = Some(panic_message_ref(p.as_ref()));
            }
        }
        let mut spins = 0u32;
        while self.shared.done.load(Ordering::Acquire) < self.nth - 1 {
            if spins < SPIN_LIMIT {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
        *self.shared.job.lock() = None;
        match self.shared.panic_msg.lock().take() {
            Some(m) => Err(m),
            None => Ok(()),
        }
    }
}

fn worker_loop(ith: usize, shared: &Shared) {
    let mut seen = 0u64;
    loop {
        // Wait for a new generation: spin, then park on the condvar.
        let mut spins = 0u32;
        loop {
            if shared.shutdown.load(Ordering::Acquire) {
                return;
            }
            let g = shared.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            if spins < SPIN_LIMIT {
                std::hint::spin_loop();
                spins += 1;
            } else {
                let mut l = shared.wake_lock.lock();
                if shared.generation.load(Ordering::Acquire) == seen
                    && !shared.shutdown.load(Ordering::Acquire)
                {
                    shared
                        .wake
                        .wait_for(&mut l, std::time::Duration::from_millis(50));
                }
            }
        }
        let job = *shared.job.lock();
        let barrier = shared.barrier.lock().clone();
        if let Some(JobPtr(ptr)) = job {
            // SAFETY: `run` keeps the job alive until this worker increments `done` below.
            let f = unsafe { &*ptr };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(ith, &barrier))) {
                barrier.poison();
                if !p.is::<Poisoned>() {
                    let mut m = shared.panic_msg.lock();
                    if m.is_none() {
                        *m = Some(panic_message_ref(p.as_ref()));
                    }
                }
            }
        }
        shared.done.fetch_add(1, Ordering::AcqRel);
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    panic_message_ref(p.as_ref())
}

fn panic_message_ref(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a kernel panicked".to_string()
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _l = self.shared.wake_lock.lock();
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_runs_and_barrier_orders_phases() {
        for nth in [1, 2, 3, 5] {
            let pool = ThreadPool::new(nth, "t").unwrap();
            let a: Vec<AtomicUsize> = (0..nth).map(|_| AtomicUsize::new(0)).collect();
            for round in 1..=20 {
                pool.run(&|ith, b| {
                    a[ith].fetch_add(1, Ordering::Relaxed);
                    b.wait();
                    // After the barrier every thread has incremented its counter.
                    for c in &a {
                        assert_eq!(c.load(Ordering::Relaxed), round);
                    }
                    b.wait();
                })
                .unwrap();
            }
        }
    }

    #[test]
    fn a_panicking_thread_is_an_error_not_a_hang() {
        let pool = ThreadPool::new(3, "t").unwrap();
        let r = pool.run(&|ith, b| {
            if ith == 2 {
                panic!("kernel failed on thread 2");
            }
            b.wait();
        });
        assert_eq!(r.unwrap_err(), "kernel failed on thread 2");
        // The pool is still usable.
        pool.run(&|_, b| b.wait()).unwrap();
    }
}
