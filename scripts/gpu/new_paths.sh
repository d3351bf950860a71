#!/usr/bin/env bash
# One call: the GPU runs of the paths added without a GPU (the table view's CUDA row reads and gradients, hooks
# carried to a swapped embedding, the norm carrier in the client optimizer's first group, zero_to_fp32 on a CUDA
# checkpoint, tied saves after lm_head.enabled), in 8 shards within TEST_S seconds (TESTS: other test paths); then,
# with PHASES=1, peft_phases.sh (#38's phase times, ~4 min).
# Run as `timeout 560 bash scripts/gpu/new_paths.sh; . scripts/gpu/common.sh; pack_out`.
set -x
. "$(dirname "$0")/common.sh"
build_ops cuda cpu
timeout "${TEST_S:-210}" bash scripts/gpu/pytest_shards.sh 8 "$OUT/new_paths" ${TESTS:-tests/vocab/test_sharded_embedding_module.py \
  tests/engine/test_dropin.py tests/integrations/test_zero_to_fp32.py tests/conformance/test_fidelity_regressions.py}
echo "new path tests rc=$?"
grep -h -A30 "^_____" "$OUT"/new_paths.* | head -150
if [ "${PHASES:-0}" = 1 ]; then bash scripts/gpu/peft_phases.sh; fi
