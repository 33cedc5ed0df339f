//! A naive float64 interpreter of graphs, written from the op semantics in `src/op.rs` and the
//! builder docs (after ggml's `include/ggml.h`), never calling a crate kernel. Memory is modelled
//! per root as the values of its elements in memory order; views, permutes, `cpy` and
//! `set_rows` address a root through their layout (byte offset and strides), exactly as the
//! bytes would be addressed. Every value written to a root is rounded to the root's dtype with
//! the format's definition (f32, the `half` crate's f16/bf16, the crate's reference quantizers
//! in `dtype.rs`), so storage rounding is modelled and tolerances only cover arithmetic.

use metashard::dtype::{bytes_to_f32, f32_to_bytes};
use metashard::graph::Node;
use metashard::op::{BinaryOp, RopeMode, RopeParams, RowWindow, UnaryOp};
use metashard::{DType, Graph, Op, TensorId};

type R<T> = Result<T, String>;

/// A tensor's logical values (ne[0] fastest).
#[derive(Clone, Debug)]
pub struct T {
    pub ne: [usize; 4],
    pub d: Vec<f64>,
}

impl T {
    pub fn zeros(ne: [usize; 4]) -> T {
        T {
            ne,
            d: vec![0.0; ne.iter().product()],
        }
    }

    #[inline]
    fn idx(&self, i0: usize, i1: usize, i2: usize, i3: usize) -> usize {
        i0 + self.ne[0] * (i1 + self.ne[1] * (i2 + self.ne[2] * i3))
    }

    #[inline]
    pub fn at(&self, i0: usize, i1: usize, i2: usize, i3: usize) -> f64 {
        self.d[self.idx(i0, i1, i2, i3)]
    }

    #[inline]
    fn set(&mut self, i0: usize, i1: usize, i2: usize, i3: usize, v: f64) {
        let i = self.idx(i0, i1, i2, i3);
        self.d[i] = v;
    }

    fn row(&self, i1: usize, i2: usize, i3: usize) -> &[f64] {
        let s = self.idx(0, i1, i2, i3);
        &self.d[s..s + self.ne[0]]
    }

    fn row_mut(&mut self, i1: usize, i2: usize, i3: usize) -> &mut [f64] {
        let s = self.idx(0, i1, i2, i3);
        &mut self.d[s..s + self.ne[0]]
    }

    /// Row indices `(i1, i2, i3)` in order.
    fn rows(&self) -> impl Iterator<Item = (usize, usize, usize)> + use<> {
        let [_, n1, n2, n3] = self.ne;
        (0..n3).flat_map(move |i3| (0..n2).flat_map(move |i2| (0..n1).map(move |i1| (i1, i2, i3))))
    }
}

/// Root images: the values of each root's elements in memory order.
pub struct Memory {
    images: Vec<Option<Vec<f64>>>,
}

impl Memory {
    pub fn root_image(&self, id: TensorId) -> R<Vec<f64>> {
        self.images[id.index()]
            .clone()
            .ok_or_else(|| format!("node {} has no image", id.index()))
    }
}

/// Index in the root image of element `i` of node `n` (layout, view offset).
fn elem_index(n: &Node, i: [usize; 4]) -> R<usize> {
    let l = &n.layout;
    let (ts, bs) = (l.dtype.type_size(), l.dtype.block_size());
    let byte =
        n.view_offs + (i[0] / bs) * l.nb[0] + i[1] * l.nb[1] + i[2] * l.nb[2] + i[3] * l.nb[3];
    if !byte.is_multiple_of(ts) {
        return Err(format!(
            "`{}` addresses byte {byte}, not on a {ts}-byte element",
            n.name
        ));
    }
    Ok(byte / ts * bs + i[0] % bs)
}

fn for_each_index(ne: [usize; 4], mut f: impl FnMut([usize; 4]) -> R<()>) -> R<()> {
    for i3 in 0..ne[3] {
        for i2 in 0..ne[2] {
            for i1 in 0..ne[1] {
                for i0 in 0..ne[0] {
                    f([i0, i1, i2, i3])?;
                }
            }
        }
    }
    Ok(())
}

