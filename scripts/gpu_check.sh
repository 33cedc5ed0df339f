#!/usr/bin/env bash
# gpu_check.sh build [DIR]   (here, with Rust)    -> DIR (default gpu-bundle/), split in parts
# gpu_check.sh run   [DIR]   (on the GPU machine)  -> the whole GPU check, a table in $OUT or DIR
#
# `build` compiles everything the GPU check needs with `--features cuda` (the binary and the
# CUDA test executables, stripped), adds the model files (SmolLM2, MiniLM) and this script, and
# packs it all as DIR/bundle.tar cut into parts of at most 56 MiB (DIR/part-NN), so that each
# part fits one transfer to a machine without Rust or network.
#
# `run` (from the repository root on the GPU machine, the parts under DIR) joins and unpacks
# the parts, points METASHARD_CUDA_LIBS at the CUDA 13 libraries of the Python wheels there
# (nvidia-*-cu13: NVRTC, cuBLAS, NCCL), prints the GPU, then runs:
#   1. the CUDA test executables: cuda_kernels (NVRTC, rendezvous), targets::cuda (the op
#      harness and the meta properties on cuda:0xN), cuda_models (SmolLM2 greedy tokens and
#      MiniLM embeddings on cuda and cuda:0x2 against the CPU);
#   2. `bench model` on cpu, cuda and cuda:0x2 (prompt and generation tokens/s);
# and writes everything to gpu_check.log and a summary table gpu_check.md (in $OUT if set).
# Exit status: 0 when every step passed.
set -uo pipefail

mode="${1:-}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${2:-$repo/gpu-bundle}"

build() {
    set -e
    cd "$repo"
    rm -rf "$dir" && mkdir -p "$dir/stage/bin" "$dir/stage/models"
    echo "== cargo build --release --features cuda"
    cargo build --release --features cuda
    cp target/release/metashard "$dir/stage/bin/"
    echo "== cargo test --release --features cuda --no-run (the CUDA test executables)"
    cargo test --release --features cuda --no-run --message-format=json \
        --test cuda_kernels --test cuda_models --test targets 2>/dev/null |
        python3 -c '
import json, sys, shutil, os
dest = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        shutil.copy(m["executable"], os.path.join(dest, m["target"]["name"]))
        print("  ", m["target"]["name"])
' "$dir/stage/bin"
    strip "$dir"/stage/bin/*
    echo "== model files"
    bash scripts/fetch_models.sh >/dev/null
    models="${METASHARD_MODELS:-$repo/models-cache}"
    cp -r "$models/smollm2" "$models/minilm" "$dir/stage/models/"
    cp scripts/gpu_check.sh "$dir/stage/"
    tar -C "$dir/stage" -cf "$dir/bundle.tar" .
    rm -rf "$dir/stage"
    (cd "$dir" && split -b 56m -d bundle.tar part- && rm bundle.tar)
    echo "== $(ls "$dir" | wc -l) parts in $dir:"
    ls -la "$dir"
    echo "Send each part in its own device call (carry: [\"${dir#"$repo"/}/part-NN\"]), then run"
    echo "  bash scripts/gpu_check.sh run"
}

# The lib/ folders of the NVIDIA Python wheels (CUDA 13 first).
wheel_lib_dirs() {
    python3 - <<'EOF' 2>/dev/null
import glob, os, site, sys
roots = set(site.getsitepackages() + [site.getusersitepackages()] + sys.path)
dirs = []
for r in roots:
    for pat in ("nvidia/cu13/lib", "nvidia/*/lib"):
        for d in sorted(glob.glob(os.path.join(r, pat))):
            if os.path.isdir(d) and d not in dirs:
                dirs.append(d)
print(":".join(dirs))
EOF
}

run() {
    cd "$repo"
    local out="${OUT:-$dir}"
    mkdir -p "$out"
    local log="$out/gpu_check.log" md="$out/gpu_check.md"
    : >"$log"
    local work="$dir/unpacked"
    if [ ! -x "$work/bin/metashard" ]; then
        rm -rf "$work" && mkdir -p "$work"
        cat "$dir"/part-* | tar -C "$work" -xf - || { echo "gpu_check: cannot unpack $dir/part-*" | tee -a "$log"; return 1; }
    fi
    export METASHARD_CUDA_LIBS="$(wheel_lib_dirs)"
    export METASHARD_MODELS="$work/models"
    export METASHARD_SKIP_PYREF=1
    local bin="$work/bin" status=0
    {
        echo "# metashard GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
        echo
        echo '```'
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
        echo "METASHARD_CUDA_LIBS=$METASHARD_CUDA_LIBS"
        "$bin/metashard" devices 2>&1
        echo '```'
        echo
        echo "| step | result | seconds |"
        echo "|---|---|---|"
    } >"$md"
    step() {
        local name="$1"
        shift
        local t0=$(date +%s)
        echo "== $name: $*" | tee -a "$log"
        local part="$out/step.log"
        if "$@" >"$part" 2>&1; then r=pass; else r="FAIL ($?)"; status=1; fi
        # A test that found no GPU passes after printing why: say so, and fail the check.
        if [ "$r" = pass ] && grep -q "^skipped:" "$part"; then
            r="SKIPPED: $(grep -m1 "^skipped:" "$part" | cut -c10-)"
            status=1
        fi
        cat "$part" >>"$log"
        rm -f "$part"
        echo "| $name | $r | $(( $(date +%s) - t0 )) |" >>"$md"
        echo "   -> $r" | tee -a "$log"
    }
    step "cuda_kernels" "$bin/cuda_kernels"
    step "op harness on cuda" "$bin/targets" cuda:: --nocapture
    step "models on cuda, cuda:0x2" "$bin/cuda_models" --nocapture
    step "bench model" "$bin/metashard" bench model --model smollm2 --devices cpu \
        --devices cuda --devices cuda:0x2 --pp 128 --tg 64 --reps 3
    {
        echo
        echo '```'
        sed -n '/== bench model/,$p' "$log" | tail -n 20
        echo '```'
    } >>"$md"
    cat "$md"
    return $status
}

case "$mode" in
build) build ;;
run) run ;;
*)
    echo "usage: scripts/gpu_check.sh build|run [DIR]" >&2
    exit 2
    ;;
esac
