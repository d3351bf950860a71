#!/usr/bin/env bash
# #38, one call (~4 min), results in $OUT: our row ops built; peft_alloc_retries.py for ours capped at 16 GiB
# (alloc_retries.txt: which allocation makes the capped allocator free its cache and wait for every stream, each step).
set -x
. "$(dirname "$0")/common.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
timeout "${RUN_S:-200}" python -u scripts/gpu/peft_alloc_retries.py --peer ours_capped --steps 8 --watched 2 $EXTRA \
  > "$OUT/alloc_retries.txt" 2> "$OUT/alloc_retries.log"
echo "alloc retries rc=$?"; head -c 12000 "$OUT/alloc_retries.txt"; tail -n 3 "$OUT/alloc_retries.log"
