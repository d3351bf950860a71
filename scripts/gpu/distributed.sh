#!/usr/bin/env bash
# Issue 10 on a multi-GPU host (the device tool's nvidia-h200-x2 or larger), every rank on its own GPU, NCCL:
#   tests  - the multi-rank tests with MAXIMUS_TEST_RANKS=cuda: PartitionedEmbedding (2 ranks = 1 GPU, bad
#            ids, a dead and a stalled rank), every shard mode under the deepspeed launcher = 1 GPU,
#            data-parallel training = 1 GPU, MoE expert training on 2 ranks, HF Trainer on 2 ranks
#   bench  - benchmarks/bench_distributed_embedding.py at V=262144, d=4096, 8 x 2048 Zipf tokens per rank
#            (BENCH_ARGS: more of its arguments, e.g. --phases)
#   llama  - examples/train_llama.py (ZeRO-2, bf16, 262144-token vocabulary, the headline's model) on 1 and 2 GPUs
# PARTS picks them (default "tests bench llama"). Writes $OUT/distributed_tests.txt, $OUT/distributed.md,
# $OUT/llama_x{1,2}.{log,json}.
set -x
set -o pipefail
. "$(dirname "$0")/common.sh"
PARTS=${PARTS:-tests bench llama}
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
RANKS=1,2
if [ "$NGPU" -ge 4 ]; then RANKS=1,2,4; fi
if [ "$NGPU" -ge 8 ]; then RANKS=1,2,4,8; fi
nvidia-smi topo -m | tee "$OUT/topo.txt"
# both ops once, outside the time limits below (ranks must not race to build them)
python -c "from ds_maximus.ops import row_ops as o; print('ops', o.load_op('cpu') is not None, o.load_op('cuda') is not None)"

if [[ " $PARTS " == *" tests "* ]]; then
  MAXIMUS_TEST_RANKS=cuda timeout ${TESTS_S:-480} python -m pytest -q -rs -m distributed -p no:cacheprovider \
    tests/distributed tests/engine/test_data_parallel.py tests/experts/training/test_launcher.py \
    tests/integrations/test_hf_trainer.py 2>&1 | tail -40 | tee "$OUT/distributed_tests.txt"
fi
if [[ " $PARTS " == *" bench "* ]]; then
  timeout ${BENCH_S:-300} python -m benchmarks.bench_distributed_embedding --ranks "$RANKS" --vocab 262144 \
    --dim 4096 --tokens 16384 --cache-frac 0.1 --warmup ${WARMUP:-30} --steps 20 --out "$OUT/distributed.md" ${BENCH_ARGS:-}
fi
if [[ " $PARTS " == *" llama "* ]]; then
  args="--deepspeed_config ds_configs/llama_262k_16gib.json --vocab 262144 --hidden 2048 --layers 16 --heads 16
    --ffn 2816 --seq 2048 --micro-batch 8 --zipf 1.1 --seed 0 --grad-checkpointing --steps ${LLAMA_STEPS:-10}
    --warmup-steps 3 --log-every 1"
  for n in 1 2; do
    timeout ${LLAMA_S:-150} python -m deepspeed.launcher.runner --num_gpus $n --master_port $((29600 + n)) \
      examples/train_llama.py $args --json-out "$OUT/llama_x$n.json" > "$OUT/llama_x$n.log" 2>&1
    echo "rc=$?" >> "$OUT/llama_x$n.log"
    grep -h "done:\|maximus step\|rc=" "$OUT/llama_x$n.log"
  done
fi
