#!/usr/bin/env bash
# Issue #37 after a kernel change, one call of at most $TOTAL_S seconds (default 560) on the H200:
#   1. our ops built (row_ops cuda, expert_cpu), outside any time limit
#   2. the kernels' tests: expert_cpu on this host's 16 cores (under faulthandler: a crash names its frame), the
#      Triton quant GEMMs' GPU tests (every gemv configuration against the plain-PyTorch reference)
#   3. (SWEEP=1) benchmarks/sweep_quant_gemv (the gemv configurations on the Mixtral and Qwen3 expert shapes beside bf16
#      F.linear, 4- and 2-bit, 1 and 8 tokens); benchmarks/bench_expert_kernels (one Mixtral expert: GPU
#      projections and host SwiGLU against torch)
#   4. the 32-layer Mixtral-8x7B at a 16 GiB cap (bench_moe_offload, as scripts/gpu/moe_scale.sh, fewer peers:
#      full, int4, int4 + cpu_compute auto, bf16 + cpu_compute auto, int2, bf16 default; $PEERS), agreement over
#      $AGREE (64) tokens
# Writes $OUT/*.md and logs, packed into $OUT/results.tgz (pack_out) at the end.
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda expert   # the expert cache's host-side slot map uses row_ops (the CUDA build serves CPU tensors)
timeout ${TEST_S:-35} python -X faulthandler -m pytest -q -x -p no:cacheprovider tests/ops/test_expert_cpu.py \
  > "$OUT/test_expert_cpu.log" 2>&1
echo "expert_cpu tests rc=$?"; tail -4 "$OUT/test_expert_cpu.log"
timeout ${TEST_S:-35} python -m pytest -q -x -p no:cacheprovider -m gpu tests/experts/test_quant.py > "$OUT/test_quant.log" 2>&1
echo "quant gpu tests rc=$?"; tail -4 "$OUT/test_quant.log"; grep -E "^(FAILED|ERROR)" "$OUT/test_quant.log" | head
if [ "${SWEEP:-0}" = 1 ] && [ -f benchmarks/sweep_quant_gemv.py ]; then   # the tuned gemv's configurations (branch gemv-tune)
  timeout 60 python -u -m benchmarks.sweep_quant_gemv --bits 4,2 --tokens 1,8 --budget-s 50 > "$OUT/sweep.md" 2>&1
  echo "sweep rc=$?"; grep -v -i warn "$OUT/sweep.md" | tail -25
fi
timeout ${KERNELS_S:-50} python -u -m benchmarks.bench_expert_kernels --bits 4,2 --tokens 1,8 --repeat 10 --host-repeat 3 \
  --out "$OUT/expert_kernels.md" > "$OUT/kernels.log" 2>&1
echo "kernels rc=$?"; cat "$OUT/expert_kernels.md"
LEFT=$(( ${TOTAL_S:-560} - (SECONDS - T0) - 15 ))
echo "left for the scale run: $LEFT s"
timeout "$LEFT" python -u -m benchmarks.bench_moe_offload --family mixtral --layers 32 --cap-gib 16 --slots auto \
  --tokens 32 --agree-tokens ${AGREE:-64} --expert-source gpu --ours-variants default \
  --peers ${PEERS:-full,int4,int4+auto,bf16+auto,int2,ours} --budget-s $(( LEFT - 20 )) \
  --out "$OUT/moe_scale_mixtral.md" > "$OUT/moe_scale_mixtral.log" 2>&1
echo "bench rc=$?"
grep -v -i warning "$OUT/moe_scale_mixtral.log" | grep -E "^\[" | tail -20
cat "$OUT/moe_scale_mixtral.md"
pack_out
