//! Models: the Llama-family decoder graph (`decoder.rs`), its built-in split callback
//! (`split.rs`), layer and hybrid split on the scheduler (`layer_split.rs`), and decoders with random weights for benchmarks and tests (`synthetic.rs`);
//! the BERT encoder (`bert.rs`) and its built-in split callback (`bert_split.rs`).

pub mod bert;
pub mod bert_split;
pub mod decoder;
pub mod layer_split;
pub mod llama;
pub mod open;
pub mod paths;
pub mod split;
pub mod synthetic;
