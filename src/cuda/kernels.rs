//! The CUDA kernels (`kernels.cu`, and `kernels_qx.cu` for the weight types after Q4_1), their
//! argument types, what they take (the dtype codes they dispatch on, `kernels_for`, and the
//! nodes they compute, `supports_node`) and their compilation by NVRTC: once per process and
//! compute capability, to PTX for the virtual architecture `compute_XY`, which the driver turns
//! into machine code for the GPU when the module is loaded.

use super::libs::{Lib, missing, present};
use crate::graph::{Graph, TensorId};
use crate::op::Op;
use crate::tensor::Layout;
use crate::{DType, Error, Result};
use cudarc::cublas::sys as blas_sys;
use smallvec::SmallVec;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The kernel source: `kernels.cu`, then the weight types after Q4_1 (`kernels_qx.cu`).
pub const SOURCE: &str = concat!(include_str!("kernels.cu"), include_str!("kernels_qx.cu"));

/// Every kernel the backend launches, by its `extern "C"` name.
pub const KERNELS: &[&str] = &[
    "k_cpy",
    "k_cpy_rows_bytes",
    "k_quantize",
    "k_quantize_qk",
    "k_concat",
    "k_binary",
    "k_unary",
    "k_swiglu",
    "k_row_reduce",
    "k_rms_norm_sums",
    "k_soft_max",
    "k_argmax",
    "k_rope",
    "k_get_rows",
    "k_set_rows",
    "k_mul_mat_vec",
    "k_mul_mat_vec_q8_0",
    "k_mul_mat_vec_q4_0",
    "k_mul_mat_vec_q4_1",
    "k_mul_mat_vec_q5_0",
    "k_mul_mat_vec_q5_1",
    "k_mul_mat_vec_q2_k",
    "k_mul_mat_vec_q3_k",
    "k_mul_mat_vec_q4_k",
    "k_mul_mat_vec_q5_k",
    "k_mul_mat_vec_q6_k",
    "k_mul_mat_vec_iq4_nl",
    "k_mul_mat_vec_iq4_xs",
    "k_mul_mat_vec_q8_0_m1",
    "k_mul_mat_vec_q4_0_m1",
    "k_mul_mat_vec_q4_1_m1",
    "k_mul_mat_vec_q5_0_m1",
    "k_mul_mat_vec_q5_1_m1",
    "k_mul_mat_vec_q2_k_m1",
    "k_mul_mat_vec_q3_k_m1",
    "k_mul_mat_vec_q4_k_m1",
    "k_mul_mat_vec_q5_k_m1",
    "k_mul_mat_vec_q6_k_m1",
    "k_mul_mat_vec_iq4_nl_m1",
    "k_mul_mat_vec_iq4_xs_m1",
    "k_quantize_q8a",
    "k_mul_mat_vec_q8a_q8_0",
    "k_mul_mat_vec_q8a_q4_0",
    "k_mul_mat_vec_q8a_q4_1",
    "k_mul_mat_vec_q8a_q5_0",
    "k_mul_mat_vec_q8a_q5_1",
    "k_mul_mat_vec_q8a_q4_k",
    "k_mul_mat_vec_q8a_q5_k",
    "k_mul_mat_vec_q8a_q6_k",
    "k_mul_mat_vec_q8a_q8_0_m1",
    "k_mul_mat_vec_q8a_q4_0_m1",
    "k_mul_mat_vec_q8a_q4_1_m1",
    "k_mul_mat_vec_q8a_q5_0_m1",
    "k_mul_mat_vec_q8a_q5_1_m1",
    "k_mul_mat_vec_q8a_q4_k_m1",
    "k_mul_mat_vec_q8a_q5_k_m1",
    "k_mul_mat_vec_q8a_q6_k_m1",
    "k_argsort",
    "k_moe_group",
    "k_moe_gather",
    "k_moe_scatter",
    "k_to_dense",
    "k_flash_attn",
    "k_sum_ranks",
];

/// Pairs of one expert per chunk of a grouped `mul_mat_id` (`MOE_CHUNK` in `kernels.cu`): the
/// rows of the 8-row GEMV.
pub(crate) const MOE_CHUNK: usize = 8;

