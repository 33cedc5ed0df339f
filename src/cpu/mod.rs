//! The CPU backend: 1..16 logical devices on one host, each with its own thread pool, aligned
//! host buffers, and kernels per op family.

pub mod matmul;
pub mod pool;
pub mod simd;
pub mod view;

pub use pool::{Barrier, ThreadPool};
pub use view::{ComputeParams, TensorView, split_range};
