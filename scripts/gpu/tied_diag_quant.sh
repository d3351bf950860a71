#!/usr/bin/env bash
# One call (~9 min): #38's tied-head question, then #37's quantized-kernel GPU suite to the end.
#   1. tied_reuse_diag.py: which rows a tied head with reuse_rows on ends with differently from off, after 1..4 steps,
#      with and without a host wait after each step, and whether off/off and on/on repeat bit for bit
#   2. tests/experts/test_quant.py's GPU tests in $SHARDS pytest processes (Triton compiles on the host's cores),
#      within QUANT_S seconds
set -x
. "$(dirname "$0")/common.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
timeout "${DIAG_S:-150}" python scripts/gpu/tied_reuse_diag.py 2>&1 | grep -v "WARN" | tee "$OUT/tied_diag.log"
timeout "${QUANT_S:-330}" bash "$(dirname "$0")/pytest_shards.sh" "${SHARDS:-12}" "$OUT/test_quant.log" -m gpu \
  tests/experts/test_quant.py
echo "quant gpu tests rc=$?"
pack_out
