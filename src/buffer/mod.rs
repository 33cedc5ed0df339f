//! The memory rungs of the backend ladder: `BufferType` (an allocator of one kind of memory)
//! and `Buffer` (one allocation holding tensors at byte offsets), plus `Storage` (where one
//! tensor's bytes are), `BufferRange` (a byte range of a buffer, what collectives move),
//! `tensor_copy` between any two buffers, and the backend-neutral aligned host memory
//! (`host.rs`: `HostBufferType`, `HostBuffer`).
//!
//! Shaped after ggml-backend's `ggml_backend_buffer_type_i` / `ggml_backend_buffer_i`
//! (ggml-org/ggml `src/ggml-backend-impl.h`): optional entries have default methods.

pub mod host;

pub use host::{HostBuffer, HostBufferType};

use crate::tensor::Layout;
use crate::{Error, Result};
use std::any::Any;
use std::sync::Arc;

/// What a buffer holds; backends may place weights and compute buffers differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BufferUsage {
    #[default]
    Any,
    Weights,
    Compute,
}

/// An allocator of one kind of memory (host RAM, one GPU's memory, a meta device's slices).
pub trait BufferType: Send + Sync + Any {
    fn name(&self) -> String;
    /// Allocate `size` bytes. Errors (never aborts) if the memory cannot be had.
    fn alloc_buffer(&self, size: usize) -> Result<Arc<dyn Buffer>>;
    /// Alignment of tensor offsets inside buffers of this type.
    fn alignment(&self) -> usize;
    /// (optional) Largest single buffer.
    fn max_size(&self) -> usize {
        usize::MAX
    }
    /// (optional) Bytes to reserve for a tensor; defaults to its span.
    fn alloc_size(&self, layout: &Layout) -> usize {
        layout.nbytes()
    }
    /// (optional) Host memory, readable by CPU kernels.
    fn is_host(&self) -> bool {
        false
    }
    fn as_any(&self) -> &dyn Any;
}

/// One allocation. Tensors live in it at byte offsets; `offset` arguments of the tensor methods
/// are relative to the tensor's start.
///
/// Concurrency contract (as in ggml): a buffer is plain memory. Writes to bytes that another
/// thread reads or writes at the same time are the caller's race; the executors order a graph's
/// reads and writes, and set/get calls from one thread are ordered with graph computes they
/// precede or follow.
pub trait Buffer: Send + Sync + Any {
    fn buffer_type(&self) -> Arc<dyn BufferType>;
    fn size(&self) -> usize;
    /// Host address of byte 0, for host buffers whose memory CPU kernels may read and write.
    fn host_ptr(&self) -> Option<*mut u8> {
        None
    }
    /// (optional) Called once when a tensor is placed in the buffer (the meta buffer derives its
    /// split state here).
    fn init_tensor(&self, _name: &str, _layout: &Layout, _offset: usize) -> Result<()> {
        Ok(())
    }
    /// Write `data` into the tensor at `buf_offset`, starting `offset` bytes into its span.
    fn set_tensor(
        &self,
        layout: &Layout,
        buf_offset: usize,
        data: &[u8],
        offset: usize,
    ) -> Result<()>;
    /// Read `out.len()` bytes of the tensor at `buf_offset`, starting `offset` bytes into its span.
    fn get_tensor(
        &self,
        layout: &Layout,
        buf_offset: usize,
        out: &mut [u8],
        offset: usize,
    ) -> Result<()>;
    /// Fill `size` bytes of the tensor, starting `offset` bytes into its span, with `value`.
    fn memset_tensor(
        &self,
        layout: &Layout,
        buf_offset: usize,
        value: u8,
        offset: usize,
        size: usize,
    ) -> Result<()>;
    /// (optional) Copy a tensor from another buffer directly; `Ok(false)` if not possible.
    fn cpy_tensor(
        &self,
        _src: &dyn Buffer,
        _src_layout: &Layout,
        _src_offset: usize,
        _dst_layout: &Layout,
        _dst_offset: usize,
    ) -> Result<bool> {
        Ok(false)
    }
    /// Fill the whole buffer with `value`.
    fn clear(&self, value: u8);
    fn usage(&self) -> BufferUsage;
    fn set_usage(&self, usage: BufferUsage);
    fn as_any(&self) -> &dyn Any;
}

