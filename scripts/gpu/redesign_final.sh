#!/usr/bin/env bash
# The partition-core redesign's last checks in one call (~9 min on a fresh H200 machine):
#   1. both trees' ops built once into one extension folder (the older tree, $OLD, is ae975c3: its op names differ)
#   2. the GPU tests added since the whole suite last ran (the staged tier update, rounds fidelity, CPU compute's
#      host/link split, the split-step pipeline)
#   3. bench_moe_training old/new, twice, at a fixed CPU share (both trees step the same experts on each side; the
#      measured share moves with each run's timings and made one pair of 2 steps inconclusive)
#   4. bench_serving: one warm-up run first (the first process on the GPU pays one-time costs), then old/new
# Writes $OUT/*.log and $OUT/ba_*.md, packed into $OUT/results.tgz at the end (pack_out). Its steps take ~9 min on a
# fresh machine: run it as `timeout 560 bash scripts/gpu/redesign_final.sh; . scripts/gpu/common.sh; pack_out`, so
# that a cut run still returns what it wrote.
set -x
. "$(dirname "$0")/common.sh"
: "${OLD:?OLD must name the older tree}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu expert old ds
if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0: the pairs only (the tests passed on 2026-12-02, 39 + the 4 fixed)
  timeout ${TESTS_S:-150} python -m pytest -q -rs -p no:cacheprovider -m gpu tests/vocab/test_sharded_embedding_gpu.py \
    tests/experts/test_rounds_fidelity.py tests/experts/test_cpu_compute.py tests/experts/training/test_gpu.py \
    tests/experts/training/test_store.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
fi
MOE="bench_moe_training:--layers+3+--warmup+2+--steps+4+--peers+ours_split+--cpu-share+${SHARE:-0.55}+--budget-s+75+--slot-s+75"
PER_S=${MOE_S:-80} BENCHES="$MOE $MOE" bash "$(dirname "$0")/before_after.sh"
SERVE="--budget-s 70 --also-batch 32 --also-new 32 --also-repeat 2"
timeout 80 python -u -m benchmarks.bench_serving $SERVE --out "$OUT/serving_warmup.md" > "$OUT/serving_warmup.log" 2>&1
echo "serving warm-up rc=$?"
PER_S=80 BENCHES="bench_serving:${SERVE// /+}" bash "$(dirname "$0")/before_after.sh"
grep -i "unavailable\|reference" "$OUT"/ba_*_old.log | head -3   # the older tree must have used its own op
pack_out
