//! The CUDA stream: `CudaBackend::graph_compute` checks every node against the kernels,
//! allocates unallocated roots in its compute buffer (the crate's graph allocator over device
//! memory), uploads inline inputs, and launches one kernel per node, in order, on the logical
//! device's stream. `graph_plan` resolves an allocated graph's device addresses once and
//! launches node ranges of it on demand (the meta backend runs collectives between them); each
//! range ends with a stream synchronization, so what the range wrote is visible to the
//! communicator and to synchronous copies.
//!
//! Matrix products: with at most 8 activation columns (decoding), `k_mul_mat_vec` (float
//! weights) or `k_mul_mat_vec_<type>` (one per quantized type) reads the weights once in their
//! own dtype (`gemv_kernel_for`; the quantized ones have a variant for one activation row),
//! quantized blocks unpacked in registers (each lane sums quants times activations and scales
//! once per 8 values), f32 activations (the CPU backend's default precision); on a device at
//! `Precision::Q8` (the CPU's `--q8`), the types `gemv_q8a` has take 8-bit activations
//! (`k_quantize_q8a`, once per computed activation within a range: `Q8Key`) and integer dot
//! products (`k_mul_mat_vec_q8a_<type>`). Above that, cuBLAS `cublasGemmEx`, one call per
//! (dim 2, dim 3) pair: F16 and BF16 weights in place on tensor cores with the activations
//! rounded to the weight's type and f32 accumulation (ggml's CUDA backend does the same);
//! quantized and F32 weights expanded to f32 in scratch memory and multiplied in f32
//! (CUBLAS_COMPUTE_32F, no TF32); an empty contraction (K = 0) writes zeros. Cached
//! dequantized weights for prompts are not done yet. `mul_mat_id` runs the same GEMV kernels
//! with the expert ids, one (expert slot, token) pair per batch, or, for a prompt, with the
//! pairs grouped by expert on the device into chunks of up to 8 (`mul_mat_id_grouped`: each
//! expert read once per chunk; not yet run on a GPU); `argsort` sorts a row per block.
//!
//! With `METASHARD_CUDA_GRAPHS=1`, a plan's node range computed a second time is captured
//! into a CUDA graph and replayed with one launch from then on (`CudaPlan::replay`; not yet run
//! on a GPU, see docs/cuda.md).
//!
//! A kernel that finds a bad operand (an I32 row id outside its table) records it in a `Fault`
//! word in device memory; the range's synchronization reads it and the error names the node.

use super::device::{CudaBuffer, CudaDevice, driver_err};
pub use super::kernels::supports_node;
use super::kernels::{
    ATTN_BLOCK, Fault, GROUP_MIN_PAIRS_PER_EXPERT, Ids, MOE_CHUNK, MOE_MAX_EXPERTS, Tensor,
    gemm_input, gemv_kernel_for, gemv_q8a_kernel_for, no_kernels,
};
use super::libs::{Lib, missing, present};
use crate::DType;
use crate::alloc::GraphAllocator;
use crate::backend::{Backend, Device, GraphPlan, check_supported};
use crate::buffer::Buffer;
use crate::cpu::Precision;
use crate::graph::{Graph, TensorId};
use crate::op::{BinaryOp, Op, RopeMode, RopeParams, RowWindow, UnaryOp};
use crate::tensor::Layout;
use crate::{Error, Result};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result as cu, sys};
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

/// Threads per block of the element-wise and row kernels.
const BLOCK: u32 = 256;
/// Activation columns up to which products go through `k_mul_mat_vec` / `k_mul_mat_vec_<type>`.
const GEMV_MAX_M: usize = 8;

// A grouped `mul_mat_id`'s chunks run through the GEMV kernels.
const _: () = assert!(MOE_CHUNK <= GEMV_MAX_M);

/// A CUDA stream handle.
struct Stream(sys::CUstream);
// SAFETY: a stream handle may be used from any thread with the context current; the backend
// serializes its own launches (graph computes and plans are not run concurrently on one
// backend, by the `Backend` contract).
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

/// A cuBLAS handle bound to the stream.
struct Blas(blas_sys::cublasHandle_t);
// SAFETY: as for `Stream`.
unsafe impl Send for Blas {}
// SAFETY: as for `Stream`.
unsafe impl Sync for Blas {}

/// Device scratch memory for dense weights and packed activations; grows, never shrinks.
#[derive(Default)]
struct Scratch {
    ptr: u64,
    size: usize,
}

struct Inner {
    dev: CudaDevice,
    stream: Stream,
    blas: OnceLock<std::result::Result<Blas, String>>,
    /// Device address of one `Fault`.
    fault: u64,
    scratch: Mutex<Scratch>,
    /// The 8-bit activations of `Precision::Q8` products (`k_quantize_q8a`'s packed rows).
    q8: Mutex<Scratch>,
    /// CUDA graphs (`METASHARD_CUDA_GRAPHS=1`, see [`CudaPlan::compute`]); the stream is then
    /// non-blocking, so no other thread's copy on the legacy default stream joins a capture.
    graphs: bool,
    /// A prompt's `mul_mat_id` groups its pairs by expert (`mul_mat_id_grouped`); off with
    /// `METASHARD_CUDA_MOE_GROUPS=0`, for timing against the per-pair path.
    moe_groups: bool,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.dev.gpu.bind().is_ok() {
            // SAFETY: handles and memory owned by this backend, released once; the stream is
            // synchronized first so nothing in flight uses them.
            unsafe {
                let _ = cu::stream::synchronize(self.stream.0);
                if let Some(Ok(b)) = self.blas.get() {
                    let _ = blas::destroy_handle(b.0);
                }
                let _ = cu::free_sync(self.fault);
                for s in [self.scratch.get_mut(), self.q8.get_mut()] {
                    if s.size > 0 {
                        let _ = cu::free_sync(s.ptr);
                    }
                }
                let _ = cu::stream::destroy(self.stream.0);
            }
        }
    }
}

impl Inner {
    fn name(&self) -> String {
        self.dev.name()
    }

    fn err(&self, what: &str, e: cu::DriverError) -> Error {
        driver_err(&self.name(), what, e)
    }

    fn sync(&self) -> Result<()> {
        // SAFETY: this backend's stream.
        unsafe { cu::stream::synchronize(self.stream.0) }
            .map_err(|e| self.err("cuStreamSynchronize", e))
    }

