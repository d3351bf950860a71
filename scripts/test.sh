#!/usr/bin/env bash
# The README's test command (and what .ci/run calls): set up the Python (scripts/env.sh: the active venv,
# else ./.venv; installs once), lint (ruff: pycodestyle, pyflakes, import order), then one pytest run over
# the CPU suite and every docstring example (pyproject.toml: testpaths tests, ds_maximus, op_builder with
# --doctest-modules). Arguments go to pytest (paths given there replace the testpaths).
set -eu
cd "$(dirname "$0")/.."
source scripts/env.sh
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
"$MAXIMUS_PY" -m ruff check .
exec "$MAXIMUS_PY" -m pytest -q -x --durations=15 "$@"
