//! Rotary position embedding. For each row `(head, token)`, pairs of dimensions are rotated by
//! `theta_i = pos * freq_scale * freq_base^(-2i/n_dims)`: adjacent pairs `(2i, 2i+1)` in normal
//! mode, `(i, i + n_dims/2)` in NeoX mode (ggml `ggml_rope`, modes 0 and 2); dimensions from
//! `n_dims` on are copied. Angles are computed in f64 per token; with frequency factors
//! (ggml's `ggml_rope_ext` `c` operand, Llama 3's `rope_freqs`) pair i's angle is divided by
//! `factors[i]`.
//!
//! A decode step ropes Q and K of every layer at the same position with one or two parameter
//! sets (Gemma 3's local and global bases), so each worker thread keeps the cos/sin of the last
//! few (position, parameters) it computed ([`ANGLE_CACHE`] entries) and reuses them: same
//! values, computed once per step instead of twice per layer. Within one call the inverse
//! frequencies are computed once, not per token.

use super::{read_row_f32, thread_scratch, unravel_row, write_row_f32};
use crate::cpu::view::{ComputeParams, TensorView};
use crate::op::{RopeMode, RopeParams};
use std::cell::RefCell;

/// Entries of each thread's cos/sin cache.
const ANGLE_CACHE: usize = 4;

