#!/usr/bin/env bash
# #38, one call (~7 min), results in $OUT/results.tgz: is ours' gap to plain PEFT the 16 GiB cap (the allocator
# working close to it) or our own work? bench_peft_vocab's ours_capped at the Gemma-3-4B shape with the cap at
# 16 GiB, then with no effective cap (--cap-gib 120), then 16 again (an A/B/A), then two traced steps of ours at
# 16 GiB (slim_ours_capped.json.gz, read here with benchmarks.trace_timeline).
set -x
. "$(dirname "$0")/common.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
VARIANTS="${VARIANTS:---cap-gib 16;--cap-gib 120;--cap-gib 16}" TEST_S=1 RUN_S="${RUN_S:-75}" \
  bash "$(dirname "$0")/peft_ab.sh" 2>&1 | grep -v "^+\|OVERFLOW"
timeout "${TRACE_S:-170}" python -u -m benchmarks.bench_peft_vocab --peers ours_capped --batch 4 --steps 8 --warmup 2 \
  --trace 2 --peer-timeout-s $(( ${TRACE_S:-170} - 5 )) --out "$OUT/peft_trace.md" > "$OUT/peft_trace.log" 2>&1
echo "trace rc=$?"; grep -h "^\[" "$OUT/peft_trace.log"
slim_traces
pack_out
