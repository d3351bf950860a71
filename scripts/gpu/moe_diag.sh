#!/usr/bin/env bash
# Where the MoE decode's time goes at the real expert size (issue #37), one call of ~300 s on the H200:
#   1. our ops built (row_ops cuda, expert_cpu), then the kernels' GPU tests (the Triton quant GEMMs, expert_cpu)
#   2. benchmarks/bench_expert_kernels: one Mixtral-8x7B expert's GPU projections (bf16 F.linear, quant_matmul gemv
#      and loop per width) and host SwiGLU (ours per width, torch's bf16 linear) at 1 and 8 tokens
#   3. benchmarks/profile_moe_offload on 8 Mixtral layers: int4 with 3 slots and cpu_compute auto, then bf16 with 1
#      slot and cpu_compute auto (the 16 GiB budget's slot counts); the op tables by host and device time
# Writes $OUT/expert_kernels.md and $OUT/moe_diag.log (everything else packed into $OUT/results.tgz).
set -x
. "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv || true
build_ops cuda expert
timeout 100 python -m pytest -q -p no:cacheprovider -m gpu tests/experts/test_quant.py 2>&1 | tail -4
timeout 60 python -m pytest -q -p no:cacheprovider tests/ops/test_expert_cpu.py 2>&1 | tail -4
timeout 150 python -u -m benchmarks.bench_expert_kernels --out "$OUT/expert_kernels.md" > "$OUT/kernels.log" 2>&1
cat "$OUT/expert_kernels.md"
for spec in "4 3 auto" "0 1 auto"; do
  set -- $spec
  Q=$([ "$1" = 0 ] && echo "" || echo "--quant $1")
  timeout 150 python -u -m benchmarks.profile_moe_offload --out "$OUT/prof_q$1" --layers 8 --slots "$2" $Q \
    --cpu-compute "$3" --modes top1 --warmup 4 --tokens 8 --table-rows 30 2>&1 | grep -v -i warning \
    > "$OUT/prof_q$1.log"
  grep -E "^===|host blocked" "$OUT/prof_q$1.log"
done
pack_out
