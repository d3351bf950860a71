#!/usr/bin/env bash
# #37, one call (~8 min): packed experts a round at a time (compute.packed_forward: each projection of a round's
# experts in one launch of quant_matmul_grouped) against the per-expert loop before it.
#   1. our ops built (row_ops cuda, expert_cpu)
#   2. the GPU tests of the grouped kernel and of packed offload (test_quant.py, test_quant_offload.py)
#   3. bench_moe_offload on the Qwen3-30B-A3B shape (48 layers, 128 experts of ffn 768, top-8; the shape where ~10
#      small experts a layer make launches, not bytes, the cost), GPU capped at 16 GiB, int4 (and the uncapped
#      model, the run's reference), batch 1, ~2 min a tree:
#      $PREV (the tree before, e.g. `git archive 4c0b9ce | tar x -C .prev_tree`, carried) then this tree, through
#      before_after.sh (ORDER="new old" runs this tree first)
# The bf16 cache variants at this shape (whether small experts want more guesses than the default's one staged
# expert) need no branch: FAMILY=qwen3 PEERS=full,ours EXTRA="--ours-variants all --agree-tokens 64" moe_scale.sh.
# Writes $OUT/test_gpu.log, ba_*_{old,new}.{md,log}, packed into $OUT/results.tgz (pack_out).
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
: "${PREV:?PREV must name the tree before (carried)}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda expert
timeout "${TEST_S:-120}" python -m pytest -q -p no:cacheprovider -m gpu -x tests/experts/test_quant.py \
  tests/experts/test_quant_offload.py -k "grouped or packed or quant_cuda or int8_bf16" > "$OUT/test_gpu.log" 2>&1
echo "gpu tests rc=$?"; tail -n 2 "$OUT/test_gpu.log"; grep -E "^(FAILED|ERROR|E  )" "$OUT/test_gpu.log" | head
per=$(( (${TOTAL_S:-560} - (SECONDS - T0) - 15) / 2 ))
ARGS="--family+qwen3+--cap-gib+16+--slots+auto+--tokens+32+--agree-tokens+64+--expert-source+gpu+--peers+full,int4"
OLD="$PREV" PER_S=$per BENCHES="bench_moe_offload:$ARGS+--budget-s+$(( per - 10 ))" \
  bash "$(dirname "$0")/before_after.sh" 2>&1 | grep -v "^+"
grep -h "tokens/s" "$OUT"/ba_*.log | grep -v "^\s*$" | tail -12
pack_out
