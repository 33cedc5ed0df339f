//! The scale searches of ggml's reference K-quant quantizers (ggml-org/ggml `ggml-quants.c`,
//! "2-6 bit quantization in super-blocks": `nearest_int`, `make_qx_quants`, `make_q3_quants`,
//! `make_qkx2_quants`), and the 6-bit packing of Q4_K / Q5_K scales and minimums
//! (`get_scale_min_k4` and its inverse in `quantize_row_q4_K_ref`).
//!
//! Written here from the algorithms, in the same f32 operations in the same order (no fused
//! multiply-add, no reassociation), so the bytes equal ggml's reference output: ggml builds
//! `ggml-quants.c` for the baseline x86-64 target, where every one of these operations is
//! rounded on its own. Only the forms the reference quantizers call are written (`make_qx_quants`
//! with `rmse_type` 1 and no importance weights, `make_q3_quants` with `do_rmse`); the
//! importance-matrix variants (`quantize_row_q*_K_impl`) are not.

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below it is all zeros.
pub(super) const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`: `x` rounded to the nearest integer, ties to even, by adding 1.5 * 2^23
/// and reading the mantissa. Exact for |x| < 2^22; outside that range (ggml asserts against
/// it in debug builds) it gives what ggml's gives.
pub(super) fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// The value of largest magnitude (its sign kept; the first one on ties) and that magnitude.
pub(super) fn signed_amax(x: &[f32]) -> (f32, f32) {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

/// `make_qx_quants(n, nmax, x, L, rmse_type = 1, qw = NULL)`: a symmetric scale for signed
/// quants in `-nmax..nmax`, written to `l` offset by `nmax`. Starts from the scale that maps the
/// largest magnitude to `-nmax`, takes the weighted least-squares scale (weights x^2) of those
/// quants, then tries 18 nearby starting scales `-(nmax + 0.1 is) / max` and keeps the one with
/// the best `sumlx^2 / suml2`. Returns the scale.
pub(super) fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (max, amax) = signed_amax(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let quant = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    // The weighted sums of x * q and q * q for the quants of `iscale`.
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let q = quant(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let write = |iscale: f32, l: &mut [i8]| {
        for (l, &v) in l.iter_mut().zip(x) {
            *l = (nmax + quant(iscale, v)) as i8;
        }
    };
    let iscale = -(nmax as f32) / max;
    write(iscale, l);
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            write(iscale, l);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `make_q3_quants(n, nmax, x, L, do_rmse = true)`: quants in `-nmax..nmax` (written to `l`
/// offset by `nmax`) for the scale mapping the largest magnitude to `-nmax`, then up to 5
/// passes that move single quants to their least-squares optimum (weights x^2) while that
/// improves `sumlx^2 / suml2`. Returns the least-squares scale of the final quants.
pub(super) fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (max, amax) = signed_amax(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (l, &v) in l.iter_mut().zip(x) {
        let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *l = q as i8;
        let w = v * v;
        sumlx += w * v * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (l, &v) in l.iter_mut().zip(x) {
            let w = v * v;
            let old = *l as f32;
            let mut slx = sumlx - w * v * old;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * old * old;
                let new = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new != *l as i32 {
                    slx += w * v * new as f32;
                    sl2 += w * new as f32 * new as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *l = new as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for l in l.iter_mut() {
        *l += nmax as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// The search parameters of `make_qkx2_quants`: candidate inverse scales
/// `(rmin + rdelta * is + nmax) / (max - min)` for `is` in `0..=nstep`, errors measured as
/// absolute (`use_mad`) or squared differences.
#[derive(Clone, Copy)]
pub(super) struct Qkx2 {
    pub nmax: i32,
    pub rmin: f32,
    pub rdelta: f32,
    pub nstep: i32,
    pub use_mad: bool,
}

/// The searches `quantize_row_q2_K_ref` runs on groups of 16 (2-bit quants, absolute errors).
pub(super) const Q2K_SEARCH: Qkx2 = Qkx2 {
    nmax: 3,
    rmin: -0.5,
    rdelta: 0.1,
    nstep: 15,
    use_mad: true,
};

/// The searches `quantize_row_q4_K_ref` runs on groups of 32 (4-bit quants).
pub(super) const Q4K_SEARCH: Qkx2 = Qkx2 {
    nmax: 15,
    rmin: -1.0,
    rdelta: 0.1,
    nstep: 20,
    use_mad: false,
};

/// The searches `quantize_row_q5_K_ref` runs on groups of 32 (5-bit quants).
pub(super) const Q5K_SEARCH: Qkx2 = Qkx2 {
    nmax: 31,
    rmin: -0.5,
    rdelta: 0.1,
    nstep: 15,
    use_mad: false,
};

/// `make_qkx2_quants`: an asymmetric quantization `x ~ scale * q - the_min` with q in
/// `0..=nmax` (written to `l`) and `the_min >= 0`: starts from the range `[min(x, 0), max(x)]`,
/// then for every candidate scale fits scale and minimum by weighted least squares and keeps
/// the pair with the smallest weighted error. Returns `(scale, the_min)`.
pub(super) fn make_qkx2_quants(p: Qkx2, x: &[f32], weights: &[f32], l: &mut [u8]) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let nmax = p.nmax as f32;
    let quant = |iscale: f32, v: f32, min: f32| nearest_int(iscale * (v - min)).clamp(0, p.nmax);
    let error = |scale: f32, min: f32, q: &[u8]| {
        let mut e = 0f32;
        for i in 0..n {
            let diff = scale * q[i] as f32 + min - x[i];
            e += weights[i] * if p.use_mad { diff.abs() } else { diff * diff };
        }
        e
    };
    let iscale = nmax / (max - min);
    let mut scale = 1.0 / iscale;
    for (l, &v) in l.iter_mut().zip(x) {
        *l = quant(iscale, v, min) as u8;
    }
    let mut best_error = error(scale, min, l);
    if p.nstep < 1 {
        return (scale, -min);
    }
    let mut aux = [0u8; 32];
    let aux = &mut aux[..n];
    for is in 0..=p.nstep {
        // Around the best minimum so far, as ggml does.
        let iscale = (p.rmin + p.rdelta * is as f32 + nmax) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = quant(iscale, x[i], min);
            aux[i] = q as u8;
            let (w, q) = (weights[i], q as f32);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let cur_error = error(this_scale, this_min, aux);
            if cur_error < best_error {
                l.copy_from_slice(aux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Packs eight 6-bit scales and eight 6-bit minimums into Q4_K / Q5_K's 12 bytes: bytes 0-3
/// hold scales 0-3 and bytes 4-7 minimums 0-3 in their low 6 bits; scales and minimums 4-7
/// keep their low 4 bits in bytes 8-11 (scale low nibble, minimum high nibble) and their top 2
/// bits in the top bits of bytes 0-3 (scales) and 4-7 (minimums).
pub(super) fn pack_scale_min_k4(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = ls[j] | ((ls[j + 4] >> 4) << 6);
        q[j + 4] = lm[j] | ((lm[j + 4] >> 4) << 6);
        q[j + 8] = (ls[j + 4] & 0x0f) | ((lm[j + 4] & 0x0f) << 4);
    }
    q
}

/// Scale and minimum `j` (0..8) of Q4_K / Q5_K's 12 packed bytes (ggml's `get_scale_min_k4`).
pub(super) fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        for (x, want) in [
            (0.4f32, 0),
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (-2.6, -3),
            (100.49, 100),
            (4_194_303.0, 4_194_303),
        ] {
            assert_eq!(nearest_int(x), want, "{x}");
        }
    }

    #[test]
    fn scale_min_packing_round_trips() {
        let ls = [0, 1, 17, 63, 62, 33, 16, 48];
        let lm = [63, 0, 5, 40, 1, 63, 47, 31];
        let q = pack_scale_min_k4(&ls, &lm);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &q), (ls[j], lm[j]), "{j}");
        }
    }

    #[test]
    fn searches_fit_representable_groups_exactly() {
        // Values on a grid of the form scale * q (symmetric) are found with that scale.
        let x: Vec<f32> = (0..16).map(|i| 0.25 * (i as f32 - 8.0)).collect();
        let mut l = [0i8; 16];
        let s = make_qx_quants(32, &x, &mut l);
        for (q, v) in l.iter().zip(&x) {
            assert!((s * (*q as i32 - 32) as f32 - v).abs() < 1e-6);
        }
        let s = make_q3_quants(4, &x[4..12], &mut l[..8]);
        for (q, v) in l[..8].iter().zip(&x[4..12]) {
            assert!((s * (*q as i32 - 4) as f32 - v).abs() < 1e-6, "{s} {q} {v}");
        }
        // An affine grid with a negative minimum: scale 0.5, minimum 3.
        let x: Vec<f32> = (0..32).map(|i| 0.5 * (i % 16) as f32 - 3.0).collect();
        let w = vec![1f32; 32];
        let mut q = [0u8; 32];
        let (s, m) = make_qkx2_quants(Q4K_SEARCH, &x, &w, &mut q);
        for (q, v) in q.iter().zip(&x) {
            assert!((s * *q as f32 - m - v).abs() < 1e-5, "{s} {m} {q} {v}");
        }
        // All zeros: scale 0, quants 0.
        assert_eq!(make_qx_quants(32, &[0.0; 16], &mut l), 0.0);
        assert_eq!(l, [0; 16]);
    }
}
