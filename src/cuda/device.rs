//! GPUs, logical devices and device memory.
//!
//! A [`Gpu`] is one physical GPU: its primary context (retained once per process and made
//! current on every thread that touches it: cudarc binds no context to a thread by itself) and
//! the kernel module, compiled by NVRTC for its compute capability on first use. A
//! [`CudaDevice`] is a logical device on a GPU: `cuda:0x2` puts two on GPU 0, each with its own
//! stream, cuBLAS handle and an equal share of the memory as its budget, so tensor parallelism
//! runs on one GPU as `cpu:2x1` does on one CPU. [`CudaBuffer`] is one `cuMemAlloc` allocation;
//! its set/get/memset calls are synchronous and go through the legacy default stream, which
//! orders them with the backends' blocking streams.

use super::kernels::{KERNELS, arch_name, compile};
use super::libs::{Lib, missing, present};
use crate::backend::{Backend, Device, DeviceCaps, DeviceKind, MemoryInfo, Registry};
use crate::buffer::{Buffer, BufferType, BufferUsage};
use crate::cpu::Precision;
use crate::graph::{Graph, TensorId};
use crate::tensor::Layout;
use crate::{Error, Result};
use cudarc::driver::{result as cu, sys};
use parking_lot::Mutex;
use std::any::Any;
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, OnceLock};

/// A driver error as the crate's error, naming the device and what was being done.
pub(crate) fn driver_err(device: &str, what: &str, e: cu::DriverError) -> Error {
    Error::Device {
        device: device.to_string(),
        reason: format!("{what}: {e:?}"),
    }
}

/// The kernel module of one GPU: every function of `KERNELS`.
struct Module {
    _module: sys::CUmodule,
    funcs: HashMap<&'static str, sys::CUfunction>,
}

/// One physical GPU.
pub struct Gpu {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    pub total_memory: usize,
    ctx: sys::CUcontext,
    module: OnceLock<std::result::Result<Module, String>>,
}

// SAFETY: CUDA contexts, modules and functions are process-wide handles usable from any thread
// once the context is current there (`bind`); the Rust side only copies the handles.
unsafe impl Send for Gpu {}
// SAFETY: as above.
unsafe impl Sync for Gpu {}

/// Whether the driver library loads and initializes; the number of GPUs.
pub fn gpu_count() -> Result<usize> {
    if !present(Lib::Driver) {
        return Err(Error::Device {
            device: "cuda".into(),
            reason: missing(Lib::Driver),
        });
    }
    cu::init().map_err(|e| driver_err("cuda", "cuInit", e))?;
    let n = cu::device::get_count().map_err(|e| driver_err("cuda", "cuDeviceGetCount", e))?;
    Ok(n.max(0) as usize)
}

