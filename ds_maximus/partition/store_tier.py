"""``ShardStoreTier``: a backing tier on NVMe (a :class:`ds_maximus.store.ShardStore`) with a bounded
CPU cache of whole shards (LRU; dirty shards are written back atomically when evicted or flushed).

Shards are the unit of disk I/O; the partition cache above still moves single entries (rows).

>>> import tempfile, torch
>>> tier = ShardStoreTier.for_table(tempfile.mkdtemp() + "/t", 10, 2, (), rows_per_shard=4, cpu_cache_shards=1,
...                                 init=lambda lo, hi: torch.arange(lo, hi, dtype=torch.float32)[:, None].repeat(1, 2))
>>> out = {"weight": torch.empty(2, 2)}
>>> tier.read(torch.tensor([9, 1]), out); out["weight"][:, 0].tolist()
[9.0, 1.0]
"""
from __future__ import annotations

import collections
import os
from typing import Callable, Dict, Sequence

import torch
from torch import Tensor

from ds_maximus.partition.tier import Tier
from ds_maximus.errors import ConfigError


class ShardStoreTier(Tier):
    """Entries in a ``ShardStore``; at most ``cpu_cache_shards`` shards held in (pinned) CPU memory."""

    def __init__(self, store, cpu_cache_shards: int = 8, pin_memory: bool = False):
        self.store = store
        self.num_ids = store.vocab_size
        self.names = ("weight", *store.state_names)
        self.capacity = max(1, int(cpu_cache_shards))
        self.pinned = bool(pin_memory and torch.cuda.is_available())
        self._shards: "collections.OrderedDict[int, Dict[str, Tensor]]" = collections.OrderedDict()
        self._dirty: set = set()
        self.shard_reads = 0
        self.shard_writes = 0

    @classmethod
    def for_table(cls, path: str, num_ids: int, dim: int, state_names: Sequence[str], rows_per_shard: int,
                  cpu_cache_shards: int, init: Callable[[int, int], Tensor], pin_memory: bool = False,
                  overwrite: bool = False) -> "ShardStoreTier":
        """The store at ``path`` for a ``num_ids x dim`` float32 table, so that repeated runs keep disk use flat.

        * ``overwrite=False`` (the table comes from the store): an existing store is reused as it is; one of
          another shape is a ConfigError. With no store there, one is created from ``init``.
        * ``overwrite=True`` (the run gives the table, ``init``): a store of the same layout (shape, dtype,
          rows per shard, state names, format) is reused and rewritten shard by shard; any other store,
          or an unreadable one, is replaced: the new shards are written under new names, the index is
          switched to them atomically, then the old files are removed.

        Either way, files of earlier runs that no index names (a crash between those steps) are removed at
        open. Checkpoints hold their tables in full (``maximus_states*.pt``), never references to shard files,
        so replacing a store never breaks a checkpoint.
        """
        from ds_maximus.errors import ShardStoreError
        from ds_maximus.store import INDEX_NAME, ShardStore
        store = None
        if os.path.exists(os.path.join(path, INDEX_NAME)):
            try:
                store = ShardStore.open(path)
            except ShardStoreError:
                if not overwrite:
                    raise
        if store is not None:
            shape = (store.vocab_size, store.dim, tuple(store.state_names))
            if not overwrite and shape != (num_ids, dim, tuple(state_names)):
                raise ConfigError(
                    f"shard store {path} holds a {store.vocab_size}x{store.dim} table with state "
                    f"{tuple(store.state_names)}, but this embedding is {num_ids}x{dim} with state "
                    f"{tuple(state_names)}; point maximus.embedding.offload.nvme_path at another folder or delete it",
                    "maximus.embedding.offload.nvme_path")
            store.remove_orphans()
            same = shape == (num_ids, dim, tuple(state_names)) and store.dtype == torch.float32 \
                and store.rows_per_shard == rows_per_shard
            if overwrite and same:
                store.rewrite(lambda lo, hi: {"weight": init(lo, hi)})
            elif overwrite:
                store = None
        if store is None:
            store = ShardStore.create(path, num_ids, dim, torch.float32, rows_per_shard=rows_per_shard,
                                      state_names=tuple(state_names), init=lambda lo, hi: {"weight": init(lo, hi)},
                                      overwrite=True)
        return cls(store, cpu_cache_shards, pin_memory)

    def entry_shape(self, name):
        return (self.store.dim,)

    def dtype(self, name):
        return self.store.dtype

    # -- shard cache ----------------------------------------------------------------------------------
    def _get(self, i: int) -> Dict[str, Tensor]:
        t = self._shards.get(i)
        if t is not None:
            self._shards.move_to_end(i)
            return t
        while len(self._shards) >= self.capacity:
            j, old = self._shards.popitem(last=False)
            if j in self._dirty:
                self._write(j, old)
        raw = self.store.read_shard(i)
        self.shard_reads += 1
        t = {k: (v.pin_memory() if self.pinned else v.clone()) for k, v in raw.items()}
        self._shards[i] = t
        return t

    def _write(self, i: int, t: Dict[str, Tensor]) -> None:
        self.store.write_shard(i, t)
        self._dirty.discard(i)
        self.shard_writes += 1

    def _groups(self, ids: Tensor):
        shards = self.store.shard_of(ids)
        for i in torch.unique(shards).tolist():
            sel = (shards == i).nonzero().squeeze(1)
            lo, _ = self.store.shard_range(i)
            yield i, sel, ids[sel] - lo

    # -- Tier -------------------------------------------------------------------------------------------
    def read(self, ids, out):
        for i, sel, local in self._groups(ids):
            t = self._get(i)
            for name in self.names:
                out[name][sel] = t[name][local]

    def write(self, ids, src):
        n = ids.numel()
        for i, sel, local in self._groups(ids):
            t = self._get(i)
            for name in self.names:
                t[name][local] = src[name][:n][sel]
            self._dirty.add(i)

    def blocks(self, block_rows=None):
        for i in range(self.store.num_shards):
            lo, hi = self.store.shard_range(i)
            yield lo, hi, self._get(i)

    def mark_dirty_range(self, lo: int, hi: int) -> None:
        for i in torch.unique(self.store.shard_of(torch.arange(lo, hi))).tolist():
            if i in self._shards:
                self._dirty.add(i)

    def flush(self):
        for i in sorted(self._dirty):
            self._write(i, self._shards[i])

    def load(self, tensors):
        self.flush()
        self._shards.clear()
        self._dirty.clear()
        for i in range(self.store.num_shards):
            lo, hi = self.store.shard_range(i)
            self.store.write_shard(i, {k: v[lo:hi].to(torch.float32).contiguous() for k, v in tensors.items()})
