#!/usr/bin/env bash
# All set-up and the whole test suite on a fresh machine: the Python packages the reference
# checks need (numpy, gguf, tokenizers), the model files, then `cargo test --release`.
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
echo "== model files"
bash scripts/fetch_models.sh
echo "== cargo test --release"
cargo test --release "$@"
