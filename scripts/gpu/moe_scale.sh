#!/usr/bin/env bash
# The real-scale MoE inference runs of issue #37 on the H200 host (139 GiB GPU, 125 GiB RAM, 16 cores), one call
# of at most $TOTAL_S seconds (default 530):
#   1. our ops built first, one process each (row_ops cuda, expert_cpu; a JIT build is single-threaded for most
#      of its ~40-70 s), outside any time limit (a killed build leaves torch's lock behind); MemAvailable printed
#   2. benchmarks/bench_moe_offload.py on the 32-layer Mixtral-8x7B (90 GB of bf16 experts), GPU capped at 16 GiB for
#      every peer but 'full', slots per layer from the cap for each peer's expert size (--slots auto; SLOTS=fill
#      gives each peer that room as one moe.gpu_expert_total_bytes budget, with RESERVE GiB kept, default 0.5), 32 timed
#      decode tokens, token agreement over the bf16 model's 256-token continuation (one forward per peer); the
#      experts are regenerated on the GPU for each peer (--expert-source gpu: a 90 GB host copy next to a bf16
#      peer's 90 GB pinned tier does not fit the host). Peers run most important first, so a cut leaves the
#      rest as "skipped" rows: full (the reference), int4, int4+cpu, ours bf16 (the default cache only),
#      bf16+cpu, int8, int3, int2, then the bnb row and CPU-only inference (last; a row when it does not fit
#      or time is out). FAMILY=qwen3 runs the Qwen3-30B-A3B shape instead (48 layers, 128 experts of ffn 768,
#      top-8: 58 GB of bf16 experts). $PEERS replaces the peer list; $EXTRA adds arguments (e.g. "--batch 8
#      --prefill-len 2048" for batched decode and a prefill, "--agree-tokens 64" for a shorter agreement forward).
# Writes $OUT/moe_scale_$FAMILY.md (the table, rewritten after every peer), the log and the build logs.
#
# Time estimate for the 32-layer Mixtral, scaled from the 8- and 16-layer figures in docs/bench/: imports and
# host bandwidth ~15 s; the 93 GB model built on the GPU in seconds; full: 32 warm-up + 32 timed tokens at
# ~9 tok/s ~10 s; the 256-token reference ~40 s (a cuDNN graph per new length); per offloaded peer: regenerating
# the experts ~1 s, offload (bf16: 90 GB pinned, ~15-25 s; int4: quantized on the GPU, 25 GB pinned, ~8 s),
# decode 34 tokens (bf16 1 slot ~2 tok/s ~17 s; int4 3 slots ~5 tok/s ~7 s), agreement forward ~2 s: int4 ~20 s,
# int4+cpu ~20 s, bf16 ~45 s, bf16+cpu ~40 s, int8 ~30 s, int3 and int2 ~20 s each: ~290 s with the set-up; the
# CPU-only peer (93 GB to the host, minutes of CPU decode) only if time is left. Builds ~120 s when not cached.
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
FAMILY="${FAMILY:-mixtral}"
nvidia-smi --query-gpu=name,memory.total --format=csv || true
nproc
build_ops cuda expert
grep -E "MemTotal|MemAvailable" /proc/meminfo
# what is left of the call for the benchmark, and its budget inside that (peers start only while they fit)
LEFT=$(( ${TOTAL_S:-530} - (SECONDS - T0) - 10 ))
BUDGET=$(( LEFT - 25 ))
echo "builds took $((SECONDS - T0)) s; benchmark timeout ${LEFT} s, budget ${BUDGET} s"
if [ "$FAMILY" = qwen3 ]; then
  SHAPE="--family qwen3"                 # 48 layers, H=2048, 128 experts of F=768, top-8, vocab 151936
else
  SHAPE="--family mixtral --layers 32"   # the whole Mixtral-8x7B
fi
SLOT_ARGS="--slots ${SLOTS:-auto}"
[ "${SLOTS:-auto}" = fill ] && SLOT_ARGS="$SLOT_ARGS --reserve-gib ${RESERVE:-0.5}"
timeout "$LEFT" python -u -m benchmarks.bench_moe_offload $SHAPE --cap-gib 16 $SLOT_ARGS --tokens 32 \
  --agree-tokens 256 --expert-source gpu --ours-variants default \
  --peers ${PEERS:-full,int4,int4+auto,int4+cpu,ours,bf16+auto,bf16+cpu,int8,int3,int2,bnb,cpu} ${EXTRA:-} \
  --budget-s "$BUDGET" \
  --out "$OUT/moe_scale_$FAMILY.md" > "$OUT/moe_scale_$FAMILY.log" 2>&1
rc=$?
grep -v -i warning "$OUT/moe_scale_$FAMILY.log" | grep -E "^\[" | tail -40
grep MemAvailable /proc/meminfo
cat "$OUT/moe_scale_$FAMILY.md"
echo "bench rc=$rc"
[ "$rc" = 0 ]
# CPU smoke run of the same options: python -m benchmarks.bench_moe_offload --small --expert-source gpu --slots auto \
#   --cap-gib 0.02 --reserve-gib 0 --agree-tokens 24 --peers full,int4,int4+cpu,ours --ours-variants default
