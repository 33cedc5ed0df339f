//! metashard: run one compute graph across N devices with tensor parallelism.
//!
//! The crate follows ggml-backend's ladder (registry, device, buffer type, buffer, backend,
//! event) and the ggml meta backend's split states. See `ARCHITECTURE.md` for the code map.

pub mod bench;
pub mod cpu;
pub mod dtype;
pub mod error;

pub use dtype::DType;
pub use error::{Error, Result, Shape};
