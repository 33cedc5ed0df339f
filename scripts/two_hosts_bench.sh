#!/usr/bin/env bash
# two_hosts_bench.sh [OUT_DIR]   (also `two_hosts.sh bench [OUT_DIR]`)
#
# The measurement of docs/distributed.md, "Two hosts on one machine", in one run: sets up the
# two namespaces (scripts/two_hosts.sh), then, REPS times interleaved,
#
#   collectives  `metashard bench comm` (all-reduce, all-gather, reduce-scatter of f32, 2 ranks)
#                in process (2 threads) | MPI shared memory (vader) | MPI over the veth,
#                unshaped | MPI over the veth shaped to SHAPE_RATE each way (tc tbf), plus
#                SHAPE_DELAY one way if set (tc netem, where the kernel has it)
#   decode       SmolLM2 `metashard run -n DECODE_N --ignore-eos --json`: cpu:2x1 in one
#                process | 2 MPI ranks on shared memory | over the veth | over the shaped veth
#
# then prints the medians side by side, checks that every configuration generated the same
# tokens, and fits a two-level cluster for the planner: `metashard calibrate --devices cpu:2x1
# --quick --hosts 2 --inter <veth medians>` -> OUT_DIR/cluster-netns.json (and
# cluster-netns-shaped.json from the shaped link). The namespaces are removed at the end,
# also on failure or Ctrl-C.
#
# Environment: REPS (3), SIZES (4096,65536,1048576,16777216), COMM_REPS (20 calls per size),
# DECODE_N (64), SHAPE_RATE (10gbit), SHAPE_DELAY (unset), METASHARD (target/release/metashard,
# built with --features mpi), plus two_hosts.sh's MS2H_PREFIX and MS2H_NET.

set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_dir="$(cd "$script_dir/.." && pwd)"
out="${1:-$repo_dir/target/two-hosts}"
reps="${REPS:-3}"
sizes="${SIZES:-4096,65536,1048576,16777216}"
comm_reps="${COMM_REPS:-20}"
decode_n="${DECODE_N:-64}"
shape_rate="${SHAPE_RATE:-10gbit}"
shape_delay="${SHAPE_DELAY:-}"
bin="${METASHARD:-$repo_dir/target/release/metashard}"
hosts="$script_dir/two_hosts.sh"

die() { echo "two_hosts bench: error: $*" >&2; exit 1; }
[[ -x "$bin" ]] || die "$bin is missing: cargo build --release --features mpi"
command -v mpirun >/dev/null 2>&1 || die "mpirun is missing (apt-get install openmpi-bin)"
command -v python3 >/dev/null 2>&1 || die "python3 is missing (it prints the tables)"
mkdir -p -- "$out"
rm -f -- "$out"/comm-*.json "$out"/decode-*.json "$out"/log.txt

rc=0
bash "$hosts" setup || rc=$?
[[ $rc -eq 0 ]] || exit "$rc"
trap 'bash "$hosts" teardown >/dev/null 2>&1 || true' EXIT
trap 'exit 130' INT TERM

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
log="$out/log.txt"
shm() { mpirun -np 2 --mca pml ob1 --mca btl self,vader "$@"; }

# run CONFIG KIND FILE COMMAND...: the command on that configuration, stdout to FILE.
on() {
    local cfg="$1" file="$2"
    shift 2
    echo "== $cfg: $*" >>"$log"
    case "$cfg" in
        inproc) "$@" >"$file" 2>>"$log" ;;
        shm) shm "$@" >"$file" 2>>"$log" ;;
        veth) bash "$hosts" run "$@" >"$file" 2>>"$log" ;;
        shaped)
            # shellcheck disable=SC2086 # no delay: no argument
            bash "$hosts" shape "$shape_rate" $shape_delay >>"$log" 2>&1
            bash "$hosts" run "$@" >"$file" 2>>"$log"
            bash "$hosts" unshape >>"$log" 2>&1
            ;;
    esac
}

prompt="Tell me a story"
for r in $(seq 1 "$reps"); do
    for cfg in inproc shm veth shaped; do
        echo "two_hosts bench: round $r/$reps: $cfg" >&2
        if [[ $cfg == inproc ]]; then
            on "$cfg" "$out/comm-$cfg-$r.json" "$bin" bench comm --world 2 --bytes "$sizes" \
                --reps "$comm_reps" --json
            on "$cfg" "$out/decode-$cfg-$r.json" "$bin" run --devices cpu:2x1 -n "$decode_n" \
                --ignore-eos --json --prompt "$prompt"
        else
            on "$cfg" "$out/comm-$cfg-$r.json" "$bin" bench comm --dist mpi --bytes "$sizes" \
                --reps "$comm_reps" --json
            on "$cfg" "$out/decode-$cfg-$r.json" "$bin" run --dist mpi --devices cpu:1x1 \
                -n "$decode_n" --ignore-eos --json --prompt "$prompt"
        fi
    done
done

