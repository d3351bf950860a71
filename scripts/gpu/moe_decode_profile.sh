#!/usr/bin/env bash
# The MoE decode path on the GPU, in one call:
#   1. the moe.decode_graphs GPU tests (captured layers replay bit for bit the same tokens and logits; TEST_S, 240:
#      the first compiles the quantized kernels);
#   2. benchmarks/bench_moe_offload.py at the 32-layer Mixtral shape, int4 group 128, one total slot budget
#      (--slots fill --reserve-gib 0.75), 64 timed tokens a row on one offload per prefetch top-k (TOPK, 1), each
#      with the guesses past resident experts off or on (SKIP, on), and each of --decode-graphs GRAPHS (default
#      off,static,on,off,static,on: static = a static KV cache without graphs; on = static cache + each layer's CUDA
#      graph; the bench warms the first row of each cache kind up over its whole length, past cuDNN attention's
#      per-length graph builds); after each timed decode a profiled
#      decode of PROF tokens (--profile-tokens: 'GPU busy %' and the top device ops in $OUT/scale.md.profile.txt,
#      each timeline beside it). The experts are built in host memory on an 80 GB card, on the GPU on a larger one
#      (or with LAYERS <= 16). SCALE_S bounds it (330).
# Env: TEST_S, SCALE_S (seconds), SKIP_TESTS=1, TOPK, SKIP, GRAPHS, PROF (the values above), LAYERS and CAP (a
# shorter model under a smaller cap, e.g. LAYERS=8 CAP=5: about the same share resident).
# Pass MAXIMUS_COMMIT=<the tree's commit> (the device's copy of .git is stale: the tables would name an old one).
# Writes $OUT/tests.log, $OUT/scale.md, $OUT/scale.log and $OUT/scale.md.profile.txt.
. "$(dirname "$0")/common.sh"
M=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
echo "GPU memory ${M} MiB, $(nproc) host cores"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_S:-240}" python -m pytest -q -m gpu tests/experts/test_decode_graphs.py 2>&1 | tail -15 \
    | tee "$OUT/tests.log"
fi
SRC="--expert-source host-regen"
if [ "${M:-0}" -ge 120000 ] || [ "${LAYERS:-32}" -le 16 ]; then SRC="--expert-source gpu"; fi
ARGS="--family mixtral --layers ${LAYERS:-32} --cap-gib ${CAP:-16} --agree-tokens 16 --ours-variants default
  --budget-s 1000 --slots fill
  --reserve-gib 0.75 --group-size 128 --prefetch-top-k ${TOPK:-1} --tokens 64 --peers int4
  --profile-tokens ${PROF:-4} --skip-resident ${SKIP:-on} --decode-graphs ${GRAPHS:-off,static,on,off,static,on} $SRC"
timeout "${SCALE_S:-330}" python -u -m benchmarks.bench_moe_offload $ARGS --out "$OUT/scale.md" > "$OUT/scale.log" 2>&1
echo "scale rc=$?"; cat "$OUT/scale.md" 2>/dev/null || tail -20 "$OUT/scale.log"
grep -h "^## " "$OUT/scale.md.profile.txt" 2>/dev/null
