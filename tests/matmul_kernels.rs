//! The CPU `mul_mat` kernels against a float64 reference computed from the dequantized weights
//! (`dtype.rs` reference conversions) and the f32 activations, by normalized mean squared error:
//! every weight dtype, M in {1, 2, 7, 32, 33} plus GEMM-sized M, odd N and K, padded and
//! transposed activations, broadcast batch dims, KV-cache views, 1..3 threads of a real
//! `ThreadPool`, every SIMD level this CPU has (the scalar fallback forced), every precision
//! (f32 activations: fused in-register dequantization for small M, dequantized scratch for
//! larger M; 8-bit activations; the automatic choice). dst sits between guard bytes that must
//! stay untouched.

mod support;

use metashard::DType;
use metashard::cpu::matmul::{self, Isa, Precision};
use metashard::cpu::{ComputeParams, TensorView, ThreadPool};
use metashard::dtype::{row_from_f32, row_to_f32};
use support::{Rng, quantized_weight_types};

/// A byte buffer with 64-byte alignment.
struct Buf {
    words: Vec<[u64; 8]>,
    len: usize,
}

impl Buf {
    fn new(len: usize, fill: u8) -> Buf {
        let mut b = Buf {
            words: vec![[0u64; 8]; len.div_ceil(64).max(1)],
            len,
        };
        b.bytes_mut().fill(fill);
        b
    }
    fn ptr(&mut self) -> *mut u8 {
        self.words.as_mut_ptr().cast()
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: the vector holds at least `len` initialized bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.len) }
    }
}

/// How src1 is laid out in memory.
#[derive(Clone, Copy, Debug, PartialEq)]
enum XLayout {
    Contiguous,
    /// Rows padded with 5 extra floats; batch strides follow.
    PaddedRows,
    /// Element (k, m) at `k * M + m`: nb[0] = 4 * M, so the kernels gather.
    Transposed,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    wt: DType,
    k: usize,
    n: usize,
    m: usize,
    /// Weight batch dims (ne02, ne03) and activation batch dims (ne12, ne13).
    wb: [usize; 2],
    xb: [usize; 2],
    /// Extra bytes after each weight row.
    w_pad: usize,
    x: XLayout,
    /// Extra floats after each dst row.
    d_pad: usize,
}

const GUARD: usize = 256;
const SENTINEL: u8 = 0xa7;

struct Operands {
    wbuf: Buf,
    w: TensorView,
    xbuf: Buf,
    x: TensorView,
    /// Dequantized weights [batch][n][k] and activations [batch][m][k], in f64.
    wref: Vec<f64>,
    xref: Vec<f64>,
}

fn make_operands(c: &Case, seed: u64) -> Operands {
    let mut rng = Rng::new(seed);
    let [ne02, ne03] = c.wb;
    let row = c.wt.row_size(c.k) + c.w_pad;
    let nb = [c.wt.type_size(), row, row * c.n, row * c.n * ne02];
    let mut wbuf = Buf::new(nb[3] * ne03, 0x55);
    let mut wref = Vec::with_capacity(c.k * c.n * ne02 * ne03);
    let mut vals = vec![0f32; c.k];
    let mut deq = vec![0f32; c.k];
    for r in 0..c.n * ne02 * ne03 {
        vals.iter_mut().for_each(|v| *v = rng.signed_unit());
        let bytes = &mut wbuf.bytes_mut()[r * row..r * row + c.wt.row_size(c.k)];
        row_from_f32(c.wt, &vals, bytes).unwrap();
        row_to_f32(c.wt, bytes, &mut deq).unwrap();
        wref.extend(deq.iter().map(|&v| v as f64));
    }
    let w = TensorView {
        data: wbuf.ptr(),
        dtype: c.wt,
        ne: [c.k, c.n, ne02, ne03],
        nb,
    };

    let [ne12, ne13] = c.xb;
    let nbat = ne12 * ne13;
    let (nbx, xlen) = match c.x {
        XLayout::Contiguous => {
            let r = 4 * c.k;
            ([4, r, r * c.m, r * c.m * ne12], r * c.m * nbat)
        }
        XLayout::PaddedRows => {
            let r = 4 * (c.k + 5);
            (
                [4, r, r * c.m + 12, (r * c.m + 12) * ne12],
                (r * c.m + 12) * nbat,
            )
        }
        XLayout::Transposed => {
            let plane = 4 * c.k * c.m;
            ([4 * c.m, 4, plane, plane * ne12], plane * nbat)
        }
    };
    let mut xbuf = Buf::new(xlen, 0x77);
    let mut xref = Vec::with_capacity(c.k * c.m * nbat);
    for i3 in 0..ne13 {
        for i2 in 0..ne12 {
            for i1 in 0..c.m {
                for i0 in 0..c.k {
                    let v = rng.signed_unit();
                    let off = i0 * nbx[0] + i1 * nbx[1] + i2 * nbx[2] + i3 * nbx[3];
                    xbuf.bytes_mut()[off..off + 4].copy_from_slice(&v.to_le_bytes());
                    xref.push(v as f64);
                }
            }
        }
    }
    let x = TensorView {
        data: xbuf.ptr(),
        dtype: DType::F32,
        ne: [c.k, c.m, ne12, ne13],
        nb: nbx,
    };
    Operands {
        wbuf,
        w,
        xbuf,
        x,
        wref,
        xref,
    }
}

