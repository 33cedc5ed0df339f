//! The randomized cases of the meta properties: for every op of the op set, random small
//! shapes, random grid data, and the states each input may take (`blocks.rs`: views, KV
//! caches, chains of ops, an attention block).

use super::case::{Case, Input, quantized_weight_types};
use super::meta::{Space, random_extents};
use super::rng::Rng;
use metashard::DType;
use metashard::op::{BinaryOp, RopeMode, RopeParams, UnaryOp};
use metashard::split_state::SplitState;

mod blocks;
pub use blocks::*;

/// A random divisor of `x` (1 and `x` included).
pub fn divisor(rng: &mut Rng, x: usize) -> usize {
    let ds: Vec<usize> = (1..=x).filter(|d| x.is_multiple_of(*d)).collect();
    rng.pick(&ds)
}

/// `count` factored randomly into four dimensions.
pub fn random_shape(rng: &mut Rng, count: usize) -> [usize; 4] {
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

pub fn random_mul_mat(rng: &mut Rng, dt: DType, p: [usize; 7]) -> Case {
    let [k, rows, m, b2, r2, b3, r3] = p;
    let k = if dt.is_quantized() {
        dt.block_size() * k.div_ceil(3)
    } else {
        k
    };
    let a = Input::random(rng, "a", dt, [k, rows, b2, b3]);
    let b = Input::random(rng, "b", DType::F32, [k, m, b2 * r2, b3 * r3]);
    // Heads split in whole groups half the time (GQA: r2 query heads per kv head).
    let mut sb = Space::any(&b);
    if rng.chance(1, 2) {
        sb = sb.gran(2, r2).gran(3, r3);
    }
    let mut c = Case::new("mul_mat", vec![a, b], |g, l| {
        Ok(vec![g.mul_mat(l[0], l[1])?])
    })
    .space(1, sb);
    if dt.is_quantized() {
        c.quant_mm = Some((0, 1));
    }
    c
}

pub fn random_binary(rng: &mut Rng, op: BinaryOp, ne: [usize; 4]) -> Case {
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
    let a = Input::random(rng, "a", dta, ne);
    let b = if op == BinaryOp::Div {
        Input::random_nonzero(rng, "b", dtb, nb)
    } else {
        Input::random(rng, "b", dtb, nb)
    };
    let mut c = Case::new(op.name(), vec![a, b], move |g, l| {
        Ok(vec![g.binary(op, l[0], l[1])?])
    });
    if op == BinaryOp::Div {
        // Partial divisors could sum to anything near zero; their sum is what matters.
        c.inputs[1].space.partial = false;
    }
    c
}

pub fn random_unary(rng: &mut Rng, ne: [usize; 4], which: usize) -> Case {
    let a = Input::random(rng, "a", DType::F32, ne);
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
        UnaryOp::Sigmoid,
    ];
    let op = match which {
        0 => "scale",
        1 => "clamp",
        w => u[w - 2].name(),
    };
    Case::new(op, vec![a], move |g, l| {
        Ok(vec![match which {
            0 => g.scale_bias(l[0], s, bias)?,
            1 => g.clamp(l[0], lo, hi)?,
            w => g.unary(u[w - 2], l[0])?,
        }])
    })
}

pub fn random_swiglu(rng: &mut Rng, n: usize, ne: [usize; 4], fused: bool) -> Case {
    if !fused {
        let a = Input::random(rng, "gate", DType::F32, ne);
        let b = Input::random(rng, "up", DType::F32, ne);
        return Case::new("swiglu", vec![a, b], |g, l| Ok(vec![g.swiglu(l[0], l[1])?]));
    }
    let h = ne[0];
    let x = Input::random(rng, "gate_up", DType::F32, [2 * h, ne[1], ne[2], ne[3]]);
    // Each device gets equal shares of gate and up: segments [g, g].
    let g = random_extents(rng, h, 1, n);
    let s = Space::any(&x).extra(SplitState::segmented(0, &[g.clone(), g]));
    Case::new("swiglu", vec![x], |g, l| Ok(vec![g.swiglu_fused(l[0])?])).space(0, s)
}

