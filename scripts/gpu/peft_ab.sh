#!/usr/bin/env bash
# #38, a short call (~4 min), results in $OUT: our row ops built; the staged tier-step GPU tests (those of
# test_sharded_embedding_gpu.py matching $TEST_K); bench_peft_vocab's
# ours_capped at the Gemma-3-4B shape over applied steps, once per variant in $VARIANTS (';'-separated bench options;
# default: the tied head's kept gradient memory on, off, on: an A/B/A in one call). Give RUN_S room for the first,
# cold run.
set -x
. "$(dirname "$0")/common.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
timeout "${TEST_S:-40}" python -m pytest -q -p no:cacheprovider -m gpu tests/vocab/test_sharded_embedding_gpu.py \
  -k "${TEST_K:-staged_tier_update or written_while}" > "$OUT/test_gpu.log" 2>&1
echo "gpu tests rc=$?"; tail -n 2 "$OUT/test_gpu.log"; grep -E "^(FAILED|ERROR|E  )" "$OUT/test_gpu.log" | head
IFS=';' read -r -a VARS <<< "${VARIANTS:---keep-grad-buffer on;--keep-grad-buffer off;--keep-grad-buffer on}"
for i in "${!VARS[@]}"; do
  timeout "${RUN_S:-90}" python -u -m benchmarks.bench_peft_vocab --peers ours_capped --batch 4 --steps 10 --warmup 2 \
    ${VARS[$i]} --peer-timeout-s $(( ${RUN_S:-90} - 3 )) --out "$OUT/peft_var$i.md" > "$OUT/peft_var$i.log" 2>&1
  echo "variant ${VARS[$i]} rc=$?"; grep -h "^\[" "$OUT/peft_var$i.log"
done
