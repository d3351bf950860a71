"""ZeRO-3's consolidated state dict (what HF Trainer's ``save_model`` writes) with the model's own keys.

Under ZeRO-3, ``Trainer.save_model`` (through accelerate) saves ``engine._zero3_consolidated_16bit_state_dict()``,
which DeepSpeed builds from each module's Parameters and persistent buffers, not from ``state_dict()``: it
would hold the norm carrier (engine plumbing) and miss every sharded table, whose rows are no Parameter.
:func:`own_keys_consolidated_state_dict` wraps it on the engine: the carrier leaves, each sharded table joins
under the key its module had (``model.embed_tokens.weight``; every alias of a shared table, as
``state_dict()`` lists them), in the dtype of the other floating tensors (the 16-bit dtype the engine
trains in, fp32 for an fp32 run). Heads tied to a table add no key, as HF's own tied models do.
"""
from __future__ import annotations

import functools

import torch

from ds_maximus.engine.norm_carrier import CARRIER_NAME


def _tables(module: torch.nn.Module):
    """``(key, module)`` of every sharded table in ``module`` (its aliases too)."""
    from ds_maximus.vocab import ShardedEmbedding
    for name, m in module.named_modules(remove_duplicate=False):
        if isinstance(m, ShardedEmbedding):
            yield (f"{name}.weight" if name else "weight"), m


def own_keys_consolidated_state_dict(engine) -> None:
    """Make ``engine._zero3_consolidated_16bit_state_dict`` return the model's own keys (see module doc)."""
    orig = getattr(engine, "_zero3_consolidated_16bit_state_dict", None)
    if orig is None or getattr(orig, "_maximus", False):
        return

    @functools.wraps(orig)
    def consolidated(*args, **kwargs):
        sd = orig(*args, **kwargs)
        tables = list(_tables(engine.module))   # every rank: a table's full weight is a local read
        if sd is None:                          # ranks other than 0 get None from DeepSpeed
            return sd
        for key in [k for k in sd if k.rsplit(".", 1)[-1] == CARRIER_NAME]:
            del sd[key]
        floats = [t.dtype for t in sd.values() if t.is_floating_point()]
        dtype = max(set(floats), key=floats.count) if floats else torch.float32
        done = {}
        for key, m in tables:
            if id(m) not in done:
                done[id(m)] = m.full_weight().to(dtype)
            sd[key] = done[id(m)]
        return sd

    consolidated._maximus = True
    engine._zero3_consolidated_16bit_state_dict = consolidated