/// The logical values of node `id`, read through its layout from its root's image.
fn gather(g: &Graph, mem: &Memory, id: TensorId) -> R<T> {
    let n = g.node(id);
    let img = mem.images[g.root(id).index()]
        .as_ref()
        .ok_or_else(|| format!("`{}` is read before its root has values", n.name))?;
    let mut t = T::zeros(n.layout.ne);
    let mut k = 0;
    for_each_index(n.layout.ne, |i| {
        let e = elem_index(n, i)?;
        t.d[k] = *img
            .get(e)
            .ok_or_else(|| format!("`{}` reads element {e} past its root", n.name))?;
        k += 1;
        Ok(())
    })?;
    Ok(t)
}

/// Round one row of values to how `dtype` stores them.
fn round_row(dtype: DType, row: &[f64]) -> R<Vec<f64>> {
    let v: Vec<f32> = row.iter().map(|&x| x as f32).collect();
    let stored = match dtype {
        DType::F32 => v,
        _ => {
            let b = f32_to_bytes(dtype, &v).map_err(|e| e.to_string())?;
            bytes_to_f32(dtype, &b, v.len()).map_err(|e| e.to_string())?
        }
    };
    Ok(stored.into_iter().map(f64::from).collect())
}

/// Write logical values `t` through node `id`'s layout into its root's image, row by row
/// (quantized rows are whole blocks), rounded to the dtype.
fn scatter(g: &Graph, mem: &mut Memory, id: TensorId, t: &T) -> R<()> {
    scatter_rounded(g, mem, id, t, true)
}

/// [`scatter`], rounding to the dtype only when `round`: a copy between tensors of one dtype
/// moves the stored values as they are (ggml's `dup` copies the bytes; requantizing values
/// already in Q3_K or IQ4_XS need not give them back, their scale searches are not
/// idempotent).
fn scatter_rounded(g: &Graph, mem: &mut Memory, id: TensorId, t: &T, round: bool) -> R<()> {
    let n = g.node(id);
    if t.ne != n.layout.ne {
        return Err(format!(
            "`{}` ({}): the builder's shape {:?} differs from the reference's {:?}",
            n.name,
            n.op.name(),
            n.layout.ne,
            t.ne
        ));
    }
    let root = g.root(id).index();
    let img = mem.images[root]
        .as_mut()
        .ok_or_else(|| format!("`{}` writes a root without an image", n.name))?;
    for (i1, i2, i3) in t.rows() {
        let row = if round {
            round_row(n.layout.dtype, t.row(i1, i2, i3))?
        } else {
            t.row(i1, i2, i3).to_vec()
        };
        for (i0, v) in row.into_iter().enumerate() {
            let e = elem_index(n, [i0, i1, i2, i3])?;
            *img.get_mut(e)
                .ok_or_else(|| format!("`{}` writes element {e} past its root", n.name))? = v;
        }
    }
    Ok(())
}

/// Evaluate every node of `g` in order; `inputs` are the stored values of the input roots.
pub fn evaluate(g: &Graph, inputs: &[(TensorId, Vec<f64>)]) -> R<Memory> {
    let mut mem = Memory {
        images: vec![None; g.len()],
    };
    for (id, v) in inputs {
        mem.images[id.index()] = Some(v.clone());
    }
    for id in g.ids() {
        let n = g.node(id);
        match n.op {
            Op::Leaf => {
                if mem.images[id.index()].is_none() {
                    return Err(format!("leaf `{}` has no values", n.name));
                }
            }
            Op::Reshape | Op::View { .. } | Op::Permute { .. } => {}
            Op::Cpy => {
                let s = gather(g, &mem, n.src[0])?;
                let same = g.layout(n.src[0]).dtype == n.layout.dtype;
                let t = T {
                    ne: n.layout.ne,
                    d: s.d,
                };
                scatter_rounded(g, &mut mem, id, &t, !same)?;
            }
            Op::SetRows { window } => {
                let srcs = sources(g, &mem, n)?;
                let out = set_rows(&srcs[0], &srcs[1], &srcs[2], window)?;
                scatter(g, &mut mem, id, &out)?;
            }
            _ => {
                let srcs = sources(g, &mem, n)?;
                let out = compute(&n.op, &srcs)?;
                mem.images[id.index()] = Some(vec![0.0; n.layout.nelements()]);
                let copy = matches!(n.op, Op::Cont) && g.layout(n.src[0]).dtype == n.layout.dtype;
                scatter_rounded(g, &mut mem, id, &out, !copy)?;
            }
        }
    }
    Ok(mem)
}

