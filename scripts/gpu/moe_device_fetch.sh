#!/usr/bin/env bash
# moe.device_fetch on the GPU, in one call:
#   1. its GPU tests (the fetch kernel through the mapped CPU tier, bit for bit the default path) and the default
#      path's skip-resident twin;
#   2. benchmarks/bench_moe_offload.py at the 32-layer Mixtral shape, int4 group 128, one total slot budget
#      (--slots fill --reserve-gib 0.75: the fetch buffers need room), 64 timed tokens eight times on one offload
#      (--device-fetch off,on,bare,on: bare is without the GPU's guesses), each with the guesses past resident
#      experts off and on (--skip-resident off,on: with device_fetch a guess of a resident expert moves nothing);
#      the experts built in host memory on an 80 GB card, on the GPU on a larger one. SCALE_S bounds it (270);
#   3. scripts/gpu/probe_zero_copy.py: a Mixtral expert read over the link by the gemv itself, copied by the fetch
#      kernel, and copied by the copy engine (GB/s of each).
# Env: TEST_S, SCALE_S, PROBE_S (each step's seconds), SKIP_SCALE=1, FETCH and SKIP (the modes of step 2),
# LAYERS and CAP (a shorter model under a smaller cap, e.g. LAYERS=8 CAP=5: about the same share resident).
# Writes $OUT/tests.log, $OUT/probe.log and $OUT/scale.md.
. "$(dirname "$0")/common.sh"
M=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
echo "GPU memory ${M} MiB, $(nproc) host cores"
timeout "${TEST_S:-150}" python -m pytest -q -m gpu tests/experts/test_device_fetch.py \
  "tests/experts/test_offload_gpu.py::test_skip_resident_guesses_cuda" 2>&1 | tail -15 | tee "$OUT/tests.log"
if [ "${SKIP_SCALE:-0}" != 1 ]; then
SRC="--expert-source host-regen"
if [ "${M:-0}" -ge 120000 ] || [ "${LAYERS:-32}" -le 16 ]; then SRC="--expert-source gpu"; fi
ARGS="--family mixtral --layers ${LAYERS:-32} --cap-gib ${CAP:-16} --agree-tokens 16 --ours-variants default
  --budget-s 1000 --slots fill
  --reserve-gib 0.75 --group-size 128 --prefetch-top-k 1 --tokens 64 --peers int4 --profile-tokens ${PROF:-4}
  --device-fetch ${FETCH:-off,on,bare,on} --skip-resident ${SKIP:-off,on} $SRC"
timeout "${SCALE_S:-270}" python -u -m benchmarks.bench_moe_offload $ARGS --out "$OUT/scale.md" > "$OUT/scale.log" 2>&1
echo "scale rc=$?"; cat "$OUT/scale.md" 2>/dev/null || tail -20 "$OUT/scale.log"
fi
timeout "${PROBE_S:-90}" python -u scripts/gpu/probe_zero_copy.py --configs decode 2>&1 | tail -12 | tee "$OUT/probe.log"
