//! Randomized meta cases beyond single ops: view ops (reshape, permute, sub-views, segment
//! views of fused tensors), KV-cache writes and views, chains of ops over derived states, and a
//! decoder attention block (random states, or the layout a tensor-parallel model uses).

use super::random_shape;
use crate::support::case::{Case, Input};
use crate::support::meta::{Space, random_extents};
use crate::support::rng::Rng;
use metashard::op::{RopeMode, RopeParams};
use metashard::split_state::SplitState;
use metashard::{DType, Graph, Result, TensorId};

// ---- views ----------------------------------------------------------------------------------

pub fn random_reshape(rng: &mut Rng, ne: [usize; 4]) -> Case {
    let a = Input::random(rng, "a", DType::F32, ne);
    let to = random_shape(rng, ne.iter().product());
    let s = rng.grid();
    Case::new("reshape", vec![a], move |g, l| {
        let r = g.reshape(l[0], to)?;
        Ok(vec![g.scale(r, s)?])
    })
}

pub fn random_permute(rng: &mut Rng, ne: [usize; 4], consumer: usize) -> Case {
    let a = Input::random(rng, "a", DType::F32, ne);
    let p = rng.perm(4);
    let axes = [p[0], p[1], p[2], p[3]];
    let transpose = rng.chance(1, 3);
    Case::new("permute", vec![a], move |g, l| {
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
    })
}

/// A KV cache `[heads * hd, kv_size]` split by whole heads, by slots (or anyhow), new rows written with
/// `set_rows`, then viewed as `[hd, n_kv, heads]` from position `p0` and consumed by
/// flash attention or by a batched `mul_mat` (attention scores with GQA broadcast).
pub fn random_kv_cache(rng: &mut Rng, n: usize, p: [usize; 7]) -> Case {
    let [hd, hk, group, kv, nq, write, fa] = p;
    let emb = hd * hk;
    let dt = rng.pick(&[DType::F32, DType::F16]);
    let ck = Input::random(rng, "cache_k", dt, [emb, kv, 1, 1]);
    let cv = Input::random(rng, "cache_v", dt, [emb, kv, 1, 1]);
    let q = Input::random(rng, "q", DType::F32, [hd, nq, hk * group, 1]);
    // Rows written first (none when `write` is 0: the leaves stay unused).
    let nw = write.min(kv);
    let rows = nw.max(1);
    let knew = Input::random(rng, "k_new", DType::F32, [emb, rows, 1, 1]);
    let vnew = Input::random(rng, "v_new", DType::F32, [emb, rows, 1, 1]);
    let pos: Vec<i32> = rng
        .perm(kv)
        .into_iter()
        .take(rows)
        .map(|x| x as i32)
        .collect();
    let pos = Input::from_i32("pos", [rows, 1, 1, 1], &pos);
    let p0 = rng.below(kv);
    let nkv = 1 + rng.below(kv - p0);
    let heads = SplitState::axis(0, &random_extents(rng, emb, hd, n));
    // By heads (axis 0) or by slots (axis 1: each device writes the rows its slots hold).
    let cache_space = |l: &Input| {
        Space::any(l)
            .no_partial()
            .axes(&[0, 1])
            .extra(heads.clone())
    };
    let (sk, sv) = (cache_space(&ck), cache_space(&cv));
    let inputs = vec![ck, cv, q, knew, vnew, pos];
    let ts = dt.type_size();
    let build = move |g: &mut Graph, l: &[TensorId]| -> Result<Vec<TensorId>> {
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
    };
    Case {
        written: vec![0, 1],
        ..Case::new("kv cache views", inputs, build)
    }
    .space(0, sk)
    .space(1, sv)
}

