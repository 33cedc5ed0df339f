#!/usr/bin/env python3
"""GEMV lab: the quantized GEMV kernels of src/cuda/kernels*.cu against an older version of the
same source (`--old FILE`: kernels.cu and kernels_qx.cu of a commit, concatenated), timed side
by side in one process on the GPU machine (CuPy compiles the project's NVRTC source there; no
Rust needed):

    git show REV:src/cuda/kernels.cu REV:src/cuda/kernels_qx.cu > gpu-bundle/lab-old.cu   (here)
    python3 scripts/gemv_lab.py --old gpu-bundle/lab-old.cu      (on the GPU machine)

For every quantized type, shape and M in (1, 4): random blocks (random quants, scales set to
small f16 values) in four copies, rotated so that the 50 MB L2 does not hold them; the old
kernel (`gemv_q` for Q8_0/Q4_0/Q4_1 where the old source has it, else `gemv_qx<TYPE, M>`) against
the new `gemv_qx<TYPE, M>`. The two outputs must agree within 1e-5 of the largest (f32 sums in
another order). With `--dp4a scripts/gemv_dp4a_lab.cu`, the backend's 8-bit-activation GEMV
(`gemv_q8a`) of each type it has is timed beside them at 1, 2 and 4 blocks per iteration, with
and without the activations' quantization, within 3e-2 of the largest f32-path output; `--types
q4_0,q4_k` keeps a run short. Times are medians of 40 batches of 4 launches between CUDA events, each batch
queued behind a 2 ms spinning kernel so that the launches run back to back; GB/s counts
the weight bytes once. The copy's bandwidth (bytes read plus written) is the CUDA issue's
reference: the quantized GEMV's target is half of it.
"""
import argparse
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# name: (code in kernels.cu, bytes per block, elements per block, f16 fields' byte offsets)
TYPES = {
    "q4_0": ("T_Q4_0", 18, 32, [0]),
    "q8_0": ("T_Q8_0", 34, 32, [0]),
    "q4_1": ("T_Q4_1", 20, 32, [0, 2]),
    "q5_0": ("T_Q5_0", 22, 32, [0]),
    "q5_1": ("T_Q5_1", 24, 32, [0, 2]),
    "q2_k": ("T_Q2_K", 84, 256, [80, 82]),
    "q3_k": ("T_Q3_K", 110, 256, [108]),
    "q4_k": ("T_Q4_K", 144, 256, [0, 2]),
    "q5_k": ("T_Q5_K", 176, 256, [0, 2]),
    "q6_k": ("T_Q6_K", 210, 256, [208]),
    "iq4_nl": ("T_IQ4_NL", 18, 32, [0]),
    "iq4_xs": ("T_IQ4_XS", 136, 256, [0]),
}
SHAPES = [(4096, 14336), (14336, 4096), (2048, 8192)]
UNROLLS = [1, 2, 8]
# The types of gemv_dp4a_lab.cu's kernels (those `gemv_q8a` has).
DP4A_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def source(base, old):
    src = base + r"""
__device__ Tensor lab_t(const void *p, int type, i64 ne0, i64 ne1, i64 nb0, i64 nb1) {
    Tensor t;
    t.p = (char *)p;
    t.ne[0] = ne0; t.ne[1] = ne1; t.ne[2] = 1; t.ne[3] = 1;
    t.nb[0] = nb0; t.nb[1] = nb1; t.nb[2] = nb1 * ne1; t.nb[3] = t.nb[2];
    t.type = type;
    t.pad = 0;
    return t;
}
// Busy for `cycles` clock cycles: launched ahead of a timed batch, it keeps the GPU busy while
// Python queues the batch's launches, so they run back to back (a 40 us product is about as
// long as CuPy takes to launch one: without it, the GPU waited on the host and the timings of
// identical kernels differed by up to 2x, round 3 of 2026-11-26).
extern "C" __global__ void lab_spin(i64 cycles) {
    i64 t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
#define LAB_ARGS float *d, const char *w, const float *x, i64 K, i64 N, i64 M, Fault *f
#define LAB_TENSORS(TY, BB, BE) \
    Tensor D = lab_t(d, T_F32, N, M, 4, N * 4), W = lab_t(w, TY, K, N, BB, K / BE * BB), \
           X = lab_t(x, T_F32, K, M, 4, K * 4); \
    Ids ids; ids.t = lab_t(0, T_I32, 0, 0, 0, 0); ids.rows = ids.lo = ids.hi = ids.at = 0;
"""
    has_q = "gemv_q(" in base or "void gemv_q(" in base or "gemv_q<" in base
    for name, (code, bb, be, _) in TYPES.items():
        for mm in (1, 8):
            if old and has_q and name in ("q4_0", "q8_0", "q4_1"):
                call = f"gemv_q<{mm}>"
            else:
                call = f"gemv_qx<{code}, {mm}>"
            src += (f'extern "C" __global__ void lab_{name}_m{mm}(LAB_ARGS) {{ LAB_TENSORS({code}, {bb}, {be}) '
                    f"{call}(D, W, X, ids, f, 0); }}\n")
            # Unrolled variants of the one-row kernel, where the source has them (a third
            # template parameter U: steps per iteration).
            for u in UNROLLS if mm == 1 and not old and "int U =" in base else []:
                src += (f'extern "C" __global__ void lab_{name}_m1_u{u}(LAB_ARGS) {{ LAB_TENSORS({code}, {bb}, {be}) '
                        f"gemv_qx<{code}, 1, {u}>(D, W, X, ids, f, 0); }}\n")
    return src


