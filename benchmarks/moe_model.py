"""The MoE training benchmark's model: a stack of Mixtral decoder layers built on the CPU without HF's weight init
and filled once with random weights on every core (``benchmarks/bench_moe_training.py``; ``a`` is its arguments)."""
from __future__ import annotations

import os

import torch

from benchmarks.harness import default_dtype

FILL_CHUNK_ELEMS = 1 << 24  # random init in pieces of 16M elements, one generator each, on every core


def _fill_random_(params) -> None:
    """Norms 1, router N(0, 0.5), the rest N(0, 0.02): CPU ``normal_`` is one thread, so the pieces run on a
    thread pool (2.9B parameters: ~20 s on one core, ~2 s on 16), each with its own seeded generator."""
    from concurrent.futures import ThreadPoolExecutor
    jobs = []
    for n, p in params:
        # a ZeRO-3 parameter built under zero.Init holds its data in ``ds_tensor`` (one rank: all of it)
        flat = (p.ds_tensor if hasattr(p, "ds_tensor") else p.data).view(-1)
        if len(getattr(p, "ds_shape", p.shape)) == 1:
            flat.fill_(1.0)
            continue
        std = 0.5 if "gate.weight" in n else 0.02
        jobs += [(flat, lo, min(lo + FILL_CHUNK_ELEMS, flat.numel()), std)
                 for lo in range(0, flat.numel(), FILL_CHUNK_ELEMS)]

    def one(i):
        flat, lo, hi, std = jobs[i]
        flat[lo:hi].normal_(0.0, std, generator=torch.Generator().manual_seed(i))
    with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as ex:
        list(ex.map(one, range(len(jobs))))


def build_model(a, dtype, zero3_config=None):
    """The Mixtral-shaped model on the CPU; with ``zero3_config`` under ``deepspeed.zero.Init`` (parameters
    partitioned and offloaded as they are made: ZeRO-3 + offload_param never holds the model on the GPU,
    which DeepSpeed would otherwise do in ``initialize`` before partitioning)."""
    import contextlib

    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.initialization import no_init_weights
    cfg = MixtralConfig(hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                        num_attention_heads=max(1, a.hidden // 128), num_key_value_heads=max(1, a.hidden // 512),
                        num_local_experts=a.experts, num_experts_per_tok=a.top_k, vocab_size=a.vocab,
                        max_position_embeddings=max(4096, a.seq), router_aux_loss_coef=0.0,
                        initializer_range=0.02)
    cfg._experts_implementation = "grouped_mm"
    with default_dtype(dtype):
        ctx = contextlib.nullcontext()
        if zero3_config is not None:
            import deepspeed
            ctx = deepspeed.zero.Init(config_dict_or_path=zero3_config, remote_device="cpu", pin_memory=True,
                                      dtype=dtype)
        with no_init_weights(), ctx:  # the weights are written once, below (HF's init would write them twice)
            model = MixtralForCausalLM(cfg)
    with torch.no_grad():
        _fill_random_(list(model.named_parameters()))
    return model
