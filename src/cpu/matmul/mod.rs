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
//!   ([`kf32`]; on AVX-512 Q6_K at M <= 2 and Q5_K at M = 1 through integer limbs of the
//!   activations instead, [`klimb`]), above it rows dequantized into scratch ([`dequant`]) for
//!   the f32 tiles;
//! - Q2_K, Q3_K, IQ4_XS, Q5_1 and IQ4_NL ([`Weights::Low`]): blocks decoded to small
//!   integers and per-16 scales ([`low`]); with 8-bit activations (Q8_K for the 256-element
//!   types, [`quant`]'s blocks of 32 for the others, as ggml pairs them) integer dot products
//!   at every M ([`lowq8`]); with f32 activations and small M fused in registers ([`lowf32`]);
//!   larger M converts rows ([`dequant`], AVX2) into scratch for the f32 tiles or the GEMM;
//!   "small M" is [`plan::fused_max_m`] (per type on AVX2 and AVX-512, measured: 2 to 32);
//! - large M ([`plan::use_gemm`]): the `gemm` crate's packed GEMM, one call per thread on its share of
//!   the output (`Parallelism::None`), F16/BF16/quantized weights converted to f32 chunk by chunk.
//!
//! Threads split the output into (batch, N-chunk, M-chunk) items: whole batches when their
//! count divides evenly, else N in `nth` chunks (each thread streams its share of the weights),
//! else M, else fine-grained items.
//!
//! Files: this one holds the weight-type dispatch ([`kernels_for`]), [`supports`], and the
//! threaded driver ([`forward_with`]); [`plan`] decides the path, scratch and work items;
//! [`run`] runs one item (and the shared stage-1 gather/quantize of src1); the kernels live in
//! [`float`], [`qf32`], [`quant`], [`kf32`], [`klimb`], [`kquant`], [`lowf32`] and [`lowq8`].

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
mod klimb;
mod kquant;
#[cfg(target_arch = "x86_64")]
mod kquant512;
#[cfg(target_arch = "x86_64")]
mod lanes512;
mod low;
mod lowf32;
mod lowq8;
mod plan;
mod qf32;
mod quant;
#[cfg(target_arch = "x86_64")]
mod quant512;
mod run;

pub use crate::cpu::simd::Isa;
pub use crate::cpu::view::Precision;

use crate::DType;
use crate::cpu::view::{ComputeParams, TensorView, split_range};
use plan::{Path, Plan, Src1};
use run::{Item, gather_rows, quantize_rows, quantize_rows_k, run_item, zero_rows};
use std::sync::atomic::Ordering;

/// Whether `mul_mat(src0, src1)` at `precision` quantizes the activations to 8 bits (false for
/// float weights, and for every product at [`Precision::Exact`]).
pub fn quantizes_activations(src0: &TensorView, precision: Precision) -> bool {
    matches!(
        kernels_for(src0.dtype),
        Some(Weights::Quant(_) | Weights::KQuant(_) | Weights::Low(_))
    ) && precision == Precision::Q8
}

