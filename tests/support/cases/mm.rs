//! Cases for the contractions: `mul_mat` (every src0 dtype, M = 1, 2, 7, 32, 33, odd N and K
//! for float types, whole blocks for quantized ones, batch and broadcast dims, non-contiguous
//! src1, src0 as a strided KV-cache view) and `flash_attn` (GQA ratios 1 and 3, f32 and f16
//! K/V, with and without a causal mask, odd n_kv, cache views, a fully masked query).
//!
//! Shapes stay modest (K, N <= 256, M <= 33) but for one larger mul_mat, so the whole list runs
//! in seconds even on the placeholder matmul.

use super::u;
use crate::support::case::{Case, Fill, Lay, TRANSPOSED, case, dtype_tol, quantized_weight_types};
use metashard::DType::{self, BF16, F16, F32, Q4_0, Q4_1, Q8_0};
use metashard::{Graph, TensorId};

/// NMSE bounds of a mul_mat with this src0 dtype: (default mode, exact mode).
///
/// Quantized src0 is compared with the f64 product of its dequantized values. In exact mode
/// the backend multiplies in f32 too: f32 accumulation over K <= 1024 leaves a relative error
/// ~eps * sqrt(K / 2) ~ 1e-6, NMSE ~1e-12, bound 1e-10. In default mode the activations are
/// quantized to 8 bits per block of 32 (q8_0/q8_1): a uniform error of +-amax/254, NMSE
/// ~(1/127)^2 / 12 / (1/3) = 1.6e-5 for uniform data. Few outputs make it spread: simulating
/// ggml's q8_0 rounding of the activations over 20,000 seeds (numpy) gave a median of 1.4e-5
/// and a worst case of 3.9e-4 for the smallest shape here (K = 32, N = 7, M = 1); bound 1e-3.
pub fn mul_mat_tols(dt: DType) -> (f64, f64) {
    if dt.is_quantized() {
        (1e-3, 1e-10)
    } else {
        (dtype_tol(dt), dtype_tol(dt))
    }
}

fn mm_case(label: String, a: (DType, [usize; 4], Lay), b: ([usize; 4], Lay)) -> Case {
    let (t, te) = mul_mat_tols(a.0);
    case("mul_mat", label)
        .input("a", a.0, a.1, a.2, u())
        .input("b", F32, b.0, b.1, u())
        .tol(t)
        .tol_exact(te)
        .build(|g, s| g.mul_mat(s[0], s[1]))
}

/// `[D, n, Hk, B]` view of the first `n` positions of a cache root `[D, Hk, ctx, B]`
/// (llama.cpp's K cache layout): rows are packed, row stride is a whole cache position.
pub fn kv_view(g: &mut Graph, cache: TensorId, n: usize) -> metashard::Result<TensorId> {
    let c = *g.layout(cache);
    let ne = [c.ne[0], n, c.ne[1], c.ne[3]];
    g.view(cache, ne, [c.nb[0], c.nb[2], c.nb[1], c.nb[3]], 0)
}

