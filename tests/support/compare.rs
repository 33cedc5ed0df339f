//! Comparing results: normalized mean squared error against a reference ([`nmse`]), outputs
//! read back from a graph ([`Out`]), their largest difference ([`max_diff`]) and scale
//! ([`scale_of`]), and the relative tolerance of an output dtype between two runs
//! ([`rel_tol`]).

use metashard::{DType, Graph, Result, TensorId};

/// `sum((a - b)^2) / sum(b^2)` over finite reference values (the sum itself when the
/// reference is all zeros), and the largest absolute difference.
pub fn nmse(got: &[f64], want: &[f64]) -> (f64, f64) {
    assert_eq!(got.len(), want.len(), "nmse of slices of different lengths");
    let (mut num, mut den, mut max) = (0f64, 0f64, 0f64);
    for (a, b) in got.iter().zip(want) {
        if !b.is_finite() {
            continue;
        }
        let d = a - b;
        num += d * d;
        den += b * b;
        max = max.max(d.abs());
    }
    (if den == 0.0 { num } else { num / den }, max)
}

/// One output read back.
#[derive(Clone, Debug)]
pub struct Out {
    pub dtype: DType,
    pub ne: [usize; 4],
    pub values: Vec<f32>,
}

/// Read `outs` of a computed graph.
pub fn read_outputs(g: &Graph, outs: &[TensorId]) -> Result<Vec<Out>> {
    outs.iter()
        .map(|&id| {
            Ok(Out {
                dtype: g.layout(id).dtype,
                ne: g.layout(id).ne,
                values: g.read_f32(id)?,
            })
        })
        .collect()
}

/// Largest absolute difference, or an error if shapes differ or NaNs appear on one side only.
pub fn max_diff(want: &Out, got: &Out) -> std::result::Result<f32, String> {
    if want.ne != got.ne || want.dtype != got.dtype {
        return Err(format!(
            "shape/dtype {:?} {} vs {:?} {}",
            want.ne, want.dtype, got.ne, got.dtype
        ));
    }
    let mut m = 0f32;
    for (i, (a, b)) in want.values.iter().zip(&got.values).enumerate() {
        if a.is_nan() != b.is_nan() {
            return Err(format!("element {i}: {a} vs {b}"));
        }
        if a.is_nan() {
            continue;
        }
        if a.is_infinite() || b.is_infinite() {
            if a != b {
                return Err(format!("element {i}: {a} vs {b}"));
            }
            continue;
        }
        m = m.max((a - b).abs());
    }
    Ok(m)
}

/// Largest magnitude of a tensor's values (at least 1).
pub fn scale_of(o: &Out) -> f32 {
    o.values
        .iter()
        .filter(|x| x.is_finite())
        .fold(1f32, |m, x| m.max(x.abs()))
}

/// Relative tolerance (against max(1, |reference|)) of an output dtype, a meta device of `n`
/// devices against one device: f32 sums in another order; half types may round partial pieces
/// on each of the n devices before they are summed.
pub fn rel_tol(dtype: DType, n: usize) -> f32 {
    match dtype {
        DType::F16 => 1e-3 * (n + 1) as f32,
        DType::BF16 => 8e-3 * (n + 1) as f32,
        _ => 1e-4,
    }
}