# Medians, the check of tokens and of the bytes on the veth, and the veth medians as bench
# comm rows for calibrate.
OUT="$out" REPS="$reps" COMM_REPS="$comm_reps" \
    SHAPE="$shape_rate${shape_delay:+, $shape_delay one way}" \
    python3 - <<'PY'
import json, os, re, statistics
out, reps = os.environ["OUT"], int(os.environ["REPS"])
cfgs = ["inproc", "shm", "veth", "shaped"]
names = {"inproc": "in process (2 threads)", "shm": "MPI shared memory",
         "veth": "MPI over veth", "shaped": "MPI over veth " + os.environ["SHAPE"]}
comm = {}
for c in cfgs:
    for r in range(1, reps + 1):
        for row in json.load(open(f"{out}/comm-{c}-{r}.json")):
            comm.setdefault((c, row["collective"], row["bytes"]), []).append(row)
def fmt_us(us):
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.1f} us"
keys = sorted({(k[1], k[2]) for k in comm}, key=lambda k: (["all_reduce", "all_gather", "reduce_scatter"].index(k[0]), k[1]))
print(f"collectives, f32, 2 ranks: median over {reps} runs of the median of "
      f"{os.environ['COMM_REPS']} calls (time, bus bandwidth)\n")
print("| collective | bytes | " + " | ".join(names[c] for c in cfgs) + " |")
print("|---|---|" + "---|" * len(cfgs))
medians = {}
for coll, b in keys:
    cells = []
    for c in cfgs:
        rows = comm[(c, coll, b)]
        us = statistics.median(x["median_us"] for x in rows)
        bw = statistics.median(x["busbw_gbs"] for x in rows)
        medians[(c, coll, b)] = (us, rows[0]["ranks"])
        cells.append(f"{fmt_us(us)}, {bw:.2f} GB/s")
    size = f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
    print(f"| {coll.replace('_', '-')} | {size} | " + " | ".join(cells) + " |")
for c in ["veth", "shaped"]:
    rows = [{"collective": coll, "bytes": b, "ranks": medians[(c, coll, b)][1],
             "median_us": medians[(c, coll, b)][0]} for coll, b in keys]
    json.dump(rows, open(f"{out}/comm-{c}-median.json", "w"), indent=1)

print("\nSmolLM2-135M decode (run -n N --ignore-eos): median tokens/s over %d runs\n" % reps)
print("| configuration | prompt t/s | decode t/s | tokens as in process |")
print("|---|---|---|---|")
ref = None
for c in cfgs:
    runs = [json.loads(next(l for l in open(f"{out}/decode-{c}-{r}.json") if l.startswith("{")))
            for r in range(1, reps + 1)]
    toks = [tuple(x["tokens"]) for x in runs]
    ref = ref or toks[0]
    same = all(t == ref for t in toks)
    print(f"| {names[c]} | {statistics.median(x['prompt_tokens_per_s'] for x in runs):.1f} | "
          f"{statistics.median(x['gen_tokens_per_s'] for x in runs):.1f} | {'yes' if same else 'NO'} |")
    if not same:
        raise SystemExit(f"{c}: the greedy tokens differ from the in-process run")

# The bytes that crossed the veth during each veth bench comm run, against what the
# collectives must move: per call and rank, all-reduce B (two halves), all-gather B/2,
# reduce-scatter B/2 (2 ranks), over COMM_REPS + 3 calls (3 untimed warm-ups).
log = open(f"{out}/log.txt").read()
sizes = sorted({b for _, b in keys})
need = sum(2 * b for b in sizes) * (int(os.environ["COMM_REPS"]) + 3)
parts = re.split(r"^== ", log, flags=re.M)
for p in parts:
    if p.startswith("veth:") and " bench comm " in p.splitlines()[0]:
        m = re.search(r"over \S+: (\d+) bytes a->b, (\d+) bytes b->a", p)
        if m:
            a, b = int(m.group(1)), int(m.group(2))
            print(f"\nbytes over the veth in one bench comm run: {a} a->b, {b} b->a; the "
                  f"collectives' payload is {need} each way ({a / need:.3f}x, {b / need:.3f}x)")
        break
PY

"$bin" calibrate --devices cpu:2x1 --quick --hosts 2 --inter "$out/comm-veth-median.json" \
    --inter-kind "veth between two network namespaces, TCP (MPI btl tcp), unshaped" \
    -o "$out/cluster-netns.json" >"$out/calibrate.txt" 2>>"$log"
"$bin" calibrate --devices cpu:2x1 --quick --hosts 2 --inter "$out/comm-shaped-median.json" \
    --inter-kind "veth between two network namespaces, TCP, shaped to $shape_rate${shape_delay:+, $shape_delay one way}" \
    -o "$out/cluster-netns-shaped.json" >"$out/calibrate-shaped.txt" 2>>"$log"
echo
sed -n '/^between hosts/,$p' "$out/calibrate.txt" | sed -n '1,9p'
echo "two_hosts bench: cluster profiles in $out/cluster-netns.json and cluster-netns-shaped.json; log in $log"
