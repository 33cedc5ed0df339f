//! Benchmarks behind `metashard bench`: `meta` (the cost of tensor parallelism on one host),
//! `model` (a real model's prompt and generation throughput per device set).
pub mod meta;
pub mod model;
