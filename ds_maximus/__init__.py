"""ds_maximus: vocabulary rows and MoE experts as swappable partitions across GPU, pinned CPU and NVMe.

Switched on by a ``"maximus"`` section in an ordinary DeepSpeed ds_config::

    engine, optimizer, _, _ = ds_maximus.initialize(model=model, config="ds_config.json",
                                                    model_parameters=model.parameters())

Public names are imported lazily so ``import ds_maximus`` stays cheap.
"""
from __future__ import annotations

import importlib

from ds_maximus.config import MaximusConfig
from ds_maximus.errors import CapacityError, ConfigError, OpBuildError, ShardStoreError

__version__ = "0.1.0"

_LAZY = {
    "initialize": "ds_maximus.engine",
    "enable": "ds_maximus.engine",
    "stats": "ds_maximus.observability",
    "ShardedEmbedding": "ds_maximus.vocab",
    "ShardedLMHead": "ds_maximus.vocab",
    "linear_cross_entropy": "ds_maximus.vocab",
    "ShardStore": "ds_maximus.store",
    "TokenMap": "ds_maximus.tokenmap",
    "MultiTokenMap": "ds_maximus.tokenmap",
    "PartitionCache": "ds_maximus.partition",
    "maximize": "ds_maximus.integrations.hf",
    "MaximusDataCollator": "ds_maximus.integrations.hf",
    "export_hf": "ds_maximus.integrations.export",
    "save_peft": "ds_maximus.integrations.peft",
    "resize_token_embeddings": "ds_maximus.vocab.resize",
    "offload_experts": "ds_maximus.experts",
}

# modules that register a model adapter with the engine when imported: ds_maximus.engine.adapters imports them
# by name the first time it needs adapters (the engine itself imports no integration)
ADAPTERS = ("ds_maximus.integrations.hf", "ds_maximus.integrations.peft")

__all__ = ["MaximusConfig", "ConfigError", "ShardStoreError", "CapacityError", "OpBuildError", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ds_maximus' has no attribute {name!r}")
