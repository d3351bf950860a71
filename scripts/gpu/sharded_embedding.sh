#!/usr/bin/env bash
# GPU run of ShardedEmbedding: the gpu-marked tests (embedding, op, cache), then the benchmark.
# Writes $OUT/sharded_embedding.md (benchmark table) and $OUT/sharded_embedding_tests.txt.
set -x
cd "$(dirname "$0")/../.."
OUT="${OUT:-bench_out}"
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}"
export DS_ACCELERATOR=cuda
export MAXIMUS_BENCH_OUT="$OUT"
# build the CUDA op once, up front, so a build failure is visible on its own
python -c "from ds_maximus.ops import sharded_embedding as o; assert o.load_op('cuda') is not None, 'CUDA op build failed'" \
  2>&1 | tail -40 | tee "$OUT/sharded_embedding_build.txt"
timeout 150 python -m pytest -q -m gpu -x tests/embedding/test_sharded_embedding_gpu.py \
  tests/ops/test_sharded_embedding.py tests/cache 2>&1 | tail -40 | tee "$OUT/sharded_embedding_tests.txt"
timeout 200 python -m benchmarks.bench_sharded_embedding --out "$OUT/sharded_embedding.md" 2>&1 | tail -30
# the CPU mode of the same benchmark (V=32768, d=256) runs on CPU machines: python -m benchmarks.bench_sharded_embedding --cpu
