//! The test suite's shared support, used from any test file with `mod support;`: one
//! generator, one case type, the op-by-op harness, the meta check, the case lists, and the
//! targets the whole harness runs on.
//!
//! - `rng.rs`: [`Rng`], SplitMix64, the suite's only generator.
//! - `case.rs`: [`Case`] (inputs, graph builder, tolerances, and where the inputs live:
//!   [`Case::placement`], one device or a meta device with a place per input), [`Input`],
//!   [`Fill`], [`Lay`], the builder [`case`], and `DType::WEIGHT_TYPES` helpers.
//! - `meta.rs`: [`Place`] and [`Space`]: the states an input takes on a meta device, random
//!   places (uneven and zero extents, segments, partial pieces that sum exactly).
//! - `target.rs`: [`Target`] (a backend's devices) and [`CPU`]; meta devices and placed graphs
//!   on a target; [`run_single`], one CPU device, the reference of the meta runs.
//! - `run.rs`: the op-by-op harness ([`run_case`]: seeded inputs, guard bytes, poisoned output,
//!   the float64 reference of `reference.rs`, NMSE).
//! - `compare.rs`: NMSE, outputs read back, differences and tolerances between runs.
//! - `check.rs`: the meta check (a placed case against one device; refusals; plan reuse).
//! - `cases/`: the op-by-op list, [`all_cases`]; `random/`: the randomized meta cases.
//! - `suite.rs`, `regressions.rs`, `row_splits.rs`: the bodies of the tests
//!   [`harness_tests!`] emits (`row_splits.rs`: tables and destinations split by rows, case by
//!   case, with their plans).
//! - `plugin.rs`: a backend from outside the crate (a wrapped CPU device with its own
//!   communicator), [`plugin::PLUGIN`].
//! - `decoders.rs` (not a module of this one: `tests/families.rs`, `batched.rs` and
//!   `gemma3_file.rs` include it alone with `#[path]`): the families' small configurations,
//!   synthetic files written atomically, exact opening, the numpy reference runner.
//!
//! # Running the whole harness on a backend
//!
//! A [`Target`] says how to get `n` devices of a backend (with `threads` worker threads each
//! where it has them) and how to join them into a meta device. `harness_tests!(name, target)`
//! emits, in a module `name`, every test that takes a target: the op-by-op list against the
//! float64 reference on one device at 1, 2 and 3 threads (which must agree bit for bit) and on
//! meta devices over 1..=3 devices with mirrored inputs, every meta property (each op's
//! randomized case on N = 1..=8 devices in random states against one CPU device) and the meta
//! regressions. `tests/targets.rs` holds one line per backend:
//!
//! ```ignore
//! harness_tests!(cpu, support::CPU);
//! ```
//!
//! A backend added later (say, one that wraps the CPU device and brings its own communicator)
//! adds one line there:
//!
//! ```ignore
//! harness_tests!(wrapped, support::Target::new("wrapped", wrapped::devices));
//! // or, when it joins its devices itself:
//! harness_tests!(wrapped, support::Target { meta: wrapped::meta, ..support::Target::new("wrapped", wrapped::devices) });
//! // or, when it cannot run everywhere (a GPU), with a reason to skip:
//! harness_tests!(gpu, support::Target::new("gpu", gpu::devices).unless(gpu::absent));
//! ```
//!
//! where `devices: fn(n, threads) -> metashard::Result<Vec<Arc<dyn Device>>>`,
//! `meta: fn(devices, SplitFn, MetaOptions) -> metashard::Result<Arc<MetaDevice>>` and
//! `absent: fn() -> Option<String>` (why the target cannot run here: every test of it then
//! passes at once, after one printed line). `support::CUDA` is the CUDA backend's target.
//!
//! Not every test file uses every item, hence the `dead_code` and `unused_imports` allowances.
#![allow(dead_code, unused_imports, unused_macros)]

pub mod case;
pub mod cases;
pub mod check;
pub mod compare;
pub mod meta;
pub mod plugin;
pub mod random;
pub mod reference;
pub mod regressions;
pub mod rng;
pub mod row_splits;
pub mod run;
pub mod suite;
pub mod target;

