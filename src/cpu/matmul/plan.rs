//! The plan of one `mul_mat` node: the path (which kernels), the form src1 takes in the shared
//! scratch, the scratch sizes and the work items, decided identically by every thread and by
//! `work_size` before any data is touched.

use super::klimb::{self, LimbLayout};
use super::kquant::KActLayout;
use super::quant::ActLayout;
use super::{FloatW, KQuantW, LowW, Precision, QuantW, Weights};
use crate::cpu::simd::Isa;
use crate::cpu::view::TensorView;

/// Whether `m` activation rows of length `k` go to the packed GEMM (the `gemm` crate) rather
/// than the register-tiled kernels. Measured on Zen 4 with the AVX-512 tiles, F32 weights,
/// N and K in 1024..4096, 1 and 2 threads (docs/kernels.md): the tiles are 1.3-1.9x faster at
/// M = 128 and 256 (they read each weight once, the GEMM packs them), about even at M = 512,
/// the GEMM 1.1-1.3x faster from M = 1024; at K = 64 (attention heads) the GEMM wins from
/// M = 64. The rule does not depend on the SIMD level so that `work_size` and `forward_with`
/// at any level agree on the scratch.
pub(super) fn use_gemm(m: usize, k: usize) -> bool {
    m >= 512 || (m >= 64 && k <= 64)
}
/// Largest M (activation rows per batch) multiplied by the fused kernels ([`qf32`](super::qf32),
/// [`kf32`](super::kf32), [`lowf32`](super::lowf32)) when quantized weights meet f32
/// activations; larger M dequantizes chunks of weight rows into scratch once and uses the
/// wider f32 tiles (the `Convert` path).
///
/// Per weight type on AVX2, measured (2026-11-27, Zen 2, 2 threads, `bench ops --precision
/// exact`, 4096 x 4096 and 4096 x 14336, convert time / fused time): Q8_0 1.31-1.95x at
/// M = 3..8 (fused to 8); Q4_0 1.00-1.26x at M <= 4, 0.73-0.95x from 5; Q4_1 1.03-1.40x to 5,
/// 0.89-0.98x from 6; Q4_K 0.91-0.98x at 3, 1.05-1.11x at 4, 0.67-0.76x from 5; Q3_K, Q5_1,
/// IQ4_NL, IQ4_XS 1.15-1.73x at M = 2 and 0.55-0.96x at 3, down to 0.51-0.69x at 8 (the
/// fused tiles redo a block's decoding for every 4 rows; the converted rows are decoded once
/// and then reused by every row). Since the fused tiles widen decoded bytes from memory
/// (`kf32::avx2::decode_ahead`, second session of 2026-11-27, K = N = 4096): Q5_0 1.04x at
/// 3 and 1.17x at 4, Q5_K 1.07x at 4, Q6_K 1.02x at 3 and 1.20x at 4, Q2_K 1.17x at 3 and
/// 1.31x at 4, all 0.77-0.94x from 5, so those four fuse to 4.
///
/// On AVX-512, measured (2026-11-28, Xeon with AVX-512, 4096 x 4096, `bench ops --no-rotate`, the
/// fused and the convert path alternated, medians of two rounds, convert time / fused time, 2
/// threads; 1 thread in brackets): the eight types not ahead at 9 below are ahead at M = 2..4
/// (1.1-3.0x) and at 8 (1.0-1.3x; Q3_K and IQ4_XS behind at 6, 0.80x and 0.76x); past 8, Q4_1 1.74x
/// at 9, 1.25x [1.45x] at 16, 1.03x [1.28x] at 32, 1.00x at 64 [0.96x at 48]; Q4_0 1.53x at 9,
/// 1.11x [1.49x] at 24, 1.07x [0.92x] at 32; Q8_0 1.45x at 9, 1.08x [1.51x] at 16, 1.05x [0.94x] at
/// 24; Q4_K 1.29x at 9, 1.19x [1.33x] at 16, 1.06x [0.93x] at 24; Q5_K 1.17x [1.05x] at 12, 0.94x
/// [0.88x] at 16; the rest 0.76-1.07x at 9 (Q5_0 1.07x, Q2_K 1.04x, IQ4_NL 1.03x; Q6_K, Q3_K, Q5_1,
/// IQ4_XS 0.76-0.88x), so they keep 8. Each type fuses up to the last M where both thread counts
/// gain. Until then every M from 9 took the convert path: 1.1-1.7x slower at M = 9..16 for the
/// common types (a batch of 9 to 16 sequences, a prompt's micro-batch). The scalar fallback keeps
/// 8. The level is the machine's ([`Isa::detect`]), not the one a kernel is forced to, so
/// `work_size` and `forward_with` agree on the scratch.
pub(super) fn fused_max_m(w: Weights) -> usize {
    match Isa::detect() {
        Isa::Avx2 => match w {
            Weights::Quant(QuantW::Q8_0) => 8,
            Weights::Quant(QuantW::Q4_1) => 5,
            Weights::Quant(QuantW::Q4_0 | QuantW::Q5_0)
            | Weights::KQuant(KQuantW::Q4_K | KQuantW::Q5_K | KQuantW::Q6_K)
            | Weights::Low(LowW::Q2_K) => 4,
            _ => 2,
        },
        Isa::Avx512 => match w {
            Weights::Quant(QuantW::Q4_1) => 32,
            Weights::Quant(QuantW::Q4_0) => 24,
            Weights::Quant(QuantW::Q8_0) | Weights::KQuant(KQuantW::Q4_K) => 16,
            Weights::KQuant(KQuantW::Q5_K) => 12,
            _ => 8,
        },
        Isa::Scalar => 8,
    }
}

