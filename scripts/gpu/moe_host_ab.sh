#!/usr/bin/env bash
# The MoE decode's own host work, this tree against an older one ($OLD: `git archive <rev> | tar x -C .old`, carried
# as an ignored path), on one machine in one call, then the 32-layer Mixtral int4 decode at 16 GiB with skipping
# resident experts off and on:
#   1. our ops built (row_ops cuda, expert_cpu), outside any time limit;
#   2. scripts/gpu/probe_offload_overhead.py (8 Mixtral layers, every expert resident: no copies, so the gap to the
#      plain model is the offload path's host work a layer), ROUNDS times, this tree and $OLD in turn;
#   3. benchmarks/bench_moe_offload.py at the 32-layer shape, int4 group 128, slots from one total budget
#      (--slots fill --reserve-gib 0.5), 64 timed tokens four times on one offload (--skip-resident off,on,off,on);
#      the experts built in host memory on an 80 GB card, on the GPU on a larger one (where the all-on-GPU peer
#      also runs). SCALE_S bounds it (default 270); SKIP_SCALE=1 leaves it out, OLD_SCALE=1 runs it for $OLD too.
# Writes $OUT/host_ab.log (the probes' lines) and $OUT/scale_{new,old}.md.
. "$(dirname "$0")/common.sh"
build_ops cuda expert
M=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
echo "GPU memory ${M} MiB, $(nproc) host cores"
probe() {  # probe TAG: the all-resident probe of the tree in the working folder
  timeout "${PROBE_S:-100}" python -u scripts/gpu/probe_offload_overhead.py --layers 8 --modes int4 --tokens 64 \
    --trace-tokens 2 2>&1 | grep -E "ms/token" | sed "s/^/$1 /"
}
for i in $(seq "${ROUNDS:-2}"); do
  probe "new$i" | tee -a "$OUT/host_ab.log"
  if [ -n "${OLD:-}" ]; then
    (cd "$OLD" && PYTHONPATH="$OLD:$PYTHONPATH" probe "old$i") | tee -a "$OUT/host_ab.log"
  fi
done
[ "${SKIP_SCALE:-0}" = 1 ] && exit 0
if [ "${M:-0}" -ge 120000 ]; then SRC="--expert-source gpu --peers full,int4"; else SRC="--expert-source host-regen --peers int4"; fi
ARGS="--family mixtral --layers 32 --cap-gib 16 --agree-tokens 16 --ours-variants default --budget-s 1000 --slots fill
  --reserve-gib 0.5 --group-size 128 --prefetch-top-k 1 --tokens 64 --skip-resident off,on,off,on $SRC"
timeout "${SCALE_S:-270}" python -u -m benchmarks.bench_moe_offload $ARGS --out "$OUT/scale_new.md" > /tmp/scale_new.log 2>&1
echo "scale new rc=$?"; cat "$OUT/scale_new.md" 2>/dev/null || tail -5 /tmp/scale_new.log
if [ -n "${OLD:-}" ] && [ "${OLD_SCALE:-0}" = 1 ]; then
  (cd "$OLD" && PYTHONPATH="$OLD:$PYTHONPATH" timeout "${SCALE_S:-270}" python -u -m benchmarks.bench_moe_offload $ARGS \
    --out "$OUT/scale_old.md" > /tmp/scale_old.log 2>&1)
  echo "scale old rc=$?"; cat "$OUT/scale_old.md" 2>/dev/null || tail -5 /tmp/scale_old.log
fi
