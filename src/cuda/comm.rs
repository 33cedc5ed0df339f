//! The communicator of logical devices on one GPU (`cuda:0x2`): every rank's buffers live in
//! the same context, so a rank reads its peers' device memory directly. Each collective is
//! two barriers around device work on the calling rank's own stream:
//!
//! - all-reduce: rank r sums chunk r of every rank's buffer, in rank order, into its own buffer
//!   (`k_sum_ranks`, f32 accumulation as `collectives/reduce.rs`, so the result is bit-identical
//!   to the CPU communicator's); after a barrier it copies chunk r into every peer's buffer;
//! - all-gather: rank r copies its slice into every rank's full tensor, run by run;
//! - reduce-scatter: rank r sums its slice of every rank's full tensor, run by run;
//! - broadcast: every rank copies the root's buffer.
//!
//! Ranks arrive with their streams drained (the CUDA backend synchronizes at the end of every
//! compute range), and leave after their own stream drained, so the next range sees the
//! results. Barriers wait at most the group's timeout; a failed or aborted group fails every
//! pending and later collective with the reason, naming the late ranks.

use super::device::{CudaBuffer, CudaDevice, Gpu, driver_err};
use crate::backend::Device;
use crate::buffer::BufferRange;
use crate::collectives::{Communicator, CommunicatorFactory, SliceLayout};
use crate::{DType, Error, Result};
use cudarc::driver::{result as cu, sys};
use parking_lot::{Condvar, Mutex};
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Joins logical devices of one GPU.
pub struct OneGpuFactory {
    pub ordinal: usize,
}

impl CommunicatorFactory for OneGpuFactory {
    fn name(&self) -> String {
        format!("cuda-peer:{}", self.ordinal)
    }

    fn create(
        &self,
        devices: &[Arc<dyn Device>],
        timeout: Duration,
    ) -> Result<Arc<dyn Communicator>> {
        let mut gpu = None;
        for d in devices {
            let c = d
                .as_any()
                .downcast_ref::<CudaDevice>()
                .filter(|c| c.gpu.ordinal == self.ordinal)
                .ok_or_else(|| Error::Device {
                    device: d.name(),
                    reason: format!("not a logical device of cuda{}", self.ordinal),
                })?;
            gpu.get_or_insert_with(|| c.gpu.clone());
        }
        let gpu = gpu.ok_or_else(|| Error::invalid_argument("devices", "[]", "no device"))?;
        Ok(Arc::new(OneGpuComm::new(gpu, devices.len(), timeout)?))
    }
}

/// A stream handle owned by one rank of the group.
pub(super) struct Stream(pub(super) sys::CUstream);
// SAFETY: used only by its rank's thread (with the context bound there) and destroyed in Drop.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

/// What each rank deposits before the first barrier of a collective.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Deposit {
    /// Device address of the rank's full (or in-place) buffer.
    pub a: u64,
    /// Collective kind and layout fingerprint: every rank must agree.
    pub sig: (u8, u64),
}

/// The meeting point of a group's ranks: barriers with a deadline, the deposits each rank
/// leaves for the others, and the failure that ends the group. No GPU involved, so it is
/// tested without one (`tests/cuda_kernels.rs`).
pub struct Rendezvous {
    label: String,
    /// The communicator's kind in errors (`cuda-peer`, `nccl`).
    kind: &'static str,
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    deposits: Vec<Deposit>,
    /// Arrivals at the current barrier (and which ranks), and barriers passed.
    arrived: usize,
    here: Vec<bool>,
    generation: u64,
    failed: Option<String>,
}

impl Rendezvous {
    pub fn new(label: &str, world: usize, timeout: Duration) -> Rendezvous {
        Self::of_kind("cuda-peer", label, world, timeout)
    }

    /// [`Rendezvous::new`] for a communicator of another kind (named in its errors).
    pub fn of_kind(kind: &'static str, label: &str, world: usize, timeout: Duration) -> Rendezvous {
        Rendezvous {
            kind,
            label: label.to_string(),
            world,
            timeout,
            state: Mutex::new(State {
                deposits: vec![Deposit::default(); world],
                arrived: 0,
                here: vec![false; world],
                generation: 0,
                failed: None,
            }),
            cv: Condvar::new(),
        }
    }

