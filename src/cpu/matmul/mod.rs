//! `mul_mat` on the CPU, with ggml's semantics (`ggml_mul_mat`): `src0` = weights
//! `[K, N, ne02, ne03]`, `src1` = f32 activations `[K, M, ne12, ne13]`, `dst` = f32
//! `[N, M, ne12, ne13]` with `dst[i3][i2][m][n] = dot(src0[i3/r3][i2/r2][n], src1[i3][i2][m])`,
//! `r2 = ne12 / ne02`, `r3 = ne13 / ne03` (weights broadcast over dims 2 and 3).
//!
//! Paths (chosen by [`Plan`], identically in `work_size` and `forward`):
//! - quantized weights with 8-bit activations ([`Precision::Q8`]): activations are quantized to 8 bits per block into the
//!   scratch (split over threads, then a barrier), then integer dot products ([`quant`]);
//! - quantized weights with f32 activations and small M: weights dequantized in registers and
//!   multiplied with the activations in place ([`qf32`]; no scratch, no barrier);
//! - float weights (or quantized ones with f32 activations and medium M, dequantized chunk by
//!   chunk into per-thread scratch) with small and medium M: register-tiled SIMD kernels
//!   ([`float`]);
//! - K-quant weights (Q4_K, Q5_K, Q6_K; [`Weights::KQuant`]): with 8-bit activations, Q8_K
//!   activations and integer dot products per 256-element super-block ([`kquant`], AVX-512:
//!   [`kquant512`]); with f32 activations and small M, super-blocks dequantized in registers
//!   ([`kf32`]), above it rows dequantized into scratch ([`dequant`]) for the f32 tiles;
//! - weights of a type without kernels of its own ([`Weights::Table`]: Q2_K, Q3_K, Q5_1,
//!   IQ4) at every M: rows dequantized by the type table's reference conversion into
//!   per-thread scratch, then the f32 tiles or the GEMM (correct, not fast: docs/kernels.md);
//! - large M ([`use_gemm`]): the `gemm` crate's packed GEMM, one call per thread on its share of
//!   the output (`Parallelism::None`), F16/BF16/quantized weights converted to f32 chunk by chunk.
//!
//! Threads split the output into (batch, N-chunk, M-chunk) items: whole batches when their
//! count divides evenly, else N in `nth` chunks (each thread streams its share of the weights),
//! else M, else fine-grained items.

/// `f::<..>(args.., extra..)`: splices [`drive_tiles`]'s extra arguments after the common ones.
macro_rules! call_tile {
    ($f:ident::<$($g:tt),+>($($a:expr),*) ($($e:expr),*)) => {
        $f::<$($g),+>($($a),*, $($e),*)
    };
}

/// Drive a tile kernel `$tile::<$wt, RN, RM>(w, ldw, x, ldx, d, ldd, extra..)` over a block `$b`
/// (fields `w, ldw, x, ldx, d, ldd, n, m`): full `$rn`-row tiles, leftover weight rows one at a
/// time, activation rows in the widest listed tile that fits. Shared by the float and the fused
/// quantized kernels.
macro_rules! drive_tiles {
    ($b:expr, $tile:ident, $wt:ident, $rn:literal, [$($rm:literal),+], $extra:tt) => {{
        let b = $b;
        let mut n0 = 0;
        while n0 < b.n {
            let rows = if b.n - n0 >= $rn { $rn } else { 1 };
            let mut m0 = 0;
            while m0 < b.m {
                let left = b.m - m0;
                // SAFETY: weight rows n0..n0 + rows <= b.n, activation rows m0..m0 + cols <= b.m
                // and their outputs are inside the block the caller vouched for.
                let (w, x, d) = unsafe {
                    (b.w.add(n0 * b.ldw), b.x.add(m0 * b.ldx), b.d.add(m0 * b.ldd + n0))
                };
                let mut cols = 0;
                $(
                    if cols == 0 && left >= $rm {
                        cols = $rm;
                        // SAFETY: as above.
                        unsafe {
                            if rows == $rn {
                                call_tile!($tile::<$wt, $rn, $rm>(w, b.ldw, x, b.ldx, d, b.ldd) $extra);
                            } else {
                                call_tile!($tile::<$wt, 1, $rm>(w, b.ldw, x, b.ldx, d, b.ldd) $extra);
                            }
                        }
                    }
                )+
                m0 += cols;
            }
            n0 += rows;
        }
    }};
}

