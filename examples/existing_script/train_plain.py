"""A plain DeepSpeed training script, as users already have (the "before").

    deepspeed --num_gpus 1 examples/existing_script/train_plain.py \\
        --deepspeed_config examples/existing_script/ds_config.json
"""
import argparse

import deepspeed
import torch
from transformers import LlamaConfig, LlamaForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=0)
ap.add_argument("--steps", type=int, default=8)
ap = deepspeed.add_config_arguments(ap)
args = ap.parse_args()

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=50000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4))
engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())

g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    ids = torch.randint(0, 50000, (engine.train_micro_batch_size_per_gpu(), 32), generator=g).to(engine.device)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    if engine.global_rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
torch.distributed.destroy_process_group()  # before exit: a live gloo group can abort the teardown (rc -6)
