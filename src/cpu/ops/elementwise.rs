//! Element-wise kernels: binary ops with broadcasting, unary functions, scale, clamp, swiglu.
//! Work is split by output rows, or, when there are fewer rows than threads (decoding one
//! token), by columns within each row; f32 rows with packed elements take a slice fast path
//! that the compiler vectorizes (`map_span`, `zip_span`: an AVX2 instance where the CPU has
//! it; an input that partly overlaps the output goes element by element), everything else
//! goes element by element.

use super::{Split, unravel_row};
use crate::DType;
use crate::cpu::view::{ComputeParams, TensorView};
use crate::op::{BinaryOp, UnaryOp};

#[inline(always)]
fn packed_f32(t: &TensorView) -> bool {
    t.dtype == DType::F32 && t.nb[0] == 4
}

/// Fewest columns per thread worth splitting a row for: a shorter row is done by one thread
/// in less time than the barrier that a column split puts before a row-wise node that follows
/// (a norm), and with whole rows the chain norm, weight, residual add runs barrier-free.
const COLS_MIN: usize = 1024;

/// How `nth` threads split `dst` (see [`my_spans`]).
pub(super) fn split(dst: &TensorView, nth: usize) -> Split {
    let (rows, n0) = (dst.nrows(), dst.ne[0]);
    if rows < nth && n0 >= COLS_MIN * nth {
        Split::Cols(n0.div_ceil(nth).next_multiple_of(16))
    } else {
        Split::Rows(rows)
    }
}

/// The parts of the output this thread computes: `(i1, i2, i3, c0..c1)`, whole rows split
/// between threads, or with fewer rows than threads long rows split into column ranges
/// (whole multiples of 16 elements, so vector loops stay aligned to the row start).
fn my_spans(
    p: &ComputeParams,
    dst: &TensorView,
) -> impl Iterator<Item = (usize, usize, usize, std::ops::Range<usize>)> {
    let ne = dst.ne;
    let (rows, n0) = (dst.nrows(), ne[0]);
    let (rows_mine, cols) = match split(dst, p.nth) {
        Split::Cols(chunk) => {
            let c0 = (p.ith * chunk).min(n0);
            (0..rows, c0..(c0 + chunk).min(n0))
        }
        Split::Rows(_) => (p.range(rows), 0..n0),
    };
    rows_mine.map(move |r| {
        let (i1, i2, i3) = unravel_row(r, &ne);
        (i1, i2, i3, cols.clone())
    })
}

pub fn binary(p: &ComputeParams, op: BinaryOp, dst: &TensorView, a: &TensorView, b: &TensorView) {
    // One instance per op (a closure chosen by `match` into one variable would be a function
    // pointer: a call per element and no vector loop).
    match op {
        BinaryOp::Add => binary_with(p, dst, a, b, |x, y| x + y),
        BinaryOp::Sub => binary_with(p, dst, a, b, |x, y| x - y),
        BinaryOp::Mul => binary_with(p, dst, a, b, |x, y| x * y),
        BinaryOp::Div => binary_with(p, dst, a, b, |x, y| x / y),
    }
}

