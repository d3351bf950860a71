#!/usr/bin/env bash
# The soak test (tests/soak/test_soak.py, marker slow): three 2,000-step CPU runs on one NVMe-tier folder with
# batches of 10%-300% of the row cache, a checkpoint every 100 steps, a SIGKILL at a random step and a resume;
# the weights must equal the uninterrupted run's, store disk use and RSS must stay flat. Figures: docs/soak.md.
#
#   scripts/soak.sh                      # 2,000 steps a run (~30-60 min on a 2-core machine)
#   SOAK_STEPS=300 scripts/soak.sh       # a shorter one
#   SOAK_KILL_SEED=7 SOAK_DIR=/mnt/nvme/soak SOAK_REPORT=/tmp/soak.json scripts/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh >/dev/null
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}"
export MAXIMUS_SOAK=1
exec "$MAXIMUS_PY" -m pytest -q -s -m slow tests/soak/test_soak.py "$@"
