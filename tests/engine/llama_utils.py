"""The tiny Llama's embedding-test engines (plain DS vs maximus): its ``maximus`` section, its engine, its table.

The model, the batches, the config and the training loop come from :mod:`tests.helpers.models`.
"""
from __future__ import annotations

import copy

import torch

# VOCAB and zipf_batches: re-exported for tests/distributed/combo_worker.py and test_combinations.py
from tests.helpers.models import LLAMA_VOCAB as VOCAB  # noqa: F401
from tests.helpers.models import ds_config, initialize, tiny_llama, zipf_batches  # noqa: F401


def maximus_section(cache_rows: int = 48, mode: str = "exact", **emb):
    return {"embedding": {"modules": ["model.embed_tokens"], "gpu_cache_rows": cache_rows,
                          "optimizer": {"mode": mode}, **emb},
            "logging": {"interval_steps": 5}}


def build(stage, dtype, gas=1, clip=0.0, maximus=None, seed=0, tie=False, init=None, **kw):
    """A tiny Llama (``tiny_llama(seed, tie=tie)``, or the weights ``init``) in a plain engine, or in a maximus
    one when ``maximus`` (the section) is given."""
    model = tiny_llama(seed, tie=tie)
    if init is not None:
        model.load_state_dict(copy.deepcopy(init))
    return initialize(model, ds_config(stage, dtype, gas=gas, clip=clip, maximus=maximus, **kw))


def embedding_weight(engine) -> torch.Tensor:
    """The full embedding table (fp32, CPU) of a plain or maximus engine."""
    emb = engine.module.model.embed_tokens
    if hasattr(emb, "full_weight"):
        return emb.full_weight().float().cpu()
    import deepspeed
    w = emb.weight
    if hasattr(w, "ds_id"):
        with deepspeed.zero.GatheredParameters([w]):
            return w.detach().float().cpu().clone()
    # the fp32 master lives in the optimizer under bf16/ZeRO; the module copy is what forward used
    return w.detach().float().cpu().clone()
