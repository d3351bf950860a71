#!/usr/bin/env bash
# The default MoE decode path profiled on the GPU, in one call: benchmarks/bench_moe_offload.py at the 32-layer
# Mixtral shape, int4 group 128, one total slot budget (--slots fill --reserve-gib 0.75), 64 timed tokens a run on
# one offload per prefetch top-k (--prefetch-top-k 1,2), each with the guesses past resident experts off and on
# (--skip-resident off,on); after each timed decode a profiled decode of PROF tokens (--profile-tokens: 'GPU busy %'
# and the top device ops in $OUT/scale.md.profile.txt, each timeline beside it). The experts are built in host
# memory on an 80 GB card, on the GPU on a larger one (or with LAYERS <= 16). SCALE_S bounds it (330).
# Env: SCALE_S (seconds), TOPK, SKIP and PROF (the values above), LAYERS and CAP (a shorter model under a smaller
# cap, e.g. LAYERS=8 CAP=5: about the same share resident).
# Writes $OUT/scale.md, $OUT/scale.log and $OUT/scale.md.profile.txt.
. "$(dirname "$0")/common.sh"
M=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
echo "GPU memory ${M} MiB, $(nproc) host cores"
SRC="--expert-source host-regen"
if [ "${M:-0}" -ge 120000 ] || [ "${LAYERS:-32}" -le 16 ]; then SRC="--expert-source gpu"; fi
ARGS="--family mixtral --layers ${LAYERS:-32} --cap-gib ${CAP:-16} --agree-tokens 16 --ours-variants default
  --budget-s 1000 --slots fill
  --reserve-gib 0.75 --group-size 128 --prefetch-top-k ${TOPK:-1,2} --tokens 64 --peers int4
  --profile-tokens ${PROF:-4} --skip-resident ${SKIP:-off,on} $SRC"
timeout "${SCALE_S:-330}" python -u -m benchmarks.bench_moe_offload $ARGS --out "$OUT/scale.md" > "$OUT/scale.log" 2>&1
echo "scale rc=$?"; cat "$OUT/scale.md" 2>/dev/null || tail -20 "$OUT/scale.log"
