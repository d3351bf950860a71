#!/usr/bin/env bash
# Issue #38's GPU call, at most $TOTAL_S seconds (default 560), results in $OUT (at most 8 files come back):
#   1. our row ops built (outside any time limit: a killed build leaves torch's lock behind)
#   2. where a step goes: ours capped and plain PEFT at the Gemma-3-4B vocabulary with 4 decoder layers (the
#      table's cost is the vocabulary's; the blocks' shrink), one extra step each under torch.profiler:
#      $OUT/profile_ours_capped.txt, $OUT/profile_peft_mts.txt
#   3. the Llama-3-8B-shaped QLoRA row with a 262K vocabulary (needs the bitsandbytes wheel in .device/)
# The full comparison (0.9x target, the 200-step curve) is `--preset gpu600`, a call of its own.
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
python -c "import bitsandbytes as b; print('bitsandbytes', b.__version__)" || echo "no bitsandbytes: the QLoRA row skips"
LEFT=$(( ${TOTAL_S:-560} - (SECONDS - T0) - 15 ))
timeout $(( LEFT * 2 / 5 )) python -u -m benchmarks.bench_peft_vocab --peers ours_capped peft_mts --layers 4 \
  --batch 4 --steps 4 --warmup 2 --profile 1 --peer-timeout-s 110 --out "$OUT/peft_profile.md" > "$OUT/peft_profile.log" 2>&1
echo "profile rc=$?"; cat "$OUT/peft_profile.md"
LEFT=$(( ${TOTAL_S:-560} - (SECONDS - T0) - 15 ))
timeout "$LEFT" python -u -m benchmarks.bench_peft_vocab --peers qlora_ours_capped qlora_peft_mts_capped --batch 4 \
  --steps 4 --warmup 2 --peer-timeout-s $(( LEFT - 60 )) --budget-s $(( LEFT - 10 )) --out "$OUT/peft_qlora.md" \
  > "$OUT/peft_qlora.log" 2>&1
echo "qlora rc=$?"; cat "$OUT/peft_qlora.md"
head -45 "$OUT/profile_ours_capped.txt"
pack_out
