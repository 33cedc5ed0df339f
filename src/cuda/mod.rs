//! The CUDA backend (cargo feature `cuda`): NVIDIA GPUs through cudarc (driver API, NVRTC
//! kernels, cuBLAS). The libraries are loaded at run time, so the crate builds without CUDA;
//! every entry point probes for them first ([`libs`]) and reports a missing one as an error,
//! never a panic. Without the feature, these functions return [`Error::CudaNotCompiled`] so
//! callers need no `cfg`.

#[cfg(feature = "cuda")]
pub mod kernels;
#[cfg(feature = "cuda")]
pub mod libs;

use crate::backend::{Device, Registry};
use crate::{Error, Result};
use std::sync::Arc;

/// The CUDA registry, when compiled in and a driver is present.
pub fn registry() -> Option<Arc<dyn Registry>> {
    None
}

/// Parse `cuda`, `cuda:0,1`.
pub fn parse_cuda_spec(spec: &str) -> Result<Vec<Arc<dyn Device>>> {
    if cfg!(feature = "cuda") {
        Err(Error::Device {
            device: spec.to_string(),
            reason: "the CUDA backend is not implemented in this build yet".into(),
        })
    } else {
        Err(Error::CudaNotCompiled)
    }
}
