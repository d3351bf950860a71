#!/usr/bin/env bash
# Run several scripts/gpu/<feature>.sh on the GPU machine in one call, each under its own time limit,
# and pack every result file into $OUT/results.tgz (the device tool brings back at most 8 files).
#   bash scripts/gpu/run_all.sh "sharded_embedding:150 nvme_loader:120 ..."
set -u
cd "$(dirname "$0")/../.."
FINAL_OUT="${OUT:-$PWD/bench_out}"
export OUT="$FINAL_OUT/work"
mkdir -p "$OUT"
export MAXIMUS_COMMIT="${MAXIMUS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}"
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
for item in $1; do
  name="${item%%:*}"; limit="${item##*:}"
  echo "=================== $name (limit ${limit}s) ==================="
  start=$(date +%s)
  timeout "$limit" bash "scripts/gpu/$name.sh" > "$OUT/${name}_log.txt" 2>&1
  rc=$?
  echo "$name rc=$rc in $(( $(date +%s) - start ))s"
  tail -25 "$OUT/${name}_log.txt"
done
tar czf "$FINAL_OUT/results.tgz" -C "$OUT" .
rm -rf "$OUT"
