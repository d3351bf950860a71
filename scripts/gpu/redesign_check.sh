#!/usr/bin/env bash
# The partition-core redesign on the GPU machine, one call (~8 min on an H200):
#   1. every op built once (DS_OPS=1: also DeepSpeed's CPU Adam, fused Adam and async_io), outside any time limit (a killed JIT build leaves torch's lock behind): ours, and, when
#      $OLD names an older tree (scripts/gpu/before_after.sh compares against it), that tree's, into its own folder
#   2. the GPU suite: pytest -m gpu $TESTS (default: every test folder; the MoE benchmark smoke test is left out: it is
#      a CPU test)
#   3. the shard modes' one-GPU ratio: bench_distributed_embedding, partitioned x1 against one plain ShardedEmbedding,
#      $ROUNDS interleaved rounds (default 3) of 20 warm-up and 20 timed steps (DIST=0 leaves it out)
# Writes $OUT/gpu_tests.log, $OUT/distributed.md and the build logs.
set -x
. "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv || true
# one process per op: each JIT build is single-threaded for most of its ~40-70 s
python -u -c "from ds_maximus.ops import row_ops; print('row_ops cuda', row_ops.load_op('cuda') is not None)" \
  > "$OUT/build.log" 2>&1 &
b1=$!
python -u -c "from ds_maximus.ops import row_ops; print('row_ops cpu', row_ops.load_op('cpu') is not None)" \
  > "$OUT/build_cpu.log" 2>&1 &
b2=$!
python -u -c "from ds_maximus.ops import expert_cpu; print('expert_cpu', expert_cpu.load_op() is not None)" \
  > "$OUT/build_expert.log" 2>&1 &
b3=$!
if [ "${NVME:-1}" = 1 ]; then
  python -u -c "from ds_maximus.ops import nvme_loader; print('nvme_loader', nvme_loader.nvme_loader_available())" \
    > "$OUT/build_nvme.log" 2>&1 &
  b4=$!
fi
if [ "${DS_OPS:-0}" = 1 ]; then  # DeepSpeed's own ops the training benchmarks load (built once, shared with $OLD)
  python -u -c "
from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
from deepspeed.ops.op_builder.async_io import AsyncIOBuilder
CPUAdamBuilder().load(); FusedAdamBuilder().load(); print('ds ops built, async_io', AsyncIOBuilder().is_compatible(verbose=False) and AsyncIOBuilder().load(verbose=False) is not None)" \
    > "$OUT/build_ds_ops.log" 2>&1 &
  b5=$!
fi
if [ -n "${OLD:-}" ]; then
  (cd "$OLD" && PYTHONPATH="$OLD:/tmp/site" TORCH_EXTENSIONS_DIR=/tmp/torch_ext_old python -u -c "
from ds_maximus.ops import sharded_embedding as o; print('old op', o.load_op('cuda') is not None, o.load_op('cpu') is not None)"
  ) > "$OUT/build_old.log" 2>&1 &
  build_old=$!
fi
wait $b1 $b2 $b3 ${b4:-} ${b5:-}; tail -qn2 "$OUT"/build*.log
if [ "${DS_OPS:-0}" = 1 ] && [ -n "${OLD:-}" ]; then  # the older tree loads the same DeepSpeed builds
  mkdir -p /tmp/torch_ext_old
  for d in "$TORCH_EXTENSIONS_DIR"/*; do case "$(basename "$d")" in maximus_*) ;; *) cp -r "$d" /tmp/torch_ext_old/ ;; esac; done
fi
timeout ${TESTS_S:-330} python -m pytest -q -rs -m gpu -p no:cacheprovider ${TESTS:-tests} \
  --deselect tests/experts/training/test_bench_smoke.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -30
[ -n "${OLD:-}" ] && { wait $build_old; tail -3 "$OUT/build_old.log"; }
if [ "${DIST:-1}" = 1 ]; then
  timeout ${DIST_S:-150} python -u -m benchmarks.bench_distributed_embedding --ranks 1 --vocab 262144 --dim 4096 \
    --tokens 16384 --cache-frac 0.1 --modes replicated,partitioned --warmup 20 --steps 20 --rounds ${ROUNDS:-3} \
    --out "$OUT/distributed.md" > "$OUT/distributed.log" 2>&1
  echo "dist bench rc=$?"; tail -4 "$OUT/distributed.log"
fi