/// The most experts `k_moe_group` counts (`MOE_MAX_EXPERTS` in `kernels.cu`, two shared
/// arrays of ints): the models' limit (`hparams::MAX_EXPERTS`).
pub(crate) const MOE_MAX_EXPERTS: usize = 4096;

/// A `mul_mat_id` groups its pairs by expert when they are at least this many per expert the
/// device holds (a prompt): below it most experts get one pair and the three extra launches
/// buy nothing.
pub(crate) const GROUP_MIN_PAIRS_PER_EXPERT: usize = 2;

/// A tensor as kernels see it (`struct Tensor` in `kernels.cu`): device address of element
/// (0, 0, 0, 0), elements and byte strides per dimension, dtype code.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tensor {
    pub ptr: u64,
    pub ne: [i64; 4],
    pub nb: [i64; 4],
    pub dtype: i32,
    pub pad: i32,
}

// SAFETY: repr(C), plain integers, the layout of `struct Tensor` in kernels.cu.
unsafe impl cudarc::driver::DeviceRepr for Tensor {}

impl Tensor {
    /// `layout` at device address `ptr`, or `None` when the kernels have no code for its dtype
    /// ([`kernels_for`]).
    pub fn new(ptr: u64, layout: &Layout) -> Option<Tensor> {
        let mut t = Tensor {
            ptr,
            dtype: kernels_for(layout.dtype)?,
            ..Tensor::default()
        };
        for d in 0..4 {
            t.ne[d] = layout.ne[d] as i64;
            t.nb[d] = layout.nb[d] as i64;
        }
        Some(t)
    }

    /// A stand-in for an absent optional source (a mask): never read.
    pub fn none() -> Tensor {
        Tensor {
            ne: [1; 4],
            ..Tensor::default()
        }
    }
}

/// The expert ids of a GEMV kernel and the experts its weights hold (`struct Ids` in
/// `kernels.cu`): `t.ptr` 0 for a plain product; `rows` 0 for all experts, else the window of
/// a device's share of experts split whole (`op::RowWindow`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ids {
    pub t: Tensor,
    pub rows: i64,
    pub lo: i64,
    pub hi: i64,
    pub at: i64,
}

// SAFETY: repr(C), plain integers, the layout of `struct Ids` in kernels.cu.
unsafe impl cudarc::driver::DeviceRepr for Ids {}

impl Ids {
    /// No ids: a plain product.
    pub fn none() -> Ids {
        Ids {
            t: Tensor::none(),
            ..Ids::default()
        }
    }
}

/// The code `kernels.cu` dispatches on for `d` (`T_F32` ...: every kernel reads and writes its
/// operands by this code), or `None` when the kernels do not know the dtype; then
/// `supports_node` refuses every node that would launch a kernel on it, naming the dtype.
/// Every `DType` is matched by name: a type added to the table does not compile until it is
/// answered here, so none reaches a kernel as another type's code.
pub const fn kernels_for(d: DType) -> Option<i32> {
    match d {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        DType::I32 => Some(3),
        DType::Q8_0 => Some(4),
        DType::Q4_0 => Some(5),
        DType::Q4_1 => Some(6),
        DType::Q5_0 => Some(7),
        DType::Q5_1 => Some(8),
        DType::Q2_K => Some(9),
        DType::Q3_K => Some(10),
        DType::Q4_K => Some(11),
        DType::Q5_K => Some(12),
        DType::Q6_K => Some(13),
        DType::IQ4_NL => Some(14),
        DType::IQ4_XS => Some(15),
        #[cfg(test)]
        DType::FakeQ4x16 => None,
    }
}

/// The code of a dtype the kernels know ([`kernels_for`]). Callers pass only such dtypes (the
/// communicator sums float types); another is a bug, reported by name.
pub fn dtype_code(d: DType) -> i32 {
    match kernels_for(d) {
        Some(code) => code,
        None => panic!("the CUDA kernels have no code for dtype {d}"),
    }
}

/// The longest row `k_argsort` sorts (its keys in shared memory, O(n^2) comparisons per row:
/// made for a router's experts, not a vocabulary).
pub(crate) const ARGSORT_MAX: usize = 4096;

/// Threads per block of the attention kernel (kv rows per tile).
pub(crate) const ATTN_BLOCK: u32 = 128;

