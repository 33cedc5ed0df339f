//! Benchmarks behind `metashard bench`: `meta` (the cost of tensor parallelism on one host).
pub mod meta;