/// Where one tensor's bytes live.
#[derive(Clone)]
pub struct Storage {
    pub buffer: Arc<dyn Buffer>,
    pub offset: usize,
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}@{:p}+{}",
            self.buffer.buffer_type().name(),
            Arc::as_ptr(&self.buffer).cast::<u8>(),
            self.offset
        )
    }
}

impl Storage {
    pub fn new(buffer: Arc<dyn Buffer>, offset: usize) -> Self {
        Storage { buffer, offset }
    }

    /// Identity of the buffer (for caches keyed by storage).
    pub fn buffer_id(&self) -> usize {
        Arc::as_ptr(&self.buffer).cast::<u8>() as usize
    }

    pub fn set(&self, layout: &Layout, data: &[u8]) -> Result<()> {
        self.buffer.set_tensor(layout, self.offset, data, 0)
    }

    pub fn get(&self, layout: &Layout, out: &mut [u8]) -> Result<()> {
        self.buffer.get_tensor(layout, self.offset, out, 0)
    }

    /// The host address of the tensor's first byte, if the buffer is host memory.
    pub fn host_ptr(&self) -> Option<*mut u8> {
        // SAFETY: offset is within the buffer (checked when the storage was bound), so the
        // pointer stays inside the allocation.
        self.buffer
            .host_ptr()
            .map(|p| unsafe { p.add(self.offset) })
    }
}

/// `len` bytes of a buffer from `storage.offset`: a tensor's bytes on its device, as
/// collectives take them. A communicator reads the memory the way its devices can (host
/// pointers, device pointers, a transport), so no host slice is formed above it.
#[derive(Clone, Debug)]
pub struct BufferRange {
    pub storage: Storage,
    pub len: usize,
}

impl BufferRange {
    pub fn new(storage: Storage, len: usize) -> Self {
        BufferRange { storage, len }
    }

    /// The range as a host pointer, if the buffer is host memory and the range lies inside it;
    /// the error names the buffer type and the range.
    pub fn host_ptr(&self) -> Result<*mut u8> {
        let bt = || self.storage.buffer.buffer_type().name();
        let size = self.storage.buffer.size();
        if self
            .storage
            .offset
            .checked_add(self.len)
            .is_none_or(|end| end > size)
        {
            return Err(Error::OutOfBounds {
                what: format!("a byte range of a `{}` buffer", bt()),
                offset: self.storage.offset,
                size: self.len,
                capacity: size,
            });
        }
        self.storage.host_ptr().ok_or_else(|| Error::Device {
            device: bt(),
            reason: "this memory is not host memory; a host communicator cannot reach it".into(),
        })
    }
}

/// Check that `[buf_offset + offset, +len)` lies inside the tensor's span and the buffer.
pub fn check_range(
    what: &str,
    layout: &Layout,
    buf_offset: usize,
    offset: usize,
    len: usize,
    buf_size: usize,
) -> Result<()> {
    let span = layout.nbytes();
    let end = offset.checked_add(len);
    if end.is_none_or(|e| e > span) {
        return Err(Error::OutOfBounds {
            what: format!("{what}: tensor of {span} bytes"),
            offset,
            size: len,
            capacity: span,
        });
    }
    if buf_offset.checked_add(span).is_none_or(|e| e > buf_size) {
        return Err(Error::OutOfBounds {
            what: format!("{what}: tensor span in buffer"),
            offset: buf_offset,
            size: span,
            capacity: buf_size,
        });
    }
    Ok(())
}

/// Copy a tensor between two buffers of any types: directly if the destination can, else
/// through host memory. Layouts must have equal spans.
pub fn tensor_copy(
    src: &Storage,
    src_layout: &Layout,
    dst: &Storage,
    dst_layout: &Layout,
) -> Result<()> {
    let n = src_layout.nbytes();
    if n != dst_layout.nbytes() {
        return Err(Error::BufferTooSmall {
            what: "tensor_copy".into(),
            needed: n,
            available: dst_layout.nbytes(),
        });
    }
    if dst.buffer.cpy_tensor(
        src.buffer.as_ref(),
        src_layout,
        src.offset,
        dst_layout,
        dst.offset,
    )? {
        return Ok(());
    }
    let mut tmp = vec![0u8; n];
    src.get(src_layout, &mut tmp)?;
    dst.set(dst_layout, &tmp)
}
