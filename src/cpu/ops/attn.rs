//! Fused attention: for each query row and head, `softmax(q·kⱼ * scale + mask[j, i]) v` with an
//! online softmax over the kv positions (running max and sum, rescaled per block), grouped-query
//! heads (query head h reads kv head h / (H / Hk)). Output is `[Dv, H, n_q, batch]` as ggml's
//! `flash_attn_ext`.
//!
//! Work is cut into units of (batch, kv head, query row) that cover all the query heads of one
//! GQA group, so each K and V row is read by every head of the group while it is in cache, or
//! into single heads where those balance the threads better (`heads_per_unit`). Scores are
//! computed for a block of 32 kv rows, exponentiated together (a vectorizable polynomial exp),
//! then the block's V rows are accumulated. f16 rows of 32, 64 or 128 elements go through
//! AVX-512 block kernels that keep the query row and the accumulator in registers (`avx512`);
//! other f16 rows of a multiple of 8 elements through AVX2 block kernels that do the same 64
//! elements at a time (`avx2`: the AVX2 level, and head sizes such as Gemma 3's 256 on
//! AVX-512); other rows are widened one at a time by `simd::dot_f16_f32_raw` / `axpy_f16_raw`.

use super::thread_scratch;
use crate::DType;
use crate::cpu::simd::{self, Isa};
use crate::cpu::view::{ComputeParams, TensorView};

/// Kv rows per block of scores.
const BLOCK: usize = 32;

/// The element type of the K or V rows the row kernels read, chosen once per node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KvRow {
    F32,
    F16,
}

/// The row kernels for K or V rows of `dtype`, or `None` where there are none (refused by
/// [`supports`]). Every `DType` is matched by name, so none falls through to another's kernel.
const fn kv_row(dtype: DType) -> Option<KvRow> {
    match dtype {
        DType::F32 => Some(KvRow::F32),
        DType::F16 => Some(KvRow::F16),
        DType::BF16
        | DType::I32
        | DType::Q8_0
        | DType::Q4_0
        | DType::Q4_1
        | DType::Q5_0
        | DType::Q5_1
        | DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::IQ4_NL
        | DType::IQ4_XS => None,
        #[cfg(test)]
        DType::FakeQ4x16 => None,
    }
}

pub fn supports(src: &[TensorView]) -> Result<(), String> {
    let (q, k, v) = (&src[0], &src[1], &src[2]);
    if q.dtype != DType::F32 {
        return Err("q must be f32".into());
    }
    for (t, n) in [(k, "k"), (v, "v")] {
        if kv_row(t.dtype).is_none() {
            return Err(format!("{n} must be f32 or f16, not {}", t.dtype));
        }
        if !t.rows_contiguous() {
            return Err(format!("{n} rows must be packed"));
        }
    }
    Ok(())
}

/// Heads processed together per unit on `nth` threads: a whole GQA group (each K and V row
/// converted once for all its heads) unless single heads balance the threads clearly better.
/// Decoding SmolLM2 (3 groups of 3 heads, one query row) on 2 threads: groups give 2 + 1 units
/// (6 head passes on the slower thread), single heads 5 + 4; measured at
/// 224 cached positions: 86 -> 48-62 us per node (noisy machine).
fn heads_per_unit(src: &[TensorView], nth: usize) -> usize {
    let (q, k) = (&src[0], &src[1]);
    let group = (q.ne[2] / k.ne[2].max(1)).max(1);
    let units = q.ne[3] * k.ne[2] * q.ne[1];
    // Head passes on the busiest thread; sharing a group's K/V rows is worth about 10%.
    let grouped = units.div_ceil(nth.max(1)) * group * 9;
    let single = (units * group).div_ceil(nth.max(1)) * 10;
    if single < grouped { 1 } else { group }
}