fn sources(g: &Graph, mem: &Memory, n: &Node) -> R<Vec<T>> {
    n.src.iter().map(|&s| gather(g, mem, s)).collect()
}

fn compute(op: &Op, s: &[T]) -> R<T> {
    Ok(match *op {
        Op::MulMat => mul_mat(&s[0], &s[1]),
        Op::MulMatId { window } => mul_mat_id(&s[0], &s[1], &s[2], window)?,
        Op::Binary(b) => binary(b, &s[0], &s[1]),
        Op::Scale { scale, bias } => map(&s[0], |x| x * scale as f64 + bias as f64),
        Op::Clamp { min, max } => map(&s[0], |x| x.clamp(min as f64, max as f64)),
        Op::Unary(u) => map(&s[0], |x| unary(u, x)),
        Op::Swiglu => swiglu(s),
        Op::RmsNorm { eps } => rows_map(&s[0], |r| {
            let ms = r.iter().map(|x| x * x).sum::<f64>() / r.len() as f64;
            let k = 1.0 / (ms + eps as f64).sqrt();
            r.iter().map(|x| x * k).collect()
        }),
        Op::Norm { eps } => rows_map(&s[0], |r| {
            let n = r.len() as f64;
            let mean = r.iter().sum::<f64>() / n;
            let var = r.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
            let k = 1.0 / (var + eps as f64).sqrt();
            r.iter().map(|x| (x - mean) * k).collect()
        }),
        Op::SoftMax { scale } => soft_max(&s[0], s.get(1), scale as f64),
        Op::Rope(p) => rope(&s[0], &s[1], s.get(2), &p),
        Op::SumRows => reduce_rows(&s[0], |r| r.iter().sum()),
        Op::SumSqrRows => reduce_rows(&s[0], |r| r.iter().map(|x| x * x).sum()),
        Op::RmsNormSums { eps, width } => rows_map_at(&s[0], |r, i1, i2, i3| {
            let ms = s[1].at(0, i1, i2, i3) / width.max(1) as f64;
            let k = 1.0 / (ms + eps as f64).sqrt();
            r.iter()
                .enumerate()
                .map(|(i, x)| x * k * s[2].at(i, 0, 0, 0))
                .collect()
        }),
        Op::Mean => reduce_rows(&s[0], |r| r.iter().sum::<f64>() / r.len() as f64),
        Op::Argmax => argmax(&s[0]),
        Op::Argsort { descending } => argsort(&s[0], descending),
        Op::FlashAttn { scale } => flash_attn(&s[0], &s[1], &s[2], s.get(3), scale as f64),
        Op::GetRows { window } => get_rows(&s[0], &s[1], window)?,
        Op::Cont => s[0].clone(),
        Op::Concat { dim } => concat(&s[0], &s[1], dim),
        Op::Leaf
        | Op::Reshape
        | Op::View { .. }
        | Op::Permute { .. }
        | Op::Cpy
        | Op::SetRows { .. } => {
            return Err(format!("{} is not computed", op.name()));
        }
        // Only in the meta backend's per-device programs; its results depend on other devices.
        Op::Collective(_) => return Err(format!("{} has no single-device value", op.name())),
    })
}

// ---- the ops ------------------------------------------------------------------------------

