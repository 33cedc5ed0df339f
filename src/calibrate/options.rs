//! What a calibration measures and how long: [`CalibrateOptions`] (the caller's choices), the
//! shapes and sizes measured, and the repetition counts of the quick and the full mode.

use crate::cpu::Precision;
use crate::{DType, Error, Result};
use std::time::Duration;

/// Weight shapes `(K, N)` of the GEMV and GEMM measurements: SmolLM2-135M's FFN projections
/// (576 -> 1536 and back) and a 2048- and a 4096-wide projection cut to N = 1024 rows, a
/// device's share of a split matrix.
pub const SHAPES: [(usize, usize); 4] = [(576, 1536), (1536, 576), (2048, 1024), (4096, 1024)];
/// Head sizes of the attention measurement (SmolLM2's and Gemma 3's 64, Llama's 128).
pub const ATTN_SHAPES: [usize; 2] = [64, 128];
/// Query heads of the attention measurement (over 2 KV heads: groups of 4).
pub const ATTN_HEADS: usize = 8;
/// Cache rows each query row of the attention measurement attends to.
pub const ATTN_KV_ROWS: usize = 512;
/// Activation rows of the GEMV (matrix-vector) measurement.
pub const GEMV_M: usize = 1;
/// Activation rows of the GEMM measurement (a prompt batch; above the cost model's M <= 8).
pub const GEMM_M: usize = 128;
/// Nodes of the short chain the per-node costs are measured against.
pub(super) const SHORT_CHAIN: usize = 1;
/// F32 elements per tensor of the memory measurement (4 MiB).
pub(super) const STREAM_ELEMS: usize = 1 << 20;
/// Idle time before each timed step of the overhead measurement: longer than the workers'
/// spinning (about 20 us, `workers.rs`), as the sampling between two decode steps is, so
/// waking parked workers is part of the step overhead, as in a generation loop.
pub const STEP_GAP: Duration = Duration::from_millis(1);
/// How long a worker may stay inside one measurement before the calibration fails.
pub(super) const STALL_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a rank waits for its peers in a collective.
pub(super) const COMM_TIMEOUT: Duration = Duration::from_secs(60);

/// What to measure and how long.
#[derive(Clone, Debug)]
pub struct CalibrateOptions {
    /// Fewer repetitions, smaller sizes and fewer shapes: under a minute on two cores (48-52 s
    /// for `cpu:2x1` with the six default types on the AVX-512 Xeon), instead of about two and
    /// a half.
    pub quick: bool,
    /// Precision of products with quantized weights on CPU devices (default: the runs'
    /// default, [`Precision::Exact`]).
    pub precision: Precision,
    /// Weight types whose GEMV and GEMM rates are measured (default: [`MEASURED_TYPES`]).
    pub weight_types: Vec<DType>,
}

/// The weight types measured by default. The others (Q5_0, Q5_1, the K-quants, IQ4) have
/// kernels of their own too (docs/kernels.md) but are left out to keep the calibration's time;
/// they can be named in `weight_types` (`metashard calibrate --types`; `bench strategies`
/// measures F32 and the model's own types), and a profile without them prices them at its F32
/// figures.
pub const MEASURED_TYPES: &[DType] = &[
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
];

/// The weight types worth measuring for `shape`: F32 (what the cost model falls back to for a
/// type without figures, and the rate of unfused attention), then every type the model's
/// matrices are stored in, each once, in the order of their first tensor. The other types'
/// rates would not price anything for this model, and leaving them out leaves the calibration's
/// time to the ones that do (SmolLM2: F32, Q8_0 and Q4_1; `bench strategies` and `calibrate
/// --model` measure these).
pub fn types_of(shape: &crate::planner::ModelShape) -> Result<Vec<DType>> {
    let decls = shape.weight_decls()?;
    let stored = decls.iter().map(|d| d.layout.dtype);
    Ok(with_f32(stored.filter(|t| DType::WEIGHT_TYPES.contains(t))))
}

/// F32 first (the figure other types fall back to, the rate of unfused attention, and the type
/// the alone-against-together speedup is timed with), then `types` in their order, each once:
/// the `weight_types` of a calibration asked for these types (`calibrate --types`).
pub fn with_f32(types: impl IntoIterator<Item = DType>) -> Vec<DType> {
    let mut out = vec![DType::F32];
    for t in types {
        if !out.contains(&t) {
            out.push(t);
        }
    }
    out
}

