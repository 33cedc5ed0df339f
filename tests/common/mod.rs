//! Shared test support: the op-by-op harness (`harness`: cases, seeded inputs, guarded
//! buffers, `run_case`), the float64 reference interpreter of every op (`reference`), and the
//! case list (`cases`, `cases_data`, `cases_mm`: `all_cases()`), usable from any test file with `mod common;`.
//!
//! Not every test file uses every item, hence the `dead_code` and `unused_imports` allowances.
#![allow(dead_code, unused_imports)]

pub mod cases;
pub mod cases_data;
pub mod cases_mm;
pub mod harness;
pub mod reference;

pub use cases::all_cases;
pub use harness::{Case, CaseReport, RunOptions, run_case, run_cases};