/// The most activation rows per batch (`src1.ne[1]`) for which a graph node at
/// [`Precision::Q8`] quantizes its activations on this SIMD level; above it the node runs at
/// [`Precision::Exact`] (the CPU backend's `make_plan`, [`node_precision`]). The kernels
/// themselves ([`forward`], [`forward_with`]) take the precision they are given at any M.
///
/// Why: on AVX2 without VNNI (Zen 2 measured) `vpmaddubsw` and `vpmaddwd` share one vector
/// pipe, so an 8-bit product retires no more multiply-adds per cycle than two f32 FMA pipes,
/// and once a block of weights is reused by enough rows the f32 tiles over dequantized
/// weights win. `bench ops --threads 2 --precision exact,q8 --m 3,5,6,8,16,32,64`
/// (2026-11-27, Zen 2, 4096 x 4096 and 4096 x 14336, q8 time / the faster exact path's):
/// Q4_0, Q4_1, Q5_0 0.77-0.91x at M = 8, 1.00-1.23x at 16; IQ4_NL 0.86-0.92x at 8, 1.00-1.17x
/// at 16; Q8_0, Q4_K, Q5_K, Q6_K 0.78-1.01x at 16 and 1.00-1.28x at 32; Q2_K 0.71-0.73x at 3,
/// 0.94-1.04x at 5, 1.16-1.26x at 6; Q3_K, Q5_1, IQ4_XS 0.89-1.02x at 5, 0.95-1.11x at 6,
/// 1.00-1.16x at 8. Q5_0 after its one-by-two tiles and signed weights (same day): 0.72-0.78x
/// at 8, 0.92-0.97x at 12, 0.99-1.04x at 16. Q2_K and Q3_K after they took the K-quant tiles
/// (2026-11-29, Zen 3, the same command at M = 3..32, two runs): 0.39-0.67x at 3-6, 0.50-0.76x
/// at 8, 0.62-0.93x at 12, 0.73-0.89x at 16, 0.82-1.10x at 32. IQ4_XS after it took them
/// (2026-11-29, Zen 3, M = 4..24, two runs): 0.55-0.57x at 4, 0.88-0.90x at 8, 0.90-0.94x at
/// 12, 0.92-1.10x at 16, 0.99-1.16x at 24. Gemma 3's K = 640 products are ~2x slower with 8-bit activations at
/// M = 64 (its prompt: 318 vs 520 t/s on cpu:1x2). AVX-512 (VNNI's `vpdpbusd`: one
/// instruction per 64 byte products) and the scalar level keep 8-bit activations at every M
/// (not measured against f32 there).
pub fn q8_max_rows(dtype: DType, isa: Isa) -> usize {
    if isa != Isa::Avx2 {
        return usize::MAX;
    }
    match kernels_for(dtype) {
        Some(Weights::Quant(QuantW::Q4_0 | QuantW::Q4_1)) | Some(Weights::Low(LowW::IQ4_NL)) => 8,
        Some(Weights::Quant(QuantW::Q5_0)) | Some(Weights::Low(LowW::IQ4_XS)) => 12,
        Some(Weights::Quant(QuantW::Q8_0))
        | Some(Weights::KQuant(_))
        | Some(Weights::Low(LowW::Q2_K | LowW::Q3_K)) => 16,
        Some(Weights::Low(LowW::Q5_1)) => 5,
        Some(Weights::Float(_)) | None => usize::MAX,
    }
}

/// The precision a graph node's `mul_mat(src0, src1)` runs at on `isa` when the device's is
/// `precision`: [`Precision::Exact`] where 8-bit activations would be slower
/// ([`q8_max_rows`]), else `precision`.
pub fn node_precision(
    src0: &TensorView,
    src1: &TensorView,
    precision: Precision,
    isa: Isa,
) -> Precision {
    match precision {
        Precision::Q8 if src1.ne[1] > q8_max_rows(src0.dtype, isa) => Precision::Exact,
        p => p,
    }
}

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

/// Weight types of the fused kernels over decoded blocks ([`low`], [`lowf32`], [`lowq8`]):
/// the K-quants of 2 and 3 bits and IQ4_XS (256-element super-blocks, Q8_K activations under
/// `--q8`), Q5_1 and IQ4_NL (blocks of 32, activations as [`quant`]'s Q8_1-style blocks).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LowW {
    Q2_K,
    Q3_K,
    IQ4_XS,
    Q5_1,
    IQ4_NL,
}

/// The kernels that multiply weights of one dtype, chosen once per node by [`kernels_for`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Weights {
    Float(FloatW),
    Quant(QuantW),
    KQuant(KQuantW),
    Low(LowW),
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
            Weights::Low(LowW::Q2_K) => DType::Q2_K,
            Weights::Low(LowW::Q3_K) => DType::Q3_K,
            Weights::Low(LowW::IQ4_XS) => DType::IQ4_XS,
            Weights::Low(LowW::Q5_1) => DType::Q5_1,
            Weights::Low(LowW::IQ4_NL) => DType::IQ4_NL,
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
        DType::Q2_K => Some(Weights::Low(LowW::Q2_K)),
        DType::Q3_K => Some(Weights::Low(LowW::Q3_K)),
        DType::IQ4_XS => Some(Weights::Low(LowW::IQ4_XS)),
        DType::Q5_1 => Some(Weights::Low(LowW::Q5_1)),
        DType::IQ4_NL => Some(Weights::Low(LowW::IQ4_NL)),
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

