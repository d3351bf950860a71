#!/usr/bin/env bash
# MoE expert offload benchmark on the GPU machine (the benchmark only; its GPU tests run on their own):
# the Mixtral-shaped 8-layer bf16 model (H=4096, F=14336, 8 experts, top-2; built on the GPU without HF's
# weight init), batch-1 decode of 32 tokens, under a 165 s budget
#   -> $OUT/moe_offload.md (+ CSV, + full log in $OUT/moe_offload_bench.log). At most ~165 s on an H200.
set -x
. "$(dirname "$0")/common.sh"
timeout 200 python -u -m benchmarks.bench_moe_offload --tokens 64 --budget-s 190 --out "$OUT/moe_offload.md" \
  > "$OUT/moe_offload_bench.log" 2>&1
bench_rc=$?
grep -v -i warning "$OUT/moe_offload_bench.log" | tail -20
echo "bench rc=$bench_rc"
[ "$bench_rc" = 0 ]
# CPU smoke run of the same benchmark: python -m benchmarks.bench_moe_offload --small
