//! Models: the Llama-family decoder graph (`decoder.rs`), its built-in split callback
//! (`split.rs`), and decoders with random weights for benchmarks and tests (`synthetic.rs`).

pub mod decoder;
pub mod llama;
pub mod paths;
pub mod split;
pub mod synthetic;
