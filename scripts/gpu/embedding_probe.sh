#!/usr/bin/env bash
# ShardedEmbedding on the GPU machine, quick loop: build our CUDA op, its GPU tests, the benchmark without
# the DeepSpeed peers (ours at steady state, dense, SparseAdam), and a profile with a per-stream timeline.
# About 3 min on an H200 (70 s of it the cold op build). The full benchmark is scripts/gpu/sharded_embedding.sh.
# Everything it writes comes back as $OUT/probe_outputs.tgz.
set -x
. "$(dirname "$0")/common.sh"
python -u -c "from ds_maximus.ops import row_ops as o; assert o.load_op('cuda') is not None; print('op built')" \
  > "$OUT/op_build.log" 2>&1
echo "build rc=$?"; tail -2 "$OUT/op_build.log"
if [ "${PROBE_TESTS:-1}" = 1 ]; then  # PROBE_TESTS=0: the benchmark and profile only
  # the op, cache and module tests: on this machine the module tests' device is the GPU
  timeout 200 python -m pytest -q tests/vocab/test_sharded_embedding_gpu.py tests/ops/test_row_ops.py \
    tests/partition tests/vocab/test_sharded_embedding_module.py tests/vocab/test_batch_plan.py \
    > "$OUT/emb_gpu_tests.log" 2>&1
  echo "emb gpu tests rc=$?"; tail -3 "$OUT/emb_gpu_tests.log"
fi
timeout 60 python -u -m benchmarks.bench_host_plan --repeat 200 > "$OUT/host_plan.log" 2>&1  # the H200 host's figures
echo "host plan rc=$?"; grep -E "^\| (batch_plan|slot_assign|BatchPlanner|SlotMap)" "$OUT/host_plan.log"
timeout 110 python -u -m benchmarks.bench_sharded_embedding --no-deepspeed --repeat 20 --budget-s 100 --out "$OUT/sharded_embedding.md" \
  > "$OUT/sharded_embedding_bench.log" 2>&1
echo "emb bench rc=$?"; tail -9 "$OUT/sharded_embedding_bench.log"
timeout 90 python -u -m benchmarks.profile_sharded_embedding --out "$OUT/emb_profile.txt" --trace "$OUT/emb_trace.json" \
  > "$OUT/emb_profile.log" 2>&1
echo "profile rc=$?"; grep -E "host phases|copy kernel blocks|^step:" "$OUT/emb_profile.txt"
python -m benchmarks.trace_timeline "$OUT/emb_trace.json" --bucket-ms 1 > "$OUT/emb_timeline.txt" 2>&1
head -30 "$OUT/emb_timeline.txt"
gzip -f "$OUT/emb_trace.json"
# one archive: the device tool brings back at most a few files from $OUT
tar czf /tmp/probe_outputs.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/probe_outputs.tgz "$OUT"/