/// The cos and sin of one position under one parameter set.
#[derive(Default)]
struct Angles {
    pos: i32,
    freq_base: u32,
    freq_scale: u32,
    n_dims: usize,
    /// The frequency factors' values (empty without factors): compared by value, so a buffer
    /// reused at the same address with other contents cannot hit.
    factors: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

thread_local! {
    /// Most recently used first.
    static ANGLES: RefCell<Vec<Angles>> = const { RefCell::new(Vec::new()) };
}

pub fn rope(
    p: &ComputeParams,
    dst: &TensorView,
    x: &TensorView,
    pos: &TensorView,
    factors: Option<&TensorView>,
    rp: &RopeParams,
) {
    let n = x.ne[0];
    let half = rp.n_dims / 2;
    // Scratch: the row, then cos and sin of the current token.
    // SAFETY: `row_scratch` reserves 2 * max(ne0) floats per thread, and n + 2 * half <= 2 * n
    // because the builder checked n_dims <= ne0.
    let buf = unsafe { thread_scratch(p, 2 * n) };
    let (row, rest) = buf.split_at_mut(n);
    let (cos, sin) = rest.split_at_mut(half);
    let sin = &mut sin[..half];
    let factor_values: Vec<f32> = match factors {
        // SAFETY: the builder checked the factors are a contiguous F32 [n_dims / 2].
        Some(ff) => (0..half)
            .map(|i| unsafe { ff.ptr(i, 0, 0, 0).cast::<f32>().read_unaligned() })
            .collect(),
        None => Vec::new(),
    };
    let mut inv_freq: Vec<f64> = Vec::new();
    let mut cur_token = usize::MAX;
    for r in p.range(x.nrows()) {
        let (i1, i2, i3) = unravel_row(r, &x.ne);
        if i2 != cur_token {
            cur_token = i2;
            // SAFETY: the builder checked positions are I32 [ne2].
            let t = unsafe { pos.ptr(i2, 0, 0, 0).cast::<i32>().read_unaligned() };
            angles(rp, &factor_values, &mut inv_freq, t, cos, sin);
        }
        // SAFETY: rows in range; this thread owns dst row (i1, i2, i3).
        unsafe { read_row_f32(x, i1, i2, i3, row) };
        for i in 0..half {
            let (a, b) = match rp.mode {
                RopeMode::Normal => (2 * i, 2 * i + 1),
                RopeMode::NeoX => (i, i + half),
            };
            let (x0, x1) = (row[a], row[b]);
            row[a] = x0 * cos[i] - x1 * sin[i];
            row[b] = x0 * sin[i] + x1 * cos[i];
        }
        // SAFETY: as above.
        unsafe { write_row_f32(dst, i1, i2, i3, row) };
    }
}

/// Fills `cos`/`sin` for position `t`: from this thread's cache when it holds them, else
/// computed in f64 (the inverse frequencies once per call, in `inv_freq`) and cached.
fn angles(
    rp: &RopeParams,
    factors: &[f32],
    inv_freq: &mut Vec<f64>,
    t: i32,
    cos: &mut [f32],
    sin: &mut [f32],
) {
    let half = cos.len();
    let (base, scale) = (rp.freq_base.to_bits(), rp.freq_scale.to_bits());
    ANGLES.with_borrow_mut(|cache| {
        let hit = cache.iter().position(|a| {
            a.pos == t
                && a.freq_base == base
                && a.freq_scale == scale
                && a.n_dims == rp.n_dims
                && a.factors == factors
        });
        if let Some(k) = hit {
            let a = cache.remove(k);
            cos.copy_from_slice(&a.cos);
            sin.copy_from_slice(&a.sin);
            cache.insert(0, a);
            return;
        }
        if inv_freq.is_empty() {
            inv_freq.extend((0..half).map(|i| {
                let f = (rp.freq_base as f64).powf(-2.0 * i as f64 / rp.n_dims as f64);
                match factors.get(i) {
                    Some(&c) => f / c as f64,
                    None => f,
                }
            }));
        }
        for i in 0..half {
            let theta = t as f64 * rp.freq_scale as f64 * inv_freq[i];
            cos[i] = theta.cos() as f32;
            sin[i] = theta.sin() as f32;
        }
        // The least recently used entry's vectors are reused once the cache is full.
        let mut a = if cache.len() >= ANGLE_CACHE {
            cache.pop().unwrap_or_default()
        } else {
            Angles::default()
        };
        a.pos = t;
        a.freq_base = base;
        a.freq_scale = scale;
        a.n_dims = rp.n_dims;
        a.factors.clear();
        a.factors.extend_from_slice(factors);
        a.cos.clear();
        a.cos.extend_from_slice(cos);
        a.sin.clear();
        a.sin.extend_from_slice(sin);
        cache.insert(0, a);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn direct(rp: &RopeParams, factors: &[f32], t: i32) -> (Vec<f32>, Vec<f32>) {
        let half = rp.n_dims / 2;
        (0..half)
            .map(|i| {
                let mut f = (rp.freq_base as f64).powf(-2.0 * i as f64 / rp.n_dims as f64);
                if let Some(&c) = factors.get(i) {
                    f /= c as f64;
                }
                let theta = t as f64 * rp.freq_scale as f64 * f;
                (theta.cos() as f32, theta.sin() as f32)
            })
            .unzip()
    }

    #[test]
    fn cached_angles_equal_computed_ones_and_never_cross_parameters() {
        let rp = |base: f32| RopeParams {
            mode: RopeMode::NeoX,
            n_dims: 16,
            freq_base: base,
            freq_scale: 1.0,
        };
        let f1: Vec<f32> = (0..8).map(|i| 1.0 + i as f32).collect();
        let f2: Vec<f32> = (0..8).map(|i| 2.0 + i as f32).collect();
        let cases: Vec<(RopeParams, &[f32], i32)> = vec![
            (rp(10000.0), &[], 7),
            (rp(1e6), &[], 7),
            (rp(10000.0), &f1, 7),
            (rp(10000.0), &f2, 7),
            (rp(10000.0), &[], 8),
            (rp(10000.0), &[], 7),
            (rp(1e6), &[], 7),
            (rp(10000.0), &f1, 7),
        ];
        // Twice through, more keys than the cache holds: hits, misses and evictions all give
        // the directly computed values.
        for _ in 0..2 {
            for (p, f, t) in &cases {
                let (mut c, mut s) = (vec![0f32; 8], vec![0f32; 8]);
                angles(p, f, &mut Vec::new(), *t, &mut c, &mut s);
                assert_eq!((c, s), direct(p, f, *t), "base {} t {t}", p.freq_base);
            }
        }
    }
}