/// Floats of scratch per thread for `g` heads per unit.
fn per_thread(src: &[TensorView], g: usize) -> usize {
    let (d, dv) = (src[0].ne[0], src[2].ne[0]);
    g * d + g * dv + g * BLOCK + 3 * g + 64
}

/// Private scratch bytes per thread on `nth` threads.
pub fn thread_bytes(src: &[TensorView], nth: usize) -> usize {
    per_thread(src, heads_per_unit(src, nth)) * 4
}

/// `e^x` for x <= 0 (and moderately positive), ~2 ulp: range reduction by ln 2 and a degree-6
/// polynomial for e^r on [-ln2/2, ln2/2] (Taylor coefficients), then scaling by 2^n through the
/// exponent bits. Written without branches so loops over blocks vectorize.
#[inline(always)]
pub(super) fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer (ties to even) for
    // |v| < 2^22, in two vectorizable additions (`f32::round` is a libm call).
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // `t`'s bits are ROUND's plus n (|n| <= 127), so 2^n's exponent field is read off them
    // with integer arithmetic (`n as i32` is a saturating conversion, which keeps the loops
    // scalar).
    let scale = f32::from_bits(t.to_bits().wrapping_sub(ROUND.to_bits() - 127) << 23);
    p * scale
}

/// The row kernels of K and V (their types were checked by [`supports`]).
fn kv_rows(k: &TensorView, v: &TensorView) -> (KvRow, KvRow) {
    match (kv_row(k.dtype), kv_row(v.dtype)) {
        (Some(kt), Some(vt)) => (kt, vt),
        _ => panic!(
            "flash_attn: forward called on unsupported K/V types {} {}",
            k.dtype, v.dtype
        ),
    }
}

/// `dot(a, row)` for a packed f32 or f16 row of `n` elements at `row`.
///
/// # Safety
/// `a` holds `n` floats and `row` one packed row of `n` elements of `kt`.
#[inline(always)]
unsafe fn dot_row(isa: Isa, a: *const f32, row: *const u8, kt: KvRow, n: usize) -> f32 {
    // SAFETY: per the function's contract.
    unsafe {
        match kt {
            KvRow::F32 => simd::dot_f32_raw(isa, a, row.cast(), n),
            KvRow::F16 => simd::dot_f16_f32_raw(isa, a, row, n),
        }
    }
}

/// `acc += w * row` for a packed f32 or f16 row of `acc.len()` elements at `row`.
///
/// # Safety
/// `row` is one packed row of `acc.len()` elements of `vt`.
#[inline(always)]
unsafe fn axpy_row(isa: Isa, acc: &mut [f32], w: f32, row: *const u8, vt: KvRow) {
    // SAFETY: per the function's contract; acc and the tensor row do not overlap (the
    // scratch is the node's own memory).
    unsafe {
        match vt {
            KvRow::F32 => {
                let vr = std::slice::from_raw_parts(row.cast::<f32>(), acc.len());
                for (a, &x) in acc.iter_mut().zip(vr) {
                    *a += w * x;
                }
            }
            KvRow::F16 => simd::axpy_f16_raw(isa, acc.as_mut_ptr(), w, row, acc.len()),
        }
    }
}

/// The block kernels a row of `n` elements of type `t` goes through, chosen once per node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Blocks {
    /// AVX-512, this many vectors of 16 f32 per row (2, 4 or 8).
    Avx512(usize),
    /// AVX2, 64 elements (8 vectors of 8 f32) at a time.
    Avx2,
}