impl Gpu {
    /// GPU `ordinal`, shared by every logical device on it (one per process).
    pub fn get(ordinal: usize) -> Result<Arc<Gpu>> {
        static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
        let mut map = GPUS.get_or_init(Default::default).lock();
        if let Some(g) = map.get(&ordinal) {
            return Ok(g.clone());
        }
        let n = gpu_count()?;
        let name = format!("cuda{ordinal}");
        if ordinal >= n {
            return Err(Error::Device {
                device: name,
                reason: format!(
                    "no such GPU: the driver sees {n} GPU{}",
                    if n == 1 { "" } else { "s" }
                ),
            });
        }
        let err = |what: &str, e| driver_err(&name, what, e);
        let dev = cu::device::get(ordinal as i32).map_err(|e| err("cuDeviceGet", e))?;
        // SAFETY: `dev` came from cuDeviceGet; the primary context is retained for the life of
        // the process (never released: devices are shared through this map).
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| err("retain", e))?;
        // SAFETY: a context just retained.
        unsafe { cu::ctx::set_current(ctx) }.map_err(|e| err("cuCtxSetCurrent", e))?;
        let attr = |a| {
            // SAFETY: `dev` is a valid device.
            unsafe { cu::device::get_attribute(dev, a) }.map_err(|e| err("attribute", e))
        };
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        // SAFETY: `dev` is a valid device.
        let total = unsafe { cu::device::total_mem(dev) }.map_err(|e| err("total_mem", e))?;
        let gname = cu::device::get_name(dev).unwrap_or_else(|_| "NVIDIA GPU".into());
        let g = Arc::new(Gpu {
            ordinal,
            name: gname,
            cc: (major, minor),
            total_memory: total,
            ctx,
            module: OnceLock::new(),
        });
        map.insert(ordinal, g.clone());
        Ok(g)
    }

    /// `cuda{ordinal}`.
    pub fn label(&self) -> String {
        format!("cuda{}", self.ordinal)
    }

    /// Make this GPU's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for the life of the process.
        unsafe { cu::ctx::set_current(self.ctx) }
            .map_err(|e| driver_err(&self.label(), "cuCtxSetCurrent", e))
    }

    /// Free and total bytes of the GPU.
    pub fn memory(&self) -> MemoryInfo {
        if self.bind().is_err() {
            return MemoryInfo {
                free: 0,
                total: self.total_memory,
            };
        }
        let (free, total) = cu::mem_get_info().unwrap_or((0, self.total_memory));
        MemoryInfo { free, total }
    }

    /// Kernel `name`, compiling and loading the module on first use.
    pub fn function(&self, name: &str) -> Result<sys::CUfunction> {
        let m = self
            .module
            .get_or_init(|| self.load_module().map_err(|e| e.to_string()));
        match m {
            Ok(m) => m.funcs.get(name).copied().ok_or_else(|| Error::Internal {
                component: "cuda",
                reason: format!("kernel `{name}` is not in kernels.cu"),
            }),
            Err(e) => Err(Error::Device {
                device: self.label(),
                reason: e.clone(),
            }),
        }
    }

    fn load_module(&self) -> Result<Module> {
        let ptx = compile(arch_name(self.cc.0, self.cc.1))?;
        self.bind()?;
        let err = |what: &str, e| driver_err(&self.label(), what, e);
        let src = CString::new(ptx.as_bytes()).map_err(|_| Error::Internal {
            component: "cuda",
            reason: "PTX with a NUL byte".into(),
        })?;
        // SAFETY: a NUL-terminated PTX image; the module stays loaded for the process.
        let module = unsafe { cu::module::load_data(src.as_ptr().cast()) }
            .map_err(|e| err("cuModuleLoadData", e))?;
        let mut funcs = HashMap::new();
        for &k in KERNELS {
            // SAFETY: a module just loaded; the name is a kernel of it.
            let f = unsafe { cu::module::get_function(module, CString::new(k).unwrap()) }
                .map_err(|e| err(&format!("cuModuleGetFunction({k})"), e))?;
            funcs.insert(k, f);
        }
        Ok(Module {
            _module: module,
            funcs,
        })
    }
}

/// One logical device on a GPU.
#[derive(Clone)]
pub struct CudaDevice {
    pub gpu: Arc<Gpu>,
    /// Index among the logical devices of this GPU, and their count.
    pub index: usize,
    pub count: usize,
    /// The activations' precision in products of quantized weights with at most 8 activation
    /// rows: f32 (`Exact`, the default) or 8-bit with integer dot products (`Q8`, the CPU's
    /// `--q8`), for the types `gemv_q8a` has.
    pub precision: Precision,
}

