//! Op cases of the meta-device tests: for every op of the op set (and views, and chains of
//! ops), random small shapes, random data, and the states each input may take.

use super::check::*;
use super::*;
use metashard::DType;
use metashard::op::{BinaryOp, RopeMode, RopeParams, UnaryOp};
use metashard::split_state::SplitState;
use std::rc::Rc;

/// A random divisor of `x` (1 and `x` included).
pub fn divisor(rng: &mut TestRng, x: usize) -> usize {
    let ds: Vec<usize> = (1..=x).filter(|d| x.is_multiple_of(*d)).collect();
    rng.pick(&ds)
}

/// `count` factored randomly into four dimensions.
pub fn random_shape(rng: &mut TestRng, count: usize) -> [usize; 4] {
    let mut ne = [1usize; 4];
    let mut c = count;
    let mut p = 2;
    while c > 1 {
        while c.is_multiple_of(p) {
            ne[rng.below(4)] *= p;
            c /= p;
        }
        p += 1;
    }
    ne
}

// ---- cases ----------------------------------------------------------------------------------

pub fn mul_mat_case(rng: &mut TestRng, dt: DType, p: [usize; 7]) -> Case {
    let [k, rows, m, b2, r2, b3, r3] = p;
    let k = if dt.is_quantized() {
        32 * k.div_ceil(3)
    } else {
        k
    };
    let a = Leaf::random(rng, "a", dt, [k, rows, b2, b3]);
    let b = Leaf::random(rng, "b", DType::F32, [k, m, b2 * r2, b3 * r3]);
    // Heads split in whole groups half the time (GQA: r2 query heads per kv head).
    let mut sb = Space::any(&b);
    if rng.chance(1, 2) {
        sb = sb.gran(2, r2).gran(3, r3);
    }
    let mut c =
        Case::new(vec![a, b], Rc::new(|g, l| Ok(vec![g.mul_mat(l[0], l[1])?]))).space(1, sb);
    if dt.is_quantized() {
        c.quant_mm = Some((0, 1));
    }
    c
}

pub fn binary_case(rng: &mut TestRng, op: BinaryOp, ne: [usize; 4]) -> Case {
    let mut nb = ne;
    for x in nb.iter_mut() {
        *x = match rng.below(3) {
            0 => *x,
            1 => 1,
            _ => divisor(rng, *x),
        };
    }
    let dta = if rng.chance(1, 4) {
        DType::F16
    } else {
        DType::F32
    };
    let dtb = rng.pick(&[DType::F32, DType::F32, DType::F16]);
    let a = Leaf::random(rng, "a", dta, ne);
    let b = if op == BinaryOp::Div {
        Leaf::random_nonzero(rng, "b", dtb, nb)
    } else {
        Leaf::random(rng, "b", dtb, nb)
    };
    let mut c = Case::new(
        vec![a, b],
        Rc::new(move |g, l| Ok(vec![g.binary(op, l[0], l[1])?])),
    );
    if op == BinaryOp::Div {
        // Partial divisors could sum to anything near zero; their sum is what matters.
        c.spaces[1].partial = false;
    }
    c
}

pub fn unary_case(rng: &mut TestRng, ne: [usize; 4], which: usize) -> Case {
    let a = Leaf::random(rng, "a", DType::F32, ne);
    let s = rng.grid();
    let bias = if rng.chance(1, 2) { 0.0 } else { rng.grid() };
    let lo = rng.grid();
    let hi = lo + rng.grid().abs();
    let u = [
        UnaryOp::Silu,
        UnaryOp::Gelu,
        UnaryOp::GeluErf,
        UnaryOp::Relu,
        UnaryOp::Tanh,
    ];
    Case::new(
        vec![a],
        Rc::new(move |g, l| {
            Ok(vec![match which {
                0 => g.scale_bias(l[0], s, bias)?,
                1 => g.clamp(l[0], lo, hi)?,
                w => g.unary(u[w - 2], l[0])?,
            }])
        }),
    )
}