mod dequant;
mod float;
mod kf32;
mod kquant;
#[cfg(target_arch = "x86_64")]
mod kquant512;
mod qf32;
mod quant;
#[cfg(target_arch = "x86_64")]
mod quant512;

pub use crate::cpu::simd::Isa;
pub use crate::cpu::view::Precision;

use crate::DType;
use crate::cpu::view::{ComputeParams, TensorView, split_range};
use float::FloatBlock;
use kf32::KF32Block;
use kquant::{KActLayout, KQuantBlock};
use qf32::QF32Block;
use quant::{ActLayout, QuantBlock};

/// Whether `m` activation rows of length `k` go to the packed GEMM (the `gemm` crate) rather
/// than the register-tiled kernels. Measured on Zen 4 with the AVX-512 tiles, F32 weights,
/// N and K in 1024..4096, 1 and 2 threads (docs/kernels.md): the tiles are 1.3-1.9x faster at
/// M = 128 and 256 (they read each weight once, the GEMM packs them), about even at M = 512,
/// the GEMM 1.1-1.3x faster from M = 1024; at K = 64 (attention heads) the GEMM wins from
/// M = 64. The rule does not depend on the SIMD level so that `work_size` and `forward_with`
/// at any level agree on the scratch.
fn use_gemm(m: usize, k: usize) -> bool {
    m >= 512 || (m >= 64 && k <= 64)
}
/// Largest M (activation rows per batch) multiplied by the fused kernels ([`qf32`]) when
/// quantized weights meet f32 activations; larger M dequantizes chunks of weight rows into
/// scratch once and uses the wider f32 tiles.
const FUSED_MAX_M: usize = 8;

/// Whether `mul_mat(src0, src1)` at `precision` quantizes the activations to 8 bits (false for
/// float weights, and for every product at [`Precision::Exact`]).
pub fn quantizes_activations(src0: &TensorView, precision: Precision) -> bool {
    matches!(
        kernels_for(src0.dtype),
        Some(Weights::Quant(_) | Weights::KQuant(_))
    ) && precision == Precision::Q8
}

/// Activation rows the fused kernels multiply per pass over an item's weights: as many as
/// fit in 256 KiB of f32 (a quarter of a Zen 4 L2), 8 to 64, a multiple of 4 (the tile width).
fn fused_chunk_m(k: usize) -> usize {
    ((256 << 10) / (4 * k.max(1))).clamp(8, 64) / 4 * 4
}

/// Weight rows per work item are a multiple of this (keeps tiles whole).
const TILE_N: usize = 16;
/// Per-thread scratch for weights converted to f32 before a GEMM call.
const CONV_BYTES: usize = 2 << 20;
/// Rows converted at a time for the small-M exact-mode path.
const CONV_ROWS_SMALL: usize = 16;
/// Quantized activation rows multiplied per pass over an item's weights.
const Q_CHUNK_M: usize = 64;

/// Float weight types of the register-tiled kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FloatW {
    F32,
    F16,
    BF16,
}

/// Quantized weight types of the fused and integer kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QuantW {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
}

/// K-quant weight types (256-element super-blocks) of the fused and integer kernels
/// ([`kf32`], [`kquant`]).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KQuantW {
    Q4_K,
    Q5_K,
    Q6_K,
}

/// The kernels that multiply weights of one dtype, chosen once per node by [`kernels_for`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Weights {
    Float(FloatW),
    Quant(QuantW),
    KQuant(KQuantW),
    /// A quantized type without kernels of its own (Q2_K, Q3_K, Q5_1, IQ4): rows
    /// dequantized by the type table's reference conversion into per-thread scratch, then the
    /// f32 tiles or the GEMM, at every M and precision (activations stay f32).
    Table(DType),
}

