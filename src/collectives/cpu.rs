//! `CpuCommunicator`: the in-process communicator for 1..=16 ranks on one host, and
//! `HostCommunicatorFactory`, which makes one for devices that compute in host memory. Ranks
//! publish pointers to their buffers and access their peers' buffers directly (see the
//! algorithms, determinism and failure model in the parent module's doc).
//!
//! Synchronization: each rank owns a counter of the barriers it has reached, on its own cache
//! line; a barrier is "store mine + 1, wait until every peer's is at least that". Waiting
//! spins (without the PAUSE hint when every rank has a core: see `relax`), then yields, checks the failed flag every round and gives up after the timeout. No
//! allocation, lock or system call on the path of a successful call when peers are on time.

use super::reduce::{check_reducible, sum_into};
use super::{Communicator, CommunicatorFactory, SliceLayout};
use crate::backend::Device;
use crate::buffer::BufferRange;
use crate::{DType, Error, Result};
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize};
use std::time::{Duration, Instant};

/// Most ranks one communicator takes.
pub const MAX_WORLD: usize = 16;
/// How long a rank waits for its peers at one barrier before failing the communicator.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Spins before a waiter starts yielding, when every rank can have a core of its own.
const SPINS: u32 = 1 << 11;
/// Spins before yielding when there are more ranks than cores: a waiting rank then likely
/// holds the core its peer needs.
const SPINS_OVERSUBSCRIBED: u32 = 16;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    AllReduce = 1,
    AllGather = 2,
    ReduceScatter = 3,
    Broadcast = 4,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Broadcast => "broadcast",
        }
    }

    fn from_code(c: usize) -> Option<Kind> {
        [
            Kind::AllReduce,
            Kind::AllGather,
            Kind::ReduceScatter,
            Kind::Broadcast,
        ]
        .into_iter()
        .find(|k| *k as usize == c)
    }
}

/// What a call must agree on across ranks.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Sig {
    kind: Kind,
    dtype: Option<DType>,
    root: usize,
    /// Buffer bytes (all_reduce, broadcast) or full-tensor bytes (all_gather, reduce_scatter).
    len: usize,
    /// Layout fingerprint, 0 without a layout.
    layout: u64,
}

/// Align a value to its own cache-line pair (adjacent-line prefetch pulls lines in twos).
#[repr(align(128))]
struct Padded<T>(T);

/// What a rank publishes for its call in progress. Only the owner stores; peers load after
/// the publishing barrier.
#[derive(Default)]
struct Desc {
    /// `Kind` in the low byte, `1 + index in DType::ALL` (0: none) in the next.
    code: AtomicUsize,
    root: AtomicUsize,
    len: AtomicUsize,
    layout: AtomicU64,
    /// The buffer peers access: all_reduce's buf (read and written), all_gather's local,
    /// reduce_scatter's full, broadcast's buf (read only).
    src: AtomicPtr<u8>,
    src_len: AtomicUsize,
    /// True while this rank may be accessing peers' buffers (see `enter`).
    accessing: AtomicBool,
    /// True while a thread is inside a collective as this rank: a second thread calling with
    /// the same rank at the same time is refused, so descriptors are never written twice.
    busy: AtomicBool,
    bytes_moved: AtomicU64,
}

impl Desc {
    fn store(&self, sig: &Sig, src: *mut u8, src_len: usize) {
        let dt = sig
            .dtype
            .and_then(|d| DType::ALL.iter().position(|x| *x == d))
            .map_or(0, |i| i + 1);
        self.code.store(sig.kind as usize | dt << 8, Relaxed);
        self.root.store(sig.root, Relaxed);
        self.len.store(sig.len, Relaxed);
        self.layout.store(sig.layout, Relaxed);
        self.src.store(src, Relaxed);
        self.src_len.store(src_len, Relaxed);
    }