/// `Ok` when the kernels compute node `id`; otherwise why not.
pub fn supports_node(g: &Graph, id: TensorId) -> std::result::Result<(), String> {
    let n = g.node(id);
    let dst = &n.layout;
    let src: SmallVec<[&Layout; 4]> = n.src.iter().map(|&s| g.layout(s)).collect();
    let float = |l: &Layout, what: &str| {
        if matches!(l.dtype, DType::F32 | DType::F16 | DType::BF16) {
            Ok(())
        } else {
            Err(format!("{what} must be f32, f16 or bf16, not {}", l.dtype))
        }
    };
    let launches = !n.op.is_noop() && !matches!(n.op, Op::Collective(_));
    if launches
        && let Some(l) = src
            .iter()
            .copied()
            .chain([dst])
            .find(|l| kernels_for(l.dtype).is_none())
    {
        return Err(no_kernels(l));
    }
    let packed_blocks = |l: &Layout, what: &str| {
        if l.dtype.is_quantized() && l.nb[0] != l.dtype.type_size() {
            Err(format!("quantized {what} rows must be packed"))
        } else {
            Ok(())
        }
    };
    match n.op {
        Op::Leaf | Op::Reshape | Op::View { .. } | Op::Permute { .. } => Ok(()),
        Op::MulMat => {
            let (w, x) = (src[0], src[1]);
            if gemm_input(w.dtype).is_none() {
                return Err(format!("weights of dtype {} are not supported", w.dtype));
            }
            packed_blocks(w, "weight")?;
            if x.dtype != DType::F32 || dst.dtype != DType::F32 {
                return Err("src1 and dst must be f32".into());
            }
            if !dst.is_contiguous() {
                return Err("the product's output must be packed".into());
            }
            if w.ne[2] == 0 || w.ne[3] == 0 || x.ne[2] % w.ne[2] != 0 || x.ne[3] % w.ne[3] != 0 {
                return Err("weights must broadcast over dims 2 and 3 of src1".into());
            }
            Ok(())
        }
        Op::Binary(_) | Op::Scale { .. } | Op::Clamp { .. } | Op::Unary(_) | Op::Swiglu => {
            for (i, s) in src.iter().enumerate() {
                float(s, &format!("source {i}"))?;
            }
            float(dst, "the output")
        }
        Op::RmsNorm { .. } | Op::Norm { .. } | Op::SumRows | Op::SumSqrRows | Op::Mean => {
            float(src[0], "the input")?;
            float(dst, "the output")
        }
        Op::RmsNormSums { .. } => {
            float(src[0], "the input")?;
            if src[1].dtype != DType::F32 {
                return Err("the sums must be f32".into());
            }
            float(src[2], "the weight")?;
            float(dst, "the output")
        }
        Op::SoftMax { .. } => {
            for (i, s) in src.iter().enumerate() {
                float(s, &format!("source {i}"))?;
            }
            float(dst, "the output")
        }
        Op::MulMatId { .. } => {
            let (w, b, ids) = (src[0], src[1], src[2]);
            if gemv_kernel(w.dtype).is_none() {
                return Err(format!(
                    "expert weights of dtype {} are not supported",
                    w.dtype
                ));
            }
            packed_blocks(w, "expert weight")?;
            if b.dtype != DType::F32 || ids.dtype != DType::I32 || dst.dtype != DType::F32 {
                return Err("mul_mat_id takes f32 activations and I32 ids, and gives f32".into());
            }
            if !dst.is_contiguous() {
                return Err("the output of mul_mat_id must be packed".into());
            }
            // The kernels view the activations' column e % n_b by a stride: n_b is 1 or n_used.
            if b.ne[1] != 1 && b.ne[1] != ids.ne[0] {
                return Err(format!(
                    "activations with {} rows per token for {} experts per token (1 or one per \
                     expert)",
                    b.ne[1], ids.ne[0]
                ));
            }
            Ok(())
        }
        Op::Argsort { .. } => {
            if src[0].dtype != DType::F32 || dst.dtype != DType::I32 {
                return Err("argsort takes f32 and gives I32".into());
            }
            if src[0].ne[0] > ARGSORT_MAX {
                return Err(format!(
                    "rows of {} values (the kernel sorts rows of at most {ARGSORT_MAX})",
                    src[0].ne[0]
                ));
            }
            Ok(())
        }
        Op::Argmax => {
            if src[0].dtype == DType::F32 {
                Ok(())
            } else {
                Err("argmax takes f32".into())
            }
        }
        Op::Rope(_) => {
            if !matches!(src[0].dtype, DType::F32 | DType::F16) {
                return Err(format!("rope takes f32 or f16, not {}", src[0].dtype));
            }
            float(dst, "the output")
        }
        Op::GetRows { .. } => {
            packed_blocks(src[0], "table")?;
            if dst.dtype == DType::I32 {
                return if src[0].dtype == DType::I32 {
                    Ok(())
                } else {
                    Err("an I32 output needs an I32 table".into())
                };
            }
            float(dst, "the output")
        }
        Op::SetRows { .. } => {
            float(dst, "the destination")?;
            float(src[1], "the rows")
        }
        Op::Cont | Op::Cpy => {
            let s = src[0];
            packed_blocks(s, "source")?;
            if dst.dtype.is_quantized() {
                // Same-type rows move as bytes; float sources are quantized block by block.
                let from_float = matches!(s.dtype, DType::F32 | DType::F16 | DType::BF16);
                if (s.dtype != dst.dtype && !from_float)
                    || s.ne[0] != dst.ne[0]
                    || dst.nb[0] != dst.dtype.type_size()
                {
                    return Err(format!(
                        "a copy into {} needs a float source or packed rows of the same type, \
                         of the same row length",
                        dst.dtype
                    ));
                }
                return Ok(());
            }
            if s.dtype.is_quantized() && s.ne[0] != dst.ne[0] {
                return Err("a quantized copy must keep the row length".into());
            }
            if (s.dtype == DType::I32) != (dst.dtype == DType::I32) {
                return Err("I32 copies only to I32".into());
            }
            Ok(())
        }
        Op::Concat { .. } => {
            if src[0].dtype != src[1].dtype || src[0].dtype != dst.dtype {
                return Err("concat operands must share a dtype".into());
            }
            if dst.dtype == DType::I32 {
                return Ok(());
            }
            float(dst, "the output")
        }
        Op::FlashAttn { .. } => {
            for (i, s) in src.iter().enumerate().take(3) {
                float(s, &format!("source {i}"))?;
            }
            if let Some(m) = src.get(3) {
                float(m, "the mask")?;
            }
            let dv = src[2].ne[0];
            if dv > 4 * ATTN_BLOCK as usize {
                return Err(format!(
                    "value rows of {dv} elements (at most {})",
                    4 * ATTN_BLOCK
                ));
            }
            float(dst, "the output")
        }
        Op::Collective(_) => Err("collectives run in the meta backend, between node ranges".into()),
    }
}