    /// Launch kernel `name` on the stream with `args` (pointers to the argument values, which
    /// the driver copies at launch).
    fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            // Nothing to do (a `set_rows` of no rows, a soft-max of no rows): the driver
            // refuses an empty grid.
            return Ok(());
        }
        let f = self.dev.gpu.function(name)?;
        // SAFETY: `f` is a kernel of the loaded module; `args` point at values of the kernel's
        // parameter types (checked against kernels.cu by the argument structs' tests), alive
        // for the call; every tensor address was resolved from a live buffer of this GPU.
        unsafe { cu::launch_kernel(f, grid, block, shared, self.stream.0, args) }
            .map_err(|e| self.err(&format!("launching {name}"), e))
    }

    /// At least `bytes` of scratch; the stream is drained before the old block is freed.
    fn scratch(&self, bytes: usize) -> Result<u64> {
        self.grow(&self.scratch, bytes)
    }

    /// Where the scratch blocks are now (the dense one, the q8 one).
    fn scratch_at(&self) -> (u64, u64) {
        (self.scratch.lock().ptr, self.q8.lock().ptr)
    }

    /// At least `bytes` of the scratch block `slot`, as [`Inner::scratch`].
    fn grow(&self, slot: &Mutex<Scratch>, bytes: usize) -> Result<u64> {
        let mut s = slot.lock();
        if s.size < bytes {
            self.sync()?;
            if s.size > 0 {
                // SAFETY: allocated below by a previous call; nothing in flight uses it.
                unsafe { cu::free_sync(s.ptr) }.map_err(|e| self.err("cuMemFree", e))?;
                *s = Scratch::default();
            }
            let size = bytes.next_power_of_two();
            // SAFETY: the context is current (the caller bound it).
            let ptr = unsafe { cu::malloc_sync(size) }.map_err(|e| Error::Device {
                device: self.name(),
                reason: format!("cannot allocate {size} bytes of scratch memory: {e:?}"),
            })?;
            *s = Scratch { ptr, size };
        }
        Ok(s.ptr)
    }

    fn blas(&self) -> Result<blas_sys::cublasHandle_t> {
        let h = self.blas.get_or_init(|| {
            if !present(Lib::Cublas) {
                return Err(missing(Lib::Cublas));
            }
            let h = blas::create_handle().map_err(|e| format!("cublasCreate: {e:?}"))?;
            // SAFETY: a handle just created; the stream belongs to this backend and outlives it
            // (destroyed after the handle in Drop).
            unsafe { blas::set_stream(h, self.stream.0 as _) }
                .map_err(|e| format!("cublasSetStream: {e:?}"))?;
            Ok(Blas(h))
        });
        match h {
            Ok(b) => Ok(b.0),
            Err(e) => Err(Error::Device {
                device: self.name(),
                reason: e.clone(),
            }),
        }
    }
}

pub struct CudaBackend {
    inner: Arc<Inner>,
    alloc: Mutex<GraphAllocator>,
    /// With CUDA graphs: the last `graph_compute`'s plan, reused (with its captured graphs)
    /// when the next graph's plan launches the same kernels on the same addresses (a decoding
    /// step after another of the same shapes).
    last: Mutex<Option<CudaPlan>>,
}

impl CudaBackend {
    pub fn new(dev: CudaDevice) -> Result<CudaBackend> {
        dev.gpu.bind()?;
        let name = dev.name();
        let graphs = std::env::var("METASHARD_CUDA_GRAPHS").is_ok_and(|v| v == "1");
        let kind = if graphs {
            cu::stream::StreamKind::NonBlocking
        } else {
            cu::stream::StreamKind::Default
        };
        let stream =
            cu::stream::create(kind).map_err(|e| driver_err(&name, "cuStreamCreate", e))?;
        // SAFETY: the context is current.
        let fault = unsafe { cu::malloc_sync(std::mem::size_of::<Fault>()) }
            .map_err(|e| driver_err(&name, "cuMemAlloc", e))?;
        let bt = dev.buffer_type();
        Ok(CudaBackend {
            inner: Arc::new(Inner {
                dev,
                stream: Stream(stream),
                blas: OnceLock::new(),
                fault,
                scratch: Mutex::new(Scratch::default()),
                q8: Mutex::new(Scratch::default()),
                graphs,
                moe_groups: std::env::var("METASHARD_CUDA_MOE_GROUPS").map_or(true, |v| v != "0"),
            }),
            alloc: Mutex::new(GraphAllocator::new(bt)),
            last: Mutex::new(None),
        })
    }
}

/// Node `id` as kernels address it, or an error if its bytes are not on this GPU.
fn device_tensor(g: &Graph, id: TensorId, inner: &Inner) -> Result<Tensor> {
    let n = g.node(id);
    let st = g.storage(id).ok_or_else(|| Error::NoStorage {
        tensor: n.name.clone(),
        reason: "not allocated".into(),
    })?;
    let b = st
        .buffer
        .as_any()
        .downcast_ref::<CudaBuffer>()
        .filter(|b| b.gpu.ordinal == inner.dev.gpu.ordinal)
        .ok_or_else(|| Error::IncompatibleBuffer {
            backend: inner.name(),
            tensor: n.name.clone(),
            buffer_type: st.buffer.buffer_type().name(),
        })?;
    Tensor::new(b.ptr + st.offset as u64, &n.layout).ok_or_else(|| Error::UnsupportedOp {
        backend: inner.name(),
        op: n.op.name().to_string(),
        node: n.name.clone(),
        detail: no_kernels(&n.layout),
    })
}

/// One node ready to launch.
struct ExecNode {
    id: TensorId,
    /// For products: the computed node whose data the activations (src 1) view, `None` where
    /// they view a leaf (inputs, caches, which `set_rows` can rewrite within a graph). Keys the
    /// plan's reuse of quantized activations (`Q8Key`).
    x_base: Option<TensorId>,
    name: String,
    op: Op,
    dst: Tensor,
    dst_layout: Layout,
    src: SmallVec<[Tensor; 4]>,
    src_layouts: SmallVec<[Layout; 4]>,
}

/// Which activations the q8 scratch holds: the view (`Tensor`) of a computed node. Within one
/// `compute` range a node is written once, before its consumers, and its memory is not reused
/// while a consumer is pending, so products reading the same view (Q, K and V; gate and up)
/// quantize it once. Reset at the start of every range (the communicator writes between
/// ranges).
#[derive(Clone, Copy, PartialEq)]
struct Q8Key {
    base: TensorId,
    view: Tensor,
    at: u64,
}

/// A captured node range (`cuGraphInstantiate`), destroyed with its plan, and the addresses of
/// the backend's scratch blocks it was captured with (a block that grew since, for another
/// graph, moved: the capture is then stale).
struct GraphExec {
    exec: sys::CUgraphExec,
    scratch: (u64, u64),
}
// SAFETY: launched and destroyed by the plan's owner only (plans are computed by one thread
// at a time, by the `GraphPlan` contract).
unsafe impl Send for GraphExec {}
// SAFETY: as above.
unsafe impl Sync for GraphExec {}

