#!/usr/bin/env bash
# The README's test command: install (idempotent, about a minute on a fresh machine), then the CPU suite.
set -eu
cd "$(dirname "$0")/.."
pip install -q torch==2.13.0
pip install -q -e .
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="$PWD/build/torch_extensions"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec python -m pytest -q -x --durations=15 tests "$@"
