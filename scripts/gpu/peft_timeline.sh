#!/usr/bin/env bash
# #38, one call (~9 min), results in $OUT (pack_out): our row ops built; the LM head's GPU tests; bench_peft_vocab at
# the Gemma-3-4B shape: ours capped at 16 GiB (lm_head.reuse_rows auto) and plain PEFT uncapped, each with two more
# steps under torch.profiler run as the timed ones are (timeline_<peer>.txt: per-stream busy time and the compute
# stream's idle gaps); ours with reuse_rows off; the capped PEFT peers (modules_to_save, + Liger's fused linear
# cross-entropy, trainable_token_indices). Each run's share of $TOTAL_S is kept back from the runs before it.
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
timeout "${TEST_S:-100}" python -m pytest -q -p no:cacheprovider -m gpu tests/vocab/test_lm_head.py \
  tests/vocab/test_sharded_embedding_gpu.py > "$OUT/test_gpu.log" 2>&1
echo "gpu tests rc=$?"; tail -n 3 "$OUT/test_gpu.log"; grep -E "^(FAILED|ERROR|E  )" "$OUT/test_gpu.log" | head -20
ARGS="--batch 4 --steps 10 --warmup 2"   # DeepSpeed skips steps 0-3 at this shape: steps 5-9 are timed
left() { echo $(( ${TOTAL_S:-560} - (SECONDS - T0) - ${1:-10} )); }
L=$(left 190); timeout "$L" python -u -m benchmarks.bench_peft_vocab --peers ours_capped peft_mts $ARGS --trace 2 \
  --peer-timeout-s $(( L / 2 - 3 )) --budget-s $(( L - 5 )) --out "$OUT/peft_trace.md" > "$OUT/peft_trace.log" 2>&1
echo "trace rc=$?"; cat "$OUT/peft_trace.md"; grep -h "^\[" "$OUT/peft_trace.log"; rm -f "$OUT"/trace_*.json.gz
head -45 "$OUT"/timeline_*.txt
L=$(left 100); timeout "$L" python -u -m benchmarks.bench_peft_vocab --peers ours_capped $ARGS --reuse-rows off \
  --peer-timeout-s $(( L - 5 )) --budget-s $(( L - 3 )) --out "$OUT/peft_noreuse.md" > "$OUT/peft_noreuse.log" 2>&1
echo "noreuse rc=$?"; cat "$OUT/peft_noreuse.md"; grep -h "^\[\|Error" "$OUT/peft_noreuse.log" | head
L=$(left 15); timeout "$L" python -u -m benchmarks.bench_peft_vocab --peers peft_mts_capped peft_mts_liger_capped \
  peft_tti_capped $ARGS --peer-timeout-s 90 --budget-s $(( L - 5 )) --out "$OUT/peft_peers.md" \
  > "$OUT/peft_peers.log" 2>&1
echo "peers rc=$?"; cat "$OUT/peft_peers.md"; grep -h "^\[" "$OUT/peft_peers.log"
pack_out
