//! The op-by-op case list: [`all_cases`] gathers every family. This file holds the element-wise
//! ops, the row-wise ops (norms, soft_max, reductions, argmax), rope, and multi-node chains that
//! exercise intermediates and in-place reuse; `data.rs` holds data movement, `mm.rs`
//! mul_mat and flash_attn, `experts.rs` the mixture-of-experts ops.
//!
//! Shapes are odd on purpose (1, 3, 7, 33, 65) so that no kernel gets away with assuming
//! multiples of a vector width; zero extents appear where the builders accept them.

use super::case::{Case, Fill, Lay, TRANSPOSED, case};
use metashard::DType::{self, BF16, F16, F32, I32};
use metashard::op::{BinaryOp, RopeMode, RopeParams, UnaryOp};

mod data;
mod experts;
mod mm;

pub use mm::{kv_view, mul_mat_tols};

/// Every case, in a fixed order.
pub fn all_cases() -> Vec<Case> {
    let mut v = Vec::new();
    binary_cases(&mut v);
    unary_cases(&mut v);
    swiglu_cases(&mut v);
    norm_cases(&mut v);
    sum_sqr_cases(&mut v);
    soft_max_cases(&mut v);
    rope_cases(&mut v);
    reduction_cases(&mut v);
    chain_cases(&mut v);
    data::data_cases(&mut v);
    mm::mul_mat_cases(&mut v);
    mm::flash_attn_cases(&mut v);
    experts::expert_cases(&mut v);
    v
}

pub fn u() -> Fill {
    Fill::Uniform(-1.0, 1.0)
}

const FLOATS: [DType; 3] = [F32, F16, BF16];
const PAD: Lay = Lay::Padded { pad: 3, off: 1 };

fn binary_case(op: BinaryOp, a: (DType, [usize; 4], Lay), b: (DType, [usize; 4], Lay)) -> Case {
    // Denominators stay away from zero so the quotient is well conditioned.
    let fb = if op == BinaryOp::Div {
        Fill::AwayFromZero(0.5, 2.0)
    } else {
        u()
    };
    case(op.name(), "")
        .input("a", a.0, a.1, a.2, u())
        .input("b", b.0, b.1, b.2, fb)
        .build(move |g, x| g.binary(op, x[0], x[1]))
}

fn binary_cases(v: &mut Vec<Case>) {
    use BinaryOp::*;
    let p = Lay::Packed;
    let a = [7, 3, 2, 3];
    // b broadcast over each dim, several at once, and not at all.
    let bcasts = [
        [7, 3, 2, 3],
        [1, 3, 2, 3],
        [7, 1, 2, 3],
        [7, 3, 1, 3],
        [7, 3, 2, 1],
        [7, 1, 1, 1],
        [1, 1, 1, 1],
    ];
    for op in [Add, Sub, Mul, Div] {
        for b in bcasts {
            v.push(binary_case(op, (F32, a, p), (F32, b, p)));
        }
        for (da, db) in [
            (F16, F32),
            (F32, F16),
            (BF16, F32),
            (F16, F16),
            (BF16, BF16),
        ] {
            for b in [a, [7, 1, 1, 1]] {
                v.push(binary_case(op, (da, a, p), (db, b, p)));
            }
        }
        // Non-contiguous operands.
        v.push(binary_case(op, (F32, a, TRANSPOSED), (F32, a, p)));
        v.push(binary_case(
            op,
            (F32, a, p),
            (F32, [7, 3, 1, 1], TRANSPOSED),
        ));
        v.push(binary_case(
            op,
            (F32, a, PAD),
            (F32, a, Lay::Permuted([0, 2, 1, 3])),
        ));
        v.push(binary_case(op, (F16, a, PAD), (F32, [1, 3, 2, 1], p)));
        // b's row repeats within a's row (b.ne0 divides a.ne0), packed and strided.
        v.push(binary_case(
            op,
            (F32, [6, 6, 2, 1], p),
            (F32, [3, 2, 1, 1], p),
        ));
        v.push(binary_case(
            op,
            (F16, [6, 6, 2, 1], p),
            (F32, [3, 2, 2, 1], TRANSPOSED),
        ));
        // A bias over a wide row, and zero extents.
        v.push(binary_case(
            op,
            (F32, [65, 33, 1, 1], p),
            (F32, [65, 1, 1, 1], p),
        ));
        // One or two wide rows (decoding one token): threads split the columns.
        v.push(binary_case(
            op,
            (F32, [1000, 1, 1, 1], p),
            (F32, [1000, 1, 1, 1], p),
        ));
        v.push(binary_case(
            op,
            (F32, [403, 2, 1, 1], p),
            (F32, [1, 1, 1, 1], p),
        ));
        v.push(binary_case(
            op,
            (F16, [403, 1, 1, 1], p),
            (F32, [403, 1, 1, 1], TRANSPOSED),
        ));
        v.push(binary_case(
            op,
            (F32, [5, 0, 3, 1], p),
            (F32, [5, 1, 1, 1], p),
        ));
        v.push(binary_case(
            op,
            (F32, [0, 4, 1, 1], p),
            (F32, [0, 1, 1, 1], p),
        ));
    }
}

