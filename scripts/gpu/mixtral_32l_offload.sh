#!/usr/bin/env bash
# The 32-layer Mixtral-8x7B shape (90 GB of bf16 experts) offloaded to the pinned CPU tier on the H200 host
# (125 GiB RAM): setup time, tokens/s of 32 tokens after a 16-token prompt, GPU peak, host peak RSS
#   -> $OUT/mixtral_32l_offload.json (+ the log). Expected a few minutes; the host's free memory is printed first.
set -x
. "$(dirname "$0")/common.sh"
grep -E "MemTotal|MemAvailable" /proc/meminfo
timeout 560 python -u scripts/gpu/mixtral_32l_offload.py --out "$OUT/mixtral_32l_offload.json" \
  > "$OUT/mixtral_32l_offload.log" 2>&1
rc=$?
grep -v -i warning "$OUT/mixtral_32l_offload.log" | tail -20
echo "rc=$rc"
[ "$rc" = 0 ]
# CPU smoke run of the same script: python scripts/gpu/mixtral_32l_offload.py --tiny --check
