#!/usr/bin/env bash
# #38, one short call (~4 min), results in $OUT: peft_phase_times.py for ours capped at 16 GiB and plain PEFT
# uncapped: per phase of a step, the host's time and when the GPU finished the phase's work (no profiler).
set -x
. "$(dirname "$0")/common.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
for peer in ${PEERS:-ours_capped peft_mts}; do
  timeout "${RUN_S:-75}" python -u scripts/gpu/peft_phase_times.py --peer "$peer" --steps 10 --watched 4 \
    > "$OUT/phases_$peer.log" 2>&1
  echo "$peer rc=$?"; grep -A12 "mean over them" "$OUT/phases_$peer.log"; grep -h "Error" "$OUT/phases_$peer.log" | tail -3
done