    pub fn failure(&self) -> Option<String> {
        self.state.lock().failed.clone()
    }

    /// Fail the group (the first reason stays) and wake every waiting rank.
    pub fn fail_with(&self, reason: String) -> Error {
        let mut st = self.state.lock();
        let reason = st.failed.get_or_insert(reason).clone();
        self.cv.notify_all();
        Error::Device {
            device: self.label.clone(),
            reason: format!("{} group failed: {reason}", self.kind),
        }
    }

    /// Wait until every rank arrived (depositing `dep` when given); the deposits as they were.
    pub fn barrier(&self, rank: usize, dep: Option<Deposit>) -> Result<Vec<Deposit>> {
        let mut st = self.state.lock();
        if let Some(f) = &st.failed {
            return Err(Error::Device {
                device: self.label.clone(),
                reason: format!("{} group failed: {f}", self.kind),
            });
        }
        if let Some(d) = dep {
            st.deposits[rank] = d;
        }
        let at_gen = st.generation;
        st.arrived += 1;
        st.here[rank] = true;
        if st.arrived == self.world {
            st.arrived = 0;
            st.here.iter_mut().for_each(|h| *h = false);
            st.generation += 1;
            self.cv.notify_all();
            return Ok(st.deposits.clone());
        }
        let deadline = Instant::now() + self.timeout;
        while st.generation == at_gen && st.failed.is_none() {
            if self.cv.wait_until(&mut st, deadline).timed_out()
                && st.generation == at_gen
                && st.failed.is_none()
            {
                let late: Vec<usize> = (0..self.world).filter(|&q| !st.here[q]).collect();
                drop(st);
                return Err(self.fail_with(format!(
                    "rank {rank} waited {:?} for rank(s) {late:?} at a barrier",
                    self.timeout
                )));
            }
        }
        if let Some(f) = &st.failed {
            return Err(Error::Device {
                device: self.label.clone(),
                reason: format!("{} group failed: {f}", self.kind),
            });
        }
        Ok(st.deposits.clone())
    }

    /// Deposit, meet, check every rank called the same collective.
    pub fn meet(&self, rank: usize, dep: Deposit, what: &str) -> Result<Vec<Deposit>> {
        if rank >= self.world {
            return Err(Error::invalid_argument(
                "rank",
                rank.to_string(),
                format!("this group has {} ranks", self.world),
            ));
        }
        let all = self.barrier(rank, Some(dep))?;
        if let Some(q) = all.iter().position(|d| d.sig != dep.sig) {
            return Err(self.fail_with(format!(
                "rank {rank} called {what} while rank {q} called a different collective or layout"
            )));
        }
        Ok(all)
    }
}

pub struct OneGpuComm {
    gpu: Arc<Gpu>,
    world: usize,
    meet: Rendezvous,
    streams: Vec<Stream>,
    /// Per rank: a device array of `world` pointers for `k_sum_ranks` (one run at a time).
    ptr_arrays: Vec<u64>,
    moved: Vec<AtomicU64>,
}

impl Drop for OneGpuComm {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            for (s, p) in self.streams.iter().zip(&self.ptr_arrays) {
                // SAFETY: owned by this group, released once, after the stream drained.
                unsafe {
                    let _ = cu::stream::synchronize(s.0);
                    let _ = cu::free_sync(*p);
                    let _ = cu::stream::destroy(s.0);
                }
            }
        }
    }
}

/// The device address of `r` (`what` in errors of `component`), checked against its buffer.
pub(super) fn dev_ptr_of(component: &'static str, r: &BufferRange, what: &str) -> Result<u64> {
    let b = r
        .storage
        .buffer
        .as_any()
        .downcast_ref::<CudaBuffer>()
        .ok_or_else(|| Error::Internal {
            component,
            reason: format!("{what} is not in device memory"),
        })?;
    if r.storage.offset + r.len > crate::buffer::Buffer::size(b) {
        return Err(Error::Internal {
            component,
            reason: format!("{what} lies outside its buffer"),
        });
    }
    Ok(b.ptr + r.storage.offset as u64)
}

fn dev_ptr(r: &BufferRange, what: &str) -> Result<u64> {
    dev_ptr_of("cuda-peer", r, what)
}

