//! Cases for data movement: `get_rows` (every table dtype; windowed: one device's share of a
//! table split by rows), `set_rows` (f32 rows into f32/f16/bf16 destinations, ids
//! broadcasting; windowed), `cpy` (between layouts, shapes and dtypes),
//! `cont`/`cast` (including to and from quantized types), `concat`, and the view ops
//! (`reshape`, `view`, `view_2d`, `view_3d`, `permute`, `transpose`) seen through `cont`.

use super::u;
use crate::support::case::{Case, Fill, Lay, TRANSPOSED, case, quantized_weight_types};
use metashard::DType::{self, BF16, F16, F32, I32, Q4_0, Q4_1, Q8_0};
use metashard::op::RowWindow;

pub fn data_cases(v: &mut Vec<Case>) {
    get_rows_cases(v);
    set_rows_cases(v);
    cpy_cases(v);
    cont_cases(v);
    concat_cases(v);
    view_cases(v);
}

fn fill_for(dt: DType) -> Fill {
    if dt == I32 {
        Fill::Ints(-1000, 1000)
    } else {
        u()
    }
}

fn get_rows_case(dt: DType, table: [usize; 4], lay: Lay, ids: [usize; 4]) -> Case {
    case("get_rows", "")
        .input("table", dt, table, lay, fill_for(dt))
        .packed("ids", I32, ids, Fill::Ints(0, table[1] as i32))
        .build(|g, s| g.get_rows(s[0], s[1]))
}

fn get_rows_cases(v: &mut Vec<Case>) {
    for dt in DType::WEIGHT_TYPES.iter().copied().chain([I32]) {
        let ne0 = if dt.is_quantized() {
            2 * dt.block_size()
        } else {
            7
        };
        let p = Lay::Packed;
        v.push(get_rows_case(dt, [ne0, 10, 1, 1], p, [13, 1, 1, 1]));
        v.push(get_rows_case(dt, [ne0, 10, 2, 1], p, [5, 2, 1, 1]));
        v.push(get_rows_case(dt, [ne0, 6, 2, 3], p, [4, 2, 3, 1]));
        v.push(get_rows_case(dt, [ne0, 10, 1, 1], p, [0, 1, 1, 1]));
        // Rows of the table not adjacent: a view with padded rows.
        let pad = Lay::Padded {
            pad: dt.block_size() * 2,
            off: dt.block_size(),
        };
        v.push(get_rows_case(dt, [ne0, 10, 2, 1], pad, [5, 2, 1, 1]));
    }
    v.push(get_rows_case(F32, [7, 10, 1, 1], TRANSPOSED, [9, 1, 1, 1]));
    // Ids not packed: [n, ne2] seen from a [ne2, n] tensor.
    v.push(
        case("get_rows", "")
            .packed("table", Q4_1, [64, 10, 2, 1], u())
            .input("ids", I32, [5, 2, 1, 1], TRANSPOSED, Fill::Ints(0, 10))
            .build(|g, s| g.get_rows(s[0], s[1])),
    );
    v.push(get_rows_case(F16, [1, 3, 1, 1], Lay::Packed, [5, 1, 1, 1]));
    // One device's share of a 10-row table: ids of 0..10, a table of 5 rows holding the
    // window's ids at rows at.., zeros for the other ids; an empty window gives all zeros.
    let w = |lo, hi, at| RowWindow {
        rows: 10,
        lo,
        hi,
        at,
    };
    for dt in DType::WEIGHT_TYPES.iter().copied().chain([I32]) {
        let ne0 = if dt.is_quantized() {
            2 * dt.block_size()
        } else {
            7
        };
        for win in [w(3, 7, 0), w(6, 10, 1), w(0, 5, 0), w(0, 0, 0)] {
            v.push(
                case(
                    "get_rows",
                    format!("window {}..{} at {}", win.lo, win.hi, win.at),
                )
                .packed("table", dt, [ne0, 5, 2, 1], fill_for(dt))
                .packed("ids", I32, [6, 2, 1, 1], Fill::Ints(0, 10))
                .build(move |g, s| g.get_rows_windowed(s[0], s[1], win)),
            );
        }
    }
}

