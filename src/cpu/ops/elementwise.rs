//! Element-wise kernels: binary ops with broadcasting, unary functions, scale, clamp, swiglu.
//! Work is split by output rows; f32 rows with packed elements take a slice fast path that the
//! compiler vectorizes, everything else goes through f32 row buffers.

use super::unravel_row;
use crate::DType;
use crate::cpu::view::{ComputeParams, TensorView};
use crate::op::{BinaryOp, UnaryOp};

#[inline(always)]
fn packed_f32(t: &TensorView) -> bool {
    t.dtype == DType::F32 && t.nb[0] == 4
}

/// Rows `(i1, i2, i3)` owned by this thread.
fn my_rows(p: &ComputeParams, dst: &TensorView) -> impl Iterator<Item = (usize, usize, usize)> {
    let ne = dst.ne;
    p.range(dst.nrows()).map(move |r| unravel_row(r, &ne))
}

/// # Safety (for the row helpers below)
/// Views come from the executor: in range, output rows owned by this thread.
unsafe fn f32_row<'a>(t: &TensorView, i1: usize, i2: usize, i3: usize) -> &'a mut [f32] {
    // SAFETY: packed f32 row in range (caller).
    unsafe { std::slice::from_raw_parts_mut(t.row_ptr(i1, i2, i3).cast::<f32>(), t.ne[0]) }
}

pub fn binary(p: &ComputeParams, op: BinaryOp, dst: &TensorView, a: &TensorView, b: &TensorView) {
    let f = match op {
        BinaryOp::Add => |x: f32, y: f32| x + y,
        BinaryOp::Sub => |x: f32, y: f32| x - y,
        BinaryOp::Mul => |x: f32, y: f32| x * y,
        BinaryOp::Div => |x: f32, y: f32| x / y,
    };
    let fast = packed_f32(dst) && packed_f32(a) && packed_f32(b);
    let n0 = dst.ne[0];
    for (i1, i2, i3) in my_rows(p, dst) {
        let (j1, j2, j3) = (i1 % b.ne[1], i2 % b.ne[2], i3 % b.ne[3]);
        if fast {
            // SAFETY: executor-provided views, rows in range; dst row owned by this thread. `a`
            // may alias `dst` (in place), which is fine element by element, so read through raw
            // pointers before writing.
            unsafe {
                let ap = a.row_ptr(i1, i2, i3).cast::<f32>();
                let bp = b.row_ptr(j1, j2, j3).cast::<f32>();
                let dp = dst.row_ptr(i1, i2, i3).cast::<f32>();
                if b.ne[0] == n0 {
                    for i in 0..n0 {
                        *dp.add(i) = f(*ap.add(i), *bp.add(i));
                    }
                } else if b.ne[0] == 1 {
                    let y = *bp;
                    for i in 0..n0 {
                        *dp.add(i) = f(*ap.add(i), y);
                    }
                } else {
                    let nb0 = b.ne[0];
                    for i in 0..n0 {
                        *dp.add(i) = f(*ap.add(i), *bp.add(i % nb0));
                    }
                }
            }
        } else {
            for i0 in 0..n0 {
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
    for (i1, i2, i3) in my_rows(p, dst) {
        if fast {
            // SAFETY: as in `binary`; `a` may alias `dst` element by element.
            unsafe {
                let ap = a.row_ptr(i1, i2, i3).cast::<f32>();
                let dp = dst.row_ptr(i1, i2, i3).cast::<f32>();
                for i in 0..dst.ne[0] {
                    *dp.add(i) = f(*ap.add(i));
                }
            }
        } else {
            for i0 in 0..dst.ne[0] {
                // SAFETY: indices in range; this thread owns the dst row.
                unsafe { dst.set_f32(i0, i1, i2, i3, f(a.get_f32(i0, i1, i2, i3))) };
            }
        }
    }
}

#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)).tanh())
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
    }
}

/// `silu(gate) * up` from two tensors, or from the halves of one fused tensor.
pub fn swiglu(p: &ComputeParams, dst: &TensorView, src: &[TensorView]) {
    let n = dst.ne[0];
    let fused = src.len() == 1;
    let (g, u) = (&src[0], src.get(1).unwrap_or(&src[0]));
    let fast = packed_f32(dst) && packed_f32(g) && packed_f32(u);
    for (i1, i2, i3) in my_rows(p, dst) {
        // SAFETY: executor-provided views, rows in range; dst row owned by this thread.
        unsafe {
            let gp = g.row_ptr(i1, i2, i3);
            let up = if fused {
                gp.add(n * u.nb[0])
            } else {
                u.row_ptr(i1, i2, i3)
            };
            if fast {
                let d = f32_row(dst, i1, i2, i3);
                let (gp, up) = (gp.cast::<f32>(), up.cast::<f32>());
                for (i, o) in d.iter_mut().enumerate() {
                    *o = silu(*gp.add(i)) * *up.add(i);
                }
            } else {
                let off = if fused { n } else { 0 };
                for i0 in 0..n {
                    let x = g.get_f32(i0, i1, i2, i3);
                    let y = u.get_f32(i0 + off, i1, i2, i3);
                    dst.set_f32(i0, i1, i2, i3, silu(x) * y);
                }
            }
        }
    }
}
