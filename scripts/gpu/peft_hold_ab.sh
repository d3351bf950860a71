#!/usr/bin/env bash
# #38, one call (~8 min), results in $OUT: our row ops built; the GPU tests of the held tied step (HostGate, the tied
# head bit for bit with the step's copies held and not, the staged tier-step tests); then bench_peft_vocab's
# ours_capped at the Gemma-3-4B shape with the step's copies held (--hold-tier-stores on), not held, held (A/B/A),
# and plain PEFT (peft_mts, uncapped) in the same call; last, if time is left, peft_step_pipeline.py's window
# timeline with the copies held. RUN_S: each bench run's limit; TEST_S: the tests'.
set -x
. "$(dirname "$0")/common.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
timeout "${TEST_S:-120}" python -m pytest -q -p no:cacheprovider -m gpu tests/partition/test_staged_update.py \
  tests/vocab/test_lm_head.py tests/vocab/test_sharded_embedding_gpu.py \
  -k "${TEST_K:-host_gate or held or bit_identically or staged_tier_update or written_while or overlapping}" \
  > "$OUT/test_gpu.log" 2>&1
echo "gpu tests rc=$?"; tail -n 2 "$OUT/test_gpu.log"; grep -E "^(FAILED|ERROR|E  )" "$OUT/test_gpu.log" | head
i=0
for v in on off on; do
  timeout "${RUN_S:-100}" python -u -m benchmarks.bench_peft_vocab --peers ours_capped --batch 4 --steps 10 --warmup 2 \
    --hold-tier-stores $v --peer-timeout-s $(( ${RUN_S:-100} - 3 )) --out "$OUT/hold_$i.md" > "$OUT/hold_$i.log" 2>&1
  echo "hold $v rc=$?"; grep -h "^\[" "$OUT/hold_$i.log" | tail -n 3; grep -h "ours_capped" "$OUT/hold_$i.md" | head -n 2
  i=$((i + 1))
done
timeout "${RUN_S:-100}" python -u -m benchmarks.bench_peft_vocab --peers peft_mts --batch 4 --steps 10 --warmup 2 \
  --peer-timeout-s $(( ${RUN_S:-100} - 3 )) --out "$OUT/plain.md" > "$OUT/plain.log" 2>&1
echo "plain rc=$?"; grep -h "peft_mts" "$OUT/plain.md" | head -n 2
if [ -n "${PIPELINE_S:-}" ]; then
  timeout "$PIPELINE_S" python scripts/gpu/peft_step_pipeline.py --steps 9 --watched 2 2>&1 | grep -v Warn | tail -n 40
fi
