//! Builder methods of `Graph`: one per op, each checking its operands' shapes and dtypes and
//! returning an error that names the op and both shapes.

use super::{Flags, Graph, Node, TensorId};
use crate::op::{BinaryOp, Op, RopeParams, RowWindow, UnaryOp};
use crate::tensor::{Layout, can_repeat};
use crate::{DType, Error, Result};
use smallvec::SmallVec;

mod experts;

fn dtype_err(op: &'static str, operand: &str, expected: &str, got: DType) -> Error {
    Error::DTypeMismatch {
        op,
        operand: operand.to_string(),
        expected: expected.to_string(),
        got: got.to_string(),
    }
}

/// A row window must lie within the rows of the operand it addresses (`ne[1]`; the experts,
/// `ne[2]`, for `mul_mat_id`).
fn check_window(
    op: &'static str,
    window: Option<RowWindow>,
    ne: [usize; 4],
    axis: usize,
) -> Result<()> {
    let Some(w) = window else {
        return Ok(());
    };
    let fits = w.lo <= w.hi
        && w.hi <= w.rows
        && w.at
            .checked_add(w.hi - w.lo)
            .is_some_and(|end| end <= ne[axis]);
    if fits {
        return Ok(());
    }
    Err(Error::invalid_op(
        op,
        format!(
            "window {w:?} must hold ids lo..hi within 0..rows at local rows at..at + (hi - lo) \
             within the {} rows of {}",
            ne[axis],
            crate::Shape(ne)
        ),
    ))
}

impl Graph {
    // ---- leaves -------------------------------------------------------------------------

    fn leaf(&mut self, name: &str, dtype: DType, ne: [usize; 4], flags: Flags) -> Result<TensorId> {
        dtype.check_row(ne[0], name)?;
        let layout = packed_layout(dtype, ne).ok_or_else(|| Error::TensorTooLarge {
            tensor: name.to_string(),
            shape: crate::Shape(ne),
            dtype: dtype.name(),
        })?;
        Ok(self.push(Node {
            layout,
            op: Op::Leaf,
            src: SmallVec::new(),
            view_src: None,
            view_offs: 0,
            name: match self.is_named() {
                true => name.to_string(),
                false => String::new(),
            },
            flags,
            storage: None,
            data: None,
        }))
    }

    /// A leaf tensor without flags (e.g. a cache), packed.
    pub fn new_tensor(&mut self, name: &str, dtype: DType, ne: [usize; 4]) -> Result<TensorId> {
        self.leaf(name, dtype, ne, Flags::default())
    }

    /// An input leaf: its bytes come with the graph (`set_data`) or from bound storage.
    pub fn input(&mut self, name: &str, dtype: DType, ne: [usize; 4]) -> Result<TensorId> {
        self.leaf(name, dtype, ne, Flags::INPUT)
    }

    /// A weight leaf: static data bound with `bind`.
    pub fn weight(&mut self, name: &str, dtype: DType, ne: [usize; 4]) -> Result<TensorId> {
        self.leaf(name, dtype, ne, Flags::WEIGHT)
    }

    /// An F32 input holding `data` (shape `ne`).
    pub fn input_f32(&mut self, name: &str, ne: [usize; 4], data: &[f32]) -> Result<TensorId> {
        let id = self.input(name, DType::F32, ne)?;
        self.set_f32(id, data)?;
        Ok(id)
    }

    /// An I32 input holding `data` (shape `ne`).
    pub fn input_i32(&mut self, name: &str, ne: [usize; 4], data: &[i32]) -> Result<TensorId> {
        let id = self.input(name, DType::I32, ne)?;
        self.set_i32(id, data)?;
        Ok(id)
    }

    // ---- node construction ------------------------------------------------------------

    fn op_node(&mut self, op: Op, layout: Layout, src: &[TensorId]) -> TensorId {
        let id = self.len();
        self.push(Node {
            layout,
            op,
            src: src.iter().copied().collect(),
            view_src: None,
            view_offs: 0,
            name: match self.is_named() {
                true => format!("{}_{id}", op.name()),
                false => String::new(),
            },
            flags: Flags::default(),
            storage: None,
            data: None,
        })
    }

