//! The typed op set: one `Op` variant per operation with typed parameters (no int arrays),
//! and the classification other modules need (views, elementwise, in place).
//!
//! Semantics follow ggml's ops of the same names (ggml-org/ggml `include/ggml.h`): `mul_mat`
//! contracts dimension 0 of both operands, binary ops broadcast `src1` over `src0`, row-wise
//! ops reduce dimension 0, `rope` rotates pairs per position, `flash_attn` returns
//! `[Dv, n_head, n_q, batch]`.

/// Data movement between the devices of a meta device, as it appears in per-device programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    /// Sum over devices, in place.
    AllReduce,
    /// Each device's slice along `axis` -> the whole tensor on every device.
    AllGather { axis: u8 },
    /// Partial sums -> each device's slice along `axis` of the sum.
    ReduceScatter { axis: u8 },
}

/// Element-wise functions of one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// x * sigmoid(x)
    Silu,
    /// GELU, tanh approximation: 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))
    Gelu,
    /// GELU, exact: 0.5x(1 + erf(x/sqrt(2)))
    GeluErf,
    Relu,
    Tanh,
}

impl UnaryOp {
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Silu => "silu",
            UnaryOp::Gelu => "gelu",
            UnaryOp::GeluErf => "gelu_erf",
            UnaryOp::Relu => "relu",
            UnaryOp::Tanh => "tanh",
        }
    }
}

/// Binary element-wise ops; `src1` broadcasts over `src0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
}

impl BinaryOp {
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
        }
    }
}

/// How `rope` pairs dimensions: `Normal` rotates adjacent pairs `(x[2i], x[2i+1])`, `NeoX`
/// rotates `(x[i], x[i + n_dims/2])` (ggml `GGML_ROPE_TYPE_NEOX`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeMode {
    Normal,
    NeoX,
}

/// Parameters of `rope`: `theta_i = pos * freq_scale * freq_base^(-2i/n_dims)`; dimensions
/// at and beyond `n_dims` pass through unchanged.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    pub mode: RopeMode,
    pub n_dims: usize,
    pub freq_base: f32,
    pub freq_scale: f32,
}

/// One operation. `Graph` nodes hold an `Op` and up to four sources; the sources' meaning is
/// given per variant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Op {
    /// No computation: a weight, an input, a cache; its data comes from storage or inline bytes.
    Leaf,
    // ---- views: no computation, the node shares its source's storage ------------------
    /// `[src]` with a new shape of the same element count (src contiguous).
    Reshape,
    /// `[src]` with the node's own `ne`, `nb` at `offset` bytes from the source's start.
    View {
        offset: usize,
    },
    /// `[src]` with axes moved: output axis `axes[i]` is input axis `i`.
    Permute {
        axes: [usize; 4],
    },
    // ---- data movement ------------------------------------------------------------------
    /// `[src]` copied into a new packed tensor of the node's dtype (a cast if dtypes differ).
    Cont,
    /// `[src, dst]`: copy src's elements, in order, into `dst` (any dtype and strides, same
    /// element count). The node is a view of `dst`.
    Cpy,
    /// `[a, b]` joined along `dim`.
    Concat {
        dim: usize,
    },
    /// `[table, ids]`: rows of `table` picked by I32 `ids` `[n, ne2, ne3]`, as f32.
    GetRows,
    /// `[dst, rows, ids]`: `dst[:, ids[i]] = rows[:, i]` per batch; the node is a view of `dst`.
    SetRows,
    // ---- arithmetic ---------------------------------------------------------------------
    /// `[a, b]` -> `[a.ne1, b.ne1, b.ne2, b.ne3]`, each output `dot(a row, b row)`.
    MulMat,
    Binary(BinaryOp),
    /// `x * scale + bias`.
    Scale {
        scale: f32,
        bias: f32,
    },
    Clamp {
        min: f32,
        max: f32,
    },
    Unary(UnaryOp),
    /// `[gate, up]`: `silu(gate) * up`; or `[fused]` with gate in the first half of dim 0.
    Swiglu,
    /// Row-wise `x / sqrt(mean(x^2) + eps)`.
    RmsNorm {
        eps: f32,
    },
    /// Row-wise `(x - mean) / sqrt(var + eps)` (layer norm without the affine part).
    Norm {
        eps: f32,
    },
    /// `[x, mask?]`: row-wise `softmax(x * scale + mask)`; the mask broadcasts over dims 2, 3.
    SoftMax {
        scale: f32,
    },
    /// `[x, positions]`: rotate `x [head_dim, n_head, n_tokens, 1]` by I32 positions `[n_tokens]`.
    Rope(RopeParams),
    /// Row sums: `[1, ne1, ne2, ne3]`.
    SumRows,
    /// Row means: `[1, ne1, ne2, ne3]`.
    Mean,
    /// Index of each row's maximum (I32 `[ne1]`, 2-D input).
    Argmax,
    /// `[q, k, v, mask?]`: `softmax(q kᵀ * scale + mask) v` per head, grouped-query heads;
    /// output `[dv, n_head, n_q, batch]`.
    FlashAttn {
        scale: f32,
    },
    /// `[src]`: filled by a collective between devices. Only the meta backend's per-device
    /// programs contain it; backends do not compute it (the meta backend runs it between
    /// node ranges). An in-place all-reduce is a view of its source.
    Collective(CollectiveKind),
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Leaf => "leaf",
            Op::Reshape => "reshape",
            Op::View { .. } => "view",
            Op::Permute { .. } => "permute",
            Op::Cont => "cont",
            Op::Cpy => "cpy",
            Op::Concat { .. } => "concat",
            Op::GetRows => "get_rows",
            Op::SetRows => "set_rows",
            Op::MulMat => "mul_mat",
            Op::Binary(b) => b.name(),
            Op::Scale { .. } => "scale",
            Op::Clamp { .. } => "clamp",
            Op::Unary(u) => u.name(),
            Op::Swiglu => "swiglu",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Norm { .. } => "norm",
            Op::SoftMax { .. } => "soft_max",
            Op::Rope(_) => "rope",
            Op::SumRows => "sum_rows",
            Op::Mean => "mean",
            Op::Argmax => "argmax",
            Op::FlashAttn { .. } => "flash_attn",
            Op::Collective(CollectiveKind::AllReduce) => "all_reduce",
            Op::Collective(CollectiveKind::AllGather { .. }) => "all_gather",
            Op::Collective(CollectiveKind::ReduceScatter { .. }) => "reduce_scatter",
        }
    }

    /// Ops whose node shares storage with a source and computes nothing.
    pub fn is_view(&self) -> bool {
        matches!(self, Op::Reshape | Op::View { .. } | Op::Permute { .. })
    }

    /// Ops that write into an existing tensor (`dst` is a source) and return a view of it.
    pub fn writes_into_source(&self) -> bool {
        matches!(self, Op::Cpy | Op::SetRows)
    }

    /// Ops that do no work when executed (leaves and views).
    pub fn is_noop(&self) -> bool {
        matches!(self, Op::Leaf) || self.is_view()
    }

    /// Ops the allocator may run in place: output element i depends only on input element i of
    /// `src[0]`, with the same layout, so the output may overwrite `src[0]`.
    pub fn can_inplace(&self) -> bool {
        matches!(
            self,
            Op::Binary(_) | Op::Scale { .. } | Op::Clamp { .. } | Op::Unary(_)
        )
    }
}
