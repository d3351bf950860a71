#!/usr/bin/env bash
# One call (~8 min on a fresh H200 machine) after the tuned gemv kernel returned and before the redesign's last pair:
#   1. ops of both trees built (cuda, cpu, expert, $OLD's own op, DeepSpeed's Adams)
#   2. the Triton quant GEMMs' GPU tests, every gemv configuration against the plain-PyTorch reference ($QUANT_S)
#   3. the expert_cpu tests on this host's cores, and scripts/gpu/probe_expert_cpu.py: a C++ argument error in a
#      child process (a crash shows as a negative exit code, with gdb's backtrace where gdb exists), the host
#      expert's time at 16, 8 and 4 threads
#   4. bench_moe_training old ($OLD, the tree before the partition-core redesign) then new, in this call (#39)
# Writes $OUT/*.log, *.md, packed into $OUT/results.tgz (pack_out).
set -x
. "$(dirname "$0")/common.sh"
: "${OLD:?OLD must name the older tree}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu expert old ds
timeout ${QUANT_S:-150} python -m pytest -q -p no:cacheprovider -m gpu tests/experts/test_quant.py > "$OUT/test_quant.log" 2>&1
echo "quant gpu tests rc=$?"; tail -n 3 "$OUT/test_quant.log"; grep -E "^(FAILED|ERROR)" "$OUT/test_quant.log" | head
timeout 60 python -X faulthandler -m pytest -q -p no:cacheprovider tests/ops/test_expert_cpu.py \
  --deselect tests/ops/test_expert_cpu.py::test_bad_inputs_raise_clear_errors > "$OUT/test_expert_cpu.log" 2>&1
echo "expert_cpu tests rc=$?"; grep -E "passed|failed|Fatal|File \"/.*/(tests|ds_maximus)/" "$OUT/test_expert_cpu.log" | head
timeout 150 python -u scripts/gpu/probe_expert_cpu.py > "$OUT/probe_expert_cpu.md" 2>&1
echo "probe rc=$?"; grep -v -i warn "$OUT/probe_expert_cpu.md"
MOE="bench_moe_training:--layers+3+--warmup+2+--steps+4+--peers+ours_split+--cpu-share+${SHARE:-0.55}+--budget-s+75+--slot-s+75"
PER_S=${MOE_S:-80} BENCHES="$MOE" bash "$(dirname "$0")/before_after.sh"
pack_out
