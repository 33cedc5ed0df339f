//! Ranks as processes: a meta device whose devices live in different processes of one MPI job
//! (`mpirun -np N metashard ... --dist mpi --devices cpu:1xT`). Each process opens its own
//! device and is one rank of the meta device; the others are [`RemoteDevice`]s, stand-ins that
//! hold no memory and run nothing here (their programs run in their own processes). Every
//! process runs the same driver code on the same inputs, so every process builds the same
//! graphs, derives the same sharding and rewrites the same per-device programs, and runs only
//! its own rank's program; its collectives meet the peers' over MPI
//! (`collectives::mpi`, behind the cargo feature `mpi`).
//!
//! What changes for the meta device (see `meta/backend.rs`): it runs jobs only for local
//! devices, and makes every output it registers mirrored (an all-gather or all-reduce at the
//! end of each program) so each process reads outputs from its own device; greedy decoding
//! therefore picks the same token in every process. Weights placed in a meta buffer are
//! written only to the local device's slice: a [`RemoteBuffer`] ignores writes without reading
//! the data, so a process reads from the memory-mapped model file only the bytes of its own
//! slices (and the mirrored tensors).
//!
//! "The same inputs" is checked, not assumed (`agree.rs`): before loading, the ranks compare
//! what changes the math or the shapes and fail naming the first rank that differs, and rank
//! 0 owns the request (prompt tokens, sampling, step counts), which the others take from it.

use crate::backend::{Backend, Device, DeviceKind, GraphPlan, MemoryInfo};
use crate::buffer::{Buffer, BufferType, BufferUsage};
use crate::collectives::CommunicatorFactory;
use crate::graph::{Graph, TensorId};
use crate::tensor::Layout;
use crate::{Error, Result};
use parking_lot::Mutex;
use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

mod agree;
pub use agree::{Setting, agree, agree_over, share_from_leader, share_over, version};

/// How the devices of a device list are spread over processes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dist {
    /// All devices in this process (threads meeting in host memory).
    #[default]
    Local,
    /// One rank per process of an MPI job: this process owns the device list's one device.
    Mpi,
}

impl Dist {
    /// `local` or `mpi`.
    pub fn from_name(s: &str) -> Option<Dist> {
        match s {
            "local" | "none" => Some(Dist::Local),
            "mpi" => Some(Dist::Mpi),
            _ => None,
        }
    }
}

/// Whether this process was started by an MPI launcher (`mpirun`, `srun`): OpenMPI, PMIx and
/// Slurm set these variables.
pub fn launched_by_mpirun() -> bool {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMIX_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
}

/// This process's rank and the job size under `dist` (`(0, 1)` for `Local`). Initializes MPI
/// on the first call with `Mpi`.
pub fn rank_and_size(dist: Dist) -> Result<(usize, usize)> {
    match dist {
        Dist::Local => Ok((0, 1)),
        Dist::Mpi => mpi_rank_and_size(),
    }
}

#[cfg(feature = "mpi")]
fn mpi_rank_and_size() -> Result<(usize, usize)> {
    let w = crate::collectives::mpi::world()?;
    Ok((w.rank(), w.size()))
}

#[cfg(not(feature = "mpi"))]
fn mpi_rank_and_size() -> Result<(usize, usize)> {
    Err(Error::MpiNotCompiled)
}

/// This process's rank, if it is a rank of an MPI job that was started (without starting
/// one).
pub fn current_rank() -> Option<usize> {
    #[cfg(feature = "mpi")]
    return crate::collectives::mpi::started_rank();
    #[cfg(not(feature = "mpi"))]
    None
}

/// The rank the MPI launcher gave this process in its environment (OpenMPI, MPICH's Hydra,
/// Slurm), whether or not MPI started: what an error says before MPI runs or when it could
/// not start.
pub fn launcher_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

