#!/usr/bin/env bash
# The main job on a fresh machine: fetch the models (once), build, and generate text with
# SmolLM2 split across two CPU devices. Extra arguments go to `metashard run`, e.g.
#   scripts/run.sh --devices cpu:3x1 --prompt "Tell me about the moon" -n 64
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash scripts/fetch_models.sh
cargo build --release --quiet
exec ./target/release/metashard run --model smollm2 --devices cpu:2x1 "$@"