/// `set_rows(dst, rows, ids)` with `ids [n, e2, e3]` broadcasting over the rows' dims 2, 3.
fn set_rows_case(dt: DType, ne0: usize, dst_lay: Lay, rows_lay: Lay, e: [usize; 2]) -> Case {
    let (n, r, d2, d3) = (4, 10, 3, 2);
    case("set_rows", "")
        .input("dst", dt, [ne0, r, d2, d3], dst_lay, u())
        .input("rows", F32, [ne0, n, d2, d3], rows_lay, u())
        .packed("ids", I32, [n, e[0], e[1], 1], Fill::DistinctIds(r))
        .build(|g, s| g.set_rows(s[0], s[1], s[2]))
}

fn set_rows_cases(v: &mut Vec<Case>) {
    let p = Lay::Packed;
    for dt in [F32, F16, BF16] {
        for e in [[3, 2], [1, 1], [3, 1], [1, 2]] {
            v.push(set_rows_case(dt, 7, p, p, e));
        }
        v.push(set_rows_case(dt, 64, p, TRANSPOSED, [3, 2]));
        // Into a view with padded rows (a cache slice): the padding must stay untouched.
        v.push(set_rows_case(
            dt,
            7,
            Lay::Padded { pad: 3, off: 1 },
            p,
            [1, 2],
        ));
    }
    // A KV-cache write: 7 new f16 rows of 64 into a 33-row cache.
    v.push(
        case("set_rows", "kv cache write")
            .packed("cache", F16, [64, 33, 1, 1], u())
            .packed("rows", F32, [64, 7, 1, 1], u())
            .packed("ids", I32, [7, 1, 1, 1], Fill::DistinctIds(33))
            .build(|g, s| g.set_rows(s[0], s[1], s[2])),
    );
    // One device's share of a 10-row destination: the rows whose id is in the window are
    // written at rows at.., the others skipped (an empty window writes nothing).
    for dt in [F32, F16, BF16] {
        for (lo, hi, at) in [(2, 6, 1), (5, 10, 0), (0, 0, 0)] {
            let win = RowWindow {
                rows: 10,
                lo,
                hi,
                at,
            };
            v.push(
                case("set_rows", format!("window {lo}..{hi} at {at}"))
                    .packed("dst", dt, [7, 6, 3, 2], u())
                    .packed("rows", F32, [7, 4, 3, 2], u())
                    .packed("ids", I32, [4, 3, 1, 1], Fill::DistinctIds(10))
                    .build(move |g, s| g.set_rows_windowed(s[0], s[1], s[2], win)),
            );
        }
    }
    v.push(
        case("set_rows", "no rows")
            .packed("dst", F32, [5, 4, 1, 1], u())
            .packed("rows", F32, [5, 0, 1, 1], u())
            .packed("ids", I32, [0, 1, 1, 1], Fill::DistinctIds(4))
            .build(|g, s| g.set_rows(s[0], s[1], s[2])),
    );
}

/// `cpy(a, dst')` where `dst'` is `dst_lay` applied to a packed destination root.
fn cpy_case(src: (DType, [usize; 4], Lay), dst: (DType, [usize; 4], Lay)) -> Case {
    case("cpy", "")
        .input("a", src.0, src.1, src.2, u())
        .input("dst", dst.0, dst.1, dst.2, u())
        .involves(dst.0)
        .build(|g, s| g.cpy(s[0], s[1]))
}