/// Reference output [batch][m][n] in f64.
fn reference(c: &Case, o: &Operands) -> Vec<f64> {
    let [ne02, ne03] = c.wb;
    let [ne12, ne13] = c.xb;
    let mut out = Vec::with_capacity(c.n * c.m * ne12 * ne13);
    for i3 in 0..ne13 {
        for i2 in 0..ne12 {
            let wb = (i3 / (ne13 / ne03)) * ne02 + i2 / (ne12 / ne02);
            let xb = i3 * ne12 + i2;
            for m in 0..c.m {
                let xr = &o.xref[(xb * c.m + m) * c.k..][..c.k];
                for n in 0..c.n {
                    let wr = &o.wref[(wb * c.n + n) * c.k..][..c.k];
                    out.push(wr.iter().zip(xr).map(|(a, b)| a * b).sum());
                }
            }
        }
    }
    out
}

/// Run the kernel; returns dst as [batch][m][n] after checking the guard and padding bytes.
fn run(c: &Case, o: &Operands, pool: &ThreadPool, isa: Isa, precision: Precision) -> Vec<f32> {
    let [ne12, ne13] = c.xb;
    let ld = c.n + c.d_pad;
    let nbd = [4, 4 * ld, 4 * ld * c.m, 4 * ld * c.m * ne12];
    let body = nbd[3] * ne13;
    let mut dbuf = Buf::new(GUARD + body + GUARD, SENTINEL);
    // SAFETY: GUARD < the buffer's length.
    let dptr = unsafe { dbuf.ptr().add(GUARD) };
    let d = TensorView {
        data: dptr,
        dtype: DType::F32,
        ne: [c.n, c.m, ne12, ne13],
        nb: nbd,
    };
    matmul::supports(&o.w, &o.x, &d).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let nth = pool.nth();
    let ws = matmul::work_size(&o.w, &o.x, &d, nth, precision);
    let mut scratch = Buf::new(ws + 1, 0);
    let wdata = scratch.ptr() as usize;
    let (w, x) = (o.w, o.x);
    pool.run(&|ith, barrier| {
        let p = ComputeParams {
            ith,
            nth,
            wdata: wdata as *mut u8,
            wsize: ws,
            tdata: std::ptr::null_mut(),
            tsize: 0,
            barrier,
            precision,
            items: None,
        };
        matmul::forward_with(isa, &p, &w, &x, &d);
    })
    .unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let bytes = dbuf.bytes();
    assert!(
        bytes[..GUARD].iter().all(|&b| b == SENTINEL),
        "{c:?}: wrote before dst"
    );
    assert!(
        bytes[GUARD + body..].iter().all(|&b| b == SENTINEL),
        "{c:?}: wrote after dst"
    );
    let mut out = Vec::with_capacity(c.n * c.m * ne12 * ne13);
    for r in 0..c.m * ne12 * ne13 {
        let row = &bytes[GUARD + r * 4 * ld..][..4 * ld];
        for n in 0..c.n {
            out.push(f32::from_le_bytes(
                row[4 * n..4 * n + 4].try_into().unwrap(),
            ));
        }
        assert!(
            row[4 * c.n..].iter().all(|&b| b == SENTINEL),
            "{c:?}: wrote into row padding"
        );
    }
    out
}