#[inline(always)]
fn binary_with(
    p: &ComputeParams,
    dst: &TensorView,
    a: &TensorView,
    b: &TensorView,
    f: impl Fn(f32, f32) -> f32,
) {
    let fast = packed_f32(dst) && packed_f32(a) && packed_f32(b);
    let n0 = dst.ne[0];
    for (i1, i2, i3, cols) in my_spans(p, dst) {
        let (j1, j2, j3) = (i1 % b.ne[1], i2 % b.ne[2], i3 % b.ne[3]);
        if fast {
            // SAFETY: executor-provided views, rows in range; dst row owned by this thread. `a`
            // may alias `dst` (in place), which is fine element by element, so read through raw
            // pointers before writing.
            unsafe {
                let ap = a.row_ptr(i1, i2, i3).cast::<f32>();
                let bp = b.row_ptr(j1, j2, j3).cast::<f32>();
                let dp = dst.row_ptr(i1, i2, i3).cast::<f32>();
                let (c, len) = (cols.start, cols.len());
                if b.ne[0] == n0 {
                    zip_span(dp.add(c), ap.add(c), bp.add(c), len, &f);
                } else if b.ne[0] == 1 {
                    let y = *bp;
                    map_span(dp.add(c), ap.add(c), len, |x| f(x, y));
                } else {
                    let nb0 = b.ne[0];
                    for i in cols {
                        *dp.add(i) = f(*ap.add(i), *bp.add(i % nb0));
                    }
                }
            }
        } else {
            for i0 in cols {
                // SAFETY: indices in range; this thread owns the dst row.
                unsafe {
                    let x = a.get_f32(i0, i1, i2, i3);
                    let y = b.get_f32(i0 % b.ne[0], j1, j2, j3);
                    dst.set_f32(i0, i1, i2, i3, f(x, y));
                }
            }
        }
    }
}

/// `dst = f(a)` element-wise, same shape.
pub fn map(p: &ComputeParams, dst: &TensorView, a: &TensorView, f: impl Fn(f32) -> f32) {
    let fast = packed_f32(dst) && packed_f32(a);
    for (i1, i2, i3, cols) in my_spans(p, dst) {
        if fast {
            // SAFETY: as in `binary`; `a` may alias `dst` element by element.
            unsafe {
                let ap = a.row_ptr(i1, i2, i3).cast::<f32>();
                let dp = dst.row_ptr(i1, i2, i3).cast::<f32>();
                map_span(dp.add(cols.start), ap.add(cols.start), cols.len(), &f);
            }
        } else {
            for i0 in cols {
                // SAFETY: indices in range; this thread owns the dst row.
                unsafe { dst.set_f32(i0, i1, i2, i3, f(a.get_f32(i0, i1, i2, i3))) };
            }
        }
    }
}

/// Whether `n` f32 at `p` and at `q` share no byte.
#[inline(always)]
fn disjoint(p: *const f32, q: *const f32, n: usize) -> bool {
    let (p, q) = (p as usize, q as usize);
    p + 4 * n <= q || q + 4 * n <= p
}

/// `d[i] = f(a[i])` for `n` f32, `a` being `d` itself (in place) or anywhere else. Where `a`
/// is `d` or shares no byte with it the loop runs over slices, which the compiler vectorizes
/// (8 lanes in the AVX2 instance, picked at run time); a partial overlap goes element by
/// element through the pointers. Lane results equal the scalar ones: the functions have no
/// fused multiply-adds for the compiler to form.
///
/// # Safety
/// `d` writable and `a` readable for `n` f32; no other thread touches `d`'s range meanwhile.
#[inline(always)]
unsafe fn map_span(d: *mut f32, a: *const f32, n: usize, f: impl Fn(f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd::Isa::detect() >= crate::cpu::simd::Isa::Avx2 {
        #[target_feature(enable = "avx2")]
        unsafe fn wide(d: *mut f32, a: *const f32, n: usize, f: impl Fn(f32) -> f32) {
            // SAFETY: the caller's contract.
            unsafe { map_body(d, a, n, f) }
        }
        // SAFETY: AVX2 detected; the caller's contract.
        return unsafe { wide(d, a, n, f) };
    }
    // SAFETY: the caller's contract.
    unsafe { map_body(d, a, n, f) }
}

#[inline(always)]
unsafe fn map_body(d: *mut f32, a: *const f32, n: usize, f: impl Fn(f32) -> f32) {
    // SAFETY (all three arms): the ranges are the caller's; a slice is formed only where no
    // other live slice overlaps it.
    unsafe {
        if d.cast_const() == a {
            for v in std::slice::from_raw_parts_mut(d, n) {
                *v = f(*v);
            }
        } else if disjoint(d, a, n) {
            let (d, a) = (
                std::slice::from_raw_parts_mut(d, n),
                std::slice::from_raw_parts(a, n),
            );
            for (o, &x) in d.iter_mut().zip(a) {
                *o = f(x);
            }
        } else {
            for i in 0..n {
                *d.add(i) = f(*a.add(i));
            }
        }
    }
}

/// `d[i] = f(a[i], b[i])` for `n` f32, as [`map_span`]: over slices where each input is `d`
/// itself or shares no byte with it.
///
/// # Safety
/// As [`map_span`], `b` readable for `n` f32.
#[inline(always)]
unsafe fn zip_span(
    d: *mut f32,
    a: *const f32,
    b: *const f32,
    n: usize,
    f: &impl Fn(f32, f32) -> f32,
) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::simd::Isa::detect() >= crate::cpu::simd::Isa::Avx2 {
        #[target_feature(enable = "avx2")]
        unsafe fn wide(
            d: *mut f32,
            a: *const f32,
            b: *const f32,
            n: usize,
            f: &impl Fn(f32, f32) -> f32,
        ) {
            // SAFETY: the caller's contract.
            unsafe { zip_body(d, a, b, n, f) }
        }
        // SAFETY: AVX2 detected; the caller's contract.
        return unsafe { wide(d, a, b, n, f) };
    }
    // SAFETY: the caller's contract.
    unsafe { zip_body(d, a, b, n, f) }
}

