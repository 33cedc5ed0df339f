//! The communicator of devices on different GPUs (`cuda:0,1`): NCCL (through cudarc's `nccl`
//! bindings, loaded at run time like the other libraries), one rank per GPU, the ranks'
//! communicators made together by `ncclCommInitAll` (NVIDIA NCCL user guide, "Creating a
//! communicator": the single-process form) and each rank's collectives issued from its own
//! thread on a stream of its own.
//!
//! - all-reduce: `ncclAllReduce` in place (F32, F16, BF16 with `ncclSum`);
//! - all-gather: `ncclAllGather` straight into the full tensor where every rank's slice is one
//!   block of the same size at its rank's place (an even split along the outermost axis);
//!   otherwise each rank's slice is broadcast from it (`ncclBroadcast`, the N of them in one
//!   NCCL group) into a staging block, from which every rank copies the slices' runs into its
//!   full tensor ([`GatherPlan`]);
//! - reduce-scatter: `ncclReduceScatter` in the same even case; otherwise the full partial
//!   tensor is copied to staging, summed there by `ncclAllReduce`, and the rank's runs copied
//!   out (twice the bytes of a true reduce-scatter, for any layout);
//! - broadcast: `ncclBroadcast` in place.
//!
//! Unlike the CPU and `cuda-peer` communicators, the sums are NCCL's: its ring or tree order,
//! F16 and BF16 added in their own precision, so results agree with them within rounding, not
//! bit for bit. Before each collective the ranks meet at a host barrier ([`Rendezvous`]), which
//! checks that they called the same collective with the same sizes and layout (NCCL itself
//! would hang or corrupt memory) and gives the group its timeout: a rank waiting longer for its
//! peers, or for its stream after the NCCL call, fails the group and aborts the NCCL
//! communicators (`ncclCommAbort`), which releases the other ranks' kernels.
//!
//! Not yet run on a GPU: the GPU machines lent so far have one GPU, and NCCL takes one rank per
//! GPU (`cuda:0x2` uses `cuda-peer`). The logic that needs no GPU (which plan an all-gather
//! takes, the staging offsets and copies, refusing a GPU named twice) is tested in
//! `tests/cuda_kernels.rs`; `cuda_models` runs SmolLM2 on `cuda:0,1` wherever two GPUs are
//! present (docs/cuda.md).

use super::comm::{Deposit, Rendezvous, Stream, dev_ptr_of};
use super::device::{CudaDevice, Gpu, driver_err};
use super::libs::{Lib, missing, present};
use crate::backend::Device;
use crate::backend::layout::SliceLayout;
use crate::buffer::BufferRange;
use crate::collectives::{Communicator, CommunicatorFactory};
use crate::{DType, Error, Result};
use cudarc::driver::{result as cu, sys};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use parking_lot::Mutex;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The ranks of a group of `ordinals` (the GPU of each device, in rank order) as NCCL's device
/// list, or why NCCL cannot join them: an empty group, or a GPU named twice (NCCL takes one
/// rank per GPU; logical devices of one GPU join through `cuda-peer`).
pub fn nccl_device_list(ordinals: &[usize]) -> Result<Vec<i32>> {
    if ordinals.is_empty() {
        return Err(Error::invalid_argument("devices", "[]", "at least one GPU"));
    }
    for (i, &o) in ordinals.iter().enumerate() {
        if ordinals[..i].contains(&o) {
            return Err(Error::Device {
                device: format!("cuda{o}"),
                reason: "NCCL takes one rank per GPU and this GPU is named twice (logical \
                         devices of one GPU, `cuda:0x2`, join through cuda-peer)"
                    .into(),
            });
        }
    }
    Ok(ordinals.iter().map(|&o| o as i32).collect())
}

/// How an all-gather (or a reduce-scatter) of a layout runs over NCCL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GatherPlan {
    /// Rank r's slice is bytes `r * bytes .. (r + 1) * bytes` of the full tensor, for every
    /// rank: NCCL's own all-gather (reduce-scatter) of `bytes` per rank, no staging.
    Direct { bytes: usize },
    /// Rank q's slice goes to staging bytes `at[q] .. at[q] + local_bytes(q)`; the full tensor
    /// is then filled run by run from there ([`staged_copies`]). `total`: staging bytes.
    Staged { at: Vec<usize>, total: usize },
}

