#!/usr/bin/env bash
# The README's first command: set up the Python (scripts/env.sh: the active venv, else ./.venv), then train
# the built-in example (a Llama with a 65,536-token vocabulary, 30 steps) under the deepspeed launcher.
# On a machine without a CUDA GPU DeepSpeed's CPU accelerator is used.
set -eu
cd "$(dirname "$0")/.."
source scripts/env.sh
if ! "$MAXIMUS_PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
exec deepspeed --num_gpus 1 examples/train_llama.py --deepspeed_config ds_configs/zero2_cpu_tier.json "$@"