impl Weights {
    /// The dtype these kernels read (the inverse of [`kernels_for`]).
    pub(crate) const fn dtype(self) -> DType {
        match self {
            Weights::Float(FloatW::F32) => DType::F32,
            Weights::Float(FloatW::F16) => DType::F16,
            Weights::Float(FloatW::BF16) => DType::BF16,
            Weights::Quant(QuantW::Q8_0) => DType::Q8_0,
            Weights::Quant(QuantW::Q4_0) => DType::Q4_0,
            Weights::Quant(QuantW::Q4_1) => DType::Q4_1,
            Weights::Quant(QuantW::Q5_0) => DType::Q5_0,
            Weights::KQuant(KQuantW::Q4_K) => DType::Q4_K,
            Weights::KQuant(KQuantW::Q5_K) => DType::Q5_K,
            Weights::KQuant(KQuantW::Q6_K) => DType::Q6_K,
            Weights::Table(d) => d,
        }
    }
}

/// The CPU `mul_mat` kernels for weights of `dtype`, or `None` where the CPU has none (then
/// [`supports`] refuses the node, naming the dtype). Every `DType` is matched by name: a type
/// added to the table does not compile until it is answered here, and none falls through to
/// another type's kernels.
pub(crate) const fn kernels_for(dtype: DType) -> Option<Weights> {
    match dtype {
        DType::F32 => Some(Weights::Float(FloatW::F32)),
        DType::F16 => Some(Weights::Float(FloatW::F16)),
        DType::BF16 => Some(Weights::Float(FloatW::BF16)),
        DType::Q8_0 => Some(Weights::Quant(QuantW::Q8_0)),
        DType::Q4_0 => Some(Weights::Quant(QuantW::Q4_0)),
        DType::Q4_1 => Some(Weights::Quant(QuantW::Q4_1)),
        DType::Q4_K => Some(Weights::KQuant(KQuantW::Q4_K)),
        DType::Q5_K => Some(Weights::KQuant(KQuantW::Q5_K)),
        DType::Q6_K => Some(Weights::KQuant(KQuantW::Q6_K)),
        DType::Q5_0 => Some(Weights::Quant(QuantW::Q5_0)),
        DType::Q5_1 | DType::Q2_K | DType::Q3_K | DType::IQ4_NL | DType::IQ4_XS => {
            Some(Weights::Table(dtype))
        }
        DType::I32 => None,
        #[cfg(test)]
        DType::FakeQ4x16 => None,
    }
}

/// Ok(()) if the CPU kernels handle these operands, else Err(reason).
pub fn supports(src0: &TensorView, src1: &TensorView, dst: &TensorView) -> Result<(), String> {
    let shapes = || {
        format!(
            "src0 {:?} {:?}, src1 {:?} {:?}, dst {:?} {:?}",
            src0.dtype, src0.ne, src1.dtype, src1.ne, dst.dtype, dst.ne
        )
    };
    if kernels_for(src0.dtype).is_none() {
        return Err(format!(
            "weights of dtype {} are not supported ({})",
            src0.dtype,
            shapes()
        ));
    }
    if src1.dtype != DType::F32 || dst.dtype != DType::F32 {
        return Err(format!("src1 and dst must be f32 ({})", shapes()));
    }
    let [k, n, ne02, ne03] = src0.ne;
    let [k1, m, ne12, ne13] = src1.ne;
    if k != k1 {
        return Err(format!(
            "src0 and src1 rows differ in length ({})",
            shapes()
        ));
    }
    if dst.ne != [n, m, ne12, ne13] {
        return Err(format!(
            "dst must have shape [{n}, {m}, {ne12}, {ne13}] ({})",
            shapes()
        ));
    }
    let divides = |a: usize, b: usize| a.is_multiple_of(b);
    if !divides(ne12, ne02) || !divides(ne13, ne03) {
        return Err(format!(
            "src0 dims 2 and 3 must divide src1's for broadcasting ({})",
            shapes()
        ));
    }
    if !src0.rows_contiguous() {
        return Err(format!(
            "src0 rows must be contiguous (nb[0] = {}, type size {}) ({})",
            src0.nb[0],
            src0.dtype.type_size(),
            shapes()
        ));
    }
    if !k.is_multiple_of(src0.dtype.block_size()) {
        return Err(format!(
            "{} rows must be whole blocks of {} ({})",
            src0.dtype,
            src0.dtype.block_size(),
            shapes()
        ));
    }
    if dst.nb[0] != 4 || dst.nb[1..].iter().any(|&b| b % 4 != 0) {
        return Err(format!(
            "dst must have nb[0] = 4 and strides that are multiples of 4 (nb {:?}) ({})",
            dst.nb,
            shapes()
        ));
    }
    Ok(())
}