fn cpy_cases(v: &mut Vec<Case>) {
    let p = Lay::Packed;
    let t = TRANSPOSED;
    for (src, dst) in [
        // Same element count, different shapes (row lengths differ).
        ((F32, [6, 4, 1, 1], p), (F32, [8, 3, 1, 1], p)),
        ((F32, [6, 4, 2, 1], p), (F32, [3, 16, 1, 1], p)),
        ((BF16, [5, 3, 2, 1], p), (F32, [30, 1, 1, 1], p)),
        // Into a transposed destination, converting.
        ((F32, [6, 4, 2, 1], p), (F16, [6, 4, 2, 1], t)),
        ((F32, [6, 4, 2, 1], p), (BF16, [6, 4, 2, 1], t)),
        ((F16, [6, 4, 2, 1], t), (F32, [6, 4, 2, 1], t)),
        (
            (F32, [5, 3, 2, 1], Lay::Permuted([2, 0, 1, 3])),
            (F32, [5, 3, 2, 1], p),
        ),
        ((F32, [7, 3, 1, 1], t), (F16, [3, 7, 1, 1], p)),
        ((F16, [33, 3, 1, 1], p), (BF16, [33, 3, 1, 1], p)),
        (
            (F32, [7, 5, 1, 1], Lay::Padded { pad: 2, off: 1 }),
            (F32, [7, 5, 1, 1], Lay::Padded { pad: 3, off: 0 }),
        ),
        // Quantized ends keep the row length.
        ((Q8_0, [64, 3, 1, 1], p), (F32, [64, 3, 1, 1], p)),
        ((Q4_1, [64, 2, 2, 1], p), (F16, [64, 4, 1, 1], p)),
        ((F32, [64, 3, 1, 1], p), (Q4_0, [64, 3, 1, 1], p)),
        ((F32, [32, 4, 1, 1], p), (Q8_0, [32, 2, 2, 1], p)),
        (
            (F32, [64, 3, 1, 1], Lay::Permuted([0, 1, 2, 3])),
            (Q4_1, [64, 3, 1, 1], p),
        ),
        // Nothing to copy.
        ((F32, [0, 3, 1, 1], p), (F32, [3, 0, 1, 1], p)),
    ] {
        v.push(cpy_case(src, dst));
    }
}

fn cast_case(from: (DType, [usize; 4], Lay), to: DType) -> Case {
    case("cont", format!("to {to}"))
        .input("a", from.0, from.1, from.2, u())
        .involves(to)
        .build(move |g, s| g.cast(s[0], to))
}

fn cont_cases(v: &mut Vec<Case>) {
    let p = Lay::Packed;
    for dt in [F32, F16, BF16] {
        for axes in [[1, 0, 2, 3], [2, 0, 3, 1], [0, 2, 1, 3], [3, 2, 1, 0]] {
            v.push(
                case("cont", "")
                    .input("a", dt, [7, 5, 3, 2], Lay::Permuted(axes), u())
                    .build(|g, s| g.cont(s[0])),
            );
        }
        v.push(
            case("cont", "")
                .input("a", dt, [7, 5, 3, 1], Lay::Padded { pad: 3, off: 2 }, u())
                .build(|g, s| g.cont(s[0])),
        );
    }
    for dt in quantized_weight_types() {
        let bs = dt.block_size();
        v.push(
            case("cont", "")
                .packed("a", dt, [2 * bs, 3, 2, 1], u())
                .build(|g, s| g.cont(s[0])),
        );
        let pad = Lay::Padded { pad: bs, off: bs };
        v.push(
            case("cont", "")
                .input("a", dt, [2 * bs, 3, 2, 1], pad, u())
                .build(|g, s| g.cont(s[0])),
        );
    }
    for (from, to) in [
        ((F32, [33, 3, 2, 1], p), F16),
        ((F32, [33, 3, 2, 1], p), BF16),
        ((F16, [33, 3, 2, 1], p), F32),
        ((BF16, [33, 3, 2, 1], p), F16),
        ((F16, [33, 3, 2, 1], TRANSPOSED), BF16),
        ((Q8_0, [64, 3, 1, 1], p), F32),
        ((Q4_0, [64, 3, 1, 1], p), F16),
        ((Q4_1, [96, 2, 1, 1], p), BF16),
        ((Q4_1, [64, 3, 1, 1], Lay::Padded { pad: 32, off: 0 }), F32),
        ((F32, [64, 3, 1, 1], p), Q8_0),
        ((F32, [64, 3, 1, 1], p), Q4_0),
        ((F32, [96, 2, 2, 1], p), Q4_1),
        ((F32, [64, 3, 1, 1], TRANSPOSED), Q8_0),
        ((F32, [64, 3, 1, 1], Lay::Padded { pad: 5, off: 3 }), Q4_0),
        ((F32, [0, 3, 1, 1], p), F16),
    ] {
        v.push(cast_case(from, to));
    }
}

fn concat_case(dt: DType, a: [usize; 4], b: [usize; 4], lays: [Lay; 2], dim: usize) -> Case {
    case("concat", format!("dim {dim}"))
        .input("a", dt, a, lays[0], fill_for(dt))
        .input("b", dt, b, lays[1], fill_for(dt))
        .build(move |g, s| g.concat(s[0], s[1], dim))
}

