#!/usr/bin/env bash
# Issue #39's last figure, one call (~9 min): bench_moe_training at a fixed CPU share, this tree against $OLD (the tree
# before the partition-core redesign), two pairs in alternating order (old new, then new old; ORDERS="old new" runs
# one) so that neither tree always runs first, $STEPS timed steps each (default 6), and the host's AnonHugePages
# before every run.
# Writes $OUT/ba_*_{old,new}.{md,log} and pairs.md, packed into $OUT/results.tgz (pack_out).
set -x
. "$(dirname "$0")/common.sh"
T0=$SECONDS
: "${OLD:?OLD must name the older tree}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu old ds
ARGS="--layers+3+--warmup+2+--steps+${STEPS:-6}+--peers+ours_split+--cpu-share+${SHARE:-0.55}+--budget-s+${RUN_S:-100}+--slot-s+${RUN_S:-100}"
IFS=, read -ra ORDERS <<< "${ORDERS:-old new,new old}"   # ORDERS="old new": one pair
per=$(( (${TOTAL_S:-560} - (SECONDS - T0) - 20) / (2 * ${#ORDERS[@]}) ))
echo "each run: $per s"
for order in "${ORDERS[@]}"; do
  for k in $order; do
    grep AnonHugePages /proc/meminfo
    PER_S=$per ORDER=$k BENCHES="bench_moe_training:$ARGS" bash "$(dirname "$0")/before_after.sh" > /dev/null 2>&1
  done
done
grep -i "unavailable\|reference" "$OUT"/ba_*_old.log | head -3   # the older tree must have used its own op
grep -H RESULT "$OUT"/ba_*.log | sed 's/"losses[^]]*],//' | tee "$OUT/pairs.md"
pack_out
