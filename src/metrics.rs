//! Numeric comparison of two result vectors: normalized mean squared error and largest
//! absolute difference. Imports nothing, so every checker (the scheduler's node-by-node
//! comparison, `verify`, the tests) can use it.

/// Normalized mean squared error of `a` against `b`.
pub fn nmse(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    num / den.max(f64::MIN_POSITIVE)
}

/// Largest `|a[i] - b[i]|`.
pub fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