pub fn swiglu_case(rng: &mut TestRng, n: usize, ne: [usize; 4], fused: bool) -> Case {
    if !fused {
        let a = Leaf::random(rng, "gate", DType::F32, ne);
        let b = Leaf::random(rng, "up", DType::F32, ne);
        return Case::new(vec![a, b], Rc::new(|g, l| Ok(vec![g.swiglu(l[0], l[1])?])));
    }
    let h = ne[0];
    let x = Leaf::random(rng, "gate_up", DType::F32, [2 * h, ne[1], ne[2], ne[3]]);
    // Each device gets equal shares of gate and up: segments [g, g].
    let g = random_extents(rng, h, 1, n);
    let s = Space::any(&x).extra(SplitState::segmented(0, &[g.clone(), g]));
    Case::new(vec![x], Rc::new(|g, l| Ok(vec![g.swiglu_fused(l[0])?]))).space(0, s)
}

pub fn rowwise_case(rng: &mut TestRng, ne: [usize; 4], which: usize) -> Case {
    let a = Leaf::random(rng, "a", DType::F32, ne);
    Case::new(
        vec![a],
        Rc::new(move |g, l| {
            Ok(vec![match which {
                0 => g.rms_norm(l[0], 1e-5)?,
                1 => g.norm(l[0], 1e-5)?,
                2 => g.sum_rows(l[0])?,
                _ => g.mean(l[0])?,
            }])
        }),
    )
}

pub fn soft_max_case(rng: &mut TestRng, ne: [usize; 4], mask: bool) -> Case {
    let a = Leaf::random(rng, "a", DType::F32, ne);
    let scale = (1 + rng.below(8)) as f32 / 4.0;
    if !mask {
        return Case::new(
            vec![a],
            Rc::new(move |g, l| Ok(vec![g.soft_max(l[0], None, scale)?])),
        );
    }
    let nm = [
        ne[0],
        ne[1] + rng.below(2),
        if rng.chance(1, 2) { 1 } else { ne[2] },
        if rng.chance(1, 2) { 1 } else { ne[3] },
    ];
    let dt = rng.pick(&[DType::F32, DType::F16]);
    let mut m = Leaf::random(rng, "mask", dt, nm);
    let inf = rng.chance(1, 3);
    if inf {
        let mut v = m.values();
        v.iter_mut()
            .filter(|_| rng.chance(1, 4))
            .for_each(|x| *x = f32::NEG_INFINITY);
        m = Leaf::from_f32("mask", dt, nm, &v);
    }
    let sm = if inf {
        Space::any(&m).no_partial()
    } else {
        Space::any(&m)
    };
    Case::new(
        vec![a, m],
        Rc::new(move |g, l| Ok(vec![g.soft_max(l[0], Some(l[1]), scale)?])),
    )
    .space(1, sm)
}

pub fn rope_case(rng: &mut TestRng, hd: usize, nh: usize, t: usize, neox: bool) -> Case {
    let hd = 2 * hd;
    let dt = rng.pick(&[DType::F32, DType::F32, DType::F16]);
    let x = Leaf::random(rng, "x", dt, [hd, nh, t, 1]);
    let pos: Vec<i32> = (0..t).map(|_| rng.below(64) as i32).collect();
    let pos = Leaf::from_i32("pos", [t, 1, 1, 1], &pos);
    let p = RopeParams {
        mode: if neox {
            RopeMode::NeoX
        } else {
            RopeMode::Normal
        },
        n_dims: 2 * (1 + rng.below(hd / 2)),
        freq_base: 10000.0,
        freq_scale: rng.pick(&[1.0, 0.5]),
    };
    Case::new(
        vec![x, pos],
        Rc::new(move |g, l| Ok(vec![g.rope(l[0], l[1], p)?])),
    )
}

