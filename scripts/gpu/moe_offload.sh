#!/usr/bin/env bash
# MoE expert offload on the GPU machine: GPU tests, then the Mixtral-shaped 8-layer benchmark.
# Writes $OUT/moe_offload.md (benchmark table) and $OUT/moe_offload_tests.txt. ~3-4 minutes on an H200.
set -x
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export MAXIMUS_BENCH_OUT="$OUT"
python -m pytest -q -m gpu tests/moe 2>&1 | tee "$OUT/moe_offload_tests.txt"
python -m pytest -q tests/moe/test_offload_generate.py -k "generate_identical and mixtral" 2>&1 | tail -3 | tee -a "$OUT/moe_offload_tests.txt"
timeout 420 python -m benchmarks.bench_moe_offload --tokens 32 --out "$OUT/moe_offload.md" 2>&1 | tee "$OUT/moe_offload_bench.log"
python examples/generate_moe_offload.py --tokens 16 2>&1 | tail -3 | tee -a "$OUT/moe_offload_tests.txt"
