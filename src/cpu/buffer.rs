//! Host memory of the CPU backend: the backend-neutral aligned host allocation
//! (`crate::buffer::host`) under the CPU backend's names; its buffer type is named "CPU".

pub use crate::buffer::host::{
    HOST_ALIGN as CPU_ALIGN, HostBuffer as CpuBuffer, HostBufferType as CpuBufferType,
};