/// A row-wise op of `a`; `which` 4 is the RMS norm in two ops (`sum_sqr_rows`, then
/// `rms_norm_sums` with a weight), which a split of dimension 0 keeps split, the sums
/// all-reduced.
pub fn random_rowwise(rng: &mut Rng, ne: [usize; 4], which: usize) -> Case {
    let a = Input::random(rng, "a", DType::F32, ne);
    if which >= 4 {
        let w = Input::random(rng, "w", DType::F32, [ne[0], 1, 1, 1]);
        return Case::new("rms_norm_sums", vec![a, w], move |g, l| {
            let sums = g.sum_sqr_rows(l[0])?;
            Ok(vec![g.rms_norm_sums(l[0], sums, l[1], 1e-5, ne[0])?])
        });
    }
    let op = ["rms_norm", "norm", "sum_rows", "mean"][which];
    Case::new(op, vec![a], move |g, l| {
        Ok(vec![match which {
            0 => g.rms_norm(l[0], 1e-5)?,
            1 => g.norm(l[0], 1e-5)?,
            2 => g.sum_rows(l[0])?,
            _ => g.mean(l[0])?,
        }])
    })
}

pub fn random_soft_max(rng: &mut Rng, ne: [usize; 4], mask: bool) -> Case {
    let a = Input::random(rng, "a", DType::F32, ne);
    let scale = (1 + rng.below(8)) as f32 / 4.0;
    if !mask {
        return Case::new("soft_max", vec![a], move |g, l| {
            Ok(vec![g.soft_max(l[0], None, scale)?])
        });
    }
    let nm = [
        ne[0],
        ne[1] + rng.below(2),
        if rng.chance(1, 2) { 1 } else { ne[2] },
        if rng.chance(1, 2) { 1 } else { ne[3] },
    ];
    let dt = rng.pick(&[DType::F32, DType::F16]);
    let mut m = Input::random(rng, "mask", dt, nm);
    let inf = rng.chance(1, 3);
    if inf {
        let mut v = m.values();
        v.iter_mut()
            .filter(|_| rng.chance(1, 4))
            .for_each(|x| *x = f32::NEG_INFINITY);
        m = Input::from_f32("mask", dt, nm, &v);
    }
    let sm = if inf {
        Space::any(&m).no_partial()
    } else {
        Space::any(&m)
    };
    Case::new("soft_max", vec![a, m], move |g, l| {
        Ok(vec![g.soft_max(l[0], Some(l[1]), scale)?])
    })
    .space(1, sm)
}

pub fn random_rope(rng: &mut Rng, hd: usize, nh: usize, t: usize, neox: bool) -> Case {
    let hd = 2 * hd;
    let dt = rng.pick(&[DType::F32, DType::F32, DType::F16]);
    let x = Input::random(rng, "x", dt, [hd, nh, t, 1]);
    let pos: Vec<i32> = (0..t).map(|_| rng.below(64) as i32).collect();
    let pos = Input::from_i32("pos", [t, 1, 1, 1], &pos);
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
    // Half the cases with per-pair frequency factors (Llama 3's `rope_freqs`), in 1..8.
    if rng.below(2) == 1 {
        let f: Vec<f32> = (0..p.n_dims / 2)
            .map(|_| 1.0 + rng.below(7000) as f32 / 1000.0)
            .collect();
        let factors = Input::from_f32("factors", DType::F32, [p.n_dims / 2, 1, 1, 1], &f);
        // Any placement but partial sums (pieces of these values do not add up exactly).
        let sf = Space::any(&factors).no_partial();
        return Case::new("rope", vec![x, pos, factors], move |g, l| {
            Ok(vec![g.rope_ext(l[0], l[1], Some(l[2]), p)?])
        })
        .space(2, sf);
    }
    Case::new("rope", vec![x, pos], move |g, l| {
        Ok(vec![g.rope(l[0], l[1], p)?])
    })
}

pub fn random_argmax(rng: &mut Rng, ne0: usize, ne1: usize) -> Case {
    let a = Input::random(rng, "a", DType::F32, [ne0, ne1, 1, 1]);
    Case::new("argmax", vec![a], |g, l| Ok(vec![g.argmax(l[0])?]))
}

