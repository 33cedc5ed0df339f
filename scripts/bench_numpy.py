#!/usr/bin/env python3
"""Time numpy (its BLAS, OpenBLAS in the system wheel) on the F32 shapes of
`metashard bench ops`, so the two can be printed side by side.

Usage: scripts/bench_numpy.py [--threads 1,2] [--json] [--min-time 1.0] [--filter TEXT]

Output rows use the same keys as metashard's results (op, dtype, m, n, k, threads,
median_us, gflops, gbps) plus "source": "numpy"; `--json` prints a JSON array that
`metashard::bench::ops::parse_refs` reads. For the matrix product, dst[m][n] =
dot(W[n], X[m]) is computed as `X @ W.T` (M > 1) or `W @ x` (M = 1, BLAS gemv), with W an
N x K row-major f32 array, like the weights of the Rust benchmark.

BLAS threads are fixed per process through OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, which
must be set before numpy is imported, so each thread count runs in a child process.
"""

import argparse
import json
import os
import subprocess
import sys
import time

# (op, dtype, m, n, k): the F32 cases of src/bench/ops.rs.
CASES = [
    ("mul_mat", "f32", 1024, 1024, 1024),
    ("mul_mat", "f32", 2048, 2048, 2048),
    ("mul_mat", "f32", 1, 4096, 4096),
    ("mul_mat", "f32", 32, 4096, 4096),
    ("mul_mat", "f32", 1, 4096, 14336),
    ("mul_mat", "f32", 2, 4096, 14336),
]


def label(case):
    op, dtype, m, n, k = case
    return f"{op} {dtype} m={m} n={n} k={k}"


def run_child(threads, min_time, filt):
    """Runs in a process whose BLAS thread count is already fixed."""
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for case in CASES:
        if filt and filt not in label(case):
            continue
        op, dtype, m, n, k = case
        w = rng.uniform(-1, 1, size=(n, k)).astype(np.float32)
        if m == 1:
            x = rng.uniform(-1, 1, size=(k,)).astype(np.float32)
            f = lambda: w @ x  # noqa: E731
        else:
            x = rng.uniform(-1, 1, size=(m, k)).astype(np.float32)
            wt = w.T
            f = lambda: x @ wt  # noqa: E731
        for _ in range(2):
            f()
        times = []
        start = time.perf_counter()
        while len(times) < 10 or (time.perf_counter() - start < min_time and len(times) < 500):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        times.sort()
        mid = len(times) // 2
        med = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
        flops = 2.0 * m * n * k
        nbytes = 4.0 * (n * k + m * k + m * n)
        out.append(
            {
                "source": "numpy",
                "op": op,
                "dtype": dtype,
                "m": m,
                "n": n,
                "k": k,
                "threads": threads,
                "median_us": med * 1e6,
                "gflops": flops / med / 1e9,
                "gbps": nbytes / med / 1e9,
            }
        )
        print(f"[numpy] {label(case)} threads={threads}: {med * 1e6:.1f} us", file=sys.stderr)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated BLAS thread counts")
    ap.add_argument("--json", action="store_true", help="print a JSON array")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds of timed runs per case")
    ap.add_argument("--filter", default=None, help="only cases whose label contains this")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child is not None:
        json.dump(run_child(args.child, args.min_time, args.filter), sys.stdout)
        return

    results = []
    for t in [int(s) for s in args.threads.split(",") if s]:
        env = dict(os.environ, OPENBLAS_NUM_THREADS=str(t), OMP_NUM_THREADS=str(t))
        cmd = [sys.executable, __file__, "--child", str(t), "--min-time", str(args.min_time)]
        if args.filter:
            cmd += ["--filter", args.filter]
        res = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True)
        results.extend(json.loads(res.stdout))

    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(f"{'case':<34} {'thr':>3} {'median us':>11} {'GFLOP/s':>9} {'GB/s':>7}")
        for r in results:
            case = (r["op"], r["dtype"], r["m"], r["n"], r["k"])
            print(
                f"{label(case):<34} {r['threads']:>3} {r['median_us']:>11.1f} "
                f"{r['gflops']:>9.1f} {r['gbps']:>7.1f}"
            )


if __name__ == "__main__":
    main()