fn unary_cases(v: &mut Vec<Case>) {
    use UnaryOp::*;
    // Wide enough to reach the tails of tanh, gelu and silu.
    let wide = || Fill::Uniform(-4.0, 4.0);
    // [777, 1, 1, 1]: one wide row, split by columns between threads.
    let shapes = [[1, 1, 1, 1], [33, 7, 2, 1], [777, 1, 1, 1]];
    for op in [Silu, Gelu, GeluErf, Relu, Tanh, Sigmoid] {
        for dt in FLOATS {
            for ne in shapes {
                v.push(
                    case(op.name(), "")
                        .packed("x", dt, ne, wide())
                        .build(move |g, x| g.unary(op, x[0])),
                );
            }
        }
        for (dt, lay) in [(F32, TRANSPOSED), (F32, PAD), (F16, TRANSPOSED)] {
            v.push(
                case(op.name(), "")
                    .input("x", dt, [33, 7, 2, 1], lay, wide())
                    .build(move |g, x| g.unary(op, x[0])),
            );
        }
        v.push(
            case(op.name(), "")
                .packed("x", F32, [4, 0, 3, 1], wide())
                .build(move |g, x| g.unary(op, x[0])),
        );
    }
    for dt in FLOATS {
        for lay in [Lay::Packed, TRANSPOSED, PAD] {
            let ne = [33, 5, 3, 1];
            v.push(
                case("scale", "scale 0.37")
                    .input("x", dt, ne, lay, u())
                    .build(|g, x| g.scale(x[0], 0.37)),
            );
            v.push(
                case("scale", "scale -1.5 bias 0.25")
                    .input("x", dt, ne, lay, u())
                    .build(|g, x| g.scale_bias(x[0], -1.5, 0.25)),
            );
            v.push(
                case("clamp", "min -0.5 max 0.3")
                    .input("x", dt, ne, lay, u())
                    .build(|g, x| g.clamp(x[0], -0.5, 0.3)),
            );
        }
    }
    v.push(
        case("scale", "scale 2, zero rows")
            .packed("x", F32, [3, 0, 1, 1], u())
            .build(|g, x| g.scale(x[0], 2.0)),
    );
}

