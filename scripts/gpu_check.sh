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
    mkdir -p "$dir/stage/scripts" "$dir/stage/wheels"
    cp scripts/gpu_check.sh scripts/gpu_torch_ref.py "$dir/stage/scripts/"
    # transformers reads GGUF files through the `gguf` package, which the GPU image lacks.
    python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$dir/stage/wheels" \
        "gguf==0.19.0" || echo "gguf wheel not fetched: the transformers comparison will be skipped"
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
    step "bench backend" sh -c "\"$bin/metashard\" bench backend --devices cuda --json >\"$out/backend.json\""
    step "bench model" sh -c "\"$bin/metashard\" bench model --model smollm2 --devices cuda \
        --devices cuda:0x2 --devices cpu --pp 128 --tg 64 --reps 3 --json >\"$out/model.json\""
    if ls "$work"/wheels/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/gguf-site "$work"/wheels/*.whl \
            && export PYTHONPATH=/tmp/gguf-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    step "torch reference" sh -c "python3 \"$work/scripts/gpu_torch_ref.py\" \
        --gguf \"$work/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\" >\"$out/torch_ref.json\""
    python3 - "$out" >>"$md" 2>>"$log" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception as e:
        return None
backend, model, torch = load("backend.json") or [], load("model.json") or {}, load("torch_ref.json") or {}
ours = {r["case"]: r for r in backend}
rows = []
def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "n/a"
copy = ours.get("copy f32 256 MiB", {}).get("rate")
tcopy = torch.get("copy f32 256 MiB", {}).get("rate")
rows.append(("copy f32 256 MiB", f"{copy or 0:.0f} GB/s", f"torch {tcopy or 0:.0f} GB/s", ratio(copy, tcopy), "-"))
for dt in ("f16", "bf16"):
    k = f"gemm {dt} 4096^3"
    a, b = ours.get(k, {}).get("rate"), torch.get(k, {}).get("rate")
    rows.append((k, f"{a or 0:.0f} TFLOP/s", f"torch.matmul {b or 0:.0f} TFLOP/s", ratio(a, b), ">= 0.9x"))
for dt in ("q4_0", "q8_0", "f16"):
    k = f"gemv {dt} m=1 14336x4096"
    a = ours.get(k, {}).get("rate")
    rows.append((k, f"{a or 0:.0f} GB/s", f"copy {copy or 0:.0f} GB/s", ratio(a, copy), ">= 0.5x"))
tg = {r["devices"]: r["tg_tokens_per_s"] for r in model.get("rows", [])}
pp = {r["devices"]: r["pp_tokens_per_s"] for r in model.get("rows", [])}
hf = torch.get("smollm2 decode f32", {}).get("rate")
hf16 = torch.get("smollm2 decode f16", {}).get("rate")
rows.append(("smollm2 decode, cuda", f"{tg.get('cuda', 0):.0f} t/s", f"transformers f32 {hf or 0:.0f} t/s", ratio(tg.get("cuda"), hf), ">= 1.0x"))
rows.append(("smollm2 decode, cuda", f"{tg.get('cuda', 0):.0f} t/s", f"transformers f16 {hf16 or 0:.0f} t/s", ratio(tg.get("cuda"), hf16), "-"))
rows.append(("smollm2 decode, cuda:0x2", f"{tg.get('cuda:0x2', 0):.0f} t/s", f"cuda {tg.get('cuda', 0):.0f} t/s", ratio(tg.get("cuda:0x2"), tg.get("cuda")), ">= 0.8x"))
rows.append(("smollm2 prompt 128, cuda", f"{pp.get('cuda', 0):.0f} t/s", f"cpu {pp.get('cpu', 0):.0f} t/s", ratio(pp.get("cuda"), pp.get("cpu")), "-"))
print()
print("| measurement | metashard | against | ratio | target |")
print("|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(r) + " |")
for k in ("kernels_error", "generate_error"):
    if k in torch:
        print(f"\ntorch reference: {k}: {torch[k]}")
EOF
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