    /// The published signature, `None` if the code is not one `store` writes (a rank that
    /// never published).
    fn sig(&self) -> Option<Sig> {
        let code = self.code.load(Relaxed);
        let dtype = match code >> 8 {
            0 => None,
            i => Some(*DType::ALL.get(i - 1)?),
        };
        Some(Sig {
            kind: Kind::from_code(code & 0xff)?,
            dtype,
            root: self.root.load(Relaxed),
            len: self.len.load(Relaxed),
            layout: self.layout.load(Relaxed),
        })
    }

    fn describe(&self) -> String {
        let Some(s) = self.sig() else {
            return "nothing published".into();
        };
        let mut d = format!("{} of {} B", s.kind.name(), s.len);
        if let Some(t) = s.dtype {
            d += &format!(" {t}");
        }
        if s.kind == Kind::Broadcast {
            d += &format!(" from root {}", s.root);
        }
        if s.layout != 0 {
            d += &format!(" layout {:016x}", s.layout);
        }
        d + &format!(", buffer {} B", self.src_len.load(Relaxed))
    }
}

struct Slot {
    /// Barriers this rank has reached; peers poll it, so it has its own line.
    arrived: Padded<AtomicU64>,
    desc: Padded<Desc>,
}

/// The in-process communicator (see the module doc). Share it between the rank threads
/// (`Arc` or a scoped borrow).
pub struct CpuCommunicator {
    world: usize,
    timeout: Duration,
    spins: u32,
    slots: Box<[Slot]>,
    failed: AtomicBool,
    /// Why it failed: written once, before `failed` is set.
    reason: Mutex<Option<String>>,
}

impl CpuCommunicator {
    /// A communicator for `world` ranks (1..=16) with the default 30 s timeout.
    pub fn new(world: usize) -> Result<Self> {
        Self::with_timeout(world, DEFAULT_TIMEOUT)
    }

