#!/usr/bin/env bash
# One call (~8 min): the GPU runs of the paths added without a GPU (the table view's CUDA row reads and gradients,
# hooks carried to a swapped embedding, the norm carrier in the client optimizer's first group, zero_to_fp32 on a CUDA
# checkpoint, the conformance families), in shards within TEST_S seconds; then peft_phases.sh (#38's phase times).
# Run as `timeout 560 bash scripts/gpu/new_paths.sh; . scripts/gpu/common.sh; pack_out`.
set -x
. "$(dirname "$0")/common.sh"
build_ops cuda cpu
timeout "${TEST_S:-210}" bash scripts/gpu/pytest_shards.sh 8 "$OUT/new_paths" tests/vocab/test_sharded_embedding_module.py \
  tests/engine/test_dropin.py tests/integrations/test_zero_to_fp32.py tests/conformance/test_fidelity_regressions.py \
  tests/conformance/test_dense_families.py
echo "new path tests rc=$?"
grep -h -A30 "^_____" "$OUT"/new_paths.* | head -150
bash scripts/gpu/peft_phases.sh
