#!/usr/bin/env bash
# Prompt and decode tokens/s of `metashard bench model` against llama.cpp's `llama-bench` on
# the same GGUF and threads, in interleaved rounds (issue 18's speed check): each round runs
# our device sets at each precision, then llama-bench, one process at a time. Prints each
# round's figures, the medians, and our decode and prompt rates over llama.cpp's. Run it alone
# on the machine:
#   flock /tmp/bench.lock scripts/decode_vs_llama.sh [ROUNDS]
# Environment: LLAMA_BENCH (default /tmp/llama.cpp/build/bin/llama-bench), MODEL (default the
# Gemma 3 270M Q4_K_M file under $METASHARD_MODELS), DEVICES ("cpu:1x2 cpu:2x1"), PRECISION
# ("exact,q8": `q8` is like for like with llama.cpp, which multiplies quantized weights by
# 8-bit activations), PP (64), TG (64), REPS (3 per round), BIN (target/release/metashard).
# llama-bench gets OMP_WAIT_POLICY=active unless set: its OpenMP threads then spin between
# nodes as ggml's own pool does, which is llama.cpp at its fastest on a quiet machine.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds="${1:-3}"
models="${METASHARD_MODELS:-$repo/models-cache}"
llama="${LLAMA_BENCH:-/tmp/llama.cpp/build/bin/llama-bench}"
model="${MODEL:-$models/gemma3/gemma-3-270m-q4_k_m.gguf}"
devices="${DEVICES:-cpu:1x2 cpu:2x1}" precision="${PRECISION:-exact,q8}"
pp="${PP:-64}" tg="${TG:-64}" reps="${REPS:-3}"
bin="${BIN:-$repo/target/release/metashard}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-active}"
for f in "$llama" "$model" "$bin"; do
    [ -e "$f" ] || { echo "missing: $f" >&2; exit 1; }
done
threads=2
for d in $devices; do
    # cpu:NxT uses N x T threads; llama-bench gets the most any device set uses.
    n="${d#cpu:}" && [ "$n" != "$d" ] && case "$n" in
        *x*) t=$(( ${n%x*} * ${n#*x} )); [ "$t" -gt "$threads" ] && threads="$t" ;;
    esac
done
out="$(mktemp -d)"
dev_flags=()
for d in $devices; do dev_flags+=(--devices "$d"); done
echo "machine: $(uptime)"
for r in $(seq "$rounds"); do
    "$bin" bench model --model "$model" "${dev_flags[@]}" --precision "$precision" \
        --pp "$pp" --tg "$tg" --reps "$reps" --json >"$out/ours-$r.json" 2>"$out/ours-$r.log"
    "$llama" -m "$model" -t "$threads" -p "$pp" -n "$tg" -r "$reps" -o json \
        >"$out/llama-$r.json" 2>"$out/llama-$r.log"
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
ours, llama = {}, {"pp": [], "tg": []}
for r in range(1, rounds + 1):
    for row in json.load(open(f"{out}/ours-{r}.json"))["rows"]:
        key = (row["devices"], row["precision"])
        ours.setdefault(key, {"pp": [], "tg": []})
        ours[key]["pp"].append(row["pp_tokens_per_s"])
        ours[key]["tg"].append(row["tg_tokens_per_s"])
    for row in json.load(open(f"{out}/llama-{r}.json")):
        llama["pp" if row["n_gen"] == 0 else "tg"].append(row["avg_ts"])
med = lambda xs: statistics.median(xs)
fmt = lambda xs: " ".join(f"{x:.1f}" for x in xs)
print(f"{'':>22} {'prompt t/s (rounds)':>28} {'median':>7} {'x llama':>8}   "
      f"{'decode t/s (rounds)':>28} {'median':>7} {'x llama':>8}")
print(f"{'llama.cpp':>22} {fmt(llama['pp']):>28} {med(llama['pp']):7.1f} {'':>8}   "
      f"{fmt(llama['tg']):>28} {med(llama['tg']):7.1f}")
for (dev, prec), v in ours.items():
    print(f"{dev + ' ' + prec:>22} {fmt(v['pp']):>28} {med(v['pp']):7.1f} "
          f"{med(v['pp']) / med(llama['pp']):7.2f}x   {fmt(v['tg']):>28} {med(v['tg']):7.1f} "
          f"{med(v['tg']) / med(llama['tg']):7.2f}x")
PY
echo "machine: $(uptime)"
echo "the reports: $out"