/// The shared NMSE of f32 results against an f64 reference.
fn nmse(got: &[f32], want: &[f64]) -> f64 {
    let got: Vec<f64> = got.iter().map(|&v| v as f64).collect();
    support::compare::nmse(&got, want).0
}

fn nmse32(a: &[f32], b: &[f32]) -> f64 {
    let bb: Vec<f64> = b.iter().map(|&v| v as f64).collect();
    nmse(a, &bb)
}

/// Tolerances (normalized mean squared error against the f64 reference).
/// - Float weights, and quantized weights with f32 activations: the products are the
///   reference's (weights are exactly representable in f32; Q4_1's `q * d + m` is rounded once
///   by the fused kernels where the reference rounds twice, a relative difference of at most
///   2^-24 per weight), only f32 summation differs: a relative error of a few 1e-7 per output,
///   NMSE ~1e-14. Observed maximum over this file: 5e-14; bound 1e-12.
/// - Quantized activations: 8-bit rounding of every activation (relative error ~1/(127 *
///   sqrt(12)) per element) gives NMSE ~1e-5. Observed maximum: 2.1e-5; bound 2e-4.
/// - Two SIMD levels or thread counts: same products, different summation order: 1e-12.
const TOL_FLOAT: f64 = 1e-12;
const TOL_Q8_ACT: f64 = 2e-4;
const TOL_BETWEEN_RUNS: f64 = 1e-12;

/// The precisions a case runs at: all three for quantized weights (they differ only there).
fn modes(wt: DType) -> &'static [Precision] {
    if wt.is_quantized() {
        &[Precision::Exact, Precision::Q8]
    } else {
        &[Precision::Exact]
    }
}

/// The bound for `precision`: f32-level unless the activations are quantized to 8 bits.
fn tolerance(o: &Operands, precision: Precision) -> f64 {
    if matmul::quantizes_activations(&o.w, precision) {
        TOL_Q8_ACT
    } else {
        TOL_FLOAT
    }
}

fn check(c: &Case, pools: &[ThreadPool], seed: u64) {
    let o = make_operands(c, seed);
    let want = reference(c, &o);
    for &precision in modes(c.wt) {
        let mut by_isa: Vec<(Isa, Vec<f32>)> = Vec::new();
        for pool in pools {
            for isa in Isa::available() {
                let got = run(c, &o, pool, isa, precision);
                let e = nmse(&got, &want);
                let tol = tolerance(&o, precision);
                assert!(
                    e <= tol,
                    "{c:?} isa={isa} nth={} precision={precision}: nmse {e:e} > {tol:e}",
                    pool.nth()
                );
                // Every level and thread count agrees with the first to f32 rounding.
                match by_isa.iter().find(|(i, _)| *i == isa).or(by_isa.first()) {
                    Some((_, first)) => {
                        let d = nmse32(&got, first);
                        assert!(
                            d <= TOL_BETWEEN_RUNS,
                            "{c:?} isa={isa} nth={}: {d:e} from first",
                            pool.nth()
                        );
                    }
                    None => by_isa.push((isa, got)),
                }
            }
        }
    }
    if matmul::quantizes_activations(&o.w, Precision::Q8) && c.k > 0 && c.n * c.m > 0 {
        // Exact mode is the accuracy mode: strictly closer to the reference (every quantized
        // type; float weights keep f32 at both precisions).
        let pool = &pools[0];
        let e_exact = nmse(&run(c, &o, pool, Isa::detect(), Precision::Exact), &want);
        let e_q8 = nmse(&run(c, &o, pool, Isa::detect(), Precision::Q8), &want);
        assert!(
            e_exact * 100.0 < e_q8,
            "{c:?}: exact {e_exact:e} vs q8 {e_q8:e}"
        );
    }
    drop((o.wbuf, o.xbuf));
}

fn pools() -> Vec<ThreadPool> {
    (1..=3)
        .map(|n| ThreadPool::new(n, "mm-test").unwrap())
        .collect()
}

fn base(wt: DType, m: usize) -> Case {
    // Three blocks of a quantized type (96 for blocks of 32, 768 for the K-quants' 256).
    let k = if wt.is_quantized() {
        3 * wt.block_size()
    } else {
        67
    };
    Case {
        wt,
        k,
        n: 37,
        m,
        wb: [1, 1],
        xb: [1, 1],
        w_pad: 0,
        x: XLayout::Contiguous,
        d_pad: 0,
    }
}

