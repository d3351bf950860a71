"""``ShardStoreTier``: the NVMe tier of the :class:`ds_maximus.partition.tier.Tier` protocol, a
:class:`ds_maximus.store.ShardStore` (read through the async NVMe loader) with a bounded CPU cache of whole
shards (LRU; dirty shards are written back atomically when evicted or flushed).

Rows and experts share its one on-disk format: a vocabulary table is shards of ``rows_per_shard`` rows, an
expert table is shards of one expert each (``rows_per_shard=1``, ``dim`` = the expert's flat size). Shards
are the unit of disk I/O; the partition cache above still moves single entries (rows). With
``cpu_cache_shards=0`` nothing is cached: a read of a one-entry shard goes from the file straight into the
destination (no bounce copy), and every write is a durable shard write.

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

from ds_maximus.errors import ConfigError
from ds_maximus.partition.tier import Tier


class ShardStoreTier(Tier):
    """Entries in a ``ShardStore``; at most ``cpu_cache_shards`` shards held in (pinned) CPU memory.

    ``host_view`` is ``None`` and ``pieces`` empty: an entry is read into a destination the caller owns.
    """

    def __init__(self, store, cpu_cache_shards: int = 8, pin_memory: bool = False):
        self.store = store
        self.num_ids = store.vocab_size
        self.names = ("weight", *store.state_names)
        self.capacity = max(0, int(cpu_cache_shards))
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

    @property
    def cached_shards(self) -> int:
        """Shards held in CPU memory now."""
        return len(self._shards)

    def dtype(self, name):
        return self.store.dtype

    # -- shard cache ----------------------------------------------------------------------------------
    def _get(self, i: int) -> Dict[str, Tensor]:
        t = self._shards.get(i)
        if t is not None:
            self._shards.move_to_end(i)
            return t
        while self._shards and len(self._shards) >= self.capacity:
            j, old = self._shards.popitem(last=False)
            if j in self._dirty:
                self._write(j, old)
        raw = self.store.read_shard(i)
        self.shard_reads += 1
        t = {k: (v.pin_memory() if self.pinned else v.clone()) for k, v in raw.items()}
        if self.capacity:
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
    def check_ids(self, ids):
        ids = super().check_ids(ids)
        self.store.shard_of(ids)  # the store's own check, too
        return ids

    def read(self, ids, out):
        ids = self.check_ids(ids)
        for i, sel, local in self._groups(ids):
            if self._read_direct(i, sel, out):
                continue
            t = self._get(i)
            for name in self.names:
                out[name][sel] = t[name][local]

    def _read_direct(self, i: int, sel: Tensor, out: Dict[str, Tensor]) -> bool:
        """A one-entry, one-tensor shard not cached here: read from the file straight into its destination."""
        if i in self._shards or len(self.names) != 1 or sel.numel() != 1:
            return False
        lo, hi = self.store.shard_range(i)
        dst = out[self.names[0]][int(sel[0])]
        if hi - lo != 1 or not dst.is_contiguous() or dst.dtype != self.store.dtype or dst.device.type != "cpu":
            return False
        self.store.read_shard_into(i, dst)
        self.shard_reads += 1
        return True

    def write(self, ids, src):
        ids = self.check_ids(ids)
        n = ids.numel()
        for i, sel, local in self._groups(ids):
            lo, hi = self.store.shard_range(i)
            if not self.capacity and local.numel() == hi - lo and torch.equal(local, torch.arange(hi - lo)):
                self._write(i, {name: src[name][:n][sel] for name in self.names})  # the whole shard: no read
                continue
            t = self._get(i)
            for name in self.names:
                t[name][local] = src[name][:n][sel]
            if self.capacity:
                self._dirty.add(i)
            else:
                self._write(i, t)

    def blocks(self, block_rows=None):
        for i in range(self.store.num_shards):
            lo, hi = self.store.shard_range(i)
            t = self._get(i)
            yield lo, hi, t
            if not self.capacity:  # nothing cached: the block's edits are written now
                self._write(i, t)

    def materialize(self, name):
        out = torch.empty((self.num_ids, self.store.dim), dtype=self.store.dtype)
        for i in range(self.store.num_shards):
            lo, hi = self.store.shard_range(i)
            t = self._shards.get(i)
            out[lo:hi].copy_((t if t is not None else self.store.read_shard(i))[name])
        return out

    def append(self, src: Dict[str, Tensor]) -> None:
        """Grow the table by ``src["weight"].shape[0]`` entries, written as new shards (names left out are zeros)."""
        self.store.append_shards({k: v.to(self.store.dtype) for k, v in src.items()})
        self.num_ids = self.store.vocab_size

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
