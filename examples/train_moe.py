"""Train a Mixtral-architecture MoE (random init) whose experts live in the CPU tier, under the deepspeed launcher.

    deepspeed --num_gpus 1 examples/train_moe.py --deepspeed_config ds_configs/moe_training.json
    deepspeed --num_gpus 1 examples/train_moe.py --deepspeed_config ds_configs/moe_training.json --plain

Every expert's fp32 master and AdamW state stay in pinned CPU memory; the GPU holds
``gpu_experts_per_layer`` experts per layer and brings in only the experts the router picks. With
``--plain`` the same script runs plain ``deepspeed.initialize`` (the "maximus" section is dropped) for
comparison. On CPU ranks (``DS_ACCELERATOR=cpu``) pass ``--torch-adam`` and ``--fp32`` to skip the fused
Adam build and bf16. Prints one ``step`` line per step, the maximus stats line, and a digest of the
final expert weights (``experts sumsq``, ``experts delta``: distance from the initial weights) that a
2-rank run must reproduce from a 1-rank run.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed_config", required=True)
    ap.add_argument("--local_rank", type=int, default=-1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=None, help="samples per step over all ranks "
                    "(default: micro-batch x ranks); each rank trains its slice")
    ap.add_argument("--plain", action="store_true", help="plain deepspeed.initialize, no maximus section")
    ap.add_argument("--torch-adam", action="store_true", help="torch AdamW instead of DeepSpeed's fused Adam")
    ap.add_argument("--fp32", action="store_true", help="drop bf16/fp16 from the config")
    ap.add_argument("--gas", type=int, default=None, help="override gradient_accumulation_steps")
    return ap.parse_args(argv)


def build_model(a):
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=a.experts,
                        num_experts_per_tok=a.top_k, vocab_size=a.vocab, max_position_embeddings=max(64, a.seq),
                        router_aux_loss_coef=0.0)
    cfg._experts_implementation = "grouped_mm"
    return MixtralForCausalLM(cfg)


def main(argv=None):
    import deepspeed

    import ds_maximus
    a = parse_args(argv)
    with open(a.deepspeed_config) as f:
        cfg = json.load(f)
    if a.plain:
        cfg.pop("maximus", None)
    if a.torch_adam:
        cfg["optimizer"]["params"]["torch_adam"] = True
    if a.gas is not None:
        cfg["gradient_accumulation_steps"] = a.gas
    if a.fp32:
        cfg.pop("bf16", None)
        cfg.pop("fp16", None)
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    micro = cfg["train_micro_batch_size_per_gpu"]
    gb = a.global_batch or micro * world
    if gb % world or gb // world != micro * cfg.get("gradient_accumulation_steps", 1):
        raise SystemExit(f"--global-batch {gb} must equal micro-batch x accumulation x ranks ({micro} x "
                         f"{cfg.get('gradient_accumulation_steps', 1)} x {world})")
    model = build_model(a)
    init = [{n: getattr(layer.mlp.experts, n).detach().float().clone() for n in ("gate_up_proj", "down_proj")}
            for layer in model.model.layers]
    fn = deepspeed.initialize if a.plain else ds_maximus.initialize
    engine, *_ = fn(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(1)
    gas = cfg.get("gradient_accumulation_steps", 1)
    t0 = time.perf_counter()
    for step in range(a.steps):
        batch = torch.randint(0, a.vocab, (gb, a.seq), generator=g)[rank * gb // world:(rank + 1) * gb // world]
        for j in range(gas):
            ids = batch[j * micro:(j + 1) * micro].to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        if rank == 0:
            print(f"step {step + 1} loss {float(loss.detach().float()):.6f}", flush=True)
    dt = time.perf_counter() - t0
    if getattr(engine, "maximus", None) is not None:
        t = engine.maximus.modules["moe"]
        experts = [t.expert_tensors(i) for i in range(t.num_layers)]
        if rank == 0:
            s = t.stats()
            moved = s['demand_misses'] + s['prefetch_issued']
            print(f"maximus moe: hit rate {s['hit_rate']:.3f}, experts moved {moved},"
                  f" stepped {s['experts_stepped']}, {s['bytes_moved'] / 2**20:.1f} MiB loaded", flush=True)
    else:
        experts = []
        for layer in engine.module.model.layers:
            ex = layer.mlp.experts
            with deepspeed.zero.GatheredParameters([ex.gate_up_proj, ex.down_proj],
                                                   enabled=hasattr(ex.gate_up_proj, "ds_id")):
                experts.append({"gate_up_proj": ex.gate_up_proj.detach().float().cpu().clone(),
                                "down_proj": ex.down_proj.detach().float().cpu().clone()})
    sumsq = sum(float(t.double().pow(2).sum()) for d in experts for t in d.values())
    delta = sum(float((t.double() - w0[n].double()).pow(2).sum()) for d, w0 in zip(experts, init)
                for n, t in d.items()) ** 0.5
    if rank == 0:
        tokens = a.steps * gb * a.seq
        print(f"experts sumsq {sumsq:.10e}", flush=True)
        print(f"experts delta {delta:.10e}", flush=True)  # distance travelled from the initial weights
        print(f"done: {a.steps} steps, {tokens / dt:.0f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # an exit with a live gloo group can abort in teardown (rc -6)
        torch.distributed.destroy_process_group()
