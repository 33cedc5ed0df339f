//! The CPU backend: 1..16 logical devices on one host, each with its own thread pool, aligned
//! host buffers, and kernels per op family.

pub mod backend;
pub mod buffer;
pub mod convert;
pub mod device;
pub mod matmul;
mod ops;
pub mod pool;
mod profile;
pub mod simd;
pub mod view;

pub use backend::CpuBackend;
pub use buffer::{CpuBuffer, CpuBufferType};
pub use device::{
    CpuDevice, CpuOptions, CpuRegistry, MAX_THREADS_ENV, default_max_threads, host_threads,
    max_total_threads, parse_cpu_spec, parse_cpu_spec_with,
};
pub use pool::{Barrier, ThreadPool};
pub use view::{ComputeParams, Precision, TensorView, split_range};