fn concat_cases(v: &mut Vec<Case>) {
    let p = Lay::Packed;
    let a = [7, 3, 2, 3];
    for dim in 0..4 {
        let mut b = a;
        b[dim] = [5, 1, 3, 2][dim];
        v.push(concat_case(F32, a, b, [p, p], dim));
        v.push(concat_case(
            F32,
            a,
            b,
            [TRANSPOSED, Lay::Padded { pad: 2, off: 1 }],
            dim,
        ));
        // An empty operand.
        let mut z = a;
        z[dim] = 0;
        v.push(concat_case(F32, a, z, [p, p], dim));
        v.push(concat_case(F32, z, a, [p, p], dim));
    }
    for dt in [F16, BF16, I32] {
        v.push(concat_case(dt, [7, 3, 2, 1], [7, 4, 2, 1], [p, p], 1));
        v.push(concat_case(
            dt,
            [7, 3, 2, 1],
            [2, 3, 2, 1],
            [p, TRANSPOSED],
            0,
        ));
    }
}

/// The view ops compute nothing; `cont` makes their element order observable.
fn view_cases(v: &mut Vec<Case>) {
    v.push(
        case("reshape", "[6, 4] -> [3, 8]")
            .packed("x", F32, [6, 4, 1, 1], u())
            .build(|g, s| {
                let r = g.reshape(s[0], [3, 8, 1, 1])?;
                g.cont(r)
            }),
    );
    v.push(
        case("reshape", "[64, 3, 2] -> [32, 12], quantized")
            .packed("x", Q4_0, [64, 3, 2, 1], u())
            .build(|g, s| {
                let r = g.reshape(s[0], [32, 12, 1, 1])?;
                g.cast(r, F32)
            }),
    );
    v.push(
        case("view", "view_2d 4 x 5, row stride 10, offset 2")
            .packed("x", F32, [10, 6, 1, 1], u())
            .build(|g, s| {
                let r = g.view_2d(s[0], 4, 5, 40, 8)?;
                g.cont(r)
            }),
    );
    v.push(
        case(
            "view",
            "view_3d [3, 4, 2] of f16 [8, 5, 3], strides 16, 80, offset 18",
        )
        .packed("x", F16, [8, 5, 3, 1], u())
        .build(|g, s| {
            let r = g.view_3d(s[0], [3, 4, 2], 16, 80, 18)?;
            g.cont(r)
        }),
    );
    v.push(
        case(
            "view",
            "4-d view with overlapping rows (stride smaller than the row)",
        )
        .packed("x", F32, [40, 1, 1, 1], u())
        .build(|g, s| {
            let r = g.view(s[0], [8, 5, 2, 1], [4, 12, 32, 64], 4)?;
            g.cont(r)
        }),
    );
    v.push(
        case(
            "view",
            "last column of a matrix: strided elements ending at the root's end",
        )
        .packed("x", F32, [8, 4, 1, 1], u())
        .build(|g, s| {
            let r = g.view(s[0], [4, 1, 1, 1], [32, 128, 128, 128], 28)?;
            g.cont(r)
        }),
    );
    v.push(
        case("view", "view of a permuted view")
            .packed("x", F32, [6, 5, 4, 1], u())
            .build(|g, s| {
                let t = g.permute(s[0], [2, 0, 1, 3])?;
                let l = *g.layout(t);
                let r = g.view(t, [3, 2, 4, 1], l.nb, l.nb[2])?;
                g.cont(r)
            }),
    );
    v.push(
        case("permute", "[1, 2, 3, 0]")
            .packed("x", BF16, [3, 4, 5, 2], u())
            .build(|g, s| {
                let r = g.permute(s[0], [1, 2, 3, 0])?;
                g.cont(r)
            }),
    );
    v.push(
        case("transpose", "twice")
            .packed("x", F32, [7, 3, 2, 1], u())
            .build(|g, s| {
                let t = g.transpose(s[0])?;
                let t = g.cont(t)?;
                let t = g.transpose(t)?;
                g.cont(t)
            }),
    );
}
