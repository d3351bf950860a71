#!/usr/bin/env bash
# Shard store + token map on the GPU machine: the store tests (NVMe loader path with pinned, page-aligned
# buffers and a real NVMe disk), the token map tests, and the token map benchmark -> $OUT/tokenmap.md
set -x
set -u
. "$(dirname "$0")/common.sh"
python -m pytest -q tests/store tests/tokenmap 2>&1 | tail -20 | tee "$OUT/tokenmap_tests.txt"
{
  echo "## tokenmap (GPU machine, CPU work: tokenizer counting)"
  TOKENIZERS_PARALLELISM=true python -m benchmarks.bench_tokenmap --repeat 3 --copies 8
  echo
  echo "tests: $(tail -1 "$OUT/tokenmap_tests.txt")"
} 2>&1 | tee "$OUT/tokenmap.md"