    /// A communicator whose ranks give up waiting for a peer after `timeout` at any barrier.
    pub fn with_timeout(world: usize, timeout: Duration) -> Result<Self> {
        if !(1..=MAX_WORLD).contains(&world) {
            return Err(Error::Collective {
                collective: "CpuCommunicator::new",
                rank: 0,
                world,
                reason: format!("world size must be 1..={MAX_WORLD}"),
            });
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let slots = (0..world)
            .map(|_| Slot {
                arrived: Padded(AtomicU64::new(0)),
                desc: Padded(Desc::default()),
            })
            .collect();
        Ok(CpuCommunicator {
            world,
            timeout,
            spins: if world <= cores {
                SPINS
            } else {
                SPINS_OVERSUBSCRIBED
            },
            slots,
            failed: AtomicBool::new(false),
            reason: Mutex::new(None),
        })
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Why the communicator failed, if it did.
    pub fn failure(&self) -> Option<String> {
        if self.failed.load(SeqCst) {
            self.reason.lock().clone()
        } else {
            None
        }
    }

    /// Record `reason` (the first one wins) and fail the communicator.
    fn fail(&self, reason: String) {
        {
            let mut r = self.reason.lock();
            if r.is_none() {
                *r = Some(reason);
            }
        }
        self.failed.store(true, SeqCst);
    }

    fn failed_reason(&self) -> String {
        let r = self.reason.lock();
        format!(
            "the communicator has failed: {}",
            r.as_deref().unwrap_or("unknown reason")
        )
    }

    /// One round of waiting: spin for the first `self.spins` rounds, then yield the core.
    /// Returns whether it yielded (the caller then checks its deadline).
    ///
    /// When every rank has a core, a spinning round is a bare re-check of the flags, without
    /// the PAUSE hint (`spin_loop`): with it, a rank waiting inside a decoding step noticed
    /// its peer's arrival late (the later rank of SmolLM2's cpu:2x1 all-reduces spent 6-22 us
    /// in each; likely the hypervisor's pause-loop exits on the guest the project measures
    /// on), and decoding was 1.8-2.7% slower (three interleaved experiments of three rounds,
    /// Zen 2, 2026-11-28; spinning longer with PAUSE was no better). At most `SPINS` rounds,
    /// a few microseconds, before the core is yielded. Oversubscribed ranks keep the hint.
    fn relax(&self, round: &mut u32) -> bool {
        if *round < self.spins {
            *round += 1;
            if self.spins <= SPINS_OVERSUBSCRIBED {
                std::hint::spin_loop();
            }
            false
        } else {
            std::thread::yield_now();
            true
        }
    }

    /// Arrive at the next barrier and wait for every peer to arrive too: an error if the
    /// communicator fails first or the peers take longer than the timeout.
    fn barrier(&self, rank: usize) -> Result<(), String> {
        let mine = &self.slots[rank].arrived.0;
        let target = mine.load(Relaxed) + 1;
        // Release: everything this rank wrote before (its descriptor, its results in peers'
        // buffers) is visible to a peer that sees the new count.
        mine.store(target, Release);
        let arrived = |q: usize| q == rank || self.slots[q].arrived.0.load(Acquire) >= target;
        let (mut next, mut round, mut deadline) = (0, 0, None);
        loop {
            // Peers below `next` have arrived; they cannot leave this barrier without us.
            while next < self.world && arrived(next) {
                next += 1;
            }
            if next == self.world {
                return Ok(());
            }
            if self.failed.load(Acquire) {
                return Err(self.failed_reason());
            }
            if self.relax(&mut round) {
                let now = Instant::now();
                if now >= *deadline.get_or_insert(now + self.timeout) {
                    let late: Vec<usize> = (0..self.world).filter(|&q| !arrived(q)).collect();
                    return Err(format!(
                        "timed out after {:?} waiting for rank(s) {late:?} to reach barrier \
                         {target}",
                        self.timeout
                    ));
                }
            }
        }
    }

    /// Start accessing peers' buffers. Together with `drain` this is a Dekker handshake (both
    /// sides store, then load the other's flag, all SeqCst): either this rank sees `failed`
    /// and touches nothing, or the failing rank sees `accessing` and waits.
    fn enter(&self, rank: usize) -> Result<(), String> {
        let d = &self.slots[rank].desc.0;
        d.accessing.store(true, SeqCst);
        if self.failed.load(SeqCst) {
            d.accessing.store(false, Release);
            return Err(self.failed_reason());
        }
        Ok(())
    }

    fn exit(&self, rank: usize, moved: usize) {
        let d = &self.slots[rank].desc.0;
        d.bytes_moved.fetch_add(moved as u64, Relaxed);
        d.accessing.store(false, Release);
    }

    /// After `failed` is set: wait until no peer is between its `enter` and `exit`, so this
    /// rank's buffers may be released. Nothing between `enter` and `exit` waits for another
    /// rank, so this ends.
    fn drain(&self, rank: usize) {
        for q in (0..self.world).filter(|&q| q != rank) {
            let accessing = &self.slots[q].desc.0.accessing;
            let mut round = 0;
            while accessing.load(SeqCst) {
                self.relax(&mut round);
            }
        }
    }

    /// Publish this rank's call, meet the peers, and check that every rank made the same call
    /// with a buffer of the size this rank will access (`expected_src_len(q)` for rank q).
    /// Returns every rank's published buffer pointer.
    fn publish(
        &self,
        rank: usize,
        sig: Sig,
        src: *mut u8,
        src_len: usize,
        expected_src_len: impl Fn(usize) -> usize,
    ) -> Result<[*mut u8; MAX_WORLD], String> {
        self.slots[rank].desc.0.store(&sig, src, src_len);
        self.barrier(rank)?;
        let mut ptrs = [std::ptr::null_mut::<u8>(); MAX_WORLD];
        let mut ok = true;
        for (q, p) in ptrs.iter_mut().enumerate().take(self.world) {
            let d = &self.slots[q].desc.0;
            ok &= d.sig() == Some(sig) && d.src_len.load(Relaxed) == expected_src_len(q);
            *p = d.src.load(Relaxed);
        }
        if ok {
            return Ok(ptrs);
        }
        let calls: Vec<String> = (0..self.world)
            .map(|q| format!("rank {q}: {}", self.slots[q].desc.0.describe()))
            .collect();
        Err(format!("ranks made mismatched calls: {}", calls.join("; ")))
    }

    /// Run one collective's body for `rank`: argument and state checks before, failure
    /// handling after (see the failure model).
    fn run(
        &self,
        kind: Kind,
        rank: usize,
        body: impl FnOnce() -> Result<(), String>,
    ) -> Result<()> {
        let err = |reason| Error::Collective {
            collective: kind.name(),
            rank,
            world: self.world,
            reason,
        };
        if rank >= self.world {
            let reason = format!("rank {rank} is out of range");
            self.fail(format!("{} called with {reason}", kind.name()));
            return Err(err(reason));
        }
        let slot = &self.slots[rank].desc.0;
        // Acquire/Release on `busy` also orders this rank's calls when they come from
        // different threads one after another (its barrier count is read Relaxed).
        if slot.busy.swap(true, Acquire) {
            let reason = format!("rank {rank} is already inside a collective on another thread");
            self.fail(format!("{} called while {reason}", kind.name()));
            return Err(err(reason));
        }
        let guard = PanicGuard {
            comm: self,
            rank,
            kind,
        };
        let result = if self.failed.load(Acquire) {
            Err(self.failed_reason())
        } else {
            body()
        };
        drop(guard);
        let result = result.map_err(|reason| {
            self.fail(format!("rank {rank} in {}: {reason}", kind.name()));
            self.drain(rank);
            err(reason)
        });
        slot.busy.store(false, Release);
        result
    }

    /// The element range of all-reduce chunk `r`: equal shares rounded up to whole 64-byte
    /// lines, the last ones shorter or empty.
    fn chunk(&self, n: usize, esz: usize, r: usize) -> (usize, usize) {
        let line = (64 / esz).max(1);
        let per = n.div_ceil(self.world).div_ceil(line) * line;
        let lo = per.saturating_mul(r).min(n);
        (lo, per.saturating_add(lo).min(n))
    }
}

/// Fails the communicator if a rank's thread unwinds out of a collective, after making sure
/// no peer still accesses the buffers the unwinding frame is about to release.
struct PanicGuard<'a> {
    comm: &'a CpuCommunicator,
    rank: usize,
    kind: Kind,
}

impl Drop for PanicGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let c = self.comm;
            c.slots[self.rank].desc.0.accessing.store(false, SeqCst);
            c.fail(format!(
                "rank {} panicked inside {}",
                self.rank,
                self.kind.name()
            ));
            c.drain(self.rank);
            c.slots[self.rank].desc.0.busy.store(false, Release);
        }
    }
}

