#!/usr/bin/env bash
# #38, branch tied-grad-kept, one call (~8 min), results in $OUT: whether the tied head's kept gradient memory
# (add_head_grad_, per-window read events) changes what trains. The tied-head GPU tests of test_lm_head.py and the
# staged tier-step tests, failures printed in full (-rA), on this tree and on $PREV (main before the branch: `git
# archive main | tar x -C .prev_tree`, carried); then bench_peft_vocab's ours_capped with the kept memory on, off, on
# and plain PEFT (allocator retries per run in the log lines).
set -x
. "$(dirname "$0")/common.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
TESTS="tests/vocab/test_lm_head.py tests/vocab/test_sharded_embedding_gpu.py"
K="tied or staged_tier_update or written_while or overlapping"
timeout "${TEST_S:-150}" python -m pytest -q -rA -p no:cacheprovider -m gpu $TESTS -k "$K" > "$OUT/test_branch.log" 2>&1
echo "branch tests rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/test_branch.log" | tail -30
grep -B5 -A40 "^_____" "$OUT/test_branch.log" | head -120
if [ -n "${PREV:-}" ]; then
  (cd "$PREV" && PYTHONPATH="$PREV:/tmp/site" TORCH_EXTENSIONS_DIR=/tmp/torch_ext_prev timeout 300 python -m pytest -q -rA -p no:cacheprovider \
    -m gpu $TESTS -k "$K" > "$OUT/test_prev.log" 2>&1)
  echo "prev tests rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/test_prev.log" | tail -30
fi
VARIANTS="--keep-grad-buffer on;--keep-grad-buffer off;--keep-grad-buffer on;--peers peft_mts" TEST_S=1 \
  RUN_S="${RUN_S:-90}" bash "$(dirname "$0")/peft_ab.sh" 2>&1 | grep -v "^+\|OVERFLOW"
