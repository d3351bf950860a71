#!/usr/bin/env bash
# #38, one call (~8 min), results in $OUT: whether the tied head's kept gradient memory (add_head_grad_, per-window
# read events; ShardedEmbedding.KEEP_GRAD_BUFFER) changes what trains. The tied-head and staged tier-step GPU tests,
# failures in full, on this tree and on $PREV (an older tree: `git archive REV | tar x -C .prev_tree`, carried); then
# bench_peft_vocab's ours_capped with the kept memory on, off, on and plain PEFT (allocator retries per run in the log
# lines).
set -x
. "$(dirname "$0")/common.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
tied_gpu_tests "$OUT/test_branch.log"
if [ -n "${PREV:-}" ]; then
  (cd "$PREV" && PYTHONPATH="$PREV:/tmp/site" TORCH_EXTENSIONS_DIR=/tmp/torch_ext_prev TEST_S=300 \
    tied_gpu_tests "$OUT/test_prev.log")
fi
VARIANTS="--keep-grad-buffer on;--keep-grad-buffer off;--keep-grad-buffer on;--peers peft_mts" TEST_S=1 \
  RUN_S="${RUN_S:-90}" bash "$(dirname "$0")/peft_ab.sh" 2>&1 | grep -v "^+\|OVERFLOW"