/// `mul_mat_id(experts, b, ids)` of a random weight type: `[k, n, n_expert]` experts, `n_b`
/// activation rows per token (1 or `n_used`), ids that may repeat an expert.
pub fn random_mul_mat_id(rng: &mut Rng, p: [usize; 6]) -> Case {
    let [k, n, n_expert, n_used, shared, tokens] = p;
    let dt = rng.pick(DType::WEIGHT_TYPES);
    let k = if dt.is_quantized() {
        dt.block_size() * k.div_ceil(3)
    } else {
        k
    };
    let n_b = if shared == 0 { 1 } else { n_used };
    let a = Input::random(rng, "experts", dt, [k, n, n_expert, 1]);
    let b = Input::random(rng, "b", DType::F32, [k, n_b, tokens, 1]);
    let ids: Vec<i32> = (0..n_used * tokens)
        .map(|_| rng.below(n_expert) as i32)
        .collect();
    let ids = Input::from_i32("ids", [n_used, tokens, 1, 1], &ids);
    let mut c = Case::new("mul_mat_id", vec![a, b, ids], |g, l| {
        Ok(vec![g.mul_mat_id(l[0], l[1], l[2])?])
    });
    if dt.is_quantized() {
        c.quant_mm = Some((0, 1));
    }
    c
}

pub fn random_argsort(rng: &mut Rng, ne: [usize; 4], descending: bool) -> Case {
    let a = Input::random(rng, "a", DType::F32, ne);
    Case::new("argsort", vec![a], move |g, l| {
        Ok(vec![g.argsort(l[0], descending)?])
    })
}

pub fn random_get_rows(
    rng: &mut Rng,
    ne0: usize,
    rows: usize,
    nid: usize,
    e2: usize,
    e3: usize,
) -> Case {
    // Every weight type, and i32 tables.
    let tables: Vec<DType> = DType::WEIGHT_TYPES
        .iter()
        .copied()
        .chain([DType::I32])
        .collect();
    let dt = rng.pick(&tables);
    let ne0 = if dt.is_quantized() {
        dt.block_size() * ne0.div_ceil(3)
    } else {
        ne0
    };
    let table = if dt == DType::I32 {
        let v: Vec<i32> = (0..ne0 * rows * e2 * e3)
            .map(|_| rng.below(1000) as i32 - 500)
            .collect();
        Input::from_i32("table", [ne0, rows, e2, e3], &v)
    } else {
        Input::random(rng, "table", dt, [ne0, rows, e2, e3])
    };
    let ids: Vec<i32> = (0..nid * e2 * e3).map(|_| rng.below(rows) as i32).collect();
    let ids = Input::from_i32("ids", [nid, e2, e3, 1], &ids);
    Case::new("get_rows", vec![table, ids], |g, l| {
        Ok(vec![g.get_rows(l[0], l[1])?])
    })
}

/// `set_rows(dst, rows, ids)`: the destination's admissible states, and the case.
pub fn random_set_rows(rng: &mut Rng, p: [usize; 5]) -> (Case, Vec<usize>) {
    let [ne0, r, d2, d3, nr] = p;
    let nr = nr.min(r);
    let dt = rng.pick(&[DType::F32, DType::F16]);
    let dst = Input::random(rng, "dst", dt, [ne0, r, d2, d3]);
    let rows = Input::random(rng, "rows", DType::F32, [ne0, nr, d2, d3]);
    let (e2, e3) = (divisor(rng, d2), divisor(rng, d3));
    let mut ids = Vec::new();
    for _ in 0..e2 * e3 {
        ids.extend(rng.perm(r).into_iter().take(nr).map(|x| x as i32));
    }
    let ids = Input::from_i32("ids", [nr, e2, e3, 1], &ids);
    // The rule: dst Axis(0); Axis(1) (its rows: each device writes those it holds, rows and
    // ids gathered); Axis(k >= 2) when ids broadcast along k or match rows there.
    let mut axes = vec![0, 1];
    for (k, e) in [(2, e2), (3, e3)] {
        if e == 1 || e == rows.ne[k] {
            axes.push(k);
        }
    }
    let sd = Space::any(&dst).no_partial().axes(&axes);
    let c = Case::new("set_rows", vec![dst, rows, ids], |g, l| {
        let s = g.set_rows(l[0], l[1], l[2])?;
        g.set_name(s, "set_rows_out");
        Ok(vec![s])
    })
    .space(0, sd);
    let c = Case {
        written: vec![0],
        ..c
    };
    (c, axes)
}

