//! The CUDA kernels (`kernels.cu`), their argument types and their compilation by NVRTC: once
//! per process and compute capability, to PTX for the virtual architecture `compute_XY`, which
//! the driver turns into machine code for the GPU when the module is loaded.

use super::libs::{Lib, missing, present};
use crate::tensor::Layout;
use crate::{DType, Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The kernel source.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every kernel the backend launches, by its `extern "C"` name.
pub const KERNELS: &[&str] = &[
    "k_cpy",
    "k_cpy_rows_bytes",
    "k_concat",
    "k_binary",
    "k_unary",
    "k_swiglu",
    "k_row_reduce",
    "k_soft_max",
    "k_argmax",
    "k_rope",
    "k_get_rows",
    "k_set_rows",
    "k_mul_mat_vec",
    "k_to_dense",
    "k_flash_attn",
    "k_sum_ranks",
];

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
    pub fn new(ptr: u64, layout: &Layout) -> Tensor {
        let mut t = Tensor {
            ptr,
            dtype: dtype_code(layout.dtype),
            ..Tensor::default()
        };
        for d in 0..4 {
            t.ne[d] = layout.ne[d] as i64;
            t.nb[d] = layout.nb[d] as i64;
        }
        t
    }

    /// A stand-in for an absent optional source (a mask): never read.
    pub fn none() -> Tensor {
        Tensor {
            ne: [1; 4],
            ..Tensor::default()
        }
    }
}

/// The dtype codes of `kernels.cu` (`T_F32` ...).
pub fn dtype_code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::I32 => 3,
        DType::Q8_0 => 4,
        DType::Q4_0 => 5,
        DType::Q4_1 => 6,
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
