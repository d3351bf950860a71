#!/usr/bin/env bash
# One call (~9 min):
#   1. #38: whether a tied head's first run in a process differs from later ones whatever its reuse_rows
#      (tied_reuse_diag.py with "on" first), whether plain GEMMs in autograd's backward thread give other bits the
#      first time (cold_gemm_check.py, a fresh process), then the tied-head and staged tier-step GPU tests
#   2. #37: batched decode (8 sequences) at the 32-layer Mixtral-8x7B shape, GPU capped at 16 GiB: full and int4
#      (moe_scale.sh with PEERS, EXTRA), in what is left of TOTAL_S
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
build_ops cuda expert
timeout 120 python scripts/gpu/tied_reuse_diag.py on 2>&1 | grep -v WARN | tee "$OUT/tied_diag_on_first.log"
timeout 60 python scripts/gpu/cold_gemm_check.py 2>&1 | tee "$OUT/cold_gemm.log"
TEST_S=120 tied_gpu_tests "$OUT/test_gpu.log"
FAMILY=mixtral PEERS="${PEERS:-full,int4}" EXTRA="${EXTRA:---batch 8 --agree-tokens 64}" \
  TOTAL_S=$(( ${TOTAL_S:-540} - (SECONDS - T0) )) bash "$(dirname "$0")/moe_scale.sh" 2>&1 | grep -v "^+"
pack_out