fn check_layout(layout: &SliceLayout, world: usize) -> Result<(), String> {
    if layout.world() != world {
        return Err(format!(
            "layout has {} ranks, the communicator {world}",
            layout.world()
        ));
    }
    Ok(())
}

/// The collectives over host slices: what the [`Communicator`] implementation calls once it has
/// the host addresses of its buffer handles, and what host-only callers (benchmarks, tests) use
/// directly. Same semantics as the trait's methods of the same names.
impl CpuCommunicator {
    pub fn all_reduce(&self, rank: usize, buf: &mut [u8], dtype: DType) -> Result<()> {
        self.run(Kind::AllReduce, rank, || {
            let len = buf.len();
            let esz = check_reducible(dtype, "buffer", len)?;
            if self.world == 1 {
                return Ok(());
            }
            // From here on this rank touches its buffer only through `base`, the pointer its
            // peers use too, so every access derives from one borrow.
            let base = buf.as_mut_ptr();
            let sig = Sig {
                kind: Kind::AllReduce,
                dtype: Some(dtype),
                root: 0,
                len,
                layout: 0,
            };
            let peers = self.publish(rank, sig, base, len, |_| len)?;
            let (lo, hi) = self.chunk(len / esz, esz, rank);
            // Reduce-scatter and all-gather fused: this rank sums chunk `rank` of every
            // buffer in rank order and writes the sum back into chunk `rank` of every buffer.
            let mut chunks = [std::ptr::null_mut::<u8>(); MAX_WORLD];
            for (c, p) in chunks.iter_mut().zip(&peers).take(self.world) {
                // SAFETY: `p` is a rank's buffer of `len` bytes (checked in `publish`) and
                // lo * esz <= len, so the offset stays inside it.
                *c = unsafe { p.add(lo * esz) };
            }
            let mut srcs = [std::ptr::null::<u8>(); MAX_WORLD];
            for (s, c) in srcs.iter_mut().zip(&chunks) {
                *s = c.cast_const();
            }
            self.enter(rank)?;
            // SAFETY: every rank's buffer stays valid and unmoved from its publishing barrier
            // until it leaves the call: after the final barrier, which this rank reaches only
            // after this line, or on error after `drain` saw this rank stop accessing peers.
            // Every rank accesses its buffer during the call only through the published
            // pointer, and each rank accesses only its own chunk of every buffer; chunks are
            // disjoint, so nobody else reads or writes these ranges now. Each destination
            // equals a source, which `sum_into` allows, and hi - lo elements from `lo` fit in
            // every buffer.
            unsafe {
                sum_into(dtype, &chunks[..self.world], &srcs[..self.world], hi - lo);
            }
            self.exit(rank, 2 * (self.world - 1) * (hi - lo) * esz);
            self.barrier(rank)
        })
    }