pub fn random_cpy(rng: &mut Rng, ne: [usize; 4]) -> (Case, bool) {
    // A quantized source (dequantized by the copy) keeps its rows: same shape, whole blocks.
    let quant = rng.chance(1, 4);
    let mut ne = ne;
    let sdt = if quant {
        let dt = rng.pick(&quantized_weight_types());
        ne[0] = dt.block_size() * (1 + ne[0] % 2);
        dt
    } else {
        DType::F32
    };
    let a = Input::random(rng, "src", sdt, ne);
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
    let dst = Input::random(rng, "dst", dt, dne);
    let mut sd = Space::any(&dst).gran(0, sdt.block_size());
    sd.partial &= !quant;
    if !same {
        sd.axes.clear();
        sd.partial = false;
    }
    let c = Case::new("cpy", vec![a, dst], move |g, l| {
        let s = if transposed { g.transpose(l[0])? } else { l[0] };
        let c = g.cpy(s, l[1])?;
        g.set_name(c, "cpy_out");
        Ok(vec![c])
    })
    .space(1, sd);
    let c = Case {
        written: vec![1],
        ..c
    };
    (c, same)
}

pub fn random_cast(rng: &mut Rng, ne: [usize; 4]) -> Case {
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
    let a = Input::random(rng, "a", DType::F32, ne);
    Case::new("cont", vec![a], move |g, l| {
        let s = if permute {
            g.permute(l[0], axes)?
        } else {
            l[0]
        };
        Ok(vec![g.cast(s, to)?])
    })
}

pub fn random_concat(rng: &mut Rng, ne: [usize; 4], dim: usize, extra: usize) -> Case {
    let mut nb = ne;
    nb[dim] = extra;
    let (a, b) = if rng.chance(1, 5) {
        let v = |rng: &mut Rng, ne: [usize; 4]| -> Vec<i32> {
            (0..ne.iter().product::<usize>())
                .map(|_| rng.below(100) as i32)
                .collect()
        };
        let va = v(rng, ne);
        let vb = v(rng, nb);
        (Input::from_i32("a", ne, &va), Input::from_i32("b", nb, &vb))
    } else {
        (
            Input::random(rng, "a", DType::F32, ne),
            Input::random(rng, "b", DType::F32, nb),
        )
    };
    Case::new("concat", vec![a, b], move |g, l| {
        Ok(vec![g.concat(l[0], l[1], dim)?])
    })
}

pub fn random_flash_attn(rng: &mut Rng, p: [usize; 8]) -> Case {
    let [d, dv, nq, nkv, hk, group, b, mask] = p;
    let dt = rng.pick(&[DType::F32, DType::F16]);
    let h = hk * group;
    let q = Input::random(rng, "q", DType::F32, [d, nq, h, b]);
    let k = Input::random(rng, "k", dt, [d, nkv, hk, b]);
    let v = Input::random(rng, "v", dt, [dv, nkv, hk, b]);
    let scale = (1 + rng.below(4)) as f32 / 4.0;
    let mut leaves = vec![q, k, v];
    let with_mask = mask > 0;
    if with_mask {
        let mut mv: Vec<f32> = (0..nkv * (nq + mask - 1)).map(|_| rng.grid()).collect();
        mv.iter_mut()
            .filter(|_| rng.chance(1, 5))
            .for_each(|x| *x = f32::NEG_INFINITY);
        leaves.push(Input::from_f32(
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
    let mut c = Case::new("flash_attn", leaves, move |g, l| {
        Ok(vec![g.flash_attn(
            l[0],
            l[1],
            l[2],
            l.get(3).copied(),
            scale,
        )?])
    })
    .space(0, sq);
    if with_mask {
        c.inputs[3].space.partial = false;
    }
    c
}
