//! Models: the Llama-family decoder graph (`decoder.rs`), its built-in split callback
//! (`split.rs`), and decoders with random weights for benchmarks and tests (`synthetic.rs`);
//! the BERT encoder (`bert.rs`) and its built-in split callback (`bert_split.rs`).

pub mod bert;
pub mod bert_split;
pub mod decoder;
pub mod llama;
pub mod open;
pub mod paths;
pub mod split;
pub mod synthetic;
