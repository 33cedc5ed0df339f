//! The CUDA backend (cargo feature `cuda`): NVIDIA GPUs through cudarc (driver API, NVRTC
//! kernels, cuBLAS). The libraries are loaded at run time, so the crate builds without CUDA;
//! every entry point probes for them first ([`libs`]) and reports a missing one as an error,
//! never a panic. Without the feature, these functions return [`Error::CudaNotCompiled`] so
//! callers need no `cfg`.

#[cfg(feature = "cuda")]
pub mod backend;
#[cfg(feature = "cuda")]
pub mod comm;
#[cfg(feature = "cuda")]
pub mod device;
#[cfg(feature = "cuda")]
pub mod kernels;
#[cfg(feature = "cuda")]
pub mod libs;
#[cfg(feature = "cuda")]
pub mod nccl;

#[cfg(not(feature = "cuda"))]
use crate::Error;
use crate::Result;
use crate::backend::{Device, Registry};
use crate::cpu::Precision;
use std::sync::Arc;

/// The CUDA registry, when compiled in and a driver with at least one GPU is present.
pub fn registry() -> Option<Arc<dyn Registry>> {
    #[cfg(feature = "cuda")]
    {
        device::registry()
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

/// Parse `cuda` (every GPU), `cuda:0,1` or `cuda:0x2` (two logical devices on GPU 0), the
/// devices computing products of quantized weights at `precision` (`Q8`: 8-bit activations and
/// integer dot products for up to 8 activation rows).
pub fn parse_cuda_spec(spec: &str, precision: Precision) -> Result<Vec<Arc<dyn Device>>> {
    #[cfg(feature = "cuda")]
    {
        device::parse_spec_with(spec, precision)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (spec, precision);
        Err(Error::CudaNotCompiled)
    }
}
