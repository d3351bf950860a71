"""Backing tiers of a partition cache: where the entries live when they are not in cache slots.

A tier holds ``num_ids`` entries, each a set of named tensors of fixed shape (a vocab row with its
optimizer state, a flat expert buffer). The cache reads misses out of it and writes dirty
evictions back into it. :class:`TensorTier` keeps everything in (pinned) CPU memory;
:class:`ds_maximus.partition.store_tier.ShardStoreTier` keeps it on NVMe with a bounded CPU cache of shards.

>>> import torch
>>> tier = TensorTier({"weight": torch.arange(6.).view(3, 2)})
>>> out = {"weight": torch.empty(2, 2)}
>>> tier.read(torch.tensor([2, 0]), out); out["weight"].tolist()
[[4.0, 5.0], [0.0, 1.0]]
"""
from __future__ import annotations

from typing import Dict, Iterator, Tuple

import torch
from torch import Tensor

Block = Tuple[int, int, Dict[str, Tensor]]


class Tier:
    """Interface of a backing tier (entries indexed by id in ``[0, num_ids)``)."""

    names: Tuple[str, ...] = ()
    num_ids: int = 0
    pinned: bool = False

    def entry_shape(self, name: str) -> Tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, name: str) -> torch.dtype:
        raise NotImplementedError

    def read(self, ids: Tensor, out: Dict[str, Tensor]) -> None:
        """Copy entries ``ids`` (CPU LongTensor) into ``out[name][:len(ids)]`` (CPU tensors)."""
        raise NotImplementedError

    def write(self, ids: Tensor, src: Dict[str, Tensor]) -> None:
        """Store ``src[name][i]`` as entry ``ids[i]``."""
        raise NotImplementedError

    def blocks(self, block_rows: int = 32768) -> Iterator[Block]:
        """Yield ``(lo, hi, tensors)`` covering every entry; in-place edits of the views persist."""
        raise NotImplementedError

    def flush(self) -> None:
        """Make every write durable (NVMe tier); a no-op for memory tiers."""

    def materialize(self, name: str) -> Tensor:
        """The whole table of ``name`` as one CPU tensor (a copy)."""
        out = torch.empty((self.num_ids, *self.entry_shape(name)), dtype=self.dtype(name))
        for lo, hi, t in self.blocks():
            out[lo:hi].copy_(t[name])
        return out

    def load(self, tensors: Dict[str, Tensor]) -> None:
        """Overwrite whole tables (``[num_ids, ...]`` each; names not given are kept)."""
        for lo, hi, t in self.blocks():
            for name, src in tensors.items():
                t[name].copy_(src[lo:hi])


class TensorTier(Tier):
    """All entries in CPU memory, one tensor per name (pinned when ``pin_memory`` and CUDA exist)."""

    def __init__(self, tensors: Dict[str, Tensor], pin_memory: bool = False):
        n = {t.shape[0] for t in tensors.values()}
        if len(n) != 1:
            raise ValueError(f"tier tensors disagree on the number of entries: {sorted(n)}")
        self.num_ids = n.pop()
        self.pinned = bool(pin_memory and torch.cuda.is_available())
        self.tensors = {k: _host(v, self.pinned) for k, v in tensors.items()}
        self.names = tuple(self.tensors)

    def entry_shape(self, name):
        return tuple(self.tensors[name].shape[1:])

    def dtype(self, name):
        return self.tensors[name].dtype

    def read(self, ids, out):
        n = ids.numel()
        for name, t in self.tensors.items():
            torch.index_select(t, 0, ids, out=out[name][:n])

    def write(self, ids, src):
        n = ids.numel()
        for name, t in self.tensors.items():
            t.index_copy_(0, ids, src[name][:n])

    def blocks(self, block_rows=32768):
        for lo in range(0, self.num_ids, block_rows):
            hi = min(lo + block_rows, self.num_ids)
            yield lo, hi, {k: v[lo:hi] for k, v in self.tensors.items()}

    def materialize(self, name):
        return self.tensors[name].clone()


def _host(t: Tensor, pin: bool) -> Tensor:
    t = t.detach().to("cpu").contiguous()
    if pin and not t.is_pinned():
        t = t.pin_memory()
    return t
