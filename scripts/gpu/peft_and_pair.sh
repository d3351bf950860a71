#!/usr/bin/env bash
# One call of at most $TOTAL_S seconds (default 570), results in $OUT:
#   1. ops built: row ops (cuda, cpu), $OLD's own op, DeepSpeed's Adams
#   2. the GPU tests of the vocabulary modules and the PEFT integration
#   3. #38: bench_peft_vocab at the Gemma-3-4B shape, ours capped at 16 GiB against plain PEFT uncapped
#   4. #39: bench_moe_training at a fixed CPU share, $OLD then this tree, each in half the time left
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
: "${OLD:?OLD must name the older tree}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu old ds
timeout ${TEST_S:-120} python -m pytest -q -p no:cacheprovider -m gpu tests/vocab tests/integrations/test_peft_gpu_memory.py \
  tests/integrations/test_peft_frozen_original.py > "$OUT/test_gpu.log" 2>&1
echo "gpu tests rc=$?"; tail -n 3 "$OUT/test_gpu.log"; grep -E "^(FAILED|ERROR)" "$OUT/test_gpu.log" | head
timeout ${PEFT_S:-170} python -u -m benchmarks.bench_peft_vocab --peers ours_capped peft_mts --batch 4 --steps 6 --warmup 2 \
  --peer-timeout-s 110 --budget-s $(( ${PEFT_S:-170} - 5 )) --out "$OUT/peft_new.md" > "$OUT/peft_new.log" 2>&1
echo "peft rc=$?"; cat "$OUT/peft_new.md"; grep -h "^\[" "$OUT/peft_new.log"
per=$(( (${TOTAL_S:-570} - (SECONDS - T0) - 15) / 2 ))
echo "each moe_training run: $per s"
ARGS="--layers+3+--warmup+2+--steps+${STEPS:-6}+--peers+ours_split+--cpu-share+${SHARE:-0.55}+--budget-s+$((per - 5))+--slot-s+$((per - 5))"
PER_S=$per ORDER="old new" BENCHES="bench_moe_training:$ARGS" bash "$(dirname "$0")/before_after.sh" > /dev/null 2>&1
grep -i "unavailable\|reference" "$OUT"/ba_*_old.log | head -3   # the older tree must have used its own op
grep -H RESULT "$OUT"/ba_*.log | sed 's/"losses[^]]*],//'
pack_out
