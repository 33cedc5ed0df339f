//! CPU kernels by op family, and the one place that fans an `Op` out to them: `supports`
//! (which operand types and layouts each kernel takes), `scratch` (shared and per-thread bytes) and
//! `forward` (run one node on one thread of the pool; a kernel that meets an operand value it
//! cannot use, such as an out-of-range row id, returns a [`KernelError`] instead of panicking).
//!
//! Every kernel splits its output by `(ith, nth)` so threads write disjoint bytes, reads its
//! inputs through their strides, and converts half types through f32.

mod attn;
mod copy;
mod elementwise;
mod experts;
#[cfg(test)]
mod fake_type;
mod norm;
mod rope;
mod rows;

use super::matmul;
use super::view::{ComputeParams, Precision, TensorView};
use crate::DType;
use crate::op::Op;

type Support = Result<(), String>;

fn need(cond: bool, why: impl FnOnce() -> String) -> Support {
    if cond { Ok(()) } else { Err(why()) }
}

fn float(t: &TensorView, what: &str) -> Support {
    need(t.dtype.is_float(), || {
        format!("{what} has dtype {}, kernels take f32, f16, bf16", t.dtype)
    })
}

/// Whether a kernel computes `op` with these operands.
pub fn supports(op: &Op, dst: &TensorView, src: &[TensorView]) -> Support {
    match op {
        Op::Leaf | Op::Reshape | Op::View { .. } | Op::Permute { .. } => Ok(()),
        Op::MulMat => matmul::supports(&src[0], &src[1], dst),
        Op::MulMatId { .. } => experts::supports(src, dst),
        Op::Binary(_) | Op::Scale { .. } | Op::Clamp { .. } | Op::Unary(_) | Op::Swiglu => {
            for (i, s) in src.iter().enumerate() {
                float(s, &format!("source {i}"))?;
            }
            float(dst, "the output")
        }
        Op::RmsNorm { .. } | Op::Norm { .. } | Op::SumRows | Op::SumSqrRows | Op::Mean => {
            float(&src[0], "the input")
        }
        Op::RmsNormSums { .. } => {
            float(&src[0], "the input")?;
            need(src[1].dtype == DType::F32, || "the sums must be f32".into())?;
            float(&src[2], "the weight")?;
            float(dst, "the output")
        }
        Op::SoftMax { .. } => {
            float(&src[0], "the input")?;
            need(dst.dtype == DType::F32 || dst.dtype == src[0].dtype, || {
                "output dtype".into()
            })
        }
        Op::Argmax => need(src[0].dtype == DType::F32, || "argmax takes f32".into()),
        Op::Argsort { .. } => need(
            src[0].dtype == DType::F32 && dst.dtype == DType::I32 && dst.nb[0] == 4,
            || "argsort takes f32 into I32 rows whose elements are adjacent".into(),
        ),
        Op::Rope(_) => need(matches!(src[0].dtype, DType::F32 | DType::F16), || {
            format!("rope takes f32 or f16, not {}", src[0].dtype)
        }),
        // A window is any part of the table or destination (checked by the builder).
        Op::GetRows { window: _ } => need(
            src[0].rows_contiguous() || !src[0].dtype.is_quantized(),
            || "quantized tables need packed rows".into(),
        ),
        Op::SetRows { window: _ } => need(dst.dtype.is_float(), || {
            format!("set_rows into {} is not supported", dst.dtype)
        }),
        Op::Cont | Op::Cpy => copy::supports(&src[0], dst),
        Op::Concat { .. } => need(
            src[0].dtype == src[1].dtype && src[0].dtype == dst.dtype,
            || "concat operands must share a dtype".into(),
        ),
        Op::FlashAttn { .. } => attn::supports(src),
        Op::Collective(_) => Err("collectives run in the meta backend, between node ranges".into()),
    }
}

/// Scratch a node needs: bytes shared by all its threads (written by all, then read by all
/// after a barrier: the matmul's quantized activations), and bytes private to each thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scratch {
    pub shared: usize,
    pub per_thread: usize,
}

