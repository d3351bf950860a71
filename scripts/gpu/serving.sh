#!/usr/bin/env bash
# Serving on the GPU machine (~2-3 minutes on an H200):
#   1. the export/serving tests: GPU ones (maximized generate on CUDA) and the CPU ones (export
#      round trips through ZeRO-2/3 checkpoints into a process without ds_maximus)
#   2. benchmarks/bench_serving.py: a 262144-vocabulary Llama (d=2048, 4 layers, bf16) generating
#      64 tokens for 8 prompts of 128, plain vs embedding off the GPU vs embedding + head off the GPU
#      -> $OUT/serving.md (peak GPU memory, tokens/s, same-token share); batch 32 -> $OUT/serving_b32.md
set -x
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/bench_out}"
mkdir -p "$OUT"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cuda}"
export MAXIMUS_BENCH_OUT="$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total --format=csv || true
python -m pytest -q -p no:cacheprovider -m gpu tests/integrations/test_export.py 2>&1 | tee "$OUT/serving_tests.txt" | tail -20
gpu_rc=${PIPESTATUS[0]}
# the CPU tests compare against CPU references: run them with the GPU hidden
CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu timeout 200 python -m pytest -q -p no:cacheprovider -m "not gpu" \
    tests/integrations/test_export.py 2>&1 \
    | tee -a "$OUT/serving_tests.txt" | tail -8
cpu_rc=${PIPESTATUS[0]}

timeout 150 python -m benchmarks.bench_serving --out "$OUT/serving.md" 2>&1 | tee "$OUT/serving_bench.log" | tail -14
bench_rc=${PIPESTATUS[0]}
timeout 90 python -m benchmarks.bench_serving --batch 32 --new 32 --repeat 2 --out "$OUT/serving_b32.md" 2>&1 \
    | tail -10
cat "$OUT/serving_b32.md" >> "$OUT/serving.md" 2>/dev/null || true

echo "gpu tests rc=$gpu_rc cpu tests rc=$cpu_rc bench rc=$bench_rc"
[ "$gpu_rc" = 0 ] && [ "$bench_rc" = 0 ]