#[inline(always)]
unsafe fn zip_body(
    d: *mut f32,
    a: *const f32,
    b: *const f32,
    n: usize,
    f: &impl Fn(f32, f32) -> f32,
) {
    let dc = d.cast_const();
    // SAFETY (all arms): the ranges are the caller's; a slice is formed only where no other
    // live slice overlaps it (an input equal to `d` is read through `d`'s own slice).
    unsafe {
        let ds = || std::slice::from_raw_parts_mut(d, n);
        let sl = |p: *const f32| std::slice::from_raw_parts(p, n);
        if a == dc && disjoint(d, b, n) {
            for (o, &y) in ds().iter_mut().zip(sl(b)) {
                *o = f(*o, y);
            }
        } else if b == dc && disjoint(d, a, n) {
            for (o, &x) in ds().iter_mut().zip(sl(a)) {
                *o = f(x, *o);
            }
        } else if disjoint(d, a, n) && disjoint(d, b, n) {
            for ((o, &x), &y) in ds().iter_mut().zip(sl(a)).zip(sl(b)) {
                *o = f(x, y);
            }
        } else {
            for i in 0..n {
                *d.add(i) = f(*a.add(i), *b.add(i));
            }
        }
    }
}

/// `x * sigmoid(x)` with the branch-free `exp_fast` (~2 ulp), so loops over rows vectorize.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + super::attn::exp_fast(-x))
}

/// GELU's tanh approximation `0.5 x (1 + tanh(u))`, `u = sqrt(2 / pi) (x + 0.044715 x^3)`,
/// computed as `x * sigmoid(2u)` (the same function: `(1 + tanh(u)) / 2 = 1 / (1 + e^(-2u))`)
/// with the branch-free `exp_fast`, so loops over rows vectorize (libm's `tanhf` is a call
/// per element: 1.7% of a Gemma 3 decode step).
#[inline(always)]
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    const TWO_SQRT_2_OVER_PI: f32 = 2.0 * 0.797_884_6;
    x / (1.0 + super::attn::exp_fast(-TWO_SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)))
}

#[inline(always)]
fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

pub fn unary(p: &ComputeParams, op: UnaryOp, dst: &TensorView, a: &TensorView) {
    match op {
        UnaryOp::Silu => map(p, dst, a, silu),
        UnaryOp::Gelu => map(p, dst, a, gelu_tanh),
        UnaryOp::GeluErf => map(p, dst, a, gelu_erf),
        UnaryOp::Relu => map(p, dst, a, |x| x.max(0.0)),
        UnaryOp::Tanh => map(p, dst, a, f32::tanh),
        UnaryOp::Sigmoid => map(p, dst, a, |x| 1.0 / (1.0 + (-x).exp())),
    }
}