/// End this rank's part of the job if this process started MPI and its group did not fail
/// (call at the end of `main`, after a success; a no-op otherwise): every rank says it
/// finished and waits for the others' word, so a rank still waiting in a collective learns
/// that its peer finished ("rank 1 finished normally ...") instead of blaming it as stalled;
/// an error when a peer aborted or exited instead.
pub fn finalize() -> Result<()> {
    #[cfg(feature = "mpi")]
    return crate::collectives::mpi::finalize();
    #[cfg(not(feature = "mpi"))]
    Ok(())
}

/// This rank fails with `reason` outside any collective (call before exiting with an error):
/// the peers are told at once and report the reason, naming this rank, instead of waiting for
/// it. A no-op if this process did not start MPI.
pub fn abort(reason: &str) {
    #[cfg(feature = "mpi")]
    crate::collectives::mpi::abort(reason);
    #[cfg(not(feature = "mpi"))]
    let _ = reason;
}

/// How long the ranks of a job wait for each other at start-up: MPI's start, the first
/// exchange, and [`agree`] (`METASHARD_STARTUP_TIMEOUT` seconds, default 60).
pub fn startup_timeout() -> Result<Duration> {
    #[cfg(feature = "mpi")]
    return crate::collectives::mpi::startup_timeout().map_err(|reason| Error::Device {
        device: "mpi".into(),
        reason,
    });
    #[cfg(not(feature = "mpi"))]
    Ok(Duration::from_secs(60))
}

/// How long the ranks wait for rank 0's request ([`share_from_leader`]): it comes after the
/// weights are loaded, and ranks may finish loading minutes apart (a cold page cache, another
/// disk).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

/// The devices of a distributed meta device: `local` (exactly one device, this process's) at
/// this process's rank, [`RemoteDevice`]s elsewhere, all offering the group's communicator.
pub fn distributed_devices(
    spec: &str,
    local: Vec<Arc<dyn Device>>,
    dist: Dist,
) -> Result<Vec<Arc<dyn Device>>> {
    if dist == Dist::Local {
        return Ok(local);
    }
    one_device_per_process(spec, local.len())?;
    let factory = mpi_factory()?;
    let (rank, size) = rank_and_size(dist)?;
    let mut devices: Vec<Arc<dyn Device>> = Vec::with_capacity(size);
    for r in 0..size {
        if r == rank {
            devices.push(Arc::new(RankDevice {
                rank: r,
                inner: local[0].clone(),
                factory: factory.clone(),
            }));
        } else {
            devices.push(Arc::new(RemoteDevice {
                rank: r,
                factory: factory.clone(),
            }));
        }
    }
    Ok(devices)
}

/// With ranks as processes a process owns one device: `n`, the devices `spec` lists, must be 1.
pub fn one_device_per_process(spec: &str, n: usize) -> Result<()> {
    if n == 1 {
        return Ok(());
    }
    Err(Error::Device {
        device: spec.to_string(),
        reason: format!(
            "with --dist mpi each process is one rank and owns one device, but `{spec}` lists \
             {n}: use `cpu:1xT` (T threads) and start more processes"
        ),
    })
}

#[cfg(feature = "mpi")]
fn mpi_factory() -> Result<Arc<dyn CommunicatorFactory>> {
    let world = crate::collectives::mpi::world()?;
    Ok(Arc::new(crate::collectives::mpi::MpiCommunicatorFactory {
        world,
    }))
}

#[cfg(not(feature = "mpi"))]
fn mpi_factory() -> Result<Arc<dyn CommunicatorFactory>> {
    Err(Error::MpiNotCompiled)
}

/// This process's device as rank `rank` of a distributed meta device: the device itself, plus
/// the group's communicator.
pub struct RankDevice {
    pub rank: usize,
    pub inner: Arc<dyn Device>,
    factory: Arc<dyn CommunicatorFactory>,
}

