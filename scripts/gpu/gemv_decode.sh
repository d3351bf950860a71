#!/usr/bin/env bash
# #37, one call (~9 min): the routing counts without host waits (ops.count_ids), and the gemv kernels' one-token
# path (decode: elementwise partial sums in the weight tile's layout, several groups a step, a pipelined loop;
# quant_triton.DECODE_CONFIG) on the GPU:
#   1. the GPU tests of test_quant.py (the grouped and single kernels against the fp32 reference, every width and
#      token count), test_quant_offload.py, test_offload_gpu.py and test_count_ids.py (the routing counts without a
#      host wait) in 12 pytest processes, within TEST_S seconds (default 150);
#   2. benchmarks/sweep_quant_gemv.py: every GEMV_CONFIGS launch, the launch before this path and bf16 F.linear at
#      the Mixtral and Qwen3 expert shapes, one token an expert;
#   3. scripts/gpu/probe_offload_overhead.py: 8 Mixtral layers, every expert resident, full against int4 and bf16
#      (the offload path's own cost a layer: the int4 kernels were most of it, and three bincounts a layer made
#      the host wait for the GPU six times beside the layer's one sync);
#   4. moe_scale.sh at the 32-layer Mixtral shape, GPU capped at 16 GiB: full, int4 (agreement over 64 tokens);
#      then, with QWEN=1, the Qwen3-30B-A3B shape: full, int4. SKIP_SCALE=1 leaves step 4 out (an H100).
# Run as `timeout 575 bash scripts/gpu/gemv_decode.sh; . scripts/gpu/common.sh; pack_out`.
set -x
. "$(dirname "$0")/common.sh"
build_ops cuda expert
timeout "${TEST_S:-150}" bash scripts/gpu/pytest_shards.sh 12 "$OUT/quant_gpu" -m gpu tests/experts/test_quant.py \
  tests/experts/test_quant_offload.py tests/experts/test_offload_gpu.py tests/ops/test_count_ids.py
echo "quant gpu tests rc=$?"
grep -h -A30 "^_____" "$OUT"/quant_gpu.* | head -60
timeout "${SWEEP_S:-150}" python -u -m benchmarks.sweep_quant_gemv --bits "${SWEEP_BITS:-4}" --out "$OUT/sweep_quant_gemv.md" \
  > "$OUT/sweep_quant_gemv.log" 2>&1
echo "sweep rc=$?"; grep -E "^\||^device" "$OUT/sweep_quant_gemv.log"; grep -i -B2 -A8 "error\|Traceback" "$OUT/sweep_quant_gemv.log" | head -30
timeout 120 python -u scripts/gpu/probe_offload_overhead.py --layers 8 --modes int4,bf16 > "$OUT/overhead.md" 2>&1
echo "overhead probe rc=$?"; grep -v "^USDT\|WARNING\|warn" "$OUT/overhead.md" | head -60
[ "${SKIP_SCALE:-0}" = 1 ] && exit 0   # an H100 (80 GB) cannot hold the 32-layer model the benchmark builds
PEERS=full,int4 EXTRA="--agree-tokens 64" TOTAL_S="${TOTAL_S:-150}" bash scripts/gpu/moe_scale.sh
if [ "${QWEN:-0}" = 1 ]; then
  FAMILY=qwen3 PEERS=full,int4 EXTRA="--agree-tokens 64" TOTAL_S="${QWEN_S:-120}" bash scripts/gpu/moe_scale.sh
fi
