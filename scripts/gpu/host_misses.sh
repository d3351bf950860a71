#!/usr/bin/env bash
# #37, one call (~6-9 min on an H200): why a missed expert computed on the host is slower inside a decode than alone.
#   1. the ops built (row_ops cuda, expert_cpu);
#   2. scripts/gpu/probe_host_misses.py: 8 Mixtral layers, cpu_compute: misses, 1 slot a layer, bf16 and int4, at
#      OpenMP teams of THREADS (default 16,15,12,8): the op alone, then in the decode with the guesses on and off;
#   3. unless SKIP_SCALE=1, moe_scale.sh at the 32-layer Mixtral shape, GPU capped at 16 GiB, with PEERS (default
#      bf16+cpu,bf16+auto) and OMP_NUM_THREADS=$SCALE_THREADS when set, TOTAL_S (default 280).
# Run as `timeout 575 bash scripts/gpu/host_misses.sh; . scripts/gpu/common.sh; pack_out`.
set -x
. "$(dirname "$0")/common.sh"
build_ops cuda expert
timeout "${PROBE_S:-200}" python -u scripts/gpu/probe_host_misses.py --layers 8 --modes "${MODES:-bf16,int4}" \
  --threads "${THREADS:-16,15,12,8}" > "$OUT/probe_host_misses.md" 2>&1
echo "probe rc=$?"; grep -E "^(\||##)" "$OUT/probe_host_misses.md"; grep -v "^|" "$OUT/probe_host_misses.md" | tail -15
if [ "${SKIP_SCALE:-0}" != 1 ]; then
  ${SCALE_THREADS:+env OMP_NUM_THREADS=$SCALE_THREADS} env PEERS="${PEERS:-bf16+cpu,bf16+auto}" \
    EXTRA="${EXTRA:---agree-tokens 16}" TOTAL_S="${TOTAL_S:-280}" bash scripts/gpu/moe_scale.sh
fi