/// Scratch bytes the node needs for `nth` threads (64-byte multiples inside).
pub fn work_size(
    src0: &TensorView,
    src1: &TensorView,
    dst: &TensorView,
    nth: usize,
    precision: Precision,
) -> usize {
    let Some(w) = kernels_for(src0.dtype) else {
        return 0; // refused by `supports`: never run
    };
    let p = Plan::new(w, src0, src1, dst, nth.max(1), precision);
    p.shared + p.nth * p.per_thread
}

/// Compute `dst` on all `p.nth` threads (call from every thread of the pool).
pub fn forward(p: &ComputeParams, src0: &TensorView, src1: &TensorView, dst: &TensorView) {
    forward_with(Isa::detect(), p, src0, src1, dst)
}

/// [`forward`] at a chosen SIMD level (lowered to what the CPU supports). For tests and
/// benchmarks that compare levels.
pub fn forward_with(
    isa: Isa,
    p: &ComputeParams,
    src0: &TensorView,
    src1: &TensorView,
    dst: &TensorView,
) {
    let w = match (supports(src0, src1, dst), kernels_for(src0.dtype)) {
        (Ok(()), Some(w)) => w,
        (Err(e), _) => panic!("mul_mat: forward called on unsupported operands: {e}"),
        (Ok(()), None) => unreachable!("supports refuses weights without kernels"),
    };
    let plan = Plan::new(w, src0, src1, dst, p.nth, p.precision);
    let need = plan.shared + plan.nth * plan.per_thread;
    assert!(
        p.wsize >= need && (need == 0 || !p.wdata.is_null()),
        "mul_mat: scratch of {} bytes is too small, {need} needed",
        p.wsize
    );
    let isa = isa.clamp();
    match plan.path {
        Path::Nothing => return,
        Path::Zero => {
            zero_rows(p, &plan, dst);
            return;
        }
        _ => {}
    }
    // Stage 1: bring src1 into the form the kernels read, shared by all threads.
    match plan.src1 {
        Src1::Direct => {}
        Src1::Gather { ld } => {
            gather_rows(p, &plan, src1, ld);
            p.barrier();
        }
        Src1::Quant(lay) => {
            quantize_rows(isa, p, &plan, src1, lay);
            p.barrier();
        }
        Src1::KQuant(lay) => {
            quantize_rows_k(p, &plan, src1, lay);
            p.barrier();
        }
    }
    // Stage 2: this thread's items.
    let per_item = plan.cn * plan.cm;
    for it in split_range(plan.items, p.ith, p.nth) {
        let b = it / per_item;
        let ci = it % per_item / plan.cm;
        let mi = it % plan.cm;
        let n0 = ci * plan.bn;
        let m0 = mi * plan.bm;
        let item = Item {
            i2: b % plan.ne12,
            i3: b / plan.ne12,
            n0,
            n1: (n0 + plan.bn).min(plan.n),
            m0,
            m1: (m0 + plan.bm).min(plan.m),
        };
        // SAFETY: supports() validated shapes and strides; the executor guarantees the tensors'
        // bytes are in their buffers, that scratch holds `need` bytes, and items are disjoint
        // output regions (split_range partitions the item list).
        unsafe { run_item(isa, p, &plan, src0, src1, dst, &item) };
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// dst has no elements.
    Nothing,
    /// K == 0: every output is an empty sum.
    Zero,
    /// Float tiles of `wt`, or the GEMM (then `wt` is F32), reading the weights in place.
    Direct { wt: FloatW, gemm: bool },
    /// Weights of `w` converted to f32 chunk by chunk in per-thread scratch, then float tiles
    /// or the GEMM.
    Convert { w: Weights, gemm: bool },
    /// Quantized weights dequantized in registers, f32 activations ([`qf32`]).
    Fused(QuantW),
    /// Integer kernels on quantized activations.
    Quant(QuantW),
    /// K-quant weights dequantized in registers, f32 activations ([`kf32`]).
    KFused(KQuantW),
    /// K-quant integer kernels on Q8_K activations ([`kquant`]).
    KQuant(KQuantW),
}

#[derive(Clone, Copy, Debug)]
enum Src1 {
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
struct Plan {
    path: Path,
    src1: Src1,
    nth: usize,
    k: usize,
    n: usize,
    m: usize,
    ne12: usize,
    r2: usize,
    r3: usize,
    /// Shared scratch bytes (src1 gathered or quantized), a multiple of 64.
    shared: usize,
    /// Per-thread scratch bytes (converted weights), a multiple of 64.
    per_thread: usize,
    /// Weight rows converted per step, and their f32 row stride.
    conv_rows: usize,
    conv_ld: usize,
    /// Work items: batches x `cn` chunks of `bn` weight rows x `cm` chunks of `bm` rows of src1.
    items: usize,
    bn: usize,
    cn: usize,
    bm: usize,
    cm: usize,
}

impl Plan {
    fn new(
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
                Weights::Quant(q) if m <= FUSED_MAX_M => Path::Fused(q),
                Weights::KQuant(q) if precision == Precision::Q8 => Path::KQuant(q),
                Weights::KQuant(q) if m <= FUSED_MAX_M => Path::KFused(q),
                Weights::Float(wt) if !gemm || f32_rows => Path::Direct { wt, gemm },
                Weights::Quant(_) | Weights::KQuant(_) | Weights::Float(_) | Weights::Table(_) => {
                    Path::Convert { w, gemm }
                }
            }
        };
        let rows1 = m * batches;
        let src1_direct = src1.nb[0] == 4 && src1.nb[1..].iter().all(|b| b % 4 == 0);
        let (src1_mode, shared) = match path {
            Path::Quant(_) => {
                let lay = ActLayout::new(k);
                (Src1::Quant(lay), rows1 * lay.row_bytes)
            }
            Path::KQuant(_) => {
                let lay = KActLayout::new(k);
                (Src1::KQuant(lay), rows1 * lay.row_bytes)
            }
            Path::Direct { .. } | Path::Convert { .. } | Path::Fused(_) | Path::KFused(_)
                if !src1_direct =>
            {
                let ld = k.next_multiple_of(16);
                (Src1::Gather { ld }, rows1 * ld * 4)
            }
            _ => (Src1::Direct, 0),
        };
        let conv_ld = k.next_multiple_of(16);
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
            _ => (0, 0),
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

/// Chunk sizes `(bn, bm)` of the work items for `batches` outputs of `n x m` on `nth` threads.
fn grid(batches: usize, n: usize, m: usize, nth: usize) -> (usize, usize) {
    if nth <= 1 || batches.is_multiple_of(nth) {
        return (n, m);
    }
    if n >= TILE_N * nth {
        // Each thread takes 1/nth of every batch's weight rows.
        return (n.div_ceil(nth).next_multiple_of(TILE_N), m);
    }
    if m >= nth {
        return (n, m.div_ceil(nth));
    }
    (TILE_N.min(n).max(1), 1)
}

/// One work item: batch `(i2, i3)`, weight rows `n0..n1`, src1 rows `m0..m1`.
struct Item {
    i2: usize,
    i3: usize,
    n0: usize,
    n1: usize,
    m0: usize,
    m1: usize,
}

/// # Safety
/// The operands passed `supports`, their bytes are valid, scratch holds the plan's bytes, and
/// no other thread writes the item's outputs.
unsafe fn run_item(
    isa: Isa,
    p: &ComputeParams,
    plan: &Plan,
    src0: &TensorView,
    src1: &TensorView,
    dst: &TensorView,
    it: &Item,
) {
    let (n, m) = (it.n1 - it.n0, it.m1 - it.m0);
    let row1 = (it.i3 * plan.ne12 + it.i2) * plan.m + it.m0;
    // SAFETY (whole body): indices are within the shapes checked by `supports`; the broadcast
    // divisions map a batch to an existing weight matrix; scratch offsets are within `need`.
    unsafe {
        let w = src0
            .row_ptr(it.n0, it.i2 / plan.r2, it.i3 / plan.r3)
            .cast_const();
        let d = dst.row_ptr(it.m0, it.i2, it.i3).cast::<f32>().add(it.n0);
        let ldd = dst.nb[1] / 4;
        if let (Path::Quant(wt), Src1::Quant(lay)) = (plan.path, plan.src1) {
            // Chunks of Q_CHUNK_M activation rows (~5 bytes per element: 320 KiB at K = 4096)
            // stay in L2 while the item's weight rows stream past them.
            let mut mc = 0;
            while mc < m {
                let rows = Q_CHUNK_M.min(m - mc);
                let a = p.wdata.add((row1 + mc) * lay.row_bytes).cast_const();
                let b = QuantBlock {
                    w,
                    ldw: src0.nb[1],
                    wt,
                    a,
                    lay,
                    d: d.add(mc * ldd),
                    ldd,
                    n,
                    m: rows,
                };
                quant::block(isa, &b);
                mc += rows;
            }
            return;
        }
        if let (Path::KQuant(wt), Src1::KQuant(lay)) = (plan.path, plan.src1) {
            let mut mc = 0;
            while mc < m {
                let rows = Q_CHUNK_M.min(m - mc);
                let b = KQuantBlock {
                    w,
                    ldw: src0.nb[1],
                    wt,
                    a: p.wdata.add((row1 + mc) * lay.row_bytes).cast_const(),
                    lay,
                    d: d.add(mc * ldd),
                    ldd,
                    n,
                    m: rows,
                };
                kquant::block(isa, &b);
                mc += rows;
            }
            return;
        }
        let (x, ldx) = match plan.src1 {
            Src1::Gather { ld } => (p.wdata.cast::<f32>().add(row1 * ld).cast_const(), ld),
            _ => (
                src1.row_ptr(it.m0, it.i2, it.i3).cast::<f32>().cast_const(),
                src1.nb[1] / 4,
            ),
        };
        if let Path::Fused(wt) = plan.path {
            // Chunks of activation rows stay in L2 while the item's weight rows stream past.
            let chunk = fused_chunk_m(plan.k);
            let mut mc = 0;
            while mc < m {
                let rows = chunk.min(m - mc);
                let b = QF32Block {
                    w,
                    ldw: src0.nb[1],
                    wt,
                    x: x.add(mc * ldx),
                    ldx,
                    d: d.add(mc * ldd),
                    ldd,
                    n,
                    m: rows,
                    nblk: plan.k / quant::BLK,
                    gemv: plan.m == 1,
                };
                qf32::block(isa, &b);
                mc += rows;
            }
            return;
        }
        if let Path::KFused(wt) = plan.path {
            let chunk = fused_chunk_m(plan.k);
            let mut mc = 0;
            while mc < m {
                let rows = chunk.min(m - mc);
                let b = KF32Block {
                    w,
                    ldw: src0.nb[1],
                    wt,
                    x: x.add(mc * ldx),
                    ldx,
                    d: d.add(mc * ldd),
                    ldd,
                    n,
                    m: rows,
                    nblk: plan.k / crate::dtype::QK_K,
                };
                kf32::block(isa, &b);
                mc += rows;
            }
            return;
        }
        let (conv, gemm) = match plan.path {
            Path::Convert { w, gemm } => (w, gemm),
            Path::Direct { wt, gemm } => {
                if gemm {
                    gemm_block(w.cast(), src0.nb[1] / 4, x, ldx, d, ldd, n, m, plan.k);
                    return;
                }
                let b = FloatBlock {
                    w,
                    ldw: src0.nb[1],
                    wt,
                    x,
                    ldx,
                    d,
                    ldd,
                    n,
                    m,
                    k: plan.k,
                };
                float::block(isa, &b);
                return;
            }
            Path::Nothing
            | Path::Zero
            | Path::Fused(_)
            | Path::Quant(_)
            | Path::KFused(_)
            | Path::KQuant(_) => return,
        };
        // Convert chunks of weight rows to f32 in this thread's scratch, then multiply.
        let scratch = p
            .wdata
            .add(plan.shared + p.ith * plan.per_thread)
            .cast::<f32>();
        let mut r0 = 0;
        while r0 < n {
            let rows = plan.conv_rows.min(n - r0);
            for r in 0..rows {
                let src = w.add((r0 + r) * src0.nb[1]);
                dequant::row_to_f32(isa, conv, src, scratch.add(r * plan.conv_ld), plan.k);
            }
            let dr = d.add(r0);
            if gemm {
                gemm_block(scratch, plan.conv_ld, x, ldx, dr, ldd, rows, m, plan.k);
            } else {
                let b = FloatBlock {
                    w: scratch.cast_const().cast(),
                    ldw: plan.conv_ld * 4,
                    wt: FloatW::F32,
                    x,
                    ldx,
                    d: dr,
                    ldd,
                    n: rows,
                    m,
                    k: plan.k,
                };
                float::block(isa, &b);
            }
            r0 += rows;
        }
    }
}

/// `d[m][n] = dot(w[n], x[m])` with the `gemm` crate on one thread.
///
/// # Safety
/// `w` holds `n` rows of `k` f32 at stride `ldw`, `x` holds `m` rows at stride `ldx`, `d` is
/// writable for `m` rows at stride `ldd` of `n` f32; all f32-aligned.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_block(
    w: *const f32,
    ldw: usize,
    x: *const f32,
    ldx: usize,
    d: *mut f32,
    ldd: usize,
    n: usize,
    m: usize,
    k: usize,
) {
    // dst (m x n, row stride ldd) = lhs (m x k, row stride ldx) * rhs (k x n, column stride
    // ldw): rhs is the weight matrix transposed, read in place. gemm computes
    // dst := alpha * dst + beta * lhs * rhs; read_dst = false ignores alpha.
    // SAFETY: the caller guarantees the three matrices' bounds.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            d,
            1,
            ldd as isize,
            false,
            x,
            1,
            ldx as isize,
            w,
            ldw as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// K == 0: write zeros to this thread's share of dst rows.
fn zero_rows(p: &ComputeParams, plan: &Plan, dst: &TensorView) {
    let rows = dst.nrows();
    for r in split_range(rows, p.ith, p.nth) {
        let (i1, i2, i3) = (r % plan.m, r / plan.m % plan.ne12, r / plan.m / plan.ne12);
        // SAFETY: r < rows, so the row is inside dst; rows are split disjointly.
        unsafe {
            let row = dst.row_ptr(i1, i2, i3).cast::<f32>();
            std::ptr::write_bytes(row, 0, plan.n);
        }
    }
}

/// Copy this thread's share of src1 rows into contiguous rows of `ld` f32.
fn gather_rows(p: &ComputeParams, plan: &Plan, src1: &TensorView, ld: usize) {
    let rows = src1.nrows();
    for r in split_range(rows, p.ith, p.nth) {
        let (i1, i2, i3) = (r % plan.m, r / plan.m % plan.ne12, r / plan.m / plan.ne12);
        // SAFETY: r < rows and j < k keep reads inside src1; row r of the scratch holds ld >= k
        // f32 and is written only by this thread.
        unsafe {
            let src = src1.row_ptr(i1, i2, i3);
            let out = p.wdata.cast::<f32>().add(r * ld);
            for j in 0..plan.k {
                *out.add(j) = src.add(j * src1.nb[0]).cast::<f32>().read_unaligned();
            }
        }
    }
}

/// Quantize this thread's share of src1 blocks (flattened over rows, so one long row is split
/// too).
fn quantize_rows(isa: Isa, p: &ComputeParams, plan: &Plan, src1: &TensorView, lay: ActLayout) {
    let total = src1.nrows() * lay.nblk;
    let range = split_range(total, p.ith, p.nth);
    let mut f = range.start;
    while f < range.end {
        let r = f / lay.nblk;
        let blk = f % lay.nblk;
        let count = (lay.nblk - blk).min(range.end - f);
        let (i1, i2, i3) = (r % plan.m, r / plan.m % plan.ne12, r / plan.m / plan.ne12);
        // SAFETY: blocks blk..blk+count of row r are inside src1 and inside row r of the
        // scratch; block ranges are split disjointly between threads.
        unsafe {
            let x = src1.row_ptr(i1, i2, i3).add(blk * quant::BLK * src1.nb[0]);
            let row = p.wdata.add(r * lay.row_bytes);
            quant::quantize_blocks(
                isa,
                x,
                src1.nb[0],
                row.add(blk * quant::BLK).cast(),
                row.add(lay.d_off()).cast::<f32>().add(blk),
                row.add(lay.s_off()).cast::<f32>().add(blk),
                count,
            );
        }
        f += count;
    }
}

/// [`quantize_rows`] for Q8_K activations (256-element blocks).
fn quantize_rows_k(p: &ComputeParams, plan: &Plan, src1: &TensorView, lay: KActLayout) {
    let total = src1.nrows() * lay.nblk;
    let range = split_range(total, p.ith, p.nth);
    let mut f = range.start;
    while f < range.end {
        let r = f / lay.nblk;
        let blk = f % lay.nblk;
        let count = (lay.nblk - blk).min(range.end - f);
        let (i1, i2, i3) = (r % plan.m, r / plan.m % plan.ne12, r / plan.m / plan.ne12);
        // SAFETY: blocks blk..blk+count of row r are inside src1 and inside row r of the
        // scratch; block ranges are split disjointly between threads.
        unsafe {
            let x = src1
                .row_ptr(i1, i2, i3)
                .add(blk * crate::dtype::QK_K * src1.nb[0]);
            let row = p.wdata.add(r * lay.row_bytes);
            kquant::quantize_blocks(
                x,
                src1.nb[0],
                row.add(blk * crate::dtype::QK_K).cast(),
                row.add(lay.d_off()).cast::<f32>().add(blk),
                row.add(lay.s_off()).cast::<i16>().add(16 * blk),
                count,
            );
        }
        f += count;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(dtype: DType, ne: [usize; 4]) -> TensorView {
        let ts = dtype.type_size();
        let nb1 = dtype.row_size(ne[0]);
        TensorView {
            data: std::ptr::null_mut(),
            dtype,
            ne,
            nb: [ts, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2]],
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

    #[test]
    fn supports_names_what_is_wrong() {
        let w = view(DType::Q4_0, [64, 8, 1, 1]);
        let x = view(DType::F32, [64, 3, 1, 1]);
        let d = view(DType::F32, [8, 3, 1, 1]);
        assert!(supports(&w, &x, &d).is_ok());
        let bad_k = view(DType::Q4_0, [48, 8, 1, 1]);
        let x48 = view(DType::F32, [48, 3, 1, 1]);
        assert!(
            supports(&bad_k, &x48, &d)
                .unwrap_err()
                .contains("blocks of 32")
        );
        let bad_d = view(DType::F32, [8, 4, 1, 1]);
        assert!(
            supports(&w, &x, &bad_d)
                .unwrap_err()
                .contains("dst must have shape")
        );
        let xb = view(DType::F32, [64, 3, 3, 1]);
        let wb = view(DType::Q4_0, [64, 8, 2, 1]);
        let db = view(DType::F32, [8, 3, 3, 1]);
        assert!(supports(&wb, &xb, &db).unwrap_err().contains("broadcast"));
        let i32w = view(DType::I32, [64, 8, 1, 1]);
        assert!(supports(&i32w, &x, &d).unwrap_err().contains("i32"));
    }

    #[test]
    fn work_size_covers_quantized_activations_and_conversion_scratch() {
        let x = view(DType::F32, [4096, 32, 1, 1]);
        let d = view(DType::F32, [64, 32, 1, 1]);
        let q = view(DType::Q4_0, [4096, 64, 1, 1]);
        // 32 rows of 4096 quants + 2 * 128 f32 each.
        assert_eq!(
            work_size(&q, &x, &d, 2, Precision::Q8),
            32 * (4096 + 8 * 128)
        );
        // Exact mode: no quantized activations, a dequantized chunk per thread instead.
        assert_eq!(
            work_size(&q, &x, &d, 2, Precision::Exact),
            2 * CONV_ROWS_SMALL * 4096 * 4
        );
        let f = view(DType::F32, [4096, 64, 1, 1]);
        for p in [Precision::Q8, Precision::Exact] {
            assert_eq!(work_size(&f, &x, &d, 2, p), 0);
        }
        // Decode shapes with f32 activations: the fused kernels need no scratch.
        let x1 = view(DType::F32, [4096, 1, 1, 1]);
        let d1 = view(DType::F32, [64, 1, 1, 1]);
        assert_eq!(work_size(&q, &x1, &d1, 2, Precision::Exact), 0);
    }
}