/// Activation rows the fused kernels multiply per pass over an item's weights: as many as
/// fit in 256 KiB of f32 (a quarter of a Zen 4 L2), 8 to 64, a multiple of 4 (the tile width).
pub(super) fn fused_chunk_m(k: usize) -> usize {
    ((256 << 10) / (4 * k.max(1))).clamp(8, 64) / 4 * 4
}

/// Weight rows per work item are a multiple of this (keeps tiles whole).
pub(super) const TILE_N: usize = 16;
/// Per-thread scratch for weights converted to f32 before a GEMM call.
pub(super) const CONV_BYTES: usize = 2 << 20;
/// Rows converted at a time for the small-M exact-mode path.
pub(super) const CONV_ROWS_SMALL: usize = 16;
/// Quantized activation rows multiplied per pass over an item's weights.
pub(super) const Q_CHUNK_M: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Path {
    /// dst has no elements.
    Nothing,
    /// K == 0: every output is an empty sum.
    Zero,
    /// Float tiles of `wt`, or the GEMM (then `wt` is F32), reading the weights in place.
    Direct { wt: FloatW, gemm: bool },
    /// Weights of `w` converted to f32 chunk by chunk in per-thread scratch, then float tiles
    /// or the GEMM.
    Convert { w: Weights, gemm: bool },
    /// Quantized weights dequantized in registers, f32 activations ([`qf32`](super::qf32)).
    Fused(QuantW),
    /// Integer kernels on quantized activations.
    Quant(QuantW),
    /// K-quant weights dequantized in registers, f32 activations ([`kf32`](super::kf32)).
    KFused(KQuantW),
    /// K-quant integer kernels on Q8_K activations ([`kquant`](super::kquant)).
    KQuant(KQuantW),
    /// Q2_K, Q3_K, IQ4 or Q5_1 weights decoded in registers, f32 activations, M <= [`fused_max_m`]
    /// ([`lowf32`](super::lowf32)).
    LowFused(LowW),
    /// Their integer kernels on Q8_K (256-element types) or Q8_1-style (blocks of 32)
    /// activations ([`lowq8`](super::lowq8)).
    LowQuant(LowW),
}