impl Device for RankDevice {
    fn name(&self) -> String {
        format!("rank{}:{}", self.rank, self.inner.name())
    }
    fn description(&self) -> String {
        format!(
            "{} (rank {}, this process)",
            self.inner.description(),
            self.rank
        )
    }
    fn memory(&self) -> MemoryInfo {
        self.inner.memory()
    }
    fn kind(&self) -> DeviceKind {
        self.inner.kind()
    }
    fn caps(&self) -> crate::backend::DeviceCaps {
        self.inner.caps()
    }
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        self.inner.buffer_type()
    }
    fn host_buffer_type(&self) -> Option<Arc<dyn BufferType>> {
        self.inner.host_buffer_type()
    }
    fn init_backend(&self) -> Result<Arc<dyn Backend>> {
        self.inner.init_backend()
    }
    fn supports_op(&self, graph: &Graph, id: TensorId) -> std::result::Result<(), String> {
        self.inner.supports_op(graph, id)
    }
    fn supports_buffer_type(&self, bt: &dyn BufferType) -> bool {
        self.inner.supports_buffer_type(bt)
    }
    fn communicators(&self) -> Vec<Arc<dyn CommunicatorFactory>> {
        vec![self.factory.clone()]
    }
    /// The wrapped device's, so downcasts to its concrete type keep working.
    fn as_any(&self) -> &dyn Any {
        self.inner.as_any()
    }
}

/// Rank `rank` of a distributed meta device, owned by another process: it holds no memory
/// ([`RemoteBuffer`]s have only a size) and computes nothing here.
pub struct RemoteDevice {
    pub rank: usize,
    factory: Arc<dyn CommunicatorFactory>,
}