/// What a plan knows of a node range under CUDA graphs.
enum Capture {
    /// Computed once by launches (so every scratch block has grown to its size): the next
    /// compute captures it.
    Seen,
    Exec(GraphExec),
    /// Not capturable (a cuBLAS product, or the capture failed): always launched.
    Refused,
}

struct CudaPlan {
    inner: Arc<Inner>,
    exec: Vec<ExecNode>,
    q8_key: Mutex<Option<Q8Key>>,
    /// Per node range (`exec` indices), under CUDA graphs.
    captures: Mutex<std::collections::HashMap<(usize, usize), Capture>>,
    /// Keeps every buffer the addresses point into alive while the plan exists.
    _buffers: Vec<Arc<dyn Buffer>>,
}

fn make_plan(inner: &Arc<Inner>, g: &Graph) -> Result<CudaPlan> {
    let name = inner.name();
    check_supported(g, &name, true, supports_node)?;
    let mut exec = Vec::new();
    let mut buffers: Vec<Arc<dyn Buffer>> = Vec::new();
    for id in g.ids() {
        let n = g.node(id);
        if let Some(st) = g.storage(id)
            && !buffers.iter().any(|b| Arc::ptr_eq(b, &st.buffer))
        {
            buffers.push(st.buffer);
        }
        if n.op.is_noop() || matches!(n.op, Op::Collective(_)) || n.layout.nelements() == 0 {
            continue;
        }
        let dst = device_tensor(g, id, inner)?;
        let src = n
            .src
            .iter()
            .map(|&s| device_tensor(g, s, inner))
            .collect::<Result<SmallVec<_>>>()?;
        let x_base = match n.op {
            Op::MulMat | Op::MulMatId { .. } => computed_base(g, n.src[1]),
            _ => None,
        };
        exec.push(ExecNode {
            id,
            x_base,
            name: n.name.clone(),
            op: n.op,
            dst,
            dst_layout: n.layout,
            src,
            src_layouts: n.src.iter().map(|&s| *g.layout(s)).collect(),
        });
    }
    Ok(CudaPlan {
        inner: inner.clone(),
        exec,
        q8_key: Mutex::new(None),
        captures: Mutex::new(std::collections::HashMap::new()),
        _buffers: buffers,
    })
}

/// The node whose data `id` views (through reshapes, views and permutations), if it is computed
/// (not a leaf).
fn computed_base(g: &Graph, mut id: TensorId) -> Option<TensorId> {
    loop {
        let n = g.node(id);
        match n.op {
            Op::Leaf => return None,
            Op::Reshape | Op::View { .. } | Op::Permute { .. } => id = n.src[0],
            _ => return Some(id),
        }
    }
}

/// A pointer to a kernel argument.
fn arg<T>(v: &T) -> *mut c_void {
    (v as *const T).cast_mut().cast()
}

/// Blocks for a grid-stride kernel over `n` items: at most 4096 (about four waves of resident
/// blocks on a 132-SM GPU); more only add launch and scheduling cost to a memory-bound loop.
fn blocks(n: usize) -> u32 {
    n.div_ceil(BLOCK as usize).clamp(1, 4096) as u32
}

fn nrows(t: &Tensor) -> usize {
    (t.ne[1] * t.ne[2] * t.ne[3]) as usize
}

impl CudaPlan {
    /// Launch node `e` (index `at` in the plan).
    fn run(&self, at: usize, e: &ExecNode) -> Result<()> {
        let inner = &self.inner;
        let one = (BLOCK, 1, 1);
        let n_dst = e.dst_layout.nelements();
        let (d, s) = (&e.dst, &e.src);
        match e.op {
            Op::Leaf | Op::Reshape | Op::View { .. } | Op::Permute { .. } | Op::Collective(_) => {
                Ok(())
            }
            Op::MulMatId { window } => self.mul_mat_id(at, e, window),
            Op::Argsort { descending } => {
                let desc = descending as i32;
                inner.launch(
                    "k_argsort",
                    (nrows(&s[0]) as u32, 1, 1),
                    one,
                    (s[0].ne[0] * 4) as u32,
                    &mut [arg(d), arg(&s[0]), arg(&desc)],
                )
            }
            Op::Cont | Op::Cpy => self.copy(e),
            Op::Concat { dim } => {
                let dim = dim as i32;
                inner.launch(
                    "k_concat",
                    (blocks(n_dst), 1, 1),
                    one,
                    0,
                    &mut [arg(d), arg(&s[0]), arg(&s[1]), arg(&dim)],
                )
            }
            Op::Binary(op) => {
                let code: i32 = match op {
                    BinaryOp::Add => 0,
                    BinaryOp::Sub => 1,
                    BinaryOp::Mul => 2,
                    BinaryOp::Div => 3,
                };
                inner.launch(
                    "k_binary",
                    (blocks(n_dst), 1, 1),
                    one,
                    0,
                    &mut [arg(d), arg(&s[0]), arg(&s[1]), arg(&code)],
                )
            }
            Op::Unary(_) | Op::Scale { .. } | Op::Clamp { .. } => self.unary(e),
            Op::Swiglu => {
                let (u, off) = match s.get(1) {
                    Some(u) => (*u, 0i64),
                    None => (s[0], d.ne[0]),
                };
                inner.launch(
                    "k_swiglu",
                    (blocks(n_dst), 1, 1),
                    one,
                    0,
                    &mut [arg(d), arg(&s[0]), arg(&u), arg(&off)],
                )
            }
            Op::RmsNorm { eps } | Op::Norm { eps } => {
                let mode: i32 = if matches!(e.op, Op::RmsNorm { .. }) {
                    0
                } else {
                    1
                };
                self.row_reduce(e, mode, eps)
            }
            Op::SumRows => self.row_reduce(e, 2, 0.0),
            Op::Mean => self.row_reduce(e, 3, 0.0),
            Op::SumSqrRows => self.row_reduce(e, 4, 0.0),
            Op::RmsNormSums { eps, width } => {
                let width = width as i64;
                inner.launch(
                    "k_rms_norm_sums",
                    (nrows(&s[0]) as u32, 1, 1),
                    one,
                    0,
                    &mut [
                        arg(d),
                        arg(&s[0]),
                        arg(&s[1]),
                        arg(&s[2]),
                        arg(&eps),
                        arg(&width),
                    ],
                )
            }
            Op::SoftMax { scale } => {
                let (mask, has) = match s.get(1) {
                    Some(m) => (*m, 1i32),
                    None => (Tensor::none(), 0),
                };
                inner.launch(
                    "k_soft_max",
                    (nrows(&s[0]) as u32, 1, 1),
                    one,
                    0,
                    &mut [arg(d), arg(&s[0]), arg(&mask), arg(&has), arg(&scale)],
                )
            }
            Op::Argmax => inner.launch(
                "k_argmax",
                (s[0].ne[1] as u32, 1, 1),
                one,
                0,
                &mut [arg(d), arg(&s[0])],
            ),
            Op::Rope(rp) => self.rope(e, &rp),
            Op::GetRows { window } => {
                self.rows(at, e, window, ("k_get_rows", nrows(d), s[0], s[1]))
            }
            Op::SetRows { window } => {
                self.rows(at, e, window, ("k_set_rows", nrows(&s[1]), s[1], s[2]))
            }
            Op::MulMat => self.mul_mat(at, e),
            Op::FlashAttn { scale } => self.flash_attn(e, scale),
        }
    }