fn swiglu_cases(v: &mut Vec<Case>) {
    let ne = [33, 5, 2, 1];
    let wide = || Fill::Uniform(-3.0, 3.0);
    for dt in FLOATS {
        v.push(
            case("swiglu", "gate, up")
                .packed("gate", dt, ne, wide())
                .packed("up", dt, ne, wide())
                .build(|g, x| g.swiglu(x[0], x[1])),
        );
        v.push(
            case("swiglu", "fused [gate | up]")
                .packed("x", dt, [66, 5, 2, 1], wide())
                .build(|g, x| g.swiglu_fused(x[0])),
        );
    }
    v.push(
        case("swiglu", "gate, up, mixed dtypes and layouts")
            .input("gate", F32, ne, TRANSPOSED, wide())
            .input("up", F16, ne, PAD, wide())
            .build(|g, x| g.swiglu(x[0], x[1])),
    );
    for lay in [TRANSPOSED, Lay::Padded { pad: 4, off: 2 }] {
        v.push(
            case("swiglu", "fused [gate | up], strided")
                .input("x", F32, [66, 5, 2, 1], lay, wide())
                .build(|g, x| g.swiglu_fused(x[0])),
        );
    }
    v.push(
        case("swiglu", "fused, one row")
            .packed("x", F32, [2, 1, 1, 1], wide())
            .build(|g, x| g.swiglu_fused(x[0])),
    );
    // One wide row (decoding one token): threads split the columns.
    v.push(
        case("swiglu", "fused, one wide row")
            .packed("x", F32, [2 * 1003, 1, 1, 1], wide())
            .build(|g, x| g.swiglu_fused(x[0])),
    );
    v.push(
        case("swiglu", "gate, up, one wide row, strided up")
            .packed("gate", F32, [1003, 1, 1, 1], wide())
            .input("up", F32, [1003, 1, 1, 1], TRANSPOSED, wide())
            .build(|g, x| g.swiglu(x[0], x[1])),
    );
}

fn norm_cases(v: &mut Vec<Case>) {
    // Shifted values make the mean matter for `norm`.
    let shifted = || Fill::Uniform(1.0, 3.0);
    for dt in FLOATS {
        for ne in [[1, 1, 1, 1], [7, 3, 2, 1], [65, 5, 1, 3]] {
            v.push(
                case("rms_norm", "eps 1e-5")
                    .packed("x", dt, ne, u())
                    .build(|g, x| g.rms_norm(x[0], 1e-5)),
            );
            v.push(
                case("norm", "eps 1e-12")
                    .packed("x", dt, ne, shifted())
                    .build(|g, x| g.norm(x[0], 1e-12)),
            );
        }
    }
    for (ne, lay) in [
        ([576, 2, 1, 1], Lay::Packed),
        ([7, 3, 2, 1], TRANSPOSED),
        ([65, 5, 1, 3], Lay::Padded { pad: 5, off: 2 }),
        ([7, 3, 2, 1], Lay::Permuted([0, 2, 1, 3])),
        ([5, 0, 2, 1], Lay::Packed),
    ] {
        v.push(
            case("rms_norm", "eps 1e-6")
                .input("x", F32, ne, lay, u())
                .build(|g, x| g.rms_norm(x[0], 1e-6)),
        );
        v.push(
            case("norm", "eps 1e-5")
                .input("x", F32, ne, lay, shifted())
                .build(|g, x| g.norm(x[0], 1e-5)),
        );
    }
}

/// `sum_sqr_rows` and `rms_norm_sums`: on their own (sums and a width given, as a device
/// holding some of a row's columns sees them), and together as the RMS norm of whole rows
/// with its weight (what OLMoE's norms over whole projections compute).
fn sum_sqr_cases(v: &mut Vec<Case>) {
    for dt in FLOATS {
        for ne in [[1, 1, 1, 1], [7, 3, 2, 1], [65, 5, 1, 3]] {
            v.push(
                case("sum_sqr_rows", "")
                    .packed("x", dt, ne, u())
                    .build(|g, x| g.sum_sqr_rows(x[0])),
            );
            let sums = [1, ne[1], ne[2], ne[3]];
            v.push(
                case("rms_norm_sums", "width 100")
                    .packed("x", dt, ne, u())
                    .packed("sums", F32, sums, Fill::Uniform(0.5, 3.0))
                    .packed("w", F32, [ne[0], 1, 1, 1], u())
                    .build(|g, x| g.rms_norm_sums(x[0], x[1], x[2], 1e-5, 100)),
            );
            v.push(
                case("rms_norm_sums", "of its own sums")
                    .packed("x", dt, ne, u())
                    .packed("w", F32, [ne[0], 1, 1, 1], u())
                    .build(move |g, x| {
                        let sums = g.sum_sqr_rows(x[0])?;
                        g.rms_norm_sums(x[0], sums, x[1], 1e-6, ne[0])
                    }),
            );
        }
    }
    for (ne, lay) in [
        ([33, 7, 2, 1], TRANSPOSED),
        ([33, 7, 2, 1], PAD),
        ([7, 0, 2, 1], Lay::Packed),
    ] {
        v.push(
            case("sum_sqr_rows", "")
                .input("x", F32, ne, lay, u())
                .build(|g, x| g.sum_sqr_rows(x[0])),
        );
        v.push(
            case("rms_norm_sums", "of its own sums")
                .input("x", F32, ne, lay, u())
                .packed("w", F32, [ne[0], 1, 1, 1], u())
                .build(move |g, x| {
                    let sums = g.sum_sqr_rows(x[0])?;
                    g.rms_norm_sums(x[0], sums, x[1], 1e-6, ne[0])
                }),
        );
    }
}

