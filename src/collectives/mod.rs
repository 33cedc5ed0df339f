//! Collectives for a group of N ranks, one thread per rank: the [`Communicator`] trait
//! (all-reduce, all-gather, reduce-scatter, broadcast, abort) over buffer handles, the
//! [`CommunicatorFactory`] a device offers to say which groups it can join, the
//! [`SliceLayout`] that says which bytes of a full tensor each rank holds, and the in-process
//! [`CpuCommunicator`] over host memory (the fallback every host device can use).
//!
//! # Algorithms and bytes moved of the CPU communicator (per rank, buffer of B bytes, N ranks)
//!
//! The CPU communicator is zero-copy: each rank publishes a pointer to its buffer, the ranks
//! meet at a barrier, then each accesses its peers' buffers directly, and a final barrier
//! ends the call. `bytes_moved` counts the bytes a rank read from or wrote to peers' buffers.
//!
//! - **all-reduce**: a reduce-scatter and an all-gather over N chunks of the buffer, fused
//!   (chunk edges on 64-byte multiples): rank r reads chunk r of every rank's buffer, sums it,
//!   and writes the sum into chunk r of every rank's buffer. It reads (N-1)·B/N and writes
//!   (N-1)·B/N of peers' memory, 2(N-1)/N·B in all, the bandwidth-optimal amount, with two
//!   barriers. Each chunk of every buffer is touched by one rank only, so no cache line is
//!   read by one core and then written by another within a call. Such writes (an upgrade of
//!   a line shared with another core) are the slow case: ~7 ns per 64-byte line on the
//!   EPYC guest we measured, against ~1 ns for a line another core holds modified. The
//!   unfused variant (each rank pulls the other chunks after a middle barrier) writes every
//!   line of its buffer that way and needs a third barrier.
//! - **all-gather**: rank r copies each peer's slice into its full tensor along the layout's
//!   runs: Σ_{q≠r} local_bytes(q), about (N-1)/N of the full tensor.
//! - **reduce-scatter**: rank r sums its own runs of every rank's full tensor into its slice,
//!   reading (N-1)·local_bytes(r).
//! - **broadcast**: every non-root rank copies B bytes from the root.
//!
//! During a call, peers read every rank's input buffers and, for all-reduce, write into the
//! rank's buffer: the caller must not touch its buffers until the call returns (the borrows
//! say so). Buffers aligned to 64 bytes keep chunk edges off shared cache lines. A rank's calls
//! may come from different threads one after another, never at the same time (refused).
//!
//! # Determinism
//!
//! Every reduced element is `x_0 + x_1 + ... + x_{N-1}` added in rank order, computed by
//! exactly one rank and copied by the others, so every rank ends with bit-identical results,
//! the result does not depend on the chunking, and reduce-scatter followed by all-gather gives
//! exactly the all-reduce result. F32 is added in f32. F16 and BF16 are widened to f32 (exact),
//! added in f32 in the same order, and rounded to the half type once per element at the end
//! (round to nearest, ties to even): the only half-precision rounding is the last one.
//!
//! # Failure model
//!
//! Any error fails the whole communicator: a bad argument on one rank, calls that do not match
//! across ranks (different collective, sizes, dtype, layout or root, detected by comparing what
//! every rank published at the first barrier), [`Communicator::abort`], a rank panicking
//! inside a collective, or a rank waiting longer than the timeout for a peer (a rank that
//! never arrives). Every rank's pending collective then returns
//! [`Error::Collective`](crate::Error::Collective) promptly, and every later call on every
//! rank returns an error too: a failed communicator stays failed; make a new one. A rank
//! leaving with an error first waits until no peer still accesses its buffers, so the caller
//! may free them as soon as the call returns. After an error the contents of the output
//! buffers (all-reduce's in-place buffer included) are unspecified. Hold an [`AbortOnPanic`]
//! in each rank's worker so that a panic outside a collective releases the peers at once
//! instead of after the timeout.

