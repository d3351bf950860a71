#!/usr/bin/env bash
# Where the headline's maximus step spends its time: examples/train_llama.py with the headline's sizes and
# config under the 16 GiB cap, --profile over 2 steps after 3 warm-up steps (torch.profiler tables and a
# chrome trace in $OUT/headline_profile/, per-phase GPU-stream times in the log). Then the same for plain
# ZeRO-2 uncapped. About 2 x 40 s on an H200. Env: MAXIMUS_ARGS (extra train_llama arguments of the maximus
# run, e.g. "--maximus lm_head.grad_on_device=bf16"), PROFILE_PLAIN=0 leaves the plain run out.
set -x
. "$(dirname "$0")/common.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"  # as bench_headline
export DS_ACCELERATOR=cuda MASTER_ADDR=127.0.0.1 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0
args="--deepspeed_config ds_configs/llama_262k_16gib.json --vocab 262144 --hidden 2048 --layers 16 --heads 16
  --ffn 2816 --seq 2048 --micro-batch 8 --zipf 1.1 --seed 0 --grad-checkpointing --steps 6 --warmup-steps 3 --log-every 1"
# our CUDA op first (~70 s cold), outside the runs' time limits
python -c "from ds_maximus.ops import row_ops as o; print('op', o.load_op('cuda') is not None)"
MASTER_PORT=29701 timeout 120 python -u examples/train_llama.py $args --cap-gib 16 \
  ${MAXIMUS_ARGS:-} --profile "$OUT/headline_profile/maximus" > "$OUT/headline_profile_maximus.log" 2>&1
[ "${PROFILE_PLAIN:-1}" = 0 ] || MASTER_PORT=29702 timeout 120 python -u examples/train_llama.py $args --plain \
  --profile "$OUT/headline_profile/plain" > "$OUT/headline_profile_plain.log" 2>&1
grep -h "phases\|done:" "$OUT"/headline_profile_*.log
# timelines as text (a trace is ~30 MB): per-stream busy time and 20 ms buckets
for k in maximus $([ "${PROFILE_PLAIN:-1}" = 0 ] || echo plain); do
  python -m benchmarks.trace_timeline "$OUT/headline_profile/$k/trace_rank0.json" > "$OUT/headline_profile/$k/timeline.txt"
  gzip "$OUT/headline_profile/$k/trace_rank0.json"
done
tar czf "$OUT/headline_profile.tgz" -C "$OUT" headline_profile && rm -rf "$OUT/headline_profile"
