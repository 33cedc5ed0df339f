//! Fused attention: for each head, query and batch, `softmax(q·kⱼ * scale + mask[j, i]) v`
//! with an online softmax over the kv positions (one pass, running max and sum), grouped-query
//! heads (query head h reads kv head h / (H / Hk)), f32 or f16 K and V converted by row.
//! Output is `[Dv, H, n_q, batch]` as ggml's `flash_attn_ext`.

use super::{read_row_f32, thread_scratch};
use crate::DType;
use crate::cpu::view::{ComputeParams, TensorView};

pub fn supports(src: &[TensorView]) -> Result<(), String> {
    let (q, k, v) = (&src[0], &src[1], &src[2]);
    if q.dtype != DType::F32 {
        return Err("q must be f32".into());
    }
    for (t, n) in [(k, "k"), (v, "v")] {
        if !matches!(t.dtype, DType::F32 | DType::F16) {
            return Err(format!("{n} must be f32 or f16"));
        }
    }
    Ok(())
}

/// Per thread: q row, k row, v row, accumulator.
pub fn work_size(src: &[TensorView], nth: usize) -> usize {
    let d = src[0].ne[0].max(src[2].ne[0]);
    nth * (4 * d + 16) * 4
}

pub fn flash_attn(p: &ComputeParams, dst: &TensorView, src: &[TensorView], scale: f32) {
    let (q, k, v) = (&src[0], &src[1], &src[2]);
    let mask = src.get(3);
    let (d, dv, n_kv) = (q.ne[0], v.ne[0], k.ne[1]);
    let (n_q, n_head, batch) = (q.ne[1], q.ne[2], q.ne[3]);
    let group = (n_head / k.ne[2].max(1)).max(1);
    // SAFETY: work_size reserved 4 * max(d, dv) + 16 floats per thread.
    let buf = unsafe { thread_scratch(p, 4 * d.max(dv) + 16) };
    let (qr, rest) = buf.split_at_mut(d);
    let (kr, rest) = rest.split_at_mut(d);
    let (vr, rest) = rest.split_at_mut(dv);
    let acc = &mut rest[..dv];
    for r in p.range(n_q * n_head * batch) {
        let (iq, h, b) = (r % n_q, (r / n_q) % n_head, r / (n_q * n_head));
        let hk = h / group;
        // SAFETY: indices in range by construction; the output row (h, iq, b) is owned here.
        unsafe { read_row_f32(q, iq, h, b, qr) };
        acc.iter_mut().for_each(|x| *x = 0.0);
        let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
        for j in 0..n_kv {
            let mut s = 0f32;
            // SAFETY: j < n_kv, hk < Hk, b < batch.
            unsafe { read_row_f32(k, j, hk, b, kr) };
            for (a, c) in qr.iter().zip(kr.iter()) {
                s += a * c;
            }
            s *= scale;
            if let Some(mk) = mask {
                // SAFETY: the builder checked mask is [n_kv, >= n_q].
                s += unsafe { mk.get_f32(j, iq, 0, 0) };
            }
            if s == f32::NEG_INFINITY {
                continue;
            }
            // SAFETY: as above.
            unsafe { read_row_f32(v, j, hk, b, vr) };
            if s > m {
                let c = (m - s).exp();
                acc.iter_mut().for_each(|x| *x *= c);
                l *= c;
                m = s;
            }
            let e = (s - m).exp();
            l += e;
            for (a, &x) in acc.iter_mut().zip(vr.iter()) {
                *a += e * x;
            }
        }
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        for (i, a) in acc.iter().enumerate() {
            // SAFETY: dst is [dv, H, n_q, batch]; element (i, h, iq, b) is owned by this thread.
            unsafe { dst.set_f32(i, h, iq, b, a * inv) };
        }
    }
}