/// [`Blocks`] for f16 rows of `n` elements on `isa`: AVX-512 for 32, 64 or 128 elements (the
/// head sizes of most models), AVX2 for any other multiple of 8 on a CPU with AVX2; None for
/// f32 rows and other lengths (row by row).
fn blocks(isa: Isa, t: KvRow, n: usize) -> Option<Blocks> {
    if !cfg!(target_arch = "x86_64") || t != KvRow::F16 || n == 0 || !n.is_multiple_of(8) {
        return None;
    }
    match isa {
        Isa::Avx512 if n.is_multiple_of(16) && matches!(n / 16, 2 | 4 | 8) => {
            Some(Blocks::Avx512(n / 16))
        }
        Isa::Avx512 | Isa::Avx2 => Some(Blocks::Avx2),
        Isa::Scalar => None,
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// `out[j] = dot(q, k_j)` for `n` f16 rows `k_j = k + j * ld` of `16 * C` elements, the
    /// query row held in registers.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL and F16C are available; `q` holds `16 * C` floats, each K row
    /// `32 * C` bytes, `out` `n` floats.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dots<const C: usize>(
        q: *const f32,
        k: *const u8,
        ld: usize,
        n: usize,
        out: *mut f32,
    ) {
        // SAFETY (whole body): within the bounds the caller vouched for.
        unsafe {
            let qv: [__m512; C] = std::array::from_fn(|c| _mm512_loadu_ps(q.add(16 * c)));
            for j in 0..n {
                let row = k.add(j * ld);
                let mut acc = _mm512_setzero_ps();
                for (c, qc) in qv.iter().enumerate() {
                    let kv = _mm512_cvtph_ps(_mm256_loadu_si256(row.add(32 * c).cast()));
                    acc = _mm512_fmadd_ps(*qc, kv, acc);
                }
                *out.add(j) = _mm512_reduce_add_ps(acc);
            }
        }
    }

    /// `acc += sum_j w[j] * v_j` over `n` f16 rows `v_j = v + j * ld` of `16 * C` elements,
    /// the accumulator held in registers; rows with `w[j] == 0` are skipped (never read: past
    /// the causal mask they may hold anything).
    ///
    /// # Safety
    /// As [`dots`], with `acc` holding `16 * C` floats and `w` `n`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn axpys<const C: usize>(
        acc: *mut f32,
        w: *const f32,
        v: *const u8,
        ld: usize,
        n: usize,
    ) {
        // SAFETY (whole body): within the bounds the caller vouched for.
        unsafe {
            let mut a: [__m512; C] = std::array::from_fn(|c| _mm512_loadu_ps(acc.add(16 * c)));
            for j in 0..n {
                let wj = *w.add(j);
                if wj == 0.0 {
                    continue;
                }
                let (wv, row) = (_mm512_set1_ps(wj), v.add(j * ld));
                for (c, ac) in a.iter_mut().enumerate() {
                    let vv = _mm512_cvtph_ps(_mm256_loadu_si256(row.add(32 * c).cast()));
                    *ac = _mm512_fmadd_ps(wv, vv, *ac);
                }
            }
            for (c, ac) in a.iter().enumerate() {
                _mm512_storeu_ps(acc.add(16 * c), *ac);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// `out[j] = dot(q, k_j)` (or `+=` with `add`) for `n` f16 rows `k_j = k + j * ld` of
    /// `8 * C` elements, the query row held in registers, two accumulators.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available; `q` holds `8 * C` floats, each K row `16 * C` bytes,
    /// `out` `n` floats.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots<const C: usize>(
        q: *const f32,
        k: *const u8,
        ld: usize,
        n: usize,
        out: *mut f32,
        add: bool,
    ) {
        // SAFETY (whole body): within the bounds the caller vouched for.
        unsafe {
            let qv: [__m256; C] = std::array::from_fn(|c| _mm256_loadu_ps(q.add(8 * c)));
            for j in 0..n {
                let row = k.add(j * ld);
                let mut acc = [_mm256_setzero_ps(); 2];
                for (c, qc) in qv.iter().enumerate() {
                    let kv = _mm256_cvtph_ps(_mm_loadu_si128(row.add(16 * c).cast()));
                    acc[c % 2] = _mm256_fmadd_ps(*qc, kv, acc[c % 2]);
                }
                let s = crate::cpu::simd::hsum256(_mm256_add_ps(acc[0], acc[1]));
                *out.add(j) = if add { *out.add(j) + s } else { s };
            }
        }
    }

    /// `acc += sum_j w[j] * v_j` over `n` f16 rows `v_j = v + j * ld` of `8 * C` elements,
    /// the accumulator held in registers; rows with `w[j] == 0` are skipped (never read: past
    /// the causal mask they may hold anything).
    ///
    /// # Safety
    /// As [`dots`], with `acc` holding `8 * C` floats and `w` `n`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpys<const C: usize>(
        acc: *mut f32,
        w: *const f32,
        v: *const u8,
        ld: usize,
        n: usize,
    ) {
        // SAFETY (whole body): within the bounds the caller vouched for.
        unsafe {
            let mut a: [__m256; C] = std::array::from_fn(|c| _mm256_loadu_ps(acc.add(8 * c)));
            for j in 0..n {
                let wj = *w.add(j);
                if wj == 0.0 {
                    continue;
                }
                let (wv, row) = (_mm256_set1_ps(wj), v.add(j * ld));
                for (c, ac) in a.iter_mut().enumerate() {
                    let vv = _mm256_cvtph_ps(_mm_loadu_si128(row.add(16 * c).cast()));
                    *ac = _mm256_fmadd_ps(wv, vv, *ac);
                }
            }
            for (c, ac) in a.iter().enumerate() {
                _mm256_storeu_ps(acc.add(8 * c), *ac);
            }
        }
    }

    /// [`dots`] over a row of `d` elements (a multiple of 8): pieces of 64, their sums added.
    ///
    /// # Safety
    /// As [`dots`] for `d` elements.
    pub unsafe fn row_dots(
        d: usize,
        q: *const f32,
        k: *const u8,
        ld: usize,
        n: usize,
        out: *mut f32,
    ) {
        let mut e = 0;
        while e < d {
            // SAFETY: elements e..e + 8C of every row and of q are inside them.
            unsafe {
                let (q, k, add) = (q.add(e), k.add(2 * e), e > 0);
                match (d - e).min(64) / 8 {
                    8 => dots::<8>(q, k, ld, n, out, add),
                    7 => dots::<7>(q, k, ld, n, out, add),
                    6 => dots::<6>(q, k, ld, n, out, add),
                    5 => dots::<5>(q, k, ld, n, out, add),
                    4 => dots::<4>(q, k, ld, n, out, add),
                    3 => dots::<3>(q, k, ld, n, out, add),
                    2 => dots::<2>(q, k, ld, n, out, add),
                    _ => dots::<1>(q, k, ld, n, out, add),
                }
            }
            e += 64;
        }
    }

    /// [`axpys`] over rows of `d` elements (a multiple of 8): 64 of them at a time.
    ///
    /// # Safety
    /// As [`axpys`] for `d` elements.
    pub unsafe fn row_axpys(
        d: usize,
        acc: *mut f32,
        w: *const f32,
        v: *const u8,
        ld: usize,
        n: usize,
    ) {
        let mut e = 0;
        while e < d {
            // SAFETY: elements e..e + 8C of every row and of acc are inside them.
            unsafe {
                let (acc, v) = (acc.add(e), v.add(2 * e));
                match (d - e).min(64) / 8 {
                    8 => axpys::<8>(acc, w, v, ld, n),
                    7 => axpys::<7>(acc, w, v, ld, n),
                    6 => axpys::<6>(acc, w, v, ld, n),
                    5 => axpys::<5>(acc, w, v, ld, n),
                    4 => axpys::<4>(acc, w, v, ld, n),
                    3 => axpys::<3>(acc, w, v, ld, n),
                    2 => axpys::<2>(acc, w, v, ld, n),
                    _ => axpys::<1>(acc, w, v, ld, n),
                }
            }
            e += 64;
        }
    }
}