pub fn argmax_case(rng: &mut TestRng, ne0: usize, ne1: usize) -> Case {
    let a = Leaf::random(rng, "a", DType::F32, [ne0, ne1, 1, 1]);
    Case::new(vec![a], Rc::new(|g, l| Ok(vec![g.argmax(l[0])?])))
}

pub fn get_rows_case(
    rng: &mut TestRng,
    ne0: usize,
    rows: usize,
    nid: usize,
    e2: usize,
    e3: usize,
) -> Case {
    let dt = rng.pick(&[
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::I32,
    ]);
    let ne0 = if dt.is_quantized() {
        32 * ne0.div_ceil(3)
    } else {
        ne0
    };
    let table = if dt == DType::I32 {
        let v: Vec<i32> = (0..ne0 * rows * e2 * e3)
            .map(|_| rng.below(1000) as i32 - 500)
            .collect();
        Leaf::from_i32("table", [ne0, rows, e2, e3], &v)
    } else {
        Leaf::random(rng, "table", dt, [ne0, rows, e2, e3])
    };
    let ids: Vec<i32> = (0..nid * e2 * e3).map(|_| rng.below(rows) as i32).collect();
    let ids = Leaf::from_i32("ids", [nid, e2, e3, 1], &ids);
    Case::new(
        vec![table, ids],
        Rc::new(|g, l| Ok(vec![g.get_rows(l[0], l[1])?])),
    )
}

/// `set_rows(dst, rows, ids)`: the destination's admissible states, and the case.
pub fn set_rows_case(rng: &mut TestRng, p: [usize; 5]) -> (Case, Vec<usize>) {
    let [ne0, r, d2, d3, nr] = p;
    let nr = nr.min(r);
    let dt = rng.pick(&[DType::F32, DType::F16]);
    let dst = Leaf::random(rng, "dst", dt, [ne0, r, d2, d3]);
    let rows = Leaf::random(rng, "rows", DType::F32, [ne0, nr, d2, d3]);
    let (e2, e3) = (divisor(rng, d2), divisor(rng, d3));
    let mut ids = Vec::new();
    for _ in 0..e2 * e3 {
        ids.extend(rng.perm(r).into_iter().take(nr).map(|x| x as i32));
    }
    let ids = Leaf::from_i32("ids", [nr, e2, e3, 1], &ids);
    // The rule: dst Axis(0); Axis(k >= 2) when ids broadcast along k or match rows there.
    let mut axes = vec![0];
    for (k, e) in [(2, e2), (3, e3)] {
        if e == 1 || e == rows.ne[k] {
            axes.push(k);
        }
    }
    let sd = Space::any(&dst).no_partial().axes(&axes);
    let c = Case::new(
        vec![dst, rows, ids],
        Rc::new(|g, l| {
            let s = g.set_rows(l[0], l[1], l[2])?;
            g.set_name(s, "set_rows_out");
            Ok(vec![s])
        }),
    )
    .space(0, sd);
    let c = Case {
        written: vec![0],
        ..c
    };
    (c, axes)
}

pub fn cpy_case(rng: &mut TestRng, ne: [usize; 4]) -> (Case, bool) {
    // A quantized source (dequantized by the copy) keeps its rows: same shape, whole blocks.
    let quant = rng.chance(1, 4);
    let mut ne = ne;
    let sdt = if quant {
        ne[0] = 32 * (1 + ne[0] % 2);
        rng.pick(&[DType::Q8_0, DType::Q4_0, DType::Q4_1])
    } else {
        DType::F32
    };
    let a = Leaf::random(rng, "src", sdt, ne);
    let count: usize = ne.iter().product();
    let transposed = !quant && rng.chance(1, 3);
    let src_ne = if transposed {
        [ne[1], ne[0], ne[2], ne[3]]
    } else {
        ne
    };
    let same = quant || rng.chance(1, 2);
    let dne = if same {
        src_ne
    } else {
        random_shape(rng, count)
    };
    let same = dne == src_ne;
    let dt = rng.pick(&[DType::F32, DType::F16]);
    let dst = Leaf::random(rng, "dst", dt, dne);
    let mut sd = Space::any(&dst).gran(0, sdt.block_size());
    sd.partial &= !quant;
    if !same {
        sd.axes.clear();
        sd.partial = false;
    }
    let c = Case::new(
        vec![a, dst],
        Rc::new(move |g, l| {
            let s = if transposed { g.transpose(l[0])? } else { l[0] };
            let c = g.cpy(s, l[1])?;
            g.set_name(c, "cpy_out");
            Ok(vec![c])
        }),
    )
    .space(1, sd);
    let c = Case {
        written: vec![1],
        ..c
    };
    (c, same)
}

