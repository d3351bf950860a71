#!/usr/bin/env bash
# GPU run of the ShardedEmbedding benchmark.
#   1. build our CUDA op (~70 s cold) while DeepSpeed's fused_adam/cpu_adam JIT ops build in the
#      background (the ZeRO-2 peers need them; ~40-60 s, in parallel, so they cost no extra wall time)
#   2. the GPU tests of the op and the module (~45 s)
#   3. benchmarks/bench_sharded_embedding.py under a 160 s budget (peers that no longer fit are rows that
#      say so) -> $OUT/sharded_embedding.md (+ CSV, + full log in $OUT/sharded_embedding_bench.log)
#   4. benchmarks/profile_sharded_embedding.py: link bandwidth, host/device profile, per-stream timeline
# About 70 s build + 45 s tests + <= 160 s benchmark + ~40 s profile on an H200.
set -x
. "$(dirname "$0")/common.sh"

timeout 150 python -u -c "
import traceback
from deepspeed.ops.op_builder import FusedAdamBuilder, CPUAdamBuilder
for b in (FusedAdamBuilder, CPUAdamBuilder):
    try:
        b().load(); print(b.NAME, 'built', flush=True)
    except Exception:
        traceback.print_exc()" > "$OUT/sharded_embedding_ds_ops_build.log" 2>&1 &
ds_build=$!
timeout 150 python -u -c "from ds_maximus.ops import row_ops as o; assert o.load_op('cuda') is not None, 'CUDA op build failed'; print('op built')" \
  > "$OUT/sharded_embedding_build.txt" 2>&1
build_rc=$?
tail -5 "$OUT/sharded_embedding_build.txt"
timeout 200 python -m pytest -q -m gpu tests/vocab/test_sharded_embedding_gpu.py tests/ops/test_row_ops.py \
  > "$OUT/sharded_embedding_gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -2 "$OUT/sharded_embedding_gpu_tests.log"
timeout 170 python -u -m benchmarks.bench_sharded_embedding --repeat 20 --budget-s 160 --out "$OUT/sharded_embedding.md" \
  > "$OUT/sharded_embedding_bench.log" 2>&1
bench_rc=$?
tail -20 "$OUT/sharded_embedding_bench.log"
kill "$ds_build" 2>/dev/null; wait "$ds_build" 2>/dev/null
tail -3 "$OUT/sharded_embedding_ds_ops_build.log"
timeout 90 python -u -m benchmarks.profile_sharded_embedding --out "$OUT/sharded_embedding_profile.txt" \
  --trace "$OUT/sharded_embedding_trace.json" > "$OUT/sharded_embedding_profile.log" 2>&1
sed -n 1,9p "$OUT/sharded_embedding_profile.txt"
python -m benchmarks.trace_timeline "$OUT/sharded_embedding_trace.json" --bucket-ms 1 > "$OUT/sharded_embedding_timeline.txt" 2>&1
head -6 "$OUT/sharded_embedding_timeline.txt"
gzip -f "$OUT/sharded_embedding_trace.json"
echo "build rc=$build_rc bench rc=$bench_rc"
[ "$build_rc" = 0 ] && [ "$bench_rc" = 0 ]
# CPU mode of the same benchmark (V=32768, d=256): python -m benchmarks.bench_sharded_embedding --cpu