    /// `cont` / `cpy`: rows of one quantized type copied as bytes, float sources quantized into
    /// a quantized destination block by block (`k_quantize`, `k_quantize_qk`), anything else
    /// converted element by element.
    fn copy(&self, e: &ExecNode) -> Result<()> {
        let (inner, one) = (&self.inner, (BLOCK, 1, 1));
        let (d, s) = (&e.dst, &e.src);
        let n_dst = e.dst_layout.nelements();
        let sl = &e.src_layouts[0];
        let dl = &e.dst_layout;
        if sl.dtype.is_quantized() && sl.dtype == dl.dtype {
            let row = sl.dtype.row_size(sl.ne[0]) as i64;
            let n = nrows(d) * row as usize;
            inner.launch(
                "k_cpy_rows_bytes",
                (blocks(n), 1, 1),
                one,
                0,
                &mut [arg(d), arg(&s[0]), arg(&row)],
            )
        } else if dl.dtype.is_quantized() {
            // One thread per destination block: of 32 (`k_quantize`) or of 256, the K-quants'
            // and IQ4_XS's super-blocks with their scale searches (`k_quantize_qk`).
            let bs = dl.dtype.block_size();
            let n = nrows(d) * (dl.ne[0] / bs);
            inner.launch(
                if bs == 256 {
                    "k_quantize_qk"
                } else {
                    "k_quantize"
                },
                (blocks(n), 1, 1),
                one,
                0,
                &mut [arg(d), arg(&s[0])],
            )
        } else {
            inner.launch(
                "k_cpy",
                (blocks(n_dst), 1, 1),
                one,
                0,
                &mut [arg(d), arg(&s[0])],
            )
        }
    }

    /// Unary functions, `scale` and `clamp`: one kernel with an op code and two parameters.
    fn unary(&self, e: &ExecNode) -> Result<()> {
        let (d, s) = (&e.dst, &e.src);
        let (code, p0, p1): (i32, f32, f32) = match e.op {
            Op::Unary(UnaryOp::Silu) => (0, 0.0, 0.0),
            Op::Unary(UnaryOp::Gelu) => (1, 0.0, 0.0),
            Op::Unary(UnaryOp::GeluErf) => (2, 0.0, 0.0),
            Op::Unary(UnaryOp::Relu) => (3, 0.0, 0.0),
            Op::Unary(UnaryOp::Tanh) => (4, 0.0, 0.0),
            Op::Unary(UnaryOp::Sigmoid) => (7, 0.0, 0.0),
            Op::Scale { scale, bias } => (5, scale, bias),
            Op::Clamp { min, max } => (6, min, max),
            _ => unreachable!("called for unary, scale and clamp only"),
        };
        self.inner.launch(
            "k_unary",
            (blocks(e.dst_layout.nelements()), 1, 1),
            (BLOCK, 1, 1),
            0,
            &mut [arg(d), arg(&s[0]), arg(&code), arg(&p0), arg(&p1)],
        )
    }

    /// `rope` over the rotated pairs (and the copied tail) of every row.
    fn rope(&self, e: &ExecNode, rp: &RopeParams) -> Result<()> {
        let (d, s) = (&e.dst, &e.src);
        let mode: i32 = match rp.mode {
            RopeMode::Normal => 0,
            RopeMode::NeoX => 1,
        };
        let n_dims = rp.n_dims as i32;
        let half = rp.n_dims / 2;
        let per_row = half + (s[0].ne[0] as usize - 2 * half);
        let n = nrows(&s[0]) * per_row;
        // Frequency factors, when the node has them (the input stands in otherwise, unread).
        let (factors, has_factors) = match s.get(2) {
            Some(f) => (f, 1i32),
            None => (&s[0], 0i32),
        };
        self.inner.launch(
            "k_rope",
            (blocks(n), 1, 1),
            (BLOCK, 1, 1),
            0,
            &mut [
                arg(d),
                arg(&s[0]),
                arg(&s[1]),
                arg(&mode),
                arg(&n_dims),
                arg(&rp.freq_base),
                arg(&rp.freq_scale),
                arg(factors),
                arg(&has_factors),
            ],
        )
    }

    /// `get_rows` / `set_rows` of node `at` (`kernel` over `grid` rows of `table` picked by
    /// `ids`), with its row window; a bad id is reported through the fault record.
    fn rows(
        &self,
        at: usize,
        e: &ExecNode,
        window: Option<RowWindow>,
        (kernel, grid, table, ids): (&str, usize, Tensor, Tensor),
    ) -> Result<()> {
        let (inner, d) = (&self.inner, &e.dst);
        let (rows, lo, hi, wat) = window.map_or((0i64, 0i64, 0i64, 0i64), |w| {
            (w.rows as i64, w.lo as i64, w.hi as i64, w.at as i64)
        });
        let node = at as i32;
        inner.launch(
            kernel,
            (grid as u32, 1, 1),
            (BLOCK, 1, 1),
            0,
            &mut [
                arg(d),
                arg(&table),
                arg(&ids),
                arg(&rows),
                arg(&lo),
                arg(&hi),
                arg(&wat),
                arg(&inner.fault),
                arg(&node),
            ],
        )
    }

    /// Fused attention: one block per (query row, head, batch).
    fn flash_attn(&self, e: &ExecNode, scale: f32) -> Result<()> {
        let (d, s) = (&e.dst, &e.src);
        let (q, k, v) = (s[0], s[1], s[2]);
        let (mask, has) = match s.get(3) {
            Some(m) => (*m, 1i32),
            None => (Tensor::none(), 0),
        };
        let shared = ((q.ne[0] as u32) + 2 * ATTN_BLOCK) * 4;
        self.inner.launch(
            "k_flash_attn",
            (q.ne[1] as u32, q.ne[2] as u32, q.ne[3] as u32),
            (ATTN_BLOCK, 1, 1),
            shared,
            &mut [
                arg(d),
                arg(&q),
                arg(&k),
                arg(&v),
                arg(&mask),
                arg(&has),
                arg(&scale),
            ],
        )
    }

