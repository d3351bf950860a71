#!/usr/bin/env bash
# #38, one call (~8 min), results in $OUT: the tied head's reads of the step's table brought up to date once a step
# (rows_for_compute) against the per-chunk bookkeeping before (patched in by peft_step_table_ab.py old): the tied
# and staged GPU tests, then ours_capped new, old, new, old at the Gemma-3-4B shape, then plain PEFT.
set -x
. "$(dirname "$0")/common.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
tied_gpu_tests "$OUT/test_gpu.log"
for mode in ${MODES:-new old new old}; do
  timeout "${RUN_S:-75}" python -u scripts/gpu/peft_step_table_ab.py "$mode" --steps 10 --warmup 2 \
    > "$OUT/ab_$mode.log" 2>&1
  echo "rc=$?"; grep -h "step table\|Error\|error" "$OUT/ab_$mode.log" | tail -3
done
timeout "${RUN_S:-75}" python -u -m benchmarks.bench_peft_vocab --peers peft_mts --batch 4 --steps 10 --warmup 2 \
  --peer-timeout-s $(( ${RUN_S:-75} - 3 )) --out "$OUT/peft_ref.md" > "$OUT/peft_ref.log" 2>&1
echo "ref rc=$?"; grep -h "^\[" "$OUT/peft_ref.log"
pack_out
