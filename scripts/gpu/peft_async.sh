#!/usr/bin/env bash
# Issue #38's overlapped tied step, one call of at most $TOTAL_S seconds (default 560), results in $OUT:
#   1. our row ops built (outside any time limit)
#   2. the ShardedEmbedding GPU tests (the overlapped step against dense AdamW among them)
#   3. bench_peft_vocab at the Gemma-3-4B shape (34 layers, 4 x 2048 tokens): ours capped at 16 GiB and plain PEFT
#      uncapped from this tree, then ours capped from $BEFORE (a tree before the overlapped step, given this tree's
#      benchmark file so both time their steps alike) when $BEFORE is set
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
if [ -n "${BEFORE:-}" ]; then  # its ops into a folder of its own (its sources' paths differ), built beside ours
  (cd "$BEFORE" && PYTHONPATH="$BEFORE:/tmp/site" TORCH_EXTENSIONS_DIR=/tmp/torch_ext_before timeout 300 python -c \
    "from ds_maximus.ops import row_ops as o; print('before ops', o.load_op('cuda') is not None)") > "$OUT/build_before.log" 2>&1 &
fi
build_ops cuda cpu
wait; tail -n1 "$OUT/build_before.log" 2>/dev/null
timeout ${TEST_S:-150} python -m pytest -q -p no:cacheprovider -m gpu tests/vocab/test_sharded_embedding_gpu.py \
  > "$OUT/test_vocab_gpu.log" 2>&1
echo "vocab gpu tests rc=$?"; tail -15 "$OUT/test_vocab_gpu.log"
ARGS="--batch 4 --steps ${STEPS:-6} --warmup 2 --peer-timeout-s ${PEER_S:-150}"
LEFT=$(( ${TOTAL_S:-560} - (SECONDS - T0) - 15 ))
[ -n "${BEFORE:-}" ] && LEFT=$(( LEFT * 2 / 3 ))
timeout "$LEFT" python -u -m benchmarks.bench_peft_vocab --peers ours_capped peft_mts $ARGS --budget-s $(( LEFT - 10 )) \
  ${EXTRA:-} --out "$OUT/peft_new.md" > "$OUT/peft_new.log" 2>&1
echo "new rc=$?"; cat "$OUT/peft_new.md"; grep -i "error\|Traceback" "$OUT/peft_new.log" | head
if [ -n "${BEFORE:-}" ]; then
  LEFT=$(( ${TOTAL_S:-560} - (SECONDS - T0) - 15 ))
  (cd "$BEFORE" && MAXIMUS_BENCH_OUT="$OUT/before" PYTHONPATH="$BEFORE:/tmp/site" TORCH_EXTENSIONS_DIR=/tmp/torch_ext_before timeout "$LEFT" python -u -m \
    benchmarks.bench_peft_vocab --peers ours_capped $ARGS --budget-s $(( LEFT - 10 )) --out "$OUT/peft_before.md") \
    > "$OUT/peft_before.log" 2>&1
  echo "before rc=$?"; cat "$OUT/peft_before.md"; grep -i "error\|Traceback" "$OUT/peft_before.log" | head
fi
pack_out