impl Device for RemoteDevice {
    fn name(&self) -> String {
        format!("rank{}", self.rank)
    }
    fn description(&self) -> String {
        format!("rank {} (another process)", self.rank)
    }
    fn memory(&self) -> MemoryInfo {
        MemoryInfo::default()
    }
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        Arc::new(RemoteBufferType { rank: self.rank })
    }
    fn init_backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(RemoteBackend { rank: self.rank }))
    }
    /// The owning process checks its own device.
    fn supports_op(&self, _graph: &Graph, _id: TensorId) -> std::result::Result<(), String> {
        Ok(())
    }
    fn supports_buffer_type(&self, bt: &dyn BufferType) -> bool {
        bt.as_any().is::<RemoteBufferType>()
    }
    fn communicators(&self) -> Vec<Arc<dyn CommunicatorFactory>> {
        vec![self.factory.clone()]
    }
    fn is_remote(&self) -> bool {
        true
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn elsewhere(rank: usize, what: &str) -> Error {
    Error::Device {
        device: format!("rank{rank}"),
        reason: format!("{what}: this memory lives in the process of rank {rank}"),
    }
}

/// Buffers of a [`RemoteDevice`]: sizes only.
pub struct RemoteBufferType {
    rank: usize,
}

impl BufferType for RemoteBufferType {
    fn name(&self) -> String {
        format!("remote(rank{})", self.rank)
    }
    fn alloc_buffer(&self, size: usize) -> Result<Arc<dyn Buffer>> {
        Ok(Arc::new(RemoteBuffer {
            rank: self.rank,
            size,
            usage: Mutex::new(BufferUsage::Any),
        }))
    }
    fn alignment(&self) -> usize {
        64
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A buffer of another process's rank: writes are dropped unread (that process writes its
/// own copy), reads are an error naming the rank.
pub struct RemoteBuffer {
    rank: usize,
    size: usize,
    usage: Mutex<BufferUsage>,
}

impl Buffer for RemoteBuffer {
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        Arc::new(RemoteBufferType { rank: self.rank })
    }
    fn size(&self) -> usize {
        self.size
    }
    fn set_tensor(&self, _: &Layout, _: usize, _: &[u8], _: usize) -> Result<()> {
        Ok(())
    }
    fn get_tensor(&self, _: &Layout, _: usize, _: &mut [u8], _: usize) -> Result<()> {
        Err(elsewhere(self.rank, "reading a tensor"))
    }
    fn memset_tensor(&self, _: &Layout, _: usize, _: u8, _: usize, _: usize) -> Result<()> {
        Ok(())
    }
    fn clear(&self, _: u8) {}
    fn usage(&self) -> BufferUsage {
        *self.usage.lock()
    }
    fn set_usage(&self, usage: BufferUsage) {
        *self.usage.lock() = usage;
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The backend of a [`RemoteDevice`]: plans that run nothing (the meta backend never runs a
/// remote device's program; its owner does).
struct RemoteBackend {
    rank: usize,
}

struct NoPlan;

impl GraphPlan for NoPlan {
    fn compute(&mut self, _: std::ops::Range<usize>) -> Result<()> {
        Ok(())
    }
}

impl Backend for RemoteBackend {
    fn name(&self) -> String {
        format!("remote(rank{})", self.rank)
    }
    fn device(&self) -> Arc<dyn Device> {
        // Only names are asked of it; a stand-in without a communicator.
        Arc::new(RemoteDevice {
            rank: self.rank,
            factory: Arc::new(crate::collectives::HostCommunicatorFactory),
        })
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn graph_compute(&self, _: &mut Graph) -> Result<()> {
        Err(elsewhere(self.rank, "computing a graph"))
    }
    fn graph_plan(&self, _: &Graph) -> Result<Box<dyn GraphPlan>> {
        Ok(Box::new(NoPlan))
    }
}

/// This process's rank and a communicator over the whole job (one rank per process) whose
/// waits give up after `timeout`: what `metashard selftest comm` and `bench comm` drive.
pub fn job_communicator(
    dist: Dist,
    timeout: std::time::Duration,
) -> Result<(usize, Arc<dyn crate::collectives::Communicator>)> {
    match dist {
        Dist::Local => Err(Error::invalid_argument(
            "--dist",
            "local",
            "a job communicator needs ranks as processes (--dist mpi under mpirun)",
        )),
        Dist::Mpi => mpi_job_communicator(timeout),
    }
}

#[cfg(feature = "mpi")]
fn mpi_job_communicator(
    timeout: std::time::Duration,
) -> Result<(usize, Arc<dyn crate::collectives::Communicator>)> {
    let w = crate::collectives::mpi::world()?;
    let rank = w.rank();
    Ok((
        rank,
        Arc::new(crate::collectives::mpi::MpiCommunicator::new(w, timeout)),
    ))
}

#[cfg(not(feature = "mpi"))]
fn mpi_job_communicator(
    _: std::time::Duration,
) -> Result<(usize, Arc<dyn crate::collectives::Communicator>)> {
    Err(Error::MpiNotCompiled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::HostCommunicatorFactory;

    fn remote(rank: usize) -> RemoteDevice {
        RemoteDevice {
            rank,
            factory: Arc::new(HostCommunicatorFactory),
        }
    }

    #[test]
    fn a_remote_buffer_drops_writes_and_refuses_reads_naming_the_rank() {
        let d = remote(2);
        assert!(d.is_remote());
        assert_eq!(d.name(), "rank2");
        let b = d.buffer_type().alloc_buffer(1 << 20).unwrap();
        assert_eq!(b.size(), 1 << 20);
        assert!(b.host_ptr().is_none());
        let l = Layout::contiguous(crate::DType::F32, [4, 1, 1, 1]);
        b.set_tensor(&l, 0, &[1u8; 16], 0).unwrap();
        let e = b.get_tensor(&l, 0, &mut [0u8; 16], 0).unwrap_err();
        assert!(e.to_string().contains("process of rank 2"), "{e}");
        let e = d.init_backend().unwrap().graph_compute(&mut Graph::new());
        assert!(e.is_err_and(|e| e.to_string().contains("rank2")));
    }

    #[test]
    fn a_process_owns_exactly_one_device() {
        let local = crate::parse_devices("cpu:2x1").unwrap();
        let Err(e) = distributed_devices("cpu:2x1", local, Dist::Mpi) else {
            panic!("two devices in one process were taken");
        };
        assert!(e.to_string().contains("lists 2: use `cpu:1xT`"), "{e}");
        let local = crate::parse_devices("cpu:2x1").unwrap();
        assert_eq!(
            distributed_devices("cpu:2x1", local, Dist::Local)
                .unwrap()
                .len(),
            2
        );
        assert_eq!(Dist::from_name("mpi"), Some(Dist::Mpi));
        assert_eq!(Dist::from_name("nccl"), None);
    }
}