def read_new():
    return "".join(open(os.path.join(ROOT, "src", "cuda", f)).read() for f in ("kernels.cu", "kernels_qx.cu"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--emit", help="write the two CUDA sources to EMIT.old.cu and EMIT.new.cu and stop")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dp4a", help="scripts/gemv_dp4a_lab.cu (appended to the new source): the "
                    "backend's 8-bit-activation GEMV with 1, 2, 4 blocks per iteration, timed with "
                    "the quantization ('q8uU') and without ('g-q8uU'), checked within 3e-2 of the "
                    "largest output")
    ap.add_argument("--json")
    ap.add_argument("--types", help="only these types, comma-separated (e.g. q4_0,q4_k)")
    a = ap.parse_args()
    srcs = {"old": source(open(a.old).read(), True), "new": source(read_new(), False)}
    if a.dp4a:
        srcs["new"] += open(a.dp4a).read()
    if a.emit:
        for k, v in srcs.items():
            open(f"{a.emit}.{k}.cu", "w").write(v)
        return
    import cupy as cp
    import numpy as np

    opts = ("--ftz=false", "--prec-div=true", "--prec-sqrt=true")
    mods = {k: cp.RawModule(code=v, options=opts) for k, v in srcs.items()}
    rng = np.random.default_rng(1)
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()

    spin = mods["new"].get_function("lab_spin")

    def timed(fn, reps=50, warm=10):
        ts = []
        for i in range(reps):
            spin((1,), (1,), (np.int64(4_000_000),))  # about 2 ms at 1.98 GHz
            ev0.record()
            fn()
            ev1.record()
            ev1.synchronize()
            if i >= warm:
                ts.append(cp.cuda.get_elapsed_time(ev0, ev1))
        return float(np.median(ts))

    n = 256 << 20
    a_ = cp.ones(n // 4, dtype=cp.float32)
    b_ = cp.empty_like(a_)
    copy_ms = timed(lambda: cp.copyto(b_, a_), reps=30, warm=5)
    copy_gbs = 2 * n / (copy_ms * 1e6)
    del a_, b_
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"GPU {name}; copy 256 MiB: {copy_gbs:.0f} GB/s (read + written)")
    fault = cp.zeros(64, dtype=cp.uint8)
    rows = []
    ok = True
    print("type         K      N M | microseconds per product | weight GB/s")
    shapes = SHAPES[:1] if a.quick else SHAPES
    for K, N in shapes:
        for M in (1, 4):
            x = cp.asarray(rng.standard_normal(K * M, dtype=np.float32))
            for tname, (code, bb, be, halves) in TYPES.items():
                if K % be or (a.types and tname not in a.types.split(",")):
                    continue
                nblk = K // be * N
                raw = rng.integers(0, 256, size=(nblk, bb), dtype=np.uint8)
                for at in halves:
                    sc = (rng.random(nblk, dtype=np.float32) * 0.02 + 0.001).astype(np.float16)
                    raw[:, at:at + 2] = sc.view(np.uint8).reshape(nblk, 2)
                w0 = cp.asarray(raw.reshape(-1))
                # Four copies, each the blocks rotated (still valid blocks, different rows).
                copies = [w0] + [cp.roll(w0, bb * 997 * c) for c in range(1, 4)]
                wbytes = nblk * bb
                grid = ((N + 7) // 8,)
                res, outs = {}, {}
                kernels = [("old", "old", f"lab_{tname}_m{1 if M == 1 else 8}"),
                           ("new", "new", f"lab_{tname}_m{1 if M == 1 else 8}")]
                if M == 1:
                    kernels += [(f"u{u}", "new", f"lab_{tname}_m1_u{u}") for u in UNROLLS
                                if f"lab_{tname}_m1_u{u}" in srcs["new"]]
                for v, modname, kname in kernels:
                    k = mods[modname].get_function(kname)
                    out = cp.full(N * M, cp.nan, dtype=cp.float32)

                    def run():
                        for w in copies:
                            k(grid, (256,), (out, w, x, np.int64(K), np.int64(N), np.int64(M), fault))

                    res[v] = timed(run) / 4 * 1000.0  # us per product
                    outs[v] = out.get()
                loose = set()
                dp4a = [(f"q8u{u}", f"lab_{tname}_m1_q8u{u}", "lab_quantize_q8a") for u in (1, 2, 4)]
                for v, kname, qname in dp4a:
                    if M != 1 or not a.dp4a or tname not in DP4A_TYPES:
                        continue
                    k = mods["new"].get_function(kname)
                    qz = mods["new"].get_function(qname)
                    xq = cp.zeros(K + K // 32 * 4, dtype=cp.uint8)
                    out = cp.full(N, cp.nan, dtype=cp.float32)

                    def gemv():
                        for w in copies:
                            k(grid, (256,), (out, w, xq, np.int64(K), np.int64(N)))

                    def both():
                        for w in copies:
                            qz(((K // 32 + 7) // 8,), (256,), (x, xq, np.int64(K)))
                            k(grid, (256,), (out, w, xq, np.int64(K), np.int64(N)))

                    res[v] = timed(both) / 4 * 1000.0
                    res[f"g-{v}"] = timed(gemv) / 4 * 1000.0
                    outs[v] = out.get()
                    loose.add(v)
                verdict = ""
                ref = outs["old"]
                for v, got in outs.items():
                    if np.isnan(got).any():
                        verdict += f" {v}:NaN"
                        ok = False
                        continue
                    err = float(np.max(np.abs(ref - got)) / max(np.max(np.abs(ref)), 1e-30))
                    if err > (3e-2 if v in loose else 1e-5):
                        verdict += f" {v}:DIFFER {err:.1e}"
                        ok = False
                g = {v: wbytes / (res[v] * 1e3) for v in res}
                best = max(g, key=g.get)
                print(f"{tname:7} {K:6} {N:6} {M} | " + " ".join(f"{v} {res[v]:6.2f}" for v in res) +
                      f" | GB/s old {g['old']:5.0f} new {g['new']:5.0f} best {best} {g[best]:5.0f}"
                      f" = {g[best] / copy_gbs:4.2f}x copy{verdict}")
                sys.stdout.flush()
                rows.append({"type": tname, "K": K, "N": N, "M": M, "us": res, "weight_bytes": wbytes})
                del copies, outs
    if a.json:
        json.dump({"gpu": name, "copy_gbs": copy_gbs, "rows": rows}, open(a.json, "w"), indent=1)
    print("new equals old within 1e-5" if ok else "SOME OUTPUTS DIFFER")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