/// `out[j] = dot(q, k_j)` for `n` f16 rows of `d` elements through the block kernels `b`.
///
/// # Safety
/// As [`avx512::dots`] / [`avx2::dots`] for rows of `d` elements; `b` came from [`blocks`]
/// for `d`.
#[cfg(target_arch = "x86_64")]
unsafe fn block_dots(
    b: Blocks,
    d: usize,
    q: *const f32,
    k: *const u8,
    ld: usize,
    n: usize,
    out: *mut f32,
) {
    // SAFETY: forwarded; `blocks` checked the level and the row length.
    unsafe {
        match b {
            Blocks::Avx512(2) => avx512::dots::<2>(q, k, ld, n, out),
            Blocks::Avx512(4) => avx512::dots::<4>(q, k, ld, n, out),
            Blocks::Avx512(_) => avx512::dots::<8>(q, k, ld, n, out),
            Blocks::Avx2 => avx2::row_dots(d, q, k, ld, n, out),
        }
    }
}

/// `acc += sum_j w[j] * v_j` over `n` f16 rows of `d` elements through the block kernels `b`.
///
/// # Safety
/// As [`avx512::axpys`] / [`avx2::axpys`] for rows of `d` elements; `b` came from [`blocks`]
/// for `d`.
#[cfg(target_arch = "x86_64")]
unsafe fn block_axpys(
    b: Blocks,
    d: usize,
    acc: *mut f32,
    w: *const f32,
    v: *const u8,
    ld: usize,
    n: usize,
) {
    // SAFETY: forwarded; `blocks` checked the level and the row length.
    unsafe {
        match b {
            Blocks::Avx512(2) => avx512::axpys::<2>(acc, w, v, ld, n),
            Blocks::Avx512(4) => avx512::axpys::<4>(acc, w, v, ld, n),
            Blocks::Avx512(_) => avx512::axpys::<8>(acc, w, v, ld, n),
            Blocks::Avx2 => avx2::row_axpys(d, acc, w, v, ld, n),
        }
    }
}

