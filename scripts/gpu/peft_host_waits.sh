#!/usr/bin/env bash
# #38, one call (~8 min), results in $OUT (pack_out): which code makes the host wait for the GPU inside a step at the
# Gemma-3-4B shape. peft_sync_waits.py for ours capped at 16 GiB and plain PEFT uncapped (sync_<peer>.txt: each
# synchronizing op of two steps under its Python stack, phase by phase); then bench_peft_vocab with two traced steps of
# each (timeline_<peer>.txt, and slim_<peer>.json.gz to read here with benchmarks.trace_timeline).
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
left() { echo $(( ${TOTAL_S:-560} - (SECONDS - T0) - ${1:-10} )); }
build_ops cuda cpu
for peer in ours_capped peft_mts; do
  timeout "${SYNC_S:-110}" python -u scripts/gpu/peft_sync_waits.py --peer "$peer" --steps 8 --watched 2 \
    > "$OUT/sync_$peer.txt" 2> "$OUT/sync_$peer.log"
  echo "sync waits $peer rc=$?"; head -n 40 "$OUT/sync_$peer.txt"; tail -n 3 "$OUT/sync_$peer.log"
done
L=$(left 25); timeout "$L" python -u -m benchmarks.bench_peft_vocab --peers ours_capped peft_mts --batch 4 --steps 10 \
  --warmup 2 --trace 2 --peer-timeout-s $(( L / 2 - 3 )) --budget-s $(( L - 5 )) --out "$OUT/peft_trace.md" \
  > "$OUT/peft_trace.log" 2>&1
echo "trace rc=$?"; cat "$OUT/peft_trace.md"; grep -h "^\[" "$OUT/peft_trace.log"
slim_traces
pack_out
