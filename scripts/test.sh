#!/usr/bin/env bash
# All set-up and the whole test suite on a fresh machine: the Python packages the reference
# checks need (numpy, gguf, tokenizers), NVRTC from PyPI, the model files, then
# `cargo test --release` and the CUDA kernels' NVRTC compile test (no GPU needed).
# A missing Python reference fails the tests (METASHARD_SKIP_PYREF=1 turns that into a skip).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
echo "== python packages for the reference checks"
python3 -m pip install --quiet --disable-pip-version-check -r scripts/requirements.txt
echo "== graphviz (metashard plan --svg)"
if ! command -v dot >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) \
            || echo "graphviz could not be installed: plan --svg writes DOT instead"
    else
        echo "graphviz missing (not root or no apt-get): plan --svg writes DOT instead"
    fi
fi
echo "== NVRTC from PyPI (the CUDA kernels compile without a GPU)"
python3 -m pip install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc-cu12==12.9.86"
nvrtc_dir="$(python3 -c "import nvidia.cuda_nvrtc as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))")"
echo "== model files"
bash scripts/fetch_models.sh
echo "== cargo test --release"
cargo test --release "$@"
echo "== CUDA backend without a GPU: cargo test --release --features cuda --test cuda_kernels"
METASHARD_CUDA_LIBS="$nvrtc_dir" METASHARD_REQUIRE_NVRTC=1 \
    cargo test --release --features cuda --test cuda_kernels