#[test]
fn every_dtype_m_layout_and_broadcast_matches_the_reference() {
    // The full product: dtype x M x src1 layout x (no broadcast, broadcast over dim 2) x
    // threads {1, 2, 3} x every SIMD level x every precision; odd N and K.
    let pools = pools();
    for &wt in DType::WEIGHT_TYPES {
        for m in [1, 2, 7, 32, 33] {
            for x in [
                XLayout::Contiguous,
                XLayout::PaddedRows,
                XLayout::Transposed,
            ] {
                for (wb, xb) in [([1, 1], [1, 1]), ([2, 1], [4, 1])] {
                    let c = Case {
                        x,
                        wb,
                        xb,
                        ..base(wt, m)
                    };
                    check(&c, &pools, m as u64);
                }
            }
        }
    }
}

#[test]
fn fused_tiles_at_every_small_m() {
    // f32 activations with quantized weights and small M take the fused kernels: M = 1 uses
    // 8 x 1 (AVX-512) or 4 x 1 (AVX2) tiles, larger M the 4 x {4, 3, 2, 1} or 2 x {2, 1} tiles;
    // N = 37 leaves single rows after the full tiles. How small depends on the type and the
    // level (`plan::fused_max_m`: up to 32 on AVX-512), so M = 12..33 runs each type on both
    // sides of its limit. Long rows (K = 4096) cross the prefetch distance many times, and at
    // M = 24 take two passes over the weights (16 activation rows per pass at that K).
    let pools = pools();
    for wt in quantized_weight_types() {
        for m in (1..=9).chain([12, 13, 16, 17, 24, 25, 32, 33]) {
            check(&base(wt, m), &pools, 30 + m as u64);
        }
        for m in [1, 4, 24] {
            check(
                &Case {
                    k: 4096,
                    n: 21,
                    ..base(wt, m)
                },
                &pools[..2],
                40,
            );
        }
    }
}

#[test]
fn only_q8_quantizes_activations_and_only_for_quantized_weights() {
    let o = make_operands(&base(DType::Q4_1, 1), 1);
    assert!(matmul::quantizes_activations(&o.w, Precision::Q8));
    assert!(!matmul::quantizes_activations(&o.w, Precision::Exact));
    // Every quantized type has 8-bit kernels, the types of 2 to 5 bits included.
    for wt in quantized_weight_types() {
        let o = make_operands(&base(wt, 1), 1);
        assert!(matmul::quantizes_activations(&o.w, Precision::Q8), "{wt}");
        assert!(
            !matmul::quantizes_activations(&o.w, Precision::Exact),
            "{wt}"
        );
    }
    let f = make_operands(&base(DType::F16, 1), 1);
    assert!(!matmul::quantizes_activations(&f.w, Precision::Q8));
}

#[test]
fn long_rows_and_odd_k() {
    let pools = pools();
    for &wt in DType::WEIGHT_TYPES {
        for (k, n) in [
            (
                if wt.is_quantized() {
                    wt.block_size()
                } else {
                    1
                },
                5,
            ),
            (1024, 19),
        ] {
            for m in [1, 3] {
                check(
                    &Case {
                        k,
                        n,
                        ..base(wt, m)
                    },
                    &pools,
                    7,
                );
            }
        }
        if !wt.is_quantized() {
            for k in [7, 15, 17, 31, 33] {
                check(&Case { k, ..base(wt, 2) }, &pools, 8);
            }
        }
    }
}

#[test]
fn medium_and_gemm_sized_m() {
    // M from 48 to 511 uses the register tiles at these K; M >= 512, and M >= 64 with K <= 64,
    // use the packed GEMM (with weights converted to f32 for non-f32 dtypes).
    let pools = pools();
    for &wt in DType::WEIGHT_TYPES {
        for m in [48, 65, 130, 520] {
            check(
                &Case {
                    n: 45,
                    ..base(wt, m)
                },
                &pools,
                11,
            );
        }
        check(
            &Case {
                n: 45,
                k: 64.max(wt.block_size()),
                ..base(wt, 64)
            },
            &pools,
            12,
        );
    }
}