    /// A computed node with a new packed output of `dtype` and shape `ne`; an error naming the
    /// op if the output's bytes cannot be addressed.
    fn computed(
        &mut self,
        op: Op,
        dtype: DType,
        ne: [usize; 4],
        src: &[TensorId],
    ) -> Result<TensorId> {
        let layout = packed_layout(dtype, ne).ok_or_else(|| {
            Error::invalid_op(
                op.name(),
                format!(
                    "output {} of {dtype} needs more bytes than memory can address",
                    crate::Shape(ne)
                ),
            )
        })?;
        Ok(self.op_node(op, layout, src))
    }

    /// A node sharing the bytes of `base` at `offs` bytes from `base`'s first byte.
    fn view_node(
        &mut self,
        op: Op,
        layout: Layout,
        src: &[TensorId],
        base: TensorId,
        offs: usize,
    ) -> TensorId {
        let root = self.root(base);
        let total = self.node(base).view_offs + offs;
        let id = self.op_node(op, layout, src);
        let n = self.node_mut(id);
        n.view_src = Some(root);
        n.view_offs = total;
        id
    }

    fn lay(&self, id: TensorId) -> Result<Layout> {
        Ok(self.get(id)?.layout)
    }

    fn float_operand(&self, op: &'static str, id: TensorId) -> Result<Layout> {
        let l = self.lay(id)?;
        if !l.dtype.is_float() {
            return Err(dtype_err(op, self.name(id), "f32, f16 or bf16", l.dtype));
        }
        Ok(l)
    }

    // ---- arithmetic ---------------------------------------------------------------------

    /// ggml `mul_mat`: `a [K, N, B2, B3]` (any dtype but i32) times `b [K, M, B2', B3']` (f32),
    /// giving f32 `[N, M, B2', B3']`; `a` broadcasts over dims 2 and 3.
    pub fn mul_mat(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        let (la, lb) = (self.lay(a)?, self.lay(b)?);
        if la.dtype == DType::I32 {
            return Err(dtype_err(
                "mul_mat",
                self.name(a),
                "a float or quantized type",
                la.dtype,
            ));
        }
        if lb.dtype != DType::F32 {
            return Err(dtype_err("mul_mat", self.name(b), "f32", lb.dtype));
        }
        if la.ne[0] != lb.ne[0] {
            return Err(Error::shape(
                "mul_mat",
                la.ne,
                lb.ne,
                "dimension 0 (K) must be equal",
            ));
        }
        let bcast = |x: usize, y: usize| if x == 0 { y == 0 } else { y.is_multiple_of(x) };
        if !bcast(la.ne[2], lb.ne[2]) || !bcast(la.ne[3], lb.ne[3]) {
            return Err(Error::shape(
                "mul_mat",
                la.ne,
                lb.ne,
                "dims 2 and 3 of the second operand must be multiples of the first's",
            ));
        }
        let ne = [la.ne[1], lb.ne[1], lb.ne[2], lb.ne[3]];
        self.computed(Op::MulMat, DType::F32, ne, &[a, b])
    }

    /// Element-wise binary op; `b` broadcasts over `a` (each extent of `b` divides `a`'s).
    pub fn binary(&mut self, op: BinaryOp, a: TensorId, b: TensorId) -> Result<TensorId> {
        let name = op.name();
        let la = self.float_operand(name, a)?;
        let lb = self.float_operand(name, b)?;
        if !can_repeat(&lb.ne, &la.ne) {
            return Err(Error::shape(
                name,
                la.ne,
                lb.ne,
                "the second operand must broadcast to the first",
            ));
        }
        self.computed(Op::Binary(op), la.dtype, la.ne, &[a, b])
    }

    pub fn add(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(BinaryOp::Add, a, b)
    }
    pub fn sub(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(BinaryOp::Sub, a, b)
    }
    pub fn mul(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(BinaryOp::Mul, a, b)
    }
    pub fn div(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(BinaryOp::Div, a, b)
    }

    fn same_shape_op(&mut self, op: Op, a: TensorId) -> Result<TensorId> {
        let la = self.float_operand(op.name(), a)?;
        self.computed(op, la.dtype, la.ne, &[a])
    }

    /// `a * s`.
    pub fn scale(&mut self, a: TensorId, s: f32) -> Result<TensorId> {
        self.scale_bias(a, s, 0.0)
    }

    /// `a * s + b`.
    pub fn scale_bias(&mut self, a: TensorId, s: f32, b: f32) -> Result<TensorId> {
        self.same_shape_op(Op::Scale { scale: s, bias: b }, a)
    }