/// Why a node on `l` cannot run: the kernels have no code for its dtype.
pub(crate) fn no_kernels(l: &Layout) -> String {
    format!("the CUDA kernels have no code for dtype {}", l.dtype)
}

/// How the GEMM takes weights of `dtype` (bytes per element, the `kernels.cu` code of the dense
/// copy, the cuBLAS type): F16 and BF16 on tensor cores, every other weight type expanded to
/// f32; `None` for types that are not weights.
pub(crate) fn gemm_input(dtype: DType) -> Option<(usize, i32, blas_sys::cudaDataType)> {
    match dtype {
        DType::F16 => Some((2, 1, blas_sys::cudaDataType::CUDA_R_16F)),
        DType::BF16 => Some((2, 2, blas_sys::cudaDataType::CUDA_R_16BF)),
        // F32 and every quantized type with a GEMV kernel (which `gemv_kernel` answers for
        // every `DType` by name).
        _ => gemv_kernel(dtype).map(|_| (4, 0, blas_sys::cudaDataType::CUDA_R_32F)),
    }
}

/// The GEMV kernel (M <= 8) for weights of `dtype`: `k_mul_mat_vec` for float weights,
/// `k_mul_mat_vec_<type>` for each quantized type (`gemv_qx` / `lane8` in `kernels_qx.cu`);
/// `None` for types that are not weights. Every `DType` is matched
/// by name.
pub(crate) fn gemv_kernel(dtype: DType) -> Option<&'static str> {
    gemv_kernels(dtype).map(|k| k.0)
}

/// The GEMV kernel for weights of `dtype` and `m` activation rows: the quantized ones have a
/// variant for one row (`_m1`: one accumulator in registers, not eight, so more warps fit).
pub(crate) fn gemv_kernel_for(dtype: DType, m: usize) -> Option<&'static str> {
    gemv_kernels(dtype).map(|(any, one)| if m == 1 { one } else { any })
}