/// Scratch the node needs on `nth` threads.
pub fn scratch(
    op: &Op,
    dst: &TensorView,
    src: &[TensorView],
    nth: usize,
    precision: Precision,
) -> Scratch {
    let rows = || copy::row_scratch(src, dst);
    match op {
        Op::MulMat => {
            let (shared, per_thread) = matmul::node_scratch(&src[0], &src[1], dst, nth, precision);
            Scratch { shared, per_thread }
        }
        Op::MulMatId { .. } => Scratch {
            shared: experts::work_size(src, nth, precision),
            per_thread: 0,
        },
        Op::FlashAttn { .. } => Scratch {
            shared: 0,
            per_thread: attn::thread_bytes(src, nth),
        },
        Op::RmsNorm { .. }
        | Op::RmsNormSums { .. }
        | Op::Norm { .. }
        | Op::SoftMax { .. }
        | Op::SumRows
        | Op::SumSqrRows
        | Op::Mean
        | Op::Argmax
        | Op::Argsort { .. }
        | Op::Rope(_)
        | Op::GetRows { .. }
        | Op::SetRows { .. }
        | Op::Cont
        | Op::Cpy => Scratch {
            shared: 0,
            per_thread: rows(),
        },
        _ => Scratch::default(),
    }
}

/// How a node's threads split its output by a rule of its shape alone: thread `ith` writes
/// rows `split_range(n, ith, nth)` (whole rows, `Rows(n)`), or columns `ith * c..(ith + 1) * c`
/// of every row (`Cols(c)`). Two nodes with the same split over the same view touch the same
/// elements on each thread, so no barrier is needed between them (`backend::plan_barriers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Rows(usize),
    Cols(usize),
}

/// The split of `op`'s output on `nth` threads, for the kernels whose split is fixed by the
/// shape (element-wise and row-wise ones); `None` for the others (products take work items
/// from a counter).
pub fn split(op: &Op, dst: &TensorView, src: &[TensorView], nth: usize) -> Option<Split> {
    match op {
        Op::Binary(_) | Op::Scale { .. } | Op::Clamp { .. } | Op::Unary(_) | Op::Swiglu => {
            Some(elementwise::split(dst, nth))
        }
        // `norm::for_rows` and `rope` take rows `p.range(src0.nrows())`.
        Op::RmsNorm { .. }
        | Op::RmsNormSums { .. }
        | Op::Norm { .. }
        | Op::SoftMax { .. }
        | Op::Rope(_) => Some(Split::Rows(src[0].nrows())),
        _ => None,
    }
}

/// Whether source `k` is read only where the output is written: element `i` (or row `i`, for
/// the row-wise kernels) of the output reads element (row) `i` of a source of the output's
/// shape. With the producer's [`Split`] equal to the node's, a thread then reads only what it
/// wrote itself.
pub fn reads_aligned(op: &Op, dst: &TensorView, src: &[TensorView], k: usize) -> bool {
    let same_shape = src.get(k).is_some_and(|s| s.ne == dst.ne);
    match op {
        Op::Binary(_) | Op::Scale { .. } | Op::Clamp { .. } | Op::Unary(_) => same_shape,
        // The fused form reads two halves of one wider row.
        Op::Swiglu => src.len() == 2 && same_shape,
        Op::RmsNorm { .. }
        | Op::RmsNormSums { .. }
        | Op::Norm { .. }
        | Op::SoftMax { .. }
        | Op::Rope(_) => k == 0 && same_shape,
        _ => false,
    }
}

/// An operand value a kernel cannot use, found at run time; the executor turns it into an
/// error naming the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelError {
    /// The I32 id `ids[at]` is `id`, outside the `0..rows` rows it indexes.
    RowId {
        id: i64,
        at: [usize; 3],
        rows: usize,
    },
}

