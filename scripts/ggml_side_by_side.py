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

With `--table` it runs issue 17's speed table instead: every type of `--types` (default Q4_K,
Q5_K, Q6_K, Q5_0, Q8_0) at 4096x4096 and 4096x14336, every M of `--ms` (default 1,2,8,32,128),
ours with f32 activations (`exact`) and with 8-bit activations (`q8`, like for like with ggml),
one `bench ops` run per type and round (`--precision exact,q8 --m MS`). Only `ggml_mm_bench`
is needed then.
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


def ggml_name(t):
    """ggml's spelling of a type name in any case: lower case, the K-quants' `_K` upper
    (ggml.c's type_traits names: "q4_K", "q8_0", "iq4_xs")."""
    t = t.strip().lower()
    return t[:-2] + "_K" if t.endswith("_k") else t


def speed_table(a, mm):
    """Issue 17's speed table: types x shapes x M, ours at both precisions against ggml."""
    t = str(a.threads)
    ms = [int(x) for x in a.ms.split(",")]
    types = [ggml_name(x) for x in a.types.split(",")]
    shapes = [(4096, 4096), (4096, 14336)]
    res = {}
    for rep in range(a.reps):
        print("round %d/%d" % (rep + 1, a.reps), file=sys.stderr)
        for dt in types:
            ours = dt.lower()
            for (n, k) in shapes:
                for m in ms:
                    g = run([mm, dt, str(n), str(m), str(k), t]).split()
                    res.setdefault((dt, n, k, m), {"ggml": [], "exact": [], "q8": []})
                    res[(dt, n, k, m)]["ggml"].append(float(g[5]))
            js = json.loads(run([a.metashard, "bench", "ops", "--threads", t, "--no-rotate",
                                 "--m", a.ms, "--precision", "exact,q8",
                                 "--filter", "mul_mat %s " % ours, "--json"]))
            for e in js:
                key = (dt, e["n"], e["k"], e["m"])
                if key in res:
                    res[key][e["precision"]].append(e["median_us"])
    rows = []
    for (dt, n, k, m), v in res.items():
        g, x, q = (statistics.median(v[s]) if v[s] else float("nan")
                   for s in ("ggml", "exact", "q8"))
        rows.append({"type": dt, "n": n, "k": k, "m": m, "threads": a.threads, "ggml_us": g,
                     "exact_us": x, "q8_us": q, "exact_ratio": g / x, "q8_ratio": g / q})
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    print("| type | N x K | M | ggml us | ours f32-act us | ours q8 us | f32-act / ggml "
          "| q8 / ggml |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %d x %d | %d | %.0f | %.0f | %.0f | %.2fx | %.2fx |" % (
            r["type"], r["n"], r["k"], r["m"], r["ggml_us"], r["exact_us"], r["q8_us"],
            r["exact_ratio"], r["q8_ratio"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ggml-dir", required=True)
    ap.add_argument("--metashard", default="target/release/metashard")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--filter", default="", help="only cases whose label contains this")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--table", action="store_true",
                    help="issue 17's table: --types x two shapes x --ms, both precisions")
    ap.add_argument("--types", default="q4_K,q5_K,q6_K,q5_0,q8_0", help="type names, any case (ggml's spelling is used)")
    ap.add_argument("--ms", default="1,2,8,32,128")
    a = ap.parse_args()
    mm = os.path.join(a.ggml_dir, "ggml_mm_bench")
    if a.table:
        for f in (mm, a.metashard):
            if not os.access(f, os.X_OK):
                sys.exit("not an executable: %s" % f)
        speed_table(a, mm)
        return
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
