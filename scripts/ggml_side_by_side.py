#!/usr/bin/env python3
"""Side-by-side ratios against ggml for the decode kernels (issue 12), in one run.

    scripts/ggml_side_by_side.py --ggml-dir DIR [--metashard BIN] [--reps 5] [--threads 2]

DIR holds `ggml_mm_bench` and `ggml_meta_anchor`, built as ../shared/anchors/README.md says.
For each case the run alternates ggml and metashard REPS times and prints the median of each
side's medians and their ratio (ggml time / ours: above 1 means ours is faster):

- `mul_mat` cases: `ggml_mm_bench TYPE N M K THREADS` against `metashard bench ops --threads
  THREADS --no-rotate` (both reuse one copy of the weights); ours at the default precision
  (f32 activations), ggml with its 8-bit activations for quantized weights;
- the F32 MLP stack (D = 1024, F = 4096, 4 layers, one token): `ggml_meta_anchor 1 4 THREADS`
  (its plain backend) against `metashard bench meta --graph mlp --tokens 1` (plain cpu:1xT).
"""
import argparse, json, os, re, statistics, subprocess, sys

CASES = [("q8_0", m, 4096, 4096) for m in (1, 2, 4, 8)] + [
    ("q8_0", 1, 4096, 14336), ("q8_0", 2, 4096, 14336),
    ("f32", 1, 4096, 1024), ("f32", 1, 1024, 4096),
]


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("failed (%d): %s\n%s" % (p.returncode, " ".join(cmd), p.stderr[-2000:]))
    return p.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ggml-dir", required=True)
    ap.add_argument("--metashard", default="target/release/metashard")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--filter", default="", help="only cases whose label contains this")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    mm = os.path.join(a.ggml_dir, "ggml_mm_bench")
    anchor = os.path.join(a.ggml_dir, "ggml_meta_anchor")
    for f in (mm, anchor, a.metashard):
        if not os.access(f, os.X_OK):
            sys.exit("not an executable: %s" % f)
    t = str(a.threads)
    labels = ["%s m=%d n=%d k=%d" % c for c in CASES] + ["f32 mlp D=1024 F=4096 L=4 T=1"]
    res = {l: ([], []) for l in labels if a.filter in l}
    if a.threads != 2 and labels[-1] in res:
        # bench meta's plain device is cpu:1x2.
        print("the MLP case needs --threads 2 (bench meta runs cpu:1x2); skipped", file=sys.stderr)
        del res[labels[-1]]
    for rep in range(a.reps):
        print("round %d/%d" % (rep + 1, a.reps), file=sys.stderr)
        for (dt, m, n, k), label in zip(CASES, labels):
            if label not in res:
                continue
            g = run([mm, dt, str(n), str(m), str(k), t]).split()
            res[label][0].append(float(g[5]))
            js = json.loads(run([a.metashard, "bench", "ops", "--threads", t, "--no-rotate",
                                 "--m", str(m), "--filter", label, "--json"]))
            ours = [e for e in js if (e["m"], e["n"], e["k"]) == (m, n, k)]
            res[label][1].append(ours[0]["median_us"])
        if labels[-1] in res:
            out = run([anchor, "1", "4", t])
            hit = re.search(r"plain\(\d+ thr\)=(\d+) us", out)
            res[labels[-1]][0].append(float(hit.group(1)))
            js = json.loads(run([a.metashard, "bench", "meta", "--graph", "mlp", "--tokens", "1",
                                 "--json"]))
            rows = js if isinstance(js, list) else js["rows"]
            res[labels[-1]][1].append(1000 * rows[0]["median_ms"])
    table = []
    for label, (g, o) in res.items():
        gm, om = statistics.median(g), statistics.median(o)
        table.append({"case": label, "threads": a.threads, "ggml_us": gm, "ours_us": om,
                      "ratio": gm / om, "ratios": [x / y for x, y in zip(g, o)]})
    if a.json:
        print(json.dumps(table, indent=2))
        return
    print("%-32s %4s %10s %10s %7s  %s" % ("case", "thr", "ggml us", "ours us", "ratio",
                                          "per round"))
    for r in table:
        print("%-32s %4d %10.1f %10.1f %6.2fx  %s" % (
            r["case"], r["threads"], r["ggml_us"], r["ours_us"], r["ratio"],
            " ".join("%.2f" % x for x in r["ratios"])))


if __name__ == "__main__":
    main()