#[test]
fn strided_activations_weights_and_outputs() {
    let pools = pools();
    for &wt in DType::WEIGHT_TYPES {
        for x in [XLayout::PaddedRows, XLayout::Transposed] {
            for m in [1, 7, 33, 130] {
                let c = Case {
                    x,
                    w_pad: 6,
                    d_pad: 3,
                    ..base(wt, m)
                };
                check(&c, &pools, 13);
            }
        }
        // Rows at odd byte offsets (f32 rows not 4-byte aligned).
        check(
            &Case {
                w_pad: 3,
                ..base(wt, 2)
            },
            &pools,
            14,
        );
        check(
            &Case {
                w_pad: 3,
                ..base(wt, 129)
            },
            &pools,
            15,
        );
    }
}

#[test]
fn broadcast_batch_dims() {
    let pools = pools();
    for &wt in DType::WEIGHT_TYPES {
        for (wb, xb, m) in [
            ([2, 1], [4, 1], 3),
            ([1, 1], [3, 2], 1),
            ([2, 3], [4, 6], 2),
            ([3, 1], [3, 1], 33),
            ([1, 2], [2, 2], 130),
        ] {
            let c = Case {
                wb,
                xb,
                n: 13,
                d_pad: 1,
                ..base(wt, m)
            };
            check(&c, &pools, 17);
        }
    }
}