pub use case::{Case, Fill, Input, Lay, TRANSPOSED, case, quantized_weight_types};
pub use cases::all_cases;
pub use meta::{Place, Space};
pub use rng::Rng;
pub use run::{CaseReport, RunOptions, run_case, run_cases};
#[cfg(feature = "cuda")]
pub use target::CUDA;
pub use target::{CPU, Target, run_single};

/// Every test that takes a target, in a module `$name`, for `$target` (a `support::Target`
/// constant expression). See the module doc.
macro_rules! harness_tests {
    ($name:ident, $target:expr) => {
        mod $name {
            // The invocation's names (`$target` is written there).
            #[allow(unused_imports)]
            use super::*;
            use crate::support::check::cfg;
            use crate::support::random::AttnSizes;
            use crate::support::{Target, regressions, suite};
            use metashard::op::BinaryOp;
            use proptest::prelude::*;

            const TARGET: Target = $target;

            fn shape4() -> impl Strategy<Value = [usize; 4]> {
                [1usize..=7, 1usize..=5, 1usize..=3, 1usize..=2]
            }

            // ---- the op-by-op list against the float64 reference ----

            #[test]
            fn every_case_matches_the_reference_at_1_2_3_threads_and_they_agree() {
                if TARGET.absent() { return; }
                suite::op_cases_at_1_2_3_threads(&TARGET);
            }

            #[test]
            fn every_case_runs_on_the_meta_device_with_mirrored_inputs() {
                if TARGET.absent() { return; }
                suite::op_cases_on_meta_devices_mirrored(&TARGET);
            }

            // ---- meta properties: sharded equals one device, op by op ----

            proptest! {
                #![proptest_config(cfg(400))]

                #[test]
                fn mul_mat_f32(n in 1usize..=8, seed: u64, p in [1usize..=9, 1usize..=6, 1usize..=5, 1usize..=3, 1usize..=3, 1usize..=2, 1usize..=2]) {
                    if TARGET.absent() { return Ok(()); }
                    suite::mul_mat_f32(&TARGET, n, seed, p)?;
                }

                #[test]
                fn mul_mat_quantized(n in 1usize..=8, seed: u64, dt in prop::sample::select(crate::support::quantized_weight_types()), p in [1usize..=9, 1usize..=5, 1usize..=4, 1usize..=3, 1usize..=2, 1usize..=2, 1usize..=2]) {
                    if TARGET.absent() { return Ok(()); }
                    suite::mul_mat_quantized(&TARGET, n, seed, dt, p)?;
                }

                #[test]
                fn binary_broadcast(n in 1usize..=8, seed: u64, op in prop::sample::select(vec![BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div]), ne in shape4()) {
                    if TARGET.absent() { return Ok(()); }
                    suite::binary_broadcast(&TARGET, n, seed, op, ne)?;
                }

                #[test]
                fn unary_scale_clamp(n in 1usize..=8, seed: u64, which in 0usize..8, ne in shape4()) {
                    if TARGET.absent() { return Ok(()); }
                    suite::unary_scale_clamp(&TARGET, n, seed, which, ne)?;
                }

                #[test]
                fn swiglu(n in 1usize..=8, seed: u64, fused: bool, ne in shape4()) {
                    if TARGET.absent() { return Ok(()); }
                    suite::swiglu(&TARGET, n, seed, fused, ne)?;
                }

                #[test]
                fn rowwise(n in 1usize..=8, seed: u64, which in 0usize..5, ne in shape4()) {
                    if TARGET.absent() { return Ok(()); }
                    suite::rowwise(&TARGET, n, seed, which, ne)?;
                }

                #[test]
                fn soft_max(n in 1usize..=8, seed: u64, mask: bool, ne in shape4()) {
                    if TARGET.absent() { return Ok(()); }
                    suite::soft_max(&TARGET, n, seed, mask, ne)?;
                }

                #[test]
                fn rope(n in 1usize..=8, seed: u64, hd in 1usize..=4, nh in 1usize..=5, t in 1usize..=4, neox: bool) {
                    if TARGET.absent() { return Ok(()); }
                    suite::rope(&TARGET, n, seed, [hd, nh, t], neox)?;
                }

                #[test]
                fn argmax(n in 1usize..=8, seed: u64, ne0 in 1usize..=9, ne1 in 1usize..=6) {
                    if TARGET.absent() { return Ok(()); }
                    suite::argmax(&TARGET, n, seed, ne0, ne1)?;
                }

                #[test]
                fn mul_mat_id(n in 1usize..=8, seed: u64, p in [1usize..=40, 1usize..=9, 1usize..=5, 1usize..=3, 0usize..=1, 1usize..=5]) {
                    if TARGET.absent() { return Ok(()); }
                    suite::mul_mat_id(&TARGET, n, seed, p)?;
                }

                #[test]
                fn argsort(n in 1usize..=8, seed: u64, ne in shape4(), descending: bool) {
                    if TARGET.absent() { return Ok(()); }
                    suite::argsort(&TARGET, n, seed, ne, descending)?;
                }

                #[test]
                fn get_rows(n in 1usize..=8, seed: u64, ne0 in 1usize..=6, rows in 1usize..=7, nid in 1usize..=5, e2 in 1usize..=3, e3 in 1usize..=2) {
                    if TARGET.absent() { return Ok(()); }
                    suite::get_rows(&TARGET, n, seed, [ne0, rows, nid, e2, e3])?;
                }

                #[test]
                fn set_rows(n in 1usize..=8, seed: u64, p in [1usize..=5, 1usize..=6, 1usize..=4, 1usize..=2, 1usize..=4], refuse in 0usize..5) {
                    if TARGET.absent() { return Ok(()); }
                    suite::set_rows(&TARGET, n, seed, p, refuse)?;
                }

                #[test]
                fn cpy(n in 1usize..=8, seed: u64, ne in shape4(), refuse in 0usize..5) {
                    if TARGET.absent() { return Ok(()); }
                    suite::cpy(&TARGET, n, seed, ne, refuse)?;
                }

                #[test]
                fn cont_cast(n in 1usize..=8, seed: u64, ne in shape4()) {
                    if TARGET.absent() { return Ok(()); }
                    suite::cont_cast(&TARGET, n, seed, ne)?;
                }

                #[test]
                fn concat(n in 1usize..=8, seed: u64, ne in shape4(), dim in 0usize..4, extra in 1usize..=4) {
                    if TARGET.absent() { return Ok(()); }
                    suite::concat(&TARGET, n, seed, ne, dim, extra)?;
                }

                #[test]
                fn flash_attn(n in 1usize..=8, seed: u64, p in [1usize..=6, 1usize..=5, 1usize..=4, 1usize..=5, 1usize..=3, 1usize..=3, 1usize..=2, 0usize..=2]) {
                    if TARGET.absent() { return Ok(()); }
                    suite::flash_attn(&TARGET, n, seed, p)?;
                }

                #[test]
                fn reshape(n in 1usize..=8, seed: u64, ne in shape4()) {
                    if TARGET.absent() { return Ok(()); }
                    suite::reshape(&TARGET, n, seed, ne)?;
                }

                #[test]
                fn permute_transpose(n in 1usize..=8, seed: u64, ne in shape4(), consumer in 0usize..3) {
                    if TARGET.absent() { return Ok(()); }
                    suite::permute_transpose(&TARGET, n, seed, ne, consumer)?;
                }

                #[test]
                fn kv_cache_views(n in 1usize..=8, seed: u64, p in [1usize..=4, 1usize..=3, 1usize..=3, 1usize..=6, 1usize..=3, 0usize..=2, 0usize..=1]) {
                    if TARGET.absent() { return Ok(()); }
                    suite::kv_cache_views(&TARGET, n, seed, p)?;
                }

                #[test]
                fn expert_groups(n in 1usize..=8, seed: u64, p in [1usize..=12, 1usize..=9, 1usize..=6, 1usize..=3, 1usize..=4]) {
                    if TARGET.absent() { return Ok(()); }
                    suite::expert_groups(&TARGET, n, seed, p)?;
                }

                #[test]
                fn segment_views(n in 1usize..=8, seed: u64, p in [1usize..=6, 1usize..=4, 1usize..=4, 1usize..=3, 0usize..=1]) {
                    if TARGET.absent() { return Ok(()); }
                    suite::segment_views(&TARGET, n, seed, p)?;
                }

                #[test]
                fn sub_views(n in 1usize..=8, seed: u64, ne0 in 1usize..=6, ne1 in 1usize..=6) {
                    if TARGET.absent() { return Ok(()); }
                    suite::sub_views(&TARGET, n, seed, ne0, ne1)?;
                }

                #[test]
                fn chains(n in 1usize..=8, seed: u64, d in [1usize..=6, 1usize..=4, 1usize..=3], steps in 1usize..=6) {
                    if TARGET.absent() { return Ok(()); }
                    suite::chains(&TARGET, n, seed, d, steps)?;
                }

                #[test]
                fn attention_block(n in 1usize..=8, seed: u64, hd in 1usize..=3, hk in 1usize..=3, group in 1usize..=3, t in 1usize..=3, past in 0usize..=3, f16_cache: bool, megatron: bool) {
                    if TARGET.absent() { return Ok(()); }
                    let z = AttnSizes { hd: 2 * hd, hk, group, t, past, f16_cache };
                    suite::attention_block(&TARGET, n, seed, z, megatron)?;
                }
            }

            // ---- splits by rows: a vocabulary-split table, a cache split by slots ----

            #[test]
            fn row_split_table_gives_a_partial_lookup() {
                if TARGET.absent() { return; }
                crate::support::row_splits::table_split_by_rows_gives_a_partial_lookup(&TARGET);
            }

            #[test]
            fn row_split_table_keeps_out_of_range_ids_errors() {
                if TARGET.absent() { return; }
                crate::support::row_splits::out_of_range_ids_of_a_table_split_by_rows_are_errors(&TARGET);
            }

            #[test]
            fn row_split_destination_takes_its_window() {
                if TARGET.absent() { return; }
                crate::support::row_splits::destination_split_by_rows_takes_its_window(&TARGET);
            }

            // ---- meta regressions: cases the properties found, fixed in src/ ----

            #[test]
            fn regression_quantized_weight_follows_k_split_in_whole_blocks_only() {
                if TARGET.absent() { return; }
                regressions::quantized_weight_follows_k_split_in_whole_blocks_only(&TARGET);
            }

            #[test]
            fn regression_cast_to_quantized_keeps_axis0_split_only_in_whole_blocks() {
                if TARGET.absent() { return; }
                regressions::cast_to_quantized_keeps_axis0_split_only_in_whole_blocks(&TARGET);
            }

            #[test]
            fn regression_segmented_slice_of_quantized_tensor() {
                if TARGET.absent() { return; }
                regressions::segmented_slice_of_quantized_tensor(&TARGET);
            }

            #[test]
            fn regression_split_to_partial_pads_with_zeros() {
                if TARGET.absent() { return; }
                regressions::split_to_partial_pads_with_zeros(&TARGET);
            }

            #[test]
            fn regression_empty_slices_skip_the_op() {
                if TARGET.absent() { return; }
                regressions::empty_slices_skip_the_op(&TARGET);
            }

            #[test]
            fn regression_all_reduce_of_a_partial_leaf_leaves_it_unchanged() {
                if TARGET.absent() { return; }
                regressions::all_reduce_of_a_partial_leaf_leaves_it_unchanged(&TARGET);
            }

            #[test]
            fn regression_computing_a_graph_again_gives_new_results() {
                if TARGET.absent() { return; }
                regressions::computing_a_graph_again_gives_new_results(&TARGET);
            }

            #[test]
            fn regression_cpy_of_quantized_source_into_partial_block_split() {
                if TARGET.absent() { return; }
                regressions::cpy_of_quantized_source_into_partial_block_split(&TARGET);
            }
        }
    };
}
pub(crate) use harness_tests;
