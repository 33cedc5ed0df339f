#!/usr/bin/env bash
# All set-up and the whole test suite on a fresh machine: the Python packages the reference
# checks need (numpy, gguf, tokenizers), the model files, then `cargo test --release`.
# A missing Python reference fails the tests (METASHARD_SKIP_PYREF=1 turns that into a skip).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
echo "== python packages for the reference checks"
python3 -m pip install --quiet --disable-pip-version-check -r scripts/requirements.txt
echo "== model files"
bash scripts/fetch_models.sh
echo "== cargo test --release"
cargo test --release "$@"