    pub fn clamp(&mut self, a: TensorId, min: f32, max: f32) -> Result<TensorId> {
        if min > max || min.is_nan() || max.is_nan() {
            return Err(Error::invalid_op(
                "clamp",
                format!("min {min} must not exceed max {max}"),
            ));
        }
        self.same_shape_op(Op::Clamp { min, max }, a)
    }

    pub fn unary(&mut self, op: UnaryOp, a: TensorId) -> Result<TensorId> {
        self.same_shape_op(Op::Unary(op), a)
    }
    pub fn silu(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(UnaryOp::Silu, a)
    }
    pub fn gelu(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(UnaryOp::Gelu, a)
    }
    pub fn gelu_erf(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(UnaryOp::GeluErf, a)
    }
    pub fn relu(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(UnaryOp::Relu, a)
    }
    pub fn tanh(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(UnaryOp::Tanh, a)
    }

    /// `silu(gate) * up`, both the same shape.
    pub fn swiglu(&mut self, gate: TensorId, up: TensorId) -> Result<TensorId> {
        let lg = self.float_operand("swiglu", gate)?;
        let lu = self.float_operand("swiglu", up)?;
        if lg.ne != lu.ne {
            return Err(Error::shape(
                "swiglu",
                lg.ne,
                lu.ne,
                "gate and up must have equal shapes",
            ));
        }
        self.computed(Op::Swiglu, lg.dtype, lg.ne, &[gate, up])
    }

    /// `silu(x[:n]) * x[n:]` along dim 0 of a fused `[2n, ...]` gate/up tensor.
    pub fn swiglu_fused(&mut self, x: TensorId) -> Result<TensorId> {
        let l = self.float_operand("swiglu", x)?;
        if l.ne[0] % 2 != 0 {
            return Err(Error::invalid_op(
                "swiglu",
                format!("fused input {} must have an even dimension 0", l.shape()),
            ));
        }
        let ne = [l.ne[0] / 2, l.ne[1], l.ne[2], l.ne[3]];
        self.computed(Op::Swiglu, l.dtype, ne, &[x])
    }

    pub fn rms_norm(&mut self, a: TensorId, eps: f32) -> Result<TensorId> {
        self.same_shape_op(Op::RmsNorm { eps }, a)
    }

    pub fn norm(&mut self, a: TensorId, eps: f32) -> Result<TensorId> {
        self.same_shape_op(Op::Norm { eps }, a)
    }

    /// Row-wise `softmax(a * scale + mask)`; `mask [ne0, >= ne1, d2, d3]` (f32 or f16) broadcasts
    /// over dims 2 and 3.
    pub fn soft_max(
        &mut self,
        a: TensorId,
        mask: Option<TensorId>,
        scale: f32,
    ) -> Result<TensorId> {
        let la = self.float_operand("soft_max", a)?;
        let mut src = vec![a];
        if let Some(m) = mask {
            let lm = self.lay(m)?;
            if !matches!(lm.dtype, DType::F32 | DType::F16) {
                return Err(dtype_err("soft_max", self.name(m), "f32 or f16", lm.dtype));
            }
            let bc = |x: usize, y: usize| if x == 0 { y == 0 } else { y.is_multiple_of(x) };
            if lm.ne[0] != la.ne[0]
                || lm.ne[1] < la.ne[1]
                || !bc(lm.ne[2], la.ne[2])
                || !bc(lm.ne[3], la.ne[3])
            {
                return Err(Error::shape(
                    "soft_max",
                    la.ne,
                    lm.ne,
                    "mask must be [ne0, >= ne1, d2 | ne2, d3 | ne3] of the input",
                ));
            }
            src.push(m);
        }
        self.computed(Op::SoftMax { scale }, la.dtype, la.ne, &src)
    }

    /// Rotary embedding of `a [head_dim, n_head, n_tokens, 1]` by I32 `pos [n_tokens]`.
    pub fn rope(&mut self, a: TensorId, pos: TensorId, p: RopeParams) -> Result<TensorId> {
        self.rope_ext(a, pos, None, p)
    }