pub mod cpu;
pub mod layout;
#[cfg(feature = "mpi")]
pub mod mpi;
pub(crate) mod reduce;

pub use cpu::{CpuCommunicator, HostCommunicatorFactory};
pub use layout::{Run, Runs, SliceLayout};

use crate::backend::Device;
use crate::buffer::BufferRange;
use crate::{DType, Result};
use std::sync::Arc;
use std::time::Duration;

/// A group of `world_size()` ranks; rank r calls every collective from its own thread, all
/// ranks make the same calls in the same order. Buffers are handles to device memory
/// ([`BufferRange`]: a buffer, an offset, a length) holding raw bytes of the element type; each
/// communicator reaches them the way its devices can (host pointers, device pointers, a
/// transport). During a call, peers may read and write the rank's buffers: the caller leaves
/// them alone until the call returns.
pub trait Communicator: Send + Sync {
    /// What kind of group this is, for logs and reports (`host(2)`, `nccl(8)`).
    fn name(&self) -> String;

    fn world_size(&self) -> usize;

    /// Sum `buf` over ranks, element-wise; every rank ends with the sum, in place. `dtype` is
    /// F32, F16 or BF16 (half types are summed in f32 and rounded once, see the module doc).
    fn all_reduce(&self, rank: usize, buf: &BufferRange, dtype: DType) -> Result<()>;

    /// Every rank's slice `local` (per `layout`) into the full tensor `full` on every rank.
    /// Byte moves only: works for any dtype, quantized blocks included, through the layout.
    fn all_gather(
        &self,
        rank: usize,
        local: &BufferRange,
        full: &BufferRange,
        layout: &SliceLayout,
    ) -> Result<()>;

    /// Sum the full partial tensors of all ranks and leave rank r's slice (per `layout`) of
    /// the sum in `local`. `dtype` as for [`Communicator::all_reduce`].
    fn reduce_scatter(
        &self,
        rank: usize,
        full: &BufferRange,
        local: &BufferRange,
        layout: &SliceLayout,
        dtype: DType,
    ) -> Result<()>;

    /// Copy `buf` of rank `root` into `buf` on every rank.
    fn broadcast(&self, rank: usize, root: usize, buf: &BufferRange) -> Result<()>;

    /// Mark the group failed because of `rank`: every pending and future collective on every
    /// rank returns an error promptly.
    fn abort(&self, rank: usize, reason: &str);

    /// Why the group failed, if it did (a failed group stays failed; make a new one).
    fn failure(&self) -> Option<String>;

    /// Bytes this rank read from or wrote to other ranks' memory so far (tests, reports).
    fn bytes_moved(&self, _rank: usize) -> u64 {
        0
    }
}

/// A kind of communicator devices can join: a device lists the ones it can
/// ([`Device::communicators`]), and the meta device makes a group with the first kind all its
/// devices offer (same [`name`](CommunicatorFactory::name)), falling back to
/// [`HostCommunicatorFactory`] over host memory. A group is made again after it fails.
pub trait CommunicatorFactory: Send + Sync {
    /// Equal for every device that can join the same group (`host`, `cuda-peer:0`, `nccl`).
    fn name(&self) -> String;

    /// A new group in which rank r is `devices[r]`, whose ranks give up waiting for a peer
    /// after `timeout`; an error says why these devices cannot form one.
    fn create(
        &self,
        devices: &[Arc<dyn Device>],
        timeout: Duration,
    ) -> Result<Arc<dyn Communicator>>;
}

/// Aborts the communicator for `rank` if dropped while its thread panics: hold one in each
/// rank's worker so peers are released at once rather than after the timeout.
pub struct AbortOnPanic<'a> {
    comm: &'a dyn Communicator,
    rank: usize,
}

impl<'a> AbortOnPanic<'a> {
    pub fn new(comm: &'a dyn Communicator, rank: usize) -> Self {
        AbortOnPanic { comm, rank }
    }
}

impl Drop for AbortOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.comm.abort(self.rank, "its thread panicked");
        }
    }
}