/// The GEMV kernel on 8-bit activations (`gemv_q8a` in `kernels_qx.cu`: the activations
/// quantized by `k_quantize_q8a`, integer dot products) for weights of `dtype` and `m` rows;
/// `None` for the types it does not have (they take [`gemv_kernel_for`]'s f32 path).
pub(crate) fn gemv_q8a_kernel_for(dtype: DType, m: usize) -> Option<&'static str> {
    let (any, one) = match dtype {
        DType::Q8_0 => ("k_mul_mat_vec_q8a_q8_0", "k_mul_mat_vec_q8a_q8_0_m1"),
        DType::Q4_0 => ("k_mul_mat_vec_q8a_q4_0", "k_mul_mat_vec_q8a_q4_0_m1"),
        DType::Q4_1 => ("k_mul_mat_vec_q8a_q4_1", "k_mul_mat_vec_q8a_q4_1_m1"),
        DType::Q5_0 => ("k_mul_mat_vec_q8a_q5_0", "k_mul_mat_vec_q8a_q5_0_m1"),
        DType::Q5_1 => ("k_mul_mat_vec_q8a_q5_1", "k_mul_mat_vec_q8a_q5_1_m1"),
        DType::Q4_K => ("k_mul_mat_vec_q8a_q4_k", "k_mul_mat_vec_q8a_q4_k_m1"),
        DType::Q5_K => ("k_mul_mat_vec_q8a_q5_k", "k_mul_mat_vec_q8a_q5_k_m1"),
        DType::Q6_K => ("k_mul_mat_vec_q8a_q6_k", "k_mul_mat_vec_q8a_q6_k_m1"),
        _ => return None,
    };
    Some(if m == 1 { one } else { any })
}

/// (up to 8 rows, one row).
fn gemv_kernels(dtype: DType) -> Option<(&'static str, &'static str)> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => Some(("k_mul_mat_vec", "k_mul_mat_vec")),
        DType::Q8_0 => Some(("k_mul_mat_vec_q8_0", "k_mul_mat_vec_q8_0_m1")),
        DType::Q4_0 => Some(("k_mul_mat_vec_q4_0", "k_mul_mat_vec_q4_0_m1")),
        DType::Q4_1 => Some(("k_mul_mat_vec_q4_1", "k_mul_mat_vec_q4_1_m1")),
        DType::Q5_0 => Some(("k_mul_mat_vec_q5_0", "k_mul_mat_vec_q5_0_m1")),
        DType::Q5_1 => Some(("k_mul_mat_vec_q5_1", "k_mul_mat_vec_q5_1_m1")),
        DType::Q2_K => Some(("k_mul_mat_vec_q2_k", "k_mul_mat_vec_q2_k_m1")),
        DType::Q3_K => Some(("k_mul_mat_vec_q3_k", "k_mul_mat_vec_q3_k_m1")),
        DType::Q4_K => Some(("k_mul_mat_vec_q4_k", "k_mul_mat_vec_q4_k_m1")),
        DType::Q5_K => Some(("k_mul_mat_vec_q5_k", "k_mul_mat_vec_q5_k_m1")),
        DType::Q6_K => Some(("k_mul_mat_vec_q6_k", "k_mul_mat_vec_q6_k_m1")),
        DType::IQ4_NL => Some(("k_mul_mat_vec_iq4_nl", "k_mul_mat_vec_iq4_nl_m1")),
        DType::IQ4_XS => Some(("k_mul_mat_vec_iq4_xs", "k_mul_mat_vec_iq4_xs_m1")),
        DType::I32 => None,
        #[cfg(test)]
        DType::FakeQ4x16 => None,
    }
}

/// What a kernel reports about a bad operand (`struct Fault` in `kernels.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fault {
    pub flag: i32,
    pub node: i32,
    pub id: i64,
    pub at: [i64; 3],
    pub rows: i64,
}

// SAFETY: repr(C), plain integers, the layout of `struct Fault` in kernels.cu.
unsafe impl cudarc::driver::DeviceRepr for Fault {}