impl CudaDevice {
    pub fn new(gpu: Arc<Gpu>, index: usize, count: usize) -> CudaDevice {
        CudaDevice {
            gpu,
            index,
            count: count.max(1),
            precision: Precision::Exact,
        }
    }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        if self.count == 1 {
            self.gpu.label()
        } else {
            format!("{}.{}", self.gpu.label(), self.index)
        }
    }

    fn description(&self) -> String {
        let (maj, min) = self.gpu.cc;
        let share = if self.count == 1 {
            String::new()
        } else {
            format!(", logical device {} of {}", self.index, self.count)
        };
        format!("{} (sm_{maj}{min}){share}", self.gpu.name)
    }

    /// The GPU's memory; logical devices are each shown an equal share (their budget).
    fn memory(&self) -> MemoryInfo {
        let m = self.gpu.memory();
        MemoryInfo {
            free: m.free / self.count,
            total: m.total / self.count,
        }
    }

    fn kind(&self) -> DeviceKind {
        DeviceKind::Gpu
    }

    fn caps(&self) -> DeviceCaps {
        DeviceCaps::default()
    }

    fn buffer_type(&self) -> Arc<dyn BufferType> {
        Arc::new(CudaBufferType {
            gpu: self.gpu.clone(),
        })
    }

    fn init_backend(&self) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(super::backend::CudaBackend::new(self.clone())?))
    }

    fn supports_op(&self, graph: &Graph, id: TensorId) -> std::result::Result<(), String> {
        super::backend::supports_node(graph, id)
    }

    fn supports_buffer_type(&self, bt: &dyn BufferType) -> bool {
        bt.as_any()
            .downcast_ref::<CudaBufferType>()
            .is_some_and(|b| b.gpu.ordinal == self.gpu.ordinal)
    }

    /// Logical devices of one GPU reduce through each other's memory (`comm.rs`); devices on
    /// different GPUs through NCCL (`nccl.rs`), one rank per GPU.
    fn communicators(&self) -> Vec<Arc<dyn crate::collectives::CommunicatorFactory>> {
        vec![
            Arc::new(super::comm::OneGpuFactory {
                ordinal: self.gpu.ordinal,
            }),
            Arc::new(super::nccl::NcclFactory),
        ]
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Device memory of one GPU.
pub struct CudaBufferType {
    pub gpu: Arc<Gpu>,
}

impl BufferType for CudaBufferType {
    fn name(&self) -> String {
        self.gpu.label().to_uppercase()
    }

    fn alloc_buffer(&self, size: usize) -> Result<Arc<dyn Buffer>> {
        self.gpu.bind()?;
        // SAFETY: the context is current; freed in Drop.
        let ptr = unsafe { cu::malloc_sync(size.max(1)) }.map_err(|e| Error::Device {
            device: self.gpu.label(),
            reason: format!("cannot allocate {size} bytes of device memory: {e:?}"),
        })?;
        Ok(Arc::new(CudaBuffer {
            gpu: self.gpu.clone(),
            ptr,
            size,
            usage: Mutex::new(BufferUsage::Any),
        }))
    }

    fn alignment(&self) -> usize {
        256
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// One device allocation.
pub struct CudaBuffer {
    pub gpu: Arc<Gpu>,
    /// Device address of byte 0.
    pub ptr: u64,
    size: usize,
    usage: Mutex<BufferUsage>,
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated by cuMemAlloc in `alloc_buffer`, freed once here.
            let _ = unsafe { cu::free_sync(self.ptr) };
        }
    }
}

impl CudaBuffer {
    fn check(&self, at: usize, len: usize, what: &str) -> Result<()> {
        if at.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(Error::Internal {
                component: "cuda",
                reason: format!(
                    "{what} of {len} bytes at {at} outside a {}-byte buffer of {}",
                    self.size,
                    self.gpu.label()
                ),
            });
        }
        Ok(())
    }

    fn err(&self, what: &str, e: cu::DriverError) -> Error {
        driver_err(&self.gpu.label(), what, e)
    }
}

