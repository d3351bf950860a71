#!/usr/bin/env bash
# #37, one call (~9 min): the one-row quantized gemv (batch-1 decode's launches) on the GPU.
#   1. the GPU tests of the quantized kernels in 12 shards within TEST_S seconds (default 120):
#      tests/experts/test_quant.py's grouped, one-row and packed-slot tests;
#   2. benchmarks/sweep_quant_gemv.py at the Mixtral expert shapes (SWEEP_BITS, default 4,2,8) within SWEEP_S
#      (default 150): the token-tile kernel the decode path runs, the one-row kernel at DECODE_CONFIG, every launch
#      swept at 4 bits, bf16 F.linear;
#   3. where step 4 does not run (or SKIP_PROBE=0): scripts/gpu/probe_offload_overhead.py, 8 Mixtral layers, every
#      expert resident, int4 with the token-tile kernel and (where step 1 passed) with the one-row kernel;
#   4. on a GPU of 100 GB or more, unless SKIP_SCALE=1: moe_scale.sh at the 32-layer Mixtral shape, GPU capped
#      at 16 GiB (PEERS, default full,int4; TOTAL_S, default 220; a 93 GB model), slots from the default reserve
#      (3 a layer at int4: a fourth measured slower, docs/bench/moe_offload.md). Step 4 runs the one-row kernel in
#      the decode path (--decode-gemv one-row) where step 1 passed, else the token-tile kernel.
# Run as `timeout 575 bash scripts/gpu/gemv_decode.sh; . scripts/gpu/common.sh; pack_out`.
set -x
. "$(dirname "$0")/common.sh"
# step 4 needs an H200's memory; where it runs, step 3 is left out (the call's time)
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ -z "${SKIP_SCALE:-}" ]; then if [ "${mem:-0}" -lt 100000 ]; then SKIP_SCALE=1; else SKIP_SCALE=0; fi; fi
if [ -z "${SKIP_PROBE:-}" ]; then if [ "$SKIP_SCALE" = 1 ]; then SKIP_PROBE=0; else SKIP_PROBE=1; fi; fi
timeout "${TEST_S:-120}" bash scripts/gpu/pytest_shards.sh 12 "$OUT/quant_tests" tests/experts/test_quant.py -k "grouped or one_row or packed_slot"
tests_rc=$?
echo "quant tests rc=$tests_rc"
# steps 3-4 with the one-row kernel in the decode path only where its tests passed
if [ "$tests_rc" = 0 ]; then GEMV=one-row; else GEMV=tile; fi
grep -h -A25 "^_____" "$OUT"/quant_tests.* | head -80
timeout "${SWEEP_S:-150}" python -u benchmarks/sweep_quant_gemv.py --bits "${SWEEP_BITS:-4,2,8}" --all > "$OUT/sweep_gemv.md" 2>&1
echo "sweep rc=$?"; grep -v "^WARNING" "$OUT/sweep_gemv.md" | grep -v "| GemvConfig(" | tail -60
if [ "${SKIP_PROBE:-0}" != 1 ]; then
  modes=int4; [ "$GEMV" = one-row ] && modes=int4,int4:one-row
  timeout 180 python -u scripts/gpu/probe_offload_overhead.py --layers 8 --modes "$modes" > "$OUT/overhead.md" 2>&1
  echo "overhead probe rc=$?"; grep -v "^USDT\|WARNING" "$OUT/overhead.md" | head -80
fi
if [ "${SKIP_SCALE:-0}" != 1 ]; then
  build_ops cuda expert
  PEERS="${PEERS:-full,int4}" EXTRA="${EXTRA:---agree-tokens 64 --decode-gemv $GEMV}" TOTAL_S="${TOTAL_S:-220}" \
    bash scripts/gpu/moe_scale.sh
fi
