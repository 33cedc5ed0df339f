//! What a CPU kernel sees: [`TensorView`], a raw descriptor of one tensor in host memory (data
//! pointer, dtype, `ne`, `nb`), and [`ComputeParams`], the thread's index in its pool, the
//! barrier and the node's scratch memory.
//!
//! Kernels split their work by `(ith, nth)` so that no two threads write the same bytes; the
//! executor guarantees that a node's output does not overlap its inputs unless the op is
//! allowed in place, and that every tensor's bytes lie inside its buffer.

use super::pool::Barrier;
use crate::DType;

/// A tensor in host memory, as kernels address it: element `(i0, i1, i2, i3)` of a plain type
/// is at `data + i0*nb[0] + i1*nb[1] + i2*nb[2] + i3*nb[3]`; for quantized types `i0` counts
/// blocks along dimension 0.
#[derive(Clone, Copy, Debug)]
pub struct TensorView {
    pub data: *mut u8,
    pub dtype: DType,
    pub ne: [usize; 4],
    pub nb: [usize; 4],
}

// SAFETY: a TensorView is a descriptor (pointer plus shape); it grants no access by itself.
// Reading or writing through `data` is `unsafe` and kernels do it only within the partition of
// work given by `(ith, nth)`, which the executor makes disjoint for writes; reads of inputs
// happen while no thread writes them (the barrier between nodes orders them).
unsafe impl Send for TensorView {}
// SAFETY: see `Send` above.
unsafe impl Sync for TensorView {}

impl TensorView {
    pub fn nelements(&self) -> usize {
        self.ne.iter().product()
    }

    pub fn nrows(&self) -> usize {
        self.ne[1] * self.ne[2] * self.ne[3]
    }

    /// Bytes of one contiguous row of `ne[0]` elements.
    pub fn row_size(&self) -> usize {
        self.dtype.row_size(self.ne[0])
    }

    /// Rows are contiguous along dimension 0 (elements or blocks packed).
    pub fn rows_contiguous(&self) -> bool {
        self.nb[0] == self.dtype.type_size()
    }

    /// The tensor's layout (shape and strides without the pointer).
    pub fn layout(&self) -> crate::tensor::Layout {
        crate::tensor::Layout {
            dtype: self.dtype,
            ne: self.ne,
            nb: self.nb,
        }
    }

    /// The whole tensor is packed in ggml order without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.layout().is_contiguous()
    }

    /// Pointer to the first element of row `(i1, i2, i3)`.
    ///
    /// # Safety
    /// The indices must be in range, so the pointer stays inside the tensor's allocation.
    #[inline(always)]
    pub unsafe fn row_ptr(&self, i1: usize, i2: usize, i3: usize) -> *mut u8 {
        // SAFETY: the caller keeps the indices in range, so the offset stays in the allocation.
        unsafe {
            self.data
                .add(i1 * self.nb[1] + i2 * self.nb[2] + i3 * self.nb[3])
        }
    }

    /// Pointer to element `(i0, i1, i2, i3)` (for quantized types, `i0` is a block index).
    ///
    /// # Safety
    /// As [`TensorView::row_ptr`].
    #[inline(always)]
    pub unsafe fn ptr(&self, i0: usize, i1: usize, i2: usize, i3: usize) -> *mut u8 {
        // SAFETY: the caller keeps the indices in range.
        unsafe { self.row_ptr(i1, i2, i3).add(i0 * self.nb[0]) }
    }

    /// Read an element of a plain type as f32 (I32 is converted).
    ///
    /// # Safety
    /// As [`TensorView::row_ptr`]; the dtype must not be quantized.
    #[inline(always)]
    pub unsafe fn get_f32(&self, i0: usize, i1: usize, i2: usize, i3: usize) -> f32 {
        // SAFETY: the caller keeps indices in range; reads are unaligned-safe.
        unsafe {
            let p = self.ptr(i0, i1, i2, i3);
            match self.dtype {
                DType::F32 => p.cast::<f32>().read_unaligned(),
                DType::F16 => p.cast::<half::f16>().read_unaligned().to_f32(),
                DType::BF16 => p.cast::<half::bf16>().read_unaligned().to_f32(),
                DType::I32 => p.cast::<i32>().read_unaligned() as f32,
                _ => f32::NAN,
            }
        }
    }

    /// Write an element of a plain type from f32.
    ///
    /// # Safety
    /// As [`TensorView::row_ptr`]; no other thread may access the element.
    #[inline(always)]
    pub unsafe fn set_f32(&self, i0: usize, i1: usize, i2: usize, i3: usize, v: f32) {
        // SAFETY: the caller keeps indices in range and owns the element.
        unsafe {
            let p = self.ptr(i0, i1, i2, i3);
            match self.dtype {
                DType::F32 => p.cast::<f32>().write_unaligned(v),
                DType::F16 => p
                    .cast::<half::f16>()
                    .write_unaligned(half::f16::from_f32(v)),
                DType::BF16 => p
                    .cast::<half::bf16>()
                    .write_unaligned(half::bf16::from_f32(v)),
                DType::I32 => p.cast::<i32>().write_unaligned(v as i32),
                _ => {}
            }
        }
    }
}

