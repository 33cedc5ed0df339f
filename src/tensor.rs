//! Tensor layouts: `Layout` (dtype, `ne[4]` element counts in ggml order with `ne[0]`
//! contiguous, `nb[4]` byte strides) and the arithmetic on them (bytes, contiguity, views,
//! permutations). A layout says nothing about where the bytes are; see `graph::Storage`.

use crate::{DType, Error, Result};

/// Shape and strides of one tensor. For quantized dtypes, `nb[0]` is the bytes of one block and
/// `ne[0]` counts elements (a multiple of the block size).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    pub dtype: DType,
    pub ne: [usize; 4],
    pub nb: [usize; 4],
}

impl Layout {
    /// A packed layout: rows of `ne[0]` elements, then `ne[1]` rows, and so on.
    pub fn contiguous(dtype: DType, ne: [usize; 4]) -> Layout {
        Layout {
            dtype,
            ne,
            nb: contiguous_strides(dtype, ne),
        }
    }

    pub fn nelements(&self) -> usize {
        self.ne.iter().product()
    }

    pub fn nrows(&self) -> usize {
        self.ne[1] * self.ne[2] * self.ne[3]
    }

    /// Bytes of one packed row of `ne[0]` elements.
    pub fn row_size(&self) -> usize {
        self.dtype.row_size(self.ne[0])
    }

    /// Bytes spanned from the first to one past the last element (ggml's `ggml_nbytes`):
    /// what a buffer must hold for this tensor. Zero if any extent is zero.
    pub fn nbytes(&self) -> usize {
        if self.ne.contains(&0) {
            return 0;
        }
        let bs = self.dtype.block_size();
        if bs == 1 {
            let mut n = self.dtype.type_size();
            for i in 0..4 {
                n += (self.ne[i] - 1) * self.nb[i];
            }
            n
        } else {
            let mut n = self.ne[0] / bs * self.nb[0];
            for i in 1..4 {
                n += (self.ne[i] - 1) * self.nb[i];
            }
            n
        }
    }

    /// Packed in ggml order without gaps (dims of extent 1 may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expect = self.dtype.type_size();
        if self.ne[0] != self.dtype.block_size() && self.nb[0] != expect {
            return false;
        }
        expect = self.row_size();
        for i in 1..4 {
            if self.ne[i] != 1 && self.nb[i] != expect {
                return false;
            }
            expect *= self.ne[i];
        }
        true
    }

    /// Elements within a row are packed (`nb[0]` is one element or one block).
    pub fn rows_contiguous(&self) -> bool {
        self.nb[0] == self.dtype.type_size() || self.ne[0] <= self.dtype.block_size()
    }

    /// The layout with axes moved: output axis `axes[i]` is input axis `i` (ggml_permute).
    pub fn permute(&self, axes: [usize; 4]) -> Result<Layout> {
        let mut seen = [false; 4];
        for &a in &axes {
            if a > 3 || seen[a] {
                return Err(Error::invalid_op(
                    "permute",
                    format!("axes {axes:?} are not a permutation of 0..4"),
                ));
            }
            seen[a] = true;
        }
        let mut ne = [0; 4];
        let mut nb = [0; 4];
        for i in 0..4 {
            ne[axes[i]] = self.ne[i];
            nb[axes[i]] = self.nb[i];
        }
        Ok(Layout {
            dtype: self.dtype,
            ne,
            nb,
        })
    }

    pub fn shape(&self) -> crate::Shape {
        crate::Shape(self.ne)
    }
}

/// Strides of a packed tensor of this dtype and shape.
pub fn contiguous_strides(dtype: DType, ne: [usize; 4]) -> [usize; 4] {
    let nb0 = dtype.type_size();
    let nb1 = dtype.row_size(ne[0]);
    let nb2 = nb1 * ne[1];
    let nb3 = nb2 * ne[2];
    [nb0, nb1, nb2, nb3]
}

/// `b` can be broadcast to `a`: each extent of `b` divides the matching extent of `a`
/// (ggml's `ggml_can_repeat`). A zero extent only broadcasts to zero.
pub fn can_repeat(b: &[usize; 4], a: &[usize; 4]) -> bool {
    (0..4).all(|i| {
        if b[i] == 0 {
            a[i] == 0
        } else {
            a[i].is_multiple_of(b[i])
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nbytes_and_contiguity() {
        let l = Layout::contiguous(DType::F32, [3, 4, 5, 1]);
        assert_eq!(l.nb, [4, 12, 48, 240]);
        assert_eq!(l.nbytes(), 240);
        assert!(l.is_contiguous());
        let t = l.permute([1, 0, 2, 3]).unwrap();
        assert_eq!(t.ne, [4, 3, 5, 1]);
        assert!(!t.is_contiguous());
        assert_eq!(t.nbytes(), 240);
        let q = Layout::contiguous(DType::Q4_0, [64, 2, 1, 1]);
        assert_eq!(q.nb, [18, 36, 72, 72]);
        assert_eq!(q.nbytes(), 72);
        assert_eq!(Layout::contiguous(DType::F16, [0, 4, 1, 1]).nbytes(), 0);
        assert!(l.permute([0, 0, 1, 2]).is_err());
    }

    #[test]
    fn repeat_rules() {
        assert!(can_repeat(&[3, 1, 1, 1], &[3, 4, 5, 1]));
        assert!(!can_repeat(&[2, 1, 1, 1], &[3, 4, 5, 1]));
        assert!(can_repeat(&[0, 1, 1, 1], &[0, 4, 1, 1]));
        assert!(!can_repeat(&[0, 1, 1, 1], &[3, 4, 1, 1]));
    }
}
