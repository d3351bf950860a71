#!/usr/bin/env bash
# Issue 9 (shard modes) on the GPU machine: the PartitionedEmbedding tests (gloo CPU ranks) and the
# scaling benchmark (NCCL when the host has >= N GPUs, else gloo). Writes $OUT/distributed.md.
set -x
set -o pipefail
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
RANKS=1,2
if [ "$NGPU" -ge 4 ]; then RANKS=1,2,4; fi
if [ "$NGPU" -ge 8 ]; then RANKS=1,2,4,8; fi
CUDA_VISIBLE_DEVICES= timeout 300 python -m pytest -q tests/distributed/test_partitioned_embedding.py \
  2>&1 | tail -5 | tee "$OUT/distributed_tests.txt"
timeout 180 python -m benchmarks.bench_distributed_embedding --ranks "$RANKS" --vocab 262144 --dim 1024 \
  --tokens 8192 --cache-rows 65536 --steps 10 --out "$OUT/distributed.md"