#[test]
fn kv_cache_views() {
    // A cache of n_kv positions, each holding 3 heads of 64: K = 64, nb1 = one position,
    // nb2 = one head. Six query heads share three KV heads (r2 = 2).
    let pools = pools();
    for &wt in DType::WEIGHT_TYPES {
        if !64usize.is_multiple_of(wt.block_size()) {
            continue; // a head of 64 is not whole blocks of a K-quant
        }
        for n_kv in [1, 7, 40] {
            for m in [1, 5] {
                let head = wt.row_size(64);
                let c = Case {
                    wt,
                    k: 64,
                    n: n_kv,
                    m,
                    wb: [3, 1],
                    xb: [6, 1],
                    w_pad: 0,
                    x: XLayout::Contiguous,
                    d_pad: 0,
                };
                let mut o = make_operands(&c, 21);
                // Re-lay the weights as a cache: same values, position-major.
                let mut cache = Buf::new(n_kv * 3 * head, 0);
                let src = o.w;
                for h in 0..3 {
                    for pos in 0..n_kv {
                        let from = &o.wbuf.bytes()[h * src.nb[2] + pos * src.nb[1]..][..head];
                        let to = pos * 3 * head + h * head;
                        let from = from.to_vec();
                        cache.bytes_mut()[to..to + head].copy_from_slice(&from);
                    }
                }
                o.w = TensorView {
                    data: cache.ptr(),
                    dtype: wt,
                    ne: [64, n_kv, 3, 1],
                    nb: [wt.type_size(), 3 * head, head, 3 * head * n_kv],
                };
                let want = reference(&c, &o);
                for &precision in modes(wt) {
                    let tol = tolerance(&o, precision);
                    for pool in &pools {
                        for isa in Isa::available() {
                            let got = run(&c, &o, pool, isa, precision);
                            let e = nmse(&got, &want);
                            assert!(
                                e <= tol,
                                "{c:?} {isa} nth={} {precision}: {e:e}",
                                pool.nth()
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn zero_sized_dims() {
    let pools = pools();
    for &wt in DType::WEIGHT_TYPES {
        // K = 0 writes zeros (an empty sum) over whatever dst held.
        let c = Case {
            k: 0,
            ..base(wt, 3)
        };
        let o = make_operands(&c, 1);
        for pool in &pools {
            for &precision in modes(wt) {
                let got = run(&c, &o, pool, Isa::detect(), precision);
                assert!(got.iter().all(|&v| v == 0.0), "{c:?}");
            }
        }
        // Empty N, M and batch dims are no-ops (the guards check nothing is written).
        for c in [
            Case {
                n: 0,
                ..base(wt, 3)
            },
            Case {
                m: 0,
                ..base(wt, 3)
            },
            Case {
                xb: [0, 1],
                wb: [1, 1],
                ..base(wt, 3)
            },
            Case {
                xb: [2, 0],
                wb: [1, 1],
                ..base(wt, 3)
            },
        ] {
            let o = make_operands(&c, 2);
            for pool in &pools {
                for &precision in modes(wt) {
                    assert!(run(&c, &o, pool, Isa::detect(), precision).is_empty());
                }
            }
        }
    }
}

#[test]
fn unsupported_operands_are_refused_by_supports() {
    let c = base(DType::F16, 2);
    let mut o = make_operands(&c, 3);
    let d = TensorView {
        data: std::ptr::null_mut(),
        dtype: DType::F32,
        ne: [c.n, c.m, 1, 1],
        nb: [4, 4 * c.n, 4 * c.n * c.m, 4 * c.n * c.m],
    };
    assert!(matmul::supports(&o.w, &o.x, &d).is_ok());
    o.w.nb[0] = 4;
    assert!(
        matmul::supports(&o.w, &o.x, &d)
            .unwrap_err()
            .contains("contiguous")
    );
    o.w.nb[0] = 2;
    o.x.dtype = DType::F16;
    assert!(
        matmul::supports(&o.w, &o.x, &d)
            .unwrap_err()
            .contains("f32")
    );
}

/// Byte offset of the f16 block scale `d` in a block of `wt` (ggml-common.h: first in every
/// block type but Q2_K (after 16 scale and 64 quant bytes), Q3_K (after 32 + 64 + 12) and
/// Q6_K (after 128 + 64 + 16)).
fn scale_offset(wt: DType) -> usize {
    match wt {
        DType::Q2_K => 80,
        DType::Q3_K => 108,
        DType::Q6_K => 208,
        _ => 0,
    }
}

#[test]
fn non_finite_and_huge_block_scales_give_what_the_reference_gives() {
    // One block of each of rows 0..4 gets the scale NaN, +inf, -inf or 65504 (the largest
    // f16); rows 4..8 stay ordinary. Every level, thread count and precision must give a
    // non-finite output exactly where the reference (dequantized weights, f64 sums) has one,
    // never panic, and agree with it elsewhere: to f32 rounding with f32 activations, to
    // the 8-bit rounding of the activations (a few percent of the sum of |w x|) with --q8.
    const SPECIAL: [u16; 4] = [0x7e00, 0x7c00, 0xfc00, 0x7bff];
    let pools = pools();
    for wt in quantized_weight_types() {
        let c = Case {
            n: 8,
            ..base(wt, 3)
        };
        let mut o = make_operands(&c, 91);
        let row = c.wt.row_size(c.k);
        let nblk = c.k / wt.block_size();
        let mut deq = vec![0f32; c.k];
        for (r, bits) in SPECIAL.iter().enumerate() {
            let at = r * row + (r % nblk) * wt.type_size() + scale_offset(wt);
            o.wbuf.bytes_mut()[at..at + 2].copy_from_slice(&bits.to_le_bytes());
            row_to_f32(wt, &o.wbuf.bytes()[r * row..(r + 1) * row], &mut deq).unwrap();
            for (w, &v) in o.wref[r * c.k..(r + 1) * c.k].iter_mut().zip(&deq) {
                *w = v as f64;
            }
        }
        let want = reference(&c, &o);
        let mag: Vec<f64> = (0..c.m * c.n)
            .map(|i| {
                let (m, n) = (i / c.n, i % c.n);
                let (wr, xr) = (&o.wref[n * c.k..][..c.k], &o.xref[m * c.k..][..c.k]);
                wr.iter().zip(xr).map(|(a, b)| (a * b).abs()).sum()
            })
            .collect();
        assert!(want.iter().any(|v| !v.is_finite()) && want.iter().any(|v| v.is_finite()));
        for pool in &pools {
            for isa in Isa::available() {
                for &precision in modes(wt) {
                    let got = run(&c, &o, pool, isa, precision);
                    let tol = if tolerance(&o, precision) == TOL_FLOAT {
                        1e-5
                    } else {
                        5e-2
                    };
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let at = format!("{wt} {isa} nth={} {precision} output {i}", pool.nth());
                        assert_eq!(g.is_finite(), w.is_finite(), "{at}: {g} vs {w}");
                        if w.is_finite() {
                            assert!((*g as f64 - w).abs() <= tol * mag[i], "{at}: {g} vs {w}");
                        }
                    }
                }
            }
        }
    }
}