#[derive(Clone, Copy, Debug)]
pub(super) enum Src1 {
    /// The kernels read src1 in place (f32 rows, strides multiples of 4).
    Direct,
    /// Gathered into contiguous rows of `ld` f32 in the shared scratch.
    Gather { ld: usize },
    /// Quantized into the shared scratch.
    Quant(ActLayout),
    /// Quantized to Q8_K into the shared scratch.
    KQuant(KActLayout),
}

/// Everything `forward` decides before touching data; computed identically by every thread and
/// by `work_size`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Plan {
    pub(super) path: Path,
    pub(super) src1: Src1,
    pub(super) nth: usize,
    pub(super) k: usize,
    pub(super) n: usize,
    pub(super) m: usize,
    pub(super) ne12: usize,
    pub(super) r2: usize,
    pub(super) r3: usize,
    /// Shared scratch bytes (src1 gathered or quantized), a multiple of 64.
    pub(super) shared: usize,
    /// Per-thread scratch bytes (converted weights, or activation limbs), a multiple of 64.
    pub(super) per_thread: usize,
    /// K-quant products with f32 activations that go through integer limbs
    /// ([`klimb`](super::klimb)): their layout, made per item in the per-thread scratch.
    pub(super) limbs: Option<LimbLayout>,
    /// Weight rows converted per step, and their f32 row stride.
    pub(super) conv_rows: usize,
    pub(super) conv_ld: usize,
    /// Work items: batches x `cn` chunks of `bn` weight rows x `cm` chunks of `bm` rows of src1.
    pub(super) items: usize,
    pub(super) bn: usize,
    pub(super) cn: usize,
    pub(super) bm: usize,
    pub(super) cm: usize,
}

impl Plan {
    pub(super) fn new(
        w: Weights,
        src0: &TensorView,
        src1: &TensorView,
        dst: &TensorView,
        nth: usize,
        precision: Precision,
    ) -> Plan {
        let [k, n, ne02, ne03] = src0.ne;
        let [_, m, ne12, ne13] = src1.ne;
        let batches = ne12 * ne13;
        let gemm = use_gemm(m, k);
        let f32_rows = w == Weights::Float(FloatW::F32) && src0.nb[1..].iter().all(|b| b % 4 == 0);
        let path = if dst.nelements() == 0 {
            Path::Nothing
        } else if k == 0 {
            Path::Zero
        } else {
            match w {
                Weights::Quant(q) if precision == Precision::Q8 => Path::Quant(q),
                Weights::Quant(q) if m <= fused_max_m(w) => Path::Fused(q),
                Weights::KQuant(q) if precision == Precision::Q8 => Path::KQuant(q),
                Weights::KQuant(q) if m <= fused_max_m(w) => Path::KFused(q),
                Weights::Float(wt) if !gemm || f32_rows => Path::Direct { wt, gemm },
                Weights::Low(q) if precision == Precision::Q8 => Path::LowQuant(q),
                Weights::Low(q) if m <= fused_max_m(w) => Path::LowFused(q),
                Weights::Quant(_) | Weights::KQuant(_) | Weights::Float(_) | Weights::Low(_) => {
                    Path::Convert { w, gemm }
                }
            }
        };
        let rows1 = m * batches;
        let src1_direct = src1.nb[0] == 4 && src1.nb[1..].iter().all(|b| b % 4 == 0);
        let (src1_mode, shared) = match path {
            Path::Quant(q) => {
                let lay = ActLayout::with_vectors(k, q);
                (Src1::Quant(lay), rows1 * lay.row_bytes)
            }
            Path::KQuant(_) => {
                let lay = KActLayout::new(k);
                (Src1::KQuant(lay), rows1 * lay.row_bytes)
            }
            Path::LowQuant(q) if super::lowq8::k_act(q) => {
                let lay = KActLayout::new(k);
                (Src1::KQuant(lay), rows1 * lay.row_bytes)
            }
            Path::LowQuant(_) => {
                let lay = ActLayout::new(k);
                (Src1::Quant(lay), rows1 * lay.row_bytes)
            }
            Path::Direct { .. }
            | Path::Convert { .. }
            | Path::Fused(_)
            | Path::KFused(_)
            | Path::LowFused(_)
                if !src1_direct =>
            {
                let ld = k.next_multiple_of(16);
                (Src1::Gather { ld }, rows1 * ld * 4)
            }
            _ => (Src1::Direct, 0),
        };
        let conv_ld = k.next_multiple_of(16);
        let limbs = match path {
            Path::KFused(q) if klimb::use_limbs(q, m) => Some(LimbLayout::new(k)),
            _ => None,
        };
        let (conv_rows, per_thread) = match path {
            Path::Convert { gemm, .. } => {
                let rows = if gemm {
                    (CONV_BYTES / (4 * conv_ld) / TILE_N * TILE_N).max(TILE_N)
                } else {
                    CONV_ROWS_SMALL
                };
                let rows = rows.min(n.next_multiple_of(TILE_N));
                (rows, (rows * conv_ld * 4).next_multiple_of(64))
            }
            _ => match limbs {
                Some(l) => (0, m.min(fused_chunk_m(k)) * l.row_bytes),
                None => (0, 0),
            },
        };
        let (bn, bm) = grid(batches, n, m, nth);
        let (cn, cm) = (n.div_ceil(bn.max(1)), m.div_ceil(bm.max(1)));
        Plan {
            path,
            src1: src1_mode,
            nth,
            k,
            n,
            m,
            ne12: ne12.max(1),
            r2: ne12.checked_div(ne02).unwrap_or(1).max(1),
            r3: ne13.checked_div(ne03).unwrap_or(1).max(1),
            shared: shared.next_multiple_of(64),
            per_thread,
            limbs,
            conv_rows,
            conv_ld,
            items: batches * cn * cm,
            bn,
            cn,
            bm,
            cm,
        }
    }
}