/// The plan for `layout`: [`GatherPlan::Direct`] when every rank's slice is one block of the
/// same size at its rank's place, else [`GatherPlan::Staged`].
pub fn gather_plan(layout: &SliceLayout) -> GatherPlan {
    let world = layout.world();
    let bytes = layout.local_bytes(0);
    let direct = (0..world).all(|r| {
        let mut runs = layout.runs(r).filter(|run| run.len > 0);
        layout.local_bytes(r) == bytes
            && match (runs.next(), runs.next()) {
                (Some(run), None) => run.full == r * bytes && run.local == 0 && run.len == bytes,
                (None, _) => bytes == 0,
                _ => false,
            }
    });
    if direct {
        return GatherPlan::Direct { bytes };
    }
    let mut at = Vec::with_capacity(world);
    let mut total = 0;
    for r in 0..world {
        at.push(total);
        total += layout.local_bytes(r);
    }
    GatherPlan::Staged { at, total }
}

/// The copies `(staging offset, full offset, bytes)` that fill the full tensor from a staged
/// all-gather's staging block (every rank's slice at `at[rank]`).
pub fn staged_copies(layout: &SliceLayout, at: &[usize]) -> Vec<(usize, usize, usize)> {
    (0..layout.world())
        .flat_map(|q| {
            layout
                .runs(q)
                .filter(|run| run.len > 0)
                .map(move |run| (at[q] + run.local, run.full, run.len))
        })
        .collect()
}

/// Joins devices on different GPUs through NCCL.
pub struct NcclFactory;

impl CommunicatorFactory for NcclFactory {
    fn name(&self) -> String {
        "nccl".into()
    }

