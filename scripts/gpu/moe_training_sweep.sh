#!/usr/bin/env bash
# Settings of ours on the MoE training benchmark's Mixtral shape, one device call (<= 600 s with a cold op build):
#   TESTS  - pytest files run first on the GPU (default: the MoE GPU tests, the expert gradients', the ops');
#   RUNS   - space-separated runs "slots:grad_experts:cap_gib:peers[:extra flags joined by +]", each one
#            bench_moe_training invocation (3 layers, 1 warm-up + $STEPS timed steps); "-" keeps a default;
#   PER_S  - most seconds a run may take (default 150; a ZeRO-3 offload peer takes ~100 s);
#   STEPS  - timed steps a run (default 3; each adds ~1.3 s to ours and ~2.5 s to ZeRO-3 offload).
# Writes $OUT/sweep_tests.log, and per run $OUT/sweep_<i>.{md,log}, all in $OUT/sweep.tgz.
set -x
. "$(dirname "$0")/common.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
TESTS=${TESTS-tests/experts/training/test_gpu.py tests/experts/training/test_grads.py tests/ops/test_row_ops.py}
RUNS=${RUNS:-"4:-:-:ours_split,zero3_offload_nocap"}
# never under `timeout`: a killed JIT build leaves its lock and the peers would wait on it forever
python -c "from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
CPUAdamBuilder().load(); FusedAdamBuilder().load()" > "$OUT/sweep_adam_build.log" 2>&1 &
build_pid=$!
python -c "from ds_maximus.ops import row_ops as o; print('ops', o.load_op('cuda') is not None, o.load_op('cpu') is not None)"
if [ -n "$TESTS" ]; then
  timeout ${TESTS_S:-150} python -m pytest -q -x -p no:cacheprovider $TESTS > "$OUT/sweep_tests.log" 2>&1
  echo "tests rc=$?"; tail -4 "$OUT/sweep_tests.log"
fi
wait $build_pid || tail -5 "$OUT/sweep_adam_build.log"
i=0
for run in $RUNS; do
  i=$((i + 1))
  IFS=: read -r slots grads cap peers extra <<< "$run"
  args="--layers 3 --warmup 1 --steps ${STEPS:-3} --peers $peers --budget-s $(( ${PER_S:-150} - 5 )) --slot-s ${PER_S:-150}"
  [ "$slots" != - ] && args="$args --slots $slots"
  [ "$grads" != - ] && args="$args --grad-experts $grads"
  [ "$cap" != - ] && args="$args --cap-gib $cap"
  [ -n "$extra" ] && args="$args ${extra//+/ }"
  timeout ${PER_S:-150} python -u -m benchmarks.bench_moe_training $args --out "$OUT/sweep_$i.md" > "$OUT/sweep_$i.log" 2>&1
  echo "run $i ($run) rc=$?"
  grep "GPU cap\|ExpertTrainer step\|DEVICE GiB\|HOST GRADS\|OOM MEMORY\|^\[" "$OUT/sweep_$i.log" | tail -20
  cat "$OUT/sweep_$i.md"
done
tar czf /tmp/sweep.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/sweep.tgz "$OUT"/
