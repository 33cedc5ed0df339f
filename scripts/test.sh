#!/usr/bin/env bash
# All set-up and the whole test suite on a fresh machine: the Python packages the reference
# checks need (numpy, gguf, tokenizers), NVRTC from PyPI, OpenMPI (as root, with apt-get), the
# model files, then `cargo test --release --features cuda` (the CUDA kernels compile with NVRTC,
# no GPU needed; GPU tests skip) with `mpi` too when OpenMPI is there.
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
export METASHARD_CUDA_LIBS="$nvrtc_dir" METASHARD_REQUIRE_NVRTC=1
echo "== OpenMPI and libclang (ranks as processes: the \`mpi\` feature, tests/mpi.rs)"
features=cuda
if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1 \
    || ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            libopenmpi-dev openmpi-bin libclang-dev >/dev/null) \
            || echo "OpenMPI could not be installed: the MPI tests are left out"
    else
        echo "OpenMPI missing (not root or no apt-get): the MPI tests are left out"
    fi
fi
if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then
    features=cuda,mpi
fi
echo "== model files"
bash scripts/fetch_models.sh
echo "== cargo test --release --features $features"
cargo test --release --features "$features" "$@"