impl Buffer for CudaBuffer {
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        Arc::new(CudaBufferType {
            gpu: self.gpu.clone(),
        })
    }

    fn size(&self) -> usize {
        self.size
    }

    fn set_tensor(
        &self,
        _layout: &Layout,
        buf_offset: usize,
        data: &[u8],
        offset: usize,
    ) -> Result<()> {
        let at = buf_offset + offset;
        self.check(at, data.len(), "a write")?;
        if data.is_empty() {
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: the range is inside the allocation (checked); synchronous copy.
        unsafe { cu::memcpy_htod_sync(self.ptr + at as u64, data) }
            .map_err(|e| self.err("cuMemcpyHtoD", e))
    }

    fn get_tensor(
        &self,
        _layout: &Layout,
        buf_offset: usize,
        out: &mut [u8],
        offset: usize,
    ) -> Result<()> {
        let at = buf_offset + offset;
        self.check(at, out.len(), "a read")?;
        if out.is_empty() {
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: the range is inside the allocation (checked); synchronous copy.
        unsafe { cu::memcpy_dtoh_sync(out, self.ptr + at as u64) }
            .map_err(|e| self.err("cuMemcpyDtoH", e))
    }

    fn memset_tensor(
        &self,
        _layout: &Layout,
        buf_offset: usize,
        value: u8,
        offset: usize,
        size: usize,
    ) -> Result<()> {
        let at = buf_offset + offset;
        self.check(at, size, "a fill")?;
        if size == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: the range is inside the allocation (checked).
        unsafe { cu::memset_d8_sync(self.ptr + at as u64, value, size) }
            .map_err(|e| self.err("cuMemsetD8", e))
    }

    fn cpy_tensor(
        &self,
        src: &dyn Buffer,
        src_layout: &Layout,
        src_offset: usize,
        dst_layout: &Layout,
        dst_offset: usize,
    ) -> Result<bool> {
        let Some(s) = src.as_any().downcast_ref::<CudaBuffer>() else {
            return Ok(false);
        };
        if s.gpu.ordinal != self.gpu.ordinal
            || !src_layout.is_contiguous()
            || !dst_layout.is_contiguous()
            || src_layout.nbytes() != dst_layout.nbytes()
        {
            return Ok(false);
        }
        let n = src_layout.nbytes();
        s.check(src_offset, n, "a copy source")?;
        self.check(dst_offset, n, "a copy")?;
        self.gpu.bind()?;
        // SAFETY: both ranges are inside their allocations on this GPU (checked).
        unsafe { cu::memcpy_dtod_sync(self.ptr + dst_offset as u64, s.ptr + src_offset as u64, n) }
            .map_err(|e| self.err("cuMemcpyDtoD", e))?;
        Ok(true)
    }

    fn clear(&self, value: u8) {
        if self.gpu.bind().is_ok() {
            // SAFETY: the whole allocation.
            let _ = unsafe { cu::memset_d8_sync(self.ptr, value, self.size) };
        }
    }

    fn usage(&self) -> BufferUsage {
        *self.usage.lock()
    }

    fn set_usage(&self, usage: BufferUsage) {
        *self.usage.lock() = usage;
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The CUDA registry: one device per GPU.
pub struct CudaRegistry {
    gpus: usize,
}

impl Registry for CudaRegistry {
    fn name(&self) -> &str {
        "CUDA"
    }

    fn devices(&self) -> Vec<Arc<dyn Device>> {
        (0..self.gpus)
            .filter_map(|i| Gpu::get(i).ok())
            .map(|g| Arc::new(CudaDevice::new(g, 0, 1)) as Arc<dyn Device>)
            .collect()
    }
}

/// The registry when a driver and at least one GPU are present.
pub fn registry() -> Option<Arc<dyn Registry>> {
    match gpu_count() {
        Ok(n) if n > 0 => Some(Arc::new(CudaRegistry { gpus: n })),
        _ => None,
    }
}

/// Parse `cuda` (every GPU), `cuda:0,1` (those GPUs) or `cuda:0x2` / `cuda:0x2,1x2` (logical
/// devices per GPU).
pub fn parse_spec(spec: &str) -> Result<Vec<Arc<dyn Device>>> {
    parse_spec_with(spec, Precision::Exact)
}

/// [`parse_spec`] with the devices' [`CudaDevice::precision`].
pub fn parse_spec_with(spec: &str, precision: Precision) -> Result<Vec<Arc<dyn Device>>> {
    let bad = |reason: String| Error::Device {
        device: spec.to_string(),
        reason,
    };
    let rest = spec
        .trim()
        .strip_prefix("cuda")
        .ok_or_else(|| bad("expected `cuda`, `cuda:0,1` or `cuda:0x2`".into()))?;
    let mut wanted: Vec<(usize, usize)> = Vec::new();
    if rest.is_empty() {
        let n = gpu_count()?;
        if n == 0 {
            return Err(bad("the driver sees no GPU".into()));
        }
        wanted.extend((0..n).map(|i| (i, 1)));
    } else {
        let list = rest
            .strip_prefix(':')
            .ok_or_else(|| bad("expected `cuda`, `cuda:0,1` or `cuda:0x2`".into()))?;
        for item in list.split(',') {
            let num = |s: &str, what: &str| {
                s.trim()
                    .parse::<usize>()
                    .map_err(|_| bad(format!("{what} `{s}` is not a number")))
            };
            let (g, k) = match item.split_once(['x', 'X']) {
                Some((g, k)) => (num(g, "GPU")?, num(k, "logical device count")?),
                None => (num(item, "GPU")?, 1),
            };
            if k == 0 || k > 16 {
                return Err(bad(format!("{k} logical devices on GPU {g}: use 1 to 16")));
            }
            if wanted.iter().any(|&(w, _)| w == g) {
                return Err(bad(format!("GPU {g} is named twice")));
            }
            wanted.push((g, k));
        }
    }
    let mut out: Vec<Arc<dyn Device>> = Vec::new();
    for (g, k) in wanted {
        let gpu = Gpu::get(g)?;
        for i in 0..k {
            out.push(Arc::new(CudaDevice {
                precision,
                ..CudaDevice::new(gpu.clone(), i, k)
            }));
        }
    }
    Ok(out)
}