pub fn mul_mat_cases(v: &mut Vec<Case>) {
    let p = Lay::Packed;
    let mnk = |m: usize, n: usize, k: usize| format!("M={m} N={n} K={k}");
    // The float weight types.
    for dt in DType::WEIGHT_TYPES
        .iter()
        .copied()
        .filter(|d| !d.is_quantized())
    {
        for m in [1, 2, 7, 32, 33] {
            for (k, n) in [(33, 17), (65, 7)] {
                v.push(mm_case(
                    mnk(m, n, k),
                    (dt, [k, n, 1, 1], p),
                    ([k, m, 1, 1], p),
                ));
            }
        }
        v.push(mm_case(
            mnk(2, 3, 1),
            (dt, [1, 3, 1, 1], p),
            ([1, 2, 1, 1], p),
        ));
    }
    for dt in quantized_weight_types() {
        // One, three and eight blocks (K = 32, 96, 256 for blocks of 32).
        let bs = dt.block_size();
        for m in [1, 2, 7, 32, 33] {
            for (k, n) in [(bs, 7), (3 * bs, 33), (8 * bs, 16)] {
                v.push(mm_case(
                    mnk(m, n, k),
                    (dt, [k, n, 1, 1], p),
                    ([k, m, 1, 1], p),
                ));
            }
        }
    }
    // Empty contraction (zeros), empty outputs.
    v.push(mm_case(
        mnk(2, 3, 0),
        (F32, [0, 3, 1, 1], p),
        ([0, 2, 1, 1], p),
    ));
    v.push(mm_case(
        mnk(0, 17, 33),
        (F32, [33, 17, 1, 1], p),
        ([33, 0, 1, 1], p),
    ));
    v.push(mm_case(
        mnk(5, 0, 64),
        (Q8_0, [64, 0, 1, 1], p),
        ([64, 5, 1, 1], p),
    ));
    // Batches, and src0 broadcast over dims 2 and 3 (r2 = 3, r3 = 2).
    for &dt in DType::WEIGHT_TYPES {
        let k = dt.block_size().max(64);
        v.push(mm_case(
            "batch 3 x 2".into(),
            (dt, [k, 9, 3, 2], p),
            ([k, 5, 3, 2], p),
        ));
        v.push(mm_case(
            "broadcast r2 = 3, r3 = 2".into(),
            (dt, [k, 9, 2, 1], p),
            ([k, 3, 6, 2], p),
        ));
    }
    v.push(mm_case(
        "broadcast r2 = 3, r3 = 2, 4-d src0".into(),
        (F16, [32, 9, 1, 2], p),
        ([32, 3, 3, 4], p),
    ));
    // Non-contiguous src1.
    for (dt, k) in [(F32, 33), (F16, 33), (Q8_0, 64), (Q4_1, 64)] {
        v.push(mm_case(
            mnk(7, 9, k),
            (dt, [k, 9, 1, 1], p),
            ([k, 7, 1, 1], TRANSPOSED),
        ));
        v.push(mm_case(
            "src1 [K, M, H] from [K, H, M]".into(),
            (dt, [k, 9, 3, 1], p),
            ([k, 5, 3, 1], Lay::Permuted([0, 2, 1, 3])),
        ));
        v.push(mm_case(
            mnk(7, 9, k),
            (dt, [k, 9, 1, 1], p),
            ([k, 7, 2, 1], Lay::Padded { pad: 3, off: 1 }),
        ));
    }
    // src0 with padded rows (a slice of a wider matrix).
    for dt in [F32, F16, Q4_1, Q8_0] {
        let bs = dt.block_size();
        let pad = Lay::Padded {
            pad: 2 * bs.max(2),
            off: bs,
        };
        v.push(mm_case(
            mnk(7, 9, 64),
            (dt, [64, 9, 2, 1], pad),
            ([64, 7, 2, 1], p),
        ));
    }
    // src0 as a KV-cache view: K [64, n_kv = 33, Hk = 2] out of a [64, 2, 40] cache, times q
    // [64, n_q, H] with H = Hk (packed or permuted from [64, H, n_q]) and H = 3 Hk (broadcast).
    for dt in [F32, F16, BF16, Q8_0, Q4_0] {
        for (h, q_lay) in [(2, p), (2, Lay::Permuted([0, 2, 1, 3])), (6, p)] {
            let (t, te) = mul_mat_tols(dt);
            v.push(
                case(
                    "mul_mat",
                    format!("kq: K cache view n_kv 33 of ctx 40, H {h}"),
                )
                .packed("k_cache", dt, [64, 2, 40, 1], u())
                .input("q", F32, [64, 7, h, 1], q_lay, u())
                .tol(t)
                .tol_exact(te)
                .build(|g, s| {
                    let k = kv_view(g, s[0], 33)?;
                    g.mul_mat(k, s[1])
                }),
            );
        }
    }
    // One larger product.
    v.push(mm_case(
        mnk(33, 512, 1024),
        (Q4_0, [1024, 512, 1, 1], p),
        ([1024, 33, 1, 1], p),
    ));
}

struct Fa {
    kv: DType,
    d: usize,
    dv: usize,
    h: usize,
    hk: usize,
    nq: usize,
    nkv: usize,
    b: usize,
    /// Mask dtype, rows (>= nq), fully masked rows.
    mask: Option<(DType, usize, Vec<usize>)>,
    q_lay: Lay,
    /// K and V as views of `[D, Hk, nkv + 4, B]` caches.
    cache: bool,
}

