//! The sharding planner: which split is fastest for a model on a cluster, whether it fits, and
//! what it costs in communication, answered without running it, then checked by running it.
//!
//! - `cluster.rs`: [`Cluster`], the cost model's devices and links (alpha-beta collectives),
//!   JSON profiles.
//! - `shape.rs`: [`ModelShape`], a decoder without its weights (GGUF header, config.json,
//!   presets).
//! - `virtual_device.rs`: devices without memory, so a model is placed and sharded exactly as
//!   a run would, without weights.

pub mod calibrate;
pub mod cluster;
pub mod presets;
pub mod shape;
pub mod virtual_device;

pub use calibrate::{CalibrateOptions, Calibration, calibrate, calibrate_report};
pub use cluster::{Cluster, Collective, CollectiveFit, DeviceProfile, LinkLevel, Links};
pub use presets::PRESET_NAMES;
pub use shape::{ModelShape, WeightTypes};
pub use virtual_device::VirtualDevice;