    pub fn all_gather(
        &self,
        rank: usize,
        local: &[u8],
        full: &mut [u8],
        layout: &SliceLayout,
    ) -> Result<()> {
        self.run(Kind::AllGather, rank, || {
            check_layout(layout, self.world)?;
            layout
                .gather_into(local, rank, full)
                .map_err(|e| e.to_string())?;
            if self.world == 1 {
                return Ok(());
            }
            let sig = Sig {
                kind: Kind::AllGather,
                dtype: None,
                root: 0,
                len: full.len(),
                layout: layout.fingerprint(),
            };
            // Peers only read through this pointer.
            let src = local.as_ptr().cast_mut();
            let peers = self.publish(rank, sig, src, local.len(), |q| layout.local_bytes(q))?;
            self.enter(rank)?;
            let mut moved = 0;
            for (q, &p) in peers.iter().enumerate().take(self.world) {
                if q == rank {
                    continue;
                }
                let bytes = layout.local_bytes(q);
                // SAFETY: rank q published `local` of exactly `bytes` bytes (checked in
                // `publish`); it stays valid and unwritten (it is a shared borrow) until q
                // leaves the call, which waits for this rank as in all_reduce. `full` is this
                // rank's own and nobody else touches it.
                let slice = unsafe { std::slice::from_raw_parts(p, bytes) };
                if let Err(e) = layout.gather_into(slice, q, full) {
                    self.exit(rank, moved);
                    return Err(e.to_string());
                }
                moved += bytes;
            }
            self.exit(rank, moved);
            self.barrier(rank)
        })
    }

