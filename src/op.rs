//! The typed op set: one `Op` variant per operation with typed parameters (no int arrays),
//! the classification other modules need (views, elementwise, in place), and the hash of every
//! parameter that keys cached plans.
//!
//! Semantics follow ggml's ops of the same names (ggml-org/ggml `include/ggml.h`): `mul_mat`
//! contracts dimension 0 of both operands, binary ops broadcast `src1` over `src0`, row-wise
//! ops reduce dimension 0, `rope` rotates pairs per position, `flash_attn` returns
//! `[Dv, n_head, n_q, batch]`. `get_rows` and `set_rows` may carry a [`RowWindow`] (this
//! crate's own: one device's share of a table or destination split by rows).

use std::hash::{Hash, Hasher};

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
    /// 1 / (1 + exp(-x)) (ggml `GGML_UNARY_OP_SIGMOID`; the shared-expert gate of Qwen2-MoE)
    Sigmoid,
}

impl UnaryOp {
    /// Whether f(0) = 0 (a value that is zero on all but one device stays so).
    pub fn keeps_zero(self) -> bool {
        match self {
            UnaryOp::Silu | UnaryOp::Gelu | UnaryOp::GeluErf | UnaryOp::Relu | UnaryOp::Tanh => {
                true
            }
            UnaryOp::Sigmoid => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Silu => "silu",
            UnaryOp::Gelu => "gelu",
            UnaryOp::GeluErf => "gelu_erf",
            UnaryOp::Relu => "relu",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
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
/// at and beyond `n_dims` pass through unchanged. Hashed like [`Op`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    pub mode: RopeMode,
    pub n_dims: usize,
    pub freq_base: f32,
    pub freq_scale: f32,
}

/// The rows of a table or destination that one device holds when it is split by rows (axis 1)
/// over devices: ids in `lo..hi` are held here, at local row `at + (id - lo)`; every other id in
/// `0..rows` is held elsewhere (`get_rows` writes zeros for it, `set_rows` skips it), and an id
/// outside `0..rows` is an error, as without a window. `rows` is the whole tensor's row count.
///
/// The meta backend sets one per device (per segment of a segmented split) from the split's
/// extents; users build the plain ops, whose window is `None` (every row of the operand).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowWindow {
    pub rows: usize,
    pub lo: usize,
    pub hi: usize,
    pub at: usize,
}

impl RowWindow {
    /// Every row of a tensor of `rows` rows, where it is: what `None` means.
    pub fn whole(rows: usize) -> RowWindow {
        RowWindow {
            rows,
            lo: 0,
            hi: rows,
            at: 0,
        }
    }

