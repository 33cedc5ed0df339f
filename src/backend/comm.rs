//! The communicator rung of the backend ladder: the [`Communicator`] trait (all-reduce,
//! all-gather, reduce-scatter, broadcast, abort) over [`BufferRange`] handles, and the
//! [`CommunicatorFactory`] a device offers ([`Device::communicators`]) to say which groups it
//! can join. The implementations live above the backend layer: host memory and MPI in
//! `crate::collectives` (whose module doc gives the determinism and failure model every
//! implementation follows), peer memory of one GPU in `crate::cuda`.

use super::Device;
use super::layout::SliceLayout;
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
    /// F32, F16 or BF16 (half types are summed in f32 and rounded once, see `crate::collectives`).
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
/// [`HostCommunicatorFactory`](crate::collectives::HostCommunicatorFactory) over host memory. A group is made again after it fails.
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
