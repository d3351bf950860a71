#!/usr/bin/env bash
# #37, one call (~8 min): the host expert's word decode (4- and 2-bit codes a 16-bit word at a time) on the H200
# host's cores, then what it does to cpu_compute at the real Mixtral-8x7B shape.
#   1. the ops built (row_ops cuda, expert_cpu);
#   2. tests/ops/test_expert_cpu.py on this host (the word decode's exact one-hot reads and reference checks) and
#      tests/ops/test_count_ids.py (the routing counts without a host wait, on the GPU);
#   3. scripts/gpu/probe_expert_cpu.py at 16 and 8 threads: one Mixtral expert, bf16 / int4 / int2 at 1, 2 and 8
#      tokens, with the decode each call takes;
#   4. with OVERHEAD=1 (~90 s): scripts/gpu/probe_offload_overhead.py, 8 Mixtral layers with every expert resident
#      (8 slots a layer, no cap): full, int4, bf16, each timed and traced. No stalls and no copies after the
#      warm-up, so the gap to `full` is the offload path's own cost a layer (the layer's sync, the bookkeeping, the
#      packed kernels), which at the 32-layer shape is ~26 ms a token beyond the stalls (docs/bench/moe_offload.md);
#      the traces (overhead_*.json.gz) say whether the GPU idles for the host or the kernels are slow;
#   5. moe_scale.sh at the 32-layer Mixtral shape, GPU capped at 16 GiB: full, int4, int4+auto (PEERS, EXTRA and
#      TOTAL_S as there; agreement over 64 tokens by default). For int4's prefetch recall (0.42 with one guess a
#      layer), a second run with EXTRA="--agree-tokens 64 --prefetch-top-k 2" PEERS=int4,int4+auto compares two.
# Run as `timeout 580 bash scripts/gpu/host_decode.sh; . scripts/gpu/common.sh; pack_out`. A shorter call (~8 min):
# SKIP_TESTS=1 (step 2 left out), THREADS=16 (the probe at 16 threads only), TOTAL_S=200.
set -x
. "$(dirname "$0")/common.sh"
build_ops cuda expert
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 90 python -m pytest -q -p no:cacheprovider tests/ops/test_expert_cpu.py tests/ops/test_count_ids.py \
    > "$OUT/expert_cpu_tests.log" 2>&1
  echo "expert_cpu tests rc=$?"; tail -3 "$OUT/expert_cpu_tests.log"
fi
timeout 120 python -u scripts/gpu/probe_expert_cpu.py --threads "${THREADS:-16,8}" --repeat 9 > "$OUT/probe_expert_cpu.md" 2>&1
echo "probe rc=$?"; grep -E "^\|" "$OUT/probe_expert_cpu.md"
if [ "${OVERHEAD:-0}" = 1 ]; then
  timeout 200 python -u scripts/gpu/probe_offload_overhead.py --layers 8 --modes int4,bf16 > "$OUT/overhead.md" 2>&1
  echo "overhead probe rc=$?"; grep -v "^USDT\|WARNING" "$OUT/overhead.md" | tail -150
fi
PEERS="${PEERS:-full,int4,int4+auto}" EXTRA="${EXTRA:---agree-tokens 64}" TOTAL_S="${TOTAL_S:-300}" \
  bash scripts/gpu/moe_scale.sh
