//! Host memory, backend-neutral: `HostBufferType` (64-byte aligned, zero-initialized
//! allocations) and `HostBuffer`, with bounds-checked tensor reads and writes. The CPU backend
//! computes in it (as `cpu::CpuBufferType`, named "CPU"), and the scheduler stages copies
//! between backends in it.

use super::{Buffer, BufferType, BufferUsage, check_range};
use crate::tensor::Layout;
use crate::{Error, Result};
use parking_lot::Mutex;
use std::any::Any;
use std::sync::Arc;

/// Alignment of host buffers and of tensors in them: one cache line, enough for AVX-512 loads.
pub const HOST_ALIGN: usize = 64;

/// Aligned host memory. Its name is "CPU", the CPU backend's buffer type (which it is).
#[derive(Debug, Default)]
pub struct HostBufferType;

impl BufferType for HostBufferType {
    fn name(&self) -> String {
        "CPU".into()
    }

    fn alloc_buffer(&self, size: usize) -> Result<Arc<dyn Buffer>> {
        Ok(Arc::new(HostBuffer::new(size)?))
    }

    fn alignment(&self) -> usize {
        HOST_ALIGN
    }

    fn max_size(&self) -> usize {
        isize::MAX as usize - HOST_ALIGN
    }

    fn is_host(&self) -> bool {
        true
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// One aligned host allocation.
pub struct HostBuffer {
    ptr: *mut u8,
    size: usize,
    layout: std::alloc::Layout,
    usage: Mutex<BufferUsage>,
}

// SAFETY: the buffer owns its allocation exclusively; the raw pointer is only an address. Access
// to the bytes follows the `Buffer` concurrency contract (callers order conflicting accesses);
// the copies done by the methods below are bounds-checked.
unsafe impl Send for HostBuffer {}
// SAFETY: as for `Send`: shared references only hand out the address or do checked copies.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// A zeroed buffer of `size` bytes (at least one byte is reserved so the pointer is real).
    pub fn new(size: usize) -> Result<Self> {
        let fail = |reason: &str| Error::AllocFailed {
            buffer_type: "CPU".into(),
            size,
            reason: reason.into(),
        };
        let layout = std::alloc::Layout::from_size_align(size.max(1), HOST_ALIGN)
            .map_err(|_| fail("size exceeds the address space"))?;
        // SAFETY: the layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(fail("the system allocator refused (out of memory)"));
        }
        Ok(HostBuffer {
            ptr,
            size,
            layout,
            usage: Mutex::new(BufferUsage::Any),
        })
    }

    fn span(
        &self,
        layout: &Layout,
        buf_offset: usize,
        offset: usize,
        len: usize,
        what: &str,
    ) -> Result<*mut u8> {
        check_range(what, layout, buf_offset, offset, len, self.size)?;
        // SAFETY: check_range proved buf_offset + offset + len <= size.
        Ok(unsafe { self.ptr.add(buf_offset + offset) })
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated with exactly this layout and is freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

impl Buffer for HostBuffer {
    fn buffer_type(&self) -> Arc<dyn BufferType> {
        Arc::new(HostBufferType)
    }

    fn size(&self) -> usize {
        self.size
    }

    fn host_ptr(&self) -> Option<*mut u8> {
        Some(self.ptr)
    }

    fn set_tensor(
        &self,
        layout: &Layout,
        buf_offset: usize,
        data: &[u8],
        offset: usize,
    ) -> Result<()> {
        let p = self.span(layout, buf_offset, offset, data.len(), "set_tensor")?;
        // SAFETY: the range is inside the allocation (checked); `data` is a separate borrow so
        // the regions cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Ok(())
    }

    fn get_tensor(
        &self,
        layout: &Layout,
        buf_offset: usize,
        out: &mut [u8],
        offset: usize,
    ) -> Result<()> {
        let p = self.span(layout, buf_offset, offset, out.len(), "get_tensor")?;
        // SAFETY: as in set_tensor.
        unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn memset_tensor(
        &self,
        layout: &Layout,
        buf_offset: usize,
        value: u8,
        offset: usize,
        size: usize,
    ) -> Result<()> {
        let p = self.span(layout, buf_offset, offset, size, "memset_tensor")?;
        // SAFETY: the range is inside the allocation (checked).
        unsafe { std::ptr::write_bytes(p, value, size) };
        Ok(())
    }

    fn cpy_tensor(
        &self,
        src: &dyn Buffer,
        src_layout: &Layout,
        src_offset: usize,
        dst_layout: &Layout,
        dst_offset: usize,
    ) -> Result<bool> {
        let Some(sp) = src.host_ptr() else {
            return Ok(false);
        };
        let n = src_layout.nbytes();
        check_range(
            "cpy_tensor (source)",
            src_layout,
            src_offset,
            0,
            n,
            src.size(),
        )?;
        let dp = self.span(dst_layout, dst_offset, 0, n, "cpy_tensor (destination)")?;
        // SAFETY: both ranges are inside their allocations (checked); `copy` allows overlap.
        unsafe { std::ptr::copy(sp.add(src_offset), dp, n) };
        Ok(true)
    }

    fn clear(&self, value: u8) {
        // SAFETY: the whole allocation is `size` bytes (at least).
        unsafe { std::ptr::write_bytes(self.ptr, value, self.size) };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn reads_and_writes_are_bounds_checked() {
        let b = HostBuffer::new(64).unwrap();
        let l = Layout::contiguous(DType::F32, [8, 1, 1, 1]);
        b.set_tensor(&l, 32, &[1u8; 32], 0).unwrap();
        let mut out = [0u8; 4];
        b.get_tensor(&l, 32, &mut out, 28).unwrap();
        assert_eq!(out, [1; 4]);
        // Past the tensor's span.
        assert!(b.set_tensor(&l, 32, &[1u8; 8], 28).is_err());
        // Tensor span past the buffer's end.
        assert!(b.get_tensor(&l, 40, &mut out, 0).is_err());
        assert_eq!(b.host_ptr().unwrap() as usize % HOST_ALIGN, 0);
    }

    #[test]
    fn impossible_allocation_is_an_error() {
        let err = HostBufferType
            .alloc_buffer(usize::MAX / 2)
            .err()
            .expect("must fail");
        assert!(err.to_string().contains("cannot allocate"), "{err}");
    }
}