/// The NVRTC options: PTX for `arch` (`compute_90`), IEEE division and square roots, no
/// flush-to-zero, so results follow the CPU backend's f32 arithmetic as closely as the
/// different summation orders allow.
fn options(arch: &'static str) -> cudarc::nvrtc::CompileOptions {
    cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        name: Some("metashard_kernels.cu".into()),
        ..Default::default()
    }
}

/// `compute_XY` for a compute capability, as a static string (NVRTC's option type wants one).
pub fn arch_name(major: i32, minor: i32) -> &'static str {
    static NAMES: OnceLock<Mutex<HashMap<(i32, i32), &'static str>>> = OnceLock::new();
    let mut m = NAMES.get_or_init(Default::default).lock().unwrap();
    m.entry((major, minor))
        .or_insert_with(|| Box::leak(format!("compute_{major}{minor}").into_boxed_str()))
}

/// Compile the kernels to PTX for `arch` (`compute_80`), once per process and architecture.
/// The error carries NVRTC's log.
pub fn compile(arch: &'static str) -> Result<Arc<String>> {
    static CACHE: OnceLock<Mutex<HashMap<&'static str, Arc<String>>>> = OnceLock::new();
    if let Some(p) = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap()
        .get(arch)
    {
        return Ok(p.clone());
    }
    if !present(Lib::Nvrtc) {
        return Err(Error::Device {
            device: "cuda".into(),
            reason: missing(Lib::Nvrtc),
        });
    }
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, options(arch)).map_err(|e| {
        let detail = match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        };
        Error::Device {
            device: "cuda".into(),
            reason: format!("NVRTC could not compile the kernels for {arch}:\n{detail}"),
        }
    })?;
    let ptx = Arc::new(ptx.to_src());
    CACHE
        .get()
        .unwrap()
        .lock()
        .unwrap()
        .insert(arch, ptx.clone());
    Ok(ptx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Graph;
    use crate::cuda::backend::supports_node;

    #[test]
    fn every_node_on_a_type_without_a_code_is_refused_naming_it() {
        // The test builds' fake quantized type has no code: no kernel may read its bytes as
        // another type's, so products, rows and copies of it are refused, naming it.
        let fake = DType::FakeQ4x16;
        assert_eq!(kernels_for(fake), None);
        let mut g = Graph::new();
        let w = g.input("w", fake, [64, 4, 1, 1]).unwrap();
        let x = g.input("x", DType::F32, [64, 3, 1, 1]).unwrap();
        let ids = g.input("ids", DType::I32, [2, 1, 1, 1]).unwrap();
        let nodes = [
            g.mul_mat(w, x).unwrap(),
            g.get_rows(w, ids).unwrap(),
            g.cont(w).unwrap(),
            g.cast(x, fake).unwrap(),
        ];
        for id in nodes {
            let why = supports_node(&g, id).unwrap_err();
            assert!(
                why.contains("fake_q4x16"),
                "{}: {why}",
                g.node(id).op.name()
            );
        }
        // Leaves and views launch nothing.
        assert!(supports_node(&g, w).is_ok());
    }

    #[test]
    fn one_row_products_take_the_one_row_variants() {
        for d in DType::ALL {
            let (Some(any), Some(one)) = (gemv_kernel_for(d, 8), gemv_kernel_for(d, 1)) else {
                continue;
            };
            assert!(KERNELS.contains(&any) && KERNELS.contains(&one), "{d}");
            assert_eq!(gemv_kernel_for(d, 2), Some(any), "{d}");
            if d.is_quantized() {
                assert_eq!(one, format!("{any}_m1"), "{d}");
            } else {
                assert_eq!(one, any, "{d}");
            }
        }
    }

    #[test]
    fn grouped_expert_constants_are_the_kernels_defines() {
        assert!(SOURCE.contains(&format!("#define MOE_CHUNK {MOE_CHUNK}")));
        assert!(SOURCE.contains(&format!("#define MOE_MAX_EXPERTS {MOE_MAX_EXPERTS}")));
        assert_eq!(MOE_MAX_EXPERTS, crate::models::hparams::MAX_EXPERTS);
    }

    #[test]
    fn codes_are_the_kernels_defines() {
        for d in DType::ALL {
            if let Some(code) = kernels_for(d) {
                let define = format!("#define T_{} {code}", d.name().to_uppercase());
                assert!(SOURCE.contains(&define), "{define}");
            }
        }
    }
}
