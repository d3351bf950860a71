"""Hugging Face Trainer with DeepSpeed and maximus: ``ds_maximus.enable()`` and a ds_config, nothing else.

    python examples/hf_trainer.py --steps 6                       # one process (sets RANK etc. itself)
    deepspeed --num_gpus 2 examples/hf_trainer.py --steps 6       # two ranks (CPU ranks on a CPU machine)
    python examples/hf_trainer.py --steps 6 --moe                 # a tiny Mixtral, experts trained as partitions

The Trainer reaches ``deepspeed.initialize`` through accelerate; after ``ds_maximus.enable()`` that call
swaps the large embedding for ``ShardedEmbedding`` and drives its sparse update at every optimizer step.
``MaximusDataCollator`` prefetches each batch's rows as accelerate's loader fetches it one batch ahead.
The maximus figures appear in the Trainer's own log lines (``maximus/embed_tokens/hit_rate`` beside ``loss``).
"""
import argparse
import json
import os
import tempfile

import torch

import ds_maximus


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=40000)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "maximus_hf_trainer"))
    ap.add_argument("--moe", action="store_true", help="a tiny Mixtral whose experts train as partitions "
                    "(maximus.moe.train) instead of a Llama with a sharded embedding")
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args(argv)
    # started as one plain process: the one-rank environment the deepspeed launcher would give it
    from ds_maximus.integrations.launch_env import single_process_env
    single_process_env()

    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Trainer,
        TrainingArguments,
    )
    ds_maximus.enable()
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "bf16": {"enabled": "auto"},
        "maximus": {"embedding": {"gpu_cache_rows": 4096}, "logging": {"interval_steps": 2}},
    }
    torch.manual_seed(0)
    if args.moe:  # 8 experts per layer, 2 GPU slots: the cache is smaller than one layer's experts
        ds_config["maximus"] = {"embedding": {"enabled": False}, "logging": {"interval_steps": 2},
                                "moe": {"enabled": True, "train": True, "gpu_experts_per_layer": 2}}
        args.vocab = min(args.vocab, 1024)
        model = MixtralForCausalLM(MixtralConfig(vocab_size=args.vocab, hidden_size=64, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                                 num_local_experts=8, num_experts_per_tok=2))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids.clone()}
            for ids in torch.randint(0, args.vocab, (64, 32), generator=g)]

    def collate(features):
        ids = torch.stack([f["input_ids"] for f in features])
        return {"input_ids": ids, "labels": ids.clone()}

    targs = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=2,
                              learning_rate=1e-3, weight_decay=0.01, logging_steps=2, save_strategy="no",
                              report_to=[], deepspeed=ds_config, use_cpu=not torch.cuda.is_available(),
                              dataloader_num_workers=0)
    trainer = Trainer(model=model, args=targs, train_dataset=data,
                      data_collator=ds_maximus.MaximusDataCollator(collate, model))
    result = trainer.train()
    engine = trainer.model_wrapped
    if getattr(engine, "maximus", None) is not None and trainer.is_world_process_zero():
        s = ds_maximus.stats(engine)
        print(json.dumps({"train_loss": result.training_loss, "maximus_steps": s.steps}), flush=True)
    return result


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # an exit with a live gloo group can abort in teardown (rc -6)
        torch.distributed.destroy_process_group()
