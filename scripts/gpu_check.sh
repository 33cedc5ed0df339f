#!/usr/bin/env bash
# gpu_check.sh build [DIR]          (here, with Rust)   -> DIR (default gpu-bundle/): the parts
# gpu_check.sh run kernels|models   (on the GPU machine) -> one stage of the GPU check, in $OUT
#
# A session's device time is 15 minutes, every start, transfer and idle second counted, and each
# device call carries at most 64 MiB. So the check is two calls on one warm machine:
#
#   1. carry gpu-bundle/bins.tar.xz and gpu-bundle/models-00, run `gpu_check.sh run kernels`:
#      unpacks the binaries (metashard and the CUDA test executables, stripped, xz) and runs
#      cuda_kernels (NVRTC, rendezvous, synthetic decoders in each of Q5_0, Q5_1, Q2_K..Q6_K,
#      IQ4_NL, IQ4_XS against the CPU), targets cuda:: (the op harness and the meta properties
#      on cuda:0xN, every weight type included), `bench backend` (copy, GEMM, GEMV) and
#      PyTorch's copy and matmul;
#   2. carry gpu-bundle/models-01 (a warm machine keeps the first call's files), run
#      `gpu_check.sh run models`: joins the model parts (SmolLM2's GGUF), runs cuda_models
#      (SmolLM2's greedy tokens on cuda and cuda:0x2 against the CPU), `bench model` on cuda,
#      cuda:0x2 and cpu, and transformers' greedy decoding of the same file.
#
# Each stage writes gpu_check.md (a pass/fail table and the ratios the CUDA issue targets, from
# every result so far), gpu_check-STAGE.log and the JSON behind them to $OUT; every step has a
# time limit (STEP_TIMEOUT, 240 s), so one hang cannot eat the lease. MiniLM (87 MiB) does not
# fit the two calls: `MODELS=minilm gpu_check.sh build` bundles it alone (MODELS names the
# folders of the models cache to carry; default smollm2); `run models` runs the checks of the
# models it finds. `MODELS=gemma3` bundles the Gemma 3 270M Q4_K_M file (253 MB: models-00 ..
# models-04, five calls: the parts between the first and the last carried with the command
# `true`), which `run models` verifies on cuda and cuda:0x2 against the CPU.
# Exit status: 0 when every step of the stage passed.
set -uo pipefail

mode="${1:-}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$repo/gpu-bundle"
[ "$mode" = build ] && [ -n "${2:-}" ] && dir="$2"

build() {
    set -e
    cd "$repo"
    rm -rf "$dir" && mkdir -p "$dir/stage/bin" "$dir/models/models"
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
    mkdir -p "$dir/stage/scripts" "$dir/stage/wheels"
    cp scripts/gpu_check.sh scripts/gpu_torch_ref.py "$dir/stage/scripts/"
    # transformers reads GGUF files through the `gguf` package, which the GPU image lacks.
    python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$dir/stage/wheels" \
        "gguf==0.19.0" || echo "gguf wheel not fetched: the transformers comparison will be skipped"
    tar -C "$dir/stage" -cf - . | xz -T0 -6 >"$dir/bins.tar.xz"
    rm -rf "$dir/stage"
    echo "== model files"
    bash scripts/fetch_models.sh >/dev/null
    models="${METASHARD_MODELS:-$repo/models-cache}"
    for m in ${MODELS:-smollm2}; do
        cp -r "$models/$m" "$dir/models/models/"
    done
    tar -C "$dir/models" -cf "$dir/models.tar" models
    rm -rf "$dir/models"
    # The first call carries the binaries and the first model part: 57 MiB together, leaving
    # room for the working tree (4 MiB of sources and docs) under the 64 MiB a call carries.
    local bins first
    bins=$(stat -c %s "$dir/bins.tar.xz")
    first=$(( 57 * 1024 * 1024 - bins ))
    [ "$first" -gt 0 ] || { echo "the binaries alone ($bins bytes) fill a call" >&2; exit 1; }
    head -c "$first" "$dir/models.tar" >"$dir/models-00"
    tail -c +"$((first + 1))" "$dir/models.tar" | split -b 60m -d -a 2 --numeric-suffixes=1 - "$dir/models-"
    rm "$dir/models.tar"
    ls -la "$dir"
    echo "call 1: carry [\"gpu-bundle/bins.tar.xz\", \"gpu-bundle/models-00\"], command: bash scripts/gpu_check.sh run kernels"
    echo "call 2: carry [\"gpu-bundle/models-01\"] (and later parts), command: bash scripts/gpu_check.sh run models"
}

