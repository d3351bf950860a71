#!/usr/bin/env bash
# Serving benchmark on the GPU machine (the benchmark only; the export/serving tests run on their own):
# benchmarks/bench_serving.py, one process, one 70 s budget: a 262144-vocabulary Llama (d=2048, 4 layers,
# bf16; built without HF's weight init) generating 64 tokens for 8 prompts of 128, plain vs embedding off
# the GPU vs embedding + head off the GPU, then the same peers at batch 32 (32 new tokens, 2 calls)
#   -> $OUT/serving.md (both tables; + CSVs, + full log in $OUT/serving_bench.log). At most ~70 s on an H200.
set -x
. "$(dirname "$0")/common.sh"

timeout 80 python -u -m benchmarks.bench_serving --budget-s 70 --also-batch 32 --also-new 32 --also-repeat 2 \
    --out "$OUT/serving.md" > "$OUT/serving_bench.log" 2>&1
bench_rc=$?
grep -v -i warning "$OUT/serving_bench.log" | tail -24
echo "bench rc=$bench_rc"
[ "$bench_rc" = 0 ]
# CPU smoke run: python -m benchmarks.bench_serving --vocab 4096 --hidden 256 --layers 2 --new 8
