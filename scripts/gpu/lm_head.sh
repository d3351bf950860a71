#!/usr/bin/env bash
# ShardedLMHead on the GPU machine (~3-4 minutes on an H200):
#   1. install the peers' wheels (Liger-Kernel, Cut Cross-Entropy) into /tmp/site (failure is fine: rows say so)
#   2. GPU tests of linear_cross_entropy / ShardedLMHead, then the CPU tests of the head and the HF patch
#   3. benchmarks/bench_lm_head.py at V=262144, d=4096, N=16384, bf16 -> $OUT/lm_head.md
#      (+ $OUT/lm_head_eager.md: ours with the tile math uncompiled, for comparison)
set -x
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/bench_out}"
mkdir -p "$OUT"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cuda}"
export MAXIMUS_BENCH_OUT="$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}:/tmp/site"

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/liger_kernel-*.whl \
    .device/cut_cross_entropy-*.whl 2>&1 | tail -3 || true
python -c "import triton, liger_kernel, cut_cross_entropy; print('triton', triton.__version__)" 2>&1 | tail -2

python -m pytest -q -p no:cacheprovider -m gpu tests/embedding/test_lm_head.py 2>&1 | tee "$OUT/lm_head_tests.txt" | tail -30
tests_rc=${PIPESTATUS[0]}
python -m pytest -q -p no:cacheprovider -m "not gpu" tests/embedding/test_lm_head.py tests/integrations/test_hf_lm_head.py \
    2>&1 | tail -5 | tee -a "$OUT/lm_head_tests.txt"
cpu_rc=${PIPESTATUS[0]}

timeout 300 python -m benchmarks.bench_lm_head --out "$OUT/lm_head.md" 2>&1 | tee "$OUT/lm_head_bench.log" | tail -30
bench_rc=${PIPESTATUS[0]}
DS_MAXIMUS_LCE_COMPILE=0 timeout 60 python -m benchmarks.bench_lm_head --skip floor,streamed,torch,liger,cce,big \
    --out "$OUT/lm_head_eager.md" 2>&1 | tail -12

echo "gpu tests rc=$tests_rc cpu tests rc=$cpu_rc bench rc=$bench_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