    fn row_reduce(&self, e: &ExecNode, mode: i32, eps: f32) -> Result<()> {
        self.inner.launch(
            "k_row_reduce",
            (nrows(&e.src[0]) as u32, 1, 1),
            (BLOCK, 1, 1),
            0,
            &mut [arg(&e.dst), arg(&e.src[0]), arg(&mode), arg(&eps)],
        )
    }

    /// A GEMV kernel of node `at`: one warp per weight row (`n` rows), `batches` batches
    /// spread over grid.y and grid.z (each at most 65535); `ids` is `Ids::none()` except for
    /// `mul_mat_id`.
    fn gemv(
        &self,
        at: usize,
        kernel: &str,
        n: usize,
        batches: usize,
        (d, w, x, ids): (&Tensor, &Tensor, &Tensor, &Ids),
        xq: Option<u64>,
    ) -> Result<()> {
        let warps = (BLOCK / 32) as usize;
        let y = batches.clamp(1, 65535);
        let z = batches.div_ceil(y);
        let node = at as i32;
        let mut args: SmallVec<[*mut c_void; 7]> = SmallVec::new();
        args.extend([
            arg(d),
            arg(w),
            arg(x),
            arg(ids),
            arg(&self.inner.fault),
            arg(&node),
        ]);
        if let Some(q) = &xq {
            args.push(arg(q));
        }
        self.inner.launch(
            kernel,
            (n.div_ceil(warps) as u32, y as u32, z as u32),
            (BLOCK, 1, 1),
            0,
            &mut args,
        )
    }

