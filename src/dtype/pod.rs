//! Byte views: the `Pod` marker for plain-old-data element and block types, and checked casts
//! between byte slices and slices of them.

use super::formats::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1};
use crate::{Error, Result};
use half::{bf16, f16};

/// Marker for plain-old-data block types that may be viewed from raw bytes.
///
/// # Safety
/// Implementors are `repr(C)`, have no padding and accept any bit pattern.
pub unsafe trait Pod: Copy + 'static {}
// SAFETY: each is repr(C) of f16/i8/u8 fields with sizes asserted in `formats.rs` (no padding),
// and every bit pattern is a valid f16, i8 or u8.
unsafe impl Pod for BlockQ8_0 {}
// SAFETY: as above.
unsafe impl Pod for BlockQ4_0 {}
// SAFETY: as above.
unsafe impl Pod for BlockQ4_1 {}
// SAFETY: as above.
unsafe impl Pod for BlockQ8_1 {}
// SAFETY: as above.
unsafe impl Pod for BlockQ5_0 {}
// SAFETY: as above.
unsafe impl Pod for BlockQ5_1 {}
// SAFETY: primitive numeric types accept every bit pattern and have no padding.
unsafe impl Pod for f32 {}
// SAFETY: as above.
unsafe impl Pod for f16 {}
// SAFETY: as above.
unsafe impl Pod for bf16 {}
// SAFETY: as above.
unsafe impl Pod for i32 {}
// SAFETY: as above.
unsafe impl Pod for u8 {}
// SAFETY: as above.
unsafe impl Pod for i8 {}

fn byte_view_error<T>(bytes: &[u8]) -> Error {
    Error::ByteView {
        len: bytes.len(),
        addr: bytes.as_ptr() as usize,
        elem: std::any::type_name::<T>(),
        size: std::mem::size_of::<T>(),
        align: std::mem::align_of::<T>(),
    }
}

/// View bytes as a slice of `T`. Errors if the length is not a multiple of `size_of::<T>()` or
/// the pointer is misaligned for `T`.
pub fn cast_slice<T: Pod>(bytes: &[u8]) -> Result<&[T]> {
    let sz = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(sz)
        || !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        return Err(byte_view_error::<T>(bytes));
    }
    // SAFETY: length and alignment checked above; T is Pod so any bytes are a valid T.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / sz) })
}

/// Mutable version of [`cast_slice`].
pub fn cast_slice_mut<T: Pod>(bytes: &mut [u8]) -> Result<&mut [T]> {
    let sz = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(sz)
        || !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
    {
        return Err(byte_view_error::<T>(bytes));
    }
    // SAFETY: length and alignment checked above; T is Pod so any bytes are a valid T, and the
    // exclusive borrow of `bytes` is moved into the result.
    Ok(unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<T>(), bytes.len() / sz) })
}

/// View a slice of `T` as bytes.
pub fn as_bytes<T: Pod>(v: &[T]) -> &[u8] {
    // SAFETY: T is Pod (no padding), so all its bytes are initialized.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Mutable byte view of a slice of `T`.
pub fn as_bytes_mut<T: Pod>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: T is Pod: every byte pattern written through the view is a valid T.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}
