//! ggml's non-linear 4-bit types: IQ4_NL (blocks of 32, one f16 scale) and IQ4_XS
//! (super-blocks of 256, an f16 scale and 6-bit signed scales per 32), whose 4-bit indices
//! select one of 16 fixed values (`kvalues_iq4nl`) instead of an evenly spaced level.
//!
//! Layouts and the codebook after ggml-org/ggml `ggml-common.h` (`block_iq4_nl`,
//! `block_iq4_xs`, `kvalues_iq4nl`); dequantizers and quantizers after `ggml-quants.c`
//! (`dequantize_row_iq4_nl`, `dequantize_row_iq4_xs`, `quantize_row_iq4_nl_impl` as
//! `quantize_row_iq4_nl_ref` and `quantize_row_iq4_xs_ref` call it, without importance
//! weights), written from the algorithms in the same f32 operations in the same order.
//! Within each 32 elements, byte j holds element j in its low nibble and j + 16 in its high.

use super::formats::GgmlBlock;
use super::kquants::{QK_K, zeroed};
use super::kscales::{GROUP_MAX_EPS, nearest_int, signed_amax};
use super::pod::Pod;
use half::f16;

/// Elements per `block_iq4_nl` (ggml-common.h `QK4_NL`).
pub const QK4_NL: usize = 32;

/// The 16 values an IQ4 index selects (ggml-common.h `kvalues_iq4nl`).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// `block_iq4_nl`: 18 bytes; x = d * KVALUES_IQ4NL[q].
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockIq4Nl {
    pub d: f16,
    pub qs: [u8; QK4_NL / 2],
}

/// `block_iq4_xs`: 136 bytes; x = d * (scale - 32) * KVALUES_IQ4NL[q] with a 6-bit scale per
/// 32 elements: low 4 bits of scale g in `scales_l[g / 2]` (nibble g % 2), top 2 bits in
/// `scales_h` at bit 2g.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockIq4Xs {
    pub d: f16,
    pub scales_h: u16,
    pub scales_l: [u8; QK_K / 64],
    pub qs: [u8; QK_K / 2],
}

const _: () = assert!(std::mem::size_of::<BlockIq4Nl>() == 18);
const _: () = assert!(std::mem::size_of::<BlockIq4Xs>() == 136);

// SAFETY: repr(C) of f16/u16/u8 fields with the sizes asserted above equal to the sums of the
// fields (no padding); every bit pattern is a valid f16, u16 or u8.
unsafe impl Pod for BlockIq4Nl {}
// SAFETY: as above.
unsafe impl Pod for BlockIq4Xs {}

impl Default for BlockIq4Xs {
    fn default() -> Self {
        zeroed()
    }
}

/// The codebook value of element j of 32 packed indices.
fn value(qs: &[u8], j: usize) -> f32 {
    let q = if j < 16 {
        qs[j] & 0x0f
    } else {
        qs[j - 16] >> 4
    };
    KVALUES_IQ4NL[q as usize] as f32
}