pub fn cast_case(rng: &mut TestRng, ne: [usize; 4]) -> Case {
    let permute = rng.chance(1, 2);
    let p = rng.perm(4);
    let axes = [p[0], p[1], p[2], p[3]];
    let to = rng.pick(&[DType::F32, DType::F16, DType::BF16, DType::Q8_0]);
    let mut ne = ne;
    if to.is_quantized() {
        // The output's dim 0 (input dim i with axes[i] == 0 when permuted) is one block.
        let i = if permute {
            axes.iter().position(|&a| a == 0).unwrap()
        } else {
            0
        };
        ne[i] = 32;
    }
    let a = Leaf::random(rng, "a", DType::F32, ne);
    Case::new(
        vec![a],
        Rc::new(move |g, l| {
            let s = if permute {
                g.permute(l[0], axes)?
            } else {
                l[0]
            };
            Ok(vec![g.cast(s, to)?])
        }),
    )
}

pub fn concat_case(rng: &mut TestRng, ne: [usize; 4], dim: usize, extra: usize) -> Case {
    let mut nb = ne;
    nb[dim] = extra;
    let (a, b) = if rng.chance(1, 5) {
        let v = |rng: &mut TestRng, ne: [usize; 4]| -> Vec<i32> {
            (0..ne.iter().product::<usize>())
                .map(|_| rng.below(100) as i32)
                .collect()
        };
        let va = v(rng, ne);
        let vb = v(rng, nb);
        (Leaf::from_i32("a", ne, &va), Leaf::from_i32("b", nb, &vb))
    } else {
        (
            Leaf::random(rng, "a", DType::F32, ne),
            Leaf::random(rng, "b", DType::F32, nb),
        )
    };
    Case::new(
        vec![a, b],
        Rc::new(move |g, l| Ok(vec![g.concat(l[0], l[1], dim)?])),
    )
}

pub fn flash_attn_case(rng: &mut TestRng, p: [usize; 8]) -> Case {
    let [d, dv, nq, nkv, hk, group, b, mask] = p;
    let dt = rng.pick(&[DType::F32, DType::F16]);
    let h = hk * group;
    let q = Leaf::random(rng, "q", DType::F32, [d, nq, h, b]);
    let k = Leaf::random(rng, "k", dt, [d, nkv, hk, b]);
    let v = Leaf::random(rng, "v", dt, [dv, nkv, hk, b]);
    let scale = (1 + rng.below(4)) as f32 / 4.0;
    let mut leaves = vec![q, k, v];
    let with_mask = mask > 0;
    if with_mask {
        let mut mv: Vec<f32> = (0..nkv * (nq + mask - 1)).map(|_| rng.grid()).collect();
        mv.iter_mut()
            .filter(|_| rng.chance(1, 5))
            .for_each(|x| *x = f32::NEG_INFINITY);
        leaves.push(Leaf::from_f32(
            "mask",
            DType::F16,
            [nkv, nq + mask - 1, 1, 1],
            &mv,
        ));
    }
    let mut sq = Space::any(&leaves[0]);
    if rng.chance(1, 2) {
        sq = sq.gran(2, group);
    }
    let mut c = Case::new(
        leaves,
        Rc::new(move |g, l| {
            Ok(vec![g.flash_attn(
                l[0],
                l[1],
                l[2],
                l.get(3).copied(),
                scale,
            )?])
        }),
    )
    .space(0, sq);
    if with_mask {
        c.spaces[3].partial = false;
    }
    c
}