/// Quantized activations of at most this many bytes (one decoding step's row: about 1.1
/// bytes per element, 3.1 with the AVX-512 kernel's vectors) are made by every thread for
/// itself in its private scratch, instead of split between the threads into shared scratch: no barrier after the quantization, and
/// consecutive products (a layer's Q, K and V) need none between them for the scratch. Each
/// block is quantized the same way whoever makes it, so the bytes are the same.
pub(super) const PRIVATE_SRC1_BYTES: usize = 16 << 10;

impl Plan {
    /// Whether a graph node's threads quantize src1 each for itself (see
    /// [`PRIVATE_SRC1_BYTES`]); never with per-thread conversion scratch.
    pub(super) fn private_src1(&self) -> bool {
        matches!(self.src1, Src1::Quant(_) | Src1::KQuant(_))
            && self.per_thread == 0
            && self.shared <= PRIVATE_SRC1_BYTES
    }

    /// The plan with smaller items over the weight rows, for threads that take items from a
    /// shared counter: about [`ITEMS_PER_THREAD`] per thread, at least [`MIN_ITEM_ROWS`] rows
    /// each; unchanged where the grid does not split weight rows. Each output element is
    /// computed the same way in any item (results are bit-identical across thread counts,
    /// tests/targets.rs), and the scratch does not depend on the items.
    pub(super) fn finer(mut self) -> Plan {
        if self.bn >= self.n || self.items == 0 {
            return self;
        }
        let bn = self
            .n
            .div_ceil(self.nth * ITEMS_PER_THREAD)
            .next_multiple_of(TILE_N)
            .max(MIN_ITEM_ROWS);
        if bn < self.bn {
            let batches = self.items / (self.cn * self.cm);
            self.bn = bn;
            self.cn = self.n.div_ceil(bn);
            self.items = batches * self.cn * self.cm;
        }
        self
    }
}

