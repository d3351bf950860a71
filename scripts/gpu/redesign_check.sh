#!/usr/bin/env bash
# The partition-core redesign on the GPU machine, one call (~8 min on an H200):
#   1. every op built once, before any time limit (build_ops in common.sh; DS_OPS=1: also DeepSpeed's Adams and
#      async_io): ours, and, when $OLD names an older tree (scripts/gpu/before_after.sh compares against it), its own
#   2. the GPU suite: pytest -m gpu $TESTS (default: every test folder; the MoE benchmark smoke test is left out: it is
#      a CPU test)
#   3. the shard modes' one-GPU ratio: bench_distributed_embedding, partitioned x1 against one plain ShardedEmbedding,
#      $ROUNDS interleaved rounds (default 3) of 20 warm-up and 20 timed steps (DIST=0 leaves it out)
# Writes $OUT/gpu_tests.log, $OUT/distributed.md and the build logs.
set -x
. "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv || true
ops="cuda cpu expert"
[ "${NVME:-1}" = 1 ] && ops="$ops nvme"
[ "${DS_OPS:-0}" = 1 ] && ops="$ops ds"   # DeepSpeed's own ops the training benchmarks load
[ -n "${OLD:-}" ] && ops="$ops old"
build_ops $ops
timeout ${TESTS_S:-330} python -m pytest -q -rs -m gpu -p no:cacheprovider ${TESTS:-tests} \
  --deselect tests/experts/training/test_bench_smoke.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -30
if [ "${DIST:-1}" = 1 ]; then
  timeout ${DIST_S:-150} python -u -m benchmarks.bench_distributed_embedding --ranks 1 --vocab 262144 --dim 4096 \
    --tokens 16384 --cache-frac 0.1 --modes replicated,partitioned --warmup 20 --steps 20 --rounds ${ROUNDS:-3} \
    --out "$OUT/distributed.md" > "$OUT/distributed.log" 2>&1
  echo "dist bench rc=$?"; tail -4 "$OUT/distributed.log"
fi