/// `out[n, m, i2, i3] = sum_k a[k, n, i2 / r2, i3 / r3] * b[k, m, i2, i3]`.
pub fn mul_mat(a: &T, b: &T) -> T {
    let mut out = T::zeros([a.ne[1], b.ne[1], b.ne[2], b.ne[3]]);
    if out.d.is_empty() {
        return out;
    }
    let (r2, r3) = (b.ne[2] / a.ne[2], b.ne[3] / a.ne[3]);
    for (m, i2, i3) in T::zeros([1, b.ne[1], b.ne[2], b.ne[3]]).rows() {
        let br = b.row(m, i2, i3);
        for n in 0..a.ne[1] {
            let ar = a.row(n, i2 / r2, i3 / r3);
            out.set(n, m, i2, i3, ar.iter().zip(br).map(|(x, y)| x * y).sum());
        }
    }
    out
}

/// ggml `mul_mat_id`: `out[n, e, t] = sum_k as[k, n, ids[e, t]] * b[k, e % n_b, t]`.
pub fn mul_mat_id(a: &T, b: &T, ids: &T, window: Option<RowWindow>) -> R<T> {
    let (n_used, n_tokens) = (ids.ne[0], ids.ne[1]);
    let mut out = T::zeros([a.ne[1], n_used, n_tokens, 1]);
    for t in 0..n_tokens {
        for e in 0..n_used {
            // Ids outside the window leave zeros.
            let Some(x) = row_of(ids, (e, t, 0), a.ne[2], window, "mul_mat_id")? else {
                continue;
            };
            let br = b.row(e % b.ne[1], t, 0);
            for n in 0..a.ne[1] {
                let dot = a.row(n, x, 0).iter().zip(br).map(|(p, q)| p * q).sum();
                out.set(n, e, t, 0, dot);
            }
        }
    }
    Ok(out)
}

/// Each row's indices sorted by value (largest first when `descending`), ties by index.
fn argsort(a: &T, descending: bool) -> T {
    let mut out = T::zeros(a.ne);
    for (i1, i2, i3) in a.rows() {
        let r = a.row(i1, i2, i3);
        let mut idx: Vec<usize> = (0..r.len()).collect();
        idx.sort_by(|&i, &j| {
            let o = r[i].total_cmp(&r[j]);
            if descending { o.reverse() } else { o }
        });
        for (o, i) in out.row_mut(i1, i2, i3).iter_mut().zip(idx) {
            *o = i as f64;
        }
    }
    out
}

/// `b` repeats over `a` (each of its extents divides `a`'s).
pub fn binary(op: BinaryOp, a: &T, b: &T) -> T {
    let f = |x: f64, y: f64| match op {
        BinaryOp::Add => x + y,
        BinaryOp::Sub => x - y,
        BinaryOp::Mul => x * y,
        BinaryOp::Div => x / y,
    };
    let mut out = T::zeros(a.ne);
    for (i1, i2, i3) in a.rows() {
        for i0 in 0..a.ne[0] {
            let y = b.at(i0 % b.ne[0], i1 % b.ne[1], i2 % b.ne[2], i3 % b.ne[3]);
            out.set(i0, i1, i2, i3, f(a.at(i0, i1, i2, i3), y));
        }
    }
    out
}

fn map(a: &T, f: impl Fn(f64) -> f64) -> T {
    T {
        ne: a.ne,
        d: a.d.iter().map(|&x| f(x)).collect(),
    }
}

pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

pub fn unary(u: UnaryOp, x: f64) -> f64 {
    match u {
        UnaryOp::Silu => silu(x),
        UnaryOp::Gelu => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
        }
        UnaryOp::GeluErf => 0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2)),
        UnaryOp::Relu => x.max(0.0),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
    }
}

/// `silu(gate) * up`; one source: gate is the first half of dim 0, up the second.
fn swiglu(s: &[T]) -> T {
    let (g, u, off) = match s {
        [x] => (x, x, x.ne[0] / 2),
        [g, u, ..] => (g, u, 0),
        [] => unreachable!("swiglu has a source"),
    };
    let mut out = T::zeros([g.ne[0] - off, g.ne[1], g.ne[2], g.ne[3]]);
    for (i1, i2, i3) in out.rows() {
        for i0 in 0..out.ne[0] {
            let v = silu(g.at(i0, i1, i2, i3)) * u.at(i0 + off, i1, i2, i3);
            out.set(i0, i1, i2, i3, v);
        }
    }
    out
}

