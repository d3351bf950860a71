#!/usr/bin/env bash
# #37, one call (~9 min): the quantized kernels of the decode path on the GPU.
#   1. the GPU tests of the quantized kernels and of packed offload through them, in 12 shards within TEST_S seconds
#      (default 240): tests/experts/test_quant.py's grouped, one-row, packed-slot and tensor-core (mma) tests,
#      tests/experts/test_quant_offload.py's CUDA decodes (the one-row gemv is the default; the tensor-core
#      kernel's rounds through compute.ROUND_MMA);
#      Our ops (row_ops cuda, expert_cpu) build meanwhile, in the background.
#   2. benchmarks/sweep_quant_gemv.py at the Mixtral expert shapes within SWEEP_S (default 100): the token-tile
#      kernel, the one-row kernel the decode path runs and bf16 F.linear at one row an expert (SWEEP_BITS, default
#      4), then rounds of several rows an expert (ROUND_ROWS, default 2,4,16,512): the token-tile kernel, the
#      tensor-core kernel's launches and bf16 F.linear;
#   3. where step 4 does not run (or SKIP_PROBE=0): scripts/gpu/probe_offload_overhead.py, 8 Mixtral layers, every
#      expert resident, int4 with the token-tile kernel for every round and with the defaults (the one-row gemv,
#      the tensor-core kernel for the prompt's rounds);
#   4. on a GPU of 100 GB or more, unless SKIP_SCALE=1: moe_scale.sh at the 32-layer Mixtral shape, GPU capped
#      at 16 GiB (PEERS, default full,int4,int4+auto; TOTAL_S, default 280; a 93 GB model), slots from the default
#      reserve (3 a layer at int4: a fourth measured slower, docs/bench/moe_offload.md), the one-row gemv at batch-1
#      decode and the tensor-core kernel for the prompt's prefill where step 1 passed (else --round-mma off).
# Run as `timeout 575 bash scripts/gpu/gemv_decode.sh; . scripts/gpu/common.sh; pack_out`.
set -x
. "$(dirname "$0")/common.sh"
# step 4 needs an H200's memory; where it runs, step 3 is left out (the call's time)
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ -z "${SKIP_SCALE:-}" ]; then if [ "${mem:-0}" -lt 100000 ]; then SKIP_SCALE=1; else SKIP_SCALE=0; fi; fi
if [ -z "${SKIP_PROBE:-}" ]; then if [ "$SKIP_SCALE" = 1 ]; then SKIP_PROBE=0; else SKIP_PROBE=1; fi; fi
# our ops built beside the tests (the CUDA decodes among them wait for the same build; step 4 needs them)
build_ops cuda expert > "$OUT/builds.txt" 2>&1 &
build_pid=$!
timeout "${TEST_S:-240}" bash scripts/gpu/pytest_shards.sh 12 "$OUT/quant_tests" tests/experts/test_quant.py \
  tests/experts/test_quant_offload.py -k "grouped or one_row or packed_slot or mma or packed_rounds or cuda_equals"
tests_rc=$?
echo "quant tests rc=$tests_rc"
# step 4 with the tensor-core kernel only where the tests passed
if [ "$tests_rc" = 0 ]; then MMA=on; else MMA=off; fi
grep -h -A25 "^_____" "$OUT"/quant_tests.* | head -80
timeout "${SWEEP_S:-100}" python -u benchmarks/sweep_quant_gemv.py --bits "${SWEEP_BITS:-4}" --sweep "" \
  --round-rows "${ROUND_ROWS:-2,4,16,512}" > "$OUT/sweep_gemv.md" 2>&1
echo "sweep rc=$?"; grep -v "^WARNING" "$OUT/sweep_gemv.md" | tail -60
wait "$build_pid"; cat "$OUT/builds.txt"
if [ "${SKIP_PROBE:-0}" != 1 ]; then
  modes=int4:tile,int4
  timeout 200 python -u scripts/gpu/probe_offload_overhead.py --layers 8 --modes "$modes" > "$OUT/overhead.md" 2>&1
  echo "overhead probe rc=$?"; grep "ms/token" "$OUT/overhead.md"
fi
if [ "${SKIP_SCALE:-0}" != 1 ]; then
  PEERS="${PEERS:-full,int4,int4+auto}" EXTRA="${EXTRA:---agree-tokens 64 --round-mma $MMA}" TOTAL_S="${TOTAL_S:-280}" \
    bash scripts/gpu/moe_scale.sh
fi
