//! Models as graphs: the architecture table (`arch/`: tensor roles and names, each family's
//! tensors and layer), hyper-parameters from GGUF (`hparams.rs`), weights by role
//! (`weights.rs`), the shared graph blocks (`blocks.rs`; the mixture of experts `moe.rs`), the
//! decoder step graph
//! (`decoder.rs`), GGUF decoder loading (`loader.rs`; older files' per-expert tensors stacked
//! by `legacy_experts.rs`), sessions and sampling (`session.rs`,
//! `sampler.rs`, `prompt.rs`), the built-in split callbacks of every architecture (`split.rs`),
//! layer and hybrid placement as data (`layer_split.rs`), the BERT encoder (`bert.rs`), model
//! paths and synthetic decoders. Nothing here opens devices: `crate::runtime` does. Every count
//! a configuration declares is bounded in one table (`limits.rs`) before anything is sized.

pub mod arch;
pub mod batch;
pub mod bert;
pub mod blocks;
pub mod decoder;
pub mod engine;
pub mod hparams;
pub mod layer_split;
pub mod legacy_experts;
pub mod limits;
pub mod loader;
pub mod moe;
pub mod paths;
pub mod prompt;
pub mod sampler;
pub mod session;
pub mod split;
pub mod synthetic;
pub mod weights;
