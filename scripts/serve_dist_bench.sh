#!/usr/bin/env bash
# `metashard serve --dist mpi` on 2 ranks (`cpu:1x1` each) against `serve --devices cpu:2x1` in
# one process, measured by the same client (`metashard bench serve --url`) in interleaved
# rounds: each round measures one request at a time and 8 clients at once on each server, then
# stops it with SIGTERM (to rank 0 under mpirun) and checks it exited with status 0. Prints
# each measurement and the medians. Needs a build with `--features mpi`. Run it alone:
#   flock /tmp/bench.lock scripts/serve_dist_bench.sh [ROUNDS]
# Environment: REQUESTS (16 per concurrency), MAX_TOKENS (32), BIN (target/release/metashard).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds="${1:-3}"
requests="${REQUESTS:-16}" max_tokens="${MAX_TOKENS:-32}"
bin="${BIN:-$repo/target/release/metashard}"
export METASHARD_MODELS="${METASHARD_MODELS:-$repo/models-cache}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out="$(mktemp -d)"
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# Wait until the server on port $1 (process $2) is healthy; false when it exits or takes 2 min.
up() {
    for _ in $(seq 1 600); do
        curl -sf "127.0.0.1:$1/health" >/dev/null && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}
# The pid of rank 0 among mpirun's children (OpenMPI tells each its rank in its environment).
rank0() {
    for c in $(cat "/proc/$1/task/$1/children"); do
        if grep -qz '^OMPI_COMM_WORLD_RANK=0$' "/proc/$c/environ"; then echo "$c"; fi
    done
}
for round in $(seq 1 "$rounds"); do
    for kind in mpi local; do
        p="$(port)"
        flags=(--model smollm2 --parallel 8 --ctx 256 --port "$p")
        if [ "$kind" = mpi ]; then
            mpirun --oversubscribe -np 2 --mca btl_vader_single_copy_mechanism none \
                "$bin" serve "${flags[@]}" --dist mpi --devices cpu:1x1 \
                >/dev/null 2>"$out/$kind-$round.err" &
        else
            "$bin" serve "${flags[@]}" --devices cpu:2x1 >/dev/null 2>"$out/$kind-$round.err" &
        fi
        pid=$!
        up "$p" "$pid" || { cat "$out/$kind-$round.err"; kill "$pid" 2>/dev/null; exit 1; }
        echo "round $round $kind: $(uptime)"
        "$bin" bench serve --url "http://127.0.0.1:$p" --concurrency 1,8 \
            --requests "$requests" --max-tokens "$max_tokens" --json >"$out/$kind-$round.json"
        if [ "$kind" = mpi ]; then kill -TERM "$(rank0 "$pid")"; else kill -TERM "$pid"; fi
        status=0
        wait "$pid" || status=$?
        [ "$status" = 0 ] || { echo "$kind exited with $status"; cat "$out/$kind-$round.err"; exit 1; }
    done
done
python3 - "$out" <<'EOF'
import glob, json, statistics as st, sys
rows, texts = {}, []
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    kind = f.split("/")[-1].split("-")[0]
    r = json.load(open(f))
    texts.append({p["prompt"]: sorted(p["texts"]) for p in r["outputs"]})
    for row in r["rows"]:
        rows.setdefault((kind, row["concurrency"]), []).append(row)
for (kind, c), rs in sorted(rows.items()):
    med = lambda k: st.median(r[k] for r in rs)
    print(f"{kind:5} c={c}: tokens/s {[round(r['tokens_per_s'], 1) for r in rs]} median "
          f"{med('tokens_per_s'):.1f}, TTFT {med('ttft_median_ms'):.0f} ms, ITL "
          f"{med('itl_median_ms'):.1f} ms, failed {sum(r['failed'] for r in rs)}")
for c in sorted({c for _, c in rows}):
    m = st.median(r["tokens_per_s"] for r in rows[("mpi", c)])
    l = st.median(r["tokens_per_s"] for r in rows[("local", c)])
    print(f"c={c}: mpi / local tokens/s {m / l:.2f}x")
print("one text per prompt, the same on both servers:",
      all(t == texts[0] for t in texts) and all(len(v) == 1 for t in texts for v in t.values()))
EOF
