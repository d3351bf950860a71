#!/usr/bin/env bash
# MoE training benchmark on the GPU machine: the GPU tests of tests/moe_training first (~1 min), then
# bench_moe_training on the Mixtral-shaped stack (3 layers, H=4096, F=14336, 8 experts, top-2) and the
# fine-grained one (64 experts, top-4, F=1792), bf16, offloading peers capped below the experts' bytes.
# DeepSpeed's fused Adam and CPU Adam (the peers' optimizers) are prebuilt first so no peer pays the JIT.
# GPU cap 0.9 x the experts' bf16 bytes (7.1 GiB); every peer is its own subprocess, OOM is a row.
#   -> $OUT/moe_training_{mixtral,fine}.md (+ CSV, + logs). At most ~9.5 min on an H200.
set -x
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/bench_out}"
mkdir -p "$OUT"
export MAXIMUS_BENCH_OUT="$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 90 python -m pytest -q -x tests/moe_training/test_gpu.py > "$OUT/moe_training_gpu_tests.log" 2>&1
tests_rc=$?
tail -5 "$OUT/moe_training_gpu_tests.log"
timeout 100 python -c "from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
CPUAdamBuilder().load(); FusedAdamBuilder().load()" \
  > "$OUT/moe_training_cpu_adam_build.log" 2>&1 || tail -5 "$OUT/moe_training_cpu_adam_build.log"
timeout 185 python -u -m benchmarks.bench_moe_training --layers 3 --budget-s 175 \
  --out "$OUT/moe_training_mixtral.md" > "$OUT/moe_training_mixtral.log" 2>&1
m_rc=$?
grep -v -i warning "$OUT/moe_training_mixtral.log" | tail -14
timeout 185 python -u -m benchmarks.bench_moe_training --layers 3 --fine-grained --slots 8 --budget-s 175 \
  --out "$OUT/moe_training_fine.md" > "$OUT/moe_training_fine.log" 2>&1
f_rc=$?
grep -v -i warning "$OUT/moe_training_fine.log" | tail -14
echo "tests rc=$tests_rc mixtral rc=$m_rc fine rc=$f_rc"
[ "$tests_rc" = 0 ] && [ "$m_rc" = 0 ] && [ "$f_rc" = 0 ]
# CPU smoke run of the same benchmark: python -m benchmarks.bench_moe_training --tiny [--fine-grained]