/// A fused tensor `[s0 + s1 + s2, T]` (a leaf, or the output of a column-parallel `mul_mat`)
/// viewed segment by segment, each segment consumed by an op.
pub fn random_segment_views(rng: &mut Rng, n: usize, p: [usize; 5]) -> Case {
    let [s0, s1, s2, t, from_mm] = p;
    let sizes = [s0, s1, s2];
    let total = s0 + s1 + s2;
    let segs: Vec<Vec<usize>> = sizes
        .iter()
        .map(|&s| random_extents(rng, s, 1, n))
        .collect();
    let k = 1 + rng.below(4);
    let (inputs, spaces) = if from_mm == 1 {
        let w = Input::random(rng, "w_qkv", DType::F32, [k, total, 1, 1]);
        let x = Input::random(rng, "x", DType::F32, [k, t, 1, 1]);
        let sw = Space::any(&w).extra(SplitState::segmented(1, &segs));
        let sx = Space::any(&x);
        (vec![w, x], vec![sw, sx])
    } else {
        let x = Input::random(rng, "qkv", DType::F32, [total, t, 1, 1]);
        let sx = Space::any(&x).extra(SplitState::segmented(0, &segs));
        (vec![x], vec![sx])
    };
    let build = move |g: &mut Graph, l: &[TensorId]| -> Result<Vec<TensorId>> {
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
    };
    let mut c = Case::new("segment views", inputs, build);
    for (inp, s) in c.inputs.iter_mut().zip(spaces) {
        inp.space = s;
    }
    c
}

/// A view of rows `r0..r1` (not a segment) and a view of one column: gathered first.
pub fn random_sub_views(rng: &mut Rng, ne0: usize, ne1: usize) -> Case {
    let a = Input::random(rng, "a", DType::F32, [ne0, ne1, 1, 1]);
    let r0 = rng.below(ne1);
    let r1 = r0 + 1 + rng.below(ne1 - r0);
    let c0 = rng.below(ne0);
    Case::new("view", vec![a], move |g, l| {
        let rows = g.view_2d(l[0], ne0, r1 - r0, ne0 * 4, r0 * ne0 * 4)?;
        let col = g.view_2d(l[0], 1, ne1, ne0 * 4, c0 * 4)?;
        Ok(vec![g.cont(rows)?, g.scale(col, 2.0)?])
    })
}

// ---- chains: ops on derived states ----------------------------------------------------------