fn soft_max_case(
    x: (DType, [usize; 4], Lay),
    mask: Option<(DType, [usize; 4], Fill)>,
    scale: f32,
) -> Case {
    let mut c = case("soft_max", format!("scale {scale}")).input(
        "x",
        x.0,
        x.1,
        x.2,
        Fill::Uniform(-5.0, 5.0),
    );
    let has_mask = mask.is_some();
    if let Some((dt, ne, fill)) = mask {
        c = c.packed("mask", dt, ne, fill);
    }
    c.build(move |g, s| g.soft_max(s[0], has_mask.then(|| s[1]), scale))
}

fn soft_max_cases(v: &mut Vec<Case>) {
    let causal = || Fill::CausalMask { dead: vec![] };
    let ne = [33, 7, 3, 2];
    let p = Lay::Packed;
    for dt in FLOATS {
        v.push(soft_max_case((dt, ne, p), None, 1.0));
        v.push(soft_max_case(
            (dt, ne, p),
            Some((F32, [33, 7, 1, 1], causal())),
            0.125,
        ));
        v.push(soft_max_case(
            (dt, ne, p),
            Some((F16, [33, 9, 1, 1], causal())),
            0.125,
        ));
    }
    // The mask broadcast over dim 2, dim 3, both, or neither; random (non-causal) masks.
    for m in [[33, 7, 3, 1], [33, 7, 1, 2], [33, 7, 3, 2], [33, 8, 1, 2]] {
        v.push(soft_max_case((F32, ne, p), Some((F32, m, causal())), 0.5));
    }
    v.push(soft_max_case(
        (F32, ne, p),
        Some((F16, [33, 7, 1, 2], u())),
        1.0,
    ));
    v.push(soft_max_case(
        (F32, ne, TRANSPOSED),
        Some((F32, [33, 7, 1, 1], causal())),
        0.3,
    ));
    v.push(soft_max_case((F16, ne, PAD), None, 1.0));
    v.push(soft_max_case((F32, [1, 1, 1, 1], p), None, 1.0));
    v.push(soft_max_case((F32, [4096, 2, 1, 1], p), None, 1.0));
    v.push(soft_max_case((F32, [5, 0, 1, 1], p), None, 1.0));
    // Rows whose every key is masked give zeros (by design), the others sum to one.
    for mdt in [F32, F16] {
        let (n_kv, rows) = (9, 5);
        let dead = vec![1, 3];
        let mask = Fill::CausalMask { dead: dead.clone() };
        let c = soft_max_case(
            (F32, [n_kv, rows, 2, 1], p),
            Some((mdt, [n_kv, rows, 1, 1], mask)),
            1.0,
        );
        let check = move |out: &[f64]| -> Result<(), String> {
            for (r, row) in out.chunks(n_kv).enumerate() {
                let s: f64 = row.iter().sum();
                if dead.contains(&(r % rows)) {
                    if row.iter().any(|&x| x != 0.0) {
                        return Err(format!("fully masked row {r} is {row:?}, not zeros"));
                    }
                } else if (s - 1.0).abs() > 1e-5 {
                    return Err(format!("row {r} sums to {s}"));
                }
            }
            Ok(())
        };
        v.push(Case {
            params: format!("{} (rows 1 and 3 fully masked)", c.params),
            check: Some(std::sync::Arc::new(check)),
            ..c
        });
    }
}

