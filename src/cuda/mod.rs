//! CUDA backend entry points. The backend itself is not built yet; without it (or without the
//! `cuda` feature) these return a clear error so callers need no `cfg`.

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