    /// The ids this window holds.
    pub fn len(&self) -> usize {
        self.hi.saturating_sub(self.lo)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `id` names a row at all (is in `0..rows`).
    #[inline]
    pub fn valid(&self, id: i64) -> bool {
        id >= 0 && (id as u64) < self.rows as u64
    }

    /// The local row of the valid id `id`, if this window holds it.
    #[inline]
    pub fn local_row(&self, id: usize) -> Option<usize> {
        (self.lo..self.hi)
            .contains(&id)
            .then(|| self.at + (id - self.lo))
    }

    /// This window narrowed to the rows `piece` of the operand it addresses (operand rows
    /// `piece.start..piece.end`), which sit at local row `at` of a tensor holding only them:
    /// how one device's share of a split operand is addressed.
    pub fn restrict(&self, piece: std::ops::Range<usize>, at: usize) -> RowWindow {
        // Ids in lo..hi address operand rows self.at + (id - lo); keep those in `piece`.
        let lo = self.lo + piece.start.saturating_sub(self.at);
        let hi = self.hi.min(self.lo + piece.end.saturating_sub(self.at));
        if hi <= lo {
            return RowWindow {
                rows: self.rows,
                lo: 0,
                hi: 0,
                at: 0,
            };
        }
        RowWindow {
            rows: self.rows,
            lo,
            hi,
            at: at + (self.at + (lo - self.lo) - piece.start),
        }
    }
}

/// One operation. `Graph` nodes hold an `Op` and up to four sources; the sources' meaning is
/// given per variant.
///
/// `Op` is `Hash` (see the impl below) so that a graph's signature (`Graph::signature`) covers every parameter.
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
    /// `[table, ids]`: rows of `table` picked by I32 `ids` `[n, ne2, ne3]`, as f32; with a
    /// window, only the ids it holds (zeros for the others).
    GetRows {
        window: Option<RowWindow>,
    },
    /// `[dst, rows, ids]`: `dst[:, ids[i]] = rows[:, i]` per batch; the node is a view of `dst`.
    /// With a window, only the rows whose id it holds are written.
    SetRows {
        window: Option<RowWindow>,
    },
    // ---- arithmetic ---------------------------------------------------------------------
    /// `[a, b]` -> `[a.ne1, b.ne1, b.ne2, b.ne3]`, each output `dot(a row, b row)`.
    MulMat,
    /// `[as, b, ids]`: ggml `mul_mat_id` (ggml.c `ggml_mul_mat_id`): expert weights
    /// `as [K, N, n_expert]`, activations `b [K, n_b, n_tokens]`, I32 expert ids
    /// `[n_used, n_tokens]` with `n_used % n_b == 0`; output f32 `[N, n_used, n_tokens]` with
    /// `out[:, e, t] = as[:, :, ids[e, t]] · b[:, e % n_b, t]`. With a window (this crate's
    /// own: one device's share of experts split whole), `as` holds only the window's experts
    /// (ids `lo..hi` at local experts `at..`) and the rows of other ids are zeros.
    MulMatId {
        window: Option<RowWindow>,
    },
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
    /// The sum of squares of each row (along ne0), f32 `[1, ne1, ne2, ne3]`: the first half of
    /// an RMS norm whose row is split by columns, each device summing its own columns (the
    /// partial sums are then all-reduced; OLMoE's norms over the whole Q and K projections).
    SumSqrRows,
    /// `x * w / sqrt(sums / width + eps)` of `[x, sums, w]`: the second half, with the norm's
    /// weight (`sums` `[1, ne1, ne2, ne3]` from [`Op::SumSqrRows`] over the whole row, `w`
    /// `[ne0]`); `width` is the whole row's length, which a device holding some columns does
    /// not see. ggml's `rms_norm` then `mul` when the sums are the row's own.
    RmsNormSums {
        eps: f32,
        width: usize,
    },
    /// Row means: `[1, ne1, ne2, ne3]`.
    Mean,
    /// Index of each row's maximum (I32 `[ne1]`, 2-D input).
    Argmax,
    /// Each row's indices in the order that sorts it (I32, the input's shape; ggml
    /// `ggml_argsort` with `GGML_SORT_ORDER_DESC` when `descending`). Equal values keep their
    /// index order. `top_k` is its first k columns (a view), as ggml's `ggml_top_k` was built.
    Argsort {
        descending: bool,
    },
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
            Op::GetRows { .. } => "get_rows",
            Op::SetRows { .. } => "set_rows",
            Op::MulMat => "mul_mat",
            Op::MulMatId { .. } => "mul_mat_id",
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
            Op::SumSqrRows => "sum_sqr_rows",
            Op::RmsNormSums { .. } => "rms_norm_sums",
            Op::Mean => "mean",
            Op::Argmax => "argmax",
            Op::Argsort { .. } => "argsort",
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
        matches!(self, Op::Cpy | Op::SetRows { .. })
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

/// The f32 parameters of ops hash by bit pattern.
fn hash_f32<H: Hasher>(x: f32, h: &mut H) {
    x.to_bits().hash(h);
}

/// Every parameter is hashed, floats by bit pattern, so two ops that differ in any parameter
/// hash apart (and so do `0.0` and `-0.0`, which `==` calls equal: the hash is never coarser
/// than `==`; `Op` is not `Eq`, so no std map keys on it). The patterns name every field, with
/// no `..` and no wildcard: a new variant or a new field does not compile until it is hashed.
impl Hash for Op {
    fn hash<H: Hasher>(&self, h: &mut H) {
        std::mem::discriminant(self).hash(h);
        match *self {
            Op::Leaf
            | Op::Reshape
            | Op::Cont
            | Op::Cpy
            | Op::MulMat
            | Op::Swiglu
            | Op::SumRows
            | Op::SumSqrRows
            | Op::Mean
            | Op::Argmax => {}
            Op::View { offset } => offset.hash(h),
            Op::Permute { axes } => axes.hash(h),
            Op::Concat { dim } => dim.hash(h),
            Op::Argsort { descending } => descending.hash(h),
            Op::GetRows { window } | Op::SetRows { window } | Op::MulMatId { window } => {
                window.hash(h)
            }
            Op::Binary(op) => op.hash(h),
            Op::Scale { scale, bias } => {
                hash_f32(scale, h);
                hash_f32(bias, h);
            }
            Op::Clamp { min, max } => {
                hash_f32(min, h);
                hash_f32(max, h);
            }
            Op::Unary(op) => op.hash(h),
            Op::RmsNorm { eps } | Op::Norm { eps } => hash_f32(eps, h),
            Op::RmsNormSums { eps, width } => {
                hash_f32(eps, h);
                width.hash(h);
            }
            Op::SoftMax { scale } | Op::FlashAttn { scale } => hash_f32(scale, h),
            Op::Rope(params) => params.hash(h),
            Op::Collective(kind) => kind.hash(h),
        }
    }
}

impl Hash for RopeParams {
    fn hash<H: Hasher>(&self, h: &mut H) {
        let RopeParams {
            mode,
            n_dims,
            freq_base,
            freq_scale,
        } = *self;
        mode.hash(h);
        n_dims.hash(h);
        hash_f32(freq_base, h);
        hash_f32(freq_scale, h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash_of(op: &Op) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        op.hash(&mut h);
        h.finish()
    }

    /// Values that differ from `self` in one parameter each, covering every parameter.
    trait Changes: Sized {
        fn changes(&self) -> Vec<Self>;
    }

    impl Changes for f32 {
        // Negation also turns 0.0 into -0.0: equal by `==`, apart by bits.
        fn changes(&self) -> Vec<f32> {
            vec![*self + 1.0, -*self]
        }
    }

    impl Changes for bool {
        fn changes(&self) -> Vec<bool> {
            vec![!*self]
        }
    }

    impl Changes for usize {
        fn changes(&self) -> Vec<usize> {
            vec![*self + 1]
        }
    }

    impl Changes for [usize; 4] {
        fn changes(&self) -> Vec<[usize; 4]> {
            (0..4)
                .map(|i| {
                    let mut a = *self;
                    a[i] += 1;
                    a
                })
                .collect()
        }
    }

    /// Every other value of a fieldless enum, by cycling through `next` (an exhaustive match).
    fn others<T: Copy + PartialEq>(start: T, next: fn(T) -> T) -> Vec<T> {
        let mut v = Vec::new();
        let mut x = next(start);
        while x != start {
            assert!(v.len() < 64, "`next` does not cycle back");
            v.push(x);
            x = next(x);
        }
        v
    }

    impl Changes for BinaryOp {
        fn changes(&self) -> Vec<BinaryOp> {
            others(*self, |b| match b {
                BinaryOp::Add => BinaryOp::Sub,
                BinaryOp::Sub => BinaryOp::Mul,
                BinaryOp::Mul => BinaryOp::Div,
                BinaryOp::Div => BinaryOp::Add,
            })
        }
    }

    impl Changes for UnaryOp {
        fn changes(&self) -> Vec<UnaryOp> {
            others(*self, |u| match u {
                UnaryOp::Silu => UnaryOp::Gelu,
                UnaryOp::Gelu => UnaryOp::GeluErf,
                UnaryOp::GeluErf => UnaryOp::Relu,
                UnaryOp::Relu => UnaryOp::Tanh,
                UnaryOp::Tanh => UnaryOp::Sigmoid,
                UnaryOp::Sigmoid => UnaryOp::Silu,
            })
        }
    }

    impl Changes for RopeMode {
        fn changes(&self) -> Vec<RopeMode> {
            others(*self, |m| match m {
                RopeMode::Normal => RopeMode::NeoX,
                RopeMode::NeoX => RopeMode::Normal,
            })
        }
    }

    impl Changes for CollectiveKind {
        fn changes(&self) -> Vec<CollectiveKind> {
            use CollectiveKind::*;
            match *self {
                AllReduce => vec![AllGather { axis: 0 }, ReduceScatter { axis: 0 }],
                AllGather { axis } => vec![
                    AllGather { axis: axis + 1 },
                    ReduceScatter { axis },
                    AllReduce,
                ],
                ReduceScatter { axis } => vec![
                    ReduceScatter { axis: axis + 1 },
                    AllGather { axis },
                    AllReduce,
                ],
            }
        }
    }

    impl Changes for RopeParams {
        fn changes(&self) -> Vec<RopeParams> {
            // Names every field: a new one does not compile until it is changed here too.
            let RopeParams {
                mode,
                n_dims,
                freq_base,
                freq_scale,
            } = *self;
            let mut v = Vec::new();
            v.extend(
                mode.changes()
                    .into_iter()
                    .map(|mode| RopeParams { mode, ..*self }),
            );
            v.extend(
                n_dims
                    .changes()
                    .into_iter()
                    .map(|n_dims| RopeParams { n_dims, ..*self }),
            );
            v.extend(
                freq_base
                    .changes()
                    .into_iter()
                    .map(|freq_base| RopeParams { freq_base, ..*self }),
            );
            v.extend(
                freq_scale
                    .changes()
                    .into_iter()
                    .map(|freq_scale| RopeParams {
                        freq_scale,
                        ..*self
                    }),
            );
            v
        }
    }

    impl Changes for RowWindow {
        fn changes(&self) -> Vec<RowWindow> {
            // Names every field: a new one does not compile until it is changed here too.
            let RowWindow { rows, lo, hi, at } = *self;
            let mut v = Vec::new();
            v.extend(
                rows.changes()
                    .into_iter()
                    .map(|rows| RowWindow { rows, ..*self }),
            );
            v.extend(lo.changes().into_iter().map(|lo| RowWindow { lo, ..*self }));
            v.extend(hi.changes().into_iter().map(|hi| RowWindow { hi, ..*self }));
            v.extend(at.changes().into_iter().map(|at| RowWindow { at, ..*self }));
            v
        }
    }

    impl Changes for Option<RowWindow> {
        fn changes(&self) -> Vec<Option<RowWindow>> {
            match self {
                None => vec![Some(RowWindow::whole(4))],
                Some(w) => std::iter::once(None)
                    .chain(w.changes().into_iter().map(Some))
                    .collect(),
            }
        }
    }

    /// Defines `every_op()`: one sample of every variant, each with the ops that differ from it
    /// in exactly one parameter (every field of a struct variant is changed in turn). The
    /// `listed` match is exhaustive and its struct patterns name every field, so a new variant
    /// or field fails to compile until it is listed here.
    macro_rules! every_op {
        (
            units: $($unit:ident),* ;
            structs: $($sv:ident { $($field:ident : $value:expr),* }),* ;
            tuples: $($tv:ident ( $t:expr )),* ;
        ) => {
            fn every_op() -> Vec<(Op, Vec<Op>)> {
                fn listed(op: &Op) {
                    match *op {
                        $(Op::$unit => {})*
                        $(Op::$sv { $($field: _),* } => {})*
                        $(Op::$tv(_) => {})*
                    }
                }
                let mut all: Vec<(Op, Vec<Op>)> = vec![$((Op::$unit, Vec::new())),*];
                $({
                    let sample = Op::$sv { $($field: $value),* };
                    let mut changed = Vec::new();
                    $(
                        if let Op::$sv { $field: value, .. } = sample {
                            for c in Changes::changes(&value) {
                                let mut op = sample;
                                if let Op::$sv { $field: slot, .. } = &mut op {
                                    *slot = c;
                                }
                                changed.push(op);
                            }
                        }
                    )*
                    all.push((sample, changed));
                })*
                $({
                    let value = $t;
                    let changed = Changes::changes(&value).into_iter().map(Op::$tv).collect();
                    all.push((Op::$tv(value), changed));
                })*
                all.iter().for_each(|(op, _)| listed(op));
                all
            }
        };
    }

    every_op! {
        units: Leaf, Reshape, Cont, Cpy, MulMat, Swiglu, SumRows, SumSqrRows, Mean, Argmax;
        structs:
            GetRows { window: Some(RowWindow { rows: 10, lo: 2, hi: 5, at: 1 }) },
            MulMatId { window: Some(RowWindow { rows: 8, lo: 2, hi: 6, at: 0 }) },
            SetRows { window: Some(RowWindow { rows: 8, lo: 4, hi: 8, at: 0 }) },
            View { offset: 64 },
            Permute { axes: [1, 0, 2, 3] },
            Concat { dim: 1 },
            Argsort { descending: true },
            Scale { scale: 0.5, bias: 0.0 },
            Clamp { min: -1.0, max: 1.0 },
            RmsNorm { eps: 1e-6 },
            RmsNormSums { eps: 1e-6, width: 64 },
            Norm { eps: 1e-5 },
            SoftMax { scale: 0.125 },
            FlashAttn { scale: 0.125 };
        tuples:
            Binary(BinaryOp::Mul),
            Unary(UnaryOp::Gelu),
            Rope(RopeParams {
                mode: RopeMode::NeoX,
                n_dims: 64,
                freq_base: 10000.0,
                freq_scale: 1.0,
            }),
            Collective(CollectiveKind::AllGather { axis: 1 });
    }

    #[test]
    fn a_window_locates_ids_and_narrows_to_a_piece() {
        let w = RowWindow::whole(10);
        assert!(w.valid(0) && w.valid(9) && !w.valid(10) && !w.valid(-1));
        assert_eq!(w.local_row(7), Some(7));
        // Device rows 4..7 of the table, at local row 2 (after a 2-row piece of an earlier
        // segment).
        let d = w.restrict(4..7, 2);
        assert_eq!(
            d,
            RowWindow {
                rows: 10,
                lo: 4,
                hi: 7,
                at: 2
            }
        );
        assert_eq!(
            (
                d.local_row(3),
                d.local_row(4),
                d.local_row(6),
                d.local_row(7)
            ),
            (None, Some(2), Some(4), None)
        );
        assert!(d.valid(9) && !d.valid(10), "validity is the whole table's");
        // A window of a window: ids 5..9 read operand rows 1..5; the piece 3..8 of the operand
        // holds ids 7..9 (rows 3, 4), at local rows 0, 1.
        let u = RowWindow {
            rows: 12,
            lo: 5,
            hi: 9,
            at: 1,
        };
        let r = u.restrict(3..8, 0);
        assert_eq!(
            r,
            RowWindow {
                rows: 12,
                lo: 7,
                hi: 9,
                at: 0
            }
        );
        // A piece before the window's rows, and an empty piece: nothing.
        assert!(u.restrict(0..1, 0).is_empty());
        assert!(w.restrict(3..3, 5).is_empty());
        assert_eq!(u.restrict(0..1, 0).rows, 12);
    }

    #[test]
    fn changing_any_parameter_of_any_op_changes_its_hash() {
        let all = every_op();
        // Each variant listed once; distinct variants hash apart.
        for (i, (a, _)) in all.iter().enumerate() {
            assert_eq!(hash_of(a), hash_of(&a.clone()), "{a:?}");
            for (b, _) in &all[..i] {
                assert_ne!(
                    std::mem::discriminant(a),
                    std::mem::discriminant(b),
                    "{a:?} listed twice"
                );
                assert_ne!(hash_of(a), hash_of(b), "{a:?} and {b:?}");
            }
        }
        for (op, changed) in &all {
            let has_params = format!("{op:?}").contains(['{', '(']);
            assert_eq!(has_params, !changed.is_empty(), "{op:?}: {changed:?}");
            for c in changed {
                // The change is real (Debug shows -0.0 apart from 0.0), and the hash sees it.
                assert_ne!(format!("{op:?}"), format!("{c:?}"));
                assert_ne!(hash_of(op), hash_of(c), "{op:?} and {c:?} hash alike");
            }
        }
    }
}
