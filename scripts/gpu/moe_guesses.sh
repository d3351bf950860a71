#!/usr/bin/env bash
# #37, one call (~8 min on an H200): guesses staged a layer (moe.prefetch_top_k) at the 32-layer Mixtral shape,
# GPU capped at 16 GiB, int4, batch-1 decode. With the one-row gemv the int4 path waits on the link (stalls of
# ~59 ms a token, docs/bench/moe_offload.md): one staged guess a layer brings at most one of the two routed experts
# early (prefetch recall 0.41 at precision 0.98).
#   1. the GPU tests of offload (tests/experts/test_offload_gpu.py) within TEST_S (default 60), our ops built first;
#   2. moe_scale.sh with PEERS (default int4) at each --prefetch-top-k of TOPK (default 1,2,3,1), one process
#      (one model build, one reference), TOTAL_S (default 420), agreement over AGREE tokens (default 16).
# Run as `timeout 575 bash scripts/gpu/moe_guesses.sh; . scripts/gpu/common.sh; pack_out`.
set -x
. "$(dirname "$0")/common.sh"
build_ops cuda expert
timeout "${TEST_S:-60}" python -m pytest -q -p no:cacheprovider -m gpu tests/experts/test_offload_gpu.py \
  > "$OUT/offload_gpu_tests.log" 2>&1
echo "offload gpu tests rc=$?"; tail -3 "$OUT/offload_gpu_tests.log"
grep -A30 "^_____" "$OUT/offload_gpu_tests.log" | head -60
PEERS="${PEERS:-int4}" EXTRA="--agree-tokens ${AGREE:-16} --prefetch-top-k ${TOPK:-1,2,3,1} ${EXTRA:-}" \
  TOTAL_S="${TOTAL_S:-420}" bash scripts/gpu/moe_scale.sh > "$OUT/moe_scale_guesses.out" 2>&1
grep "^| ours" "$OUT/moe_scale_mixtral.md"
