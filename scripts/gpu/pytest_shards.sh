#!/usr/bin/env bash
# pytest_shards.sh N LOG ARGS...: the tests pytest collects from ARGS, split round-robin over N pytest processes run
# at once (the GPU tests of a Triton kernel spend their time compiling, one process mostly on one core: N processes
# use N of the host's cores); each shard's output goes to LOG.<i>, the summary lines to stdout, rc = the worst.
set -u
n=$1; log=$2; shift 2
ids=$(mktemp)
python -m pytest -q --co -p no:cacheprovider "$@" 2>/dev/null | grep "::" > "$ids"
echo "$(wc -l < "$ids") tests in $n shards"
pids=()
for ((i = 0; i < n; i++)); do
  mapfile -t mine < <(awk -v n="$n" -v i="$i" 'NR % n == i' "$ids")
  [ "${#mine[@]}" -eq 0 ] && continue
  python -m pytest -q -p no:cacheprovider "${mine[@]}" > "$log.$i" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
tail -qn1 "$log".*; grep -h -E "^(FAILED|ERROR)" "$log".* | head -20
rm -f "$ids"
exit $rc
