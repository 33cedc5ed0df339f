#!/usr/bin/env bash
# `metashard serve` against llama.cpp's `llama-server` on the same GGUF, threads and slots,
# measured by the same client (`metashard bench serve --url`), in interleaved rounds (one server
# alive at a time, started and stopped in each round): each round measures one request at a
# time and SLOTS clients at once on each server. Prints each
# measurement's tokens/s and the medians and ratios. Run it alone on the machine:
#   flock /tmp/bench.lock scripts/serve_vs_llama.sh [ROUNDS]
# Environment: LLAMA_SERVER (default /tmp/llama.cpp/build/bin/llama-server), MODEL (default
# SmolLM2's GGUF under $METASHARD_MODELS), THREADS (2), SLOTS (8), REQUESTS (32 at SLOTS
# clients, a quarter of them alone), MAX_TOKENS (32), BIN (target/release/metashard).
# llama-server's CPU threads wait for work in OpenMP, which spins by default; on a machine
# shared with other jobs the spinning threads slowed it 10-20x here, so OMP_WAIT_POLICY
# defaults to passive (set OMP_WAIT_POLICY=active for a quiet machine).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds="${1:-2}"
models="${METASHARD_MODELS:-$repo/models-cache}"
llama="${LLAMA_SERVER:-/tmp/llama.cpp/build/bin/llama-server}"
model="${MODEL:-$models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
threads="${THREADS:-2}" slots="${SLOTS:-8}" requests="${REQUESTS:-32}" max_tokens="${MAX_TOKENS:-32}"
bin="${BIN:-$repo/target/release/metashard}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
for f in "$llama" "$model" "$bin"; do
    [ -e "$f" ] || { echo "missing: $f" >&2; exit 1; }
done
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
out="$(mktemp -d)"
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null || true' EXIT
# One server alive at a time: an idle llama-server with OMP_WAIT_POLICY=active keeps its
# threads spinning (75% of a core each, measured), which halved metashard's share of the CPU
# when both servers stayed up through the rounds.
start() {
    local p
    p="$(port)"
    if [ "$1" = metashard ]; then
        "$bin" serve --model "$model" --devices "cpu:1x$threads" --parallel "$slots" --ctx 512 \
            --port "$p" ${METASHARD_FLAGS:-} >>"$out/metashard.log" 2>&1 &
    else
        "$llama" -m "$model" -t "$threads" -tb "$threads" -np "$slots" -c $((slots * 512)) \
            --host 127.0.0.1 --port "$p" >>"$out/llama.log" 2>&1 &
    fi
    pid=$!
    url="http://127.0.0.1:$p"
    for _ in $(seq 300); do
        curl -sf "$url/health" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "$1 did not become ready; its log: $out/$1.log" >&2
    exit 1
}
stop() { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; }
echo "machine: $(uptime)"
for r in $(seq "$rounds"); do
    for server in metashard llama; do
        start "$server"
        for c in 1 "$slots"; do
            n="$requests"
            [ "$c" = 1 ] && n=$(( (requests + 3) / 4 ))
            "$bin" bench serve --url "$url" --concurrency "$c" --requests "$n" \
                --max-tokens "$max_tokens" --json >"$out/$server-$c-$r.json"
        done
        stop
    done
done
python3 - "$out" "$rounds" "$slots" <<'PY'
import json, statistics, sys
out, rounds, slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
med = {}
for server in ("metashard", "llama"):
    for c in (1, slots):
        rows = [json.load(open(f"{out}/{server}-{c}-{r}.json"))["rows"][0] for r in range(1, rounds + 1)]
        tps = [r["tokens_per_s"] for r in rows]
        med[server, c] = statistics.median(tps)
        ttft = statistics.median(r["ttft_median_ms"] for r in rows)
        itl = statistics.median(r["itl_median_ms"] for r in rows)
        print(f"{server:>9} c={c:<2} tokens/s {' '.join(f'{t:.1f}' for t in tps)} median {med[server, c]:.1f}"
              f"  TTFT p50 {ttft:.0f} ms  ITL p50 {itl:.1f} ms")
print(f"metashard at {slots} clients: {med['metashard', slots] / med['llama', slots]:.2f}x llama-server's, "
      f"{med['metashard', slots] / med['metashard', 1]:.2f}x its own one-request rate "
      f"(llama-server: {med['llama', slots] / med['llama', 1]:.2f}x)")
PY
echo "machine: $(uptime)"
echo "the reports: $out"