// ---- views ----------------------------------------------------------------------------------

pub fn reshape_case(rng: &mut TestRng, ne: [usize; 4]) -> Case {
    let a = Leaf::random(rng, "a", DType::F32, ne);
    let to = random_shape(rng, ne.iter().product());
    let s = rng.grid();
    Case::new(
        vec![a],
        Rc::new(move |g, l| {
            let r = g.reshape(l[0], to)?;
            Ok(vec![g.scale(r, s)?])
        }),
    )
}

pub fn permute_case(rng: &mut TestRng, ne: [usize; 4], consumer: usize) -> Case {
    let a = Leaf::random(rng, "a", DType::F32, ne);
    let p = rng.perm(4);
    let axes = [p[0], p[1], p[2], p[3]];
    let transpose = rng.chance(1, 3);
    Case::new(
        vec![a],
        Rc::new(move |g, l| {
            let v = if transpose {
                g.transpose(l[0])?
            } else {
                g.permute(l[0], axes)?
            };
            Ok(vec![match consumer {
                0 => g.cont(v)?,
                1 => g.silu(v)?,
                _ => g.rms_norm(v, 1e-5)?,
            }])
        }),
    )
}

/// A KV cache `[heads * hd, kv_size]` split by whole heads (or anyhow), new rows written with
/// `set_rows`, then viewed as `[hd, n_kv, heads]` from position `p0` and consumed by
/// flash attention or by a batched `mul_mat` (attention scores with GQA broadcast).
pub fn kv_cache_case(rng: &mut TestRng, n: usize, p: [usize; 7]) -> Case {
    let [hd, hk, group, kv, nq, write, fa] = p;
    let emb = hd * hk;
    let dt = rng.pick(&[DType::F32, DType::F16]);
    let ck = Leaf::random(rng, "cache_k", dt, [emb, kv, 1, 1]);
    let cv = Leaf::random(rng, "cache_v", dt, [emb, kv, 1, 1]);
    let q = Leaf::random(rng, "q", DType::F32, [hd, nq, hk * group, 1]);
    // Rows written first (none when `write` is 0: the leaves stay unused).
    let nw = write.min(kv);
    let rows = nw.max(1);
    let knew = Leaf::random(rng, "k_new", DType::F32, [emb, rows, 1, 1]);
    let vnew = Leaf::random(rng, "v_new", DType::F32, [emb, rows, 1, 1]);
    let pos: Vec<i32> = rng
        .perm(kv)
        .into_iter()
        .take(rows)
        .map(|x| x as i32)
        .collect();
    let pos = Leaf::from_i32("pos", [rows, 1, 1, 1], &pos);
    let p0 = rng.below(kv);
    let nkv = 1 + rng.below(kv - p0);
    let heads = SplitState::axis(0, &random_extents(rng, emb, hd, n));
    let cache_space = |l: &Leaf| Space::any(l).no_partial().axes(&[0]).extra(heads.clone());
    let leaves = vec![ck, cv, q, knew, vnew, pos];
    let spaces = vec![
        cache_space(&leaves[0]),
        cache_space(&leaves[1]),
        Space::any(&leaves[2]),
        Space::any(&leaves[3]),
        Space::any(&leaves[4]),
        Space::any(&leaves[5]),
    ];
    let ts = dt.type_size();
    let build: BuildFn = Rc::new(move |g, l| {
        let (mut ck, mut cv) = (l[0], l[1]);
        if nw > 0 {
            ck = g.set_rows(ck, l[3], l[5])?;
            cv = g.set_rows(cv, l[4], l[5])?;
        }
        let row = emb * ts;
        let kview = g.view_3d(ck, [hd, nkv, hk], row, hd * ts, p0 * row)?;
        let vview = g.view_3d(cv, [hd, nkv, hk], row, hd * ts, p0 * row)?;
        if fa == 1 {
            Ok(vec![g.flash_attn(l[2], kview, vview, None, 0.5)?])
        } else {
            // Scores [n_kv, nq, heads]: batched mul_mat, kv heads broadcast over groups.
            let kq = if dt == DType::F32 {
                kview
            } else {
                g.cast(kview, DType::F32)?
            };
            let kq = g.cont(kq)?;
            Ok(vec![g.mul_mat(kq, l[2])?])
        }
    });
    Case {
        leaves,
        spaces,
        build,
        quant_mm: None,
        written: vec![0, 1],
        rel: 0.0,
    }
}