fn fa_case(f: Fa) -> Case {
    let Fa {
        kv,
        d,
        dv,
        h,
        hk,
        nq,
        nkv,
        b,
        q_lay,
        cache,
        ..
    } = f;
    let mut label = format!("D {d} Dv {dv} H {h} Hk {hk} n_q {nq} n_kv {nkv} B {b}");
    if cache {
        label += " (k, v: cache views)";
    }
    let (kne, vne) = if cache {
        ([d, hk, nkv + 4, b], [dv, hk, nkv + 4, b])
    } else {
        ([d, nkv, hk, b], [dv, nkv, hk, b])
    };
    let mut c = case("flash_attn", label)
        .input("q", F32, [d, nq, h, b], q_lay, u())
        .packed("k", kv, kne, u())
        .packed("v", kv, vne, u());
    let has_mask = f.mask.is_some();
    if let Some((mdt, rows, dead)) = f.mask {
        c = c.packed("mask", mdt, [nkv, rows, 1, 1], Fill::CausalMask { dead });
    }
    let scale = 1.0 / (d as f32).sqrt();
    c.build(move |g, s| {
        let (k, v) = if cache {
            (kv_view(g, s[1], nkv)?, kv_view(g, s[2], nkv)?)
        } else {
            (s[1], s[2])
        };
        g.flash_attn(s[0], k, v, has_mask.then(|| s[3]), scale)
    })
}

pub fn flash_attn_cases(v: &mut Vec<Case>) {
    let base = |kv, h, hk, nq, mask| Fa {
        kv,
        d: 64,
        dv: 64,
        h,
        hk,
        nq,
        nkv: 33,
        b: 1,
        mask,
        q_lay: Lay::Packed,
        cache: false,
    };
    for kv in [F32, F16] {
        for (h, hk) in [(3, 3), (6, 2)] {
            for nq in [1, 7] {
                for mask in [None, Some((F32, nq, vec![])), Some((F16, nq + 1, vec![]))] {
                    v.push(fa_case(base(kv, h, hk, nq, mask)));
                }
            }
        }
    }
    let q_perm = Lay::Permuted([0, 2, 1, 3]);
    v.push(fa_case(Fa {
        nkv: 1,
        ..base(F16, 2, 1, 3, Some((F32, 3, vec![])))
    }));
    v.push(fa_case(Fa {
        nkv: 65,
        b: 2,
        ..base(F16, 4, 4, 5, Some((F16, 5, vec![])))
    }));
    v.push(fa_case(Fa {
        d: 32,
        dv: 48,
        ..base(F32, 3, 1, 4, Some((F32, 4, vec![])))
    }));
    // f16 with K rows the AVX-512 block kernel takes (32) and V rows it does not (48), and
    // 128-element rows.
    v.push(fa_case(Fa {
        d: 32,
        dv: 48,
        ..base(F16, 3, 1, 4, Some((F32, 4, vec![])))
    }));
    v.push(fa_case(Fa {
        d: 128,
        dv: 128,
        nkv: 70,
        ..base(F16, 4, 2, 3, Some((F16, 3, vec![])))
    }));
    v.push(fa_case(Fa {
        q_lay: q_perm,
        cache: true,
        ..base(F16, 6, 2, 7, Some((F16, 8, vec![])))
    }));
    v.push(fa_case(Fa {
        q_lay: q_perm,
        cache: true,
        b: 2,
        ..base(F32, 3, 3, 1, None)
    }));
    // No keys at all: every output is zero, like a fully masked query.
    v.push(fa_case(Fa {
        nkv: 0,
        ..base(F32, 3, 3, 2, None)
    }));
    // A query whose every key is masked gets zeros (by design, as soft_max).
    let (dv, h, nq) = (64, 3, 4);
    let c = fa_case(Fa {
        nkv: 9,
        ..base(F32, h, 1, nq, Some((F32, nq, vec![2])))
    });
    v.push(Case {
        params: format!("{} (query 2 fully masked)", c.params),
        check: Some(std::sync::Arc::new(move |out: &[f64]| {
            // Output [Dv, H, n_q, B]: query iq owns dv * H consecutive values.
            for (iq, blk) in out.chunks(dv * h).enumerate() {
                let zero = blk.iter().all(|&x| x == 0.0);
                if (iq % nq == 2) != zero {
                    return Err(format!("query {iq}: all zeros is {zero}"));
                }
            }
            Ok(())
        })),
        ..c
    });
}
