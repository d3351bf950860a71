"""One rank of a HF Trainer run on a tied PEFT model (LoRA + the embedding copy, ``ensure_weight_tying``) after
``ds_maximus.enable()``, ending in ``trainer.save_model()``: rank 0 then writes the logits the folder must reload to.

    deepspeed --num_gpus 2 tests/integrations/peft_trainer_worker.py OUT STAGE
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import ds_maximus  # noqa: E402
from tests.distributed.ranks import end_rank  # noqa: E402


def main(out: str, stage: int) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    ds_maximus.enable()
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "zero_optimization": zero, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
           "maximus": {"embedding": {"gpu_cache_rows": 64, "min_rows": 100}, "logging": {"interval_steps": 1000}}}
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True))
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        base.save_pretrained(os.path.join(out, "base"))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"],
                                            ensure_weight_tying=True, init_lora_weights=False))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (x := torch.randint(0, 512, (16,), generator=g)), "labels": x} for _ in range(16)]
    args = TrainingArguments(output_dir=os.path.join(out, "run"), per_device_train_batch_size=2, max_steps=3,
                             deepspeed=cfg, report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-2,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(os.path.join(out, "adapter"))   # rank 0 writes, from the state dict every rank gathered
    ids = data[0]["input_ids"][None]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    if rank == 0:
        torch.save({"ids": ids, "logits": logits}, os.path.join(out, "want.pt"))
    end_rank(barrier=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(args[0], int(args[1]))
