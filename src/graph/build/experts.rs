//! Builders of the mixture-of-experts ops, with ggml's shapes and checks (ggml.c
//! `ggml_mul_mat_id`, `ggml_argsort`, `ggml_top_k`, `ggml_sigmoid`): the expert product, the
//! sort that picks each token's experts, and the sigmoid of gates.

use super::{check_window, dtype_err};
use crate::graph::{Graph, TensorId};
use crate::op::{Op, RowWindow, UnaryOp};
use crate::{DType, Error, Result};

impl Graph {
    /// ggml `mul_mat_id`: expert weights `as [K, N, n_expert, 1]` (any dtype but i32; rows
    /// packed, as `mul_mat`'s), f32 activations `b [K, n_b, n_tokens, 1]`, I32 expert ids
    /// `ids [n_used, n_tokens]` with `n_used % n_b == 0` (`n_b` is `n_used` or 1); output f32
    /// `[N, n_used, n_tokens, 1]`, `out[:, e, t] = as[:, :, ids[e, t]] · b[:, e % n_b, t]`.
    /// An id outside `0..n_expert` is an error naming the node when it runs.
    pub fn mul_mat_id(
        &mut self,
        experts: TensorId,
        b: TensorId,
        ids: TensorId,
    ) -> Result<TensorId> {
        self.mul_mat_id_op(experts, b, ids, None)
    }

    /// [`Graph::mul_mat_id`] of the ids `window` holds, with weights holding only its experts
    /// (at `window.at..` along `ne[2]`): the rows of other ids are zeros, ids outside
    /// `0..window.rows` are errors. How one device multiplies its share of experts split whole
    /// over the devices of a meta device (expert parallelism).
    pub fn mul_mat_id_windowed(
        &mut self,
        experts: TensorId,
        b: TensorId,
        ids: TensorId,
        window: RowWindow,
    ) -> Result<TensorId> {
        self.mul_mat_id_op(experts, b, ids, Some(window))
    }

    fn mul_mat_id_op(
        &mut self,
        experts: TensorId,
        b: TensorId,
        ids: TensorId,
        window: Option<RowWindow>,
    ) -> Result<TensorId> {
        const OP: &str = "mul_mat_id";
        let (la, lb, li) = (self.lay(experts)?, self.lay(b)?, self.lay(ids)?);
        if la.dtype == DType::I32 {
            let what = "a float or quantized type";
            return Err(dtype_err(OP, self.name(experts), what, la.dtype));
        }
        if lb.dtype != DType::F32 {
            return Err(dtype_err(OP, self.name(b), "f32", lb.dtype));
        }
        if li.dtype != DType::I32 {
            return Err(dtype_err(OP, self.name(ids), "i32", li.dtype));
        }
        if la.ne[3] != 1 || la.ne[0] != lb.ne[0] || lb.ne[3] != 1 {
            return Err(Error::shape(
                OP,
                la.ne,
                lb.ne,
                "experts must be [K, N, n_expert, 1] and activations [K, n_b, n_tokens, 1]",
            ));
        }
        let broadcasts = if lb.ne[1] == 0 {
            li.ne[0] == 0
        } else {
            li.ne[0].is_multiple_of(lb.ne[1])
        };
        if li.ne[2] != 1 || li.ne[3] != 1 || li.ne[1] != lb.ne[2] || !broadcasts {
            return Err(Error::shape(
                OP,
                lb.ne,
                li.ne,
                "ids must be [n_used, n_tokens] with the activations' n_tokens and n_used a \
                 multiple of their dimension 1",
            ));
        }
        check_window(OP, window, la.ne, 2)?;
        let ne = [la.ne[1], li.ne[0], li.ne[1], 1];
        self.computed(Op::MulMatId { window }, DType::F32, ne, &[experts, b, ids])
    }

    /// ggml `argsort`: each row's indices in the order that sorts it (I32, `a`'s shape), largest
    /// first when `descending`; `a` f32.
    pub fn argsort(&mut self, a: TensorId, descending: bool) -> Result<TensorId> {
        let l = self.lay(a)?;
        if l.dtype != DType::F32 {
            return Err(dtype_err("argsort", self.name(a), "f32", l.dtype));
        }
        self.computed(Op::Argsort { descending }, DType::I32, l.ne, &[a])
    }

    /// The indices of each row's `k` largest values, largest first: the first `k` columns of a
    /// descending [`Graph::argsort`] (a view, as ggml's `ggml_top_k` was built), I32
    /// `[k, ne1, ne2, ne3]`.
    pub fn top_k(&mut self, a: TensorId, k: usize) -> Result<TensorId> {
        let ne = self.lay(a)?.ne;
        if k > ne[0] {
            return Err(Error::invalid_op(
                "top_k",
                format!(
                    "k = {k} is more than the {} values of a row of {}",
                    ne[0],
                    crate::Shape(ne)
                ),
            ));
        }
        let sorted = self.argsort(a, true)?;
        let nb = self.lay(sorted)?.nb;
        self.view(sorted, [k, ne[1], ne[2], ne[3]], nb, 0)
    }

    pub fn sigmoid(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(UnaryOp::Sigmoid, a)
    }
}
