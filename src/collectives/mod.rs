//! Collectives for a group of N ranks, one thread per rank: implementations of the
//! [`Communicator`] trait (all-reduce, all-gather, reduce-scatter, broadcast, abort over buffer
//! handles) and of the [`CommunicatorFactory`] a device offers to say which groups it can join
//! (both traits, and the [`SliceLayout`] that says which bytes of a full tensor each rank
//! holds, are defined in the backend layer, `crate::backend`, and re-exported here): the
//! in-process [`CpuCommunicator`] over host memory (the fallback every host device can use),
//! MPI across processes (`mpi`), and the rank-order sums they share (`reduce`).
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
#[cfg(feature = "mpi")]
pub mod mpi;
pub(crate) mod reduce;

/// The traits and the slice layout live in the backend layer (devices name the communicators
/// they can join); re-exported so `collectives::Communicator` and friends keep working.
pub use crate::backend::layout;
pub use crate::backend::{Communicator, CommunicatorFactory};
pub use cpu::{CpuCommunicator, HostCommunicatorFactory};
pub use layout::{Run, Runs, SliceLayout};

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
