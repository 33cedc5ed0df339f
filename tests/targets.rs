//! The whole harness on every target, one line per backend (the CPU; the plug-in of
//! `support/plugin.rs`, a wrapped CPU device whose meta devices use its own communicator; with
//! `--features cuda`, the CUDA backend, skipped without a GPU): the op-by-op list against the
//! float64 reference (one device at 1, 2 and 3 threads; meta devices with mirrored inputs), the
//! meta properties on N = 1..=8 devices, and the meta regressions (see `support/mod.rs`).
//!
//! `cargo test --release --test targets -- --nocapture` prints one report line per op case.

mod support;

support::harness_tests!(cpu, support::CPU);
support::harness_tests!(plugin, support::plugin::PLUGIN);
// The CUDA backend on logical devices of GPU 0; every test passes at once without a GPU.
#[cfg(feature = "cuda")]
support::harness_tests!(cuda, support::CUDA);
