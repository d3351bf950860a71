#!/usr/bin/env bash
# GPU machine run of the nvme_loader op (about 3-4 minutes on an H200 box):
#   1. tests/ops/test_nvme_loader.py (CPU + nvme + gpu tests, on this machine's real disk)
#   2. benchmarks/bench_nvme_loader.py with 2 GiB in 8 files -> $OUT/nvme_loader.md (+ CSV)
# Run from the repo root with $OUT set; exits non-zero when the tests or the benchmark failed.
set -x
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/bench_out}"
mkdir -p "$OUT"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cuda}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}"
export MAXIMUS_BENCH_OUT="$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv || true
df -h . /tmp || true
# build the op once, up front, so its compile time is visible
python -c "from ds_maximus.ops.nvme_loader import nvme_loader_available as a; assert a()" 2>&1 | tail -20

python -m pytest -q -x -p no:cacheprovider --durations=5 tests/ops/test_nvme_loader.py 2>&1 | tee "$OUT/nvme_loader_tests.txt" | tail -40
tests_rc=${PIPESTATUS[0]}

BENCH_DIR="${MAXIMUS_BENCH_NVME_DIR:-$PWD/build/bench_nvme}"
timeout 240 python -m benchmarks.bench_nvme_loader --total-mib "${MAXIMUS_BENCH_NVME_MIB:-2048}" --files 8 \
    --repeat 3 --dir "$BENCH_DIR" --out "$OUT/nvme_loader.md" 2>&1 | tail -30
bench_rc=${PIPESTATUS[0]}
rm -rf "$BENCH_DIR"

echo "tests rc=$tests_rc bench rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