/// A fused tensor `[s0 + s1 + s2, T]` (a leaf, or the output of a column-parallel `mul_mat`)
/// viewed segment by segment, each segment consumed by an op.
pub fn segment_view_case(rng: &mut TestRng, n: usize, p: [usize; 5]) -> Case {
    let [s0, s1, s2, t, from_mm] = p;
    let sizes = [s0, s1, s2];
    let total = s0 + s1 + s2;
    let segs: Vec<Vec<usize>> = sizes
        .iter()
        .map(|&s| random_extents(rng, s, 1, n))
        .collect();
    let k = 1 + rng.below(4);
    let (leaves, spaces) = if from_mm == 1 {
        let w = Leaf::random(rng, "w_qkv", DType::F32, [k, total, 1, 1]);
        let x = Leaf::random(rng, "x", DType::F32, [k, t, 1, 1]);
        let sw = Space::any(&w).extra(SplitState::segmented(1, &segs));
        let sx = Space::any(&x);
        (vec![w, x], vec![sw, sx])
    } else {
        let x = Leaf::random(rng, "qkv", DType::F32, [total, t, 1, 1]);
        let sx = Space::any(&x).extra(SplitState::segmented(0, &segs));
        (vec![x], vec![sx])
    };
    let build: BuildFn = Rc::new(move |g, l| {
        let fused = if from_mm == 1 {
            g.mul_mat(l[0], l[1])?
        } else {
            l[0]
        };
        let row = total * 4;
        let mut outs = Vec::new();
        let mut start = 0;
        for (i, &s) in sizes.iter().enumerate() {
            let v = g.view_2d(fused, s, t, row, start * 4)?;
            outs.push(match i {
                0 => g.scale(v, 0.5)?,
                1 => g.cont(v)?,
                _ => g.silu(v)?,
            });
            start += s;
        }
        Ok(outs)
    });
    Case {
        leaves,
        spaces,
        build,
        quant_mm: None,
        written: Vec::new(),
        rel: 0.0,
    }
}

/// A view of rows `r0..r1` (not a segment) and a view of one column: gathered first.
pub fn sub_view_case(rng: &mut TestRng, ne0: usize, ne1: usize) -> Case {
    let a = Leaf::random(rng, "a", DType::F32, [ne0, ne1, 1, 1]);
    let r0 = rng.below(ne1);
    let r1 = r0 + 1 + rng.below(ne1 - r0);
    let c0 = rng.below(ne0);
    Case::new(
        vec![a],
        Rc::new(move |g, l| {
            let rows = g.view_2d(l[0], ne0, r1 - r0, ne0 * 4, r0 * ne0 * 4)?;
            let col = g.view_2d(l[0], 1, ne1, ne0 * 4, c0 * 4)?;
            Ok(vec![g.cont(rows)?, g.scale(col, 2.0)?])
        }),
    )
}

// ---- chains: ops on derived states ----------------------------------------------------------