    /// [`Graph::rope`] with per-dimension frequency factors: F32 `factors [n_dims / 2]` divide
    /// each pair's angle (ggml's `ggml_rope_ext` with its `c` operand: Llama 3's long-context
    /// RoPE scaling, the `rope_freqs` tensor of its GGUF files).
    pub fn rope_ext(
        &mut self,
        a: TensorId,
        pos: TensorId,
        factors: Option<TensorId>,
        p: RopeParams,
    ) -> Result<TensorId> {
        let la = self.lay(a)?;
        if !matches!(la.dtype, DType::F32 | DType::F16) {
            return Err(dtype_err("rope", self.name(a), "f32 or f16", la.dtype));
        }
        let lp = self.lay(pos)?;
        if lp.dtype != DType::I32 {
            return Err(dtype_err("rope", self.name(pos), "i32", lp.dtype));
        }
        if lp.ne[0] != la.ne[2] || lp.ne[1] * lp.ne[2] * lp.ne[3] != 1 {
            return Err(Error::shape(
                "rope",
                la.ne,
                lp.ne,
                "positions must be [ne2 of the input]",
            ));
        }
        if p.n_dims == 0 || !p.n_dims.is_multiple_of(2) || p.n_dims > la.ne[0] {
            return Err(Error::invalid_op(
                "rope",
                format!(
                    "n_dims {} must be even, positive and at most ne0 = {}",
                    p.n_dims, la.ne[0]
                ),
            ));
        }
        if p.freq_base.is_nan() || p.freq_base <= 0.0 || !p.freq_scale.is_finite() {
            return Err(Error::invalid_op(
                "rope",
                format!(
                    "freq_base {} and freq_scale {} must be finite and positive",
                    p.freq_base, p.freq_scale
                ),
            ));
        }
        match factors {
            None => self.computed(Op::Rope(p), la.dtype, la.ne, &[a, pos]),
            Some(f) => {
                let lf = self.lay(f)?;
                if lf.dtype != DType::F32 {
                    return Err(dtype_err("rope", self.name(f), "f32", lf.dtype));
                }
                if lf.ne != [p.n_dims / 2, 1, 1, 1] || !lf.is_contiguous() {
                    return Err(Error::shape(
                        "rope",
                        la.ne,
                        lf.ne,
                        "frequency factors must be a contiguous [n_dims / 2]",
                    ));
                }
                self.computed(Op::Rope(p), la.dtype, la.ne, &[a, pos, f])
            }
        }
    }

    pub fn sum_rows(&mut self, a: TensorId) -> Result<TensorId> {
        let l = self.float_operand("sum_rows", a)?;
        let ne = [1, l.ne[1], l.ne[2], l.ne[3]];
        self.computed(Op::SumRows, DType::F32, ne, &[a])
    }

    /// The sum of squares of each row of `a`: f32 `[1, ne1, ne2, ne3]`.
    pub fn sum_sqr_rows(&mut self, a: TensorId) -> Result<TensorId> {
        let l = self.float_operand("sum_sqr_rows", a)?;
        let ne = [1, l.ne[1], l.ne[2], l.ne[3]];
        self.computed(Op::SumSqrRows, DType::F32, ne, &[a])
    }

    /// `x * w / sqrt(sums / width + eps)`, row by row: the RMS norm of rows of `width`
    /// elements of which `x` holds some, `sums` (f32 `[1, ne1, ne2, ne3]` of `x`'s) their
    /// whole rows' sums of squares, `w` (`[ne0]`) the norm's weight of `x`'s elements.
    pub fn rms_norm_sums(
        &mut self,
        x: TensorId,
        sums: TensorId,
        w: TensorId,
        eps: f32,
        width: usize,
    ) -> Result<TensorId> {
        let what = "rms_norm_sums";
        let lx = self.float_operand(what, x)?;
        let ls = self.lay(sums)?;
        let lw = self.float_operand(what, w)?;
        let want_s = [1, lx.ne[1], lx.ne[2], lx.ne[3]];
        if ls.dtype != DType::F32 || ls.ne != want_s {
            return Err(Error::shape(
                what,
                lx.ne,
                ls.ne,
                format!(
                    "sums must be f32 {:?} (one per row of x), got {}",
                    want_s, ls.dtype
                ),
            ));
        }
        if lw.ne != [lx.ne[0], 1, 1, 1] {
            return Err(Error::shape(
                what,
                lx.ne,
                lw.ne,
                "the weight must be [ne0 of x]",
            ));
        }
        if width < lx.ne[0] {
            return Err(Error::invalid_op(
                what,
                format!("rows of {width} elements cannot hold x's {}", lx.ne[0]),
            ));
        }
        self.computed(
            Op::RmsNormSums { eps, width },
            lx.dtype,
            lx.ne,
            &[x, sums, w],
        )
    }