    fn create(
        &self,
        devices: &[Arc<dyn Device>],
        timeout: Duration,
    ) -> Result<Arc<dyn Communicator>> {
        let gpus = devices
            .iter()
            .map(|d| {
                d.as_any()
                    .downcast_ref::<CudaDevice>()
                    .map(|c| c.gpu.clone())
                    .ok_or_else(|| Error::Device {
                        device: d.name(),
                        reason: "NCCL joins CUDA devices only".into(),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(NcclComm::new(gpus, timeout)?))
    }
}

/// A NCCL communicator handle of one rank.
struct Handle(nccl_sys::ncclComm_t);
// SAFETY: a rank's handle is used by that rank's calls (one at a time, by the Communicator
// contract) and by `abort`, which NCCL allows from another thread (ncclCommAbort).
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

/// Device memory a rank stages through; grows, never shrinks.
#[derive(Default)]
struct Staging {
    ptr: u64,
    size: usize,
}

pub struct NcclComm {
    gpus: Vec<Arc<Gpu>>,
    comms: Vec<Handle>,
    streams: Vec<Stream>,
    staging: Vec<Mutex<Staging>>,
    meet: Rendezvous,
    timeout: Duration,
    moved: Vec<AtomicU64>,
    /// The NCCL communicators were aborted (which frees them).
    aborted: std::sync::atomic::AtomicBool,
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let aborted = *self.aborted.get_mut();
        for (r, gpu) in self.gpus.iter().enumerate() {
            if gpu.bind().is_err() {
                continue;
            }
            // SAFETY: owned by this group and released once, after the stream drained; an
            // aborted communicator was already freed by ncclCommAbort (a group that failed at
            // a host barrier only still holds its communicators, idle).
            unsafe {
                let _ = cu::stream::synchronize(self.streams[r].0);
                if !aborted {
                    let _ = nccl::comm_destroy(self.comms[r].0);
                }
                let s = self.staging[r].get_mut();
                if s.size > 0 {
                    let _ = cu::free_sync(s.ptr);
                }
                let _ = cu::stream::destroy(self.streams[r].0);
            }
        }
    }
}

fn dev_ptr(r: &BufferRange, what: &str) -> Result<u64> {
    dev_ptr_of("nccl", r, what)
}

/// NCCL's type for summing `dtype`, and its size.
fn nccl_type(dtype: DType) -> Result<(nccl_sys::ncclDataType_t, usize)> {
    match dtype {
        DType::F32 => Ok((nccl_sys::ncclDataType_t::ncclFloat32, 4)),
        DType::F16 => Ok((nccl_sys::ncclDataType_t::ncclFloat16, 2)),
        DType::BF16 => Ok((nccl_sys::ncclDataType_t::ncclBfloat16, 2)),
        other => Err(Error::Internal {
            component: "nccl",
            reason: format!("cannot sum {other} tensors"),
        }),
    }
}

const BYTES: nccl_sys::ncclDataType_t = nccl_sys::ncclDataType_t::ncclUint8;
const SUM: nccl_sys::ncclRedOp_t = nccl_sys::ncclRedOp_t::ncclSum;

impl NcclComm {
    pub fn new(gpus: Vec<Arc<Gpu>>, timeout: Duration) -> Result<NcclComm> {
        let list = nccl_device_list(&gpus.iter().map(|g| g.ordinal).collect::<Vec<_>>())?;
        if !present(Lib::Nccl) {
            return Err(Error::Device {
                device: format!("cuda:{list:?}"),
                reason: missing(Lib::Nccl),
            });
        }
        let world = gpus.len();
        let mut comms = vec![std::ptr::null_mut(); world];
        // SAFETY: `comms` has room for `world` handles and `list` names `world` distinct GPUs.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), world as i32, list.as_ptr()) }.map_err(
            |e| Error::Device {
                device: format!("cuda:{list:?}"),
                reason: format!("ncclCommInitAll: {e:?}"),
            },
        )?;
        let mut streams = Vec::with_capacity(world);
        for g in &gpus {
            g.bind()?;
            let s = cu::stream::create(cu::stream::StreamKind::Default)
                .map_err(|e| driver_err(&g.label(), "cuStreamCreate", e))?;
            streams.push(Stream(s));
        }
        let label = format!(
            "nccl({})",
            gpus.iter().map(|g| g.label()).collect::<Vec<_>>().join(",")
        );
        Ok(NcclComm {
            comms: comms.into_iter().map(Handle).collect(),
            streams,
            staging: (0..world).map(|_| Mutex::new(Staging::default())).collect(),
            meet: Rendezvous::of_kind("nccl", &label, world, timeout),
            timeout,
            moved: (0..world).map(|_| AtomicU64::new(0)).collect(),
            aborted: std::sync::atomic::AtomicBool::new(false),
            gpus,
        })
    }

    fn world(&self) -> usize {
        self.gpus.len()
    }

    /// Fail the group and abort every rank's NCCL communicator (which ends their kernels).
    fn fail_with(&self, reason: String) -> Error {
        let e = self.meet.fail_with(reason);
        if !self.aborted.swap(true, Ordering::SeqCst) {
            for h in &self.comms {
                // SAFETY: a communicator of this group; NCCL allows aborting from any thread.
                let _ = unsafe { nccl::comm_abort(h.0) };
            }
        }
        e
    }

    /// Bind the rank's GPU and meet the other ranks with what this call is (`sig`).
    fn enter(&self, rank: usize, sig: (u8, u64), what: &str) -> Result<()> {
        if rank >= self.world() {
            return Err(Error::invalid_argument(
                "rank",
                rank.to_string(),
                format!("this group has {} ranks", self.world()),
            ));
        }
        self.gpus[rank].bind()?;
        self.meet
            .meet(rank, Deposit { a: 0, sig }, what)
            .map(|_| ())
    }

    fn stream(&self, rank: usize) -> sys::CUstream {
        self.streams[rank].0
    }

    fn nccl_err(&self, rank: usize, what: &str, e: nccl::NcclError) -> Error {
        self.fail_with(format!("rank {rank}: {what}: {e:?}"))
    }

    /// Wait for the rank's stream, at most the group's timeout (polling, so that a peer that
    /// never launched its part cannot hang this rank); then fail the group.
    fn drain(&self, rank: usize) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        loop {
            // SAFETY: the rank's own stream.
            match unsafe { sys::cuStreamQuery(self.stream(rank)) } {
                sys::CUresult::CUDA_SUCCESS => return Ok(()),
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => {
                    return Err(self.fail_with(format!("rank {rank}: cuStreamQuery: {e:?}")));
                }
            }
            if let Some(f) = self.meet.failure() {
                // The group failed elsewhere (a peer late at a barrier): abort, so that this
                // rank's NCCL kernels, which wait for that peer, end (the first reason stays).
                return Err(self.fail_with(f));
            }
            if Instant::now() >= deadline {
                return Err(self.fail_with(format!(
                    "rank {rank}: its NCCL work did not finish within {:?}",
                    self.timeout
                )));
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    fn copy(&self, rank: usize, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 || dst == src {
            return Ok(());
        }
        // SAFETY: both ranges lie in live device memory of this rank's GPU (checked by the
        // callers against the buffers and the layout).
        unsafe { cu::memcpy_dtod_async(dst, src, len, self.stream(rank)) }
            .map_err(|e| self.fail_with(format!("rank {rank}: cuMemcpyDtoDAsync: {e:?}")))
    }

    /// At least `bytes` of the rank's staging memory (its stream drained before a regrowth).
    fn staging(&self, rank: usize, bytes: usize) -> Result<u64> {
        let mut s = self.staging[rank].lock();
        if s.size < bytes {
            self.drain(rank)?;
            if s.size > 0 {
                // SAFETY: allocated below by an earlier call; nothing in flight uses it.
                unsafe { cu::free_sync(s.ptr) }
                    .map_err(|e| self.fail_with(format!("rank {rank}: cuMemFree: {e:?}")))?;
                *s = Staging::default();
            }
            let size = bytes.next_power_of_two();
            // SAFETY: the rank's context is bound (`enter`).
            let ptr = unsafe { cu::malloc_sync(size) }.map_err(|e| Error::Device {
                device: self.gpus[rank].label(),
                reason: format!("cannot allocate {size} bytes of NCCL staging memory: {e:?}"),
            })?;
            *s = Staging { ptr, size };
        }
        Ok(s.ptr)
    }

    fn count(&self, rank: usize, bytes: usize) {
        self.moved[rank].fetch_add(bytes as u64, Ordering::Relaxed);
    }

    fn comm(&self, rank: usize) -> nccl_sys::ncclComm_t {
        self.comms[rank].0
    }

    fn cstream(&self, rank: usize) -> nccl_sys::cudaStream_t {
        self.stream(rank) as nccl_sys::cudaStream_t
    }
}

fn vp(a: u64) -> *mut c_void {
    a as *mut c_void
}

impl Communicator for NcclComm {
    fn name(&self) -> String {
        format!("nccl({})", self.world())
    }

    fn world_size(&self) -> usize {
        self.world()
    }

    fn all_reduce(&self, rank: usize, buf: &BufferRange, dtype: DType) -> Result<()> {
        let (ty, e) = nccl_type(dtype)?;
        self.enter(rank, (1, buf.len as u64), "all-reduce")?;
        let p = dev_ptr(buf, "the all-reduce buffer")?;
        // SAFETY: `p` holds `buf.len` bytes on this rank's GPU; in place.
        unsafe {
            nccl::all_reduce(
                vp(p),
                vp(p),
                buf.len / e,
                ty,
                SUM,
                self.comm(rank),
                self.cstream(rank),
            )
        }
        .map_err(|err| self.nccl_err(rank, "ncclAllReduce", err))?;
        self.count(rank, 2 * buf.len * (self.world() - 1) / self.world());
        self.drain(rank)
    }

    fn all_gather(
        &self,
        rank: usize,
        local: &BufferRange,
        full: &BufferRange,
        layout: &SliceLayout,
    ) -> Result<()> {
        self.enter(rank, (2, layout.fingerprint()), "all-gather")?;
        let (l, f) = (
            dev_ptr(local, "the local slice")?,
            dev_ptr(full, "the full tensor")?,
        );
        if full.len < layout.full_bytes() || local.len < layout.local_bytes(rank) {
            return Err(self.fail_with(format!(
                "rank {rank}: all-gather buffers smaller than the layout"
            )));
        }
        match gather_plan(layout) {
            GatherPlan::Direct { bytes } => {
                // SAFETY: `l` holds `bytes`, `f` world * bytes (checked above).
                unsafe {
                    nccl::all_gather(
                        vp(l),
                        vp(f),
                        bytes,
                        BYTES,
                        self.comm(rank),
                        self.cstream(rank),
                    )
                }
                .map_err(|e| self.nccl_err(rank, "ncclAllGather", e))?;
            }
            GatherPlan::Staged { at, total } => {
                let s = self.staging(rank, total)?;
                nccl::group_start().map_err(|e| self.nccl_err(rank, "ncclGroupStart", e))?;
                for (q, &off) in at.iter().enumerate() {
                    let n = layout.local_bytes(q);
                    let send = if q == rank { l } else { s + off as u64 };
                    // SAFETY: the root sends its `n`-byte slice; every rank receives it at
                    // `off` of its staging block of `total` bytes.
                    let r = unsafe {
                        nccl::broadcast(
                            vp(send),
                            vp(s + off as u64),
                            n,
                            BYTES,
                            q as i32,
                            self.comm(rank),
                            self.cstream(rank),
                        )
                    };
                    if let Err(e) = r {
                        let _ = nccl::group_end();
                        return Err(self.nccl_err(rank, "ncclBroadcast", e));
                    }
                }
                nccl::group_end().map_err(|e| self.nccl_err(rank, "ncclGroupEnd", e))?;
                for (src, dst, len) in staged_copies(layout, &at) {
                    self.copy(rank, f + dst as u64, s + src as u64, len)?;
                }
            }
        }
        self.count(rank, layout.full_bytes() - layout.local_bytes(rank));
        self.drain(rank)
    }

    fn reduce_scatter(
        &self,
        rank: usize,
        full: &BufferRange,
        local: &BufferRange,
        layout: &SliceLayout,
        dtype: DType,
    ) -> Result<()> {
        let (ty, e) = nccl_type(dtype)?;
        self.enter(rank, (3, layout.fingerprint()), "reduce-scatter")?;
        let (f, l) = (
            dev_ptr(full, "the full tensor")?,
            dev_ptr(local, "the local slice")?,
        );
        let fb = layout.full_bytes();
        if full.len < fb || local.len < layout.local_bytes(rank) {
            return Err(self.fail_with(format!(
                "rank {rank}: reduce-scatter buffers smaller than the layout"
            )));
        }
        match gather_plan(layout) {
            GatherPlan::Direct { bytes } if bytes % e == 0 => {
                // SAFETY: `f` holds world * bytes, `l` bytes (checked above).
                unsafe {
                    nccl::reduce_scatter(
                        vp(f),
                        vp(l),
                        bytes / e,
                        ty,
                        SUM,
                        self.comm(rank),
                        self.cstream(rank),
                    )
                }
                .map_err(|err| self.nccl_err(rank, "ncclReduceScatter", err))?;
            }
            _ => {
                // The whole partial tensor summed in staging, the rank's runs copied out.
                let s = self.staging(rank, fb)?;
                self.copy(rank, s, f, fb)?;
                // SAFETY: the staging block holds `fb` bytes; in place.
                unsafe {
                    nccl::all_reduce(
                        vp(s),
                        vp(s),
                        fb / e,
                        ty,
                        SUM,
                        self.comm(rank),
                        self.cstream(rank),
                    )
                }
                .map_err(|err| self.nccl_err(rank, "ncclAllReduce", err))?;
                for run in layout.runs(rank) {
                    self.copy(rank, l + run.local as u64, s + run.full as u64, run.len)?;
                }
            }
        }
        self.count(rank, fb - layout.local_bytes(rank));
        self.drain(rank)
    }

    fn broadcast(&self, rank: usize, root: usize, buf: &BufferRange) -> Result<()> {
        self.enter(rank, (4, (root as u64) << 32 | buf.len as u64), "broadcast")?;
        if root >= self.world() {
            return Err(self.fail_with(format!("broadcast from rank {root} of {}", self.world())));
        }
        let p = dev_ptr(buf, "the broadcast buffer")?;
        // SAFETY: `p` holds `buf.len` bytes on this rank's GPU; in place.
        unsafe {
            nccl::broadcast(
                vp(p),
                vp(p),
                buf.len,
                BYTES,
                root as i32,
                self.comm(rank),
                self.cstream(rank),
            )
        }
        .map_err(|e| self.nccl_err(rank, "ncclBroadcast", e))?;
        if rank != root {
            self.count(rank, buf.len);
        }
        self.drain(rank)
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