/// Scratch of a graph node's product run by [`forward_node`]: `(shared, per_thread)` bytes.
/// Small quantized activations are private to each thread ([`Plan::private_src1`]).
pub fn node_scratch(
    src0: &TensorView,
    src1: &TensorView,
    dst: &TensorView,
    nth: usize,
    precision: Precision,
) -> (usize, usize) {
    let Some(w) = kernels_for(src0.dtype) else {
        return (0, 0); // refused by `supports`: never run
    };
    let p = Plan::new(w, src0, src1, dst, nth.max(1), precision);
    match p.private_src1() {
        true => (0, p.shared),
        false => (p.shared + p.nth * p.per_thread, 0),
    }
}

/// Compute `dst` on all `p.nth` threads (call from every thread of the pool), all scratch in
/// `p.wdata` ([`work_size`]).
pub fn forward(p: &ComputeParams, src0: &TensorView, src1: &TensorView, dst: &TensorView) {
    forward_impl(Isa::detect(), p, src0, src1, dst, false)
}

/// [`forward`] for a graph node whose scratch is [`node_scratch`]: small quantized
/// activations are made by every thread in its own `p.tdata`.
pub fn forward_node(p: &ComputeParams, src0: &TensorView, src1: &TensorView, dst: &TensorView) {
    forward_impl(Isa::detect(), p, src0, src1, dst, true)
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
    forward_impl(isa, p, src0, src1, dst, false)
}

/// The driver; with `private_ok`, src1 is quantized into each thread's `p.tdata` where the
/// plan says so ([`node_scratch`]).
fn forward_impl(
    isa: Isa,
    p: &ComputeParams,
    src0: &TensorView,
    src1: &TensorView,
    dst: &TensorView,
    private_ok: bool,
) {
    let w = match (supports(src0, src1, dst), kernels_for(src0.dtype)) {
        (Ok(()), Some(w)) => w,
        (Err(e), _) => panic!("mul_mat: forward called on unsupported operands: {e}"),
        (Ok(()), None) => unreachable!("supports refuses weights without kernels"),
    };
    let plan = Plan::new(w, src0, src1, dst, p.nth, p.precision);
    let private = private_ok && plan.private_src1();
    // Private activations: the kernels find them at `wdata` as they would the shared ones.
    let own = ComputeParams {
        wdata: p.tdata,
        wsize: p.tsize,
        ..*p
    };
    let p = if private { &own } else { p };
    let need = match private {
        true => plan.shared,
        false => plan.shared + plan.nth * plan.per_thread,
    };
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
    let alone = ComputeParams {
        ith: 0,
        nth: 1,
        ..*p
    };
    // Stage 1: bring src1 into the form the kernels read, shared by all threads.
    match plan.src1 {
        Src1::Direct => {}
        Src1::Gather { ld } => {
            gather_rows(p, &plan, src1, ld);
            p.barrier();
        }
        // Private: this thread quantizes every block (as thread 0 of 1), nobody waits.
        Src1::Quant(lay) => {
            quantize_rows(isa, if private { &alone } else { p }, &plan, src1, lay);
            if !private {
                p.barrier();
            }
        }
        Src1::KQuant(lay) => {
            quantize_rows_k(if private { &alone } else { p }, &plan, src1, lay);
            if !private {
                p.barrier();
            }
        }
    }
    // Stage 2: the items, smaller ones taken from the node's counter, or this thread's share.
    let (plan, mut share) = match p.items {
        Some(_) => (plan.finer(), 0..0),
        None => (plan, split_range(plan.items, p.ith, p.nth)),
    };
    let per_item = plan.cn * plan.cm;
    let mut next = || match p.items {
        Some(c) => Some(c.fetch_add(1, Ordering::Relaxed)).filter(|&i| i < plan.items),
        None => share.next(),
    };
    while let Some(it) = next() {
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
        // output regions, each run by one thread (split_range partitions the item list, the
        // counter hands each index out once).
        unsafe { run_item(isa, p, &plan, src0, src1, dst, &item) };
    }
}

#[cfg(test)]
mod tests {
    use super::plan::CONV_ROWS_SMALL;
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
        // 32 rows of 4096 quants + 2 * 128 f32 each, then two 64-byte vectors per pair of
        // blocks (the AVX-512 kernel's scales).
        assert_eq!(
            work_size(&q, &x, &d, 2, Precision::Q8),
            32 * (4096 + 8 * 128 + 64 * 128)
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