    pub fn mean(&mut self, a: TensorId) -> Result<TensorId> {
        let l = self.float_operand("mean", a)?;
        let ne = [1, l.ne[1], l.ne[2], l.ne[3]];
        self.computed(Op::Mean, DType::F32, ne, &[a])
    }

    /// Index of each row's maximum of a 2-D f32 tensor, as I32 `[ne1]`.
    pub fn argmax(&mut self, a: TensorId) -> Result<TensorId> {
        let l = self.lay(a)?;
        if l.dtype != DType::F32 {
            return Err(dtype_err("argmax", self.name(a), "f32", l.dtype));
        }
        if l.ne[2] != 1 || l.ne[3] != 1 {
            return Err(Error::invalid_op(
                "argmax",
                format!("input {} must be 2-D", l.shape()),
            ));
        }
        self.computed(Op::Argmax, DType::I32, [l.ne[1], 1, 1, 1], &[a])
    }

    /// `softmax(q kᵀ * scale + mask) v` per head: `q [D, nq, H, B]` f32, `k [D, nkv, Hk, B]` and
    /// `v [Dv, nkv, Hk, B]` f32 or f16 with `H % Hk == 0`, `mask [nkv, >= nq]`; output f32
    /// `[Dv, H, nq, B]`.
    pub fn flash_attn(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        mask: Option<TensorId>,
        scale: f32,
    ) -> Result<TensorId> {
        let (lq, lk, lv) = (self.lay(q)?, self.lay(k)?, self.lay(v)?);
        if lq.dtype != DType::F32 {
            return Err(dtype_err("flash_attn", self.name(q), "f32", lq.dtype));
        }
        for (id, l) in [(k, lk), (v, lv)] {
            if !matches!(l.dtype, DType::F32 | DType::F16) {
                return Err(dtype_err(
                    "flash_attn",
                    self.name(id),
                    "f32 or f16",
                    l.dtype,
                ));
            }
        }
        if lk.ne[0] != lq.ne[0] || lk.ne[3] != lq.ne[3] {
            return Err(Error::shape(
                "flash_attn",
                lq.ne,
                lk.ne,
                "q and k must share head size and batch",
            ));
        }
        if lv.ne[1] != lk.ne[1] || lv.ne[2] != lk.ne[2] || lv.ne[3] != lk.ne[3] {
            return Err(Error::shape(
                "flash_attn",
                lk.ne,
                lv.ne,
                "k and v must share kv length, heads, batch",
            ));
        }
        let groups_ok = if lk.ne[2] == 0 {
            lq.ne[2] == 0
        } else {
            lq.ne[2] % lk.ne[2] == 0
        };
        if !groups_ok {
            return Err(Error::shape(
                "flash_attn",
                lq.ne,
                lk.ne,
                "query heads must be a multiple of kv heads",
            ));
        }
        let mut src = vec![q, k, v];
        if let Some(m) = mask {
            let lm = self.lay(m)?;
            if !matches!(lm.dtype, DType::F32 | DType::F16) {
                return Err(dtype_err(
                    "flash_attn",
                    self.name(m),
                    "f32 or f16",
                    lm.dtype,
                ));
            }
            if lm.ne[0] != lk.ne[1] || lm.ne[1] < lq.ne[1] || lm.ne[2] != 1 || lm.ne[3] != 1 {
                return Err(Error::shape(
                    "flash_attn",
                    lq.ne,
                    lm.ne,
                    "mask must be [n_kv, >= n_q, 1, 1]",
                ));
            }
            src.push(m);
        }
        let ne = [lv.ne[0], lq.ne[2], lq.ne[1], lq.ne[3]];
        self.computed(Op::FlashAttn { scale }, DType::F32, ne, &src)
    }

    /// A node filled by a collective from `src` (meta backend programs). An all-reduce is in
    /// place (a view of `src`); gathers and scatters produce a new tensor of shape `ne`.
    pub fn collective(
        &mut self,
        kind: crate::op::CollectiveKind,
        src: TensorId,
        ne: [usize; 4],
    ) -> Result<TensorId> {
        let l = self.lay(src)?;
        let op = Op::Collective(kind);
        if kind == crate::op::CollectiveKind::AllReduce {
            if !l.is_contiguous() {
                return Err(Error::invalid_op(
                    "all_reduce",
                    "the source must be contiguous",
                ));
            }
            return Ok(self.view_node(op, l, &[src], src, 0));
        }
        self.computed(op, l.dtype, ne, &[src])
    }

    // ---- data movement --------------------------------------------------------------------