impl Default for CalibrateOptions {
    fn default() -> Self {
        CalibrateOptions {
            quick: false,
            precision: Precision::default(),
            weight_types: MEASURED_TYPES.to_vec(),
        }
    }
}

impl CalibrateOptions {
    pub fn quick() -> Self {
        CalibrateOptions {
            quick: true,
            ..Default::default()
        }
    }

    /// An error naming a weight type that is not one (or an empty list), before anything is
    /// measured.
    pub(super) fn check(&self) -> Result<()> {
        if self.weight_types.is_empty() {
            return Err(Error::invalid_argument(
                "weight types",
                "[]",
                "give at least one weight type to measure",
            ));
        }
        if let Some(t) = self
            .weight_types
            .iter()
            .find(|t| !DType::WEIGHT_TYPES.contains(t))
        {
            let names: Vec<&str> = DType::WEIGHT_TYPES.iter().map(|d| d.name()).collect();
            return Err(Error::invalid_argument(
                "weight types",
                t,
                format!("not a weight type ({})", names.join(", ")),
            ));
        }
        Ok(())
    }
}

/// Sizes and repetition counts of one mode.
pub(super) struct Budget {
    /// Bytes of weights streamed per GEMV graph, over all devices.
    pub gemv_total: usize,
    /// Shapes in the GEMM graph (a prefix of SHAPES).
    pub gemm_shapes: usize,
    /// Bytes moved per memory graph, over all devices.
    pub stream_total: usize,
    pub warmup: usize,
    pub reps: usize,
    pub chain: usize,
    pub step_reps: usize,
    pub link_sizes: Vec<usize>,
    /// Timed seconds per (N, collective, size), at least `link_min_reps` calls.
    pub link_time: f64,
    pub link_min_reps: usize,
}

impl Budget {
    pub fn new(quick: bool) -> Budget {
        let llc = super::host::last_level_cache().unwrap_or(32 << 20);
        if quick {
            Budget {
                gemv_total: (2 * llc).max(32 << 20),
                gemm_shapes: 2,
                stream_total: (2 * llc).max(32 << 20),
                warmup: 1,
                // Seven, not three (until 2026-11-28): on the shared AVX-512 Xeon one quick
                // calibration predicted SmolLM2's cpu:2x1 decoding at 194 tokens/s, where
                // three others that hour said 125-136 and the run measured 134; that
                // prediction is the GEMV rates' almost alone, each the median of the reps.
                reps: 7,
                chain: 257,
                step_reps: 31,
                link_sizes: vec![4 << 10, 64 << 10, 1 << 20, 4 << 20],
                link_time: 0.01,
                link_min_reps: 5,
            }
        } else {
            Budget {
                gemv_total: (8 * llc).max(128 << 20),
                gemm_shapes: SHAPES.len(),
                stream_total: (8 * llc).max(128 << 20),
                warmup: 2,
                reps: 11,
                chain: 257,
                step_reps: 61,
                link_sizes: vec![
                    4 << 10,
                    16 << 10,
                    64 << 10,
                    256 << 10,
                    1 << 20,
                    4 << 20,
                    16 << 20,
                ],
                link_time: 0.06,
                link_min_reps: 10,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::ModelShape;

    /// F32 first, then the asked types in order, each once (F32 asked for too).
    #[test]
    fn asked_types_come_after_f32_once_each() {
        let asked = [DType::Q4_K, DType::F32, DType::Q4_K, DType::Q8_0];
        assert_eq!(with_f32(asked), [DType::F32, DType::Q4_K, DType::Q8_0]);
        assert_eq!(with_f32([]), [DType::F32]);
    }

    /// A calibration for a model measures F32 and each of the model's matrix types, once.
    #[test]
    fn the_calibration_measures_f32_and_the_models_types() {
        let mut shape = ModelShape::preset("smollm2-135m").unwrap();
        shape.types.ffn_down = DType::Q4_1;
        shape.types.output = DType::Q8_0;
        let types = types_of(&shape).unwrap();
        assert_eq!(types[0], DType::F32);
        for d in shape.weight_decls().unwrap() {
            assert!(types.contains(&d.layout.dtype), "{}: {types:?}", d.name);
        }
        assert!(types.contains(&DType::Q4_1) && types.contains(&DType::Q8_0));
        let mut unique = types.clone();
        unique.sort_by_key(|t| t.name());
        unique.dedup();
        assert_eq!(unique.len(), types.len(), "{types:?}");
    }
}
