"""``RowPartition``: which rank owns which rows of a partitioned table.

The vocabulary is cut into contiguous blocks of ``block_rows`` rows, dealt round-robin to the ranks:
block ``b`` belongs to rank ``b % world``. With a frequency-ordered vocabulary (hot ids small, as
``maximus-tokenizer build`` writes it) the hot head is spread over every rank instead of landing on
rank 0. A rank stores its blocks one after the other, so a global id maps to a local row by
arithmetic alone (no lookup table).

Example::

    >>> import torch
    >>> p = RowPartition(10, world=2, block_rows=2)
    >>> p.owner(torch.tensor([0, 2, 3, 9])).tolist()
    [0, 1, 1, 0]
    >>> p.global_ids(1).tolist(), p.to_local(torch.tensor([2, 3, 6])).tolist()
    ([2, 3, 6, 7], [0, 1, 2])
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

BLOCKS_PER_RANK = 16


def default_block_rows(num_rows: int, world: int, rows_per_shard: int = 32768) -> int:
    """About ``BLOCKS_PER_RANK`` blocks per rank, never more rows than a store shard."""
    return max(1, min(int(rows_per_shard), math.ceil(num_rows / (world * BLOCKS_PER_RANK))))


class RowPartition:
    """Round-robin deal of ``block_rows``-row blocks of ``num_rows`` rows over ``world`` ranks."""

    def __init__(self, num_rows: int, world: int, block_rows: Optional[int] = None):
        if world < 1 or num_rows < 1:
            raise ValueError(f"RowPartition needs num_rows >= 1 and world >= 1, got {num_rows}, {world}")
        self.num_rows = int(num_rows)
        self.world = int(world)
        self.block_rows = int(block_rows or default_block_rows(num_rows, world))
        self.num_blocks = math.ceil(self.num_rows / self.block_rows)

    def signature(self) -> Tensor:
        return torch.tensor([self.num_rows, self.world, self.block_rows], dtype=torch.long)

    def owner(self, ids: Tensor) -> Tensor:
        return torch.div(ids, self.block_rows, rounding_mode="floor") % self.world

    def to_local(self, ids: Tensor) -> Tensor:
        """Local row of each id on its owner."""
        b = torch.div(ids, self.block_rows, rounding_mode="floor")
        return torch.div(b, self.world, rounding_mode="floor") * self.block_rows + ids % self.block_rows

    def global_ids(self, rank: int) -> Tensor:
        """Global ids of ``rank``'s rows, in local-row order."""
        blocks = torch.arange(rank, self.num_blocks, self.world, dtype=torch.long)
        ids = (blocks[:, None] * self.block_rows + torch.arange(self.block_rows)).reshape(-1)
        return ids[ids < self.num_rows]

    def num_local(self, rank: int) -> int:
        return int(self.global_ids(rank).numel())

    def __repr__(self) -> str:
        return f"RowPartition(num_rows={self.num_rows}, world={self.world}, block_rows={self.block_rows})"


class MasterPartition:
    """Every row owned by one rank, ``master`` (the ``broadcast`` shard mode): the same interface as
    :class:`RowPartition`, so the lookup, gradient and checkpoint paths of a partitioned table route every id to
    the master and the other ranks hold no rows.

    Example::

        >>> import torch
        >>> p = MasterPartition(10, world=3, master=1)
        >>> p.owner(torch.tensor([0, 9])).tolist(), p.num_local(0), p.num_local(1)
        ([1, 1], 0, 10)
    """

    def __init__(self, num_rows: int, world: int, master: int):
        if world < 1 or num_rows < 1 or not 0 <= master < world:
            raise ValueError(f"MasterPartition needs num_rows >= 1, world >= 1 and 0 <= master < world, got "
                             f"{num_rows}, {world}, {master}")
        self.num_rows, self.world, self.master = int(num_rows), int(world), int(master)
        self.block_rows = self.num_rows  # one block, the master's
        self.num_blocks = 1

    def signature(self) -> Tensor:
        return torch.tensor([self.num_rows, self.world, self.block_rows], dtype=torch.long)

    def owner(self, ids: Tensor) -> Tensor:
        return torch.full_like(ids, self.master)

    def to_local(self, ids: Tensor) -> Tensor:
        return ids

    def global_ids(self, rank: int) -> Tensor:
        return torch.arange(self.num_rows if rank == self.master else 0, dtype=torch.long)

    def num_local(self, rank: int) -> int:
        return self.num_rows if rank == self.master else 0

    def __repr__(self) -> str:
        return f"MasterPartition(num_rows={self.num_rows}, world={self.world}, master={self.master})"
