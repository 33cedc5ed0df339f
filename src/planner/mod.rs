//! The sharding planner: which split is fastest for a model on a cluster, whether it fits, and
//! what it costs in communication, answered without running it, then checked by running it.
//!
//! - `cluster.rs`: [`Cluster`], the cost model's devices and links (alpha-beta collectives),
//!   JSON profiles.
//! - `fit.rs`: the pure half of calibration: measured collective times fitted to alpha-beta
//!   links, a cluster assembled from measured rates (the measuring half is `crate::calibrate`).
//! - `shape.rs`: [`ModelShape`], a decoder without its weights (GGUF header, config.json,
//!   presets); `model_presets.rs`: presets kept as their published `config.json` (the
//!   mixtures of experts, with their checkpoints' sizes).
//! - `experts.rs`: mixtures of experts: their `config.json` keys, what an expert product
//!   streams and computes under a routing skew, the experts each device holds.
//! - `evaluate.rs`: the cost model: predicted prefill and decode time, collectives and memory
//!   per device of any split callback for a [`Workload`], from the real per-device programs.
//! - `strategy.rs`: the named strategies (assignments of split states), device shares.
//! - `search.rs`: `auto`, a dynamic program over tied layers under memory budgets.
//! - `layouts.rs`: how many devices and how to group them: `auto` on subsets of the devices
//!   (`auto_devices`), hybrid and layer splits of groups the nodes suggest, replicas for a
//!   batch; the fastest chosen (the fewest devices within 2%), the others with their costs.
//! - `layer.rs`: the layer split (whole layers per device, micro-batches pipelined through
//!   them) and the
//!   hybrid split (groups of devices under Megatron, layers across the groups) in the same
//!   cost model, for `plan --strategy layer|hybrid` and the comparisons in a searched plan.
//! - `report.rs`: the readable [`Plan`] (tables, JSON plan files, DOT of one layer).
//! - `virtual_device.rs`: devices without memory, so a model is placed and sharded exactly as
//!   a run would, without weights.

pub mod cluster;
pub mod evaluate;
pub mod experts;
pub mod fit;
pub mod layer;
pub mod layouts;
pub mod model_presets;
pub mod presets;
pub mod report;
pub mod search;
pub mod shape;
pub mod strategy;
pub mod virtual_device;

pub use cluster::{
    CALIBRATED_M, Cluster, Collective, CollectiveFit, DeviceProfile, LinkLevel, Links, MAX_DEVICES,
    PIPELINE_FACTOR, STEP_FACTOR,
};
pub use evaluate::{Evaluation, Placed, Workload, evaluate};
pub use fit::{LinkFitReport, LinkSample, fit_collective, fit_level};
pub use layer::{
    LayerSplitCost, MicroBatches, evaluate_hybrid_split, evaluate_hybrid_split_with,
    evaluate_layer_split, evaluate_layer_split_with,
};
pub use layouts::{Considered, LayoutKind, LayoutSearch, search_layouts};
pub use presets::PRESET_NAMES;
pub use report::{Plan, load_plan, parse_plan};
pub use search::{DeviceCount, Replicas, SearchResult, auto, auto_devices, replicas};
pub use shape::{ModelShape, WeightTypes};
pub use strategy::{Shares, Strategy};
pub use virtual_device::VirtualDevice;
