#!/usr/bin/env bash
# One call (~7 min on a fresh H200 machine):
#   1. ops built (row_ops cuda and cpu, $OLD's own op, DeepSpeed's Adams)
#   2. the Triton quant GEMMs' GPU tests (every gemv configuration and both kernels against the plain-PyTorch
#      reference), in $SHARDS parallel pytest processes (they spend their time compiling, on the host's cores)
#   3. bench_moe_training at a fixed CPU share through before_after.sh with ORDER="new old": this tree first, then
#      $OLD (the tree before the partition-core redesign), the reverse of its default order, so that an order effect
#      shows against the earlier pairs
# Writes $OUT/*.log, *.md, packed into $OUT/results.tgz (pack_out). Keeps to $TOTAL_S seconds (default 560) itself:
# run it under a longer outer limit, or the archive is never made and the shards' logs (one a shard) do not come back.
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
: "${OLD:?OLD must name the older tree}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu old ds
timeout ${QUANT_S:-170} bash "$(dirname "$0")/pytest_shards.sh" ${SHARDS:-6} "$OUT/test_quant.log" -m gpu \
  tests/experts/test_quant.py
echo "quant gpu tests rc=$?"
ARGS="--layers+3+--warmup+2+--steps+4+--peers+ours_split+--cpu-share+${SHARE:-0.55}+--budget-s+100+--slot-s+100"
per=$(( (${TOTAL_S:-560} - (SECONDS - T0) - 20) / 2 ))
echo "each moe_training run: $per s"
PER_S=$per ORDER="new old" BENCHES="bench_moe_training:$ARGS" bash "$(dirname "$0")/before_after.sh"
grep -i "unavailable\|reference" "$OUT"/ba_*_old.log | head -3   # the older tree must have used its own op
grep RESULT "$OUT"/ba_*.log
pack_out