    /// Rows of `table [ne0, rows, ne2, ne3]` picked by I32 `ids [n, ne2, ne3]`, as f32
    /// `[ne0, n, ne2, ne3]` (i32 tables give i32).
    pub fn get_rows(&mut self, table: TensorId, ids: TensorId) -> Result<TensorId> {
        self.get_rows_op(table, ids, None)
    }

    /// [`Graph::get_rows`] of the ids `window` holds, from a table holding only its rows
    /// (at `window.at..`): the other ids give rows of zeros, ids outside `0..window.rows` are
    /// errors. How one device looks up its share of a table split by rows.
    pub fn get_rows_windowed(
        &mut self,
        table: TensorId,
        ids: TensorId,
        window: RowWindow,
    ) -> Result<TensorId> {
        self.get_rows_op(table, ids, Some(window))
    }

    fn get_rows_op(
        &mut self,
        table: TensorId,
        ids: TensorId,
        window: Option<RowWindow>,
    ) -> Result<TensorId> {
        let (lt, li) = (self.lay(table)?, self.lay(ids)?);
        if li.dtype != DType::I32 {
            return Err(dtype_err("get_rows", self.name(ids), "i32", li.dtype));
        }
        if li.ne[1] != lt.ne[2] || li.ne[2] != lt.ne[3] || li.ne[3] != 1 {
            return Err(Error::shape(
                "get_rows",
                lt.ne,
                li.ne,
                "ids must be [n, ne2, ne3] of the table",
            ));
        }
        check_window("get_rows", window, lt.ne, 1)?;
        let out = if lt.dtype == DType::I32 {
            DType::I32
        } else {
            DType::F32
        };
        let ne = [lt.ne[0], li.ne[0], li.ne[1], li.ne[2]];
        self.computed(Op::GetRows { window }, out, ne, &[table, ids])
    }

    /// `dst[:, ids[i], j, k] = rows[:, i, j, k]`: `rows [ne0, n, d2, d3]` (f32) into
    /// `dst [ne0, R, d2, d3]` (f32, f16 or bf16) with I32 `ids [n, e2, e3]`, `e2 | d2`, `e3 | d3`.
    /// Returns a view of `dst`.
    pub fn set_rows(&mut self, dst: TensorId, rows: TensorId, ids: TensorId) -> Result<TensorId> {
        self.set_rows_op(dst, rows, ids, None)
    }

    /// [`Graph::set_rows`] of the rows whose id `window` holds, into a destination holding only
    /// the window's rows (at `window.at..`): the other rows are skipped, ids outside
    /// `0..window.rows` are errors. How one device writes its share of a destination split by
    /// rows (a KV cache split by slots).
    pub fn set_rows_windowed(
        &mut self,
        dst: TensorId,
        rows: TensorId,
        ids: TensorId,
        window: RowWindow,
    ) -> Result<TensorId> {
        self.set_rows_op(dst, rows, ids, Some(window))
    }

    fn set_rows_op(
        &mut self,
        dst: TensorId,
        rows: TensorId,
        ids: TensorId,
        window: Option<RowWindow>,
    ) -> Result<TensorId> {
        let (ld, lr, li) = (self.lay(dst)?, self.lay(rows)?, self.lay(ids)?);
        if !ld.dtype.is_float() {
            return Err(dtype_err(
                "set_rows",
                self.name(dst),
                "f32, f16 or bf16",
                ld.dtype,
            ));
        }
        if lr.dtype != DType::F32 {
            return Err(dtype_err("set_rows", self.name(rows), "f32", lr.dtype));
        }
        if li.dtype != DType::I32 {
            return Err(dtype_err("set_rows", self.name(ids), "i32", li.dtype));
        }
        if ld.ne[0] != lr.ne[0] || ld.ne[2] != lr.ne[2] || ld.ne[3] != lr.ne[3] {
            return Err(Error::shape(
                "set_rows",
                ld.ne,
                lr.ne,
                "rows must match dst in dims 0, 2, 3",
            ));
        }
        let bc = |x: usize, y: usize| if x == 0 { y == 0 } else { y.is_multiple_of(x) };
        if li.ne[0] != lr.ne[1]
            || !bc(li.ne[1], lr.ne[2])
            || !bc(li.ne[2], lr.ne[3])
            || li.ne[3] != 1
        {
            return Err(Error::shape(
                "set_rows",
                lr.ne,
                li.ne,
                "ids must be [n rows, e2 | d2, e3 | d3]",
            ));
        }
        check_window("set_rows", window, ld.ne, 1)?;
        Ok(self.view_node(Op::SetRows { window }, ld, &[dst, rows, ids], dst, 0))
    }