fn rope_case(dt: DType, x: ([usize; 4], Lay), p: RopeParams) -> Case {
    let n_tokens = x.0[2];
    case(
        "rope",
        format!(
            "{:?} n_dims {} base {} scale {}",
            p.mode, p.n_dims, p.freq_base, p.freq_scale
        ),
    )
    .input("x", dt, x.0, x.1, u())
    // Positions in any order, with repeats, far from zero (large angles).
    .packed("pos", I32, [n_tokens, 1, 1, 1], Fill::Ints(0, 4096))
    .build(move |g, s| g.rope(s[0], s[1], p))
}

fn rope_cases(v: &mut Vec<Case>) {
    let rp = |mode, n_dims, freq_base, freq_scale| RopeParams {
        mode,
        n_dims,
        freq_base,
        freq_scale,
    };
    for dt in [F32, F16] {
        for mode in [RopeMode::Normal, RopeMode::NeoX] {
            v.push(rope_case(
                dt,
                ([64, 3, 5, 1], Lay::Packed),
                rp(mode, 64, 10000.0, 1.0),
            ));
            // Partial rotation: dims from n_dims on pass through.
            v.push(rope_case(
                dt,
                ([10, 2, 7, 1], Lay::Packed),
                rp(mode, 6, 10000.0, 1.0),
            ));
            v.push(rope_case(
                dt,
                ([64, 3, 5, 1], Lay::Packed),
                rp(mode, 32, 100000.0, 0.25),
            ));
        }
    }
    for mode in [RopeMode::Normal, RopeMode::NeoX] {
        // Heads of a token not adjacent ([D, n_tokens, n_head] permuted), padded rows.
        let p = rp(mode, 64, 10000.0, 1.0);
        v.push(rope_case(
            F32,
            ([64, 3, 5, 1], Lay::Permuted([0, 2, 1, 3])),
            p,
        ));
        v.push(rope_case(
            F32,
            ([64, 3, 5, 1], Lay::Padded { pad: 8, off: 4 }),
            p,
        ));
        v.push(rope_case(
            F32,
            ([2, 1, 1, 1], Lay::Packed),
            rp(mode, 2, 10000.0, 1.0),
        ));
        // Positions read out of a longer i32 tensor.
        v.push(
            case("rope", format!("{mode:?}, positions a view"))
                .packed("x", F32, [8, 2, 5, 1], u())
                .input(
                    "pos",
                    I32,
                    [5, 1, 1, 1],
                    Lay::Padded { pad: 3, off: 2 },
                    Fill::Ints(0, 50),
                )
                .build(move |g, s| g.rope(s[0], s[1], rp(mode, 8, 10000.0, 1.0))),
        );
        // Q heads viewed out of a fused QKV row: [D, H + 2 Hk, T] root, view of heads 1..4.
        v.push(
            case("rope", format!("{mode:?} on a view of fused qkv rows"))
                .packed("qkv", F32, [16, 6, 5, 1], u())
                .packed("pos", I32, [5, 1, 1, 1], Fill::Ints(0, 100))
                .build(move |g, s| {
                    let l = *g.layout(s[0]);
                    let q = g.view(s[0], [16, 3, 5, 1], l.nb, l.nb[1])?;
                    g.rope(q, s[1], rp(mode, 16, 10000.0, 1.0))
                }),
        );
    }
}