    pub fn reduce_scatter(
        &self,
        rank: usize,
        full: &[u8],
        local: &mut [u8],
        layout: &SliceLayout,
        dtype: DType,
    ) -> Result<()> {
        self.run(Kind::ReduceScatter, rank, || {
            check_layout(layout, self.world)?;
            layout
                .check_sizes("reduce_scatter", full.len(), rank, local.len())
                .map_err(|e| e.to_string())?;
            let esz = check_reducible(dtype, "layout unit", layout.unit_bytes())?;
            if self.world == 1 {
                // A sum of one term is the term, bit for bit.
                return layout.scatter(full, rank, local).map_err(|e| e.to_string());
            }
            let sig = Sig {
                kind: Kind::ReduceScatter,
                dtype: Some(dtype),
                root: 0,
                len: full.len(),
                layout: layout.fingerprint(),
            };
            let full_len = full.len();
            let src = full.as_ptr().cast_mut();
            let peers = self.publish(rank, sig, src, full_len, |_| full_len)?;
            let local_len = local.len();
            let dst = local.as_mut_ptr();
            self.enter(rank)?;
            let mut srcs = [std::ptr::null::<u8>(); MAX_WORLD];
            for run in layout.runs(rank) {
                for (s, p) in srcs.iter_mut().zip(&peers).take(self.world) {
                    // SAFETY: every rank's full tensor has `full_len` bytes (checked in
                    // `publish`) and the run lies inside the layout's full tensor.
                    *s = unsafe { p.add(run.full).cast_const() };
                }
                // SAFETY: the full tensors are shared borrows, valid and unwritten until their
                // owners leave the call (after this rank stops accessing, as in all_reduce);
                // `local` is this rank's own, exclusive, and the run fits in it (sizes checked
                // above). Runs are whole units, so whole elements.
                unsafe {
                    sum_into(
                        dtype,
                        &[dst.add(run.local)],
                        &srcs[..self.world],
                        run.len / esz,
                    )
                };
            }
            self.exit(rank, (self.world - 1) * local_len);
            self.barrier(rank)
        })
    }

    pub fn broadcast(&self, rank: usize, root: usize, buf: &mut [u8]) -> Result<()> {
        self.run(Kind::Broadcast, rank, || {
            if root >= self.world {
                return Err(format!("root {root} is out of range"));
            }
            if self.world == 1 {
                return Ok(());
            }
            let sig = Sig {
                kind: Kind::Broadcast,
                dtype: None,
                root,
                len: buf.len(),
                layout: 0,
            };
            let len = buf.len();
            let peers = self.publish(rank, sig, buf.as_mut_ptr(), len, |_| len)?;
            if rank != root {
                self.enter(rank)?;
                // SAFETY: the root's buffer has `len` bytes (checked in `publish`), stays valid
                // until the root leaves the call (after this rank stops accessing), and nobody
                // writes it during the call: the root does not touch it and every other rank
                // writes only its own buffer.
                let src = unsafe { std::slice::from_raw_parts(peers[root], len) };
                buf.copy_from_slice(src);
                self.exit(rank, len);
            }
            self.barrier(rank)
        })
    }
}

/// The host slice of a buffer handle.
///
/// # Safety
/// The caller must not let the slice outlive the buffer, and (the buffer concurrency contract
/// of `crate::buffer::Buffer`) nothing else may write the range while the slice is used: the
/// meta backend runs no kernel of a device during its collectives, and peers reach the range
/// only inside the collective's barriers.
unsafe fn host_slice<'a>(b: &BufferRange) -> Result<&'a mut [u8]> {
    let p = b.host_ptr()?;
    // SAFETY: `host_ptr` checked that `len` bytes from `p` lie inside the buffer's host
    // allocation; exclusivity is the caller's contract above.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, b.len) })
}

impl Communicator for CpuCommunicator {
    fn name(&self) -> String {
        format!("host({})", self.world)
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, rank: usize, buf: &BufferRange, dtype: DType) -> Result<()> {
        // SAFETY: the buffer lives through the call (the handle holds it), and the caller of a
        // collective leaves its buffers alone until it returns (the trait's contract).
        let b = unsafe { host_slice(buf)? };
        CpuCommunicator::all_reduce(self, rank, b, dtype)
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
        CpuCommunicator::all_gather(self, rank, l, f, layout)
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
        CpuCommunicator::reduce_scatter(self, rank, f, l, layout, dtype)
    }

