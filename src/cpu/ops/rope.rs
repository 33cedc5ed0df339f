//! Rotary position embedding. For each row `(head, token)`, pairs of dimensions are rotated by
//! `theta_i = pos * freq_scale * freq_base^(-2i/n_dims)`: adjacent pairs `(2i, 2i+1)` in normal
//! mode, `(i, i + n_dims/2)` in NeoX mode (ggml `ggml_rope`, modes 0 and 2); dimensions from
//! `n_dims` on are copied. Angles are computed in f64 per token; with frequency factors
//! (ggml's `ggml_rope_ext` `c` operand, Llama 3's `rope_freqs`) pair i's angle is divided by
//! `factors[i]`.

use super::{read_row_f32, thread_scratch, unravel_row, write_row_f32};
use crate::cpu::view::{ComputeParams, TensorView};
use crate::op::{RopeMode, RopeParams};

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
    let mut cur_token = usize::MAX;
    let inv_freq = |i: usize| {
        let f = (rp.freq_base as f64).powf(-2.0 * i as f64 / rp.n_dims as f64);
        match factors {
            // SAFETY: the builder checked the factors are a contiguous F32 [n_dims / 2].
            Some(ff) => f / unsafe { ff.ptr(i, 0, 0, 0).cast::<f32>().read_unaligned() } as f64,
            None => f,
        }
    };
    for r in p.range(x.nrows()) {
        let (i1, i2, i3) = unravel_row(r, &x.ne);
        if i2 != cur_token {
            cur_token = i2;
            // SAFETY: the builder checked positions are I32 [ne2].
            let t = unsafe { pos.ptr(i2, 0, 0, 0).cast::<i32>().read_unaligned() } as f64;
            for i in 0..half {
                let theta = t * rp.freq_scale as f64 * inv_freq(i);
                cos[i] = theta.cos() as f32;
                sin[i] = theta.sin() as f32;
            }
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