/// The block-aligned start and the end of the cache rows query row `iq` may see: from the
/// block holding the first row whose mask value is not `-inf` to just past the last such row
/// (`(0, 0)` when the mask hides every row). A step over many sequences in one cache (each
/// query row sees its own sequence's rows) would otherwise test every block of every other
/// sequence, for every head block: for 8 sequences of SmolLM2 in a 4096-row cache, that scan
/// was most of the attention's time. Memoized per row in `seen`.
fn visible_blocks(
    mk: &TensorView,
    iq: usize,
    n_kv: usize,
    seen: &mut [Option<(usize, usize)>],
) -> (usize, usize) {
    if let Some(span) = seen[iq] {
        return span;
    }
    let shown = |j: usize| {
        // SAFETY: the builder checked the mask is [n_kv, >= n_q]; j < n_kv.
        unsafe { mk.get_f32(j, iq, 0, 0) != f32::NEG_INFINITY }
    };
    let span = if mk.dtype == crate::DType::F32 && mk.nb[0] == 4 {
        // SAFETY: as above; row iq holds n_kv packed f32.
        let row = unsafe { std::slice::from_raw_parts(mk.row_ptr(iq, 0, 0).cast::<f32>(), n_kv) };
        let first = row.iter().position(|&x| x != f32::NEG_INFINITY);
        let last = row.iter().rposition(|&x| x != f32::NEG_INFINITY);
        first.zip(last)
    } else {
        (0..n_kv).position(shown).zip((0..n_kv).rposition(shown))
    };
    let span = span.map_or((0, 0), |(a, b)| (a / BLOCK * BLOCK, b + 1));
    seen[iq] = Some(span);
    span
}

