#!/usr/bin/env bash
# ShardedLMHead benchmark on the GPU machine (the benchmark only; its GPU tests run on their own):
#   1. install the peers' wheels (Liger-Kernel, Cut Cross-Entropy) into /tmp/site (failure is fine: rows say so)
#   2. benchmarks/bench_lm_head.py at V=262144, d=4096, N=16384, bf16 under a 100 s budget (providers that
#      no longer fit are rows that say so; ours with the tile math uncompiled is a row of the same table)
#      -> $OUT/lm_head.md (+ CSV, + full log in $OUT/lm_head_bench.log)
# About 100 s on an H200.
set -x
. "$(dirname "$0")/common.sh"
export PYTHONPATH="$PYTHONPATH:/tmp/site"

python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/liger_kernel-*.whl \
    .device/cut_cross_entropy-*.whl 2>&1 | tail -3 || true

timeout 110 python -u -m benchmarks.bench_lm_head --budget-s 100 --out "$OUT/lm_head.md" > "$OUT/lm_head_bench.log" 2>&1
bench_rc=$?
tail -25 "$OUT/lm_head_bench.log"
echo "bench rc=$bench_rc"
[ "$bench_rc" = 0 ]
# CPU smoke run of the same benchmark: python -m benchmarks.bench_lm_head --small --dtype fp32
