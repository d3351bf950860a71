#!/usr/bin/env bash
# #38's peers that docs/bench/peft_vocab.md has no figures for, one call (~6 min), results in $OUT (pack_out): our
# row ops built, then bench_peft_vocab at the Gemma-3-4B shape with plain PEFT uncapped (the reference), PEFT modules_to_save capped
# (expected OOM), PEFT modules_to_save + Liger's fused linear cross-entropy capped, PEFT trainable_token_indices
# capped (only the new rows trained) and ours capped; then ours and plain PEFT at 4 layers under torch.profiler
# (one extra step each: profile_<peer>.txt), where the step's remaining gap goes.
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu
python -c "import liger_kernel; print('liger', liger_kernel.__name__)" || echo "no liger: its row skips"
LEFT=$(( ${TOTAL_S:-560} - (SECONDS - T0) - 15 ))
timeout $(( LEFT * 2 / 3 )) python -u -m benchmarks.bench_peft_vocab --peers peft_mts ours_capped peft_mts_capped \
  peft_mts_liger_capped peft_tti_capped --batch 4 --steps 6 --warmup 2 --peer-timeout-s 100 \
  --budget-s $(( LEFT * 2 / 3 - 5 )) --out "$OUT/peft_peers.md" > "$OUT/peft_peers.log" 2>&1
echo "peers rc=$?"; cat "$OUT/peft_peers.md"; grep -h "^\[" "$OUT/peft_peers.log"
LEFT=$(( ${TOTAL_S:-560} - (SECONDS - T0) - 15 ))
timeout "$LEFT" python -u -m benchmarks.bench_peft_vocab --peers ours_capped peft_mts --layers 4 --batch 4 --steps 4 \
  --warmup 2 --profile 1 --peer-timeout-s $(( LEFT / 2 - 5 )) --budget-s $(( LEFT - 5 )) --out "$OUT/peft_profile.md" \
  > "$OUT/peft_profile.log" 2>&1
echo "profile rc=$?"; cat "$OUT/peft_profile.md"
head -30 "$OUT/profile_ours_capped.txt"
pack_out