pub fn flash_attn(p: &ComputeParams, dst: &TensorView, src: &[TensorView], scale: f32) {
    let isa = Isa::detect();
    let (q, k, v) = (&src[0], &src[1], &src[2]);
    let mask = src.get(3);
    let (d, dv, n_kv) = (q.ne[0], v.ne[0], k.ne[1]);
    let (n_q, n_head, batch, n_kvh) = (q.ne[1], q.ne[2], q.ne[3], k.ne[2]);
    let group = (n_head / n_kvh.max(1)).max(1);
    let g = heads_per_unit(src, p.nth);
    let (kt, vt) = kv_rows(k, v);
    // Blocks of f16 K and V rows through the AVX-512 or AVX2 kernels (query row and
    // accumulator in registers, one call per block and head), or row by row.
    let (k_chunks, v_chunks) = (blocks(isa, kt, d), blocks(isa, vt, dv));
    // SAFETY: thread_bytes reserved `per_thread` floats for this thread and this `g`.
    let buf = unsafe { thread_scratch(p, per_thread(src, g)) };
    let (qs, rest) = buf.split_at_mut(g * d);
    let (acc, rest) = rest.split_at_mut(g * dv);
    let (sc, rest) = rest.split_at_mut(g * BLOCK);
    let (m, rest) = rest.split_at_mut(g);
    let l = &mut rest[..g];
    // Units: (batch, head block, query row); a head block is `g` consecutive query heads.
    let blocks = n_head / g;
    let units = batch * blocks * n_q;
    // Each query row's span of rows the mask shows, found once per row and thread.
    let mut visible: Vec<Option<(usize, usize)>> = vec![None; if mask.is_some() { n_q } else { 0 }];
    for u in p.range(units) {
        let (iq, hb, b) = (u % n_q, (u / n_q) % blocks, u / (n_q * blocks));
        let h0 = hb * g;
        let hk = h0 / group;
        for j in 0..g {
            // SAFETY: the query row (iq, h0 + j, b) is in range; qs holds g rows of d floats.
            unsafe { super::read_row_f32(q, iq, h0 + j, b, &mut qs[j * d..(j + 1) * d]) };
        }
        acc.fill(0.0);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        // Only the blocks from the first to the last row the mask shows can add anything.
        let (mut j0, end) = match mask {
            Some(mk) => visible_blocks(mk, iq, n_kv, &mut visible),
            None => (0, n_kv),
        };
        while j0 < end {
            let jn = BLOCK.min(n_kv - j0);
            // A block the mask hides entirely adds nothing (its weights are all 0): skipped, so
            // a step over many sequences in one cache (each token seeing its own sequence's
            // rows) reads only those rows.
            // SAFETY: the builder checked the mask is [n_kv, >= n_q].
            let hidden = |mk: &TensorView| unsafe {
                (j0..j0 + jn).all(|j| mk.get_f32(j, iq, 0, 0) == f32::NEG_INFINITY)
            };
            if mask.is_some_and(hidden) {
                j0 += jn;
                continue;
            }
            // Scores of the block for every head.
            #[cfg(target_arch = "x86_64")]
            if let Some(kc) = k_chunks {
                // SAFETY: rows j0..j0 + jn of kv head hk are packed rows `nb[1]` apart; the
                // query rows hold d floats and sc holds BLOCK scores per head.
                unsafe {
                    let kr = k.row_ptr(j0, hk, b).cast_const();
                    for h in 0..g {
                        let (qh, out) = (qs[h * d..].as_ptr(), sc[h * BLOCK..].as_mut_ptr());
                        block_dots(kc, d, qh, kr, k.nb[1], jn, out);
                    }
                }
                for jj in 0..jn {
                    // SAFETY: the builder checked the mask is [n_kv, >= n_q].
                    let mv = mask.map_or(0.0, |mk| unsafe { mk.get_f32(j0 + jj, iq, 0, 0) });
                    for h in 0..g {
                        let x = &mut sc[h * BLOCK + jj];
                        // A masked row may hold anything: its score is -inf whatever the dot.
                        *x = if mv == f32::NEG_INFINITY {
                            f32::NEG_INFINITY
                        } else {
                            *x * scale + mv
                        };
                    }
                }
            }
            for jj in 0..if k_chunks.is_some() { 0 } else { jn } {
                let j = j0 + jj;
                // SAFETY: the builder checked the mask is [n_kv, >= n_q].
                let mv = mask.map_or(0.0, |mk| unsafe { mk.get_f32(j, iq, 0, 0) });
                if mv == f32::NEG_INFINITY {
                    for h in 0..g {
                        sc[h * BLOCK + jj] = f32::NEG_INFINITY;
                    }
                    continue;
                }
                // SAFETY: j < n_kv, hk < Hk, b < batch; rows are packed (checked by `supports`).
                let kr = unsafe { k.row_ptr(j, hk, b).cast_const() };
                for h in 0..g {
                    // SAFETY: the query row holds d floats, the K row d elements.
                    let s = unsafe { dot_row(isa, qs[h * d..].as_ptr(), kr, kt, d) };
                    sc[h * BLOCK + jj] = s * scale + mv;
                }
            }
            // Online softmax update per head, then probabilities in place of the scores.
            for h in 0..g {
                let s = &mut sc[h * BLOCK..h * BLOCK + jn];
                let bm = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                if bm == f32::NEG_INFINITY {
                    s.fill(0.0);
                    continue;
                }
                let nm = m[h].max(bm);
                if m[h] != f32::NEG_INFINITY && nm > m[h] {
                    let c = exp_fast(m[h] - nm);
                    acc[h * dv..(h + 1) * dv].iter_mut().for_each(|x| *x *= c);
                    l[h] *= c;
                }
                m[h] = nm;
                let mut sum = 0.0;
                for x in s.iter_mut() {
                    *x = if *x == f32::NEG_INFINITY {
                        0.0
                    } else {
                        exp_fast(*x - nm)
                    };
                    sum += *x;
                }
                l[h] += sum;
            }
            // Accumulate the block's V rows.
            #[cfg(target_arch = "x86_64")]
            if let Some(vc) = v_chunks {
                // SAFETY: as for K; acc holds dv floats per head.
                unsafe {
                    let vr = v.row_ptr(j0, hk, b).cast_const();
                    for h in 0..g {
                        let (ah, wh) = (acc[h * dv..].as_mut_ptr(), sc[h * BLOCK..].as_ptr());
                        block_axpys(vc, dv, ah, wh, vr, v.nb[1], jn);
                    }
                }
            }
            for jj in 0..if v_chunks.is_some() { 0 } else { jn } {
                if (0..g).all(|h| sc[h * BLOCK + jj] == 0.0) {
                    continue;
                }
                // SAFETY: as for K.
                let vr = unsafe { v.row_ptr(j0 + jj, hk, b).cast_const() };
                for h in 0..g {
                    let w = sc[h * BLOCK + jj];
                    // SAFETY: the V row holds dv elements, acc's slice dv floats.
                    unsafe { axpy_row(isa, &mut acc[h * dv..(h + 1) * dv], w, vr, vt) };
                }
            }
            j0 += jn;
        }
        for h in 0..g {
            let inv = if l[h] > 0.0 { 1.0 / l[h] } else { 0.0 };
            for (i, a) in acc[h * dv..(h + 1) * dv].iter().enumerate() {
                // SAFETY: dst is [dv, H, n_q, batch]; element (i, h0 + h, iq, b) is this unit's.
                unsafe { dst.set_f32(i, h0 + h, iq, b, a * inv) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::exp_fast;

    #[test]
    fn exp_fast_is_accurate() {
        let mut worst = 0f64;
        let mut x = -80.0f32;
        while x < 10.0 {
            let (a, b) = (exp_fast(x) as f64, (x as f64).exp());
            worst = worst.max(((a - b) / b).abs());
            x += 0.0137;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert!(exp_fast(-1000.0) < 1e-37);
    }
}
