//! Constructors of extents: an even split and a split by ratios (as `--tensor-split 3,1`), both in
//! whole units of a granularity (quantization blocks, heads, GQA groups), with the rounding
//! remainder rotated between devices (so layer l's extra units go to device `l mod n` first and
//! no device is always the one holding them).

use crate::{DType, Error, Result};

/// The unit extents are made of: whole blocks, whole heads, whole GQA groups...
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Granularity(pub usize);

impl Granularity {
    /// The unit a split along `axis` of a tensor of `dtype` keeps whole: the type's block
    /// (from the type table) on axis 0, where blocks lie, one element on the other axes.
    pub fn of_axis(dtype: DType, axis: usize) -> Granularity {
        Granularity(if axis == 0 { dtype.block_size() } else { 1 })
    }

    /// The least common multiple of two granularities (a slice that is whole in both).
    pub fn and(self, o: Granularity) -> Granularity {
        let (a, b) = (self.0.max(1), o.0.max(1));
        Granularity(a / gcd(a, b) * b)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn units(total: usize, g: Granularity, what: &str) -> Result<usize> {
    let g = g.0.max(1);
    if !total.is_multiple_of(g) {
        return Err(Error::invalid_argument(
            format!("{what}: extent"),
            total,
            format!("not a whole number of units of {g}"),
        ));
    }
    Ok(total / g)
}

/// `total` split over `n` devices as evenly as whole units allow; the `total/g mod n` leftover
/// units go one each to devices `rotation, rotation+1, ...` (mod n).
pub fn split_even(total: usize, n: usize, g: Granularity, rotation: usize) -> Result<Vec<usize>> {
    if n == 0 {
        return Err(Error::invalid_argument(
            "split_even: device count",
            n,
            "at least one device is needed",
        ));
    }
    let u = units(total, g, "split_even")?;
    let (base, rem) = (u / n, u % n);
    Ok((0..n)
        .map(|d| {
            let extra = usize::from((d + n - rotation % n) % n < rem);
            (base + extra) * g.0.max(1)
        })
        .collect())
}

/// `total` split in proportion to `ratios` (non-negative, not all zero), in whole units, by the
/// largest-remainder method; ties go to devices in rotated order.
pub fn split_ratios(
    total: usize,
    ratios: &[f64],
    g: Granularity,
    rotation: usize,
) -> Result<Vec<usize>> {
    let n = ratios.len();
    let sum: f64 = ratios.iter().sum();
    if n == 0 || !sum.is_finite() || sum <= 0.0 || ratios.iter().any(|r| !r.is_finite() || *r < 0.0)
    {
        return Err(Error::invalid_argument(
            "split ratios",
            format!("{ratios:?}"),
            "must be finite, non-negative and not all zero",
        ));
    }
    let u = units(total, g, "split_ratios")?;
    let exact: Vec<f64> = ratios.iter().map(|r| u as f64 * r / sum).collect();
    let mut out: Vec<usize> = exact.iter().map(|x| x.floor() as usize).collect();
    let mut left = u - out.iter().sum::<usize>();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        let fa = exact[a] - exact[a].floor();
        let fb = exact[b] - exact[b].floor();
        let ra = (a + n - rotation % n) % n;
        let rb = (b + n - rotation % n) % n;
        fb.partial_cmp(&fa)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(ra.cmp(&rb))
    });
    for &d in order
        .iter()
        .filter(|&&d| ratios[d] > 0.0)
        .cycle()
        .take(left)
    {
        out[d] += 1;
        left -= 1;
    }
    debug_assert_eq!(left, 0);
    Ok(out.into_iter().map(|x| x * g.0.max(1)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_splits_rotate_the_remainder() {
        let g = Granularity(64);
        // 9 heads of 64 over 2 devices: 5 + 4, then 4 + 5 on the next layer.
        assert_eq!(split_even(576, 2, g, 0).unwrap(), vec![320, 256]);
        assert_eq!(split_even(576, 2, g, 1).unwrap(), vec![256, 320]);
        // 3 GQA groups over 4 devices: one device gets none.
        assert_eq!(
            split_even(3, 4, Granularity(1), 0).unwrap(),
            vec![1, 1, 1, 0]
        );
        assert_eq!(
            split_even(3, 4, Granularity(1), 2).unwrap(),
            vec![1, 0, 1, 1]
        );
        assert!(split_even(100, 2, Granularity(32), 0).is_err());
    }

    #[test]
    fn ratio_splits_are_whole_units_and_sum() {
        let v = split_ratios(1536, &[3.0, 1.0], Granularity(32), 0).unwrap();
        assert_eq!(v, vec![1152, 384]);
        let v = split_ratios(3, &[1.0, 1.0], Granularity(1), 0).unwrap();
        assert_eq!(v, vec![2, 1]);
        let v = split_ratios(3, &[1.0, 1.0], Granularity(1), 1).unwrap();
        assert_eq!(v, vec![1, 2]);
        let v = split_ratios(10, &[0.0, 1.0, 1.0], Granularity(1), 0).unwrap();
        assert_eq!(v, vec![0, 5, 5]);
        assert!(split_ratios(10, &[0.0, 0.0], Granularity(1), 0).is_err());
        // Finite ratios whose sum is not: an error, not a split of NaN shares.
        assert!(split_ratios(10, &[f64::MAX, f64::MAX], Granularity(1), 0).is_err());
        assert_eq!(Granularity(64).and(Granularity(32)), Granularity(64));
        // Blocks come from the type: the test builds' fake type has blocks of 16.
        assert_eq!(Granularity::of_axis(DType::Q4_0, 0), Granularity(32));
        assert_eq!(Granularity::of_axis(DType::FakeQ4x16, 0), Granularity(16));
        assert_eq!(Granularity::of_axis(DType::Q4_0, 1), Granularity(1));
        assert_eq!(Granularity::of_axis(DType::F16, 0), Granularity(1));
        let g = Granularity::of_axis(DType::FakeQ4x16, 0);
        assert_eq!(split_even(80, 2, g, 0).unwrap(), vec![48, 32]);
        assert_eq!(Granularity(192).and(Granularity(32)), Granularity(192));
    }
}
