//! metashard: run one compute graph across N devices with tensor parallelism.
//!
//! The crate follows ggml-backend's ladder (registry, device, buffer type, buffer, backend,
//! event) and the ggml meta backend's split states. See `ARCHITECTURE.md` for the code map.

pub mod alloc;
pub mod backend;
pub mod buffer;
pub mod calibrate;
pub mod collectives;
pub mod cpu;
pub mod cuda;
pub mod devices;
pub mod dist;
pub mod dtype;
pub mod error;
pub mod graph;
pub mod io;
pub mod meta;
pub mod metrics;
pub mod models;
pub mod op;
pub mod planner;
pub mod runtime;
pub mod sched;
pub mod split_state;
pub mod tensor;
pub mod tokenizer;
pub mod verify;
pub mod workers;

pub use backend::{Backend, Device};
pub use buffer::{Buffer, BufferType, Storage};
pub use devices::{DeviceSet, parse_devices};
pub use dtype::DType;
pub use error::{Error, Result, Shape};
pub use graph::{Graph, TensorId};
pub use op::Op;
pub use tensor::Layout;
