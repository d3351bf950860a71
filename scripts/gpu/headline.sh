#!/usr/bin/env bash
# GPU run of the headline benchmark (benchmarks/bench_headline.py): a 262K-vocabulary Llama
# (hidden 2048, 16 layers, ffn 2816, 8 x 2048 tokens, bf16 ZeRO-2) under a 16 GiB cap.
#   1. build our ShardedEmbedding CUDA op (cached: seconds; cold ~70 s) while DeepSpeed's cpu_adam
#      builds in the background (the offload peers, run last, need it)
#   2. speed table: plain ZeRO-2 capped (OOM expected), maximus capped (as configured, and with the head's
#      gradient in the CPU tier instead of on the GPU: lm_head.grad_on_device=off), plain ZeRO-2 uncapped
#      (reference), then ZeRO-2 / ZeRO-3 CPU offload capped; 16 steps each (4 warm-up: 12 timed, the ratio is read to 0.01), own processes
#   3. 200-step loss curve, maximus (capped) vs plain ZeRO-2 (uncapped), same seed, at vocab 262144,
#      hidden 1024, 4 layers, 8 x 512 tokens (the full model's 200 steps would take ~4 min alone)
# -> $OUT/headline.md (+ CSV, + the full log in $OUT/headline.log). About 480 s wall on an H200.
set -x
. "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv || true

# builds never run under `timeout`: a killed JIT build leaves torch's lock and later loads wait on it
python -u -c "
from deepspeed.ops.op_builder import CPUAdamBuilder
CPUAdamBuilder().load(); print('cpu_adam built', flush=True)" > "$OUT/headline_ds_ops_build.log" 2>&1 &
ds_build=$!
python -u -c "from ds_maximus.ops import row_ops as o; print('op', o.load_op('cuda') is not None)" \
  > "$OUT/headline_build.txt" 2>&1
tail -3 "$OUT/headline_build.txt"
# the head's CUDA step tests (staged step, gradient kept on the GPU) against the host step
timeout 90 python -m pytest -q -m gpu tests/vocab/test_lm_head_update.py > "$OUT/headline_gpu_tests.log" 2>&1
tests_rc=$?
tail -3 "$OUT/headline_gpu_tests.log"
timeout 490 python -u -m benchmarks.bench_headline --out "$OUT/headline.md" --steps 16 --warmup 4 \
  --config-timeout-s 75 --offload-timeout-s 45 --curve-steps 200 --budget-s 470 \
  --maximus-variant lm_head.grad_on_device=off 2>&1 | tee "$OUT/headline.log"
bench_rc=${PIPESTATUS[0]}
wait "$ds_build" 2>/dev/null
tail -3 "$OUT/headline_ds_ops_build.log"
echo "tests rc=$tests_rc bench rc=$bench_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
# CPU smoke test of the same benchmark (tiny sizes): python -m benchmarks.bench_headline --cpu --curve-steps 20