/// A random chain of ops over activations `[d0, d1, d2]`: each step takes earlier results (so a
/// node may be consumed in several states, and outputs are also consumed), with weights and a
/// bias as leaves. Covers derived Partial, Axis and Mirrored states meeting every conversion.
pub fn random_chain(rng: &mut Rng, d: [usize; 3], steps: usize) -> Case {
    let [d0, d1, d2] = d;
    let x = Input::random(rng, "x", DType::F32, [d0, d1, d2, 1]);
    let y = Input::random(rng, "y", DType::F32, [d0, d1, d2, 1]);
    let w = Input::random(rng, "w", DType::F32, [d0, d0, 1, 1]);
    let bias = Input::random(rng, "bias", DType::F32, [d0, 1, 1, 1]);
    // (op, operand, operand) by index into the pool of results so far (x and y first).
    let ops: Vec<(usize, usize, usize)> = (0..steps)
        .map(|i| (rng.below(12), rng.below(i + 2), rng.below(i + 2)))
        .collect();
    let also = rng.below(steps + 2);
    Case::new("chain", vec![x, y, w, bias], move |g, l| {
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
    })
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
pub fn random_attention_block(rng: &mut Rng, n: usize, z: AttnSizes, megatron: bool) -> Case {
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
    let mut inputs = vec![
        Input::random(rng, "x", DType::F32, [d, t, 1, 1]),
        Input::random(rng, "attn_norm", DType::F32, [d, 1, 1, 1]),
        Input::random(rng, "wq", DType::F32, [d, h * hd, 1, 1]),
        Input::random(rng, "wk", DType::F32, [d, hk * hd, 1, 1]),
        Input::random(rng, "wv", DType::F32, [d, hk * hd, 1, 1]),
        Input::random(rng, "wo", DType::F32, [h * hd, d, 1, 1]),
        Input::random(rng, "cache_k", cdt, [hk * hd, kv, 1, 1]),
        Input::random(rng, "cache_v", cdt, [hk * hd, kv, 1, 1]),
    ];
    let pos: Vec<i32> = (past..past + t).map(|p| p as i32).collect();
    inputs.push(Input::from_i32("pos", [t, 1, 1, 1], &pos));
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
    inputs.push(Input::from_f32(
        "kq_mask",
        DType::F16,
        [nkv, t, 1, 1],
        &mask,
    ));
    let mut spaces: Vec<Space> = inputs.iter().map(Space::any).collect();
    // Caches are set_rows destinations: axis 0 (by heads), axis 1 (by slots) or mirrored; the
    // mask has -inf.
    for i in [6, 7] {
        spaces[i] = Space::any(&inputs[i]).no_partial().axes(&[0, 1]);
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
    let build = move |g: &mut Graph, l: &[TensorId]| -> Result<Vec<TensorId>> {
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
    };
    let mut c = Case {
        written: vec![6, 7],
        // K and V pass through the f16 cache: a few f16 ulps (2^-11) of the values.
        rel: if f16_cache { 2e-3 } else { 0.0 },
        ..Case::new("attention block", inputs, build)
    };
    for (inp, s) in c.inputs.iter_mut().zip(spaces) {
        inp.space = s;
    }
    c
}

// ---- experts over groups of devices ---------------------------------------------------------

/// The experts of a mixture of experts over random groups of the `n` devices (`--experts
/// both`): gate and up `[k, f, E]` split on axis 1 inside each group, down `[f, k, E]` on axis
/// 0 alike (each weight in this split half the time, else in any state of its own), a
/// group-routed gate product as an output, swiglu, the down product. Random group sizes,
/// experts per group (zero included) and uneven or zero inner extents.
pub fn random_expert_groups(rng: &mut Rng, n: usize, p: [usize; 5]) -> Case {
    let [k, f, n_expert, used, tokens] = p;
    let used = used.min(n_expert);
    // Group sizes: a random composition of n into 1..=n parts.
    let n_groups = 1 + rng.below(n);
    let mut sizes = vec![1usize; n_groups];
    for _ in n_groups..n {
        let g = rng.below(n_groups);
        sizes[g] += 1;
    }
    let experts = random_extents(rng, n_expert, 1, n_groups);
    let parts: Vec<(usize, Vec<usize>)> = experts
        .iter()
        .zip(&sizes)
        .map(|(&e, &s)| (e, random_extents(rng, f, 1, s)))
        .collect();
    let cols = SplitState::expert_groups(1, &parts);
    let rows = SplitState::expert_groups(0, &parts);
    let wg = Input::random(rng, "gate_exps", DType::F32, [k, f, n_expert, 1]);
    let wu = Input::random(rng, "up_exps", DType::F32, [k, f, n_expert, 1]);
    let wd = Input::random(rng, "down_exps", DType::F32, [f, k, n_expert, 1]);
    let x = Input::random(rng, "x", DType::F32, [k, 1, tokens, 1]);
    // Distinct experts per token, as a router's top-k.
    let mut ids = Vec::with_capacity(used * tokens);
    for _ in 0..tokens {
        let mut all: Vec<i32> = (0..n_expert as i32).collect();
        for _ in 0..used {
            let i = rng.below(all.len());
            ids.push(all.swap_remove(i));
        }
    }
    let ids = Input::from_i32("ids", [used, tokens, 1, 1], &ids);
    let spaces = [
        Space::any(&wg).extra(cols.clone()),
        Space::any(&wu).extra(cols),
        Space::any(&wd).extra(rows),
        Space::any(&x),
        Space::any(&ids),
    ];
    let build = |g: &mut Graph, l: &[TensorId]| -> Result<Vec<TensorId>> {
        let gate = g.mul_mat_id(l[0], l[3], l[4])?;
        let up = g.mul_mat_id(l[1], l[3], l[4])?;
        let h = g.swiglu(gate, up)?;
        let y = g.mul_mat_id(l[2], h, l[4])?;
        Ok(vec![gate, y])
    };
    let mut c = Case::new("experts over groups", vec![wg, wu, wd, x, ids], build);
    for (inp, s) in c.inputs.iter_mut().zip(spaces) {
        inp.space = s;
    }
    c
}