/// `silu(gate) * up` from two tensors, or from the halves of one fused tensor.
pub fn swiglu(p: &ComputeParams, dst: &TensorView, src: &[TensorView]) {
    let n = dst.ne[0];
    let fused = src.len() == 1;
    let (g, u) = (&src[0], src.get(1).unwrap_or(&src[0]));
    let fast = packed_f32(dst) && packed_f32(g) && packed_f32(u);
    for (i1, i2, i3, cols) in my_spans(p, dst) {
        // SAFETY: executor-provided views, rows in range; dst row owned by this thread.
        unsafe {
            let gp = g.row_ptr(i1, i2, i3);
            let up = if fused {
                gp.add(n * u.nb[0])
            } else {
                u.row_ptr(i1, i2, i3)
            };
            if fast {
                // Raw pointers: another thread may own other columns of this row.
                let dp = dst.row_ptr(i1, i2, i3).cast::<f32>();
                let (gp, up) = (gp.cast::<f32>(), up.cast::<f32>());
                let c = cols.start;
                zip_span(dp.add(c), gp.add(c), up.add(c), cols.len(), &|g, u| {
                    silu(g) * u
                });
            } else {
                let off = if fused { n } else { 0 };
                for i0 in cols {
                    let x = g.get_f32(i0, i1, i2, i3);
                    let y = u.get_f32(i0 + off, i1, i2, i3);
                    dst.set_f32(i0, i1, i2, i3, silu(x) * y);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{gelu_tanh, map_span, zip_span};

    /// The span loops give every element the function's own value in place, apart, and with
    /// inputs overlapping the output by part of a span (where a slice would be unsound and
    /// the element order decides what is read): against the plain loop over a copy.
    #[test]
    fn spans_equal_the_plain_loop_in_place_apart_and_overlapping() {
        let n = 37;
        let init: Vec<f32> = (0..3 * n).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
        let f = |x: f32| gelu_tanh(x);
        let g = |x: f32, y: f32| x * y - 0.5;
        // (output offset, first input offset, second input offset) in one buffer.
        for (o, a, b) in [
            (n, n, 2 * n),
            (0, n, 2 * n),
            (n, 0, n),
            (3, 0, n + 5),
            (0, 5, 2),
        ] {
            let (mut got_map, mut got_zip) = (init.clone(), init.clone());
            let (mut want_map, mut want_zip) = (init.clone(), init.clone());
            for i in 0..n {
                want_map[o + i] = f(want_map[a + i]);
                want_zip[o + i] = g(want_zip[a + i], want_zip[b + i]);
            }
            // SAFETY: every range lies inside the buffer; nothing else uses it meanwhile.
            unsafe {
                let p = got_map.as_mut_ptr();
                map_span(p.add(o), p.add(a), n, f);
                let p = got_zip.as_mut_ptr();
                zip_span(p.add(o), p.add(a), p.add(b), n, &g);
            }
            assert_eq!(got_map, want_map, "map, offsets {o} {a}");
            assert_eq!(got_zip, want_zip, "zip, offsets {o} {a} {b}");
        }
    }

    #[test]
    fn gelu_through_the_sigmoid_equals_the_tanh_form() {
        // The tanh form in f64 (the definition) against the f32 kernel, over the range
        // activations take and past where exp_fast clamps. Within a few ulp relative: for
        // negative x the sigmoid form avoids `1 + tanh(u)`'s cancellation, which cost the
        // f32 tanh form up to 1e-5 relative at x = -2.8.
        for i in -4000..=4000 {
            let x = i as f32 * 0.01;
            let xd = x as f64;
            let u = (2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd * xd * xd);
            let want = 0.5 * xd * (1.0 + u.tanh());
            let got = gelu_tanh(x) as f64;
            let tol = 1.5e-6 * want.abs() + 1e-12;
            assert!((got - want).abs() <= tol, "x {x}: {got} against {want}");
        }
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert_eq!(gelu_tanh(1e4), 1e4);
        assert!(gelu_tanh(-1e4).abs() < 1e-30);
    }
}