/// Per-thread parameters of one node's computation.
pub struct ComputeParams<'a> {
    /// This thread's index, `0..nth`.
    pub ith: usize,
    /// Threads working on the node.
    pub nth: usize,
    /// Scratch memory shared by the node's threads (its `shared` bytes, 64-byte aligned).
    pub wdata: *mut u8,
    pub wsize: usize,
    /// This thread's own scratch (the node's `per_thread` bytes or more, 64-byte aligned).
    pub tdata: *mut u8,
    pub tsize: usize,
    pub barrier: &'a Barrier,
    /// How activations meet quantized weights in `mul_mat`.
    pub precision: Precision,
    /// The node's work-item counter, 0 when the node starts, shared by its threads: `mul_mat`
    /// hands its items out through it, smaller ones, so a thread that is slowed down
    /// (preempted, or with slower rows) leaves the rest of its share to the others instead of
    /// holding them at the next barrier (ggml's chunked `mul_mat`). `None`: each thread takes
    /// its own `1/nth` of the items.
    pub items: Option<&'a std::sync::atomic::AtomicUsize>,
}

/// The precision of activations in products with quantized weights (Q8_0, Q4_0, Q4_1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Activations quantized to 8 bits per block (Q8_0 / Q8_1 / Q8_K numbers) and integer dot
    /// products, as ggml's CPU backend does. The kernels honour it at every M; a graph node
    /// on AVX2 without VNNI runs in f32 above [`q8_max_rows`](crate::cpu::matmul::q8_max_rows)
    /// activation rows, where that is faster (the CPU backend's plan).
    Q8,
    /// f32 activations (the default): weights dequantized (in registers for small batches, into
    /// scratch for larger ones) and multiplied in f32, so the only error is f32 rounding.
    /// Measured against [`Precision::Q8`] on SmolLM2 (docs/kernels.md): prompt processing is
    /// faster (the f32 GEMM beats integer tiles at M = 128), decoding within ~5%, and greedy
    /// decoding follows the f32 reference where 8-bit activations flip tokens.
    #[default]
    Exact,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::Q8 => "q8",
            Precision::Exact => "exact",
        }
    }

    pub fn from_name(s: &str) -> Option<Precision> {
        [Precision::Q8, Precision::Exact]
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s))
    }

    /// The precision chosen by the `--q8` command-line flag.
    pub fn from_q8_flag(q8: bool) -> Precision {
        if q8 { Precision::Q8 } else { Precision::Exact }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl ComputeParams<'_> {
    /// Meet the other threads of this node.
    pub fn barrier(&self) {
        self.barrier.wait()
    }

    /// This thread's share `[start, end)` of `n` items, split as evenly as possible.
    pub fn range(&self, n: usize) -> std::ops::Range<usize> {
        split_range(n, self.ith, self.nth)
    }
}

/// Share `ith` of `nth` of `n` items: the first `n % nth` shares get one extra item.
pub fn split_range(n: usize, ith: usize, nth: usize) -> std::ops::Range<usize> {
    let base = n / nth;
    let rem = n % nth;
    let start = ith * base + ith.min(rem);
    let len = base + usize::from(ith < rem);
    start..start + len
}

#[cfg(test)]
mod tests {
    use super::split_range;

    #[test]
    fn split_range_covers_everything_once() {
        for n in [0, 1, 5, 17] {
            for nth in 1..6 {
                let mut next = 0;
                for ith in 0..nth {
                    let r = split_range(n, ith, nth);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}