# The lib/ folders of the NVIDIA Python wheels (CUDA 13 first), then the toolkit's.
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
for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"):
    if os.path.isdir(d) and d not in dirs:
        dirs.append(d)
print(":".join(dirs))
EOF
}

run() {
    local stage="${1:-}"
    case "$stage" in kernels | models) ;; *)
        echo "usage: scripts/gpu_check.sh run kernels|models" >&2
        return 2
        ;;
    esac
    cd "$repo"
    # Results of both stages stay on the warm machine (git-ignored) and go to $OUT each time.
    local res="$dir/results" out="${OUT:-$dir/results}"
    mkdir -p "$res" "$out"
    local log="$res/gpu_check-$stage.log" md="$res/gpu_check.md"
    : >"$log"
    local work="$dir/unpacked"
    if [ ! -x "$work/bin/metashard" ]; then
        rm -rf "$work" && mkdir -p "$work"
        xz -dc "$dir/bins.tar.xz" | tar -C "$work" -xf - ||
            { echo "gpu_check: cannot unpack $dir/bins.tar.xz" | tee -a "$log"; return 1; }
    fi
    if [ "$stage" = models ] && [ ! -d "$work/models" ]; then
        cat "$dir"/models-* | tar -C "$work" -xf - ||
            { echo "gpu_check: cannot unpack $dir/models-* (a part missing?)" | tee -a "$log"; return 1; }
    fi
    export METASHARD_CUDA_LIBS="$(wheel_lib_dirs)"
    export METASHARD_MODELS="$work/models"
    export METASHARD_SKIP_PYREF=1
    export RUST_BACKTRACE=1
    local bin="$work/bin" status=0 limit="${STEP_TIMEOUT:-240}"
    if [ ! -f "$md" ]; then
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
    fi
    step() {
        local name="$1"
        shift
        local t0=$(date +%s)
        echo "== $name: $*" | tee -a "$log"
        local part="$res/step.log"
        if timeout "$limit" "$@" >"$part" 2>&1; then r=pass; else
            local rc=$?
            r="FAIL ($rc)"
            [ $rc = 124 ] && r="FAIL (over ${limit} s)"
            status=1
        fi
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
    if [ "$stage" = kernels ]; then
        # The host_ tests compile kernels_qx.cu's host-testable part with a host C++ compiler (CI
        # runs them; the GPU machine may have none). The rest include synthetic decoders in
        # every K-quant / Q5 / IQ4 type on cuda and cuda:0x2 against the CPU.
        step "cuda_kernels" "$bin/cuda_kernels" --skip host_ --nocapture
        step "op harness on cuda" "$bin/targets" cuda:: --nocapture
        step "bench backend" sh -c "\"$bin/metashard\" bench backend --devices cuda --json >\"$res/backend.json\""
        # A prompt's mul_mat_id with each expert read once per pair (not grouped by expert).
        step "bench backend, experts per pair" sh -c "METASHARD_CUDA_MOE_GROUPS=0 \"$bin/metashard\" \
            bench backend --devices cuda --filter tokens --json >\"$res/backend_pairs.json\""
        step "torch kernels" sh -c "python3 \"$work/scripts/gpu_torch_ref.py\" >\"$res/torch_ref.json\""
    else
        # The checks of the models the bundle carries (MODELS at build time).
        local skip=()
        [ -d "$work/models/minilm" ] || skip+=(--skip minilm)
        [ -d "$work/models/smollm2" ] || skip+=(--skip smollm2)
        if [ -d "$work/models/minilm" ] || [ -d "$work/models/smollm2" ]; then
            step "models on cuda, cuda:0x2" "$bin/cuda_models" --nocapture "${skip[@]}"
        fi
        # The real Gemma 3 270M Q4_K_M file (Q4_K, Q6_K, Q5_0 and Q8_0 tensors), when bundled
        # (MODELS=gemma3: five parts), against the CPU: logits and 16 greedy tokens.
        local g3="$work/models/gemma3/gemma-3-270m-q4_k_m.gguf"
        if [ -f "$g3" ]; then
            for d in cuda cuda:0x2; do
                step "gemma3 Q4_K_M on $d" "$bin/metashard" verify --model "$g3" --devices "$d" \
                    --against cpu --steps 16
            done
        fi
        if [ -d "$work/models/smollm2" ]; then
            step "bench model" sh -c "\"$bin/metashard\" bench model --model smollm2 --devices cuda \
                --devices cuda:0x2 --devices cpu --precision exact,q8 --pp 128 --tg 64 --reps 3 \
                --json >\"$res/model.json\""
            # CUDA graphs (opt-in, METASHARD_CUDA_GRAPHS=1): the same tests and decode again.
            step "models with CUDA graphs" env METASHARD_CUDA_GRAPHS=1 "$bin/cuda_models" --nocapture "${skip[@]}"
            step "bench model, CUDA graphs" sh -c "METASHARD_CUDA_GRAPHS=1 \"$bin/metashard\" bench model --model smollm2 \
                --devices cuda --devices cuda:0x2 --precision exact,q8 --pp 128 --tg 64 --reps 3 \
                --json >\"$res/model_graphs.json\""
            if ls "$work"/wheels/*.whl >/dev/null 2>&1; then
                python3 -m pip install -q --no-index --no-deps --target /tmp/gguf-site "$work"/wheels/*.whl &&
                    export PYTHONPATH=/tmp/gguf-site${PYTHONPATH:+:$PYTHONPATH}
            fi
            step "torch reference" sh -c "python3 \"$work/scripts/gpu_torch_ref.py\" \
                --gguf \"$work/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\" >\"$res/torch_ref.json\""
        fi
    fi
    summary "$res" >"$res/summary.md" 2>>"$log"
    cp "$res"/*.json "$res"/*.log "$res"/*.md "$out"/ 2>/dev/null
    cat "$md" "$res/summary.md"
    return $status
}

# The ratios the CUDA issue targets, from whatever JSON the stages have written so far.
summary() {
    python3 - "$1" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception as e:
        return None
backend, model, torch = load("backend.json") or [], load("model.json") or {}, load("torch_ref.json") or {}
graphs = load("model_graphs.json") or {}
ours = {r["case"]: r for r in backend}
rows = []
def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "n/a"
copy = ours.get("copy f32 256 MiB", {}).get("rate")
tcopy = torch.get("copy f32 256 MiB", {}).get("rate")
rows.append(("copy f32 256 MiB", f"{copy or 0:.0f} GB/s", f"torch {tcopy or 0:.0f} GB/s", ratio(copy, tcopy), "-"))
launch = ours.get("launch: 64 scale nodes of 256 f32", {}).get("rate")
rows.append(("launch: 64 scale nodes of 256 f32", f"{launch or 0:.1f} us per node", "-", "-", "-"))
for dt in ("f16", "bf16"):
    k = f"gemm {dt} 4096^3"
    a, b = ours.get(k, {}).get("rate"), torch.get(k, {}).get("rate")
    rows.append((k, f"{a or 0:.0f} TFLOP/s", f"torch.matmul {b or 0:.0f} TFLOP/s", ratio(a, b), ">= 0.9x"))
# The 8-bit-activation rows (`... q8`: Precision::Q8, integer dot products) after the f32 ones.
for q8 in ("", " q8"):
    for dt in ("q4_0", "q8_0", "q4_k", "q6_k", "q5_0") + (("f16",) if not q8 else ()):
        k = f"gemv {dt} m=1 14336x4096{q8}"
        a = ours.get(k, {}).get("rate")
        rows.append((k, f"{a or 0:.0f} GB/s", f"copy {copy or 0:.0f} GB/s", ratio(a, copy), ">= 0.5x"))
for q8 in ("", " q8"):
    for dt in ("q4_k", "q8_0"):
        k = f"mul_mat_id {dt} 8 of 128 768x2048{q8}"
        a = ours.get(k, {}).get("rate")
        rows.append((k, f"{a or 0:.0f} GB/s", f"copy {copy or 0:.0f} GB/s", ratio(a, copy), "-"))
pairs = {r["case"]: r for r in (load("backend_pairs.json") or [])}
for dt in ("q4_k", "q8_0"):
    k = f"mul_mat_id {dt} 8 of 128 768x2048 512 tokens"
    a, b = ours.get(k, {}).get("rate"), pairs.get(k, {}).get("rate")
    rows.append((k + ", grouped by expert", f"{a or 0:.1f} TFLOP/s", f"per pair {b or 0:.1f} TFLOP/s", ratio(a, b), "-"))
mrows = model.get("rows", [])
tg = {r["devices"]: r["tg_tokens_per_s"] for r in mrows if r.get("precision", "exact") == "exact"}
pp = {r["devices"]: r["pp_tokens_per_s"] for r in mrows if r.get("precision", "exact") == "exact"}
tg8 = {r["devices"]: r["tg_tokens_per_s"] for r in mrows if r.get("precision") == "q8"}
hf = torch.get("smollm2 decode f32", {}).get("rate")
hf16 = torch.get("smollm2 decode f16", {}).get("rate")
rows.append(("smollm2 decode, cuda", f"{tg.get('cuda', 0):.0f} t/s", f"transformers f32 {hf or 0:.0f} t/s", ratio(tg.get("cuda"), hf), ">= 1.0x"))
rows.append(("smollm2 decode, cuda", f"{tg.get('cuda', 0):.0f} t/s", f"transformers f16 {hf16 or 0:.0f} t/s", ratio(tg.get("cuda"), hf16), "-"))
rows.append(("smollm2 decode, cuda:0x2", f"{tg.get('cuda:0x2', 0):.0f} t/s", f"cuda {tg.get('cuda', 0):.0f} t/s", ratio(tg.get("cuda:0x2"), tg.get("cuda")), ">= 0.8x"))
rows.append(("smollm2 decode, cuda, q8", f"{tg8.get('cuda', 0):.0f} t/s", f"cuda exact {tg.get('cuda', 0):.0f} t/s", ratio(tg8.get("cuda"), tg.get("cuda")), "-"))
rows.append(("smollm2 decode, cuda:0x2, q8", f"{tg8.get('cuda:0x2', 0):.0f} t/s", f"cuda q8 {tg8.get('cuda', 0):.0f} t/s", ratio(tg8.get("cuda:0x2"), tg8.get("cuda")), "-"))
for prec in ("exact", "q8"):
    tgg = {r["devices"]: r["tg_tokens_per_s"] for r in graphs.get("rows", []) if r.get("precision", "exact") == prec}
    base = tg if prec == "exact" else tg8
    for d in ("cuda", "cuda:0x2"):
        rows.append((f"smollm2 decode, {d}, {prec}, CUDA graphs", f"{tgg.get(d, 0):.0f} t/s", f"without {base.get(d, 0):.0f} t/s", ratio(tgg.get(d), base.get(d)), "-"))
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
}

case "$mode" in
build) build ;;
run) run "${2:-}" ;;
*)
    echo "usage: scripts/gpu_check.sh build [DIR] | run kernels|models" >&2
    exit 2
    ;;
esac
