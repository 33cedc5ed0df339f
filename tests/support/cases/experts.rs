//! Cases for the mixture-of-experts ops: `mul_mat_id` (every weight type, ids repeating an
//! expert within a token and leaving experts unused, activations shared by a token's experts
//! (`n_b = 1`) or one row per expert, M up to 33 rows for one expert so the dense kernels take
//! their GEMM and tile paths, one token (read in place), strided activations, zero tokens),
//! `argsort` both ways, `top_k`,
//! and the routing chain of llama.cpp's `build_moe_ffn` (softmax, top-k, weights by
//! `get_rows`, normalised by their sum, expert products weighted and summed).

use super::mm::mul_mat_tols;
use super::u;
use crate::support::case::{Case, Fill, Lay, TRANSPOSED, case};
use metashard::DType::{self, F32, I32, Q4_K, Q8_0};

pub fn expert_cases(v: &mut Vec<Case>) {
    mul_mat_id_cases(v);
    sort_cases(v);
    routing_cases(v);
}

/// Experts `[k, n, n_expert]` of `dt`, activations `[k, n_b, tokens]`, ids `[n_used, tokens]`.
fn mmid_case(
    dt: DType,
    [k, n, n_expert]: [usize; 3],
    n_b: usize,
    [n_used, tokens]: [usize; 2],
    b_lay: Lay,
) -> Case {
    let (t, te) = mul_mat_tols(dt);
    case(
        "mul_mat_id",
        format!("{dt} k={k} n={n} experts={n_expert} n_b={n_b} used={n_used} tokens={tokens}"),
    )
    .packed("experts", dt, [k, n, n_expert, 1], u())
    .input("b", F32, [k, n_b, tokens, 1], b_lay, u())
    .packed(
        "ids",
        I32,
        [n_used, tokens, 1, 1],
        Fill::Ints(0, n_expert as i32),
    )
    .tol(t)
    .tol_exact(te)
    .build(|g, s| g.mul_mat_id(s[0], s[1], s[2]))
}

fn mul_mat_id_cases(v: &mut Vec<Case>) {
    let p = Lay::Packed;
    for dt in DType::WEIGHT_TYPES.iter().copied() {
        let k = if dt.is_quantized() {
            2 * dt.block_size()
        } else {
            33
        };
        v.push(mmid_case(dt, [k, 17, 4], 1, [2, 3], p));
        v.push(mmid_case(dt, [k, 7, 3], 2, [2, 5], p));
        // One token (a decoding step): the experts read its row in place, unless the ids
        // repeat an expert (then it is gathered; 3 ids of 2 experts always repeat one).
        v.push(mmid_case(dt, [k, 9, 5], 1, [2, 1], p));
        v.push(mmid_case(dt, [k, 9, 2], 1, [3, 1], p));
    }
    for dt in [F32, Q8_0, Q4_K] {
        let k = if dt.is_quantized() { 256 } else { 65 };
        // One expert for every row of many tokens: the dense GEMM and the wide tiles.
        v.push(mmid_case(dt, [k, 33, 1], 1, [1, 33], p));
        v.push(mmid_case(dt, [k, 20, 8], 4, [4, 17], p));
    }
    v.push(mmid_case(F32, [33, 9, 5], 3, [3, 4], TRANSPOSED));
    v.push(mmid_case(F32, [33, 9, 5], 1, [2, 0], p));
    v.push(mmid_case(F32, [0, 9, 5], 1, [2, 3], p));
}

fn sort_cases(v: &mut Vec<Case>) {
    for descending in [false, true] {
        for ne in [[1, 1, 1, 1], [7, 5, 1, 1], [60, 3, 2, 1], [0, 3, 1, 1]] {
            v.push(
                case("argsort", format!("descending {descending}"))
                    .packed("x", F32, ne, u())
                    .build(move |g, x| g.argsort(x[0], descending)),
            );
        }
        v.push(
            case("argsort", format!("transposed, descending {descending}"))
                .input("x", F32, [9, 4, 1, 1], TRANSPOSED, u())
                .build(move |g, x| g.argsort(x[0], descending)),
        );
    }
    v.push(
        case("argsort", "top_k 3 of 8, made contiguous")
            .packed("x", F32, [8, 5, 1, 1], u())
            .build(|g, x| {
                let t = g.top_k(x[0], 3)?;
                g.cont(t)
            }),
    );
    v.push(
        case("sigmoid", "")
            .packed("x", F32, [33, 7, 1, 1], Fill::Uniform(-6.0, 6.0))
            .build(|g, x| g.sigmoid(x[0])),
    );
}

/// llama.cpp's `build_moe_ffn` (llama-graph.cpp) over `tokens` tokens: router logits
/// `[n_expert, tokens]`, softmax, top-k experts, their probabilities picked by `get_rows` on
/// `[1, n_expert, tokens]`, normalised when `norm`, then the SwiGLU experts and the weighted sum
/// over each token's experts (views of the `n_used` slots, added).
fn routing_cases(v: &mut Vec<Case>) {
    for (dt, norm) in [(F32, true), (Q8_0, false)] {
        let (k, n_ff, n_expert, n_used, tokens) = (64, 32, 6, 2, 5);
        let (t, te) = mul_mat_tols(dt);
        v.push(
            case("mul_mat_id", format!("chain: moe ffn {dt}, norm {norm}"))
                .packed("x", F32, [k, tokens, 1, 1], u())
                .packed("router", F32, [k, n_expert, 1, 1], Fill::Uniform(-3.0, 3.0))
                .packed("gate", dt, [k, n_ff, n_expert, 1], u())
                .packed("up", dt, [k, n_ff, n_expert, 1], u())
                .packed("down", dt, [n_ff, k, n_expert, 1], u())
                .tol(t)
                .tol_exact(te)
                .build(move |g, s| {
                    let logits = g.mul_mat(s[1], s[0])?;
                    let probs = g.soft_max(logits, None, 1.0)?;
                    let chosen = g.top_k(probs, n_used)?;
                    let p3 = g.reshape(probs, [1, n_expert, tokens, 1])?;
                    let mut w = g.get_rows(p3, chosen)?;
                    if norm {
                        let w2 = g.reshape(w, [n_used, tokens, 1, 1])?;
                        let sum = g.sum_rows(w2)?;
                        let w2 = g.div(w2, sum)?;
                        w = g.reshape(w2, [1, n_used, tokens, 1])?;
                    }
                    let x3 = g.reshape(s[0], [k, 1, tokens, 1])?;
                    let gate = g.mul_mat_id(s[2], x3, chosen)?;
                    let up = g.mul_mat_id(s[3], x3, chosen)?;
                    let h = g.swiglu(gate, up)?;
                    let y = g.mul_mat_id(s[4], h, chosen)?;
                    let y = g.mul(y, w)?;
                    let nb = g.layout(y).nb;
                    let mut out = g.view_2d(y, k, tokens, nb[2], 0)?;
                    for e in 1..n_used {
                        let slot = g.view_2d(y, k, tokens, nb[2], e * nb[1])?;
                        out = g.add(out, slot)?;
                    }
                    Ok(out)
                }),
        );
    }
}