/// Run one node on thread `p.ith` of `p.nth`.
pub fn forward(
    p: &ComputeParams,
    op: &Op,
    dst: &TensorView,
    src: &[TensorView],
) -> Result<(), KernelError> {
    match *op {
        // The kernels that index by I32 ids check them; the others cannot fail at run time
        // (operands were checked by `supports` and the builder).
        Op::GetRows { window } => return rows::get_rows(p, dst, &src[0], &src[1], window),
        Op::SetRows { window } => return rows::set_rows(p, dst, &src[1], &src[2], window),
        Op::MulMatId { window } => return experts::mul_mat_id(p, dst, src, window),
        Op::Leaf | Op::Reshape | Op::View { .. } | Op::Permute { .. } => {}
        Op::MulMat => matmul::forward_node(p, &src[0], &src[1], dst),
        Op::Binary(b) => elementwise::binary(p, b, dst, &src[0], &src[1]),
        Op::Scale { scale, bias } => elementwise::map(p, dst, &src[0], |x| x * scale + bias),
        Op::Clamp { min, max } => elementwise::map(p, dst, &src[0], |x| x.clamp(min, max)),
        Op::Unary(u) => elementwise::unary(p, u, dst, &src[0]),
        Op::Swiglu => elementwise::swiglu(p, dst, src),
        Op::RmsNorm { eps } => norm::rms_norm(p, dst, &src[0], eps),
        Op::Norm { eps } => norm::norm(p, dst, &src[0], eps),
        Op::SoftMax { scale } => norm::soft_max(p, dst, &src[0], src.get(1), scale),
        Op::SumRows => norm::sum_rows(p, dst, &src[0], false),
        Op::SumSqrRows => norm::sum_sqr_rows(p, dst, &src[0]),
        Op::RmsNormSums { eps, width } => norm::rms_norm_sums(p, dst, src, eps, width),
        Op::Mean => norm::sum_rows(p, dst, &src[0], true),
        Op::Argmax => norm::argmax(p, dst, &src[0]),
        Op::Argsort { descending } => norm::argsort(p, dst, &src[0], descending),
        Op::Rope(params) => rope::rope(p, dst, &src[0], &src[1], src.get(2), &params),
        Op::Cont => copy::cont(p, dst, &src[0]),
        Op::Cpy => copy::cpy(p, dst, &src[0]),
        Op::Concat { dim } => copy::concat(p, dst, &src[0], &src[1], dim),
        Op::FlashAttn { scale } => attn::flash_attn(p, dst, src, scale),
        Op::Collective(_) => {}
    }
    Ok(())
}

/// Decompose a row index of a tensor with extents `ne` into `(i1, i2, i3)`.
#[inline(always)]
pub(crate) fn unravel_row(r: usize, ne: &[usize; 4]) -> (usize, usize, usize) {
    let i1 = r % ne[1];
    let i2 = (r / ne[1]) % ne[2];
    let i3 = r / (ne[1] * ne[2]);
    (i1, i2, i3)
}

/// Read row `(i1, i2, i3)` of a float or quantized tensor into f32 (`out.len() == ne[0]`);
/// `scratch` holds a packed copy when elements are strided.
///
/// # Safety
/// The row indices are in range and the tensor's bytes are readable.
pub(crate) unsafe fn read_row_f32(
    t: &TensorView,
    i1: usize,
    i2: usize,
    i3: usize,
    out: &mut [f32],
) {
    let n = t.ne[0];
    // SAFETY: the caller keeps the indices in range; reads stay within the row.
    unsafe {
        let base = t.row_ptr(i1, i2, i3);
        if t.dtype == DType::F32 && t.rows_contiguous() {
            std::ptr::copy_nonoverlapping(base.cast::<f32>(), out.as_mut_ptr(), n);
        } else if t.rows_contiguous() || t.dtype.is_quantized() {
            let bytes = std::slice::from_raw_parts(base, t.dtype.row_size(n));
            super::convert::row_to_f32(t.dtype, bytes, out);
        } else {
            for (i0, o) in out.iter_mut().enumerate() {
                *o = t.get_f32(i0, i1, i2, i3);
            }
        }
    }
}

/// Write f32 values into row `(i1, i2, i3)` of a float or quantized tensor.
///
/// # Safety
/// The row indices are in range and this thread owns the row.
pub(crate) unsafe fn write_row_f32(t: &TensorView, i1: usize, i2: usize, i3: usize, v: &[f32]) {
    // SAFETY: the caller keeps the indices in range and owns the row.
    unsafe {
        let base = t.row_ptr(i1, i2, i3);
        if t.dtype == DType::F32 && t.rows_contiguous() {
            std::ptr::copy_nonoverlapping(v.as_ptr(), base.cast::<f32>(), v.len());
        } else if t.rows_contiguous() || t.dtype.is_quantized() {
            let bytes = std::slice::from_raw_parts_mut(base, t.dtype.row_size(v.len()));
            super::convert::row_from_f32(t.dtype, v, bytes);
        } else {
            for (i0, &x) in v.iter().enumerate() {
                t.set_f32(i0, i1, i2, i3, x);
            }
        }
    }
}

/// This thread's f32 scratch of `len` floats.
///
/// # Safety
/// The node's `scratch().per_thread` covered `len` floats.
pub(crate) unsafe fn thread_scratch<'a>(p: &ComputeParams, len: usize) -> &'a mut [f32] {
    assert!(
        len * 4 <= p.tsize,
        "thread scratch: {len} floats requested, {} bytes reserved",
        p.tsize
    );
    // SAFETY: tdata is this thread's private, 64-byte aligned region of tsize bytes (checked
    // above), alive for the whole node.
    unsafe { std::slice::from_raw_parts_mut(p.tdata.cast::<f32>(), len) }
}
