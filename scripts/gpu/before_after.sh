#!/usr/bin/env bash
# Benchmarks of this tree and of an older one ($OLD, e.g. `git archive <rev> | tar x -C .old_tree`), run in the same
# call, each benchmark old then new, so a regression shows against the same machine's state. BENCHES lists
# "module:arguments" items (arguments joined by +); PER_S bounds each run; ORDER="new old" runs this tree first; the older tree's ops load from $OLD_EXT
# (common.sh). Ops must be built (redesign_check.sh builds
# both trees'). Writes $OUT/ba_<i>_{old,new}.{md,log}, <i> counting on from what $OUT already holds (a second
# invocation in one call, or the same benchmark twice, adds files instead of overwriting the first).
set -x
. "$(dirname "$0")/common.sh"
: "${OLD:?OLD must name the older tree}"
BENCHES=${BENCHES:-"bench_sharded_embedding:--no-deepspeed+--repeat+10+--budget-s+55 bench_lm_head:--skip+liger,cce,floor,big,eager+--budget-s+55 bench_moe_offload:--quick+--budget-s+55"}
i=$(ls "$OUT"/ba_*_new.log "$OUT"/ba_*_old.log 2>/dev/null | sed 's/.*ba_\([0-9]*\)_.*/\1/' | sort -n | tail -1)
i=${i:-0}
for item in $BENCHES; do
  i=$((i + 1)); mod="${item%%:*}"; args="${item#*:}"; args="${args//+/ }"
  for k in ${ORDER:-old new}; do
    if [ "$k" = old ]; then
      (cd "$OLD" && MAXIMUS_BENCH_OUT="$OUT/old" PYTHONPATH="$OLD:/tmp/site" TORCH_EXTENSIONS_DIR=$OLD_EXT \
        timeout ${PER_S:-75} python -u -m benchmarks.$mod $args --out "$OUT/ba_${i}_old.md") > "$OUT/ba_${i}_old.log" 2>&1
    else
      timeout ${PER_S:-75} python -u -m benchmarks.$mod $args --out "$OUT/ba_${i}_new.md" > "$OUT/ba_${i}_new.log" 2>&1
    fi
    echo "$mod $k rc=$?"
  done
  for k in old new; do echo "--- $mod $k"; cat "$OUT/ba_${i}_$k.md" 2>/dev/null || tail -5 "$OUT/ba_${i}_$k.log"; done
done
