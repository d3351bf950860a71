"""The types DeepSpeed pickles into real GPU checkpoints (fp16 and bf16, ZeRO 0-3) are all on ds_maximus's
allow-list: every ``*.pt`` of each saved checkpoint passes ``check_deepspeed_folder`` (no opt-in needed).

    python scripts/gpu/check_checkpoint_globals.py     # a CUDA machine (DeepSpeed's fp16 needs one)
"""
from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29671")
for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(k, v)

import ds_maximus  # noqa: E402
from ds_maximus.safe_load import DEEPSPEED_GLOBALS, check_deepspeed_folder  # noqa: E402


def one(dtype: str, stage: int, root: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, dtype: {"enabled": True},
           "maximus": {"embedding": {"min_rows": 1024, "gpu_cache_rows": 512}}}
    if dtype == "fp16":
        cfg["fp16"].update({"initial_scale_power": 8})
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for _ in range(2):
        ids = torch.randint(0, 4096, (2, 32), device=engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    folder = os.path.join(root, f"{dtype}_z{stage}")
    engine.save_checkpoint(folder, tag="t")
    unsafe = {}
    for f in sorted(glob.glob(os.path.join(folder, "t", "*.pt"))):
        names = torch.serialization.get_unsafe_globals_in_checkpoint(f)
        unsafe[os.path.basename(f)] = [n for n in names if n not in DEEPSPEED_GLOBALS]
    check_deepspeed_folder(os.path.join(folder, "t"))  # raises UntrustedCheckpointError on anything else
    return {"dtype": dtype, "stage": stage, "outside_allow_list": unsafe}


def main():
    results = []
    with tempfile.TemporaryDirectory() as root:
        for dtype in ("fp16", "bf16"):
            for stage in (0, 1, 2, 3):
                try:
                    results.append(one(dtype, stage, root))
                except Exception as e:  # report every combination, not only the first failure
                    results.append({"dtype": dtype, "stage": stage, "error": f"{type(e).__name__}: {e}"[:400]})
    print(json.dumps(results, indent=1))
    bad = [r for r in results if r.get("error") or any(r.get("outside_allow_list", {}).values())]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