fn esz(dtype: DType) -> Result<usize> {
    match dtype {
        DType::F32 => Ok(4),
        DType::F16 | DType::BF16 => Ok(2),
        other => Err(Error::Internal {
            component: "cuda-peer",
            reason: format!("cannot sum {other} tensors"),
        }),
    }
}

impl OneGpuComm {
    pub fn new(gpu: Arc<Gpu>, world: usize, timeout: Duration) -> Result<OneGpuComm> {
        gpu.bind()?;
        let label = gpu.label();
        let mut streams = Vec::with_capacity(world);
        let mut ptr_arrays = Vec::with_capacity(world);
        for _ in 0..world {
            let s = cu::stream::create(cu::stream::StreamKind::Default)
                .map_err(|e| driver_err(&label, "cuStreamCreate", e))?;
            streams.push(Stream(s));
            // SAFETY: the context is current; freed in Drop.
            let p = unsafe { cu::malloc_sync(world * 8) }
                .map_err(|e| driver_err(&label, "cuMemAlloc", e))?;
            ptr_arrays.push(p);
        }
        Ok(OneGpuComm {
            meet: Rendezvous::new(&label, world, timeout),
            gpu,
            world,
            streams,
            ptr_arrays,
            moved: (0..world).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    fn fail_with(&self, reason: String) -> Error {
        self.meet.fail_with(reason)
    }

    fn barrier(&self, rank: usize) -> Result<()> {
        self.meet.barrier(rank, None).map(|_| ())
    }

    fn meet(&self, rank: usize, dep: Deposit, what: &str) -> Result<Vec<Deposit>> {
        self.meet.meet(rank, dep, what)
    }

    fn stream(&self, rank: usize) -> sys::CUstream {
        self.streams[rank].0
    }

    fn copy(&self, rank: usize, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 || dst == src {
            return Ok(());
        }
        // SAFETY: both ranges were checked against their buffers by `dev_ptr` / the layout.
        unsafe { cu::memcpy_dtod_async(dst, src, len, self.stream(rank)) }
            .map_err(|e| self.fail_with(format!("rank {rank}: cuMemcpyDtoDAsync: {e:?}")))?;
        self.moved[rank].fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    /// `dst[0..n] = sum over ranks of srcs[q][0..n]`, on `rank`'s stream.
    fn sum(&self, rank: usize, dst: u64, srcs: &[u64], n: usize, dtype: DType) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let arr = self.ptr_arrays[rank];
        // SAFETY: the rank's own pointer array of `world` entries; the copy is synchronous with
        // respect to the host and ordered before the kernel by the legacy default stream.
        unsafe { cu::memcpy_htod_sync(arr, srcs) }
            .map_err(|e| self.fail_with(format!("rank {rank}: cuMemcpyHtoD: {e:?}")))?;
        let f = self.gpu.function("k_sum_ranks")?;
        let (nsrc, n64, code) = (
            srcs.len() as i32,
            n as i64,
            super::kernels::dtype_code(dtype),
        );
        let mut args: [*mut c_void; 5] = [
            (&dst as *const u64).cast_mut().cast(),
            (&arr as *const u64).cast_mut().cast(),
            (&nsrc as *const i32).cast_mut().cast(),
            (&n64 as *const i64).cast_mut().cast(),
            (&code as *const i32).cast_mut().cast(),
        ];
        let blocks = n.div_ceil(256).clamp(1, 1 << 20) as u32;
        // SAFETY: `k_sum_ranks(char*, const char* const*, int, i64, int)`; every address lies in
        // a live buffer of this GPU (checked by the callers).
        unsafe {
            cu::launch_kernel(
                f,
                (blocks, 1, 1),
                (256, 1, 1),
                0,
                self.stream(rank),
                &mut args,
            )
        }
        .map_err(|e| self.fail_with(format!("rank {rank}: launching k_sum_ranks: {e:?}")))?;
        self.moved[rank].fetch_add(
            (n * esz(dtype)? * (srcs.len() - 1)) as u64,
            Ordering::Relaxed,
        );
        Ok(())
    }

    fn drain(&self, rank: usize) -> Result<()> {
        // SAFETY: the rank's own stream.
        unsafe { cu::stream::synchronize(self.stream(rank)) }
            .map_err(|e| self.fail_with(format!("rank {rank}: cuStreamSynchronize: {e:?}")))
    }
}

impl Communicator for OneGpuComm {
    fn name(&self) -> String {
        format!("cuda-peer({})", self.world)
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, rank: usize, buf: &BufferRange, dtype: DType) -> Result<()> {
        self.gpu.bind()?;
        let e = esz(dtype)?;
        let p = dev_ptr(buf, "the all-reduce buffer")?;
        let all = self.meet(
            rank,
            Deposit {
                a: p,
                sig: (1, buf.len as u64),
            },
            "all-reduce",
        )?;
        // Chunks of whole elements, the remainder on the first ranks.
        let n = buf.len / e;
        let (q, r) = (n / self.world, n % self.world);
        let lo = rank * q + rank.min(r);
        let len = q + usize::from(rank < r);
        let srcs: Vec<u64> = all.iter().map(|d| d.a + (lo * e) as u64).collect();
        self.sum(rank, srcs[rank], &srcs, len, dtype)?;
        self.drain(rank)?;
        self.barrier(rank)?;
        for (d, dep) in all.iter().enumerate() {
            if d != rank {
                self.copy(rank, dep.a + (lo * e) as u64, srcs[rank], len * e)?;
            }
        }
        self.drain(rank)?;
        self.barrier(rank)
    }

    fn all_gather(
        &self,
        rank: usize,
        local: &BufferRange,
        full: &BufferRange,
        layout: &SliceLayout,
    ) -> Result<()> {
        self.gpu.bind()?;
        let (l, f) = (
            dev_ptr(local, "the local slice")?,
            dev_ptr(full, "the full tensor")?,
        );
        if full.len < layout.full_bytes() || local.len < layout.local_bytes(rank) {
            return Err(self.fail_with(format!(
                "rank {rank}: all-gather buffers smaller than the layout"
            )));
        }
        let all = self.meet(
            rank,
            Deposit {
                a: f,
                sig: (2, layout.fingerprint()),
            },
            "all-gather",
        )?;
        for dep in &all {
            for run in layout.runs(rank) {
                self.copy(rank, dep.a + run.full as u64, l + run.local as u64, run.len)?;
            }
        }
        self.drain(rank)?;
        self.barrier(rank)
    }

    fn reduce_scatter(
        &self,
        rank: usize,
        full: &BufferRange,
        local: &BufferRange,
        layout: &SliceLayout,
        dtype: DType,
    ) -> Result<()> {
        self.gpu.bind()?;
        let e = esz(dtype)?;
        let (f, l) = (
            dev_ptr(full, "the full tensor")?,
            dev_ptr(local, "the local slice")?,
        );
        if full.len < layout.full_bytes() || local.len < layout.local_bytes(rank) {
            return Err(self.fail_with(format!(
                "rank {rank}: reduce-scatter buffers smaller than the layout"
            )));
        }
        let all = self.meet(
            rank,
            Deposit {
                a: f,
                sig: (3, layout.fingerprint()),
            },
            "reduce-scatter",
        )?;
        for run in layout.runs(rank) {
            let srcs: Vec<u64> = all.iter().map(|d| d.a + run.full as u64).collect();
            self.sum(rank, l + run.local as u64, &srcs, run.len / e, dtype)?;
            // The pointer array is reused by the next run: wait for this one.
            self.drain(rank)?;
        }
        self.barrier(rank)
    }

    fn broadcast(&self, rank: usize, root: usize, buf: &BufferRange) -> Result<()> {
        self.gpu.bind()?;
        let p = dev_ptr(buf, "the broadcast buffer")?;
        let all = self.meet(
            rank,
            Deposit {
                a: p,
                sig: (4, (root as u64) << 32 | buf.len as u64),
            },
            "broadcast",
        )?;
        if rank != root {
            self.copy(rank, p, all[root].a, buf.len)?;
        }
        self.drain(rank)?;
        self.barrier(rank)
    }

    fn abort(&self, rank: usize, reason: &str) {
        let _ = self.fail_with(format!("rank {rank}: {reason}"));
    }

    fn failure(&self) -> Option<String> {
        self.meet.failure()
    }

    fn bytes_moved(&self, rank: usize) -> u64 {
        self.moved
            .get(rank)
            .map_or(0, |m| m.load(Ordering::Relaxed))
    }
}
