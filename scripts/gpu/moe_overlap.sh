#!/usr/bin/env bash
# Host experts beside the Python thread (cpu_compute's worker thread and HostGate), on whichever card comes:
#   1. our ops (row_ops cuda with the gate, expert_cpu), then the gate's and cpu_compute's GPU tests
#   2. the Mixtral-8x7B shape (32 layers on an H200, 24 on an H100 unless $LAYERS) at a 16 GiB cap, batch-1
#      decode of 32 tokens, each peer run twice (a process's first offloaded run is slow): int4 with 3 slots a layer, off and auto; bf16 with 1 slot, misses,
#      its guesses queued and dropped while the link is busy (--busy-guesses; the first run warms the process up).
#      With LAYERS=32 on a card too small for the whole model (an H100's 80 GB against 93 GB) the experts are built
#      and kept in host memory (--expert-source host-regen: no 'full' peer, no agreement reference).
#   3. with the time left, the same peers once more with --host-overlap off (the in-line host experts).
# Writes $OUT/overlap_{int4,bf16,off}.md (tables) and their logs. $TOTAL_S (560): the call's seconds.
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv || true
build_ops cuda expert
timeout 150 python -m pytest -q -x -m gpu tests/ops/test_row_ops.py -k host_gate tests/experts/test_cpu_compute.py \
  2>&1 | tail -4
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
# the whole model fits an H200 (--expert-source gpu regenerates a peer's experts in seconds); an H100 runs 24 layers
# so, or 32 with LAYERS=32 (host-regen: each peer's 93 GB regenerated through host memory, ~30 s more a run)
if [ "${MEM:-0}" -ge 120000 ]; then LAYERS="${LAYERS:-32}"; else LAYERS="${LAYERS:-24}"; fi
SRC=gpu
[ "${MEM:-0}" -lt 120000 ] && [ "$LAYERS" -gt 24 ] && SRC=host-regen
grep -E "MemTotal|MemAvailable" /proc/meminfo
B="python -u -m benchmarks.bench_moe_offload --family mixtral --layers $LAYERS --cap-gib 16 --agree-tokens 16
   --expert-source $SRC --ours-variants default --tokens 32"
run() {  # run NAME SECONDS ARGS...: one bench process under a timeout, its table printed
  local name=$1 s=$2
  shift 2
  [ "$s" -lt 60 ] && { echo "no time left for $name"; return; }
  timeout "$s" $B --budget-s $((s - 20)) "$@" --out "$OUT/$name.md" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
  grep -v -i warning "$OUT/$name.log" | grep -E "^\[" | tail -12
  cat "$OUT/$name.md"
}
left() { echo $(( ${TOTAL_S:-560} - (SECONDS - T0) )); }
run overlap_int4 $(( $(left) * 42 / 100 )) --slots 3 --peers int4,int4+auto --prefetch-top-k 1,1
run overlap_bf16 $(( $(left) * 85 / 100 )) --slots 1 --peers bf16+cpu --busy-guesses skip,queue,skip
run overlap_off $(( $(left) - 10 )) --slots 3 --peers int4+auto --host-overlap off