fn rows_map(a: &T, f: impl Fn(&[f64]) -> Vec<f64>) -> T {
    let mut out = T::zeros(a.ne);
    for (i1, i2, i3) in a.rows() {
        let r = f(a.row(i1, i2, i3));
        out.row_mut(i1, i2, i3).copy_from_slice(&r);
    }
    out
}

fn reduce_rows(a: &T, f: impl Fn(&[f64]) -> f64) -> T {
    let mut out = T::zeros([1, a.ne[1], a.ne[2], a.ne[3]]);
    for (i1, i2, i3) in a.rows() {
        out.set(0, i1, i2, i3, f(a.row(i1, i2, i3)));
    }
    out
}

/// Row-wise `softmax(x * scale + mask)`, the mask repeating over dims 2 and 3. A row whose
/// every entry is `-inf` has no distribution; by design it gives zeros.
fn soft_max(x: &T, mask: Option<&T>, scale: f64) -> T {
    rows_map_at(x, |r, i1, i2, i3| {
        let y: Vec<f64> = r
            .iter()
            .enumerate()
            .map(|(i0, &v)| {
                let m = mask.map_or(0.0, |m| m.at(i0, i1, i2 % m.ne[2], i3 % m.ne[3]));
                v * scale + m
            })
            .collect();
        softmax_or_zeros(&y)
    })
}