/// A random chain of ops over activations `[d0, d1, d2]`: each step takes earlier results (so a
/// node may be consumed in several states, and outputs are also consumed), with weights and a
/// bias as leaves. Covers derived Partial, Axis and Mirrored states meeting every conversion.
pub fn chain_case(rng: &mut TestRng, d: [usize; 3], steps: usize) -> Case {
    let [d0, d1, d2] = d;
    let x = Leaf::random(rng, "x", DType::F32, [d0, d1, d2, 1]);
    let y = Leaf::random(rng, "y", DType::F32, [d0, d1, d2, 1]);
    let w = Leaf::random(rng, "w", DType::F32, [d0, d0, 1, 1]);
    let bias = Leaf::random(rng, "bias", DType::F32, [d0, 1, 1, 1]);
    // (op, operand, operand) by index into the pool of results so far (x and y first).
    let ops: Vec<(usize, usize, usize)> = (0..steps)
        .map(|i| (rng.below(12), rng.below(i + 2), rng.below(i + 2)))
        .collect();
    let also = rng.below(steps + 2);
    Case::new(
        vec![x, y, w, bias],
        Rc::new(move |g, l| {
            let mut pool = vec![l[0], l[1]];
            for &(op, i, j) in &ops {
                let (p, q) = (pool[i], pool[j]);
                let r = match op {
                    0 => g.add(p, q)?,
                    1 => g.mul(p, q)?,
                    2 => g.sub(p, q)?,
                    3 => g.add(p, l[3])?,
                    4 => g.mul_mat(l[2], p)?,
                    5 => g.scale(p, 0.75)?,
                    6 => g.silu(p)?,
                    7 => g.rms_norm(p, 1e-5)?,
                    8 => g.soft_max(p, None, 0.5)?,
                    9 => {
                        let r = g.reshape(p, [d0 * d1, d2, 1, 1])?;
                        let r = g.scale(r, 0.5)?;
                        g.reshape(r, [d0, d1, d2, 1])?
                    }
                    10 => {
                        let s = g.sum_rows(p)?;
                        g.add(q, s)?
                    }
                    _ => {
                        let t = g.transpose(p)?;
                        let t = g.cont(t)?;
                        let t = g.transpose(t)?;
                        g.cont(t)?
                    }
                };
                pool.push(r);
            }
            Ok(vec![*pool.last().unwrap(), pool[also]])
        }),
    )
}

// ---- a decoder attention block --------------------------------------------------------------

/// Sizes of an attention block: head size, kv heads, query heads per kv head, tokens, cached
/// positions before them, and whether the cache is f16.
#[derive(Clone, Copy, Debug)]
pub struct AttnSizes {
    pub hd: usize,
    pub hk: usize,
    pub group: usize,
    pub t: usize,
    pub past: usize,
    pub f16_cache: bool,
}

