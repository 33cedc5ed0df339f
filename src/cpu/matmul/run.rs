//! Running one work item of a `mul_mat` plan on one thread (the kernels' blocks, the weight
//! conversion into scratch, the `gemm` crate), and the shared first stage: src1 gathered or
//! quantized into the scratch, or zeros when K == 0.

use super::dequant;
use super::float::{self, FloatBlock};
use super::kf32::{self, KF32Block};
use super::klimb::{self, LimbBlock};
use super::kquant::{self, KActLayout, KQuantBlock};
use super::low;
use super::lowf32::{self, LowF32Block};
use super::lowq8::{self, LowQ8Block};
use super::plan::{Path, Plan, Q_CHUNK_M, Src1, fused_chunk_m};
use super::qf32::{self, QF32Block};
use super::quant::{self, ActLayout, QuantBlock};
use super::{FloatW, Isa};
use crate::cpu::view::{ComputeParams, TensorView, split_range};

/// One work item: batch `(i2, i3)`, weight rows `n0..n1`, src1 rows `m0..m1`.
pub(super) struct Item {
    pub(super) i2: usize,
    pub(super) i3: usize,
    pub(super) n0: usize,
    pub(super) n1: usize,
    pub(super) m0: usize,
    pub(super) m1: usize,
}

/// `(first, count)` of the chunks of `size` rows (the last one shorter) that cover `m` rows.
fn row_chunks(m: usize, size: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..m)
        .step_by(size.max(1))
        .map(move |mc| (mc, size.min(m - mc)))
}

/// # Safety
/// The operands passed `supports`, their bytes are valid, scratch holds the plan's bytes, and
/// no other thread writes the item's outputs.
pub(super) unsafe fn run_item(
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
            // Chunks of Q_CHUNK_M activation rows (~7 bytes per element with the AVX-512
            // kernel's vectors: 448 KiB at K = 4096)
            // stay in L2 while the item's weight rows stream past them.
            for (mc, rows) in row_chunks(m, Q_CHUNK_M) {
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
            }
            return;
        }
        if let (Path::KQuant(wt), Src1::KQuant(lay)) = (plan.path, plan.src1) {
            for (mc, rows) in row_chunks(m, Q_CHUNK_M) {
                let b = KQuantBlock {
                    w,
                    ldw: src0.nb[1],
                    a: p.wdata.add((row1 + mc) * lay.row_bytes).cast_const(),
                    lay,
                    d: d.add(mc * ldd),
                    ldd,
                    n,
                    m: rows,
                };
                kquant::block(isa, wt, &b);
            }
            return;
        }
        if let Path::LowQuant(wt) = plan.path {
            let (row_bytes, d_off, s_off) = match plan.src1 {
                Src1::KQuant(l) => (l.row_bytes, l.d_off(), l.s_off()),
                Src1::Quant(l) => (l.row_bytes, l.d_off(), l.s_off()),
                Src1::Direct | Src1::Gather { .. } => return,
            };
            for (mc, rows) in row_chunks(m, Q_CHUNK_M) {
                let b = LowQ8Block {
                    w,
                    ldw: src0.nb[1],
                    wt,
                    x: p.wdata.add((row1 + mc) * row_bytes).cast_const(),
                    ldx: row_bytes,
                    d_off,
                    s_off,
                    d: d.add(mc * ldd),
                    ldd,
                    n,
                    m: rows,
                    nblk: plan.k / low::elems(low::code(wt)),
                };
                lowq8::block(isa, &b);
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
            for (mc, rows) in row_chunks(m, fused_chunk_m(plan.k)) {
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
            }
            return;
        }
        if let Path::LowFused(wt) = plan.path {
            let b = LowF32Block {
                w,
                ldw: src0.nb[1],
                wt,
                x,
                ldx,
                d,
                ldd,
                n,
                m,
                nblk: plan.k / low::elems(low::code(wt)),
                gemv: plan.m == 1,
            };
            lowf32::block(isa, &b);
            return;
        }
        if let Path::KFused(wt) = plan.path {
            for (mc, rows) in row_chunks(m, fused_chunk_m(plan.k)) {
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
                    gemv: plan.m == 1,
                };
                if let Some(lay) = plan.limbs {
                    let scratch = p.wdata.add(plan.shared + p.ith * plan.per_thread);
                    if klimb::block(isa, &LimbBlock { f: b, lay, scratch }) {
                        continue;
                    }
                }
                kf32::block(isa, &b);
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
            | Path::KQuant(_)
            | Path::LowFused(_)
            | Path::LowQuant(_) => return,
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
pub(super) unsafe fn gemm_block(
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
pub(super) fn zero_rows(p: &ComputeParams, plan: &Plan, dst: &TensorView) {
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
pub(super) fn gather_rows(p: &ComputeParams, plan: &Plan, src1: &TensorView, ld: usize) {
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
pub(super) fn quantize_rows(
    isa: Isa,
    p: &ComputeParams,
    plan: &Plan,
    src1: &TensorView,
    lay: ActLayout,
) {
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
            if lay.vectors {
                quant::fill_vectors(row, lay, blk, count);
            }
        }
        f += count;
    }
}

/// [`quantize_rows`] for Q8_K activations (256-element blocks).
pub(super) fn quantize_rows_k(p: &ComputeParams, plan: &Plan, src1: &TensorView, lay: KActLayout) {
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
