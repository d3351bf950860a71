"""``broadcast`` shard mode: one rank (``distributed.master_rank``) reads the store, the others receive.

For setups where only one rank can read the table's store (one node with the NVMe, or the only
rank with access to a network file system). The master builds its ``ShardedEmbedding`` on the
configured tier (NVMe store included); every other rank builds one on a CPU tier, with no file on
disk, and receives the table from the master by broadcast. Training is then replicated: sparse grads
are combined across ranks at each step (as in ``replicated`` mode), so every copy stays equal.
Checkpoints are written by the master alone and, on load, read by the master and broadcast.

Example::

    ds_config["maximus"]["distributed"] = {"shard_mode": "broadcast", "master_rank": 0}
    engine, *_ = ds_maximus.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
"""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch import nn

from ds_maximus.config import MaximusConfig, OffloadDevice
from ds_maximus.distributed.collectives import Collectives
from ds_maximus.errors import ConfigError, ShardStoreError


def _master(cfg: MaximusConfig, comm: Collectives) -> int:
    m = cfg.distributed.master_rank
    if m >= comm.world:
        raise ConfigError(f"maximus.distributed.master_rank={m} but the data-parallel group has {comm.world} ranks; "
                          f"use a rank in [0, {comm.world})", "maximus.distributed.master_rank")
    return m


def broadcast_embedding(old: nn.Embedding, cfg: MaximusConfig):
    """A ``ShardedEmbedding`` on every rank whose table comes from the master rank (collective)."""
    from ds_maximus.vocab import ShardedEmbedding
    comm = Collectives(None, cfg.distributed.timeout_s)
    master = _master(cfg, comm)
    emb_cfg = cfg.embedding
    if comm.rank != master and emb_cfg.offload.device == OffloadDevice.NVME:
        emb_cfg = copy.deepcopy(emb_cfg)  # the other ranks keep no copy on disk
        emb_cfg.offload.device = OffloadDevice.CPU
        emb_cfg.offload.nvme_path = None
    mod = ShardedEmbedding.from_embedding(old, emb_cfg)
    w = mod.full_weight() if comm.rank == master else torch.empty(mod.num_embeddings, mod.embedding_dim)
    comm.broadcast("broadcast table", w, master)
    if comm.rank != master:
        mod.tier.load({"weight": w})
        mod.cache.clear()
    mod.broadcast_comm = comm
    mod.shard_master = master
    return mod


def load_broadcast_state(path: str, cfg: MaximusConfig, group=None, trust: bool = False) -> dict:
    """The master reads the checkpoint state file at ``path`` (``weights_only``; see :mod:`ds_maximus.safe_load`
    for ``trust``) and sends it to every rank."""
    from ds_maximus.safe_load import safe_torch_load
    comm = Collectives(group, cfg.distributed.timeout_s)
    master = _master(cfg, comm)
    box = [None]
    if comm.rank == master:
        box = [safe_torch_load(path, trust=trust) if os.path.exists(path) else None]
    src = dist.get_global_rank(comm.group, master) if comm.group is not dist.group.WORLD else master
    dist.broadcast_object_list(box, src=src, group=comm.group)
    if box[0] is None:
        from ds_maximus.distributed.repartition import missing_whole_state
        err = missing_whole_state(os.path.dirname(path), path)
        raise ShardStoreError(f"on the master rank {master}: {err}", path)
    return box[0]