/// One Llama-style attention block as the model builds it: rms_norm and its weight, Q/K/V
/// projections reshaped to heads, rope on Q and K, K and V written into the caches with
/// set_rows, KV-cache views of all cached positions, flash attention with a causal mask,
/// heads merged back, the output projection, and the residual. With `megatron`, weights and
/// caches take the layout a tensor-parallel model uses (whole GQA groups per device, the output
/// projection row-parallel); otherwise every leaf takes a random state its role admits.
pub fn attention_case(rng: &mut TestRng, n: usize, z: AttnSizes, megatron: bool) -> Case {
    let AttnSizes {
        hd,
        hk,
        group,
        t,
        past,
        f16_cache,
    } = z;
    let h = hk * group;
    let d = h * hd;
    let kv = past + t + rng.below(3);
    let cdt = if f16_cache { DType::F16 } else { DType::F32 };
    let mut leaves = vec![
        Leaf::random(rng, "x", DType::F32, [d, t, 1, 1]),
        Leaf::random(rng, "attn_norm", DType::F32, [d, 1, 1, 1]),
        Leaf::random(rng, "wq", DType::F32, [d, h * hd, 1, 1]),
        Leaf::random(rng, "wk", DType::F32, [d, hk * hd, 1, 1]),
        Leaf::random(rng, "wv", DType::F32, [d, hk * hd, 1, 1]),
        Leaf::random(rng, "wo", DType::F32, [h * hd, d, 1, 1]),
        Leaf::random(rng, "cache_k", cdt, [hk * hd, kv, 1, 1]),
        Leaf::random(rng, "cache_v", cdt, [hk * hd, kv, 1, 1]),
    ];
    let pos: Vec<i32> = (past..past + t).map(|p| p as i32).collect();
    leaves.push(Leaf::from_i32("pos", [t, 1, 1, 1], &pos));
    let nkv = past + t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..nkv).map(move |j| {
                if j <= past + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    leaves.push(Leaf::from_f32("kq_mask", DType::F16, [nkv, t, 1, 1], &mask));
    let mut spaces: Vec<Space> = leaves.iter().map(Space::any).collect();
    // Caches are set_rows destinations: axis 0 (by heads) or mirrored; the mask has -inf.
    for i in [6, 7] {
        spaces[i] = Space::any(&leaves[i]).no_partial().axes(&[0]);
    }
    spaces[9] = spaces[9].clone().no_partial();
    if megatron {
        // Whole GQA groups: kv heads e[d], query heads e[d] * group.
        let groups = random_extents(rng, hk, 1, n);
        let q: Vec<usize> = groups.iter().map(|e| e * group * hd).collect();
        let k: Vec<usize> = groups.iter().map(|e| e * hd).collect();
        let only = |s: SplitState| Space {
            inline: false,
            mirrored: false,
            partial: false,
            axes: Vec::new(),
            gran: [1; 4],
            segments: false,
            extra: vec![s],
        };
        spaces[2] = only(SplitState::axis(1, &q));
        spaces[3] = only(SplitState::axis(1, &k));
        spaces[4] = only(SplitState::axis(1, &k));
        spaces[5] = only(SplitState::axis(0, &q));
        spaces[6] = only(SplitState::axis(0, &k));
        spaces[7] = only(SplitState::axis(0, &k));
    }
    let ts = cdt.type_size();
    let build: BuildFn = Rc::new(move |g, l| {
        let (x, norm, wq, wk, wv, wo, ck, cv, pos, mask) =
            (l[0], l[1], l[2], l[3], l[4], l[5], l[6], l[7], l[8], l[9]);
        let rope = RopeParams {
            mode: RopeMode::NeoX,
            n_dims: hd,
            freq_base: 10000.0,
            freq_scale: 1.0,
        };
        let hn = g.rms_norm(x, 1e-5)?;
        let hn = g.mul(hn, norm)?;
        let q = g.mul_mat(wq, hn)?;
        let q = g.reshape(q, [hd, h, t, 1])?;
        let q = g.rope(q, pos, rope)?;
        let q = g.permute(q, [0, 2, 1, 3])?; // [hd, t, h]
        let k = g.mul_mat(wk, hn)?;
        let k = g.reshape(k, [hd, hk, t, 1])?;
        let k = g.rope(k, pos, rope)?;
        let k = g.reshape(k, [hk * hd, t, 1, 1])?;
        let v = g.mul_mat(wv, hn)?;
        let ck = g.set_rows(ck, k, pos)?;
        let cv = g.set_rows(cv, v, pos)?;
        let row = hk * hd * ts;
        let kview = g.view_3d(ck, [hd, nkv, hk], row, hd * ts, 0)?;
        let vview = g.view_3d(cv, [hd, nkv, hk], row, hd * ts, 0)?;
        let a = g.flash_attn(q, kview, vview, Some(mask), 1.0 / (hd as f32).sqrt())?;
        let a = g.reshape(a, [h * hd, t, 1, 1])?;
        let o = g.mul_mat(wo, a)?;
        Ok(vec![g.add(o, x)?, ck])
    });
    Case {
        leaves,
        spaces,
        build,
        quant_mm: None,
        written: vec![6, 7],
        // K and V pass through the f16 cache: a few f16 ulps (2^-11) of the values.
        rel: if f16_cache { 2e-3 } else { 0.0 },
    }
}
