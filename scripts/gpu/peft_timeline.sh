#!/usr/bin/env bash
# #38, one call (~9 min), results in $OUT (pack_out): our row ops built; the LM head's GPU tests; bench_peft_vocab at
# the Gemma-3-4B shape: ours capped at 16 GiB (lm_head.reuse_rows auto) and plain PEFT uncapped, timed over applied
# steps, each with two more steps under torch.profiler run as the timed ones are (timeline_<peer>.txt: per-stream busy
# time, the compute stream's idle gaps, the host's annotated ranges and waits); a cProfile of two applied steps of ours
# (host_profile.txt). Each run's share of $TOTAL_S is kept back from the runs before it.
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
L=$(left 110); timeout "$L" python -u -m benchmarks.bench_peft_vocab --peers ours_capped peft_mts $ARGS --trace 2 \
  --peer-timeout-s $(( L / 2 - 3 )) --budget-s $(( L - 5 )) --out "$OUT/peft_trace.md" > "$OUT/peft_trace.log" 2>&1
echo "trace rc=$?"; cat "$OUT/peft_trace.md"; grep -h "^\[" "$OUT/peft_trace.log"; rm -f "$OUT"/trace_*.json.gz
head -45 "$OUT"/timeline_*.txt
L=$(left 15); timeout "$L" python -u scripts/gpu/peft_host_profile.py --steps 8 --profiled 2 --rows 60 \
  > "$OUT/host_profile.txt" 2>&1
echo "host profile rc=$?"; grep -c OVERFLOW "$OUT/host_profile.txt"
pack_out
