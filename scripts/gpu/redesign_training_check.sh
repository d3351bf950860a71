#!/usr/bin/env bash
# The training benchmarks before and after the partition-core redesign, in one call on a fresh GPU machine (~9 min):
#   1. every op both trees load, built once into one extension folder (the trees' op names differ; the NVMe
#      loader's sources are the same): ours, $OLD's, DeepSpeed's fused and CPU Adam
#   2. the PEFT frozen-original GPU test
#   3. bench_moe_training (3 Mixtral layers, the split step), $OLD then this tree
#   4. the headline's maximus configuration (262K vocabulary, 16 GiB cap), $OLD then this tree, and the uncapped
#      plain ZeRO-2 reference, each one examples/train_llama.py process as bench_headline runs it
# Writes $OUT/*.log, $OUT/ba_*.md and $OUT/headline_*.json.
set -x
. "$(dirname "$0")/common.sh"
: "${OLD:?OLD must name the older tree}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
build_ops cuda cpu old ds
timeout 60 python -m pytest -q -m gpu -p no:cacheprovider tests/integrations/test_peft_frozen_original.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu test rc=$?"; tail -2 "$OUT/gpu_tests.log"
PER_S=${MOE_S:-85} \
  BENCHES="bench_moe_training:--layers+3+--warmup+1+--steps+2+--peers+ours_split+--budget-s+80+--slot-s+80" \
  bash "$(dirname "$0")/before_after.sh"
HEAD_CLI="--deepspeed_config ds_configs/llama_262k_16gib.json --vocab 262144 --hidden 2048 --layers 16 --heads 16
  --ffn 2816 --seq 2048 --micro-batch 8 --zipf 1.1 --seed 0 --log-every 5 --grad-checkpointing --steps 4
  --warmup-steps 2"
run_head() {  # name, tree, extra arguments
  local name=$1 tree=$2; shift 2
  (cd "$tree" && RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29600 + RANDOM % 300)) \
    PYTHONPATH="$tree:/tmp/site" timeout ${HEAD_S:-70} python -u examples/train_llama.py $HEAD_CLI "$@" \
    --json-out "$OUT/headline_$name.json") > "$OUT/headline_$name.log" 2>&1
  echo "headline $name rc=$?"; grep -v -i warn "$OUT/headline_$name.log" | tail -2
}
run_head maximus_old "$OLD" --cap-gib 16
run_head maximus_new "$PWD" --cap-gib 16
run_head plain_uncapped "$PWD" --plain
python - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("headline_*.json")):
    d = json.loads(f.read_text())
    print(f.stem, {k: d.get(k) for k in ("tokens_per_s", "peak_gib", "steps", "error")}, "losses", d.get("losses"))
PY
