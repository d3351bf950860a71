#!/usr/bin/env bash
# #38, one call (~4 min): our row ops built, the ShardedEmbedding GPU tests, then bench_peft_vocab at the Gemma-3-4B
# shape: ours capped at 16 GiB and plain PEFT uncapped with the bench's 8192-row loss chunks, then ours with
# 16384-row chunks (lm_head.chunk_rows' default). Results in $OUT (pack_out).
set -x
. "$(dirname "$0")/common.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
timeout ${TEST_S:-90} python -m pytest -q -p no:cacheprovider -m gpu tests/vocab/test_sharded_embedding_gpu.py \
  > "$OUT/test_gpu.log" 2>&1
echo "gpu tests rc=$?"; tail -n 3 "$OUT/test_gpu.log"; grep -E "^(FAILED|ERROR|E  )" "$OUT/test_gpu.log" | head -20
ARGS="--batch 4 --steps 6 --warmup 2 --peer-timeout-s 110"
timeout 150 python -u -m benchmarks.bench_peft_vocab --peers ours_capped peft_mts $ARGS --budget-s 140 \
  --out "$OUT/peft_8192.md" > "$OUT/peft_8192.log" 2>&1
echo "8192 rc=$?"; cat "$OUT/peft_8192.md"; grep -h "^\[" "$OUT/peft_8192.log"
timeout 100 python -u -m benchmarks.bench_peft_vocab --peers ours_capped $ARGS --chunk-rows 16384 --budget-s 95 \
  --out "$OUT/peft_16384.md" > "$OUT/peft_16384.log" 2>&1
echo "16384 rc=$?"; cat "$OUT/peft_16384.md"; grep -h "^\[\|Error" "$OUT/peft_16384.log" | head
pack_out
