#!/usr/bin/env bash
# #38, one call (~9 min): the GPU tests of the paths added without a GPU (the table view's CUDA reads, carried hooks,
# the carrier in group 0, zero_to_fp32 on a CUDA checkpoint, the tied step deferred to the first block, the tied
# and staged tier-step tests), in shards within TEST_S; then bench_peft_vocab's ours_capped with the tied table's
# step deferred to the first block (on), issued at the step (off), on again, and plain PEFT uncapped; results in $OUT.
# Run as `timeout 580 bash scripts/gpu/peft_defer_ab.sh; . scripts/gpu/common.sh; pack_out`.
set -x
. "$(dirname "$0")/common.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
timeout "${TEST_S:-170}" bash scripts/gpu/pytest_shards.sh 8 "$OUT/tests" tests/vocab/test_sharded_embedding_module.py \
  tests/vocab/test_sharded_embedding_state.py tests/engine/test_dropin.py tests/integrations/test_zero_to_fp32.py \
  tests/conformance/test_fidelity_regressions.py tests/vocab/test_sharded_embedding_gpu.py tests/engine/test_lookahead.py
echo "tests rc=$?"
grep -h -A25 "^_____" "$OUT"/tests.* | head -120
run() {  # NAME PEER OPTIONS...
  local name=$1 peer=$2; shift 2
  timeout "${RUN_S:-80}" python -u -m benchmarks.bench_peft_vocab --peers "$peer" --batch 4 --steps 10 --warmup 2 "$@" \
    --peer-timeout-s $(( ${RUN_S:-80} - 3 )) --out "$OUT/peft_$name.md" > "$OUT/peft_$name.log" 2>&1
  echo "$name rc=$?"; grep -h "^\[\|^|" "$OUT/peft_$name.log" | tail -4
}
run defer_on ours_capped --defer-tier-steps on
run defer_off ours_capped --defer-tier-steps off
run defer_on2 ours_capped --defer-tier-steps on
run plain peft_mts
