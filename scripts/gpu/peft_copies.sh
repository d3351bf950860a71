#!/usr/bin/env bash
# #38, one call (~8 min), results in $OUT (pack_out): our row ops built; the vocabulary, engine and PEFT GPU tests;
# bench_peft_vocab at the Gemma-3-4B shape over applied steps: ours capped at 16 GiB and plain PEFT uncapped, traced
# (timeline_<peer>.txt); then ours once more per variant in $VARIANTS (';'-separated bench options, e.g.
# "--keep-grad-buffer off"; default none: no variant). PROBE=1 adds probe_copy_latency.py (how long a small
# device-to-host read waits behind big copies), PROFILE=1 a cProfile of two applied steps of ours (host_profile.txt).
# Each run's share of $TOTAL_S is kept back from the runs before it.
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
timeout "${TEST_S:-150}" python -m pytest -q -p no:cacheprovider -m gpu tests/vocab/test_lm_head.py \
  tests/vocab/test_sharded_embedding_gpu.py tests/engine/test_fp16.py tests/vocab/test_overflow.py \
  tests/integrations/test_peft_gpu_memory.py > "$OUT/test_gpu.log" 2>&1
echo "gpu tests rc=$?"; tail -n 3 "$OUT/test_gpu.log"; grep -E "^(FAILED|ERROR|E  )" "$OUT/test_gpu.log" | head -20
[ "${PROBE:-0}" = 1 ] && timeout 90 python scripts/gpu/probe_copy_latency.py 2>&1 | tee "$OUT/probe_copy_latency.txt"
ARGS="--batch 4 --steps 10 --warmup 2"   # DeepSpeed skips steps 0-3 at this shape: steps 5-9 are timed
IFS=';' read -r -a VARS <<< "${VARIANTS:-}"
[ "${VARIANTS:-none}" = none ] && VARS=()
left() { echo $(( ${TOTAL_S:-560} - (SECONDS - T0) - ${1:-10} )); }
L=$(left $(( ${#VARS[@]} * 65 + ${PROFILE:-0} * 70 ))); timeout "$L" python -u -m benchmarks.bench_peft_vocab \
  --peers ours_capped peft_mts $ARGS --trace 2 --peer-timeout-s $(( L / 2 - 3 )) --budget-s $(( L - 5 )) \
  --out "$OUT/peft_trace.md" > "$OUT/peft_trace.log" 2>&1
echo "trace rc=$?"; cat "$OUT/peft_trace.md"; grep -h "^\[" "$OUT/peft_trace.log"; rm -f "$OUT"/trace_*.json.gz
for i in "${!VARS[@]}"; do
  L=$(left $(( (${#VARS[@]} - i - 1) * 65 + ${PROFILE:-0} * 70 + 5 )))
  timeout "$L" python -u -m benchmarks.bench_peft_vocab --peers ours_capped $ARGS ${VARS[$i]} \
    --peer-timeout-s $(( L - 5 )) --budget-s $(( L - 3 )) --out "$OUT/peft_var$i.md" > "$OUT/peft_var$i.log" 2>&1
  echo "variant ${VARS[$i]} rc=$?"; grep -h "^| ours\|^\[" "$OUT/peft_var$i.md" "$OUT/peft_var$i.log"
done
if [ "${PROFILE:-0}" = 1 ]; then
  L=$(left 10); timeout "$L" python -u scripts/gpu/peft_host_profile.py --steps 8 --profiled 2 --rows 50 \
    > "$OUT/host_profile.txt" 2>&1
  echo "host profile rc=$?"
fi
pack_out