/// Items per thread of a product whose threads take items from a shared counter.
pub(super) const ITEMS_PER_THREAD: usize = 4;
/// Fewest weight rows per item taken from a shared counter (a few microseconds of work).
pub(super) const MIN_ITEM_ROWS: usize = 4 * TILE_N;

/// Chunk sizes `(bn, bm)` of the work items for `batches` outputs of `n x m` on `nth` threads.
pub(super) fn grid(batches: usize, n: usize, m: usize, nth: usize) -> (usize, usize) {
    if nth <= 1 || batches.is_multiple_of(nth) {
        return (n, m);
    }
    if n >= TILE_N * nth {
        // Each thread takes 1/nth of every batch's weight rows.
        return (n.div_ceil(nth).next_multiple_of(TILE_N), m);
    }
    if m >= nth {
        // Whole groups of 8 rows when 16 weight rows allow the AVX-512 lane tiles
        // (`lanes512`), so that which kernel computes an output does not depend on `nth`.
        let bm = m.div_ceil(nth);
        return (
            n,
            if n >= TILE_N && m >= 8 {
                bm.next_multiple_of(8)
            } else {
                bm
            },
        );
    }
    (
        TILE_N.min(n).max(1),
        if n >= TILE_N && m >= 8 { 8 } else { 1 },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::view::split_range;

    fn view(ne: [usize; 4]) -> TensorView {
        TensorView {
            data: std::ptr::null_mut(),
            dtype: crate::DType::F32,
            ne,
            nb: [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]],
        }
    }

    #[test]
    fn finer_items_cover_the_rows_a_few_per_thread() {
        let w = Weights::Float(FloatW::F32);
        // (n, m, nth) -> items of the finer plan (a decode step's products on 2 threads).
        for (n, m, nth, want) in [
            (262_144, 1, 2, 8),
            (2048, 1, 2, 8),
            (640, 1, 2, 8),
            (256, 1, 2, 4),
            (100, 1, 2, 2),
            (4096, 1, 3, 12),
            (10, 33, 2, 2),
        ] {
            let (a, b, d) = (view([64, n, 1, 1]), view([64, m, 1, 1]), view([n, m, 1, 1]));
            let p = Plan::new(w, &a, &b, &d, nth, Precision::Exact);
            let f = p.finer();
            assert_eq!(f.items, want, "n {n} m {m} nth {nth}");
            // The same rows and scratch, in whole tiles, never fewer items than before.
            assert!(f.bn * f.cn >= n && f.bn * (f.cn - 1) < n && f.bm * f.cm >= m);
            assert!(f.bn.is_multiple_of(TILE_N) || f.bn == p.bn);
            assert!(f.items >= p.items && (f.shared, f.per_thread) == (p.shared, p.per_thread));
        }
    }

    #[test]
    fn grid_covers_the_output_and_balances_decode_shapes() {
        // M = 1 on two threads: each thread streams half of the weight rows.
        assert_eq!(grid(1, 4096, 1, 2), (2048, 1));
        assert_eq!(grid(1, 49152, 1, 2), (24576, 1));
        // Batches that divide evenly are handed out whole.
        assert_eq!(grid(4, 100, 7, 2), (100, 7));
        // Few weight rows: split src1 rows instead.
        assert_eq!(grid(1, 10, 33, 2), (10, 17));
        for (b, n, m, nth) in [(3, 4096, 1, 2), (9, 7, 1, 2), (1, 33, 2, 3), (5, 1, 1, 4)] {
            let (bn, bm) = grid(b, n, m, nth);
            assert!(bn >= 1 && bm >= 1 && bn <= n.next_multiple_of(TILE_N) && bm <= m);
            let items = b * n.div_ceil(bn) * m.div_ceil(bm);
            // Every thread gets within one item of the others.
            let sizes: Vec<usize> = (0..nth).map(|t| split_range(items, t, nth).len()).collect();
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        }
    }
}