    /// Copy `a`'s elements in logical order into `b` (same element count, any dtypes/strides).
    /// Returns a view of `b`.
    pub fn cpy(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        let (la, lb) = (self.lay(a)?, self.lay(b)?);
        if la.nelements() != lb.nelements() {
            return Err(Error::shape("cpy", la.ne, lb.ne, "element counts differ"));
        }
        check_convertible("cpy", &la, lb.dtype)?;
        Ok(self.view_node(Op::Cpy, lb, &[a, b], b, 0))
    }

    /// `a` as a new packed tensor of the same dtype.
    pub fn cont(&mut self, a: TensorId) -> Result<TensorId> {
        let dt = self.lay(a)?.dtype;
        self.cast(a, dt)
    }

    /// `a` as a new packed tensor of dtype `dtype` (quantized targets need whole blocks in ne0).
    pub fn cast(&mut self, a: TensorId, dtype: DType) -> Result<TensorId> {
        let la = self.lay(a)?;
        check_convertible("cont", &la, dtype)?;
        self.computed(Op::Cont, dtype, la.ne, &[a])
    }

    /// `a` (packed) seen with shape `ne` of the same element count.
    pub fn reshape(&mut self, a: TensorId, ne: [usize; 4]) -> Result<TensorId> {
        let la = self.lay(a)?;
        if !la.is_contiguous() {
            return Err(Error::invalid_op(
                "reshape",
                format!(
                    "`{}` {} is not contiguous; use cont first",
                    self.name(a),
                    la.shape()
                ),
            ));
        }
        let count = ne.iter().try_fold(1usize, |p, &n| p.checked_mul(n));
        if count != Some(la.nelements()) {
            return Err(Error::shape("reshape", la.ne, ne, "element counts differ"));
        }
        la.dtype.check_row(ne[0], "reshape")?;
        let l = packed_layout(la.dtype, ne)
            .ok_or_else(|| Error::shape("reshape", la.ne, ne, "the new strides overflow"))?;
        Ok(self.view_node(Op::Reshape, l, &[a], a, 0))
    }

    /// A view of `a` with shape `ne`, strides `nb`, starting `offset` bytes into `a`.
    pub fn view(
        &mut self,
        a: TensorId,
        ne: [usize; 4],
        nb: [usize; 4],
        offset: usize,
    ) -> Result<TensorId> {
        let la = self.lay(a)?;
        let l = Layout {
            dtype: la.dtype,
            ne,
            nb,
        };
        la.dtype.check_row(ne[0], "view")?;
        let root = self.root(a);
        let root_span = self.node(root).layout.nbytes();
        // Checked arithmetic: huge offsets or strides must not wrap around into bounds.
        let start = self.node(a).view_offs.checked_add(offset);
        let span = checked_nbytes(&l);
        let end = start.zip(span).and_then(|(s, n)| s.checked_add(n));
        if !l.ne.contains(&0) && end.is_none_or(|e| e > root_span) {
            return Err(Error::OutOfBounds {
                what: format!("view of `{}` with shape {}", self.name(a), l.shape()),
                offset: start.unwrap_or(usize::MAX),
                size: span.unwrap_or(usize::MAX),
                capacity: root_span,
            });
        }
        // Kernels address whole elements (or blocks), aligned as their type.
        let ts = la.dtype.type_size();
        let start = start.unwrap_or(usize::MAX);
        if !start.is_multiple_of(ts) || nb.iter().any(|&b| b % ts != 0) {
            return Err(Error::invalid_op(
                "view",
                format!(
                    "view of `{}`: offset {start} and strides {nb:?} must be multiples of the \
                     {} element size {ts}",
                    self.name(a),
                    la.dtype
                ),
            ));
        }
        Ok(self.view_node(Op::View { offset }, l, &[a], a, offset))
    }

    /// A packed 2-D view: `ne0 x ne1` with row stride `nb1`, at `offset` bytes.
    pub fn view_2d(
        &mut self,
        a: TensorId,
        ne0: usize,
        ne1: usize,
        nb1: usize,
        offset: usize,
    ) -> Result<TensorId> {
        let dt = self.lay(a)?.dtype;
        let nb0 = dt.type_size();
        self.view(
            a,
            [ne0, ne1, 1, 1],
            [nb0, nb1, nb1 * ne1, nb1 * ne1],
            offset,
        )
    }

