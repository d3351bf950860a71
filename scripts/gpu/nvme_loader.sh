#!/usr/bin/env bash
# nvme_loader benchmark on the GPU machine (the benchmark only; its tests run on their own):
#   1. build our op (~30 s) while DeepSpeed's async_io op (a peer; needs libaio) builds in the background
#   2. benchmarks/bench_nvme_loader.py with 1 GiB in 8 files, 2 passes per row, under a 70 s budget
#      -> $OUT/nvme_loader.md (+ CSV, + full log in $OUT/nvme_loader_bench.log)
# About 30 s build + <= 70 s benchmark on an H200 box.
set -x
. "$(dirname "$0")/common.sh"

df -h . /tmp || true
timeout 90 python -u -c "
from deepspeed.ops.op_builder.async_io import AsyncIOBuilder as B
b = B()
print('async_io compatible:', b.is_compatible(verbose=False), flush=True)
b.is_compatible(verbose=False) and b.load(verbose=False) and print('async_io built')" \
  > "$OUT/nvme_loader_aio_build.log" 2>&1 &
aio_build=$!
timeout 90 python -u -c "from ds_maximus.ops.nvme_loader import nvme_loader_available as a; assert a(); print('op built')" \
  > "$OUT/nvme_loader_build.txt" 2>&1
build_rc=$?
tail -5 "$OUT/nvme_loader_build.txt"
wait "$aio_build"   # normally done before ours; bounded by its timeout
tail -3 "$OUT/nvme_loader_aio_build.log"

BENCH_DIR="${MAXIMUS_BENCH_NVME_DIR:-$PWD/build/bench_nvme}"
timeout 80 python -u -m benchmarks.bench_nvme_loader --total-mib "${MAXIMUS_BENCH_NVME_MIB:-1024}" --files 8 \
    --repeat 2 --budget-s 70 --dir "$BENCH_DIR" --out "$OUT/nvme_loader.md" > "$OUT/nvme_loader_bench.log" 2>&1
bench_rc=$?
tail -20 "$OUT/nvme_loader_bench.log"
rm -rf "$BENCH_DIR"

echo "build rc=$build_rc bench rc=$bench_rc"
[ "$build_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