fn softmax_or_zeros(y: &[f64]) -> Vec<f64> {
    let max = y.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return vec![0.0; y.len()];
    }
    let e: Vec<f64> = y.iter().map(|v| (v - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

fn rows_map_at(a: &T, f: impl Fn(&[f64], usize, usize, usize) -> Vec<f64>) -> T {
    let mut out = T::zeros(a.ne);
    for (i1, i2, i3) in a.rows() {
        let r = f(a.row(i1, i2, i3), i1, i2, i3);
        out.row_mut(i1, i2, i3).copy_from_slice(&r);
    }
    out
}

/// Rotate `x [head_dim, n_head, n_tokens, ..]` by `theta_i = pos * freq_scale *
/// freq_base^(-2i / n_dims) / factors[i]` (factors 1 without them): pairs `(2i, 2i + 1)`
/// (normal) or `(i, i + n_dims / 2)` (NeoX); dims from `n_dims` on pass through.
fn rope(x: &T, pos: &T, factors: Option<&T>, p: &RopeParams) -> T {
    let half = p.n_dims / 2;
    rows_map_at(x, |r, _, i2, _| {
        let t = pos.d[i2];
        let mut o = r.to_vec();
        for i in 0..half {
            let theta = t
                * p.freq_scale as f64
                * (p.freq_base as f64).powf(-2.0 * i as f64 / p.n_dims as f64)
                / factors.map_or(1.0, |f| f.d[i]);
            let (a, b) = match p.mode {
                RopeMode::Normal => (2 * i, 2 * i + 1),
                RopeMode::NeoX => (i, i + half),
            };
            let (c, s) = (theta.cos(), theta.sin());
            o[a] = r[a] * c - r[b] * s;
            o[b] = r[a] * s + r[b] * c;
        }
        o
    })
}

/// The index of each row's first maximum, I32 `[ne1]`.
fn argmax(a: &T) -> T {
    let mut out = T::zeros([a.ne[1], 1, 1, 1]);
    for i1 in 0..a.ne[1] {
        let r = a.row(i1, 0, 0);
        let mut best = 0;
        for (i, &v) in r.iter().enumerate() {
            if v > r[best] {
                best = i;
            }
        }
        out.d[i1] = best as f64;
    }
    out
}

/// `out[:, h, i, b] = softmax_j(scale * q[:, i, h, b]·k[:, j, h/g, b] + mask[j, i]) v[:, j, h/g, b]`
/// with `g = H / Hk`; a query whose every key is masked gives zeros.
fn flash_attn(q: &T, k: &T, v: &T, mask: Option<&T>, scale: f64) -> T {
    let (n_q, n_head, batch) = (q.ne[1], q.ne[2], q.ne[3]);
    let (n_kv, dv) = (k.ne[1], v.ne[0]);
    let mut out = T::zeros([dv, n_head, n_q, batch]);
    let group = n_head.checked_div(k.ne[2]).unwrap_or(1);
    for b in 0..batch {
        for h in 0..n_head {
            let hk = h / group;
            for i in 0..n_q {
                let qr = q.row(i, h, b);
                let s: Vec<f64> = (0..n_kv)
                    .map(|j| {
                        let dot: f64 = qr.iter().zip(k.row(j, hk, b)).map(|(x, y)| x * y).sum();
                        dot * scale + mask.map_or(0.0, |m| m.at(j, i, 0, 0))
                    })
                    .collect();
                let w = softmax_or_zeros(&s);
                for c in 0..dv {
                    let o: f64 = (0..n_kv).map(|j| w[j] * v.at(c, j, hk, b)).sum();
                    out.set(c, h, i, b, o);
                }
            }
        }
    }
    out
}

fn id_of(ids: &T, i: usize, j: usize, k: usize, rows: usize, op: &str) -> R<usize> {
    let id = ids.at(i, j, k, 0);
    if id < 0.0 || id as usize >= rows {
        return Err(format!("{op}: id {id} outside 0..{rows}"));
    }
    Ok(id as usize)
}

/// The operand row of `ids[i, j, k]` under `window` (ids `lo..hi` at rows `at..`; other ids
/// of `0..rows` held elsewhere: `None`), or every row of an operand of `rows` rows.
fn row_of(
    ids: &T,
    (i, j, k): (usize, usize, usize),
    rows: usize,
    window: Option<RowWindow>,
    op: &str,
) -> R<Option<usize>> {
    let Some(w) = window else {
        return id_of(ids, i, j, k, rows, op).map(Some);
    };
    let id = id_of(ids, i, j, k, w.rows, op)?;
    Ok((w.lo..w.hi).contains(&id).then(|| w.at + id - w.lo))
}

/// `out[:, i, j2, j3] = table[:, ids[i, j2, j3], j2, j3]` (zeros for ids outside the window).
fn get_rows(table: &T, ids: &T, window: Option<RowWindow>) -> R<T> {
    let mut out = T::zeros([table.ne[0], ids.ne[0], ids.ne[1], ids.ne[2]]);
    for (i, j2, j3) in out.rows() {
        if let Some(r) = row_of(ids, (i, j2, j3), table.ne[1], window, "get_rows")? {
            let src = table.row(r, j2, j3).to_vec();
            out.row_mut(i, j2, j3).copy_from_slice(&src);
        }
    }
    Ok(out)
}

/// `dst[:, ids[i, j2 % e2, j3 % e3], j2, j3] = rows[:, i, j2, j3]`, other rows unchanged (and
/// rows whose id is outside the window skipped).
fn set_rows(dst: &T, rows: &T, ids: &T, window: Option<RowWindow>) -> R<T> {
    let mut out = dst.clone();
    for (i, j2, j3) in rows.rows() {
        let at = (i, j2 % ids.ne[1], j3 % ids.ne[2]);
        if let Some(r) = row_of(ids, at, dst.ne[1], window, "set_rows")? {
            out.row_mut(r, j2, j3).copy_from_slice(rows.row(i, j2, j3));
        }
    }
    Ok(out)
}

fn concat(a: &T, b: &T, dim: usize) -> T {
    let mut ne = a.ne;
    ne[dim] += b.ne[dim];
    let mut out = T::zeros(ne);
    let mut k = 0;
    for i3 in 0..ne[3] {
        for i2 in 0..ne[2] {
            for i1 in 0..ne[1] {
                for i0 in 0..ne[0] {
                    let mut i = [i0, i1, i2, i3];
                    out.d[k] = if i[dim] < a.ne[dim] {
                        a.at(i[0], i[1], i[2], i[3])
                    } else {
                        i[dim] -= a.ne[dim];
                        b.at(i[0], i[1], i[2], i[3])
                    };
                    k += 1;
                }
            }
        }
    }
    out
}