fn reduction_cases(v: &mut Vec<Case>) {
    for dt in FLOATS {
        for ne in [[1, 1, 1, 1], [33, 7, 2, 3]] {
            v.push(
                case("sum_rows", "")
                    .packed("x", dt, ne, u())
                    .build(|g, x| g.sum_rows(x[0])),
            );
            v.push(
                case("mean", "")
                    .packed("x", dt, ne, u())
                    .build(|g, x| g.mean(x[0])),
            );
        }
    }
    for (ne, lay) in [
        ([33, 7, 2, 1], TRANSPOSED),
        ([33, 7, 2, 1], PAD),
        ([7, 0, 2, 1], Lay::Packed),
    ] {
        v.push(
            case("sum_rows", "")
                .input("x", F32, ne, lay, u())
                .build(|g, x| g.sum_rows(x[0])),
        );
        v.push(
            case("mean", "")
                .input("x", F32, ne, lay, u())
                .build(|g, x| g.mean(x[0])),
        );
    }
    // An empty row sums to zero (the output is poisoned first, so it must be written).
    v.push(
        case("sum_rows", "empty rows")
            .packed("x", F32, [0, 3, 1, 1], u())
            .build(|g, x| g.sum_rows(x[0])),
    );
    for (ne, lay) in [
        ([7, 5, 1, 1], Lay::Packed),
        ([1, 3, 1, 1], Lay::Packed),
        ([65, 1, 1, 1], Lay::Packed),
        ([1000, 4, 1, 1], Lay::Packed),
        ([7, 5, 1, 1], TRANSPOSED),
        ([33, 4, 1, 1], PAD),
        ([7, 0, 1, 1], Lay::Packed),
    ] {
        v.push(
            case("argmax", "")
                .input("x", F32, ne, lay, u())
                .build(|g, x| g.argmax(x[0])),
        );
    }
}

/// Several nodes per graph: intermediates live in the backend's compute buffer, and the
/// allocator may run element-wise nodes in place over a dying intermediate.
fn chain_cases(v: &mut Vec<Case>) {
    v.push(
        case(
            "add",
            "chain: relu(scale(x, 2) + b), in place over intermediates",
        )
        .packed("x", F32, [33, 4, 1, 1], u())
        .packed("b", F32, [33, 1, 1, 1], u())
        .build(|g, s| {
            let t = g.scale(s[0], 2.0)?;
            let t = g.add(t, s[1])?;
            g.relu(t)
        }),
    );
    v.push(
        case("mul_mat", "chain: sum_rows(gelu(w x + b))")
            .packed("w", F32, [33, 17, 1, 1], u())
            .packed("x", F32, [33, 5, 1, 1], u())
            .packed("b", F32, [17, 1, 1, 1], u())
            .build(|g, s| {
                let t = g.mul_mat(s[0], s[1])?;
                let t = g.add(t, s[2])?;
                let t = g.gelu(t)?;
                g.sum_rows(t)
            }),
    );
    v.push(
        case("rms_norm", "chain: rms_norm(cont(permute(x))) * w")
            .packed("x", F16, [7, 5, 3, 1], u())
            .packed("w", F32, [5, 1, 1, 1], u())
            .build(|g, s| {
                let t = g.permute(s[0], [1, 0, 2, 3])?;
                let t = g.cont(t)?;
                let t = g.rms_norm(t, 1e-5)?;
                g.mul(t, s[1])
            }),
    );
    v.push(
        case("get_rows", "chain: norm(get_rows(emb, ids)) * w + b")
            .packed("emb", DType::Q8_0, [64, 11, 1, 1], u())
            .packed("ids", I32, [6, 1, 1, 1], Fill::Ints(0, 11))
            .packed("w", F32, [64, 1, 1, 1], u())
            .packed("b", F32, [64, 1, 1, 1], u())
            .build(|g, s| {
                let t = g.get_rows(s[0], s[1])?;
                let t = g.norm(t, 1e-12)?;
                let t = g.mul(t, s[2])?;
                g.add(t, s[3])
            }),
    );
    v.push(
        case("soft_max", "chain: attention by mul_mat, soft_max, mul_mat")
            .packed("q", F32, [16, 5, 2, 1], u())
            .packed("k", F32, [16, 9, 2, 1], u())
            .packed("v", F32, [9, 16, 2, 1], u())
            .packed("mask", F32, [9, 5, 1, 1], Fill::CausalMask { dead: vec![] })
            .build(|g, s| {
                let kq = g.mul_mat(s[1], s[0])?;
                let p = g.soft_max(kq, Some(s[3]), 0.25)?;
                g.mul_mat(s[2], p)
            }),
    );
}