    /// The q8 GEMV kernel for weights of `wt` with `m` activation rows of `k` values, where this
    /// device computes at `Precision::Q8` and `gemv_q8a` has the type.
    fn q8a_kernel(&self, wt: DType, k: usize, m: usize) -> Option<&'static str> {
        if self.inner.dev.precision != Precision::Q8 || !k.is_multiple_of(32) {
            return None;
        }
        gemv_q8a_kernel_for(wt, m)
    }

    /// The activations `x` (node `e`'s view of its src 1) quantized to 8 bits in the q8 scratch
    /// (`k_quantize_q8a`), or the scratch as it is where it already holds them (`Q8Key`); its
    /// device address.
    fn quantize_q8a(&self, e: &ExecNode, x: &Tensor) -> Result<u64> {
        let mut held = self.q8_key.lock();
        if let (Some(base), Some(h)) = (e.x_base, *held)
            && h.base == base
            && h.view == *x
        {
            return Ok(h.at);
        }
        let at = self.quantize_q8a_rows(x)?;
        *held = e.x_base.map(|base| Q8Key { base, view: *x, at });
        Ok(at)
    }

    /// `x`'s rows quantized to 8 bits in the q8 scratch (`k_quantize_q8a`), whatever it held
    /// (the caller keeps or clears `q8_key`); its device address.
    fn quantize_q8a_rows(&self, x: &Tensor) -> Result<u64> {
        let inner = &self.inner;
        let k = x.ne[0] as usize;
        let rows = nrows(x);
        let at = inner.grow(&inner.q8, rows * (k + k / 8))?;
        let warps = rows * (k / 32);
        let grid = (warps * 32).div_ceil(BLOCK as usize) as u32;
        inner.launch(
            "k_quantize_q8a",
            (grid, 1, 1),
            (BLOCK, 1, 1),
            0,
            &mut [arg(x), arg(&at)],
        )?;
        Ok(at)
    }

    /// The GEMV kernel of a `mul_mat_id` node's expert weights for `m` activation rows: the
    /// 8-bit one where this device computes at `Precision::Q8` (`Some` in the first place),
    /// else the f32 one; an error naming the node where the type has neither.
    fn expert_kernel(
        &self,
        e: &ExecNode,
        m: usize,
    ) -> Result<(Option<&'static str>, &'static str)> {
        let wt = e.src_layouts[0].dtype;
        let q8 = self.q8a_kernel(wt, e.src[0].ne[0] as usize, m);
        let kernel = q8
            .or_else(|| gemv_kernel_for(wt, m))
            .ok_or_else(|| Error::UnsupportedOp {
                backend: self.inner.name(),
                op: e.op.name().to_string(),
                node: e.name.clone(),
                detail: format!("expert weights of dtype {wt} are not supported"),
            })?;
        Ok((q8, kernel))
    }

    /// A `mul_mat_id` node's activations and output viewed per (slot, token) pair, `[K, 1,
    /// n_used, n_tokens]` and `[N, 1, n_used, n_tokens]` (column e % n_b of the activations by a
    /// zero stride when n_b is 1); with a `window`, the output zeroed first (the pairs of
    /// experts held elsewhere stay 0).
    fn pair_views(&self, e: &ExecNode, window: Option<RowWindow>) -> Result<(Tensor, Tensor)> {
        let (b, ids) = (&e.src[1], &e.src[2]);
        let (n_used, n_tokens) = (ids.ne[0], ids.ne[1]);
        let mut x = *b;
        x.ne = [b.ne[0], 1, n_used, n_tokens];
        x.nb = [
            b.nb[0],
            b.nb[1],
            if b.ne[1] == 1 { 0 } else { b.nb[1] },
            b.nb[2],
        ];
        let mut d = e.dst;
        d.ne = [d.ne[0], 1, n_used, n_tokens];
        d.nb = [d.nb[0], d.nb[1], d.nb[1], d.nb[2]];
        if window.is_some() {
            let bytes = e.dst_layout.nelements() * 4;
            // SAFETY: the output node is packed (supports_node), `bytes` long on this GPU;
            // ordered on this backend's stream before the products.
            unsafe { cu::memset_d8_async(e.dst.ptr, 0, bytes, self.inner.stream.0) }
                .map_err(|err| self.inner.err("cuMemsetD8Async", err))?;
        }
        Ok((x, d))
    }

    /// ggml `mul_mat_id`, `out[:, e, t] = experts[:, :, ids[e, t]] · b[:, e % n_b, t]`: the
    /// GEMV kernels with the ids, one activation row per batch (e, t). The activations and the
    /// output are viewed as [K, 1, n_used, n_tokens] and [N, 1, n_used, n_tokens] (column
    /// e % n_b by a zero stride when n_b is 1; supports_node admits n_b of 1 or n_used). Each
    /// (e, t) streams its expert's weights: a decoding step reads each selected expert once; with
    /// several tokens and at least [`GROUP_MIN_PAIRS_PER_EXPERT`] pairs per expert held (a
    /// prompt) the pairs go through [`Self::mul_mat_id_grouped`] instead. With a
    /// window (a device's share of experts split whole), the output is zeroed first and only
    /// the rows of ids in the window are computed.
    fn mul_mat_id(&self, at: usize, e: &ExecNode, window: Option<RowWindow>) -> Result<()> {
        let (w, ids) = (&e.src[0], &e.src[2]);
        let (n_used, n_tokens) = (ids.ne[0], ids.ne[1]);
        let held = window.unwrap_or(RowWindow::whole(w.ne[2] as usize));
        let pairs = (n_used * n_tokens) as usize;
        if self.inner.moe_groups
            && n_tokens > 1
            && held.rows <= MOE_MAX_EXPERTS
            && pairs >= GROUP_MIN_PAIRS_PER_EXPERT * held.len().max(1)
        {
            return self.mul_mat_id_grouped(at, e, window, held);
        }
        let (q8, kernel) = self.expert_kernel(e, 1)?;
        let (x, d) = self.pair_views(e, window)?;
        let mut with = Ids {
            t: *ids,
            ..Ids::default()
        };
        if let Some(win) = window {
            [with.rows, with.lo, with.hi, with.at] =
                [win.rows, win.lo, win.hi, win.at].map(|v| v as i64);
        }
        let xq = match q8 {
            Some(_) => Some(self.quantize_q8a(e, &x)?),
            None => None,
        };
        self.gemv(at, kernel, w.ne[1] as usize, pairs, (&d, w, &x, &with), xq)
    }

    /// [`Self::mul_mat_id`] with the (slot, token) pairs grouped by expert (a prompt's): the
    /// pairs counted and sorted by expert on the device (`k_moe_group`, chunks of up to 8
    /// pairs of one expert), each chunk's activation rows packed (`k_moe_gather`), the 8-row
    /// GEMV over the chunks with each chunk's expert as its id (so each expert's weights are
    /// read once per 8 pairs, not once per pair), and the products put back at their pairs
    /// (`k_moe_scatter`). `held`: the experts this device holds (all of them without a
    /// window). Each pair's product is the per-pair path's, in the same order.
    fn mul_mat_id_grouped(
        &self,
        at: usize,
        e: &ExecNode,
        window: Option<RowWindow>,
        held: RowWindow,
    ) -> Result<()> {
        let inner = &self.inner;
        let (w, ids) = (&e.src[0], &e.src[2]);
        let (k, n) = (w.ne[0] as usize, w.ne[1] as usize);
        let (q8, kernel) = self.expert_kernel(e, MOE_CHUNK)?;
        let (n_used, n_tokens) = (ids.ne[0], ids.ne[1]);
        let pairs = (n_used * n_tokens) as usize;
        // At most one partly filled chunk per expert held.
        let chunks = pairs.div_ceil(MOE_CHUNK) + held.len().min(pairs);
        if chunks > 65535 * 65535 {
            return Err(Error::invalid_op(
                "mul_mat_id",
                format!("{pairs} (slot, token) pairs are more than one launch can group"),
            ));
        }
        // Scratch: order (pairs), chunk ids, starts and lengths (chunks each, i32), then the
        // packed activations [K, 8, chunks] and products [N, 8, chunks] (f32, 16-byte aligned).
        let ints = (pairs + 3 * chunks).next_multiple_of(4) * 4;
        let (xs_bytes, ds_bytes) = (k * MOE_CHUNK * chunks * 4, n * MOE_CHUNK * chunks * 4);
        let base = inner.scratch(ints + xs_bytes + ds_bytes)?;
        let order = base;
        let chunk_id = order + (pairs * 4) as u64;
        let chunk_start = chunk_id + (chunks * 4) as u64;
        let chunk_len = chunk_start + (chunks * 4) as u64;
        let packed = |ptr: u64, ne0: usize| Tensor {
            ptr,
            ne: [ne0 as i64, MOE_CHUNK as i64, chunks as i64, 1],
            nb: [
                4,
                4 * ne0 as i64,
                (4 * ne0 * MOE_CHUNK) as i64,
                (4 * ne0 * MOE_CHUNK * chunks) as i64,
            ],
            dtype: 0,
            pad: 0,
        };
        let xs = packed(base + ints as u64, k);
        let ds = packed(xs.ptr + xs_bytes as u64, n);
        let (x, d) = self.pair_views(e, window)?;
        let node = at as i32;
        let [rows, lo, hi, local] = [held.rows, held.lo, held.hi, held.at].map(|v| v as i64);
        let max_chunks = chunks as i64;
        inner.launch(
            "k_moe_group",
            (1, 1, 1),
            (1024, 1, 1),
            0,
            &mut [
                arg(ids),
                arg(&rows),
                arg(&lo),
                arg(&hi),
                arg(&order),
                arg(&chunk_id),
                arg(&chunk_start),
                arg(&chunk_len),
                arg(&max_chunks),
                arg(&inner.fault),
                arg(&node),
            ],
        )?;
        inner.launch(
            "k_moe_gather",
            (blocks(k * MOE_CHUNK * chunks), 1, 1),
            (BLOCK, 1, 1),
            0,
            &mut [
                arg(&xs),
                arg(&x),
                arg(&order),
                arg(&chunk_start),
                arg(&chunk_len),
            ],
        )?;
        // Each chunk's expert: ids [chunks] (I32); an unused chunk's id is `rows`, which the
        // window below leaves out. The window is `rows + 1` wide so that id is in range.
        let chunk_ids = Ids {
            t: Tensor {
                ptr: chunk_id,
                ne: [chunks as i64, 1, 1, 1],
                nb: [4, 4 * chunks as i64, 4 * chunks as i64, 4 * chunks as i64],
                dtype: 3,
                pad: 0,
            },
            rows: rows + 1,
            lo,
            hi,
            at: local,
        };
        let xq = match q8 {
            Some(_) => {
                let q = self.quantize_q8a_rows(&xs)?;
                // The q8 scratch now holds the gathered rows, not what the key names.
                *self.q8_key.lock() = None;
                Some(q)
            }
            None => None,
        };
        self.gemv(at, kernel, n, chunks, (&ds, w, &xs, &chunk_ids), xq)?;
        inner.launch(
            "k_moe_scatter",
            (blocks(n * MOE_CHUNK * chunks), 1, 1),
            (BLOCK, 1, 1),
            0,
            &mut [
                arg(&d),
                arg(&ds),
                arg(&order),
                arg(&chunk_start),
                arg(&chunk_len),
            ],
        )
    }

    /// `dst [N, M, b2, b3] = w [K, N, w2, w3] x [K, M, b2, b3]` (each output a dot product of
    /// a weight row and an activation row).
    fn mul_mat(&self, at: usize, e: &ExecNode) -> Result<()> {
        let inner = &self.inner;
        let (d, w, x) = (&e.dst, &e.src[0], &e.src[1]);
        let (k, n, m) = (w.ne[0] as usize, w.ne[1] as usize, x.ne[1] as usize);
        let (b2, b3) = (x.ne[2] as usize, x.ne[3] as usize);
        if m <= GEMV_MAX_M {
            let wt = e.src_layouts[0].dtype;
            if let Some(kernel) = self.q8a_kernel(wt, k, m) {
                let xq = self.quantize_q8a(e, x)?;
                return self.gemv(at, kernel, n, b2 * b3, (d, w, x, &Ids::none()), Some(xq));
            }
            let Some(kernel) = gemv_kernel_for(wt, m) else {
                return Err(Error::UnsupportedOp {
                    backend: inner.name(),
                    op: e.op.name().to_string(),
                    node: e.name.clone(),
                    detail: format!("weights of dtype {wt} are not supported"),
                });
            };
            return self.gemv(at, kernel, n, b2 * b3, (d, w, x, &Ids::none()), None);
        }
        if k == 0 {
            // An empty contraction (a device's share of K split at whole blocks can be none):
            // zeros, which cuBLAS refuses to compute (a leading dimension of 0).
            // SAFETY: the output node is packed (supports_node), `nelements * 4` bytes on this
            // GPU; ordered on this backend's stream.
            return unsafe {
                cu::memset_d8_async(d.ptr, 0, e.dst_layout.nelements() * 4, inner.stream.0)
            }
            .map_err(|err| inner.err("cuMemsetD8Async", err));
        }
        // F16 and BF16 weights multiply on tensor cores: the activations are rounded to the
        // weight's type (as ggml's CUDA backend does), products accumulate in f32. Other
        // weights are expanded to f32 and multiplied in f32. Weights already packed in their
        // own 16-bit type are read in place.
        let wl = &e.src_layouts[0];
        let Some((esz, code, cu_type)) = gemm_input(wl.dtype) else {
            return Err(Error::UnsupportedOp {
                backend: inner.name(),
                op: e.op.name().to_string(),
                node: e.name.clone(),
                detail: format!("weights of dtype {} are not supported", wl.dtype),
            });
        };
        let half = esz == 2;
        let (w2, w3) = (w.ne[2] as usize, w.ne[3] as usize);
        let w_in_place = half && wl.nb[0] == 2 && wl.nb[1].is_multiple_of(2) && wl.nb[1] / 2 >= k;
        let w_elems = if w_in_place { 0 } else { k * n * w2 * w3 };
        let x_elems = k * m * b2 * b3;
        let base = inner.scratch((w_elems + x_elems) * esz)?;
        let x_dense = base + (w_elems * esz) as u64;
        if !w_in_place {
            inner.launch(
                "k_to_dense",
                (blocks(w_elems), 1, 1),
                (BLOCK, 1, 1),
                0,
                &mut [arg(&base), arg(&code), arg(w)],
            )?;
        }
        // Weight matrix (j2, j3) and its leading dimension, in elements.
        let lda = if w_in_place { wl.nb[1] / 2 } else { k };
        let (nb2, nb3) = (wl.nb[2], wl.nb[3]);
        let a_at = |j2: usize, j3: usize| {
            if w_in_place {
                w.ptr + (j2 * nb2 + j3 * nb3) as u64
            } else {
                base + (((j3 * w2 + j2) * k * n) * esz) as u64
            }
        };
        let xl = &e.src_layouts[1];
        let x_ptr = if !half && xl.is_contiguous() {
            x.ptr
        } else {
            inner.launch(
                "k_to_dense",
                (blocks(x_elems), 1, 1),
                (BLOCK, 1, 1),
                0,
                &mut [arg(&x_dense), arg(&code), arg(x)],
            )?;
            x_dense
        };
        let h = inner.blas()?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        for i3 in 0..b3 {
            for i2 in 0..b2 {
                let (j2, j3) = (i2 / (b2 / w2), i3 / (b3 / w3));
                let a = a_at(j2, j3);
                let bp = x_ptr + (((i3 * b2 + i2) * k * m) * esz) as u64;
                let c = d.ptr + (((i3 * b2 + i2) * n * m) * 4) as u64;
                // Column-major: C (N x M) = A^T (N x K) B (K x M), A = the weight rows (K x N).
                // SAFETY: the three matrices lie inside scratch, the weight tensor and the
                // output node (sizes from the checked layouts); the handle is bound to this
                // backend's stream.
                unsafe {
                    blas::gemm_ex(
                        h,
                        blas_sys::cublasOperation_t::CUBLAS_OP_T,
                        blas_sys::cublasOperation_t::CUBLAS_OP_N,
                        n as i32,
                        m as i32,
                        k as i32,
                        arg(&alpha),
                        a as *const c_void,
                        cu_type,
                        lda as i32,
                        bp as *const c_void,
                        cu_type,
                        k as i32,
                        arg(&beta),
                        c as *mut c_void,
                        blas_sys::cudaDataType::CUDA_R_32F,
                        n as i32,
                        blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(|err| Error::Device {
                    device: inner.name(),
                    reason: format!("cublasGemmEx at node `{}`: {err:?}", e.name),
                })?;
            }
        }
        Ok(())
    }
}

impl CudaPlan {
    /// Launch nodes `lo..hi` one kernel each (no activations quantized yet: a failed capture
    /// may have recorded some that never ran).
    fn launch_range(&self, lo: usize, hi: usize) -> Result<()> {
        *self.q8_key.lock() = None;
        for i in lo..hi {
            let e = &self.exec[i];
            self.run(i, e).map_err(|err| match err {
                Error::Device { device, reason } => Error::Device {
                    device,
                    reason: format!("{reason} (node `{}`, {})", e.name, e.op.name()),
                },
                other => other,
            })?;
        }
        Ok(())
    }

    /// CUDA graphs: launch nodes `lo..hi` as one captured graph when this plan computed them
    /// before (capturing them the second time); false where they must be launched node by
    /// node (the first time; ranges with a cuBLAS product, whose workspace and handle are not
    /// captured; a capture that failed). A decoding step's graph repeats with the same shapes
    /// and addresses for many steps (the KV length padded), so its ranges replay in one
    /// `cuGraphLaunch` each instead of one launch per node.
    fn replay(&self, lo: usize, hi: usize) -> Result<bool> {
        let inner = &self.inner;
        let mut caps = self.captures.lock();
        let Some(state) = caps.get_mut(&(lo, hi)) else {
            let cublas = self.exec[lo..hi].iter().any(|e| {
                matches!(e.op, Op::MulMat)
                    && e.src[1].ne[1] as usize > GEMV_MAX_M
                    && e.src[0].ne[0] > 0
            });
            let first = if cublas {
                Capture::Refused
            } else {
                Capture::Seen
            };
            caps.insert((lo, hi), first);
            return Ok(false);
        };
        if let Capture::Exec(g) = state
            && g.scratch != inner.scratch_at()
        {
            // SAFETY: instantiated by this plan; the stream drained after its last launch.
            unsafe {
                let _ = cu::graph::exec_destroy(g.exec);
            }
            *state = Capture::Seen;
        }
        match state {
            Capture::Refused => return Ok(false),
            Capture::Exec(_) => {}
            Capture::Seen => match self.capture(lo, hi) {
                Ok(g) => *state = Capture::Exec(g),
                Err(e) => {
                    tracing::warn!(device = %inner.name(), error = %e, "CUDA graph capture failed; launching node by node");
                    *state = Capture::Refused;
                    return Ok(false);
                }
            },
        }
        let Capture::Exec(g) = state else {
            unreachable!()
        };
        // SAFETY: a graph instantiated from this plan's launches, whose addresses its buffers
        // keep alive; on this backend's stream.
        unsafe { cu::graph::launch(g.exec, inner.stream.0) }
            .map_err(|e| inner.err("cuGraphLaunch", e))?;
        Ok(true)
    }

    /// Capture nodes `lo..hi` into an instantiated graph (nothing runs).
    fn capture(&self, lo: usize, hi: usize) -> Result<GraphExec> {
        let inner = &self.inner;
        let stream = inner.stream.0;
        // Thread-local mode: other threads (the meta backend's other devices) may copy on the
        // legacy stream meanwhile; this stream is non-blocking, so they do not join it.
        // SAFETY: this backend's stream, idle at the start of a range.
        unsafe {
            cu::stream::begin_capture(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(|e| inner.err("cuStreamBeginCapture", e))?;
        let launched = self.launch_range(lo, hi);
        // SAFETY: ends the capture begun above, whatever the launches did.
        let graph = unsafe { cu::stream::end_capture(stream) };
        if let Err(e) = launched {
            if let Ok(g) = graph {
                // SAFETY: a graph just captured, not instantiated.
                unsafe {
                    let _ = cu::graph::destroy(g);
                }
            }
            return Err(e);
        }
        let graph = graph.map_err(|e| inner.err("cuStreamEndCapture", e))?;
        // SAFETY: a graph just captured; destroyed once instantiated (the instance is
        // independent of it).
        let exec = unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
        // SAFETY: as above.
        unsafe {
            let _ = cu::graph::destroy(graph);
        }
        Ok(GraphExec {
            exec: exec.map_err(|e| inner.err("cuGraphInstantiate", e))?,
            scratch: inner.scratch_at(),
        })
    }

    /// Whether `other` launches the same kernels on the same addresses as this plan.
    fn same_launches(&self, other: &CudaPlan) -> bool {
        self.exec.len() == other.exec.len()
            && self.exec.iter().zip(&other.exec).all(|(a, b)| {
                a.op == b.op && a.dst == b.dst && a.src == b.src && a.x_base == b.x_base
            })
    }
}

impl Drop for CudaPlan {
    fn drop(&mut self) {
        let caps = self.captures.get_mut();
        if caps.is_empty() || self.inner.dev.gpu.bind().is_err() {
            return;
        }
        for c in caps.values() {
            if let Capture::Exec(g) = c {
                // SAFETY: instantiated by this plan, destroyed once; the stream drained at the
                // end of the range that launched it.
                unsafe {
                    let _ = cu::graph::exec_destroy(g.exec);
                }
            }
        }
    }
}

impl GraphPlan for CudaPlan {
    fn compute(&mut self, range: std::ops::Range<usize>) -> Result<()> {
        let lo = self.exec.partition_point(|e| e.id.index() < range.start);
        let hi = self.exec.partition_point(|e| e.id.index() < range.end);
        if lo == hi {
            return Ok(());
        }
        let inner = &self.inner;
        inner.dev.gpu.bind()?;
        // SAFETY: the fault word belongs to this backend; ordered on its stream.
        unsafe {
            cu::memset_d8_async(inner.fault, 0, std::mem::size_of::<Fault>(), inner.stream.0)
        }
        .map_err(|e| inner.err("cuMemsetD8Async", e))?;
        if !(inner.graphs && self.replay(lo, hi)?) {
            self.launch_range(lo, hi)?;
        }
        inner.sync()?;
        let mut f = [Fault::default()];
        // SAFETY: reads the backend's fault word after the stream drained.
        unsafe { cu::memcpy_dtoh_sync(&mut f, inner.fault) }
            .map_err(|e| inner.err("cuMemcpyDtoH", e))?;
        let f = f[0];
        if f.flag != 0 {
            let e = self.exec.get(f.node.max(0) as usize);
            return Err(Error::RowIdOutOfRange {
                device: inner.name(),
                node: e.map_or_else(|| "?".into(), |e| e.name.clone()),
                op: e.map_or("?", |e| e.op.name()),
                id: f.id,
                index: f.at.map(|v| v.max(0) as usize),
                rows: f.rows.max(0) as usize,
            });
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn device(&self) -> Arc<dyn Device> {
        Arc::new(self.inner.dev.clone())
    }

    fn synchronize(&self) -> Result<()> {
        self.inner.dev.gpu.bind()?;
        self.inner.sync()
    }

    fn graph_compute(&self, g: &mut Graph) -> Result<()> {
        check_supported(g, &self.name(), false, supports_node)?;
        self.inner.dev.gpu.bind()?;
        let mut alloc = self.alloc.lock();
        alloc.alloc_graph(g)?;
        for n in g.nodes() {
            if let (Some(data), Some(st)) = (&n.data, &n.storage) {
                st.set(&n.layout, data)?;
            }
        }
        let mut plan = make_plan(&self.inner, g)?;
        if !self.inner.graphs {
            return plan.compute(0..g.len());
        }
        // CUDA graphs: reuse the last plan (and what it captured) when this one launches the
        // same kernels on the same addresses, keeping the new plan's buffers alive.
        let mut last = self.last.lock();
        match last.as_mut() {
            Some(old) if old.same_launches(&plan) => {
                old._buffers = std::mem::take(&mut plan._buffers);
            }
            _ => *last = Some(plan),
        }
        let plan = last.as_mut().expect("set above");
        plan.compute(0..g.len())
    }

    fn compute_buffer_bytes(&self) -> Vec<usize> {
        vec![self.alloc.lock().buffer_size()]
    }

    fn graph_plan(&self, g: &Graph) -> Result<Box<dyn GraphPlan>> {
        Ok(Box::new(make_plan(&self.inner, g)?))
    }
}