/// ggml's `best_index_int8`: the index of the codebook value nearest `x` (the upper one on
/// ties), by bisection.
fn best_index(x: f32) -> u8 {
    let v = |i: usize| KVALUES_IQ4NL[i] as f32;
    if x <= v(0) {
        return 0;
    }
    if x >= v(15) {
        return 15;
    }
    let (mut lo, mut hi) = (0, 15);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < v(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - v(hi - 1) < v(hi) - x {
        hi as u8 - 1
    } else {
        hi as u8
    }
}

/// The weighted sums of `q x` and `q q` (weights x^2) of the indices of `x * id`, and the
/// indices.
fn fit(xb: &[f32], id: f32, l: &mut [u8]) -> (f32, f32) {
    let (mut sumqx, mut sumq2) = (0f32, 0f32);
    for (l, &x) in l.iter_mut().zip(xb) {
        *l = best_index(id * x);
        let q = KVALUES_IQ4NL[*l as usize] as f32;
        let w = x * x;
        sumqx += w * q * x;
        sumq2 += w * q * q;
    }
    (sumqx, sumq2)
}

/// The scale of one group of 32 (`quantize_row_iq4_nl_impl`'s inner loop): the scale that
/// maps the value of largest magnitude to the codebook's end, its least-squares refinement,
/// then `2 ntry + 1` starting scales `(itry + kvalues[0]) / max`, keeping the best. Its
/// indices are left in `l` (the first fit's; ggml's do not follow the search either).
/// `None` for a group of zeros (indices untouched).
fn group_scale(xb: &[f32], ntry: i32, l: &mut [u8]) -> Option<f32> {
    let (max, amax) = signed_amax(xb);
    if amax < GROUP_MAX_EPS {
        return None;
    }
    let k0 = KVALUES_IQ4NL[0] as f32;
    let d = if ntry > 0 { -max / k0 } else { max / k0 };
    let (sumqx, sumq2) = fit(xb, 1.0 / d, l);
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    let mut scratch = [0u8; 32];
    for itry in -ntry..=ntry {
        let id = (itry + KVALUES_IQ4NL[0] as i32) as f32 / max;
        let (sumqx, sumq2) = fit(xb, id, &mut scratch[..xb.len()]);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    Some(d)
}

/// Packs indices of groups of 32: byte j of each group holds j (low) and j + 16 (high).
fn pack(l: &[u8], qs: &mut [u8]) {
    for (q, l) in qs.chunks_exact_mut(16).zip(l.chunks_exact(32)) {
        for j in 0..16 {
            q[j] = l[j] | (l[j + 16] << 4);
        }
    }
}

impl GgmlBlock for BlockIq4Nl {
    const BLOCK: usize = QK4_NL;

    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (j, o) in out.iter_mut().enumerate().take(QK4_NL) {
            *o = d * value(&self.qs, j);
        }
    }

    /// `quantize_row_iq4_nl_ref` (`ntry` = -1: the first fit, no search). A block of zeros is
    /// d = 0 with zero indices (ggml leaves its indices unwritten).
    fn quantize(x: &[f32]) -> Self {
        let mut l = [0u8; QK4_NL];
        let d = group_scale(x, -1, &mut l).unwrap_or(0.0);
        let mut b = BlockIq4Nl {
            d: f16::from_f32(d),
            ..Default::default()
        };
        pack(&l, &mut b.qs);
        b
    }
}

impl GgmlBlock for BlockIq4Xs {
    const BLOCK: usize = QK_K;

    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (g, o) in out.chunks_exact_mut(32).take(QK_K / 32).enumerate() {
            let low = (self.scales_l[g / 2] >> (4 * (g % 2))) & 0x0f;
            let high = ((self.scales_h >> (2 * g)) & 3) as u8;
            let dl = d * ((low | (high << 4)) as i32 - 32) as f32;
            let qs = &self.qs[16 * g..16 * g + 16];
            for (j, o) in o.iter_mut().enumerate() {
                *o = dl * value(qs, j);
            }
        }
    }

    /// `quantize_row_iq4_xs_ref` (`quantize_row_iq4_nl_impl` with `ntry` = 7): a scale per 32
    /// by `group_scale`, those scales to signed 6 bits against the one of largest magnitude,
    /// then every index again from its stored scale.
    fn quantize(x: &[f32]) -> Self {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; QK_K / 32];
        for (g, s) in scales.iter_mut().enumerate() {
            let r = 32 * g..32 * g + 32;
            *s = group_scale(&x[r.clone()], 7, &mut l[r]).unwrap_or(0.0);
        }
        let (max_scale, _) = signed_amax(&scales);
        let d = -max_scale / 32.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut b = BlockIq4Xs {
            d: f16::from_f32(d),
            ..Default::default()
        };
        for (g, &s) in scales.iter().enumerate() {
            let ls = nearest_int(id * s).clamp(-32, 31);
            let dl = d * ls as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            for i in 32 * g..32 * g + 32 {
                l[i] = best_index(idl * x[i]);
            }
            let ls = (ls + 32) as u8;
            b.scales_l[g / 2] |= (ls & 0x0f) << (4 * (g % 2));
            b.scales_h |= u16::from(ls >> 4) << (2 * g);
        }
        pack(&l, &mut b.qs);
        b
    }
}