    fn broadcast(&self, rank: usize, root: usize, buf: &BufferRange) -> Result<()> {
        // SAFETY: as in all_reduce.
        let b = unsafe { host_slice(buf)? };
        CpuCommunicator::broadcast(self, rank, root, b)
    }

    fn abort(&self, rank: usize, reason: &str) {
        self.fail(format!("rank {rank} aborted: {reason}"));
    }

    fn failure(&self) -> Option<String> {
        CpuCommunicator::failure(self)
    }

    fn bytes_moved(&self, rank: usize) -> u64 {
        self.slots
            .get(rank)
            .map_or(0, |s| s.desc.0.bytes_moved.load(Relaxed))
    }
}

/// Makes [`CpuCommunicator`]s: the meta device's fallback when its devices offer no common
/// communicator, valid when every device computes in host memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostCommunicatorFactory;

impl CommunicatorFactory for HostCommunicatorFactory {
    fn name(&self) -> String {
        "host".into()
    }

    fn create(
        &self,
        devices: &[Arc<dyn Device>],
        timeout: Duration,
    ) -> Result<Arc<dyn Communicator>> {
        if let Some(d) = devices.iter().find(|d| !d.buffer_type().is_host()) {
            return Err(Error::Device {
                device: d.name(),
                reason: format!(
                    "computes in `{}`, not host memory: the in-process host communicator cannot \
                     reach it, and the devices offer no communicator in common",
                    d.buffer_type().name()
                ),
            });
        }
        Ok(Arc::new(CpuCommunicator::with_timeout(
            devices.len(),
            timeout,
        )?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_partition_the_buffer_on_line_edges() {
        for world in 1..=MAX_WORLD {
            let comm = CpuCommunicator::new(world).unwrap();
            for esz in [2, 4] {
                for n in [0, 1, 15, 16, 17, 576, 1000, 4099] {
                    let mut at = 0;
                    for r in 0..world {
                        let (lo, hi) = comm.chunk(n, esz, r);
                        assert_eq!(lo, at, "world {world} n {n} rank {r}");
                        assert!(hi >= lo && hi <= n);
                        assert!(lo * esz % 64 == 0 || lo == n, "edge {lo} not on a line");
                        at = hi;
                    }
                    assert_eq!(at, n, "world {world} n {n}: chunks do not cover the buffer");
                }
            }
        }
    }

    #[test]
    fn a_panic_inside_a_collective_releases_the_peers() {
        let comm = CpuCommunicator::with_timeout(2, Duration::from_secs(60)).unwrap();
        let t = Instant::now();
        let (panicked, peer) = std::thread::scope(|s| {
            let a = s.spawn(|| {
                let mut buf = [0u8; 64];
                let base = buf.as_mut_ptr();
                let sig = Sig {
                    kind: Kind::AllReduce,
                    dtype: Some(DType::F32),
                    root: 0,
                    len: 64,
                    layout: 0,
                };
                // Publish like all_reduce, then panic while the peer may be accessing `buf`.
                let _ = comm.run(Kind::AllReduce, 0, || {
                    let _peers = comm.publish(0, sig, base, 64, |_| 64)?;
                    comm.enter(0)?;
                    panic!("a bug inside the collective");
                });
            });
            let b = s.spawn(|| comm.all_reduce(1, &mut [0u8; 64], DType::F32));
            (a.join().is_err(), b.join().unwrap())
        });
        assert!(t.elapsed() < Duration::from_secs(10));
        assert!(panicked);
        assert!(peer.is_err());
        let why = comm.failure().unwrap();
        assert!(why.contains("rank 0 panicked inside all_reduce"), "{why}");
        // The guard released the panicking rank's slot; the communicator stays failed.
        assert!(!comm.slots[0].desc.0.busy.load(SeqCst));
        assert!(!comm.slots[0].desc.0.accessing.load(SeqCst));
        let again = comm.all_reduce(0, &mut [0u8; 64], DType::F32).unwrap_err();
        assert!(again.to_string().contains("has failed"), "{again}");
    }
}