    /// A 3-D view with strides `nb1`, `nb2`, at `offset` bytes.
    pub fn view_3d(
        &mut self,
        a: TensorId,
        ne: [usize; 3],
        nb1: usize,
        nb2: usize,
        offset: usize,
    ) -> Result<TensorId> {
        let dt = self.lay(a)?.dtype;
        let nb = [dt.type_size(), nb1, nb2, nb2 * ne[2]];
        self.view(a, [ne[0], ne[1], ne[2], 1], nb, offset)
    }

    /// Output axis `axes[i]` is input axis `i` (ggml_permute).
    pub fn permute(&mut self, a: TensorId, axes: [usize; 4]) -> Result<TensorId> {
        let l = self.lay(a)?.permute(axes)?;
        Ok(self.view_node(Op::Permute { axes }, l, &[a], a, 0))
    }

    /// Swap dims 0 and 1.
    pub fn transpose(&mut self, a: TensorId) -> Result<TensorId> {
        self.permute(a, [1, 0, 2, 3])
    }

    /// `a` and `b` joined along `dim` (equal in every other dim, same dtype).
    pub fn concat(&mut self, a: TensorId, b: TensorId, dim: usize) -> Result<TensorId> {
        let (la, lb) = (self.lay(a)?, self.lay(b)?);
        if dim > 3 {
            return Err(Error::invalid_op(
                "concat",
                format!("dim {dim} is not in 0..4"),
            ));
        }
        if la.dtype != lb.dtype || !la.dtype.is_float() && la.dtype != DType::I32 {
            return Err(dtype_err("concat", self.name(b), la.dtype.name(), lb.dtype));
        }
        if (0..4).any(|i| i != dim && la.ne[i] != lb.ne[i]) {
            return Err(Error::shape(
                "concat",
                la.ne,
                lb.ne,
                "all dims but the joined one must be equal",
            ));
        }
        let mut ne = la.ne;
        ne[dim] = la.ne[dim]
            .checked_add(lb.ne[dim])
            .ok_or_else(|| Error::shape("concat", la.ne, lb.ne, "the joined extent overflows"))?;
        self.computed(Op::Concat { dim }, la.dtype, ne, &[a, b])
    }
}

/// A packed layout, or `None` if one of its strides or its size exceeds `isize::MAX` bytes (the
/// plain arithmetic of `Layout::contiguous` would wrap, and kernels would overrun a small
/// allocation).
fn packed_layout(dtype: DType, ne: [usize; 4]) -> Option<Layout> {
    let mut bytes = (ne[0] / dtype.block_size()).checked_mul(dtype.type_size())?;
    for &n in &ne[1..] {
        bytes = bytes.checked_mul(n).filter(|&b| b <= isize::MAX as usize)?;
    }
    Some(Layout::contiguous(dtype, ne))
}

/// Bytes from a layout's first element to one past its last (ggml's `ggml_nbytes`: one element
/// plus `(ne[i] - 1) * nb[i]` per dim, whole rows of blocks for quantized types), computed
/// without overflow: `None` if the span does not fit in `usize`.
fn checked_nbytes(l: &Layout) -> Option<usize> {
    if l.ne.contains(&0) {
        return Some(0);
    }
    let (bs, ts) = (l.dtype.block_size(), l.dtype.type_size());
    let mut n = if bs == 1 {
        ts.checked_add((l.ne[0] - 1).checked_mul(l.nb[0])?)?
    } else {
        (l.ne[0] / bs).checked_mul(l.nb[0])?
    };
    for i in 1..4 {
        n = n.checked_add((l.ne[i] - 1).checked_mul(l.nb[i])?)?;
    }
    Some(n)
}

/// Element conversions the copy kernels provide: between float types, from a quantized type to
/// a float type, and from f32 to a quantized type (whole blocks).
fn check_convertible(op: &'static str, src: &Layout, to: DType) -> Result<()> {
    let from = src.dtype;
    let ok = from == to
        || (from.is_float() && to.is_float())
        || (from.is_quantized() && to.is_float())
        || (from == DType::F32 && to.is_quantized() && src.ne[0].is_multiple_of(to.block_size()));
    if !ok {
        return Err(Error::invalid_op(
            op,
            format!("cannot convert {from} {} to {to}", src.shape()),
        ));
    }
    Ok(())
}
